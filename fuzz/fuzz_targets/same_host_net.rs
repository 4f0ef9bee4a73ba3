#![no_main]
//! The same-host net's listen handle and channel messages: never panic;
//! whatever decodes re-encodes to the same bytes.
use libfuzzer_sys::fuzz_target;
use tcpx_p2p_wire::same_host_net::{NetHandleV1, NetMsg};

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = NetMsg::decode(data) {
        let mut v = Vec::new();
        m.encode(&mut v);
        assert_eq!(v, data);
    }
    if let Ok(h) = NetHandleV1::decode(data) {
        let v: [u8; 128] = h.encode();
        assert_eq!(NetHandleV1::decode(&v), Ok(h));
    }
});
