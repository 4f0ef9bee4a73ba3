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
//! So, as Go's scheduler spins a thread only while a processor is idle and
//! keeps its spinning threads to a share of the busy ones, the engine's
//! spinners are counted: a thread spins only while it holds a [`Spin`],
//! and at most a quarter of the CPUs that other threads leave are held at
//! once ([`allowance`]: the running count of `/proc/loadavg` less our own
//! spinners and the asking thread, against the CPUs online, read at most
//! every [`REFRESH`] by whichever thread asks first). With no CPU idle
//! none spins; when a reading allows fewer than spin, all stop where they
//! are and as many as it allows start again. Both counts are the whole
//! machine's (a container sees its host's): a CPU quota on the process's
//! cgroup is not seen, and `TCPX_P2P_SPIN_US=0` / `TCPX_P2P_WAIT_SPIN_US=0`
//! are the way to keep spinning off there.
//!
//! Measured on `nvidia-h200` (16 CPUs, both processes on it) in UCCL's
//! loop (`benchmarks/sendrecv_loop.py --shape uccl`, receiver's GB/s,
//! medians of six rounds, four to six runs each): with every waiting
//! stream free to spin through a caller's wait (only "some CPU idle"
//! asked), 10 MB read 6.6-7.6 GB/s; with no spinning at all 11.7-13.2;
//! counted to a quarter 11.4-12.4, to a half 8.1-8.5. The quarter keeps
//! what spinning buys a small message where CPUs are free
//! (`OMP_NUM_THREADS=1`: 256 KB 3.4-3.9 against 2.4-2.6 with none) and the
//! blocking write's latency (4 KiB p50 37-38 µs).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long one reading of the machine's load is used.
const REFRESH: Duration = Duration::from_millis(2);

/// Not read yet: no thread may spin until the first reading.
const UNREAD: usize = usize::MAX;

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

fn machine_running() -> Option<u64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .as_deref()
        .and_then(parse_running)
}

/// How many of our threads may spin at once: a quarter of the CPUs that
/// the machine's other runnable threads leave (`running` less `ours`, our
/// spinners when it was read, and less the reading thread, which holds a
/// CPU as it asks). Measured (see the module's doc), a quarter read better
/// than half where both sides of a transfer share the machine.
fn allowance(running: u64, ours: usize, cpus: u64) -> usize {
    let others = running.saturating_sub(ours as u64 + 1);
    usize::try_from(cpus.saturating_sub(others) / 4).unwrap_or(usize::MAX)
}

/// No CPU idle beside the asking thread: other runnable threads (not our
/// spinners, which give their CPUs up at once) take every other CPU.
fn full(running: u64, ours: usize, cpus: u64) -> bool {
    running.saturating_sub(ours as u64) >= cpus
}

/// The process's spinning threads and how many the machine allows.
pub(crate) struct Spinners {
    /// Threads holding a [`Spin`] now.
    now: AtomicUsize,
    /// How many may, from the last reading ([`UNREAD`] before the first).
    allowed: AtomicUsize,
    /// When the load was last read (ns past [`epoch`]; 0: never).
    checked_ns: AtomicU64,
    /// Whether the last reading found no CPU idle beside the reading
    /// thread ([`machine_full`]).
    full: AtomicBool,
    /// Reads the machine's runnable threads (`/proc/loadavg`; a test's).
    running: fn() -> Option<u64>,
    cpus: fn() -> u64,
}

static SPINNERS: Spinners = Spinners::new(machine_running, online_cpus);

/// Leave to busy-wait, held by a spinning thread; given back on drop.
pub(crate) struct Spin {
    of: Option<&'static Spinners>,
}

impl Spinners {
    const fn new(running: fn() -> Option<u64>, cpus: fn() -> u64) -> Spinners {
        Spinners {
            now: AtomicUsize::new(0),
            allowed: AtomicUsize::new(UNREAD),
            checked_ns: AtomicU64::new(0),
            full: AtomicBool::new(false),
            running,
            cpus,
        }
    }

    /// Reads the machine's load if the last reading is [`REFRESH`] old:
    /// whichever thread asks first reads it.
    fn refresh(&self) {
        let now = u64::try_from(epoch().elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1);
        let last = self.checked_ns.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= REFRESH.as_nanos() as u64)
            && self
                .checked_ns
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            // Where the load cannot be read, spinning is left as
            // configured: one thread, as on a machine with CPUs to spare.
            let ours = self.now.load(Ordering::Relaxed);
            let cpus = (self.cpus)();
            let running = (self.running)();
            let allowed = running.map_or(ours.max(1), |running| allowance(running, ours, cpus));
            self.full.store(
                running.is_some_and(|r| full(r, ours, cpus)),
                Ordering::Relaxed,
            );
            if self.allowed.swap(allowed, Ordering::Relaxed) != allowed {
                tracing::trace!(allowed, ours, cpus, "lat: spinners allowed");
            }
        }
    }

    fn allowed(&self) -> usize {
        match self.allowed.load(Ordering::Relaxed) {
            UNREAD => 0,
            n => n,
        }
    }

    /// Whether one more thread could spin now.
    fn room(&self) -> bool {
        self.refresh();
        self.now.load(Ordering::Relaxed) < self.allowed()
    }

    /// Leave for one more thread to spin, if the machine allows it.
    fn start(&'static self) -> Option<Spin> {
        self.refresh();
        let allowed = self.allowed();
        self.now
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < allowed).then_some(n + 1)
            })
            .ok()
            .map(|_| Spin { of: Some(self) })
    }
}

impl Spin {
    /// Leave that counts against nothing (a test answering for the
    /// machine).
    #[cfg(test)]
    pub(crate) fn uncounted() -> Spin {
        Spin { of: None }
    }

    /// Whether this thread may go on spinning: the spinners are not more
    /// than the last reading allows (all stop where they are, then as many
    /// as it allows start again).
    pub(crate) fn pays(&self) -> bool {
        self.of.is_none_or(|s| {
            s.refresh();
            s.now.load(Ordering::Relaxed) <= s.allowed()
        })
    }
}

impl Drop for Spin {
    fn drop(&mut self) {
        if let Some(s) = self.of {
            s.now.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Leave for this thread to busy-wait now (None: it should sleep).
pub(crate) fn start() -> Option<Spin> {
    SPINNERS.start()
}

/// Busy-waits while `keep` holds and the machine allows (leave taken
/// first, given back at the end); false if no leave was given.
pub(crate) fn spin_while(mut keep: impl FnMut() -> bool) -> bool {
    let Some(leave) = start() else {
        return false;
    };
    while keep() && leave.pays() {
        std::hint::spin_loop();
    }
    true
}

/// Whether the machine has no CPU idle (at the last reading, at most
/// [`REFRESH`] old): work handed to another thread of ours would wait for
/// a CPU (a scheduler's slice, milliseconds), so a thread that has one
/// does the work itself.
pub(crate) fn machine_full() -> bool {
    #[cfg(test)]
    if let Some(full) = FULL_HERE.with(|f| f.get()) {
        return full;
    }
    SPINNERS.refresh();
    SPINNERS.full.load(Ordering::Relaxed)
}

#[cfg(test)]
thread_local! {
    /// A test's answer to [`machine_full`], on its own thread.
    static FULL_HERE: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Answers [`machine_full`] on the calling thread (tests; None: the
/// machine's own answer).
#[cfg(test)]
pub(crate) fn answer_full_here(full: Option<bool>) {
    FULL_HERE.with(|f| f.set(full));
}

/// Whether a thread of ours could busy-wait now (one more spinner fits in
/// what the machine allows): for a decision to spin later, or to have
/// another spin.
pub(crate) fn spinning_pays() -> bool {
    SPINNERS.room()
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
        assert!(machine_running().is_some_and(|n| n >= 1));
        assert!(online_cpus() >= 1);
    }

    #[test]
    fn spinners_fill_at_most_a_quarter_of_what_other_threads_leave() {
        // The asking thread alone on 16 CPUs: 16 left, 4 may spin.
        assert_eq!(allowance(1, 0, 16), 4);
        assert_eq!(allowance(1, 0, 208), 52);
        // Fewer than four CPUs idle beside the asking thread: none spins.
        assert_eq!(allowance(16, 0, 16), 0);
        assert_eq!(allowance(34, 0, 16), 0);
        assert_eq!(allowance(14, 0, 16), 0);
        assert_eq!(allowance(13, 0, 16), 1);
        assert_eq!(allowance(9, 0, 16), 2);
        // Our own spinners are not counted as others: 11 others, 1 spins.
        assert_eq!(allowance(20, 8, 16), 1);
        // (Spinners counted after the reading: never fewer others than 0.)
        assert_eq!(allowance(3, 5, 16), 4);
        // A machine of fewer than four CPUs: none spins.
        assert_eq!(allowance(1, 0, 2), 0);
        assert_eq!(allowance(0, 0, 4), 1);
    }

    /// Spinners of their own, on a machine of 16 CPUs whose running count
    /// the test sets.
    fn spinners(running: fn() -> Option<u64>) -> &'static Spinners {
        Box::leak(Box::new(Spinners::new(running, || 16)))
    }

    #[test]
    fn no_more_threads_spin_than_the_reading_allows() {
        static RUNNING: AtomicU64 = AtomicU64::new(1);
        let s = spinners(|| Some(RUNNING.load(Ordering::SeqCst)));
        let held: Vec<Spin> = (0..4).map_while(|_| s.start()).collect();
        assert_eq!(held.len(), 4, "4 of 16 CPUs' spinners");
        assert!(s.start().is_none() && !s.room(), "a fifth is refused");
        assert!(held.iter().all(Spin::pays));
        drop(held);
        assert_eq!(s.now.load(Ordering::SeqCst), 0, "given back on drop");
        let one = s.start().expect("room again");
        // The machine fills (12 others beside the reader and our spinner):
        // from the next reading one spinner is allowed, so the one
        // spinning goes on, a second is refused.
        RUNNING.store(14, Ordering::SeqCst);
        std::thread::sleep(REFRESH * 2);
        assert!(one.pays());
        assert!(s.start().is_none());
        // No CPU idle beside ours: it stops.
        RUNNING.store(17, Ordering::SeqCst);
        std::thread::sleep(REFRESH * 2);
        assert!(!one.pays() && !s.room());
        drop(one);
        assert!(s.start().is_none());
        // A test's leave counts against nothing.
        assert!(Spin::uncounted().pays());
        assert_eq!(s.now.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_machine_is_full_once_other_threads_take_every_cpu() {
        assert!(full(16, 0, 16));
        assert!(full(40, 0, 16));
        assert!(!full(15, 0, 16), "one idle");
        // Our spinners give their CPUs up at once: not counted.
        assert!(!full(20, 8, 16));
        assert!(full(17, 1, 16));
        assert!(full(2, 0, 2) && !full(1, 0, 2));
        // A test answers for the machine on its own thread only.
        answer_full_here(Some(true));
        assert!(machine_full());
        std::thread::spawn(|| assert_eq!(FULL_HERE.with(|f| f.get()), None))
            .join()
            .unwrap();
        answer_full_here(None);
    }

    #[test]
    fn where_the_load_cannot_be_read_one_thread_spins() {
        let s = spinners(|| None);
        let one = s.start().expect("one spins");
        assert!(one.pays() && s.start().is_none());
    }

    #[test]
    fn the_load_is_read_at_most_once_a_refresh() {
        static READS: AtomicU64 = AtomicU64::new(0);
        let s = spinners(|| {
            READS.fetch_add(1, Ordering::SeqCst);
            Some(1)
        });
        assert!(s.room());
        let first = s.checked_ns.load(Ordering::Relaxed);
        assert_ne!(first, 0);
        assert_eq!(READS.load(Ordering::SeqCst), 1);
        // Asked again at once: the reading stands (unless this thread was
        // held up past a refresh in between).
        let _held = s.start();
        let again = s.checked_ns.load(Ordering::Relaxed);
        assert!(again == first || again >= first + REFRESH.as_nanos() as u64);
        std::thread::sleep(REFRESH * 2);
        s.room();
        assert!(s.checked_ns.load(Ordering::Relaxed) > first);
        assert!(READS.load(Ordering::SeqCst) >= 2);
    }
}
