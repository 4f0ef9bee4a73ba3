//! Engine errors in Python: one exception hierarchy under `TcpxP2PError`
//! (itself a `RuntimeError`, so code written for UCCL catches it),
//! and the UCCL-compatible `False` returns whose reason is logged to the
//! `tcpx_p2p` logger and kept for `Endpoint.last_error()`.

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use tcpx_p2p::{Error, ErrorKind};

create_exception!(
    tcpx_p2p,
    TcpxP2PError,
    PyRuntimeError,
    "Base of every tcpx_p2p error; a RuntimeError, as UCCL's errors are."
);
create_exception!(
    tcpx_p2p,
    InvalidArgumentError,
    TcpxP2PError,
    "A bad id, pointer, size or descriptor."
);
create_exception!(
    tcpx_p2p,
    ConnectError,
    TcpxP2PError,
    "A connection could not be made."
);
create_exception!(
    tcpx_p2p,
    ConnectionLostError,
    TcpxP2PError,
    "The connection broke or was closed."
);
create_exception!(
    tcpx_p2p,
    RefusedError,
    TcpxP2PError,
    "The peer refused the request."
);
create_exception!(
    tcpx_p2p,
    ProtocolError,
    ConnectionLostError,
    "The peer broke the protocol; the connection was ended."
);
create_exception!(
    tcpx_p2p,
    TimedOutError,
    ConnectionLostError,
    "The peer went silent past the deadline; the connection was ended."
);
create_exception!(tcpx_p2p, CudaError, TcpxP2PError, "A CUDA failure.");
create_exception!(
    tcpx_p2p,
    ConfigError,
    TcpxP2PError,
    "Bad configuration (environment variables)."
);

/// The one mapping from engine errors to Python exceptions, by the kind of
/// failure ([`Error::kind`]): a CUDA failure on an I/O thread is a
/// `CudaError`, whichever layer met it.
pub fn to_py(e: &Error) -> PyErr {
    let msg = e.to_string();
    match (e, e.kind()) {
        (Error::Config(_), _) => ConfigError::new_err(msg),
        (Error::Connect { .. }, _) => ConnectError::new_err(msg),
        (_, ErrorKind::InvalidArgument) => InvalidArgumentError::new_err(msg),
        (_, ErrorKind::LocalCuda) => CudaError::new_err(msg),
        (_, ErrorKind::Protocol) => ProtocolError::new_err(msg),
        (_, ErrorKind::Refused) => RefusedError::new_err(msg),
        (_, ErrorKind::Lost) => ConnectionLostError::new_err(msg),
        (_, ErrorKind::TimedOut) => TimedOutError::new_err(msg),
        _ => TcpxP2PError::new_err(msg),
    }
}

/// Sends `msg` to Python's `logging.getLogger("tcpx_p2p")` at WARNING.
pub fn log_warning(py: Python<'_>, msg: &str) {
    let r = py
        .import("logging")
        .and_then(|l| l.call_method1("getLogger", ("tcpx_p2p",)))
        .and_then(|lg| lg.call_method1("warning", (msg,)));
    if let Err(e) = r {
        e.print(py);
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TcpxP2PError", py.get_type::<TcpxP2PError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("ConnectError", py.get_type::<ConnectError>())?;
    m.add("ConnectionLostError", py.get_type::<ConnectionLostError>())?;
    m.add("RefusedError", py.get_type::<RefusedError>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("TimedOutError", py.get_type::<TimedOutError>())?;
    m.add("CudaError", py.get_type::<CudaError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    Ok(())
}
