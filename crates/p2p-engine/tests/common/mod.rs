//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test binary uses its own share of them

use std::path::PathBuf;

pub mod budget;

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

/// `count` blocks of `bs` bytes back to back from the start of `base`.
pub fn blocks(base: &Buf, count: usize, bs: usize) -> Vec<Buf> {
    (0..count)
        .map(|i| Buf {
            mr: base.mr,
            ptr: base.ptr + (i * bs) as u64,
            len: bs,
        })
        .collect()
}

/// Where block `i` of `count` lands, as KV blocks land in another order
/// on the target: a permutation (7919 is prime; `count` must not be a
/// multiple of it) that leaves no two neighbours adjacent.
pub fn scrambled(i: usize, count: usize) -> usize {
    (i * 7919) % count
}

/// The peer's side of `count` blocks of `bs` bytes written to (or read
/// from) their [`scrambled`] slots of the range `remote` names.
pub fn scrambled_offsets(
    remote: tcpx_p2p::RemoteDesc,
    count: usize,
    bs: usize,
) -> Vec<(tcpx_p2p::RemoteDesc, u64)> {
    (0..count)
        .map(|i| (remote, (scrambled(i, count) * bs) as u64))
        .collect()
}

/// Whether every `bs`-byte block `i` of `src` sits in `target` at its
/// [`scrambled`] slot.
pub fn placed(target: &[u8], src: &[u8], bs: usize) -> bool {
    let count = src.len() / bs;
    (0..count).all(|i| target[scrambled(i, count) * bs..][..bs] == src[i * bs..][..bs])
}

/// Where the built emulator is: `$NCCL_NET_EMU_PATH`, else in this test's
/// target directory (`deps/`, where `cargo test --workspace` builds it, then
/// the profile directory, where `cargo build` puts it), else the workspace
/// target.
pub fn emu_path() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("NCCL_NET_EMU_PATH") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let name = "libnccl_net_emu.so";
    let mut dirs = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        // target/<profile>/deps/plugin-<hash>
        if let Some(deps) = exe.parent() {
            dirs.push(deps.to_path_buf());
            if let Some(profile) = deps.parent() {
                dirs.push(profile.to_path_buf());
            }
        }
    }
    let ws = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target");
    dirs.push(ws.join("debug"));
    dirs.push(ws.join("release"));
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}
