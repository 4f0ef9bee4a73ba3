//! The control handler's harness ([`control_handler`]).
//!
//! The bytes are read as a program: each step builds one control message
//! that decodes (built with the encoders, then decoded) or a local event
//! (our own request going out, a served request ending), and feeds it to a
//! `Book` over a small registry of real memory. After each step it checks:
//! no panic; everything accepted lies inside an advertisement made to this
//! connection, and is carried out on a shadow of the memory; what the book
//! holds stays within its limits; every one of our requests gets at most
//! one answer. At the end, no byte outside the advertised ranges has
//! changed.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use tcpx_p2p::fuzzing::{Action, Book, Ctx, Gather, Limits, OpPlan, Pieces, Registry};
use tcpx_p2p_wire::{self as wire, Control, PullRun, RmaItem, Token, MAX_INLINE};

use crate::bytes::Bytes;

/// The connection the harness plays; adverts for others must be refused.
const CONN: u64 = 1;
/// Limits small enough for short inputs to reach them.
pub const LIMITS: Limits = Limits {
    max_requests: 8,
    max_items: 4096,
};
/// The registered memory's size.
const MEM: usize = 64 << 10;
/// (offset, length) of the two advertisements this connection may use.
const OURS: [(u64, u64); 2] = [(4096, 8192), (16384, 100)];
/// Length and offset of each advertisement: ours, one for another
/// connection, and a stale one (its region gone, its offset in other
/// memory).
const ADVERT_LEN: [u64; 4] = [8192, 100, 4096, 4096];
const ADVERT_OFF: [u64; 4] = [4096, 16384, 32768, 0];
/// Steps of one run at most.
const STEPS: usize = 256;

/// What a run saw, for the stable harness's counts.
#[derive(Debug, Default, Clone, Copy)]
pub struct Seen {
    pub steps: u64,
    pub accepted: u64,
    pub refused: u64,
    pub protocol_errors: u64,
}

/// The memory the connection may touch and the advertisements made of it.
struct Fixture {
    reg: Registry,
    /// The shadow: a served write fills what it covers.
    mem: Vec<u8>,
    base: u64,
    rid: u64,
    tokens: [Token; 4],
    /// The memory of the stale advertisement (deregistered, kept alive).
    _other: Vec<u8>,
}

impl Fixture {
    fn new() -> Fixture {
        let reg = Registry::new();
        let mem = vec![0u8; MEM];
        let base = mem.as_ptr() as u64;
        let rid = reg
            .register(base, MEM)
            .expect("register the harness memory")
            .id;
        let t0 = reg
            .advertise(rid, base + ADVERT_OFF[0], 8192, Some(CONN))
            .expect("advert");
        let t1 = reg
            .advertise(rid, base + ADVERT_OFF[1], 100, None)
            .expect("advert");
        let t2 = reg
            .advertise(rid, base + ADVERT_OFF[2], 4096, Some(CONN + 1))
            .expect("advert");
        // A stale one: its region is gone.
        let other = vec![0u8; 4096];
        let r2id = reg
            .register(other.as_ptr() as u64, 4096)
            .expect("register")
            .id;
        let t3 = reg
            .advertise(r2id, other.as_ptr() as u64, 4096, Some(CONN))
            .expect("advert");
        reg.deregister(r2id, std::time::Duration::ZERO)
            .expect("dereg");
        Fixture {
            reg,
            mem,
            base,
            rid,
            tokens: [t0, t1, t2, t3],
            _other: other,
        }
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            registry: &self.reg,
            conn: CONN,
            chunk: 4096,
            gather: Gather::new(4096, 16),
            pull: true,
        }
    }

    /// Asserts that `len` bytes at `addr` lie inside one of our
    /// advertisements; returns their offset in the memory.
    fn check_ours(&self, addr: u64, len: usize, what: &str) -> usize {
        let off = addr.wrapping_sub(self.base);
        assert!(
            inside_ours(off, len as u64),
            "{what} of {len} bytes at offset {off:#x}, outside what was advertised"
        );
        off as usize
    }
}

/// Whether `len` bytes at offset `off` lie inside one of our advertisements.
fn inside_ours(off: u64, len: u64) -> bool {
    OURS.iter()
        .any(|&(o, l)| off >= o && off.checked_add(len).is_some_and(|e| e <= o + l))
}

/// What the harness expects of the book: a model of our side.
#[derive(Default)]
struct Model {
    /// Our requests awaiting an answer: (is a read, stage). Stage 0: sent;
    /// 1: a write cleared to send; 2: an inline write; 3: an inline read;
    /// 4: a write offered for pulling; 5: a read offered for us to copy.
    asked: HashMap<u64, (bool, u8)>,
    /// The peer's reads we granted and it has not released.
    granted: std::collections::HashSet<u64>,
    /// Weights of the peer's requests being served.
    served: Vec<usize>,
    /// The payload length each of our inline requests awaits.
    inline_len: HashMap<u64, u32>,
    /// Our two-sided messages posted and acknowledged.
    msgs_sent: u64,
    msgs_acked: u64,
}

/// Runs one input. Panics on any broken invariant (that is the finding).
pub fn control_handler(data: &[u8]) -> Seen {
    let mut seen = Seen::default();
    let mut b = Bytes(data);
    let mut fx = Fixture::new();
    let mut book = Book::new(LIMITS);
    let mut model = Model::default();
    for _ in 0..STEPS {
        if b.done() {
            break;
        }
        seen.steps += 1;
        let op = opcode(b.u8());
        let Some(msg) = next_message(&mut b, op, &fx, &mut book, &mut model) else {
            continue;
        };
        // Only messages that decode reach the handler.
        let mut wire_bytes = Vec::new();
        msg.encode(&mut wire_bytes);
        let Ok(msg) = Control::decode(&wire_bytes) else {
            continue;
        };
        let held_before = book.held();
        let Ok(action) = book.on_control(fx.ctx(), msg) else {
            // The connection ends: nothing more reaches it.
            seen.protocol_errors += 1;
            break;
        };
        check_action(
            action,
            op == 0,
            held_before,
            &mut fx,
            &book,
            &mut model,
            &mut seen,
        );
        check_book(&book, &model);
    }
    // Nothing outside the advertised ranges changed.
    for (i, &x) in fx.mem.iter().enumerate() {
        if x != 0 {
            assert!(
                inside_ours(i as u64, 1),
                "byte {i:#x} written outside what was advertised"
            );
        }
    }
    seen
}

/// A step's kind: 0 a write request, 1 a read request, 2-5 an answer to
/// one of ours, 6 an acknowledgement or keep-alive, 7 a local event, 8 a
/// close or keep-alive.
fn opcode(byte: u8) -> u8 {
    match byte % 16 {
        0..=4 => 0,
        5..=8 => 1,
        9 => 2,
        10 => 3,
        11 => 4,
        12 => 5,
        13 => 6,
        14 => 7,
        _ => 8,
    }
}

/// The message step `op` feeds to the book, or `None` for a local event
/// (carried out here) or an answer with nothing to answer.
fn next_message(
    b: &mut Bytes<'_>,
    op: u8,
    fx: &Fixture,
    book: &mut Book,
    model: &mut Model,
) -> Option<Control> {
    Some(match op {
        0 | 1 => request(b, op == 0, fx),
        2..=5 => answer(b, op, model)?,
        6 if b.u8() & 1 == 1 => Control::MsgDone {
            count: match b.u8() % 3 {
                0 => model.msgs_acked + 1,
                1 => model.msgs_sent,
                _ => b.u64(),
            },
        },
        6 if b.u8() & 3 == 0 => {
            let token = Token {
                id: u64::from(b.u8() % 8),
                secret: u64::from(b.u8() % 2),
            };
            match b.u8() % 3 {
                0 => Control::Revoke { token },
                1 => Control::Revoked { token },
                _ => Control::Leases { leases: leases(b) },
            }
        }
        6 => Control::KeepAlive,
        7 => {
            local_event(b, book, model);
            return None;
        }
        _ if b.u8() == 0xFF => Control::Close,
        _ => Control::KeepAlive,
    })
}

/// The peer's request: a write (`write`) or a read of items partly inside
/// our advertisements and partly not, in runs, now and then in the inline
/// forms.
fn request(b: &mut Bytes<'_>, write: bool, fx: &Fixture) -> Control {
    let n = if b.u8() & 0x80 != 0 {
        1 + b.u16() as usize % 5000
    } else {
        1 + b.u8() as usize % 8
    };
    let items: Vec<RmaItem> = (0..n).map(|_| item(b, fx)).collect();
    // A random partition of the items into runs.
    let mut runs = Vec::new();
    let mut left = n as u32;
    while left > 0 {
        let r = 1 + (b.u8() as u32 % left.min(16));
        runs.push(r);
        left -= r;
    }
    let xfer = b.u8() as u64 % 16;
    // Now and then the inline forms, with a payload length that matches the
    // items or not.
    let inline = b.u8();
    match (inline & 3 == 0, write) {
        (true, true) => {
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
        }
        (true, false) => Control::ReadInline { xfer, items, runs },
        (false, true) if inline & 4 == 4 => {
            // One key per run, now and then one more or fewer.
            let n = match inline >> 3 & 7 {
                0 => runs.len() + 1,
                1 => runs.len().saturating_sub(1),
                _ => runs.len(),
            };
            let src = (0..n)
                .map(|_| PullRun {
                    gpu: b.u8() & 1 == 1,
                    key: vec![0xAB; b.u8() as usize % 32],
                })
                .collect();
            Control::WritePull {
                xfer,
                items,
                runs,
                src,
            }
        }
        (false, true) => Control::WriteReq { xfer, items, runs },
        (false, false) if inline & 4 == 4 => {
            let n = match inline >> 3 & 7 {
                0 => runs.len() + 1,
                _ => runs.len(),
            };
            let dst_gpu = (0..n).map(|_| b.u8() & 1 == 1).collect();
            Control::ReadOffer {
                xfer,
                items,
                runs,
                dst_gpu,
            }
        }
        (false, false) => Control::ReadReq { xfer, items, runs },
    }
}

/// One item of a request: half the time valid (inside one of our
/// advertisements), else a token and range that may be anything.
fn item(b: &mut Bytes<'_>, fx: &Fixture) -> RmaItem {
    let k = b.u8() as usize % 12;
    if k < 6 {
        let t = k % 2;
        let (off, len) = OURS[t];
        let at = b.u16() as u64 % len;
        let l = b.u16() as u64 % (len - at + 1);
        return RmaItem {
            token: fx.tokens[t],
            addr: fx.base + off + at,
            len: l,
        };
    }
    let k = k - 6;
    let token = match k {
        0..=3 => fx.tokens[k],
        4 => Token {
            id: fx.tokens[0].id,
            secret: fx.tokens[0].secret ^ 1,
        },
        _ => Token {
            id: b.u64(),
            secret: b.u64(),
        },
    };
    let ki = k.min(3);
    let addr = match b.u8() % 4 {
        0 => fx.base + ADVERT_OFF[ki],
        1 => fx.base + ADVERT_OFF[ki] + b.u16() as u64 % 256,
        2 => fx.base.wrapping_add(b.u16() as u64),
        _ => b.u64(),
    };
    let len = match b.u8() % 5 {
        0 => ADVERT_LEN[ki],
        1 => b.u8() as u64,
        2 => b.u16() as u64,
        3 => 1 << 62,
        _ => b.u64(),
    };
    RmaItem { token, addr, len }
}

/// Up to two leases, of small made-up tokens.
fn leases(b: &mut Bytes<'_>) -> Vec<wire::Lease> {
    (0..b.u8() % 3)
        .map(|_| wire::Lease {
            token: Token {
                id: u64::from(b.u8() % 8),
                secret: u64::from(b.u8() % 2),
            },
            addr: b.u64(),
            len: b.u64(),
            gpu: b.u8() & 1 == 1,
            write: b.u8() & 1 == 1,
            key: vec![8; usize::from(b.u8() % 24)],
        })
        .collect()
}

/// The peer's answer to a transfer (`op` 2-5): mostly one of ours.
fn answer(b: &mut Bytes<'_>, op: u8, model: &Model) -> Option<Control> {
    let xfer = pick(b, model)?;
    Some(match op {
        2 => Control::WriteCts { xfer },
        3 if b.u8() & 3 == 0 => Control::ReadDone {
            xfer: u64::from(b.u8() % 16),
        },
        3 => Control::WriteDone { xfer },
        4 if b.u8() & 3 == 0 => Control::ReadGrant {
            xfer,
            src: (0..1 + b.u8() % 4)
                .map(|_| PullRun {
                    gpu: false,
                    key: vec![7; usize::from(b.u8() % 24)],
                })
                .collect(),
            leases: leases(b),
        },
        4 => Control::ReadAck { xfer },
        _ if b.u8() & 1 == 1 => {
            let awaited = model.inline_len.get(&xfer).copied().unwrap_or(0);
            Control::ReadData {
                xfer,
                len: match b.u8() % 3 {
                    0 => awaited,
                    1 => awaited + 1,
                    _ => b.u16() as u32,
                },
            }
        }
        _ => Control::Refused {
            xfer,
            reason: "no".into(),
        },
    })
}

/// The transfer an answer names: mostly one we asked about, now and then
/// another; `None` now and then only.
fn pick(b: &mut Bytes<'_>, model: &Model) -> Option<u64> {
    let r = b.u8();
    let mut keys: Vec<u64> = model.asked.keys().copied().collect();
    keys.sort_unstable();
    if r & 3 != 0 && !keys.is_empty() {
        Some(keys[r as usize % keys.len()])
    } else if r & 0x1C == 0 {
        Some(r as u64 % 16)
    } else {
        None
    }
}

/// Our side acts: a two-sided message goes out, one of our one-sided
/// requests goes out (ids never reused while outstanding), or one of the
/// peer's requests we serve ends.
fn local_event(b: &mut Bytes<'_>, book: &mut Book, model: &mut Model) {
    match b.u8() % 5 {
        4 => {
            assert_eq!(book.msg_posted(), model.msgs_sent);
            model.msgs_sent += 1;
        }
        0 | 3 => {
            let xfer = b.u8() as u64 % 16;
            let read = b.u8() & 1 == 1;
            let inline = b.u8();
            if let Entry::Vacant(e) = model.asked.entry(xfer) {
                if inline & 1 == 1 {
                    let len = inline as u32 * 16;
                    book.expect_inline(xfer, read, len);
                    e.insert((read, if read { 3 } else { 2 }));
                    model.inline_len.insert(xfer, len);
                } else if !read && inline & 2 == 2 {
                    book.expect_pull(xfer);
                    e.insert((false, 4));
                } else if read && inline & 2 == 2 {
                    book.expect_offer(xfer);
                    e.insert((true, 5));
                } else {
                    book.expect(xfer, read);
                    e.insert((read, 0));
                }
            }
        }
        1 => {
            if let Some(w) = model.served.pop() {
                book.served_end(w);
            }
        }
        _ => {}
    }
}

/// Checks what the book decided against the model and carries out an
/// accepted request on the shadow memory. `write`: the step was a write
/// request.
fn check_action(
    action: Action,
    write: bool,
    held_before: (usize, usize),
    fx: &mut Fixture,
    book: &Book,
    model: &mut Model,
    seen: &mut Seen,
) {
    match action {
        Action::AcceptWrite(req) | Action::AcceptRead(req) => {
            accepted(fx, model, seen, &req.local, &req.plan, req.weight, write)
        }
        Action::AcceptPull { req, src } => {
            assert_eq!(src.len(), req.local.len(), "a pull without one key per run");
            accepted(fx, model, seen, &req.local, &req.plan, req.weight, write);
        }
        Action::GrantRead { req, tokens } => {
            assert!(
                model.granted.insert(req.xfer),
                "granted twice before its release"
            );
            // Each advertisement once, within the bound, and only ours.
            assert!(tokens.len() <= wire::MAX_GRANT_LEASES);
            for (i, t) in tokens.iter().enumerate() {
                assert!(!tokens[..i].contains(t), "a token named twice for a lease");
                assert!(fx.tokens.contains(t), "a lease of a token not ours");
            }
            accepted(fx, model, seen, &req.local, &req.plan, req.weight, write);
        }
        Action::ReadReleased { xfer } => {
            assert!(
                model.granted.remove(&xfer),
                "a release of a read not granted"
            );
        }
        Action::RefuseWrite { .. } | Action::RefuseRead { .. } => {
            // A refusal holds nothing, whatever the request claimed.
            seen.refused += 1;
            assert_eq!(book.held(), held_before, "a refusal held something");
        }
        // Bounded by the endpoint's queue, not by the book.
        Action::Notif { .. } => {}
        Action::LandWrite {
            local, len, weight, ..
        } => {
            seen.accepted += 1;
            assert!(weight <= LIMITS.max_items);
            assert!(len <= MAX_INLINE);
            let mut total = 0;
            for (m, r) in &local {
                assert_eq!(r.id, fx.rid, "accepted memory of another region");
                let off = fx.check_ours(m.addr, m.len, "inline write");
                fx.mem[off..off + m.len].fill(0xCD);
                total += m.len;
            }
            assert_eq!(total, len, "payload length differs from the items'");
            model.served.push(weight);
        }
        Action::DropWrite { len, .. } => {
            assert!(len <= MAX_INLINE);
            seen.refused += 1;
        }
        Action::SendReadData {
            local, len, weight, ..
        } => {
            seen.accepted += 1;
            assert!(len <= MAX_INLINE);
            for (m, _) in &local {
                fx.check_ours(m.addr, m.len, "inline read");
            }
            model.served.push(weight);
        }
        Action::MsgsLanded { from, to } => {
            assert_eq!(from, model.msgs_acked, "acknowledgements skip or repeat");
            assert!(
                to > from && to <= model.msgs_sent,
                "more acknowledged than sent"
            );
            model.msgs_acked = to;
        }
        // The book holds nothing for leases: the machine's bookkeeping does
        // (crate::lease), and its tests check it.
        Action::Nothing
        | Action::Revoke { .. }
        | Action::Revoked { .. }
        | Action::Leased { .. } => {}
        answer @ (Action::SendWrite { .. }
        | Action::Acked { .. }
        | Action::ReadAccepted { .. }
        | Action::Pulled { .. }
        | Action::ReadGranted { .. }
        | Action::PeerRefused { .. }
        | Action::LandRead { .. }) => check_answer(answer, model),
    }
}

/// An accepted request: within the limits, its memory checked and carried
/// out ([`carry_out`]), its weight held until our side ends it.
fn accepted(
    fx: &mut Fixture,
    model: &mut Model,
    seen: &mut Seen,
    local: &Pieces,
    plan: &[OpPlan],
    weight: usize,
    write: bool,
) {
    seen.accepted += 1;
    assert!(weight <= LIMITS.max_items && plan.len() <= LIMITS.max_items);
    carry_out(fx, local, plan, write);
    model.served.push(weight);
}

/// An accepted request's memory: inside our advertisements, each piece of
/// its plan inside its item; a write fills what it covers.
fn carry_out(fx: &mut Fixture, local: &Pieces, plan: &[OpPlan], write: bool) {
    for (m, r) in local {
        assert_eq!(r.id, fx.rid, "accepted memory of another region");
        fx.check_ours(m.addr, m.len, "accepted memory");
    }
    for p in plan {
        let pieces: Vec<(u64, usize)> = match *p {
            OpPlan::Piece { item, off, len, .. } => {
                let m = &local.mems()[item];
                assert!(off + len <= m.len);
                vec![(m.addr + off as u64, len)]
            }
            OpPlan::Gather { start, end } => local.mems()[start..end]
                .iter()
                .map(|m| (m.addr, m.len))
                .collect(),
        };
        if write {
            for (addr, len) in pieces {
                let off = (addr - fx.base) as usize;
                fx.mem[off..off + len].fill(0xAB);
            }
        }
    }
}

/// An answer to one of our requests: exactly one per request, of the
/// kind the request awaits.
fn check_answer(action: Action, model: &mut Model) {
    match action {
        Action::SendWrite { xfer } => {
            let a = model
                .asked
                .get_mut(&xfer)
                .expect("clear-to-send for a write we made");
            assert!(
                !a.0 && (a.1 == 0 || a.1 == 4),
                "clear-to-send for a read or twice"
            );
            a.1 = 1;
        }
        Action::Acked { xfer } => {
            let a = model
                .asked
                .remove(&xfer)
                .expect("an answer to a request we made");
            assert!(
                !a.0 && (a.1 == 1 || a.1 == 2),
                "a write acknowledged before it was cleared, or a read acknowledged as a write"
            );
        }
        Action::Pulled { xfer } => {
            let a = model
                .asked
                .remove(&xfer)
                .expect("a pulled write we offered");
            assert!(!a.0 && a.1 == 4, "pulled: a write not offered to pull");
        }
        Action::ReadGranted { xfer, .. } => {
            let a = model
                .asked
                .remove(&xfer)
                .expect("a grant of a read we offered");
            assert!(a.0 && a.1 == 5, "granted: a read not offered");
        }
        Action::ReadAccepted { xfer } => {
            let a = model
                .asked
                .remove(&xfer)
                .expect("an answer to a request we made");
            assert!(
                a.0 && (a.1 == 0 || a.1 == 5),
                "a read acceptance for no read awaiting one"
            );
        }
        Action::PeerRefused { xfer, .. } => {
            model
                .asked
                .remove(&xfer)
                .expect("a refusal of a request we made");
            model.inline_len.remove(&xfer);
        }
        Action::LandRead { xfer, len } => {
            let a = model.asked.remove(&xfer).expect("data for a read we made");
            assert!(
                a.0 && a.1 == 3,
                "inline data for a request that is no inline read"
            );
            assert_eq!(model.inline_len.remove(&xfer), Some(len as u32));
        }
        other => unreachable!("not an answer: {other:?}"),
    }
}

/// After every step: what the book holds stays within its limits and
/// agrees with the model.
fn check_book(book: &Book, model: &Model) {
    assert_eq!(book.msgs_unacked(), model.msgs_sent - model.msgs_acked);
    let (reqs, items) = book.held();
    assert!(reqs <= LIMITS.max_requests);
    assert!(items <= LIMITS.max_items);
    assert_eq!(
        book.awaiting(),
        model.asked.len(),
        "the book and the model disagree"
    );
}
