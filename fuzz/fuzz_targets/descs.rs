#![no_main]
//! Serialized descriptor lists: never panic; round-trip.
use libfuzzer_sys::fuzz_target;
use tcpx_p2p_wire::{decode_descs, encode_descs};

fuzz_target!(|data: &[u8]| {
    if let Ok(l) = decode_descs(data) {
        let mut v = Vec::new();
        encode_descs(&l, &mut v);
        assert_eq!(v, data);
    }
});
