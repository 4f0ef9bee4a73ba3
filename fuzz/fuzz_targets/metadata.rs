#![no_main]
//! Endpoint metadata: decoding never panics; what decodes re-encodes to the same bytes.
use libfuzzer_sys::fuzz_target;
use tcpx_p2p_wire::Metadata;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Metadata::decode(data) {
        let mut v = Vec::new();
        m.encode(&mut v);
        assert_eq!(v, data);
    }
});
