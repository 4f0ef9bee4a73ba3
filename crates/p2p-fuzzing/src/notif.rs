//! The notification queue's bounds ([`notif_queue`]).

use std::collections::{HashMap, VecDeque};

use tcpx_p2p::fuzzing::NotifQueue;
use tcpx_p2p::notif::NotifLimits;
use tcpx_p2p::Notif;

use crate::bytes::Bytes;

/// What a run of [`notif_queue`] saw.
#[derive(Debug, Default, Clone, Copy)]
pub struct NotifSeen {
    pub pushed: u64,
    pub refused: u64,
    pub drained: u64,
}

/// Runs one input through a `NotifQueue` with small bounds: up to eight
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
