//! Notifications: short messages a peer sends on their own or after a
//! one-sided transfer, queued per endpoint until the application takes them
//! ([`crate::Endpoint::get_notifs`]). What a peer may make us queue is
//! bounded per peer, so that one peer that floods is the one refused (its
//! connection fails) while the others' notifications still arrive:
//!
//! - each connection may have at most [`NotifLimits::per_peer`]
//!   notifications and [`NotifLimits::per_peer_bytes`] bytes queued
//!   (`TCPX_P2P_NOTIF_PER_PEER`, `TCPX_P2P_NOTIF_PER_PEER_BYTES`);
//! - so the endpoint holds at most those bounds times its connections;
//!   and once it holds [`QUEUE_MAX`] notifications or [`QUEUE_MAX_BYTES`]
//!   bytes, a peer that holds its fair share of them (those figures divided
//!   among the peers with notifications queued) or more is refused too.
//!   A peer under its share is still served: one peer's flood never
//!   refuses another.

pub(crate) mod queue;

pub use crate::wire::{MAX_NOTIF, MAX_NOTIF_NAME};
pub(crate) use queue::NotifQueue;

/// Notifications an endpoint queues before its fair-share rule applies.
pub const QUEUE_MAX: usize = 65_536;
/// Bytes (messages and sender names) an endpoint queues before its
/// fair-share rule applies.
pub const QUEUE_MAX_BYTES: usize = 64 << 20;
/// Most notifications one peer may have queued (`TCPX_P2P_NOTIF_PER_PEER`).
pub const PER_PEER: usize = 4096;
/// Most bytes one peer may have queued (`TCPX_P2P_NOTIF_PER_PEER_BYTES`).
pub const PER_PEER_BYTES: usize = 8 << 20;

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

/// The bounds of a [`NotifQueue`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotifLimits {
    /// Notifications and bytes of the whole endpoint (see the fair share).
    pub max: usize,
    pub max_bytes: usize,
    /// Notifications and bytes of one connection.
    pub per_peer: usize,
    pub per_peer_bytes: usize,
}

impl Default for NotifLimits {
    fn default() -> Self {
        NotifLimits {
            max: QUEUE_MAX,
            max_bytes: QUEUE_MAX_BYTES,
            per_peer: PER_PEER,
            per_peer_bytes: PER_PEER_BYTES,
        }
    }
}

/// A peer's notification was refused: it went past its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "notification refused: this peer has {count} notifications ({bytes} bytes) queued, \
     at most {max} and {max_bytes} bytes ({why}); the application does not take them \
     (get_notifs) or the peer floods"
)]
pub struct QueueFull {
    /// What the refused peer holds, and the bound it went past.
    pub count: usize,
    pub bytes: usize,
    pub max: usize,
    pub max_bytes: usize,
    pub why: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(conn: u64, len: usize) -> Notif {
        Notif {
            from_name: "p".into(),
            conn,
            msg: vec![conn as u8; len],
        }
    }

    fn limits(max: usize, max_bytes: usize, per_peer: usize, per_peer_bytes: usize) -> NotifLimits {
        NotifLimits {
            max,
            max_bytes,
            per_peer,
            per_peer_bytes,
        }
    }

    #[test]
    fn drains_in_order_and_bounds_each_peer_by_count_and_bytes() {
        let q = NotifQueue::new(limits(100, 10_000, 3, 100));
        for _ in 0..3 {
            q.push(n(1, 10)).unwrap();
        }
        let full = q.push(n(1, 1)).unwrap_err();
        assert_eq!((full.count, full.bytes, full.max), (3, 33, 3));
        // Another peer is not affected.
        q.push(n(2, 10)).unwrap();
        let got = q.drain();
        assert_eq!(got, vec![n(1, 10), n(1, 10), n(1, 10), n(2, 10)]);
        assert!(q.drain().is_empty());
        // Bytes (message and name): 99 queued, 2 more do not fit; draining frees them.
        q.push(n(1, 98)).unwrap();
        assert!(q.push(n(1, 1)).is_err());
        q.push(n(2, 98)).unwrap();
        assert_eq!(q.drain().len(), 2);
        q.push(n(1, 98)).unwrap();
    }

    #[test]
    fn a_full_endpoint_refuses_only_peers_at_their_share() {
        // Room for 6 in all; each peer may hold 6 on its own.
        let q = NotifQueue::new(limits(6, 10_000, 6, 10_000));
        for _ in 0..5 {
            q.push(n(1, 0)).unwrap();
        }
        q.push(n(2, 0)).unwrap();
        assert_eq!(q.held().0, 6);
        // Full: peer 1 holds 5 of a share of 3 (6 among 2): refused.
        assert!(q.push(n(1, 0)).unwrap_err().why.contains("share"));
        // Peers 2 and 3 are under their share (peer 2: 1 of 3, 6 among
        // 2; peer 3: none of 2, 6 among 3): still served.
        q.push(n(2, 0)).unwrap();
        q.push(n(3, 0)).unwrap();
        assert_eq!(q.held().0, 8);
        // Peer 2 now holds its share (2): refused.
        assert!(q.push(n(2, 0)).is_err());
        // Bytes alike.
        let q = NotifQueue::new(limits(100, 100, 100, 90));
        q.push(n(1, 89)).unwrap();
        assert!(q.push(n(1, 1)).is_err(), "its own bound");
        q.push(n(2, 9)).unwrap();
        assert!(
            q.push(n(2, 60)).is_err(),
            "full, 70 bytes past a share of 50"
        );
        q.push(n(3, 20)).unwrap();
    }
}
