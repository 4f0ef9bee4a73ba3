//! The endpoint's queue of received notifications, bounded per peer and in
//! all. Its type is reachable only inside the crate (and by the fuzz
//! harness, through the `fuzzing` feature).

use std::collections::{HashMap, VecDeque};

use parking_lot::Mutex;

use super::{Notif, NotifLimits, QueueFull};

#[derive(Default)]
struct Queued {
    q: VecDeque<Notif>,
    bytes: usize,
    /// Per connection: notifications and bytes queued.
    by_conn: HashMap<u64, (usize, usize)>,
}

/// Received notifications, oldest first, bounded per peer and in all.
pub struct NotifQueue {
    q: Mutex<Queued>,
    limits: NotifLimits,
}

impl NotifQueue {
    pub fn new(limits: NotifLimits) -> Self {
        NotifQueue {
            q: Mutex::new(Queued::default()),
            limits,
        }
    }

    /// Queues `n`, or refuses it when its peer would go past its bound.
    pub fn push(&self, n: Notif) -> Result<(), QueueFull> {
        let l = self.limits;
        let mut g = self.q.lock();
        let size = n.bytes();
        let (count, bytes) = g.by_conn.get(&n.conn).copied().unwrap_or((0, 0));
        let refuse = |max, max_bytes, why| QueueFull {
            count,
            bytes,
            max,
            max_bytes,
            why,
        };
        if count >= l.per_peer || bytes.saturating_add(size) > l.per_peer_bytes {
            return Err(refuse(
                l.per_peer,
                l.per_peer_bytes,
                "per peer: TCPX_P2P_NOTIF_PER_PEER, TCPX_P2P_NOTIF_PER_PEER_BYTES",
            ));
        }
        if g.q.len() >= l.max || g.bytes.saturating_add(size) > l.max_bytes {
            // The endpoint is full: refuse only a peer at or past its share.
            let peers = g.by_conn.len() + usize::from(count == 0);
            let (share, share_bytes) = (l.max / peers, l.max_bytes / peers);
            if count >= share || bytes.saturating_add(size) > share_bytes {
                return Err(refuse(
                    share,
                    share_bytes,
                    "its share of the endpoint's queue, which is full",
                ));
            }
        }
        g.bytes += size;
        let e = g.by_conn.entry(n.conn).or_default();
        e.0 += 1;
        e.1 += size;
        g.q.push_back(n);
        Ok(())
    }

    /// Takes everything queued, oldest first.
    pub fn drain(&self) -> Vec<Notif> {
        let mut g = self.q.lock();
        g.bytes = 0;
        g.by_conn.clear();
        g.q.drain(..).collect()
    }

    /// Notifications and bytes queued, in all (for tests and the fuzz
    /// harness).
    #[cfg(any(test, feature = "fuzzing"))]
    pub fn held(&self) -> (usize, usize) {
        let g = self.q.lock();
        (g.q.len(), g.bytes)
    }
}
