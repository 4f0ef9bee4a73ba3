//! Notifications between two endpoints in one process over loopback: on
//! their own, attached to writes and reads (delivered only once every byte
//! has landed), the size limit, and a peer that floods the queue.

use std::time::{Duration, Instant};

use tcpx_p2p::notif::{MAX_NOTIF, PER_PEER, QUEUE_MAX};
use tcpx_p2p::FifoItem;
use tcpx_p2p::RemoteDesc;
use tcpx_p2p::{Config, Endpoint, Error, Notif};

mod common;
use common::{buf, pattern};

fn cfg(name: &str) -> Config {
    Config {
        ifname: Some("lo".into()),
        streams: 2,
        chunk: 256 << 10,
        min_part: 16 << 10,
        name: Some(name.into()),
        ..Config::default()
    }
}

fn pair() -> (Endpoint, Endpoint, u64, u64) {
    let a = Endpoint::new(None, cfg("alpha")).unwrap();
    let b = Endpoint::new(None, cfg("beta")).unwrap();
    let addr = b.local_addr();
    let ca = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    let cb = b.accept(Some(Duration::from_secs(10))).unwrap().conn;
    (a, b, ca, cb)
}

/// Polls `ep` until `n` notifications came (or 20 s passed).
fn take(ep: &Endpoint, n: usize) -> Vec<Notif> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        got.extend(ep.get_notifs());
        std::thread::sleep(Duration::from_millis(1));
    }
    got
}

#[test]
fn notif_alone_carries_name_and_bytes() {
    let (a, b, ca, cb) = pair();
    assert_eq!(a.name(), "alpha");
    a.send_notif(ca, b"hello").unwrap();
    a.send_notif(ca, b"").unwrap();
    b.send_notif(cb, &[0xab; 70_000]).unwrap();
    let got = take(&b, 2);
    assert_eq!(
        got,
        vec![
            Notif {
                from_name: "alpha".into(),
                conn: cb,
                msg: b"hello".to_vec()
            },
            Notif {
                from_name: "alpha".into(),
                conn: cb,
                msg: vec![]
            }
        ]
    );
    let got = take(&a, 1);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].from_name.as_str(), got[0].conn), ("beta", ca));
    assert_eq!(got[0].msg, vec![0xab; 70_000]);
    assert!(b.get_notifs().is_empty());
}

#[test]
fn notif_size_limit_and_bad_conn() {
    let (a, _b, ca, _cb) = pair();
    a.send_notif(ca, &vec![1u8; MAX_NOTIF]).unwrap();
    assert!(matches!(
        a.send_notif(ca, &vec![1u8; MAX_NOTIF + 1]),
        Err(Error::Invalid(_))
    ));
    assert!(matches!(a.send_notif(999, b"x"), Err(Error::Invalid(_))));
}

#[test]
fn write_notif_arrives_after_every_byte() {
    let (a, b, ca, cb) = pair();
    let n = 3 << 20;
    let mut target = vec![0u8; n];
    let tb = buf(&b, &mut target);
    let meta = FifoItem::decode(&b.advertise(cb, tb.mr, tb.ptr, n).unwrap()).unwrap();
    let mut src = pattern(n, 3);
    let sb = buf(&a, &mut src);
    let w = a
        .write_async_with_notif(ca, &[sb], &[meta], Some(b"written"))
        .unwrap();
    // The target looks at its buffer the moment the notification shows.
    let got = take(&b, 1);
    assert_eq!(got.len(), 1, "no notification");
    assert_eq!(got[0].msg, b"written");
    assert_eq!(got[0].from_name, "alpha");
    assert!(target == src, "notification before the data landed");
    assert!(a.wait(w, Some(Duration::from_secs(20))).unwrap());
}

#[test]
fn read_notif_goes_to_owner_after_read_completed() {
    let (a, b, ca, cb) = pair();
    let n = 2 << 20;
    let mut owned = pattern(n, 9);
    let ob = buf(&b, &mut owned);
    let desc = b.export_range(ob.mr, ob.ptr, n).unwrap();
    let mut got_back = vec![0u8; n / 2];
    let gb = buf(&a, &mut got_back);
    // Two pieces at offsets into the export: its second half, then nothing else.
    let r = a
        .rma_async(
            ca,
            true,
            &[gb],
            &[(RemoteDesc::from(&desc), (n / 2) as u64)],
            Some(b"read done"),
        )
        .unwrap();
    let got = take(&b, 1);
    assert_eq!(got.len(), 1, "no notification");
    assert_eq!(
        (got[0].msg.as_slice(), got[0].conn),
        (&b"read done"[..], cb)
    );
    assert!(
        got_back[..] == owned[n / 2..],
        "notification before the read completed"
    );
    assert!(a.wait(r, Some(Duration::from_secs(20))).unwrap());
    // An offset past the range is refused locally.
    let mut x = vec![0u8; 16];
    let xb = buf(&a, &mut x);
    assert!(matches!(
        a.rma_async(
            ca,
            true,
            &[xb],
            &[(RemoteDesc::from(&desc), n as u64 - 8)],
            None
        ),
        Err(Error::Invalid(_))
    ));
}

#[test]
fn refused_write_sends_no_notif() {
    let (a, b, ca, cb) = pair();
    let mut target = vec![0u8; 4096];
    let tb = buf(&b, &mut target);
    let mut meta = FifoItem::decode(&b.advertise(cb, tb.mr, tb.ptr, 4096).unwrap()).unwrap();
    meta.token.secret ^= 1;
    let mut src = pattern(4096, 1);
    let sb = buf(&a, &mut src);
    let w = a
        .write_async_with_notif(ca, &[sb], &[meta], Some(b"never"))
        .unwrap();
    assert!(matches!(
        a.wait(w, Some(Duration::from_secs(20))),
        Err(Error::Refused { .. })
    ));
    // A notification sent after it arrives; the refused one never does.
    a.send_notif(ca, b"after").unwrap();
    let got = take(&b, 1);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].msg, b"after");
    assert!(target.iter().all(|&x| x == 0));
}

#[test]
fn flooding_peer_fails_its_connection() {
    let (a, b, ca, cb) = pair();
    // Nobody takes b's notifications: one past the peer's bound fails the
    // connection.
    let mut sent = 0;
    while sent <= PER_PEER {
        if a.send_notif(ca, b"").is_err() {
            break;
        }
        sent += 1;
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while b.conn_failure(cb).ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let why = match b.conn_failure(cb) {
        Ok(Some(w)) => w,
        Err(Error::ConnectionLost { reason, .. }) => reason,
        other => panic!("connection still up after a flood: {other:?}"),
    };
    assert!(why.contains("notification refused"), "{why}");
    assert!(why.contains("TCPX_P2P_NOTIF_PER_PEER"), "{why}");
    assert_eq!(b.get_notifs().len(), PER_PEER);
}

#[test]
fn write_to_self_with_notif() {
    // An endpoint connected to itself (what a transfer to self uses).
    let a = Endpoint::new(None, cfg("self")).unwrap();
    let addr = a.local_addr();
    let c = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    let back = a.accept(Some(Duration::from_secs(10))).unwrap().conn;
    let n = 1 << 20;
    let mut dst = vec![0u8; n];
    let db = buf(&a, &mut dst);
    let desc = a.export_range(db.mr, db.ptr, n).unwrap();
    let mut src = pattern(n, 4);
    let sb = buf(&a, &mut src);
    let w = a
        .rma_async(
            c,
            false,
            &[sb],
            &[(RemoteDesc::from(&desc), 0)],
            Some(b"me"),
        )
        .unwrap();
    let got = take(&a, 1);
    assert_eq!((got[0].from_name.as_str(), got[0].conn), ("self", back));
    assert!(dst == src);
    assert!(a.wait(w, Some(Duration::from_secs(20))).unwrap());
}

/// Issue 29, defect 5: 65,537 empty notifications from one peer filled the
/// endpoint's queue, and each of three other peers then lost its
/// connection for one 16-byte notification. The flooding peer is the one
/// refused; the others' notifications arrive and their connections stay.
#[test]
fn a_flooding_peer_is_refused_and_the_others_still_arrive() {
    let b = Endpoint::new(None, cfg("target")).unwrap();
    let addr = b.local_addr();
    let join = |name: &str| {
        let a = Endpoint::new(None, cfg(name)).unwrap();
        let ca = a
            .connect(&addr.ip().to_string(), addr.port(), None)
            .unwrap();
        let cb = b.accept(Some(Duration::from_secs(10))).unwrap().conn;
        (a, ca, cb)
    };
    let (flood, cf, cbf) = join("flood");
    let legit: Vec<_> = (0..3).map(|i| join(&format!("legit{i}"))).collect();
    // Nobody takes b's notifications meanwhile.
    for _ in 0..=QUEUE_MAX {
        if flood.send_notif(cf, b"").is_err() {
            break;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let why = loop {
        match b.conn_failure(cbf) {
            Ok(Some(w)) => break w,
            Err(Error::ConnectionLost { reason, .. }) => break reason,
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "the flooding peer was never refused"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(why.contains("notification"), "{why}");
    for (i, (a, ca, _)) in legit.iter().enumerate() {
        a.send_notif(*ca, &[i as u8; 16]).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got = Vec::new();
    while got
        .iter()
        .filter(|n: &&Notif| n.from_name.starts_with("legit"))
        .count()
        < 3
    {
        assert!(
            Instant::now() < deadline,
            "the other peers' notifications did not arrive: {:?}",
            legit
                .iter()
                .map(|l| b.conn_failure(l.2))
                .collect::<Vec<_>>()
        );
        got.extend(b.get_notifs());
        std::thread::sleep(Duration::from_millis(5));
    }
    for (i, (_, _, cb)) in legit.iter().enumerate() {
        let n: Vec<_> = got.iter().filter(|n| n.conn == *cb).collect();
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].from_name, format!("legit{i}"));
        assert_eq!(n[0].msg, vec![i as u8; 16]);
        assert!(
            matches!(b.conn_failure(*cb), Ok(None)),
            "peer {i} kept its connection"
        );
    }
    let flooded = got.iter().filter(|n| n.conn == cbf).count();
    assert_eq!(flooded, PER_PEER, "the flood held only its own share");
}
