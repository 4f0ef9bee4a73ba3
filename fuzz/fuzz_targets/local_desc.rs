#![no_main]
//! The same-host IPC descriptor: never panics; what decodes re-encodes to
//! the same bytes.
use libfuzzer_sys::fuzz_target;
use tcpx_p2p_wire::same_host::IpcDesc;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = IpcDesc::decode(data) {
        assert_eq!(d.to_bytes(), data);
    }
});
