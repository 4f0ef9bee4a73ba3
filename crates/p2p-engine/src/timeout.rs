//! Timeouts given by callers, and the deadlines they make: one parser for
//! every binding (Python seconds, C milliseconds), and deadlines that never
//! overflow the clock. A wait is `Option<Duration>` everywhere: `None` waits
//! without limit.

use std::time::{Duration, Instant};

/// The longest finite timeout a caller may give in seconds (about 31
/// years): a longer one is almost surely a unit mistake, and "no limit"
/// has its own spelling in every binding.
pub const MAX_TIMEOUT_S: f64 = 1e9;

/// Why a timeout in seconds was refused.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TimeoutError {
    #[error("is NaN; give seconds, or None to wait without limit")]
    NaN,
    #[error("{0} is negative; give seconds >= 0, or None to wait without limit")]
    Negative(f64),
    #[error("{0} s is too long (at most {MAX_TIMEOUT_S:e}); pass None or math.inf to wait without limit")]
    TooLong(f64),
}

/// A timeout in seconds: `+inf` waits without limit (`None`); a finite
/// number from 0 to [`MAX_TIMEOUT_S`] waits that long (0: just look); a
/// negative number (`-inf` included), NaN or a longer finite one is
/// refused.
pub fn from_secs_f64(t: f64) -> Result<Option<Duration>, TimeoutError> {
    if t.is_nan() {
        return Err(TimeoutError::NaN);
    }
    if t == f64::INFINITY {
        return Ok(None);
    }
    if t < 0.0 {
        return Err(TimeoutError::Negative(t));
    }
    if t > MAX_TIMEOUT_S {
        return Err(TimeoutError::TooLong(t));
    }
    // In range: `from_secs_f64` cannot panic on a finite value of 0..=1e9.
    Ok(Some(Duration::from_secs_f64(t)))
}

/// A timeout in milliseconds as the C API takes it: negative waits without
/// limit, and so does one longer than [`MAX_TIMEOUT_S`] (`INT64_MAX` is a
/// common way of saying "forever").
pub fn from_millis_i64(ms: i64) -> Option<Duration> {
    let ms = u64::try_from(ms).ok()?;
    let d = Duration::from_millis(ms);
    (d.as_secs_f64() <= MAX_TIMEOUT_S).then_some(d)
}

/// When a wait of `t` from now ends; `None` when that lies beyond what the
/// clock can represent, which is no limit in practice.
pub fn deadline_after(t: Duration) -> Option<Instant> {
    Instant::now().checked_add(t)
}

/// The deadline of an optional timeout (`None`: no limit).
pub fn deadline(t: Option<Duration>) -> Option<Instant> {
    t.and_then(deadline_after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_seconds_are_refused_or_unlimited_never_a_panic() {
        for t in [-1.0, -0.5, -f64::MIN_POSITIVE, f64::NEG_INFINITY, -1e300] {
            assert!(
                matches!(from_secs_f64(t), Err(TimeoutError::Negative(_))),
                "{t}"
            );
        }
        assert_eq!(from_secs_f64(f64::NAN), Err(TimeoutError::NaN));
        for t in [1e19, 1e300, 2f64.powi(64), 1e30, f64::MAX, 1e9 + 1.0] {
            assert!(
                matches!(from_secs_f64(t), Err(TimeoutError::TooLong(_))),
                "{t}"
            );
        }
        assert_eq!(from_secs_f64(f64::INFINITY), Ok(None));
        assert_eq!(from_secs_f64(0.0), Ok(Some(Duration::ZERO)));
        assert_eq!(from_secs_f64(-0.0), Ok(Some(Duration::ZERO)));
        assert_eq!(from_secs_f64(1.5), Ok(Some(Duration::from_millis(1500))));
        assert_eq!(
            from_secs_f64(MAX_TIMEOUT_S),
            Ok(Some(Duration::from_secs(1_000_000_000)))
        );
    }

    #[test]
    fn c_milliseconds() {
        assert_eq!(from_millis_i64(-1), None);
        assert_eq!(from_millis_i64(i64::MIN), None);
        assert_eq!(from_millis_i64(i64::MAX), None);
        assert_eq!(from_millis_i64(0), Some(Duration::ZERO));
        assert_eq!(from_millis_i64(2500), Some(Duration::from_millis(2500)));
    }

    #[test]
    fn deadlines_never_overflow() {
        assert_eq!(deadline_after(Duration::MAX), None);
        assert_eq!(deadline(Some(Duration::from_secs(u64::MAX))), None);
        assert_eq!(deadline(None), None);
        let d = deadline(Some(Duration::from_secs(5))).unwrap();
        assert!(d > Instant::now());
    }
}
