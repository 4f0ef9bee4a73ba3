//! Fuzz harnesses of tcpx-p2p's pure state machines, shared by the
//! cargo-fuzz targets (`fuzz/fuzz_targets/`) and the stable test that runs
//! them over seeded random inputs and the committed corpora
//! (`tests/handler_fuzz.rs` here). A development crate: the engine exposes
//! what these harnesses drive only with its `fuzzing` feature
//! (`tcpx_p2p::fuzzing`), which nothing an application links turns on.
//!
//! - [`control_handler`]: the control handler (`Book`) against a small
//!   registry of real memory ([`control`]);
//! - [`rma_recvs()`]: the order our one-sided receives are posted in, with
//!   reads refused, accepted, answered out of order, and the connection
//!   ending, against a model of the peer's sends;
//! - [`notif_queue`]: the notification queue's per-peer and fair-share
//!   bounds, with several peers and draining;
//! - [`proto_pair`]: two connection machines wired together in memory
//!   ([`pair`]), every call, frame, message move, timer tick and forged
//!   frame in an order the input picks, against the bytes that land;
//! - [`part_header`]: the socket net's checks of a received part's header
//!   against the posted receive (the engine's own).
//!
//! Each harness reads its input as a program; bytes past the end read as
//! zero. Each panics on a broken invariant: that is the finding.

mod bytes;
pub mod control;
pub mod notif;
pub mod pair;
mod pair_fuzz;
pub mod rma_recvs;

pub use control::{control_handler, Seen, LIMITS};
pub use notif::{notif_queue, NotifSeen};
pub use pair_fuzz::{proto_pair, PairSeen, PAIR_LIMITS};
pub use rma_recvs::{rma_recvs, RecvsSeen};

/// Runs `data` through the socket net's part-header checks: the first 48
/// bytes are a header, the rest the posted receive's segment lengths (one
/// byte each, in KiB). Panics if a part that passes the checks would land
/// outside the posted memory.
pub fn part_header(data: &[u8]) {
    tcpx_p2p::fuzzing::fuzz_part_header(data)
}
