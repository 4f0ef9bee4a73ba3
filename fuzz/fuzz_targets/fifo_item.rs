#![no_main]
//! The 64-byte advertised descriptor: never panics; round-trips.
use libfuzzer_sys::fuzz_target;
use tcpx_p2p_wire::FifoItem;

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = FifoItem::decode(data) {
        assert_eq!(FifoItem::decode(&f.to_bytes()), Ok(f));
    }
});
