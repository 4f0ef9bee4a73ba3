//! `XferDesc`: a registered buffer as `register_memory` returns it.

use crate::*;

/// A registered buffer as `register_memory` returns it. `rkeys` holds the
/// token a peer must present to use it: `[advertisement id, secret]`;
/// `lkeys` the id of the region that token belongs to.
#[pyclass(get_all, module = "tcpx_p2p._native")]
#[derive(Clone, Debug)]
pub(crate) struct XferDesc {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) mr_id: u64,
    pub(crate) lkeys: Vec<u64>,
    pub(crate) rkeys: Vec<u64>,
}

#[pymethods]
impl XferDesc {
    /// `XferDesc()` (all zero, as UCCL allows) or with its fields.
    #[new]
    #[pyo3(signature = (addr=0, size=0, mr_id=0, lkeys=vec![], rkeys=vec![]))]
    pub(crate) fn new(
        #[pyo3(from_py_with = args::addr)] addr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        #[pyo3(from_py_with = args::mr_id)] mr_id: u64,
        #[pyo3(from_py_with = args::lkeys)] lkeys: Vec<u64>,
        #[pyo3(from_py_with = args::rkeys)] rkeys: Vec<u64>,
    ) -> Self {
        XferDesc {
            addr,
            size: size as u64,
            mr_id,
            lkeys,
            rkeys,
        }
    }
    #[setter]
    pub(crate) fn set_addr(&mut self, #[pyo3(from_py_with = args::addr)] v: u64) {
        self.addr = v;
    }
    #[setter]
    pub(crate) fn set_size(&mut self, #[pyo3(from_py_with = args::size)] v: usize) {
        self.size = v as u64;
    }
    #[setter]
    pub(crate) fn set_mr_id(&mut self, #[pyo3(from_py_with = args::mr_id)] v: u64) {
        self.mr_id = v;
    }
    #[setter]
    pub(crate) fn set_lkeys(&mut self, #[pyo3(from_py_with = args::lkeys)] v: Vec<u64>) {
        self.lkeys = v;
    }
    #[setter]
    pub(crate) fn set_rkeys(&mut self, #[pyo3(from_py_with = args::rkeys)] v: Vec<u64>) {
        self.rkeys = v;
    }
    pub(crate) fn __repr__(&self) -> String {
        format!(
            "XferDesc(addr={:#x}, size={}, mr_id={})",
            self.addr, self.size, self.mr_id
        )
    }
    /// Picklable, so descriptors can travel through torch.distributed or
    /// multiprocessing.
    #[allow(clippy::type_complexity)]
    pub(crate) fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> (
        Bound<'py, pyo3::types::PyType>,
        (u64, u64, u64, Vec<u64>, Vec<u64>),
    ) {
        let d = slf.borrow();
        (
            slf.get_type(),
            (d.addr, d.size, d.mr_id, d.lkeys.clone(), d.rkeys.clone()),
        )
    }
}

impl XferDesc {
    pub(crate) fn entry(&self) -> EResult<DescEntry> {
        let token = tcpx_p2p::Token::from_keys(&self.rkeys).ok_or_else(|| {
            Error::Invalid(format!(
                "descriptor of mr {} carries no access token (rkeys); use descriptors from register_memory/deserialize_descs",
                self.mr_id
            ))
        })?;
        Ok(DescEntry {
            addr: self.addr,
            size: self.size,
            mr_id: self.mr_id,
            token,
        })
    }
    pub(crate) fn buf(&self) -> EResult<Buf> {
        let len = usize::try_from(self.size).map_err(|_| {
            Error::Invalid(format!(
                "descriptor of mr {}: size {} is too large",
                self.mr_id, self.size
            ))
        })?;
        Ok(Buf {
            mr: self.mr_id,
            ptr: self.addr,
            len,
        })
    }
}
