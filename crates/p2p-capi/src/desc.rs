//! Remote descriptors as C sees them: 64 opaque bytes. Either an
//! advertisement (the engine's 64-byte `FifoItem`, one connection, under
//! 4 GiB) or an export of a range to every peer (any size): the engine's
//! one-entry serialized descriptor list (48 bytes), then 16 zero bytes.

use tcpx_p2p::RemoteDesc;
use tcpx_p2p_wire::{decode_descs, encode_descs, DescEntry, FifoItem, FIFO_ITEM_LEN};

use crate::status::{Fail, Status};

/// Bytes of a descriptor (`TCPX_DESC_LEN`).
pub const DESC_LEN: usize = FIFO_ITEM_LEN;
/// Bytes of the serialized one-entry list at the start of an export.
const EXPORT_BODY: usize = 48;

/// The 64 bytes of an export.
pub fn export_bytes(d: &DescEntry) -> [u8; DESC_LEN] {
    let mut v = Vec::with_capacity(DESC_LEN);
    encode_descs(std::slice::from_ref(d), &mut v);
    debug_assert_eq!(v.len(), EXPORT_BODY);
    let mut a = [0u8; DESC_LEN];
    a[..v.len()].copy_from_slice(&v);
    a
}

/// What a descriptor names; [`Status::Malformed`] when it is neither form.
pub fn parse(b: &[u8; DESC_LEN]) -> Result<RemoteDesc, Fail> {
    // An advertisement carries its own magic inside the pad; an export's
    // bytes there are a small advertisement id, never that magic.
    if let Ok(m) = FifoItem::decode(b) {
        return Ok(RemoteDesc::from(&m));
    }
    let (body, pad) = b.split_at(EXPORT_BODY);
    match decode_descs(body) {
        Ok(l) if l.len() == 1 && pad.iter().all(|&x| x == 0) => Ok(RemoteDesc::from(&l[0])),
        _ => Err(Fail::new(
            Status::Malformed,
            "not a remote descriptor (from tcpx_advertise or tcpx_export)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tcpx_p2p::Token;

    #[test]
    fn both_forms_parse_and_garbage_does_not() {
        let fifo = FifoItem {
            addr: 0x1000,
            size: 64,
            rkey: 3,
            nmsgs: 1,
            rid: 0,
            idx: 9,
            token: Token { id: 9, secret: 77 },
        };
        let r = parse(&fifo.to_bytes()).unwrap();
        assert_eq!(
            (r.addr, r.len, r.region, r.token),
            (0x1000, 64, 3, fifo.token)
        );
        let exp = DescEntry {
            addr: 0x2000,
            size: 5 << 30,
            mr_id: 4,
            token: Token { id: 10, secret: 78 },
        };
        let b = export_bytes(&exp);
        let r = parse(&b).unwrap();
        assert_eq!(
            (r.addr, r.len, r.region, r.token),
            (0x2000, 5 << 30, 4, exp.token)
        );
        let mut bad = b;
        bad[60] = 1;
        assert_eq!(parse(&bad).unwrap_err().status, Status::Malformed);
        assert_eq!(
            parse(&[0u8; DESC_LEN]).unwrap_err().status,
            Status::Malformed
        );
    }
}
