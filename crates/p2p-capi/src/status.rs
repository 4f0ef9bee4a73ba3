//! Status codes, the one mapping from engine errors, the thread's last
//! error text, and the panic boundary every `extern "C"` body runs behind.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use tcpx_p2p::{Error, ErrorKind};

/// `tcpx_status_t`: keep in step with `include/tcpx_p2p.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    Again = 1,
    InvalidArgument = -1,
    UnknownId = -2,
    Malformed = -3,
    Connect = -4,
    Refused = -5,
    ConnectionLost = -6,
    Net = -7,
    Cuda = -8,
    Io = -9,
    Config = -10,
    Timeout = -11,
    BufferTooSmall = -12,
    Panic = -13,
    Internal = -14,
    Cancelled = -15,
}

impl Status {
    /// Every code, for tests and `tcpx_status_str`.
    pub const ALL: [Status; 17] = [
        Status::Ok,
        Status::Again,
        Status::InvalidArgument,
        Status::UnknownId,
        Status::Malformed,
        Status::Connect,
        Status::Refused,
        Status::ConnectionLost,
        Status::Net,
        Status::Cuda,
        Status::Io,
        Status::Config,
        Status::Timeout,
        Status::BufferTooSmall,
        Status::Panic,
        Status::Internal,
        Status::Cancelled,
    ];

    /// A short static description, NUL-terminated.
    pub fn describe(self) -> &'static std::ffi::CStr {
        match self {
            Status::Ok => c"ok",
            Status::Again => c"not yet (try again)",
            Status::InvalidArgument => c"invalid argument",
            Status::UnknownId => c"unknown id",
            Status::Malformed => c"malformed input",
            Status::Connect => c"cannot connect",
            Status::Refused => c"refused by peer",
            Status::ConnectionLost => c"connection lost",
            Status::Net => c"transport error",
            Status::Cuda => c"CUDA error",
            Status::Io => c"operating-system error",
            Status::Config => c"bad configuration",
            Status::Timeout => c"timed out",
            Status::BufferTooSmall => c"buffer too small",
            Status::Panic => c"internal panic",
            Status::Internal => c"internal error",
            Status::Cancelled => c"cancelled",
        }
    }
}

/// The status code of an engine error: the one place they are mapped.
pub fn status_of(e: &Error) -> Status {
    match e {
        Error::Invalid(_) => Status::InvalidArgument,
        Error::Wire(_) => Status::Malformed,
        Error::Connect { .. } => Status::Connect,
        Error::Refused { .. } => Status::Refused,
        // A peer that broke the protocol, or went silent past the deadline,
        // had its connection ended: to the caller the connection is lost
        // (TCPX_ERR_TIMEOUT is kept for the caller's own timeouts); the
        // last-error text says why.
        Error::ConnectionLost { .. } | Error::Protocol { .. } | Error::TimedOut { .. } => {
            Status::ConnectionLost
        }
        // A transport error is reported by what it did to the caller: a
        // closed or reset stream loses the connection like any other.
        Error::Net { .. } => match e.kind() {
            ErrorKind::Lost | ErrorKind::Protocol | ErrorKind::TimedOut => Status::ConnectionLost,
            ErrorKind::LocalCuda => Status::Cuda,
            _ => Status::Net,
        },
        Error::Cuda(_) => Status::Cuda,
        Error::Io { .. } => Status::Io,
        Error::Config(_) => Status::Config,
        Error::Cancelled { .. } => Status::Cancelled,
        _ => Status::Internal,
    }
}

/// Why a call failed: its code and the text `tcpx_last_error` returns.
#[derive(Debug)]
pub struct Fail {
    pub status: Status,
    pub msg: String,
}

impl Fail {
    pub fn new(status: Status, msg: impl Into<String>) -> Self {
        Fail {
            status,
            msg: msg.into(),
        }
    }
    pub fn invalid(msg: impl Into<String>) -> Self {
        Fail::new(Status::InvalidArgument, msg)
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail {
            status: status_of(&e),
            msg: e.to_string(),
        }
    }
}

pub type Res<T = Status> = Result<T, Fail>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Keeps `msg` as this thread's last error (interior NULs dropped).
pub fn set_last_error(msg: String) {
    let c = CString::new(msg.replace('\0', "")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// This thread's last error; valid until it is set again.
pub fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// Runs the body of `call`: its failure becomes a status and the thread's
/// last error, and a panic becomes [`Status::Panic`] instead of unwinding
/// into C.
pub fn guard(call: &str, f: impl FnOnce() -> Res) -> Status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(s)) => s,
        Ok(Err(fail)) => {
            set_last_error(format!("{call}: {}", fail.msg));
            fail.status
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(format!("{call}: internal panic: {what}"));
            Status::Panic
        }
    }
}

/// [`guard`] for the calls that return nothing (frees): a panic is kept as
/// the last error and goes no further.
pub fn guard_void(call: &str, f: impl FnOnce()) {
    let _ = guard(call, || {
        f();
        Ok(Status::Ok)
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use tcpx_p2p::NetError;

    #[test]
    fn engine_errors_map_to_their_codes() {
        assert_eq!(
            status_of(&Error::Invalid("x".into())),
            Status::InvalidArgument
        );
        assert_eq!(
            status_of(&Error::Refused {
                conn: 1,
                reason: "no".into()
            }),
            Status::Refused
        );
        assert_eq!(
            status_of(&Error::ConnectionLost {
                conn: 1,
                reason: "gone".into()
            }),
            Status::ConnectionLost
        );
        assert_eq!(status_of(&Error::Config("x".into())), Status::Config);
        assert_eq!(
            status_of(&Error::Protocol {
                conn: 1,
                reason: "bad".into()
            }),
            Status::ConnectionLost
        );
        assert_eq!(
            status_of(&Error::TimedOut {
                conn: 1,
                reason: "slow".into()
            }),
            Status::ConnectionLost
        );
        assert_eq!(
            status_of(&Error::Net {
                conn: 1,
                source: NetError::Closed { net: "socket" }
            }),
            Status::ConnectionLost
        );
        assert_eq!(
            status_of(&Error::Net {
                conn: 1,
                source: NetError::Misuse {
                    net: "socket",
                    reason: "x".into()
                }
            }),
            Status::Net
        );
    }

    #[test]
    fn panics_become_a_status_and_a_message() {
        let s = guard("tcpx_test", || panic!("boom"));
        assert_eq!(s, Status::Panic);
        // SAFETY: the pointer is this thread's live last-error string.
        let msg = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) };
        assert_eq!(msg.to_str().unwrap(), "tcpx_test: internal panic: boom");
        let s = guard("tcpx_test", || Err(Fail::invalid("bad\0arg")));
        assert_eq!(s, Status::InvalidArgument);
        // SAFETY: as above.
        let msg = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) };
        assert_eq!(msg.to_str().unwrap(), "tcpx_test: badarg");
    }

    #[test]
    fn codes_are_distinct_and_described() {
        let mut v: Vec<i32> = Status::ALL.iter().map(|s| *s as i32).collect();
        v.sort_unstable();
        v.dedup();
        assert_eq!(v.len(), Status::ALL.len());
        for s in Status::ALL {
            assert!(!s.describe().to_bytes().is_empty());
        }
    }
}
