//! Bounds on the work of the core (docs/graph-ir.md, "Limits"): the largest byte sizes a graph
//! may hold, the largest schedule a reference schedule may build, and [`Stop`], the time limit
//! and cancellation flag that long loops poll.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The largest sum of the byte sizes of a graph: over every tensor, the bytes of its storage (a
/// view counts its base's bytes), plus every op's workspace. Within it, every memory figure the
/// core computes (a view kept alive after its base is recomputed counts a second copy; an output
/// recomputed while alive counts a duplicate during the step) stays below `2^63`, so it is exact
/// in `u64` and in the `int64` arrays Python receives. 2^62 - 1 bytes is 4 EiB.
pub const MAX_GRAPH_BYTES: u64 = (1 << 62) - 1;

/// The largest value of one size field (a tensor's bytes, an op's workspace) and of an id: what
/// an `int64` holds.
pub const MAX_FIELD_VALUE: u64 = i64::MAX as u64;

/// The most steps a reference schedule (recompute-all) may have: 20 million steps take about
/// 320 MB as a schedule and as much again on their way to Python and through the simulator.
pub const MAX_SCHEDULE_STEPS: usize = 20_000_000;

/// Why long work stopped before it finished.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Stopped {
    /// The time limit given to the call ran out.
    #[error("stopped at the time limit ({} s) before finishing; raise time_limit or give a smaller problem", seconds_str(*.seconds))]
    TimeLimit { seconds: f64 },
    /// The caller cancelled the work (Ctrl-C in Python).
    #[error("interrupted")]
    Cancelled,
}

/// Seconds for messages: two decimals at most, no trailing zeros ("300", "1.04", "0.2").
fn seconds_str(seconds: f64) -> String {
    let s = format!("{seconds:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Work refused because what it would build exceeds a bound; the message names the sizes and
/// what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TooLarge(pub String);

/// A time limit and a cancellation flag for one call, polled by long loops with [`Stop::check`]
/// (cheap: one atomic load and one clock read; loops call it every few thousand iterations).
#[derive(Debug, Clone, Copy, Default)]
pub struct Stop<'a> {
    cancel: Option<&'a AtomicBool>,
    deadline: Option<Instant>,
    time_limit: f64,
}

impl<'a> Stop<'a> {
    /// Never stops.
    pub fn never() -> Stop<'static> {
        Stop::default()
    }

    /// Stops when `cancel` is set or `time_limit` seconds after now (`None`: no time limit).
    /// A limit that is not a finite number >= 0 is an error naming it.
    pub fn new(cancel: Option<&'a AtomicBool>, time_limit: Option<f64>) -> Result<Stop<'a>, String> {
        let deadline = match time_limit {
            None => None,
            Some(s) if s.is_finite() && s >= 0.0 => {
                // Far-future limits (beyond what Instant can add) mean no limit.
                Duration::try_from_secs_f64(s).ok().and_then(|d| Instant::now().checked_add(d))
            }
            Some(s) => return Err(format!("time_limit must be a finite number of seconds >= 0 or None, got {s}")),
        };
        Ok(Stop { cancel, deadline, time_limit: time_limit.unwrap_or(f64::INFINITY) })
    }

    /// Err when the work must stop: cancelled, or past the deadline.
    pub fn check(&self) -> Result<(), Stopped> {
        if self.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(Stopped::Cancelled);
        }
        match self.deadline {
            Some(d) if Instant::now() >= d => Err(Stopped::TimeLimit { seconds: self.time_limit }),
            _ => Ok(()),
        }
    }

    /// Whether [`Stop::check`] fails (for code that reports stopping in its own way).
    pub fn should_stop(&self) -> bool {
        self.check().is_err()
    }

    /// The cancellation flag, for code that polls a flag directly (a flag never set when this
    /// stop has none).
    pub fn cancel_flag(&self) -> &'a AtomicBool {
        static NEVER: AtomicBool = AtomicBool::new(false);
        self.cancel.unwrap_or(&NEVER)
    }
}

/// A size for messages in binary units, as Python's `hrockmate.budget.format_bytes` writes it
/// ("1.50 GiB"; TiB and above stay in TiB).
pub fn human_bytes(bytes: u128) -> String {
    let mut value = bytes as f64;
    for unit in ["B", "KiB", "MiB", "GiB"] {
        if value < 1024.0 {
            return if unit == "B" { format!("{bytes} B") } else { format!("{value:.2} {unit}") };
        }
        value /= 1024.0;
    }
    format!("{value:.2} TiB")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_reports_cancellation_and_the_time_limit() {
        assert!(Stop::never().check().is_ok());
        let flag = AtomicBool::new(false);
        let stop = Stop::new(Some(&flag), None).unwrap();
        assert!(stop.check().is_ok());
        flag.store(true, Ordering::Relaxed);
        assert_eq!(stop.check(), Err(Stopped::Cancelled));
        let stop = Stop::new(None, Some(0.0)).unwrap();
        assert_eq!(stop.check(), Err(Stopped::TimeLimit { seconds: 0.0 }));
        assert!(stop.check().unwrap_err().to_string().starts_with("stopped at the time limit (0 s)"));
        assert_eq!(seconds_str(300.0), "300");
        assert_eq!(seconds_str(1.0437), "1.04");
        assert!(Stop::new(None, Some(1e300)).unwrap().check().is_ok());
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            assert!(Stop::new(None, Some(bad)).unwrap_err().contains("time_limit"));
        }
    }

    #[test]
    fn sizes_read_well() {
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
        assert_eq!(human_bytes(1 << 50), "1024.00 TiB");
    }
}
