//! Byte formats of the same-host path, as pure functions over the crate's
//! checked [`Reader`]: the opaque IPC descriptor `advertise_ipc` hands out,
//! the handshake on the Unix socket, and the control messages after it.
//! Decoders never panic and reject trailing bytes.

use crate::{Reader, Token, WireError};

/// `"TXIP"`, little-endian: the first four bytes of an IPC descriptor.
pub const IPC_MAGIC: u32 = 0x5049_5854;
/// Version of the IPC descriptor layout.
pub const IPC_VERSION: u8 = 1;
/// Length of an encoded [`IpcDesc`].
pub const IPC_DESC_LEN: usize = 56;

/// Where an advertised range lives, as the advertiser saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Host,
    /// Device memory of the advertiser's GPU with this ordinal.
    Gpu(i32),
}

/// What `advertise_ipc` returns (opaque to applications): a token naming the
/// advertiser's record and the range the record covers. The advertiser checks
/// every request against its record, never against these bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcDesc {
    pub placement: Placement,
    pub token: Token,
    pub addr: u64,
    pub len: u64,
    /// The advertising endpoint's random identity (catches use on a
    /// connection to another endpoint before a round trip).
    pub owner: u64,
}

impl IpcDesc {
    /// `magic u32 | version u8 | kind u8 (0 host, 1 GPU) | 0u16 | gpu i32 |
    /// 0u32 | token id u64 | secret u64 | addr u64 | len u64 | owner u64`,
    /// little-endian, 56 bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (kind, gpu) = match self.placement {
            Placement::Host => (0u8, -1i32),
            Placement::Gpu(g) => (1u8, g),
        };
        out.extend_from_slice(&IPC_MAGIC.to_le_bytes());
        out.push(IPC_VERSION);
        out.push(kind);
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&gpu.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for v in [
            self.token.id,
            self.token.secret,
            self.addr,
            self.len,
            self.owner,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    pub fn to_bytes(self) -> Vec<u8> {
        let mut v = Vec::with_capacity(IPC_DESC_LEN);
        self.encode(&mut v);
        v
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "IPC descriptor";
        if b.len() != IPC_DESC_LEN {
            return Err(WireError::BadLength {
                what: WHAT,
                len: b.len(),
            });
        }
        let mut r = Reader::new(b, WHAT);
        let magic = r.u32_le()?;
        if magic != IPC_MAGIC {
            return Err(WireError::BadValue {
                what: "IPC descriptor magic",
                value: magic as u64,
            });
        }
        let version = r.u8()?;
        if version != IPC_VERSION {
            return Err(WireError::BadValue {
                what: "IPC descriptor version",
                value: version as u64,
            });
        }
        let kind = r.u8()?;
        let pad = r.u16_le()?;
        let gpu = r.i32_le()?;
        let pad2 = r.u32_le()?;
        if pad != 0 || pad2 != 0 {
            return Err(WireError::BadValue {
                what: "IPC descriptor reserved bytes",
                value: (pad as u64) | ((pad2 as u64) << 16),
            });
        }
        let placement = match (kind, gpu) {
            (0, -1) => Placement::Host,
            (1, g) if g >= 0 => Placement::Gpu(g),
            _ => {
                return Err(WireError::BadValue {
                    what: "IPC descriptor kind",
                    value: kind as u64,
                })
            }
        };
        let token = Token {
            id: r.u64_le()?,
            secret: r.u64_le()?,
        };
        let addr = r.u64_le()?;
        let len = r.u64_le()?;
        let owner = r.u64_le()?;
        r.finish()?;
        if addr.checked_add(len).is_none() {
            return Err(WireError::BadValue {
                what: "IPC descriptor range",
                value: len,
            });
        }
        Ok(IpcDesc {
            placement,
            token,
            addr,
            len,
            owner,
        })
    }
}

/// `"TCPXLOC1"`: the first field of the same-host handshake.
pub const LOCAL_MAGIC: u64 = 0x3143_4f4c_5850_4354;
pub const LOCAL_VERSION: u16 = 1;

/// The same-host handshake, sent by each side once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalHello {
    pub version: u16,
    /// Digest of the shared secret (the TCP handshake's rule).
    pub auth: u64,
    pub gpu_index: i32,
    pub gpu_bdf: String,
    /// The endpoint's random identity (refuses a connection to itself).
    pub nonce: u64,
}

impl LocalHello {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&LOCAL_MAGIC.to_le_bytes());
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.auth.to_le_bytes());
        out.extend_from_slice(&self.gpu_index.to_le_bytes());
        put_str(out, &self.gpu_bdf);
        out.extend_from_slice(&self.nonce.to_le_bytes());
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(b, "same-host handshake");
        let magic = r.u64_le()?;
        if magic != LOCAL_MAGIC {
            return Err(WireError::BadValue {
                what: "same-host handshake magic",
                value: magic,
            });
        }
        let version = r.u16_le()?;
        if version != LOCAL_VERSION {
            return Err(WireError::BadValue {
                what: "same-host handshake version",
                value: version as u64,
            });
        }
        let h = LocalHello {
            version,
            auth: r.u64_le()?,
            gpu_index: r.i32_le()?,
            gpu_bdf: r.string(64)?,
            nonce: r.u64_le()?,
        };
        r.finish()?;
        Ok(h)
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let b = &s.as_bytes()[..s.len().min(MAX_REASON)];
    out.extend_from_slice(&(b.len() as u16).to_le_bytes());
    out.extend_from_slice(b);
}

/// Which record a request's token names on the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    /// An `advertise_ipc` record of this connection (or a posted receive).
    Ipc,
    /// A registry advertisement (`advertise`, `register_memory`).
    Registry,
}

/// One range of a one-sided request: `len` bytes at `addr` of the target's
/// record `token`, and the requester's own address `peer` for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReqItem {
    pub space: Space,
    pub token: Token,
    pub addr: u64,
    pub len: u64,
    pub peer: u64,
}

/// How the requester may reach one GPU range of the target: the CUDA IPC
/// handle of its allocation and the range's offset in it (or, between two
/// endpoints of one process, the address itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    pub handle: [u8; 64],
    /// CUDA's id of the allocation (a freed and reused address gets a new one).
    pub buffer_id: u64,
    pub offset: u64,
    /// Non-zero between endpoints of one process: the range's address.
    pub direct: u64,
    pub gpu: i32,
    /// The whole range of the target's record holding this range (the
    /// requester may cache the export for exactly that range).
    pub record_addr: u64,
    pub record_len: u64,
}

pub const MAX_ITEMS: usize = 4096;
pub const MAX_REASON: usize = 1024;
/// Largest control frame: a request or answer of `MAX_ITEMS` items.
pub const MAX_MSG: usize = 64 + MAX_ITEMS * 116 + MAX_REASON;

/// Control messages after the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalMsg {
    /// Requester → target: write into (or read from) these ranges.
    Req {
        op: u64,
        read: bool,
        items: Vec<ReqItem>,
    },
    /// Target → requester: the host ranges are done; GPU ranges are the
    /// requester's to copy through their exports.
    Done {
        op: u64,
        exports: Vec<Option<Export>>,
    },
    /// Target → requester: refused (or failed) before or while copying.
    Refused { op: u64, reason: String },
    /// Receiver → sender: a receive was posted into this one-shot record.
    RecvPosted { token: Token, addr: u64, len: u64 },
    /// Sender → receiver: the data of a send into a GPU receive landed
    /// (or did not).
    Landed {
        token: Token,
        ok: bool,
        reason: String,
    },
}

impl LocalMsg {
    pub fn encode(&self, out: &mut Vec<u8>) {
        let u64s = |out: &mut Vec<u8>, vs: &[u64]| {
            for v in vs {
                out.extend_from_slice(&v.to_le_bytes());
            }
        };
        match self {
            LocalMsg::Req { op, read, items } => {
                out.push(1);
                u64s(out, &[*op]);
                out.push(*read as u8);
                out.extend_from_slice(&(items.len() as u32).to_le_bytes());
                for it in items {
                    out.push(match it.space {
                        Space::Ipc => 0,
                        Space::Registry => 1,
                    });
                    u64s(
                        out,
                        &[it.token.id, it.token.secret, it.addr, it.len, it.peer],
                    );
                }
            }
            LocalMsg::Done { op, exports } => {
                out.push(2);
                u64s(out, &[*op]);
                out.extend_from_slice(&(exports.len() as u32).to_le_bytes());
                for e in exports {
                    match e {
                        None => out.push(0),
                        Some(e) => {
                            out.push(1);
                            out.extend_from_slice(&e.handle);
                            u64s(out, &[e.buffer_id, e.offset, e.direct]);
                            out.extend_from_slice(&e.gpu.to_le_bytes());
                            u64s(out, &[e.record_addr, e.record_len]);
                        }
                    }
                }
            }
            LocalMsg::Refused { op, reason } => {
                out.push(3);
                u64s(out, &[*op]);
                put_str(out, reason);
            }
            LocalMsg::RecvPosted { token, addr, len } => {
                out.push(4);
                u64s(out, &[token.id, token.secret, *addr, *len]);
            }
            LocalMsg::Landed { token, ok, reason } => {
                out.push(5);
                u64s(out, &[token.id, token.secret]);
                out.push(*ok as u8);
                put_str(out, reason);
            }
        }
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(b, "same-host control message");
        let flag = |v: u8, what: &'static str| match v {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(WireError::BadValue {
                what,
                value: v as u64,
            }),
        };
        let count = |r: &mut Reader<'_>, what: &'static str| {
            let n = r.u32_le()? as usize;
            if n > MAX_ITEMS {
                return Err(WireError::BadLength { what, len: n });
            }
            Ok(n)
        };
        let m = match r.u8()? {
            1 => {
                let op = r.u64_le()?;
                let read = flag(r.u8()?, "request direction")?;
                let n = count(&mut r, "request items")?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    let space = match r.u8()? {
                        0 => Space::Ipc,
                        1 => Space::Registry,
                        v => {
                            return Err(WireError::BadValue {
                                what: "request item space",
                                value: v as u64,
                            })
                        }
                    };
                    items.push(ReqItem {
                        space,
                        token: Token {
                            id: r.u64_le()?,
                            secret: r.u64_le()?,
                        },
                        addr: r.u64_le()?,
                        len: r.u64_le()?,
                        peer: r.u64_le()?,
                    });
                }
                LocalMsg::Req { op, read, items }
            }
            2 => {
                let op = r.u64_le()?;
                let n = count(&mut r, "answer items")?;
                let mut exports = Vec::with_capacity(n);
                for _ in 0..n {
                    if flag(r.u8()?, "export present")? {
                        let mut handle = [0u8; 64];
                        handle.copy_from_slice(r.take(64)?);
                        exports.push(Some(Export {
                            handle,
                            buffer_id: r.u64_le()?,
                            offset: r.u64_le()?,
                            direct: r.u64_le()?,
                            gpu: r.i32_le()?,
                            record_addr: r.u64_le()?,
                            record_len: r.u64_le()?,
                        }));
                    } else {
                        exports.push(None);
                    }
                }
                LocalMsg::Done { op, exports }
            }
            3 => LocalMsg::Refused {
                op: r.u64_le()?,
                reason: r.string(MAX_REASON)?,
            },
            4 => LocalMsg::RecvPosted {
                token: Token {
                    id: r.u64_le()?,
                    secret: r.u64_le()?,
                },
                addr: r.u64_le()?,
                len: r.u64_le()?,
            },
            5 => LocalMsg::Landed {
                token: Token {
                    id: r.u64_le()?,
                    secret: r.u64_le()?,
                },
                ok: flag(r.u8()?, "landed flag")?,
                reason: r.string(MAX_REASON)?,
            },
            t => {
                return Err(WireError::BadValue {
                    what: "same-host control message type",
                    value: t as u64,
                })
            }
        };
        r.finish()?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn sample() -> IpcDesc {
        IpcDesc {
            placement: Placement::Gpu(3),
            token: Token {
                id: 0x0102_0304_0506_0708,
                secret: 0x1112_1314_1516_1718,
            },
            addr: 0x7f00_0000_1000,
            len: 4096,
            owner: 0xa1a2_a3a4_a5a6_a7a8,
        }
    }

    #[test]
    fn ipc_desc_fixed_bytes() {
        let b = sample().to_bytes();
        assert_eq!(b.len(), IPC_DESC_LEN);
        let want: Vec<u8> = [
            &b"TXIP"[..],
            &[1, 1, 0, 0],
            &3i32.to_le_bytes(),
            &[0, 0, 0, 0],
            &[8, 7, 6, 5, 4, 3, 2, 1],
            &[0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11],
            &0x7f00_0000_1000u64.to_le_bytes(),
            &4096u64.to_le_bytes(),
            &[0xa8, 0xa7, 0xa6, 0xa5, 0xa4, 0xa3, 0xa2, 0xa1],
        ]
        .concat();
        assert_eq!(b, want);
        assert_eq!(IpcDesc::decode(&b).unwrap(), sample());
        let host = IpcDesc {
            placement: Placement::Host,
            ..sample()
        };
        let hb = host.to_bytes();
        assert_eq!(&hb[4..12], &[1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(IpcDesc::decode(&hb).unwrap(), host);
    }

    #[test]
    fn ipc_desc_rejects() {
        let b = sample().to_bytes();
        assert!(IpcDesc::decode(&b[..55]).is_err());
        let mut long = b.clone();
        long.push(0);
        assert!(IpcDesc::decode(&long).is_err());
        // A 64-byte FIFO item is not an IPC descriptor.
        assert!(IpcDesc::decode(&[0u8; 64]).is_err());
        let bad = |i: usize, v: u8| {
            let mut c = b.clone();
            c[i] = v;
            IpcDesc::decode(&c).is_err()
        };
        assert!(bad(0, b'X'), "magic");
        assert!(bad(4, 2), "version");
        assert!(bad(5, 2), "kind");
        assert!(bad(6, 1), "reserved");
        assert!(bad(12, 1), "reserved");
        // GPU kind with a negative ordinal; host kind with an ordinal.
        let mut c = b.clone();
        c[8..12].copy_from_slice(&(-1i32).to_le_bytes());
        assert!(IpcDesc::decode(&c).is_err());
        let mut c = b.clone();
        c[5] = 0;
        assert!(IpcDesc::decode(&c).is_err());
        // A range that wraps.
        let wrap = IpcDesc {
            addr: u64::MAX - 10,
            len: 11,
            ..sample()
        };
        assert!(IpcDesc::decode(&wrap.to_bytes()).is_err());
    }

    /// Seeded random descriptors round-trip; random bytes and flipped
    /// descriptors decode or fail without panicking, and whatever decodes
    /// re-encodes to the same bytes.
    #[test]
    fn ipc_desc_seeded_fuzz() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x7c9);
        for _ in 0..2000 {
            let addr: u64 = rng.random::<u64>() >> 1;
            let d = IpcDesc {
                placement: if rng.random() {
                    Placement::Host
                } else {
                    Placement::Gpu(rng.random_range(0..64))
                },
                token: Token {
                    id: rng.random(),
                    secret: rng.random(),
                },
                addr,
                len: rng.random_range(0..(1u64 << 40)),
                owner: rng.random(),
            };
            let b = d.to_bytes();
            assert_eq!(IpcDesc::decode(&b).unwrap(), d);
            let mut f = b.clone();
            let i = rng.random_range(0..f.len());
            f[i] ^= 1 << rng.random_range(0..8);
            if let Ok(d2) = IpcDesc::decode(&f) {
                assert_eq!(d2.to_bytes(), f);
            }
            let n = rng.random_range(0..80);
            let junk: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            if let Ok(d2) = IpcDesc::decode(&junk) {
                assert_eq!(d2.to_bytes(), junk);
            }
            let _ = LocalMsg::decode(&junk);
            let _ = LocalHello::decode(&junk);
        }
    }

    #[test]
    fn hello_round_trip() {
        let h = LocalHello {
            version: LOCAL_VERSION,
            auth: 77,
            gpu_index: 2,
            gpu_bdf: "0000:4a:00.0".into(),
            nonce: 99,
        };
        let mut v = Vec::new();
        h.encode(&mut v);
        assert_eq!(&v[..8], b"TCPXLOC1");
        assert_eq!(LocalHello::decode(&v).unwrap(), h);
        let mut bad = v.clone();
        bad[8] = 9;
        assert!(LocalHello::decode(&bad).is_err(), "version");
        v.push(0);
        assert!(LocalHello::decode(&v).is_err(), "trailing");
    }

    #[test]
    fn messages_round_trip() {
        let t = Token { id: 5, secret: 6 };
        let all = vec![
            LocalMsg::Req {
                op: 1,
                read: true,
                items: vec![
                    ReqItem {
                        space: Space::Ipc,
                        token: t,
                        addr: 10,
                        len: 20,
                        peer: 30,
                    },
                    ReqItem {
                        space: Space::Registry,
                        token: t,
                        addr: 11,
                        len: 21,
                        peer: 31,
                    },
                ],
            },
            LocalMsg::Done {
                op: 2,
                exports: vec![
                    None,
                    Some(Export {
                        handle: [7; 64],
                        buffer_id: 8,
                        offset: 9,
                        direct: 0,
                        gpu: 1,
                        record_addr: 10,
                        record_len: 11,
                    }),
                ],
            },
            LocalMsg::Refused {
                op: 3,
                reason: "no".into(),
            },
            LocalMsg::RecvPosted {
                token: t,
                addr: 1,
                len: 2,
            },
            LocalMsg::Landed {
                token: t,
                ok: false,
                reason: "too big".into(),
            },
        ];
        for m in all {
            let mut v = Vec::new();
            m.encode(&mut v);
            assert!(v.len() <= MAX_MSG);
            assert_eq!(LocalMsg::decode(&v).unwrap(), m);
            v.push(0);
            assert!(LocalMsg::decode(&v).is_err(), "trailing");
        }
        // Fixed bytes of one message.
        let mut v = Vec::new();
        LocalMsg::Refused {
            op: 0x0102,
            reason: "x".into(),
        }
        .encode(&mut v);
        assert_eq!(v, [3, 2, 1, 0, 0, 0, 0, 0, 0, 1, 0, b'x']);
        // Bounds: unknown type, too many items, bad flags.
        assert!(LocalMsg::decode(&[9]).is_err());
        let mut v = vec![1];
        v.extend_from_slice(&0u64.to_le_bytes());
        v.push(0);
        v.extend_from_slice(&((MAX_ITEMS + 1) as u32).to_le_bytes());
        assert!(LocalMsg::decode(&v).is_err());
        let mut v = vec![1];
        v.extend_from_slice(&0u64.to_le_bytes());
        v.push(2);
        v.extend_from_slice(&0u32.to_le_bytes());
        assert!(LocalMsg::decode(&v).is_err());
    }
}
