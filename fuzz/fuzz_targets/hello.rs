#![no_main]
//! The connection handshake's frames (hello, then refusal / proof /
//! handles): never panic; round-trip.
use libfuzzer_sys::fuzz_target;
use tcpx_p2p_wire::{HandshakeMsg, Hello};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Hello::decode(data) {
        let mut v = Vec::new();
        h.encode(&mut v);
        assert_eq!(Hello::decode(&v), Ok(h));
    }
    if let Ok(m) = HandshakeMsg::decode(data) {
        let mut v = Vec::new();
        m.encode(&mut v);
        assert_eq!(HandshakeMsg::decode(&v), Ok(m));
    }
});
