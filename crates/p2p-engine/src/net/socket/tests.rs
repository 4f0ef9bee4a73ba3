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
use crate::net::{MemRef, MrHandle, Net, RecvComm, ReqId, SendComm, Waker};
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

fn host(addr: u64, len: usize) -> MemRef {
    MemRef {
        addr,
        len,
        kind: MemKind::Host,
    }
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
    let sreqs: Vec<ReqId> = srcs
        .iter()
        .map(|src| {
            s.isend(host(src.as_ptr() as u64, src.len()), MrHandle(0))
                .unwrap()
                .unwrap()
        })
        .collect();
    for (q, &n) in sreqs.into_iter().zip(&sizes) {
        assert_eq!(wait(|| s.test(q)), n);
    }
    for (seq, (src, &n)) in srcs.iter().zip(&sizes).enumerate() {
        let mut dst = vec![0u8; n + 8];
        let small = n <= 4096;
        if small {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !r.holds(seq as u64) {
                assert!(
                    Instant::now() < deadline,
                    "message {seq}'s header never held"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let q = r
            .irecv(host(dst.as_mut_ptr() as u64, dst.len()), MrHandle(0))
            .unwrap()
            .unwrap();
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
fn peers_with_other_part_sizes_agree_on_streams() {
    // The receiver enters each receive on the streams its parts ride,
    // reckoned with its own smallest part, which the sender adopts.
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
    // Messages shorter than their receives (fewer parts than the
    // streams the receive was entered on), and whole ones.
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
    let rreqs: Vec<ReqId> = dsts
        .iter_mut()
        .map(|d| {
            r.irecv(host(d.as_mut_ptr() as u64, d.len()), MrHandle(0))
                .unwrap()
                .unwrap()
        })
        .collect();
    for src in &srcs {
        let q = s
            .isend(host(src.as_ptr() as u64, src.len()), MrHandle(0))
            .unwrap()
            .unwrap();
        assert_eq!(wait(|| s.test(q)), src.len());
    }
    for (i, q) in rreqs.into_iter().enumerate() {
        assert_eq!(wait(|| r.test(q)), sizes[i]);
        assert_eq!(&dsts[i][..sizes[i]], &srcs[i][..], "message {i}");
    }
}

#[test]
fn part_on_a_stream_its_receive_does_not_expect_fails_the_receive() {
    // A peer that writes a one-part message on the wrong stream: the
    // receive fails with the reason instead of waiting for ever.
    let net = SocketNet::new(cfg(2));
    let waker: Waker = Arc::new(|| {});
    let mut l = net.listen(0).unwrap();
    let handle = Handle::decode(&l.handle()).unwrap();
    let mut socks = Vec::new();
    for i in 0..handle.streams {
        let mut s = TcpStream::connect(handle.addr).unwrap();
        let hello = Hello {
            nonce: handle.nonce,
            stream: i as u64,
        };
        s.write_all(&hello.encode()).unwrap();
        socks.push(s);
    }
    let mut r = loop {
        if let Some(r) = l.accept(waker.clone()).unwrap() {
            break r;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let mut dst = vec![0u8; 100];
    let m = host(dst.as_mut_ptr() as u64, 100);
    let q = r.irecv(m, MrHandle(0)).unwrap().unwrap();
    // Message 0 has one part, which rides stream 0; send it on stream 1.
    let hdr = PartHeader {
        seq: 0,
        off: 0,
        len: 100,
        total: 100,
        nparts: 1,
        shape: Segs::new(&[m]).unwrap().shape,
        spliced: false,
    };
    socks[1].write_all(&hdr.encode()).unwrap();
    socks[1].write_all(&[7u8; 100]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let err = loop {
        match r.test(q) {
            Err(e) => break e.to_string(),
            Ok(Some(_)) => panic!("a part on the wrong stream must not complete"),
            Ok(None) => assert!(Instant::now() < deadline, "the receive waited for ever"),
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert!(err.contains("does not expect"), "{err}");
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
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match r.test(q) {
            Err(_) => break,
            Ok(Some(_)) => panic!("an oversized message must not complete"),
            Ok(None) => assert!(Instant::now() < deadline),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
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
    let deadline = Instant::now() + Duration::from_secs(5);
    while r.test(q).is_ok() {
        assert!(
            Instant::now() < deadline,
            "receive should fail when the sender goes away"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}
