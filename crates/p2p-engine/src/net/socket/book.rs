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
    /// Parts whose headers passed the checks, one bit each: a part is
    /// accepted once ([`claim_part`]).
    pub(super) claimed: AtomicU64,
    pub(super) done: AtomicBool,
    /// Parts being written into its memory now: a failed receive is
    /// reported only once none is, so that its caller, seeing the failure,
    /// may free the memory (a peer that sent a part twice failed the
    /// receive while the first copy was still landing).
    pub(super) landing: AtomicUsize,
}

/// The receives posted and still expecting a part, keyed by message
/// sequence number. One per comm: a part may ride any of the streams open
/// when it was sent (their number grows with the traffic, see
/// [`super::streams`]), so every stream's task looks here.
#[derive(Default)]
pub(super) struct Book {
    pub(super) due: HashMap<u64, Arc<RecvReq>>,
}

impl Book {
    /// Whether a message whose first part is still due would have it on
    /// stream `index` of `streams` if the sender's streams were idle (it
    /// then gives part i of message `seq` to stream (seq + i) mod its
    /// stream count; the receiver's count is the same once every stream is
    /// in): a hint for spinning, not a rule (a busy sender gives parts to
    /// its least-queued streams).
    pub(super) fn first_due_on(&self, index: usize, streams: usize) -> bool {
        let n = streams.max(1) as u64;
        self.due
            .iter()
            .any(|(&seq, r)| seq % n == index as u64 && r.claimed.load(Ordering::Acquire) & 1 == 0)
    }
}

pub(super) struct RecvShared {
    pub(super) book: Mutex<Book>,
    /// Signalled when a receive is entered in the book (and at close).
    pub(super) cv: Condvar,
    /// Receive streams accepted so far (the spinning rule's guess of the
    /// sender's count).
    pub(super) streams: AtomicUsize,
    /// How the peer cuts messages: the listen handle's streams and
    /// smallest part (see [`claim_part`]).
    pub(super) split: (usize, usize),
    /// Receives `0..posted` have been entered in the book.
    pub(super) posted: AtomicU64,
    pub(super) closing: AtomicBool,
    pub(super) failed: Mutex<Option<NetError>>,
    pub(super) waker: Waker,
    /// Per stream (by its index), the message of the last part header
    /// read on it. A stream carries the sender's messages in the order they
    /// were sent (each stream's parts go out in order), so no part of an
    /// earlier message can come on it any more.
    past: Box<[AtomicU64]>,
}

impl RecvShared {
    /// A receive comm's state before any stream is in or any receive is
    /// posted; `split`: how the peer cuts messages (its listen handle's
    /// streams and smallest part).
    pub(super) fn new(split: (usize, usize), waker: Waker) -> Self {
        RecvShared {
            book: Mutex::new(Book::default()),
            cv: Condvar::new(),
            streams: AtomicUsize::new(0),
            split,
            posted: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            failed: Mutex::new(None),
            waker,
            past: (0..split.0).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Stream `index` read a part header of message `seq`.
    pub(super) fn moved_past(&self, index: usize, seq: u64) {
        if let Some(p) = self.past.get(index) {
            p.fetch_max(seq, Ordering::AcqRel);
        }
    }

    /// What stream `index` has gone past (tests).
    #[cfg(test)]
    pub(super) fn past_of(&self, index: usize) -> Option<u64> {
        self.past.get(index).map(|p| p.load(Ordering::Acquire))
    }

    /// Why the comm must fail, where a posted receive still lacks parts
    /// once every stream is in and has read a header of a later message
    /// (none can come for it: it would wait for ever). Looked at only when
    /// the streams have all gone past message `from` (without the book's
    /// lock otherwise). While a stream is still to come it may bring any
    /// message's part.
    pub(super) fn stranded(&self, from: u64) -> Option<NetError> {
        if self.streams.load(Ordering::Acquire) < self.past.len() {
            return None;
        }
        let past = self.past.iter().map(|p| p.load(Ordering::Acquire)).min()?;
        if past <= from {
            return None;
        }
        let seq = self
            .book
            .lock()
            .due
            .keys()
            .copied()
            .filter(|&seq| seq < past)
            .min()?;
        Some(NetError::Protocol {
            net: super::NET,
            reason: format!(
                "message {seq} lacks parts that no stream can bring: every stream has gone on to message {past} or later (the sender broke its order, or skipped them)"
            ),
        })
    }

    /// Fails the comm with its first failure, which every receive not yet
    /// done then reports; later failures are not kept.
    pub(super) fn fail(&self, e: NetError) {
        if !self.closing.load(Ordering::Acquire) {
            self.failed.lock().get_or_insert(e);
            self.closing.store(true, Ordering::Release);
            self.notify_all();
            (self.waker)();
        }
    }

    /// Enters the receive of message `seq` into `segs` in the book (the
    /// streams waiting for it are told), and marks receives up to it
    /// posted.
    pub(super) fn enter(&self, seq: u64, segs: Segs) -> Arc<RecvReq> {
        let req = Arc::new(RecvReq {
            segs,
            parts_done: AtomicUsize::new(0),
            shape: Mutex::new(None),
            claimed: AtomicU64::new(0),
            done: AtomicBool::new(false),
            landing: AtomicUsize::new(0),
        });
        self.book.lock().due.insert(seq, req.clone());
        self.cv.notify_all();
        self.posted.store(seq + 1, Ordering::Release);
        req
    }

    /// Wakes every stream's thread (closing, failing).
    pub(super) fn notify_all(&self) {
        self.cv.notify_all();
    }
}

/// A received part whose bytes are still being copied to the GPU.
pub(super) struct Landing {
    pub(super) req: Arc<RecvReq>,
    pub(super) seq: u64,
    pub(super) nparts: usize,
    /// Counted in its receive's `landing` while it waits in the staging
    /// ring behind its copies ([`Landing::behind_copies`]).
    counted: bool,
}

impl Landing {
    pub(super) fn new(req: Arc<RecvReq>, seq: u64, nparts: usize) -> Self {
        Landing {
            req,
            seq,
            nparts,
            counted: false,
        }
    }

    /// The part's bytes are in copies to the device that may still run:
    /// its receive counts as landing until this is handed back (or
    /// dropped), so that a failure is not reported to its caller -- who
    /// may then free the memory -- while they can still write into it.
    pub(super) fn behind_copies(mut self) -> Self {
        if !self.counted {
            self.req.landing.fetch_add(1, Ordering::SeqCst);
            self.counted = true;
        }
        self
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        if self.counted {
            self.req.landing.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Counts one part of a receive as done; the last one completes it.
pub(super) fn part_done(shared: &RecvShared, l: Landing) {
    if l.req.parts_done.fetch_add(1, Ordering::AcqRel) + 1 == l.nparts {
        tracing::trace!(seq = l.seq, "lat: rx done");
        l.req.done.store(true, Ordering::Release);
        (shared.waker)();
    }
}

/// Accepts part `h` (already through [`check_part`]) of the receive
/// `req`: its (offset, length) must be one of the parts the sender's rule
/// ([`super::split_grid`], with the listen handle's `streams` and
/// `min_part`) cuts a message of its total into, its part count that
/// rule's, and no part is accepted twice -- so a peer can neither complete
/// a receive early by sending a part twice (on two streams) nor land bytes
/// other than the message's. Returns whether it was the message's last
/// part to be accepted (its book entry may go).
pub(crate) fn claim_part(
    h: &PartHeader,
    claimed: &AtomicU64,
    streams: usize,
    min_part: usize,
) -> Result<bool, PartFault> {
    let total = usize::try_from(h.total).unwrap_or(usize::MAX);
    let (per, count) = super::split_grid(total, streams, min_part);
    let not_a_part = PartFault::NotAPart {
        seq: h.seq,
        off: h.off,
        len: h.len,
    };
    if count as u64 > MAX_PARTS || h.nparts != count as u64 || !h.off.is_multiple_of(per as u64) {
        return Err(not_a_part);
    }
    let i = h.off / per as u64;
    if i >= count as u64 || h.len != (per as u64).min(h.total - h.off) {
        return Err(not_a_part);
    }
    let bit = 1u64 << i;
    let before = claimed.fetch_or(bit, Ordering::AcqRel);
    if before & bit != 0 {
        return Err(PartFault::Duplicate {
            seq: h.seq,
            part: i,
        });
    }
    Ok((before | bit).count_ones() as u64 == h.nparts)
}

/// Most parts a message may be cut into (the most streams a comm has).
pub(super) const MAX_PARTS: u64 = 64;

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
    #[error(
        "message {seq}: bytes {off}+{len} are not one of the parts its sender's rule cuts it into"
    )]
    NotAPart { seq: u64, off: u64, len: u64 },
    #[error("message {seq}: part {part} arrived twice")]
    Duplicate { seq: u64, part: u64 },
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
        // A part is accepted only if it is one of the sender's cut (for
        // 1..=8 streams and 4 KiB parts), and only once.
        let streams = 1 + (h.seq % 8) as usize;
        let claimed = AtomicU64::new(0);
        if claim_part(&h, &claimed, streams, 4096).is_ok() {
            let cut = super::split_parts(h.total as usize, streams, 4096);
            assert!(
                cut.contains(&(h.off as usize, h.len as usize)),
                "an accepted part is one of the cut"
            );
            assert!(
                matches!(
                    claim_part(&h, &claimed, streams, 4096),
                    Err(PartFault::Duplicate { .. })
                ),
                "a part is accepted once"
            );
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
    fn each_part_of_the_cut_is_accepted_once_and_nothing_else() {
        for &(total, streams) in &[
            (0usize, 4usize),
            (100, 8),
            (1 << 20, 4),
            (10_000_000, 8),
            (12_289, 4),
        ] {
            let cut = crate::net::socket::split_parts(total, streams, 4096);
            let claimed = AtomicU64::new(0);
            let head = |off: usize, len: usize| PartHeader {
                seq: 1,
                off: off as u64,
                len: len as u64,
                total: total as u64,
                nparts: cut.len() as u64,
                shape: 0,
                spliced: false,
            };
            for (i, &(off, len)) in cut.iter().enumerate() {
                // Off the cut: shifted, shortened, another part count.
                if len > 1 {
                    assert!(claim_part(&head(off + 1, len - 1), &claimed, streams, 4096).is_err());
                    assert!(claim_part(&head(off, len - 1), &claimed, streams, 4096).is_err());
                }
                let other = PartHeader {
                    nparts: cut.len() as u64 + 1,
                    ..head(off, len)
                };
                assert!(claim_part(&other, &claimed, streams, 4096).is_err());
                let last = claim_part(&head(off, len), &claimed, streams, 4096).unwrap();
                assert_eq!(last, i + 1 == cut.len(), "{total}: part {i}");
                assert!(matches!(
                    claim_part(&head(off, len), &claimed, streams, 4096),
                    Err(PartFault::Duplicate { .. })
                ));
            }
            assert_eq!(
                claimed.load(Ordering::Acquire).count_ones() as usize,
                cut.len()
            );
        }
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
