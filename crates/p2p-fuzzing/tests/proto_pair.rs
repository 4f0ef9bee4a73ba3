//! Two connection machines wired together in memory ([`Pair`]): frames
//! from one fed to the other, net requests carried out by a mover that
//! copies bytes between the two sides' memories. Each test asserts on the
//! bytes that landed and on how each transfer ended.

use tcpx_p2p::fuzzing::{Answer, Failure, Limits, Set};
use tcpx_p2p_fuzzing::pair::{Dir, End, Frame, Pair, CHUNK};
use tcpx_p2p_wire::{Control, RmaItem};

const MEM: usize = 1 << 20;

fn fill(mem: &mut [u8], off: usize, len: usize, seed: u8) {
    for (i, b) in mem[off..off + len].iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed) | 1;
    }
}

fn encode(m: Control, payload: Vec<u8>) -> Frame {
    let mut body = Vec::new();
    m.encode(&mut body);
    Frame { body, payload }
}

/// a writes two items into b: one over several chunks, one small.
fn write_two_items(p: &mut Pair, seed: u8) -> u64 {
    fill(&mut p.a.mem, 0, 3 * CHUNK + 100, seed);
    let items = vec![
        p.b.advertise(8192, 3 * CHUNK, Some(2)),
        p.b.advertise(65536, 100, Some(2)),
    ];
    p.a.rma(false, &[(0, 3 * CHUNK), (3 * CHUNK, 100)], items)
        .unwrap()
}

/// The two items of [`write_two_items`] are at b.
fn assert_two_items_landed(p: &Pair) {
    assert_eq!(&p.b.mem[8192..8192 + 3 * CHUNK], &p.a.mem[..3 * CHUNK]);
    assert_eq!(&p.b.mem[65536..65636], &p.a.mem[3 * CHUNK..3 * CHUNK + 100]);
}

#[test]
fn a_write_lands_its_bytes_and_ends_once_on_both_sides() {
    let mut p = Pair::new(MEM);
    let w = write_two_items(&mut p, 7);
    assert_eq!(p.a.end_of(w), End::Pending);
    p.settle();
    assert_eq!(p.a.end_of(w), End::Done);
    assert_two_items_landed(&p);
    // Nothing else of b's memory changed, and b holds nothing for a now.
    let touched = p.b.mem.iter().enumerate().filter(|&(i, &x)| {
        x != 0 && !(8192..8192 + 3 * CHUNK).contains(&i) && !(65536..65636).contains(&i)
    });
    assert_eq!(touched.count(), 0);
    assert_eq!(p.b.proto.held(), (0, 0, 0));
    assert_eq!(p.a.queued() + p.b.queued(), 0);
}

#[test]
fn a_read_brings_the_peers_bytes_only_once_accepted() {
    let mut p = Pair::new(MEM);
    fill(&mut p.b.mem, 4096, 10_000, 3);
    let item = p.b.advertise(4096, 10_000, None);
    let r = p.a.rma(true, &[(200_000, 10_000)], vec![item]).unwrap();
    // The request goes out; nothing is posted into the read's buffers
    // before b accepts.
    assert_eq!(p.a.queued(), 0);
    assert_eq!(p.a.proto.held().0, 1, "the read's receives wait their turn");
    p.settle();
    assert_eq!(p.a.end_of(r), End::Done);
    assert_eq!(&p.a.mem[200_000..210_000], &p.b.mem[4096..14_096]);
    assert_eq!(p.a.proto.held(), (0, 0, 0));
}

#[test]
fn inline_writes_and_reads_ride_the_control_connection() {
    let mut p = Pair::new(MEM);
    p.a.inline_max = 64 << 10;
    fill(&mut p.a.mem, 0, 1000, 11);
    fill(&mut p.b.mem, 50_000, 2000, 13);
    let wi = p.b.advertise(30_000, 1000, Some(2));
    let ri = p.b.advertise(50_000, 2000, Some(2));
    let w = p.a.rma(false, &[(0, 1000)], vec![wi]).unwrap();
    let r = p.a.rma(true, &[(100_000, 2000)], vec![ri]).unwrap();
    // Inline: no net request is ever posted.
    assert_eq!(p.a.queued() + p.b.queued(), 0);
    let frames = p.a.out.len();
    assert_eq!(frames, 2);
    assert!(
        p.a.out[0].payload.len() == 1000,
        "the write's bytes follow its frame"
    );
    p.settle();
    assert_eq!(p.a.end_of(w), End::Done);
    assert_eq!(p.a.end_of(r), End::Done);
    assert_eq!(&p.b.mem[30_000..31_000], &p.a.mem[..1000]);
    assert_eq!(&p.a.mem[100_000..102_000], &p.b.mem[50_000..52_000]);
    assert_eq!(p.b.proto.held(), (0, 0, 0));
}

#[test]
fn sends_and_receives_match_in_posting_order_and_are_acknowledged() {
    let mut p = Pair::new(MEM);
    // A large message, a gathered list of small items, and an empty one.
    fill(&mut p.a.mem, 0, 5 * CHUNK + 17, 1);
    fill(&mut p.a.mem, 100_000, 64 * 10, 2);
    let big = p.a.send(&[(0, 5 * CHUNK + 17)]).unwrap();
    let small: Vec<(usize, usize)> = (0..64).map(|i| (100_000 + i * 10, 10)).collect();
    let list = p.a.send(&small).unwrap();
    // The receives are posted after the sends: the messages wait.
    p.settle();
    assert_eq!(p.a.end_of(big), End::Pending);
    assert_eq!(p.a.proto.msgs_unacked(), 2);
    let rbig = p.b.recv(&[(300_000, 5 * CHUNK + 17)]).unwrap();
    let rsmall: Vec<(usize, usize)> = (0..64).map(|i| (400_000 + i * 10, 10)).collect();
    let rlist = p.b.recv(&rsmall).unwrap();
    p.settle();
    for (x, side) in [(big, &p.a), (list, &p.a), (rbig, &p.b), (rlist, &p.b)] {
        assert_eq!(side.end_of(x), End::Done);
    }
    assert_eq!(
        &p.b.mem[300_000..300_000 + 5 * CHUNK + 17],
        &p.a.mem[..5 * CHUNK + 17]
    );
    assert_eq!(&p.b.mem[400_000..400_640], &p.a.mem[100_000..100_640]);
    // The receiver acknowledges together: two landed receives are not
    // told yet. A closing sender asks (a keep-alive), and the count comes
    // back: every message acknowledged, the close waits for none.
    assert_eq!(p.a.proto.msgs_unacked(), 2);
    p.a.proto.ask_acks();
    p.a.effects();
    p.settle();
    assert_eq!(p.a.proto.msgs_unacked(), 0);
}

#[test]
fn a_message_longer_than_its_receive_fails_both_ends_before_a_byte_lands() {
    let mut p = Pair::new(MEM);
    // One piece of 3,000 bytes for a receive of 1,000.
    fill(&mut p.a.mem, 0, 3000, 5);
    let s = p.a.send(&[(0, 3000)]).unwrap();
    let r = p.b.recv(&[(500_000, 1000)]).unwrap();
    p.settle();
    assert!(matches!(p.b.end_of(r), End::Failed(Failure::Protocol(_))));
    assert!(matches!(p.a.end_of(s), End::Failed(_)));
    assert!(p.b.mem[500_000..501_000].iter().all(|&x| x == 0));
}

#[test]
fn notifications_arrive_in_order() {
    let mut p = Pair::new(MEM);
    p.a.notify("a", b"first");
    p.a.notify("a", b"second");
    p.settle();
    assert_eq!(
        p.b.notifs,
        vec![
            ("a".to_string(), b"first".to_vec()),
            ("a".to_string(), b"second".to_vec())
        ]
    );
}

#[test]
fn a_cancelled_write_moves_no_byte_and_keeps_both_sides_in_step() {
    let mut p = Pair::new(MEM);
    fill(&mut p.a.mem, 0, 3 * CHUNK, 9);
    fill(&mut p.a.mem, 20_000, 2 * CHUNK, 4);
    let target = p.b.advertise(0, 3 * CHUNK, Some(2));
    let w = p.a.rma(false, &[(0, 3 * CHUNK)], vec![target]).unwrap();
    assert!(p.a.cancel(w), "waiting for clear-to-send: cancellable");
    assert_eq!(p.a.end_of(w), End::Failed(Failure::Cancelled));
    assert!(!p.a.cancel(w), "once");
    // Both sides then go on: a later write lands in step.
    let next = p.b.advertise(100_000, 2 * CHUNK, Some(2));
    let w2 = p.a.rma(false, &[(20_000, 2 * CHUNK)], vec![next]).unwrap();
    p.settle();
    assert!(
        p.b.mem[..3 * CHUNK].iter().all(|&x| x == 0),
        "the cancelled write moved nothing"
    );
    assert_eq!(p.a.end_of(w2), End::Done);
    assert_eq!(
        &p.b.mem[100_000..100_000 + 2 * CHUNK],
        &p.a.mem[20_000..20_000 + 2 * CHUNK]
    );
    assert_eq!(
        p.a.end_of(w),
        End::Failed(Failure::Cancelled),
        "the refusal of the filled write changes nothing"
    );
    assert!(p.a.failed.is_none() && p.b.failed.is_none());
    assert_eq!(p.b.proto.held(), (0, 0, 0));
}

#[test]
fn a_cancelled_inline_read_drops_its_data() {
    let mut p = Pair::new(MEM);
    p.a.inline_max = 64 << 10;
    fill(&mut p.b.mem, 0, 500, 6);
    let item = p.b.advertise(0, 500, Some(2));
    let r = p.a.rma(true, &[(1000, 500)], vec![item]).unwrap();
    assert!(p.a.cancel(r));
    p.settle();
    assert_eq!(p.a.end_of(r), End::Failed(Failure::Cancelled));
    assert!(p.a.mem[1000..1500].iter().all(|&x| x == 0));
    assert!(p.a.failed.is_none() && p.b.failed.is_none());
}

#[test]
fn forged_requests_are_refused_and_hold_nothing() {
    let mut p = Pair::new(MEM);
    fill(&mut p.a.mem, 0, CHUNK, 8);
    // A made-up token, an advert for another connection, a range past the
    // advert's end.
    let forged = p.b.forged(0, 1 << 40);
    let other = p.b.advertise(0, CHUNK, Some(77));
    let mut past = p.b.advertise(8192, CHUNK, Some(2));
    past.len += 1;
    let mut ids = Vec::new();
    for item in [forged, other, past] {
        ids.push(p.a.rma(false, &[(0, CHUNK)], vec![item]).unwrap());
        ids.push(p.a.rma(true, &[(0, CHUNK)], vec![item]).unwrap());
    }
    p.settle();
    for x in ids {
        assert!(
            matches!(p.a.end_of(x), End::Failed(Failure::Refused(_))),
            "{x}"
        );
    }
    assert!(p.b.mem.iter().all(|&x| x == 0), "nothing landed at b");
    assert_eq!(p.b.proto.held(), (0, 0, 0));
    assert_eq!(
        p.a.proto.held(),
        (0, 0, 0),
        "a refused read posts no receive"
    );
    assert!(p.a.failed.is_none() && p.b.failed.is_none());
}

#[test]
fn the_limits_refuse_what_is_over_them_and_serve_the_rest() {
    let mut p = Pair::with_limits(
        MEM,
        Limits {
            max_requests: 2,
            max_items: 1 << 20,
        },
    );
    let items: Vec<_> = (0..3)
        .map(|i| p.b.advertise(i * CHUNK, CHUNK, Some(2)))
        .collect();
    let w: Vec<_> = items
        .into_iter()
        .enumerate()
        .map(|(i, it)| p.a.rma(false, &[(i * CHUNK, CHUNK)], vec![it]).unwrap())
        .collect();
    // b takes all three requests before any data moves: the third is over.
    while p.deliver(Dir::AtoB) {}
    assert_eq!(p.b.proto.held().1, 2);
    p.settle();
    assert_eq!(p.a.end_of(w[0]), End::Done);
    assert_eq!(p.a.end_of(w[1]), End::Done);
    match p.a.end_of(w[2]) {
        End::Failed(Failure::Refused(r)) => assert!(r.contains("TCPX_P2P_MAX_REQUESTS"), "{r}"),
        e => panic!("{e:?}"),
    }
    assert_eq!(p.b.proto.held(), (0, 0, 0));
}

#[test]
fn a_peer_breaking_the_protocol_fails_the_connection_and_every_transfer() {
    for bad in [
        Control::WriteDone { xfer: 12345 },
        Control::ReadAck { xfer: 1 },
        Control::MsgDone { count: 5 },
        Control::ReadData { xfer: 1, len: 3 },
    ] {
        let mut p = Pair::new(MEM);
        let item = p.b.advertise(0, CHUNK, Some(2));
        let w = p.a.rma(false, &[(0, CHUNK)], vec![item]).unwrap();
        let r = p.a.recv(&[(0, 100)]).unwrap();
        p.inject(Dir::BtoA, encode(bad.clone(), vec![]));
        match p.a.failed.clone() {
            Some(Failure::Protocol(_)) => {}
            f => panic!("{bad:?}: {f:?}"),
        }
        for x in [w, r] {
            assert!(
                matches!(p.a.end_of(x), End::Failed(Failure::Protocol(_))),
                "{bad:?}"
            );
        }
        // The peer sees the connection go.
        assert!(p.b.failed.is_some());
        // And the failed machine takes nothing more, and writes nothing.
        assert!(p.a.proto.on_control(Control::KeepAlive).is_err());
        p.a.proto.send_notif("late".into(), vec![1]);
        p.a.proto.served_ended(3, 0, Answer::Write, Ok(()));
        assert!(
            p.a.proto.poll().is_none(),
            "{bad:?}: a frame after the failure"
        );
    }
    // Inline data of the wrong length for our inline read.
    let mut p = Pair::new(MEM);
    p.a.inline_max = 4096;
    let item = p.b.advertise(0, 100, Some(2));
    let r = p.a.rma(true, &[(0, 100)], vec![item]).unwrap();
    // Dropped from the line: b never sees the request, a forged answer comes.
    p.a.out.clear();
    p.inject(
        Dir::BtoA,
        encode(Control::ReadData { xfer: r, len: 101 }, vec![9; 101]),
    );
    assert!(matches!(p.a.end_of(r), End::Failed(Failure::Protocol(_))));
    assert!(p.a.mem[..101].iter().all(|&x| x == 0), "no byte landed");
}

#[test]
fn keepalives_and_the_silence_deadline_run_on_the_given_time() {
    let mut p = Pair::new(MEM);
    let r = p.a.recv(&[(0, 100)]).unwrap();
    p.a.tick(100, 1000, 10_000);
    assert!(p.a.out.is_empty(), "not quiet long enough");
    p.a.tick(1000, 1000, 10_000);
    assert_eq!(p.a.out.len(), 1, "a keep-alive");
    p.settle();
    // b heard it at b's time 0 (b's clock is its own).
    p.b.tick(5000, 1000, 10_000);
    p.settle();
    p.a.tick(10_000, 1000, 10_000);
    assert!(p.a.failed.is_none(), "a heard b's keep-alive");
    p.a.tick(20_001, 1000, 10_000);
    match p.a.failed.clone() {
        Some(Failure::TimedOut(why)) => assert!(why.contains("TCPX_P2P_DEADLINE_MS"), "{why}"),
        f => panic!("{f:?}"),
    }
    assert!(matches!(p.a.end_of(r), End::Failed(Failure::TimedOut(_))));
}

#[test]
fn a_close_is_the_peer_closing_not_a_breach() {
    let mut p = Pair::new(MEM);
    let r = p.b.recv(&[(0, 100)]).unwrap();
    p.a.proto.close();
    p.a.effects();
    p.settle();
    match p.b.end_of(r) {
        End::Failed(Failure::Lost(why)) => assert!(why.contains("closed"), "{why}"),
        e => panic!("{e:?}"),
    }
    let _ = Set::Msg;
}

#[test]
fn a_pulled_write_is_copied_by_its_target_with_no_send_and_ends_on_write_done() {
    let mut p = Pair::pulling(MEM, Limits::default());
    let w = write_two_items(&mut p, 21);
    // One frame, the offer; no send is posted, then or later.
    assert_eq!(p.a.out.len(), 1);
    assert!(matches!(
        Control::decode(&p.a.out[0].body),
        Ok(Control::WritePull { ref src, .. }) if src.len() == 2
    ));
    assert!(!p.a.cancel(w), "the target may be copying: not cancellable");
    assert_eq!(p.a.queued(), 0);
    p.deliver(Dir::AtoB);
    assert_eq!(p.a.queued(), 0);
    assert!(p.b.queued() > 0, "b's pulls wait to be made");
    p.settle();
    assert_eq!(p.a.end_of(w), End::Done);
    assert_two_items_landed(&p);
    assert_eq!(p.b.proto.held(), (0, 0, 0));
    assert_eq!(p.a.queued() + p.b.queued(), 0);
    assert!(p.a.failed.is_none() && p.b.failed.is_none());
}

#[test]
fn a_target_that_cannot_pull_clears_the_offered_write_and_takes_it_sent() {
    use tcpx_p2p_fuzzing::pair::Side;
    let mut p = Pair {
        a: Side::with_pull("a", 1, MEM, Limits::default(), true),
        b: Side::new("b", 2, MEM, Limits::default()),
    };
    fill(&mut p.a.mem, 0, 2 * CHUNK, 5);
    let item = p.b.advertise(4096, 2 * CHUNK, Some(2));
    let w = p.a.rma(false, &[(0, 2 * CHUNK)], vec![item]).unwrap();
    p.settle();
    assert_eq!(p.a.end_of(w), End::Done);
    assert_eq!(&p.b.mem[4096..4096 + 2 * CHUNK], &p.a.mem[..2 * CHUNK]);
    assert_eq!(p.b.proto.held(), (0, 0, 0));
}

#[test]
fn a_pull_past_what_the_writer_exported_is_refused_and_lands_nothing() {
    use tcpx_p2p_wire::PullRun;
    let mut p = Pair::pulling(MEM, Limits::default());
    fill(&mut p.a.mem, 0, 2 * CHUNK, 17);
    let item = p.b.advertise(4096, 2 * CHUNK, Some(2));
    // The writer's key names half the run its request claims.
    let mut key = (p.a.mem.as_ptr() as u64).to_le_bytes().to_vec();
    key.extend_from_slice(&(CHUNK as u64).to_le_bytes());
    p.inject(
        Dir::AtoB,
        encode(
            Control::WritePull {
                xfer: 77,
                items: vec![item],
                runs: vec![1],
                src: vec![PullRun { gpu: false, key }],
            },
            vec![],
        ),
    );
    assert_eq!(p.settle_side(Dir::AtoB), 2, "one pull per chunk");
    // The first chunk lies inside what the key names and lands; the
    // second would be read past it: refused, none of it lands.
    assert_eq!(&p.b.mem[4096..4096 + CHUNK], &p.a.mem[..CHUNK]);
    assert!(
        p.b.mem[4096 + CHUNK..].iter().all(|&x| x == 0) && p.b.mem[..4096].iter().all(|&x| x == 0),
        "no byte read past the writer's key landed"
    );
    assert_eq!(p.b.proto.held(), (0, 0, 0));
    assert!(p.b.failed.is_none(), "a refusal, not a broken connection");
    let answer = p.b.out.pop_front().expect("b answers");
    assert!(matches!(
        Control::decode(&answer.body),
        Ok(Control::Refused { xfer: 77, .. })
    ));
}

#[test]
fn a_granted_read_is_copied_by_its_reader_and_released_once_it_ends() {
    let mut p = Pair::pulling(MEM, Limits::default());
    fill(&mut p.b.mem, 4096, 3 * CHUNK + 10, 23);
    let item = p.b.advertise(4096, 3 * CHUNK + 10, None);
    let r =
        p.a.rma(true, &[(200_000, 3 * CHUNK + 10)], vec![item])
            .unwrap();
    assert!(matches!(
        Control::decode(&p.a.out[0].body),
        Ok(Control::ReadOffer { ref dst_gpu, .. }) if dst_gpu == &[false]
    ));
    // The offer reaches b, whose grant reaches a: a's copies wait to be
    // made, and b holds the range meanwhile.
    p.deliver(Dir::AtoB);
    assert!(matches!(
        Control::decode(&p.b.out[0].body),
        Ok(Control::ReadGrant { ref src, .. }) if src.len() == 1
    ));
    p.deliver(Dir::BtoA);
    assert!(p.a.queued() > 0, "a's pulls wait to be made");
    assert_eq!(p.b.proto.held().1, 1, "b holds the granted read");
    p.settle();
    assert_eq!(p.a.end_of(r), End::Done);
    assert_eq!(
        &p.a.mem[200_000..200_000 + 3 * CHUNK + 10],
        &p.b.mem[4096..4096 + 3 * CHUNK + 10]
    );
    assert_eq!(p.a.proto.held(), (0, 0, 0));
    assert_eq!(p.b.proto.held(), (0, 0, 0), "released by a's ReadDone");
    assert!(p.a.failed.is_none() && p.b.failed.is_none());
}

#[test]
fn a_grant_short_of_keys_fails_the_read_and_still_releases_the_target() {
    let mut p = Pair::pulling(MEM, Limits::default());
    fill(&mut p.b.mem, 0, 2 * CHUNK, 5);
    let i1 = p.b.advertise(0, CHUNK, None);
    let i2 = p.b.advertise(CHUNK + 512, CHUNK, None);
    let r =
        p.a.rma(true, &[(100_000, CHUNK), (300_000, CHUNK)], vec![i1, i2])
            .unwrap();
    p.deliver(Dir::AtoB);
    // b's grant, replaced by one key for two runs.
    let g = p.b.out.pop_front().expect("b grants");
    let Ok(Control::ReadGrant {
        xfer,
        mut src,
        leases,
    }) = Control::decode(&g.body)
    else {
        panic!("not a grant");
    };
    src.truncate(1);
    p.inject(
        Dir::BtoA,
        encode(Control::ReadGrant { xfer, src, leases }, vec![]),
    );
    p.settle();
    assert!(matches!(p.a.end_of(r), End::Failed(Failure::Protocol(_))));
    assert_eq!(p.b.proto.held(), (0, 0, 0), "released by a's ReadDone");
    assert!(p.a.failed.is_none() && p.b.failed.is_none());
}

#[test]
fn a_leased_advertisement_is_read_again_with_no_frame_until_its_revoke_is_answered() {
    let mut p = Pair::pulling(MEM, Limits::default());
    fill(&mut p.b.mem, 0, 4 * CHUNK, 31);
    let whole = p.b.advertise(0, 4 * CHUNK, None);
    let window = |off: u64, len: u64| RmaItem {
        token: whole.token,
        addr: whole.addr + off,
        len,
    };
    // The first read is offered and granted; the grant leases the whole
    // advertisement.
    let r =
        p.a.rma(true, &[(100_000, CHUNK)], vec![window(0, CHUNK as u64)]);
    p.settle();
    assert_eq!(p.a.end_of(r.unwrap()), End::Done);
    assert_eq!((p.b.leases().0, p.a.leases().1), (1, 1));
    // Later reads of windows of it: no frame, copied at their offsets.
    fill(&mut p.b.mem, 0, 4 * CHUNK, 32);
    let r2 =
        p.a.rma(
            true,
            &[(200_000, 2 * CHUNK + 7)],
            vec![window(CHUNK as u64 - 3, 2 * CHUNK as u64 + 7)],
        )
        .unwrap();
    let r3 =
        p.a.rma(true, &[(300_000, 5)], vec![window(4 * CHUNK as u64 - 5, 5)])
            .unwrap();
    assert!(p.a.out.is_empty(), "a leased read sends nothing");
    assert_eq!(
        p.b.proto.held(),
        (0, 0, 0),
        "the target holds no request for it"
    );
    // b deregisters: its revoke waits for a's reads to end.
    p.b.revoke_leases();
    p.deliver(Dir::BtoA);
    assert!(p.a.out.is_empty(), "not answered while reads copy from it");
    // A read of the revoked lease is asked for again.
    let r4 = p.a.rma(true, &[(400_000, 8)], vec![window(0, 8)]).unwrap();
    assert!(matches!(
        Control::decode(&p.a.out[0].body),
        Ok(Control::ReadOffer { .. })
    ));
    // Only r2 and r3's pulls, then the answer.
    while p.pull_one(Dir::BtoA) {}
    assert_eq!((p.a.end_of(r2), p.a.end_of(r3)), (End::Done, End::Done));
    assert!(p.a.out.iter().any(|f| matches!(
        Control::decode(&f.body),
        Ok(Control::Revoked { token }) if token == whole.token
    )));
    assert_eq!(
        &p.a.mem[200_000..200_000 + 2 * CHUNK + 7],
        &p.b.mem[CHUNK - 3..3 * CHUNK + 4]
    );
    assert_eq!(
        &p.a.mem[300_000..300_005],
        &p.b.mem[4 * CHUNK - 5..4 * CHUNK]
    );
    p.settle();
    assert_eq!(p.a.end_of(r4), End::Done);
    // The answer let b's hold go. r4's grant came while the revoke was
    // pending, so it leased nothing; the next grant leases it anew.
    assert_eq!((p.b.leases().0, p.a.leases().1), (0, 0));
    let r5 = p.a.rma(true, &[(500_000, 8)], vec![window(8, 8)]).unwrap();
    p.settle();
    assert_eq!(p.a.end_of(r5), End::Done);
    assert_eq!((p.b.leases().0, p.a.leases().1), (1, 1));
    assert!(p.a.failed.is_none() && p.b.failed.is_none());
}

#[test]
fn a_revoked_that_was_never_asked_for_breaks_the_protocol() {
    let mut p = Pair::pulling(MEM, Limits::default());
    let item = p.b.advertise(0, CHUNK, None);
    p.inject(
        Dir::AtoB,
        encode(Control::Revoked { token: item.token }, vec![]),
    );
    assert!(matches!(p.b.failed, Some(Failure::Protocol(_))));
}

#[test]
fn a_record_leased_for_writes_is_written_with_no_frame_and_a_read_lease_is_never_written() {
    let mut p = Pair::pulling(MEM, Limits::default());
    // b's record for this connection is leased to a as it is made.
    let rec = p.b.advertise_leased(0, 4 * CHUNK);
    p.settle();
    assert_eq!((p.b.leases().0, p.a.leases().1), (1, 1));
    let window = |off: u64, len: u64| RmaItem {
        token: rec.token,
        addr: rec.addr + off,
        len,
    };
    // A write inside it: no frame, a's own copy into b's memory.
    fill(&mut p.a.mem, 100_000, 2 * CHUNK + 7, 41);
    let w =
        p.a.rma(
            false,
            &[(100_000, 2 * CHUNK + 7)],
            vec![window(CHUNK as u64 - 3, 2 * CHUNK as u64 + 7)],
        )
        .unwrap();
    assert!(p.a.out.is_empty(), "a leased write sends nothing");
    while p.push_one(Dir::BtoA) {}
    assert_eq!(p.a.end_of(w), End::Done);
    assert_eq!(
        &p.b.mem[CHUNK - 3..3 * CHUNK + 4],
        &p.a.mem[100_000..100_000 + 2 * CHUNK + 7]
    );
    assert!(
        p.b.mem[..CHUNK - 3].iter().all(|&x| x == 0),
        "before the write"
    );
    // Past the record: no lease's, so it is asked for, and refused.
    let past =
        p.a.rma(
            false,
            &[(200_000, 8)],
            vec![window(4 * CHUNK as u64 - 4, 8)],
        )
        .unwrap();
    assert!(matches!(
        Control::decode(&p.a.out[0].body),
        Ok(Control::WritePull { .. })
    ));
    p.settle();
    assert!(matches!(p.a.end_of(past), End::Failed(_)));
    // A registry advertisement, leased by a read, takes no write through
    // its lease: the write is asked for (and pulled by b).
    let any = p.b.advertise(5 * CHUNK, CHUNK, None);
    let r = p.a.rma(true, &[(300_000, CHUNK)], vec![any]).unwrap();
    p.settle();
    assert_eq!(p.a.end_of(r), End::Done);
    assert_eq!(p.a.leases().1, 2);
    fill(&mut p.a.mem, 400_000, CHUNK, 42);
    let w2 = p.a.rma(false, &[(400_000, CHUNK)], vec![any]).unwrap();
    assert!(matches!(
        Control::decode(&p.a.out[0].body),
        Ok(Control::WritePull { .. })
    ));
    p.settle();
    assert_eq!(p.a.end_of(w2), End::Done);
    assert_eq!(
        &p.b.mem[5 * CHUNK..6 * CHUNK],
        &p.a.mem[400_000..400_000 + CHUNK]
    );
    assert!(p.a.failed.is_none() && p.b.failed.is_none());
}

#[test]
fn leases_on_a_connection_whose_net_has_no_one_sided_path_break_the_protocol() {
    let mut p = Pair::new(MEM);
    let item = p.b.advertise(0, CHUNK, None);
    p.inject(
        Dir::BtoA,
        encode(
            Control::Leases {
                leases: vec![tcpx_p2p_wire::Lease {
                    token: item.token,
                    addr: item.addr,
                    len: item.len,
                    gpu: false,
                    write: true,
                    key: vec![0; 16],
                }],
            },
            vec![],
        ),
    );
    assert!(matches!(p.a.failed, Some(Failure::Protocol(_))));
}
