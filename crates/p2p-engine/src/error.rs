//! Error families, kept apart as the design asks: malformed input, a peer that
//! broke the protocol or went away, the caller's misuse, and local CUDA/OS
//! failures.

use std::io;
use std::sync::Arc;

/// A malformed byte string (defined with the byte formats).
pub use tcpx_p2p_wire::WireError;

/// Errors of a network transport (one implementation of [`crate::net::Net`]).
/// Cloned to every request a failed comm reports it for.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    #[error("{net}: {call} failed: {source}")]
    Io {
        net: &'static str,
        call: &'static str,
        #[source]
        source: Arc<io::Error>,
    },
    #[error("{net}: peer broke the protocol: {reason}")]
    Protocol { net: &'static str, reason: String },
    #[error("{net}: connection closed by peer")]
    Closed { net: &'static str },
    #[error("{net}: {call} returned error code {code} ({meaning})")]
    Plugin {
        net: &'static str,
        call: &'static str,
        code: i32,
        meaning: &'static str,
    },
    #[error("{net}: {reason}")]
    Misuse { net: &'static str, reason: String },
    #[error("cuda: {0}")]
    Cuda(#[from] CudaError),
    #[error("{net}: cannot load: {reason}")]
    Load { net: &'static str, reason: String },
}

impl NetError {
    /// What kind of failure this is, for the caller (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            NetError::Io { source, .. } if source.kind() == io::ErrorKind::TimedOut => {
                ErrorKind::TimedOut
            }
            NetError::Io { .. } | NetError::Closed { .. } | NetError::Plugin { .. } => {
                ErrorKind::Lost
            }
            NetError::Protocol { .. } => ErrorKind::Protocol,
            NetError::Misuse { .. } => ErrorKind::InvalidArgument,
            NetError::Cuda(_) => ErrorKind::LocalCuda,
            NetError::Load { .. } => ErrorKind::Local,
        }
    }

    pub(crate) fn io(net: &'static str, call: &'static str, source: io::Error) -> Self {
        NetError::Io {
            net,
            call,
            source: Arc::new(source),
        }
    }
}

/// A failure of the local CUDA driver (defined with the GPU helpers).
pub use tcpx_p2p_gpu::CudaError;

/// The kinds of failure a caller tells apart (the Python exceptions and C
/// status codes are mapped from these, once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller's mistake: a bad id, pointer, size, descriptor or setting.
    InvalidArgument,
    /// A CUDA call failed on this machine (or CUDA is missing).
    LocalCuda,
    /// Another local failure: a system call, a library that would not load.
    Local,
    /// The peer broke the protocol (malformed or inconsistent messages).
    Protocol,
    /// The peer refused a request, or a connection.
    Refused,
    /// The connection is gone: closed, reset, or its transport failed.
    Lost,
    /// The peer did not answer in time.
    TimedOut,
    /// The application cancelled the transfer.
    Cancelled,
}

/// The engine's error: everything a caller of [`crate::Endpoint`] can see.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The caller's mistake: unknown ids, bad pointers, out-of-range sizes.
    #[error("{0}")]
    Invalid(String),
    /// Malformed bytes given by the caller (metadata, descriptors).
    #[error("malformed input: {0}")]
    Wire(#[from] WireError),
    /// A connection could not be made.
    #[error("cannot connect to {peer}: {reason}")]
    Connect { peer: String, reason: String },
    /// The peer refused a request or broke the protocol.
    #[error("connection {conn}: peer refused: {reason}")]
    Refused { conn: u64, reason: String },
    /// The connection is gone (peer closed, crashed, timed out, or it was removed).
    #[error("connection {conn}: {reason}")]
    ConnectionLost { conn: u64, reason: String },
    /// The peer broke the protocol: the connection was ended.
    #[error("connection {conn}: peer broke the protocol: {reason}")]
    Protocol { conn: u64, reason: String },
    /// The application cancelled the transfer before its data moved.
    #[error("connection {conn}: transfer cancelled before its data moved")]
    Cancelled { conn: u64 },
    /// The peer went silent past the deadline: the connection was ended.
    #[error("connection {conn}: {reason}")]
    TimedOut { conn: u64, reason: String },
    /// The transport failed (its error says whether locally or because of
    /// the peer: see [`NetError::kind`]).
    #[error("connection {conn}: transport error: {source}")]
    Net {
        conn: u64,
        #[source]
        source: NetError,
    },
    #[error("cuda: {0}")]
    Cuda(#[from] CudaError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("configuration: {0}")]
    Config(String),
}

impl Error {
    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Invalid(_) | Error::Wire(_) | Error::Config(_) => ErrorKind::InvalidArgument,
            Error::Connect { .. } | Error::ConnectionLost { .. } => ErrorKind::Lost,
            Error::Refused { .. } => ErrorKind::Refused,
            Error::Protocol { .. } => ErrorKind::Protocol,
            Error::TimedOut { .. } => ErrorKind::TimedOut,
            Error::Cancelled { .. } => ErrorKind::Cancelled,
            Error::Net { source, .. } => source.kind(),
            Error::Cuda(_) => ErrorKind::LocalCuda,
            Error::Io { .. } => ErrorKind::Local,
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::Invalid(msg.into())
    }
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            what: what.into(),
            source,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
