//! Issue 29, item 6: a same-host peer's pid was trusted for the
//! connection's life. A process connected, handed its socket to a child,
//! then ran exec (in the report, `/usr/bin/passwd`: same pid, euid 0); the
//! child's requests made the endpoint write into the new program's memory.
//!
//! Here process P connects, hands the socket to its child C, and execs
//! `sleep`. C then asks the endpoint to read 16 bytes of an advertised
//! range into a writable page of `sleep`. The endpoint must refuse (P is
//! no longer the process that connected), and the bytes must not land.
//! Run twice: P of our own uid, and (as root) P of uid 65534 with
//! `TCPX_P2P_LOCAL_ANY_UID=1`, where the endpoint holds rights P lacks.
//! What this covers: an exec of another program by the pinned process
//! (its executable changes; with another uid, its address space too). A
//! setuid exec changes more (its ids, its dumpable owner); those checks
//! are covered by the unit tests in `local/os.rs` on a changed identity,
//! since a test cannot gain a setuid binary without installing one.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::FileExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tcpx_p2p::{Config, Endpoint};
use tcpx_p2p_wire::same_host::{IpcDesc, LocalHello, LocalMsg, ReqItem, Space, LOCAL_VERSION};
use tcpx_p2p_wire::{read_frame, write_frame};

const ROLE: &str = "TCPX_TEST_LOCAL_ROLE";
const TEST: &str = "a_peer_that_execs_after_connecting_is_refused";
const PATTERN: [u8; 16] = *b"CHOSEN-16-BYTES!";

/// A line to the parent (written to stdout directly: the test harness
/// captures `println!`).
fn say(line: &str) {
    let mut o = std::io::stdout();
    writeln!(o, "{line}").unwrap();
    o.flush().unwrap();
}

fn me() -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", TEST, "--nocapture", "--test-threads=1"]);
    c
}

/// P: connects to the endpoint's same-host socket, hands the socket to a
/// child C, then execs `sleep`.
fn connector() {
    if let Ok(uid) = std::env::var("AS_UID") {
        let uid: u32 = uid.parse().unwrap();
        // SAFETY: plain credential calls of this single-purpose process.
        unsafe {
            assert_eq!(libc::setgid(uid), 0);
            assert_eq!(libc::setuid(uid), 0);
        }
    }
    let name = std::env::var("TARGET_NAME").unwrap();
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    let mut v = Vec::new();
    LocalHello {
        version: LOCAL_VERSION,
        auth: 0,
        gpu_index: -1,
        gpu_bdf: String::new(),
        nonce: 0x5eed_0000_0000_0001,
    }
    .encode(&mut v);
    write_frame(&mut s, &v).unwrap();
    let theirs = read_frame(&mut s, 256).unwrap();
    assert!(LocalHello::decode(&theirs).is_ok(), "handshake refused");
    // Hand the socket to C (clear close-on-exec on it for the spawn).
    let fd = s.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own, no pointers.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
    }
    // P execs right after: nothing here could wait for C.
    #[allow(clippy::zombie_processes)]
    me().env(ROLE, "requester")
        .env("PEER_PID", std::process::id().to_string())
        .env("SOCK_FD", fd.to_string())
        .env_remove("AS_UID")
        .spawn()
        .unwrap();
    drop(s);
    say("connected");
    // Same pid, another program, for as long as the test needs it: the
    // parent kills it once C is done (however slow the machine).
    let e = Command::new("sleep").arg("3600").exec();
    panic!("exec sleep: {e}");
}

/// C: once P runs `sleep`, asks the endpoint to read the advertised range
/// into a writable page of `sleep`, and reports the answer and whether the
/// bytes landed.
fn requester() {
    let pid: i32 = std::env::var("PEER_PID").unwrap().parse().unwrap();
    let fd: i32 = std::env::var("SOCK_FD").unwrap().parse().unwrap();
    // SAFETY: the descriptor was handed to us by P and nothing else here owns it.
    let mut s = unsafe { UnixStream::from_raw_fd(fd) };
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let desc: Vec<u8> = (0..line.trim().len() / 2)
        .map(|i| u8::from_str_radix(&line.trim()[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let d = IpcDesc::decode(&desc).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let maps = loop {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        if exe.file_name().is_some_and(|n| n == "sleep") {
            break std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        }
        assert!(Instant::now() < deadline, "P did not exec");
        std::thread::sleep(Duration::from_millis(5));
    };
    // A writable page of the new program (its data or its heap).
    let target = maps
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("rw-p"))
        .and_then(|l| l.split('-').next())
        .map(|a| u64::from_str_radix(a, 16).unwrap())
        .unwrap();
    let mem = std::fs::OpenOptions::new()
        .read(true)
        .open(format!("/proc/{pid}/mem"))
        .unwrap();
    let mut before = [0u8; 16];
    mem.read_exact_at(&mut before, target).unwrap();
    let mut v = Vec::new();
    LocalMsg::Req {
        op: 7,
        read: true,
        items: vec![ReqItem {
            space: Space::Ipc,
            token: d.token,
            addr: d.addr,
            len: 16,
            peer: target,
        }],
    }
    .encode(&mut v);
    write_frame(&mut s, &v).unwrap();
    let answer = match read_frame(&mut s, 1 << 20).map(|b| LocalMsg::decode(&b)) {
        Ok(Ok(LocalMsg::Done { .. })) => "Done".to_string(),
        Ok(Ok(LocalMsg::Refused { reason, .. })) => format!("Refused: {reason}"),
        other => format!("other: {other:?}"),
    };
    let mut after = [0u8; 16];
    mem.read_exact_at(&mut after, target).unwrap();
    println!("answer: {answer}");
    println!(
        "landed: {}",
        if after == PATTERN && before != PATTERN {
            "yes"
        } else {
            "no"
        }
    );
    // The endpoint closes a connection whose peer changed.
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut x = [0u8; 64];
    let closed = match s.read(&mut x) {
        Ok(n) => n == 0,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    };
    say(&format!("closed: {closed}"));
    say("done");
}

/// P (the program it execs, `sleep`), killed and reaped when the test is
/// done with it or fails.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run(as_uid: Option<u32>) {
    let b = Endpoint::new(
        None,
        Config {
            ifname: Some("lo".into()),
            ..Config::default()
        },
    )
    .unwrap();
    let a = b.local_addr();
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let mut region = PATTERN;
    let mut p = me();
    p.env(ROLE, "connector")
        .env(
            "TARGET_NAME",
            format!("tcpx-p2p-local:{uid}:{}:{}", a.ip(), a.port()),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if let Some(u) = as_uid {
        p.env("AS_UID", u.to_string());
    }
    let mut p = Killed(p.spawn().unwrap());
    let mut out = BufReader::new(p.0.stdout.take().unwrap()).lines();
    let mut next = |prefix: &str| loop {
        let l = out.next().expect("the peer processes ended early").unwrap();
        // The children's test harness may have begun the line.
        if let Some((_, r)) = l.split_once(prefix) {
            return r.to_string();
        }
    };
    next("connected");
    let conn = b.accept_local(Some(Duration::from_secs(10))).unwrap().conn;
    let info = b
        .advertise_ipc(conn, region.as_mut_ptr() as u64, region.len())
        .unwrap();
    let hex: String = info.iter().map(|x| format!("{x:02x}")).collect();
    let mut stdin = p.0.stdin.take().unwrap();
    writeln!(stdin, "{hex}").unwrap();
    let answer = next("answer: ");
    let landed = next("landed: ");
    let closed = next("closed: ");
    next("done");
    drop(p);
    eprintln!("peer uid {as_uid:?}: answer {answer:?}, landed {landed}, closed {closed}");
    assert!(
        answer.starts_with("Refused") && answer.contains("no longer the process that connected"),
        "{answer}"
    );
    assert_eq!(landed, "no", "bytes landed in the exec'd program");
    assert_eq!(closed, "true");
    // The endpoint goes on: its region is intact and it serves a new peer.
    assert_eq!(region, PATTERN);
    let c = Endpoint::new(
        None,
        Config {
            ifname: Some("lo".into()),
            ..Config::default()
        },
    )
    .unwrap();
    let cc = c
        .connect_local(&tcpx_p2p::LocalPeer::Metadata(b.metadata()))
        .unwrap();
    let cb = b.accept_local(Some(Duration::from_secs(10))).unwrap().conn;
    let mut dst = [0u8; 16];
    let info = b
        .advertise_ipc(cb, dst.as_mut_ptr() as u64, dst.len())
        .unwrap();
    c.write_ipc(cc, &[(PATTERN.as_ptr() as u64, 16)], &[&info])
        .unwrap();
    assert_eq!(dst, PATTERN);
}

/// Binds `name` as uid 65534 and answers one same-host handshake.
fn squatter() {
    // SAFETY: plain credential calls of this single-purpose process.
    unsafe {
        assert_eq!(libc::setgid(65534), 0);
        assert_eq!(libc::setuid(65534), 0);
    }
    let name = std::env::var("TARGET_NAME").unwrap();
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let l = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    say("listening");
    let (mut s, _) = l.accept().unwrap();
    if let Ok(b) = read_frame(&mut s, 256) {
        let mut h = LocalHello::decode(&b).unwrap();
        h.nonce ^= 1;
        let mut v = Vec::new();
        h.encode(&mut v);
        let _ = write_frame(&mut s, &v);
    }
    let mut x = [0u8; 1];
    let _ = s.read(&mut x);
}

/// Issue 29, minor: another uid could bind our same-host name
/// (`tcpx-p2p-local:<uid>:gpu:<i>`) before our endpoint, and
/// `connect_local` reached it. The listener's credentials are now checked:
/// a listener of another uid is refused, even with
/// `TCPX_P2P_LOCAL_ANY_UID=1`. Needs root (to run the squatter as another
/// uid); skipped otherwise.
#[test]
fn a_squatter_of_another_uid_is_refused() {
    if std::env::var(ROLE).as_deref() == Ok("squatter") {
        return squatter();
    }
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: cannot run a squatter of another uid; skipped");
        return;
    }
    std::env::set_var("TCPX_P2P_LOCAL_ANY_UID", "1");
    let gpu = 4000 + (std::process::id() % 1000) as i32;
    let mut q = Command::new(std::env::current_exe().unwrap());
    q.args([
        "--exact",
        "a_squatter_of_another_uid_is_refused",
        "--nocapture",
    ])
    .env(ROLE, "squatter")
    .env("TARGET_NAME", format!("tcpx-p2p-local:0:gpu:{gpu}"))
    .stdout(Stdio::piped());
    let mut q = q.spawn().unwrap();
    let mut out = BufReader::new(q.stdout.take().unwrap()).lines();
    while !out.next().unwrap().unwrap().contains("listening") {}
    let a = Endpoint::new(
        None,
        Config {
            ifname: Some("lo".into()),
            ..Config::default()
        },
    )
    .unwrap();
    let e = a
        .connect_local(&tcpx_p2p::LocalPeer::Index(gpu))
        .expect_err("connect_local reached a squatter of another uid");
    let _ = q.kill();
    let _ = q.wait();
    eprintln!("{e}");
    assert!(e.to_string().contains("runs as uid 65534"), "{e}");
}

/// Issue 29, item 3 on the same-host path: connections that never
/// handshake are bounded (`max_handshakes`; past it they are closed at
/// once) and end at the connect timeout; then a legitimate peer connects.
#[test]
fn silent_same_host_connections_are_bounded() {
    let cfg = || Config {
        ifname: Some("lo".into()),
        max_handshakes: 4,
        connect_timeout: Duration::from_millis(1500),
        ..Config::default()
    };
    let b = Endpoint::new(None, cfg()).unwrap();
    let a = b.local_addr();
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    let name = format!("tcpx-p2p-local:{uid}:{}:{}", a.ip(), a.port());
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let mut silent: Vec<UnixStream> = (0..12)
        .map(|_| UnixStream::connect_addr(&addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let closed_at_once = silent
        .iter_mut()
        .map(|s| {
            s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            matches!(s.read(&mut [0u8; 64]), Ok(0))
        })
        .filter(|&closed| closed)
        .count();
    assert!(
        closed_at_once >= 8,
        "only {closed_at_once} of 12 closed at once"
    );
    // The held ones end at the deadline; a legitimate peer then connects.
    std::thread::sleep(Duration::from_millis(1500));
    let c = Endpoint::new(None, cfg()).unwrap();
    let cc = c
        .connect_local(&tcpx_p2p::LocalPeer::Metadata(b.metadata()))
        .unwrap();
    let cb = b.accept_local(Some(Duration::from_secs(10))).unwrap().conn;
    let mut dst = [0u8; 16];
    let info = b
        .advertise_ipc(cb, dst.as_mut_ptr() as u64, dst.len())
        .unwrap();
    c.write_ipc(cc, &[(PATTERN.as_ptr() as u64, 16)], &[&info])
        .unwrap();
    assert_eq!(dst, PATTERN);
}

#[test]
fn a_peer_that_execs_after_connecting_is_refused() {
    match std::env::var(ROLE).as_deref() {
        Ok("connector") => return connector(),
        Ok("requester") => return requester(),
        _ => {}
    }
    run(None);
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        std::env::set_var("TCPX_P2P_LOCAL_ANY_UID", "1");
        run(Some(65534));
    } else {
        eprintln!("not root: the other-uid case is not run");
    }
}
