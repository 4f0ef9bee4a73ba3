//! The one error of the byte formats.

/// A malformed byte string: what was being read and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    #[error("{what}: truncated, needed {needed} more bytes")]
    Truncated { what: &'static str, needed: usize },
    #[error("{what}: {left} trailing bytes")]
    Trailing { what: &'static str, left: usize },
    #[error("{what}: bad value {value}")]
    BadValue { what: &'static str, value: u64 },
    #[error("{what}: bad length {len}")]
    BadLength { what: &'static str, len: usize },
    #[error("{what}: not valid UTF-8")]
    BadUtf8 { what: &'static str },
}
