//! The same-host calls' argument handling that is not a Python method.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tcpx_p2p::Error;

use crate::Endpoint;

impl Endpoint {
    pub(crate) fn connect_local_to(
        &self,
        py: Python<'_>,
        remote_gpu_bdf: Bound<'_, PyAny>,
    ) -> (bool, i64) {
        let peer = if let Ok(b) = remote_gpu_bdf.cast::<PyBytes>() {
            Ok(tcpx_p2p::LocalPeer::Metadata(b.as_bytes().to_vec()))
        } else if let Ok(i) = remote_gpu_bdf.extract::<i32>() {
            Ok(tcpx_p2p::LocalPeer::Index(i))
        } else if let Ok(s) = remote_gpu_bdf.extract::<String>() {
            Ok(tcpx_p2p::LocalPeer::Bdf(s))
        } else {
            Err(Error::Invalid(
                "connect_local: remote_gpu_bdf must be a PCI bus id, a GPU index or metadata bytes"
                    .into(),
            ))
        };
        let r = peer.and_then(|p| py.detach(|| self.ep.connect_local(&p)));
        match self.check(py, r) {
            Some(id) => (true, id as i64),
            None => (false, -1),
        }
    }
}
