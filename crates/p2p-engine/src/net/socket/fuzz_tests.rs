//! A hostile sender on the socket net's data streams, at random. A test
//! peer opens a receive comm's streams itself and writes messages as parts
//! (header and payload), most as the sender's rule cuts them and some
//! broken on purpose: a header field changed, a payload cut short, bytes
//! that are no header at all. The receiver posts its receives before,
//! between and after the parts arrive, as the posting thread with CPUs idle
//! and with none (which lands held parts itself), one segment or several.
//!
//! Whatever the peer writes: every receive ends (the peer's streams close
//! at the end of each case) and none is reported ended while bytes still
//! land in it; nothing is written outside a posted receive's memory, nor
//! into it once its receive has ended, nor past the size a completed
//! receive reports; and a case with nothing broken completes every
//! receive with exactly the bytes sent.
//!
//! Beside it, an honest sender (our own) at random: messages of random
//! sizes on 1-8 streams, small socket buffers at times, receives posted
//! before, between and after, CPUs idle or none on each side: every
//! message arrives whole and in time.
//!
//! `TCPX_P2P_FUZZ_SECS` runs it for that many seconds instead of
//! `TCPX_P2P_FUZZ_ITERS` cases (default 24; honest 12); `TCPX_P2P_FUZZ_SEED` seeds it;
//! `TCPX_P2P_FUZZ_CASE` plays one case of that seed over and over.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::segs::Segs;
use super::split_parts;
use super::tests::{accept, host, raw_peer, raw_stream, until};
use super::wire::PartHeader;
use crate::gpu;
use crate::memory::MemKind;
use crate::net::{MemRef, MrHandle, RecvComm, ReqId, SendComm};

#[path = "../../../tests/common/budget.rs"]
mod budget;

/// Bytes on each side of a receive's memory that must stay as they are.
const GUARD: usize = 256;
const GUARD_BYTE: u8 = 0xa5;
/// How long every receive has to end once the peer's streams are closed.
const END_WITHIN: Duration = Duration::from_secs(10);
/// How long the peer's write may wait for a receiver that reads nothing.
const WRITE_WITHIN: Duration = Duration::from_secs(2);

/// How a message's parts are broken.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Break {
    None,
    /// One header field of one part changed.
    Field(u8),
    /// One part's payload cut short, then its stream closed.
    Short,
    /// Bytes that are no header written on a stream, then it closed.
    Garbage,
}

/// A receive's memory: guards around `cap` bytes, zeroed; in host memory
/// or on GPU 0.
enum Mem {
    Host(Vec<u8>),
    Gpu(gpu::DeviceBuf),
}

impl Mem {
    fn new(cap: usize, on_gpu: bool) -> Self {
        let mut v = vec![GUARD_BYTE; cap + 2 * GUARD];
        v[GUARD..GUARD + cap].fill(0);
        if !on_gpu {
            return Mem::Host(v);
        }
        let dev = gpu::Device::get(0).unwrap();
        let b = gpu::DeviceBuf::new(&dev, v.len()).unwrap();
        // SAFETY: both ranges are v.len() bytes, ours.
        #[allow(unsafe_code)]
        unsafe { gpu::copy_sync(b.ptr, v.as_ptr() as u64, v.len()) }.unwrap();
        Mem::Gpu(b)
    }

    /// The first byte of the receive (past the front guard), and its kind.
    fn at(&mut self) -> (u64, MemKind) {
        match self {
            Mem::Host(v) => (v.as_mut_ptr() as u64 + GUARD as u64, MemKind::Host),
            Mem::Gpu(b) => (b.ptr + GUARD as u64, MemKind::Cuda(0)),
        }
    }

    /// Every byte, guards included, as it is now.
    fn bytes(&self) -> Vec<u8> {
        match self {
            Mem::Host(v) => v.clone(),
            Mem::Gpu(b) => {
                let mut v = vec![0u8; b.len];
                // SAFETY: both ranges are b.len bytes, ours.
                #[allow(unsafe_code)]
                unsafe { gpu::copy_sync(v.as_mut_ptr() as u64, b.ptr, b.len) }.unwrap();
                v
            }
        }
    }
}

/// One message as the peer writes it, and the receive posted for it.
struct Msg {
    mem: Mem,
    /// The receive's segments' lengths (one, or several gathered).
    blocks: Vec<usize>,
    cap: usize,
    /// The bytes the peer sends (a message may be larger or smaller than
    /// its receive).
    src: Vec<u8>,
    brk: Break,
    /// Whether a receive is posted for it at all.
    posted: bool,
}

impl Msg {
    fn segs(&mut self) -> Vec<MemRef> {
        let (base, kind) = self.mem.at();
        let mut off = 0u64;
        self.blocks
            .iter()
            .map(|&len| {
                let m = MemRef {
                    addr: base + off,
                    len,
                    kind,
                };
                off += len as u64;
                m
            })
            .collect()
    }
}

/// A size for a message or receive: one part, a few, or past the posting
/// thread's budget of 1 MiB.
fn size(rng: &mut StdRng) -> usize {
    match rng.random_range(0..4) {
        0 => rng.random_range(1..=4096),
        1 => rng.random_range(4097..=64 << 10),
        2 => rng.random_range((64 << 10) + 1..=512 << 10),
        _ => rng.random_range((512 << 10) + 1..=(3 << 20) / 2),
    }
}

fn plan(rng: &mut StdRng, n: usize, broken: bool, on_gpu: bool) -> Vec<Msg> {
    (0..n)
        .map(|seq| {
            let cap = size(rng);
            let blocks = if cap >= 4 * 1024 && rng.random_ratio(1, 5) {
                // Gathered: equal blocks (the last takes the rest).
                let k = rng.random_range(2..=4);
                let b = cap / k;
                let mut v = vec![b; k - 1];
                v.push(cap - b * (k - 1));
                v
            } else {
                vec![cap]
            };
            let len = match rng.random_range(0..6) {
                0 if blocks.len() == 1 => rng.random_range(1..=cap),
                1 if broken => cap + rng.random_range(1..=8192),
                _ => cap,
            };
            let src = (0..len)
                .map(|i| (i as u64 * 131 + seq as u64 * 17 + 5) as u8)
                .collect();
            let brk = if broken && rng.random_ratio(1, 3) {
                match rng.random_range(0..6) {
                    0 => Break::Short,
                    1 => Break::Garbage,
                    _ => Break::Field(rng.random_range(0..8)),
                }
            } else {
                Break::None
            };
            Msg {
                mem: Mem::new(cap, on_gpu),
                blocks,
                cap,
                src,
                brk,
                posted: !broken || rng.random_ratio(9, 10),
            }
        })
        .collect()
}

/// A part's header changed in field `which`.
fn broken_field(h: PartHeader, which: u8, rng: &mut StdRng) -> PartHeader {
    let any = |rng: &mut StdRng| match rng.random_range(0..3) {
        0 => rng.random::<u64>(),
        1 => u64::MAX - rng.random_range(0..4),
        _ => rng.random_range(0..1 << 21),
    };
    let mut h = h;
    match which {
        0 => h.seq = h.seq.wrapping_add(rng.random_range(1..=3)),
        1 => h.off = any(rng),
        2 => h.len = any(rng),
        3 => h.total = any(rng),
        4 => h.nparts = any(rng),
        5 => h.shape = rng.random(),
        6 => h.spliced = true,
        _ => h.len = h.len.wrapping_add(1),
    }
    h
}

/// What the peer writes: `(stream, bytes)` in order, then every stream is
/// closed (a stream broken on purpose is closed once broken).
fn writes(rng: &mut StdRng, msgs: &[Msg], streams: usize) -> Vec<(usize, Vec<u8>, bool)> {
    let mut out = Vec::new();
    for (seq, m) in msgs.iter().enumerate() {
        let total = m.src.len();
        let shape = Segs::new(&m.blocks.iter().map(|&l| host(0, l)).collect::<Vec<_>>())
            .unwrap()
            .shape;
        let parts = split_parts(total, streams, 4096);
        let victim = rng.random_range(0..parts.len());
        for (k, &(off, len)) in parts.iter().enumerate() {
            let mut h = PartHeader {
                seq: seq as u64,
                off: off as u64,
                len: len as u64,
                total: total as u64,
                nparts: parts.len() as u64,
                // A message larger than its gathered receive keeps the
                // receive's shape: its size is what is wrong.
                shape,
                spliced: false,
            };
            let s = rng.random_range(0..streams);
            let mut bytes = Vec::new();
            let mut close = false;
            match m.brk {
                Break::Field(f) if k == victim => h = broken_field(h, f, rng),
                Break::Short if k == victim => close = true,
                Break::Garbage if k == victim => {
                    let n = rng.random_range(1..200);
                    bytes.extend((0..n).map(|_| rng.random::<u8>()));
                    out.push((s, bytes, true));
                    continue;
                }
                _ => {}
            }
            bytes.extend_from_slice(&h.encode());
            let payload = &m.src[off..off + len];
            if close {
                bytes.extend_from_slice(&payload[..rng.random_range(0..len.max(1))]);
            } else {
                bytes.extend_from_slice(payload);
            }
            out.push((s, bytes, close));
        }
    }
    out
}

/// Counts over a run, to show what it did.
#[derive(Default, Debug)]
struct Seen {
    cases: u64,
    broken_cases: u64,
    completed: u64,
    failed: u64,
    unposted: u64,
    with_no_cpu_idle: u64,
}

fn one_case(rng: &mut StdRng, seen: &mut Seen, what: &str, on_gpu: bool) {
    let streams = rng.random_range(1..=4);
    let broken = rng.random_ratio(2, 3);
    let n = rng.random_range(1..=6);
    let mut msgs = plan(rng, n, broken, on_gpu);
    let broken = msgs
        .iter()
        .any(|m| m.brk != Break::None || m.src.len() > m.cap);
    if !broken {
        // An honest peer's receiver posts every receive.
        msgs.iter_mut().for_each(|m| m.posted = true);
    }
    let plan_w = writes(rng, &msgs, streams);
    let what = format!(
        "{what} ({streams} streams; messages {:?})",
        msgs.iter()
            .map(|m| format!(
                "{:?} {} into {:?}{}",
                m.brk,
                m.src.len(),
                m.blocks,
                if m.posted { "" } else { " unposted" }
            ))
            .collect::<Vec<_>>()
    );
    let (mut l, h) = raw_peer(streams);
    let mut socks = vec![raw_stream(h.addr, h.nonce, 0)];
    let mut r = accept(&mut l);
    for i in 1..streams {
        socks.push(raw_stream(h.addr, h.nonce, i as u64));
    }
    until(
        || r.stream_count() == streams,
        "the peer's streams are admitted",
    );
    for s in &socks {
        s.set_write_timeout(Some(WRITE_WITHIN)).unwrap();
    }
    // The peer writes from its own thread (a receiver that reads nothing
    // must not stop the test), before, while or after receives are posted.
    // A broken peer then closes every stream; an honest one once its
    // receives have completed (`close`).
    let lead = rng.random_range(0..3);
    let (close, closing) = std::sync::mpsc::channel::<()>();
    let writer = std::thread::spawn(move || {
        let mut socks: Vec<Option<TcpStream>> = socks.into_iter().map(Some).collect();
        for (s, bytes, close) in plan_w {
            let Some(sock) = socks[s].as_mut() else {
                continue;
            };
            if sock.write_all(&bytes).is_err() || close {
                socks[s] = None;
            }
        }
        if !broken {
            let _ = closing.recv();
        }
        // Every stream closes: nothing the receiver waits for can come.
    });
    let mut peer = Some((close, writer));
    let end_peer =
        |peer: &mut Option<(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>)>| {
            if let Some((close, writer)) = peer.take() {
                drop(close);
                writer.join().unwrap();
            }
        };
    if lead > 0 {
        std::thread::sleep(Duration::from_millis(if lead == 1 { 2 } else { 30 }));
    }
    let mut reqs: Vec<(usize, ReqId)> = Vec::new();
    for (seq, m) in msgs.iter_mut().enumerate() {
        if !m.posted {
            // Not posted, nor any after it (the next receive posted would
            // be this message's).
            seen.unposted += 1;
            break;
        }
        let full = rng.random_bool(0.5);
        seen.with_no_cpu_idle += u64::from(full);
        crate::spin::answer_full_here(Some(full));
        let segs = m.segs();
        let got = if segs.len() == 1 {
            r.irecv(segs[0], MrHandle(0))
        } else {
            r.irecvv(&segs, &vec![MrHandle(0); segs.len()])
        };
        crate::spin::answer_full_here(None);
        match got {
            Ok(Some(q)) => reqs.push((seq, q)),
            Ok(None) => panic!("{what}: the socket net always takes a receive"),
            // The comm failed already (a broken part came first).
            Err(_) => assert!(broken, "{what}: message {seq} refused at posting"),
        }
        if rng.random_ratio(1, 3) {
            std::thread::sleep(Duration::from_micros(rng.random_range(0..2000)));
        }
    }
    if broken {
        end_peer(&mut peer);
    }
    // Every receive ends; each one's memory as it was when it ended.
    let deadline = Instant::now() + END_WITHIN;
    let mut ended: Vec<(usize, Result<usize, String>, Vec<u8>)> = Vec::new();
    while !reqs.is_empty() {
        let mut i = 0;
        while i < reqs.len() {
            let (seq, q) = reqs[i];
            let end = match r.test(q) {
                Ok(None) => None,
                Ok(Some(size)) => Some(Ok(size)),
                Err(e) => Some(Err(e.to_string())),
            };
            match end {
                Some(end) => {
                    ended.push((seq, end, msgs[seq].mem.bytes()));
                    reqs.swap_remove(i);
                }
                None => i += 1,
            }
        }
        assert!(
            Instant::now() < deadline,
            "{what}: receives {:?} did not end (broken: {broken}); {}",
            reqs.iter().map(|r| r.0).collect::<Vec<_>>(),
            r.describe()
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    end_peer(&mut peer);
    drop(r);
    drop(l);
    // Whatever was in flight has had time to land, were it to.
    std::thread::sleep(Duration::from_millis(20));
    for (seq, end, snap) in &ended {
        let m = &msgs[*seq];
        let now = m.mem.bytes();
        let region = &now[GUARD..GUARD + m.cap];
        let w = format!(
            "{what}: message {seq} ({:?}, {} bytes into {:?})",
            m.brk,
            m.src.len(),
            m.blocks
        );
        assert!(
            now[..GUARD].iter().all(|&b| b == GUARD_BYTE)
                && now[GUARD + m.cap..].iter().all(|&b| b == GUARD_BYTE),
            "{w}: bytes written outside the receive's memory"
        );
        assert!(
            now == *snap,
            "{w}: bytes landed after its receive ended ({end:?})"
        );
        match end {
            Ok(size) => {
                seen.completed += 1;
                assert!(*size <= m.cap, "{w}: completed with {size} bytes");
                assert!(
                    region[*size..].iter().all(|&b| b == 0),
                    "{w}: bytes past the {size} its receive reports"
                );
                if !broken {
                    assert_eq!(*size, m.src.len(), "{w}: size");
                    assert!(region[..*size] == m.src[..], "{w}: bytes differ");
                }
            }
            Err(e) => {
                seen.failed += 1;
                assert!(broken, "{w}: failed with nothing broken: {e}");
            }
        }
    }
    if !broken {
        assert_eq!(
            ended.len(),
            n,
            "{what}: every receive of an honest peer ends"
        );
    }
    seen.cases += 1;
    seen.broken_cases += u64::from(broken);
}

/// Runs cases of `one` for the budget the environment gives (else `iters`
/// cases seeded with `seed`), each drawn from its own generator (the seed
/// and its number), so one can be played again alone:
/// TCPX_P2P_FUZZ_CASE=N plays case N for the whole budget. Returns what
/// was seen and whether one case was played.
fn run_cases(
    iters: u64,
    seed: u64,
    name: &str,
    mut one: impl FnMut(&mut StdRng, &mut Seen, &str),
) -> (Seen, bool) {
    let mut b = budget::Budget::from_env(iters, seed);
    let only: Option<u64> = std::env::var("TCPX_P2P_FUZZ_CASE")
        .ok()
        .and_then(|v| v.parse().ok());
    let mut seen = Seen::default();
    while b.next() {
        let case = only.unwrap_or(b.done);
        let mut rng = StdRng::seed_from_u64(b.seed ^ case.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        one(
            &mut rng,
            &mut seen,
            &format!("{name}seed {} case {case}", b.seed),
        );
    }
    eprintln!("{seen:?} in {:.1} s", b.secs());
    (seen, only.is_some())
}

fn run(on_gpu: bool) {
    let (seen, one) = run_cases(24, 0x5eed_9a27, "", |rng, seen, what| {
        one_case(rng, seen, what, on_gpu)
    });
    assert!(one || (seen.completed > 0 && seen.failed > 0), "{seen:?}");
}

#[test]
fn a_hostile_senders_parts_land_only_inside_open_receives() {
    run(false);
}

#[test]
fn a_hostile_senders_parts_land_only_inside_open_gpu_receives() {
    // The same into GPU memory: parts staged and copied to the device
    // (skipped without a GPU).
    if !gpu::available() {
        eprintln!("no GPU: skipped");
        return;
    }
    run(true);
}

/// One honest case: our own sender's messages of random sizes on 1-8
/// streams (small socket buffers at times, so parts spill and wait for
/// room), sent from their own thread; receives posted before, between and
/// after, some larger than their message; CPUs idle or none, on each side
/// apart. Every message arrives whole, in time, its bytes exact.
fn one_honest_case(rng: &mut StdRng, seen: &mut Seen, what: &str) {
    let streams = rng.random_range(1..=8);
    let c = super::SocketConfig {
        sockbuf: if rng.random_bool(0.3) { 64 << 10 } else { 0 },
        ..super::test_config(streams)
    };
    let (mut s, mut r, _l) = super::tests::own_pair_of(c);
    let n = rng.random_range(1..=12);
    let lens: Vec<usize> = (0..n).map(|_| size(rng)).collect();
    let srcs: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(k, &len)| {
            (0..len)
                .map(|i| (i as u64 * 7 + k as u64 * 29 + 3) as u8)
                .collect()
        })
        .collect();
    let plan: Vec<(bool, u64)> = (0..n)
        .map(|_| (rng.random_bool(0.5), rng.random_range(0..300)))
        .collect();
    let what = format!("{what} ({streams} streams; messages {lens:?})");
    let sender = {
        let srcs = srcs.clone();
        let what = what.clone();
        std::thread::spawn(move || {
            let mut reqs = Vec::new();
            for (src, (full, pause)) in srcs.iter().zip(plan) {
                crate::spin::answer_full_here(Some(full));
                let q = s.isend(host(src.as_ptr() as u64, src.len()), MrHandle(0));
                crate::spin::answer_full_here(None);
                reqs.push((q.unwrap().expect("the socket net takes a send"), src.len()));
                std::thread::sleep(Duration::from_micros(pause));
            }
            let deadline = Instant::now() + END_WITHIN;
            for (q, len) in reqs {
                loop {
                    match s.test(q) {
                        Ok(Some(got)) => {
                            assert_eq!(got, len, "{what}: a send's size");
                            break;
                        }
                        Ok(None) => {
                            assert!(Instant::now() < deadline, "{what}: a send did not end")
                        }
                        Err(e) => panic!("{what}: a send failed: {e}"),
                    }
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
            s
        })
    };
    let mut dsts: Vec<Vec<u8>> = lens
        .iter()
        .map(|&len| vec![0u8; len + rng.random_range(0..2) * rng.random_range(1..=4096)])
        .collect();
    let mut reqs = Vec::new();
    for (k, d) in dsts.iter_mut().enumerate() {
        let full = rng.random_bool(0.5);
        seen.with_no_cpu_idle += u64::from(full);
        crate::spin::answer_full_here(Some(full));
        let q = r.irecv(host(d.as_mut_ptr() as u64, d.len()), MrHandle(0));
        crate::spin::answer_full_here(None);
        reqs.push((k, q.unwrap().expect("the socket net takes a receive")));
        if rng.random_ratio(1, 3) {
            std::thread::sleep(Duration::from_micros(rng.random_range(0..2000)));
        }
    }
    let deadline = Instant::now() + END_WITHIN;
    for (k, q) in reqs {
        loop {
            match r.test(q) {
                Ok(Some(got)) => {
                    assert_eq!(got, lens[k], "{what}: message {k}'s size");
                    break;
                }
                Ok(None) => assert!(
                    Instant::now() < deadline,
                    "{what}: receive {k} did not end; {}",
                    r.describe()
                ),
                Err(e) => panic!("{what}: receive {k} failed: {e}"),
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        seen.completed += 1;
        assert!(
            dsts[k][..lens[k]] == srcs[k][..],
            "{what}: message {k}'s bytes"
        );
        assert!(
            dsts[k][lens[k]..].iter().all(|&b| b == 0),
            "{what}: past message {k}"
        );
    }
    drop(sender.join().expect("the sender"));
    seen.cases += 1;
}

#[test]
fn an_honest_senders_messages_all_arrive_whoever_lands_them() {
    run_cases(12, 0x0a11_0e57, "honest: ", one_honest_case);
}
