//! The same-host net between two comms of this process (cross-memory
//! attach works on our own pid as on a peer's), and against a raw peer
//! that forges its messages.

use std::io::{Read, Write};

use super::*;

fn host(buf: &[u8]) -> MemRef {
    MemRef {
        addr: buf.as_ptr() as u64,
        len: buf.len(),
        kind: MemKind::Host,
    }
}

fn pattern(n: usize, seed: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

/// Tests `req` until it is done (or fails), within 5 s.
fn wait<F: FnMut(ReqId) -> Result<Option<usize>, NetError>>(
    mut test: F,
    req: ReqId,
) -> Result<usize, NetError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(n) = test(req)? {
            return Ok(n);
        }
        assert!(Instant::now() < deadline, "request {req:?} not done in 5 s");
        std::thread::yield_now();
    }
}

/// Drives both comms until the send and the receive are done.
fn both(
    s: &mut dyn SendComm,
    r: &mut dyn RecvComm,
    sreq: ReqId,
    rreq: ReqId,
) -> (Result<usize, NetError>, Result<usize, NetError>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let (mut sd, mut rd) = (None, None);
    while sd.is_none() || rd.is_none() {
        if rd.is_none() {
            match r.test(rreq) {
                Ok(Some(n)) => rd = Some(Ok(n)),
                Ok(None) => {}
                Err(e) => rd = Some(Err(e)),
            }
        }
        if sd.is_none() {
            match s.test(sreq) {
                Ok(Some(n)) => sd = Some(Ok(n)),
                Ok(None) => {}
                Err(e) => sd = Some(Err(e)),
            }
        }
        assert!(Instant::now() < deadline, "pair not done in 5 s");
    }
    (sd.unwrap(), rd.unwrap())
}

#[test]
fn sends_land_in_posting_order_with_every_byte() {
    let (mut s, mut r) = test_pair();
    let sizes = [1usize, 4096, 65_537, 3 << 20, 17];
    let srcs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| pattern(n, i as u32))
        .collect();
    let mut dsts: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n + 64]).collect();
    // Sends first for the first half, receives first for the rest.
    let mut sreqs = Vec::new();
    let mut rreqs = Vec::new();
    for (i, src) in srcs.iter().enumerate() {
        let post_recv = |r: &mut Box<dyn RecvComm>, d: &mut Vec<u8>| {
            r.irecv(host(d), MrHandle(0)).unwrap().unwrap()
        };
        if i % 2 == 0 {
            sreqs.push(s.isend(host(src), MrHandle(0)).unwrap().unwrap());
            rreqs.push(post_recv(&mut r, &mut dsts[i]));
        } else {
            rreqs.push(post_recv(&mut r, &mut dsts[i]));
            sreqs.push(s.isend(host(src), MrHandle(0)).unwrap().unwrap());
        }
    }
    for i in 0..sizes.len() {
        let (sn, rn) = both(s.as_mut(), r.as_mut(), sreqs[i], rreqs[i]);
        assert_eq!(sn.unwrap(), sizes[i]);
        assert_eq!(rn.unwrap(), sizes[i]);
    }
    for (i, src) in srcs.iter().enumerate() {
        assert_eq!(&dsts[i][..sizes[i]], &src[..], "message {i}");
        assert!(
            dsts[i][sizes[i]..].iter().all(|&b| b == 0),
            "message {i}: past its end"
        );
    }
}

#[test]
fn gathered_sends_scatter_across_other_cuts() {
    let (mut s, mut r) = test_pair();
    let src = pattern(300_001, 9);
    let mut dst = vec![0u8; src.len()];
    // Three send segments, two receive segments, cut elsewhere.
    let ss = [
        host(&src[..1000]),
        host(&src[1000..200_000]),
        host(&src[200_000..]),
    ];
    let (a, b) = dst.split_at_mut(123_457);
    let rs = [host(a), host(b)];
    let rq = r.irecvv(&rs, &[MrHandle(0); 2]).unwrap().unwrap();
    let sq = s.isendv(&ss, &[MrHandle(0); 3]).unwrap().unwrap();
    let (sn, rn) = both(s.as_mut(), r.as_mut(), sq, rq);
    assert_eq!((sn.unwrap(), rn.unwrap()), (src.len(), src.len()));
    assert_eq!(dst, src);
}

#[test]
fn a_send_longer_than_its_receive_fails_both_and_writes_nothing() {
    let (mut s, mut r) = test_pair();
    let src = pattern(8192, 3);
    // The posted receive is the middle 4096 bytes; guards on both sides.
    let mut dst = vec![0xeeu8; 3 * 4096];
    let rq = r
        .irecv(host(&dst[4096..8192]), MrHandle(0))
        .unwrap()
        .unwrap();
    let sq = s.isend(host(&src), MrHandle(0)).unwrap().unwrap();
    let (sn, rn) = both(s.as_mut(), r.as_mut(), sq, rq);
    assert!(sn
        .unwrap_err()
        .to_string()
        .contains("8192 bytes into a receive of 4096"));
    assert!(rn.is_err());
    assert!(dst.iter().all(|&b| b == 0xee));
    // The pair after it still works.
    let small = pattern(4096, 4);
    let rq = r
        .irecv(host(&dst[4096..8192]), MrHandle(0))
        .unwrap()
        .unwrap();
    let sq = s.isend(host(&small), MrHandle(0)).unwrap().unwrap();
    let (sn, rn) = both(s.as_mut(), r.as_mut(), sq, rq);
    assert_eq!((sn.unwrap(), rn.unwrap()), (4096, 4096));
    assert_eq!(&dst[4096..8192], &small[..]);
    assert!(dst[..4096].iter().chain(&dst[8192..]).all(|&b| b == 0xee));
    dst.clear();
}

#[test]
fn a_full_window_asks_the_caller_to_retry() {
    let (mut s, mut r) = test_pair();
    let src = pattern(64, 1);
    let mut reqs = Vec::new();
    for _ in 0..MAX_REQUESTS {
        reqs.push(s.isend(host(&src), MrHandle(0)).unwrap().unwrap());
    }
    assert_eq!(s.isend(host(&src), MrHandle(0)).unwrap(), None);
    let mut dst = vec![0u8; 64];
    for q in reqs {
        let rq = r.irecv(host(&dst), MrHandle(0)).unwrap().unwrap();
        let (sn, rn) = both(s.as_mut(), r.as_mut(), q, rq);
        assert_eq!((sn.unwrap(), rn.unwrap()), (64, 64));
        assert_eq!(dst, src);
        dst.fill(0);
    }
}

// ------------------------------------------------------------ a raw peer

/// A raw connector on a listen comm of ours: writes whatever it is told.
fn raw_connector(l: &SameHostListen, secret: u64) -> UnixStream {
    let h = NetHandleV1::decode(&l.handle).unwrap();
    let addr =
        SocketAddr::from_abstract_name(listen_name(os::my_uid(), h.name).as_bytes()).unwrap();
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    put(&mut s, &NetMsg::Hello { secret });
    s
}

fn put(s: &mut UnixStream, m: &NetMsg) {
    let mut b = vec![0u8; 4];
    m.encode(&mut b);
    let n = (b.len() - 4) as u32;
    b[..4].copy_from_slice(&n.to_le_bytes());
    s.write_all(&b).unwrap();
}

fn take(s: &mut UnixStream) -> NetMsg {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut n = [0u8; 4];
    s.read_exact(&mut n).unwrap();
    let mut b = vec![0u8; u32::from_le_bytes(n) as usize];
    s.read_exact(&mut b).unwrap();
    NetMsg::decode(&b).unwrap()
}

fn net() -> SameHostNet {
    SameHostNet::new(SameHostConfig {
        any_uid: false,
        gpu: None,
        timeout: Duration::from_secs(5),
        linger: Duration::from_millis(5),
        pull: true,
    })
}

fn accept(l: &mut SameHostListen) -> SameHostRecv {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(r) = l.accept_here(Arc::new(|| {})).unwrap() {
            return r;
        }
        assert!(Instant::now() < deadline, "no accept");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_connector_without_the_secret_gets_no_comm() {
    let n = net();
    let mut l = n.listen_here().unwrap();
    let secret = NetHandleV1::decode(&l.handle).unwrap().secret;
    let mut stranger = raw_connector(&l, secret ^ 1);
    std::thread::sleep(Duration::from_millis(20));
    assert!(l.accept_here(Arc::new(|| {})).unwrap().is_none());
    // The stranger's channel was closed.
    let mut b = [0u8; 1];
    stranger
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert_eq!(stranger.read(&mut b).unwrap(), 0);
    // The rightful connector is still accepted, with what it sent at once.
    let _good = raw_connector(&l, secret);
    accept(&mut l);
}

/// A forged or stale publication is refused, and not a byte lands outside
/// (or inside) the posted range.
#[test]
fn forged_publications_are_refused_without_a_byte_written() {
    let src = pattern(4096, 5);
    let cases: Vec<(&str, Vec<NetMsg>)> = vec![
        (
            "a stale sequence number",
            vec![NetMsg::Send {
                seq: 7,
                segs: vec![Seg {
                    addr: src.as_ptr() as u64,
                    len: 4096,
                    export: None,
                }],
            }],
        ),
        (
            "a send longer than the receive",
            vec![NetMsg::Send {
                seq: 0,
                segs: vec![Seg {
                    addr: src.as_ptr() as u64,
                    len: 4097,
                    export: None,
                }],
            }],
        ),
        (
            "a completion from the sender",
            vec![NetMsg::Pushed { seq: 0 }],
        ),
        ("a second hello", vec![NetMsg::Hello { secret: 1 }]),
    ];
    for (what, msgs) in cases {
        let n = net();
        let mut l = n.listen_here().unwrap();
        let secret = NetHandleV1::decode(&l.handle).unwrap().secret;
        let mut raw = raw_connector(&l, secret);
        let mut r = accept(&mut l);
        let mut dst = vec![0xa5u8; 3 * 4096];
        let rq = r
            .irecv(host(&dst[4096..8192]), MrHandle(0))
            .unwrap()
            .unwrap();
        for m in &msgs {
            put(&mut raw, m);
        }
        let got = wait(|q| r.test(q), rq);
        assert!(got.is_err(), "{what}: accepted");
        assert!(dst.iter().all(|&b| b == 0xa5), "{what}: bytes written");
        // An over-long send is refused to the sender, the comm lives on;
        // anything else ends the comm.
        if what.contains("longer") {
            assert!(matches!(take(&mut raw), NetMsg::Refused { seq: 0, .. }));
        } else {
            let rq = r.irecv(host(&dst[..4096]), MrHandle(0));
            assert!(rq.is_err(), "{what}: the comm lives on");
        }
        dst.clear();
    }
}

/// A raw listener for a send comm of ours: answers whatever it is told.
fn raw_listener() -> (UnixListener, NetHandle) {
    let h = NetHandleV1 {
        name: random_secret(),
        secret: 77,
        uid: os::my_uid(),
    };
    let addr = SocketAddr::from_abstract_name(listen_name(h.uid, h.name).as_bytes()).unwrap();
    (UnixListener::bind_addr(&addr).unwrap(), h.encode())
}

#[test]
fn forged_answers_to_a_sender_end_the_comm() {
    let src = pattern(1000, 6);
    let cases: Vec<(&str, NetMsg)> = vec![
        (
            "a completion of a send never made",
            NetMsg::Done { seq: 1, len: 1000 },
        ),
        (
            "a completion of the wrong length",
            NetMsg::Done { seq: 0, len: 999 },
        ),
        (
            "a publication from the receiver",
            NetMsg::Send {
                seq: 0,
                segs: vec![Seg {
                    addr: 4096,
                    len: 1,
                    export: None,
                }],
            },
        ),
        (
            "a push target smaller than the send",
            NetMsg::Push {
                seq: 0,
                segs: vec![Seg {
                    addr: src.as_ptr() as u64,
                    len: 10,
                    export: None,
                }],
            },
        ),
    ];
    for (what, m) in cases {
        let (ls, handle) = raw_listener();
        let mut s = net().connect_here(&handle, Arc::new(|| {})).unwrap();
        let (mut raw, _) = ls.accept().unwrap();
        assert_eq!(take(&mut raw), NetMsg::Hello { secret: 77 });
        let q = s.isend(host(&src), MrHandle(0)).unwrap().unwrap();
        assert!(matches!(take(&mut raw), NetMsg::Send { seq: 0, .. }));
        put(&mut raw, &m);
        let e = wait(|q| s.test(q), q).unwrap_err();
        assert!(matches!(e, NetError::Protocol { .. }), "{what}: {e}");
        assert!(
            s.isend(host(&src), MrHandle(0)).is_err(),
            "{what}: lives on"
        );
    }
    // The honest answer completes it.
    let (ls, handle) = raw_listener();
    let mut s = net().connect_here(&handle, Arc::new(|| {})).unwrap();
    let (mut raw, _) = ls.accept().unwrap();
    take(&mut raw);
    let q = s.isend(host(&src), MrHandle(0)).unwrap().unwrap();
    take(&mut raw);
    put(&mut raw, &NetMsg::Done { seq: 0, len: 1000 });
    assert_eq!(wait(|q| s.test(q), q).unwrap(), 1000);
}

#[test]
fn a_closed_peer_fails_what_is_open() {
    let (mut s, r) = test_pair();
    let src = pattern(100, 2);
    let q = s.isend(host(&src), MrHandle(0)).unwrap().unwrap();
    drop(r);
    let e = wait(|q| s.test(q), q).unwrap_err();
    assert!(matches!(e, NetError::Closed { .. }), "{e}");
}

#[test]
fn a_listener_of_another_name_is_not_reached() {
    // A handle whose name nobody bound: the connect fails, nothing hangs.
    let h = NetHandleV1 {
        name: random_secret(),
        secret: 1,
        uid: os::my_uid(),
    };
    assert!(net().connect_here(&h.encode(), Arc::new(|| {})).is_err());
    // A handle that is not one.
    assert!(net()
        .connect_here(&[0u8; super::super::NET_HANDLE_LEN], Arc::new(|| {}))
        .is_err());
}

/// GPU memory on either side or both (between two comms of one process
/// the export is the address itself; across processes the same code opens
/// the CUDA IPC handle): host → GPU is pushed by the sender, GPU → host and
/// GPU → GPU pulled by the receiver. Skipped without a GPU.
#[test]
#[allow(unsafe_code)] // copies to and from device memory to check it
fn gpu_memory_either_side() {
    if !gpu::available() {
        eprintln!("no GPU: skipped");
        return;
    }
    let dev = gpu::Device::get(0).unwrap();
    let n = (5 << 20) + 3;
    let src = pattern(n, 11);
    let da = gpu::DeviceBuf::new(&dev, n).unwrap();
    let db = gpu::DeviceBuf::new(&dev, n).unwrap();
    let cuda = |b: &gpu::DeviceBuf| MemRef {
        addr: b.ptr,
        len: n,
        kind: MemKind::Cuda(0),
    };
    let (mut s, mut r) = test_pair();
    // Host → GPU a (the sender pushes).
    let rq = r.irecv(cuda(&da), MrHandle(0)).unwrap().unwrap();
    let sq = s.isend(host(&src), MrHandle(0)).unwrap().unwrap();
    let (sn, rn) = both(s.as_mut(), r.as_mut(), sq, rq);
    assert_eq!((sn.unwrap(), rn.unwrap()), (n, n));
    // GPU a → GPU b (the receiver pulls through the export).
    let rq = r.irecv(cuda(&db), MrHandle(0)).unwrap().unwrap();
    let sq = s.isend(cuda(&da), MrHandle(0)).unwrap().unwrap();
    let (sn, rn) = both(s.as_mut(), r.as_mut(), sq, rq);
    assert_eq!((sn.unwrap(), rn.unwrap()), (n, n));
    // GPU b → host (the receiver pulls).
    let back = vec![0u8; n];
    let rq = r.irecv(host(&back), MrHandle(0)).unwrap().unwrap();
    let sq = s.isend(cuda(&db), MrHandle(0)).unwrap().unwrap();
    let (sn, rn) = both(s.as_mut(), r.as_mut(), sq, rq);
    assert_eq!((sn.unwrap(), rn.unwrap()), (n, n));
    assert_eq!(back, src, "host → GPU → GPU → host");
    // And GPU a itself, read straight back.
    let mut direct = vec![0u8; n];
    dev.bind().unwrap();
    // SAFETY: both ranges are n bytes, ours.
    unsafe { gpu::copy_sync(direct.as_mut_ptr() as u64, da.ptr, n) }.unwrap();
    assert_eq!(direct, src);
}

/// What one pair costs at the net alone (printed): p50 of a blocking
/// send/receive of each size between two comms of this process.
#[test]
#[ignore = "a measurement: prints figures"]
fn pair_cost() {
    let (mut s, mut r) = test_pair();
    for n in [64usize << 10, 1 << 20, 16 << 20] {
        let src = pattern(n, 1);
        let dst = vec![0u8; n];
        let mut t = Vec::new();
        for _ in 0..50 {
            let t0 = Instant::now();
            let rq = r.irecv(host(&dst), MrHandle(0)).unwrap().unwrap();
            let sq = s.isend(host(&src), MrHandle(0)).unwrap().unwrap();
            let (a, b) = both(s.as_mut(), r.as_mut(), sq, rq);
            a.unwrap();
            b.unwrap();
            t.push(t0.elapsed());
        }
        t.sort();
        eprintln!("same-host net pair, {n} bytes: p50 {:?}", t[t.len() / 2]);
        assert_eq!(dst, src);
    }
}

/// The pull key of `buf` (host memory), as a writer's net makes it.
fn key_of(buf: &[u8]) -> Arc<[u8]> {
    Arc::from(net().export(host(buf)).expect("host memory is exported"))
}

/// The first 300,001 bytes of export `key` as two pieces, cut at 100,000
/// (elsewhere than the tests' own segments, cut at 77,777).
fn two_pieces(key: &Arc<[u8]>) -> [RemoteRef; 2] {
    [
        RemoteRef {
            key: key.clone(),
            off: 0,
            len: 100_000,
        },
        RemoteRef {
            key: key.clone(),
            off: 100_000,
            len: 200_001,
        },
    ]
}

#[test]
fn a_pull_copies_exported_ranges_across_other_cuts_and_leaves_the_pairing_alone() {
    let (mut s, mut r) = test_pair();
    let src = pattern(300_001, 5);
    let key = key_of(&src);
    let mut dst = vec![0u8; src.len() + 64];
    // Two pieces of the one export, landing in two segments cut elsewhere.
    let pieces = two_pieces(&key);
    let (a, b) = dst[..src.len()].split_at_mut(77_777);
    let segs = [host(a), host(b)];
    // A send published before the pull must pair with the next receive.
    let msg = pattern(4096, 6);
    let sq = s.isend(host(&msg), MrHandle(0)).unwrap().unwrap();
    let pq = r.ipull(&segs, &pieces).unwrap().unwrap();
    assert_eq!(wait(|q| r.test(q), pq).unwrap(), src.len());
    assert_eq!(&dst[..src.len()], &src[..]);
    assert!(dst[src.len()..].iter().all(|&x| x == 0), "past the pull");
    let mut got = vec![0u8; 4096];
    let rq = r.irecv(host(&got), MrHandle(0)).unwrap().unwrap();
    let (sn, rn) = both(s.as_mut(), r.as_mut(), sq, rq);
    assert_eq!((sn.unwrap(), rn.unwrap()), (4096, 4096));
    got.truncate(4096);
    assert_eq!(got, msg);
}

#[test]
fn a_pull_past_its_export_or_of_the_wrong_length_is_refused_and_the_comm_goes_on() {
    let (_s, mut r) = test_pair();
    let src = pattern(8192, 8);
    let key = key_of(&src[..4096]);
    let dst = vec![0u8; 8192];
    // Past the export's end (the writer exported 4096 bytes).
    let past = [RemoteRef {
        key: key.clone(),
        off: 4096,
        len: 4096,
    }];
    let q = r.ipull(&[host(&dst[..4096])], &past).unwrap().unwrap();
    let e = wait(|q| r.test(q), q).unwrap_err();
    assert!(e.to_string().contains("exported"), "{e}");
    // Pieces shorter than the segments they fill.
    let short = [RemoteRef {
        key: key.clone(),
        off: 0,
        len: 100,
    }];
    let q = r.ipull(&[host(&dst[..4096])], &short).unwrap().unwrap();
    let e = wait(|q| r.test(q), q).unwrap_err();
    assert!(e.to_string().contains("against 4096 bytes of ours"), "{e}");
    assert!(dst.iter().all(|&x| x == 0), "a refused pull wrote");
    // The comm still pulls.
    let ok = [RemoteRef {
        key,
        off: 0,
        len: 4096,
    }];
    let q = r.ipull(&[host(&dst[4096..])], &ok).unwrap().unwrap();
    assert_eq!(wait(|q| r.test(q), q).unwrap(), 4096);
    assert_eq!(&dst[4096..], &src[..4096]);
}

#[test]
fn a_key_that_is_no_export_ends_the_comm() {
    let (_s, mut r) = test_pair();
    let dst = vec![0u8; 64];
    let junk = [RemoteRef {
        key: Arc::from(vec![7u8; 40]),
        off: 0,
        len: 64,
    }];
    assert!(r.ipull(&[host(&dst)], &junk).is_err());
    let src = pattern(64, 1);
    let ok = [RemoteRef {
        key: key_of(&src),
        off: 0,
        len: 64,
    }];
    assert!(r.ipull(&[host(&dst)], &ok).is_err(), "the comm has ended");
    assert!(dst.iter().all(|&x| x == 0));
}

#[test]
fn a_push_copies_into_exported_ranges_and_leaves_the_sends_numbering_alone() {
    let (mut s, mut r) = test_pair();
    let src = pattern(300_001, 9);
    let dst = vec![0u8; src.len() + 64];
    let key = key_of(&dst[..src.len()]);
    // Our two segments, cut elsewhere than the two pieces of the export.
    let (a, b) = src.split_at(77_777);
    let pieces = two_pieces(&key);
    let pq = s.ipush(&[host(a), host(b)], &pieces).unwrap().unwrap();
    // A send after the push pairs with the peer's next receive, as if the
    // push were not there.
    let msg = pattern(4096, 10);
    let sq = s.isend(host(&msg), MrHandle(0)).unwrap().unwrap();
    assert_eq!(wait(|q| s.test(q), pq).unwrap(), src.len());
    assert_eq!(&dst[..src.len()], &src[..]);
    assert!(dst[src.len()..].iter().all(|&x| x == 0), "past the push");
    let got = vec![0u8; 4096];
    let rq = r.irecv(host(&got), MrHandle(0)).unwrap().unwrap();
    let (sn, rn) = both(s.as_mut(), r.as_mut(), sq, rq);
    assert_eq!((sn.unwrap(), rn.unwrap()), (4096, 4096));
    assert_eq!(got, msg);
    // Past the export, or of another length: refused, nothing written, and
    // the comm goes on.
    let other = vec![0u8; 4096];
    let okey = key_of(&other);
    let past = [RemoteRef {
        key: okey.clone(),
        off: 1,
        len: 4096,
    }];
    let q = s.ipush(&[host(&msg)], &past).unwrap().unwrap();
    assert!(wait(|q| s.test(q), q).is_err());
    assert!(other.iter().all(|&x| x == 0), "a refused push wrote");
    let ok = [RemoteRef {
        key: okey,
        off: 0,
        len: 4096,
    }];
    let q = s.ipush(&[host(&msg)], &ok).unwrap().unwrap();
    assert_eq!(wait(|q| s.test(q), q).unwrap(), 4096);
    assert_eq!(other, msg);
}
