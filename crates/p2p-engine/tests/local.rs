//! Two endpoints in one process over the same-host path (host memory):
//! one-sided and two-sided calls with the bytes checked, and descriptors
//! the target's records refuse.

use std::time::Duration;

use tcpx_p2p::FifoItem;
use tcpx_p2p::LocalPeer;
use tcpx_p2p::{Config, Endpoint, Error};

mod common;
use common::pattern;

fn pair() -> (Endpoint, Endpoint, u64, u64) {
    let cfg = || Config {
        ifname: Some("lo".into()),
        ..Config::default()
    };
    let a = Endpoint::new(None, cfg()).unwrap();
    let b = Endpoint::new(None, cfg()).unwrap();
    let ca = a.connect_local(&LocalPeer::Metadata(b.metadata())).unwrap();
    let cb = b.accept_local(Some(Duration::from_secs(10))).unwrap().conn;
    (a, b, ca, cb)
}

#[test]
fn write_read_send_recv() {
    let (a, b, ca, cb) = pair();
    for &n in &[1usize, 4096, (1 << 20) + 3] {
        let src = pattern(n, 5);
        let mut dst = vec![0u8; n + 16];
        let info = b
            .advertise_ipc(cb, dst.as_mut_ptr() as u64, n + 16)
            .unwrap();
        a.write_ipc(ca, &[(src.as_ptr() as u64, n)], &[&info])
            .unwrap();
        assert_eq!(&dst[..n], &src[..]);
        let mut back = vec![0u8; n];
        let x = a
            .read_ipc_async(ca, &[(back.as_mut_ptr() as u64, n)], &[&info])
            .unwrap();
        assert!(a.wait(x, Some(Duration::from_secs(30))).unwrap());
        assert_eq!(back, src);
        // Two-sided, the receive posted first.
        let mut rbuf = vec![0u8; n];
        let r = b.recv_ipc_async(cb, rbuf.as_mut_ptr() as u64, n).unwrap();
        let s = a.send_ipc_async(ca, src.as_ptr() as u64, n).unwrap();
        assert!(a.wait(s, Some(Duration::from_secs(30))).unwrap());
        assert!(b.wait(r, Some(Duration::from_secs(30))).unwrap());
        assert_eq!(rbuf, src);
    }
}

#[test]
fn records_refuse_forged_and_stale() {
    let (a, b, ca, cb) = pair();
    let n = 8192;
    let src = pattern(2 * n, 9);
    let mut dst = vec![0u8; 2 * n];
    let base = dst.as_mut_ptr() as u64;
    let info = b.advertise_ipc(cb, base + 100, n).unwrap();
    let d = FifoItem::decode(&info).unwrap();
    let forge = |f: &dyn Fn(&mut FifoItem)| {
        let mut x = d;
        f(&mut x);
        x.to_bytes()
    };
    let cases = [
        forge(&|x| x.token.secret ^= 1),
        forge(&|x| x.token.id += 1000),
        forge(&|x| x.addr -= 100),
        forge(&|x| x.size += 1),
    ];
    for (i, bad) in cases.iter().enumerate() {
        let len = if i == 3 { n + 1 } else { n };
        let e = a
            .write_ipc(ca, &[(src.as_ptr() as u64, len)], &[bad])
            .unwrap_err();
        assert!(matches!(e, Error::Refused { .. }), "case {i}: {e}");
        assert!(dst.iter().all(|&v| v == 0), "case {i}: bytes moved");
    }
    // Longer than the descriptor: refused here, before asking.
    let e = a
        .write_ipc(ca, &[(src.as_ptr() as u64, n + 1)], &[&info])
        .unwrap_err();
    assert!(matches!(e, Error::Invalid(_)), "{e}");
    // The connection goes; the descriptor is stale on a new one.
    b.remove_conn(cb).unwrap();
    let ca2 = a.connect_local(&LocalPeer::Metadata(b.metadata())).unwrap();
    let _cb2 = b.accept_local(Some(Duration::from_secs(10))).unwrap();
    let e = a
        .write_ipc(ca2, &[(src.as_ptr() as u64, n)], &[&info])
        .unwrap_err();
    assert!(e.to_string().contains("stale"), "{e}");
    assert!(dst.iter().all(|&v| v == 0));
    // On the old connection: gone.
    assert!(a
        .write_ipc(ca, &[(src.as_ptr() as u64, n)], &[&info])
        .is_err());
}

#[test]
fn registered_calls_take_the_same_host_path() {
    let (a, b, ca, cb) = pair();
    let n = 100_000;
    let mut src = pattern(n, 3);
    let mut dst = vec![0u8; n];
    let sb = common::buf(&a, &mut src);
    let db = common::buf(&b, &mut dst);
    // `register_memory` + `transfer`: the peer's whole-region descriptor.
    let desc = b.export_region(db.mr).unwrap();
    let x = a.transfer(ca, false, &[sb], &[desc]).unwrap();
    assert!(a.wait(x, Some(Duration::from_secs(30))).unwrap());
    assert_eq!(dst, src);
    let mut back = vec![0u8; n];
    let bb = common::buf(&a, &mut back);
    let x = a.transfer(ca, true, &[bb], &[desc]).unwrap();
    assert!(a.wait(x, Some(Duration::from_secs(30))).unwrap());
    assert_eq!(back, src);
    // Two-sided with registered buffers, two messages in one call.
    let half = n / 2;
    let parts = |b: tcpx_p2p::Buf| {
        [
            tcpx_p2p::Buf { len: half, ..b },
            tcpx_p2p::Buf {
                ptr: b.ptr + half as u64,
                len: n - half,
                ..b
            },
        ]
    };
    dst.iter_mut().for_each(|v| *v = 0);
    let r = b.recv_async(cb, &parts(db)).unwrap();
    let s = a.send_async(ca, &parts(sb)).unwrap();
    assert!(a.wait(s, Some(Duration::from_secs(30))).unwrap());
    assert!(b.wait(r, Some(Duration::from_secs(30))).unwrap());
    assert_eq!(dst, src);
    // Deregistered: the descriptor is stale and nothing moves.
    b.dereg(db.mr).unwrap();
    dst.iter_mut().for_each(|v| *v = 0);
    let x = a.transfer(ca, false, &[sb], &[desc]).unwrap();
    assert!(a.wait(x, Some(Duration::from_secs(30))).is_err());
    assert!(dst.iter().all(|&v| v == 0));
}

/// A peer's same-host connections take room in the endpoint's totals
/// (TCPX_P2P_MAX_CONNS), counted and taken at once: hellos finishing
/// together cannot pass the bound, the refused peers read why, and a
/// connection that goes gives its room back.
#[test]
fn peers_connections_are_bounded_by_the_totals() {
    let cfg = |max_conns| Config {
        ifname: Some("lo".into()),
        max_conns,
        ..Config::default()
    };
    let b = Endpoint::new(None, cfg(2)).unwrap();
    let meta = b.metadata();
    let peers: Vec<Endpoint> = (0..6)
        .map(|_| Endpoint::new(None, cfg(256)).unwrap())
        .collect();
    let results: Vec<Result<u64, Error>> = std::thread::scope(|s| {
        let hs: Vec<_> = peers
            .iter()
            .map(|p| {
                let meta = meta.clone();
                s.spawn(move || p.connect_local(&LocalPeer::Metadata(meta)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok: Vec<usize> = (0..results.len()).filter(|&i| results[i].is_ok()).collect();
    assert_eq!(ok.len(), 2, "{results:?}");
    for r in results.iter().filter(|r| r.is_err()) {
        let e = r.as_ref().unwrap_err().to_string();
        assert!(e.contains("TCPX_P2P_MAX_CONNS"), "{e}");
    }
    // Both accepted connections work; once one goes, a refused peer gets in.
    let mut taken = Vec::new();
    for _ in 0..2 {
        taken.push(b.accept_local(Some(Duration::from_secs(10))).unwrap().conn);
    }
    b.remove_conn(taken[0]).unwrap();
    let refused = (0..peers.len()).find(|i| !ok.contains(i)).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let again = loop {
        match peers[refused].connect_local(&LocalPeer::Metadata(meta.clone())) {
            Ok(c) => break c,
            Err(e) if std::time::Instant::now() < deadline => {
                assert!(e.to_string().contains("TCPX_P2P_MAX_CONNS"), "{e}");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("no room came back: {e}"),
        }
    };
    let cb = b.accept_local(Some(Duration::from_secs(10))).unwrap().conn;
    let n = 4096;
    let src = pattern(n, 3);
    let mut dst = vec![0u8; n];
    let info = b.advertise_ipc(cb, dst.as_mut_ptr() as u64, n).unwrap();
    peers[refused]
        .write_ipc(again, &[(src.as_ptr() as u64, n)], &[&info])
        .unwrap();
    assert_eq!(dst, src);
}
