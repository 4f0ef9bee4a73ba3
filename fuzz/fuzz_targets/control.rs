#![no_main]
//! Control messages from a peer (notifications included): never panic; round-trip.
use libfuzzer_sys::fuzz_target;
use tcpx_p2p_wire::Control;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Control::decode(data) {
        let mut v = Vec::new();
        m.encode(&mut v);
        assert_eq!(Control::decode(&v), Ok(m));
    }
});
