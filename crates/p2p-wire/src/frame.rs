//! The control connection's framing: a little-endian `u32` length, then
//! that many bytes.

use std::io::{self, Read, Write};

/// Writes one length-prefixed frame.
pub fn write_frame(s: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let mut v = Vec::with_capacity(4 + body.len());
    v.extend_from_slice(&(body.len() as u32).to_le_bytes());
    v.extend_from_slice(body);
    s.write_all(&v)
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
