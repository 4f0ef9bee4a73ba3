//! The C configuration: the engine's [`Config`] (from the environment)
//! plus the GPU index, set key by key.

use std::time::Duration;

use tcpx_p2p::config::parse_size;
use tcpx_p2p::notif::MAX_NOTIF_NAME;
use tcpx_p2p::{Config, NetKind};

use crate::status::{Fail, Status};

/// What `tcpx_config_t` holds.
#[derive(Debug, Clone)]
pub struct CConfig {
    pub cfg: Config,
    /// The endpoint's GPU (None: host memory only).
    pub gpu: Option<i32>,
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

impl CConfig {
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
                }
            }
            "plugin_path" => c.plugin_path = v.to_string(),
            "streams" => c.streams = number(key, v, 1, 64)?,
            "channels" => c.channels = number(key, v, 1, 32)?,
            "chunk" => c.chunk = number(key, v, 4096, 1 << 30)?,
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
        }
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
