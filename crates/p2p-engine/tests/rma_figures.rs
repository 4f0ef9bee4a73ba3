//! Figures of one-sided transfers of many small blocks (vLLM's KV lists:
//! 131,072 descriptors a transfer), run by hand:
//! `cargo test --release --test rma_figures -- --ignored --nocapture`.
//! Host memory, two endpoints over loopback; blocks small enough that
//! moving their bytes costs little, so the time is what each block costs
//! the engine (planning, the requests, the target's checks, the parts).

mod common;

use std::time::{Duration, Instant};

use common::{blocks, buf, pattern, placed, scrambled_offsets};
use tcpx_p2p::{Config, Endpoint, FifoItem, RemoteDesc};

fn cfg() -> Config {
    Config {
        ifname: Some("lo".into()),
        ..Config::default()
    }
}

#[test]
#[ignore]
fn figures_many_small_blocks() {
    let count: usize = std::env::var("BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(131_072);
    let bs: usize = std::env::var("BLOCK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    tcpx_p2p::init_logging(); // TCPX_P2P_LOG=trace: the requests' timeline
    let a = Endpoint::new(None, cfg()).unwrap();
    let b = Endpoint::new(None, cfg()).unwrap();
    let addr = b.local_addr();
    let ca = a
        .connect(&addr.ip().to_string(), addr.port(), None)
        .unwrap();
    let cb = b.accept(Some(Duration::from_secs(10))).unwrap().conn;
    let n = count * bs;
    let mut target = vec![0u8; n];
    let tb = buf(&b, &mut target);
    let remote =
        RemoteDesc::from(&FifoItem::decode(&b.advertise(cb, tb.mr, tb.ptr, n).unwrap()).unwrap());
    let mut src = pattern(n, 3);
    let sb = buf(&a, &mut src);
    let pieces = blocks(&sb, count, bs);
    let offs = scrambled_offsets(remote, count, bs);
    for read in [false, true] {
        for r in 0..rounds {
            let t0 = Instant::now();
            let x = a.rma_async(ca, read, &pieces, &offs, None).unwrap();
            let posted = t0.elapsed();
            assert!(a.wait(x, Some(Duration::from_secs(120))).unwrap());
            let total = t0.elapsed();
            println!(
                "{} {count} x {bs} B round {r}: posted in {:.1} ms, ended in {:.1} ms ({:.0} ns a block)",
                if read { "read " } else { "write" },
                posted.as_secs_f64() * 1e3,
                total.as_secs_f64() * 1e3,
                total.as_secs_f64() * 1e9 / count as f64
            );
        }
    }
    assert!(placed(&target, &src, bs));
}
