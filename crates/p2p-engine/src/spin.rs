//! Whether busy-waiting pays now.
//!
//! The engine's threads spin, rather than sleep, where a wake-up would cost
//! more than the wait (a caller waiting on its transfer, a stream expecting
//! the next part). A spinning thread holds a core. On a machine with more
//! runnable threads than CPUs the scheduler takes spinners off their cores
//! for whole slices and runs sleepers that wake first, so there spinning
//! slows the very transfer it waits for. Measured on `nvidia-h200` (16
//! CPUs) with UCCL's benchmark, whose buffer set-up leaves PyTorch's
//! OpenMP team (16 threads a process) spinning for some milliseconds: the
//! 1 MB and 10 MB rows read 1.4 and 3.4 GB/s (medians of six) with our
//! threads spinning, 2.6 and 7.9 with spinning turned off.
//!
//! So, as Go's scheduler spins a thread only while a processor is idle, the
//! engine spins only while some CPU is idle: while the running count of
//! `/proc/loadavg` (the asking thread among them) is below the CPUs
//! online, read at most every [`REFRESH`] by whichever thread asks first.
//! Both count the whole machine (a container sees its host's): a CPU quota
//! on the process's cgroup is not seen, and `TCPX_P2P_SPIN_US=0` /
//! `TCPX_P2P_WAIT_SPIN_US=0` are the way to keep spinning off there.
//! (Spinning also through the moment every CPU is taken, up to one more
//! runnable thread than CPUs, read lower on the same machine: 10 MB 4.35
//! against 5.03 GB/s, blocking send / recv 256 MiB 15.6 against 19.1.)

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long one reading of the machine's load is used.
const REFRESH: Duration = Duration::from_millis(2);

static CHECKED_NS: AtomicU64 = AtomicU64::new(0);
static PAYS: AtomicBool = AtomicBool::new(true);

fn epoch() -> Instant {
    static E: OnceLock<Instant> = OnceLock::new();
    *E.get_or_init(Instant::now)
}

/// CPUs online on the machine (what `/proc/loadavg` counts against).
fn online_cpus() -> u64 {
    static N: OnceLock<u64> = OnceLock::new();
    *N.get_or_init(|| {
        std::fs::read_to_string("/sys/devices/system/cpu/online")
            .ok()
            .and_then(|s| crate::topo::parse_cpulist(&s))
            .map(|v| v.len())
            .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
            .map_or(1, |n| n as u64)
    })
}

/// The runnable threads of the machine now: `/proc/loadavg`'s fourth
/// field, `running/total`.
fn parse_running(loadavg: &str) -> Option<u64> {
    let field = loadavg.split_ascii_whitespace().nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

/// No CPU idle: as many runnable threads (the asking one among them) as
/// CPUs, or more.
fn no_cpu_idle(running: u64, cpus: u64) -> bool {
    running >= cpus
}

/// Whether a thread of ours may busy-wait now: true unless the last
/// reading of the machine's load (at most [`REFRESH`] old) found no CPU
/// idle. Where the load cannot be read, spinning is left as configured.
pub(crate) fn spinning_pays() -> bool {
    let now = u64::try_from(epoch().elapsed().as_nanos())
        .unwrap_or(u64::MAX)
        .max(1);
    let last = CHECKED_NS.load(Ordering::Relaxed);
    if (last == 0 || now.saturating_sub(last) >= REFRESH.as_nanos() as u64)
        && CHECKED_NS
            .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    {
        if let Some(running) = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .as_deref()
            .and_then(parse_running)
        {
            let pays = !no_cpu_idle(running, online_cpus());
            if PAYS.swap(pays, Ordering::Relaxed) != pays {
                tracing::trace!(running, cpus = online_cpus(), pays, "lat: spinning pays");
            }
        }
    }
    PAYS.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_running_count_is_read_from_loadavg() {
        assert_eq!(parse_running("0.39 0.12 0.04 1/336 1377\n"), Some(1));
        assert_eq!(parse_running("12.00 8.50 3.10 34/812 99321"), Some(34));
        assert_eq!(parse_running("0.39 0.12 0.04"), None);
        assert_eq!(parse_running("0.39 0.12 0.04 x/336 1377"), None);
        assert_eq!(parse_running(""), None);
        // This machine's own file reads, the reader itself running.
        let here = std::fs::read_to_string("/proc/loadavg").unwrap();
        assert!(parse_running(&here).is_some_and(|n| n >= 1), "{here}");
    }

    #[test]
    fn spinning_stops_once_no_cpu_is_idle() {
        assert!(!no_cpu_idle(1, 16));
        assert!(!no_cpu_idle(15, 16));
        assert!(no_cpu_idle(16, 16));
        assert!(no_cpu_idle(17, 16));
        assert!(no_cpu_idle(34, 16));
        assert!(online_cpus() >= 1);
    }

    #[test]
    fn the_load_is_read_at_most_once_a_refresh() {
        spinning_pays();
        let first = CHECKED_NS.load(Ordering::Relaxed);
        assert_ne!(first, 0);
        // Asked again at once: the reading stands.
        spinning_pays();
        let again = CHECKED_NS.load(Ordering::Relaxed);
        assert!(again == first || again >= first + REFRESH.as_nanos() as u64);
        std::thread::sleep(REFRESH * 2);
        spinning_pays();
        assert!(CHECKED_NS.load(Ordering::Relaxed) > first);
    }
}
