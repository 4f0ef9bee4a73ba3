#![no_main]
//! The order a connection posts its one-sided receives in: reads accepted,
//! refused, answered out of order or twice, the connection ending. A
//! refused read's receives are never posted, nor a read's before its
//! acceptance; the rest in request order, as the peer sends
//! (see `tcpx_p2p_fuzzing::rma_recvs`).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tcpx_p2p_fuzzing::rma_recvs(data);
});
