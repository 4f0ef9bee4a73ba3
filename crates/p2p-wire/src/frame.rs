//! The control connection's framing: a little-endian `u32` length, then
//! that many bytes.

use std::io::{self, Read, Write};

/// One frame whose body `encode` writes in place, after room for the
/// length, which is filled in once the body is written (a large body is
/// not copied again behind its length).
pub fn frame_with(encode: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = vec![0u8; 4];
    encode(&mut out);
    let n = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&n.to_le_bytes());
    out
}

/// Writes one length-prefixed frame.
pub fn write_frame(s: &mut impl Write, body: &[u8]) -> io::Result<()> {
    s.write_all(&frame_with(|v| v.extend_from_slice(body)))
}

/// Reads one length-prefixed frame of at most `max` bytes.
pub fn read_frame(s: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("control frame of {n} bytes exceeds the limit of {max}"),
        ));
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_reads_back_and_an_oversized_one_is_refused() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"hello").unwrap();
        write_frame(&mut buf, &[7u8; 300]).unwrap();
        assert_eq!(&buf[..4], &5u32.to_le_bytes());
        let mut r = &buf[..];
        assert_eq!(read_frame(&mut r, 16).unwrap(), b"hello");
        let e = read_frame(&mut r, 299).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        // A stream that ends inside a frame is an error, not a short frame.
        let mut short = &buf[..7];
        assert_eq!(
            read_frame(&mut short, 16).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }
}
