//! Fuzz harnesses of the connection's pure state machines, shared by the
//! cargo-fuzz targets (`fuzz/fuzz_targets/{handler,rma_recvs,notif}.rs`)
//! and the stable test that runs them over seeded random inputs
//! (`tests/handler_fuzz.rs`):
//!
//! - [`control_handler`]: the control handler ([`Book`]), below;
//! - [`rma_recvs`]: the order our one-sided receives are posted in, with
//!   reads refused, accepted, answered out of order, and the connection
//!   ending ([`crate::rma_recvs`]), against a model of the peer's sends;
//! - [`notif_queue`]: the notification queue's per-peer and fair-share
//!   bounds ([`crate::notif`]), with several peers and draining.
//!
//! The control handler's bytes are read as a program: each step builds one control message that
//! decodes (built with the encoders, then decoded) or a local event (our
//! own request going out, a served request ending), and feeds it to a
//! [`Book`] over a small registry of real memory. After each step it
//! checks: no panic; everything accepted lies inside an advertisement made
//! to this connection, and is carried out on a shadow of the memory; what
//! the book holds stays within its limits; every one of our requests gets
//! at most one answer. At the end, no byte outside the advertised ranges
//! has changed.

use std::collections::{HashMap, VecDeque};

use crate::handler::{Action, Book, Ctx, Limits};
use crate::memory::Registry;
use crate::notif::{Notif, NotifLimits, NotifQueue};
use crate::rma_recvs::RmaRecvs;
use crate::transfer::{Gather, OpPlan};
use crate::wire::{Control, RmaItem, Token};

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        (0..8).fold(0u64, |a, _| a << 8 | self.u8() as u64)
    }
    fn done(&self) -> bool {
        self.0.is_empty()
    }
}

/// The connection the harness plays; adverts for others must be refused.
const CONN: u64 = 1;
/// Limits small enough for short inputs to reach them.
pub const LIMITS: Limits = Limits {
    max_requests: 8,
    max_items: 4096,
};
const MEM: usize = 64 << 10;

/// What a run saw, for the stable harness's counts.
#[derive(Debug, Default, Clone, Copy)]
pub struct Seen {
    pub steps: u64,
    pub accepted: u64,
    pub refused: u64,
    pub protocol_errors: u64,
}

/// Runs one input. Panics on any broken invariant (that is the finding).
pub fn control_handler(data: &[u8]) -> Seen {
    let mut seen = Seen::default();
    let mut b = Bytes(data);
    let reg = Registry::new();
    let mut mem = vec![0u8; MEM];
    let base = mem.as_ptr() as u64;
    let region = reg
        .register(base, MEM)
        .expect("register the harness memory");
    let rid = region.id;
    drop(region);
    // (token, offset, len) of each advertisement, and who may use it.
    let ours = [(4096u64, 8192u64), (16384, 100)];
    let t0 = reg
        .advertise(rid, base + 4096, 8192, Some(CONN))
        .expect("advert");
    let t1 = reg.advertise(rid, base + 16384, 100, None).expect("advert");
    let t2 = reg
        .advertise(rid, base + 32768, 4096, Some(CONN + 1))
        .expect("advert");
    // A stale one: its region is gone.
    let other = vec![0u8; 4096];
    let r2 = reg.register(other.as_ptr() as u64, 4096).expect("register");
    let r2id = r2.id;
    drop(r2);
    let t3 = reg
        .advertise(r2id, other.as_ptr() as u64, 4096, Some(CONN))
        .expect("advert");
    reg.deregister(r2id, std::time::Duration::ZERO)
        .expect("dereg");
    let tokens = [t0, t1, t2, t3];
    let advert_len = [8192u64, 100, 4096, 4096];
    let advert_off = [4096u64, 16384, 32768, 0];

    let cx = Ctx {
        registry: &reg,
        conn: CONN,
        chunk: 4096,
        gather: Gather::new(4096, 16),
    };
    let mut book = Book::new(LIMITS);
    // Our requests and whether each was answered; weights served.
    let mut asked: HashMap<u64, (bool, u8)> = HashMap::new();
    let mut served: Vec<usize> = Vec::new();
    // The payload length each of our inline requests awaits.
    let mut inline_len: HashMap<u64, u32> = HashMap::new();
    // Our two-sided messages posted and acknowledged, as the model counts.
    let (mut msgs_sent, mut msgs_acked) = (0u64, 0u64);
    let inside_ours = |off: u64, len: u64| {
        ours.iter()
            .any(|&(o, l)| off >= o && off.checked_add(len).is_some_and(|e| e <= o + l))
    };

    for _ in 0..256 {
        if b.done() {
            break;
        }
        seen.steps += 1;
        // An answer's transfer: mostly one we asked about.
        let pick = |b: &mut Bytes<'_>| {
            let r = b.u8();
            let mut keys: Vec<u64> = asked.keys().copied().collect();
            keys.sort_unstable();
            if r & 3 != 0 && !keys.is_empty() {
                Some(keys[r as usize % keys.len()])
            } else if r & 0x1C == 0 {
                Some(r as u64 % 16)
            } else {
                None // an unknown answer, now and then only
            }
        };
        let op = match b.u8() % 16 {
            0..=4 => 0,
            5..=8 => 1,
            9 => 2,
            10 => 3,
            11 => 4,
            12 => 5,
            13 => 6,
            14 => 7,
            _ => 8,
        };
        let msg = match op {
            0 | 1 => {
                let n = if b.u8() & 0x80 != 0 {
                    1 + b.u16() as usize % 5000
                } else {
                    1 + b.u8() as usize % 8
                };
                let items: Vec<RmaItem> = (0..n)
                    .map(|_| {
                        let k = b.u8() as usize % 12;
                        if k < 6 {
                            // Valid: inside one of our advertisements.
                            let t = k % 2;
                            let (off, len) = ours[t];
                            let at = b.u16() as u64 % len;
                            let l = b.u16() as u64 % (len - at + 1);
                            return RmaItem {
                                token: tokens[t],
                                addr: base + off + at,
                                len: l,
                            };
                        }
                        let k = k - 6;
                        let token = match k {
                            0..=3 => tokens[k],
                            4 => Token {
                                id: tokens[0].id,
                                secret: tokens[0].secret ^ 1,
                            },
                            _ => Token {
                                id: b.u64(),
                                secret: b.u64(),
                            },
                        };
                        let ki = k.min(3);
                        let addr = match b.u8() % 4 {
                            0 => base + advert_off[ki],
                            1 => base + advert_off[ki] + b.u16() as u64 % 256,
                            2 => base.wrapping_add(b.u16() as u64),
                            _ => b.u64(),
                        };
                        let len = match b.u8() % 5 {
                            0 => advert_len[ki],
                            1 => b.u8() as u64,
                            2 => b.u16() as u64,
                            3 => 1 << 62,
                            _ => b.u64(),
                        };
                        RmaItem { token, addr, len }
                    })
                    .collect();
                // A random partition of the items into runs.
                let mut runs = Vec::new();
                let mut left = n as u32;
                while left > 0 {
                    let r = 1 + (b.u8() as u32 % left.min(16));
                    runs.push(r);
                    left -= r;
                }
                let xfer = b.u8() as u64 % 16;
                // Now and then the inline forms, with a payload length
                // that matches the items or not.
                let inline = b.u8();
                if inline & 3 == 0 && op == 0 {
                    let sum = items.iter().fold(0u64, |a, it| a.saturating_add(it.len));
                    let len = match inline >> 2 & 3 {
                        0 | 1 => sum.min(u32::MAX as u64) as u32,
                        2 => sum.saturating_add(1).min(u32::MAX as u64) as u32,
                        _ => b.u16() as u32,
                    };
                    Control::WriteInline {
                        xfer,
                        items,
                        runs,
                        len,
                    }
                } else if inline & 3 == 0 {
                    Control::ReadInline { xfer, items, runs }
                } else if op == 0 {
                    Control::WriteReq { xfer, items, runs }
                } else {
                    Control::ReadReq { xfer, items, runs }
                }
            }
            2..=5 => {
                let Some(xfer) = pick(&mut b) else {
                    continue;
                };
                match op {
                    2 => Control::WriteCts { xfer },
                    3 => Control::WriteDone { xfer },
                    4 => Control::ReadAck { xfer },
                    _ if b.u8() & 1 == 1 => Control::ReadData {
                        xfer,
                        len: match b.u8() % 3 {
                            0 => inline_len.get(&xfer).copied().unwrap_or(0),
                            1 => inline_len.get(&xfer).copied().unwrap_or(0) + 1,
                            _ => b.u16() as u32,
                        },
                    },
                    _ => Control::Refused {
                        xfer,
                        reason: "no".into(),
                    },
                }
            }
            6 if b.u8() & 1 == 1 => Control::MsgDone {
                count: match b.u8() % 3 {
                    0 => msgs_acked + 1,
                    1 => msgs_sent,
                    _ => b.u64(),
                },
            },
            6 => Control::KeepAlive,
            7 => {
                // Local events.
                match b.u8() % 5 {
                    4 => {
                        assert_eq!(book.msg_posted(), msgs_sent);
                        msgs_sent += 1;
                    }
                    0 | 3 => {
                        let xfer = b.u8() as u64 % 16;
                        let read = b.u8() & 1 == 1;
                        // Ids are never reused while outstanding.
                        let inline = b.u8();
                        if let std::collections::hash_map::Entry::Vacant(e) = asked.entry(xfer) {
                            if inline & 1 == 1 {
                                let len = inline as u32 * 16;
                                book.expect_inline(xfer, read, len);
                                e.insert((read, if read { 3 } else { 2 }));
                                inline_len.insert(xfer, len);
                            } else {
                                book.expect(xfer, read);
                                e.insert((read, 0));
                            }
                        }
                    }
                    1 => {
                        if let Some(w) = served.pop() {
                            book.served_end(w);
                        }
                    }
                    _ => {}
                }
                continue;
            }
            _ if b.u8() == 0xFF => Control::Close,
            _ => Control::KeepAlive,
        };
        // Only messages that decode reach the handler.
        let mut wire_bytes = Vec::new();
        msg.encode(&mut wire_bytes);
        let Ok(msg) = Control::decode(&wire_bytes) else {
            continue;
        };
        let held_before = book.held();
        let action = match book.on_control(cx, msg) {
            Ok(a) => a,
            Err(_) => {
                // The connection ends: nothing more reaches it.
                seen.protocol_errors += 1;
                break;
            }
        };
        match action {
            Action::AcceptWrite {
                local,
                plan,
                weight,
                ..
            }
            | Action::AcceptRead {
                local,
                plan,
                weight,
                ..
            } => {
                seen.accepted += 1;
                let write = op == 0;
                assert!(weight <= LIMITS.max_items && plan.len() <= LIMITS.max_items);
                for (m, r) in &local {
                    assert_eq!(r.id, rid, "accepted memory of another region");
                    let off = m.addr.wrapping_sub(base);
                    assert!(
                        inside_ours(off, m.len as u64),
                        "accepted {} bytes at offset {off:#x}, outside what was advertised",
                        m.len
                    );
                }
                for p in &plan {
                    let pieces: Vec<(u64, usize)> = match *p {
                        OpPlan::Piece { item, off, len, .. } => {
                            let (m, _) = &local[item];
                            assert!(off + len <= m.len);
                            vec![(m.addr + off as u64, len)]
                        }
                        OpPlan::Gather { start, end } => local[start..end]
                            .iter()
                            .map(|(m, _)| (m.addr, m.len))
                            .collect(),
                    };
                    if write {
                        for (addr, len) in pieces {
                            let off = (addr - base) as usize;
                            mem[off..off + len].fill(0xAB);
                        }
                    }
                }
                served.push(weight);
            }
            Action::RefuseWrite { .. } => {
                seen.refused += 1;
                assert_eq!(book.held(), held_before, "a refusal held something");
            }
            // Bounded by the endpoint's queue, not by the book.
            Action::Notif { .. } => {}
            Action::RefuseRead { .. } => {
                // A refusal holds nothing, whatever the request claimed.
                seen.refused += 1;
                assert_eq!(book.held(), held_before, "a refusal held something");
            }
            Action::SendWrite { xfer } => {
                let a = asked
                    .get_mut(&xfer)
                    .expect("clear-to-send for a write we made");
                assert!(!a.0 && a.1 == 0, "clear-to-send for a read or twice");
                a.1 = 1;
            }
            Action::Acked { xfer } => {
                let a = asked.remove(&xfer).expect("an answer to a request we made");
                assert!(
                    !a.0 && (a.1 == 1 || a.1 == 2),
                    "a write acknowledged before it was cleared, or a read acknowledged as a write"
                );
            }
            Action::ReadAccepted { xfer } => {
                let a = asked.remove(&xfer).expect("an answer to a request we made");
                assert!(
                    a.0 && a.1 == 0,
                    "a read acceptance for no read awaiting one"
                );
            }
            Action::PeerRefused { xfer, .. } => {
                asked.remove(&xfer).expect("a refusal of a request we made");
                inline_len.remove(&xfer);
            }
            Action::LandWrite {
                local, len, weight, ..
            } => {
                seen.accepted += 1;
                assert!(weight <= LIMITS.max_items);
                assert!(len <= crate::wire::MAX_INLINE);
                let mut total = 0;
                for (m, r) in &local {
                    assert_eq!(r.id, rid, "accepted memory of another region");
                    let off = m.addr.wrapping_sub(base);
                    assert!(
                        inside_ours(off, m.len as u64),
                        "inline write of {} bytes at offset {off:#x}, outside what was advertised",
                        m.len
                    );
                    mem[off as usize..off as usize + m.len].fill(0xCD);
                    total += m.len;
                }
                assert_eq!(total, len, "payload length differs from the items'");
                served.push(weight);
            }
            Action::DropWrite { len, .. } => {
                assert!(len <= crate::wire::MAX_INLINE);
                seen.refused += 1;
            }
            Action::SendReadData {
                local, len, weight, ..
            } => {
                seen.accepted += 1;
                assert!(len <= crate::wire::MAX_INLINE);
                for (m, _) in &local {
                    let off = m.addr.wrapping_sub(base);
                    assert!(inside_ours(off, m.len as u64), "inline read outside");
                }
                served.push(weight);
            }
            Action::LandRead { xfer, len } => {
                let a = asked.remove(&xfer).expect("data for a read we made");
                assert!(
                    a.0 && a.1 == 3,
                    "inline data for a request that is no inline read"
                );
                assert_eq!(inline_len.remove(&xfer), Some(len as u32));
            }
            Action::MsgsLanded { from, to } => {
                assert_eq!(from, msgs_acked, "acknowledgements skip or repeat");
                assert!(to > from && to <= msgs_sent, "more acknowledged than sent");
                msgs_acked = to;
            }
            Action::Nothing => {}
        }
        assert_eq!(book.msgs_unacked(), msgs_sent - msgs_acked);
        let (reqs, items) = book.held();
        assert!(reqs <= LIMITS.max_requests);
        assert!(items <= LIMITS.max_items);
        assert_eq!(
            book.awaiting(),
            asked.len(),
            "the book and the model disagree"
        );
    }
    // Nothing outside the advertised ranges changed.
    for (i, &x) in mem.iter().enumerate() {
        if x != 0 {
            assert!(
                inside_ours(i as u64, 1),
                "byte {i:#x} written outside what was advertised"
            );
        }
    }
    drop(other);
    seen
}

/// What a run of [`rma_recvs`] saw.
#[derive(Debug, Default, Clone, Copy)]
pub struct RecvsSeen {
    pub steps: u64,
    pub accepted: u64,
    pub refused: u64,
    pub posted: u64,
}

/// Runs one input through [`RmaRecvs`]: our requests for data (reads, and
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
    // The peer's sends: our requests in order, less the refused reads.
    // Every one of them whose turn came is what we posted, in order.
    let sends: Vec<u64> = requests
        .iter()
        .filter(|&&(id, read)| !read || answer.get(&id) == Some(&true))
        .map(|&(id, _)| id)
        .collect();
    assert!(
        sends.starts_with(&posted),
        "posted {posted:?}, the peer sends {sends:?}"
    );
    // Whatever was answered has been posted, up to the first read that
    // awaits an answer (or handed back, the connection having ended).
    let first_waiting = requests
        .iter()
        .find(|&&(id, read)| read && !answer.contains_key(&id))
        .map(|&(id, _)| id);
    let posted_set: std::collections::HashSet<u64> = posted.iter().copied().collect();
    let dropped_set: std::collections::HashSet<u64> = dropped.iter().copied().collect();
    for &x in &sends {
        if first_waiting.is_some_and(|w| x > w) || dropped_set.contains(&x) {
            continue;
        }
        assert!(posted_set.contains(&x), "{x} never posted");
    }
    seen
}

/// What a run of [`notif_queue`] saw.
#[derive(Debug, Default, Clone, Copy)]
pub struct NotifSeen {
    pub pushed: u64,
    pub refused: u64,
    pub drained: u64,
}

/// Runs one input through a [`NotifQueue`] with small bounds: up to eight
/// peers push notifications of random sizes, the application drains now
/// and then. Panics on a broken invariant: a peer holds more than its own
/// bounds (so the endpoint more than those bounds times the peers); a
/// peer under its own bounds, and under its fair share once the endpoint's
/// figures are reached, is refused (or one past them served); a drain
/// returns other than what was taken, in order.
pub fn notif_queue(data: &[u8]) -> NotifSeen {
    let mut seen = NotifSeen::default();
    let mut b = Bytes(data);
    let l = NotifLimits {
        max: 1 + b.u8() as usize % 64,
        max_bytes: 1 + b.u16() as usize % 4096,
        per_peer: 1 + b.u8() as usize % 48,
        per_peer_bytes: 1 + b.u16() as usize % 3072,
    };
    let q = NotifQueue::new(l);
    let mut model: VecDeque<Notif> = VecDeque::new();
    let mut by_conn: HashMap<u64, (usize, usize)> = HashMap::new();
    for _ in 0..2048 {
        if b.done() {
            break;
        }
        let op = b.u8();
        if op < 16 {
            let got = q.drain();
            assert!(
                got.iter().eq(model.iter()),
                "drain differs from what was taken"
            );
            seen.drained += got.len() as u64;
            model.clear();
            by_conn.clear();
            continue;
        }
        let conn = u64::from(op % 8);
        let n = Notif {
            from_name: format!("p{conn}"),
            conn,
            msg: vec![op; b.u8() as usize],
        };
        let size = n.msg.len() + n.from_name.len();
        let (count, bytes) = by_conn.get(&conn).copied().unwrap_or((0, 0));
        let own_ok = count < l.per_peer && bytes + size <= l.per_peer_bytes;
        let total: usize = by_conn.values().map(|v| v.1).sum();
        let full = model.len() >= l.max || total + size > l.max_bytes;
        let peers = by_conn.len() + usize::from(count == 0);
        let share_ok = count < l.max / peers && bytes + size <= l.max_bytes / peers;
        let want = own_ok && (!full || share_ok);
        match q.push(n.clone()) {
            Ok(()) => {
                assert!(
                    want,
                    "served past a bound: {l:?} peer {conn} held {count}/{bytes}"
                );
                seen.pushed += 1;
                let e = by_conn.entry(conn).or_default();
                e.0 += 1;
                e.1 += size;
                model.push_back(n);
            }
            Err(e) => {
                assert!(!want, "refused within its bounds: {e} ({l:?})");
                assert_eq!((e.count, e.bytes), (count, bytes));
                seen.refused += 1;
            }
        }
        let (held, held_bytes) = q.held();
        assert_eq!(held, model.len());
        let peers = by_conn.len();
        assert!(held <= peers * l.per_peer && held_bytes <= peers * l.per_peer_bytes);
        for &(c, bts) in by_conn.values() {
            assert!(c <= l.per_peer && bts <= l.per_peer_bytes);
        }
    }
    seen
}
