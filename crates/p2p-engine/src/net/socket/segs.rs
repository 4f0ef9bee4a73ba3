//! A message's memory: one segment or several gathered in order, the
//! pieces a part occupies, and the staging windows device pieces are cut
//! into.

use super::{BATCH_PART, MAX_SEGS, NET};
use crate::error::NetError;
use crate::gpu;
use crate::memory::MemKind;
use crate::net::MemRef;

/// The memory of one message: one segment, or several gathered in order.
pub(super) struct Segs {
    pub(super) segs: Vec<MemRef>,
    /// Offset of each segment in the message.
    starts: Vec<usize>,
    pub(super) total: usize,
    /// 0 for one segment (a shorter message may then fill it); for several,
    /// a digest of their lengths, which the sender's must equal (else bytes
    /// would land across block boundaries).
    pub(super) shape: u64,
}

impl Segs {
    pub(super) fn new(segs: &[MemRef]) -> Result<Self, NetError> {
        if segs.is_empty() || segs.len() > MAX_SEGS {
            return Err(NetError::Misuse {
                net: NET,
                reason: format!(
                    "a request of {} segments (1 to {MAX_SEGS} allowed)",
                    segs.len()
                ),
            });
        }
        let mut starts = Vec::with_capacity(segs.len());
        let mut total = 0usize;
        for m in segs {
            starts.push(total);
            total = total.checked_add(m.len).ok_or_else(|| NetError::Misuse {
                net: NET,
                reason: "segments whose lengths overflow".into(),
            })?;
        }
        Ok(Segs {
            shape: shape_of(segs),
            segs: segs.to_vec(),
            starts,
            total,
        })
    }

    /// The pieces of segments that bytes `[off, off+len)` of the message
    /// occupy, in order.
    pub(super) fn pieces(&self, off: usize, len: usize) -> Vec<MemRef> {
        let mut out = Vec::new();
        let mut i = self.starts.partition_point(|&s| s <= off).saturating_sub(1);
        let (mut off, mut left) = (off, len);
        while left > 0 && i < self.segs.len() {
            let m = self.segs[i];
            let inner = off - self.starts[i];
            let take = m.len.saturating_sub(inner).min(left);
            if take > 0 {
                out.push(MemRef {
                    addr: m.addr + inner as u64,
                    len: take,
                    kind: m.kind,
                });
            }
            off += take;
            left -= take;
            i += 1;
        }
        out
    }
}

/// The shape of a message's segments (see [`Segs::shape`]): 0 for one
/// segment; for several, a digest of their count and lengths taken a
/// 64-bit word at a time (one multiply per segment, where a byte-wise
/// digest took eight), finished so every input bit reaches every output
/// bit. Both peers must compute it alike (the wire version says which).
pub(super) fn shape_of(segs: &[MemRef]) -> u64 {
    if segs.len() == 1 {
        return 0;
    }
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h = (segs.len() as u64 ^ 0xcbf2_9ce4_8422_2325).wrapping_mul(K);
    for m in segs {
        h = (h.rotate_left(23) ^ m.len as u64).wrapping_mul(K);
    }
    // A final mix (xor-shift, multiply) spreads the last length's bits.
    h ^= h >> 32;
    h = h.wrapping_mul(0xd6e8_feb8_6659_fd93);
    h ^= h >> 32;
    h | 1
}

/// The one memory kind of `pieces` (host for none), or None when mixed.
pub(super) fn uniform_kind(pieces: &[MemRef]) -> Option<MemKind> {
    let k = pieces.first().map_or(MemKind::Host, |m| m.kind);
    pieces.iter().all(|m| m.kind == k).then_some(k)
}

/// A staging window: its length, and each piece's (device address, offset
/// in the window, length).
pub(super) type Window = (usize, Vec<(u64, usize, usize)>);

/// Cuts device pieces into staging windows of at most `slice` bytes.
pub(super) fn windows(run: &[MemRef], slice: usize) -> Vec<Window> {
    let mut out = Vec::new();
    let (mut cur, mut used) = (Vec::new(), 0);
    for m in run {
        let mut done = 0;
        while done < m.len {
            if used == slice {
                out.push((used, std::mem::take(&mut cur)));
                used = 0;
            }
            let l = (m.len - done).min(slice - used);
            cur.push((m.addr + done as u64, used, l));
            used += l;
            done += l;
        }
    }
    if used > 0 {
        out.push((used, cur));
    }
    out
}

/// The copies between a window's device pieces and a slot at `slot`:
/// into the slot (`to_slot`, sending) or out of it (receiving). Pieces
/// that follow each other both in the GPU and in the slot are one copy
/// ([`gpu::push_copy`]): a batch of small parts, or the blocks of a KV list
/// back to back in the GPU (a window of 256 such 4 KiB blocks was 256
/// copies of the kernel; it is one copy).
pub(super) fn window_copies(
    pieces: &[(u64, usize, usize)],
    slot: u64,
    to_slot: bool,
) -> Vec<gpu::CopyOp> {
    let mut ops = Vec::with_capacity(pieces.len());
    for &(dev, at, len) in pieces {
        let host = slot + at as u64;
        let (dst, src) = if to_slot { (host, dev) } else { (dev, host) };
        gpu::push_copy(&mut ops, gpu::CopyOp { dst, src, len });
    }
    ops
}

/// The GPU of a device-memory part small enough to share one staged copy
/// (and one wait) with its neighbours, on either side of a stream.
pub(super) fn small_gpu_part(pieces: &[MemRef], len: usize, slice: usize) -> Option<i32> {
    match uniform_kind(pieces) {
        Some(MemKind::Cuda(d)) if len > 0 && len <= BATCH_PART.min(slice) => Some(d),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(addr: u64, len: usize) -> MemRef {
        MemRef {
            addr,
            len,
            kind: MemKind::Host,
        }
    }

    #[test]
    fn segments_map_message_offsets_to_pieces() {
        let segs =
            Segs::new(&[host(1000, 10), host(5000, 0), host(2000, 30), host(9000, 5)]).unwrap();
        assert_eq!(segs.total, 45);
        assert_eq!(
            segs.pieces(0, 45)
                .iter()
                .map(|m| (m.addr, m.len))
                .collect::<Vec<_>>(),
            [(1000, 10), (2000, 30), (9000, 5)]
        );
        assert_eq!(
            segs.pieces(8, 4)
                .iter()
                .map(|m| (m.addr, m.len))
                .collect::<Vec<_>>(),
            [(1008, 2), (2000, 2)]
        );
        assert_eq!(
            segs.pieces(10, 30)
                .iter()
                .map(|m| (m.addr, m.len))
                .collect::<Vec<_>>(),
            [(2000, 30)]
        );
        assert_eq!(
            segs.pieces(39, 6)
                .iter()
                .map(|m| (m.addr, m.len))
                .collect::<Vec<_>>(),
            [(2029, 1), (9000, 5)]
        );
        assert!(segs.pieces(45, 0).is_empty());
        // Shape: 0 for one segment; equal only for equal lengths.
        assert_eq!(Segs::new(&[host(1, 7)]).unwrap().shape, 0);
        let a = Segs::new(&[host(1, 4), host(9, 4)]).unwrap().shape;
        assert_ne!(a, 0);
        assert_eq!(a, Segs::new(&[host(100, 4), host(300, 4)]).unwrap().shape);
        assert_ne!(a, Segs::new(&[host(1, 8)]).unwrap().shape);
        assert_ne!(a, Segs::new(&[host(1, 2), host(9, 6)]).unwrap().shape);
        // Order and count matter; a length's high bytes count as much as its low.
        let b = Segs::new(&[host(1, 4), host(9, 8)]).unwrap().shape;
        assert_ne!(b, Segs::new(&[host(1, 8), host(9, 4)]).unwrap().shape);
        assert_ne!(
            a,
            Segs::new(&[host(1, 4), host(9, 4), host(20, 0)])
                .unwrap()
                .shape
        );
        let high = Segs::new(&[host(1, 4), host(9, 4 + (1 << 40))])
            .unwrap()
            .shape;
        assert_ne!(a, high);
        assert!(Segs::new(&[]).is_err());
        assert!(Segs::new(&vec![host(1, 1); MAX_SEGS + 1]).is_err());
    }

    #[test]
    fn a_windows_back_to_back_blocks_are_one_copy_either_way() {
        let dev = |addr, len| MemRef {
            addr,
            len,
            kind: MemKind::Cuda(0),
        };
        // 256 blocks of 4 KiB back to back in the GPU, then two apart.
        let mut run: Vec<MemRef> = (0..256).map(|i| dev(1 << 30 | i << 12, 4096)).collect();
        run.push(dev(5 << 30, 4096));
        run.push(dev(7 << 30, 4096));
        let w = windows(&run, 2 << 20);
        assert_eq!(w.len(), 1);
        let slot = 1 << 40;
        for to_slot in [true, false] {
            let ops = window_copies(&w[0].1, slot, to_slot);
            assert_eq!(
                ops.len(),
                3,
                "one copy for the run, one each for the others"
            );
            let (host, gpu) = (slot, 1u64 << 30);
            let (dst, src) = if to_slot { (host, gpu) } else { (gpu, host) };
            assert_eq!(
                ops[0],
                gpu::CopyOp {
                    dst,
                    src,
                    len: 1 << 20
                }
            );
            assert_eq!(ops[2].len, 4096);
        }
    }

    #[test]
    fn windows_cover_pieces_once() {
        let run = [host(0, 300), host(1000, 50), host(5000, 700)];
        let w = windows(&run, 256);
        assert_eq!(
            w.iter().map(|x| x.0).collect::<Vec<_>>(),
            [256, 256, 256, 256, 26]
        );
        assert_eq!(w[1].1, vec![(256, 0, 44), (1000, 44, 50), (5000, 94, 162)]);
        let mut seen: Vec<(u64, usize)> = w
            .iter()
            .flat_map(|x| x.1.iter().map(|&(a, _, l)| (a, l)))
            .collect();
        seen.sort();
        let bytes: usize = seen.iter().map(|x| x.1).sum();
        assert_eq!(bytes, 1050);
    }
}
