//! The Python face of tcpx-p2p: a thin PyO3 layer over the engine crate.
//! Each method extracts its arguments, runs the engine call with the GIL
//! released (`py.detach`), and converts the result into the shapes that
//! applications written for UCCL's P2P engine expect.

use parking_lot::Mutex;
use std::time::Duration;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use tcpx_p2p::{Buf, Config, Error, RemoteGpu};
use tcpx_p2p_wire::{self as wire, DescEntry, FifoItem, GpuId, Metadata};

mod args;
mod convert;
mod errors;
mod local;
mod rawtcp;
mod regcache;
use convert::*;
mod xferdesc;
use errors::{log_warning, to_py, InvalidArgumentError};
use xferdesc::XferDesc;

type EResult<T> = tcpx_p2p::Result<T>;

/// Data type hint accepted by `reg` (not used for the transfer itself).
#[pyclass(eq, eq_int, module = "tcpx_p2p._native")]
#[derive(Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
enum FloatType {
    kUndefined,
    kFloat16,
    kBFloat16,
    kFloat32,
    kFloat8E4M3FN,
    kFloat8E5M2,
}

/// An endpoint: one GPU (or host memory only), its connections and regions.
#[pyclass(frozen, module = "tcpx_p2p._native")]
struct Endpoint {
    ep: tcpx_p2p::Endpoint,
    last_error: Mutex<String>,
    /// `register_memory`'s registrations by range (see regcache.rs).
    regcache: Mutex<regcache::RegCache>,
}

/// Raises unless every list has `num_iovs` entries (as UCCL's vector calls
/// require).
fn check_lens(call: &str, n: usize, lists: &[(&str, usize)]) -> PyResult<()> {
    for (name, len) in lists {
        if *len != n {
            return Err(InvalidArgumentError::new_err(format!(
                "{call}: num_iovs is {n} but {name} has {len} entries"
            )));
        }
    }
    Ok(())
}

fn bufs(mr_ids: &[u64], ptrs: &[u64], sizes: &[usize], n: usize) -> EResult<Vec<Buf>> {
    if mr_ids.len() < n || ptrs.len() < n || sizes.len() < n {
        return Err(Error::Invalid(format!(
            "num_iovs is {n} but {} mr_ids, {} ptrs and {} sizes were given",
            mr_ids.len(),
            ptrs.len(),
            sizes.len()
        )));
    }
    Ok((0..n)
        .map(|i| Buf {
            mr: mr_ids[i],
            ptr: ptrs[i],
            len: sizes[i],
        })
        .collect())
}

fn fifo(meta: &[u8]) -> EResult<FifoItem> {
    Ok(FifoItem::decode(meta)?)
}

fn default_gpu(py: Python<'_>) -> Option<i32> {
    if tcpx_p2p_gpu::device_count() == 0 {
        return None;
    }
    // The current device of PyTorch, if the application uses it.
    let cur = py
        .import("sys")
        .and_then(|s| s.getattr("modules"))
        .and_then(|m| m.get_item("torch"))
        .and_then(|t| t.getattr("cuda")?.call_method0("current_device"))
        .and_then(|d| d.extract::<i32>());
    Some(cur.unwrap_or(0))
}

impl Endpoint {
    /// Registers `[ptr, ptr+size)` for `register_memory`: a new region, with
    /// the keys of an identical live registration where there is one.
    fn register_range(&self, ptr: u64, size: usize) -> EResult<XferDesc> {
        let mut cache = self.regcache.lock();
        let mr = self.ep.reg(ptr, size)?;
        let (base, token) = match cache.keys(ptr, size) {
            Some(k) => {
                cache.add_handle(ptr, size, mr);
                k
            }
            None => match self.ep.export_region(mr) {
                Ok(d) => {
                    cache.insert(ptr, size, mr, d.token);
                    (mr, d.token)
                }
                Err(e) => {
                    let _ = self.ep.dereg(mr);
                    return Err(e);
                }
            },
        };
        Ok(XferDesc {
            addr: ptr,
            size: size as u64,
            mr_id: mr,
            lkeys: vec![base],
            rkeys: vec![token.id, token.secret],
        })
    }

    /// Deregisters region `mr`, through the `register_memory` cache where
    /// it is one of its handles.
    fn release(&self, mr: u64) -> EResult<()> {
        let cached = self.regcache.lock().release(mr);
        match cached {
            Some(regions) => regions.into_iter().try_for_each(|r| self.ep.dereg(r)),
            None => self.ep.dereg(mr),
        }
    }

    /// Keeps the reason of a failure, logs it, and gives None (→ False).
    fn check<T>(&self, py: Python<'_>, r: EResult<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                let m = e.to_string();
                log_warning(py, &m);
                *self.last_error.lock() = m;
                None
            }
        }
    }

    fn blocking(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&tcpx_p2p::Endpoint) -> EResult<u64> + Send,
    ) -> bool {
        let ep = &self.ep;
        let r = py.detach(|| f(ep).and_then(|id| ep.wait_transfer(id)));
        self.check(py, r).is_some()
    }

    fn started(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&tcpx_p2p::Endpoint) -> EResult<u64> + Send,
    ) -> (bool, i64) {
        let ep = &self.ep;
        let r = py.detach(|| f(ep));
        match self.check(py, r) {
            Some(id) => (true, id as i64),
            None => (false, -1),
        }
    }
}

#[pymethods]
impl Endpoint {
    /// `Endpoint(local_gpu_idx=None, num_cpus=None)`; `num_cpus` is accepted
    /// and ignored. Without CUDA the index only labels the endpoint (host
    /// memory only); with CUDA it must name one of this machine's GPUs.
    #[new]
    #[pyo3(signature = (local_gpu_idx=None, num_cpus=None))]
    fn new(
        py: Python<'_>,
        local_gpu_idx: Option<Bound<'_, PyAny>>,
        num_cpus: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        if let Some(n) = num_cpus.filter(|n| !n.is_none()) {
            args::i64_named(&n, "num_cpus")?;
        }
        let idx = match local_gpu_idx.filter(|g| !g.is_none()) {
            Some(g) => Some(gpu_index_arg(&g)?),
            None => None,
        };
        tcpx_p2p::init_logging();
        let gpu = idx.or_else(|| default_gpu(py));
        let ep = py
            .detach(|| Config::from_env().and_then(|c| tcpx_p2p::Endpoint::new(gpu, c)))
            .map_err(|e| to_py(&e))?;
        Ok(Endpoint {
            ep,
            last_error: Mutex::new(String::new()),
            regcache: Mutex::new(Default::default()),
        })
    }

    /// The reason of the most recent `False` return.
    fn last_error(&self) -> String {
        self.last_error.lock().clone()
    }

    fn get_metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.ep.metadata())
    }

    /// `(ip, port, gpu)`: gpu is the PCI bus id (str), or an int for the older form.
    #[staticmethod]
    fn parse_metadata(
        py: Python<'_>,
        #[pyo3(from_py_with = args::metadata)] metadata: Vec<u8>,
    ) -> PyResult<(String, u16, Py<PyAny>)> {
        let m = Metadata::decode(&metadata).map_err(|e| to_py(&Error::Wire(e)))?;
        let gpu = match m.gpu {
            GpuId::Bdf(s) => s.into_pyobject(py)?.into_any().unbind(),
            GpuId::Index(i) => i.into_pyobject(py)?.into_any().unbind(),
        };
        Ok((m.ip.to_string(), m.port, gpu))
    }

    /// Connections are accepted in the background from creation on; kept for
    /// compatibility.
    fn start_passive_accept(&self) -> bool {
        true
    }

    /// `(ok, conn_id)`. `remote_gpu_bdf` is the peer's PCI bus id or GPU
    /// index (`remote_gpu`, the name of our first releases, is accepted
    /// too); `remote_port=-1` means `TCPX_P2P_PORT + the peer's index`.
    #[pyo3(signature = (remote_ip_addr, remote_gpu_bdf=None, remote_port=None, *, remote_gpu=None))]
    fn connect(
        &self,
        py: Python<'_>,
        remote_ip_addr: String,
        remote_gpu_bdf: Option<Bound<'_, PyAny>>,
        #[pyo3(from_py_with = args::remote_port)] remote_port: Option<u16>,
        remote_gpu: Option<Bound<'_, PyAny>>,
    ) -> PyResult<(bool, i64)> {
        let g = match (remote_gpu_bdf, remote_gpu) {
            (Some(g), None) | (None, Some(g)) => g,
            (Some(_), Some(_)) => {
                return Err(PyTypeError::new_err(
                    "connect() got both remote_gpu_bdf and its older name remote_gpu",
                ))
            }
            (None, None) => {
                return Err(PyTypeError::new_err(
                    "connect() missing required argument 'remote_gpu_bdf'",
                ))
            }
        };
        let gpu = if g.is_instance_of::<PyString>() {
            RemoteGpu::Bdf(g.extract()?)
        } else if g.is_instance_of::<pyo3::types::PyInt>() {
            let i = args::i64_named(&g, "remote_gpu_bdf")?;
            RemoteGpu::Index(i32::try_from(i).map_err(|_| {
                InvalidArgumentError::new_err(format!("remote_gpu_bdf: {i} is not a GPU index"))
            })?)
        } else {
            return Err(PyTypeError::new_err(
                "argument 'remote_gpu_bdf': expected a PCI bus id (str) or a GPU index (int)",
            ));
        };
        let port = match remote_port {
            Some(p) => Ok(p),
            None => {
                let base = self.ep.config().port;
                match &gpu {
                    RemoteGpu::Index(i) if base != 0 && *i >= 0 => u16::try_from(*i)
                        .ok()
                        .and_then(|i| base.checked_add(i))
                        .ok_or_else(|| {
                            Error::Invalid(format!(
                                "connect: TCPX_P2P_PORT {base} + GPU index {i} is not a port"
                            ))
                        }),
                    _ => Err(Error::Invalid(
                        "connect: no remote_port given; pass it (from the peer's metadata) or set TCPX_P2P_PORT on both sides".into(),
                    )),
                }
            }
        };
        let r = port.and_then(|p| py.detach(|| self.ep.connect(&remote_ip_addr, p, Some(gpu))));
        Ok(match self.check(py, r) {
            Some(id) => (true, id as i64),
            None => (false, -1),
        })
    }

    /// Blocks until a peer connects: `(ok, remote_ip, remote_gpu_idx, conn_id)`.
    /// `timeout` in seconds; None or `math.inf`: no limit.
    #[pyo3(signature = (timeout=None))]
    fn accept(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::timeout)] timeout: Option<Duration>,
    ) -> (bool, String, i32, i64) {
        let r = py.detach(|| self.ep.accept(timeout));
        match self.check(py, r) {
            Some(a) => (true, a.ip.to_string(), a.gpu_index, a.conn as i64),
            None => (false, String::new(), -1, -1),
        }
    }

    fn add_remote_endpoint(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::metadata_bytes)] metadata_bytes: Vec<u8>,
    ) -> (bool, i64) {
        let r = py.detach(|| self.ep.add_remote_endpoint(&metadata_bytes));
        match self.check(py, r) {
            Some(id) => (true, id as i64),
            None => (false, -1),
        }
    }

    fn remove_remote_endpoint(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
    ) -> bool {
        let r = py.detach(|| self.ep.remove_conn(conn_id));
        self.check(py, r).is_some()
    }

    /// The id of the `rank`-th connection of this endpoint (in the order they
    /// were made or accepted), or -1.
    fn conn_id_of_rank(&self, #[pyo3(from_py_with = args::rank)] rank: usize) -> i64 {
        self.ep
            .conn_ids()
            .get(rank)
            .map(|&c| c as i64)
            .unwrap_or(-1)
    }

    #[pyo3(signature = (ptr, size, floatType=None))]
    #[allow(non_snake_case)]
    fn reg(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        floatType: Option<FloatType>,
    ) -> (bool, i64) {
        let _ = floatType;
        match self.check(py, self.ep.reg(ptr, size)) {
            Some(id) => (true, id as i64),
            None => (false, -1),
        }
    }

    fn regv(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::ptrs)] ptrs: Vec<u64>,
        #[pyo3(from_py_with = args::sizes)] sizes: Vec<usize>,
    ) -> PyResult<(bool, Vec<i64>)> {
        if ptrs.len() != sizes.len() {
            return Err(InvalidArgumentError::new_err(format!(
                "regv: {} ptrs but {} sizes",
                ptrs.len(),
                sizes.len()
            )));
        }
        let mut ids = Vec::with_capacity(ptrs.len());
        for (p, s) in ptrs.iter().zip(&sizes) {
            match self.check(py, self.ep.reg(*p, *s)) {
                Some(id) => ids.push(id),
                None => {
                    // Nothing half-done: undo what this call registered.
                    for id in ids {
                        let _ = self.ep.dereg(id);
                    }
                    return Ok((false, vec![]));
                }
            }
        }
        Ok((true, ids.into_iter().map(|i| i as i64).collect()))
    }

    /// Deregisters a region (a `register_memory` handle through its cache:
    /// the shared keys stay while another handle of the range lives).
    fn dereg(&self, py: Python<'_>, #[pyo3(from_py_with = args::mr_id)] mr_id: u64) -> bool {
        let r = py.detach(|| self.release(mr_id));
        self.check(py, r).is_some()
    }

    /// Registers torch tensors (anything with `data_ptr()`, `numel()`,
    /// `element_size()`) and returns their descriptors. The same range
    /// registered again gets a new `mr_id` and the same keys (see
    /// `deregister_memory`).
    fn register_memory(&self, tensor_list: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<XferDesc>> {
        let mut out = Vec::with_capacity(tensor_list.len());
        for (i, t) in tensor_list.iter().enumerate() {
            for m in ["data_ptr", "numel", "element_size"] {
                if !t.hasattr(m)? {
                    return Err(InvalidArgumentError::new_err(format!(
                        "tensor_list[{i}]: not a tensor (it has no {m}() method)"
                    )));
                }
            }
            let ptr = args::u64_named(
                &t.call_method0("data_ptr")?,
                &format!("tensor_list[{i}].data_ptr()"),
            )?;
            let n = args::u64_named(
                &t.call_method0("numel")?,
                &format!("tensor_list[{i}].numel()"),
            )?;
            let es = args::u64_named(
                &t.call_method0("element_size")?,
                &format!("tensor_list[{i}].element_size()"),
            )?;
            let size = n
                .checked_mul(es)
                .and_then(|s| usize::try_from(s).ok())
                .ok_or_else(|| {
                    InvalidArgumentError::new_err(format!(
                        "tensor_list[{i}]: {n} elements of {es} bytes overflow a size"
                    ))
                })?;
            let d = self.register_range(ptr, size).map_err(|e| to_py(&e))?;
            out.push(d);
        }
        Ok(out)
    }

    /// Releases `register_memory` descriptors. As in UCCL, a descriptor that
    /// is no longer registered (or whose `mr_id` is 2**64-1) is skipped; the
    /// reason is logged and kept for `last_error()`.
    fn deregister_memory(&self, py: Python<'_>, desc_list: Vec<XferDesc>) {
        for d in desc_list {
            if d.mr_id == u64::MAX {
                continue;
            }
            let r = py.detach(|| self.release(d.mr_id));
            self.check(py, r);
        }
    }

    fn get_serialized_descs<'py>(
        &self,
        py: Python<'py>,
        desc_list: Vec<XferDesc>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let entries = desc_list
            .iter()
            .map(XferDesc::entry)
            .collect::<EResult<Vec<_>>>()
            .map_err(|e| to_py(&e))?;
        let mut v = Vec::new();
        wire::encode_descs(&entries, &mut v);
        Ok(PyBytes::new(py, &v))
    }

    #[staticmethod]
    fn deserialize_descs(
        #[pyo3(from_py_with = args::serialized_bytes)] serialized_bytes: Vec<u8>,
    ) -> PyResult<Vec<XferDesc>> {
        // No bytes: no descriptors, as in UCCL.
        if serialized_bytes.is_empty() {
            return Ok(vec![]);
        }
        let l = wire::decode_descs(&serialized_bytes).map_err(|e| to_py(&Error::Wire(e)))?;
        Ok(l.into_iter()
            .map(|d| XferDesc {
                addr: d.addr,
                size: d.size,
                mr_id: d.mr_id,
                lkeys: vec![],
                rkeys: vec![d.token.id, d.token.secret],
            })
            .collect())
    }

    /// One-sided, descriptor based: `op_name` is "read" or "write";
    /// local descriptor i ↔ remote descriptor i. `(ok, transfer_id)`. As in
    /// UCCL, misuse raises: an unknown or removed `conn_id`
    /// (`"Invalid conn_id"`), another `op_name`, lists of different lengths,
    /// a remote descriptor without keys.
    fn transfer(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        op_name: &str,
        local_desc_list: Vec<XferDesc>,
        remote_desc_list: Vec<XferDesc>,
    ) -> PyResult<(bool, i64)> {
        let read = match op_name {
            "read" => true,
            "write" => false,
            other => {
                return Err(InvalidArgumentError::new_err(format!(
                    "transfer: Invalid op_name {other:?} (\"read\" or \"write\")"
                )))
            }
        };
        if local_desc_list.len() != remote_desc_list.len() {
            return Err(InvalidArgumentError::new_err(format!(
                "transfer: {} local but {} remote descriptors (local and remote descriptors must have the same size)",
                local_desc_list.len(),
                remote_desc_list.len()
            )));
        }
        if let Err(Error::Invalid(why)) = self.ep.conn_failure(conn_id) {
            return Err(InvalidArgumentError::new_err(format!(
                "Invalid conn_id {conn_id}: {why}"
            )));
        }
        let local = local_desc_list
            .iter()
            .map(XferDesc::buf)
            .collect::<EResult<Vec<Buf>>>()
            .map_err(|e| to_py(&e))?;
        let remote = remote_desc_list
            .iter()
            .map(XferDesc::entry)
            .collect::<EResult<Vec<_>>>()
            .map_err(|e| to_py(&e))?;
        Ok(self.started(py, |ep| ep.transfer(conn_id, read, &local, &remote)))
    }

    fn send(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id)] mr_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
    ) -> bool {
        let b = one(mr_id, ptr, size);
        self.blocking(py, |ep| ep.send_async(conn_id, &b))
    }
    fn recv(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id)] mr_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
    ) -> bool {
        let b = one(mr_id, ptr, size);
        self.blocking(py, |ep| ep.recv_async(conn_id, &b))
    }
    fn send_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id)] mr_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
    ) -> (bool, i64) {
        let b = one(mr_id, ptr, size);
        self.started(py, |ep| ep.send_async(conn_id, &b))
    }
    fn recv_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id)] mr_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
    ) -> (bool, i64) {
        let b = one(mr_id, ptr, size);
        self.started(py, |ep| ep.recv_async(conn_id, &b))
    }

    fn sendv(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id_v)] mr_id_v: Vec<u64>,
        #[pyo3(from_py_with = args::data_ptr_v)] data_ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::num_iovs)] num_iovs: usize,
    ) -> PyResult<bool> {
        let b = two_sided("sendv", &mr_id_v, &data_ptr_v, &size_v, num_iovs)?;
        Ok(self.blocking(py, |ep| ep.send_async(conn_id, &b)))
    }
    fn recvv(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id_v)] mr_id_v: Vec<u64>,
        #[pyo3(from_py_with = args::data_ptr_v)] data_ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::num_iovs)] num_iovs: usize,
    ) -> PyResult<bool> {
        let b = two_sided("recvv", &mr_id_v, &data_ptr_v, &size_v, num_iovs)?;
        Ok(self.blocking(py, |ep| ep.recv_async(conn_id, &b)))
    }
    fn sendv_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id_v)] mr_id_v: Vec<u64>,
        #[pyo3(from_py_with = args::data_ptr_v)] data_ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::num_iovs)] num_iovs: usize,
    ) -> PyResult<(bool, i64)> {
        let b = two_sided("sendv_async", &mr_id_v, &data_ptr_v, &size_v, num_iovs)?;
        Ok(self.started(py, |ep| ep.send_async(conn_id, &b)))
    }
    fn recvv_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id_v)] mr_id_v: Vec<u64>,
        #[pyo3(from_py_with = args::data_ptr_v)] data_ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::num_iovs)] num_iovs: usize,
    ) -> PyResult<(bool, i64)> {
        let b = two_sided("recvv_async", &mr_id_v, &data_ptr_v, &size_v, num_iovs)?;
        Ok(self.started(py, |ep| ep.recv_async(conn_id, &b)))
    }

    /// `(ok, 64-byte descriptor)` of `[ptr, ptr+size)`. Two forms:
    /// `advertise(conn_id, mr_id, ptr, size)` (UCCL 0.1.1: for the peer of
    /// `conn_id` only) and `advertise(mr_id, ptr, size)` (UCCL's newer form:
    /// usable on any connection to this endpoint). Either way the peer may
    /// touch exactly that range.
    #[pyo3(signature = (*args, **kwargs))]
    fn advertise<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<(bool, Bound<'py, PyBytes>)> {
        let a = args::bind_forms(
            "advertise",
            args,
            kwargs,
            &[
                &["conn_id", "mr_id", "ptr", "size"],
                &["mr_id", "ptr", "size"],
            ],
        )?;
        let (conn, rest) = match a.len() {
            4 => (Some(args::conn_id(&a[0])?), &a[1..]),
            _ => (None, &a[..]),
        };
        let mr = args::mr_id(&rest[0])?;
        let ptr = args::ptr(&rest[1])?;
        let size = args::size(&rest[2])?;
        let r = match conn {
            Some(c) => self.ep.advertise(c, mr, ptr, size),
            None => self.ep.advertise_any(mr, ptr, size),
        };
        Ok(match self.check(py, r) {
            Some(d) => (true, PyBytes::new(py, &d)),
            None => (false, PyBytes::new(py, &[])),
        })
    }

    /// `(ok, [descriptor])`: `advertisev(conn_id, mr_id_v, ptr_v, size_v,
    /// num_iovs)` or, without a connection, `advertisev(mr_id_v, ptr_v,
    /// size_v, num_iovs)` (see `advertise`).
    #[pyo3(signature = (*args, **kwargs))]
    fn advertisev<'py>(
        &self,
        py: Python<'py>,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<(bool, Bound<'py, PyList>)> {
        let a = args::bind_forms(
            "advertisev",
            args,
            kwargs,
            &[
                &["conn_id", "mr_id_v", "ptr_v", "size_v", "num_iovs"],
                &["mr_id_v", "ptr_v", "size_v", "num_iovs"],
            ],
        )?;
        let (conn, rest) = match a.len() {
            5 => (Some(args::conn_id(&a[0])?), &a[1..]),
            _ => (None, &a[..]),
        };
        let mr_id_v = args::mr_id_v(&rest[0])?;
        let ptr_v = args::ptr_v(&rest[1])?;
        let size_v = args::size_v(&rest[2])?;
        let n = args::num_iovs(&rest[3])?;
        check_lens(
            "advertisev",
            n,
            &[
                ("mr_id_v", mr_id_v.len()),
                ("ptr_v", ptr_v.len()),
                ("size_v", size_v.len()),
            ],
        )?;
        let r = bufs(&mr_id_v, &ptr_v, &size_v, n).and_then(|bs| {
            bs.iter()
                .map(|b| match conn {
                    Some(c) => self.ep.advertise(c, b.mr, b.ptr, b.len),
                    None => self.ep.advertise_any(b.mr, b.ptr, b.len),
                })
                .collect::<EResult<Vec<_>>>()
        });
        match self.check(py, r) {
            Some(ds) => Ok((
                true,
                PyList::new(py, ds.iter().map(|d| PyBytes::new(py, d)))?,
            )),
            None => Ok((false, PyList::empty(py))),
        }
    }

    fn write(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id)] mr_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        #[pyo3(from_py_with = args::meta)] meta: Vec<u8>,
    ) -> PyResult<bool> {
        let (b, m) = (one(mr_id, ptr, size), [fifo_arg(&meta, "meta")?]);
        Ok(self.blocking(py, |ep| ep.write_async(conn_id, &b, &m)))
    }
    fn read(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id)] mr_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        #[pyo3(from_py_with = args::meta)] meta: Vec<u8>,
    ) -> PyResult<bool> {
        let (b, m) = (one(mr_id, ptr, size), [fifo_arg(&meta, "meta")?]);
        Ok(self.blocking(py, |ep| ep.read_async(conn_id, &b, &m)))
    }
    fn write_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id)] mr_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        #[pyo3(from_py_with = args::meta)] meta: Vec<u8>,
    ) -> PyResult<(bool, i64)> {
        let (b, m) = (one(mr_id, ptr, size), [fifo_arg(&meta, "meta")?]);
        Ok(self.started(py, |ep| ep.write_async(conn_id, &b, &m)))
    }
    fn read_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id)] mr_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        #[pyo3(from_py_with = args::meta)] meta: Vec<u8>,
    ) -> PyResult<(bool, i64)> {
        let (b, m) = (one(mr_id, ptr, size), [fifo_arg(&meta, "meta")?]);
        Ok(self.started(py, |ep| ep.read_async(conn_id, &b, &m)))
    }

    #[allow(clippy::too_many_arguments)]
    fn writev(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id_v)] mr_id_v: Vec<u64>,
        #[pyo3(from_py_with = args::ptr_v)] ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::meta_blob_v)] meta_blob_v: Vec<Vec<u8>>,
        #[pyo3(from_py_with = args::num_iovs)] num_iovs: usize,
    ) -> PyResult<bool> {
        let (b, m) = vec_args("writev", &mr_id_v, &ptr_v, &size_v, &meta_blob_v, num_iovs)?;
        Ok(self.blocking(py, |ep| ep.write_async(conn_id, &b, &m)))
    }
    #[allow(clippy::too_many_arguments)]
    fn readv(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id_v)] mr_id_v: Vec<u64>,
        #[pyo3(from_py_with = args::ptr_v)] ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::meta_blob_v)] meta_blob_v: Vec<Vec<u8>>,
        #[pyo3(from_py_with = args::num_iovs)] num_iovs: usize,
    ) -> PyResult<bool> {
        let (b, m) = vec_args("readv", &mr_id_v, &ptr_v, &size_v, &meta_blob_v, num_iovs)?;
        Ok(self.blocking(py, |ep| ep.read_async(conn_id, &b, &m)))
    }
    #[allow(clippy::too_many_arguments)]
    fn writev_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id_v)] mr_id_v: Vec<u64>,
        #[pyo3(from_py_with = args::ptr_v)] ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::meta_blob_v)] meta_blob_v: Vec<Vec<u8>>,
        #[pyo3(from_py_with = args::num_iovs)] num_iovs: usize,
    ) -> PyResult<(bool, i64)> {
        let (b, m) = vec_args(
            "writev_async",
            &mr_id_v,
            &ptr_v,
            &size_v,
            &meta_blob_v,
            num_iovs,
        )?;
        Ok(self.started(py, |ep| ep.write_async(conn_id, &b, &m)))
    }
    #[allow(clippy::too_many_arguments)]
    fn readv_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id_v)] mr_id_v: Vec<u64>,
        #[pyo3(from_py_with = args::ptr_v)] ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::meta_blob_v)] meta_blob_v: Vec<Vec<u8>>,
        #[pyo3(from_py_with = args::num_iovs)] num_iovs: usize,
    ) -> PyResult<(bool, i64)> {
        let (b, m) = vec_args(
            "readv_async",
            &mr_id_v,
            &ptr_v,
            &size_v,
            &meta_blob_v,
            num_iovs,
        )?;
        Ok(self.started(py, |ep| ep.read_async(conn_id, &b, &m)))
    }

    /// `(ok, is_done)`; ok is False when the transfer failed (see
    /// `last_error()`). A done transfer is forgotten after it is reported.
    fn poll_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::transfer_id)] transfer_id: u64,
    ) -> (bool, bool) {
        match self.check(py, self.ep.poll(transfer_id)) {
            Some(done) => (true, done),
            None => (false, false),
        }
    }

    /// Waits for a transfer (seconds; None or `math.inf` = no limit). True
    /// when done, False when it failed (see `last_error()`) or is still
    /// running at the timeout.
    #[pyo3(signature = (transfer_id, timeout=None))]
    fn wait(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::transfer_id)] transfer_id: u64,
        #[pyo3(from_py_with = args::timeout)] timeout: Option<Duration>,
    ) -> bool {
        let r = py.detach(|| self.ep.wait(transfer_id, timeout));
        self.check(py, r).unwrap_or(false)
    }

    /// Gives a transfer up (seconds to wait; None = no limit). One none of
    /// whose data has moved (a write the peer has not cleared yet, a small
    /// read not yet answered) is called back at once; one whose data is
    /// moving runs to its end. True once it has ended either way (its
    /// buffers are free and its id is forgotten), False if it still runs
    /// at the timeout. The connection goes on.
    #[pyo3(signature = (transfer_id, timeout=None))]
    fn cancel(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::transfer_id)] transfer_id: u64,
        #[pyo3(from_py_with = args::timeout)] timeout: Option<Duration>,
    ) -> bool {
        let r = py.detach(|| self.ep.cancel(transfer_id, timeout));
        self.check(py, r).unwrap_or(false)
    }

    /// Ids of the open connections.
    fn conn_ids(&self) -> Vec<u64> {
        self.ep.conn_ids()
    }

    /// The net in use (`socket` or the plugin's name).
    fn net_name(&self) -> String {
        self.ep.net_name()
    }

    /// The net connection `conn_id`'s data rides (`socket`, `same-host`
    /// with `TCPX_P2P_SAME_HOST_NET=1` between endpoints of one machine, or
    /// the plugin's name).
    fn conn_net(&self, conn_id: u64) -> PyResult<String> {
        self.ep.conn_net(conn_id).map_err(|e| to_py(&e))
    }

    /// The GPU index of this endpoint (-1: none).
    fn gpu_index(&self) -> i32 {
        self.ep.gpu_index()
    }

    /// This endpoint's name, sent with its notifications (`TCPX_P2P_NAME`,
    /// default `hostname:port`).
    fn name(&self) -> String {
        self.ep.name().to_string()
    }

    /// Sends `msg` (at most 1 MiB) to the peer of `conn_id`; the peer's
    /// `get_notifs()` returns it with this endpoint's name. False on
    /// failure (see `last_error()`).
    fn send_notif(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::msg)] msg: Vec<u8>,
    ) -> bool {
        let r = py.detach(|| self.ep.send_notif(conn_id, &msg));
        self.check(py, r).is_some()
    }

    /// Takes every notification received so far, oldest first:
    /// `[(sender name, message)]`.
    fn get_notifs<'py>(&self, py: Python<'py>) -> Vec<(String, Bound<'py, PyBytes>)> {
        self.ep
            .get_notifs()
            .into_iter()
            .map(|n| (n.from_name, PyBytes::new(py, &n.msg)))
            .collect()
    }

    /// `write_async`, then `notif` sent to the peer once every byte has
    /// landed there (not sent if the write fails).
    #[allow(clippy::too_many_arguments)]
    fn write_async_with_notif(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id)] mr_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        #[pyo3(from_py_with = args::meta)] meta: Vec<u8>,
        #[pyo3(from_py_with = args::notif)] notif: Vec<u8>,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            let b = Buf {
                mr: mr_id,
                ptr,
                len: size,
            };
            ep.write_async_with_notif(conn_id, &[b], &[fifo(&meta)?], Some(&notif))
        })
    }

    /// `read_async`, then `notif` sent to the data's owner once every byte
    /// has landed here (not sent if the read fails).
    #[allow(clippy::too_many_arguments)]
    fn read_async_with_notif(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::mr_id)] mr_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        #[pyo3(from_py_with = args::meta)] meta: Vec<u8>,
        #[pyo3(from_py_with = args::notif)] notif: Vec<u8>,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            let b = Buf {
                mr: mr_id,
                ptr,
                len: size,
            };
            ep.read_async_with_notif(conn_id, &[b], &[fifo(&meta)?], Some(&notif))
        })
    }
    // ---------------------------------------------------------------------
    // Same-host calls (UCCL v0.1.1's names and keywords): connections to an
    // endpoint of this machine; GPU memory by CUDA IPC, host memory by
    // cross-memory attach. Pointers need no registration; `info` blobs
    // come from the peer's `advertise_ipc` and are opaque.

    /// `(ok, conn_id)`. `remote_gpu_bdf`: the peer's PCI bus id, its GPU
    /// index, or its `get_metadata()` bytes (exact, also for host-only
    /// endpoints and several endpoints on one GPU).
    /// UCCL's own tests also pass `remote_gpu_idx=`: accepted as another
    /// name for the same argument.
    #[pyo3(signature = (remote_gpu_bdf=None, remote_gpu_idx=None))]
    fn connect_local(
        &self,
        py: Python<'_>,
        remote_gpu_bdf: Option<Bound<'_, PyAny>>,
        remote_gpu_idx: Option<Bound<'_, PyAny>>,
    ) -> PyResult<(bool, i64)> {
        let remote_gpu_bdf = match (remote_gpu_bdf, remote_gpu_idx) {
            (Some(b), None) | (None, Some(b)) => b,
            _ => {
                return Err(PyTypeError::new_err(
                    "connect_local: give exactly one of remote_gpu_bdf and remote_gpu_idx",
                ))
            }
        };
        Ok(self.connect_local_to(py, remote_gpu_bdf))
    }

    /// Blocks until an endpoint of this host connects:
    /// `(ok, remote_gpu_bdf, conn_id)` (the bdf is the GPU index as a string
    /// where the peer has no PCI bus id).
    #[pyo3(signature = (timeout=None))]
    fn accept_local(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::timeout)] timeout: Option<Duration>,
    ) -> (bool, String, i64) {
        let r = py.detach(|| self.ep.accept_local(timeout));
        match self.check(py, r) {
            Some(a) => {
                let bdf = if !a.gpu_bdf.is_empty() {
                    a.gpu_bdf
                } else if a.gpu_index >= 0 {
                    a.gpu_index.to_string()
                } else {
                    String::new()
                };
                (true, bdf, a.conn as i64)
            }
            None => (false, String::new(), -1),
        }
    }

    /// `(ok, info)`: an opaque descriptor of `[ptr, ptr+size)` for the peer.
    fn advertise_ipc<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
    ) -> (bool, Bound<'py, PyBytes>) {
        match self.check(py, self.ep.advertise_ipc(conn_id, ptr, size)) {
            Some(d) => (true, PyBytes::new(py, &d)),
            None => (false, PyBytes::new(py, &[])),
        }
    }

    fn advertisev_ipc<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr_v)] ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
    ) -> PyResult<(bool, Bound<'py, PyList>)> {
        let r = ipc_pairs(&ptr_v, &size_v, None).and_then(|bs| {
            bs.iter()
                .map(|&(p, n)| self.ep.advertise_ipc(conn_id, p, n))
                .collect::<EResult<Vec<_>>>()
        });
        match self.check(py, r) {
            Some(ds) => Ok((
                true,
                PyList::new(py, ds.iter().map(|d| PyBytes::new(py, d)))?,
            )),
            None => Ok((false, PyList::empty(py))),
        }
    }

    fn write_ipc(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        #[pyo3(from_py_with = args::info)] info: Vec<u8>,
    ) -> bool {
        let r = py.detach(|| self.ep.write_ipc(conn_id, &[(ptr, size)], &[&info]));
        self.check(py, r).is_some()
    }

    fn read_ipc(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        #[pyo3(from_py_with = args::info)] info: Vec<u8>,
    ) -> bool {
        let r = py.detach(|| self.ep.read_ipc(conn_id, &[(ptr, size)], &[&info]));
        self.check(py, r).is_some()
    }

    fn write_ipc_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        #[pyo3(from_py_with = args::info)] info: Vec<u8>,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            ep.write_ipc_async(conn_id, &[(ptr, size)], &[&info])
        })
    }

    fn read_ipc_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
        #[pyo3(from_py_with = args::info)] info: Vec<u8>,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            ep.read_ipc_async(conn_id, &[(ptr, size)], &[&info])
        })
    }

    fn writev_ipc(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr_v)] ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::info_v)] info_v: Vec<Vec<u8>>,
    ) -> bool {
        let r = py.detach(|| {
            let b = ipc_pairs(&ptr_v, &size_v, Some(info_v.len()))?;
            let i: Vec<&[u8]> = info_v.iter().map(Vec::as_slice).collect();
            self.ep.write_ipc(conn_id, &b, &i)
        });
        self.check(py, r).is_some()
    }

    fn readv_ipc(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr_v)] ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::info_v)] info_v: Vec<Vec<u8>>,
    ) -> bool {
        let r = py.detach(|| {
            let b = ipc_pairs(&ptr_v, &size_v, Some(info_v.len()))?;
            let i: Vec<&[u8]> = info_v.iter().map(Vec::as_slice).collect();
            self.ep.read_ipc(conn_id, &b, &i)
        });
        self.check(py, r).is_some()
    }

    fn writev_ipc_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr_v)] ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::info_v)] info_v: Vec<Vec<u8>>,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            let b = ipc_pairs(&ptr_v, &size_v, Some(info_v.len()))?;
            let i: Vec<&[u8]> = info_v.iter().map(Vec::as_slice).collect();
            ep.write_ipc_async(conn_id, &b, &i)
        })
    }

    fn readv_ipc_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr_v)] ptr_v: Vec<u64>,
        #[pyo3(from_py_with = args::size_v)] size_v: Vec<usize>,
        #[pyo3(from_py_with = args::info_v)] info_v: Vec<Vec<u8>>,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            let b = ipc_pairs(&ptr_v, &size_v, Some(info_v.len()))?;
            let i: Vec<&[u8]> = info_v.iter().map(Vec::as_slice).collect();
            ep.read_ipc_async(conn_id, &b, &i)
        })
    }

    /// Two-sided on a local connection, matched with the peer's `recv_ipc`
    /// calls in posting order.
    fn send_ipc(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
    ) -> bool {
        self.blocking(py, |ep| ep.send_ipc_async(conn_id, ptr, size))
    }

    fn recv_ipc(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
    ) -> bool {
        self.blocking(py, |ep| ep.recv_ipc_async(conn_id, ptr, size))
    }

    fn send_ipc_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
    ) -> (bool, i64) {
        self.started(py, |ep| ep.send_ipc_async(conn_id, ptr, size))
    }

    fn recv_ipc_async(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = args::conn_id)] conn_id: u64,
        #[pyo3(from_py_with = args::ptr)] ptr: u64,
        #[pyo3(from_py_with = args::size)] size: usize,
    ) -> (bool, i64) {
        self.started(py, |ep| ep.recv_ipc_async(conn_id, ptr, size))
    }
}

/// The IP address an endpoint advertises.
#[pyfunction]
fn get_oob_ip() -> PyResult<String> {
    let cfg = Config::from_env().map_err(|e| to_py(&e))?;
    tcpx_p2p::oob_ip(cfg.ifname.as_deref())
        .map(|ip| ip.to_string())
        .map_err(|e| to_py(&e))
}

/// TCP streams per socket-net comm under the current environment
/// (`TCPX_P2P_STREAMS` or the engine's default).
#[pyfunction]
fn configured_streams() -> PyResult<usize> {
    Config::from_env().map(|c| c.streams).map_err(|e| to_py(&e))
}

/// Number of CUDA GPUs this process sees (0 without CUDA).
#[pyfunction]
fn cuda_device_count() -> usize {
    tcpx_p2p_gpu::device_count()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Endpoint>()?;
    m.add_class::<XferDesc>()?;
    m.add_class::<FloatType>()?;
    m.add_function(wrap_pyfunction!(get_oob_ip, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(configured_streams, m)?)?;
    rawtcp::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    Ok(())
}
