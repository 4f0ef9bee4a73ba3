//! tcpx-p2p: a GPU peer-to-peer transfer engine for clusters without RDMA.
//!
//! The engine ([`Endpoint`]) is written once over the [`net::Net`] trait;
//! [`net::socket`] is the native multi-stream TCP transport. See DESIGN.md.
#![deny(unsafe_code)]

pub mod config;
pub mod conn;
pub mod endpoint;
pub mod error;
pub mod gpu;
pub mod local;
pub mod memory;
pub mod net;
pub mod progress;
pub mod rawtcp;
pub mod rma;
pub mod topo;
pub mod transfer;
pub mod wire;

pub use config::{Config, NetKind};
pub use endpoint::{Accepted, Buf, Endpoint, RemoteGpu};
pub use error::{Error, Result};

/// Sets up `tracing` output once, with the level from `TCPX_P2P_LOG`
/// (`error`, `warn`, `info`, `debug`, `trace`; default `warn`).
pub fn init_logging() {
    use std::sync::Once;
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let level = std::env::var("TCPX_P2P_LOG").unwrap_or_else(|_| "warn".into());
        let filter = tracing_subscriber::EnvFilter::try_new(format!("tcpx_p2p={level}"))
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("tcpx_p2p=warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    });
}
