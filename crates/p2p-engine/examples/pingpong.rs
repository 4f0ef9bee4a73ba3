//! Ping-pong latency between two endpoints of one process:
//! `cargo run --release --example pingpong -- [size] [iters]`.

use std::time::{Duration, Instant};

use tcpx_p2p::{Buf, Config, Endpoint};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let size: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(4096);
    let iters: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1000);
    tcpx_p2p::init_logging();
    let mut cfg = Config::from_env()?;
    cfg.ifname.get_or_insert_with(|| "lo".into());
    let a = Endpoint::new(None, cfg.clone())?;
    let b = Endpoint::new(None, cfg)?;
    let addr = b.local_addr();
    let ca = a.connect(&addr.ip().to_string(), addr.port(), None)?;
    let cb = b.accept(Some(Duration::from_secs(10)))?.conn;
    let mut va = vec![1u8; size];
    let mut vb = vec![0u8; size];
    let ba = Buf {
        mr: a.reg(va.as_mut_ptr() as u64, size)?,
        ptr: va.as_mut_ptr() as u64,
        len: size,
    };
    let bb = Buf {
        mr: b.reg(vb.as_mut_ptr() as u64, size)?,
        ptr: vb.as_mut_ptr() as u64,
        len: size,
    };
    let t = std::thread::spawn(move || -> tcpx_p2p::Result<()> {
        for _ in 0..iters {
            let r = b.recv_async(cb, &[bb])?;
            b.wait(r, None)?;
            let s = b.send_async(cb, &[bb])?;
            b.wait(s, None)?;
        }
        Ok(())
    });
    let mut lat = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = Instant::now();
        let s = a.send_async(ca, &[ba])?;
        let r = a.recv_async(ca, &[ba])?;
        a.wait(s, None)?;
        a.wait(r, None)?;
        lat.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    t.join().map_err(|_| "peer thread panicked")??;
    lat.sort_by(|x, y| x.total_cmp(y));
    println!(
        "size {size}: half round trip p50 {:.1} us, p99 {:.1} us",
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100]
    );
    Ok(())
}
