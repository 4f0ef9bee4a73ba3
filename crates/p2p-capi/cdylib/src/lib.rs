//! `libtcpx_p2p.so`: the C API ([`tcpx_p2p_capi`]) as a shared library. A
//! cdylib exports the `#[no_mangle]` functions of the crates it links; this
//! crate only links the C API crate.
pub use tcpx_p2p_capi::*;
