//! The C configuration: the engine's [`Config`] (from the environment)
//! plus the GPU index, set key by key.

use std::time::Duration;

use tcpx_p2p::notif::MAX_NOTIF_NAME;
use tcpx_p2p::{parse_size, PLUGIN_CHANNELS, PLUGIN_CHUNK};
use tcpx_p2p::{Config, NetKind};

use crate::status::{Fail, Status};

/// What `tcpx_config_t` holds.
#[derive(Debug, Clone)]
pub struct CConfig {
    pub cfg: Config,
    /// The endpoint's GPU (None: host memory only).
    pub gpu: Option<i32>,
    /// `channels` / `chunk` were set by key (a net change keeps them).
    pub channels_set: bool,
    pub chunk_set: bool,
}

fn bad(key: &str, value: &str, want: &str) -> Fail {
    Fail::new(Status::Config, format!("{key}={value:?}: expected {want}"))
}

fn number(key: &str, value: &str, min: usize, max: usize) -> Result<usize, Fail> {
    match parse_size(value) {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(bad(key, value, &format!("a number from {min} to {max}"))),
    }
}

fn millis(key: &str, value: &str, min: usize, max: usize) -> Result<Duration, Fail> {
    Ok(Duration::from_millis(number(key, value, min, max)? as u64))
}

/// Whether one of these environment variables is set (non-empty).
fn env_set(names: &[&str]) -> bool {
    names
        .iter()
        .any(|n| std::env::var(n).is_ok_and(|v| !v.trim().is_empty()))
}

impl CConfig {
    /// The engine's settings from the environment.
    pub fn from_env() -> Result<Self, Fail> {
        Ok(CConfig {
            cfg: Config::from_env()?,
            gpu: None,
            channels_set: false,
            chunk_set: false,
        })
    }

    /// The net's own defaults for what neither a key nor the environment set
    /// (as `Config::from_env` picks them for `TCPX_P2P_NET`).
    fn net_defaults(&mut self, env_set: impl Fn(&[&str]) -> bool) {
        let plugin = self.cfg.net == NetKind::Plugin;
        let d = Config::default();
        if !self.channels_set && !env_set(&["TCPX_P2P_CHANNELS", "UCCL_TCPX_NUM_CHANNELS"]) {
            self.cfg.channels = if plugin { PLUGIN_CHANNELS } else { d.channels };
        }
        if !self.chunk_set && !env_set(&["TCPX_P2P_CHUNK"]) {
            self.cfg.chunk = if plugin { PLUGIN_CHUNK } else { d.chunk };
        }
    }

    /// Sets one key (the keys are listed in the header).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), Fail> {
        let v = value.trim();
        let c = &mut self.cfg;
        match key {
            "net" => {
                c.net = match v.to_ascii_lowercase().as_str() {
                    "socket" | "tcp" => NetKind::Socket,
                    "plugin" | "tcpx" => NetKind::Plugin,
                    _ => return Err(bad(key, value, "`socket` or `plugin`")),
                };
                self.net_defaults(env_set);
            }
            "plugin_path" => c.plugin_path = v.to_string(),
            "streams" => c.streams = number(key, v, 1, 64)?,
            "channels" => {
                c.channels = number(key, v, 1, 32)?;
                self.channels_set = true;
            }
            "chunk" => {
                c.chunk = number(key, v, 4096, 1 << 30)?;
                self.chunk_set = true;
            }
            "interface" | "ifname" => c.ifname = (!v.is_empty()).then(|| v.to_string()),
            "port" => c.port = number(key, v, 0, 65535)? as u16,
            "auth_token" => c.auth_token = (!value.is_empty()).then(|| value.to_string()),
            "gpu" => {
                let g: i32 = v
                    .parse()
                    .map_err(|_| bad(key, value, "a GPU index (-1: none)"))?;
                self.gpu = (g >= 0).then_some(g);
            }
            "name" => {
                if value.len() > MAX_NOTIF_NAME {
                    return Err(bad(
                        key,
                        value,
                        &format!("a name of at most {MAX_NOTIF_NAME} bytes"),
                    ));
                }
                c.name = (!value.is_empty()).then(|| value.to_string());
            }
            "deadline_ms" => c.deadline = millis(key, v, 100, 86_400_000)?,
            "keepalive_ms" => c.keepalive = millis(key, v, 10, 3_600_000)?,
            "connect_timeout_ms" => c.connect_timeout = millis(key, v, 1, 3_600_000)?,
            _ => {
                return Err(Fail::new(
                    Status::Config,
                    format!("unknown key {key:?} (see tcpx_p2p.h for the keys)"),
                ))
            }
        }
        Ok(())
    }

    /// Checks what only the keys together decide.
    pub fn check(&self) -> Result<(), Fail> {
        if self.cfg.deadline <= self.cfg.keepalive {
            return Err(Fail::new(
                Status::Config,
                format!(
                    "deadline_ms ({}) must be longer than keepalive_ms ({})",
                    self.cfg.deadline.as_millis(),
                    self.cfg.keepalive.as_millis()
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cc() -> CConfig {
        CConfig {
            cfg: Config::default(),
            gpu: None,
            channels_set: false,
            chunk_set: false,
        }
    }

    #[test]
    fn net_key_brings_the_nets_defaults_unless_set() {
        let none = |_: &[&str]| false;
        let mut c = cc();
        c.cfg.net = NetKind::Plugin;
        c.net_defaults(none);
        assert_eq!(
            (c.cfg.channels, c.cfg.chunk),
            (PLUGIN_CHANNELS, PLUGIN_CHUNK)
        );
        c.cfg.net = NetKind::Socket;
        c.net_defaults(none);
        assert_eq!((c.cfg.channels, c.cfg.chunk), (1, 8 << 20));
        c.set("channels", "4").unwrap();
        c.cfg.net = NetKind::Plugin;
        c.net_defaults(none);
        assert_eq!((c.cfg.channels, c.cfg.chunk), (4, PLUGIN_CHUNK));
        // a chunk from the environment stays
        let mut c = cc();
        c.cfg.chunk = 1 << 20;
        c.cfg.net = NetKind::Plugin;
        c.net_defaults(|names: &[&str]| names.contains(&"TCPX_P2P_CHUNK"));
        assert_eq!((c.cfg.channels, c.cfg.chunk), (PLUGIN_CHANNELS, 1 << 20));
    }

    #[test]
    fn keys_set_their_fields_and_bad_values_are_refused() {
        let mut c = cc();
        c.set("net", "plugin").unwrap();
        c.set("streams", "4").unwrap();
        c.set("chunk", "4M").unwrap();
        c.set("interface", "lo").unwrap();
        c.set("gpu", "3").unwrap();
        c.set("name", "agent-7").unwrap();
        c.set("auth_token", "s3cret").unwrap();
        c.set("deadline_ms", "5000").unwrap();
        assert_eq!(c.cfg.net, NetKind::Plugin);
        assert_eq!((c.cfg.streams, c.cfg.chunk), (4, 4 << 20));
        assert_eq!(c.cfg.ifname.as_deref(), Some("lo"));
        assert_eq!(c.gpu, Some(3));
        assert_eq!(c.cfg.name.as_deref(), Some("agent-7"));
        assert_eq!(c.cfg.auth_token.as_deref(), Some("s3cret"));
        assert_eq!(c.cfg.deadline, Duration::from_secs(5));
        c.set("gpu", "-1").unwrap();
        assert_eq!(c.gpu, None);
        for (k, v) in [
            ("streams", "0"),
            ("streams", "x"),
            ("net", "rdma"),
            ("colour", "blue"),
            ("gpu", "one"),
        ] {
            assert_eq!(c.set(k, v).unwrap_err().status, Status::Config, "{k}={v}");
        }
        assert!(c.set("name", &"n".repeat(MAX_NOTIF_NAME + 1)).is_err());
        c.set("keepalive_ms", "6000").unwrap();
        assert_eq!(c.check().unwrap_err().status, Status::Config);
    }
}
