//! The receives each stream expects, and what a part header must satisfy
//! before any byte of it lands in one ([`check_part`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::segs::Segs;
use super::wire::PartHeader;
use crate::error::NetError;
use crate::net::Waker;

pub(super) struct RecvReq {
    pub(super) segs: Segs,
    pub(super) parts_done: AtomicUsize,
    /// (total bytes, parts) once the first header has been seen.
    pub(super) shape: Mutex<Option<(usize, usize)>>,
    pub(super) done: AtomicBool,
    /// Streams the receive was entered on: those of the parts a message
    /// of its full size would have (a shorter message may have fewer).
    pub(super) lanes: usize,
}

/// The receives that still expect a part on one stream. Each stream's
/// thread looks only at its own book, so receive threads never contend
/// with each other, and the poster wakes only the streams it concerns.
#[derive(Default)]
pub(super) struct LaneBook {
    /// seq → the receive and which of its parts rides this stream.
    pub(super) due: HashMap<u64, (Arc<RecvReq>, usize)>,
    /// Entries whose part is the message's first (whose wait is latency).
    pub(super) firsts: usize,
}

impl LaneBook {
    pub(super) fn insert(&mut self, seq: u64, req: Arc<RecvReq>, part: usize) {
        self.firsts += usize::from(part == 0);
        self.due.insert(seq, (req, part));
    }

    pub(super) fn take(&mut self, seq: u64) -> Option<Arc<RecvReq>> {
        let (req, part) = self.due.remove(&seq)?;
        self.firsts -= usize::from(part == 0);
        Some(req)
    }
}

pub(super) struct RecvLaneQ {
    pub(super) book: Mutex<LaneBook>,
    pub(super) cv: Condvar,
}

pub(super) struct RecvShared {
    pub(super) lanes: Vec<RecvLaneQ>,
    /// Receives `0..posted` have been entered on their streams' books.
    pub(super) posted: AtomicU64,
    pub(super) closing: AtomicBool,
    pub(super) failed: Mutex<Option<NetError>>,
    pub(super) waker: Waker,
}

impl RecvShared {
    /// Wakes every stream's thread (closing, failing).
    pub(super) fn notify_all(&self) {
        for q in &self.lanes {
            q.cv.notify_all();
        }
    }
}

/// A received part whose bytes are still being copied to the GPU.
pub(super) struct Landing {
    pub(super) req: Arc<RecvReq>,
    pub(super) seq: u64,
    pub(super) nparts: usize,
}

/// Counts one part of a receive as done; the last one completes it.
pub(super) fn part_done(shared: &RecvShared, l: Landing) {
    if l.req.parts_done.fetch_add(1, Ordering::AcqRel) + 1 == l.nparts {
        tracing::trace!(seq = l.seq, "lat: rx done");
        l.req.done.store(true, Ordering::Release);
        // A message shorter than its receive has fewer parts than the
        // streams the receive was entered on: drop those entries.
        let n = shared.lanes.len();
        for i in l.nparts..l.req.lanes {
            shared.lanes[(l.seq as usize + i) % n]
                .book
                .lock()
                .take(l.seq);
        }
        (shared.waker)();
    }
}

/// Most parts a message may be cut into (the most streams a comm has).
const MAX_PARTS: u64 = 64;

/// Why a part header does not fit the receive it matched (the peer broke
/// the protocol).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PartFault {
    #[error(
        "message {seq} of {total} bytes (part {off}+{len}) does not fit the posted {posted} bytes"
    )]
    DoesNotFit {
        seq: u64,
        total: u64,
        off: u64,
        len: u64,
        posted: usize,
    },
    #[error("message {seq} is gathered from blocks other than the {segs} the receive scatters into (the sender's and the receiver's block sizes must match)")]
    Shape { seq: u64, segs: usize },
    #[error("inconsistent part headers for message {seq}")]
    Inconsistent { seq: u64 },
}

/// Checks part header `h` against the receive it matched, posted into
/// `segs`: the part must lie inside the message, the message inside the
/// posted memory, its segments shaped as the receive's, and its total and
/// part count those of the message's other parts (`seen`, set by the first
/// part checked). Only then may its bytes land in `segs.pieces(off, len)`.
pub(crate) fn check_part(
    h: &PartHeader,
    segs: &Segs,
    seen: &mut Option<(usize, usize)>,
) -> Result<(), PartFault> {
    let fits = h.off.checked_add(h.len).is_some_and(|end| end <= h.total)
        && h.total <= segs.total as u64
        && h.nparts != 0
        && h.nparts <= MAX_PARTS;
    if !fits {
        return Err(PartFault::DoesNotFit {
            seq: h.seq,
            total: h.total,
            off: h.off,
            len: h.len,
            posted: segs.total,
        });
    }
    if h.shape != segs.shape {
        return Err(PartFault::Shape {
            seq: h.seq,
            segs: segs.segs.len(),
        });
    }
    let this = (h.total as usize, h.nparts as usize);
    match *seen {
        None => *seen = Some(this),
        Some(sh) if sh != this => return Err(PartFault::Inconsistent { seq: h.seq }),
        _ => {}
    }
    Ok(())
}

/// A hostile peer's bytes through the receive side's checks (fuzzing):
/// the first 48 bytes are a part header, the rest the lengths of the
/// posted receive's segments (one byte each, in KiB). Panics if a part
/// that passes the checks would land outside the posted memory.
#[cfg(any(test, feature = "fuzzing"))]
pub fn fuzz_part_header(data: &[u8]) {
    use crate::memory::MemKind;
    use crate::net::MemRef;
    let Some((head, rest)) = data.split_first_chunk::<{ super::wire::HDR_LEN }>() else {
        return;
    };
    let Ok(h) = PartHeader::decode(head) else {
        panic!("48 bytes must decode");
    };
    let lens: Vec<usize> = rest
        .iter()
        .take(32)
        .map(|&b| usize::from(b) << 10)
        .collect();
    let mut addr = 1u64 << 40;
    let posted: Vec<MemRef> = if lens.is_empty() { vec![4096] } else { lens }
        .into_iter()
        .map(|len| {
            let m = MemRef {
                addr,
                len,
                kind: MemKind::Host,
            };
            addr += len as u64 + 4096;
            m
        })
        .collect();
    let Ok(segs) = Segs::new(&posted) else {
        return;
    };
    // A sender with the same segments shapes its header as the receive's.
    let headers = [
        h,
        PartHeader {
            shape: segs.shape,
            ..h
        },
    ];
    for h in headers {
        let mut seen = None;
        if check_part(&h, &segs, &mut seen).is_err() {
            continue;
        }
        let pieces = segs.pieces(h.off as usize, h.len as usize);
        let landed: usize = pieces.iter().map(|m| m.len).sum();
        assert_eq!(landed, h.len as usize, "a checked part lands whole");
        for p in &pieces {
            let inside = posted
                .iter()
                .any(|m| p.addr >= m.addr && p.addr + p.len as u64 <= m.addr + m.len as u64);
            assert!(inside, "{p:?} lies outside the posted receive");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemKind;
    use crate::net::MemRef;
    use rand::{Rng, SeedableRng};

    fn host(addr: u64, len: usize) -> MemRef {
        MemRef {
            addr,
            len,
            kind: MemKind::Host,
        }
    }

    #[test]
    fn parts_outside_the_posted_receive_are_refused() {
        let segs = Segs::new(&[host(1 << 20, 1000)]).unwrap();
        let ok = PartHeader {
            seq: 3,
            off: 500,
            len: 500,
            total: 1000,
            nparts: 2,
            shape: 0,
            spliced: false,
        };
        let mut seen = None;
        assert_eq!(check_part(&ok, &segs, &mut seen), Ok(()));
        assert_eq!(seen, Some((1000, 2)));
        let bad = |h: PartHeader| check_part(&h, &segs, &mut None);
        assert!(matches!(
            bad(PartHeader {
                total: 1001,
                off: 501,
                ..ok
            }),
            Err(PartFault::DoesNotFit { .. })
        ));
        assert!(matches!(
            bad(PartHeader { len: 501, ..ok }),
            Err(PartFault::DoesNotFit { .. })
        ));
        assert!(matches!(
            bad(PartHeader {
                off: u64::MAX,
                ..ok
            }),
            Err(PartFault::DoesNotFit { .. })
        ));
        assert!(matches!(
            bad(PartHeader { nparts: 0, ..ok }),
            Err(PartFault::DoesNotFit { .. })
        ));
        assert!(matches!(
            bad(PartHeader { nparts: 65, ..ok }),
            Err(PartFault::DoesNotFit { .. })
        ));
        assert!(matches!(
            bad(PartHeader { shape: 7, ..ok }),
            Err(PartFault::Shape { .. })
        ));
        // A later part must agree with the first on the message's shape.
        let later = PartHeader {
            off: 0,
            total: 900,
            ..ok
        };
        assert_eq!(
            check_part(&later, &segs, &mut seen),
            Err(PartFault::Inconsistent { seq: 3 })
        );
    }

    #[test]
    fn random_headers_never_land_outside_the_posted_receive() {
        // Seeded random headers (and, half the time, headers near the
        // posted receive's edges) through the same checks a receive
        // thread runs; `fuzz_part_header` panics on a write outside.
        let mut rng = rand::rngs::StdRng::seed_from_u64(19);
        for i in 0..20_000 {
            let mut data = vec![0u8; 48 + rng.random_range(0..8)];
            rng.fill(&mut data[..]);
            if i % 2 == 0 {
                let posted: u64 = data[48..].iter().map(|&b| u64::from(b) << 10).sum();
                let total = rng.random_range(0..=posted + 2);
                let off = rng.random_range(0..=total + 1);
                let len = rng.random_range(0..=total.saturating_sub(off) + 1);
                for (j, v) in [off, len, total, rng.random_range(0..3)]
                    .into_iter()
                    .enumerate()
                {
                    data[8 + j * 8..16 + j * 8].copy_from_slice(&v.to_le_bytes());
                }
            }
            fuzz_part_header(&data);
        }
    }
}
