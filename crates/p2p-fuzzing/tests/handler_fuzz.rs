//! The fuzz harnesses of the connection's state machines on the stable
//! toolchain (the control handler, the one-sided receives' order, the
//! notification queue, two connection machines wired together): seeded
//! random programs plus the committed corpora
//! (`fuzz/corpus/{handler,rma_recvs,notif,proto_pair}`), with every allocation's size
//! watched. `TCPX_P2P_FUZZ_SECS` runs each for that long instead of
//! `TCPX_P2P_FUZZ_ITERS` inputs (default 2000).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::{Rng, SeedableRng};
use tcpx_p2p_fuzzing::{control_handler, notif_queue, proto_pair, rma_recvs, PairSeen, Seen};

// The run budget the engine's fuzzing tests read too.
#[path = "../../p2p-engine/tests/common/budget.rs"]
mod budget;
use budget::Budget;

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

/// The corpus of `target`, then seeded random inputs of up to `max_len`
/// bytes (as many as the [`Budget`] allows), through `run`: returns
/// (corpus inputs, random inputs, seconds).
fn drive(target: &str, max_len: usize, mut run: impl FnMut(&[u8])) -> (u64, u64, f64) {
    let mut corpus_inputs = 0u64;
    let corpus = format!("{}/../../fuzz/corpus/{target}", env!("CARGO_MANIFEST_DIR"));
    if let Ok(dir) = std::fs::read_dir(corpus) {
        for e in dir.flatten() {
            if let Ok(data) = std::fs::read(e.path()) {
                run(&data);
                corpus_inputs += 1;
            }
        }
    }
    let mut budget = Budget::from_env(2000, 18);
    let mut rng = rand::rngs::StdRng::seed_from_u64(budget.seed);
    while budget.next() {
        let n = rng.random_range(0..max_len);
        let data: Vec<u8> = (0..n).map(|_| rng.random()).collect();
        run(&data);
    }
    (corpus_inputs, budget.done, budget.secs())
}

#[test]
fn one_sided_receives_keep_request_order_and_never_post_a_refused_read() {
    let (mut steps, mut accepted, mut refused, mut posted) = (0, 0, 0, 0);
    let (corpus, random, secs) = drive("rma_recvs", 1024, |d| {
        let s = rma_recvs(d);
        steps += s.steps;
        accepted += s.accepted;
        refused += s.refused;
        posted += s.posted;
    });
    println!(
        "rma_recvs harness: {corpus} corpus + {random} random inputs in {secs:.0} s: \
         {steps} steps, {accepted} reads accepted, {refused} refused, {posted} receives posted"
    );
    assert!(
        accepted > 0 && refused > 0 && posted > 0,
        "every outcome reached"
    );
}

#[test]
fn notification_queue_bounds_each_peer_and_serves_the_others() {
    let (mut pushed, mut refused, mut drained) = (0, 0, 0);
    let (corpus, random, secs) = drive("notif", 1024, |d| {
        let s = notif_queue(d);
        pushed += s.pushed;
        refused += s.refused;
        drained += s.drained;
    });
    println!(
        "notif harness: {corpus} corpus + {random} random inputs in {secs:.0} s: \
         {pushed} queued, {refused} refused, {drained} drained"
    );
    assert!(
        pushed > 0 && refused > 0 && drained > 0,
        "every outcome reached"
    );
}

#[test]
fn control_handler_survives_random_programs_and_the_corpus() {
    let mut total = Seen::default();
    let (corpus_inputs, random, secs) =
        drive("handler", 2048, |d| add(&mut total, control_handler(d)));
    let largest = LARGEST.load(Ordering::Relaxed);
    println!(
        "handler harness: {corpus_inputs} corpus + {random} random inputs in {secs:.0} s: \
         {} steps, {} accepted, {} refused, {} protocol errors; largest allocation {largest} bytes",
        total.steps, total.accepted, total.refused, total.protocol_errors
    );
    assert!(
        total.accepted > 0 && total.refused > 0 && total.protocol_errors > 0,
        "the harness reached every outcome"
    );
    assert!(largest <= MAX_ALLOC, "an allocation of {largest} bytes");
}

#[test]
fn a_pair_of_connection_machines_moves_the_right_bytes_under_any_order() {
    let mut t = PairSeen::default();
    let (corpus, random, secs) = drive("proto_pair", 2048, |d| {
        let s = proto_pair(d);
        t.steps += s.steps;
        t.done += s.done;
        t.failed += s.failed;
        t.refused += s.refused;
        t.broken += s.broken;
        t.checked += s.checked;
        t.checked_pulled += s.checked_pulled;
        t.leased += s.leased;
        t.leased_writes += s.leased_writes;
        t.revoked += s.revoked;
    });
    let largest = LARGEST.load(Ordering::Relaxed);
    println!(
        "proto_pair harness: {corpus} corpus + {random} random inputs in {secs:.0} s: \
         {} steps, {} transfers done ({} checked byte for byte, {} of them pulled writes or granted reads), \
         {} reads and {} writes copied from and into leases, {} revokes answered, \
         {} refused, {} failed, {} runs with the connection broken",
        t.steps,
        t.done,
        t.checked,
        t.checked_pulled,
        t.leased,
        t.leased_writes,
        t.revoked,
        t.refused,
        t.failed,
        t.broken
    );
    assert!(
        t.done > 0
            && t.checked > 0
            && t.checked_pulled > 0
            && t.leased > 0
            && t.leased_writes > 0
            && t.revoked > 0
            && t.refused > 0
            && t.failed > 0
            && t.broken > 0,
        "the harness reached every outcome"
    );
    assert!(largest <= MAX_ALLOC, "an allocation of {largest} bytes");
}
