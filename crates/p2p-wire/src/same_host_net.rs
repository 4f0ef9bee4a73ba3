//! Byte formats of the same-host net (`tcpx_p2p::net` `same-host`): its
//! listen handle and the messages on a comm's Unix channel. A sender
//! publishes each send it posts ([`NetMsg::Send`]: its segments, with the
//! CUDA IPC export of each GPU one); the receiver pairs it with its own
//! next posted receive and either makes the one copy itself and answers
//! [`NetMsg::Done`], or, where only the sender can copy (host memory into
//! the receiver's GPU memory), answers [`NetMsg::Push`] with the exports of
//! its own segments, which the sender copies into and confirms with
//! [`NetMsg::Pushed`]. Decoders never panic and reject trailing bytes.

use crate::same_host::Export;
use crate::{put_string, Reader, WireError};

/// `"TXSN"`, little-endian: the first four bytes of a listen handle.
pub const HANDLE_MAGIC: u32 = 0x4e53_5854;
/// Version of the handle and message layouts.
pub const NET_VERSION: u8 = 1;
/// Most segments one message may carry.
pub const MAX_SEGS: usize = 1024;
/// Longest reason in a [`NetMsg::Refused`].
pub const MAX_REASON: usize = 512;
/// Bytes of one encoded segment with an export.
const SEG_MAX: usize = 17 + 64 + 8 * 3 + 4;
/// Largest message body.
pub const MAX_FRAME: usize = 32 + MAX_SEGS * SEG_MAX + MAX_REASON;

/// What a listen comm hands its peer: the listener's name (an abstract
/// Unix socket `tcpx-p2p-net:<uid>:<name>`, the uid the connector's own)
/// and a secret the connector proves it holds in its hello (abstract names
/// are visible to every process; the secret travels only in the handle,
/// over the connection's authenticated control channel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetHandleV1 {
    pub name: u64,
    pub secret: u64,
    /// The listener's uid, as it said (the connector trusts the kernel).
    pub uid: u32,
}

impl NetHandleV1 {
    /// `magic u32 | version u8 | 0u8 ×3 | uid u32 | name u64 | secret u64`,
    /// little-endian, zero-padded to `n` bytes.
    pub fn encode<const N: usize>(&self) -> [u8; N] {
        let mut v = Vec::with_capacity(N);
        v.extend_from_slice(&HANDLE_MAGIC.to_le_bytes());
        v.extend_from_slice(&[NET_VERSION, 0, 0, 0]);
        v.extend_from_slice(&self.uid.to_le_bytes());
        v.extend_from_slice(&self.name.to_le_bytes());
        v.extend_from_slice(&self.secret.to_le_bytes());
        let mut out = [0u8; N];
        let n = v.len().min(N);
        out[..n].copy_from_slice(&v[..n]);
        out
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "same-host listen handle";
        let mut r = Reader::new(b, WHAT);
        let magic = r.u32_le()?;
        if magic != HANDLE_MAGIC {
            return Err(WireError::BadValue {
                what: WHAT,
                value: magic as u64,
            });
        }
        let version = r.u8()?;
        if version != NET_VERSION {
            return Err(WireError::BadValue {
                what: "same-host listen handle version",
                value: version as u64,
            });
        }
        if r.take(3)? != [0, 0, 0] {
            return Err(WireError::BadValue {
                what: "same-host listen handle padding",
                value: 1,
            });
        }
        let uid = r.u32_le()?;
        let name = r.u64_le()?;
        let secret = r.u64_le()?;
        if r.take(r.remaining())?.iter().any(|&x| x != 0) {
            return Err(WireError::BadValue {
                what: "same-host listen handle padding",
                value: 1,
            });
        }
        Ok(NetHandleV1 { name, secret, uid })
    }
}

/// One segment of a posted send or receive: `len` bytes at `addr` of the
/// publisher's memory, and, for GPU memory, how the peer maps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seg {
    pub addr: u64,
    pub len: u64,
    pub export: Option<Export>,
}

/// The messages on a same-host comm's channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetMsg {
    /// Connector → listener, first: the handle's secret.
    Hello { secret: u64 },
    /// Sender → receiver: the send numbered `seq` (0, 1, … per comm) was
    /// posted with these segments; they stay valid until it completes.
    Send { seq: u64, segs: Vec<Seg> },
    /// Receiver → sender: send `seq` landed, `len` bytes.
    Done { seq: u64, len: u64 },
    /// Either way: the pair `seq` failed; nothing more moves for it.
    Refused { seq: u64, reason: String },
    /// Receiver → sender: copy send `seq` into these segments of ours.
    Push { seq: u64, segs: Vec<Seg> },
    /// Sender → receiver: the pushed copy of send `seq` landed.
    Pushed { seq: u64 },
}

fn put_segs(out: &mut Vec<u8>, segs: &[Seg]) {
    out.extend_from_slice(&(segs.len() as u32).to_le_bytes());
    for s in segs {
        out.extend_from_slice(&s.addr.to_le_bytes());
        out.extend_from_slice(&s.len.to_le_bytes());
        match &s.export {
            None => out.push(0),
            Some(e) => {
                out.push(1);
                out.extend_from_slice(&e.handle);
                for v in [e.buffer_id, e.offset, e.direct] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.extend_from_slice(&e.gpu.to_le_bytes());
            }
        }
    }
}

fn get_segs(r: &mut Reader<'_>) -> Result<Vec<Seg>, WireError> {
    let n = r.u32_le()? as usize;
    if n == 0 || n > MAX_SEGS {
        return Err(WireError::BadLength {
            what: "same-host segments",
            len: n,
        });
    }
    let mut segs = Vec::with_capacity(n);
    for _ in 0..n {
        let addr = r.u64_le()?;
        let len = r.u64_le()?;
        if addr.checked_add(len).is_none() {
            return Err(WireError::BadValue {
                what: "same-host segment end",
                value: addr,
            });
        }
        let export = match r.u8()? {
            0 => None,
            1 => {
                let mut handle = [0u8; 64];
                handle.copy_from_slice(r.take(64)?);
                Some(Export {
                    handle,
                    buffer_id: r.u64_le()?,
                    offset: r.u64_le()?,
                    direct: r.u64_le()?,
                    gpu: r.i32_le()?,
                    record_addr: 0,
                    record_len: 0,
                })
            }
            v => {
                return Err(WireError::BadValue {
                    what: "same-host segment export flag",
                    value: v as u64,
                })
            }
        };
        segs.push(Seg { addr, len, export });
    }
    Ok(segs)
}

/// A range of a comm's memory its peer may pull from (the engine's pull
/// key): one segment, encoded as in a message.
pub fn encode_pull_key(seg: &Seg) -> Vec<u8> {
    let mut v = Vec::with_capacity(SEG_MAX);
    put_segs(&mut v, std::slice::from_ref(seg));
    v
}

/// The segment of a pull key; exactly one, nothing after it.
pub fn decode_pull_key(b: &[u8]) -> Result<Seg, WireError> {
    let mut r = Reader::new(b, "same-host pull key");
    let mut segs = get_segs(&mut r)?;
    r.finish()?;
    match (segs.pop(), segs.is_empty()) {
        (Some(s), true) => Ok(s),
        _ => Err(WireError::BadLength {
            what: "same-host pull key segments",
            len: segs.len() + 1,
        }),
    }
}

impl NetMsg {
    /// The body (the channel prefixes each with its u32 length).
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            NetMsg::Hello { secret } => {
                out.push(1);
                out.push(NET_VERSION);
                out.extend_from_slice(&secret.to_le_bytes());
            }
            NetMsg::Send { seq, segs } => {
                out.push(2);
                out.extend_from_slice(&seq.to_le_bytes());
                put_segs(out, segs);
            }
            NetMsg::Done { seq, len } => {
                out.push(3);
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            NetMsg::Refused { seq, reason } => {
                out.push(4);
                out.extend_from_slice(&seq.to_le_bytes());
                let cut = reason
                    .char_indices()
                    .map(|(i, c)| i + c.len_utf8())
                    .take_while(|&e| e <= MAX_REASON)
                    .last()
                    .unwrap_or(0);
                put_string(out, &reason[..cut]);
            }
            NetMsg::Push { seq, segs } => {
                out.push(5);
                out.extend_from_slice(&seq.to_le_bytes());
                put_segs(out, segs);
            }
            NetMsg::Pushed { seq } => {
                out.push(6);
                out.extend_from_slice(&seq.to_le_bytes());
            }
        }
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(b, "same-host net message");
        let m = match r.u8()? {
            1 => {
                let v = r.u8()?;
                if v != NET_VERSION {
                    return Err(WireError::BadValue {
                        what: "same-host net version",
                        value: v as u64,
                    });
                }
                NetMsg::Hello {
                    secret: r.u64_le()?,
                }
            }
            2 => NetMsg::Send {
                seq: r.u64_le()?,
                segs: get_segs(&mut r)?,
            },
            3 => NetMsg::Done {
                seq: r.u64_le()?,
                len: r.u64_le()?,
            },
            4 => NetMsg::Refused {
                seq: r.u64_le()?,
                reason: r.string(MAX_REASON)?,
            },
            5 => NetMsg::Push {
                seq: r.u64_le()?,
                segs: get_segs(&mut r)?,
            },
            6 => NetMsg::Pushed { seq: r.u64_le()? },
            t => {
                return Err(WireError::BadValue {
                    what: "same-host net message type",
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

    fn export() -> Export {
        Export {
            handle: [7; 64],
            buffer_id: 9,
            offset: 4096,
            direct: 0,
            gpu: 1,
            record_addr: 0,
            record_len: 0,
        }
    }

    fn samples() -> Vec<NetMsg> {
        let segs = vec![
            Seg {
                addr: 0x1000,
                len: 64,
                export: None,
            },
            Seg {
                addr: 0x7f00_0000,
                len: 1 << 20,
                export: Some(export()),
            },
        ];
        vec![
            NetMsg::Hello { secret: 0xdead },
            NetMsg::Send {
                seq: 3,
                segs: segs.clone(),
            },
            NetMsg::Done { seq: 3, len: 1088 },
            NetMsg::Refused {
                seq: 4,
                reason: "too long".into(),
            },
            NetMsg::Push { seq: 5, segs },
            NetMsg::Pushed { seq: 5 },
        ]
    }

    #[test]
    fn messages_round_trip_and_reject_trailing() {
        for m in samples() {
            let mut b = Vec::new();
            m.encode(&mut b);
            assert!(b.len() <= MAX_FRAME);
            assert_eq!(NetMsg::decode(&b).unwrap(), m);
            b.push(0);
            assert!(NetMsg::decode(&b).is_err());
        }
        // A long reason is cut to the limit, on a character boundary.
        let mut b = Vec::new();
        NetMsg::Refused {
            seq: 1,
            reason: "é".repeat(MAX_REASON),
        }
        .encode(&mut b);
        let NetMsg::Refused { reason, .. } = NetMsg::decode(&b).unwrap() else {
            panic!("not a refusal")
        };
        assert!(reason.len() <= MAX_REASON && reason.chars().all(|c| c == 'é'));
    }

    #[test]
    fn bad_segments_are_refused() {
        let enc = |segs: Vec<Seg>| {
            let mut b = Vec::new();
            NetMsg::Send { seq: 0, segs }.encode(&mut b);
            b
        };
        // No segments; a segment that wraps the address space.
        assert!(NetMsg::decode(&enc(vec![])).is_err());
        assert!(NetMsg::decode(&enc(vec![Seg {
            addr: u64::MAX - 3,
            len: 8,
            export: None
        }]))
        .is_err());
        // Too many segments (the count alone says so).
        let mut b = vec![2];
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&(MAX_SEGS as u32 + 1).to_le_bytes());
        assert!(NetMsg::decode(&b).is_err());
    }

    #[test]
    fn handle_round_trips_and_rejects() {
        let h = NetHandleV1 {
            name: 0x0102_0304_0506_0708,
            secret: 42,
            uid: 1000,
        };
        let b: [u8; 128] = h.encode();
        assert_eq!(&b[..4], b"TXSN");
        assert_eq!(NetHandleV1::decode(&b).unwrap(), h);
        for (i, v) in [(0, b'X'), (4, 2), (5, 1), (40, 1), (127, 1)] {
            let mut c = b;
            c[i] = v;
            assert!(NetHandleV1::decode(&c).is_err(), "byte {i}");
        }
        assert!(NetHandleV1::decode(&b[..20]).is_err());
    }

    /// Random bytes and flipped messages decode or fail without panicking;
    /// whatever decodes re-encodes to the same bytes.
    #[test]
    fn seeded_fuzz() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5a11);
        let encoded: Vec<Vec<u8>> = samples()
            .iter()
            .map(|m| {
                let mut b = Vec::new();
                m.encode(&mut b);
                b
            })
            .collect();
        for _ in 0..20_000 {
            let mut b = encoded[rng.random_range(0..encoded.len())].clone();
            for _ in 0..rng.random_range(1..4) {
                let i = rng.random_range(0..b.len());
                b[i] = rng.random();
            }
            if rng.random_bool(0.2) {
                b.truncate(rng.random_range(0..b.len()));
            }
            if let Ok(m) = NetMsg::decode(&b) {
                let mut again = Vec::new();
                m.encode(&mut again);
                assert_eq!(again, b);
            }
        }
    }
}
