//! Notifications: short messages a peer sends on their own or after a
//! one-sided transfer, queued per endpoint until the application takes them
//! ([`crate::Endpoint::get_notifs`]). The queue is bounded: a peer whose
//! notification would go past the bound has its connection failed, so a
//! peer that floods cannot make us hold memory without limit.

use std::collections::VecDeque;

use parking_lot::Mutex;

pub use crate::wire::{MAX_NOTIF, MAX_NOTIF_NAME};

/// Most notifications an endpoint queues.
pub const QUEUE_MAX: usize = 65_536;
/// Most bytes (messages and sender names) an endpoint queues.
pub const QUEUE_MAX_BYTES: usize = 64 << 20;

/// A notification received from a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notif {
    /// The sender's endpoint name, as the sender configured it.
    pub from_name: String,
    /// The connection it arrived on.
    pub conn: u64,
    pub msg: Vec<u8>,
}

impl Notif {
    fn bytes(&self) -> usize {
        self.msg.len() + self.from_name.len()
    }
}

/// The queue was full: the notification was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "notification queue full ({count} queued, {bytes} bytes; at most {max} and {max_bytes} bytes): the application does not take them (get_notifs) or the peer floods"
)]
pub struct QueueFull {
    pub count: usize,
    pub bytes: usize,
    pub max: usize,
    pub max_bytes: usize,
}

/// Received notifications, oldest first, bounded in count and bytes.
pub(crate) struct NotifQueue {
    q: Mutex<(VecDeque<Notif>, usize)>,
    max: usize,
    max_bytes: usize,
}

impl NotifQueue {
    pub(crate) fn new(max: usize, max_bytes: usize) -> Self {
        NotifQueue {
            q: Mutex::new((VecDeque::new(), 0)),
            max,
            max_bytes,
        }
    }

    /// Queues `n`, or refuses it when the queue would go past its bounds.
    pub(crate) fn push(&self, n: Notif) -> Result<(), QueueFull> {
        let mut g = self.q.lock();
        let (q, bytes) = &mut *g;
        let size = n.bytes();
        if q.len() >= self.max || bytes.saturating_add(size) > self.max_bytes {
            return Err(QueueFull {
                count: q.len(),
                bytes: *bytes,
                max: self.max,
                max_bytes: self.max_bytes,
            });
        }
        *bytes += size;
        q.push_back(n);
        Ok(())
    }

    /// Takes everything queued, oldest first.
    pub(crate) fn drain(&self) -> Vec<Notif> {
        let mut g = self.q.lock();
        g.1 = 0;
        g.0.drain(..).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(i: u8, len: usize) -> Notif {
        Notif {
            from_name: "p".into(),
            conn: i as u64,
            msg: vec![i; len],
        }
    }

    #[test]
    fn drains_in_order_and_bounds_count_and_bytes() {
        let q = NotifQueue::new(3, 100);
        for i in 0..3 {
            q.push(n(i, 10)).unwrap();
        }
        let full = q.push(n(9, 1)).unwrap_err();
        assert_eq!((full.count, full.bytes), (3, 33));
        let got = q.drain();
        assert_eq!(got, vec![n(0, 10), n(1, 10), n(2, 10)]);
        assert!(q.drain().is_empty());
        // bytes (message and name): 99 queued, 2 more do not fit; draining frees them
        q.push(n(1, 98)).unwrap();
        assert!(q.push(n(2, 1)).is_err());
        assert_eq!(q.drain().len(), 1);
        q.push(n(3, 98)).unwrap();
    }
}
