//! The Python face of tcpx-p2p: a thin PyO3 layer over the engine crate.
//! Each method extracts its arguments, runs the engine call with the GIL
//! released (`py.detach`), and converts the result into the shapes that
//! applications written for UCCL's P2P engine expect.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use tcpx_p2p::wire::{self, DescEntry, FifoItem, GpuId, Metadata};
use tcpx_p2p::{Buf, Config, Error, RemoteGpu};

mod errors;
use errors::{log_warning, to_py};

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

/// A registered buffer as `register_memory` returns it. `rkeys` holds the
/// token a peer must present to use it: `[advertisement id, secret]`.
#[pyclass(get_all, set_all, module = "tcpx_p2p._native")]
#[derive(Clone, Debug)]
struct XferDesc {
    addr: u64,
    size: u64,
    mr_id: u64,
    lkeys: Vec<u64>,
    rkeys: Vec<u64>,
}

#[pymethods]
impl XferDesc {
    #[new]
    #[pyo3(signature = (addr, size, mr_id, lkeys=vec![], rkeys=vec![]))]
    fn new(addr: u64, size: u64, mr_id: u64, lkeys: Vec<u64>, rkeys: Vec<u64>) -> Self {
        XferDesc {
            addr,
            size,
            mr_id,
            lkeys,
            rkeys,
        }
    }
    fn __repr__(&self) -> String {
        format!(
            "XferDesc(addr={:#x}, size={}, mr_id={})",
            self.addr, self.size, self.mr_id
        )
    }
    /// Picklable, so descriptors can travel through torch.distributed or
    /// multiprocessing.
    #[allow(clippy::type_complexity)]
    fn __reduce__<'py>(
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
    fn entry(&self) -> EResult<DescEntry> {
        let token = tcpx_p2p::endpoint::token_from_keys(&self.rkeys).ok_or_else(|| {
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
    fn buf(&self) -> Buf {
        Buf {
            mr: self.mr_id,
            ptr: self.addr,
            len: self.size as usize,
        }
    }
}

/// An endpoint: one GPU (or host memory only), its connections and regions.
#[pyclass(frozen, module = "tcpx_p2p._native")]
struct Endpoint {
    ep: tcpx_p2p::Endpoint,
    last_error: Mutex<String>,
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
    if tcpx_p2p::gpu::device_count() == 0 {
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
    /// and ignored.
    #[new]
    #[pyo3(signature = (local_gpu_idx=None, num_cpus=None))]
    fn new(py: Python<'_>, local_gpu_idx: Option<i32>, num_cpus: Option<i64>) -> PyResult<Self> {
        let _ = num_cpus;
        tcpx_p2p::init_logging();
        let gpu = local_gpu_idx.or_else(|| default_gpu(py));
        let ep = py
            .detach(|| Config::from_env().and_then(|c| tcpx_p2p::Endpoint::new(gpu, c)))
            .map_err(|e| to_py(&e))?;
        Ok(Endpoint {
            ep,
            last_error: Mutex::new(String::new()),
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
    fn parse_metadata(py: Python<'_>, metadata: &[u8]) -> PyResult<(String, u16, Py<PyAny>)> {
        let m = Metadata::decode(metadata).map_err(|e| to_py(&Error::Wire(e)))?;
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

    /// `(ok, conn_id)`. `remote_gpu` is an index or a PCI bus id;
    /// `remote_port=-1` means `TCPX_P2P_PORT + remote_gpu`.
    #[pyo3(signature = (remote_ip_addr, remote_gpu, remote_port=-1))]
    fn connect(
        &self,
        py: Python<'_>,
        remote_ip_addr: String,
        remote_gpu: Bound<'_, PyAny>,
        remote_port: i64,
    ) -> (bool, i64) {
        let gpu = if let Ok(i) = remote_gpu.extract::<i32>() {
            Ok(RemoteGpu::Index(i))
        } else if let Ok(s) = remote_gpu.extract::<String>() {
            Ok(RemoteGpu::Bdf(s))
        } else {
            Err(Error::Invalid(
                "connect: remote_gpu must be an int index or a PCI bus id string".into(),
            ))
        };
        let port = if remote_port >= 0 {
            u16::try_from(remote_port)
                .map_err(|_| Error::Invalid(format!("connect: port {remote_port} out of range")))
        } else {
            let base = self.ep.config().port;
            match &gpu {
                Ok(RemoteGpu::Index(i)) if base != 0 && *i >= 0 => Ok(base.saturating_add(*i as u16)),
                _ => Err(Error::Invalid(
                    "connect: no remote_port given; pass it (from the peer's metadata) or set TCPX_P2P_PORT on both sides".into(),
                )),
            }
        };
        let r = match (gpu, port) {
            (Ok(g), Ok(p)) => py.detach(|| self.ep.connect(&remote_ip_addr, p, Some(g))),
            (Err(e), _) | (_, Err(e)) => Err(e),
        };
        match self.check(py, r) {
            Some(id) => (true, id as i64),
            None => (false, -1),
        }
    }

    /// Blocks until a peer connects: `(ok, remote_ip, remote_gpu_idx, conn_id)`.
    #[pyo3(signature = (timeout=None))]
    fn accept(&self, py: Python<'_>, timeout: Option<f64>) -> (bool, String, i32, i64) {
        let t = timeout.map(std::time::Duration::from_secs_f64);
        let r = py.detach(|| self.ep.accept(t));
        match self.check(py, r) {
            Some(a) => (true, a.ip.to_string(), a.gpu_index, a.conn as i64),
            None => (false, String::new(), -1, -1),
        }
    }

    fn add_remote_endpoint(&self, py: Python<'_>, metadata: Vec<u8>) -> (bool, i64) {
        let r = py.detach(|| self.ep.add_remote_endpoint(&metadata));
        match self.check(py, r) {
            Some(id) => (true, id as i64),
            None => (false, -1),
        }
    }

    fn remove_remote_endpoint(&self, py: Python<'_>, conn_id: u64) -> bool {
        let r = py.detach(|| self.ep.remove_conn(conn_id));
        self.check(py, r).is_some()
    }

    /// The id of the `rank`-th connection of this endpoint (in the order they
    /// were made or accepted), or -1.
    fn conn_id_of_rank(&self, rank: usize) -> i64 {
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
        ptr: u64,
        size: usize,
        floatType: Option<FloatType>,
    ) -> (bool, i64) {
        let _ = floatType;
        match self.check(py, self.ep.reg(ptr, size)) {
            Some(id) => (true, id as i64),
            None => (false, -1),
        }
    }

    fn regv(&self, py: Python<'_>, ptrs: Vec<u64>, sizes: Vec<usize>) -> (bool, Vec<i64>) {
        if ptrs.len() != sizes.len() {
            self.check::<()>(
                py,
                Err(Error::Invalid(format!(
                    "regv: {} ptrs but {} sizes",
                    ptrs.len(),
                    sizes.len()
                ))),
            );
            return (false, vec![]);
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
                    return (false, vec![]);
                }
            }
        }
        (true, ids.into_iter().map(|i| i as i64).collect())
    }

    fn dereg(&self, py: Python<'_>, mr_id: u64) -> bool {
        let r = py.detach(|| self.ep.dereg(mr_id));
        self.check(py, r).is_some()
    }

    /// Registers torch tensors (anything with `data_ptr()`, `numel()`,
    /// `element_size()`) and returns their descriptors.
    fn register_memory(&self, tensors: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<XferDesc>> {
        let mut out = Vec::with_capacity(tensors.len());
        for t in &tensors {
            let ptr: u64 = t.call_method0("data_ptr")?.extract()?;
            let n: u64 = t.call_method0("numel")?.extract()?;
            let es: u64 = t.call_method0("element_size")?.extract()?;
            let size = n * es;
            let r = self
                .ep
                .reg(ptr, size as usize)
                .and_then(|mr| self.ep.export_region(mr));
            let d = r.map_err(|e| to_py(&e))?;
            out.push(XferDesc {
                addr: d.addr,
                size: d.size,
                mr_id: d.mr_id,
                lkeys: vec![d.mr_id],
                rkeys: vec![d.token.id, d.token.secret],
            });
        }
        Ok(out)
    }

    fn deregister_memory(&self, py: Python<'_>, descs: Vec<XferDesc>) -> PyResult<()> {
        for d in descs {
            py.detach(|| self.ep.dereg(d.mr_id))
                .map_err(|e| to_py(&e))?;
        }
        Ok(())
    }

    fn get_serialized_descs<'py>(
        &self,
        py: Python<'py>,
        descs: Vec<XferDesc>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let entries = descs
            .iter()
            .map(XferDesc::entry)
            .collect::<EResult<Vec<_>>>()
            .map_err(|e| to_py(&e))?;
        let mut v = Vec::new();
        wire::encode_descs(&entries, &mut v);
        Ok(PyBytes::new(py, &v))
    }

    #[staticmethod]
    fn deserialize_descs(b: &[u8]) -> PyResult<Vec<XferDesc>> {
        let l = wire::decode_descs(b).map_err(|e| to_py(&Error::Wire(e)))?;
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
    /// local descriptor i ↔ remote descriptor i. `(ok, transfer_id)`.
    fn transfer(
        &self,
        py: Python<'_>,
        conn_id: u64,
        op_name: &str,
        local_descs: Vec<XferDesc>,
        remote_descs: Vec<XferDesc>,
    ) -> (bool, i64) {
        let read = match op_name {
            "read" => true,
            "write" => false,
            other => {
                self.check::<()>(
                    py,
                    Err(Error::Invalid(format!(
                        "transfer: op_name must be \"read\" or \"write\", not {other:?}"
                    ))),
                );
                return (false, -1);
            }
        };
        if local_descs.len() != remote_descs.len() {
            self.check::<()>(
                py,
                Err(Error::Invalid(format!(
                    "transfer: {} local but {} remote descriptors",
                    local_descs.len(),
                    remote_descs.len()
                ))),
            );
            return (false, -1);
        }
        let local: Vec<Buf> = local_descs.iter().map(XferDesc::buf).collect();
        let remote = match remote_descs
            .iter()
            .map(XferDesc::entry)
            .collect::<EResult<Vec<_>>>()
        {
            Ok(r) => r,
            Err(e) => {
                self.check::<()>(py, Err(e));
                return (false, -1);
            }
        };
        self.started(py, |ep| ep.transfer(conn_id, read, &local, &remote))
    }

    fn send(&self, py: Python<'_>, conn_id: u64, mr_id: u64, ptr: u64, size: usize) -> bool {
        self.blocking(py, |ep| {
            ep.send_async(
                conn_id,
                &[Buf {
                    mr: mr_id,
                    ptr,
                    len: size,
                }],
            )
        })
    }
    fn recv(&self, py: Python<'_>, conn_id: u64, mr_id: u64, ptr: u64, size: usize) -> bool {
        self.blocking(py, |ep| {
            ep.recv_async(
                conn_id,
                &[Buf {
                    mr: mr_id,
                    ptr,
                    len: size,
                }],
            )
        })
    }
    fn send_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: usize,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            ep.send_async(
                conn_id,
                &[Buf {
                    mr: mr_id,
                    ptr,
                    len: size,
                }],
            )
        })
    }
    fn recv_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: usize,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            ep.recv_async(
                conn_id,
                &[Buf {
                    mr: mr_id,
                    ptr,
                    len: size,
                }],
            )
        })
    }

    fn sendv(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_ids: Vec<u64>,
        ptrs: Vec<u64>,
        sizes: Vec<usize>,
        num_iovs: usize,
    ) -> bool {
        self.blocking(py, |ep| {
            ep.send_async(conn_id, &bufs(&mr_ids, &ptrs, &sizes, num_iovs)?)
        })
    }
    fn recvv(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_ids: Vec<u64>,
        ptrs: Vec<u64>,
        sizes: Vec<usize>,
        num_iovs: usize,
    ) -> bool {
        self.blocking(py, |ep| {
            ep.recv_async(conn_id, &bufs(&mr_ids, &ptrs, &sizes, num_iovs)?)
        })
    }
    fn sendv_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_ids: Vec<u64>,
        ptrs: Vec<u64>,
        sizes: Vec<usize>,
        num_iovs: usize,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            ep.send_async(conn_id, &bufs(&mr_ids, &ptrs, &sizes, num_iovs)?)
        })
    }
    fn recvv_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_ids: Vec<u64>,
        ptrs: Vec<u64>,
        sizes: Vec<usize>,
        num_iovs: usize,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            ep.recv_async(conn_id, &bufs(&mr_ids, &ptrs, &sizes, num_iovs)?)
        })
    }

    /// `(ok, 64-byte descriptor)` of `[ptr, ptr+size)` for the peer of `conn_id`.
    fn advertise<'py>(
        &self,
        py: Python<'py>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: usize,
    ) -> (bool, Bound<'py, PyBytes>) {
        match self.check(py, self.ep.advertise(conn_id, mr_id, ptr, size)) {
            Some(d) => (true, PyBytes::new(py, &d)),
            None => (false, PyBytes::new(py, &[])),
        }
    }

    fn advertisev<'py>(
        &self,
        py: Python<'py>,
        conn_id: u64,
        mr_ids: Vec<u64>,
        ptrs: Vec<u64>,
        sizes: Vec<usize>,
        num_iovs: usize,
    ) -> PyResult<(bool, Bound<'py, PyList>)> {
        let r = bufs(&mr_ids, &ptrs, &sizes, num_iovs).and_then(|bs| {
            bs.iter()
                .map(|b| self.ep.advertise(conn_id, b.mr, b.ptr, b.len))
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
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: usize,
        meta: Vec<u8>,
    ) -> bool {
        self.blocking(py, |ep| {
            ep.write_async(
                conn_id,
                &[Buf {
                    mr: mr_id,
                    ptr,
                    len: size,
                }],
                &[fifo(&meta)?],
            )
        })
    }
    fn read(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: usize,
        meta: Vec<u8>,
    ) -> bool {
        self.blocking(py, |ep| {
            ep.read_async(
                conn_id,
                &[Buf {
                    mr: mr_id,
                    ptr,
                    len: size,
                }],
                &[fifo(&meta)?],
            )
        })
    }
    fn write_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: usize,
        meta: Vec<u8>,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            ep.write_async(
                conn_id,
                &[Buf {
                    mr: mr_id,
                    ptr,
                    len: size,
                }],
                &[fifo(&meta)?],
            )
        })
    }
    fn read_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_id: u64,
        ptr: u64,
        size: usize,
        meta: Vec<u8>,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            ep.read_async(
                conn_id,
                &[Buf {
                    mr: mr_id,
                    ptr,
                    len: size,
                }],
                &[fifo(&meta)?],
            )
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn writev(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_ids: Vec<u64>,
        ptrs: Vec<u64>,
        sizes: Vec<usize>,
        metas: Vec<Vec<u8>>,
        num_iovs: usize,
    ) -> bool {
        self.blocking(py, |ep| {
            let (b, m) = vec_args(&mr_ids, &ptrs, &sizes, &metas, num_iovs)?;
            ep.write_async(conn_id, &b, &m)
        })
    }
    #[allow(clippy::too_many_arguments)]
    fn readv(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_ids: Vec<u64>,
        ptrs: Vec<u64>,
        sizes: Vec<usize>,
        metas: Vec<Vec<u8>>,
        num_iovs: usize,
    ) -> bool {
        self.blocking(py, |ep| {
            let (b, m) = vec_args(&mr_ids, &ptrs, &sizes, &metas, num_iovs)?;
            ep.read_async(conn_id, &b, &m)
        })
    }
    #[allow(clippy::too_many_arguments)]
    fn writev_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_ids: Vec<u64>,
        ptrs: Vec<u64>,
        sizes: Vec<usize>,
        metas: Vec<Vec<u8>>,
        num_iovs: usize,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            let (b, m) = vec_args(&mr_ids, &ptrs, &sizes, &metas, num_iovs)?;
            ep.write_async(conn_id, &b, &m)
        })
    }
    #[allow(clippy::too_many_arguments)]
    fn readv_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        mr_ids: Vec<u64>,
        ptrs: Vec<u64>,
        sizes: Vec<usize>,
        metas: Vec<Vec<u8>>,
        num_iovs: usize,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            let (b, m) = vec_args(&mr_ids, &ptrs, &sizes, &metas, num_iovs)?;
            ep.read_async(conn_id, &b, &m)
        })
    }

    /// `(ok, is_done)`; ok is False when the transfer failed (see
    /// `last_error()`). A done transfer is forgotten after it is reported.
    fn poll_async(&self, py: Python<'_>, transfer_id: u64) -> (bool, bool) {
        match self.check(py, self.ep.poll(transfer_id)) {
            Some(done) => (true, done),
            None => (false, false),
        }
    }

    /// Waits for a transfer (seconds; None = no limit). True when done, False
    /// when it failed (see `last_error()`) or is still running at the timeout.
    #[pyo3(signature = (transfer_id, timeout=None))]
    fn wait(&self, py: Python<'_>, transfer_id: u64, timeout: Option<f64>) -> bool {
        let t = timeout.map(std::time::Duration::from_secs_f64);
        let r = py.detach(|| self.ep.wait(transfer_id, t));
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

    /// The GPU index of this endpoint (-1: none).
    fn gpu_index(&self) -> i32 {
        self.ep.gpu_index()
    }

    // ---------------------------------------------------------------------
    // Same-host calls (UCCL v0.1.1's names and keywords): connections to an
    // endpoint of this machine; GPU memory by CUDA IPC, host memory by
    // cross-memory attach. Pointers need no registration; `info` blobs
    // come from the peer's `advertise_ipc` and are opaque.

    /// `(ok, conn_id)`. `remote_gpu_bdf`: the peer's PCI bus id, its GPU
    /// index, or its `get_metadata()` bytes (exact, also for host-only
    /// endpoints and several endpoints on one GPU).
    fn connect_local(&self, py: Python<'_>, remote_gpu_bdf: Bound<'_, PyAny>) -> (bool, i64) {
        let peer = if let Ok(b) = remote_gpu_bdf.cast::<PyBytes>() {
            Ok(tcpx_p2p::local::LocalPeer::Metadata(b.as_bytes().to_vec()))
        } else if let Ok(i) = remote_gpu_bdf.extract::<i32>() {
            Ok(tcpx_p2p::local::LocalPeer::Index(i))
        } else if let Ok(s) = remote_gpu_bdf.extract::<String>() {
            Ok(tcpx_p2p::local::LocalPeer::Bdf(s))
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

    /// Blocks until an endpoint of this host connects:
    /// `(ok, remote_gpu_bdf, conn_id)` (the bdf is the GPU index as a string
    /// where the peer has no PCI bus id).
    #[pyo3(signature = (timeout=None))]
    fn accept_local(&self, py: Python<'_>, timeout: Option<f64>) -> (bool, String, i64) {
        let t = timeout.map(std::time::Duration::from_secs_f64);
        let r = py.detach(|| self.ep.accept_local(t));
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
        conn_id: u64,
        ptr: u64,
        size: usize,
    ) -> (bool, Bound<'py, PyBytes>) {
        match self.check(py, self.ep.advertise_ipc(conn_id, ptr, size)) {
            Some(d) => (true, PyBytes::new(py, &d)),
            None => (false, PyBytes::new(py, &[])),
        }
    }

    fn advertisev_ipc<'py>(
        &self,
        py: Python<'py>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
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
        conn_id: u64,
        ptr: u64,
        size: usize,
        info: Vec<u8>,
    ) -> bool {
        let r = py.detach(|| self.ep.write_ipc(conn_id, &[(ptr, size)], &[&info]));
        self.check(py, r).is_some()
    }

    fn read_ipc(&self, py: Python<'_>, conn_id: u64, ptr: u64, size: usize, info: Vec<u8>) -> bool {
        let r = py.detach(|| self.ep.read_ipc(conn_id, &[(ptr, size)], &[&info]));
        self.check(py, r).is_some()
    }

    fn write_ipc_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr: u64,
        size: usize,
        info: Vec<u8>,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            ep.write_ipc_async(conn_id, &[(ptr, size)], &[&info])
        })
    }

    fn read_ipc_async(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr: u64,
        size: usize,
        info: Vec<u8>,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            ep.read_ipc_async(conn_id, &[(ptr, size)], &[&info])
        })
    }

    fn writev_ipc(
        &self,
        py: Python<'_>,
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        info_v: Vec<Vec<u8>>,
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
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        info_v: Vec<Vec<u8>>,
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
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        info_v: Vec<Vec<u8>>,
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
        conn_id: u64,
        ptr_v: Vec<u64>,
        size_v: Vec<usize>,
        info_v: Vec<Vec<u8>>,
    ) -> (bool, i64) {
        self.started(py, |ep| {
            let b = ipc_pairs(&ptr_v, &size_v, Some(info_v.len()))?;
            let i: Vec<&[u8]> = info_v.iter().map(Vec::as_slice).collect();
            ep.read_ipc_async(conn_id, &b, &i)
        })
    }

    /// Two-sided on a local connection, matched with the peer's `recv_ipc`
    /// calls in posting order.
    fn send_ipc(&self, py: Python<'_>, conn_id: u64, ptr: u64, size: usize) -> bool {
        self.blocking(py, |ep| ep.send_ipc_async(conn_id, ptr, size))
    }

    fn recv_ipc(&self, py: Python<'_>, conn_id: u64, ptr: u64, size: usize) -> bool {
        self.blocking(py, |ep| ep.recv_ipc_async(conn_id, ptr, size))
    }

    fn send_ipc_async(&self, py: Python<'_>, conn_id: u64, ptr: u64, size: usize) -> (bool, i64) {
        self.started(py, |ep| ep.send_ipc_async(conn_id, ptr, size))
    }

    fn recv_ipc_async(&self, py: Python<'_>, conn_id: u64, ptr: u64, size: usize) -> (bool, i64) {
        self.started(py, |ep| ep.recv_ipc_async(conn_id, ptr, size))
    }
}

/// `(ptr, size)` pairs of a vector same-host call, checked against each
/// other (and against the number of descriptors where given).
fn ipc_pairs(ptr_v: &[u64], size_v: &[usize], infos: Option<usize>) -> EResult<Vec<(u64, usize)>> {
    if ptr_v.len() != size_v.len() || infos.is_some_and(|n| n != ptr_v.len()) {
        return Err(Error::Invalid(format!(
            "{} pointers, {} sizes{}: the lists must have one entry per buffer",
            ptr_v.len(),
            size_v.len(),
            infos
                .map(|n| format!(" and {n} descriptors"))
                .unwrap_or_default()
        )));
    }
    Ok(ptr_v.iter().copied().zip(size_v.iter().copied()).collect())
}

fn vec_args(
    mr_ids: &[u64],
    ptrs: &[u64],
    sizes: &[usize],
    metas: &[Vec<u8>],
    n: usize,
) -> EResult<(Vec<Buf>, Vec<FifoItem>)> {
    let b = bufs(mr_ids, ptrs, sizes, n)?;
    if metas.len() < n {
        return Err(Error::Invalid(format!(
            "num_iovs is {n} but {} metas were given",
            metas.len()
        )));
    }
    let m = metas[..n]
        .iter()
        .map(|m| fifo(m))
        .collect::<EResult<Vec<_>>>()?;
    Ok((b, m))
}

/// The IP address an endpoint advertises.
#[pyfunction]
fn get_oob_ip() -> PyResult<String> {
    let cfg = Config::from_env().map_err(|e| to_py(&e))?;
    tcpx_p2p::topo::oob_ip(cfg.ifname.as_deref())
        .map(|ip| ip.to_string())
        .map_err(|e| to_py(&Error::Config(e)))
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
    tcpx_p2p::gpu::device_count()
}

/// Starts the raw-TCP reference server on `ip:port` (0 = any) in the
/// background; returns the port.
#[pyfunction]
#[pyo3(signature = (ip, port=0))]
fn rawtcp_serve(ip: &str, port: u16) -> PyResult<u16> {
    let l = std::net::TcpListener::bind((ip, port)).map_err(|e| {
        to_py(&Error::Io {
            what: format!("raw TCP reference: bind {ip}:{port}"),
            source: e,
        })
    })?;
    let port = l.local_addr().map(|a| a.port()).unwrap_or(0);
    std::thread::Builder::new()
        .name("tcpx-rawtcp".into())
        .spawn(move || {
            if let Err(e) = tcpx_p2p::rawtcp::serve(l) {
                tracing::warn!("raw TCP reference server stopped: {e}");
            }
        })
        .map_err(|e| {
            to_py(&Error::Io {
                what: "spawning raw TCP server".into(),
                source: e,
            })
        })?;
    Ok(port)
}

/// Runs the raw-TCP reference: seconds of the whole run (throughput) or of
/// each round trip (`pingpong`).
#[pyfunction]
#[pyo3(signature = (ip, port, streams, size, iters, pingpong=false))]
fn rawtcp_run(
    py: Python<'_>,
    ip: &str,
    port: u16,
    streams: usize,
    size: usize,
    iters: usize,
    pingpong: bool,
) -> PyResult<Vec<f64>> {
    let addr: std::net::SocketAddr = format!("{ip}:{port}")
        .parse()
        .map_err(|_| to_py(&Error::Invalid(format!("bad address {ip}:{port}"))))?;
    let run = tcpx_p2p::rawtcp::RawRun {
        streams,
        size,
        iters,
        pingpong,
    };
    py.detach(|| tcpx_p2p::rawtcp::run(addr, run))
        .map(|v| v.iter().map(|d| d.as_secs_f64()).collect())
        .map_err(|e| to_py(&e))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Endpoint>()?;
    m.add_class::<XferDesc>()?;
    m.add_class::<FloatType>()?;
    m.add_function(wrap_pyfunction!(get_oob_ip, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(configured_streams, m)?)?;
    m.add_function(wrap_pyfunction!(rawtcp_serve, m)?)?;
    m.add_function(wrap_pyfunction!(rawtcp_run, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    Ok(())
}
