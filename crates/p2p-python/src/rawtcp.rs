//! Part of the benchmark, not of the engine: the reference every
//! benchmark prints beside our figures: plain TCP with the same number of
//! streams, host memory, blocking I/O on one thread per
//! stream, each message split evenly across the streams. A one-byte ack on
//! stream 0 ends each timed run (throughput) or each message (ping-pong).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use tcpx_p2p::{Error, Result};

const MAGIC: u32 = 0x5241_5754; // "RAWT"

/// What a client asks the server to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawRun {
    pub streams: usize,
    pub size: usize,
    pub iters: usize,
    /// Echo each message back (latency) instead of streaming (throughput).
    pub pingpong: bool,
}

fn part(size: usize, streams: usize, i: usize) -> (usize, usize) {
    let per = size.div_ceil(streams);
    let off = (per * i).min(size);
    (off, per.min(size - off))
}

fn io(what: &str, e: std::io::Error) -> Error {
    Error::Io {
        what: format!("raw TCP reference: {what}"),
        source: e,
    }
}

/// Serves runs until the listener fails; each client connection set is one run.
pub fn serve(listener: TcpListener) -> Result<()> {
    loop {
        let (mut s0, _) = listener.accept().map_err(|e| io("accept", e))?;
        let mut h = [0u8; 32];
        s0.read_exact(&mut h).map_err(|e| io("header", e))?;
        let f = |i: usize| u64::from_le_bytes(h[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        if f(0) as u32 != MAGIC {
            continue;
        }
        let run = RawRun {
            streams: (f(1) & 0xff) as usize,
            pingpong: f(1) >> 8 != 0,
            size: f(2) as usize,
            iters: f(3) as usize,
        };
        if run.streams == 0 || run.streams > 64 || run.size > (4 << 30) {
            continue;
        }
        let mut socks = vec![s0];
        for _ in 1..run.streams {
            socks.push(listener.accept().map_err(|e| io("accept", e))?.0);
        }
        for s in &socks {
            let _ = s.set_nodelay(true);
        }
        let _ = serve_run(socks, run);
    }
}

fn serve_run(socks: Vec<TcpStream>, run: RawRun) -> Result<()> {
    let n = socks.len();
    let socks: Vec<Arc<TcpStream>> = socks.into_iter().map(Arc::new).collect();
    let barrier = Arc::new(Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let s = socks[i].clone();
            let b = barrier.clone();
            std::thread::spawn(move || -> std::io::Result<()> {
                let (_, len) = part(run.size, n, i);
                let mut buf = vec![0u8; len.max(1)];
                let mut r = &*s;
                for _ in 0..run.iters {
                    r.read_exact(&mut buf[..len])?;
                    if run.pingpong {
                        b.wait();
                        (&*s).write_all(&buf[..len])?;
                    }
                }
                b.wait();
                if i == 0 && !run.pingpong {
                    (&*s).write_all(&[1])?;
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

/// Runs one measurement against a server; returns the duration of the
/// whole run (throughput) or of each round trip (ping-pong).
pub fn run(addr: SocketAddr, r: RawRun) -> Result<Vec<Duration>> {
    let mut socks = Vec::with_capacity(r.streams);
    for i in 0..r.streams {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
            .map_err(|e| io("connect", e))?;
        s.set_nodelay(true).map_err(|e| io("nodelay", e))?;
        if i == 0 {
            let mut h = Vec::with_capacity(32);
            h.extend_from_slice(&(MAGIC as u64).to_le_bytes());
            h.extend_from_slice(&((r.streams as u64) | ((r.pingpong as u64) << 8)).to_le_bytes());
            h.extend_from_slice(&(r.size as u64).to_le_bytes());
            h.extend_from_slice(&(r.iters as u64).to_le_bytes());
            s.write_all(&h).map_err(|e| io("header", e))?;
        }
        socks.push(Arc::new(s));
    }
    let n = r.streams;
    let barrier = Arc::new(Barrier::new(n + 1));
    let t0 = Instant::now();
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let s = socks[i].clone();
            let b = barrier.clone();
            std::thread::spawn(move || -> std::io::Result<()> {
                let (_, len) = part(r.size, n, i);
                let mut buf = vec![0x5au8; len.max(1)];
                for _ in 0..r.iters {
                    (&*s).write_all(&buf[..len])?;
                    if r.pingpong {
                        (&*s).read_exact(&mut buf[..len])?;
                        b.wait();
                    }
                }
                Ok(())
            })
        })
        .collect();
    let mut out = Vec::new();
    if r.pingpong {
        let mut last = t0;
        for _ in 0..r.iters {
            barrier.wait();
            let now = Instant::now();
            out.push(now - last);
            last = now;
        }
    }
    for t in threads {
        t.join()
            .map_err(|_| Error::Invalid("raw TCP reference thread panicked".into()))?
            .map_err(|e| io("transfer", e))?;
    }
    if !r.pingpong {
        let mut ack = [0u8; 1];
        (&*socks[0])
            .read_exact(&mut ack)
            .map_err(|e| io("ack", e))?;
        out.push(t0.elapsed());
    }
    Ok(out)
}

// ------------------------------------------------------------ Python face

use pyo3::prelude::*;

use crate::args;
use crate::errors::{to_py, InvalidArgumentError};

/// Starts the raw-TCP reference server on `ip:port` (0 = any) in the
/// background; returns the port.
#[pyfunction]
#[pyo3(signature = (ip, port=0))]
fn rawtcp_serve(ip: &str, #[pyo3(from_py_with = args::port)] port: u16) -> PyResult<u16> {
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
            if let Err(e) = serve(l) {
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
    #[pyo3(from_py_with = args::port)] port: u16,
    #[pyo3(from_py_with = args::streams)] streams: usize,
    #[pyo3(from_py_with = args::size)] size: usize,
    #[pyo3(from_py_with = args::iters)] iters: usize,
    pingpong: bool,
) -> PyResult<Vec<f64>> {
    // The reference server serves 1 to 64 streams and up to 4 GiB.
    if !(1..=64).contains(&streams) {
        return Err(InvalidArgumentError::new_err(format!(
            "streams: {streams} (1 to 64)"
        )));
    }
    if size > 4 << 30 {
        return Err(InvalidArgumentError::new_err(format!(
            "size: {size} bytes (at most 4 GiB)"
        )));
    }
    let addr: std::net::SocketAddr = format!("{ip}:{port}")
        .parse()
        .map_err(|_| to_py(&Error::Invalid(format!("bad address {ip}:{port}"))))?;
    let r = RawRun {
        streams,
        size,
        iters,
        pingpong,
    };
    py.detach(|| run(addr, r))
        .map(|v| v.iter().map(|d| d.as_secs_f64()).collect())
        .map_err(|e| to_py(&e))
}

/// Adds the reference's functions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rawtcp_serve, m)?)?;
    m.add_function(wrap_pyfunction!(rawtcp_run, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throughput_and_pingpong_runs_complete() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || serve(l));
        let d = run(
            addr,
            RawRun {
                streams: 3,
                size: 1 << 20,
                iters: 4,
                pingpong: false,
            },
        )
        .unwrap();
        assert_eq!(d.len(), 1);
        let d = run(
            addr,
            RawRun {
                streams: 1,
                size: 4096,
                iters: 5,
                pingpong: true,
            },
        )
        .unwrap();
        assert_eq!(d.len(), 5);
        assert_eq!(part(10, 3, 2), (8, 2));
        assert_eq!(part(1, 4, 3), (1, 0));
    }
}
