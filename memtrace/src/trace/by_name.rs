//! The selections of a trace besides `--pid` and launch mode: they live in
//! [`crate::target::select`] (shared with `memtrace watch`) and are
//! re-exported here under the names the tracer uses; the tracer polls
//! [`Watch::find`] for processes that join a selection later.

pub use crate::target::select::{Finder as Watch, Selector};

/// How long ago (ms) a process started, from its start time in clock ticks
/// since boot (`/proc/PID/stat`); `None` when the clock cannot be read.
pub fn started_ms_ago(start_ticks: u64) -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks_per_s = u64::try_from(ticks_per_s).ok().filter(|&t| t > 0)?;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for clock_gettime to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return None;
    }
    let now_ms =
        u64::try_from(ts.tv_sec).ok()? * 1000 + u64::try_from(ts.tv_nsec).ok()? / 1_000_000;
    Some(now_ms.saturating_sub(start_ticks.saturating_mul(1000) / ticks_per_s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target;

    #[test]
    fn own_start_is_some_time_ago() {
        let start = target::start_time(std::process::id()).expect("start time");
        assert!(started_ms_ago(start).is_some());
    }
}
