//! Progress only inside `test`, as TCPX: `tcpxTest` calls
//! `tcpxCommProgress`, which schedules tasks (chunks of
//! `NCCL_DYNAMIC_CHUNK_SIZE`) of one request, at most `MAX_TASKS` per data
//! socket, and the socket threads execute only what was scheduled. A comm's
//! I/O thread here takes each piece of payload it moves from a [`Gate`]
//! that only `test` opens: a comm whose requests are never tested stalls.

use std::collections::VecDeque;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

#[derive(Default)]
struct GateState {
    /// Where each posted request ends, in bytes of the comm's stream, for
    /// those not yet wholly scheduled.
    ends: VecDeque<u64>,
    posted: u64,
    /// Scheduled by `test` so far.
    scheduled: u64,
    /// Moved (or skipped: the unused tail of a receive) so far.
    used: u64,
    closed: bool,
}

/// The bytes a comm's I/O thread may move.
pub struct Gate {
    st: Mutex<GateState>,
    cv: Condvar,
    /// Bytes scheduled and not yet moved, at most.
    window: u64,
    /// No gate at all (`NCCL_NET_EMU_LENIENT_BACKGROUND_PROGRESS=1`).
    open: bool,
}

impl Gate {
    pub fn new(window: u64, open: bool) -> Gate {
        Gate {
            st: Mutex::new(GateState::default()),
            cv: Condvar::new(),
            window,
            open,
        }
    }

    /// A request of `len` bytes (a receive: its capacity) was posted.
    pub fn post(&self, len: u64) {
        let mut st = self.st.lock();
        st.posted += len;
        let end = st.posted;
        st.ends.push_back(end);
    }

    /// `test` ran: schedules the next bytes of the oldest request not yet
    /// wholly scheduled, up to `window` beyond what has moved. Returns the
    /// bytes newly scheduled.
    pub fn schedule(&self) -> u64 {
        let mut st = self.st.lock();
        while st.ends.front().is_some_and(|&e| e <= st.scheduled) {
            st.ends.pop_front();
        }
        let Some(&end) = st.ends.front() else {
            return 0;
        };
        let target = end.min(st.used.saturating_add(self.window));
        if target <= st.scheduled {
            return 0;
        }
        let n = target - st.scheduled;
        st.scheduled = target;
        self.cv.notify_all();
        n
    }

    /// Waits until `n` bytes were scheduled, taking them as they come.
    /// `stop` is asked while waiting: Err when it says so or the gate closed.
    pub fn take(&self, mut n: u64, stop: impl Fn() -> bool) -> Result<(), String> {
        if self.open {
            return Ok(());
        }
        let mut st = self.st.lock();
        while n > 0 {
            let avail = st.scheduled - st.used;
            if avail > 0 {
                let k = avail.min(n);
                st.used += k;
                n -= k;
                continue;
            }
            if st.closed || stop() {
                return Err("the comm closed while its data waited for test".into());
            }
            self.cv.wait_for(&mut st, Duration::from_millis(20));
        }
        Ok(())
    }

    /// The last `n` bytes of a receive's capacity that its message did not
    /// use: nothing moves for them.
    pub fn skip(&self, n: u64) {
        let mut st = self.st.lock();
        st.used += n;
        if st.scheduled < st.used {
            st.scheduled = st.used;
        }
    }

    /// Wakes and fails every waiter.
    pub fn close(&self) {
        self.st.lock().closed = true;
        self.cv.notify_all();
    }

    /// Bytes scheduled so far (for tests).
    pub fn scheduled(&self) -> u64 {
        self.st.lock().scheduled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_schedules_one_request_at_most_a_window_ahead() {
        let g = Gate::new(100, false);
        assert_eq!(g.schedule(), 0, "nothing posted, nothing scheduled");
        g.post(250);
        g.post(30);
        assert_eq!(g.schedule(), 100);
        assert_eq!(g.schedule(), 0, "a window ahead of what moved");
        g.take(60, || false).unwrap();
        assert_eq!(g.schedule(), 60);
        g.take(100, || false).unwrap();
        assert_eq!(g.schedule(), 90, "up to the end of the first request");
        g.take(90, || false).unwrap();
        assert_eq!(g.schedule(), 30, "then the next request");
        assert!(g.take(31, || true).is_err(), "unscheduled bytes never move");
    }

    #[test]
    fn a_short_message_skips_the_rest_of_its_receive() {
        let g = Gate::new(1000, false);
        g.post(500);
        g.post(10);
        assert_eq!(g.schedule(), 500);
        g.take(100, || false).unwrap();
        g.skip(400);
        assert_eq!(g.schedule(), 10);
        g.take(10, || false).unwrap();
    }

    #[test]
    fn a_zero_window_never_moves_a_byte() {
        let g = Gate::new(0, false);
        g.post(1);
        assert_eq!(g.schedule(), 0);
        assert!(g.take(1, || true).is_err());
    }
}
