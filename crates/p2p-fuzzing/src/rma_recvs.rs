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
    let mut seen = RecvsSeen::default();
    let mut b = Bytes(data);
    let mut r: RmaRecvs<u64> = RmaRecvs::default();
    // Our requests in order: (id, is a read); reads' answers so far.
    let mut requests: Vec<(u64, bool)> = Vec::new();
    let mut answer: HashMap<u64, bool> = HashMap::new();
    let mut next = 0u64;
    let mut posted: Vec<u64> = Vec::new();
    let mut dropped: Vec<u64> = Vec::new();
    // Reads awaiting an answer, in request order (an honest peer answers
    // the oldest first).
    let mut waiting: VecDeque<u64> = VecDeque::new();
    for _ in 0..512 {
        if b.done() {
            break;
        }
        seen.steps += 1;
        match b.u8() % 8 {
            0 | 1 => {
                r.asked(next, next);
                requests.push((next, true));
                waiting.push_back(next);
                next += 1;
            }
            2 => {
                r.cleared(next);
                requests.push((next, false));
                next += 1;
            }
            3..=5 => {
                // An answer: mostly the oldest read, now and then another
                // one, a repeated one or one never asked.
                let how = b.u8();
                let xfer = match how % 8 {
                    0 if !waiting.is_empty() => waiting[b.u8() as usize % waiting.len()],
                    1 => b.u8() as u64 % (next + 2),
                    _ => match waiting.front() {
                        Some(&x) => x,
                        None => continue,
                    },
                };
                let accept = how & 0x80 == 0;
                let known = waiting.contains(&xfer);
                if accept {
                    assert_eq!(r.accepted(xfer), known, "acceptance of read {xfer}");
                } else {
                    match r.refused(xfer) {
                        Some(x) => {
                            assert!(known, "refused a read not awaiting an answer");
                            assert_eq!(x, xfer);
                            dropped.push(x);
                        }
                        None => assert!(!known, "a waiting read {xfer} not refused"),
                    }
                }
                if known {
                    waiting.retain(|&x| x != xfer);
                    answer.insert(xfer, accept);
                    if accept {
                        seen.accepted += 1;
                    } else {
                        seen.refused += 1;
                    }
                }
            }
            6 => {
                for x in r.due() {
                    // Never posted: a read before its acceptance, a refused
                    // read; and posted in request order.
                    if requests[x as usize].1 {
                        assert_eq!(answer.get(&x), Some(&true), "read {x} posted unaccepted");
                    }
                    assert!(posted.last().is_none_or(|&l| l < x), "out of order");
                    posted.push(x);
                }
            }
            _ if b.u8() == 0xFF => {
                // The connection ends: what waits is handed back.
                let rest = r.clear();
                assert!(r.is_empty());
                dropped.extend(rest);
                break;
            }
            _ => {}
        }
        assert_eq!(
            posted.len() + dropped.len() + r.len(),
            requests.len(),
            "a request's receives were lost or doubled"
        );
    }
    for x in r.due() {
        posted.push(x);
    }
    seen.posted = posted.len() as u64;
    check_sends(&requests, &answer, &posted, &dropped);
    seen
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
