//! The seam between the engine and a transport, in ncclNet's terms: devices
//! with properties, listen / connect / accept (resumable), memory
//! registration per comm, posted sends and receives completed by `test`.
//! The engine above is written once over [`Net`]; `socket` is our own
//! multi-stream TCP transport, `plugin` drives any ncclNet plugin.
//!
//! ## One data path per connection
//!
//! The endpoint does not fix the net: each connection picks its data path
//! when it is made, through the endpoint's [`DataPaths`], from what it knows
//! of its peer then ([`PeerInfo`]: the addresses of its control
//! connection). [`OneNet`] -- every connection on the endpoint's one net --
//! is the default. A further path is one more [`Net`] implementation beside
//! `socket` and `plugin`, and a [`DataPaths`] that returns it for the
//! peers it serves; nothing in the existing nets changes. `same_host` is
//! one (cross-memory attach and CUDA IPC), returned by [`SameHostPaths`]
//! for connections between endpoints of one machine
//! (`TCPX_P2P_SAME_HOST_NET=1`), and the data path of every same-host
//! connection (`connect_local`), which names it directly. Both sides must
//! pick nets of the same name: the connection handshake names the net and
//! refuses a mismatch.

use std::sync::Arc;

use crate::error::NetError;
use crate::memory::MemKind;
pub use crate::wire::NET_HANDLE_LEN;

pub(crate) mod plugin;
pub(crate) mod same_host;
pub(crate) mod socket;

/// The ncclNet plugin loader (a transport over any ncclNet plugin).
pub use plugin::PluginNet;
/// The same-host net (cross-memory attach and CUDA IPC) and its settings.
pub use same_host::{SameHostConfig, SameHostNet, SameHostPaths};
/// The socket net (multi-stream TCP) and its settings.
pub use socket::{SocketConfig, SocketNet};
/// The I/O threads' time accounts (shared with the ncclNet stand-in).
pub(crate) use tcpx_p2p_timing as timing;

/// What a connection knows of its peer when its data path is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's end of the control connection.
    pub peer: std::net::SocketAddr,
    /// Our end of it.
    pub local: std::net::SocketAddr,
}

/// Chooses, per connection, the net its data rides (see the module doc).
pub trait DataPaths: Send + Sync {
    /// The endpoint's own net: its name and devices describe the endpoint.
    fn default_net(&self) -> &Arc<dyn Net>;
    /// The net for a connection to `peer` (the default unless a path
    /// serves that peer better).
    fn choose(&self, peer: &PeerInfo) -> Arc<dyn Net> {
        let _ = peer;
        self.default_net().clone()
    }
}

/// Every connection on one net.
pub struct OneNet(pub Arc<dyn Net>);

impl DataPaths for OneNet {
    fn default_net(&self) -> &Arc<dyn Net> {
        &self.0
    }
}

/// The opaque handle `listen` writes and the peer passes to `connect`.
pub type NetHandle = [u8; NET_HANDLE_LEN];

/// Called by a transport's own threads when a request may have completed, so
/// that the engine's progress thread wakes without polling.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

pub use crate::topo::DeviceProps;

/// Memory a request reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemRef {
    pub addr: u64,
    pub len: usize,
    pub kind: MemKind,
}

/// A registration of memory with one comm (opaque to the engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrHandle(pub usize);

/// A posted request (opaque to the engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReqId(pub u64);

fn gather_unsupported(n: usize) -> NetError {
    NetError::Misuse {
        net: "net",
        reason: format!("a request of {n} segments on a net that takes one buffer per request"),
    }
}

/// A transport.
pub trait Net: Send + Sync {
    /// Short name, e.g. `socket` or the plugin's name.
    fn name(&self) -> &str;
    fn devices(&self) -> Vec<DeviceProps>;
    /// Starts listening on device `dev`; the handle goes to the peer.
    fn listen(&self, dev: usize) -> Result<Box<dyn ListenComm>, NetError>;
    /// Connects to a peer's listen handle. May return `Ok(None)`: call again
    /// with the same handle until it returns a comm.
    fn connect(
        &self,
        dev: usize,
        handle: &NetHandle,
        waker: Waker,
    ) -> Result<Option<Box<dyn SendComm>>, NetError>;
    /// True when requests progress only inside `test` (the engine then polls
    /// continuously); false when the transport calls the [`Waker`].
    fn needs_polling(&self) -> bool;
    /// Whether a request may be reported done (by `test`) before older
    /// ones: the engine then frees a full window's slots out of order when
    /// its oldest request stalls. ncclNet plugins complete receives in
    /// posting order (TCPX's unpack slots are FIFO): false.
    fn completes_out_of_order(&self) -> bool {
        false
    }
    /// Most requests one comm may have in flight (ncclNet plugins: 16).
    fn max_requests(&self) -> usize {
        16
    }
    /// Largest message one request may carry (TCPX: 4 MiB per receive).
    fn max_message(&self) -> usize {
        usize::MAX
    }
    /// The request size a connection on this net should cut transfers
    /// into, where the endpoint's (`TCPX_P2P_CHUNK`, sized for the
    /// endpoint's net) would cost it: None keeps the endpoint's.
    fn preferred_chunk(&self) -> Option<usize> {
        None
    }
    /// Most memory segments one request may gather (send) or scatter
    /// (receive): many small blocks then cost one request, not one each.
    /// Nets that take one buffer per request (ncclNet plugins) keep 1.
    fn max_segments(&self) -> usize {
        1
    }
    /// Where connecting to a peer's listen handle would dial, and how many
    /// TCP connections it would open: the engine refuses handles that point
    /// anywhere but the peer, or ask for too many connections. None: this
    /// net's handles are opaque (ncclNet plugins), nothing can be checked.
    fn handle_target(&self, _handle: &NetHandle) -> Result<Option<HandleTarget>, NetError> {
        Ok(None)
    }
    /// The one-sided path: how the peer's receive comm may copy `mem`
    /// straight out of our memory ([`RecvComm::ipull`]), with no send of
    /// ours: the target of our write, or the reader of a read we grant.
    /// The bytes travel to the peer (at most
    /// [`crate::wire::MAX_PULL_KEY`]). None: this net has no such path, or
    /// not for this memory (the engine then sends the data). A key lets the
    /// peer read our memory; it writes through one ([`SendComm::ipush`])
    /// only where the engine leased it for writes: a record that lives as
    /// long as the connection, never a transfer's buffer (a copy into
    /// memory of a peer that gave the transfer up could land in memory it
    /// has let go).
    fn export(&self, _mem: MemRef) -> Option<Vec<u8>> {
        None
    }
    /// Whether this net's receive comms pull ([`RecvComm::ipull`]): on a
    /// connection over it, writes are pulled by their target and reads by
    /// their reader.
    fn pulls(&self) -> bool {
        false
    }
}

/// A piece of the peer's memory a pull copies from:
/// `len` bytes at `off` in a range the peer exported ([`Net::export`], its bytes in `key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteRef {
    pub key: Arc<[u8]>,
    pub off: u64,
    pub len: u64,
}

/// What a listen handle asks its connector to dial (see [`Net::handle_target`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandleTarget {
    pub addr: std::net::SocketAddr,
    /// TCP connections one `connect` to the handle opens.
    pub connections: usize,
}

pub trait ListenComm: Send {
    fn handle(&self) -> NetHandle;
    /// Accepts the peer's connection. May return `Ok(None)`: call again.
    fn accept(&mut self, waker: Waker) -> Result<Option<Box<dyn RecvComm>>, NetError>;
}

pub trait SendComm: Send {
    /// Registers `mem` for this comm's sends. The default is for a net
    /// that needs no registration (the socket and same-host nets): a
    /// handle that names nothing.
    fn reg_mr(&mut self, _mem: MemRef) -> Result<MrHandle, NetError> {
        Ok(MrHandle(0))
    }
    fn dereg_mr(&mut self, _mr: MrHandle) -> Result<(), NetError> {
        Ok(())
    }
    /// Posts a send. `Ok(None)`: the transport cannot take it now; retry later.
    fn isend(&mut self, mem: MemRef, mr: MrHandle) -> Result<Option<ReqId>, NetError>;
    /// Posts one message gathered from `segs` in order (`mrs[i]` registers
    /// `segs[i]`); at most [`Net::max_segments`] segments.
    fn isendv(&mut self, segs: &[MemRef], mrs: &[MrHandle]) -> Result<Option<ReqId>, NetError> {
        match (segs, mrs) {
            ([m], [mr]) => self.isend(*m, *mr),
            _ => Err(gather_unsupported(segs.len())),
        }
    }
    /// Posts a push: `segs` copied by this side into the pieces of the
    /// peer's memory `dst` (ranges it exported and leased for writes, in
    /// order), with no receive posted by the peer; tested as a send. The
    /// pieces must cover `segs` exactly. Nets without a one-sided path
    /// refuse it.
    fn ipush(&mut self, segs: &[MemRef], dst: &[RemoteRef]) -> Result<Option<ReqId>, NetError> {
        let _ = (segs, dst);
        Err(NetError::Misuse {
            net: "net",
            reason: "a push on a net without a one-sided path".into(),
        })
    }
    /// `Some(bytes)` once the request is done. Call only on the oldest
    /// request not yet completed on this comm.
    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError>;
}

pub trait RecvComm: Send {
    /// As [`SendComm::reg_mr`], for this comm's receives.
    fn reg_mr(&mut self, _mem: MemRef) -> Result<MrHandle, NetError> {
        Ok(MrHandle(0))
    }
    fn dereg_mr(&mut self, _mr: MrHandle) -> Result<(), NetError> {
        Ok(())
    }
    /// Posts a receive of at most `mem.len` bytes into `mem`.
    fn irecv(&mut self, mem: MemRef, mr: MrHandle) -> Result<Option<ReqId>, NetError>;
    /// Posts a receive of one message scattered over `segs` in order; the
    /// sender's segments must have the same lengths.
    fn irecvv(&mut self, segs: &[MemRef], mrs: &[MrHandle]) -> Result<Option<ReqId>, NetError> {
        match (segs, mrs) {
            ([m], [mr]) => self.irecv(*m, *mr),
            _ => Err(gather_unsupported(segs.len())),
        }
    }
    /// Posts a pull: the pieces of the peer's memory `src` (ranges it
    /// exported, in order) copied into `segs` by this side, with no send
    /// posted by the peer; tested as a receive. The pieces must cover
    /// `segs` exactly. Nets without a one-sided path refuse it.
    fn ipull(&mut self, segs: &[MemRef], src: &[RemoteRef]) -> Result<Option<ReqId>, NetError> {
        let _ = (segs, src);
        Err(NetError::Misuse {
            net: "net",
            reason: "a pull on a net without a one-sided path".into(),
        })
    }
    /// `Some(bytes received)` once the data is in place (unpacked, where the
    /// transport needs that). Oldest request only.
    fn test(&mut self, req: ReqId) -> Result<Option<usize>, NetError>;
}
