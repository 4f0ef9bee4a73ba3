//! A hostile peer against a live endpoint on 127.0.0.1. It speaks our
//! handshake and control messages through the encoders of `wire` (and our
//! own socket net for the data channels), and breaks the rules on purpose.
//! Each test checks that the endpoint lives, that nothing was written
//! outside what was advertised, that a legitimate peer on another
//! connection still transfers, and that threads and descriptors return to
//! their baseline.

use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tcpx_p2p::net::PluginNet;
use tcpx_p2p::net::{ListenComm, MemRef, Net, RecvComm, SendComm, Waker};
use tcpx_p2p::net::{SocketConfig, SocketNet};
use tcpx_p2p::MemKind;
use tcpx_p2p::{Config, Endpoint};
use tcpx_p2p_wire::auth::{nonce, proof, Role};
use tcpx_p2p_wire::{self as wire, Control, FifoItem, HandshakeMsg, Hello, RmaItem, Token};
use tcpx_p2p_wire::{read_frame, write_frame};

mod common;
use common::{buf, emu_path, pattern};

/// These tests count the process's threads and descriptors: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const LO: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const CHUNK: u64 = 256 << 10;

fn cfg() -> Config {
    Config {
        ifname: Some("lo".into()),
        streams: 2,
        chunk: CHUNK as usize,
        min_part: 16 << 10,
        connect_timeout: Duration::from_secs(5),
        ..Config::default()
    }
}

/// This process's descriptors and the engine's threads (all named
/// `tcpx-…`). The test harness's own threads are left out: the next test's
/// thread, blocked on [`serial`], may start or not between two counts.
fn counts() -> (usize, usize) {
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let engine = thread_names()
        .iter()
        .filter(|n| n.starts_with("tcpx"))
        .count();
    (fds, engine)
}

/// [`counts`] once they hold still (two looks `apart` apart agree, 5 s at
/// most): a thread just started names itself a moment later, and a test
/// before may still be closing descriptors.
fn settled(apart: Duration) -> (usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = counts();
    loop {
        std::thread::sleep(apart);
        let now = counts();
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
                .map(|c| c.trim().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Waits (bounded) until threads and descriptors are back to `base`.
fn back_to(base: (usize, usize)) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = counts();
        if now.0 <= base.0 && now.1 <= base.1 {
            return;
        }
        if Instant::now() > deadline {
            let fds: Vec<_> = std::fs::read_dir("/proc/self/fd")
                .map(|d| {
                    d.flatten()
                        .filter_map(|e| std::fs::read_link(e.path()).ok())
                        .collect()
                })
                .unwrap_or_default();
            let threads = thread_names();
            panic!(
                "descriptors/threads {now:?} did not return to {base:?}: {fds:?}, threads {threads:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The target `b`, and a legitimate peer `a` connected to it.
struct World {
    a: Endpoint,
    b: Endpoint,
    ca: u64,
    cb: u64,
}

fn world(a_cfg: Config, b_cfg: Config) -> World {
    let b = Endpoint::new(None, b_cfg).unwrap();
    let a = Endpoint::new(None, a_cfg).unwrap();
    let addr = b.local_addr();
    let ca = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    let cb = b.accept(Some(Duration::from_secs(10))).unwrap().conn;
    let w = World { a, b, ca, cb };
    // The socket net opens a comm's further streams as its messages want
    // them (and keeps them): a first transfer grows them here, so that the
    // descriptors a test compares are the hostile peer's.
    legit_transfer(&w, 0);
    settled(Duration::from_millis(200));
    w
}

/// The legitimate peer writes into an advertised range of the target and
/// reads it back; every byte is checked, and the guard bytes around it.
fn legit_transfer(w: &World, seed: u8) {
    let n = 300 << 10;
    let mut target = vec![0xEEu8; n + 8192];
    let tb = buf(&w.b, &mut target);
    let d = w.b.advertise(w.cb, tb.mr, tb.ptr + 4096, n).unwrap();
    let meta = FifoItem::decode(&d).unwrap();
    let mut src = pattern(n, seed);
    let sb = buf(&w.a, &mut src);
    let x = w.a.write_async(w.ca, &[sb], &[meta]).unwrap();
    assert!(w.a.wait(x, Some(Duration::from_secs(30))).unwrap());
    assert_eq!(&target[4096..4096 + n], &src[..], "legitimate write landed");
    assert!(target[..4096]
        .iter()
        .chain(&target[4096 + n..])
        .all(|&b| b == 0xEE));
    let mut back = vec![0u8; n];
    let bb = buf(&w.a, &mut back);
    let x = w.a.read_async(w.ca, &[bb], &[meta]).unwrap();
    assert!(w.a.wait(x, Some(Duration::from_secs(30))).unwrap());
    assert_eq!(back, src, "legitimate read");
    w.a.dereg(sb.mr).unwrap();
    w.a.dereg(bb.mr).unwrap();
    w.b.dereg(tb.mr).unwrap();
}

// ------------------------------------------------------------ the hostile peer

fn socket_net(streams: usize) -> SocketNet {
    SocketNet::new(SocketConfig {
        addr: LO,
        streams,
        min_part: 16 << 10,
        sockbuf: 0,
        staging_slice: 1 << 20,
        staging_depth: 2,
        connect_timeout: Duration::from_secs(5),
        hello_timeout: Duration::from_secs(5),
        spin: Duration::ZERO,
        linger: Duration::from_millis(100),
        cpus: None,
        gpu: None,
        splice: false,
        stall: Duration::from_secs(10),
    })
}

fn hello(channels: u8) -> Hello {
    hello_on(channels, "socket")
}

fn hello_on(channels: u8, net: &str) -> Hello {
    Hello {
        version: wire::VERSION,
        gpu_index: -1,
        gpu_bdf: String::new(),
        net: net.into(),
        channels,
        chunk: CHUNK,
        nonce: nonce().unwrap(),
    }
}

fn bytes_of(h: &Hello) -> Vec<u8> {
    let mut v = Vec::new();
    h.encode(&mut v);
    v
}

fn send_hs(s: &mut TcpStream, m: &HandshakeMsg) {
    let mut v = Vec::new();
    m.encode(&mut v);
    write_frame(s, &v).unwrap();
}

fn send_ctl(s: &mut TcpStream, m: &Control) -> std::io::Result<()> {
    let mut v = Vec::new();
    m.encode(&mut v);
    write_frame(s, &v)
}

fn recv_hs(s: &mut TcpStream) -> HandshakeMsg {
    HandshakeMsg::decode(&read_frame(s, 1 << 20).unwrap()).unwrap()
}

/// The next control message other than a keep-alive (None: closed).
fn recv_ctl(s: &mut TcpStream) -> Option<Control> {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    loop {
        let b = read_frame(s, wire::MAX_FRAME).ok()?;
        match Control::decode(&b).unwrap() {
            Control::KeepAlive => continue,
            m => return Some(m),
        }
    }
}

/// Reads until the endpoint closes the connection (bounded).
fn expect_closed(s: &mut TcpStream) {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                panic!("the endpoint kept the connection open")
            }
            Err(_) => return,
        }
    }
}

/// A hostile peer with a finished handshake and its data channels.
struct Hostile {
    oob: TcpStream,
    channels: usize,
    sends: Vec<Box<dyn SendComm>>,
    recvs: Vec<Box<dyn RecvComm>>,
}

fn noop() -> Waker {
    Arc::new(|| {})
}

/// Proves `key` as `role` (without checking the other side's proof).
/// Returns the agreed channels, or the endpoint's refusal.
fn prove(s: &mut TcpStream, role: Role, key: &[u8], channels: u8) -> Result<usize, String> {
    prove_on(s, role, key, channels, "socket")
}

/// [`prove`] for a peer of net `net`.
fn prove_on(
    s: &mut TcpStream,
    role: Role,
    key: &[u8],
    channels: u8,
    net: &str,
) -> Result<usize, String> {
    match role {
        Role::Initiator => {
            let mine = bytes_of(&hello_on(channels, net));
            write_frame(s, &mine).unwrap();
            let tb = read_frame(s, 1 << 20).unwrap();
            let theirs = Hello::decode(&tb).map_err(|e| e.to_string())?;
            send_hs(s, &HandshakeMsg::Proof(proof(key, role, &mine, &tb)));
            match recv_hs(s) {
                HandshakeMsg::Proof(_) => Ok(theirs.channels as usize),
                HandshakeMsg::Refuse(why) => Err(why),
                m => panic!("{m:?}"),
            }
        }
        Role::Acceptor => {
            let tb = read_frame(s, 1 << 20).unwrap();
            let theirs = Hello::decode(&tb).unwrap();
            let ch = theirs.channels.min(channels);
            let mine = bytes_of(&hello_on(ch, net));
            write_frame(s, &mine).unwrap();
            match recv_hs(s) {
                HandshakeMsg::Proof(_) => {}
                m => panic!("{m:?}"),
            }
            send_hs(s, &HandshakeMsg::Proof(proof(key, role, &tb, &mine)));
            Ok(ch as usize)
        }
    }
}

impl Hostile {
    /// Completes the handshake as `role` and sets up the data channels.
    fn shake(oob: TcpStream, role: Role, key: &[u8]) -> Hostile {
        Hostile::shake_on(oob, role, key, &socket_net(2), "socket")
    }

    /// [`Hostile::shake`] over `net`, named `name` in the handshake.
    fn shake_on(mut oob: TcpStream, role: Role, key: &[u8], net: &dyn Net, name: &str) -> Hostile {
        let channels = prove_on(&mut oob, role, key, 1, name).unwrap();
        let mut listens: Vec<Box<dyn ListenComm>> =
            (0..2 * channels).map(|_| net.listen(0).unwrap()).collect();
        send_hs(
            &mut oob,
            &HandshakeMsg::Handles(listens.iter().map(|l| l.handle()).collect()),
        );
        let HandshakeMsg::Handles(theirs) = recv_hs(&mut oob) else {
            panic!("no handles")
        };
        let mut sends: Vec<Option<Box<dyn SendComm>>> = (0..2 * channels).map(|_| None).collect();
        let mut recvs: Vec<Option<Box<dyn RecvComm>>> = (0..2 * channels).map(|_| None).collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        while sends.iter().any(Option::is_none) || recvs.iter().any(Option::is_none) {
            for (i, s) in sends.iter_mut().enumerate() {
                if s.is_none() {
                    *s = net.connect(0, &theirs[i], noop()).unwrap();
                }
            }
            for (i, r) in recvs.iter_mut().enumerate() {
                if r.is_none() {
                    *r = listens[i].accept(noop()).unwrap();
                }
            }
            assert!(Instant::now() < deadline, "channels not set up");
            std::thread::sleep(Duration::from_millis(1));
        }
        oob.set_read_timeout(None).unwrap();
        Hostile {
            oob,
            channels,
            sends: sends.into_iter().flatten().collect(),
            recvs: recvs.into_iter().flatten().collect(),
        }
    }

    fn connect(to: SocketAddr, key: &[u8]) -> Hostile {
        Hostile::shake(TcpStream::connect(to).unwrap(), Role::Initiator, key)
    }
}

/// A target endpoint's connection from a hostile peer, and a region of
/// `len` bytes advertised to it (filled with 0xEE).
fn advertised(b: &Endpoint, conn: u64, mem: &mut [u8]) -> (u64, Token, u64) {
    mem.fill(0xEE);
    let tb = buf(b, mem);
    let d = FifoItem::decode(&b.advertise(conn, tb.mr, tb.ptr, mem.len()).unwrap()).unwrap();
    (tb.mr, d.token, tb.ptr)
}

/// A hostile target on its own listener: its one connection, made here by
/// `a`, is taken through the handshake as the acceptor and handed to
/// `play` on the target's thread. Returns `a`'s connection to it and that
/// thread.
fn hostile_target(
    a: &Endpoint,
    play: impl FnOnce(Hostile) + Send + 'static,
) -> (u64, std::thread::JoinHandle<()>) {
    hostile_target_on(a, None, play)
}

/// [`hostile_target`] over the ncclNet plugin at `plugin` (None: the
/// socket net).
fn hostile_target_on(
    a: &Endpoint,
    plugin: Option<String>,
    play: impl FnOnce(Hostile) + Send + 'static,
) -> (u64, std::thread::JoinHandle<()>) {
    let fake = TcpListener::bind((LO, 0)).unwrap();
    let addr = fake.local_addr().unwrap();
    let target = std::thread::spawn(move || {
        let (s, _) = fake.accept().unwrap();
        let h = match plugin {
            Some(path) => {
                let net = PluginNet::load(&path, None).unwrap();
                let name = net.name().to_string();
                // The comms close before their net is unloaded.
                let h = Hostile::shake_on(s, Role::Acceptor, b"", &net, &name);
                play(h);
                drop(net);
                return;
            }
            None => Hostile::shake(s, Role::Acceptor, b""),
        };
        play(h);
    });
    let conn = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    (conn, target)
}

/// A descriptor of `size` bytes that no record of a hostile target stands
/// behind (made up: the target only plays along).
fn made_up(size: u32) -> FifoItem {
    FifoItem {
        addr: 0x10000,
        size,
        rkey: 1,
        nmsgs: 1,
        rid: 0,
        idx: 1,
        token: Token { id: 1, secret: 2 },
    }
}

// --------------------------------------------------------------------- tests

/// Defect 1: a read claiming 2^62 bytes with a made-up token used to abort
/// the process (the refusal sized its fillers from the claim).
#[test]
fn d1_huge_claims_with_made_up_tokens_do_not_kill_the_endpoint() {
    let _g = serial();
    let w = world(cfg(), cfg());
    legit_transfer(&w, 1);
    let base = settled(Duration::from_millis(100));
    let mut mem = vec![0u8; 64 << 10];
    {
        let mut h = Hostile::connect(w.b.local_addr(), b"");
        let cb = w.b.accept(Some(Duration::from_secs(10))).unwrap().conn;
        let (_, token, ptr) = advertised(&w.b, cb, &mut mem);
        let bogus = Token {
            id: 424242,
            secret: 7,
        };
        let huge = |token| RmaItem {
            token,
            addr: ptr,
            len: 1 << 62,
        };
        // A write with a made-up token and a huge length: refused, nothing held.
        send_ctl(
            &mut h.oob,
            &Control::WriteReq {
                xfer: 1,
                items: vec![huge(bogus)],
                runs: vec![1],
            },
        )
        .unwrap();
        match recv_ctl(&mut h.oob) {
            Some(Control::Refused { xfer: 1, reason }) => {
                assert!(reason.contains("unknown or stale"), "{reason}")
            }
            m => panic!("{m:?}"),
        }
        // With the real token but a length past the advertisement: refused.
        send_ctl(
            &mut h.oob,
            &Control::WriteReq {
                xfer: 2,
                items: vec![huge(token)],
                runs: vec![1],
            },
        )
        .unwrap();
        match recv_ctl(&mut h.oob) {
            Some(Control::Refused { xfer: 2, reason }) => {
                assert!(reason.contains("outside the advertised"), "{reason}")
            }
            m => panic!("{m:?}"),
        }
        // A read of 2^62 bytes is refused with one message: nothing is
        // sized from the claim, and the connection goes on.
        send_ctl(
            &mut h.oob,
            &Control::ReadReq {
                xfer: 3,
                items: vec![huge(bogus)],
                runs: vec![1],
            },
        )
        .unwrap();
        match recv_ctl(&mut h.oob) {
            Some(Control::Refused { xfer: 3, reason }) => {
                assert!(reason.contains("unknown or stale"), "{reason}")
            }
            m => panic!("{m:?}"),
        }
        assert!(matches!(w.b.conn_failure(cb), Ok(None)), "connection up");
    }
    assert!(
        mem.iter().all(|&b| b == 0xEE),
        "nothing written to the advertised range"
    );
    legit_transfer(&w, 2);
    back_to(base);
}

/// Defect 3: one hello used to make the endpoint dial thousands of
/// connections (channels × streams) anywhere, before any authentication.
#[test]
fn d3_listen_handles_cannot_amplify_connections() {
    let _g = serial();
    let mut bcfg = cfg();
    bcfg.auth_token = Some("s3cret-token-of-the-test".into());
    let mut acfg = cfg();
    acfg.auth_token = bcfg.auth_token.clone();
    let w = world(acfg, bcfg.clone());
    let base = settled(Duration::from_millis(100));
    // Handles that ask for 2 × 8 channels (the most an accepting endpoint
    // answers) × 64 streams = 1,024 connections.
    let net = socket_net(64);
    let mut listens: Vec<Box<dyn ListenComm>> = (0..16).map(|_| net.listen(0).unwrap()).collect();
    let handles = HandshakeMsg::Handles(listens.iter().map(|l| l.handle()).collect());
    {
        // Unauthenticated: a wrong proof, the handles sent right behind it.
        let mut s = TcpStream::connect(w.b.local_addr()).unwrap();
        let mine = bytes_of(&hello(32));
        write_frame(&mut s, &mine).unwrap();
        let tb = read_frame(&mut s, 1 << 20).unwrap();
        send_hs(
            &mut s,
            &HandshakeMsg::Proof(proof(b"guess", Role::Initiator, &mine, &tb)),
        );
        send_hs(&mut s, &handles);
        match recv_hs(&mut s) {
            HandshakeMsg::Refuse(why) => assert!(why.contains("authentication failed"), "{why}"),
            m => panic!("{m:?}"),
        }
        expect_closed(&mut s);
    }
    {
        // Authenticated (the endpoint without a token), but too many streams.
        let c = Endpoint::new(None, cfg()).unwrap();
        let mut s = TcpStream::connect(c.local_addr()).unwrap();
        let ch = prove(&mut s, Role::Initiator, b"", 32).unwrap();
        assert_eq!(
            ch, 8,
            "32 channels proposed, the endpoint's ceiling answered"
        );
        // The acceptor answers our handles only once it has checked them.
        send_hs(&mut s, &handles);
        match recv_hs(&mut s) {
            HandshakeMsg::Refuse(why) => {
                assert!(why.contains("TCPX_P2P_MAX_PEER_STREAMS"), "{why}")
            }
            m => panic!("{m:?}"),
        }
        expect_closed(&mut s);
    }
    // Nobody dialed the handles.
    for l in &mut listens {
        assert!(l.accept(noop()).unwrap().is_none(), "a handle was dialed");
    }
    // The test's own net (its listener and workers) goes with its comms.
    drop(listens);
    drop(net);
    legit_transfer(&w, 3);
    back_to(base);
}

/// Defect 4: a handshake trickled one byte at a time used to be held
/// forever, and nothing bounded how many were in progress.
#[test]
fn d4_slow_handshakes_end_at_one_deadline_and_are_capped_per_address() {
    let _g = serial();
    let mut bcfg = cfg();
    bcfg.connect_timeout = Duration::from_millis(1000);
    bcfg.max_handshakes_per_ip = 4;
    let w = world(cfg(), bcfg);
    let base = settled(Duration::from_millis(100));
    let to = w.b.local_addr();
    // From another loopback address: 8 connections, each sending a hello one
    // byte every 200 ms (the whole hello would take over 10 s).
    let tricklers: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
                    .unwrap();
                sock.bind(&SocketAddr::new("127.0.0.2".parse().unwrap(), 0).into())
                    .unwrap();
                sock.connect(&to.into()).unwrap();
                let mut s: TcpStream = sock.into();
                let mut frame = Vec::new();
                let h = bytes_of(&hello(1));
                frame.extend_from_slice(&(h.len() as u32).to_le_bytes());
                frame.extend_from_slice(&h);
                s.set_read_timeout(Some(Duration::from_millis(200)))
                    .unwrap();
                // The index of the byte after which the endpoint closed.
                let last = frame.len() - 1;
                for (i, b) in frame.into_iter().enumerate() {
                    if std::io::Write::write_all(&mut s, &[b]).is_err() {
                        return i < last;
                    }
                    let mut x = [0u8; 64];
                    match s.read(&mut x) {
                        Ok(0) => return i < last,
                        Ok(_) => {} // the handshake goes on: not closed
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(_) => return i < last,
                    }
                }
                false
            })
        })
        .collect();
    // Meanwhile a legitimate peer connects and transfers.
    std::thread::sleep(Duration::from_millis(300));
    let c = Endpoint::new(None, cfg()).unwrap();
    let cc = c.connect(&to.ip().to_string(), to.port(), None).unwrap();
    let cb = w.b.accept(Some(Duration::from_secs(10))).unwrap().conn;
    let w2 = World {
        a: c,
        b: w.b,
        ca: cc,
        cb,
    };
    legit_transfer(&w2, 4);
    for t in tricklers {
        assert!(
            t.join().unwrap(),
            "a trickled handshake was held until its hello was complete, past its deadline"
        );
    }
    let World { a: c, b, .. } = w2;
    drop(c);
    let w = World {
        a: w.a,
        b,
        ca: w.ca,
        cb: w.cb,
    };
    legit_transfer(&w, 5);
    back_to(base);
}

/// A control connection from `from` (any loopback address) to `to`.
fn connect_from(from: &str, to: SocketAddr) -> std::io::Result<TcpStream> {
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    sock.bind(&SocketAddr::new(from.parse().unwrap(), 0).into())?;
    sock.connect(&to.into())?;
    Ok(sock.into())
}

/// Issue 29, item 3: established connections were not capped. One
/// connection proposing 32 channels of 1,024 streams cost the target about
/// 1,540 threads and as many descriptors; 40 of them took every descriptor
/// and a legitimate connect was refused. Now the channels are lowered to
/// `max_peer_channels`, the streams refused past `max_peer_streams`, and
/// the connections an address holds capped; every refusal is the answer
/// the peer reads, and a legitimate peer still connects.
#[test]
fn e3_established_connections_are_capped() {
    let _g = serial();
    let mut bcfg = cfg();
    bcfg.max_conns_per_ip = 2;
    let b = Endpoint::new(None, bcfg).unwrap();
    let to = b.local_addr();
    let base = settled(Duration::from_millis(100));
    // 32 channels × 1,024 streams, from 127.0.0.2: the answer lowers the
    // channels to 8; handles for 32 channels (64 × 16 streams) or for 8
    // (16 × 64 streams) are refused, and nothing is dialed.
    for (handles, streams, why) in [
        (64, 16, "64 listen handles for 8 channels"),
        (16, 64, "TCPX_P2P_MAX_PEER_STREAMS"),
    ] {
        let n = socket_net(streams);
        let mut listens: Vec<Box<dyn ListenComm>> =
            (0..handles).map(|_| n.listen(0).unwrap()).collect();
        let mut s = connect_from("127.0.0.2", to).unwrap();
        assert_eq!(prove(&mut s, Role::Initiator, b"", 32).unwrap(), 8);
        send_hs(
            &mut s,
            &HandshakeMsg::Handles(listens.iter().map(|l| l.handle()).collect()),
        );
        let under_attack = counts();
        match recv_hs(&mut s) {
            HandshakeMsg::Refuse(w) => assert!(w.contains(why), "{w}"),
            m => panic!("{m:?}"),
        }
        expect_closed(&mut s);
        for l in &mut listens {
            assert!(l.accept(noop()).unwrap().is_none(), "a handle was dialed");
        }
        eprintln!(
            "32 channels x 1,024 streams proposed ({handles} handles x {streams}): \
             target descriptors/threads {base:?} before, {under_attack:?} while refusing"
        );
    }
    back_to(base);
    // Connections per address: two within the limits from 127.0.0.2 are
    // held, the third is refused, naming the setting.
    let held: Vec<Hostile> = (0..2)
        .map(|_| Hostile::shake(connect_from("127.0.0.2", to).unwrap(), Role::Initiator, b""))
        .collect();
    let holding = counts();
    {
        let mut s = connect_from("127.0.0.2", to).unwrap();
        assert_eq!(prove(&mut s, Role::Initiator, b"", 1).unwrap(), 1);
        let n = socket_net(2);
        let listens: Vec<Box<dyn ListenComm>> = (0..2).map(|_| n.listen(0).unwrap()).collect();
        send_hs(
            &mut s,
            &HandshakeMsg::Handles(listens.iter().map(|l| l.handle()).collect()),
        );
        match recv_hs(&mut s) {
            HandshakeMsg::Refuse(w) => assert!(w.contains("TCPX_P2P_MAX_CONNS_PER_IP"), "{w}"),
            m => panic!("{m:?}"),
        }
        expect_closed(&mut s);
    }
    eprintln!(
        "two small hostile connections held: descriptors/threads {holding:?} (base {base:?}); \
         the third refused"
    );
    // A legitimate peer (another address: 127.0.0.1) still connects and
    // moves checked bytes while the hostile ones are held.
    let a = Endpoint::new(None, cfg()).unwrap();
    let ca = a.connect(&to.ip().to_string(), to.port(), None).unwrap();
    // The hostile connections were accepted first.
    let cb = loop {
        let x = b.accept(Some(Duration::from_secs(10))).unwrap();
        if x.ip == LO {
            break x.conn;
        }
    };
    let w = World { a, b, ca, cb };
    legit_transfer(&w, 6);
    drop(held);
    drop(w);
    back_to(base);
}

/// The attack of issue 29, item 3, as a separate process (so that the
/// target's threads and descriptors are counted alone): `conns`
/// connections to `to`, each proposing 32 channels of 1,024 streams and
/// setting up every net connection the target agrees to. Prints what the
/// target answered, then holds them until stdin closes.
fn amplifying_attacker(to: SocketAddr, conns: usize, streams: usize) {
    let mut held = Vec::new();
    for _ in 0..conns {
        let mut oob = TcpStream::connect(to).unwrap();
        let ch = match prove(&mut oob, Role::Initiator, b"", 32) {
            Ok(ch) => ch,
            Err(why) => {
                println!("refused: {why}");
                continue;
            }
        };
        let net = socket_net((streams / (2 * ch)).clamp(1, 64));
        let mut listens: Vec<Box<dyn ListenComm>> =
            (0..2 * ch).map(|_| net.listen(0).unwrap()).collect();
        send_hs(
            &mut oob,
            &HandshakeMsg::Handles(listens.iter().map(|l| l.handle()).collect()),
        );
        let theirs = match HandshakeMsg::decode(&read_frame(&mut oob, 1 << 20).unwrap()) {
            Ok(HandshakeMsg::Handles(h)) => h,
            Ok(HandshakeMsg::Refuse(why)) => {
                println!("refused: {why}");
                continue;
            }
            m => panic!("{m:?}"),
        };
        let mut sends: Vec<Option<Box<dyn SendComm>>> = (0..2 * ch).map(|_| None).collect();
        let mut recvs: Vec<Option<Box<dyn RecvComm>>> = (0..2 * ch).map(|_| None).collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        while sends.iter().any(Option::is_none) || recvs.iter().any(Option::is_none) {
            for (i, s) in sends.iter_mut().enumerate() {
                if s.is_none() {
                    *s = net.connect(0, &theirs[i], noop()).unwrap();
                }
            }
            for (i, r) in recvs.iter_mut().enumerate() {
                if r.is_none() {
                    *r = listens[i].accept(noop()).unwrap();
                }
            }
            assert!(Instant::now() < deadline, "channels not set up");
            std::thread::sleep(Duration::from_millis(1));
        }
        println!("accepted: {ch} channels");
        held.push((oob, sends, recvs, net));
    }
    println!("ready");
    let mut x = String::new();
    let _ = std::io::stdin().read_line(&mut x);
}

/// The figures of issue 29, item 3: the target's threads and descriptors
/// while 3 connections propose 32 channels × 1,024 streams, with the
/// limits the endpoint had before (`before`) and with the defaults. Run:
/// `cargo test -p tcpx-p2p --test hostile -- --ignored e3_figures --nocapture`.
#[test]
#[ignore = "a measurement: prints figures"]
fn e3_figures() {
    if let Ok(to) = std::env::var("HOSTILE_ATTACK_TO") {
        let n = |k: &str| std::env::var(k).unwrap().parse().unwrap();
        amplifying_attacker(
            to.parse().unwrap(),
            n("HOSTILE_CONNS"),
            n("HOSTILE_STREAMS"),
        );
        return;
    }
    let _g = serial();
    // (limits as before, connections, streams asked per connection)
    for (before, conns, streams) in [(true, 3, 1024), (false, 3, 1024), (false, 10, 256)] {
        let mut c = Config {
            streams: 8,
            ..cfg()
        };
        if before {
            c.max_peer_channels = 32;
            c.max_peer_streams = 1024;
            c.max_conns = 1 << 20;
            c.max_conns_per_ip = 1 << 20;
            c.max_streams_total = 1 << 24;
            c.max_streams_per_ip = 1 << 24;
        }
        let b = Endpoint::new(None, c).unwrap();
        let base = settled(Duration::from_millis(100));
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "e3_figures", "--nocapture"])
            .env("HOSTILE_ATTACK_TO", b.local_addr().to_string())
            .env("HOSTILE_CONNS", conns.to_string())
            .env("HOSTILE_STREAMS", streams.to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(out));
        let mut said = Vec::new();
        for l in lines.by_ref() {
            let l = l.unwrap();
            if l == "ready" {
                break;
            }
            if l.starts_with("refused") || l.starts_with("accepted") {
                said.push(l);
            }
        }
        std::thread::sleep(Duration::from_millis(500));
        let under = counts();
        drop(child.stdin.take());
        let _ = child.wait();
        eprintln!(
            "{}: {conns} connections proposing 32 channels x {streams} streams: target \
             descriptors/threads {base:?} -> {under:?}; the attacker was told {said:?}",
            if before {
                "limits as before"
            } else {
                "default limits"
            }
        );
        drop(b);
    }
}

/// Issue 29, item 7: with a token set, 16 silent handshakes from each of
/// 127.0.0.2–5 filled the 64-handshake limit and token holders got EOF
/// until the attacker stopped. Now a full bound closes an unproven
/// handshake of the busiest subnet and address to make room, and an
/// unproven handshake ends at `preauth_timeout`: while the flood runs (each
/// flooder reopens its connection as soon as it is closed), a token holder
/// connects and moves checked bytes.
#[test]
fn e7_a_silent_handshake_flood_does_not_lock_token_holders_out() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let _g = serial();
    let token = "s3cret-token-of-the-test";
    let mut bcfg = cfg();
    bcfg.auth_token = Some(token.into());
    let acfg = bcfg.clone();
    let b = Endpoint::new(None, bcfg).unwrap();
    let to = b.local_addr();
    let base = settled(Duration::from_millis(100));
    let stop = Arc::new(AtomicBool::new(false));
    let open = Arc::new(AtomicUsize::new(0));
    let opened = Arc::new(AtomicUsize::new(0));
    let flooders: Vec<_> = (2..=5)
        .flat_map(|host| (0..16).map(move |_| format!("127.0.0.{host}")))
        .map(|from| {
            let (stop, open, opened) = (stop.clone(), open.clone(), opened.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut s) = connect_from(&from, to) else {
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    };
                    open.fetch_add(1, Ordering::Relaxed);
                    opened.fetch_add(1, Ordering::Relaxed);
                    // Silent: send nothing, hold it until the endpoint closes it.
                    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                    let mut x = [0u8; 16];
                    loop {
                        match s.read(&mut x) {
                            Ok(_) => break,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                if stop.load(Ordering::Relaxed) {
                                    break;
                                }
                            }
                            Err(_) => break,
                        }
                    }
                    open.fetch_sub(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        })
        .collect();
    // Let the flood fill every place it can.
    let t0 = Instant::now();
    while opened.load(Ordering::Relaxed) < 64 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    let flooded = counts();
    let during = open.load(Ordering::Relaxed);
    // Token holders connect and move checked bytes, twice, with the flood on.
    let a = Endpoint::new(None, acfg.clone()).unwrap();
    let ca = a.connect(&to.ip().to_string(), to.port(), None).unwrap();
    let cb = b.accept(Some(Duration::from_secs(10))).unwrap().conn;
    let w = World { a, b, ca, cb };
    legit_transfer(&w, 7);
    let c = Endpoint::new(None, acfg).unwrap();
    let cc = c.connect(&to.ip().to_string(), to.port(), None).unwrap();
    let cb2 = w.b.accept(Some(Duration::from_secs(10))).unwrap().conn;
    let still = open.load(Ordering::Relaxed);
    let World { a, b, .. } = w;
    drop(a);
    let w = World {
        a: c,
        b,
        ca: cc,
        cb: cb2,
    };
    legit_transfer(&w, 8);
    stop.store(true, Ordering::Relaxed);
    for f in flooders {
        f.join().unwrap();
    }
    eprintln!(
        "flood: {during} silent connections open when the token holders came ({still} after the \
         first transfer), {} opened in all; descriptors/threads {flooded:?} under the flood, \
         base {base:?}",
        opened.load(Ordering::Relaxed)
    );
    assert!(
        during >= 32 && still >= 16,
        "the flood was running: {during}, {still}"
    );
    drop(w);
    back_to(base);
}

/// Defect 5: the token's digest went in clear and logged in when replayed.
#[test]
fn d5_wrong_and_replayed_proofs_are_refused() {
    let _g = serial();
    let token = "s3cret-token-of-the-test";
    let mut bcfg = cfg();
    bcfg.auth_token = Some(token.into());
    let w = world(bcfg.clone(), bcfg.clone());
    let base = settled(Duration::from_millis(100));
    // A wrong secret.
    let mut s = TcpStream::connect(w.b.local_addr()).unwrap();
    let r = prove(&mut s, Role::Initiator, b"s3cret-token-of-the-tesT", 1);
    assert!(r.unwrap_err().contains("authentication failed"));
    drop(s);
    // A fake server harvests a legitimate initiator's proof...
    let fake = TcpListener::bind((LO, 0)).unwrap();
    let fake_addr = fake.local_addr().unwrap();
    let harvest = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let hi = read_frame(&mut s, 1 << 20).unwrap();
        let ha = bytes_of(&hello(1));
        write_frame(&mut s, &ha).unwrap();
        let HandshakeMsg::Proof(p) = recv_hs(&mut s) else {
            panic!()
        };
        send_hs(&mut s, &HandshakeMsg::Refuse("bye".into()));
        (hi, p)
    });
    let victim = Endpoint::new(None, bcfg).unwrap();
    assert!(victim
        .connect(&fake_addr.ip().to_string(), fake_addr.port(), None)
        .is_err());
    let (hi, p) = harvest.join().unwrap();
    // ...and replays the hello and the proof to the real endpoint.
    let mut s = TcpStream::connect(w.b.local_addr()).unwrap();
    write_frame(&mut s, &hi).unwrap();
    let _theirs = read_frame(&mut s, 1 << 20).unwrap();
    send_hs(&mut s, &HandshakeMsg::Proof(p));
    match recv_hs(&mut s) {
        HandshakeMsg::Refuse(why) => assert!(why.contains("authentication failed"), "{why}"),
        m => panic!("replayed proof accepted: {m:?}"),
    }
    expect_closed(&mut s);
    drop(s);
    drop(victim);
    legit_transfer(&w, 6);
    back_to(base);
}

/// Defect 6: a second ReadAck used to complete a read before its data.
#[test]
fn d6_a_duplicate_acknowledgement_fails_the_connection() {
    let _g = serial();
    // A read through the net (not inline): ReadReq, ReadAck, data.
    let acfg = Config {
        inline_max: 0,
        ..cfg()
    };
    let w = world(acfg, cfg());
    let base = settled(Duration::from_millis(100));
    let (ca, target) = hostile_target(&w.a, |mut h| {
        let Some(Control::ReadReq { xfer, .. }) = recv_ctl(&mut h.oob) else {
            panic!()
        };
        send_ctl(&mut h.oob, &Control::ReadAck { xfer }).unwrap();
        send_ctl(&mut h.oob, &Control::ReadAck { xfer }).unwrap();
        expect_closed(&mut h.oob);
    });
    let mut dst = vec![0x11u8; 64 << 10];
    let db = buf(&w.a, &mut dst);
    let x = w.a.read_async(ca, &[db], &[made_up(64 << 10)]).unwrap();
    match w.a.wait(x, Some(Duration::from_secs(30))) {
        Err(e) => assert!(e.to_string().contains("ReadAck"), "{e}"),
        Ok(done) => panic!("a read without data ended with {done}"),
    }
    target.join().unwrap();
    assert!(dst.iter().all(|&b| b == 0x11), "no byte landed");
    w.a.dereg(db.mr).unwrap();
    legit_transfer(&w, 7);
    back_to(base);
}

/// Defect 7: a peer holding one descriptor could make the endpoint hold
/// any number of requests and items.
#[test]
fn d7_outstanding_requests_and_items_are_capped() {
    let _g = serial();
    let mut bcfg = cfg();
    bcfg.max_pending_items = 20_000;
    bcfg.max_requests = 8;
    let w = world(cfg(), bcfg);
    let base = settled(Duration::from_millis(100));
    let mut mem = vec![0u8; 64 << 10];
    {
        let mut h = Hostile::connect(w.b.local_addr(), b"");
        let cb = w.b.accept(Some(Duration::from_secs(10))).unwrap().conn;
        let (_, token, ptr) = advertised(&w.b, cb, &mut mem);
        // 20 writes of 4,096 one-byte items each, data never sent.
        let items: Vec<RmaItem> = (0..4096)
            .map(|i| RmaItem {
                token,
                addr: ptr + i * 2,
                len: 1,
            })
            .collect();
        for xfer in 0..20 {
            let m = Control::WriteReq {
                xfer,
                items: items.clone(),
                runs: vec![1; 4096],
            };
            send_ctl(&mut h.oob, &m).unwrap();
        }
        let (mut cts, mut refused) = (0, 0);
        for _ in 0..20 {
            match recv_ctl(&mut h.oob) {
                Some(Control::WriteCts { .. }) => cts += 1,
                Some(Control::Refused { reason, .. }) => {
                    assert!(reason.contains("TCPX_P2P_MAX_PENDING_ITEMS"), "{reason}");
                    refused += 1
                }
                m => panic!("{m:?}"),
            }
        }
        // Each request holds 4,096 items and 4 gathered requests.
        assert_eq!((cts, refused), (4, 16));
        assert!(h.sends.len() == 2 * h.channels);
    }
    assert!(mem.iter().all(|&b| b == 0xEE), "nothing written");
    legit_transfer(&w, 8);
    back_to(base);
}

/// Defect 2: dereg while a peer's write is posted into the region used to
/// return Ok, and the bytes landed afterwards.
#[test]
fn d2_dereg_refuses_while_a_peer_write_is_posted_into_the_region() {
    let _g = serial();
    let mut bcfg = cfg();
    bcfg.dereg_wait = Duration::from_millis(300);
    let w = world(cfg(), bcfg);
    let n = 4096usize;
    let mut mem = vec![0u8; n];
    let mut h = Hostile::connect(w.b.local_addr(), b"");
    let cb = w.b.accept(Some(Duration::from_secs(10))).unwrap().conn;
    let (mr, token, ptr) = advertised(&w.b, cb, &mut mem);
    let m = Control::WriteReq {
        xfer: 9,
        items: vec![RmaItem {
            token,
            addr: ptr,
            len: n as u64,
        }],
        runs: vec![1],
    };
    send_ctl(&mut h.oob, &m).unwrap();
    assert_eq!(recv_ctl(&mut h.oob), Some(Control::WriteCts { xfer: 9 }));
    // The receive is posted into the region: dereg refuses and keeps it.
    let e = w.b.dereg(mr).unwrap_err().to_string();
    assert!(e.contains("still in use"), "{e}");
    assert!(
        w.b.advertise(cb, mr, ptr, n).is_ok(),
        "the region stays registered"
    );
    // The peer sends; the bytes land in memory that is still registered.
    let src = pattern(n, 9);
    let mem_ref = MemRef {
        addr: src.as_ptr() as u64,
        len: n,
        kind: MemKind::Host,
    };
    let send = &mut h.sends[h.channels];
    let mrh = send.reg_mr(mem_ref).unwrap();
    let req = loop {
        if let Some(r) = send.isend(mem_ref, mrh).unwrap() {
            break r;
        }
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while send.test(req).unwrap().is_none() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(recv_ctl(&mut h.oob), Some(Control::WriteDone { xfer: 9 }));
    assert_eq!(mem, src);
    // Nothing posted any more: dereg succeeds, and the descriptor is stale.
    w.b.dereg(mr).unwrap();
    assert!(w.b.advertise(cb, mr, ptr, n).is_err());
    drop(h);
    legit_transfer(&w, 10);
}

/// Defect 9: unmapped host memory and a GPU index that does not exist are
/// refused with what is wrong.
#[test]
fn d9_unmapped_memory_and_bad_gpu_indices_are_named() {
    let _g = serial();
    let ep = Endpoint::new(None, cfg()).unwrap();
    let v = vec![0u8; 4096];
    let e = ep.reg(v.as_ptr() as u64, 1 << 40).unwrap_err().to_string();
    assert!(e.contains("not all mapped"), "{e}");
    assert!(ep.reg(v.as_ptr() as u64, v.len()).is_ok());
    let gpus = tcpx_p2p_gpu::device_count();
    for bad in [-5, 7.max(gpus as i32)] {
        let e = Endpoint::new(Some(bad), cfg())
            .err()
            .expect("accepted a GPU that does not exist")
            .to_string();
        assert!(e.contains(&format!("GPU index {bad}")), "{e}");
    }
    assert!(Endpoint::new(Some(0), cfg()).is_ok());
}

/// Inline writes and reads (data on the control connection): a forged
/// token, a payload longer or shorter than its items, a range past the
/// advertisement and an oversized payload claim land nothing; a valid one
/// lands exactly its bytes. As the reader, inline data of the wrong length
/// or for a read never made fails the connection with nothing landed.
#[test]
fn d10_inline_payloads_land_only_inside_the_advertisement() {
    let _g = serial();
    let w = world(cfg(), cfg());
    legit_transfer(&w, 11);
    let base = settled(Duration::from_millis(100));
    let n = 8192usize;
    let mut mem = vec![0xEEu8; 3 * n];
    {
        let mut h = Hostile::connect(w.b.local_addr(), b"");
        let cb = w.b.accept(Some(Duration::from_secs(10))).unwrap().conn;
        let tb = buf(&w.b, &mut mem);
        let d = w.b.advertise(cb, tb.mr, tb.ptr + n as u64, n).unwrap();
        let token = FifoItem::decode(&d).unwrap().token;
        let at = |off: usize, len: usize, token| RmaItem {
            token,
            addr: tb.ptr + (n + off) as u64,
            len: len as u64,
        };
        let mut send = |xfer, item: RmaItem, payload: &[u8]| {
            let m = Control::WriteInline {
                xfer,
                items: vec![item],
                runs: vec![1],
                len: payload.len() as u32,
            };
            send_ctl(&mut h.oob, &m).unwrap();
            std::io::Write::write_all(&mut h.oob, payload).unwrap();
            recv_ctl(&mut h.oob)
        };
        let forged = Token {
            id: token.id,
            secret: token.secret ^ 1,
        };
        let refused = |m: Option<Control>, want: u64| match m {
            Some(Control::Refused { xfer, .. }) => assert_eq!(xfer, want),
            m => panic!("{m:?}"),
        };
        refused(send(1, at(0, 100, forged), &[0x11; 100]), 1);
        refused(send(2, at(0, 100, token), &[0x22; 101]), 2);
        refused(send(3, at(0, 100, token), &[0x33; 99]), 3);
        refused(send(4, at(n - 10, 20, token), &[0x44; 20]), 4);
        refused(send(5, at(0, 1 << 40, token), &[0x55; 64]), 5);
        // Still in step after the dropped payloads: a valid one lands.
        assert_eq!(
            send(6, at(100, 1000, token), &[0x5A; 1000]),
            Some(Control::WriteDone { xfer: 6 })
        );
        // An inline read of the advertised range: exactly its bytes.
        let m = Control::ReadInline {
            xfer: 7,
            items: vec![at(0, n, token)],
            runs: vec![1],
        };
        send_ctl(&mut h.oob, &m).unwrap();
        assert_eq!(
            recv_ctl(&mut h.oob),
            Some(Control::ReadData {
                xfer: 7,
                len: n as u32
            })
        );
        let mut got = vec![0u8; n];
        h.oob.read_exact(&mut got).unwrap();
        assert!(got[..100].iter().chain(&got[1100..]).all(|&b| b == 0xEE));
        assert!(got[100..1100].iter().all(|&b| b == 0x5A));
        // A forged read is refused with nothing following.
        let m = Control::ReadInline {
            xfer: 8,
            items: vec![at(0, n, forged)],
            runs: vec![1],
        };
        send_ctl(&mut h.oob, &m).unwrap();
        refused(recv_ctl(&mut h.oob), 8);
        // A payload claim over the inline bound: malformed, the connection ends.
        let mut v = Vec::new();
        Control::WriteInline {
            xfer: 9,
            items: vec![at(0, n, token)],
            runs: vec![1],
            len: wire::MAX_INLINE as u32 + 1,
        }
        .encode(&mut v);
        write_frame(&mut h.oob, &v).unwrap();
        expect_closed(&mut h.oob);
        w.b.dereg(tb.mr).unwrap();
    }
    assert!(mem[..n + 100].iter().all(|&b| b == 0xEE));
    assert!(mem[n + 100..n + 1100].iter().all(|&b| b == 0x5A));
    assert!(mem[n + 1100..].iter().all(|&b| b == 0xEE));

    // As the reader: a hostile target answers an inline read with the
    // wrong length, then with data for a read never made.
    for wrong_xfer in [false, true] {
        let (ca, target) = hostile_target(&w.a, move |mut h| {
            let Some(Control::ReadInline { xfer, items, .. }) = recv_ctl(&mut h.oob) else {
                panic!()
            };
            let len = items[0].len as u32 + if wrong_xfer { 0 } else { 1 };
            let xfer = xfer + if wrong_xfer { 100 } else { 0 };
            send_ctl(&mut h.oob, &Control::ReadData { xfer, len }).unwrap();
            let _ = std::io::Write::write_all(&mut h.oob, &vec![0x77; len as usize]);
            expect_closed(&mut h.oob);
        });
        let mut dst = vec![0x11u8; 4096];
        let db = buf(&w.a, &mut dst);
        let x = w.a.read_async(ca, &[db], &[made_up(4096)]).unwrap();
        match w.a.wait(x, Some(Duration::from_secs(30))) {
            Err(e) => assert!(
                e.to_string().contains("ReadData") || e.to_string().contains("inline"),
                "{e}"
            ),
            Ok(done) => panic!("a read with bad data ended with {done}"),
        }
        target.join().unwrap();
        assert!(dst.iter().all(|&b| b == 0x11), "no byte landed");
        w.a.dereg(db.mr).unwrap();
    }
    // A legitimate inline write and read still work.
    let mut target = vec![0u8; 4096];
    let tb = buf(&w.b, &mut target);
    let meta = FifoItem::decode(&w.b.advertise(w.cb, tb.mr, tb.ptr, 4096).unwrap()).unwrap();
    let mut src = pattern(4096, 12);
    let sb = buf(&w.a, &mut src);
    let x = w.a.write_async(w.ca, &[sb], &[meta]).unwrap();
    assert!(w.a.wait(x, Some(Duration::from_secs(30))).unwrap());
    assert_eq!(target, src);
    let mut back = vec![0u8; 4096];
    let bb = buf(&w.a, &mut back);
    let x = w.a.read_async(w.ca, &[bb], &[meta]).unwrap();
    assert!(w.a.wait(x, Some(Duration::from_secs(30))).unwrap());
    assert_eq!(back, src);
    for (e, mr) in [(&w.a, sb.mr), (&w.a, bb.mr), (&w.b, tb.mr)] {
        e.dereg(mr).unwrap();
    }
    legit_transfer(&w, 13);
    back_to(base);
}

/// The receiver's `MsgDone` counts are checked: a count that does not
/// grow, or that covers messages never sent, fails the connection.
#[test]
fn d11_message_acknowledgements_are_checked() {
    let _g = serial();
    let w = world(cfg(), cfg());
    let base = settled(Duration::from_millis(100));
    let (go, wait_go) = std::sync::mpsc::channel::<u64>();
    let (ca, target) = hostile_target(&w.a, move |mut h| {
        // Acknowledge the first message before receiving it, then repeat
        // that count (it must grow), then claim messages never sent.
        let count = wait_go.recv().unwrap();
        send_ctl(&mut h.oob, &Control::MsgDone { count }).unwrap();
        let again = wait_go.recv().unwrap();
        send_ctl(&mut h.oob, &Control::MsgDone { count: again }).unwrap();
        expect_closed(&mut h.oob);
    });
    let mut src = pattern(4096, 3);
    let sb = buf(&w.a, &mut src);
    let x = w.a.send_async(ca, &[sb]).unwrap();
    go.send(1).unwrap();
    // Its bytes fit the socket buffers: it ends once written.
    assert!(w.a.wait(x, Some(Duration::from_secs(30))).unwrap());
    // A send completes once its bytes are written; the repeated count then
    // fails the connection.
    let y = w.a.send_async(ca, &[sb]).unwrap();
    go.send(1).unwrap();
    let _ = w.a.wait(y, Some(Duration::from_secs(30)));
    target.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let why = loop {
        if let Ok(Some(f)) = w.a.conn_failure(ca) {
            break f;
        }
        assert!(Instant::now() < deadline, "connection still up");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(why.contains("acknowledged 1 messages"), "{why}");
    w.a.dereg(sb.mr).unwrap();
    legit_transfer(&w, 11);
    back_to(base);
}

#[test]
fn d11_counts_beyond_what_was_sent_fail_the_connection() {
    let _g = serial();
    let w = world(cfg(), cfg());
    let base = settled(Duration::from_millis(100));
    let (ca, target) = hostile_target(&w.a, |mut h| {
        send_ctl(&mut h.oob, &Control::MsgDone { count: u64::MAX }).unwrap();
        expect_closed(&mut h.oob);
    });
    target.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let why = loop {
        if let Ok(Some(f)) = w.a.conn_failure(ca) {
            break f;
        }
        assert!(Instant::now() < deadline, "connection still up");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(why.contains("acknowledged"), "{why}");
    legit_transfer(&w, 12);
    back_to(base);
}

/// Cancelling is safe against whatever the peer does next: a write
/// cancelled before its clear-to-send sends empty messages when cleared
/// (the target refuses it), an inline read cancelled before its data reads
/// and drops the bytes; neither touches the buffers, and the connection
/// goes on.
#[test]
fn cancelled_transfers_keep_the_connection_in_step() {
    let _g = serial();
    let acfg = Config {
        inline_max: 4096,
        ..cfg()
    };
    let w = world(acfg, cfg());
    let base = settled(Duration::from_millis(100));
    let (go, wait_go) = std::sync::mpsc::channel::<()>();
    let (told, heard) = std::sync::mpsc::channel::<usize>();
    let (ca, target) = hostile_target(&w.a, move |mut h| {
        // The write: cleared only after it was cancelled.
        let Some(Control::WriteReq { xfer, .. }) = recv_ctl(&mut h.oob) else {
            panic!("no write request")
        };
        wait_go.recv().unwrap();
        let mut landing = vec![0x5Au8; 64 << 10];
        let mem = MemRef {
            addr: landing.as_mut_ptr() as u64,
            len: landing.len(),
            kind: MemKind::Host,
        };
        let recv = &mut h.recvs[h.channels];
        let mrh = recv.reg_mr(mem).unwrap();
        let req = loop {
            if let Some(r) = recv.irecv(mem, mrh).unwrap() {
                break r;
            }
        };
        send_ctl(&mut h.oob, &Control::WriteCts { xfer }).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let got = loop {
            if let Some(n) = recv.test(req).unwrap() {
                break n;
            }
            assert!(Instant::now() < deadline, "no filler arrived");
            std::thread::sleep(Duration::from_millis(1));
        };
        told.send(got).unwrap();
        send_ctl(
            &mut h.oob,
            &Control::Refused {
                xfer,
                reason: "empty".into(),
            },
        )
        .unwrap();
        // The inline read: answered only after it was cancelled.
        let Some(Control::ReadInline { xfer, .. }) = recv_ctl(&mut h.oob) else {
            panic!("no inline read")
        };
        wait_go.recv().unwrap();
        let mut frame = Vec::new();
        Control::ReadData { xfer, len: 2048 }.encode(&mut frame);
        write_frame(&mut h.oob, &frame).unwrap();
        std::io::Write::write_all(&mut h.oob, &[0xABu8; 2048]).unwrap();
        // Still in step: a keep-alive-free notification gets through.
        send_ctl(
            &mut h.oob,
            &Control::Notif {
                name: "hostile".into(),
                msg: b"after".to_vec(),
            },
        )
        .unwrap();
        wait_go.recv().unwrap();
    });
    let mut src = pattern(64 << 10, 4);
    let sb = buf(&w.a, &mut src);
    let x = w.a.write_async(ca, &[sb], &[made_up(64 << 10)]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(w.a.cancel(x, Some(Duration::from_secs(5))).unwrap());
    // Its buffer is free at once.
    w.a.dereg(sb.mr).unwrap();
    go.send(()).unwrap();
    assert_eq!(heard.recv().unwrap(), 0, "the cleared write sent no byte");

    let mut dst = vec![0x11u8; 2048];
    let db = buf(&w.a, &mut dst);
    let r = w.a.read_async(ca, &[db], &[made_up(2048)]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(w.a.cancel(r, Some(Duration::from_secs(5))).unwrap());
    go.send(()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while w.a.get_notifs().is_empty() {
        assert!(Instant::now() < deadline, "the connection fell out of step");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(matches!(w.a.conn_failure(ca), Ok(None)), "connection up");
    assert!(dst.iter().all(|&b| b == 0x11), "no byte of the read landed");
    w.a.dereg(db.mr).unwrap();
    go.send(()).unwrap();
    target.join().unwrap();
    legit_transfer(&w, 13);
    back_to(base);
}

/// FNV-1a of a buffer: what the application would compare.
fn checksum(v: &[u8]) -> u64 {
    v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Sends `n` bytes of `fill` on the hostile peer's first one-sided data
/// channel, and waits (bounded) until the net has taken them. The bytes
/// returned must outlive the hostile peer's comms.
fn send_stray(h: &mut Hostile, n: usize, fill: u8) -> Vec<u8> {
    let payload = vec![fill; n];
    let mem = MemRef {
        addr: payload.as_ptr() as u64,
        len: n,
        kind: MemKind::Host,
    };
    let send = &mut h.sends[h.channels];
    let mrh = send.reg_mr(mem).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let req = loop {
        match send.isend(mem, mrh) {
            Ok(Some(r)) => break r,
            Ok(None) => {}
            // The endpoint closed the connection.
            Err(_) => return payload,
        }
        assert!(Instant::now() < deadline, "send not taken");
        std::thread::sleep(Duration::from_millis(1));
    };
    // The endpoint may never take them: wait a bounded time only.
    while Instant::now() < deadline {
        match send.test(req) {
            Ok(Some(_)) | Err(_) => break,
            Ok(None) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    payload
}

/// Issue 29, defect 1: a target answered `Refused` to a 256 KiB read, then
/// sent 256 KiB on the data stream anyway; the read had ended and its
/// buffer was reused, yet every byte landed in it. A refused read must own
/// no posted receive: its buffer stays as the application left it.
#[test]
fn d12_a_refused_read_owns_no_receive_into_its_buffer() {
    let _g = serial();
    let w = world(cfg(), cfg());
    legit_transfer(&w, 21);
    let base = settled(Duration::from_millis(100));
    refused_read_then_stray_bytes(&w.a, None);
    legit_transfer(&w, 22);
    back_to(base);
}

/// [`d12_a_refused_read_owns_no_receive_into_its_buffer`] over the ncclNet
/// plugin path (the stand-in plugin; skipped, saying so, where it is not
/// built).
#[test]
fn d12_over_the_plugin_net() {
    let _g = serial();
    let Some(path) = emu_path() else {
        eprintln!("SKIPPED: libnccl_net_emu.so not found; run `cargo build --workspace` first");
        return;
    };
    let path = path.to_string_lossy().into_owned();
    // The stand-in's flow-steering wait shortened, as the plugin tests do
    // (TCPX's default is 5 s per accept).
    std::env::set_var("NCCL_DYNAMIC_CHUNK_SIZE", "524288");
    std::env::set_var(
        "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS",
        "1000",
    );
    let a = Endpoint::new(
        None,
        Config {
            net: tcpx_p2p::NetKind::Plugin,
            plugin_path: path.clone(),
            channels: 1,
            ..cfg()
        },
    )
    .unwrap();
    refused_read_then_stray_bytes(&a, Some(path));
}

/// `a` reads 256 KiB from a hostile target (over the plugin at `plugin`, or
/// the socket net), which refuses the read and then sends the bytes.
fn refused_read_then_stray_bytes(a: &Endpoint, plugin: Option<String>) {
    let n = 256 << 10;
    let (sent, heard_sent) = std::sync::mpsc::channel::<()>();
    let (go, wait_go) = std::sync::mpsc::channel::<()>();
    let (ca, target) = hostile_target_on(a, plugin, move |mut h| {
        let Some(Control::ReadReq { xfer, .. }) = recv_ctl(&mut h.oob) else {
            panic!("no read request")
        };
        send_ctl(
            &mut h.oob,
            &Control::Refused {
                xfer,
                reason: "refused, but the bytes come anyway".into(),
            },
        )
        .unwrap();
        // Told that the read ended, the application reuses the buffer.
        wait_go.recv().unwrap();
        let payload = send_stray(&mut h, n, 0xA5);
        sent.send(()).unwrap();
        wait_go.recv().unwrap();
        drop(h);
        drop(payload);
    });
    let mut dst = vec![0x11u8; n];
    let db = buf(a, &mut dst);
    let r = a.read_async(ca, &[db], &[made_up(n as u32)]).unwrap();
    // It ends (refused), and cancel says no byte of it touches its buffer.
    assert!(a.cancel(r, Some(Duration::from_secs(10))).unwrap());
    dst.fill(0x22);
    let sum = checksum(&dst);
    go.send(()).unwrap();
    heard_sent.recv_timeout(Duration::from_secs(30)).unwrap();
    // Give the stray bytes time to land, were a receive posted for them.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        checksum(&dst),
        sum,
        "bytes of the refused read landed in the reused buffer"
    );
    // Nothing is posted into it: deregistration succeeds at once.
    let t = Instant::now();
    a.dereg(db.mr).unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "dereg waited on a receive"
    );
    go.send(()).unwrap();
    target.join().unwrap();
}

/// Issue 29, defect 1, the other way a read ends early: its receive is
/// posted (the target accepted it), then the connection fails (here the
/// target breaks the protocol). The read may end only once the net has let
/// go of its buffer: at once, `dereg` finds nothing posted into it, and
/// bytes the target sends after that land nowhere.
#[test]
fn d14_a_read_ends_only_once_the_net_lets_go_of_its_buffer() {
    let _g = serial();
    let acfg = Config {
        dereg_wait: Duration::ZERO,
        ..cfg()
    };
    let w = world(acfg, cfg());
    let base = settled(Duration::from_millis(100));
    let n = 256 << 10;
    let (go, wait_go) = std::sync::mpsc::channel::<()>();
    let (ca, target) = hostile_target(&w.a, move |mut h| {
        let Some(Control::ReadReq { xfer, .. }) = recv_ctl(&mut h.oob) else {
            panic!("no read request")
        };
        send_ctl(&mut h.oob, &Control::ReadAck { xfer }).unwrap();
        // The reader posts its receive; then a second acknowledgement.
        std::thread::sleep(Duration::from_millis(200));
        send_ctl(&mut h.oob, &Control::ReadAck { xfer }).unwrap();
        wait_go.recv().unwrap();
        let payload = send_stray(&mut h, n, 0xA5);
        wait_go.recv().unwrap();
        drop(h);
        drop(payload);
    });
    let mut dst = vec![0x11u8; n];
    let db = buf(&w.a, &mut dst);
    let r = w.a.read_async(ca, &[db], &[made_up(n as u32)]).unwrap();
    let e = w.a.wait(r, Some(Duration::from_secs(20))).unwrap_err();
    assert!(e.to_string().contains("ReadAck"), "{e}");
    // The moment the read has failed, nothing holds its buffer.
    w.a.dereg(db.mr).unwrap();
    dst.fill(0x22);
    let sum = checksum(&dst);
    go.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        checksum(&dst),
        sum,
        "bytes landed in the failed read's buffer"
    );
    go.send(()).unwrap();
    target.join().unwrap();
    legit_transfer(&w, 24);
    back_to(base);
}

/// Issue 29, defect 4: one read request with a made-up token claiming 2^20
/// chunks made the target build 2^20 empty messages to keep the reader in
/// step (+49 MiB held per connection, 20 connections: 1 GB). A refusal now
/// holds nothing, whatever the claim, and the connection goes on serving.
#[test]
fn d13_refusing_a_read_holds_nothing_whatever_it_claims() {
    let _g = serial();
    let w = world(cfg(), cfg());
    let base = settled(Duration::from_millis(100));
    let mut mem = vec![0u8; 64 << 10];
    {
        let mut h = Hostile::connect(w.b.local_addr(), b"");
        let cb = w.b.accept(Some(Duration::from_secs(10))).unwrap().conn;
        let (_, token, ptr) = advertised(&w.b, cb, &mut mem);
        let idle = w.b.held_for_peer(cb).unwrap();
        let bogus = Token {
            id: 424242,
            secret: 7,
        };
        let claims = [(1u64 << 20) * CHUNK, 8 << 40, 1 << 62, u64::MAX];
        for (xfer, len) in claims.into_iter().enumerate() {
            let xfer = xfer as u64;
            let m = Control::ReadReq {
                xfer,
                items: vec![RmaItem {
                    token: bogus,
                    addr: ptr,
                    len,
                }],
                runs: vec![1],
            };
            send_ctl(&mut h.oob, &m).unwrap();
            match recv_ctl(&mut h.oob) {
                Some(Control::Refused { xfer: x, .. }) => assert_eq!(x, xfer),
                m => panic!("{m:?}"),
            }
            assert_eq!(
                w.b.held_for_peer(cb).unwrap(),
                idle,
                "a refused read of {len} bytes held something"
            );
        }
        // The same connection still serves a read of what was advertised.
        let n = mem.len();
        let mut got = vec![0u8; n];
        let dst = MemRef {
            addr: got.as_mut_ptr() as u64,
            len: n,
            kind: MemKind::Host,
        };
        let recv = &mut h.recvs[h.channels];
        let mrh = recv.reg_mr(dst).unwrap();
        let req = loop {
            if let Some(r) = recv.irecv(dst, mrh).unwrap() {
                break r;
            }
        };
        let m = Control::ReadReq {
            xfer: 9,
            items: vec![RmaItem {
                token,
                addr: ptr,
                len: n as u64,
            }],
            runs: vec![1],
        };
        send_ctl(&mut h.oob, &m).unwrap();
        assert!(matches!(
            recv_ctl(&mut h.oob),
            Some(Control::ReadAck { xfer: 9 })
        ));
        let deadline = Instant::now() + Duration::from_secs(30);
        while recv.test(req).unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "the accepted read's data did not come"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(got.iter().all(|&b| b == 0xEE), "the read's bytes");
    }
    legit_transfer(&w, 23);
    back_to(base);
}

fn proc_status(key: &str) -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Issue 29, defect 4, the figures: RSS (held and peak) of a target while
/// `n` hostile connections each send one read request with a made-up token
/// claiming as many net requests as the per-connection budget allows
/// (2^20 chunks), and stay connected. Run by hand:
/// `cargo test --release --test hostile -- --ignored --nocapture figures_refused_read`.
#[test]
#[ignore]
fn figures_refused_read_claims() {
    let _g = serial();
    for n in [1usize, 20] {
        let b = Endpoint::new(
            None,
            Config {
                ifname: Some("lo".into()),
                streams: 2,
                ..Config::default()
            },
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let (fds0, thr0) = counts();
        let rss0 = proc_status("VmRSS:");
        let mut held = Vec::new();
        for _ in 0..n {
            let mut h = Hostile::connect(b.local_addr(), b"");
            b.accept(Some(Duration::from_secs(10))).unwrap();
            // The agreed chunk is the smaller proposal: ours, 256 KiB.
            let claim = (1u64 << 20) * CHUNK;
            send_ctl(
                &mut h.oob,
                &Control::ReadReq {
                    xfer: 1,
                    items: vec![RmaItem {
                        token: Token {
                            id: 9999,
                            secret: 1,
                        },
                        addr: 0x10000,
                        len: claim,
                    }],
                    runs: vec![1],
                },
            )
            .unwrap();
            match recv_ctl(&mut h.oob) {
                Some(Control::Refused { xfer: 1, .. }) => {}
                m => panic!("{m:?}"),
            }
            held.push(h);
        }
        std::thread::sleep(Duration::from_secs(2));
        let (fds1, thr1) = counts();
        let (rss1, hwm) = (proc_status("VmRSS:"), proc_status("VmHWM:"));
        println!(
            "refused-read claims, {n} connection(s): RSS {} -> {} MiB held (+{} MiB), peak {} MiB (+{} MiB); threads {thr0} -> {thr1}, descriptors {fds0} -> {fds1}",
            rss0 >> 10,
            rss1 >> 10,
            rss1.saturating_sub(rss0) >> 10,
            hwm >> 10,
            hwm.saturating_sub(rss0) >> 10
        );
        drop(held);
        drop(b);
    }
}
