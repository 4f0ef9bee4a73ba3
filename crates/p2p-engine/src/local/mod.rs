//! Same-host connections: `connect_local` / `accept_local` between
//! endpoints of one machine. Such a connection is an ordinary connection
//! of the engine whose control connection is a Unix stream and whose data
//! rides the same-host net (`crate::net::same_host`: cross-memory attach
//! for host memory, CUDA IPC for GPU memory). This module finds the peer
//! and checks it before the engine's handshake runs.
//!
//! **Finding the peer.** Every endpoint listens on abstract Unix sockets
//! named from its identity and our uid: `tcpx-p2p-local:<uid>:<ip>:<port>`
//! (its control address, so a peer's metadata names it exactly), and, when
//! the name is free, `…:gpu:<index>` and `…:bdf:<pci bus id>` (UCCL's
//! `connect_local(remote_gpu_bdf)`; with several endpoints on one GPU the
//! first one owns these two, so such callers connect by metadata).
//!
//! **The hello.** Before the engine's handshake: both sides read the
//! other's uid and pid from the kernel (`SO_PEERCRED`), never from the
//! peer's bytes; another uid is refused unless `TCPX_P2P_LOCAL_ANY_UID=1`,
//! and a listener of another uid always (a squatter of our name). Each
//! side pins the other's process, then they exchange magic, version, the
//! digest of `TCPX_P2P_AUTH_TOKEN`, GPU and a random endpoint identity (a
//! connection to itself is refused). Then the engine's own handshake runs
//! on the same stream (with its challenge and response), and the
//! same-host net's channels check the peer process again each.
//!
//! **Trust.** CUDA IPC maps the exporter's whole allocation into the
//! importer, and cross-memory attach needs ptrace rights over the peer: a
//! same-host peer of our uid could read or write far more than it was
//! advertised with. The records keep honest peers (and stale or forged
//! descriptors) to the advertised ranges; they do not contain a hostile
//! process of the same uid. Same host means same trust.

mod hub;
use crate::net::same_host::os;

use std::collections::VecDeque;
use std::io::ErrorKind;
use std::net::IpAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::conn::{read_frame, write_frame};
use crate::error::{Error, Result};
use tcpx_p2p_wire::same_host::{LocalHello, LOCAL_VERSION};

/// What the endpoint gives its hub.
pub(crate) struct HubParams {
    pub auth: u64,
    pub gpu_index: i32,
    pub gpu_bdf: String,
    pub timeout: Duration,
    pub ip: IpAddr,
    pub port: u16,
    /// Same-host handshakes in progress at most (`TCPX_P2P_MAX_HANDSHAKES`).
    pub max_handshakes: usize,
    /// The endpoint's I/O workers: the listeners wait for connections on
    /// them, holding no thread.
    pub workers: crate::workers::Workers,
}

/// Makes a checked Unix stream a connection of the endpoint (the engine's
/// handshake on it, `initiator` for the side that dialed): its id, or why
/// not.
pub(crate) type Establish = dyn Fn(UnixStream, bool) -> Result<u64> + Send + Sync;

/// Which endpoint on this host `connect_local` means.
#[derive(Debug, Clone)]
pub enum LocalPeer {
    /// The endpoint of this GPU index.
    Index(i32),
    /// The endpoint of the GPU with this PCI bus id.
    Bdf(String),
    /// The endpoint whose `get_metadata()` this is.
    Metadata(Vec<u8>),
}

/// A local connection accepted from a peer.
#[derive(Debug, Clone)]
pub struct AcceptedLocal {
    pub conn: u64,
    pub gpu_index: i32,
    pub gpu_bdf: String,
}

/// `0000:4a:00.0`, lower case, with a four-digit domain.
fn normalize_bdf(bdf: &str) -> String {
    let b = bdf.trim().to_ascii_lowercase();
    let parts: Vec<&str> = b.split(':').collect();
    match parts.as_slice() {
        [bus, devfn] => format!("0000:{bus}:{devfn}"),
        [dom, bus, devfn] => {
            let d = u32::from_str_radix(dom, 16).unwrap_or(0);
            format!("{d:04x}:{bus}:{devfn}")
        }
        _ => b,
    }
}

fn prefix() -> String {
    format!("tcpx-p2p-local:{}", os::my_uid())
}

fn name_of(peer: &LocalPeer) -> Result<String> {
    Ok(match peer {
        LocalPeer::Index(i) => format!("{}:gpu:{i}", prefix()),
        LocalPeer::Bdf(b) => match b.trim().parse::<i32>() {
            Ok(i) => format!("{}:gpu:{i}", prefix()),
            Err(_) => format!("{}:bdf:{}", prefix(), normalize_bdf(b)),
        },
        LocalPeer::Metadata(m) => {
            let m = crate::wire::Metadata::decode(m)?;
            format!("{}:{}:{}", prefix(), m.ip, m.port)
        }
    })
}

/// This endpoint's same-host listeners, and the connections they accepted
/// not yet taken by `accept_local`.
pub(crate) struct Hub {
    p: HubParams,
    nonce: u64,
    /// Set once the endpoint exists (see [`Establish`]).
    establish: OnceLock<Box<Establish>>,
    accepted: Mutex<VecDeque<AcceptedLocal>>,
    accepted_cv: Condvar,
    stopping: AtomicBool,
    names: Vec<String>,
    /// The listeners' tasks on the I/O workers.
    acceptors: Mutex<Vec<Arc<crate::workers::Home>>>,
    /// Same-host handshakes in progress.
    handshaking: AtomicU64,
}

/// What the peer said in its hello.
pub(crate) struct PeerHello {
    pub gpu_index: i32,
    pub gpu_bdf: String,
}

/// The same-host hello on a fresh stream (see the module's text): the
/// peer's identity checked and its process pinned, then the exchange.
fn hello(s: &mut UnixStream, initiator: bool, hub: &Hub) -> Result<PeerHello> {
    let cerr = |reason: String| Error::Connect {
        peer: "same-host peer".into(),
        reason,
    };
    let cred = os::peer_cred(s).map_err(|e| Error::io("SO_PEERCRED", e))?;
    // The names we dial carry our uid: the listener must run as it,
    // whatever TCPX_P2P_LOCAL_ANY_UID says. Any process can bind an
    // abstract name first; this way such a squatter is refused, never
    // spoken to.
    if initiator && cred.uid != os::my_uid() {
        return Err(cerr(format!(
            "the process listening on our same-host name (pid {}) runs as uid {}, not ours \
             ({}): another user took the name; refused",
            cred.pid,
            cred.uid,
            os::my_uid()
        )));
    }
    let any_uid = std::env::var("TCPX_P2P_LOCAL_ANY_UID").is_ok_and(|v| v == "1");
    if cred.uid != os::my_uid() && !any_uid {
        return Err(cerr(format!(
            "peer process {} runs as uid {}, not ours ({}); set TCPX_P2P_LOCAL_ANY_UID=1 to allow it",
            cred.pid,
            cred.uid,
            os::my_uid()
        )));
    }
    // Pin the peer to its process. A peer of another uid gets no more
    // than it could do itself: its process must be one its uid could
    // attach to, and our copies reach only the address space it had
    // now (an exec, setuid or not, leaves them nothing). Pinned before
    // our hello goes out: the peer cannot have finished its handshake.
    let other_uid = cred.uid != os::my_uid();
    let peer = os::PeerProcess::pin(s, &cred, other_uid)
        .map_err(|e| cerr(format!("pinning peer process {}: {e}", cred.pid)))?;
    if other_uid && !peer.ident.reachable_by(cred.uid, cred.gid) {
        return Err(cerr(format!(
            "peer process {} of uid {} is not one that uid could attach to itself ({:?}: \
             setuid or not dumpable)",
            cred.pid, cred.uid, peer.ident
        )));
    }
    s.set_read_timeout(Some(hub.p.timeout))
        .map_err(|e| Error::io("same-host socket", e))?;
    let mine = LocalHello {
        version: LOCAL_VERSION,
        auth: hub.p.auth,
        gpu_index: hub.p.gpu_index,
        gpu_bdf: hub.p.gpu_bdf.clone(),
        nonce: hub.nonce,
    };
    let send = |s: &mut UnixStream| {
        let mut v = Vec::new();
        mine.encode(&mut v);
        write_frame(s, &v).map_err(|e| cerr(format!("sending the handshake: {e}")))
    };
    let recv = |s: &mut UnixStream| -> Result<LocalHello> {
        let b = read_frame(s, 256).map_err(|e| cerr(format!("reading the handshake: {e}")))?;
        if b.len() == 1 {
            return Err(cerr(
                "the peer refused the handshake (auth token or version mismatch; see its log)"
                    .into(),
            ));
        }
        let h = LocalHello::decode(&b).map_err(|e| {
            let _ = write_frame(s, &[0]);
            cerr(format!("bad handshake: {e}"))
        })?;
        if h.auth != hub.p.auth {
            let _ = write_frame(s, &[0]);
            return Err(cerr(
                "authentication failed: the peer's TCPX_P2P_AUTH_TOKEN differs from ours".into(),
            ));
        }
        if h.nonce == hub.nonce {
            let _ = write_frame(s, &[0]);
            return Err(cerr("connect_local reached this endpoint itself".into()));
        }
        Ok(h)
    };
    let theirs = if initiator {
        send(s)?;
        recv(s)?
    } else {
        let h = recv(s)?;
        send(s)?;
        h
    };
    s.set_read_timeout(None)
        .map_err(|e| Error::io("same-host socket", e))?;
    os::allow_peer(cred.pid);
    tracing::info!(
        peer_pid = cred.pid,
        gpu = theirs.gpu_index,
        "same-host hello"
    );
    Ok(PeerHello {
        gpu_index: theirs.gpu_index,
        gpu_bdf: theirs.gpu_bdf,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bdf_forms() {
        assert_eq!(normalize_bdf("0000:4A:00.0"), "0000:4a:00.0");
        assert_eq!(normalize_bdf("4a:00.0"), "0000:4a:00.0");
        assert_eq!(normalize_bdf("00000000:4a:00.0"), "0000:4a:00.0");
        let a = name_of(&LocalPeer::Bdf("00000000:4A:00.0".into())).unwrap();
        let b = name_of(&LocalPeer::Bdf("4a:00.0".into())).unwrap();
        assert_eq!(a, b);
        let i = name_of(&LocalPeer::Bdf("3".into())).unwrap();
        assert_eq!(i, name_of(&LocalPeer::Index(3)).unwrap());
        assert!(name_of(&LocalPeer::Metadata(vec![1, 2])).is_err());
    }
}
