//! The handshake of a control connection, in two layers: pure decisions
//! ([`negotiate`], [`proof`], [`check_handles`]) tested without sockets, and
//! the I/O that runs them ([`run`]) under one deadline.
//!
//! The exchange (initiator I, acceptor A), one frame each:
//!
//! 1. I → A: `Hello` (proposal: channels, chunk, a fresh nonce).
//! 2. A → I: `Hello` (answer: the channels and chunk both will use, a fresh nonce).
//! 3. I → A: `Proof` = HMAC-SHA256(secret, label ‖ "I" ‖ hello₁ ‖ hello₂).
//! 4. A checks it (constant time), then A → I: its `Proof` (label ‖ "A" ‖ …).
//! 5. I listens and sends its `Handles`; A checks them and finds room for
//!    the connection ([`Gate`]) before it listens and answers with its own
//!    `Handles` (or a refusal, the answer I reads); each checks the other's
//!    handles before dialing them.
//!
//! Nothing is listened on or dialed before the peer has proven the secret,
//! a proof covers both nonces (a replayed one fails) and the connection's
//! parameters (both hellos), and each role proves under its own label (a
//! reflected one fails). Without a secret (`TCPX_P2P_AUTH_TOKEN` unset)
//! the proofs use an empty key: they prove nothing, and anyone who can
//! reach the port may connect.

use std::io::{self, Read, Write};
use std::net::IpAddr;
use std::time::Instant;

use crate::ctl::Ctl;
use crate::net::{HandleTarget, ListenComm, Net, NetHandle};
/// The proofs and nonces are the protocol's, defined with its byte formats.
pub(crate) use crate::wire::auth::{local_auth, nonce, proof, verify, Role};
use crate::wire::{self, HandshakeMsg, Hello};

/// What both sides use once the hellos are exchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Agreed {
    pub channels: usize,
    pub chunk: usize,
}

/// Why a handshake was refused (by us).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    #[error("net mismatch: we use {ours:?}, the peer uses {theirs:?}")]
    Net { ours: String, theirs: String },
    #[error(
        "the peer answered {channels} channels of {chunk}-byte chunks to our proposal of \
         {asked_channels} of {asked_chunk} (an answer may only lower them)"
    )]
    Answer {
        channels: usize,
        chunk: usize,
        asked_channels: usize,
        asked_chunk: usize,
    },
    #[error(
        "authentication failed: the peer's proof does not match (its TCPX_P2P_AUTH_TOKEN \
         differs from ours, or the proof was replayed)"
    )]
    Auth,
    #[error("the peer sent {got} listen handles for {channels} channels (expected {})", 2 * channels)]
    HandleCount { got: usize, channels: usize },
    #[error("listen handle {index} is malformed: {reason}")]
    BadHandle { index: usize, reason: String },
    #[error("listen handle {index} points at {addr}, not at the peer's host {peer}")]
    HandleAddr {
        index: usize,
        addr: std::net::SocketAddr,
        peer: IpAddr,
    },
    #[error(
        "the peer's listen handles ask for {asked} TCP connections, more than the limit of \
         {max} (TCPX_P2P_MAX_PEER_STREAMS)"
    )]
    TooManyConnections { asked: usize, max: usize },
    #[error("the endpoint has no room for this connection: {0}")]
    NoRoom(String),
}

/// The pure negotiation. The acceptor answers with the lower of both sides'
/// channels and chunk; the initiator accepts an answer that lowers its
/// proposal, never one that raises it. Both use the answer.
pub fn negotiate(role: Role, mine: &Hello, theirs: &Hello) -> Result<Agreed, Refusal> {
    if mine.net != theirs.net {
        return Err(Refusal::Net {
            ours: mine.net.clone(),
            theirs: theirs.net.clone(),
        });
    }
    match role {
        Role::Acceptor => Ok(Agreed {
            channels: mine.channels.min(theirs.channels) as usize,
            chunk: mine.chunk.min(theirs.chunk) as usize,
        }),
        Role::Initiator => {
            if theirs.channels > mine.channels || theirs.chunk > mine.chunk {
                return Err(Refusal::Answer {
                    channels: theirs.channels as usize,
                    chunk: theirs.chunk as usize,
                    asked_channels: mine.channels as usize,
                    asked_chunk: mine.chunk as usize,
                });
            }
            Ok(Agreed {
                channels: theirs.channels as usize,
                chunk: theirs.chunk as usize,
            })
        }
    }
}

/// Whether two addresses are the same host: equal (IPv4-mapped IPv6 seen
/// as IPv4), or both loopback.
pub fn same_host(a: IpAddr, b: IpAddr) -> bool {
    let canon = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let (a, b) = (canon(a), canon(b));
    a == b || (a.is_loopback() && b.is_loopback())
}

/// Checks the peer's listen handles before anything is dialed: as many as
/// the channels need, each pointing at the peer's own host (where the net
/// can tell), and no more TCP connections in all than `max_connections`.
/// Returns how many TCP connections dialing them opens (a handle whose
/// net cannot tell counts as one).
pub fn check_handles(
    peer: IpAddr,
    channels: usize,
    targets: &[Result<Option<HandleTarget>, String>],
    max_connections: usize,
) -> Result<usize, Refusal> {
    if targets.len() != 2 * channels {
        return Err(Refusal::HandleCount {
            got: targets.len(),
            channels,
        });
    }
    let mut asked = 0usize;
    for (index, t) in targets.iter().enumerate() {
        match t {
            Err(reason) => {
                return Err(Refusal::BadHandle {
                    index,
                    reason: reason.clone(),
                })
            }
            Ok(None) => asked = asked.saturating_add(1),
            Ok(Some(t)) => {
                if !same_host(t.addr.ip(), peer) {
                    return Err(Refusal::HandleAddr {
                        index,
                        addr: t.addr,
                        peer,
                    });
                }
                asked = asked.saturating_add(t.connections);
            }
        }
    }
    if asked > max_connections {
        return Err(Refusal::TooManyConnections {
            asked,
            max: max_connections,
        });
    }
    Ok(asked)
}

// ------------------------------------------------------------------ I/O

fn timed_out(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("{what}: the handshake's deadline passed (TCPX_P2P_CONNECT_TIMEOUT_MS)"),
    )
}

/// Fills `buf` by `deadline`: the deadline covers the whole read, however
/// slowly the peer trickles bytes.
pub(crate) fn read_exact_by(s: &mut Ctl, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out("reading"));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[at..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(timed_out("reading"))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one length-prefixed frame of at most `max` bytes by `deadline`.
pub(crate) fn read_frame_by(s: &mut Ctl, max: usize, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact_by(s, &mut len, deadline)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("handshake frame of {n} bytes exceeds the limit of {max}"),
        ));
    }
    let mut b = vec![0u8; n];
    read_exact_by(s, &mut b, deadline)?;
    Ok(b)
}

/// Writes one length-prefixed frame by `deadline`.
pub(crate) fn write_frame_by(s: &mut Ctl, body: &[u8], deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(timed_out("writing"));
    }
    s.set_write_timeout(Some(left))?;
    s.write_all(&wire::frame_with(|v| v.extend_from_slice(body)))
}

/// What our side brings to a handshake.
pub(crate) struct Local<'a> {
    pub net: &'a dyn Net,
    /// Our hello's values (the initiator's proposal, the acceptor's limits).
    pub gpu_index: i32,
    pub gpu_bdf: &'a str,
    pub channels: usize,
    pub chunk: usize,
    /// The shared secret (empty: none).
    pub key: &'a [u8],
    /// Most TCP connections the peer's handles may ask us to open.
    pub max_connections: usize,
    /// Net device of listen i.
    pub device: &'a dyn Fn(usize, usize) -> usize,
    /// What an accepting endpoint asks of the handshake (None: we connect).
    pub gate: Option<&'a Gate<'a>>,
}

/// Something held while a connection lives (dropping it gives it back).
pub(crate) type Held = Box<dyn std::any::Any + Send>;

/// What an accepting endpoint asks of a handshake beyond the protocol.
pub(crate) struct Gate<'a> {
    /// The peer must have proven the secret by then (None: no earlier
    /// deadline than the handshake's own).
    pub preauth: Option<Instant>,
    /// Called once the peer has proven the secret.
    pub proven: &'a dyn Fn(),
    /// Room for a connection holding this many net connections (those we
    /// dial and those we accept), or why there is none.
    pub admit: &'a dyn Fn(usize) -> Result<Held, String>,
}

/// A finished handshake: what was agreed, the peer's hello, our listens and
/// the peer's (checked) handles.
pub(crate) struct Shaken {
    pub agreed: Agreed,
    pub theirs: Hello,
    pub listens: Vec<Box<dyn ListenComm>>,
    pub handles: Vec<NetHandle>,
    /// The room the gate gave this connection (None without a gate).
    pub room: Option<Held>,
}

/// Why a handshake failed: ours to tell the peer, or an I/O or format
/// problem, or the peer's refusal.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Failed {
    #[error("{0}")]
    Refused(#[from] Refusal),
    #[error("the peer refused the handshake: {0}")]
    PeerRefused(String),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("bad handshake: {0}")]
    Wire(#[from] crate::error::WireError),
    #[error("net listen (device {dev}): {source}")]
    Listen {
        dev: usize,
        #[source]
        source: crate::error::NetError,
    },
}

/// Runs the whole handshake on `oob` by `deadline`.
pub(crate) fn run(
    oob: &mut Ctl,
    role: Role,
    me: &Local<'_>,
    deadline: Instant,
) -> Result<Shaken, Failed> {
    let peer = oob
        .peer_addr()
        .map_err(|source| Failed::Io {
            what: "control connection",
            source,
        })?
        .ip();
    let res = exchange(oob, role, peer, me, deadline);
    if let Err(e @ (Failed::Refused(_) | Failed::Wire(_))) = &res {
        // Tell the peer why (best effort; it may be gone).
        let mut v = Vec::new();
        HandshakeMsg::Refuse(e.to_string()).encode(&mut v);
        let _ = write_frame_by(oob, &v, deadline);
    }
    res
}

fn exchange(
    oob: &mut Ctl,
    role: Role,
    peer: IpAddr,
    me: &Local<'_>,
    deadline: Instant,
) -> Result<Shaken, Failed> {
    let io = |what: &'static str| move |source| Failed::Io { what, source };
    // Until the peer has proven the secret, an accepting side keeps an
    // earlier deadline (a silent peer must not hold its place long).
    let proven = std::cell::Cell::new(false);
    let by = || match me.gate.and_then(|g| g.preauth) {
        Some(p) if !proven.get() => p.min(deadline),
        _ => deadline,
    };
    let send = |oob: &mut Ctl, body: &[u8]| {
        write_frame_by(oob, body, by()).map_err(io("sending the handshake"))
    };
    let recv = |oob: &mut Ctl| -> Result<Vec<u8>, Failed> {
        read_frame_by(oob, wire::MAX_HANDSHAKE_FRAME, by()).map_err(io("reading the handshake"))
    };
    // A later frame: a refusal from the peer ends the handshake.
    let recv_msg = |oob: &mut Ctl| -> Result<HandshakeMsg, Failed> {
        match HandshakeMsg::decode(&recv(oob)?)? {
            HandshakeMsg::Refuse(why) => Err(Failed::PeerRefused(why)),
            m => Ok(m),
        }
    };
    let recv_hello = |oob: &mut Ctl| -> Result<(Hello, Vec<u8>), Failed> {
        let b = recv(oob)?;
        if b.first() == Some(&0) {
            if let Ok(HandshakeMsg::Refuse(why)) = HandshakeMsg::decode(&b) {
                return Err(Failed::PeerRefused(why));
            }
        }
        let h = Hello::decode(&b)?;
        Ok((h, b))
    };
    let nonce = nonce().map_err(io("drawing a nonce"))?;
    let offer = Hello {
        version: wire::VERSION,
        gpu_index: me.gpu_index,
        gpu_bdf: me.gpu_bdf.to_string(),
        net: me.net.name().to_string(),
        channels: me.channels.clamp(1, wire::MAX_CHANNELS as usize) as u8,
        chunk: me.chunk.clamp(4096, 1 << 30) as u64,
        nonce,
    };
    let encode = |h: &Hello| {
        let mut v = Vec::new();
        h.encode(&mut v);
        v
    };
    let (agreed, theirs, i_bytes, a_bytes) = match role {
        Role::Initiator => {
            let mine = encode(&offer);
            send(oob, &mine)?;
            let (theirs, tb) = recv_hello(oob)?;
            let agreed = negotiate(role, &offer, &theirs)?;
            (agreed, theirs, mine, tb)
        }
        Role::Acceptor => {
            let (theirs, tb) = recv_hello(oob)?;
            let agreed = negotiate(role, &offer, &theirs)?;
            let answer = Hello {
                channels: agreed.channels as u8,
                chunk: agreed.chunk as u64,
                ..offer
            };
            let mine = encode(&answer);
            send(oob, &mine)?;
            (agreed, theirs, tb, mine)
        }
    };
    // Proofs: the initiator proves first; the acceptor answers only a
    // correct proof.
    let other = match role {
        Role::Initiator => Role::Acceptor,
        Role::Acceptor => Role::Initiator,
    };
    let send_proof = |oob: &mut Ctl| {
        let mut v = Vec::new();
        HandshakeMsg::Proof(proof(me.key, role, &i_bytes, &a_bytes)).encode(&mut v);
        send(oob, &v)
    };
    let check_proof = |oob: &mut Ctl| -> Result<(), Failed> {
        match recv_msg(oob)? {
            HandshakeMsg::Proof(p) if verify(me.key, other, &i_bytes, &a_bytes, &p) => Ok(()),
            _ => Err(Refusal::Auth.into()),
        }
    };
    if role == Role::Initiator {
        send_proof(oob)?;
        check_proof(oob)?;
    } else {
        check_proof(oob)?;
        proven.set(true);
        if let Some(g) = me.gate {
            (g.proven)();
        }
        send_proof(oob)?;
    }
    // Authenticated: only now listen, and dial only checked handles.
    let listen_all = || {
        (0..2 * agreed.channels)
            .map(|i| {
                let dev = (me.device)(i, agreed.channels);
                me.net
                    .listen(dev)
                    .map_err(|source| Failed::Listen { dev, source })
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let send_handles = |oob: &mut Ctl, listens: &[Box<dyn ListenComm>]| {
        let mut v = Vec::new();
        HandshakeMsg::Handles(listens.iter().map(|l| l.handle()).collect()).encode(&mut v);
        send(oob, &v)
    };
    let recv_handles = |oob: &mut Ctl| -> Result<(Vec<NetHandle>, usize), Failed> {
        let handles = match recv_msg(oob)? {
            HandshakeMsg::Handles(h) => h,
            _ => {
                return Err(Refusal::HandleCount {
                    got: 0,
                    channels: agreed.channels,
                }
                .into())
            }
        };
        let targets: Vec<_> = handles
            .iter()
            .map(|h| me.net.handle_target(h).map_err(|e| e.to_string()))
            .collect();
        let asked = check_handles(peer, agreed.channels, &targets, me.max_connections)?;
        Ok((handles, asked))
    };
    let (listens, handles, room) = match me.gate {
        // We connected: both send first, then read (the acceptor answers
        // only once it has checked ours).
        None => {
            let listens = listen_all()?;
            send_handles(oob, &listens)?;
            let (handles, _) = recv_handles(oob)?;
            (listens, handles, None)
        }
        // Accepting: check the peer's handles and find room for all the
        // connection will hold before listening or answering, so that a
        // refusal is the answer the peer reads.
        Some(g) => {
            let (handles, asked) = recv_handles(oob)?;
            let listens = listen_all()?;
            let ours: usize = listens
                .iter()
                .map(|l| match me.net.handle_target(&l.handle()) {
                    Ok(Some(t)) => t.connections,
                    _ => 1,
                })
                .sum();
            let room = (g.admit)(asked.saturating_add(ours)).map_err(Refusal::NoRoom)?;
            send_handles(oob, &listens)?;
            (listens, handles, Some(room))
        }
    };
    Ok(Shaken {
        agreed,
        theirs,
        listens,
        handles,
        room,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::NONCE_LEN;
    use std::net::SocketAddr;

    fn hello(channels: u8, chunk: u64, net: &str) -> Hello {
        Hello {
            version: wire::VERSION,
            gpu_index: 0,
            gpu_bdf: String::new(),
            net: net.into(),
            channels,
            chunk,
            nonce: [1; NONCE_LEN],
        }
    }

    #[test]
    fn the_answer_lowers_never_raises() {
        let a = negotiate(
            Role::Acceptor,
            &hello(4, 1 << 20, "socket"),
            &hello(8, 1 << 22, "socket"),
        );
        assert_eq!(
            a,
            Ok(Agreed {
                channels: 4,
                chunk: 1 << 20
            })
        );
        let a = negotiate(
            Role::Acceptor,
            &hello(32, 1 << 23, "socket"),
            &hello(2, 1 << 20, "socket"),
        );
        assert_eq!(
            a,
            Ok(Agreed {
                channels: 2,
                chunk: 1 << 20
            })
        );
        // The initiator takes a lower answer, refuses a higher one.
        let i = negotiate(
            Role::Initiator,
            &hello(8, 1 << 22, "socket"),
            &hello(4, 1 << 20, "socket"),
        );
        assert_eq!(
            i,
            Ok(Agreed {
                channels: 4,
                chunk: 1 << 20
            })
        );
        assert!(matches!(
            negotiate(
                Role::Initiator,
                &hello(2, 1 << 20, "socket"),
                &hello(32, 1 << 20, "socket")
            ),
            Err(Refusal::Answer { .. })
        ));
        assert!(matches!(
            negotiate(
                Role::Initiator,
                &hello(2, 1 << 20, "socket"),
                &hello(2, 1 << 21, "socket")
            ),
            Err(Refusal::Answer { .. })
        ));
        assert!(matches!(
            negotiate(
                Role::Acceptor,
                &hello(2, 1 << 20, "socket"),
                &hello(2, 1 << 20, "tcpx")
            ),
            Err(Refusal::Net { .. })
        ));
    }

    #[test]
    fn proofs_bind_secret_role_and_both_hellos() {
        let (i, a) = (b"hello-i".as_slice(), b"hello-a".as_slice());
        let p = proof(b"secret", Role::Initiator, i, a);
        assert!(verify(b"secret", Role::Initiator, i, a, &p));
        assert!(
            !verify(b"Secret", Role::Initiator, i, a, &p),
            "other secret"
        );
        assert!(!verify(b"secret", Role::Acceptor, i, a, &p), "reflected");
        assert!(
            !verify(b"secret", Role::Initiator, b"hello-j", a, &p),
            "other nonce"
        );
        assert!(
            !verify(b"secret", Role::Initiator, i, b"hello-b", &p),
            "replayed"
        );
        // Length prefixes: moving a byte between the hellos changes the proof.
        assert_ne!(
            proof(b"k", Role::Initiator, b"ab", b"c"),
            proof(b"k", Role::Initiator, b"a", b"bc")
        );
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn handles_must_point_at_the_peer_and_stay_few() {
        let at = |s: &str, c| {
            Ok(Some(HandleTarget {
                addr: s.parse::<SocketAddr>().unwrap(),
                connections: c,
            }))
        };
        let peer: IpAddr = "10.0.0.2".parse().unwrap();
        let ok = vec![at("10.0.0.2:5000", 8), at("10.0.0.2:5001", 8)];
        assert_eq!(check_handles(peer, 1, &ok, 16), Ok(16));
        assert!(matches!(
            check_handles(peer, 1, &ok, 15),
            Err(Refusal::TooManyConnections { asked: 16, max: 15 })
        ));
        assert!(matches!(
            check_handles(peer, 2, &ok, 64),
            Err(Refusal::HandleCount { .. })
        ));
        let elsewhere = vec![at("10.0.0.2:5000", 8), at("10.0.0.3:5001", 8)];
        assert!(matches!(
            check_handles(peer, 1, &elsewhere, 64),
            Err(Refusal::HandleAddr { index: 1, .. })
        ));
        // Loopback is one host; an IPv4-mapped address is its IPv4 address.
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(
            check_handles(lo, 1, &[at("127.0.0.5:1", 1), at("[::1]:2", 1)], 8),
            Ok(2)
        );
        assert_eq!(
            check_handles(
                peer,
                1,
                &[at("[::ffff:10.0.0.2]:1", 1), at("10.0.0.2:2", 1)],
                8
            ),
            Ok(2)
        );
        assert!(matches!(
            check_handles(lo, 1, &[at("10.0.0.2:1", 1), at("127.0.0.1:2", 1)], 8),
            Err(Refusal::HandleAddr { .. })
        ));
        // Opaque handles count one connection each; malformed ones are refused.
        assert_eq!(check_handles(peer, 1, &[Ok(None), Ok(None)], 2), Ok(2));
        assert!(matches!(
            check_handles(peer, 1, &[Ok(None), Err("magic".into())], 2),
            Err(Refusal::BadHandle { index: 1, .. })
        ));
    }
}
