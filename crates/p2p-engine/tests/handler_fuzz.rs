//! The control handler's fuzz harness on the stable toolchain: seeded
//! random programs plus the committed corpus (`fuzz/corpus/handler`), with
//! every allocation's size watched. `TCPX_P2P_FUZZ_SECS` runs it for that
//! long instead of `TCPX_P2P_FUZZ_ITERS` inputs (default 2000).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tcpx_p2p::internal::{control_handler, Seen};

/// No single allocation may be larger: nothing is sized from a claim.
const MAX_ALLOC: usize = 64 << 20;

struct Watch;
static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only
// records the largest size asked for.
unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LARGEST.fetch_max(l.size(), Ordering::Relaxed);
        // SAFETY: same layout contract as our caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `System.alloc` with this layout.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        LARGEST.fetch_max(n, Ordering::Relaxed);
        // SAFETY: `p` came from `System.alloc` with layout `l`.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Watch = Watch;

fn add(t: &mut Seen, s: Seen) {
    t.steps += s.steps;
    t.accepted += s.accepted;
    t.refused += s.refused;
    t.protocol_errors += s.protocol_errors;
}

#[test]
fn control_handler_survives_random_programs_and_the_corpus() {
    let mut total = Seen::default();
    let mut inputs = 0u64;
    let corpus = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus/handler");
    if let Ok(dir) = std::fs::read_dir(corpus) {
        for e in dir.flatten() {
            if let Ok(data) = std::fs::read(e.path()) {
                add(&mut total, control_handler(&data));
                inputs += 1;
            }
        }
    }
    let corpus_inputs = inputs;
    let secs = std::env::var("TCPX_P2P_FUZZ_SECS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    let iters = std::env::var("TCPX_P2P_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(2000);
    let seed = std::env::var("TCPX_P2P_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(18);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let start = Instant::now();
    let mut random = 0u64;
    loop {
        match secs {
            Some(s) if start.elapsed() >= Duration::from_secs(s) => break,
            None if random >= iters => break,
            _ => {}
        }
        let n = rng.random_range(0..2048);
        let data: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        add(&mut total, control_handler(&data));
        random += 1;
    }
    let largest = LARGEST.load(Ordering::Relaxed);
    println!(
        "handler harness: {corpus_inputs} corpus + {random} random inputs (seed {seed}) in {:.0} s: \
         {} steps, {} accepted, {} refused, {} protocol errors; largest allocation {largest} bytes",
        start.elapsed().as_secs_f64(),
        total.steps,
        total.accepted,
        total.refused,
        total.protocol_errors
    );
    assert!(
        total.accepted > 0 && total.refused > 0 && total.protocol_errors > 0,
        "the harness reached every outcome"
    );
    assert!(largest <= MAX_ALLOC, "an allocation of {largest} bytes");
}
