#![no_main]
//! The connection handshake: never panics; round-trips.
use libfuzzer_sys::fuzz_target;
use tcpx_p2p::internal::wire::Hello;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Hello::decode(data) {
        let mut v = Vec::new();
        h.encode(&mut v);
        assert_eq!(Hello::decode(&v), Ok(h));
    }
});
