//! tcpx-p2p: a GPU peer-to-peer transfer engine for clusters without RDMA.
//!
//! The public surface is the [`Endpoint`] and its types, its [`Config`],
//! the [`Error`] it returns (with [`ErrorKind`]), and the [`net::Net`]
//! trait a transport implements, with the two transports the engine comes
//! with ([`net::SocketNet`], multi-stream TCP, and [`net::PluginNet`], the
//! ncclNet plugin loader). The engine is written once over that trait.
//! Beside it, in crates of their own that the bindings and the ncclNet
//! stand-in use without going through the engine: the byte formats
//! (`tcpx-p2p-wire`, whose types the endpoint's calls take), the GPU
//! helpers (`tcpx-p2p-gpu`), the ncclNet ABI (`ncclnet-abi`) and the I/O
//! threads' time accounts (`tcpx-p2p-timing`). Everything else is
//! internal. The layers and the life of a transfer: `docs/ARCHITECTURE.md`
//! in the repository.
#![deny(unsafe_code)]

mod accept;
mod admission;
mod config;
mod conn;
mod ctl;
mod endpoint;
mod error;
mod handler;
mod handshake;
mod inline;
mod lease;
mod local;
mod memory;
pub mod net;
pub mod notif;
mod oob_out;
mod pieces;
mod progress;
mod proto;
mod rma;
mod rma_recvs;
mod spin;
pub mod timeout;
mod topo;
mod transfer;
mod workers;

// The crates below the engine, under the names its modules use.
use tcpx_p2p_gpu as gpu;
use tcpx_p2p_wire as wire;

pub use config::{parse_size, Config, GpuSwitches, NetKind, PLUGIN_CHANNELS, PLUGIN_CHUNK};
pub use conn::Held;
pub use endpoint::{Accepted, Buf, Endpoint, RemoteDesc, RemoteGpu};
pub use error::{CudaError, Error, ErrorKind, NetError, Result, WireError};
pub use local::{AcceptedLocal, LocalPeer};
pub use memory::MemKind;
pub use notif::Notif;
pub use topo::{oob_ip, CpuAffinity};
/// The byte formats the endpoint's calls take and return (the rest of
/// them: the `tcpx-p2p-wire` crate).
pub use wire::{DescEntry, FifoItem, Token};

/// The engine's pure state machines and checks (the connection's protocol
/// machine, `Proto`, among them), for the fuzz harnesses and the
/// paired tests
/// (`crates/p2p-fuzzing`, the targets in `fuzz/`) and nothing else:
/// compiled only with the `fuzzing` feature, never into the library that
/// applications link. Not a stable interface.
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    pub use crate::handler::{Action, Book, Ctx, Limits, ProtocolError};
    pub use crate::memory::{Region, Registry};
    /// Runs `data` through the socket net's part-header checks: the first
    /// 48 bytes are a header, the rest the posted receive's segment
    /// lengths. Panics if a part that passes would land outside the posted
    /// memory.
    pub use crate::net::socket::fuzz_part_header;
    pub use crate::net::{MemRef, RemoteRef};
    pub use crate::notif::queue::NotifQueue;
    pub use crate::pieces::Pieces;
    pub use crate::progress::Set;
    pub use crate::proto::{
        op_refs, pull_refs, requests, Effect, Landing, Payload, Proto, Requested, Serve, Setup,
        INLINE_READS,
    };
    pub use crate::rma_recvs::RmaRecvs;
    pub use crate::transfer::{plan_ops, Answer, Failure, Gather, OpPlan};
}

/// Sets up `tracing` output once, with the level from `TCPX_P2P_LOG`
/// (`error`, `warn`, `info`, `debug`, `trace`; default `warn`).
pub fn init_logging() {
    use std::sync::Once;
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let level = std::env::var("TCPX_P2P_LOG").unwrap_or_else(|_| "warn".into());
        let filter = tracing_subscriber::EnvFilter::try_new(format!("tcpx_p2p={level}"))
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("tcpx_p2p=warn"));
        // Colours only where a person reads a terminal, never in a log file.
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        // Which thread said what, where a trace follows one transfer.
        // (Also under a filter such as `trace,tcpx_p2p::workers=info`.)
        let threads = level.contains("debug") || level.contains("trace");
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_thread_ids(threads)
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .try_init();
    });
}
