//! Configuration: environment variables with the `TCPX_P2P_` prefix (and the
//! names UCCL users already set), read once into a typed [`Config`] -- and
//! the process-wide CUDA switches ([`GpuSwitches`]), read once here too.
//!
//! Sizes, one name each:
//! - `chunk` ([`Config::chunk`]): the largest piece of a transfer the engine
//!   posts to a net as one request ([`PLUGIN_CHUNK`]: its default on a
//!   plugin net);
//! - `min_part` ([`Config::min_part`]): the size of each part the socket
//!   net cuts a 1 MiB request into, one per stream (other sizes are cut
//!   into a number of parts growing with the square root of their size);
//! - `staging_slice` ([`Config::staging_slice`]): one pinned slot of GPU
//!   staging (a window: the bytes one slot carries);
//! - inside the socket net, `INLINE_MAX` (a part the posting thread writes
//!   itself) and `BATCH_PART` (a part small enough to share a system call
//!   or a staged window), documented where they are defined.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::topo::{parse_cpulist, CpuAffinity};

/// Which transport carries the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetKind {
    /// Our multi-stream TCP transport.
    Socket,
    /// An ncclNet plugin loaded from [`Config::plugin_path`].
    Plugin,
}

/// Every setting of the engine. [`Config::from_env`] documents the variables.
#[derive(Debug, Clone)]
pub struct Config {
    pub net: NetKind,
    /// Interface whose address is advertised and listened on.
    pub ifname: Option<String>,
    /// Port of the control listener (0 = any free port).
    pub port: u16,
    /// TCP streams per socket-net comm.
    pub streams: usize,
    /// Largest piece of a message posted to the net as one request.
    pub chunk: usize,
    /// The size of the parts a 1 MiB socket-net message is cut into across
    /// streams (other sizes: see the socket net's `part_count`).
    pub min_part: usize,
    /// Channels (send/receive comm pairs) per set, per connection.
    pub channels: usize,
    /// Requests in flight per send comm / receive comm (0: the net's most;
    /// never more than it allows).
    pub send_window: usize,
    pub recv_window: usize,
    /// Size of one pinned staging slice for GPU memory over the socket net.
    pub staging_slice: usize,
    /// Pinned staging slices per stream (pipelining depth).
    pub staging_depth: usize,
    /// Kernel socket buffer size (0 = leave the kernel's default).
    pub sockbuf: usize,
    /// Socket net: lend GPU staging to the socket (`vmsplice` + `splice`)
    /// instead of writing it, saving the sender's copy.
    pub splice: bool,
    /// Connections to endpoints of this machine (made with `connect` /
    /// `accept`) move their data over the same-host net (cross-memory
    /// attach, CUDA IPC) instead of the endpoint's net.
    pub same_host_net: bool,
    /// How long idle threads spin before sleeping while work is in flight
    /// (a thread wake-up costs tens of microseconds in a VM).
    pub spin: Duration,
    /// How long a blocking call (`wait`) drives its transfer from the
    /// calling thread before it sleeps: the caller has nothing else to do,
    /// and a sleeping thread's wake-up cost 0.1-3.6 ms on a 32-core VM.
    pub wait_spin: Duration,
    /// How long a stream or connection with nothing to do keeps its I/O
    /// worker before giving it back (an idle peer then holds no thread).
    /// Within it, the next frame or part wakes the waiting thread itself;
    /// past it, the poller's thread and then a worker. Measured after 20 ms
    /// of idle time, one 4 KiB write at a time, p50: 2-core box, host
    /// memory, 339-411 µs with 5 ms, 169-196 with 50; two H200s, 547 with
    /// 5, 409 with 50 (1 MiB 2,995 / 1,578); back to back, and 64 peers at
    /// once (threads at peak 11, first rounds 14-16), alike.
    pub io_linger: Duration,
    /// Keep-alive interval on an idle control connection.
    pub keepalive: Duration,
    /// A connection whose peer has been silent this long fails.
    pub deadline: Duration,
    /// How long a connect (TCP connect + handshake) may take.
    pub connect_timeout: Duration,
    /// Socket net: a TCP stream accepted on the net's listener must have
    /// sent its hello (which comm, which stream) within this, or it is
    /// closed. A stream that connected sends its hello at once.
    pub stream_hello_timeout: Duration,
    /// Shared secret peers must present (None = anyone may connect).
    pub auth_token: Option<String>,
    /// Path of the ncclNet plugin for [`NetKind::Plugin`].
    pub plugin_path: String,
    /// Static GPU → NIC map, e.g. `0-1:eth1;2-3:eth2;4-5:eth3;6-7:eth4`.
    pub gpu_nics: Option<String>,
    /// Where the I/O threads run.
    pub cpu_affinity: CpuAffinity,
    /// Per connection: the peer's one-sided requests we hold at once (see
    /// [`crate::handler::Limits`]).
    pub max_requests: usize,
    /// Per connection: pieces (items and net requests) of those requests.
    pub max_pending_items: usize,
    /// Per connection: TCP connections the peer's listen handles may ask
    /// us to open (channels × 2 × streams).
    pub max_peer_streams: usize,
    /// Per connection: the peer's notifications and their bytes queued until
    /// the application takes them (see [`crate::notif`]); past either, the
    /// peer's connection fails.
    pub notif_per_peer: usize,
    pub notif_per_peer_bytes: usize,
    /// Channels per set an accepted peer gets at most (its proposal is
    /// lowered to this; at most `wire::MAX_CHANNELS`).
    pub max_peer_channels: usize,
    /// Accepted connections held at once, in all and from one address.
    pub max_conns: usize,
    pub max_conns_per_ip: usize,
    /// Net connections (TCP streams: those we dial and those we accept)
    /// that accepted peers hold at once, in all and from one address
    /// (0: from the descriptor limit, see [`Config::stream_budget`]).
    pub max_streams_total: usize,
    pub max_streams_per_ip: usize,
    /// Handshakes in progress at once: in all, from one address, and from
    /// one subnet (/24 for IPv4, /64 for IPv6).
    pub max_handshakes: usize,
    pub max_handshakes_per_ip: usize,
    pub max_handshakes_per_subnet: usize,
    /// An accepted handshake whose peer has not proven the token (or, with
    /// no token, not finished its proof) by then is closed.
    pub preauth_timeout: Duration,
    /// How long `dereg` waits for transfers still using the region before
    /// it refuses (the registration is then kept).
    pub dereg_wait: Duration,
    /// The endpoint's name, sent with its notifications (None: `host:port`).
    pub name: Option<String>,
    /// The process-wide CUDA switches (read once per process; see
    /// [`GpuSwitches`]).
    pub gpu: GpuSwitches,
    /// One-sided writes and reads of at most this many bytes go inline:
    /// the data travels with the request (a write) or with the answer (a
    /// read) on the control connection, one round trip and no net request.
    /// 0 turns it off; at most `wire::MAX_INLINE` (1 MiB).
    pub inline_max: usize,
}

pub use tcpx_p2p_gpu::GpuSwitches;

impl Default for Config {
    fn default() -> Self {
        Config {
            net: NetKind::Socket,
            ifname: None,
            port: 0,
            streams: 8,
            chunk: 8 << 20,
            min_part: default_min_part(),
            channels: 1,
            send_window: 0,
            recv_window: 0,
            staging_slice: 1 << 20,
            staging_depth: 4,
            sockbuf: 0,
            splice: true,
            same_host_net: false,
            spin: default_spin(),
            wait_spin: default_spin() * 8,
            io_linger: Duration::from_millis(50),
            keepalive: Duration::from_millis(1000),
            deadline: Duration::from_millis(10_000),
            connect_timeout: Duration::from_secs(20),
            stream_hello_timeout: Duration::from_secs(5),
            auth_token: None,
            plugin_path: "/usr/local/tcpx/lib64/libnccl-net-tcpx.so".into(),
            gpu_nics: None,
            cpu_affinity: CpuAffinity::Gpu,
            max_requests: 16_384,
            max_pending_items: 1 << 20,
            max_peer_streams: 256,
            max_peer_channels: 8,
            max_conns: 256,
            max_conns_per_ip: 32,
            max_streams_total: 0,
            max_streams_per_ip: 0,
            notif_per_peer: crate::notif::PER_PEER,
            notif_per_peer_bytes: crate::notif::PER_PEER_BYTES,
            max_handshakes: 64,
            max_handshakes_per_ip: 16,
            max_handshakes_per_subnet: 32,
            preauth_timeout: Duration::from_secs(2),
            dereg_wait: Duration::from_secs(10),
            name: None,
            gpu: GpuSwitches::get(),
            inline_max: DEFAULT_INLINE_MAX,
        }
    }
}

impl Config {
    /// The net connections accepted peers may hold at once, in all and
    /// from one address: the settings, or by default 2048 or half the
    /// process's descriptor limit (`RLIMIT_NOFILE`) if that is lower, and
    /// a quarter of the total per address.
    pub fn stream_budget(&self) -> (usize, usize) {
        let total = if self.max_streams_total > 0 {
            self.max_streams_total
        } else {
            let half = nofile_limit().map_or(usize::MAX, |n| n / 2);
            half.clamp(16, 2048)
        };
        let per_ip = if self.max_streams_per_ip > 0 {
            self.max_streams_per_ip
        } else {
            (total / 4).max(16)
        };
        (total, per_ip.min(total))
    }
}

/// This process's soft descriptor limit (`RLIMIT_NOFILE`), from
/// `/proc/self/limits` (None: unknown or unlimited).
fn nofile_limit() -> Option<usize> {
    let t = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = t.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Parses sizes such as `4096`, `64K`, `4M`, `1G` (powers of 1024).
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1usize << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

fn var(names: &[&str]) -> Option<(String, String)> {
    names.iter().find_map(|n| {
        std::env::var(n)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .map(|v| (n.to_string(), v))
    })
}

fn size_var(names: &[&str], min: usize, max: usize) -> Result<Option<usize>> {
    match var(names) {
        None => Ok(None),
        Some((name, v)) => match parse_size(&v) {
            Some(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(Error::Config(format!(
                "{name}={v:?}: expected a size between {min} and {max} (e.g. 4M)"
            ))),
        },
    }
}

impl Config {
    /// Reads the environment:
    ///
    /// | variable | meaning | default |
    /// |---|---|---|
    /// | `TCPX_P2P_NET` | `socket` or `plugin` | `socket` |
    /// | `TCPX_P2P_IFNAME`, `UCCL_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME` | interface to advertise | first non-loopback up |
    /// | `TCPX_P2P_PORT` | control listener port | 0 (any) |
    /// | `TCPX_P2P_STREAMS` | most TCP streams per socket comm (one at connect, more as traffic needs) | 8 |
    /// | `TCPX_P2P_CHUNK` | request size posted to the net | 8M |
    /// | `TCPX_P2P_MIN_PART` | smallest per-stream piece | 1M ÷ cores (2 to 8): 128K with 8+ cores, 512K with 2 |
    /// | `TCPX_P2P_CHANNELS`, `UCCL_TCPX_NUM_CHANNELS` | channels per connection | 1 (socket), 8 (plugin) |
    /// | `TCPX_P2P_SEND_WINDOW`, `TCPX_P2P_RECV_WINDOW` | requests in flight per comm (capped by the net: 16 for plugins) | the net's most |
    /// | `TCPX_P2P_STAGING_SLICE`, `TCPX_P2P_STAGING_DEPTH` | pinned staging for GPU memory (a sender lending it keeps twice the slices) | 1M, 4 |
    /// | `TCPX_P2P_SOCKBUF` | SO_SNDBUF/SO_RCVBUF | kernel default |
    /// | `TCPX_P2P_SPLICE` | lend GPU staging to the socket (`0`/`1`) | 1 |
    /// | `TCPX_P2P_SAME_HOST_NET` | `1`: connections between endpoints of one machine carry their data over the same-host net | 0 |
    /// | `TCPX_P2P_COPY_KERNEL` | scattered staged copies through one kernel launch per window (`0`/`1`; process-wide, [`GpuSwitches`]) | 1 |
    /// | `TCPX_P2P_COPY_BATCH` | the driver's batch copy (`0`/`1`; process-wide) | 1 |
    /// | `TCPX_P2P_DISABLE_CUDA` | `1`: act as if no GPU were present (process-wide) | 0 |
    /// | `TCPX_P2P_SPIN_US` | busy-wait before sleeping, µs | 300 with 8+ cores, else 0 |
    /// | `TCPX_P2P_WAIT_SPIN_US` | how long a blocking call drives its transfer before sleeping, µs | 2400 with 8+ cores, else 0 |
    /// | `TCPX_P2P_KEEPALIVE_MS`, `TCPX_P2P_DEADLINE_MS` | keep-alive interval; silence after which a connection fails (and a receive stream stalled inside a part) | 1000, 10000 |
    /// | `TCPX_P2P_CONNECT_TIMEOUT_MS` | connect + handshake deadline | 20000 |
    /// | `TCPX_P2P_STREAM_HELLO_MS` | socket net: an accepted stream that has not said its hello by then is closed | 5000 |
    /// | `TCPX_P2P_AUTH_TOKEN` | shared secret peers must present | none |
    /// | `TCPX_P2P_PLUGIN_PATH`, `UCCL_TCPX_PLUGIN_PATH` | ncclNet plugin | GCP path |
    /// | `TCPX_P2P_GPU_NICS` | static GPU → NIC map (`0-1:eth1;2-3:eth2;…`) | PCI distance |
    /// | `TCPX_P2P_MAX_REQUESTS` | a peer's one-sided requests held at once, per connection (more are refused) | 16384 |
    /// | `TCPX_P2P_MAX_PENDING_ITEMS` | pieces (items + net requests) of those requests, per connection | 1048576 |
    /// | `TCPX_P2P_MAX_PEER_STREAMS` | TCP connections a peer's listen handles may ask for, per connection | 256 |
    /// | `TCPX_P2P_MAX_PEER_CHANNELS` | channels per set an accepted peer gets (its proposal is lowered) | 8 |
    /// | `TCPX_P2P_MAX_CONNS`, `TCPX_P2P_MAX_CONNS_PER_IP` | accepted connections held at once, in all / from one address (more are refused) | 256, 32 |
    /// | `TCPX_P2P_MAX_STREAMS_TOTAL`, `TCPX_P2P_MAX_STREAMS_PER_IP` | net connections accepted peers hold at once, in all / from one address | 2048 or half the descriptor limit if lower; a quarter of that |
    /// | `TCPX_P2P_MAX_HANDSHAKES`, `TCPX_P2P_MAX_HANDSHAKES_PER_IP`, `TCPX_P2P_MAX_HANDSHAKES_PER_SUBNET` | handshakes in progress at once: in all, from one address, from one /24 (IPv4) or /64 (IPv6); when full, the oldest unproven one is closed | 64, 16, 32 |
    /// | `TCPX_P2P_PREAUTH_TIMEOUT_MS` | an accepted handshake must have proven the token within this | 2000 |
    /// | `TCPX_P2P_NOTIF_PER_PEER`, `TCPX_P2P_NOTIF_PER_PEER_BYTES` | a peer's notifications (and their bytes) queued until taken, per connection (past either the connection fails) | 4096, 8M |
    /// | `TCPX_P2P_DEREG_WAIT_MS` | how long `dereg` waits for transfers using the region before refusing | 10000 |
    /// | `TCPX_P2P_NAME` | endpoint name sent with notifications (at most 256 bytes) | `hostname:port` |
    /// | `TCPX_P2P_INLINE_MAX` | one-sided writes/reads up to this size carry their data on the control connection (one round trip; 0: never; at most 1M) | 64K |
    pub fn from_env() -> Result<Self> {
        let mut c = Config::default();
        if let Some((name, v)) = var(&["TCPX_P2P_NET"]) {
            c.net = match v.to_ascii_lowercase().as_str() {
                "socket" | "tcp" => NetKind::Socket,
                "plugin" | "tcpx" => NetKind::Plugin,
                _ => {
                    return Err(Error::Config(format!(
                        "{name}={v:?}: expected `socket` or `plugin`"
                    )))
                }
            };
        }
        c.ifname = var(&[
            "TCPX_P2P_IFNAME",
            "UCCL_SOCKET_IFNAME",
            "NCCL_SOCKET_IFNAME",
        ])
        .map(|(_, v)| v.split(',').next().unwrap_or("").trim().to_string());
        if let Some(p) = size_var(&["TCPX_P2P_PORT"], 0, 65535)? {
            c.port = p as u16;
        }
        if let Some(n) = size_var(&["TCPX_P2P_STREAMS"], 1, 64)? {
            c.streams = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_CHUNK"], 4096, 1 << 30)? {
            c.chunk = n;
        } else if c.net == NetKind::Plugin {
            c.chunk = PLUGIN_CHUNK;
        }
        if let Some(n) = size_var(&["TCPX_P2P_MIN_PART"], 1024, 1 << 30)? {
            c.min_part = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_CHANNELS", "UCCL_TCPX_NUM_CHANNELS"], 1, 32)? {
            c.channels = n;
        } else if c.net == NetKind::Plugin {
            // A plugin comm is one connection (TCPX: one flow); the socket
            // net stripes over its own streams inside one comm instead.
            c.channels = PLUGIN_CHANNELS;
        }
        if let Some(n) = size_var(&["TCPX_P2P_SEND_WINDOW"], 1, 4096)? {
            c.send_window = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_RECV_WINDOW"], 1, 4096)? {
            c.recv_window = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_STAGING_SLICE"], 4096, 256 << 20)? {
            c.staging_slice = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_STAGING_DEPTH"], 2, 64)? {
            c.staging_depth = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_SOCKBUF"], 0, 1 << 30)? {
            c.sockbuf = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_SPLICE"], 0, 1)? {
            c.splice = n == 1;
        }
        if let Some(n) = size_var(&["TCPX_P2P_SAME_HOST_NET"], 0, 1)? {
            c.same_host_net = n == 1;
        }
        if let Some(n) = size_var(&["TCPX_P2P_SPIN_US"], 0, 1_000_000)? {
            c.spin = Duration::from_micros(n as u64);
        }
        if let Some(n) = size_var(&["TCPX_P2P_WAIT_SPIN_US"], 0, 10_000_000)? {
            c.wait_spin = Duration::from_micros(n as u64);
        }
        if let Some(n) = size_var(&["TCPX_P2P_IO_LINGER_MS"], 0, 60_000)? {
            c.io_linger = Duration::from_millis(n as u64);
        }
        if let Some(n) = size_var(&["TCPX_P2P_KEEPALIVE_MS"], 10, 3_600_000)? {
            c.keepalive = Duration::from_millis(n as u64);
        }
        if let Some(n) = size_var(&["TCPX_P2P_DEADLINE_MS"], 100, 86_400_000)? {
            c.deadline = Duration::from_millis(n as u64);
        }
        if c.deadline <= c.keepalive {
            return Err(Error::Config(format!(
                "TCPX_P2P_DEADLINE_MS ({} ms) must be longer than TCPX_P2P_KEEPALIVE_MS ({} ms)",
                c.deadline.as_millis(),
                c.keepalive.as_millis()
            )));
        }
        if let Some(n) = size_var(&["TCPX_P2P_CONNECT_TIMEOUT_MS"], 1, 3_600_000)? {
            c.connect_timeout = Duration::from_millis(n as u64);
        }
        if let Some(n) = size_var(&["TCPX_P2P_STREAM_HELLO_MS"], 1, 3_600_000)? {
            c.stream_hello_timeout = Duration::from_millis(n as u64);
        }
        c.auth_token = var(&["TCPX_P2P_AUTH_TOKEN"]).map(|(_, v)| v);
        c.gpu_nics = var(&["TCPX_P2P_GPU_NICS"]).map(|(_, v)| v);
        if let Some((name, v)) = var(&["TCPX_P2P_CPU_AFFINITY"]) {
            c.cpu_affinity = match v.trim().to_ascii_lowercase().as_str() {
                "gpu" | "numa" | "auto" => CpuAffinity::Gpu,
                "off" | "none" => CpuAffinity::Off,
                list => CpuAffinity::List(parse_cpulist(list).ok_or_else(|| {
                    Error::Config(format!(
                        "{name}={v:?}: expected `gpu` (the GPU's NUMA node), `off`, or a CPU list such as 0-15,32-47"
                    ))
                })?),
            };
        }
        if let Some(n) = size_var(&["TCPX_P2P_MAX_REQUESTS"], 1, 1 << 24)? {
            c.max_requests = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_MAX_PENDING_ITEMS"], 1, 1 << 30)? {
            c.max_pending_items = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_MAX_PEER_STREAMS"], 2, 1 << 16)? {
            c.max_peer_streams = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_NOTIF_PER_PEER"], 1, crate::notif::QUEUE_MAX)? {
            c.notif_per_peer = n;
        }
        // A peer must be able to queue one notification of the largest size.
        let one = crate::notif::MAX_NOTIF + crate::notif::MAX_NOTIF_NAME;
        if let Some(n) = size_var(
            &["TCPX_P2P_NOTIF_PER_PEER_BYTES"],
            one,
            crate::notif::QUEUE_MAX_BYTES,
        )? {
            c.notif_per_peer_bytes = n;
        }
        if let Some(n) = size_var(
            &["TCPX_P2P_MAX_PEER_CHANNELS"],
            1,
            crate::wire::MAX_CHANNELS as usize,
        )? {
            c.max_peer_channels = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_MAX_CONNS"], 1, 1 << 20)? {
            c.max_conns = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_MAX_CONNS_PER_IP"], 1, 1 << 20)? {
            c.max_conns_per_ip = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_MAX_STREAMS_TOTAL"], 2, 1 << 24)? {
            c.max_streams_total = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_MAX_STREAMS_PER_IP"], 2, 1 << 24)? {
            c.max_streams_per_ip = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_MAX_HANDSHAKES"], 1, 1 << 16)? {
            c.max_handshakes = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_MAX_HANDSHAKES_PER_IP"], 1, 1 << 16)? {
            c.max_handshakes_per_ip = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_MAX_HANDSHAKES_PER_SUBNET"], 1, 1 << 16)? {
            c.max_handshakes_per_subnet = n;
        }
        if let Some(n) = size_var(&["TCPX_P2P_PREAUTH_TIMEOUT_MS"], 10, 3_600_000)? {
            c.preauth_timeout = Duration::from_millis(n as u64);
        }
        if let Some(n) = size_var(&["TCPX_P2P_DEREG_WAIT_MS"], 0, 3_600_000)? {
            c.dereg_wait = Duration::from_millis(n as u64);
        }
        if let Some(n) = size_var(&["TCPX_P2P_INLINE_MAX"], 0, crate::wire::MAX_INLINE)? {
            c.inline_max = n;
        }
        if let Some((_, v)) = var(&["TCPX_P2P_PLUGIN_PATH", "UCCL_TCPX_PLUGIN_PATH"]) {
            c.plugin_path = v;
        }
        if let Some((name, v)) = var(&["TCPX_P2P_NAME"]) {
            if v.len() > crate::wire::MAX_NOTIF_NAME {
                return Err(Error::Config(format!(
                    "{name}: {} bytes; an endpoint name has at most {}",
                    v.len(),
                    crate::wire::MAX_NOTIF_NAME
                )));
            }
            c.name = Some(v);
        }
        Ok(c)
    }
}

/// Default of `TCPX_P2P_INLINE_MAX`. Above it a write's data goes over
/// the net after the target's clear-to-send (pipelined, striped, staged for
/// GPU memory); at or below it the extra round trip costs more than the
/// pipeline saves. A payload also stays well inside the control
/// connection's socket buffers, so one never holds that connection for long.
pub const DEFAULT_INLINE_MAX: usize = 64 << 10;

/// Channels (comm pairs) per connection on a plugin net.
pub const PLUGIN_CHANNELS: usize = 8;

/// Chunk (one plugin request) on a plugin net: a 16 MiB message spreads
/// over all 8 channels. Measured on nvidia-h200-x2 through the stand-in,
/// GPU to GPU, 16 / 256 MiB: 19.61 / 22.65 GB/s with 2 MiB chunks, 9.74 /
/// 22.85 with 4 MiB (TCPX's largest receive), socket net 20.66 / 19.84.
pub const PLUGIN_CHUNK: usize = 2 << 20;

/// A 1 MiB message is cut into one part per four cores, 2 to 8 (a power of
/// two): each part keeps a send thread and a receive thread busy, on both
/// sides, so parts run at once only where cores are spare.
/// - nvidia-h200-x2 (32 cores): 128 KiB, 8 parts, tuned there.
/// - One H100 (16 cores, both sides of a pair on it), 128 against 256 KiB
///   alternated: GPU 1 MiB blocking send p50 418-561 → 255-285 µs, write
///   254-401 → 253-371; 8 in flight 6.7 → 7.7 GB/s (write and send), host
///   9.7 → 10.7-11.3; a 256 KiB GPU write, one part instead of two, 185 →
///   235-259 µs.
/// - A 2-core box, host memory: 1 MiB blocking write p50 335-340 µs with
///   128 KiB parts, 286-297 with 256 KiB, 240-247 with 512 KiB (floor
///   128-145), 8 in flight 5.1 → 6.8-7.4 GB/s; 256 KiB and 16 MiB
///   unchanged.
fn default_min_part() -> usize {
    min_part_for(std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn min_part_for(cores: usize) -> usize {
    let parts = (cores / 4).clamp(2, 8);
    (1 << 20) >> parts.ilog2()
}

/// Spinning pays where cores are spare and costs where they are not:
/// measured on nvidia-h200-x2 (32 cores), GPU 64 KiB one-way p50 150 us
/// with 0 or 50 us of spin, 99 us with 300; on a 2-core box 4 KiB host
/// one-way p50 71 us with none, 109 us with 50.
fn default_spin() -> Duration {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Duration::from_micros(if cores >= 8 { 300 } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64K"), Some(65536));
        assert_eq!(parse_size("4m"), Some(4 << 20));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("99999999999999999999G"), None);
    }

    #[test]
    fn min_part_follows_the_cores() {
        for (cores, part) in [
            (1, 512 << 10),
            (2, 512 << 10),
            (8, 512 << 10),
            (15, 512 << 10),
            (16, 256 << 10),
            (31, 256 << 10),
            (32, 128 << 10),
            (208, 128 << 10),
        ] {
            assert_eq!(min_part_for(cores), part, "{cores} cores");
        }
    }
}
