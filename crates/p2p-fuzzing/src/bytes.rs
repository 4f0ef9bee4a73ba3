//! The harnesses' input, read as a program.

/// A fuzz input read front to back; past its end every read is zero.
pub(crate) struct Bytes<'a>(pub(crate) &'a [u8]);

impl Bytes<'_> {
    pub(crate) fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    pub(crate) fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    pub(crate) fn u64(&mut self) -> u64 {
        (0..8).fold(0u64, |a, _| a << 8 | self.u8() as u64)
    }
    pub(crate) fn done(&self) -> bool {
        self.0.is_empty()
    }
}
