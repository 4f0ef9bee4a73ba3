#![no_main]
//! The socket net's part header against a posted receive: never panics,
//! and a part that passes the checks lands inside the posted memory.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tcpx_p2p_fuzzing::part_header(data);
});
