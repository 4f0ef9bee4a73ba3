#![no_main]
//! The notification queue with several peers and draining: no peer holds
//! more than its bounds, a peer within its bounds and its fair share is
//! never refused, drains return what was taken in order
//! (see `tcpx_p2p_fuzzing::notif_queue`).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tcpx_p2p_fuzzing::notif_queue(data);
});
