//! Posting receives: each is entered on the books of the streams its
//! parts ride, where the receive threads ([`super::rx`]) find it.

use std::collections::HashMap;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::book::{Landing, LaneBook, RecvLaneQ, RecvReq, RecvShared};
use super::rx::{RxHandle, RxTask};
use super::segs::Segs;
use super::stage::StagingPool;
use super::{part_count, Lane, SocketConfig, NET};
use crate::error::NetError;
use crate::net::{MemRef, MrHandle, RecvComm, ReqId, Waker};
use crate::workers::{Home, Workers};

pub(super) struct SocketRecv {
    shared: Arc<RecvShared>,
    min_part: usize,
    socks: Vec<Arc<TcpStream>>,
    /// Each stream's receive task.
    tasks: Vec<Arc<Home>>,
    /// Each stream's state, for landing a small part whose header its task
    /// read before the receive was posted ([`RxHandle::land_held`]).
    held: Vec<RxHandle>,
    /// Keeps the I/O workers (and their poller) alive while this comm is.
    _workers: Workers,
    reqs: HashMap<u64, Arc<RecvReq>>,
    next_seq: u64,
}

impl SocketRecv {
    pub(super) fn start(
        socks: Vec<Arc<TcpStream>>,
        cfg: &SocketConfig,
        waker: Waker,
        workers: &Workers,
        staging: &Arc<StagingPool<Landing>>,
    ) -> Result<Self, NetError> {
        let shared = Arc::new(RecvShared {
            lanes: (0..socks.len())
                .map(|_| RecvLaneQ {
                    book: Mutex::new(LaneBook::default()),
                    cv: Condvar::new(),
                })
                .collect(),
            posted: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            failed: Mutex::new(None),
            waker,
        });
        let (tasks, held) = socks
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let (task, held) = RxTask::new(
                    s.clone(),
                    shared.clone(),
                    Lane::new(i, cfg),
                    cfg.linger,
                    staging.clone(),
                );
                // It waits for bytes without a thread; its staging is
                // taken from the pool at its first GPU part.
                (workers.start_readable(Box::new(task), s.as_raw_fd()), held)
            })
            .unzip();
        Ok(SocketRecv {
            shared,
            min_part: cfg.min_part,
            socks,
            tasks,
            held,
            _workers: workers.clone(),
            reqs: HashMap::new(),
            next_seq: 0,
        })
    }
}

#[cfg(test)]
impl SocketRecv {
    /// Whether message `seq`'s first stream holds its header, read before
    /// the receive was posted, with all its bytes arrived.
    pub(super) fn holds(&self, seq: u64) -> bool {
        self.held[seq as usize % self.held.len()].holds(seq)
    }
}

impl RecvComm for SocketRecv {
    fn reg_mr(&mut self, _mem: MemRef) -> Result<MrHandle, NetError> {
        Ok(MrHandle(0))
    }
    fn dereg_mr(&mut self, _mr: MrHandle) -> Result<(), NetError> {
        Ok(())
    }

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
        let n = self.shared.lanes.len();
        let lanes = part_count(segs.total, n, self.min_part);
        let req = Arc::new(RecvReq {
            segs,
            parts_done: AtomicUsize::new(0),
            shape: Mutex::new(None),
            done: AtomicBool::new(false),
            lanes,
        });
        // Part i of message `seq` rides stream (seq + i) mod S.
        for i in 0..lanes {
            let k = (seq as usize + i) % n;
            let q = &self.shared.lanes[k];
            q.book.lock().insert(seq, req.clone(), i);
            q.cv.notify_all();
        }
        self.shared.posted.store(seq + 1, Ordering::Release);
        for i in 0..lanes {
            let k = (seq as usize + i) % n;
            // A stream that read this message's header first waits idle:
            // a small part whose bytes are here is landed by this thread,
            // and the task is kicked to go on reading (or to land it).
            self.held[k].land_held(seq);
            self.tasks[k].kick();
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
        if self.shared.closing.load(Ordering::Acquire) {
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
        self.shared.closing.store(true, Ordering::Release);
        self.shared.notify_all();
        for s in &self.socks {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // Parked tasks see their stream closed and end; idle ones (waiting
        // for a receive to be posted) are woken to see it.
        Home::end_all(
            &self.tasks,
            Duration::from_secs(5),
            "socket net receive comm",
        );
    }
}
