//! The order our one-sided receives are posted in ([`rma_recvs`]).

use std::collections::{HashMap, HashSet, VecDeque};

use tcpx_p2p::fuzzing::RmaRecvs;

use crate::bytes::Bytes;

/// What a run of [`rma_recvs`] saw.
#[derive(Debug, Default, Clone, Copy)]
pub struct RecvsSeen {
    pub steps: u64,
    pub accepted: u64,
    pub refused: u64,
    pub posted: u64,
}

/// Runs one input through `RmaRecvs`: our requests for data (reads, and
/// clear-to-sends of the peer's writes) go out; the peer answers reads
/// (in order, as an honest peer does, or out of order, or twice, or for
/// reads we never made); the connection may end. Panics on a broken
/// invariant: a refused read's receives, or a read's before its
/// acceptance, are never posted; receives are posted in the order of our
/// requests; with answers in order, what we post is exactly the peer's
/// sends, request for request; at the end nothing is lost (posted, let
/// go as refused, or handed back when the connection ends).
pub fn rma_recvs(data: &[u8]) -> RecvsSeen {
    let mut b = Bytes(data);
    let mut m = Model::default();
    for _ in 0..512 {
        if b.done() {
            break;
        }
        m.seen.steps += 1;
        match b.u8() % 8 {
            0 | 1 => m.ask_read(),
            2 => m.clear_write(),
            3..=5 => m.peer_answers(&mut b),
            6 => m.post_due(),
            _ if b.u8() == 0xFF => {
                m.connection_ends();
                break;
            }
            _ => {}
        }
        assert_eq!(
            m.posted.len() + m.dropped.len() + m.r.len(),
            m.requests.len(),
            "a request's receives were lost or doubled"
        );
    }
    for x in m.r.due() {
        m.posted.push(x);
    }
    m.seen.posted = m.posted.len() as u64;
    check_sends(&m.requests, &m.answer, &m.posted, &m.dropped);
    m.seen
}

/// The receives' order under test and what the harness expects of it.
#[derive(Default)]
struct Model {
    r: RmaRecvs<u64>,
    /// Our requests in order: (id, is a read).
    requests: Vec<(u64, bool)>,
    /// Reads' answers so far: accepted or not.
    answer: HashMap<u64, bool>,
    /// The next request's id.
    next: u64,
    posted: Vec<u64>,
    /// Let go as refused, or handed back when the connection ended.
    dropped: Vec<u64>,
    /// Reads awaiting an answer, in request order (an honest peer answers
    /// the oldest first).
    waiting: VecDeque<u64>,
    seen: RecvsSeen,
}

impl Model {
    /// We ask the peer for a read.
    fn ask_read(&mut self) {
        self.r.asked(self.next, self.next);
        self.requests.push((self.next, true));
        self.waiting.push_back(self.next);
        self.next += 1;
    }

    /// We clear one of the peer's writes to send.
    fn clear_write(&mut self) {
        self.r.cleared(self.next);
        self.requests.push((self.next, false));
        self.next += 1;
    }

    /// The peer answers a read: mostly the oldest, now and then another
    /// one, a repeated one or one never asked (nothing when no read
    /// awaits one).
    fn peer_answers(&mut self, b: &mut Bytes<'_>) {
        let how = b.u8();
        let xfer = match how % 8 {
            0 if !self.waiting.is_empty() => self.waiting[b.u8() as usize % self.waiting.len()],
            1 => b.u8() as u64 % (self.next + 2),
            _ => match self.waiting.front() {
                Some(&x) => x,
                None => return,
            },
        };
        let accept = how & 0x80 == 0;
        let known = self.waiting.contains(&xfer);
        if accept {
            assert_eq!(self.r.accepted(xfer), known, "acceptance of read {xfer}");
        } else {
            match self.r.refused(xfer) {
                Some(x) => {
                    assert!(known, "refused a read not awaiting an answer");
                    assert_eq!(x, xfer);
                    self.dropped.push(x);
                }
                None => assert!(!known, "a waiting read {xfer} not refused"),
            }
        }
        if known {
            self.waiting.retain(|&x| x != xfer);
            self.answer.insert(xfer, accept);
            if accept {
                self.seen.accepted += 1;
            } else {
                self.seen.refused += 1;
            }
        }
    }

    /// We post what is due: never a read before its acceptance, never a
    /// refused read, and in request order.
    fn post_due(&mut self) {
        for x in self.r.due() {
            if self.requests[x as usize].1 {
                assert_eq!(
                    self.answer.get(&x),
                    Some(&true),
                    "read {x} posted unaccepted"
                );
            }
            assert!(self.posted.last().is_none_or(|&l| l < x), "out of order");
            self.posted.push(x);
        }
    }

    /// The connection ends: what waits is handed back.
    fn connection_ends(&mut self) {
        let rest = self.r.clear();
        assert!(self.r.is_empty());
        self.dropped.extend(rest);
    }
}

/// At the end of a run: what we posted is the peer's sends (our requests
/// in order, less the refused reads), request for request, and everything
/// answered has been posted up to the first read that awaits an answer
/// (or handed back, the connection having ended).
fn check_sends(
    requests: &[(u64, bool)],
    answer: &HashMap<u64, bool>,
    posted: &[u64],
    dropped: &[u64],
) {
    // The peer's sends: our requests in order, less the refused reads.
    // Every one of them whose turn came is what we posted, in order.
    let sends: Vec<u64> = requests
        .iter()
        .filter(|&&(id, read)| !read || answer.get(&id) == Some(&true))
        .map(|&(id, _)| id)
        .collect();
    assert!(
        sends.starts_with(posted),
        "posted {posted:?}, the peer sends {sends:?}"
    );
    // Whatever was answered has been posted, up to the first read that
    // awaits an answer (or handed back, the connection having ended).
    let first_waiting = requests
        .iter()
        .find(|&&(id, read)| read && !answer.contains_key(&id))
        .map(|&(id, _)| id);
    let posted_set: HashSet<u64> = posted.iter().copied().collect();
    let dropped_set: HashSet<u64> = dropped.iter().copied().collect();
    for &x in &sends {
        if first_waiting.is_some_and(|w| x > w) || dropped_set.contains(&x) {
            continue;
        }
        assert!(posted_set.contains(&x), "{x} never posted");
    }
}
