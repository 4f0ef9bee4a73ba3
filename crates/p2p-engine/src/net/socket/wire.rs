//! The socket net's byte formats, each encoded and decoded in one place
//! over the crate's checked [`Reader`]: the listen handle (what `listen`
//! gives the peer), the stream hello (the first bytes of each stream) and
//! the part header (before each part's payload). Decoders never panic;
//! what a decoded header may do to a posted receive is checked in
//! [`super::book::check_part`].

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use crate::error::WireError;
use crate::net::NetHandle;
use crate::wire::{Reader, NET_HANDLE_LEN};

const HANDLE_MAGIC: u32 = 0x4b43_4f53; // "SOCK"
const HELLO_MAGIC: u64 = 0x334c_4c45_484b_4353; // "SCKHELL3"

/// Bytes of a part header: six little-endian u64 fields.
pub(crate) const HDR_LEN: usize = 48;
/// Bytes of a stream hello: magic, nonce, stream index.
pub(crate) const HELLO_LEN: usize = 24;

/// Part-count field flag: the part's payload was lent (spliced, see
/// [`super::splice`]); its receiver owes credits for it.
const SPLICED: u64 = 1 << 32;

/// Most streams a listen handle may name.
const MAX_STREAMS: usize = 64;

/// The header before each part's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct PartHeader {
    /// The message's sequence number on this comm.
    pub seq: u64,
    /// Offset of this part in the message.
    pub off: u64,
    /// Payload bytes of this part.
    pub len: u64,
    /// Bytes of the whole message.
    pub total: u64,
    /// Parts the message is cut into (below 2^32).
    pub nparts: u64,
    /// The shape of a gathered message's segments (0: one segment; see
    /// [`super::segs::Segs`]).
    pub shape: u64,
    /// The payload was lent to the socket: the receiver owes credits.
    pub spliced: bool,
}

impl PartHeader {
    pub(crate) fn encode(&self) -> [u8; HDR_LEN] {
        let nparts = (self.nparts & (SPLICED - 1)) | if self.spliced { SPLICED } else { 0 };
        let mut out = [0u8; HDR_LEN];
        let fields = [self.seq, self.off, self.len, self.total, nparts, self.shape];
        for (j, v) in fields.into_iter().enumerate() {
            out[j * 8..j * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// Any 48 bytes decode (a header is checked against the receive it
    /// lands in, not here); fewer or more are refused.
    pub(crate) fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(b, "part header");
        let (seq, off, len, total) = (r.u64_le()?, r.u64_le()?, r.u64_le()?, r.u64_le()?);
        let field = r.u64_le()?;
        let shape = r.u64_le()?;
        r.finish()?;
        Ok(PartHeader {
            seq,
            off,
            len,
            total,
            nparts: field & (SPLICED - 1),
            shape,
            spliced: field & SPLICED != 0,
        })
    }
}

/// The first bytes a connecting side writes on each stream: the listener's
/// nonce (from the handle) and the stream's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub nonce: u64,
    pub stream: u64,
}

impl Hello {
    pub(crate) fn encode(&self) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[0..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        out[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        out[16..24].copy_from_slice(&self.stream.to_le_bytes());
        out
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(b, "stream hello");
        let magic = r.u64_le()?;
        if magic != HELLO_MAGIC {
            return Err(WireError::BadValue {
                what: "stream hello magic",
                value: magic,
            });
        }
        let (nonce, stream) = (r.u64_le()?, r.u64_le()?);
        r.finish()?;
        Ok(Hello { nonce, stream })
    }
}

/// The listen handle: magic, address, port, stream count, nonce, and the
/// listener's smallest part. The connecting side adopts the count and the
/// smallest part for the comm: the receiver checks each part against the
/// cut they make (`book::claim_part`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handle {
    pub addr: SocketAddr,
    pub streams: usize,
    pub nonce: u64,
    pub min_part: usize,
}

impl Handle {
    pub(crate) fn encode(&self) -> NetHandle {
        let mut h = [0u8; NET_HANDLE_LEN];
        h[0..4].copy_from_slice(&HANDLE_MAGIC.to_le_bytes());
        let v6 = match self.addr.ip() {
            IpAddr::V4(a) => a.to_ipv6_mapped(),
            IpAddr::V6(a) => a,
        };
        h[4..20].copy_from_slice(&v6.octets());
        h[20..22].copy_from_slice(&self.addr.port().to_le_bytes());
        h[22] = self.streams as u8;
        h[24..32].copy_from_slice(&self.nonce.to_le_bytes());
        h[32..40].copy_from_slice(&(self.min_part as u64).to_le_bytes());
        h
    }

    /// The handle's fields; the bytes past them are ignored (a handle has a
    /// fixed size).
    pub(crate) fn decode(h: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(h, "socket listen handle");
        let magic = r.u32_le()?;
        if magic != HANDLE_MAGIC {
            return Err(WireError::BadValue {
                what: "socket listen handle magic",
                value: magic.into(),
            });
        }
        let mut ip = [0u8; 16];
        ip.copy_from_slice(r.take(16)?);
        let v6 = Ipv6Addr::from(ip);
        let ip = v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6));
        let port = r.u16_le()?;
        let streams = r.u8()? as usize;
        if streams == 0 || streams > MAX_STREAMS {
            return Err(WireError::BadValue {
                what: "socket listen handle stream count",
                value: streams as u64,
            });
        }
        r.u8()?; // padding
        let nonce = r.u64_le()?;
        let min_part = r.u64_le()?;
        if !(1024..=1 << 30).contains(&min_part) {
            return Err(WireError::BadValue {
                what: "socket listen handle part size",
                value: min_part,
            });
        }
        Ok(Handle {
            addr: SocketAddr::new(ip, port),
            streams,
            nonce,
            min_part: min_part as usize,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_header_fixed_bytes() {
        let h = PartHeader {
            seq: 1,
            off: 0x1000,
            len: 0x20,
            total: 0x1020,
            nparts: 2,
            shape: 0xdead_beef,
            spliced: true,
        };
        let b = h.encode();
        #[rustfmt::skip]
        let want: [u8; HDR_LEN] = [
            1, 0, 0, 0, 0, 0, 0, 0,
            0, 0x10, 0, 0, 0, 0, 0, 0,
            0x20, 0, 0, 0, 0, 0, 0, 0,
            0x20, 0x10, 0, 0, 0, 0, 0, 0,
            2, 0, 0, 0, 1, 0, 0, 0,
            0xef, 0xbe, 0xad, 0xde, 0, 0, 0, 0,
        ];
        assert_eq!(b, want);
        assert_eq!(PartHeader::decode(&b).unwrap(), h);
        let plain = PartHeader {
            spliced: false,
            ..h
        };
        assert_eq!(PartHeader::decode(&plain.encode()).unwrap(), plain);
        assert_eq!(plain.encode()[36], 0);
    }

    #[test]
    fn part_header_refuses_other_lengths() {
        let b = PartHeader::default().encode();
        assert!(matches!(
            PartHeader::decode(&b[..47]),
            Err(WireError::Truncated { .. })
        ));
        let mut long = b.to_vec();
        long.push(0);
        assert!(matches!(
            PartHeader::decode(&long),
            Err(WireError::Trailing { .. })
        ));
    }

    #[test]
    fn part_header_round_trips_any_bytes() {
        // Every 48-byte string decodes; re-encoding gives it back except
        // the part-count field's bits 33..64, which are not carried.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..1000 {
            let mut b = [0u8; HDR_LEN];
            for c in b.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.copy_from_slice(&x.to_le_bytes());
            }
            let h = PartHeader::decode(&b).unwrap();
            let mut back = h.encode();
            back[36] |= b[36] & !1;
            back[37..40].copy_from_slice(&b[37..40]);
            assert_eq!(back, b);
            assert_eq!(PartHeader::decode(&h.encode()).unwrap(), h);
        }
    }

    #[test]
    fn hello_fixed_bytes_and_refusals() {
        let h = Hello {
            nonce: 0x0102_0304_0506_0708,
            stream: 3,
        };
        let b = h.encode();
        assert_eq!(&b[0..8], b"SCKHELL3");
        assert_eq!(&b[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[16..24], &[3, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Hello::decode(&b).unwrap(), h);
        let mut bad = b;
        bad[0] ^= 1;
        assert!(Hello::decode(&bad).is_err());
        assert!(Hello::decode(&b[..23]).is_err());
    }

    #[test]
    fn handle_round_trip_and_rejects_garbage() {
        let a: SocketAddr = "127.0.0.1:4242".parse().unwrap();
        let h = Handle {
            addr: a,
            streams: 4,
            nonce: 99,
            min_part: 128 << 10,
        };
        let b = h.encode();
        assert_eq!(&b[0..4], b"SOCK");
        assert_eq!(&b[4..20], &a_v6(a));
        assert_eq!(&b[20..23], &[0x92, 0x10, 4]);
        assert_eq!(Handle::decode(&b).unwrap(), h);
        assert!(Handle::decode(&Handle { min_part: 0, ..h }.encode()).is_err());
        assert!(Handle::decode(&Handle { streams: 65, ..h }.encode()).is_err());
        assert!(Handle::decode(&[0u8; 128]).is_err());
        assert!(Handle::decode(&b[..30]).is_err());
        let v6: SocketAddr = "[::1]:7".parse().unwrap();
        let h6 = Handle { addr: v6, ..h };
        assert_eq!(Handle::decode(&h6.encode()).unwrap(), h6);
    }

    fn a_v6(a: SocketAddr) -> [u8; 16] {
        match a.ip() {
            IpAddr::V4(v) => v.to_ipv6_mapped().octets(),
            IpAddr::V6(v) => v.octets(),
        }
    }
}
