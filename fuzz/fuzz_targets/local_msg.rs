#![no_main]
//! The same-host handshake and control messages: never panic; round-trip.
use libfuzzer_sys::fuzz_target;
use tcpx_p2p_wire::same_host::{LocalHello, LocalMsg};

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = LocalMsg::decode(data) {
        let mut v = Vec::new();
        m.encode(&mut v);
        assert_eq!(LocalMsg::decode(&v), Ok(m));
    }
    if let Ok(h) = LocalHello::decode(data) {
        let mut v = Vec::new();
        h.encode(&mut v);
        assert_eq!(LocalHello::decode(&v), Ok(h));
    }
});
