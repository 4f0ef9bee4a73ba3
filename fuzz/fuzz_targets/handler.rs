#![no_main]
//! A connection's control handling: sequences of control messages that
//! decode, against a small registry. Never panics, never accepts anything
//! outside what was advertised, never holds more than its limits, answers
//! each of our requests at most once (see `tcpx_p2p_fuzzing::control_handler`).
//! Run with `-malloc_limit_mb=64`: no allocation may be sized from a claim.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tcpx_p2p_fuzzing::control_handler(data);
});
