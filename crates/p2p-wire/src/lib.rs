//! Every byte format of tcpx-p2p that crosses a process boundary, as pure
//! functions over one checked reader: endpoint metadata, the 64-byte
//! advertised-region descriptor, serialized descriptor lists, the handshake
//! and the control messages, the control connection's framing ([`frame`]),
//! the handshake's proofs ([`auth`]) and the same-host path's formats
//! ([`same_host`], and its net's, [`same_host_net`]). Decoders never panic and reject trailing bytes.
//!
//! The engine (`tcpx-p2p`), its bindings, its fuzz targets and test peers
//! that speak the protocol all use this crate; it knows nothing of sockets
//! beyond reading and writing one frame.
#![deny(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub mod auth;
mod error;
pub mod frame;
pub mod same_host;
pub mod same_host_net;

pub use error::WireError;
pub use frame::{frame_with, read_frame, write_frame};

/// A cursor over borrowed bytes where every take is checked.
pub struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, what }
    }
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated {
                what: self.what,
                needed: n - self.buf.len(),
            });
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16_le(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub fn u32_le(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64_le(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub fn i32_le(&mut self) -> Result<i32, WireError> {
        Ok(i32::from_le_bytes(self.array()?))
    }
    /// A string of at most `max` bytes, prefixed by its u16 length.
    pub fn string(&mut self, max: usize) -> Result<String, WireError> {
        let n = self.u16_le()? as usize;
        if n > max {
            return Err(WireError::BadLength {
                what: self.what,
                len: n,
            });
        }
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::BadUtf8 { what: self.what })
    }
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }
    /// Succeeds only when every byte was read.
    pub fn finish(self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::Trailing {
                what: self.what,
                left: self.buf.len(),
            })
        }
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    let b = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    out.extend_from_slice(&(b.len() as u16).to_le_bytes());
    out.extend_from_slice(b);
}

// ---------------------------------------------------------------- metadata

/// Which GPU an endpoint owns, as the metadata names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuId {
    /// The PCI bus id (current form), e.g. `0000:4a:00.0`; empty for no GPU.
    Bdf(String),
    /// A device index (older form).
    Index(i32),
}

/// What a peer needs to connect: `ip | port (u16 BE) | bdf_len u8 | bdf`, or
/// the older `ip | port | i32 index (host order)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metadata {
    pub ip: IpAddr,
    pub port: u16,
    pub gpu: GpuId,
}

impl Metadata {
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self.ip {
            IpAddr::V4(a) => out.extend_from_slice(&a.octets()),
            IpAddr::V6(a) => out.extend_from_slice(&a.octets()),
        }
        out.extend_from_slice(&self.port.to_be_bytes());
        match &self.gpu {
            GpuId::Bdf(s) => {
                let b = &s.as_bytes()[..s.len().min(255)];
                out.push(b.len() as u8);
                out.extend_from_slice(b);
            }
            GpuId::Index(i) => out.extend_from_slice(&i.to_ne_bytes()),
        }
    }

    /// Tells the forms apart by length: 10 or 22 bytes is the older index form.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "metadata";
        let (iplen, legacy) = match b.len() {
            10 => (4, true),
            22 => (16, true),
            n if n >= 7 && 4 + 2 + 1 + b[6] as usize == n => (4, false),
            n if n >= 19 && 16 + 2 + 1 + b[18] as usize == n => (16, false),
            n => return Err(WireError::BadLength { what: WHAT, len: n }),
        };
        let mut r = Reader::new(b, WHAT);
        let ip = if iplen == 4 {
            IpAddr::V4(Ipv4Addr::from(r.array::<4>()?))
        } else {
            IpAddr::V6(Ipv6Addr::from(r.array::<16>()?))
        };
        let port = u16::from_be_bytes(r.array()?);
        let gpu = if legacy {
            GpuId::Index(i32::from_ne_bytes(r.array()?))
        } else {
            let n = r.u8()? as usize;
            let s = r.take(n)?;
            GpuId::Bdf(
                String::from_utf8(s.to_vec()).map_err(|_| WireError::BadUtf8 { what: WHAT })?,
            )
        };
        r.finish()?;
        Ok(Metadata { ip, port, gpu })
    }
}

// ------------------------------------------------------- advertised regions

/// The 64-byte descriptor a peer gets from `advertise` ("FifoItem"):
/// `u64 addr; u32 size; u32 rkey; u32 nmsgs; u32 rid; u64 idx; u8 pad[32]`.
/// We keep the advertisement's id and secret in the pad.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FifoItem {
    pub addr: u64,
    pub size: u32,
    pub rkey: u32,
    pub nmsgs: u32,
    pub rid: u32,
    pub idx: u64,
    pub token: Token,
}

/// Names one advertisement: its id and a random secret the peer must echo.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Token {
    pub id: u64,
    pub secret: u64,
}

impl Token {
    /// The token an `XferDesc`'s `rkeys` carry: `[advertisement id,
    /// secret]` (more keys are ignored; fewer than two name none).
    pub fn from_keys(keys: &[u64]) -> Option<Token> {
        match keys {
            [id, secret, ..] => Some(Token {
                id: *id,
                secret: *secret,
            }),
            _ => None,
        }
    }
}

pub const FIFO_ITEM_LEN: usize = 64;
const TOKEN_MAGIC: u64 = 0x5450_5850_3250_4144; // "TPXP2PAD"

impl FifoItem {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.addr.to_le_bytes());
        out.extend_from_slice(&self.size.to_le_bytes());
        out.extend_from_slice(&self.rkey.to_le_bytes());
        out.extend_from_slice(&self.nmsgs.to_le_bytes());
        out.extend_from_slice(&self.rid.to_le_bytes());
        out.extend_from_slice(&self.idx.to_le_bytes());
        out.extend_from_slice(&TOKEN_MAGIC.to_le_bytes());
        out.extend_from_slice(&self.token.id.to_le_bytes());
        out.extend_from_slice(&self.token.secret.to_le_bytes());
        out.extend_from_slice(&[0u8; 8]);
    }
    pub fn to_bytes(&self) -> [u8; FIFO_ITEM_LEN] {
        let mut v = Vec::with_capacity(FIFO_ITEM_LEN);
        self.encode(&mut v);
        let mut a = [0u8; FIFO_ITEM_LEN];
        a.copy_from_slice(&v);
        a
    }
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "advertised descriptor";
        if b.len() != FIFO_ITEM_LEN {
            return Err(WireError::BadLength {
                what: WHAT,
                len: b.len(),
            });
        }
        let mut r = Reader::new(b, WHAT);
        let addr = r.u64_le()?;
        let size = r.u32_le()?;
        let rkey = r.u32_le()?;
        let nmsgs = r.u32_le()?;
        let rid = r.u32_le()?;
        let idx = r.u64_le()?;
        let magic = r.u64_le()?;
        if magic != TOKEN_MAGIC {
            return Err(WireError::BadValue {
                what: "advertised descriptor magic",
                value: magic,
            });
        }
        let token = Token {
            id: r.u64_le()?,
            secret: r.u64_le()?,
        };
        r.take(8)?;
        r.finish()?;
        Ok(FifoItem {
            addr,
            size,
            rkey,
            nmsgs,
            rid,
            idx,
            token,
        })
    }
}

// ------------------------------------------------- serialized descriptors

/// One entry of `get_serialized_descs`: a registered region a peer may use
/// through `transfer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescEntry {
    pub addr: u64,
    pub size: u64,
    pub mr_id: u64,
    pub token: Token,
}

const DESCS_MAGIC: u32 = 0x5844_5343; // "XDSC"
/// Most descriptors one serialized list may hold.
pub const MAX_DESCS: usize = 1 << 20;

pub fn encode_descs(list: &[DescEntry], out: &mut Vec<u8>) {
    out.extend_from_slice(&DESCS_MAGIC.to_le_bytes());
    out.extend_from_slice(&(list.len() as u32).to_le_bytes());
    for d in list {
        out.extend_from_slice(&d.addr.to_le_bytes());
        out.extend_from_slice(&d.size.to_le_bytes());
        out.extend_from_slice(&d.mr_id.to_le_bytes());
        out.extend_from_slice(&d.token.id.to_le_bytes());
        out.extend_from_slice(&d.token.secret.to_le_bytes());
    }
}

pub fn decode_descs(b: &[u8]) -> Result<Vec<DescEntry>, WireError> {
    const WHAT: &str = "serialized descriptors";
    let mut r = Reader::new(b, WHAT);
    let magic = r.u32_le()?;
    if magic != DESCS_MAGIC {
        return Err(WireError::BadValue {
            what: "serialized descriptors magic",
            value: magic as u64,
        });
    }
    let n = r.u32_le()? as usize;
    if n > MAX_DESCS || n * 40 != r.remaining() {
        return Err(WireError::BadLength { what: WHAT, len: n });
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(DescEntry {
            addr: r.u64_le()?,
            size: r.u64_le()?,
            mr_id: r.u64_le()?,
            token: Token {
                id: r.u64_le()?,
                secret: r.u64_le()?,
            },
        });
    }
    r.finish()?;
    Ok(v)
}

// --------------------------------------------------------------- handshake

pub const MAGIC: u64 = 0x3150_3250_5850_4354; // "TCPXP2P1"
/// 3: small items of a vector are gathered into one request (both peers
/// must plan requests alike). 4: the socket net's listen handle carries
/// the receiver's smallest part, which the sender adopts. 5: mutual
/// challenge-response authentication (fresh nonces, HMAC-SHA256 proofs)
/// before any listen handle is exchanged; handles travel in their own frame.
/// 6: a two-sided message's receiver acknowledges it (`MsgDone`), and the
/// send completes only then. 7: the socket net cuts a message into a
/// number of parts growing with the square root of its size (both peers
/// must cut alike). 8: a read's receives are posted only once the target
/// accepts it (`ReadAck`), and a refused read gets no empty messages.
/// 9: a socket-net comm connects one stream and opens more as messages
/// are cut into more parts; any stream may carry any part (an older
/// receiver would wait for every stream at accept). 10: a gathered
/// message's shape digest hashes each segment length as one 64-bit word
/// (an older peer hashed bytes, and would refuse every gathered part).
/// 11: a write may name where the target can copy its data from itself
/// (`WritePull`), on nets with a one-sided path. 12: a reader may offer to
/// copy a read itself (`ReadOffer`): the target answers where its data
/// lies (`ReadGrant`) and the reader says when it is done (`ReadDone`).
/// 13: a grant may lease whole advertisements to the reader for later
/// reads ([`Lease`]), which the target calls back (`Revoke` / `Revoked`)
/// before their memory is deregistered. 14: a lease may also be written
/// through (`Lease::write`, for records that live as long as their
/// connection), and a target may lease on its own (`Leases`). 15: the
/// socket net gathers up to 8,192 blocks a message (1,024 before), so
/// both peers must plan a list's requests alike.
pub const VERSION: u16 = 15;
/// An ncclNet listen handle is at most this long.
pub const NET_HANDLE_LEN: usize = 128;
/// Most channels per set a connection may have.
pub const MAX_CHANNELS: u8 = 32;
/// Length of a handshake nonce and of an authentication proof.
pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;

/// The first message on a new control connection, each side sends one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub gpu_index: i32,
    pub gpu_bdf: String,
    pub net: String,
    /// Channels per set (two-sided, one-sided) proposed by the connector;
    /// the acceptor answers with the value both will use.
    pub channels: u8,
    pub chunk: u64,
    /// Fresh random bytes: both sides' proofs cover both nonces, so a
    /// proof seen on the wire is worth nothing on another connection.
    pub nonce: [u8; NONCE_LEN],
}

impl Hello {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.gpu_index.to_le_bytes());
        put_string(out, &self.gpu_bdf);
        put_string(out, &self.net);
        out.push(self.channels);
        out.extend_from_slice(&self.chunk.to_le_bytes());
        out.extend_from_slice(&self.nonce);
    }
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(b, "handshake");
        let magic = r.u64_le()?;
        if magic != MAGIC {
            return Err(WireError::BadValue {
                what: "handshake magic",
                value: magic,
            });
        }
        let version = r.u16_le()?;
        if version != VERSION {
            return Err(WireError::BadValue {
                what: "handshake version",
                value: version as u64,
            });
        }
        let gpu_index = r.i32_le()?;
        let gpu_bdf = r.string(64)?;
        let net = r.string(64)?;
        let channels = r.u8()?;
        if channels == 0 || channels > MAX_CHANNELS {
            return Err(WireError::BadValue {
                what: "handshake channels",
                value: channels as u64,
            });
        }
        let chunk = r.u64_le()?;
        if !(4096..=(1 << 30)).contains(&chunk) {
            return Err(WireError::BadValue {
                what: "handshake chunk",
                value: chunk,
            });
        }
        let nonce = r.array()?;
        r.finish()?;
        Ok(Hello {
            version,
            gpu_index,
            gpu_bdf,
            net,
            channels,
            chunk,
            nonce,
        })
    }
}

/// The handshake's later frames, after both hellos (see `handshake`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeMsg {
    /// The side refuses the connection; the reason is for the log.
    Refuse(String),
    /// HMAC-SHA256 proof of the shared secret over both hellos.
    Proof([u8; PROOF_LEN]),
    /// The listen handles of this side's receive comms: `2 * channels` of
    /// them (two-sided set first, then one-sided).
    Handles(Vec<[u8; NET_HANDLE_LEN]>),
}

const H_REFUSE: u8 = 0;
const H_PROOF: u8 = 1;
const H_HANDLES: u8 = 2;
/// Longest refusal reason in a handshake.
pub const MAX_HANDSHAKE_REASON: usize = 256;

impl HandshakeMsg {
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            HandshakeMsg::Refuse(r) => {
                out.push(H_REFUSE);
                put_string(out, &r[..floor_char_boundary(r, MAX_HANDSHAKE_REASON)]);
            }
            HandshakeMsg::Proof(p) => {
                out.push(H_PROOF);
                out.extend_from_slice(p);
            }
            HandshakeMsg::Handles(hs) => {
                out.push(H_HANDLES);
                out.push(hs.len().min(u8::MAX as usize) as u8);
                for h in hs.iter().take(u8::MAX as usize) {
                    out.extend_from_slice(h);
                }
            }
        }
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(b, "handshake message");
        let m = match r.u8()? {
            H_REFUSE => {
                // A bare refusal byte (older peers) carries no reason.
                if r.remaining() == 0 {
                    HandshakeMsg::Refuse(String::new())
                } else {
                    HandshakeMsg::Refuse(r.string(MAX_HANDSHAKE_REASON)?)
                }
            }
            H_PROOF => HandshakeMsg::Proof(r.array()?),
            H_HANDLES => {
                let n = r.u8()? as usize;
                if n == 0 || n > 2 * MAX_CHANNELS as usize {
                    return Err(WireError::BadLength {
                        what: "handshake handles",
                        len: n,
                    });
                }
                let mut hs = Vec::with_capacity(n);
                for _ in 0..n {
                    hs.push(r.array()?);
                }
                HandshakeMsg::Handles(hs)
            }
            other => {
                return Err(WireError::BadValue {
                    what: "handshake message type",
                    value: other as u64,
                })
            }
        };
        r.finish()?;
        Ok(m)
    }
}

/// Longest handshake frame accepted from a peer (a full handle list).
pub const MAX_HANDSHAKE_FRAME: usize = 2 + 2 * MAX_CHANNELS as usize * NET_HANDLE_LEN;

// -------------------------------------------------------- control messages

/// One piece of a one-sided request: `len` bytes at `addr` inside the
/// advertisement `token` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RmaItem {
    pub token: Token,
    pub addr: u64,
    pub len: u64,
}

/// Most items one request may carry.
pub const MAX_RMA_ITEMS: usize = 65_536;
/// Most pieces one one-sided transfer may have: more than
/// [`MAX_RMA_ITEMS`] go as several requests under one transfer (vLLM moves
/// a request's KV cache as one transfer of ~100,000 descriptors).
pub const MAX_RMA_PIECES: usize = 1 << 24;
/// Longest reason string carried in a refusal.
pub const MAX_REASON: usize = 1024;

/// Messages on the control connection once the handshake is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Liveness; carries nothing.
    KeepAlive,
    /// Initiator → target: I want to write these items. `runs` groups
    /// consecutive items into the messages that carry them (see
    /// [`check_runs`]): a run of items contiguous on both sides is one
    /// message.
    WriteReq {
        xfer: u64,
        items: Vec<RmaItem>,
        runs: Vec<u32>,
    },
    /// Initiator → target: a write the target may copy itself, straight
    /// from the initiator's memory, on a net with a one-sided path: as a
    /// `WriteReq`, plus where each run's data lies ([`PullRun`], one per
    /// run). The target answers `WriteDone` once it has copied every run,
    /// or, where it cannot pull, treats it as a `WriteReq` and answers
    /// `WriteCts`.
    WritePull {
        xfer: u64,
        items: Vec<RmaItem>,
        runs: Vec<u32>,
        src: Vec<PullRun>,
    },
    /// Target → initiator: receives are posted, send the data.
    WriteCts { xfer: u64 },
    /// Target → initiator: every byte of the write has landed.
    WriteDone { xfer: u64 },
    /// Initiator → target: I posted receives; send me these items, one
    /// message per run.
    ReadReq {
        xfer: u64,
        items: Vec<RmaItem>,
        runs: Vec<u32>,
    },
    /// Target → initiator: the read was accepted and its data is coming.
    ReadAck { xfer: u64 },
    /// Initiator → target: a read the initiator may copy itself, straight
    /// from the target's memory, on a net with a one-sided path: as a
    /// `ReadReq` (no receive is posted yet), plus whether each run lands in
    /// device memory (`dst_gpu`, one per run). The target answers
    /// `ReadGrant` where the reader can copy, else treats it as a `ReadReq`
    /// and answers `ReadAck`.
    ReadOffer {
        xfer: u64,
        items: Vec<RmaItem>,
        runs: Vec<u32>,
        dst_gpu: Vec<bool>,
    },
    /// Target → initiator: where each run of an offered read lies in the
    /// target's memory (one [`PullRun`] per run); the reader copies it and
    /// answers `ReadDone`. The target holds the range until then. `leases`
    /// (at most [`MAX_GRANT_LEASES`]) offer whole advertisements for later
    /// reads with no request at all, until the target revokes them.
    ReadGrant {
        xfer: u64,
        src: Vec<PullRun>,
        leases: Vec<Lease>,
    },
    /// Initiator → target: the reader will copy no more of a granted read
    /// (done or failed): the target lets its range go.
    ReadDone { xfer: u64 },
    /// Target → reader: the lease of advertisement `token` ends; the reader
    /// starts no read from it and answers `Revoked` once its reads from it
    /// have ended.
    Revoke { token: Token },
    /// Reader → target: no read of ours copies from the lease `token` any
    /// more: the target may let its memory go.
    Revoked { token: Token },
    /// Target → peer: leases given unasked (at most [`MAX_GRANT_LEASES`]),
    /// as a grant's are: a record made for this connection alone is leased
    /// as soon as it is made.
    Leases { leases: Vec<Lease> },
    /// Either way: the request was refused; nothing was written.
    Refused { xfer: u64, reason: String },
    /// Orderly close.
    Close,
    /// A notification: `msg` (at most [`MAX_NOTIF`] bytes) from the endpoint
    /// named `name` (at most [`MAX_NOTIF_NAME`] bytes), queued for the
    /// application. Sent after a transfer's last byte has landed when it is
    /// attached to one.
    Notif { name: String, msg: Vec<u8> },
    /// Initiator → target: a small write whose data comes with it. The
    /// frame is followed on the control connection by `len` bytes (at most
    /// [`MAX_INLINE`]): the items' data in order. The target checks the
    /// request exactly as a `WriteReq` before reading any of them into the
    /// advertised range, and answers `WriteDone` or `Refused` (having read
    /// and dropped the bytes).
    WriteInline {
        xfer: u64,
        items: Vec<RmaItem>,
        runs: Vec<u32>,
        len: u32,
    },
    /// Initiator → target: a small read answered on the control connection
    /// (`ReadData` or `Refused`); the reader posts no receive.
    ReadInline {
        xfer: u64,
        items: Vec<RmaItem>,
        runs: Vec<u32>,
    },
    /// Target → initiator: the data of a `ReadInline`, `len` bytes (at most
    /// [`MAX_INLINE`]) following the frame.
    ReadData { xfer: u64, len: u32 },
    /// Receiver → sender of two-sided messages: the first `count` messages
    /// the sender posted (in posting order) have landed in receives. Counts
    /// only grow; each send completes when its message is counted.
    MsgDone { count: u64 },
}

/// Where one run of a [`Control::WritePull`] lies in the initiator's
/// memory, for the target's net: `key` is that net's description of it
/// (its `Net::export`), opaque to the engine; `gpu` says whether it is
/// device memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullRun {
    pub gpu: bool,
    pub key: Vec<u8>,
}

/// An advertisement of the target's, leased to a reader on a net with a
/// one-sided path: the reader may copy any range inside `[addr, addr+len)`
/// named by `token` straight from `key` (the range's export), with no
/// request, until the target revokes the lease (`Revoke`). `gpu`: the
/// range is device memory. `write`: the peer may also copy into the
/// range (a record that lives as long as its connection).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub token: Token,
    pub addr: u64,
    pub len: u64,
    pub gpu: bool,
    pub write: bool,
    pub key: Vec<u8>,
}

/// Most leases one grant carries.
pub const MAX_GRANT_LEASES: usize = 8;

/// The encoded length of `leases` in a [`Control::ReadGrant`].
pub fn leases_len(leases: &[Lease]) -> usize {
    4 + leases.iter().map(lease_len).sum::<usize>()
}

/// The encoded length of one lease in a [`Control::ReadGrant`].
pub fn lease_len(l: &Lease) -> usize {
    16 + 8 + 8 + 1 + 3 + l.key.len()
}

/// Longest [`PullRun::key`].
pub const MAX_PULL_KEY: usize = 256;

/// The encoded length of a [`Control::WritePull`] of `items` items in `runs` runs whose keys add up to `key_bytes`: a
/// sender keeps it within [`MAX_FRAME`] (the peer refuses a longer frame).
pub fn pull_frame_len(items: usize, runs: usize, key_bytes: usize) -> usize {
    1 + 8 + 4 + items * 32 + 4 + runs * 4 + 4 + runs * 3 + key_bytes
}

/// Most payload bytes that follow one `WriteInline` or `ReadData` frame on
/// the control connection. What a side sends inline is set by
/// `TCPX_P2P_INLINE_MAX` (see `Config::inline_max`), never above this.
pub const MAX_INLINE: usize = 1 << 20;

fn get_inline_len(r: &mut Reader<'_>) -> Result<u32, WireError> {
    let len = r.u32_le()?;
    if len as usize > MAX_INLINE {
        return Err(WireError::BadLength {
            what: "inline payload",
            len: len as usize,
        });
    }
    Ok(len)
}

const T_KEEPALIVE: u8 = 1;
const T_WRITE_REQ: u8 = 2;
const T_WRITE_CTS: u8 = 3;
const T_WRITE_DONE: u8 = 4;
const T_READ_REQ: u8 = 5;
const T_READ_ACK: u8 = 6;
const T_REFUSED: u8 = 7;
const T_CLOSE: u8 = 8;
const T_NOTIF: u8 = 9;
const T_WRITE_INLINE: u8 = 10;
const T_READ_INLINE: u8 = 11;
const T_READ_DATA: u8 = 12;
const T_MSG_DONE: u8 = 13;
const T_WRITE_PULL: u8 = 14;
const T_READ_OFFER: u8 = 15;
const T_READ_GRANT: u8 = 16;
const T_READ_DONE: u8 = 17;
const T_REVOKE: u8 = 18;
const T_REVOKED: u8 = 19;
const T_LEASES: u8 = 20;

/// Longest notification message.
pub const MAX_NOTIF: usize = 1 << 20;
/// Longest sender name a notification carries.
pub const MAX_NOTIF_NAME: usize = 256;

fn put_items(out: &mut Vec<u8>, items: &[RmaItem]) {
    // 32 bytes an item: a request of 8,192 grows its buffer once.
    out.reserve(4 + items.len() * 32);
    out.extend_from_slice(&(items.len() as u32).to_le_bytes());
    for it in items {
        out.extend_from_slice(&it.token.id.to_le_bytes());
        out.extend_from_slice(&it.token.secret.to_le_bytes());
        out.extend_from_slice(&it.addr.to_le_bytes());
        out.extend_from_slice(&it.len.to_le_bytes());
    }
}

fn put_pull(out: &mut Vec<u8>, src: &[PullRun]) {
    out.extend_from_slice(&(src.len() as u32).to_le_bytes());
    for p in src {
        let key = &p.key[..p.key.len().min(MAX_PULL_KEY)];
        out.push(p.gpu as u8);
        out.extend_from_slice(&(key.len() as u16).to_le_bytes());
        out.extend_from_slice(key);
    }
}

/// One [`PullRun`] per run, each key at most [`MAX_PULL_KEY`] bytes.
fn get_pull(r: &mut Reader<'_>, runs: usize) -> Result<Vec<PullRun>, WireError> {
    let n = r.u32_le()? as usize;
    if n != runs || n * 3 > r.remaining() {
        return Err(WireError::BadLength {
            what: "pull runs",
            len: n,
        });
    }
    get_pull_runs(r, n)
}

/// `n` [`PullRun`]s, each key at most [`MAX_PULL_KEY`] bytes.
fn get_pull_runs(r: &mut Reader<'_>, n: usize) -> Result<Vec<PullRun>, WireError> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let gpu = as_bool(r.u8()?, "pull run memory kind")?;
        let len = r.u16_le()? as usize;
        if len > MAX_PULL_KEY {
            return Err(WireError::BadLength {
                what: "pull run key",
                len,
            });
        }
        v.push(PullRun {
            gpu,
            key: r.take(len)?.to_vec(),
        });
    }
    Ok(v)
}

fn put_token(out: &mut Vec<u8>, t: Token) {
    out.extend_from_slice(&t.id.to_le_bytes());
    out.extend_from_slice(&t.secret.to_le_bytes());
}

fn get_token(r: &mut Reader<'_>) -> Result<Token, WireError> {
    Ok(Token {
        id: r.u64_le()?,
        secret: r.u64_le()?,
    })
}

fn put_leases(out: &mut Vec<u8>, leases: &[Lease]) {
    out.extend_from_slice(&(leases.len() as u32).to_le_bytes());
    for l in leases {
        let key = &l.key[..l.key.len().min(MAX_PULL_KEY)];
        put_token(out, l.token);
        out.extend_from_slice(&l.addr.to_le_bytes());
        out.extend_from_slice(&l.len.to_le_bytes());
        out.push(l.write as u8);
        out.push(l.gpu as u8);
        out.extend_from_slice(&(key.len() as u16).to_le_bytes());
        out.extend_from_slice(key);
    }
}

/// At most [`MAX_GRANT_LEASES`] leases, each key at most [`MAX_PULL_KEY`]
/// bytes.
fn get_leases(r: &mut Reader<'_>) -> Result<Vec<Lease>, WireError> {
    let n = r.u32_le()? as usize;
    if n > MAX_GRANT_LEASES {
        return Err(WireError::BadLength {
            what: "grant leases",
            len: n,
        });
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let token = get_token(r)?;
        let addr = r.u64_le()?;
        let len = r.u64_le()?;
        let write = as_bool(r.u8()?, "lease write flag")?;
        let run = get_pull_runs(r, 1)?.pop().ok_or(WireError::BadLength {
            what: "lease key",
            len: 0,
        })?;
        v.push(Lease {
            token,
            addr,
            len,
            gpu: run.gpu,
            write,
            key: run.key,
        });
    }
    Ok(v)
}

fn put_flags(out: &mut Vec<u8>, flags: &[bool]) {
    out.extend_from_slice(&(flags.len() as u32).to_le_bytes());
    out.extend(flags.iter().map(|&f| f as u8));
}

/// One flag per run, each 0 or 1.
fn get_flags(r: &mut Reader<'_>, runs: usize) -> Result<Vec<bool>, WireError> {
    let n = r.u32_le()? as usize;
    if n != runs || n > r.remaining() {
        return Err(WireError::BadLength {
            what: "run flags",
            len: n,
        });
    }
    r.take(n)?.iter().map(|&b| as_bool(b, "run flag")).collect()
}

/// A flag byte: 0 or 1, anything else refused.
fn as_bool(b: u8, what: &'static str) -> Result<bool, WireError> {
    match b {
        0 => Ok(false),
        1 => Ok(true),
        x => Err(WireError::BadValue {
            what,
            value: x as u64,
        }),
    }
}

/// Keys of a grant: as many as the grant says, at most [`MAX_RMA_ITEMS`]
/// (the reader checks the count against its own runs).
fn get_grant(r: &mut Reader<'_>) -> Result<Vec<PullRun>, WireError> {
    let n = r.u32_le()? as usize;
    if n == 0 || n > MAX_RMA_ITEMS || n * 3 > r.remaining() {
        return Err(WireError::BadLength {
            what: "grant runs",
            len: n,
        });
    }
    get_pull_runs(r, n)
}

fn put_runs(out: &mut Vec<u8>, runs: &[u32]) {
    out.reserve(4 + runs.len() * 4);
    out.extend_from_slice(&(runs.len() as u32).to_le_bytes());
    for n in runs {
        out.extend_from_slice(&n.to_le_bytes());
    }
}

fn get_runs(r: &mut Reader<'_>, items: usize) -> Result<Vec<u32>, WireError> {
    let n = r.u32_le()? as usize;
    if n == 0 || n > items || n * 4 > r.remaining() {
        return Err(WireError::BadLength {
            what: "request runs",
            len: n,
        });
    }
    let runs = (0..n).map(|_| r.u32_le()).collect::<Result<Vec<_>, _>>()?;
    check_runs(&runs, items)?;
    Ok(runs)
}

/// Runs must be non-empty and cover the items exactly, in order.
pub fn check_runs(runs: &[u32], items: usize) -> Result<(), WireError> {
    let mut sum = 0usize;
    for &n in runs {
        if n == 0 {
            return Err(WireError::BadValue {
                what: "empty run",
                value: 0,
            });
        }
        sum += n as usize;
    }
    if sum != items {
        return Err(WireError::BadValue {
            what: "items covered by the runs",
            value: sum as u64,
        });
    }
    Ok(())
}

/// The byte length of each run's message, or None if one overflows.
pub fn run_lengths(items: &[RmaItem], runs: &[u32]) -> Option<Vec<u64>> {
    let mut at = 0usize;
    runs.iter()
        .map(|&n| {
            let run = items.get(at..at + n as usize)?;
            at += n as usize;
            run.iter().try_fold(0u64, |a, it| a.checked_add(it.len))
        })
        .collect()
}

fn get_items(r: &mut Reader<'_>) -> Result<Vec<RmaItem>, WireError> {
    let n = r.u32_le()? as usize;
    if n == 0 || n > MAX_RMA_ITEMS || n * 32 > r.remaining() {
        return Err(WireError::BadLength {
            what: "request items",
            len: n,
        });
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(RmaItem {
            token: Token {
                id: r.u64_le()?,
                secret: r.u64_le()?,
            },
            addr: r.u64_le()?,
            len: r.u64_le()?,
        });
    }
    Ok(v)
}

impl Control {
    /// The message as one frame ([`frame`]): its length, then its body,
    /// encoded in place (a request of 8,192 items is 256 KiB: not copied
    /// again behind its length).
    pub fn to_frame(&self) -> Vec<u8> {
        frame_with(|out| self.encode(out))
    }

    /// The message body (without the frame's length prefix).
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Control::KeepAlive => out.push(T_KEEPALIVE),
            Control::WriteReq { xfer, items, runs } => {
                out.push(T_WRITE_REQ);
                out.extend_from_slice(&xfer.to_le_bytes());
                put_items(out, items);
                put_runs(out, runs);
            }
            Control::WritePull {
                xfer,
                items,
                runs,
                src,
            } => {
                out.push(T_WRITE_PULL);
                out.extend_from_slice(&xfer.to_le_bytes());
                put_items(out, items);
                put_runs(out, runs);
                put_pull(out, src);
            }
            Control::ReadOffer {
                xfer,
                items,
                runs,
                dst_gpu,
            } => {
                out.push(T_READ_OFFER);
                out.extend_from_slice(&xfer.to_le_bytes());
                put_items(out, items);
                put_runs(out, runs);
                put_flags(out, dst_gpu);
            }
            Control::ReadGrant { xfer, src, leases } => {
                out.push(T_READ_GRANT);
                out.extend_from_slice(&xfer.to_le_bytes());
                put_pull(out, src);
                put_leases(out, leases);
            }
            Control::Revoke { token } => {
                out.push(T_REVOKE);
                put_token(out, *token);
            }
            Control::Revoked { token } => {
                out.push(T_REVOKED);
                put_token(out, *token);
            }
            Control::Leases { leases } => {
                out.push(T_LEASES);
                put_leases(out, leases);
            }
            Control::ReadDone { xfer } => {
                out.push(T_READ_DONE);
                out.extend_from_slice(&xfer.to_le_bytes());
            }
            Control::WriteCts { xfer } => {
                out.push(T_WRITE_CTS);
                out.extend_from_slice(&xfer.to_le_bytes());
            }
            Control::WriteDone { xfer } => {
                out.push(T_WRITE_DONE);
                out.extend_from_slice(&xfer.to_le_bytes());
            }
            Control::ReadReq { xfer, items, runs } => {
                out.push(T_READ_REQ);
                out.extend_from_slice(&xfer.to_le_bytes());
                put_items(out, items);
                put_runs(out, runs);
            }
            Control::ReadAck { xfer } => {
                out.push(T_READ_ACK);
                out.extend_from_slice(&xfer.to_le_bytes());
            }
            Control::Refused { xfer, reason } => {
                out.push(T_REFUSED);
                out.extend_from_slice(&xfer.to_le_bytes());
                let r = &reason[..floor_char_boundary(reason, MAX_REASON)];
                put_string(out, r);
            }
            Control::Close => out.push(T_CLOSE),
            Control::Notif { name, msg } => {
                out.push(T_NOTIF);
                put_string(out, &name[..floor_char_boundary(name, MAX_NOTIF_NAME)]);
                let m = &msg[..msg.len().min(MAX_NOTIF)];
                out.extend_from_slice(&(m.len() as u32).to_le_bytes());
                out.extend_from_slice(m);
            }
            Control::WriteInline {
                xfer,
                items,
                runs,
                len,
            } => {
                out.push(T_WRITE_INLINE);
                out.extend_from_slice(&xfer.to_le_bytes());
                put_items(out, items);
                put_runs(out, runs);
                out.extend_from_slice(&len.to_le_bytes());
            }
            Control::ReadInline { xfer, items, runs } => {
                out.push(T_READ_INLINE);
                out.extend_from_slice(&xfer.to_le_bytes());
                put_items(out, items);
                put_runs(out, runs);
            }
            Control::ReadData { xfer, len } => {
                out.push(T_READ_DATA);
                out.extend_from_slice(&xfer.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            Control::MsgDone { count } => {
                out.push(T_MSG_DONE);
                out.extend_from_slice(&count.to_le_bytes());
            }
        }
    }

    /// The message's name, for logs and traces.
    pub fn kind(&self) -> &'static str {
        match self {
            Control::KeepAlive => "KeepAlive",
            Control::WriteReq { .. } => "WriteReq",
            Control::WritePull { .. } => "WritePull",
            Control::WriteCts { .. } => "WriteCts",
            Control::WriteDone { .. } => "WriteDone",
            Control::ReadReq { .. } => "ReadReq",
            Control::ReadAck { .. } => "ReadAck",
            Control::ReadOffer { .. } => "ReadOffer",
            Control::ReadGrant { .. } => "ReadGrant",
            Control::ReadDone { .. } => "ReadDone",
            Control::Revoke { .. } => "Revoke",
            Control::Revoked { .. } => "Revoked",
            Control::Leases { .. } => "Leases",
            Control::Refused { .. } => "Refused",
            Control::Close => "Close",
            Control::WriteInline { .. } => "WriteInline",
            Control::ReadInline { .. } => "ReadInline",
            Control::ReadData { .. } => "ReadData",
            Control::MsgDone { .. } => "MsgDone",
            Control::Notif { .. } => "Notif",
        }
    }

    /// The one-sided transfer this message is about (the initiator's id),
    /// for traces; none for the others.
    pub fn xfer(&self) -> Option<u64> {
        match self {
            Control::WriteReq { xfer, .. }
            | Control::WritePull { xfer, .. }
            | Control::WriteCts { xfer }
            | Control::WriteDone { xfer }
            | Control::ReadReq { xfer, .. }
            | Control::ReadAck { xfer }
            | Control::ReadOffer { xfer, .. }
            | Control::ReadGrant { xfer, .. }
            | Control::ReadDone { xfer }
            | Control::Refused { xfer, .. }
            | Control::WriteInline { xfer, .. }
            | Control::ReadInline { xfer, .. }
            | Control::ReadData { xfer, .. } => Some(*xfer),
            Control::KeepAlive
            | Control::Close
            | Control::Revoke { .. }
            | Control::Revoked { .. }
            | Control::Leases { .. }
            | Control::Notif { .. }
            | Control::MsgDone { .. } => None,
        }
    }

    /// How many payload bytes follow this message's frame on the stream.
    pub fn payload_len(&self) -> usize {
        match self {
            Control::WriteInline { len, .. } | Control::ReadData { len, .. } => *len as usize,
            _ => 0,
        }
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(b, "control message");
        let t = r.u8()?;
        let m = match t {
            T_KEEPALIVE => Control::KeepAlive,
            T_WRITE_REQ => {
                let xfer = r.u64_le()?;
                let items = get_items(&mut r)?;
                let runs = get_runs(&mut r, items.len())?;
                Control::WriteReq { xfer, items, runs }
            }
            T_WRITE_PULL => {
                let xfer = r.u64_le()?;
                let items = get_items(&mut r)?;
                let runs = get_runs(&mut r, items.len())?;
                let src = get_pull(&mut r, runs.len())?;
                Control::WritePull {
                    xfer,
                    items,
                    runs,
                    src,
                }
            }
            T_WRITE_CTS => Control::WriteCts { xfer: r.u64_le()? },
            T_WRITE_DONE => Control::WriteDone { xfer: r.u64_le()? },
            T_READ_REQ => {
                let xfer = r.u64_le()?;
                let items = get_items(&mut r)?;
                let runs = get_runs(&mut r, items.len())?;
                Control::ReadReq { xfer, items, runs }
            }
            T_READ_ACK => Control::ReadAck { xfer: r.u64_le()? },
            T_READ_OFFER => {
                let xfer = r.u64_le()?;
                let items = get_items(&mut r)?;
                let runs = get_runs(&mut r, items.len())?;
                let dst_gpu = get_flags(&mut r, runs.len())?;
                Control::ReadOffer {
                    xfer,
                    items,
                    runs,
                    dst_gpu,
                }
            }
            T_READ_GRANT => Control::ReadGrant {
                xfer: r.u64_le()?,
                src: get_grant(&mut r)?,
                leases: get_leases(&mut r)?,
            },
            T_REVOKE => Control::Revoke {
                token: get_token(&mut r)?,
            },
            T_REVOKED => Control::Revoked {
                token: get_token(&mut r)?,
            },
            T_LEASES => Control::Leases {
                leases: get_leases(&mut r)?,
            },
            T_READ_DONE => Control::ReadDone { xfer: r.u64_le()? },
            T_REFUSED => Control::Refused {
                xfer: r.u64_le()?,
                reason: r.string(MAX_REASON)?,
            },
            T_CLOSE => Control::Close,
            T_NOTIF => {
                let name = r.string(MAX_NOTIF_NAME)?;
                let n = r.u32_le()? as usize;
                if n > MAX_NOTIF {
                    return Err(WireError::BadLength {
                        what: "notification",
                        len: n,
                    });
                }
                Control::Notif {
                    name,
                    msg: r.take(n)?.to_vec(),
                }
            }
            T_WRITE_INLINE => {
                let xfer = r.u64_le()?;
                let items = get_items(&mut r)?;
                let runs = get_runs(&mut r, items.len())?;
                let len = get_inline_len(&mut r)?;
                Control::WriteInline {
                    xfer,
                    items,
                    runs,
                    len,
                }
            }
            T_READ_INLINE => {
                let xfer = r.u64_le()?;
                let items = get_items(&mut r)?;
                let runs = get_runs(&mut r, items.len())?;
                Control::ReadInline { xfer, items, runs }
            }
            T_READ_DATA => Control::ReadData {
                xfer: r.u64_le()?,
                len: get_inline_len(&mut r)?,
            },
            T_MSG_DONE => Control::MsgDone { count: r.u64_le()? },
            other => {
                return Err(WireError::BadValue {
                    what: "control message type",
                    value: other as u64,
                })
            }
        };
        r.finish()?;
        Ok(m)
    }
}

fn floor_char_boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    let mut i = max;
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// Longest control frame accepted from a peer (an inline message's
/// payload, at most [`MAX_INLINE`], follows its frame and is not counted).
pub const MAX_FRAME: usize = 16 + 4 + MAX_RMA_ITEMS * 32 + 4 + MAX_RMA_ITEMS * 4 + 4;
// The largest notification fits a frame.
const _: () = assert!(1 + 2 + MAX_NOTIF_NAME + 4 + MAX_NOTIF <= MAX_FRAME);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_both_forms() {
        let m = Metadata {
            ip: "10.1.2.3".parse().unwrap(),
            port: 0x1234,
            gpu: GpuId::Bdf("0000:4a:00.0".into()),
        };
        let mut v = Vec::new();
        m.encode(&mut v);
        assert_eq!(&v[..7], &[10, 1, 2, 3, 0x12, 0x34, 12]);
        assert_eq!(Metadata::decode(&v).unwrap(), m);

        let old = Metadata {
            ip: "::1".parse().unwrap(),
            port: 7,
            gpu: GpuId::Index(3),
        };
        let mut v = Vec::new();
        old.encode(&mut v);
        assert_eq!(v.len(), 22);
        assert_eq!(Metadata::decode(&v).unwrap(), old);
        let mut v4 = vec![127, 0, 0, 1, 0, 80];
        v4.extend_from_slice(&5i32.to_ne_bytes());
        assert_eq!(Metadata::decode(&v4).unwrap().gpu, GpuId::Index(5));
        assert!(Metadata::decode(&[1, 2, 3]).is_err());
        assert!(Metadata::decode(&[127, 0, 0, 1, 0, 80, 9, b'x']).is_err());
    }

    #[test]
    fn fifo_item_fixed_bytes() {
        let f = FifoItem {
            addr: 0x1122334455667788,
            size: 4096,
            rkey: 9,
            nmsgs: 1,
            rid: 2,
            idx: 3,
            token: Token { id: 5, secret: 6 },
        };
        let b = f.to_bytes();
        assert_eq!(&b[..8], &0x1122334455667788u64.to_le_bytes());
        assert_eq!(&b[8..12], &4096u32.to_le_bytes());
        assert_eq!(FifoItem::decode(&b).unwrap(), f);
        let mut bad = b;
        bad[32] ^= 1;
        assert!(FifoItem::decode(&bad).is_err());
        assert!(FifoItem::decode(&b[..63]).is_err());
    }

    #[test]
    fn descs_round_trip_and_reject() {
        let l = vec![
            DescEntry {
                addr: 1,
                size: 2,
                mr_id: 3,
                token: Token { id: 4, secret: 5 },
            };
            3
        ];
        let mut v = Vec::new();
        encode_descs(&l, &mut v);
        assert_eq!(decode_descs(&v).unwrap(), l);
        v.push(0);
        assert!(decode_descs(&v).is_err());
        assert!(decode_descs(&v[..10]).is_err());
    }

    #[test]
    fn hello_round_trip_and_version() {
        let h = Hello {
            version: VERSION,
            gpu_index: 1,
            gpu_bdf: "0000:01:00.0".into(),
            net: "socket".into(),
            channels: 2,
            chunk: 1 << 20,
            nonce: [7u8; NONCE_LEN],
        };
        let mut v = Vec::new();
        h.encode(&mut v);
        assert_eq!(Hello::decode(&v).unwrap(), h);
        let mut bad = v.clone();
        bad[8] = 99; // version
        assert!(matches!(
            Hello::decode(&bad),
            Err(WireError::BadValue {
                what: "handshake version",
                ..
            })
        ));
        assert!(Hello::decode(&v[..v.len() - 1]).is_err());
    }

    #[test]
    fn handshake_messages_round_trip() {
        for m in [
            HandshakeMsg::Refuse("no".into()),
            HandshakeMsg::Proof([3u8; PROOF_LEN]),
            HandshakeMsg::Handles(vec![[9u8; NET_HANDLE_LEN]; 4]),
        ] {
            let mut v = Vec::new();
            m.encode(&mut v);
            assert!(v.len() <= MAX_HANDSHAKE_FRAME);
            assert_eq!(HandshakeMsg::decode(&v).unwrap(), m);
            assert!(HandshakeMsg::decode(&v[..v.len() - 1]).is_err() || v.len() == 1);
        }
        assert_eq!(
            HandshakeMsg::decode(&[0]).unwrap(),
            HandshakeMsg::Refuse(String::new())
        );
        assert!(HandshakeMsg::decode(&[2, 0]).is_err(), "no handles");
        assert!(HandshakeMsg::decode(&[9]).is_err());
    }

    #[test]
    fn the_pull_frame_length_is_the_encoded_length() {
        let item = RmaItem {
            token: Token { id: 1, secret: 2 },
            addr: 3,
            len: 4,
        };
        let src = vec![
            PullRun {
                gpu: true,
                key: vec![9; 113],
            },
            PullRun {
                gpu: false,
                key: vec![9; 40],
            },
        ];
        let mut v = Vec::new();
        let m = Control::WritePull {
            xfer: 1,
            items: vec![item; 5],
            runs: vec![3, 2],
            src,
        };
        m.encode(&mut v);
        assert_eq!(v.len(), pull_frame_len(5, 2, 153));
        // The frame made in place is the framed body, and reads back.
        let mut framed = Vec::new();
        write_frame(&mut framed, &v).unwrap();
        assert_eq!(m.to_frame(), framed);
        let body = read_frame(&mut &framed[..], MAX_FRAME).unwrap();
        assert_eq!(Control::decode(&body).unwrap(), m);
    }

    #[test]
    fn a_grant_carries_at_most_its_bound_of_leases_with_keys_in_bounds() {
        let lease = |n| Lease {
            token: Token { id: 1, secret: 2 },
            addr: 3,
            len: 4,
            gpu: false,
            write: false,
            key: vec![0; n],
        };
        let frame = |leases: Vec<Lease>| {
            let mut v = Vec::new();
            Control::ReadGrant {
                xfer: 1,
                src: vec![PullRun {
                    gpu: false,
                    key: vec![1; 8],
                }],
                leases,
            }
            .encode(&mut v);
            v
        };
        let ok = frame(vec![lease(8); MAX_GRANT_LEASES]);
        assert!(Control::decode(&ok).is_ok());
        assert_eq!(
            ok.len(),
            1 + 8 + 4 + 3 + 8 + leases_len(&vec![lease(8); MAX_GRANT_LEASES])
        );
        assert!(Control::decode(&frame(vec![lease(8); MAX_GRANT_LEASES + 1])).is_err());
        // A lease key longer than the bound (written by hand: the encoder cuts).
        let mut v = frame(vec![lease(8)]);
        let at = v.len() - 8 - 2;
        v[at..at + 2].copy_from_slice(&((MAX_PULL_KEY + 1) as u16).to_le_bytes());
        v.extend(std::iter::repeat_n(0, MAX_PULL_KEY + 1 - 8));
        assert!(Control::decode(&v).is_err());
        // Cut short.
        let v = frame(vec![lease(8)]);
        assert!(Control::decode(&v[..v.len() - 1]).is_err());
        // A write flag other than 0 or 1.
        let mut v = frame(vec![lease(8)]);
        let at = v.len() - 8 - 2 - 1 - 1;
        assert_eq!(v[at], 0);
        v[at] = 2;
        assert!(Control::decode(&v).is_err());
    }

    #[test]
    fn a_pull_must_describe_each_run_once_within_its_bounds() {
        let item = RmaItem {
            token: Token { id: 1, secret: 2 },
            addr: 3,
            len: 4,
        };
        let frame = |src: Vec<PullRun>| {
            let mut v = Vec::new();
            Control::WritePull {
                xfer: 1,
                items: vec![item; 2],
                runs: vec![1, 1],
                src,
            }
            .encode(&mut v);
            v
        };
        let run = |n| PullRun {
            gpu: false,
            key: vec![0; n],
        };
        assert!(Control::decode(&frame(vec![run(8), run(8)])).is_ok());
        // One run short, one too many.
        assert!(Control::decode(&frame(vec![run(8)])).is_err());
        assert!(Control::decode(&frame(vec![run(8); 3])).is_err());
        // A key longer than the bound (written by hand: the encoder cuts).
        let mut v = frame(vec![run(8), run(8)]);
        let at = v.len() - 8 - 2;
        v[at..at + 2].copy_from_slice(&((MAX_PULL_KEY + 1) as u16).to_le_bytes());
        v.extend(std::iter::repeat_n(0, MAX_PULL_KEY + 1 - 8));
        assert!(Control::decode(&v).is_err());
        // A memory kind that is neither.
        let mut v = frame(vec![run(0), run(0)]);
        let at = v.len() - 3;
        v[at] = 2;
        assert!(Control::decode(&v).is_err());
    }

    #[test]
    fn control_round_trip() {
        let item = RmaItem {
            token: Token { id: 1, secret: 2 },
            addr: 3,
            len: 4,
        };
        for m in [
            Control::KeepAlive,
            Control::WriteReq {
                xfer: 1,
                items: vec![item; 3],
                runs: vec![2, 1],
            },
            Control::WritePull {
                xfer: 7,
                items: vec![item; 3],
                runs: vec![2, 1],
                src: vec![
                    PullRun {
                        gpu: false,
                        key: vec![1; 17],
                    },
                    PullRun {
                        gpu: true,
                        key: vec![],
                    },
                ],
            },
            Control::WriteCts { xfer: 2 },
            Control::WriteDone { xfer: 3 },
            Control::ReadOffer {
                xfer: 10,
                items: vec![item; 3],
                runs: vec![1, 2],
                dst_gpu: vec![true, false],
            },
            Control::ReadGrant {
                xfer: 11,
                src: vec![
                    PullRun {
                        gpu: false,
                        key: vec![3; 20],
                    };
                    2
                ],
                leases: vec![],
            },
            Control::ReadGrant {
                xfer: 13,
                src: vec![PullRun {
                    gpu: true,
                    key: vec![4; 9],
                }],
                leases: vec![
                    Lease {
                        token: Token { id: 5, secret: 6 },
                        addr: 7,
                        len: 8,
                        gpu: true,
                        write: false,
                        key: vec![9; 30],
                    },
                    Lease {
                        token: Token { id: 10, secret: 11 },
                        addr: 12,
                        len: 13,
                        gpu: false,
                        write: true,
                        key: vec![],
                    },
                ],
            },
            Control::Leases {
                leases: vec![Lease {
                    token: Token { id: 18, secret: 19 },
                    addr: 20,
                    len: 21,
                    gpu: false,
                    write: true,
                    key: vec![22; 8],
                }],
            },
            Control::ReadDone { xfer: 12 },
            Control::Revoke {
                token: Token { id: 14, secret: 15 },
            },
            Control::Revoked {
                token: Token { id: 16, secret: 17 },
            },
            Control::ReadReq {
                xfer: 4,
                items: vec![item],
                runs: vec![1],
            },
            Control::ReadAck { xfer: 5 },
            Control::Refused {
                xfer: 6,
                reason: "no".into(),
            },
            Control::Close,
            Control::Notif {
                name: "host-a:4242".into(),
                msg: b"kv blocks 1-7 ready".to_vec(),
            },
            Control::Notif {
                name: String::new(),
                msg: vec![],
            },
            Control::WriteInline {
                xfer: 7,
                items: vec![item; 2],
                runs: vec![2],
                len: 8,
            },
            Control::ReadInline {
                xfer: 8,
                items: vec![item],
                runs: vec![1],
            },
            Control::ReadData { xfer: 9, len: 4 },
            Control::MsgDone { count: 10 },
        ] {
            let mut v = Vec::new();
            m.encode(&mut v);
            assert_eq!(Control::decode(&v).unwrap(), m);
            assert!(Control::decode(&v[..v.len() - 1]).is_err() || v.len() == 1);
        }
        assert!(Control::decode(&[200]).is_err());
        assert!(Control::decode(&[]).is_err());
        // an item count larger than the bytes that follow
        let mut v = vec![T_WRITE_REQ];
        v.extend_from_slice(&1u64.to_le_bytes());
        v.extend_from_slice(&1000u32.to_le_bytes());
        assert!(Control::decode(&v).is_err());
        // runs that do not cover the items exactly, or hold an empty run
        for runs in [vec![1, 1], vec![4], vec![3, 0], vec![]] {
            let mut v = Vec::new();
            Control::WriteReq {
                xfer: 1,
                items: vec![item; 3],
                runs: runs.clone(),
            }
            .encode(&mut v);
            assert!(Control::decode(&v).is_err(), "runs {runs:?} accepted");
        }
    }

    #[test]
    fn inline_messages_fixed_bytes_and_bounds() {
        let item = RmaItem {
            token: Token { id: 1, secret: 2 },
            addr: 3,
            len: 4,
        };
        let mut v = Vec::new();
        Control::WriteInline {
            xfer: 0x0102,
            items: vec![item],
            runs: vec![1],
            len: 4,
        }
        .encode(&mut v);
        let mut want = vec![10u8];
        want.extend_from_slice(&0x0102u64.to_le_bytes());
        want.extend_from_slice(&1u32.to_le_bytes());
        for x in [1u64, 2, 3, 4] {
            want.extend_from_slice(&x.to_le_bytes());
        }
        want.extend_from_slice(&1u32.to_le_bytes());
        want.extend_from_slice(&1u32.to_le_bytes());
        want.extend_from_slice(&4u32.to_le_bytes());
        assert_eq!(v, want);
        assert_eq!(Control::decode(&v).unwrap().payload_len(), 4);
        let mut v = Vec::new();
        Control::ReadData { xfer: 5, len: 16 }.encode(&mut v);
        let mut want = vec![12u8];
        want.extend_from_slice(&5u64.to_le_bytes());
        want.extend_from_slice(&16u32.to_le_bytes());
        assert_eq!(v, want);
        let mut v = Vec::new();
        Control::ReadInline {
            xfer: 6,
            items: vec![item],
            runs: vec![1],
        }
        .encode(&mut v);
        assert_eq!(v[0], 11);
        assert_eq!(Control::decode(&v).unwrap().payload_len(), 0);
        // A payload claim over the inline bound is malformed.
        for m in [
            Control::ReadData {
                xfer: 1,
                len: MAX_INLINE as u32 + 1,
            },
            Control::WriteInline {
                xfer: 1,
                items: vec![item],
                runs: vec![1],
                len: u32::MAX,
            },
        ] {
            let mut v = Vec::new();
            m.encode(&mut v);
            assert!(matches!(
                Control::decode(&v),
                Err(WireError::BadLength {
                    what: "inline payload",
                    ..
                })
            ));
        }
        // Trailing bytes after the length are rejected too.
        let mut v = Vec::new();
        Control::ReadData { xfer: 1, len: 1 }.encode(&mut v);
        v.push(0);
        assert!(Control::decode(&v).is_err());
    }

    #[test]
    fn run_lengths_sum_items_and_catch_overflow() {
        let it = |len| RmaItem {
            token: Token { id: 1, secret: 2 },
            addr: 0,
            len,
        };
        let items = [it(1), it(2), it(4), it(8)];
        assert_eq!(run_lengths(&items, &[1, 3]), Some(vec![1, 14]));
        assert_eq!(run_lengths(&items, &[4]), Some(vec![15]));
        assert_eq!(run_lengths(&[it(u64::MAX), it(1)], &[2]), None);
        assert_eq!(run_lengths(&items, &[5]), None);
    }

    #[test]
    fn random_bytes_never_panic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..20_000 {
            let n = rng.random_range(0..300);
            let b: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            let _ = Metadata::decode(&b);
            let _ = FifoItem::decode(&b);
            let _ = decode_descs(&b);
            let _ = Hello::decode(&b);
            let _ = HandshakeMsg::decode(&b);
            let _ = Control::decode(&b);
        }
    }

    #[test]
    fn notif_fixed_bytes_and_limits() {
        let m = Control::Notif {
            name: "ab".into(),
            msg: vec![1, 2, 3],
        };
        let mut v = Vec::new();
        m.encode(&mut v);
        assert_eq!(v, [T_NOTIF, 2, 0, b'a', b'b', 3, 0, 0, 0, 1, 2, 3]);
        assert_eq!(Control::decode(&v).unwrap(), m);
        // the largest message round-trips; one byte more is refused
        let big = Control::Notif {
            name: "x".repeat(MAX_NOTIF_NAME),
            msg: vec![7; MAX_NOTIF],
        };
        let mut v = Vec::new();
        big.encode(&mut v);
        assert!(v.len() <= MAX_FRAME);
        assert_eq!(Control::decode(&v).unwrap(), big);
        let mut over = vec![T_NOTIF, 0, 0];
        over.extend_from_slice(&(MAX_NOTIF as u32 + 1).to_le_bytes());
        over.extend(std::iter::repeat_n(0u8, MAX_NOTIF + 1));
        assert!(matches!(
            Control::decode(&over),
            Err(WireError::BadLength {
                what: "notification",
                ..
            })
        ));
        // a name over the limit, a length past the bytes, trailing bytes
        let mut long = vec![T_NOTIF];
        long.extend_from_slice(&(MAX_NOTIF_NAME as u16 + 1).to_le_bytes());
        long.extend(std::iter::repeat_n(b'n', MAX_NOTIF_NAME + 1));
        long.extend_from_slice(&0u32.to_le_bytes());
        assert!(Control::decode(&long).is_err());
        assert!(Control::decode(&[T_NOTIF, 0, 0, 9, 0, 0, 0, 1]).is_err());
        assert!(Control::decode(&[T_NOTIF, 0, 0, 0, 0, 0, 0, 5]).is_err());
    }
}
