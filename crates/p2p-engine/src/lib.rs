//! tcpx-p2p: a GPU peer-to-peer transfer engine for clusters without RDMA.
//!
//! The public surface is the [`Endpoint`] and its types, its [`Config`],
//! the [`Error`] it returns (with [`ErrorKind`]), and the [`net::Net`]
//! trait a transport implements. The engine is written once over that
//! trait; the socket net (multi-stream TCP) and the ncclNet plugin loader
//! are its transports. Everything else is internal; the bindings, the
//! ncclNet stand-in, the fuzz targets and the tests reach what they need
//! through [`internal`], which is not a stable interface. The layers and
//! the life of a transfer: `docs/ARCHITECTURE.md` in the repository.
#![deny(unsafe_code)]

mod accept;
mod admission;
mod config;
mod conn;
mod endpoint;
mod error;
mod fuzzing;
mod gpu;
mod handler;
mod handshake;
mod inline;
mod local;
mod memory;
pub mod net;
pub mod notif;
mod oob_out;
mod progress;
mod rma;
mod rma_recvs;
pub mod timeout;
mod topo;
mod transfer;
mod wire;
mod workers;

pub use config::{Config, GpuSwitches, NetKind};
pub use endpoint::{Accepted, Buf, Endpoint, RemoteDesc, RemoteGpu};
pub use error::{CudaError, Error, ErrorKind, NetError, Result, WireError};
pub use local::{AcceptedLocal, LocalPeer};
pub use memory::MemKind;
pub use notif::Notif;
pub use topo::CpuAffinity;

/// Internals for the crate's bindings, the ncclNet stand-in, fuzz targets
/// and tests. Not a stable interface: applications use [`Endpoint`].
#[doc(hidden)]
pub mod internal {
    /// The byte formats that cross a process boundary.
    pub mod wire {
        pub use crate::wire::*;
    }
    /// CUDA through the driver API (dynamically loaded).
    pub mod gpu {
        pub use crate::gpu::*;
    }
    /// Interfaces, NICs, CPUs.
    pub mod topo {
        pub use crate::topo::*;
    }
    /// The I/O threads' time accounts.
    pub mod timing {
        pub use crate::net::timing::*;
    }
    /// The same-host path's descriptor and messages (fuzz targets, tests).
    pub mod local {
        pub use crate::local::desc;
    }
    /// The socket net, for tests that speak its wire format.
    pub mod socket {
        pub use crate::net::socket::{SocketConfig, SocketNet};
    }
    /// The ncclNet plugin loader and its ABI mirror.
    pub mod plugin {
        pub use crate::net::plugin::*;
    }
    pub use crate::config::{parse_size, PLUGIN_CHANNELS, PLUGIN_CHUNK};
    // The control framing, the handshake's pieces and the control handler,
    // for the test suite's hostile peer and the fuzz targets.
    pub use crate::conn::{read_frame, write_frame, Held};
    pub use crate::endpoint::token_from_keys;
    pub use crate::fuzzing::{
        control_handler, notif_queue, rma_recvs, NotifSeen, RecvsSeen, Seen, LIMITS,
    };
    pub use crate::handler::{Action, Book, Ctx, Limits, ProtocolError};
    pub use crate::handshake::{
        check_handles, negotiate, nonce, proof, verify, Agreed, Refusal, Role,
    };
    pub use crate::memory::Registry;
    pub use crate::transfer::{plan_len, Gather, OpPlan};

    /// Runs `data` through the socket net's part-header checks (a fuzz
    /// target): the first 48 bytes are a header, the rest the posted
    /// receive's segment lengths. Panics if a part that passes would land
    /// outside the posted memory.
    pub fn fuzz_part_header(data: &[u8]) {
        crate::net::socket::fuzz_part_header(data)
    }
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
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
            .try_init();
    });
}
