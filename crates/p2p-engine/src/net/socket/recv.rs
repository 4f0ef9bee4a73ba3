//! Posting receives: each is entered in the comm's book, where the
//! receive streams' tasks ([`super::rx`]) find it.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::book::{Landing, RecvReq, RecvShared};
use super::door::Door;
use super::segs::Segs;
use super::stage::StagingPool;
use super::streams::RxStreams;
use super::{SocketConfig, NET};
use crate::error::NetError;
use crate::net::{MemRef, MrHandle, RecvComm, ReqId, Waker};
use crate::workers::Workers;

pub(super) struct SocketRecv {
    shared: Arc<RecvShared>,
    /// The comm's streams, joined by the net's listener as the peer opens
    /// them ([`super::door`]).
    streams: Arc<RxStreams>,
    /// The net's listener, and our comm's key in its records.
    door: Arc<Door>,
    nonce: u64,
    /// Keeps the I/O workers (and their poller) alive while this comm is.
    _workers: Workers,
    reqs: HashMap<u64, Arc<RecvReq>>,
    next_seq: u64,
}

impl SocketRecv {
    /// The receive comm the listen comm `nonce` of `door` becomes, on the
    /// streams that came for it so far; the door gives it later ones.
    pub(super) fn start(
        door: &Arc<Door>,
        nonce: u64,
        cfg: &SocketConfig,
        waker: Waker,
        workers: &Workers,
        staging: &Arc<StagingPool<Landing>>,
    ) -> Result<Self, NetError> {
        let shared = Arc::new(RecvShared::new((cfg.streams, cfg.min_part), waker));
        let streams = RxStreams::new(shared.clone(), cfg, workers, staging.clone());
        for (index, s) in door.attach(nonce, &streams)? {
            streams.join(index, s);
        }
        Ok(SocketRecv {
            shared,
            streams,
            door: door.clone(),
            nonce,
            _workers: workers.clone(),
            reqs: HashMap::new(),
            next_seq: 0,
        })
    }
}

#[cfg(test)]
impl SocketRecv {
    /// Whether a stream holds message `seq`'s header, read before the
    /// receive was posted, with all its bytes arrived.
    pub(super) fn holds(&self, seq: u64) -> bool {
        self.streams.holds(seq)
    }

    /// How many streams hold a part of message `seq` whole (tests).
    #[cfg(test)]
    pub(super) fn holders(&self, seq: u64) -> usize {
        self.streams.holders(seq)
    }

    /// Receive streams open now.
    pub(super) fn stream_count(&self) -> usize {
        self.shared.streams.load(Ordering::Acquire)
    }

    /// The comm's state in words: its receives and each stream's (for a
    /// test's failure message).
    pub(super) fn describe(&self) -> String {
        let mut out = format!(
            "posted {}, closing {}, failed {:?}; due:",
            self.shared.posted.load(Ordering::Acquire),
            self.shared.closing.load(Ordering::Acquire),
            self.shared.failed.lock().as_ref().map(|e| e.to_string())
        );
        let book = self.shared.book.lock();
        let mut due: Vec<_> = book.due.iter().collect();
        due.sort_by_key(|(s, _)| **s);
        for (seq, r) in due {
            out += &format!(
                " [{seq}: claimed {:#b}, parts done {}, landing {}, done {}, shape {:?}]",
                r.claimed.load(Ordering::Acquire),
                r.parts_done.load(Ordering::Acquire),
                r.landing.load(Ordering::Acquire),
                r.done.load(Ordering::Acquire),
                *r.shape.lock()
            );
        }
        drop(book);
        let mut reqs: Vec<_> = self.reqs.iter().collect();
        reqs.sort_by_key(|(s, _)| **s);
        out += "; not ended:";
        for (seq, r) in reqs {
            out += &format!(
                " [{seq}: parts done {}, landing {}, done {}]",
                r.parts_done.load(Ordering::Acquire),
                r.landing.load(Ordering::Acquire),
                r.done.load(Ordering::Acquire)
            );
        }
        out + "; streams: " + &self.streams.describe()
    }
}

impl RecvComm for SocketRecv {
    fn irecv(&mut self, mem: MemRef, mr: MrHandle) -> Result<Option<ReqId>, NetError> {
        self.irecvv(&[mem], &[mr])
    }

    fn irecvv(&mut self, segs: &[MemRef], _mrs: &[MrHandle]) -> Result<Option<ReqId>, NetError> {
        if let Some(f) = self.shared.failed.lock().clone() {
            return Err(f);
        }
        let segs = Segs::new(segs)?;
        let seq = self.next_seq;
        self.next_seq += 1;
        let req = self.shared.enter(seq, segs);
        // A stream that read this message's header first waits idle: a
        // small part whose bytes are here is landed by this thread, and
        // the tasks are kicked to go on reading (or to land it).
        self.streams.posted(seq);
        // Every stream gone past this message already: none of its parts
        // can come (the comm fails; `test` reports it).
        if let Some(e) = self.shared.stranded(seq) {
            self.shared.fail(e);
        }
        self.reqs.insert(seq, req);
        Ok(Some(ReqId(seq)))
    }

    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError> {
        let r = self
            .reqs
            .get(&req.0)
            .cloned()
            .ok_or_else(|| NetError::Misuse {
                net: NET,
                reason: format!("test of unknown receive request {}", req.0),
            })?;
        if r.done.load(Ordering::Acquire) {
            let size = r.shape.lock().map(|s| s.0).unwrap_or(0);
            self.reqs.remove(&req.0);
            return Ok(Some(size));
        }
        if self.shared.closing.load(Ordering::SeqCst) && r.landing.load(Ordering::SeqCst) == 0 {
            if let Some(e) = self.shared.failed.lock().clone() {
                self.reqs.remove(&req.0);
                return Err(e);
            }
        }
        Ok(None)
    }
}

impl Drop for SocketRecv {
    fn drop(&mut self) {
        self.door.forget(self.nonce);
        self.shared.closing.store(true, Ordering::Release);
        self.shared.notify_all();
        self.streams.close();
    }
}
