//! Byte formats of same-host connections (`connect_local`): the hello on
//! the Unix stream before the engine's own handshake, and how a GPU range
//! is exported to a peer process (which the same-host net's messages
//! carry). Decoders never panic and reject trailing bytes.

use crate::{Reader, WireError};

/// `"TCPXLOC1"`: the first field of the same-host handshake.
pub const LOCAL_MAGIC: u64 = 0x3143_4f4c_5850_4354;
pub const LOCAL_VERSION: u16 = 2;

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
    let b = &s.as_bytes()[..s.len().min(64)];
    out.extend_from_slice(&(b.len() as u16).to_le_bytes());
    out.extend_from_slice(b);
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
