//! What a connection does with each control message, as a pure state
//! machine: [`Book::on_control`] takes a decoded message and returns the
//! [`Action`] to carry out (or the protocol error that ends the
//! connection); the connection's machine ([`crate::proto::Proto`]) turns
//! the action into its effects, and [`crate::conn::Conn`] does the I/O.
//! Tested and fuzzed without sockets.
//!
//! Rules: a peer's request is resolved against our own records (the
//! registry's advertisements) before anything is sized or allocated from
//! it; what we hold for a peer is bounded ([`Limits`]); every one of our
//! requests gets exactly one answer, and any other answer is a protocol
//! error.

use std::collections::{HashMap, HashSet};

use crate::memory::{MemKind, Registry};
use crate::net::MemRef;
use crate::pieces::Pieces;
use crate::rma;
use crate::transfer::{plan_len, plan_ops, Gather, OpPlan};
use crate::wire::{self, Control, RmaItem};

/// What one connection may make us hold for its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// One-sided requests of the peer accepted and not yet finished
    /// (`TCPX_P2P_MAX_REQUESTS`).
    pub max_requests: usize,
    /// Pieces held for the peer's accepted requests: one per item plus one
    /// per net request they need (`TCPX_P2P_MAX_PENDING_ITEMS`). A refused
    /// request holds nothing: the reader of a refused read has posted no
    /// receive for it (see [`crate::rma_recvs`]).
    pub max_items: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_requests: 16_384,
            max_items: 1 << 20,
        }
    }
}

/// The answer one of our own one-sided requests waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Awaiting {
    /// A write before the peer's clear-to-send.
    Cts,
    /// A cleared write: `WriteDone` (or a refusal) comes next.
    Done,
    /// A write the target may pull: `WriteDone` once it has (or a
    /// refusal), or `WriteCts` where it cannot pull (then as `Cts`).
    Pull,
    /// A read: `ReadAck` (or a refusal).
    ReadAck,
    /// A read we offered to copy ourselves: `ReadGrant`, or `ReadAck`
    /// where the target sends it (or a refusal).
    Offer,
    /// An inline read: `ReadData` of exactly `len` bytes (or a refusal).
    ReadData { len: u32 },
}

/// A peer broke the protocol: the connection fails with this reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    #[error("peer broke the protocol: {what} for transfer {xfer}, which awaits no such answer (duplicate or unknown)")]
    Unexpected { what: &'static str, xfer: u64 },
    #[error("peer broke the protocol: inline data of {len} bytes for read {xfer}, which asked for {want}")]
    InlineLength { xfer: u64, len: u32, want: u32 },
    #[error(
        "peer broke the protocol: it acknowledged {count} messages, but {acked} were \
         acknowledged before and {sent} sent (counts must grow, up to what was sent)"
    )]
    MsgCount { count: u64, acked: u64, sent: u64 },
    #[error("peer closed the connection")]
    Closed,
    #[error("peer broke the protocol: it leased records on a connection whose net has no one-sided path")]
    LeasesWithoutPull,
}

/// A peer's one-sided request `xfer`, admitted against our records: our
/// memory it names (`local`, its runs), the requests that serve it
/// (`plan`) and what it holds against [`Limits`] until it ends (`weight`).
#[derive(Debug)]
pub struct Admitted {
    pub xfer: u64,
    pub local: Pieces,
    pub plan: Vec<OpPlan>,
    pub weight: usize,
}

/// What the connection must do about a control message.
#[derive(Debug)]
pub enum Action {
    Nothing,
    /// The peer's write is accepted: post receives for its plan over its
    /// memory, then send `WriteCts`. Hand its weight back with
    /// [`Book::served_end`] when the receives end.
    AcceptWrite(Admitted),
    /// The peer's write is accepted, to be pulled: copy each run of `src`
    /// (the peer's memory, one [`wire::PullRun`] per run of ours) into our
    /// memory per the plan, then hand the weight back with
    /// [`Book::served_end`] and send `WriteDone`.
    AcceptPull {
        req: Admitted,
        src: Vec<wire::PullRun>,
    },
    /// The peer's read is accepted: send `ReadAck`, then our memory per
    /// the plan.
    AcceptRead(Admitted),
    /// The peer's offered read is accepted, for the peer to copy: send
    /// `ReadGrant` with where each run of ours lies, and hold it (and its
    /// weight) until the peer's `ReadDone` ([`Action::ReadReleased`]).
    GrantRead {
        req: Admitted,
        /// The advertisements the read names (each once, at most
        /// [`wire::MAX_GRANT_LEASES`]): the grant may lease them
        /// ([`crate::lease`]).
        tokens: Vec<wire::Token>,
    },
    /// The peer will copy no more of the read `xfer` we granted: let its
    /// range go.
    ReadReleased {
        xfer: u64,
    },
    /// Refuse the peer's write or inline read: send `Refused`.
    RefuseWrite {
        xfer: u64,
        reason: String,
    },
    /// Refuse the peer's read: send `Refused`, and nothing else (the reader
    /// posts its receives only once we accept).
    RefuseRead {
        xfer: u64,
        reason: String,
    },
    /// The peer cleared our write `xfer`: send its data.
    SendWrite {
        xfer: u64,
    },
    /// The peer pulled every byte of our write `xfer`: it is done, and the
    /// sends it had ready are never posted.
    Pulled {
        xfer: u64,
    },
    /// The peer granted our offered read `xfer`: copy each run from
    /// `src`, then say `ReadDone`.
    ReadGranted {
        xfer: u64,
        src: Vec<wire::PullRun>,
        leases: Vec<wire::Lease>,
    },
    /// The peer revokes its lease `token` (see [`crate::lease`]).
    Revoke {
        token: wire::Token,
    },
    /// The peer no longer reads from our lease `token`.
    Revoked {
        token: wire::Token,
    },
    /// The peer leased us these records unasked (see [`crate::lease`]).
    Leased {
        leases: Vec<wire::Lease>,
    },
    /// The peer's one acknowledgement of our transfer `xfer`.
    Acked {
        xfer: u64,
    },
    /// The peer accepted our read `xfer` (its one acknowledgement): post
    /// the read's receives in their turn; the data follows.
    ReadAccepted {
        xfer: u64,
    },
    /// The peer refused our transfer `xfer`.
    PeerRefused {
        xfer: u64,
        reason: String,
    },
    /// A notification from the peer, for the endpoint's bounded queue.
    Notif {
        name: String,
        msg: Vec<u8>,
    },
    /// The peer's inline write is accepted: read its `len` payload bytes
    /// into `local`, in order (their lengths add up to `len`), then hand
    /// `weight` back with [`Book::served_end`] and send `WriteDone`.
    LandWrite {
        xfer: u64,
        local: Pieces,
        len: usize,
        weight: usize,
    },
    /// The peer's inline write is refused: read and drop its `len` payload
    /// bytes (at most [`wire::MAX_INLINE`]), then send `Refused`.
    DropWrite {
        xfer: u64,
        reason: String,
        len: usize,
    },
    /// The peer's inline read is accepted: send `ReadData` with the `len`
    /// bytes of `local`, then hand `weight` back.
    SendReadData {
        xfer: u64,
        local: Pieces,
        len: usize,
        weight: usize,
    },
    /// The data of our inline read `xfer`: read its `len` bytes into the
    /// read's buffers; it is then done.
    LandRead {
        xfer: u64,
        len: usize,
    },
    /// Our two-sided messages `from..to` (counted in posting order) have
    /// landed in the peer's receives: their sends are complete.
    MsgsLanded {
        // Checked by tests and the fuzz harness; the connection needs `to`.
        #[cfg_attr(not(any(test, feature = "fuzzing")), allow(dead_code))]
        from: u64,
        to: u64,
    },
}

/// What the handler needs to know of its connection.
#[derive(Clone, Copy)]
pub struct Ctx<'a> {
    pub registry: &'a Registry,
    pub conn: u64,
    pub chunk: usize,
    pub gather: Gather,
    /// The connection's net has a one-sided path ([`crate::net::Net::export`]):
    /// the peer's writes may be pulled.
    pub pull: bool,
}

/// One connection's one-sided bookkeeping.
#[derive(Debug, Default)]
pub struct Book {
    limits: Limits,
    /// Our own requests, by transfer id: the answer each awaits.
    ours: HashMap<u64, Awaiting>,
    /// Accepted requests of the peer not yet finished, and their pieces.
    served: usize,
    /// The peer's reads we granted and it has not released yet.
    granted: HashSet<u64>,
    served_items: usize,
    /// Our two-sided messages posted, and how many the peer has
    /// acknowledged (see [`Control::MsgDone`]).
    msgs_sent: u64,
    msgs_acked: u64,
}

impl Book {
    pub fn new(limits: Limits) -> Self {
        Book {
            limits,
            ..Default::default()
        }
    }

    /// Our request `xfer` is about to go out: its answer is now expected.
    pub fn expect(&mut self, xfer: u64, read: bool) {
        self.ours.insert(
            xfer,
            if read {
                Awaiting::ReadAck
            } else {
                Awaiting::Cts
            },
        );
    }

    /// Our read `xfer` goes out offered for us to copy: it awaits
    /// `ReadGrant`, or `ReadAck` where the target sends it.
    pub fn expect_offer(&mut self, xfer: u64) {
        self.ours.insert(xfer, Awaiting::Offer);
    }

    /// Our grant of the peer's read `xfer` could not be made (our net gave
    /// no key for its memory): it is served as a `ReadReq` instead.
    pub fn grant_failed(&mut self, xfer: u64) {
        self.granted.remove(&xfer);
    }

    /// Our write `xfer` goes out for the target to pull: it awaits
    /// `WriteDone`, or `WriteCts` where the target cannot pull.
    pub fn expect_pull(&mut self, xfer: u64) {
        self.ours.insert(xfer, Awaiting::Pull);
    }

    /// Our inline request `xfer` is about to go out: a write awaits
    /// `WriteDone`, a read its `len` bytes of `ReadData`.
    pub fn expect_inline(&mut self, xfer: u64, read: bool, len: u32) {
        self.ours.insert(
            xfer,
            if read {
                Awaiting::ReadData { len }
            } else {
                Awaiting::Done
            },
        );
    }

    /// We posted one more two-sided message; returns its number (from 0).
    pub fn msg_posted(&mut self) -> u64 {
        self.msgs_sent += 1;
        self.msgs_sent - 1
    }

    /// Our two-sided messages posted and not yet acknowledged.
    pub fn msgs_unacked(&self) -> u64 {
        self.msgs_sent - self.msgs_acked
    }

    /// An accepted request of the peer ended.
    pub fn served_end(&mut self, weight: usize) {
        self.served = self.served.saturating_sub(1);
        self.served_items = self.served_items.saturating_sub(weight);
    }

    /// What we hold for the peer: accepted requests and their pieces.
    pub fn held(&self) -> (usize, usize) {
        (self.served, self.served_items)
    }

    /// Our requests still awaiting an answer (for tests and the fuzz
    /// harness).
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn awaiting(&self) -> usize {
        self.ours.len()
    }

    /// Decides what to do about one control message.
    pub fn on_control(&mut self, cx: Ctx<'_>, m: Control) -> Result<Action, ProtocolError> {
        Ok(match m {
            Control::KeepAlive => Action::Nothing,
            Control::Close => return Err(ProtocolError::Closed),
            Control::Notif { name, msg } => Action::Notif { name, msg },
            Control::MsgDone { count } => {
                let (acked, sent) = (self.msgs_acked, self.msgs_sent);
                if count <= acked || count > sent {
                    return Err(ProtocolError::MsgCount { count, acked, sent });
                }
                self.msgs_acked = count;
                Action::MsgsLanded {
                    from: acked,
                    to: count,
                }
            }
            Control::WriteReq { xfer, items, runs } => self.write(cx, xfer, &items, &runs, None),
            Control::WritePull {
                xfer,
                items,
                runs,
                src,
            } => self.write(cx, xfer, &items, &runs, Some(src)),
            Control::ReadOffer {
                xfer,
                items,
                runs,
                dst_gpu,
            } => self.read(cx, xfer, &items, &runs, Some(&dst_gpu)),
            Control::ReadDone { xfer } => {
                if !self.granted.remove(&xfer) {
                    return Err(ProtocolError::Unexpected {
                        what: "ReadDone",
                        xfer,
                    });
                }
                Action::ReadReleased { xfer }
            }
            Control::ReadReq { xfer, items, runs } => self.read(cx, xfer, &items, &runs, None),
            Control::Revoke { token } => Action::Revoke { token },
            Control::Revoked { token } => Action::Revoked { token },
            Control::Leases { leases } if cx.pull => Action::Leased { leases },
            Control::Leases { .. } => return Err(ProtocolError::LeasesWithoutPull),
            Control::WriteInline {
                xfer,
                items,
                runs,
                len,
            } => {
                let len = len as usize;
                match self.admit(cx, xfer, &items, &runs) {
                    Ok(Admitted { local, weight, .. }) => {
                        // Our records' length, not the claim's, must match
                        // the bytes that follow.
                        let total = local.total();
                        if total == len {
                            Action::LandWrite {
                                xfer,
                                local,
                                len,
                                weight,
                            }
                        } else {
                            self.served_end(weight);
                            Action::DropWrite {
                                xfer,
                                reason: format!(
                                    "inline write of {len} bytes for items of {total} bytes"
                                ),
                                len,
                            }
                        }
                    }
                    Err(reason) => Action::DropWrite { xfer, reason, len },
                }
            }
            Control::ReadInline { xfer, items, runs } => {
                match self.admit(cx, xfer, &items, &runs) {
                    Ok(Admitted { local, weight, .. }) => {
                        let len = local.total();
                        if len <= wire::MAX_INLINE {
                            Action::SendReadData {
                                xfer,
                                local,
                                len,
                                weight,
                            }
                        } else {
                            self.served_end(weight);
                            Action::RefuseWrite {
                                xfer,
                                reason: format!(
                                    "inline read of {len} bytes exceeds the inline limit of {}",
                                    wire::MAX_INLINE
                                ),
                            }
                        }
                    }
                    Err(reason) => Action::RefuseWrite { xfer, reason },
                }
            }
            Control::ReadData { xfer, len } => match self.ours.get(&xfer) {
                Some(&Awaiting::ReadData { len: want }) if want == len => {
                    self.ours.remove(&xfer);
                    Action::LandRead {
                        xfer,
                        len: len as usize,
                    }
                }
                Some(&Awaiting::ReadData { len: want }) => {
                    return Err(ProtocolError::InlineLength { xfer, len, want })
                }
                _ => {
                    return Err(ProtocolError::Unexpected {
                        what: "ReadData",
                        xfer,
                    })
                }
            },
            Control::WriteCts { xfer } => match self.ours.get_mut(&xfer) {
                Some(a @ (Awaiting::Cts | Awaiting::Pull)) => {
                    *a = Awaiting::Done;
                    Action::SendWrite { xfer }
                }
                _ => {
                    return Err(ProtocolError::Unexpected {
                        what: "WriteCts",
                        xfer,
                    })
                }
            },
            Control::WriteDone { xfer } => match self.ours.get(&xfer) {
                Some(Awaiting::Pull) => {
                    self.ours.remove(&xfer);
                    Action::Pulled { xfer }
                }
                _ => self.answer(xfer, Awaiting::Done, "WriteDone")?,
            },
            Control::ReadAck { xfer } => match self.ours.get(&xfer) {
                Some(Awaiting::Offer) => {
                    self.ours.remove(&xfer);
                    Action::ReadAccepted { xfer }
                }
                _ => match self.answer(xfer, Awaiting::ReadAck, "ReadAck")? {
                    Action::Acked { xfer } => Action::ReadAccepted { xfer },
                    a => a,
                },
            },
            Control::ReadGrant { xfer, src, leases } => match self.ours.get(&xfer) {
                Some(Awaiting::Offer) => {
                    self.ours.remove(&xfer);
                    Action::ReadGranted { xfer, src, leases }
                }
                _ => {
                    return Err(ProtocolError::Unexpected {
                        what: "ReadGrant",
                        xfer,
                    })
                }
            },
            Control::Refused { xfer, reason } => match self.ours.remove(&xfer) {
                Some(_) => Action::PeerRefused { xfer, reason },
                None => {
                    return Err(ProtocolError::Unexpected {
                        what: "Refused",
                        xfer,
                    })
                }
            },
        })
    }

    fn answer(
        &mut self,
        xfer: u64,
        want: Awaiting,
        what: &'static str,
    ) -> Result<Action, ProtocolError> {
        if self.ours.get(&xfer) == Some(&want) {
            self.ours.remove(&xfer);
            Ok(Action::Acked { xfer })
        } else {
            Err(ProtocolError::Unexpected { what, xfer })
        }
    }

    /// The peer's write `xfer` of `items` in `runs`, offered for us to pull
    /// from `src` or not: pulled where we can copy it ourselves
    /// ([`copies_itself`]), else received as sent.
    fn write(
        &mut self,
        cx: Ctx<'_>,
        xfer: u64,
        items: &[RmaItem],
        runs: &[u32],
        src: Option<Vec<wire::PullRun>>,
    ) -> Action {
        match (self.admit(cx, xfer, items, runs), src) {
            (Ok(req), Some(src)) if copies_itself(&cx, &req.local, &src) => {
                Action::AcceptPull { req, src }
            }
            (Ok(req), _) => Action::AcceptWrite(req),
            (Err(reason), _) => Action::RefuseWrite { xfer, reason },
        }
    }

    /// The peer's read `xfer` of `items` in `runs`, offered for it to copy
    /// itself (`dst_gpu`: which of its runs are device memory) or not:
    /// granted where it can ([`reader_copies`]; one grant per id at a
    /// time), else sent.
    fn read(
        &mut self,
        cx: Ctx<'_>,
        xfer: u64,
        items: &[RmaItem],
        runs: &[u32],
        dst_gpu: Option<&[bool]>,
    ) -> Action {
        match (self.admit(cx, xfer, items, runs), dst_gpu) {
            (Ok(req), Some(dst_gpu))
                if reader_copies(&cx, &req.local, dst_gpu) && !self.granted.contains(&xfer) =>
            {
                self.granted.insert(xfer);
                Action::GrantRead {
                    req,
                    tokens: distinct_tokens(items),
                }
            }
            (Ok(req), _) => Action::AcceptRead(req),
            // Nothing is sized from the claim, and nothing is held.
            (Err(reason), _) => Action::RefuseRead { xfer, reason },
        }
    }

    /// Admits a request of the peer: within the limits, every item inside
    /// an advertisement of ours, each run contiguous in one region. Sizes
    /// come from our records only once they have bounded the claim.
    fn admit(
        &mut self,
        cx: Ctx<'_>,
        xfer: u64,
        items: &[RmaItem],
        runs: &[u32],
    ) -> Result<Admitted, String> {
        let Limits {
            max_requests,
            max_items,
        } = self.limits;
        if self.served >= max_requests {
            return Err(format!(
                "too many outstanding requests on this connection (limit {max_requests}, TCPX_P2P_MAX_REQUESTS)"
            ));
        }
        let left = max_items.saturating_sub(self.served_items);
        if items.len() > left {
            return Err(format!(
                "{} items exceed the {left} pieces left of the limit of {max_items} outstanding (TCPX_P2P_MAX_PENDING_ITEMS)",
                items.len()
            ));
        }
        let mut adverts = cx.registry.resolver(cx.conn);
        let mut each = Pieces::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            let r = adverts
                .resolve(it.token, it.addr, it.len)
                .map_err(|e| format!("item {i}: {e}"))?;
            let mem = MemRef {
                addr: it.addr,
                len: it.len as usize,
                kind: r.kind,
            };
            each.push(mem, r);
        }
        let local = rma::merge_runs(each, runs).map_err(|e| e.to_string())?;
        // Bounded by our regions now; still counted before planned.
        let lens: Vec<usize> = local.mems().iter().map(|m| m.len).collect();
        let pieces = plan_len(&lens, cx.chunk, cx.gather);
        let weight = (items.len() as u64).saturating_add(pieces);
        if weight > left as u64 {
            return Err(format!(
                "the request needs {weight} pieces, more than the {left} left of the limit of {max_items} outstanding (TCPX_P2P_MAX_PENDING_ITEMS)"
            ));
        }
        let plan = plan_ops(&lens, cx.chunk, cx.gather);
        self.served += 1;
        self.served_items += weight as usize;
        Ok(Admitted {
            xfer,
            local,
            plan,
            weight: weight as usize,
        })
    }
}

#[cfg(test)]
mod token_tests {
    use super::*;

    #[test]
    fn a_read_names_each_advertisement_once_up_to_the_lease_bound() {
        let it = |id| RmaItem {
            token: wire::Token { id, secret: 1 },
            addr: 0,
            len: 1,
        };
        let items: Vec<RmaItem> = [1, 1, 2, 1, 3, 2].into_iter().map(it).collect();
        let ids: Vec<u64> = distinct_tokens(&items).iter().map(|t| t.id).collect();
        assert_eq!(ids, [1, 2, 3]);
        let many: Vec<RmaItem> = (0..100).map(it).collect();
        assert_eq!(distinct_tokens(&many).len(), wire::MAX_GRANT_LEASES);
    }
}

/// The advertisements `items` name, each once, at most
/// [`wire::MAX_GRANT_LEASES`] (a block list names one advertisement
/// 100,000 times: one comparison each).
fn distinct_tokens(items: &[RmaItem]) -> Vec<wire::Token> {
    let mut out: Vec<wire::Token> = Vec::new();
    for it in items {
        if out.last() == Some(&it.token) || out.contains(&it.token) {
            continue;
        }
        if out.len() == wire::MAX_GRANT_LEASES {
            break;
        }
        out.push(it.token);
    }
    out
}

/// Whether the peer copies its offered read (`ReadOffer`) itself, from our
/// runs `local` into its runs (`dst_gpu`: which are device memory): on a
/// net with a one-sided path, one flag per run, and no run from our host
/// memory into its GPU memory (cross-memory attach moves host memory
/// only). Otherwise the read is served as a `ReadReq`.
fn reader_copies(cx: &Ctx<'_>, local: &Pieces, dst_gpu: &[bool]) -> bool {
    cx.pull
        && dst_gpu.len() == local.len()
        && local
            .mems()
            .iter()
            .zip(dst_gpu)
            .all(|(m, &gpu)| !gpu || m.kind != MemKind::Host)
}

/// Whether we copy a peer's offered write (`WritePull`) ourselves, from
/// its `runs` into our runs `local`: on a net with a one-sided path, one
/// key per run, and no run from the peer's host memory into our GPU
/// memory (cross-memory attach moves host memory only). Otherwise the
/// write is served as a `WriteReq`.
fn copies_itself(cx: &Ctx<'_>, local: &Pieces, runs: &[wire::PullRun]) -> bool {
    cx.pull
        && runs.len() == local.len()
        && local
            .mems()
            .iter()
            .zip(runs)
            .all(|(m, r)| r.gpu || m.kind == MemKind::Host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Token;

    struct Fixture {
        reg: Registry,
        buf: Vec<u8>,
        token: Token,
    }

    fn fixture() -> Fixture {
        let reg = Registry::new();
        let buf = vec![0u8; 1 << 16];
        let base = buf.as_ptr() as u64;
        let r = reg.register(base, buf.len()).unwrap();
        let token = reg.advertise(r.id, base + 4096, 8192, Some(1)).unwrap();
        Fixture { reg, buf, token }
    }

    fn cx(f: &Fixture) -> Ctx<'_> {
        Ctx {
            registry: &f.reg,
            conn: 1,
            chunk: 4096,
            gather: Gather::new(4096, 64),
            pull: true,
        }
    }

    fn item(f: &Fixture, off: u64, len: u64, token: Token) -> RmaItem {
        RmaItem {
            token,
            addr: f.buf.as_ptr() as u64 + off,
            len,
        }
    }

    #[test]
    fn a_huge_claim_with_a_made_up_token_is_refused_without_sizing_it() {
        let f = fixture();
        let mut b = Book::new(Limits::default());
        let bogus = Token { id: 999, secret: 1 };
        // Reads of 2^62 bytes (2^50 chunks), or of u64::MAX bytes in runs
        // whose lengths overflow, again and again: each is refused with
        // nothing sized, nothing held, and the connection goes on.
        for xfer in 0..1000 {
            let m = Control::ReadReq {
                xfer,
                items: vec![item(&f, 0, 1 << 62, bogus), item(&f, 0, u64::MAX, bogus)],
                runs: vec![2],
            };
            match b.on_control(cx(&f), m) {
                Ok(Action::RefuseRead { xfer: x, reason }) => {
                    assert_eq!(x, xfer);
                    assert!(reason.contains("unknown or stale"), "{reason}");
                }
                a => panic!("{a:?}"),
            }
            assert_eq!(b.held(), (0, 0));
        }
        let m = Control::WriteReq {
            xfer: 8,
            items: vec![item(&f, 0, 1 << 62, bogus)],
            runs: vec![1],
        };
        assert!(matches!(
            b.on_control(cx(&f), m),
            Ok(Action::RefuseWrite { xfer: 8, .. })
        ));
        assert_eq!(b.held(), (0, 0));
        // A legitimate read is still served.
        let m = Control::ReadReq {
            xfer: 9,
            items: vec![item(&f, 4096, 8192, f.token)],
            runs: vec![1],
        };
        assert!(matches!(
            b.on_control(cx(&f), m),
            Ok(Action::AcceptRead(Admitted { xfer: 9, .. }))
        ));
    }

    #[test]
    fn accepted_requests_stay_inside_the_advertisement_and_count() {
        let f = fixture();
        let mut b = Book::new(Limits {
            max_requests: 2,
            max_items: 6,
        });
        let w = |xfer, off, len| Control::WriteReq {
            xfer,
            items: vec![item(&f, off, len, f.token)],
            runs: vec![1],
        };
        match b.on_control(cx(&f), w(1, 4096, 8192)).unwrap() {
            Action::AcceptWrite(Admitted {
                local,
                plan,
                weight,
                ..
            }) => {
                assert_eq!(local.mems()[0].addr, f.buf.as_ptr() as u64 + 4096);
                assert_eq!(plan.len(), 2);
                assert_eq!(weight, 3);
            }
            a => panic!("{a:?}"),
        }
        assert!(matches!(
            b.on_control(cx(&f), w(2, 4095, 10)).unwrap(),
            Action::RefuseWrite { .. }
        ));
        assert!(matches!(
            b.on_control(cx(&f), w(3, 4096, 1)).unwrap(),
            Action::AcceptWrite { .. }
        ));
        // Third request: over the request limit.
        match b.on_control(cx(&f), w(4, 4096, 1)).unwrap() {
            Action::RefuseWrite { reason, .. } => assert!(reason.contains("TCPX_P2P_MAX_REQUESTS")),
            a => panic!("{a:?}"),
        }
        b.served_end(2);
        // Pieces: 3 held, 6 allowed; two items of a piece each (4) do not fit.
        let m = Control::WriteReq {
            xfer: 5,
            items: vec![item(&f, 4096, 4096, f.token), item(&f, 8192, 4096, f.token)],
            runs: vec![1, 1],
        };
        match b.on_control(cx(&f), m).unwrap() {
            Action::RefuseWrite { reason, .. } => {
                assert!(reason.contains("TCPX_P2P_MAX_PENDING_ITEMS"))
            }
            a => panic!("{a:?}"),
        }
    }

    #[test]
    fn a_write_offered_for_pulling_is_pulled_where_the_net_can_and_sent_otherwise() {
        let f = fixture();
        let offer = |xfer| Control::WritePull {
            xfer,
            items: vec![item(&f, 4096, 8192, f.token)],
            runs: vec![1],
            src: vec![wire::PullRun {
                gpu: false,
                key: vec![1; 16],
            }],
        };
        let mut b = Book::new(Limits::default());
        match b.on_control(cx(&f), offer(1)).unwrap() {
            Action::AcceptPull { req, src } => {
                assert_eq!(src.len(), 1);
                assert_eq!(req.plan.len(), 2, "8 KiB in 4 KiB requests");
            }
            a => panic!("{a:?}"),
        }
        // On a net without a one-sided path: an ordinary write.
        let mut no = cx(&f);
        no.pull = false;
        assert!(matches!(
            b.on_control(no, offer(2)).unwrap(),
            Action::AcceptWrite(Admitted { xfer: 2, .. })
        ));
        // A forged item is refused as any write is.
        let mut bad = offer(3);
        if let Control::WritePull { items, .. } = &mut bad {
            items[0].token.secret ^= 1;
        }
        assert!(matches!(
            b.on_control(cx(&f), bad).unwrap(),
            Action::RefuseWrite { xfer: 3, .. }
        ));
    }

    #[test]
    fn our_offered_write_ends_on_write_done_or_goes_on_after_a_clear_to_send() {
        let f = fixture();
        let mut b = Book::new(Limits::default());
        b.expect_pull(1);
        assert!(matches!(
            b.on_control(cx(&f), Control::WriteDone { xfer: 1 }),
            Ok(Action::Pulled { xfer: 1 })
        ));
        assert!(b
            .on_control(cx(&f), Control::WriteDone { xfer: 1 })
            .is_err());
        b.expect_pull(2);
        assert!(matches!(
            b.on_control(cx(&f), Control::WriteCts { xfer: 2 }),
            Ok(Action::SendWrite { xfer: 2 })
        ));
        assert!(b.on_control(cx(&f), Control::WriteCts { xfer: 2 }).is_err());
        assert!(matches!(
            b.on_control(cx(&f), Control::WriteDone { xfer: 2 }),
            Ok(Action::Acked { xfer: 2 })
        ));
        assert_eq!(b.awaiting(), 0);
    }

    #[test]
    fn an_offered_read_is_granted_where_the_reader_can_copy_and_released_once() {
        let f = fixture();
        let offer = |xfer, gpu| Control::ReadOffer {
            xfer,
            items: vec![item(&f, 4096, 8192, f.token)],
            runs: vec![1],
            dst_gpu: vec![gpu],
        };
        let mut b = Book::new(Limits::default());
        // The grant names the read's advertisement, once, for a lease.
        match b.on_control(cx(&f), offer(1, false)).unwrap() {
            Action::GrantRead { req, tokens } if req.xfer == 1 => {
                assert_eq!(tokens, vec![f.token])
            }
            a => panic!("not a grant: {a:?}"),
        }
        // Our host memory into the reader's GPU memory: sent instead.
        assert!(matches!(
            b.on_control(cx(&f), offer(2, true)).unwrap(),
            Action::AcceptRead(Admitted { xfer: 2, .. })
        ));
        let mut no = cx(&f);
        no.pull = false;
        assert!(matches!(
            b.on_control(no, offer(3, false)).unwrap(),
            Action::AcceptRead(Admitted { xfer: 3, .. })
        ));
        assert!(matches!(
            b.on_control(cx(&f), Control::ReadDone { xfer: 1 }),
            Ok(Action::ReadReleased { xfer: 1 })
        ));
        // Once; and never for a read that was not granted.
        assert!(b.on_control(cx(&f), Control::ReadDone { xfer: 1 }).is_err());
        assert!(b.on_control(cx(&f), Control::ReadDone { xfer: 2 }).is_err());
    }

    #[test]
    fn our_offered_read_takes_a_grant_or_an_acknowledgement_once() {
        let f = fixture();
        let grant = |xfer| Control::ReadGrant {
            xfer,
            leases: vec![],
            src: vec![wire::PullRun {
                gpu: false,
                key: vec![1; 16],
            }],
        };
        let mut b = Book::new(Limits::default());
        b.expect_offer(1);
        assert!(matches!(
            b.on_control(cx(&f), grant(1)),
            Ok(Action::ReadGranted { xfer: 1, .. })
        ));
        assert!(b.on_control(cx(&f), grant(1)).is_err());
        b.expect_offer(2);
        assert!(matches!(
            b.on_control(cx(&f), Control::ReadAck { xfer: 2 }),
            Ok(Action::ReadAccepted { xfer: 2 })
        ));
        assert!(b.on_control(cx(&f), grant(2)).is_err());
        // A plain read takes no grant.
        b.expect(3, true);
        assert!(b.on_control(cx(&f), grant(3)).is_err());
    }

    #[test]
    fn exactly_one_answer_per_request() {
        let f = fixture();
        let mut b = Book::new(Limits::default());
        b.expect(1, true);
        assert!(matches!(
            b.on_control(cx(&f), Control::ReadAck { xfer: 1 }),
            Ok(Action::ReadAccepted { xfer: 1 })
        ));
        assert!(
            b.on_control(cx(&f), Control::ReadAck { xfer: 1 }).is_err(),
            "duplicate"
        );
        assert!(
            b.on_control(cx(&f), Control::ReadAck { xfer: 2 }).is_err(),
            "unknown"
        );
        b.expect(3, false);
        assert!(
            b.on_control(cx(&f), Control::WriteDone { xfer: 3 })
                .is_err(),
            "done before cts"
        );
        let mut b = Book::new(Limits::default());
        b.expect(3, false);
        assert!(matches!(
            b.on_control(cx(&f), Control::WriteCts { xfer: 3 }),
            Ok(Action::SendWrite { .. })
        ));
        assert!(
            b.on_control(cx(&f), Control::WriteCts { xfer: 3 }).is_err(),
            "second cts"
        );
        let mut b = Book::new(Limits::default());
        b.expect(3, false);
        b.on_control(cx(&f), Control::WriteCts { xfer: 3 }).unwrap();
        assert!(
            b.on_control(cx(&f), Control::ReadAck { xfer: 3 }).is_err(),
            "wrong kind"
        );
        let mut b = Book::new(Limits::default());
        b.expect(3, false);
        b.on_control(cx(&f), Control::WriteCts { xfer: 3 }).unwrap();
        assert!(matches!(
            b.on_control(cx(&f), Control::WriteDone { xfer: 3 }),
            Ok(Action::Acked { .. })
        ));
        assert!(b
            .on_control(cx(&f), Control::WriteDone { xfer: 3 })
            .is_err());
        b.expect(4, true);
        let r = Control::Refused {
            xfer: 4,
            reason: "no".into(),
        };
        assert!(matches!(
            b.on_control(cx(&f), r.clone()),
            Ok(Action::PeerRefused { .. })
        ));
        assert!(b.on_control(cx(&f), r).is_err(), "refused twice");
        assert_eq!(
            b.on_control(cx(&f), Control::Close).unwrap_err(),
            ProtocolError::Closed
        );
        assert_eq!(b.awaiting(), 0);
    }

    #[test]
    fn message_acknowledgements_grow_up_to_what_was_sent() {
        let f = fixture();
        let mut b = Book::new(Limits::default());
        let done = |count| Control::MsgDone { count };
        assert_eq!(
            b.on_control(cx(&f), done(1)).unwrap_err(),
            ProtocolError::MsgCount {
                count: 1,
                acked: 0,
                sent: 0
            },
            "nothing sent"
        );
        for i in 0..3 {
            assert_eq!(b.msg_posted(), i);
        }
        assert!(matches!(
            b.on_control(cx(&f), done(2)),
            Ok(Action::MsgsLanded { from: 0, to: 2 })
        ));
        assert_eq!(b.msgs_unacked(), 1);
        assert!(b.on_control(cx(&f), done(2)).is_err(), "no growth");
        assert!(b.on_control(cx(&f), done(1)).is_err(), "backwards");
        assert!(b.on_control(cx(&f), done(4)).is_err(), "beyond sent");
        assert!(b.on_control(cx(&f), done(u64::MAX)).is_err(), "absurd");
        assert!(matches!(
            b.on_control(cx(&f), done(3)),
            Ok(Action::MsgsLanded { from: 2, to: 3 })
        ));
        assert_eq!(b.msgs_unacked(), 0);
    }

    #[test]
    fn inline_writes_land_only_inside_the_advertisement_with_exact_lengths() {
        let f = fixture();
        let mut b = Book::new(Limits {
            max_requests: 1,
            max_items: 16,
        });
        let w = |xfer, off, len, token, payload| Control::WriteInline {
            xfer,
            items: vec![item(&f, off, len, token)],
            runs: vec![1],
            len: payload,
        };
        match b.on_control(cx(&f), w(1, 4096, 100, f.token, 100)).unwrap() {
            Action::LandWrite {
                xfer: 1,
                local,
                len: 100,
                weight,
            } => {
                assert_eq!(local.mems()[0].addr, f.buf.as_ptr() as u64 + 4096);
                assert_eq!(local.mems()[0].len, 100);
                assert_eq!(weight, 2);
            }
            a => panic!("{a:?}"),
        }
        // Held while it lands: the next one is over the request limit.
        match b.on_control(cx(&f), w(2, 4096, 100, f.token, 100)).unwrap() {
            Action::DropWrite {
                len: 100, reason, ..
            } => {
                assert!(reason.contains("TCPX_P2P_MAX_REQUESTS"))
            }
            a => panic!("{a:?}"),
        }
        b.served_end(2);
        assert_eq!(b.held(), (0, 0));
        // Payload longer or shorter than the items: dropped, nothing held.
        for payload in [99, 101] {
            assert!(matches!(
                b.on_control(cx(&f), w(3, 4096, 100, f.token, payload)).unwrap(),
                Action::DropWrite { xfer: 3, len, .. } if len == payload as usize
            ));
            assert_eq!(b.held(), (0, 0));
        }
        // Outside the advertised range, or a forged token.
        let forged = Token {
            id: f.token.id,
            secret: f.token.secret ^ 1,
        };
        for m in [
            w(4, 4096 + 8192 - 10, 11, f.token, 11),
            w(5, 0, 100, f.token, 100),
            w(6, 4096, 100, forged, 100),
        ] {
            assert!(matches!(
                b.on_control(cx(&f), m).unwrap(),
                Action::DropWrite { .. }
            ));
        }
        assert_eq!(b.held(), (0, 0));
    }

    #[test]
    fn inline_reads_are_served_and_answered_exactly_once() {
        let f = fixture();
        let mut b = Book::new(Limits::default());
        let r = Control::ReadInline {
            xfer: 1,
            items: vec![item(&f, 4096, 8192, f.token)],
            runs: vec![1],
        };
        match b.on_control(cx(&f), r).unwrap() {
            Action::SendReadData {
                xfer: 1, len: 8192, ..
            } => {}
            a => panic!("{a:?}"),
        }
        let bogus = Token { id: 999, secret: 1 };
        let r = Control::ReadInline {
            xfer: 2,
            items: vec![item(&f, 0, 1 << 62, bogus)],
            runs: vec![1],
        };
        assert!(matches!(
            b.on_control(cx(&f), r).unwrap(),
            Action::RefuseWrite { xfer: 2, .. }
        ));
        // Our own inline read: exactly the bytes asked for, once.
        b.expect_inline(7, true, 64);
        assert_eq!(
            b.on_control(cx(&f), Control::ReadData { xfer: 7, len: 65 })
                .unwrap_err(),
            ProtocolError::InlineLength {
                xfer: 7,
                len: 65,
                want: 64
            }
        );
        let mut b = Book::new(Limits::default());
        b.expect_inline(7, true, 64);
        assert!(matches!(
            b.on_control(cx(&f), Control::ReadData { xfer: 7, len: 64 }),
            Ok(Action::LandRead { xfer: 7, len: 64 })
        ));
        assert!(b
            .on_control(cx(&f), Control::ReadData { xfer: 7, len: 64 })
            .is_err());
        // An inline write awaits WriteDone with no clear-to-send.
        b.expect_inline(8, false, 10);
        assert!(b.on_control(cx(&f), Control::WriteCts { xfer: 8 }).is_err());
        let mut b = Book::new(Limits::default());
        b.expect_inline(8, false, 10);
        assert!(matches!(
            b.on_control(cx(&f), Control::WriteDone { xfer: 8 }),
            Ok(Action::Acked { xfer: 8 })
        ));
        assert_eq!(b.awaiting(), 0);
    }
}
