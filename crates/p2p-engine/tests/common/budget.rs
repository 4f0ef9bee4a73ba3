//! How long a seeded fuzzing run goes, from the environment:
//! `TCPX_P2P_FUZZ_SECS` runs it for that many seconds, else
//! `TCPX_P2P_FUZZ_ITERS` inputs (each harness has its default);
//! `TCPX_P2P_FUZZ_SEED` seeds it. (Shared by the engine's and the fuzzing
//! crate's tests.)

use std::time::{Duration, Instant};

fn var(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// One run's budget and how much of it is spent.
pub struct Budget {
    secs: Option<u64>,
    iters: u64,
    /// The run's seed.
    pub seed: u64,
    start: Instant,
    /// Inputs (or operations) begun so far.
    pub done: u64,
}

impl Budget {
    /// The budget the environment asks for, else `iters` inputs seeded
    /// with `seed`.
    pub fn from_env(iters: u64, seed: u64) -> Self {
        Budget {
            secs: var("TCPX_P2P_FUZZ_SECS"),
            iters: var("TCPX_P2P_FUZZ_ITERS").unwrap_or(iters),
            seed: var("TCPX_P2P_FUZZ_SEED").unwrap_or(seed),
            start: Instant::now(),
            done: 0,
        }
    }

    /// Whether another input fits the budget (counting it if so).
    pub fn next(&mut self) -> bool {
        let more = match self.secs {
            Some(s) => self.start.elapsed() < Duration::from_secs(s),
            None => self.done < self.iters,
        };
        self.done += u64::from(more);
        more
    }

    /// Seconds since the run began.
    pub fn secs(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}
