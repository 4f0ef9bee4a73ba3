//! Cancelling at random moments, end to end (two endpoints over loopback):
//! seeded random one-sided writes and reads of random sizes (inline and
//! through the net, some with forged descriptors the target refuses), each
//! cancelled after a random delay. Every cancel must end its transfer in
//! bounded time; once it has, the buffers hold either nothing of it or all
//! of it, never part, and nothing lands in them later; the connection stays
//! in step (a legitimate round trip afterwards moves the right bytes).
//! `TCPX_P2P_FUZZ_SECS` runs it for that long instead of
//! `TCPX_P2P_FUZZ_ITERS` operations (default 120).

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tcpx_p2p::{Config, Endpoint};
use tcpx_p2p::{FifoItem, Token};

mod common;
use common::budget::Budget;
use common::{buf, pattern};

fn checksum(v: &[u8]) -> u64 {
    v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// One finished operation: a buffer that must keep `want` from now on,
/// registered as `mr` with the initiator (`on_a`) or the target.
struct Kept {
    what: String,
    mem: Vec<u8>,
    want: u64,
    mr: u64,
    on_a: bool,
}

/// Checks that nothing landed late in the buffers of ended transfers, and
/// that each deregisters at once (nothing is posted into it), then lets
/// them go.
fn check_kept(a: &Endpoint, b: &Endpoint, kept: &mut Vec<Kept>) {
    std::thread::sleep(Duration::from_millis(50));
    for k in kept.drain(..) {
        assert_eq!(
            checksum(&k.mem),
            k.want,
            "{}: changed after it ended",
            k.what
        );
        let ep = if k.on_a { a } else { b };
        ep.dereg(k.mr).unwrap();
    }
}

#[test]
fn cancels_at_random_moments_leave_whole_transfers_or_none() {
    let cfg = Config {
        ifname: Some("lo".into()),
        streams: 2,
        chunk: 64 << 10,
        min_part: 16 << 10,
        inline_max: 4096,
        ..Config::default()
    };
    let a = Endpoint::new(None, cfg.clone()).unwrap();
    let b = Endpoint::new(None, cfg).unwrap();
    let addr = b.local_addr();
    let ca = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    let cb = b.accept(Some(Duration::from_secs(10))).unwrap().conn;
    let mut budget = Budget::from_env(120, 29);
    let seed = budget.seed;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut kept: Vec<Kept> = Vec::new();
    let (mut whole, mut none, mut cancelled) = (0u64, 0u64, 0u64);
    while budget.next() {
        let ops = budget.done;
        let n = [100usize, 4096, 40 << 10, 300 << 10][rng.random_range(0..4)];
        let read = rng.random_bool(0.5);
        let forged = rng.random_ratio(1, 5);
        let seed_byte = rng.random::<u8>();
        // The target's range, advertised to this connection.
        let old = 0x5Au8 ^ seed_byte;
        let mut target = vec![old; n];
        let tb = buf(&b, &mut target);
        let mut meta = FifoItem::decode(&b.advertise(cb, tb.mr, tb.ptr, n).unwrap()).unwrap();
        if forged {
            meta.token = Token {
                id: meta.token.id,
                secret: meta.token.secret ^ 1,
            };
        }
        let src = pattern(n, seed_byte);
        let mut local = if read { vec![!old; n] } else { src.clone() };
        if read {
            target.copy_from_slice(&src);
        }
        let lb = buf(&a, &mut local);
        let x = if read {
            a.read_async(ca, &[lb], &[meta]).unwrap()
        } else {
            a.write_async(ca, &[lb], &[meta]).unwrap()
        };
        match rng.random_range(0..4) {
            0 => {}
            1 => std::thread::yield_now(),
            _ => std::thread::sleep(Duration::from_micros(rng.random_range(0..400))),
        }
        let t = Instant::now();
        assert!(
            a.cancel(x, Some(Duration::from_secs(20))).unwrap(),
            "op {ops}: not ended 20 s after cancel"
        );
        assert!(t.elapsed() < Duration::from_secs(20));
        // The buffer that receives: all of the transfer or none of it.
        let (what, got, other) = if read {
            ("read", local, target)
        } else {
            ("write", target, local)
        };
        let (all, nothing) = (
            checksum(&src),
            checksum(&vec![if read { !old } else { old }; n]),
        );
        let sum = checksum(&got);
        assert!(
            sum == all || sum == nothing,
            "op {ops}: {what} of {n} bytes (forged {forged}) left part of its bytes"
        );
        assert!(!(forged && sum == all), "op {ops}: a refused {what} landed");
        if sum == all {
            whole += 1;
        } else {
            none += 1;
            cancelled += u64::from(!forged);
        }
        kept.push(Kept {
            what: format!("op {ops}: {what} of {n} bytes"),
            mem: got,
            want: sum,
            mr: if read { lb.mr } else { tb.mr },
            on_a: read,
        });
        let want = checksum(&other);
        kept.push(Kept {
            what: format!("op {ops}: the {what}'s source"),
            mem: other,
            want,
            mr: if read { tb.mr } else { lb.mr },
            on_a: !read,
        });
        if kept.len() >= 200 {
            check_kept(&a, &b, &mut kept);
        }
    }
    // Still in step: a legitimate write and read back.
    assert!(matches!(a.conn_failure(ca), Ok(None)), "connection up");
    let n = 300 << 10;
    let mut target = vec![0u8; n];
    let tb = buf(&b, &mut target);
    let meta = FifoItem::decode(&b.advertise(cb, tb.mr, tb.ptr, n).unwrap()).unwrap();
    let mut src = pattern(n, 99);
    let sb = buf(&a, &mut src);
    let x = a.write_async(ca, &[sb], &[meta]).unwrap();
    assert!(a.wait(x, Some(Duration::from_secs(20))).unwrap());
    let mut back = vec![0u8; n];
    let bb = buf(&a, &mut back);
    let x = a.read_async(ca, &[bb], &[meta]).unwrap();
    assert!(a.wait(x, Some(Duration::from_secs(20))).unwrap());
    assert_eq!(back, src, "the round trip after the cancels");
    check_kept(&a, &b, &mut kept);
    println!(
        "cancel harness (seed {seed}): {} operations in {:.0} s: {whole} ended with all their bytes, {none} with none ({cancelled} of them cancelled, the rest refused)",
        budget.done,
        budget.secs()
    );
    assert!(whole > 0 && none > cancelled, "both outcomes reached");
}
