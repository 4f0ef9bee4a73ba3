//! The socket net's own tests: its pieces, and comm pairs over loopback.

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::segs::Segs;
use super::wire::{Handle, Hello, PartHeader};
use super::{
    split_parts, test_config as cfg, test_pair as pair_of, test_pair_here, SocketConfig, SocketNet,
};
use crate::error::NetError;
use crate::memory::MemKind;
use crate::net::{MemRef, MrHandle, RecvComm, ReqId, SendComm, Waker};
#[cfg(test)]
#[test]
fn split_covers_every_byte_once() {
    for &(len, s, m) in &[
        (0, 4, 4096),
        (1, 4, 4096),
        (4096, 4, 4096),
        (10_000_000, 8, 131072),
        (12345, 3, 1024),
        (1 << 30, 64, 1),
    ] {
        let p = split_parts(len, s, m);
        assert!(!p.is_empty() && p.len() <= s);
        let mut off = 0;
        for &(o, l) in &p {
            assert_eq!(o, off);
            off += l;
        }
        assert_eq!(off, len);
    }
    assert_eq!(split_parts(100, 8, 4096).len(), 1);
    assert_eq!(split_parts(1 << 20, 4, 4096).len(), 4);
}

#[test]
fn parts_grow_with_the_square_root_of_the_size() {
    const K: usize = 1 << 10;
    const M: usize = 1 << 20;
    let n = |len, min_part| split_parts(len, 8, min_part).len();
    // 16 cores (256 KiB parts at 1 MiB): 2 parts at 256 KiB, 4 at 1 MiB.
    let got: Vec<usize> = [64 * K, 128 * K, 256 * K, 512 * K, M, 2 * M, 4 * M, 16 * M]
        .iter()
        .map(|&l| n(l, 256 * K))
        .collect();
    assert_eq!(got, [1, 1, 2, 3, 4, 6, 8, 8]);
    // 32+ cores (128 KiB): as a plain 128 KiB cut up to 1 MiB.
    let got: Vec<usize> = [64 * K, 128 * K, 256 * K, 512 * K, M, 4 * M]
        .iter()
        .map(|&l| n(l, 128 * K))
        .collect();
    assert_eq!(got, [1, 1, 2, 4, 8, 8]);
    // 2 cores (512 KiB): 2 parts at 1 MiB, 4 at 4 MiB, every stream at 16.
    let got: Vec<usize> = [256 * K, M, 4 * M, 16 * M]
        .iter()
        .map(|&l| n(l, 512 * K))
        .collect();
    assert_eq!(got, [1, 2, 4, 8]);
    // Below the floor, `min_part` alone sets the cut (tests cut small
    // messages this way).
    assert_eq!(n(64 * K, K), 8);
    assert_eq!(split_parts(usize::MAX >> 8, 64, 1).len(), 64);
}

fn pair(streams: usize) -> (Box<dyn SendComm>, Box<dyn RecvComm>) {
    pair_of(cfg(streams), cfg(streams))
}

fn wait<F: FnMut() -> Result<Option<usize>, NetError>>(mut f: F) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(n) = f().unwrap() {
            return n;
        }
        assert!(Instant::now() < deadline, "request did not complete");
        std::thread::yield_now();
    }
}

pub(super) fn host(addr: u64, len: usize) -> MemRef {
    MemRef {
        addr,
        len,
        kind: MemKind::Host,
    }
}

/// Posts the send of all of `src` (host memory).
fn send_all(s: &mut dyn SendComm, src: &[u8]) -> ReqId {
    s.isend(host(src.as_ptr() as u64, src.len()), MrHandle(0))
        .unwrap()
        .unwrap()
}

/// Posts a receive into all of `dst` (host memory).
fn recv_into(r: &mut dyn RecvComm, dst: &mut [u8]) -> ReqId {
    r.irecv(host(dst.as_mut_ptr() as u64, dst.len()), MrHandle(0))
        .unwrap()
        .unwrap()
}

#[test]
fn gathered_messages_scatter_block_for_block() {
    let (mut s, mut r) = pair(4);
    // 300 blocks of varied sizes, sent from one buffer in order and
    // received into another in reverse order, as one message (its
    // parts cut across blocks), then an ordinary message behind it.
    let sizes: Vec<usize> = (0..300).map(|i| 1 + (i * 4099) % 20_000).collect();
    let total: usize = sizes.iter().sum();
    let src: Vec<u8> = (0..total).map(|i| (i * 31 + 7) as u8).collect();
    let mut dst = vec![0u8; total];
    let (mut so, mut ro) = (Vec::new(), vec![0; sizes.len()]);
    let mut at = 0;
    for &n in &sizes {
        so.push(at);
        at += n;
    }
    let mut at = 0;
    for i in (0..sizes.len()).rev() {
        ro[i] = at;
        at += sizes[i];
    }
    let ssegs: Vec<MemRef> = (0..sizes.len())
        .map(|i| host(src.as_ptr() as u64 + so[i] as u64, sizes[i]))
        .collect();
    let rsegs: Vec<MemRef> = (0..sizes.len())
        .map(|i| host(dst.as_mut_ptr() as u64 + ro[i] as u64, sizes[i]))
        .collect();
    let mrs = vec![MrHandle(0); sizes.len()];
    let tail_src = vec![9u8; 5000];
    let mut tail_dst = vec![0u8; 6000];
    let rq = r.irecvv(&rsegs, &mrs).unwrap().unwrap();
    let rt = r
        .irecv(host(tail_dst.as_mut_ptr() as u64, 6000), MrHandle(0))
        .unwrap()
        .unwrap();
    let sq = s.isendv(&ssegs, &mrs).unwrap().unwrap();
    let st = s
        .isend(host(tail_src.as_ptr() as u64, 5000), MrHandle(0))
        .unwrap()
        .unwrap();
    assert_eq!(wait(|| s.test(sq)), total);
    assert_eq!(wait(|| s.test(st)), 5000);
    assert_eq!(wait(|| r.test(rq)), total);
    assert_eq!(wait(|| r.test(rt)), 5000);
    for i in 0..sizes.len() {
        assert_eq!(
            &dst[ro[i]..ro[i] + sizes[i]],
            &src[so[i]..so[i] + sizes[i]],
            "block {i}"
        );
    }
    assert_eq!(&tail_dst[..5000], &tail_src[..]);
}

#[test]
fn gathered_message_into_other_block_sizes_fails_the_receive() {
    let (mut s, mut r) = pair(2);
    let src = vec![1u8; 8192];
    let mut dst = vec![0u8; 8192];
    let base = dst.as_mut_ptr() as u64;
    let mrs = [MrHandle(0); 2];
    let rq = r
        .irecvv(&[host(base, 2048), host(base + 2048, 6144)], &mrs)
        .unwrap()
        .unwrap();
    let a = src.as_ptr() as u64;
    s.isendv(&[host(a, 4096), host(a + 4096, 4096)], &mrs)
        .unwrap()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let err = loop {
        match r.test(rq) {
            Err(e) => break e.to_string(),
            Ok(Some(n)) => panic!("received {n} bytes into the wrong blocks"),
            Ok(None) => {}
        }
        assert!(Instant::now() < deadline, "the receive did not fail");
        std::thread::yield_now();
    };
    assert!(err.contains("block sizes must match"), "{err}");
    assert!(dst.iter().all(|&b| b == 0), "no byte may land");
}

#[test]
fn messages_match_in_order_and_arrive_whole() {
    let (mut s, mut r) = pair(3);
    let sizes = [0usize, 1, 4096, 100_000, 3 << 20];
    let srcs: Vec<Vec<u8>> = sizes
        .iter()
        .map(|&n| (0..n).map(|i| (i * 7 + n) as u8).collect())
        .collect();
    let mut dsts: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n + 10]).collect();
    let mut rreqs = Vec::new();
    for d in dsts.iter_mut() {
        let m = MemRef {
            addr: d.as_mut_ptr() as u64,
            len: d.len(),
            kind: MemKind::Host,
        };
        rreqs.push(r.irecv(m, MrHandle(0)).unwrap().unwrap());
    }
    let mut sreqs = Vec::new();
    for src in &srcs {
        let m = MemRef {
            addr: src.as_ptr() as u64,
            len: src.len(),
            kind: MemKind::Host,
        };
        sreqs.push(s.isend(m, MrHandle(0)).unwrap().unwrap());
    }
    for (i, q) in sreqs.into_iter().enumerate() {
        assert_eq!(wait(|| s.test(q)), sizes[i]);
    }
    for (i, q) in rreqs.into_iter().enumerate() {
        assert_eq!(wait(|| r.test(q)), sizes[i]);
        assert_eq!(&dsts[i][..sizes[i]], &srcs[i][..]);
    }
}

#[test]
fn small_messages_sent_ahead_of_their_receives_land_on_the_posting_thread() {
    // A sender that runs ahead of blocking receives: each small message's
    // header is read by its stream's task, which goes idle keeping it; the
    // receive's post lands it on the posting thread, so it is complete
    // when `irecv` returns -- no I/O worker is woken for it. A large
    // message (parts above the inline size) is still landed by its
    // streams' tasks.
    let (mut s, mut r) = test_pair_here(cfg(4), cfg(4));
    let sizes = [4096usize, 1, 0, 3000, 4096, 1 << 20, 777, 4096, 2048, 4096];
    let srcs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| (0..n).map(|i| (i * 13 + k * 7 + 1) as u8).collect())
        .collect();
    let sreqs: Vec<ReqId> = srcs.iter().map(|src| send_all(s.as_mut(), src)).collect();
    for (q, &n) in sreqs.into_iter().zip(&sizes) {
        assert_eq!(wait(|| s.test(q)), n);
    }
    for (seq, (src, &n)) in srcs.iter().zip(&sizes).enumerate() {
        let mut dst = vec![0u8; n + 8];
        let small = n <= 4096;
        if small {
            wait_until_held(&r, seq);
        }
        let q = recv_into(&mut r, &mut dst);
        let got = if small {
            r.test(q).unwrap().expect("landed by the posting thread")
        } else {
            wait(|| r.test(q))
        };
        assert_eq!(got, n, "message {seq}");
        assert!(dst[..n] == src[..], "message {seq}: bytes differ");
        assert!(
            dst[n..].iter().all(|&b| b == 0),
            "message {seq}: bytes past it"
        );
    }
}

#[test]
fn a_run_of_small_messages_sent_ahead_lands_on_the_posting_thread_one_after_another() {
    // UCCL's benchmark loop: the sender has sent every message before the
    // first blocking receive. Landing message k on the posting thread
    // also reads message k+1's header (its bytes are here), so receive
    // k+1 is complete when its `irecv` returns as well: no I/O worker is
    // woken between two receives (a wake took up to milliseconds on a VM).
    let (mut s, mut r) = test_pair_here(cfg(1), cfg(1));
    let sizes = [
        4096usize, 100, 4096, 0, 2048, 4096, 1, 4096, 4096, 512, 4096, 4096,
    ];
    let srcs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| (0..n).map(|i| (i * 31 + k * 5 + 3) as u8).collect())
        .collect();
    let sreqs: Vec<ReqId> = srcs.iter().map(|src| send_all(s.as_mut(), src)).collect();
    for (q, &n) in sreqs.into_iter().zip(&sizes) {
        assert_eq!(wait(|| s.test(q)), n);
    }
    wait_until_held(&r, 0);
    for (seq, src) in srcs.iter().enumerate() {
        recv_landed_by_the_poster(&mut r, seq, src);
    }
}

/// Waits (10 s at most) until a stream of `r` holds message `seq`'s part:
/// its header read before the receive is posted, every byte arrived.
fn wait_until_held(r: &super::recv::SocketRecv, seq: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !r.holds(seq as u64) {
        assert!(
            Instant::now() < deadline,
            "message {seq}'s part never held whole"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Socket buffers that hold a whole part of 1 MiB, on `streams` streams.
fn big_buffers(streams: usize) -> SocketConfig {
    SocketConfig {
        sockbuf: 4 << 20,
        ..cfg(streams)
    }
}

/// Posts a receive for message `seq` (`src`'s bytes) and checks that it is
/// complete when the post returns (landed on the posting thread), with
/// exactly its bytes.
fn recv_landed_by_the_poster(r: &mut super::recv::SocketRecv, seq: usize, src: &[u8]) {
    let n = src.len();
    let mut dst = vec![0u8; n + 8];
    let q = recv_into(r, &mut dst);
    let got = r.test(q).unwrap();
    assert_eq!(
        got,
        Some(n),
        "message {seq} not landed by the posting thread"
    );
    assert!(dst[..n] == src[..], "message {seq}: bytes differ");
    assert!(
        dst[n..].iter().all(|&b| b == 0),
        "message {seq}: bytes past it"
    );
}

#[test]
fn larger_messages_sent_ahead_land_on_the_posting_thread_within_its_budget() {
    // UCCL's benchmark at 256 KB / 1 MB: parts larger than a small
    // message's, arrived before their receives. Within the poster's
    // budget they land on the posting thread too (the receive complete
    // when its `irecv` returns); a worker woken for each part took up to
    // milliseconds on a VM. (Socket buffers that hold a whole part: the
    // poster lands only parts all of whose bytes are here.)
    let (mut s, mut r) = test_pair_here(big_buffers(1), big_buffers(1));
    let sizes = [256usize << 10, 300_000, super::rx::POSTER_BUDGET];
    for (seq, &n) in sizes.iter().enumerate() {
        let src: Vec<u8> = (0..n).map(|i| (i * 7 + seq * 11 + 1) as u8).collect();
        let q = send_all(s.as_mut(), &src);
        assert_eq!(wait(|| s.test(q)), n);
        wait_until_held(&r, seq);
        recv_landed_by_the_poster(&mut r, seq, &src);
    }
}

#[test]
fn every_part_of_a_message_sent_ahead_on_one_stream_lands_on_the_posting_thread() {
    // A comm's first message of two parts rides its one stream (it asks
    // for a second). Sent ahead of its receive, both parts are landed by
    // the posting thread: the receive is complete when `irecv` returns.
    // (The second part's header, read after the first part landed, was
    // handed to the stream's task: a wake-up that waited behind
    // PyTorch's spinning OpenMP team in UCCL's benchmark at 256 KB.)
    let (mut s, mut r, _l) = own_pair_of(big_buffers(2));
    let n = 256usize << 10;
    assert_eq!(split_parts(n, 2, big_buffers(2).min_part).len(), 2);
    let src: Vec<u8> = (0..n).map(|i| (i * 29 + 5) as u8).collect();
    // Posted while the sender had one stream: both parts ride it (the
    // second stream it asks for may be in by the time they land).
    assert_eq!(s.stream_count(), 1);
    let q = send_all(&mut s, &src);
    assert_eq!(wait(|| s.test(q)), n);
    wait_until_held(&r, 0);
    recv_landed_by_the_poster(&mut r, 0, &src);
}

#[test]
fn with_no_cpu_idle_the_poster_lands_every_part_held_on_the_streams() {
    // A message of four parts on four streams, each held whole before its
    // receive is posted. With no CPU idle no task is kicked to land its
    // part beside the poster (it would wait for a CPU, holding the part):
    // the poster lands all four, and the receive is complete when `irecv`
    // returns.
    let c = big_buffers(4);
    let (mut s, mut r, _l) = own_pair_of(c.clone());
    let n = 1usize << 20;
    assert_eq!(split_parts(n, 4, c.min_part).len(), 4);
    for seq in 0..6usize {
        let src: Vec<u8> = (0..n).map(|i| (i * 17 + seq * 3 + 7) as u8).collect();
        let q = send_all(&mut s, &src);
        assert_eq!(wait(|| s.test(q)), n);
        if seq == 0 {
            // The first message asked for the other streams.
            let mut dst = vec![0u8; n];
            let q = recv_into(&mut r, &mut dst);
            assert_eq!(wait(|| r.test(q)), n);
            assert!(dst == src, "message 0: bytes differ");
            s.settle_streams();
            until(
                || r.stream_count() == 4,
                "the receiver takes in four streams",
            );
            continue;
        }
        until(
            || r.holders(seq as u64) == 4,
            "each stream holds a part whole",
        );
        crate::spin::answer_full_here(Some(true));
        recv_landed_by_the_poster(&mut r, seq, &src);
        crate::spin::answer_full_here(None);
    }
}

#[test]
fn parts_sent_ahead_on_several_streams_land_between_the_poster_and_the_kicked_tasks() {
    // A message of four parts, all arrived before its receive: the tasks
    // of the streams but the first are kicked, and the poster lands what
    // a task has not begun. Whoever lands a part, every byte lands once.
    let (mut s, mut r) = test_pair_here(big_buffers(4), big_buffers(4));
    let n = 1usize << 20;
    for seq in 0..24usize {
        let src: Vec<u8> = (0..n).map(|i| (i * 31 + seq * 7 + 3) as u8).collect();
        let q = send_all(s.as_mut(), &src);
        assert_eq!(wait(|| s.test(q)), n);
        if seq > 0 {
            // The streams opened by the first message hold their parts.
            wait_until_held(&r, seq);
        }
        let mut dst = vec![0u8; n + 8];
        let q = recv_into(&mut r, &mut dst);
        assert_eq!(wait(|| r.test(q)), n, "message {seq}");
        assert!(dst[..n] == src[..], "message {seq}: bytes differ");
        assert!(dst[n..].iter().all(|&b| b == 0), "message {seq}: past it");
    }
    assert_eq!(r.stream_count(), 4);
}

#[test]
fn peers_with_other_part_sizes_agree_on_streams() {
    // The receiver checks each part against the cut its own smallest
    // part makes, which the sender adopts.
    let (mut s, mut r) = pair_of(
        SocketConfig {
            min_part: 1024,
            ..cfg(4)
        },
        SocketConfig {
            min_part: 256 << 10,
            ..cfg(4)
        },
    );
    // Messages shorter than their receives (fewer parts than a message
    // of the receive's size would have), and whole ones.
    let sizes = [100_000usize, 1 << 20, 3, 700_000, 2 << 20];
    let srcs: Vec<Vec<u8>> = sizes
        .iter()
        .map(|&n| (0..n).map(|i| (i * 13 + n) as u8).collect())
        .collect();
    let mut dsts: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| vec![0u8; if i % 2 == 0 { n + 10 } else { 2 << 20 }])
        .collect();
    let rreqs: Vec<ReqId> = dsts.iter_mut().map(|d| recv_into(r.as_mut(), d)).collect();
    for src in &srcs {
        let q = send_all(s.as_mut(), src);
        assert_eq!(wait(|| s.test(q)), src.len());
    }
    for (i, q) in rreqs.into_iter().enumerate() {
        assert_eq!(wait(|| r.test(q)), sizes[i]);
        assert_eq!(&dsts[i][..sizes[i]], &srcs[i][..], "message {i}");
    }
}

/// A listening comm on `streams` streams and the raw streams a test peer
/// opens to it (each with the hello `(nonce, index)` given), the receive
/// comm accepted once the first is in.
pub(super) fn raw_peer(streams: usize) -> (super::SocketListen, Handle) {
    let l = SocketNet::new(cfg(streams)).listen_here().unwrap();
    let handle = Handle::decode(&super::ListenComm::handle(&l)).unwrap();
    (l, handle)
}

pub(super) fn raw_stream(addr: std::net::SocketAddr, nonce: u64, index: u64) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(
        &Hello {
            nonce,
            stream: index,
        }
        .encode(),
    )
    .unwrap();
    s
}

pub(super) fn accept(l: &mut super::SocketListen) -> super::recv::SocketRecv {
    let waker: Waker = Arc::new(|| {});
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(r) = l.accept_here(waker.clone()).unwrap() {
            return r;
        }
        assert!(Instant::now() < deadline, "no stream came");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The net's I/O workers (started by its first comm).
fn workers_of(net: &SocketNet) -> crate::workers::Workers {
    net.workers
        .0
        .lock()
        .clone()
        .expect("the net's comms started its workers")
}

/// Waits until no worker is busy (`what`: what should free them), and
/// checks that none is 50 ms later.
fn parked(w: &crate::workers::Workers, what: &str) {
    until(|| w.busy() == 0, what);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(w.busy(), 0, "a worker held: {what}");
}

/// Waits until `f` holds (5 s at most).
pub(super) fn until(mut f: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The header of part `(off, len)` of a `total`-byte message `seq` cut
/// as the sender's rule cuts it for `streams` streams and 4 KiB parts.
fn part_header(
    seq: u64,
    off: usize,
    len: usize,
    total: usize,
    streams: usize,
    m: MemRef,
) -> PartHeader {
    PartHeader {
        seq,
        off: off as u64,
        len: len as u64,
        total: total as u64,
        nparts: split_parts(total, streams, 4096).len() as u64,
        shape: Segs::new(&[m]).unwrap().shape,
        spliced: false,
    }
}

/// A comm pair as the net's own types, on one stream each until messages
/// ask for more (the listen comm kept: later streams come through it).
fn own_pair(
    streams: usize,
) -> (
    super::send::SocketSend,
    super::recv::SocketRecv,
    super::SocketListen,
) {
    own_pair_of(cfg(streams))
}

/// As [`own_pair`], both sides made with `c`.
pub(super) fn own_pair_of(
    c: SocketConfig,
) -> (
    super::send::SocketSend,
    super::recv::SocketRecv,
    super::SocketListen,
) {
    let waker: Waker = Arc::new(|| {});
    let mut l = SocketNet::new(c.clone()).listen_here().unwrap();
    let s = SocketNet::new(c)
        .connect_here(&super::ListenComm::handle(&l), waker)
        .unwrap();
    let r = accept(&mut l);
    (s, r, l)
}

#[test]
fn a_comm_grows_from_one_stream_to_its_count_and_delivers_every_byte() {
    let (mut s, mut r, _l) = own_pair(4);
    assert_eq!((s.stream_count(), r.stream_count()), (1, 1));
    // A small message needs one stream: none is opened.
    let one =
        |s: &mut super::send::SocketSend, r: &mut super::recv::SocketRecv, len: usize, fill: u8| {
            let src: Vec<u8> = (0..len)
                .map(|i| (i as u8).wrapping_mul(31) ^ fill)
                .collect();
            let mut dst = vec![0u8; len];
            let q = recv_into(r, &mut dst);
            let p = send_all(s, &src);
            assert_eq!(wait(|| s.test(p)), len);
            assert_eq!(wait(|| r.test(q)), len);
            assert_eq!(dst, src, "{len} bytes, fill {fill}");
        };
    one(&mut s, &mut r, 1000, 1);
    s.settle_streams();
    assert_eq!(s.stream_count(), 1, "a one-part message opens no stream");
    // A message of 4 parts rides the one stream and asks for three more.
    one(&mut s, &mut r, 1 << 20, 2);
    s.settle_streams();
    assert_eq!(s.stream_count(), 4);
    until(
        || r.stream_count() == 4,
        "the receiver admits the new streams",
    );
    // Later messages spread over all of them, every byte in place.
    for i in 0..20u8 {
        one(
            &mut s,
            &mut r,
            [1 << 20, 300_000, 4096, 77][usize::from(i) % 4],
            i,
        );
    }
    assert_eq!((s.stream_count(), r.stream_count()), (4, 4));
}

/// Waits (5 s at most) for receive `q` to fail; its error.
fn fails(r: &mut dyn RecvComm, q: ReqId, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match r.test(q) {
            Err(e) => return e.to_string(),
            Ok(Some(n)) => panic!("{what}: completed with {n} bytes"),
            Ok(None) => assert!(Instant::now() < deadline, "{what}: waited for ever"),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn hostile_streams_are_refused_without_harming_the_comm() {
    let (mut l, h) = raw_peer(2);
    let mut s0 = raw_stream(h.addr, h.nonce, 0);
    let mut r = accept(&mut l);
    // A wrong nonce, a second stream 0, an index past the count: refused
    // (the listener closes them); then the real stream 1 is admitted.
    let mut bad = [
        raw_stream(h.addr, h.nonce ^ 1, 1),
        raw_stream(h.addr, h.nonce, 0),
        raw_stream(h.addr, h.nonce, 2),
    ];
    for b in &mut bad {
        b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut byte = [0u8; 1];
        let n = std::io::Read::read(b, &mut byte).unwrap_or(0);
        assert_eq!(n, 0, "a refused stream is closed");
    }
    assert_eq!(r.stream_count(), 1);
    let mut s1 = raw_stream(h.addr, h.nonce, 1);
    until(|| r.stream_count() == 2, "stream 1 is admitted");
    // Every stream is in: another naming the comm is refused.
    let mut more = raw_stream(h.addr, h.nonce, 1);
    assert!(closed_by_peer(&mut more));
    assert_eq!(r.stream_count(), 2);
    // A two-part message, one part on each stream, lands whole.
    let len = 8192;
    let src: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![0u8; len];
    let m = host(dst.as_mut_ptr() as u64, len);
    let q = r.irecv(m, MrHandle(0)).unwrap().unwrap();
    for (k, (off, plen)) in split_parts(len, 2, 4096).into_iter().enumerate() {
        let sock = if k == 0 { &mut s0 } else { &mut s1 };
        sock.write_all(&part_header(0, off, plen, len, 2, m).encode())
            .unwrap();
        sock.write_all(&src[off..off + plen]).unwrap();
    }
    assert_eq!(wait(|| r.test(q)), len);
    assert_eq!(dst, src);
}

#[test]
fn a_part_sent_twice_on_two_streams_fails_the_receive() {
    // A peer that sends the first part of a two-part message on both
    // streams: the second copy is refused, and the receive, which still
    // lacks its second part, fails instead of completing.
    let (mut l, h) = raw_peer(2);
    let mut socks = vec![raw_stream(h.addr, h.nonce, 0)];
    let mut r = accept(&mut l);
    socks.push(raw_stream(h.addr, h.nonce, 1));
    until(|| r.stream_count() == 2, "stream 1 is admitted");
    let len = 8192;
    let mut dst = vec![0u8; len];
    let m = host(dst.as_mut_ptr() as u64, len);
    let q = r.irecv(m, MrHandle(0)).unwrap().unwrap();
    let (off, plen) = split_parts(len, 2, 4096)[0];
    for s in &mut socks {
        s.write_all(&part_header(0, off, plen, len, 2, m).encode())
            .unwrap();
        s.write_all(&vec![7u8; plen]).unwrap();
    }
    let err = fails(&mut r, q, "a part sent twice");
    assert!(err.contains("twice"), "{err}");
    assert!(
        dst[plen..].iter().all(|&b| b == 0),
        "the second part's bytes untouched"
    );
}

#[test]
fn a_receive_no_stream_can_still_bring_a_part_for_fails_instead_of_waiting() {
    // Each stream carries the sender's messages in order: once every
    // stream has read a header of a later message, a receive still
    // lacking parts can get none. Its stream, keeping the later header for
    // its receive, reads nothing more (so a peer's close went unseen): the
    // receive failed nowhere and waited for ever. (Messages of one 4 KiB
    // part, whatever the stream count.)
    let n = 4096;
    let src = vec![9u8; n];
    // Posted first, then the header of message 1 on the only stream.
    let (mut l, h) = raw_peer(1);
    let mut s0 = raw_stream(h.addr, h.nonce, 0);
    let mut r = accept(&mut l);
    let mut dst = vec![0u8; n];
    let q = recv_into(&mut r, &mut dst);
    write_part(&mut s0, 1, &src);
    drop(s0);
    let err = fails(&mut r, q, "receive 0, message 1 on every stream");
    assert!(err.contains("message 0 lacks parts"), "{err}");
    assert!(dst.iter().all(|&b| b == 0), "nothing written");
    // Message 1's header held first: receive 0, posted after it, fails at
    // once (the peer still connected).
    let (mut l, h) = raw_peer(1);
    let mut s0 = raw_stream(h.addr, h.nonce, 0);
    let mut r = accept(&mut l);
    write_part(&mut s0, 1, &src);
    until(|| r.holds(1), "message 1's part is held");
    let q = recv_into(&mut r, &mut dst);
    let err = fails(&mut r, q, "receive 0 posted after message 1's header");
    assert!(err.contains("message 0 lacks parts"), "{err}");
    // A stream still to come may bring it: with one of two streams in and
    // past message 0, receive 0 waits, and completes once the second
    // stream brings it (message 1 after it).
    let (mut l, h) = raw_peer(2);
    let mut s0 = raw_stream(h.addr, h.nonce, 0);
    let mut r = accept(&mut l);
    let (mut d0, mut d1) = (vec![0u8; n], vec![0u8; n]);
    let q0 = recv_into(&mut r, &mut d0);
    write_part(&mut s0, 1, &src);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(r.test(q0).unwrap(), None, "receive 0 waits for stream 1");
    let mut s1 = raw_stream(h.addr, h.nonce, 1);
    let src0 = vec![3u8; n];
    write_part(&mut s1, 0, &src0);
    assert_eq!(wait(|| r.test(q0)), n);
    let q1 = recv_into(&mut r, &mut d1);
    assert_eq!(wait(|| r.test(q1)), n);
    assert!(d0 == src0 && d1 == src, "bytes");
}

#[test]
fn a_part_off_the_senders_cut_fails_the_receive() {
    // In bounds, but not one of the parts the sender's rule makes.
    let (mut l, h) = raw_peer(2);
    let mut s0 = raw_stream(h.addr, h.nonce, 0);
    let mut r = accept(&mut l);
    let len = 8192;
    let mut dst = vec![0u8; len];
    let m = host(dst.as_mut_ptr() as u64, len);
    let q = r.irecv(m, MrHandle(0)).unwrap().unwrap();
    let hdr = PartHeader {
        off: 100,
        len: 100,
        ..part_header(0, 0, 4096, len, 2, m)
    };
    s0.write_all(&hdr.encode()).unwrap();
    s0.write_all(&[7u8; 100]).unwrap();
    let err = fails(&mut r, q, "a part off the cut");
    assert!(err.contains("not one of the parts"), "{err}");
    assert!(dst.iter().all(|&b| b == 0), "nothing written");
}

#[test]
fn oversized_message_fails_the_receive() {
    let (mut s, mut r) = pair(2);
    let src = vec![1u8; 10_000];
    let mut dst = vec![0u8; 100];
    let q = r
        .irecv(
            MemRef {
                addr: dst.as_mut_ptr() as u64,
                len: 100,
                kind: MemKind::Host,
            },
            MrHandle(0),
        )
        .unwrap()
        .unwrap();
    s.isend(
        MemRef {
            addr: src.as_ptr() as u64,
            len: src.len(),
            kind: MemKind::Host,
        },
        MrHandle(0),
    )
    .unwrap();
    fails(r.as_mut(), q, "an oversized message");
    assert!(dst.iter().all(|&b| b == 0), "nothing written");
}

#[test]
fn peer_drop_fails_pending_receive() {
    let (s, mut r) = pair(2);
    let mut dst = vec![0u8; 100];
    let q = r
        .irecv(
            MemRef {
                addr: dst.as_mut_ptr() as u64,
                len: 100,
                kind: MemKind::Host,
            },
            MrHandle(0),
        )
        .unwrap()
        .unwrap();
    drop(s);
    fails(r.as_mut(), q, "a receive whose sender went away");
}

#[test]
fn a_stream_that_never_says_hello_holds_no_worker_and_closes_with_the_net() {
    let (mut l, h) = raw_peer(4);
    let mut s0 = raw_stream(h.addr, h.nonce, 0);
    let mut r = accept(&mut l);
    // A silent connection waits for its hello without a worker: streams
    // behind it are admitted, and messages flow.
    let mut silent = TcpStream::connect(h.addr).unwrap();
    let _s1 = raw_stream(h.addr, h.nonce, 1);
    until(
        || r.stream_count() == 2,
        "stream 1 is admitted beside the silent one",
    );
    let len = 1000;
    let mut dst = vec![0u8; len];
    let m = host(dst.as_mut_ptr() as u64, len);
    let q = r.irecv(m, MrHandle(0)).unwrap().unwrap();
    s0.write_all(&part_header(0, 0, len, len, 4, m).encode())
        .unwrap();
    s0.write_all(&[5u8; 1000]).unwrap();
    assert_eq!(wait(|| r.test(q)), len);
    assert!(dst.iter().all(|&b| b == 5));
    // The net's comms close, and with them its listener: so does the
    // connection still owing its hello.
    drop(r);
    drop(l);
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut byte = [0u8; 1];
    assert_eq!(std::io::Read::read(&mut silent, &mut byte).unwrap_or(0), 0);
}

#[test]
fn a_stream_that_never_says_hello_is_closed_at_the_limit_and_the_comm_goes_on() {
    let limit = Duration::from_millis(300);
    let l = SocketNet::new(SocketConfig {
        hello_timeout: limit,
        ..cfg(2)
    });
    let mut l = l.listen_here().unwrap();
    let h = Handle::decode(&super::ListenComm::handle(&l)).unwrap();
    let mut s0 = raw_stream(h.addr, h.nonce, 0);
    let mut r = accept(&mut l);
    // A connection that never sends its hello.
    let opened = Instant::now();
    let mut silent = TcpStream::connect(h.addr).unwrap();
    until(
        || l.door.waiting() == 1,
        "the silent connection awaits its hello",
    );
    // At the limit it is closed: end of stream, not a read timeout. Only
    // closing the last reference to the accepted socket ends it (nothing
    // shuts it down), so its descriptor is gone.
    silent
        .set_read_timeout(Some(limit + Duration::from_secs(10)))
        .unwrap();
    let mut byte = [0u8; 1];
    let n = std::io::Read::read(&mut silent, &mut byte)
        .expect("the silent connection is closed at the limit, not left open");
    assert_eq!(n, 0);
    assert!(opened.elapsed() >= limit, "not before the limit");
    assert_eq!(l.door.waiting(), 0, "no hello awaited any more");
    // The comm goes on: the real stream 1 is admitted, and a two-part
    // message, one part on each stream, lands whole.
    let mut s1 = raw_stream(h.addr, h.nonce, 1);
    until(|| r.stream_count() == 2, "stream 1 is admitted");
    let len = 8192;
    let src: Vec<u8> = (0..len).map(|i| (i * 11 + 3) as u8).collect();
    let mut dst = vec![0u8; len];
    let m = host(dst.as_mut_ptr() as u64, len);
    let q = r.irecv(m, MrHandle(0)).unwrap().unwrap();
    for (k, (off, plen)) in split_parts(len, 2, 4096).into_iter().enumerate() {
        let sock = if k == 0 { &mut s0 } else { &mut s1 };
        sock.write_all(&part_header(0, off, plen, len, 2, m).encode())
            .unwrap();
        sock.write_all(&src[off..off + plen]).unwrap();
    }
    assert_eq!(wait(|| r.test(q)), len);
    assert_eq!(dst, src);
}

#[test]
fn a_sender_that_stalls_inside_a_part_fails_its_receive_at_the_limit_and_frees_the_worker() {
    // A hostile (or hung) sender: a part's header and half its bytes, then
    // nothing, its connection kept open. The stream's read gives up at the
    // stall limit: the receive fails, naming the stall, and the worker that
    // read the part is free (not held for good by one peer).
    let limit = Duration::from_millis(400);
    let net = SocketNet::new(SocketConfig {
        stall: limit,
        ..cfg(1)
    });
    let (mut l, h) = listen_on(&net);
    let mut s0 = raw_stream(h.addr, h.nonce, 0);
    let mut r = accept(&mut l);
    let len = 64 << 10;
    let mut dst = vec![0u8; len];
    let m = host(dst.as_mut_ptr() as u64, len);
    let q = r.irecv(m, MrHandle(0)).unwrap().unwrap();
    // Taken before the first byte leaves: the stream's last read cannot
    // start earlier.
    let sent = Instant::now();
    s0.write_all(&part_header(0, 0, len, len, 1, m).encode())
        .unwrap();
    s0.write_all(&vec![7u8; len / 2]).unwrap();
    let failed = loop {
        match r.test(q) {
            Ok(None) => {}
            Ok(Some(n)) => panic!("a half-sent part completed ({n} bytes)"),
            Err(e) => break e,
        }
        assert!(
            sent.elapsed() < limit + Duration::from_secs(10),
            "the stalled part held its receive past the limit"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    // (The kernel's timer may round to its tick.)
    assert!(
        sent.elapsed() + Duration::from_millis(10) >= limit,
        "not before the limit"
    );
    assert!(
        failed.to_string().contains("stalled"),
        "the reason names the stall: {failed}"
    );
    assert!(
        dst[len / 2..].iter().all(|&b| b == 0),
        "nothing past what came"
    );
    // The net's workers serve on: another comm's message lands.
    let (mut l2, h2) = listen_on(&net);
    let mut t0 = raw_stream(h2.addr, h2.nonce, 0);
    let mut r2 = accept(&mut l2);
    message_lands(&mut r2, &mut [&mut t0], 0, 3);
    drop(s0);
}

#[test]
fn parts_whose_bytes_trickle_in_hold_no_worker_while_they_wait() {
    // Twelve peers each send a part's header and a little of its payload,
    // then the rest in pieces, each once no worker is held (past the
    // streams' linger). A stream waiting inside a part waits in the
    // poller: no worker is busy between the pieces (a blocked read held
    // one per stream), and every part lands whole, byte for byte.
    let net = SocketNet::new(SocketConfig {
        linger: Duration::from_millis(10),
        stall: Duration::from_secs(20),
        ..cfg(1)
    });
    let peers = 12;
    let len = 256 << 10;
    let mut dsts: Vec<Vec<u8>> = (0..peers).map(|_| vec![0u8; len]).collect();
    let srcs: Vec<Vec<u8>> = (0..peers)
        .map(|p| {
            (0..len)
                .map(|i| (i * 13 + p * 101 + i / 4093) as u8)
                .collect()
        })
        .collect();
    let mut comms = Vec::new();
    for (p, dst) in dsts.iter_mut().enumerate() {
        let (mut l, h) = listen_on(&net);
        let mut s = raw_stream(h.addr, h.nonce, 0);
        let mut r = accept(&mut l);
        let m = host(dst.as_mut_ptr() as u64, len);
        let q = r.irecv(m, MrHandle(0)).unwrap().unwrap();
        s.write_all(&part_header(0, 0, len, len, 1, m).encode())
            .unwrap();
        s.write_all(&srcs[p][..1000]).unwrap();
        comms.push((l, s, r, q));
    }
    // Eight more pieces each (the last takes the part to its end).
    let cuts: Vec<usize> = (0..=8).map(|k| 1000 + k * (len - 1000) / 8).collect();
    for k in 0..8 {
        // A stream blocked in a read would hold its worker until the next
        // piece, which is sent only once none is held: so the wait ends
        // only if every stream waits in the poller (however slowly a
        // loaded machine lets the streams get there).
        let w = workers_of(&net);
        until(
            || w.busy() == 0,
            &format!("piece {k}: workers held by streams waiting inside a part"),
        );
        for (p, (_, s, r, q)) in comms.iter_mut().enumerate() {
            assert_eq!(r.test(*q).unwrap(), None, "peer {p}: done before its bytes");
            s.write_all(&srcs[p][cuts[k]..cuts[k + 1]]).unwrap();
        }
    }
    for (p, (_, _, r, q)) in comms.iter_mut().enumerate() {
        assert_eq!(wait(|| r.test(*q)), len, "peer {p}");
    }
    for (p, (dst, src)) in dsts.iter().zip(&srcs).enumerate() {
        assert!(dst == src, "peer {p}: the part landed with other bytes");
    }
}

/// A comm's record in the net's listener, for a test peer: its handle's
/// nonce and address.
fn listen_on(net: &SocketNet) -> (super::SocketListen, Handle) {
    let l = net.listen_here().unwrap();
    let h = Handle::decode(&super::ListenComm::handle(&l)).unwrap();
    (l, h)
}

/// Reads until the peer closes (true) or 5 s pass (false).
fn closed_by_peer(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 64];
    matches!(std::io::Read::read(s, &mut buf), Ok(0))
}

/// Sends a message of one 4 KiB part per stream of `socks` (as the
/// sender's cut for that many streams deals them) into `r`; checks every
/// byte.
fn message_lands(
    r: &mut super::recv::SocketRecv,
    socks: &mut [&mut TcpStream],
    seq: u64,
    fill: u8,
) {
    let n = socks.len();
    let len = 4096 * n;
    let src: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ fill)
        .collect();
    let mut dst = vec![0u8; len];
    let m = host(dst.as_mut_ptr() as u64, len);
    let q = r.irecv(m, MrHandle(0)).unwrap().unwrap();
    let parts = split_parts(len, n, 4096);
    assert_eq!(parts.len(), n);
    for (k, (off, plen)) in parts.into_iter().enumerate() {
        socks[k]
            .write_all(&part_header(seq, off, plen, len, n, m).encode())
            .unwrap();
        socks[k].write_all(&src[off..off + plen]).unwrap();
    }
    assert_eq!(wait(|| r.test(q)), len);
    assert_eq!(dst, src, "message {seq} on {n} streams");
}

#[test]
fn one_listener_serves_every_comm_of_the_net_and_gives_each_only_its_own_streams() {
    let net = SocketNet::new(SocketConfig {
        hello_timeout: Duration::from_millis(300),
        ..cfg(2)
    });
    let (mut la, ha) = listen_on(&net);
    let (mut lb, hb) = listen_on(&net);
    assert_eq!(ha.addr, hb.addr, "one listener for both comms");
    assert_ne!(ha.nonce, hb.nonce);
    // A's stream 1 comes before A is accepted: it waits for A.
    let mut a0 = raw_stream(ha.addr, ha.nonce, 0);
    let mut a1 = raw_stream(ha.addr, ha.nonce, 1);
    let mut b0 = raw_stream(hb.addr, hb.nonce, 0);
    until(
        || la.door.has_early(ha.nonce) && lb.door.has_early(hb.nonce),
        "the first streams came",
    );
    let mut ra = accept(&mut la);
    let mut rb = accept(&mut lb);
    until(|| ra.stream_count() == 2, "A has both its streams");
    assert_eq!(rb.stream_count(), 1);
    // Hostile streams: a nonce of neither comm, A's used index, B's index
    // past its count and far past it, bytes that are no hello, and
    // silence. Each is closed; neither comm gains or loses a stream.
    let mut bad = vec![
        raw_stream(ha.addr, ha.nonce ^ hb.nonce ^ 1, 1),
        raw_stream(ha.addr, ha.nonce, 1),
        raw_stream(ha.addr, hb.nonce, 2),
        raw_stream(ha.addr, hb.nonce, u64::MAX),
    ];
    let mut junk = TcpStream::connect(ha.addr).unwrap();
    junk.write_all(&[0x5a; 24]).unwrap();
    bad.push(junk);
    bad.push(TcpStream::connect(ha.addr).unwrap());
    for (i, b) in bad.iter_mut().enumerate() {
        assert!(closed_by_peer(b), "hostile stream {i} is closed");
    }
    assert_eq!((ra.stream_count(), rb.stream_count()), (2, 1));
    until(|| la.door.waiting() == 0, "no hello awaited");
    // B's real stream 1 joins B, and both comms move their bytes.
    let mut b1 = raw_stream(hb.addr, hb.nonce, 1);
    until(|| rb.stream_count() == 2, "B has both its streams");
    message_lands(&mut ra, &mut [&mut a0, &mut a1], 0, 1);
    message_lands(&mut rb, &mut [&mut b0, &mut b1], 0, 2);
    // A closes: a stream naming it is refused from then on; B goes on.
    drop(ra);
    drop(la);
    let mut late = raw_stream(hb.addr, ha.nonce, 0);
    assert!(closed_by_peer(&mut late), "a closed comm takes no stream");
    message_lands(&mut rb, &mut [&mut b0, &mut b1], 1, 3);
}

#[test]
fn a_listen_comm_dropped_unaccepted_closes_the_streams_that_came_for_it() {
    let net = SocketNet::new(cfg(2));
    let (l, h) = listen_on(&net);
    let mut s0 = raw_stream(h.addr, h.nonce, 0);
    until(
        || l.door.has_early(h.nonce),
        "stream 0 waits for the accept",
    );
    drop(l);
    assert!(closed_by_peer(&mut s0));
}

#[test]
fn silent_connections_past_the_bound_per_address_close_the_oldest_and_streams_still_join() {
    let (mut l, h) = raw_peer(2);
    let mut s0 = raw_stream(h.addr, h.nonce, 0);
    let mut r = accept(&mut l);
    let mut silent: Vec<TcpStream> = (0..super::door::WAITING_PER_ADDR)
        .map(|_| TcpStream::connect(h.addr).unwrap())
        .collect();
    until(
        || l.door.waiting() == super::door::WAITING_PER_ADDR,
        "every silent connection awaits its hello",
    );
    // One more from the same address: the oldest waiting one is closed to
    // make room, and no more wait than the bound.
    silent.push(TcpStream::connect(h.addr).unwrap());
    assert!(closed_by_peer(&mut silent[0]), "the oldest is closed");
    until(
        || l.door.waiting() == super::door::WAITING_PER_ADDR,
        "the newest waits in its place",
    );
    // An honest stream, hello sent as it connects, still joins, and the
    // comm moves its bytes.
    let mut s1 = raw_stream(h.addr, h.nonce, 1);
    until(|| r.stream_count() == 2, "stream 1 joins");
    message_lands(&mut r, &mut [&mut s0, &mut s1], 0, 7);
}

#[test]
fn parts_go_to_the_stream_with_the_least_queued_the_rotation_among_equals() {
    use std::sync::atomic::AtomicUsize;
    let q = |v: &[usize]| -> Vec<Arc<AtomicUsize>> {
        v.iter().map(|&n| Arc::new(AtomicUsize::new(n))).collect()
    };
    let least = super::send::least_queued;
    // All idle: the rotation's turn.
    for turn in 0..9 {
        assert_eq!(least(&q(&[0, 0, 0, 0]), turn), turn % 4);
    }
    // A backed-up stream is passed over; equals go by the turn.
    assert_eq!(least(&q(&[900, 0, 0, 0]), 0), 1);
    assert_eq!(least(&q(&[900, 0, 0, 0]), 2), 2);
    assert_eq!(least(&q(&[900, 50, 900, 40]), 1), 3);
    assert_eq!(least(&q(&[7]), 5), 0);
    assert_eq!(least(&q(&[]), 3), 0);
}

/// A raw receiving end of a 2-stream comm: the sender's first stream,
/// accepted and its hello checked (receive buffers held small, so that a
/// part larger than them stays queued until it is read).
fn raw_receiver() -> (super::send::SocketSend, std::net::TcpListener, TcpStream) {
    use std::io::Read;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    socket2::SockRef::from(&l)
        .set_recv_buffer_size(64 << 10)
        .unwrap();
    let nonce = 0x5eed_0042;
    let handle = Handle {
        addr: l.local_addr().unwrap(),
        streams: 2,
        nonce,
        min_part: 4096,
    }
    .encode();
    let waker: Waker = Arc::new(|| {});
    let tx = SocketConfig {
        sockbuf: 64 << 10,
        ..cfg(2)
    };
    let s = SocketNet::new(tx).connect_here(&handle, waker).unwrap();
    let (mut s0, _) = l.accept().unwrap();
    let mut hello = [0u8; super::wire::HELLO_LEN];
    s0.read_exact(&mut hello).unwrap();
    assert_eq!(Hello::decode(&hello).unwrap().stream, 0);
    (s, l, s0)
}

/// The raw receiver's second stream: a two-part message sent (read on the
/// first stream, checked) asks the sender for it; accepted, its hello
/// checked.
fn second_raw_stream(
    s: &mut super::send::SocketSend,
    l: &std::net::TcpListener,
    s0: &mut TcpStream,
) -> TcpStream {
    use std::io::Read;
    let first: Vec<u8> = (0..64 << 10).map(|i| (i % 251) as u8).collect();
    let p = send_all(s_dyn(s), &first);
    for _ in 0..2 {
        let (h, data) = read_part(s0);
        let off = h.off as usize;
        assert_eq!(data, first[off..off + data.len()]);
    }
    assert_eq!(wait(|| s.test(p)), first.len());
    s.settle_streams();
    let (mut s1, _) = l.accept().unwrap();
    let mut hello = [0u8; super::wire::HELLO_LEN];
    s1.read_exact(&mut hello).unwrap();
    assert_eq!(Hello::decode(&hello).unwrap().stream, 1);
    s1
}

#[test]
fn with_no_cpu_idle_the_posting_thread_writes_a_message_up_to_1_mib_itself() {
    // The machine answered as full on the posting thread: a 256 KiB host
    // message (above the inline size, posted right after the last, so not
    // "lone") is written by `isend` itself, complete when it returns, with
    // no stream's task run for it; a 2 MiB one, and any with CPUs idle, go
    // to the stream's task. Every part read back by a raw receiver, byte
    // for byte.
    let (_net, mut s, mut s0, _l) = big_buffered_sender(77);
    let n = 256 << 10;
    crate::spin::answer_full_here(Some(true));
    for seq in 0..4u64 {
        let src: Vec<u8> = (0..n).map(|i| (i * 7 + seq as usize * 3) as u8).collect();
        let q = send_all(s_dyn(&mut s), &src);
        assert_eq!(
            s.test(q).unwrap(),
            Some(n),
            "message {seq}: left to the stream's task"
        );
        whole_part(&mut s0, seq, &src);
    }
    // Over 1 MiB, and with CPUs idle: the stream's task writes them.
    let big: Vec<u8> = (0..2usize << 20).map(|i| (i / 3) as u8).collect();
    let q = send_all(s_dyn(&mut s), &big);
    whole_part(&mut s0, 4, &big);
    assert_eq!(wait(|| s.test(q)), big.len());
    crate::spin::answer_full_here(Some(false));
    let src: Vec<u8> = (0..n).map(|i| (i * 13) as u8).collect();
    let q = send_all(s_dyn(&mut s), &src);
    whole_part(&mut s0, 5, &src);
    assert_eq!(wait(|| s.test(q)), n);
    crate::spin::answer_full_here(None);
}

#[test]
fn with_no_cpu_idle_the_posting_thread_writes_a_gpu_message_up_to_a_slice_itself() {
    // As above, GPU memory: a 256 KiB part (above the inline size) is
    // copied out through a ring of the streams' pool and written by
    // `isend` itself. Skipped without a GPU.
    use crate::gpu;
    if !gpu::available() {
        eprintln!("no GPU: skipped");
        return;
    }
    let dev = gpu::Device::get(0).unwrap();
    let (_net, mut s, mut s0, _l) = big_buffered_sender(78);
    let n = 256 << 10;
    let buf = gpu::DeviceBuf::new(&dev, n).unwrap();
    crate::spin::answer_full_here(Some(true));
    for seq in 0..4u64 {
        let src: Vec<u8> = (0..n).map(|i| (i * 11 + seq as usize) as u8).collect();
        // SAFETY: both ranges are n bytes, ours.
        #[allow(unsafe_code)]
        unsafe { gpu::copy_sync(buf.ptr, src.as_ptr() as u64, n) }.unwrap();
        let mem = MemRef {
            addr: buf.ptr,
            len: n,
            kind: MemKind::Cuda(0),
        };
        let q = s.isend(mem, MrHandle(0)).unwrap().unwrap();
        assert_eq!(
            s.test(q).unwrap(),
            Some(n),
            "message {seq}: left to the stream's task"
        );
        whole_part(&mut s0, seq, &src);
    }
    crate::spin::answer_full_here(None);
}

#[test]
fn with_no_cpu_idle_a_gpu_message_of_several_parts_is_written_by_the_posting_thread() {
    // With no CPU idle, every part of a GPU message of several parts up
    // to a staging slice is copied out and written by `isend` itself, on
    // one stream (a comm's first message) and on several; the receiver
    // gets every byte. Skipped without a GPU.
    use crate::gpu;
    if !gpu::available() {
        eprintln!("no GPU: skipped");
        return;
    }
    let dev = gpu::Device::get(0).unwrap();
    let c = SocketConfig {
        sockbuf: 8 << 20,
        ..cfg(4)
    };
    let (mut s, mut r, _l) = own_pair_of(c.clone());
    let n = 512 << 10;
    assert_eq!(split_parts(n, 4, c.min_part).len(), 4);
    assert!(n <= c.staging_slice);
    let from = gpu::DeviceBuf::new(&dev, n).unwrap();
    let to = gpu::DeviceBuf::new(&dev, n).unwrap();
    let gpu_mem = |ptr| MemRef {
        addr: ptr,
        len: n,
        kind: MemKind::Cuda(0),
    };
    crate::spin::answer_full_here(Some(true));
    for seq in 0..6usize {
        if seq == 1 {
            // The first message asked for the other streams.
            s.settle_streams();
            assert_eq!(s.stream_count(), 4);
        }
        let src: Vec<u8> = (0..n).map(|i| (i * 13 + seq * 5 + 1) as u8).collect();
        // SAFETY: both ranges are n bytes, ours.
        #[allow(unsafe_code)]
        unsafe { gpu::copy_sync(from.ptr, src.as_ptr() as u64, n) }.unwrap();
        let zero = vec![0u8; n];
        // SAFETY: as above.
        #[allow(unsafe_code)]
        unsafe { gpu::copy_sync(to.ptr, zero.as_ptr() as u64, n) }.unwrap();
        let q = r.irecv(gpu_mem(to.ptr), MrHandle(0)).unwrap().unwrap();
        let p = s.isend(gpu_mem(from.ptr), MrHandle(0)).unwrap().unwrap();
        assert_eq!(
            s.test(p).unwrap(),
            Some(n),
            "message {seq}: a part left to a stream's task"
        );
        assert_eq!(wait(|| r.test(q)), n, "message {seq}");
        let mut got = vec![0u8; n];
        // SAFETY: as above.
        #[allow(unsafe_code)]
        unsafe { gpu::copy_sync(got.as_mut_ptr() as u64, to.ptr, n) }.unwrap();
        assert!(got == src, "message {seq}: bytes differ");
    }
    crate::spin::answer_full_here(None);
}

/// A one-stream sender (parts up to 4 MiB) with large socket buffers on
/// both ends, to a raw receiver (its stream accepted, the hello read): the
/// net, the comm, the receiver's stream and its listener.
fn big_buffered_sender(nonce: u64) -> SenderToRaw {
    sender_to_raw(
        nonce,
        4 << 20,
        SocketConfig {
            sockbuf: 8 << 20,
            ..cfg(1)
        },
    )
}

/// Reads one part from a raw stream and checks it is message `seq` whole,
/// byte for byte `src`.
fn whole_part(s0: &mut TcpStream, seq: u64, src: &[u8]) {
    let (h, data) = read_part(s0);
    assert_eq!((h.seq, h.off, data.len()), (seq, 0, src.len()));
    assert!(data == src, "message {seq}'s bytes");
}

/// Reads one part (header and payload) from a raw stream.
fn read_part(s: &mut TcpStream) -> (PartHeader, Vec<u8>) {
    use std::io::Read;
    let mut hdr = [0u8; super::wire::HDR_LEN];
    s.read_exact(&mut hdr).expect("a part header");
    let h = PartHeader::decode(&hdr).unwrap();
    let mut payload = vec![0u8; h.len as usize];
    s.read_exact(&mut payload).expect("a part's payload");
    (h, payload)
}

#[test]
fn a_stream_whose_receiver_reads_slowly_is_given_no_new_parts() {
    let (mut s, l, mut s0) = raw_receiver();
    let bytes = |len: usize, fill: u8| -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13) ^ fill)
            .collect()
    };
    let mut s1 = second_raw_stream(&mut s, &l, &mut s0);
    s1.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // A large message puts a part on each stream; stream 0's is not read,
    // so it stays queued (far larger than the socket buffers).
    let big = bytes(16 << 20, 2);
    let pb = send_all(s_dyn(&mut s), &big);
    let (h, data) = read_part(&mut s1);
    assert_eq!((h.seq, h.nparts), (1, 2));
    assert_eq!(data, big[h.off as usize..h.off as usize + data.len()]);
    // Every part of the messages after it goes to stream 1.
    let later: Vec<Vec<u8>> = (0..5).map(|i| bytes(256 << 10, 10 + i)).collect();
    let ps: Vec<ReqId> = later.iter().map(|m| send_all(s_dyn(&mut s), m)).collect();
    for _ in 0..2 * later.len() {
        let (h, data) = read_part(&mut s1);
        assert!((2..=6).contains(&h.seq), "part of message {}", h.seq);
        let m = &later[h.seq as usize - 2];
        assert_eq!(data, m[h.off as usize..h.off as usize + data.len()]);
    }
    for (p, m) in ps.into_iter().zip(&later) {
        assert_eq!(wait(|| s.test(p)), m.len());
    }
    assert_eq!(s.test(pb).unwrap(), None, "stream 0's part is unread");
    // Stream 0's part, read now, completes the large message.
    let (h, data) = read_part(&mut s0);
    assert_eq!((h.seq, h.nparts), (1, 2));
    assert_eq!(data, big[h.off as usize..h.off as usize + data.len()]);
    assert_eq!(wait(|| s.test(pb)), big.len());
}

fn s_dyn(s: &mut super::send::SocketSend) -> &mut dyn SendComm {
    s
}

#[test]
fn parts_past_what_the_streams_are_given_wait_in_the_spill_and_keep_their_order() {
    // Messages sent far ahead of a receiver that posts one receive at a
    // time, each once the one before has completed (UCCL's blocking
    // loop): the streams are given 4 MiB each, the rest spills, and every
    // stream still carries its parts in the order they were posted (a
    // part of a later message ahead of an earlier one on one stream would
    // hold that stream until the stall limit).
    let (mut s, mut r, _l) = own_pair(2);
    let msg = |i: usize, len: usize| -> Vec<u8> {
        (0..len)
            .map(|j| (j as u8).wrapping_mul(7) ^ (i as u8))
            .collect()
    };
    // Two streams first (a message of two parts asks for the second).
    let first = msg(0, 1 << 20);
    let mut dst = vec![0u8; first.len()];
    let q = recv_into(&mut r, &mut dst);
    let p = send_all(s_dyn(&mut s), &first);
    assert_eq!(wait(|| r.test(q)), first.len());
    assert_eq!(wait(|| s.test(p)), first.len());
    assert_eq!(dst, first);
    s.settle_streams();
    assert_eq!(s.stream_count(), 2);
    until(
        || r.stream_count() == 2,
        "the receiver admits the second stream",
    );
    // 20 messages (about 20 MiB) sent at once: at most 4 MiB a stream is
    // given (plus a part), the rest waits in the spill; then one more sent
    // each time one is received, while streams drain and take from the
    // spill.
    let sizes: Vec<usize> = (0..60)
        .map(|i| [1 << 20, 300_000, 64 << 10, 2 << 20][i % 4])
        .collect();
    let msgs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| msg(i + 1, n))
        .collect();
    let ahead = 20;
    let mut sends: Vec<ReqId> = msgs[..ahead]
        .iter()
        .map(|m| send_all(s_dyn(&mut s), m))
        .collect();
    assert!(!s.spilled_is_empty(), "the burst spilled");
    for (i, m) in msgs.iter().enumerate() {
        let mut dst = vec![0u8; m.len()];
        let q = recv_into(&mut r, &mut dst);
        assert_eq!(wait(|| r.test(q)), m.len(), "message {i}");
        assert!(&dst == m, "message {i}'s bytes");
        if let Some(next) = msgs.get(i + ahead) {
            sends.push(send_all(s_dyn(&mut s), next));
        }
    }
    for (p, m) in sends.into_iter().zip(&msgs) {
        assert_eq!(wait(|| s.test(p)), m.len());
    }
    assert!(s.spilled_is_empty());
}

#[test]
fn a_receiver_gone_fails_every_send_spilled_ones_too() {
    let (mut s, l, mut s0) = raw_receiver();
    // Two streams, then 24 MiB posted while the receiver reads nothing
    // more: most of it spills.
    let s1 = second_raw_stream(&mut s, &l, &mut s0);
    let msgs: Vec<Vec<u8>> = (0..24).map(|i| vec![i as u8; 1 << 20]).collect();
    let sends: Vec<ReqId> = msgs.iter().map(|m| send_all(s_dyn(&mut s), m)).collect();
    assert!(!s.spilled_is_empty(), "the burst spilled");
    // The receiver goes away: every send fails, none is left waiting.
    drop((s0, s1, l));
    for (i, p) in sends.into_iter().enumerate() {
        fails_within_10s(&mut s, p, &format!("send {i}"));
    }
}

/// Waits up to 10 s for send `p` to fail (its receiver gone); panics if it
/// completes or is still pending then.
fn fails_within_10s(s: &mut super::send::SocketSend, p: ReqId, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match s.test(p) {
            Err(_) => return,
            Ok(None) => {
                assert!(Instant::now() < deadline, "{what} neither failed nor ended");
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(Some(n)) => panic!("{what} reported {n} bytes sent to a receiver gone"),
        }
    }
}

/// A one-stream send comm (10 ms linger, `splice` as given) with 64 KiB
/// socket buffers on both ends, to a raw receiver (its stream accepted, the
/// hello read): the net, the comm, the receiver's stream and its listener.
fn small_buffered_sender(nonce: u64, splice: bool) -> SenderToRaw {
    sender_to_raw(
        nonce,
        4096,
        SocketConfig {
            sockbuf: 64 << 10,
            linger: Duration::from_millis(10),
            splice,
            ..cfg(1)
        },
    )
}

/// A sender's net and comm, its raw receiver's stream and listener.
type SenderToRaw = (
    SocketNet,
    super::send::SocketSend,
    TcpStream,
    std::net::TcpListener,
);

/// A one-stream sender set up as `cfg`, to a raw receiver asking for
/// parts of `min_part` (its receive buffer `cfg.sockbuf`; its stream
/// accepted, the hello read): the net, the comm, the receiver's stream and
/// its listener.
fn sender_to_raw(nonce: u64, min_part: usize, cfg: SocketConfig) -> SenderToRaw {
    use std::io::Read;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    socket2::SockRef::from(&l)
        .set_recv_buffer_size(cfg.sockbuf)
        .unwrap();
    let handle = Handle {
        addr: l.local_addr().unwrap(),
        streams: 1,
        nonce,
        min_part,
    }
    .encode();
    let net = SocketNet::new(cfg);
    let s = net.connect_here(&handle, Arc::new(|| {})).unwrap();
    let (mut s0, _) = l.accept().unwrap();
    let mut hello = [0u8; super::wire::HELLO_LEN];
    s0.read_exact(&mut hello).unwrap();
    (net, s, s0, l)
}

/// A one-stream sender with small socket buffers whose raw receiver reads
/// nothing: a 16 MiB message posted, and the stream seen waiting for room
/// without a worker (in the poller, after its 10 ms linger).
fn full_stream_sender() -> (
    SocketNet,
    super::send::SocketSend,
    TcpStream,
    std::net::TcpListener,
    Vec<u8>,
    ReqId,
) {
    let (net, mut s, s0, l) = small_buffered_sender(0x5eed_0043, true);
    let big: Vec<u8> = (0..16 << 20)
        .map(|i: usize| (i as u8).wrapping_mul(29) ^ (i >> 13) as u8)
        .collect();
    let p = send_all(s_dyn(&mut s), &big);
    parked(&workers_of(&net), "the full stream gives its worker back");
    assert_eq!(s.test(p).unwrap(), None, "done before its bytes were read");
    (net, s, s0, l, big, p)
}

#[test]
fn a_send_whose_receiver_does_not_read_holds_no_worker_and_lands_whole_once_read() {
    // The stream waits for room in the poller, not blocked in a write on a
    // worker; once the receiver reads, every byte comes, in order.
    let (_net, mut s, mut s0, _l, big, p) = full_stream_sender();
    let mut got = Vec::with_capacity(big.len());
    while got.len() < big.len() {
        let (h, data) = read_part(&mut s0);
        assert_eq!(h.off as usize, got.len(), "parts in order");
        got.extend_from_slice(&data);
    }
    assert!(got == big, "the message came with other bytes");
    assert_eq!(wait(|| s.test(p)), big.len());
}

#[test]
fn a_send_waiting_for_room_fails_when_its_receiver_goes() {
    // Parked in the poller on a full socket, the stream is woken by the
    // receiver's close and fails its send, rather than waiting for good.
    let (_net, mut s, s0, l, _big, p) = full_stream_sender();
    drop((s0, l));
    fails_within_10s(&mut s, p, "the send");
}

/// A GPU message on one stream to a raw receiver that stops reading: the
/// stream waits for room in the poller, holding no worker, in the middle
/// of a window it writes or lends; lending (`splice`), it also waits there
/// for the credit of a slot it needs again when the receiver reads without
/// crediting. Then the receiver reads (and credits) on: every byte comes,
/// once, in order. Skipped without a GPU.
fn gpu_send_to_a_receiver_that_stops(splice: bool) {
    use crate::gpu;
    use std::io::Read;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    if !gpu::available() {
        eprintln!("no GPU: skipped");
        return;
    }
    const N: usize = 16 << 20;
    let dev = gpu::Device::get(0).unwrap();
    let src: Vec<u8> = (0..N)
        .map(|i: usize| (i as u8).wrapping_mul(31) ^ (i >> 14) as u8)
        .collect();
    let buf = gpu::DeviceBuf::new(&dev, N).unwrap();
    // SAFETY: both ranges are N bytes, ours.
    #[allow(unsafe_code)]
    unsafe { gpu::copy_sync(buf.ptr, src.as_ptr() as u64, N) }.unwrap();
    let (net, mut s, mut s0, _l) = small_buffered_sender(0x5eed_0044, splice);
    let mem = MemRef {
        addr: buf.ptr,
        len: N,
        kind: MemKind::Cuda(0),
    };
    let p = s.isend(mem, MrHandle(0)).unwrap().unwrap();
    let w = workers_of(&net);
    parked(&w, "the full socket's stream gives its worker back");
    assert_eq!(s.test(p).unwrap(), None, "done before its bytes were read");
    // The receiver: reads every part, crediting what it read of lent
    // parts once `credit` is set.
    let read = Arc::new(AtomicUsize::new(0));
    let credit = Arc::new(AtomicBool::new(false));
    let mut back = s0.try_clone().unwrap();
    let reader = {
        let (read, credit) = (read.clone(), credit.clone());
        std::thread::spawn(move || {
            let mut got = vec![0u8; N];
            let (mut total, mut lent) = (0, 0u64);
            while total < N {
                let mut hdr = [0u8; super::wire::HDR_LEN];
                s0.read_exact(&mut hdr).expect("a part header");
                let h = PartHeader::decode(&hdr).unwrap();
                let (off, len) = (h.off as usize, h.len as usize);
                assert!(off + len <= N, "a part past the message");
                let mut at = 0;
                while at < len {
                    let end = (at + (256 << 10)).min(len);
                    let n = s0.read(&mut got[off + at..off + end]).unwrap();
                    assert!(n > 0, "the sender closed mid-part");
                    at += n;
                    read.fetch_add(n, Ordering::SeqCst);
                    if h.spliced {
                        lent += n as u64;
                        if credit.load(Ordering::SeqCst) {
                            s0.write_all(&lent.to_le_bytes()).unwrap();
                        }
                    }
                }
                total += len;
            }
            (got, lent)
        })
    };
    if splice {
        // Read on without credit: the sender lends its slots, then waits
        // for the first one's credit in the poller.
        // Depth 2, doubled for lending, of 1 MiB slots.
        let slots = 4 << 20;
        until(
            || read.load(Ordering::SeqCst) >= slots,
            "the lent slots' bytes came",
        );
        parked(&w, "the stream waiting for a credit gives its worker back");
        let n = read.load(Ordering::SeqCst);
        assert!(n < N, "all {n} bytes came with no credit");
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            read.load(Ordering::SeqCst),
            n,
            "a lent slot rewritten uncredited"
        );
        // The reader waits in a read: the first credit comes from here.
        credit.store(true, Ordering::SeqCst);
        back.write_all(&(n as u64).to_le_bytes()).unwrap();
    } else {
        credit.store(true, Ordering::SeqCst);
        back.flush().unwrap();
    }
    let (got, lent) = reader.join().unwrap();
    assert!(got == src, "the message came with other bytes");
    if splice {
        assert_eq!(lent, N as u64, "not every window was lent");
    }
    assert_eq!(wait(|| s.test(p)), N);
}

#[test]
fn a_gpu_send_whose_receiver_stops_holds_no_worker_and_lands_whole() {
    gpu_send_to_a_receiver_that_stops(false);
}

#[test]
fn a_lending_gpu_send_waits_for_room_and_credit_without_a_worker() {
    gpu_send_to_a_receiver_that_stops(true);
}

#[test]
#[allow(unsafe_code)] // copies device memory back to check it
fn gpu_parts_whose_bytes_trickle_in_hold_no_worker_while_they_wait() {
    // As `parts_whose_bytes_trickle_in_hold_no_worker_while_they_wait`,
    // into GPU memory: parts of several staging windows, and a small one
    // whose bytes were not all there when its header came. Between the
    // pieces every stream waits in the poller with its window half read;
    // every part lands whole. Skipped without a GPU.
    use crate::gpu;
    if !gpu::available() {
        eprintln!("no GPU: skipped");
        return;
    }
    let dev = gpu::Device::get(0).unwrap();
    let net = SocketNet::new(SocketConfig {
        linger: Duration::from_millis(10),
        stall: Duration::from_secs(20),
        ..cfg(1)
    });
    let lens = [
        (3 << 20) + 4093,
        (3 << 20) + 4093,
        5 << 20,
        2 << 20,
        100_000,
    ];
    let srcs: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(p, &len)| {
            (0..len)
                .map(|i| (i * 7 + p * 59 + i / 4091) as u8)
                .collect()
        })
        .collect();
    let bufs: Vec<gpu::DeviceBuf> = lens
        .iter()
        .map(|&len| gpu::DeviceBuf::new(&dev, len).unwrap())
        .collect();
    let mut comms = Vec::new();
    for (p, b) in bufs.iter().enumerate() {
        let len = lens[p];
        let (mut l, h) = listen_on(&net);
        let mut s = raw_stream(h.addr, h.nonce, 0);
        let mut r = accept(&mut l);
        let m = MemRef {
            addr: b.ptr,
            len,
            kind: MemKind::Cuda(0),
        };
        let q = r.irecv(m, MrHandle(0)).unwrap().unwrap();
        s.write_all(&part_header(0, 0, len, len, 1, m).encode())
            .unwrap();
        s.write_all(&srcs[p][..1000]).unwrap();
        comms.push((l, s, r, q));
    }
    for k in 0..8 {
        // (As for host parts: the next piece comes only once none is held.)
        let w = workers_of(&net);
        until(
            || w.busy() == 0,
            &format!("piece {k}: workers held by streams waiting inside a GPU part"),
        );
        for (p, (_, s, r, q)) in comms.iter_mut().enumerate() {
            let len = lens[p];
            let cut = |k: usize| 1000 + k * (len - 1000) / 8;
            assert_eq!(r.test(*q).unwrap(), None, "peer {p}: done before its bytes");
            s.write_all(&srcs[p][cut(k)..cut(k + 1)]).unwrap();
        }
    }
    for (p, (_, _, r, q)) in comms.iter_mut().enumerate() {
        assert_eq!(wait(|| r.test(*q)), lens[p], "peer {p}");
    }
    dev.bind().unwrap();
    for (p, (b, src)) in bufs.iter().zip(&srcs).enumerate() {
        let mut got = vec![0u8; src.len()];
        // SAFETY: both ranges are the part's length, ours.
        unsafe { gpu::copy_sync(got.as_mut_ptr() as u64, b.ptr, got.len()) }.unwrap();
        assert!(got == *src, "peer {p}: the part landed with other bytes");
    }
}

/// A receive stream whose task is made but never run (as one waiting for
/// a CPU that does not come), over loopback: the stream's handle, the
/// comm's shared state, and the peer's end to write parts into.
fn stream_without_its_task() -> (
    super::rx::RxHandle,
    Arc<super::book::RecvShared>,
    TcpStream,
    super::rx::RxTask,
) {
    let c = cfg(1);
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    s.set_read_timeout(Some(super::sockio::LINGER_SLICE))
        .unwrap();
    let shared = Arc::new(super::book::RecvShared::new(
        (c.streams, c.min_part),
        Arc::new(|| {}),
    ));
    let workers = crate::workers::Workers::new("test-rx", None).unwrap();
    let (task, handle) = super::rx::RxTask::new(
        Arc::new(s),
        shared.clone(),
        super::Lane::new(0, &c),
        c.linger,
        Arc::new(super::stage::StagingPool::new(1)),
        workers,
    );
    (handle, shared, peer, task)
}

/// Enters a receive of message `seq` into `dst` (host memory) in the book,
/// as `irecv` does.
fn enter_recv(
    shared: &super::book::RecvShared,
    seq: u64,
    dst: &mut [u8],
) -> Arc<super::book::RecvReq> {
    shared.enter(
        seq,
        Segs::new(&[host(dst.as_mut_ptr() as u64, dst.len())]).unwrap(),
    )
}

/// Writes message `seq` (all of `src`, one part) as a sender would.
fn write_part(peer: &mut TcpStream, seq: u64, src: &[u8]) {
    let h = part_header(seq, 0, src.len(), src.len(), 1, host(0, src.len()));
    peer.write_all(&h.encode()).unwrap();
    peer.write_all(src).unwrap();
}

#[test]
fn when_asked_the_poster_reads_a_header_its_streams_task_has_not() {
    use super::rx::Landed;
    use std::sync::atomic::Ordering;
    // A part arrived before its receive, its stream's task not yet run (no
    // CPU for it): the header is still in the socket. Unless asked to read
    // (no CPU idle, a receive it may land whole: `RxStreams::posted`) the
    // poster leaves it to the task; asked, it reads the header and lands
    // the part itself, and a header of another receive it read is the
    // task's (kicked).
    let (handle, shared, mut peer, mut task) = stream_without_its_task();
    let n = 64 << 10;
    let src: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
    write_part(&mut peer, 0, &src);
    let mut dst = vec![0u8; n + 8];
    let req = enter_recv(&shared, 0, &mut dst);
    until(|| handle.bytes_waiting() >= n, "the part's bytes arrive");
    let mut budget = super::rx::POSTER_BUDGET;
    assert_eq!(
        handle.land_held(0, &mut budget, false),
        Landed::No,
        "not asked to read"
    );
    let landed = handle.land_held(0, &mut budget, true);
    assert!(matches!(landed, Landed::Here { .. }), "{landed:?}");
    assert!(req.done.load(Ordering::Acquire), "the receive completed");
    assert!(dst[..n] == src[..], "the part's bytes");
    assert!(dst[n..].iter().all(|&b| b == 0), "nothing past it");
    assert_eq!(budget, super::rx::POSTER_BUDGET - n);
    // Two receives posted, message 2's part here and not message 1's:
    // landing message 1, the poster reads message 2's header (its receive
    // is not the one it lands) and kicks the task, which lands it.
    let src2: Vec<u8> = (0..n).map(|i| (i * 5 + 1) as u8).collect();
    let (mut d1, mut d2) = (vec![0u8; n], vec![0u8; n]);
    let _r1 = enter_recv(&shared, 1, &mut d1);
    let r2 = enter_recv(&shared, 2, &mut d2);
    write_part(&mut peer, 2, &src2);
    until(|| handle.bytes_waiting() >= n, "message 2's bytes arrive");
    let mut budget = super::rx::POSTER_BUDGET;
    assert_eq!(
        handle.land_held(1, &mut budget, true),
        Landed::Here { kick: true },
        "a header read for the task"
    );
    assert!(!r2.done.load(Ordering::Acquire), "message 2 is the task's");
    assert_eq!(budget, super::rx::POSTER_BUDGET, "nothing landed");
    assert!(handle.awaits(2), "the header kept for the task");
    // The task, run (as the kick would), lands it.
    crate::workers::Task::run(&mut task);
    assert!(
        r2.done.load(Ordering::Acquire),
        "message 2 landed by the task"
    );
    assert!(d2 == src2, "message 2's bytes");
    // A header of a receive not posted yet, read so, is kept with no kick,
    // as the task keeps one; its post lands the part.
    let src3: Vec<u8> = (0..n).map(|i| (i * 3 + 2) as u8).collect();
    write_part(&mut peer, 3, &src3);
    until(|| handle.bytes_waiting() >= n, "message 3's bytes arrive");
    assert_eq!(
        handle.land_held(1, &mut budget, true),
        Landed::No,
        "a header kept for a receive to come"
    );
    assert!(!handle.awaits(1), "nothing for message 1's receive");
    let mut d3 = vec![0u8; n];
    let r3 = enter_recv(&shared, 3, &mut d3);
    assert!(matches!(
        handle.land_held(3, &mut budget, true),
        Landed::Here { .. }
    ));
    assert!(
        r3.done.load(Ordering::Acquire),
        "message 3 landed on its post"
    );
    assert!(d3 == src3, "message 3's bytes");
}
