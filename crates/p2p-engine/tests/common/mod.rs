//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test binary uses its own share of them

use tcpx_p2p::{Buf, Endpoint};

/// `n` deterministic bytes, different for each seed.
pub fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

/// Registers `len` bytes at `ptr` (host or device) with `ep`.
pub fn reg_buf(ep: &Endpoint, ptr: u64, len: usize) -> Buf {
    Buf {
        mr: ep.reg(ptr, len).unwrap(),
        ptr,
        len,
    }
}

/// Registers a host vector with `ep`.
pub fn buf(ep: &Endpoint, v: &mut [u8]) -> Buf {
    reg_buf(ep, v.as_mut_ptr() as u64, v.len())
}
