//! The endpoint: one GPU (or none), a net, a control listener, the memory
//! registry and the connections. Every call is thread-safe; every async call
//! returns a transfer id at once.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use crate::admission::{Admission, AdmissionLimits};
use crate::config::{Config, NetKind};
use crate::conn::{Conn, ConnParams, Held};
use crate::error::{Error, Result};
use crate::handler::Limits;
use crate::memory::Registry;
use crate::net::plugin::PluginNet;
use crate::net::socket::{SocketConfig, SocketNet};
use crate::net::{MemRef, Net, OneNet, SameHostConfig, SameHostNet, SameHostPaths};
use crate::notif::{Notif, NotifLimits, NotifQueue, QUEUE_MAX, QUEUE_MAX_BYTES};
use crate::pieces::Pieces;
use crate::transfer::{Failure, Status, Transfer};
use crate::wire::{DescEntry, FifoItem, GpuId, Metadata, RmaItem, Token};
use crate::workers::Workers;
use crate::{gpu, topo};

/// Between two rounds of progress driven by a blocking wait, it watches
/// its transfer this long.
const POKE_GAP: Duration = Duration::from_micros(5);

/// A buffer of a transfer: `len` bytes at `ptr` inside registered region `mr`.
#[derive(Debug, Clone, Copy)]
pub struct Buf {
    pub mr: u64,
    pub ptr: u64,
    pub len: usize,
}

/// Which GPU of the peer a connect is meant for.
#[derive(Debug, Clone)]
pub enum RemoteGpu {
    Index(i32),
    Bdf(String),
}

/// A connection accepted from a peer.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub conn: u64,
    pub ip: IpAddr,
    pub gpu_index: i32,
}

struct Inner {
    cfg: Config,
    gpu_index: i32,
    gpu_bdf: String,
    params: ConnParams,
    addr: SocketAddr,
    registry: Arc<Registry>,
    conns: RwLock<HashMap<u64, Arc<Conn>>>,
    /// Connections that failed or closed, newest last: why (bounded).
    gone: Mutex<VecDeque<(u64, Failure)>>,
    accepted: Mutex<VecDeque<u64>>,
    accepted_cv: Condvar,
    transfers: Mutex<HashMap<u64, Arc<Transfer>>>,
    by_metadata: Mutex<HashMap<Vec<u8>, u64>>,
    next_conn: Arc<AtomicU64>,
    next_xfer: AtomicU64,
    stopping: AtomicBool,
    /// What accepted peers together may make us hold (see [`crate::admission`]).
    admission: Arc<Admission>,
    /// Sent with our notifications.
    name: String,
    /// Notifications received from peers, until taken.
    notifs: Arc<NotifQueue>,
    /// Same-host connections' listeners (see [`crate::local`]).
    local: Arc<crate::local::Hub>,
    /// The parameters of a same-host connection: the same-host net.
    local_params: ConnParams,
}

/// A transfer engine endpoint.
pub struct Endpoint {
    inner: Arc<Inner>,
    /// The control listener's task on the I/O workers.
    acceptor: Option<Arc<crate::workers::Home>>,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

/// The net of `cfg`; `gpu` is the endpoint's GPU (None: host memory only).
fn make_net(
    cfg: &Config,
    ip: IpAddr,
    gpu: Option<i32>,
    cpus: Option<Arc<[usize]>>,
    workers: &Workers,
) -> Result<Arc<dyn Net>> {
    match cfg.net {
        NetKind::Socket => Ok(Arc::new(SocketNet::with_workers(
            SocketConfig {
                addr: ip,
                streams: cfg.streams,
                min_part: cfg.min_part,
                sockbuf: cfg.sockbuf,
                staging_slice: cfg.staging_slice,
                staging_depth: cfg.staging_depth,
                connect_timeout: cfg.connect_timeout,
                hello_timeout: cfg.stream_hello_timeout,
                spin: cfg.spin,
                linger: cfg.io_linger,
                cpus,
                gpu,
                splice: cfg.splice,
                stall: cfg.deadline,
            },
            workers.clone(),
        ))),
        NetKind::Plugin => PluginNet::load(&cfg.plugin_path, gpu)
            .map(|n| Arc::new(n) as Arc<dyn Net>)
            .map_err(|e| Error::Config(format!("TCPX_P2P_NET=plugin: {e}"))),
    }
}

impl Endpoint {
    /// An endpoint on GPU `gpu` (None: no GPU; host memory only). Where CUDA
    /// is absent the index is kept as a label and host memory is used.
    pub fn new(gpu: Option<i32>, cfg: Config) -> Result<Self> {
        let (gpu_index, gpu_bdf) = match gpu {
            Some(i) if gpu::available() => {
                let n = gpu::device_count();
                if i < 0 || i as usize >= n {
                    return Err(Error::invalid(format!(
                        "Endpoint: GPU index {i} does not exist: this machine has {n} GPU(s), indices 0 to {}",
                        n.saturating_sub(1)
                    )));
                }
                let d = gpu::Device::get(i)?;
                d.bind()?;
                (i, d.bdf.clone())
            }
            // Without CUDA, index 0 names "this machine" (host memory).
            Some(0) => (0, String::new()),
            Some(i) => {
                return Err(Error::invalid(format!(
                    "Endpoint: GPU index {i} does not exist: this machine has no usable GPU (CUDA unavailable); use 0 or no GPU for host memory"
                )))
            }
            None => (-1, String::new()),
        };
        let ip = topo::oob_ip(cfg.ifname.as_deref())?;
        let port = if cfg.port == 0 {
            0
        } else {
            cfg.port.saturating_add(gpu_index.max(0) as u16)
        };
        let listener = TcpListener::bind(SocketAddr::new(ip, port))
            .map_err(|e| Error::io(format!("binding the control listener on {ip}:{port}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("control listener", e))?;
        let registry = Arc::new(Registry::new());
        let cpus = topo::io_cpus(&cfg.cpu_affinity, &gpu_bdf);
        // One pool of I/O workers runs every peer's streams and tasks.
        let workers = Workers::new("tcpx-io", cpus.clone())
            .map_err(|e| Error::io("starting the I/O workers", e))?;
        workers.set_spin(cfg.spin);
        let net = make_net(
            &cfg,
            ip,
            (gpu_index >= 0 && gpu::available()).then_some(gpu_index),
            cpus.clone(),
            &workers,
        )?;
        let most = net.max_requests();
        let window = |v: usize| if v == 0 { most } else { v.min(most) };
        let windows = (window(cfg.send_window), window(cfg.recv_window));
        // The net may take less per request (TCPX: 4 MiB).
        let chunk = cfg.chunk.min(net.max_message());
        let devices =
            topo::channel_devices(&net.devices(), gpu_index, &gpu_bdf, cfg.gpu_nics.as_deref());
        let notifs = Arc::new(NotifQueue::new(NotifLimits {
            max: QUEUE_MAX,
            max_bytes: QUEUE_MAX_BYTES,
            per_peer: cfg.notif_per_peer,
            per_peer_bytes: cfg.notif_per_peer_bytes,
        }));
        // The same-host net: the data path of same-host connections
        // (`connect_local`), and, with TCPX_P2P_SAME_HOST_NET=1, of
        // connections between endpoints of this machine.
        let same_host: Arc<dyn Net> = Arc::new(SameHostNet::with_workers(
            SameHostConfig::from_env(
                (gpu_index >= 0 && gpu::available()).then_some(gpu_index),
                cfg.connect_timeout,
                cfg.io_linger,
            ),
            workers.clone(),
        ));
        let params = ConnParams {
            paths: if cfg.same_host_net {
                Arc::new(SameHostPaths {
                    default: net.clone(),
                    same_host: same_host.clone(),
                })
            } else {
                Arc::new(OneNet(net.clone()))
            },
            net,
            registry: registry.clone(),
            gpu_index,
            gpu_bdf: gpu_bdf.clone(),
            channels: cfg.channels,
            chunk,
            windows,
            auth_key: cfg
                .auth_token
                .as_deref()
                .unwrap_or("")
                .as_bytes()
                .to_vec()
                .into(),
            limits: Limits {
                max_requests: cfg.max_requests,
                max_items: cfg.max_pending_items,
            },
            max_peer_streams: cfg.max_peer_streams,
            max_peer_channels: cfg.max_peer_channels,
            timeout: cfg.connect_timeout,
            spin: cfg.spin,
            deadline: cfg.deadline,
            devices,
            notifs: notifs.clone(),
            inline_max: cfg.inline_max.min(crate::wire::MAX_INLINE),
            sockbuf: cfg.sockbuf,
            workers,
            linger: cfg.io_linger,
        };
        let name = cfg.name.clone().unwrap_or_else(|| default_name(addr));
        let next_conn = Arc::new(AtomicU64::new(0));
        let local = crate::local::Hub::start(crate::local::HubParams {
            auth: crate::handshake::local_auth(&params.auth_key),
            gpu_index,
            gpu_bdf: gpu_bdf.clone(),
            timeout: cfg.connect_timeout,
            ip: addr.ip(),
            port: addr.port(),
            max_handshakes: cfg.max_handshakes,
            workers: params.workers.clone(),
        })?;
        let local_params = params.with_net(same_host);
        let stream_budget = cfg.stream_budget();
        let admission = Admission::new(AdmissionLimits {
            handshakes: cfg.max_handshakes,
            handshakes_per_ip: cfg.max_handshakes_per_ip,
            handshakes_per_subnet: cfg.max_handshakes_per_subnet,
            conns: cfg.max_conns,
            conns_per_ip: cfg.max_conns_per_ip,
            streams: stream_budget.0,
            streams_per_ip: stream_budget.1,
        });
        let inner = Arc::new(Inner {
            cfg,
            gpu_index,
            gpu_bdf,
            params,
            addr,
            registry,
            conns: RwLock::new(HashMap::new()),
            gone: Mutex::new(VecDeque::new()),
            accepted: Mutex::new(VecDeque::new()),
            accepted_cv: Condvar::new(),
            transfers: Mutex::new(HashMap::new()),
            by_metadata: Mutex::new(HashMap::new()),
            next_conn,
            next_xfer: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            admission,
            notifs,
            name,
            local,
            local_params,
        });
        let weak = Arc::downgrade(&inner);
        inner.local.set_establish(Box::new(move |s, initiator| {
            let inner = weak
                .upgrade()
                .ok_or_else(|| Error::invalid("the endpoint is closing"))?;
            establish_local(&inner, s, initiator)
        }));
        let acceptor = control_listener(&inner.params.workers, Arc::downgrade(&inner), listener)
            .map_err(|e| Error::io("making the control listener non-blocking", e))?;
        let weak = Arc::downgrade(&inner);
        let watchdog = std::thread::Builder::new()
            .name("tcpx-watchdog".into())
            .spawn(move || watchdog_loop(weak))
            .map_err(|e| Error::io("spawning watchdog", e))?;
        tracing::info!(%addr, gpu = gpu_index, net = inner.params.net.name(), "endpoint ready");
        Ok(Endpoint {
            inner,
            acceptor: Some(acceptor),
            watchdog: Some(watchdog),
        })
    }

    pub fn config(&self) -> &Config {
        &self.inner.cfg
    }
    pub fn gpu_index(&self) -> i32 {
        self.inner.gpu_index
    }
    /// The advertised control address.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.addr
    }
    pub fn net_name(&self) -> String {
        self.inner.params.net.name().to_string()
    }

    /// `ip | port | bdf_len | bdf` (see [`Metadata`]).
    pub fn metadata(&self) -> Vec<u8> {
        let mut v = Vec::new();
        Metadata {
            ip: self.inner.addr.ip(),
            port: self.inner.addr.port(),
            gpu: if self.inner.gpu_bdf.is_empty() {
                GpuId::Bdf(String::new())
            } else {
                GpuId::Bdf(self.inner.gpu_bdf.clone())
            },
        }
        .encode(&mut v);
        v
    }

    /// Connects to the endpoint listening at `ip:port`.
    pub fn connect(&self, ip: &str, port: u16, remote_gpu: Option<RemoteGpu>) -> Result<u64> {
        let ip: IpAddr = ip
            .trim()
            .parse()
            .map_err(|_| Error::invalid(format!("connect: {ip:?} is not an IP address")))?;
        let addr = SocketAddr::new(ip, port);
        if port == 0 {
            return Err(Error::invalid(
                "connect: port 0 (give the peer's port, or set TCPX_P2P_PORT on both sides)",
            ));
        }
        let cerr = |reason: String| Error::Connect {
            peer: addr.to_string(),
            reason,
        };
        let s = TcpStream::connect_timeout(&addr, self.inner.cfg.connect_timeout).map_err(|e| {
            cerr(match e.kind() {
                std::io::ErrorKind::ConnectionRefused => "connection refused: nobody listens there (is the peer endpoint running, and is the port right?)".into(),
                _ => e.to_string(),
            })
        })?;
        let id = self.inner.next_conn.fetch_add(1, Ordering::Relaxed);
        let s = crate::ctl::Ctl::Tcp(s);
        let params = self.inner.params.for_peer(&s);
        let conn = Conn::establish(id, s, true, &params, None)?;
        if let Some(want) = remote_gpu {
            let ok = match &want {
                RemoteGpu::Index(i) => *i < 0 || conn.remote_gpu < 0 || *i == conn.remote_gpu,
                RemoteGpu::Bdf(b) => {
                    b.is_empty()
                        || conn.remote_bdf.is_empty()
                        || conn.remote_bdf.ends_with(&b.to_lowercase())
                }
            };
            if !ok {
                tracing::warn!(
                    conn = id,
                    "connected to GPU {} ({}) at {addr}, not the {want:?} asked for",
                    conn.remote_gpu,
                    conn.remote_bdf
                );
            }
        }
        self.inner.conns.write().insert(id, conn);
        Ok(id)
    }

    /// Waits for the next connection from a peer (None: forever).
    pub fn accept(&self, timeout: Option<Duration>) -> Result<Accepted> {
        let deadline = crate::timeout::deadline(timeout);
        let mut q = self.inner.accepted.lock();
        loop {
            if let Some(id) = q.pop_front() {
                drop(q);
                let conn = self.conn(id)?;
                return Ok(Accepted {
                    conn: id,
                    ip: conn.peer.ip(),
                    gpu_index: conn.remote_gpu,
                });
            }
            match deadline {
                Some(d) => {
                    if self.inner.accepted_cv.wait_until(&mut q, d).timed_out() && q.is_empty() {
                        return Err(Error::invalid("accept: no peer connected in time"));
                    }
                }
                None => self.inner.accepted_cv.wait(&mut q),
            }
        }
    }

    /// Connects by metadata, once per peer: a second call returns the same id.
    pub fn add_remote_endpoint(&self, metadata: &[u8]) -> Result<u64> {
        let m = Metadata::decode(metadata)?;
        if let Some(&id) = self.inner.by_metadata.lock().get(metadata) {
            if self.conn(id).is_ok_and(|c| c.failure().is_none()) {
                return Ok(id);
            }
        }
        let gpu = match m.gpu {
            GpuId::Bdf(b) => RemoteGpu::Bdf(b),
            GpuId::Index(i) => RemoteGpu::Index(i),
        };
        let id = self.connect(&m.ip.to_string(), m.port, Some(gpu))?;
        self.inner.by_metadata.lock().insert(metadata.to_vec(), id);
        Ok(id)
    }

    fn conn(&self, id: u64) -> Result<Arc<Conn>> {
        if let Some(c) = self.inner.conns.read().get(&id) {
            return Ok(c.clone());
        }
        match self.inner.gone.lock().iter().find(|(g, _)| *g == id) {
            Some((_, why)) => Err(why.clone().into_error(id)),
            None => Err(Error::invalid(format!("unknown connection id {id}"))),
        }
    }

    /// Closes a connection: what is in flight on it fails.
    pub fn remove_conn(&self, id: u64) -> Result<()> {
        let c = self
            .inner
            .conns
            .write()
            .remove(&id)
            .ok_or_else(|| Error::invalid(format!("unknown connection id {id}")))?;
        self.inner.by_metadata.lock().retain(|_, v| *v != id);
        c.close();
        Ok(())
    }

    /// Connection ids, oldest first.
    pub fn conn_ids(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.inner.conns.read().keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// What a connection makes this endpoint hold for its peer, for tests
    /// of the limits (see [`Held`]).
    #[doc(hidden)]
    pub fn held_for_peer(&self, id: u64) -> Result<Held> {
        Ok(self.conn(id)?.held())
    }

    /// The name of the net connection `id`'s data rides (`socket`,
    /// `same-host`, or the plugin's).
    pub fn conn_net(&self, id: u64) -> Result<String> {
        Ok(self.conn(id)?.net.clone())
    }

    /// Why a connection failed, if it did: also once the watchdog has
    /// released a failed connection (its id keeps the reason; before, the
    /// question then failed with the reason as its error, so a caller
    /// polling for the failure could miss it for good).
    pub fn conn_failure(&self, id: u64) -> Result<Option<String>> {
        if let Some(c) = self.inner.conns.read().get(&id) {
            return Ok(c.failure().map(|f| f.to_string()));
        }
        match self.inner.gone.lock().iter().find(|(g, _)| *g == id) {
            Some((_, why)) => Ok(Some(why.to_string())),
            None => Err(Error::invalid(format!("unknown connection id {id}"))),
        }
    }

    pub fn reg(&self, ptr: u64, len: usize) -> Result<u64> {
        Ok(self.inner.registry.register(ptr, len)?.id)
    }

    /// Deregisters a region. Its advertisements stop working at once, then
    /// it waits (up to `TCPX_P2P_DEREG_WAIT_MS`) for transfers still using
    /// it, a peer's write whose receives are posted into it included. If
    /// some remain, it refuses: the error says so and the region stays
    /// registered (and advertised) as before, so that no byte can land in
    /// memory the caller believes released. Ok means no byte will land.
    pub fn dereg(&self, mr: u64) -> Result<()> {
        // Leases of the region's advertisements are revoked once the
        // advertisements are gone; the wait covers the peers' answers.
        let revoke = |id| {
            let conns: Vec<Arc<Conn>> = self.inner.conns.read().values().cloned().collect();
            for c in conns {
                c.revoke_region(id);
            }
        };
        self.inner
            .registry
            .deregister_revoking(mr, self.inner.cfg.dereg_wait, revoke)?;
        for c in self.inner.conns.read().values() {
            c.drop_region(mr);
        }
        Ok(())
    }

    /// The 64-byte descriptor offering `[ptr, ptr+len)` to the peer of `conn`.
    pub fn advertise(&self, conn: u64, mr: u64, ptr: u64, len: usize) -> Result<[u8; 64]> {
        self.conn(conn)?;
        self.advertise_to(Some(conn), mr, ptr, len)
    }

    /// The 64-byte descriptor offering `[ptr, ptr+len)` to whichever
    /// connection of this endpoint presents it (UCCL's `advertise` without
    /// a connection). The record still bounds it to exactly that range, and
    /// the secret still has to match.
    pub fn advertise_any(&self, mr: u64, ptr: u64, len: usize) -> Result<[u8; 64]> {
        self.advertise_to(None, mr, ptr, len)
    }

    fn advertise_to(&self, conn: Option<u64>, mr: u64, ptr: u64, len: usize) -> Result<[u8; 64]> {
        Ok(self.advertise_item(conn, mr, ptr, len)?.to_bytes())
    }

    /// [`Endpoint::advertise_to`]'s record, not yet encoded.
    pub(super) fn advertise_item(
        &self,
        conn: Option<u64>,
        mr: u64,
        ptr: u64,
        len: usize,
    ) -> Result<FifoItem> {
        if len > u32::MAX as usize {
            return Err(Error::invalid(format!(
                "advertise: {len} bytes exceed the descriptor's 4 GiB size field; advertise smaller pieces"
            )));
        }
        let token = self.inner.registry.advertise(mr, ptr, len, conn)?;
        Ok(FifoItem {
            addr: ptr,
            size: len as u32,
            rkey: mr as u32,
            nmsgs: 1,
            rid: 0,
            idx: token.id,
            token,
        })
    }

    /// A descriptor of the whole region usable by any connected peer (what
    /// `register_memory` / `get_serialized_descs` hand out).
    pub fn export_region(&self, mr: u64) -> Result<DescEntry> {
        let r = self.inner.registry.get(mr)?;
        let token = self.inner.registry.advertise(mr, r.addr, r.len, None)?;
        Ok(DescEntry {
            addr: r.addr,
            size: r.len as u64,
            mr_id: mr,
            token,
        })
    }

    fn resolve_local(&self, bufs: &[Buf]) -> Result<Pieces> {
        if bufs.is_empty() {
            return Err(Error::invalid("no buffers given"));
        }
        let mut regions = self.inner.registry.checker();
        let mut out = Pieces::with_capacity(bufs.len());
        for b in bufs {
            let r = regions.check(b.mr, b.ptr, b.len)?;
            let mem = MemRef {
                addr: b.ptr,
                len: b.len,
                kind: r.kind,
            };
            out.push(mem, r);
        }
        Ok(out)
    }

    /// Every buffer inside the region it names, or why not (nothing
    /// resolved or held).
    fn check_local(&self, bufs: &[Buf]) -> Result<()> {
        if bufs.is_empty() {
            return Err(Error::invalid("no buffers given"));
        }
        let mut regions = self.inner.registry.checker();
        bufs.iter()
            .try_for_each(|b| regions.check_only(b.mr, b.ptr, b.len))
    }

    /// Receive buffers with their lengths clamped to what is registered
    /// from each pointer ([`crate::memory::Registry::recv_capacity`]).
    fn clamp_recv(&self, bufs: &[Buf]) -> Result<Vec<Buf>> {
        bufs.iter()
            .map(|b| {
                let len = self.inner.registry.recv_capacity(b.mr, b.ptr, b.len)?;
                Ok(Buf { len, ..*b })
            })
            .collect()
    }

    fn publish(&self, t: Arc<Transfer>) -> u64 {
        let id = t.id;
        self.inner.transfers.lock().insert(id, t);
        id
    }

    fn next_xfer(&self) -> u64 {
        self.inner.next_xfer.fetch_add(1, Ordering::Relaxed)
    }

    /// Two-sided send of one or more buffers; matched in posting order by the
    /// peer's receives of the same sizes.
    pub fn send_async(&self, conn: u64, bufs: &[Buf]) -> Result<u64> {
        let c = self.conn(conn)?;
        let local = self.resolve_local(bufs)?;
        Ok(self.publish(c.post_msg(self.next_xfer(), true, local)?))
    }

    /// Two-sided receive into one or more buffers. A buffer's length is a
    /// capacity: clamped to what is registered from its pointer (UCCL
    /// accepts a receive larger than its registration); a shorter message
    /// fills its start, a longer one fails the receive before any byte
    /// lands.
    pub fn recv_async(&self, conn: u64, bufs: &[Buf]) -> Result<u64> {
        let bufs = &self.clamp_recv(bufs)?;
        let c = self.conn(conn)?;
        let local = self.resolve_local(bufs)?;
        Ok(self.publish(c.post_msg(self.next_xfer(), false, local)?))
    }

    fn rma(
        &self,
        conn: u64,
        read: bool,
        bufs: &[Buf],
        remote: Vec<RmaItem>,
        remote_region: &[u64],
    ) -> Result<u64> {
        let clock = crate::net::timing::Steps::start(tracing::enabled!(tracing::Level::TRACE));
        let c = self.conn(conn)?;
        if remote.len() != bufs.len() || remote_region.len() != bufs.len() {
            return Err(Error::invalid(format!(
                "{} local buffers but {} remote descriptors",
                bufs.len(),
                remote.len().min(remote_region.len())
            )));
        }
        // Each part takes the next of the peer's items and region ids.
        let (mut items, mut regions) = (remote.into_iter(), remote_region.iter().copied());
        let part = |r: std::ops::Range<usize>| {
            Ok((
                self.resolve_local(&bufs[r.clone()])?,
                items.by_ref().take(r.len()).collect(),
                regions.by_ref().take(r.len()).collect(),
            ))
        };
        let t = self.post_rma_any(&c, read, bufs, part, clock)?;
        Ok(self.publish(t))
    }

    /// A one-sided request on the regions the peer advertised: its items,
    /// and each item's region id on the peer (so runs never span two).
    fn fifo_rma(&self, conn: u64, read: bool, bufs: &[Buf], metas: &[FifoItem]) -> Result<u64> {
        let items = bufs
            .iter()
            .zip(metas)
            .map(|(b, m)| {
                if b.len > m.size as usize {
                    return Err(Error::invalid(format!(
                        "{} bytes do not fit the {} bytes the peer advertised",
                        b.len, m.size
                    )));
                }
                Ok(RmaItem {
                    token: m.token,
                    addr: m.addr,
                    len: b.len as u64,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let regions: Vec<u64> = metas.iter().map(|m| m.rkey as u64).collect();
        self.rma(conn, read, bufs, items, &regions)
    }

    /// One-sided write of local buffers into the regions the peer advertised.
    pub fn write_async(&self, conn: u64, bufs: &[Buf], metas: &[FifoItem]) -> Result<u64> {
        self.fifo_rma(conn, false, bufs, metas)
    }

    /// One-sided read from the regions the peer advertised into local buffers.
    pub fn read_async(&self, conn: u64, bufs: &[Buf], metas: &[FifoItem]) -> Result<u64> {
        self.fifo_rma(conn, true, bufs, metas)
    }

    /// Descriptor-based transfer (`register_memory` descriptors of the peer):
    /// local buffer i ↔ the start of remote descriptor i.
    pub fn transfer(
        &self,
        conn: u64,
        read: bool,
        bufs: &[Buf],
        remote: &[DescEntry],
    ) -> Result<u64> {
        let items = bufs
            .iter()
            .zip(remote)
            .map(|(b, d)| {
                if b.len as u64 > d.size {
                    return Err(Error::invalid(format!(
                        "{} bytes do not fit the peer's {}-byte descriptor",
                        b.len, d.size
                    )));
                }
                Ok(RmaItem {
                    token: d.token,
                    addr: d.addr,
                    len: b.len as u64,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let regions: Vec<u64> = remote.iter().map(|d| d.mr_id).collect();
        self.rma(conn, read, bufs, items, &regions)
    }

    fn status_of(&self, xfer: u64) -> Result<Arc<Transfer>> {
        self.inner
            .transfers
            .lock()
            .get(&xfer)
            .cloned()
            .ok_or_else(|| {
                Error::invalid(format!(
                    "unknown transfer id {xfer} (already completed and polled?)"
                ))
            })
    }

    fn finish(&self, t: &Transfer, s: Status) -> Result<bool> {
        match s {
            Status::Pending => Ok(false),
            Status::Done => {
                self.inner.transfers.lock().remove(&t.id);
                Ok(true)
            }
            Status::Failed(f) => {
                self.inner.transfers.lock().remove(&t.id);
                Err(f.into_error(t.conn))
            }
        }
    }

    /// True once the transfer is done (it is then forgotten); an error if it failed.
    pub fn poll(&self, xfer: u64) -> Result<bool> {
        let t = self.status_of(xfer)?;
        if !t.ended() {
            // A caller polling in a loop drives progress itself, as a
            // blocking wait does: its transfer completes without a hand-off
            // to a woken thread.
            if let Some(c) = self.inner.conns.read().get(&t.conn).cloned() {
                c.poke();
            }
            self.inner.params.workers.keep_spinning(self.inner.cfg.spin);
        }
        self.finish(&t, t.status())
    }

    /// Waits for the transfer to end (None: no limit).
    pub fn wait(&self, xfer: u64, timeout: Option<Duration>) -> Result<bool> {
        let t = self.status_of(xfer)?;
        // Busy phase: drive the connection's progress from this thread (no
        // hand-off to wait for), then sleep on the transfer.
        let deadline = crate::timeout::deadline(timeout);
        // (No spinning unless the machine leaves CPUs idle: see
        // `crate::spin`.)
        let busy = self.inner.cfg.wait_spin;
        let spin = timeout.map_or(busy, |d| d.min(busy));
        let conn = self.inner.conns.read().get(&t.conn).cloned();
        if let Some(leave) = (!spin.is_zero() && !t.ended())
            .then(crate::spin::start)
            .flatten()
        {
            // Its next steps may be jobs of the I/O workers: one spins too.
            self.inner.params.workers.keep_spinning(spin);
            let start = Instant::now();
            while !t.ended() && start.elapsed() < spin && leave.pays() {
                // Each round keeps the window's end, and where the spinning
                // worker went off with a job, brings another idle one to
                // spin (one spins at a time).
                self.inner
                    .params
                    .workers
                    .keep_spinning(spin.saturating_sub(start.elapsed()));
                if let Some(c) = &conn {
                    c.poke();
                }
                // A round of progress takes the connection's locks: the
                // next waits a little, watching the transfer meanwhile.
                let round = Instant::now();
                while !t.ended() && round.elapsed() < POKE_GAP {
                    std::hint::spin_loop();
                }
            }
        }
        let s = match &conn {
            Some(c) if !t.ended() => {
                c.wait_on(&t, deadline);
                t.status()
            }
            _ => t.wait(timeout),
        };
        self.finish(&t, s)
    }

    /// Gives transfer `xfer` up. If none of its data has moved (a write the
    /// target has not cleared yet, an inline read not yet answered) it ends
    /// at once, failed as [`Error::Cancelled`], and the peer is kept in
    /// step; data already in flight cannot be called back, and such a
    /// transfer runs to its end. Returns true once the transfer has ended,
    /// cancelled or not (no byte of it touches its buffers any more, and its
    /// id is forgotten), false if it still runs when `timeout` passes (its
    /// id stays valid). The connection and its other transfers go on.
    pub fn cancel(&self, xfer: u64, timeout: Option<Duration>) -> Result<bool> {
        let t = self.status_of(xfer)?;
        if !t.ended() {
            let conn = self.inner.conns.read().get(&t.conn).cloned();
            if let Some(c) = conn {
                if c.cancel(&t) {
                    tracing::debug!(xfer, conn = t.conn, "transfer cancelled");
                }
            }
        }
        match self.wait(xfer, timeout) {
            Ok(ended) => Ok(ended),
            // It ended failed (cancelled, or as its connection failed).
            Err(_) => Ok(true),
        }
    }

    /// Blocks on a transfer and returns its outcome (no id lookups).
    pub fn wait_transfer(&self, xfer: u64) -> Result<()> {
        self.wait(xfer, None).map(|_| ())
    }
}

/// A checked same-host stream (see [`crate::local`]) made a connection of
/// the endpoint: the engine's handshake on it, its data on the same-host
/// net. Its id, or why not (a peer's connection is refused past
/// `TCPX_P2P_MAX_CONNS` connections held; as over TCP, our own
/// `connect_local` is not).
fn establish_local(
    inner: &Arc<Inner>,
    s: std::os::unix::net::UnixStream,
    initiator: bool,
) -> Result<u64> {
    let id = inner.next_conn.fetch_add(1, Ordering::Relaxed);
    // A peer's connection takes room in the endpoint's totals, as an
    // accepted TCP connection does (counted and taken at once, during the
    // handshake: the peer reads the refusal); our own does not.
    let admit = |streams: usize| {
        inner
            .admission
            .room_local(streams)
            .map(|r| Box::new(r) as crate::handshake::Held)
    };
    let gate = crate::handshake::Gate {
        preauth: None,
        proven: &|| {},
        admit: &admit,
    };
    let conn = Conn::establish(
        id,
        crate::ctl::Ctl::Unix(s),
        initiator,
        &inner.local_params,
        (!initiator).then_some(&gate),
    )?;
    if inner.stopping.load(Ordering::Acquire) {
        conn.close();
        return Err(Error::invalid("the endpoint is closing"));
    }
    inner.conns.write().insert(id, conn);
    Ok(id)
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.inner.stopping.store(true, Ordering::Release);
        self.inner.local.stop();
        // Wake the listener's task: it finds the endpoint stopping and
        // ends, the listener with it.
        let _ = TcpStream::connect_timeout(&self.inner.addr, Duration::from_millis(200));
        if let Some(t) = self.acceptor.take() {
            crate::workers::Home::end_all_dropped(&[t], Duration::from_secs(5), "control listener");
        }
        if let Some(t) = self.watchdog.take() {
            t.thread().unpark();
            let _ = t.join();
        }
        let conns: Vec<_> = self.inner.conns.write().drain().map(|(_, c)| c).collect();
        for c in conns {
            c.close();
        }
    }
}

/// Keep-alives and liveness deadlines of every connection.
fn watchdog_loop(inner: Weak<Inner>) {
    loop {
        let Some(ep) = inner.upgrade() else { return };
        if ep.stopping.load(Ordering::Acquire) {
            return;
        }
        let (keepalive, deadline) = (ep.cfg.keepalive, ep.cfg.deadline);
        let conns: Vec<Arc<Conn>> = ep.conns.read().values().cloned().collect();
        for c in conns {
            c.tick(keepalive, deadline);
            // A failed connection releases its threads, sockets and buffers;
            // its id keeps answering with the reason.
            if let Some(why) = c.failure() {
                ep.conns.write().remove(&c.id);
                ep.by_metadata.lock().retain(|_, v| *v != c.id);
                let mut gone = ep.gone.lock();
                gone.push_back((c.id, why));
                if gone.len() > 4096 {
                    gone.pop_front();
                }
                drop(gone);
                c.close();
            }
        }
        drop(ep);
        std::thread::park_timeout((keepalive / 4).min(Duration::from_millis(250)));
    }
}

/// The control listener as a task of the I/O workers (no thread while no
/// connection comes): each connection admitted gets a handshake thread of
/// its own (bounded by the admission's handshake limits).
fn control_listener(
    workers: &Workers,
    inner: Weak<Inner>,
    listener: TcpListener,
) -> std::io::Result<Arc<crate::workers::Home>> {
    let (mut turned_away, mut last_turned) = (0u64, None::<Instant>);
    let owner = move || {
        inner
            .upgrade()
            .filter(|ep| !ep.stopping.load(Ordering::Acquire))
    };
    let take = move |ep: Arc<Inner>, s: TcpStream| {
        let ip = match s.peer_addr() {
            Ok(a) => a.ip(),
            Err(_) => return,
        };
        // Closes this handshake's socket if it must make room for others.
        let closer: Box<dyn Fn() + Send> = match s.try_clone() {
            Ok(c) => Box::new(move || {
                let _ = c.shutdown(std::net::Shutdown::Both);
            }),
            Err(_) => return,
        };
        let slot = match ep.admission.handshake(ip, Instant::now(), closer) {
            Ok(slot) => slot,
            Err(why) => {
                // Logged at most every 10 s: a flood must not flood the log.
                turned_away += 1;
                if last_turned.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::warn!(
                        "closed {turned_away} control connection(s) at once, the last from {ip}: {why}"
                    );
                    last_turned = Some(Instant::now());
                    turned_away = 0;
                }
                return;
            }
        };
        let weak = Arc::downgrade(&ep);
        let params = ep.params.clone();
        let admission = ep.admission.clone();
        let preauth = ep.cfg.preauth_timeout;
        let id = ep.next_conn.fetch_add(1, Ordering::Relaxed);
        drop(ep);
        let spawned = std::thread::Builder::new()
            .name("tcpx-handshake".into())
            .spawn(move || {
                let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                let s = crate::ctl::Ctl::Tcp(s);
                let params = params.for_peer(&s);
                let proven = || slot.proven();
                let admit = |streams: usize| {
                    admission
                        .room(ip, streams)
                        .map(|r| Box::new(r) as crate::handshake::Held)
                };
                let gate = crate::handshake::Gate {
                    preauth: crate::timeout::deadline_after(preauth),
                    proven: &proven,
                    admit: &admit,
                };
                let res = Conn::establish(id, s, false, &params, Some(&gate));
                drop(slot);
                match res {
                    Ok(conn) => {
                        let Some(ep) = weak.upgrade() else {
                            conn.close();
                            return;
                        };
                        if ep.stopping.load(Ordering::Acquire) {
                            conn.close();
                            return;
                        }
                        ep.conns.write().insert(id, conn);
                        ep.accepted.lock().push_back(id);
                        ep.accepted_cv.notify_all();
                    }
                    Err(Error::Connect { reason, .. }) => {
                        tracing::warn!("refused a connection from {peer}: {reason}")
                    }
                    Err(e) => tracing::warn!("refused a connection from {peer}: {e}"),
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot spawn a handshake thread: {e}");
        }
    };
    crate::accept::listen_on(workers, listener, "control connections", owner, take)
}

/// `hostname:port`, or `ip:port` where the host has no name.
fn default_name(addr: SocketAddr) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let mut name = if host.is_empty() {
        addr.to_string()
    } else {
        format!("{host}:{}", addr.port())
    };
    let mut end = name.len().min(crate::wire::MAX_NOTIF_NAME);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name.truncate(end);
    name
}

/// A peer's range that one-sided transfers may use: what one of its
/// advertisements ([`FifoItem`]) or exported regions ([`DescEntry`]) names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteDesc {
    pub token: Token,
    /// First byte of the range on the peer.
    pub addr: u64,
    pub len: u64,
    /// The peer's region id (contiguous pieces of one region are merged).
    pub region: u64,
}

impl From<&FifoItem> for RemoteDesc {
    fn from(m: &FifoItem) -> Self {
        RemoteDesc {
            token: m.token,
            addr: m.addr,
            len: m.size as u64,
            region: m.rkey as u64,
        }
    }
}

impl From<&DescEntry> for RemoteDesc {
    fn from(d: &DescEntry) -> Self {
        RemoteDesc {
            token: d.token,
            addr: d.addr,
            len: d.size,
            region: d.mr_id,
        }
    }
}

mod notify;
mod same_host;

pub use crate::local::{AcceptedLocal, LocalPeer};
