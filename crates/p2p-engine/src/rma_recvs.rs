//! The receives of one-sided data that comes to us on the `Rma` set: the
//! data of our reads and of the peer's writes. The peer posts its sends in
//! the order our requests for data reach it -- our `ReadReq` (if it
//! accepts the read) and our `WriteCts`, each written in the order the
//! connection's machine decides them ([`crate::proto`]) -- so we post our
//! receives in that same order. A read's receives
//! wait for the peer's `ReadAck`: until the peer has accepted the read,
//! nothing is posted into its buffers. A refused read therefore owns no
//! receive, ends at once, and needs nothing from the peer to keep the two
//! sides in step (no empty messages, whatever the request claimed); a
//! message the peer sends for it anyway finds no receive of that read.
//!
//! Pure bookkeeping, generic over what a receive is, so that it is tested
//! and fuzzed without a net ([`crate::fuzzing::rma_recvs`]).

use std::collections::VecDeque;

struct Entry<T> {
    /// Our read awaiting the peer's answer (None: the peer's write, cleared).
    read: Option<u64>,
    /// Accepted (or a write): may be posted once everything before it is.
    ready: bool,
    recvs: T,
}

/// Receives waiting for their turn, in the order of our requests for data.
pub struct RmaRecvs<T> {
    q: VecDeque<Entry<T>>,
}

impl<T> Default for RmaRecvs<T> {
    fn default() -> Self {
        RmaRecvs { q: VecDeque::new() }
    }
}

impl<T> RmaRecvs<T> {
    /// Our read `xfer` is being requested (in order, before
    /// its `ReadReq` is written): its receives wait for the peer's answer.
    pub fn asked(&mut self, xfer: u64, recvs: T) {
        self.q.push_back(Entry {
            read: Some(xfer),
            ready: false,
            recvs,
        });
    }

    /// The peer's write is cleared (in order, before its
    /// `WriteCts` is written): its receives are posted in their turn.
    pub fn cleared(&mut self, recvs: T) {
        self.q.push_back(Entry {
            read: None,
            ready: true,
            recvs,
        });
    }

    fn find(&self, xfer: u64) -> Option<usize> {
        self.q.iter().position(|e| e.read == Some(xfer) && !e.ready)
    }

    /// The peer accepted our read `xfer`: its receives are posted in their
    /// turn. False if no read of that id awaits an answer.
    pub fn accepted(&mut self, xfer: u64) -> bool {
        match self.find(xfer) {
            Some(i) => {
                self.q[i].ready = true;
                true
            }
            None => false,
        }
    }

    /// The peer refused our read `xfer`: its receives are never posted (the
    /// peer posts no send for it). Returns them, to be let go; None if no
    /// read of that id awaits an answer.
    pub fn refused(&mut self, xfer: u64) -> Option<T> {
        let i = self.find(xfer)?;
        self.q.remove(i).map(|e| e.recvs)
    }

    /// The receives whose turn has come, in order: every ready entry at the
    /// front. Post them in this order before calling again.
    pub fn due(&mut self) -> Vec<T> {
        let mut out = Vec::new();
        while self.q.front().is_some_and(|e| e.ready) {
            if let Some(e) = self.q.pop_front() {
                out.push(e.recvs);
            }
        }
        out
    }

    /// Everything still waiting (the connection ends).
    pub fn clear(&mut self) -> Vec<T> {
        self.q.drain(..).map(|e| e.recvs).collect()
    }

    /// Entries waiting (reads awaiting an answer, and what is behind them).
    pub fn len(&self) -> usize {
        self.q.len()
    }

    #[cfg(any(test, feature = "fuzzing"))]
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receives_are_posted_in_request_order_and_never_for_a_refused_read() {
        let mut r = RmaRecvs::default();
        r.asked(1, "read 1");
        r.cleared("write a");
        r.asked(2, "read 2");
        r.cleared("write b");
        // Nothing before read 1's answer, not even the write behind it.
        assert!(r.due().is_empty());
        assert!(!r.accepted(7), "unknown read");
        assert!(r.accepted(2));
        assert!(r.due().is_empty(), "read 1 still unanswered");
        assert_eq!(r.refused(1), Some("read 1"));
        assert_eq!(r.due(), vec!["write a", "read 2", "write b"]);
        assert!(r.is_empty());
        // An answer counts once.
        r.asked(3, "read 3");
        assert!(r.accepted(3));
        assert!(!r.accepted(3));
        assert_eq!(r.refused(3), None, "accepted already");
        assert_eq!(r.due(), vec!["read 3"]);
        r.asked(4, "read 4");
        r.cleared("write c");
        assert_eq!(r.clear(), vec!["read 4", "write c"]);
        assert_eq!(r.len(), 0);
    }
}
