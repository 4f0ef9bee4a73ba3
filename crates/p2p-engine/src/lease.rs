//! Leases: whole advertisements a target lends its peer on a net with a
//! one-sided path, so that the peer's later reads of them (and, for
//! records that live as long as the connection, writes) copy straight
//! between the two processes' memory with no request and no answer.
//!
//! A granted read (`ReadGrant`) costs a round trip per read. Where the
//! read names advertisements of ours, the grant also leases them
//! ([`Lease`]: the advertisement's range and its export). From then on
//! the reader checks a read against its lease (its token, and every byte
//! inside the leased range) and copies it itself. A registry
//! advertisement is only read through a lease: the peer never writes it.
//! A record made for the connection alone (`advertise_ipc`), which lives
//! as long as the connection and is never revoked, is leased as soon as
//! it is made (`Leases`), for writes too (`Lease::write`): the peer then
//! copies a write into it itself, as a same-host connection's
//! `write_ipc` does.
//!
//! The target holds a leased advertisement's region until the lease is
//! revoked: deregistering the region sends `Revoke`, and the reader
//! answers `Revoked` once its reads from the lease have ended (so the
//! region's deregistration waits for them, as it waits for any transfer
//! using it). Both sides keep at most [`MAX_LEASES`] per connection; a
//! peer's excess is refused to that peer alone (the target grants no
//! more; the reader keeps no more and reads them by request).
//!
//! This module is the bookkeeping of both sides, with no I/O: the
//! connection's machine owns one ([`crate::proto::Proto`]).

use std::collections::HashMap;
use std::sync::Arc;

use crate::memory::Region;
use crate::wire::{Lease, RmaItem, Token, MAX_GRANT_LEASES};

/// Most leases one connection holds, on each side.
pub const MAX_LEASES: usize = 1024;

/// A lease we gave: its advertisement's region, held until `Revoked`.
struct Given {
    secret: u64,
    region: Arc<Region>,
    /// `Revoke` has gone out.
    revoking: bool,
}

/// A lease the peer gave us.
struct Held {
    secret: u64,
    addr: u64,
    len: u64,
    gpu: bool,
    key: Arc<[u8]>,
    /// We may copy into it too.
    write: bool,
    /// Our reads and writes copying from or into it now.
    using: usize,
    /// The peer revoked it: no new read uses it, and `Revoked` goes out
    /// when the last one ends.
    revoking: bool,
}

/// Where one run of a leased read copies from: the lease's key and the
/// run's offset inside it.
pub type RunSrc = (Arc<[u8]>, u64);

/// The leases of one connection, given and held.
#[derive(Default)]
pub struct Leases {
    given: HashMap<u64, Given>,
    held: HashMap<u64, Held>,
}

impl Leases {
    // ---------------------------------------------------------- the target

    /// Which of `tokens` (the advertisements a read we grant names) to
    /// lease with the grant: not leased yet, within [`MAX_LEASES`], at
    /// most [`MAX_GRANT_LEASES`].
    pub fn wanted(&self, tokens: &[Token]) -> Vec<Token> {
        let room = MAX_LEASES.saturating_sub(self.given.len());
        let mut out: Vec<Token> = Vec::new();
        for t in tokens {
            if out.len() >= room.min(MAX_GRANT_LEASES) {
                break;
            }
            if !self.given.contains_key(&t.id) && !out.iter().any(|o| o.id == t.id) {
                out.push(*t);
            }
        }
        out
    }

    /// We lease `token`, over `region`: held until the reader's `Revoked`.
    pub fn give(&mut self, token: Token, region: Arc<Region>) {
        self.given.insert(
            token.id,
            Given {
                secret: token.secret,
                region,
                revoking: false,
            },
        );
    }

    /// Region `id` is being deregistered: the leases over it to revoke
    /// (each once).
    pub fn revoke_region(&mut self, id: u64) -> Vec<Token> {
        let mut out = Vec::new();
        for (&tid, g) in self.given.iter_mut() {
            if g.region.id == id && !g.revoking {
                g.revoking = true;
                out.push(Token {
                    id: tid,
                    secret: g.secret,
                });
            }
        }
        out
    }

    /// The reader's `Revoked`: the lease's region is let go. Err for a
    /// lease we did not revoke (the peer broke the protocol).
    pub fn revoked(&mut self, token: Token) -> Result<(), String> {
        match self.given.get(&token.id) {
            Some(g) if g.revoking && g.secret == token.secret => {
                self.given.remove(&token.id);
                Ok(())
            }
            _ => Err(format!(
                "the peer answered Revoked for lease {}, which we did not revoke",
                token.id
            )),
        }
    }

    /// Leases we gave and hold regions for.
    #[cfg_attr(not(any(test, feature = "fuzzing")), allow(dead_code))]
    pub fn given(&self) -> usize {
        self.given.len()
    }

    // ---------------------------------------------------------- the reader

    /// The peer leased these with a grant: kept up to [`MAX_LEASES`]. A
    /// lease for a token we hold already is ignored (the first stands).
    pub fn hold(&mut self, leases: Vec<Lease>) {
        for l in leases {
            if self.held.len() >= MAX_LEASES || self.held.contains_key(&l.token.id) {
                continue;
            }
            self.held.insert(
                l.token.id,
                Held {
                    secret: l.token.secret,
                    addr: l.addr,
                    len: l.len,
                    gpu: l.gpu,
                    write: l.write,
                    key: Arc::from(l.key),
                    using: 0,
                    revoking: false,
                },
            );
        }
    }

    /// Leases the peer gave us that we hold.
    #[cfg_attr(not(any(test, feature = "fuzzing")), allow(dead_code))]
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The peer revokes `token`: true when `Revoked` may go out now (no
    /// read of ours uses it; a lease we never kept is answered at once),
    /// else it goes when the last such read ends ([`Leases::ended`]).
    pub fn revoke(&mut self, token: Token) -> bool {
        match self.held.get_mut(&token.id) {
            Some(h) if h.secret == token.secret => {
                if h.using == 0 {
                    self.held.remove(&token.id);
                    true
                } else {
                    h.revoking = true;
                    false
                }
            }
            _ => true,
        }
    }

    /// Where each run of our read (`write` false) or write of `items`
    /// (grouped into `runs`; `gpu[i]` says whether our side of run `i` is
    /// device memory) copies from or into, if leases cover it all: every
    /// item of a run under one leased token, the run inside the leased
    /// range, a write only into a lease given for writes, and no run
    /// between the peer's host memory and our device memory (the net
    /// cannot copy that). The leases used (each once) count the transfer
    /// until [`Leases::ended`] hears of its end.
    pub fn cover(
        &mut self,
        write: bool,
        items: &[RmaItem],
        runs: &[u32],
        gpu: &[bool],
    ) -> Option<(Vec<RunSrc>, Vec<u64>)> {
        if runs.len() != gpu.len() || self.held.is_empty() {
            return None;
        }
        let mut srcs = Vec::with_capacity(runs.len());
        let mut used: Vec<u64> = Vec::new();
        let mut at = 0usize;
        for (&n, &ours_gpu) in runs.iter().zip(gpu) {
            let run = items.get(at..at.checked_add(n as usize)?)?;
            at += n as usize;
            let first = run.first()?;
            let h = self.held.get(&first.token.id)?;
            if h.revoking
                || h.secret != first.token.secret
                || (ours_gpu && !h.gpu)
                || (write && !h.write)
            {
                return None;
            }
            let mut len = 0u64;
            for it in run {
                if it.token != first.token {
                    return None;
                }
                len = len.checked_add(it.len)?;
            }
            let off = first.addr.checked_sub(h.addr)?;
            if off.checked_add(len)? > h.len {
                return None;
            }
            srcs.push((h.key.clone(), off));
            if used.last() != Some(&first.token.id) && !used.contains(&first.token.id) {
                used.push(first.token.id);
            }
        }
        if at != items.len() {
            return None;
        }
        for id in &used {
            if let Some(h) = self.held.get_mut(id) {
                h.using += 1;
            }
        }
        Some((srcs, used))
    }

    /// A read or write with leases `used` ended (done or failed): the
    /// revoked leases it was the last to use, for `Revoked` to go out.
    pub fn ended(&mut self, used: &[u64]) -> Vec<Token> {
        let mut out = Vec::new();
        for id in used {
            let Some(h) = self.held.get_mut(id) else {
                continue;
            };
            h.using = h.using.saturating_sub(1);
            if h.revoking && h.using == 0 {
                out.push(Token {
                    id: *id,
                    secret: h.secret,
                });
                self.held.remove(id);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemKind;

    fn tok(id: u64) -> Token {
        Token { id, secret: id * 7 }
    }

    fn lease(id: u64, addr: u64, len: u64, gpu: bool) -> Lease {
        Lease {
            token: tok(id),
            addr,
            len,
            gpu,
            write: false,
            key: vec![id as u8; 4],
        }
    }

    fn item(id: u64, addr: u64, len: u64) -> RmaItem {
        RmaItem {
            token: tok(id),
            addr,
            len,
        }
    }

    fn region(id: u64) -> Arc<Region> {
        Arc::new(Region {
            id,
            addr: 0x1000,
            len: 0x1000,
            kind: MemKind::Host,
        })
    }

    #[test]
    fn a_read_inside_its_leases_copies_at_its_offsets() {
        let mut l = Leases::default();
        l.hold(vec![lease(1, 1000, 100, false), lease(2, 5000, 50, true)]);
        // Two runs: 1000..1030 (two items) and 5010..5050.
        let items = [item(1, 1000, 10), item(1, 1010, 20), item(2, 5010, 40)];
        let (srcs, used) = l.cover(false, &items, &[2, 1], &[false, true]).unwrap();
        assert_eq!(srcs.len(), 2);
        assert_eq!((&srcs[0].0[..], srcs[0].1), (&[1u8; 4][..], 0));
        assert_eq!((&srcs[1].0[..], srcs[1].1), (&[2u8; 4][..], 10));
        assert_eq!(used, vec![1, 2]);
        assert!(l.ended(&used).is_empty());
    }

    #[test]
    fn a_read_any_byte_of_which_lies_outside_its_leases_is_not_leased() {
        let mut l = Leases::default();
        l.hold(vec![lease(1, 1000, 100, false)]);
        // Past the end, before the start, a wrong secret, a token not
        // leased, two tokens in one run, host memory into device memory,
        // items and runs that disagree.
        assert!(l
            .cover(false, &[item(1, 1090, 11)], &[1], &[false])
            .is_none());
        assert!(l.cover(false, &[item(1, 999, 2)], &[1], &[false]).is_none());
        let forged = RmaItem {
            token: Token { id: 1, secret: 0 },
            addr: 1000,
            len: 1,
        };
        assert!(l.cover(false, &[forged], &[1], &[false]).is_none());
        assert!(l
            .cover(false, &[item(3, 1000, 1)], &[1], &[false])
            .is_none());
        l.hold(vec![lease(2, 1100, 100, false)]);
        assert!(l
            .cover(
                false,
                &[item(1, 1090, 10), item(2, 1100, 10)],
                &[2],
                &[false]
            )
            .is_none());
        assert!(l
            .cover(false, &[item(1, 1000, 10)], &[1], &[true])
            .is_none());
        assert!(l
            .cover(false, &[item(1, 1000, 10)], &[2], &[false])
            .is_none());
        assert!(l
            .cover(
                false,
                &[item(1, 1000, 10), item(1, 1010, 10)],
                &[1],
                &[false]
            )
            .is_none());
        assert!(l
            .cover(false, &[item(1, 1000, u64::MAX)], &[1], &[false])
            .is_none());
        // Nothing counted by the refused reads: a revoke is answered at once.
        assert!(l.revoke(tok(1)));
    }

    #[test]
    fn only_a_lease_given_for_writes_takes_a_write_and_never_from_our_gpu_into_host() {
        let mut l = Leases::default();
        l.hold(vec![
            lease(1, 1000, 100, false),
            Lease {
                write: true,
                ..lease(2, 5000, 100, false)
            },
            Lease {
                write: true,
                ..lease(3, 9000, 100, true)
            },
        ]);
        // A read-only lease reads, and takes no write.
        assert!(l
            .cover(true, &[item(1, 1000, 10)], &[1], &[false])
            .is_none());
        let (_, r) = l
            .cover(false, &[item(1, 1000, 10)], &[1], &[false])
            .unwrap();
        l.ended(&r);
        // A write lease takes writes inside its range, at their offsets.
        let (srcs, used) = l
            .cover(
                true,
                &[item(2, 5010, 10), item(3, 9050, 50)],
                &[1, 1],
                &[false, true],
            )
            .unwrap();
        assert_eq!((&srcs[0].0[..], srcs[0].1), (&[2u8; 4][..], 10));
        assert_eq!((&srcs[1].0[..], srcs[1].1), (&[3u8; 4][..], 50));
        assert_eq!(used, vec![2, 3]);
        // Past its range, or from our device memory into the peer's host
        // memory (the net cannot copy that): not leased.
        assert!(l
            .cover(true, &[item(2, 5095, 10)], &[1], &[false])
            .is_none());
        assert!(l.cover(true, &[item(2, 5000, 10)], &[1], &[true]).is_none());
        // A revoke waits for the write, as for a read.
        assert!(!l.revoke(tok(2)));
        assert!(l
            .cover(true, &[item(2, 5000, 10)], &[1], &[false])
            .is_none());
        assert_eq!(l.ended(&used), vec![tok(2)]);
    }

    #[test]
    fn a_revoked_lease_is_answered_once_its_last_read_ends_and_used_no_more() {
        let mut l = Leases::default();
        l.hold(vec![lease(1, 0, 100, false)]);
        let (_, a) = l.cover(false, &[item(1, 0, 10)], &[1], &[false]).unwrap();
        let (_, b) = l.cover(false, &[item(1, 10, 10)], &[1], &[false]).unwrap();
        assert!(!l.revoke(tok(1)), "two reads still copy from it");
        assert!(l.cover(false, &[item(1, 20, 10)], &[1], &[false]).is_none());
        assert!(l.ended(&a).is_empty());
        assert_eq!(l.ended(&b), vec![tok(1)]);
        assert_eq!(l.held(), 0);
        // A revoke of a lease we never kept is answered at once.
        assert!(l.revoke(tok(9)));
    }

    #[test]
    fn leases_are_bounded_per_connection_on_both_sides() {
        let mut l = Leases::default();
        l.hold(
            (0..MAX_LEASES as u64 + 10)
                .map(|i| lease(i, 0, 1, false))
                .collect(),
        );
        assert_eq!(l.held(), MAX_LEASES);
        // The first lease of a token stands.
        l.hold(vec![lease(0, 500, 1, false)]);
        assert!(l.cover(false, &[item(0, 0, 1)], &[1], &[false]).is_some());

        let mut g = Leases::default();
        let many: Vec<Token> = (0..20).map(tok).collect();
        assert_eq!(g.wanted(&many).len(), MAX_GRANT_LEASES);
        for i in 0..MAX_LEASES as u64 - 3 {
            g.give(tok(i + 100), region(1));
        }
        assert_eq!(g.wanted(&many).len(), 3);
        // Tokens given already, and repeats, are not wanted again.
        assert!(g.wanted(&[tok(100), tok(101)]).is_empty());
        let mut h = Leases::default();
        assert_eq!(h.wanted(&[tok(1), tok(1), tok(2)]).len(), 2);
        h.give(tok(1), region(1));
        assert_eq!(h.wanted(&[tok(1), tok(2)]), vec![tok(2)]);
    }

    #[test]
    fn a_region_revokes_its_leases_once_and_holds_them_until_revoked() {
        let mut g = Leases::default();
        let r = region(5);
        g.give(tok(1), r.clone());
        g.give(tok(2), r.clone());
        g.give(tok(3), region(6));
        assert_eq!(Arc::strong_count(&r), 3);
        let mut rev = g.revoke_region(5);
        rev.sort_by_key(|t| t.id);
        assert_eq!(rev, vec![tok(1), tok(2)]);
        assert!(g.revoke_region(5).is_empty(), "once");
        // A Revoked we did not ask for, or with the wrong secret, breaks
        // the protocol; the right one lets the region go.
        assert!(g.revoked(tok(3)).is_err());
        assert!(g.revoked(Token { id: 1, secret: 0 }).is_err());
        g.revoked(tok(1)).unwrap();
        g.revoked(tok(2)).unwrap();
        assert!(g.revoked(tok(2)).is_err(), "once");
        assert_eq!(Arc::strong_count(&r), 1);
        assert_eq!(g.given(), 1);
    }
}
