//! What peers together may make an accepting endpoint hold: handshakes in
//! progress, and the connections they become with their net connections.
//!
//! **Handshakes** are bounded in all, per address and per subnet (/24 for
//! IPv4, /64 for IPv6). When a bound is full, a handshake in it whose peer
//! has not proven itself yet is closed to make room: one of the subnet
//! holding the most such handshakes, of its address holding the most, the
//! oldest of those. Only when every handshake in the bound is proven is
//! the newcomer closed. So silent handshakes cannot lock peers out: a
//! flood pays with its own places first, and an honest handshake, proven
//! within a few round trips, is never closed once proven.
//!
//! **Connections** an accepted peer establishes are bounded in number (in
//! all and per address), and so are the net connections (TCP streams,
//! dialed and accepted) they hold, in all and per address. A handshake
//! asks for its room before it dials or accepts anything; past a bound it
//! is refused, and the peer is told why.
//!
//! The tables are small (bounded by the limits) and decisions take `now`,
//! so they are tested without sockets.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::Mutex;

/// The bounds (from [`crate::Config`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdmissionLimits {
    pub handshakes: usize,
    pub handshakes_per_ip: usize,
    pub handshakes_per_subnet: usize,
    pub conns: usize,
    pub conns_per_ip: usize,
    pub streams: usize,
    pub streams_per_ip: usize,
}

/// An address's subnet: /24 for IPv4 (IPv4-mapped IPv6 counts as IPv4),
/// /64 for IPv6.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Subnet {
    V4([u8; 3]),
    V6([u16; 4]),
}

pub(crate) fn canon(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

pub(crate) fn subnet(ip: IpAddr) -> Subnet {
    match canon(ip) {
        IpAddr::V4(a) => {
            let o = a.octets();
            Subnet::V4([o[0], o[1], o[2]])
        }
        IpAddr::V6(a) => {
            let s = a.segments();
            Subnet::V6([s[0], s[1], s[2], s[3]])
        }
    }
}

struct Handshake {
    ip: IpAddr,
    since: Instant,
    proven: bool,
    /// Closes the handshake's socket (its thread then ends and gives the
    /// place back).
    close: Box<dyn Fn() + Send>,
}

#[derive(Default)]
struct State {
    next: u64,
    handshakes: HashMap<u64, Handshake>,
    conns: usize,
    conns_by_ip: HashMap<IpAddr, usize>,
    streams: usize,
    streams_by_ip: HashMap<IpAddr, usize>,
}

/// Which bound a newcomer hit.
#[derive(Clone, Copy)]
enum Bound {
    Ip,
    Subnet,
    All,
}

impl State {
    /// Whether the totals leave room for one more connection holding
    /// `streams` net connections.
    fn totals_room(&self, l: &AdmissionLimits, streams: usize) -> Result<(), String> {
        if self.conns >= l.conns {
            return Err(format!(
                "the endpoint holds {} accepted connections (TCPX_P2P_MAX_CONNS={})",
                self.conns, l.conns
            ));
        }
        if self.streams.saturating_add(streams) > l.streams {
            return Err(format!(
                "this connection needs {streams} net connections and the endpoint holds {} of at most {} (TCPX_P2P_MAX_STREAMS_TOTAL)",
                self.streams, l.streams
            ));
        }
        Ok(())
    }

    fn in_bound(&self, b: Bound, ip: IpAddr) -> impl Iterator<Item = (&u64, &Handshake)> {
        let net = subnet(ip);
        self.handshakes.iter().filter(move |(_, h)| match b {
            Bound::Ip => h.ip == ip,
            Bound::Subnet => subnet(h.ip) == net,
            Bound::All => true,
        })
    }

    /// Makes room for a handshake from `ip` at `now`: the handshakes to
    /// close (already taken out of the table), or which bound is full of
    /// handshakes that may not be closed (then nothing changes).
    fn make_room(&mut self, l: &AdmissionLimits, ip: IpAddr) -> Result<Vec<Handshake>, String> {
        let mut victims: Vec<u64> = Vec::new();
        for (b, max, what) in [
            (
                Bound::Ip,
                l.handshakes_per_ip,
                "from this address (TCPX_P2P_MAX_HANDSHAKES_PER_IP",
            ),
            (
                Bound::Subnet,
                l.handshakes_per_subnet,
                "from this subnet (TCPX_P2P_MAX_HANDSHAKES_PER_SUBNET",
            ),
            (Bound::All, l.handshakes, "in all (TCPX_P2P_MAX_HANDSHAKES"),
        ] {
            let live = |s: &State| {
                s.in_bound(b, ip)
                    .filter(|(id, _)| !victims.contains(id))
                    .map(|(id, h)| (*id, subnet(h.ip), h.ip, h.since, h.proven))
                    .collect::<Vec<_>>()
            };
            let hs = live(self);
            if hs.len() < max {
                continue;
            }
            // Full: close an unproven one, from the subnet holding the most,
            // of its address holding the most, the oldest: a flood from one
            // place pays for itself.
            let closable: Vec<_> = hs.iter().filter(|h| !h.4).collect();
            let mut by_net: HashMap<Subnet, usize> = HashMap::new();
            let mut by_ip: HashMap<IpAddr, usize> = HashMap::new();
            for h in &closable {
                *by_net.entry(h.1).or_default() += 1;
                *by_ip.entry(h.2).or_default() += 1;
            }
            let victim = closable
                .iter()
                .min_by_key(|h| {
                    (
                        std::cmp::Reverse(by_net[&h.1]),
                        std::cmp::Reverse(by_ip[&h.2]),
                        h.3,
                        h.0,
                    )
                })
                .map(|h| h.0);
            match victim {
                Some(id) => victims.push(id),
                None => {
                    return Err(format!(
                        "{} handshakes in progress {what}={max}), none of them closable",
                        hs.len()
                    ))
                }
            }
        }
        Ok(victims
            .into_iter()
            .filter_map(|id| self.handshakes.remove(&id))
            .collect())
    }
}

/// The endpoint's admission bookkeeping.
pub(crate) struct Admission {
    limits: AdmissionLimits,
    state: Mutex<State>,
}

/// A handshake's place; given back when dropped.
pub(crate) struct HandshakeSlot {
    adm: Weak<Admission>,
    id: u64,
}

impl HandshakeSlot {
    /// The peer has proven itself: this handshake is never closed to make
    /// room.
    pub fn proven(&self) {
        if let Some(a) = self.adm.upgrade() {
            if let Some(h) = a.state.lock().handshakes.get_mut(&self.id) {
                h.proven = true;
            }
        }
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        if let Some(a) = self.adm.upgrade() {
            a.state.lock().handshakes.remove(&self.id);
        }
    }
}

/// Room an accepted connection holds (one connection, `streams` net
/// connections); given back when dropped. `ip`: the address it counts
/// against as well (None: a same-host connection, which counts in the
/// totals alone).
pub(crate) struct Room {
    adm: Weak<Admission>,
    ip: Option<IpAddr>,
    streams: usize,
}

impl Drop for Room {
    fn drop(&mut self) {
        if let Some(a) = self.adm.upgrade() {
            let mut s = a.state.lock();
            s.conns = s.conns.saturating_sub(1);
            s.streams = s.streams.saturating_sub(self.streams);
            if let Some(ip) = self.ip {
                dec(&mut s.conns_by_ip, ip, 1);
                dec(&mut s.streams_by_ip, ip, self.streams);
            }
        }
    }
}

fn dec(m: &mut HashMap<IpAddr, usize>, ip: IpAddr, n: usize) {
    if let Some(v) = m.get_mut(&ip) {
        *v = v.saturating_sub(n);
        if *v == 0 {
            m.remove(&ip);
        }
    }
}

impl Admission {
    pub fn new(limits: AdmissionLimits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            state: Mutex::new(State::default()),
        })
    }

    /// A place for a handshake from `ip` at `now` (`close` closes its
    /// socket if it must make room later), or why not. Handshakes closed
    /// to make room for it are closed before this returns.
    pub fn handshake(
        self: &Arc<Self>,
        ip: IpAddr,
        now: Instant,
        close: Box<dyn Fn() + Send>,
    ) -> Result<HandshakeSlot, String> {
        let ip = canon(ip);
        let (slot, closed) = {
            let mut s = self.state.lock();
            let closed = s.make_room(&self.limits, ip)?;
            s.next += 1;
            let id = s.next;
            s.handshakes.insert(
                id,
                Handshake {
                    ip,
                    since: now,
                    proven: false,
                    close,
                },
            );
            (
                HandshakeSlot {
                    adm: Arc::downgrade(self),
                    id,
                },
                closed,
            )
        };
        for h in closed {
            tracing::info!(
                "closed an unproven handshake from {} after {:?} to make room",
                h.ip,
                now.saturating_duration_since(h.since)
            );
            (h.close)();
        }
        Ok(slot)
    }

    /// Room for a connection from `ip` holding `streams` net connections,
    /// or why not.
    pub fn room(self: &Arc<Self>, ip: IpAddr, streams: usize) -> Result<Room, String> {
        let ip = canon(ip);
        let l = &self.limits;
        let mut s = self.state.lock();
        let ip_conns = s.conns_by_ip.get(&ip).copied().unwrap_or(0);
        let ip_streams = s.streams_by_ip.get(&ip).copied().unwrap_or(0);
        s.totals_room(l, streams)?;
        if ip_conns >= l.conns_per_ip {
            return Err(format!(
                "the endpoint holds {ip_conns} connections from {ip} (TCPX_P2P_MAX_CONNS_PER_IP={})",
                l.conns_per_ip
            ));
        }
        if ip_streams.saturating_add(streams) > l.streams_per_ip {
            return Err(format!(
                "this connection needs {streams} net connections and {ip} holds {ip_streams} of at most {} (TCPX_P2P_MAX_STREAMS_PER_IP)",
                l.streams_per_ip
            ));
        }
        s.conns += 1;
        s.streams += streams;
        *s.conns_by_ip.entry(ip).or_default() += 1;
        *s.streams_by_ip.entry(ip).or_default() += streams;
        Ok(Room {
            adm: Arc::downgrade(self),
            ip: Some(ip),
            streams,
        })
    }

    /// Room for a same-host connection holding `streams` net connections,
    /// within the endpoint's totals (its peers share one uid and no
    /// address: the limits per address do not apply), or why not. Counted
    /// and taken under one lock, so that hellos finishing at once cannot
    /// pass the bound together.
    pub fn room_local(self: &Arc<Self>, streams: usize) -> Result<Room, String> {
        let mut s = self.state.lock();
        s.totals_room(&self.limits, streams)?;
        s.conns += 1;
        s.streams += streams;
        Ok(Room {
            adm: Arc::downgrade(self),
            ip: None,
            streams,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    fn limits() -> AdmissionLimits {
        AdmissionLimits {
            handshakes: 8,
            handshakes_per_ip: 3,
            handshakes_per_subnet: 5,
            conns: 4,
            conns_per_ip: 2,
            streams: 100,
            streams_per_ip: 60,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn closer(n: &Arc<AtomicUsize>) -> Box<dyn Fn() + Send> {
        let n = n.clone();
        Box::new(move || {
            n.fetch_add(1, Ordering::Relaxed);
        })
    }

    #[test]
    fn same_host_rooms_count_in_the_totals_alone() {
        let a = Admission::new(limits());
        // More than the limit per address: same-host rooms have none.
        let mut held: Vec<Room> = (0..3).map(|_| a.room_local(10).unwrap()).collect();
        // They share the totals with TCP connections.
        let tcp = a.room(ip("10.0.0.1"), 10).unwrap();
        let e = a.room_local(10).err().unwrap();
        assert!(e.contains("TCPX_P2P_MAX_CONNS"), "{e}");
        assert!(a.room(ip("10.0.0.2"), 10).is_err());
        // Streams too.
        held.pop();
        let e = a.room_local(71).err().unwrap();
        assert!(e.contains("TCPX_P2P_MAX_STREAMS_TOTAL"), "{e}");
        // Dropped rooms give back what they took, and no address's count moves.
        drop(held);
        drop(tcp);
        let s = a.state.lock();
        assert_eq!((s.conns, s.streams), (0, 0));
        assert!(s.conns_by_ip.is_empty() && s.streams_by_ip.is_empty());
    }

    #[test]
    fn subnets() {
        assert_eq!(subnet(ip("10.1.2.3")), subnet(ip("10.1.2.200")));
        assert_ne!(subnet(ip("10.1.2.3")), subnet(ip("10.1.3.3")));
        assert_eq!(subnet(ip("::ffff:10.1.2.3")), subnet(ip("10.1.2.9")));
        assert_eq!(
            subnet(ip("2001:db8:1:2::5")),
            subnet(ip("2001:db8:1:2:ffff::1"))
        );
        assert_ne!(subnet(ip("2001:db8:1:2::5")), subnet(ip("2001:db8:1:3::5")));
    }

    #[test]
    fn silent_handshakes_make_room_for_newcomers() {
        let a = Admission::new(limits());
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let closed = Arc::new(AtomicUsize::new(0));
        // A flood fills the subnet (5): 3 from 10.0.0.2, then 2 from 10.0.0.3.
        let mut held = Vec::new();
        for (i, who) in ["10.0.0.2", "10.0.0.2", "10.0.0.3", "10.0.0.2", "10.0.0.3"]
            .iter()
            .enumerate()
        {
            held.push(a.handshake(ip(who), at(i as u64), closer(&closed)).unwrap());
        }
        // A newcomer of that subnet closes the oldest of the busiest address.
        let mine = a
            .handshake(ip("10.0.0.1"), at(10), closer(&closed))
            .unwrap();
        assert_eq!(closed.load(Ordering::Relaxed), 1);
        assert!(!a.state.lock().handshakes.contains_key(&held[0].id));
        // The flood goes on: it closes its own, never the newcomer (whose
        // address holds the fewest), though the newcomer is now the oldest
        // but two.
        for i in 0..20 {
            let who = if i % 2 == 0 { "10.0.0.2" } else { "10.0.0.3" };
            held.push(a.handshake(ip(who), at(20 + i), closer(&closed)).unwrap());
            assert!(a.state.lock().handshakes.contains_key(&mine.id));
        }
        // A proven handshake is never closed: with every one proven, the
        // newcomer is refused and nothing changes.
        let ids: Vec<u64> = a.state.lock().handshakes.keys().copied().collect();
        for h in held.iter().chain([&mine]) {
            if ids.contains(&h.id) {
                h.proven();
            }
        }
        let before = closed.load(Ordering::Relaxed);
        let e = a
            .handshake(ip("10.0.0.9"), at(99), closer(&closed))
            .err()
            .unwrap();
        assert!(e.contains("TCPX_P2P_MAX_HANDSHAKES_PER_SUBNET"), "{e}");
        assert!(e.contains("none of them closable"), "{e}");
        assert_eq!(closed.load(Ordering::Relaxed), before);
        assert_eq!(a.state.lock().handshakes.len(), 5);
        // Per address: the fourth from one address closes that address's
        // oldest, not another's.
        let b = Admission::new(limits());
        let c2 = Arc::new(AtomicUsize::new(0));
        let other = b.handshake(ip("10.9.0.1"), t0, closer(&c2)).unwrap();
        let mut same = Vec::new();
        for i in 0..3 {
            same.push(b.handshake(ip("10.8.0.1"), at(1 + i), closer(&c2)).unwrap());
        }
        let _newest = b.handshake(ip("10.8.0.1"), at(9), closer(&c2)).unwrap();
        assert!(b.state.lock().handshakes.contains_key(&other.id));
        assert!(!b.state.lock().handshakes.contains_key(&same[0].id));
        // Dropping a place gives it back.
        drop(same);
        assert_eq!(b.state.lock().handshakes.len(), 2);
    }

    #[test]
    fn in_all_the_busiest_subnet_pays() {
        let a = Admission::new(AdmissionLimits {
            handshakes: 4,
            handshakes_per_ip: 4,
            handshakes_per_subnet: 4,
            ..limits()
        });
        let t0 = Instant::now();
        let n = Arc::new(AtomicUsize::new(0));
        // The oldest comes from a quiet subnet; three from a busy one.
        let quiet = a.handshake(ip("10.1.0.1"), t0, closer(&n)).unwrap();
        let busy: Vec<_> = (0..3)
            .map(|i| {
                a.handshake(
                    ip("10.2.0.1"),
                    t0 + Duration::from_millis(1 + i),
                    closer(&n),
                )
                .unwrap()
            })
            .collect();
        let _new = a
            .handshake(ip("10.3.0.1"), t0 + Duration::from_millis(9), closer(&n))
            .unwrap();
        let s = a.state.lock();
        assert!(s.handshakes.contains_key(&quiet.id));
        assert!(!s.handshakes.contains_key(&busy[0].id));
    }

    #[test]
    fn connections_and_streams_are_bounded_in_all_and_per_address() {
        let a = Admission::new(limits());
        let r1 = a.room(ip("10.0.0.1"), 30).unwrap();
        let _r2 = a.room(ip("10.0.0.1"), 30).unwrap();
        let e = a.room(ip("10.0.0.1"), 1).err().unwrap();
        assert!(e.contains("TCPX_P2P_MAX_CONNS_PER_IP"), "{e}");
        let e = a.room(ip("10.0.0.2"), 41).err().unwrap();
        assert!(e.contains("TCPX_P2P_MAX_STREAMS_TOTAL"), "{e}");
        let _r3 = a.room(ip("::ffff:10.0.0.2"), 40).unwrap();
        let e = a.room(ip("10.0.0.3"), 1).err().unwrap();
        assert!(e.contains("TCPX_P2P_MAX_STREAMS_TOTAL"), "{e}");
        drop(r1);
        let _r4 = a.room(ip("10.0.0.3"), 30).unwrap();
        let _r5 = a.room(ip("10.0.0.4"), 0).unwrap();
        let e = a.room(ip("10.0.0.5"), 0).err().unwrap();
        assert!(e.contains("TCPX_P2P_MAX_CONNS="), "{e}");
        let b = Admission::new(limits());
        let e = b.room(ip("10.0.0.1"), 61).err().unwrap();
        assert!(e.contains("TCPX_P2P_MAX_STREAMS_PER_IP"), "{e}");
    }
}
