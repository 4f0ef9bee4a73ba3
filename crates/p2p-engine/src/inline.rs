//! The raw-memory edge of inline transfers: a small write's data, or a
//! small read's answer, carried on the control connection right after its
//! frame (`WriteInline` / `ReadData`, see [`crate::wire::MAX_INLINE`]).
//! One round trip instead of two, and no net request posted for it.
//!
//! Callers have resolved every range against a registered region (and, for
//! a peer's request, against an advertisement of ours) before calling
//! these; that is what makes the raw pointers here valid. Host memory is
//! read into and written from in place; GPU memory goes through a
//! per-thread pinned host buffer and one blocking copy (`gpu::copy_sync`).

#![allow(unsafe_code)]

use std::cell::RefCell;
use std::io::{self, IoSlice, Read, Write};

use crate::gpu;
use crate::memory::MemKind;
use crate::pieces::Pieces;

thread_local! {
    /// Host side of GPU inline copies: pinned, so that each is one DMA
    /// (measured on one H100, a 64 KiB copy into the GPU takes 13.6 µs from
    /// pinned memory, 21.8 from pageable). Grows to the largest seen (at
    /// most `wire::MAX_INLINE`) and is kept, so no transfer allocates it.
    static SCRATCH: RefCell<Option<gpu::PinnedBuf>> = const { RefCell::new(None) };
}

/// Runs `f` on the first `n` bytes of this thread's scratch, made (or
/// remade larger) first with GPU `dev`'s context current.
fn with_scratch<R>(
    dev: i32,
    n: usize,
    f: impl FnOnce(&mut [u8]) -> io::Result<R>,
) -> io::Result<R> {
    bind(dev)?;
    SCRATCH.with(|c| {
        let mut slot = c.borrow_mut();
        let buf = match slot.take() {
            Some(b) if b.len() >= n => b,
            old => {
                drop(old);
                gpu::PinnedBuf::new(n.next_power_of_two().max(64 << 10)).map_err(cuda)?
            }
        };
        let buf = slot.insert(buf);
        f(buf.as_mut_slice(n))
    })
}

fn cuda(e: crate::error::CudaError) -> io::Error {
    io::Error::other(e.to_string())
}

/// Makes GPU `dev`'s context current on this thread.
fn bind(dev: i32) -> io::Result<()> {
    gpu::Device::get(dev).and_then(|d| d.bind()).map_err(cuda)
}

/// Reads the payload from `s` into `local`, in order: exactly the sum of
/// their lengths.
pub(crate) fn land(s: &mut impl Read, local: &Pieces) -> io::Result<()> {
    for m in local.mems() {
        match m.kind {
            MemKind::Host => {
                // SAFETY: `m` lies inside a live registered host region (the
                // caller resolved it; `local` holds the region), and the
                // transfer owns the range until it completes.
                let dst = unsafe { std::slice::from_raw_parts_mut(m.addr as *mut u8, m.len) };
                s.read_exact(dst)?;
            }
            MemKind::Cuda(dev) => with_scratch(dev, m.len, |buf| {
                s.read_exact(buf)?;
                tracing::trace!(bytes = m.len, "lat: inline payload read");
                // SAFETY: `m` is device memory of a live registered region
                // (resolved by the caller); `buf` holds `m.len` bytes.
                unsafe { gpu::copy_sync(m.addr, buf.as_ptr() as u64, m.len) }.map_err(cuda)
            })?,
        }
    }
    Ok(())
}

/// Reads and drops `len` bytes (a refused inline write's payload), through
/// a small fixed buffer.
pub(crate) fn drain(s: &mut impl Read, len: usize) -> io::Result<()> {
    let n = io::copy(&mut s.take(len as u64), &mut io::sink())?;
    if n != len as u64 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Writes one frame (its length prefix included) followed by the bytes of
/// `local`, in as few system calls as the kernel takes them.
pub(crate) fn write_with_payload(
    w: &mut impl Write,
    head: &[u8],
    local: &Pieces,
) -> io::Result<()> {
    if local.mems().iter().all(|m| m.kind == MemKind::Host) {
        let mut slices = Vec::with_capacity(1 + local.len());
        slices.push(IoSlice::new(head));
        for m in local.mems() {
            // SAFETY: `m` lies inside a live registered host region (the
            // caller resolved it; `local` holds the region).
            slices.push(IoSlice::new(unsafe {
                std::slice::from_raw_parts(m.addr as *const u8, m.len)
            }));
        }
        return write_all_vectored(w, &mut slices);
    }
    // Some GPU memory: gather everything into the host buffer first.
    let dev = local
        .mems()
        .iter()
        .find_map(|m| match m.kind {
            MemKind::Cuda(d) => Some(d),
            MemKind::Host => None,
        })
        .unwrap_or(0);
    with_scratch(dev, local.total(), |buf| {
        let mut at = 0;
        for m in local.mems() {
            let dst = &mut buf[at..at + m.len];
            match m.kind {
                MemKind::Host => {
                    // SAFETY: as above.
                    dst.copy_from_slice(unsafe {
                        std::slice::from_raw_parts(m.addr as *const u8, m.len)
                    })
                }
                MemKind::Cuda(dev) => {
                    bind(dev)?;
                    // SAFETY: `m` is device memory of a live registered
                    // region; `dst` holds `m.len` bytes.
                    unsafe { gpu::copy_sync(dst.as_mut_ptr() as u64, m.addr, m.len) }
                        .map_err(cuda)?
                }
            }
            at += m.len;
        }
        tracing::trace!(bytes = at, "lat: inline payload copied");
        write_all_vectored(w, &mut [IoSlice::new(head), IoSlice::new(buf)])
    })
}

fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Region, Registry};
    use crate::net::MemRef;
    use std::sync::Arc;

    #[test]
    fn payload_goes_out_after_its_frame_and_lands_in_order() {
        let reg = Registry::new();
        let src: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; 10_000];
        let rs = reg.register(src.as_ptr() as u64, src.len()).unwrap();
        let rd = reg.register(dst.as_ptr() as u64, dst.len()).unwrap();
        let piece = |base: u64, off: u64, len: usize, r: &Arc<Region>| {
            (
                MemRef {
                    addr: base + off,
                    len,
                    kind: MemKind::Host,
                },
                r.clone(),
            )
        };
        let s0 = src.as_ptr() as u64;
        let d0 = dst.as_mut_ptr() as u64;
        let from: Pieces = [piece(s0, 0, 3000, &rs), piece(s0, 5000, 4000, &rs)]
            .into_iter()
            .collect();
        let to: Pieces = [piece(d0, 100, 3000, &rd), piece(d0, 6000, 4000, &rd)]
            .into_iter()
            .collect();
        let mut wire = Vec::new();
        let mut head = 3u32.to_le_bytes().to_vec();
        head.extend_from_slice(b"hdr");
        write_with_payload(&mut wire, &head, &from).unwrap();
        assert_eq!(&wire[..4], &3u32.to_le_bytes());
        assert_eq!(&wire[4..7], b"hdr");
        assert_eq!(wire.len(), 7 + 7000);
        let mut r = &wire[7..];
        land(&mut r, &to).unwrap();
        assert!(r.is_empty());
        assert_eq!(&dst[100..3100], &src[..3000]);
        assert_eq!(&dst[6000..10_000], &src[5000..9000]);
        assert!(dst[..100].iter().all(|&b| b == 0));
        assert!(dst[3100..6000].iter().all(|&b| b == 0));
        // Too few bytes: an error, not a hang or a short landing reported whole.
        let mut short = &wire[7..100];
        assert!(land(&mut short, &to).is_err());
        let mut r = &wire[7..];
        drain(&mut r, 7000).unwrap();
        assert!(r.is_empty());
        assert!(drain(&mut &wire[..10], 11).is_err());
    }
}
