//! Two endpoints in one process over loopback: every kind of transfer, with
//! the bytes checked.

use std::time::Duration;

use tcpx_p2p::FifoItem;
use tcpx_p2p::{Config, Endpoint, Error, ErrorKind};

mod common;
use common::{blocks, buf, pattern, placed, scrambled, scrambled_offsets};

fn cfg() -> Config {
    Config {
        ifname: Some("lo".into()),
        streams: 3,
        chunk: 256 << 10,
        min_part: 16 << 10,
        ..Config::default()
    }
}

fn pair() -> (Endpoint, Endpoint, u64, u64) {
    pair_with(cfg())
}

/// Two endpoints made with `cfg`, connected: (a, b, a's conn, b's conn).
fn pair_with(cfg: Config) -> (Endpoint, Endpoint, u64, u64) {
    let a = Endpoint::new(None, cfg.clone()).unwrap();
    let b = Endpoint::new(None, cfg).unwrap();
    let addr = b.local_addr();
    let ca = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    let cb = b.accept(Some(Duration::from_secs(10))).unwrap().conn;
    (a, b, ca, cb)
}

#[test]
fn send_recv_many_sizes() {
    let (a, b, ca, cb) = pair();
    for &n in &[1usize, 4096, 1 << 20, 3 * (256 << 10) + 17] {
        let mut src = pattern(n, 1);
        let mut dst = vec![0u8; n];
        let sb = buf(&a, &mut src);
        let rb = buf(&b, &mut dst);
        let r = b.recv_async(cb, &[rb]).unwrap();
        let s = a.send_async(ca, &[sb]).unwrap();
        assert!(a.wait(s, Some(Duration::from_secs(20))).unwrap());
        assert!(b.wait(r, Some(Duration::from_secs(20))).unwrap());
        assert_eq!(src, dst, "size {n}");
    }
}

#[test]
fn send_completes_once_its_bytes_are_out_of_the_callers_buffer() {
    // Posted before any receive, a send that the socket buffers take
    // completes: its bytes are no longer in the caller's buffer, which may
    // be reused at once. Rewritten after the send, the buffer's new bytes
    // never reach the receiver.
    let (a, b, ca, cb) = pair();
    for &n in &[64usize, 4096] {
        let mut src = pattern(n, 5);
        let sent = src.clone();
        let mut dst = vec![0u8; n];
        let sb = buf(&a, &mut src);
        let rb = buf(&b, &mut dst);
        let s = a.send_async(ca, &[sb]).unwrap();
        assert!(
            a.wait(s, Some(Duration::from_secs(20))).unwrap(),
            "a send of {n} bytes waited for its receive"
        );
        src.iter_mut().for_each(|x| *x = !*x);
        let r = b.recv_async(cb, &[rb]).unwrap();
        assert!(b.wait(r, Some(Duration::from_secs(20))).unwrap());
        assert_eq!(sent, dst, "size {n}");
    }
    // Several sends ahead of their receives, larger than the socket
    // buffers together: each lands in its receive, in order.
    let n = 300 << 10;
    let mut srcs: Vec<Vec<u8>> = (0..4).map(|i| pattern(n, 20 + i)).collect();
    let mut dsts = vec![vec![0u8; n]; 4];
    let sends: Vec<_> = srcs
        .iter_mut()
        .map(|s| a.send_async(ca, &[buf(&a, s)]).unwrap())
        .collect();
    let rbs: Vec<_> = dsts.iter_mut().map(|d| buf(&b, d)).collect();
    for rb in rbs {
        let r = b.recv_async(cb, &[rb]).unwrap();
        assert!(b.wait(r, Some(Duration::from_secs(20))).unwrap());
    }
    for s in sends {
        assert!(a.wait(s, Some(Duration::from_secs(20))).unwrap());
    }
    assert_eq!(srcs, dsts);
}

#[test]
fn sender_gone_right_after_send_still_delivers() {
    // The send completes before any receive is posted; dropping the
    // sender's endpoint then waits until the receiver has acknowledged the
    // message, so the receiver still gets every byte.
    let (a, b, ca, cb) = pair();
    let n = 4096;
    let mut src = pattern(n, 9);
    let sent = src.clone();
    let sb = buf(&a, &mut src);
    let s = a.send_async(ca, &[sb]).unwrap();
    assert!(a.wait(s, Some(Duration::from_secs(20))).unwrap());
    let posted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = posted.clone();
    let t = std::thread::spawn(move || {
        drop(a);
        // The drop ended only after the receiver's acknowledgement, which
        // follows its receive, posted after the flag was set.
        seen.load(std::sync::atomic::Ordering::Acquire)
    });
    std::thread::sleep(Duration::from_millis(300));
    let mut dst = vec![0u8; n];
    let rb = buf(&b, &mut dst);
    posted.store(true, std::sync::atomic::Ordering::Release);
    let r = b.recv_async(cb, &[rb]).unwrap();
    assert!(b.wait(r, Some(Duration::from_secs(20))).unwrap());
    assert!(
        t.join().unwrap(),
        "the drop ended before the message landed"
    );
    assert_eq!(sent, dst);
}

#[test]
fn closing_with_a_message_never_received_ends_at_the_deadline() {
    // The peer never posts a receive: removing the connection waits for
    // the acknowledgement only until the deadline, then closes.
    let (a, _b, ca, _cb) = pair_with(Config {
        deadline: Duration::from_millis(1500),
        ..cfg()
    });
    let mut src = pattern(4096, 3);
    let sb = buf(&a, &mut src);
    let s = a.send_async(ca, &[sb]).unwrap();
    assert!(a.wait(s, Some(Duration::from_secs(20))).unwrap());
    let (done, wait_done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        a.remove_conn(ca).unwrap();
        done.send(()).unwrap();
    });
    // Bounded: the deadline, with room for a loaded machine.
    wait_done
        .recv_timeout(Duration::from_secs(30))
        .expect("close did not end");
}

#[test]
fn cancel_ends_a_transfer_whole_or_not_at_all() {
    // Cancelled right after posting: a write the target has not cleared
    // yet is called back (nothing lands), one already cleared runs to its
    // end (everything lands); never a part of it, and the connection goes
    // on either way.
    let cfg = Config {
        inline_max: 0,
        ..cfg()
    };
    let (a, b, ca, cb) = pair_with(cfg);
    let n = 1 << 20;
    let mut src = pattern(n, 8);
    let sb = buf(&a, &mut src);
    let (mut called_back, mut ran) = (0, 0);
    for i in 0..20 {
        let mut target = vec![0u8; n];
        let tb = buf(&b, &mut target);
        let meta = FifoItem::decode(&b.advertise(cb, tb.mr, tb.ptr, n).unwrap()).unwrap();
        let w = a.write_async(ca, &[sb], &[meta]).unwrap();
        if i % 2 == 1 {
            std::thread::yield_now();
        }
        assert!(a.cancel(w, Some(Duration::from_secs(20))).unwrap());
        assert!(a.poll(w).is_err(), "the id is forgotten once ended");
        // The target's side ends too (its receives filled or refused).
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while b.dereg(tb.mr).is_err() {
            assert!(std::time::Instant::now() < deadline, "target still busy");
            std::thread::sleep(Duration::from_millis(2));
        }
        if target == src {
            ran += 1;
        } else {
            assert!(target.iter().all(|&x| x == 0), "a part of a write landed");
            called_back += 1;
        }
    }
    assert_eq!(called_back + ran, 20);
    // Still in step: a write after them lands whole.
    let mut target = vec![0u8; n];
    let tb = buf(&b, &mut target);
    let meta = FifoItem::decode(&b.advertise(cb, tb.mr, tb.ptr, n).unwrap()).unwrap();
    let w = a.write_async(ca, &[sb], &[meta]).unwrap();
    assert!(a.wait(w, Some(Duration::from_secs(20))).unwrap());
    assert_eq!(target, src);
    eprintln!("cancelled before clearing: {called_back}, ran to the end: {ran}");
}

#[test]
fn inline_reads_both_ways_at_once_do_not_wedge_the_control_connection() {
    // Each side reads 1 MiB inline from the other, 24 at a time, at once:
    // 24 MiB of answers each way through 64 KiB socket buffers. A control
    // thread that waited to write its answers while the peer's did the
    // same would never read again (before the control connection's writes
    // were made never to wait, this timed out).
    let cfg = Config {
        inline_max: 1 << 20,
        sockbuf: 64 << 10,
        ..cfg()
    };
    let (a, b, ca, cb) = pair_with(cfg);
    let (n, k) = (1 << 20, 24);
    let mut src_a = pattern(n, 21);
    let mut src_b = pattern(n, 22);
    let sa = buf(&a, &mut src_a);
    let sb = buf(&b, &mut src_b);
    let meta_a = FifoItem::decode(&a.advertise(ca, sa.mr, sa.ptr, n).unwrap()).unwrap();
    let meta_b = FifoItem::decode(&b.advertise(cb, sb.mr, sb.ptr, n).unwrap()).unwrap();
    let mut into_a: Vec<Vec<u8>> = (0..k).map(|_| vec![0u8; n]).collect();
    let mut into_b: Vec<Vec<u8>> = (0..k).map(|_| vec![0u8; n]).collect();
    let bufs_a: Vec<_> = into_a.iter_mut().map(|v| buf(&a, v)).collect();
    let bufs_b: Vec<_> = into_b.iter_mut().map(|v| buf(&b, v)).collect();
    let mut ids = Vec::new();
    for i in 0..k {
        ids.push((0, a.read_async(ca, &[bufs_a[i]], &[meta_b]).unwrap()));
        ids.push((1, b.read_async(cb, &[bufs_b[i]], &[meta_a]).unwrap()));
    }
    for (side, id) in ids {
        let ep = if side == 0 { &a } else { &b };
        assert!(
            ep.wait(id, Some(Duration::from_secs(30))).unwrap(),
            "read {id} did not end"
        );
    }
    assert!(into_a.iter().all(|v| *v == src_b));
    assert!(into_b.iter().all(|v| *v == src_a));
}

#[test]
fn write_read_and_refusals() {
    let (a, b, ca, cb) = pair();
    let n = 1 << 20;
    let mut target = vec![0u8; n];
    let tb = buf(&b, &mut target);
    let desc = b.advertise(cb, tb.mr, tb.ptr + 4096, n - 8192).unwrap();
    let meta = FifoItem::decode(&desc).unwrap();

    let mut src = pattern(n - 8192, 7);
    let sb = buf(&a, &mut src);
    let w = a.write_async(ca, &[sb], &[meta]).unwrap();
    assert!(a.wait(w, Some(Duration::from_secs(20))).unwrap());
    assert_eq!(&target[4096..n - 4096], &src[..], "write landed");
    assert!(
        target[..4096].iter().all(|&x| x == 0),
        "nothing before the advertised range"
    );

    let mut back = vec![0u8; n - 8192];
    let bb = buf(&a, &mut back);
    let r = a.read_async(ca, &[bb], &[meta]).unwrap();
    assert!(a.wait(r, Some(Duration::from_secs(20))).unwrap());
    assert_eq!(back, src);

    // A forged descriptor: a larger size and an address before the range.
    let mut forged = meta;
    forged.addr -= 4096;
    let mut big = vec![9u8; n - 8192];
    let gb = buf(&a, &mut big);
    let w = a.write_async(ca, &[gb], &[forged]).unwrap();
    match a.wait(w, Some(Duration::from_secs(20))) {
        Err(Error::Refused { .. }) => {}
        other => panic!("forged write must be refused, got {other:?}"),
    }
    assert!(
        target[..4096].iter().all(|&x| x == 0),
        "forged write wrote nothing"
    );
    let r = a.read_async(ca, &[gb], &[forged]).unwrap();
    assert!(matches!(
        a.wait(r, Some(Duration::from_secs(20))),
        Err(Error::Refused { .. })
    ));

    // The connection still works afterwards.
    let w = a.write_async(ca, &[sb], &[meta]).unwrap();
    assert!(a.wait(w, Some(Duration::from_secs(20))).unwrap());

    // Stale after dereg.
    b.dereg(tb.mr).unwrap();
    let w = a.write_async(ca, &[sb], &[meta]).unwrap();
    assert!(matches!(
        a.wait(w, Some(Duration::from_secs(20))),
        Err(Error::Refused { .. })
    ));
}

#[test]
fn peer_drop_fails_pending() {
    let (a, b, ca, _cb) = pair();
    let mut dst = vec![0u8; 1000];
    let rb = buf(&a, &mut dst);
    let r = a.recv_async(ca, &[rb]).unwrap();
    drop(b);
    // Which layer notices first (the control stream's close, or a data
    // stream's end) decides the variant; the kind is the contract.
    match a.wait(r, Some(Duration::from_secs(20))) {
        Err(e) if e.kind() == ErrorKind::Lost => {}
        other => panic!("a dropped peer must fail the receive as lost, got {other:?}"),
    }
}

#[test]
fn advertised_to_any_connection() {
    // b advertises one range without naming a connection; two different
    // connections to b may use it, and only that range.
    let (a, b, ca, _cb) = pair();
    let c = Endpoint::new(None, cfg()).unwrap();
    let addr = b.local_addr();
    let cc = c
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    b.accept(Some(Duration::from_secs(10))).unwrap();
    let n = 64 << 10;
    let mut target = vec![0u8; n];
    let tb = buf(&b, &mut target);
    let desc = b.advertise_any(tb.mr, tb.ptr + 1024, n - 2048).unwrap();
    let meta = FifoItem::decode(&desc).unwrap();

    let mut one = pattern(n - 2048, 3);
    let ob = buf(&a, &mut one);
    let w = a.write_async(ca, &[ob], &[meta]).unwrap();
    assert!(a.wait(w, Some(Duration::from_secs(20))).unwrap());
    assert_eq!(&target[1024..n - 1024], &one[..]);

    let mut back = vec![0u8; n - 2048];
    let bb = buf(&c, &mut back);
    let r = c.read_async(cc, &[bb], &[meta]).unwrap();
    assert!(c.wait(r, Some(Duration::from_secs(20))).unwrap());
    assert_eq!(back, one, "read on another connection");

    // Past the advertised range: refused, nothing written.
    let mut forged = meta;
    forged.addr -= 1024;
    let mut big = vec![9u8; n - 2048];
    let gb = buf(&c, &mut big);
    let w = c.write_async(cc, &[gb], &[forged]).unwrap();
    assert!(matches!(
        c.wait(w, Some(Duration::from_secs(20))),
        Err(Error::Refused { .. })
    ));
    assert!(target[..1024].iter().all(|&x| x == 0));
    // A wrong secret: refused.
    let mut wrong = meta;
    wrong.token.secret ^= 1;
    let w = c.write_async(cc, &[gb], &[wrong]).unwrap();
    assert!(matches!(
        c.wait(w, Some(Duration::from_secs(20))),
        Err(Error::Refused { .. })
    ));
    assert_eq!(&target[1024..n - 1024], &one[..]);
}

#[test]
fn a_burst_of_small_transfers_never_fills_the_control_backlog() {
    // Small one-sided transfers ride the control connection (inline). A
    // burst of them, posted faster than the target lands them, would fill
    // the control backlog past its bound and fail the connection; past a
    // backlog (writes) or a count of reads awaiting their data, further
    // ones take the net instead. Every byte lands. (64 KiB control socket
    // buffers slow the target's reading, as a loaded machine does.)
    let (a, b, ca, cb) = pair_with(Config {
        sockbuf: 64 << 10,
        ..cfg()
    });
    let (n, count) = (64 << 10, 1536); // 96 MiB in all, over the 64 MiB bound
    let mut src = pattern(n, 41);
    let mut target = vec![0u8; n];
    let sb = buf(&a, &mut src);
    let tb = buf(&b, &mut target);
    let meta = FifoItem::decode(&b.advertise(cb, tb.mr, tb.ptr, n).unwrap()).unwrap();
    let writes: Vec<u64> = (0..count)
        .map(|_| a.write_async(ca, &[sb], &[meta]).unwrap())
        .collect();
    for w in writes {
        assert!(a.wait(w, Some(Duration::from_secs(60))).unwrap());
    }
    assert_eq!(target, src);
    let mut back = vec![0u8; n];
    let bb = buf(&a, &mut back);
    let reads: Vec<u64> = (0..count)
        .map(|_| a.read_async(ca, &[bb], &[meta]).unwrap())
        .collect();
    for r in reads {
        assert!(a.wait(r, Some(Duration::from_secs(60))).unwrap());
    }
    assert_eq!(back, src);
}

/// One write and one read of 20,000 blocks (several requests under one
/// transfer), landing in a scrambled order as KV blocks do: every block
/// where it belongs, both ways. A list with one block outside what the
/// peer advertised, or one outside our own registration, is refused whole,
/// before any part is posted.
#[test]
fn many_scattered_blocks_move_as_one_transfer_of_several_requests() {
    let (a, b, ca, cb) = pair();
    let (count, bs) = (20_000usize, 64usize);
    let n = count * bs;
    let mut target = vec![0u8; n];
    let tb = buf(&b, &mut target);
    let desc = b.advertise(cb, tb.mr, tb.ptr, n).unwrap();
    let remote = tcpx_p2p::RemoteDesc::from(&FifoItem::decode(&desc).unwrap());
    let mut src = pattern(n, 3);
    let sb = buf(&a, &mut src);
    let pieces = |base: &tcpx_p2p::Buf| blocks(base, count, bs);
    let offs = scrambled_offsets(remote, count, bs);

    let w = a.rma_async(ca, false, &pieces(&sb), &offs, None).unwrap();
    assert!(a.wait(w, Some(Duration::from_secs(60))).unwrap());
    assert!(placed(&target, &src, bs), "every block where it belongs");

    let mut back = vec![0u8; n];
    let bb = buf(&a, &mut back);
    let r = a.rma_async(ca, true, &pieces(&bb), &offs, None).unwrap();
    assert!(a.wait(r, Some(Duration::from_secs(60))).unwrap());
    assert_eq!(back, src, "every block read back in its order");

    // The last block one byte past the advertised range: refused at
    // posting, nothing of the earlier blocks written.
    target.fill(0);
    let mut bad = offs.clone();
    bad[count - 1].1 = (n - bs + 1) as u64;
    assert!(a.rma_async(ca, false, &pieces(&sb), &bad, None).is_err());
    // Our own last block one byte past our registration: refused whole
    // likewise (every piece is checked before the first part is posted).
    let mut ours_bad = pieces(&sb);
    ours_bad[count - 1].ptr += 1;
    assert!(a.rma_async(ca, false, &ours_bad, &offs, None).is_err());
    std::thread::sleep(Duration::from_millis(200));
    assert!(target.iter().all(|&x| x == 0), "nothing written");
}

/// An inline write (its bytes on the control connection) of more small
/// pieces than one `sendmsg` takes slices (1,024): 3,000 blocks of 16 bytes,
/// scrambled on the target. Every block lands, and the connection lives
/// (such a write failed it with `EMSGSIZE`).
#[test]
fn an_inline_write_of_thousands_of_small_pieces_lands_whole() {
    let (a, b, ca, cb) = pair();
    let (count, bs) = (3_000usize, 16usize);
    let n = count * bs;
    let mut target = vec![0u8; n];
    let tb = buf(&b, &mut target);
    let desc = b.advertise(cb, tb.mr, tb.ptr, n).unwrap();
    let remote = tcpx_p2p::RemoteDesc::from(&FifoItem::decode(&desc).unwrap());
    let mut src = pattern(n, 11);
    let sb = buf(&a, &mut src);
    let offs = scrambled_offsets(remote, count, bs);
    let w = a
        .rma_async(ca, false, &blocks(&sb, count, bs), &offs, None)
        .unwrap();
    assert!(a.wait(w, Some(Duration::from_secs(60))).unwrap());
    assert!(placed(&target, &src, bs), "every block where it belongs");
    assert!(
        matches!(a.conn_failure(ca), Ok(None)),
        "the connection lives"
    );
}

/// UCCL's `writev` / `readv` (a descriptor per block) and the
/// `register_memory` descriptors' `transfer` with more blocks than one
/// request may carry: each call goes in parts under one transfer, as
/// `rma_async` does, never as one request the peer would end the
/// connection over. Every block checked, both ways, on both calls.
#[test]
fn more_blocks_than_one_request_carries_go_in_parts_on_every_one_sided_call() {
    let (a, b, ca, cb) = pair();
    // More than the 65,536 items one request may carry.
    let (count, bs) = (70_001usize, 16usize);
    let n = count * bs;
    let mut target = vec![0u8; n];
    let tb = buf(&b, &mut target);
    let whole = FifoItem::decode(&b.advertise(cb, tb.mr, tb.ptr, n).unwrap()).unwrap();
    let slot = |i: usize| scrambled(i, count);
    let metas: Vec<FifoItem> = (0..count)
        .map(|i| FifoItem {
            addr: whole.addr + (slot(i) * bs) as u64,
            size: bs as u32,
            ..whole
        })
        .collect();
    let pieces = |base: &tcpx_p2p::Buf| blocks(base, count, bs);
    let wait = |ep: &Endpoint, x| assert!(ep.wait(x, Some(Duration::from_secs(60))).unwrap());

    let mut src = pattern(n, 5);
    let sb = buf(&a, &mut src);
    wait(&a, a.write_async(ca, &pieces(&sb), &metas).unwrap());
    assert!(
        placed(&target, &src, bs),
        "writev: every block where it belongs"
    );
    let mut back = vec![0u8; n];
    let bb = buf(&a, &mut back);
    wait(&a, a.read_async(ca, &pieces(&bb), &metas).unwrap());
    assert_eq!(back, src, "readv: every block read back in its order");

    // The same through `register_memory`-style descriptors, one per slot.
    let descs: Vec<_> = (0..count)
        .map(|i| {
            b.export_range(tb.mr, tb.ptr + (slot(i) * bs) as u64, bs)
                .unwrap()
        })
        .collect();
    let mut src2 = pattern(n, 9);
    let sb2 = buf(&a, &mut src2);
    wait(&a, a.transfer(ca, false, &pieces(&sb2), &descs).unwrap());
    assert!(placed(&target, &src2, bs), "transfer (write): every block");
    back.fill(0);
    wait(&a, a.transfer(ca, true, &pieces(&bb), &descs).unwrap());
    assert_eq!(back, src2, "transfer (read): every block");
    assert!(
        matches!(a.conn_failure(ca), Ok(None)),
        "the connection lives"
    );
}

/// A dropped endpoint's listener is closed when the drop returns: a new
/// endpoint binds the same port at once (the listener's task is dropped
/// before the drop returns, not some time after).
#[test]
fn a_dropped_endpoints_port_is_free_at_once() {
    for _ in 0..20 {
        let a = Endpoint::new(None, cfg()).unwrap();
        let port = a.local_addr().port();
        drop(a);
        let b = Endpoint::new(None, Config { port, ..cfg() }).expect("the port is free again");
        assert_eq!(b.local_addr().port(), port);
    }
}
