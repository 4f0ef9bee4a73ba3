#![no_main]
//! Two connection machines wired together in memory: posts, cancels,
//! notifications, frames delivered and messages moved in any order, time
//! moving, forged frames. Never panics, never holds more than its limits,
//! never changes a byte outside what was advertised or chosen as a
//! destination, and without forged frames every one-sided transfer ends
//! and every finished one carries its source's bytes (see
//! `tcpx_p2p_fuzzing::proto_pair`).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tcpx_p2p_fuzzing::proto_pair(data);
});
