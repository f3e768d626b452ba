//! The selections of a trace besides `--pid` and launch mode: they live in
//! [`crate::tracee::select`] (shared with `memtrace watch`) and are
//! re-exported here under the names the tracer uses; the tracer polls
//! [`Watch::find`] for processes that join a selection later. Owns which
//! process of a selection the trace starts from ([`first_traceable`]): a
//! process with nothing to probe (`docker run --init`'s static, stripped
//! `docker-init`, tini, dumb-init) is skipped with a note, and the trace
//! fails only when no process of the selection can be traced.

pub use crate::tracee::select::{Finder as Watch, Selector};

use crate::error::Failure;

/// What trying to trace one process found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tried {
    /// Something in it is probed.
    Traced,
    /// Nothing in it to probe, and why (may be empty).
    Nothing { comm: String, why: String },
}

/// A process of a selection not traced: nothing in it to probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    pub pid: u32,
    pub comm: String,
    pub why: String,
}

impl Skipped {
    /// The one line, on stderr and in the report's notes.
    pub fn note(&self) -> String {
        format!(
            "pid {} ({}) was not traced: no allocator function to probe in it{}",
            self.pid,
            self.comm,
            if self.why.is_empty() {
                String::new()
            } else {
                format!(" ({})", self.why)
            }
        )
    }
}

/// Tries `candidates` in order until `attempt` finds something to probe in
/// one; returns it and those skipped before it. An error of `attempt` ends
/// the search (a kernel or memtrace failure, not the process's). When none
/// has anything to probe: one line naming each (`what` says how they were
/// selected, `in container 3f2a9c1b7d04`).
pub fn first_traceable(
    candidates: &[u32],
    what: &str,
    mut attempt: impl FnMut(u32) -> anyhow::Result<Tried>,
) -> anyhow::Result<(u32, Vec<Skipped>)> {
    let mut skipped = Vec::new();
    for &pid in candidates {
        match attempt(pid)? {
            Tried::Traced => return Ok((pid, skipped)),
            Tried::Nothing { comm, why } => skipped.push(Skipped { pid, comm, why }),
        }
    }
    let line = match skipped.as_slice() {
        [] => "no process to trace".to_string(),
        [one] => format!(
            "found no allocator function to probe in pid {}{}",
            one.pid,
            if one.why.is_empty() {
                String::new()
            } else {
                format!(": {}", one.why)
            }
        ),
        several => format!(
            "found no allocator function to probe in any of the {} processes {what}: {}",
            several.len(),
            several
                .iter()
                .map(|s| {
                    let why = if s.why.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", s.why)
                    };
                    format!("pid {} ({}){why}", s.pid, s.comm)
                })
                .collect::<Vec<_>>()
                .join("; ")
        ),
    };
    Err(Failure::runtime(line).into())
}

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
    use crate::tracee;

    fn nothing(comm: &str, why: &str) -> Tried {
        Tried::Nothing {
            comm: comm.into(),
            why: why.into(),
        }
    }

    /// `docker run --init`: pid 1 is the static, stripped docker-init, its
    /// child the Python process; the trace starts from the child and says
    /// why the first was skipped.
    #[test]
    fn a_process_with_nothing_to_probe_is_skipped_with_a_note() {
        let (pid, skipped) = first_traceable(&[4100, 4130], "in container 3f2a9c1b7d04", |pid| {
            Ok(if pid == 4100 {
                nothing(
                    "docker-init",
                    "/sbin/docker-init is stripped and imports no malloc",
                )
            } else {
                Tried::Traced
            })
        })
        .expect("the child is traceable");
        assert_eq!(pid, 4130);
        assert_eq!(
            skipped,
            vec![Skipped {
                pid: 4100,
                comm: "docker-init".into(),
                why: "/sbin/docker-init is stripped and imports no malloc".into()
            }]
        );
        assert_eq!(
            skipped[0].note(),
            "pid 4100 (docker-init) was not traced: no allocator function to probe in it \
             (/sbin/docker-init is stripped and imports no malloc)"
        );
    }

    /// Nothing to probe anywhere: one line naming each, a runtime failure.
    #[test]
    fn no_traceable_process_is_one_error_line() {
        let err = first_traceable(&[4100, 4101], "in container 3f2a9c1b7d04", |pid| {
            Ok(if pid == 4100 {
                nothing("docker-init", "stripped")
            } else {
                nothing("sleep", "")
            })
        })
        .expect_err("nothing to trace");
        let failure = err.downcast_ref::<Failure>().expect("a Failure");
        assert_eq!(
            failure.message,
            "found no allocator function to probe in any of the 2 processes in container \
             3f2a9c1b7d04: pid 4100 (docker-init): stripped; pid 4101 (sleep)"
        );
        assert!(!failure.message.contains('\n'));
        // One process (--pid, launch mode): the line it always was.
        let err = first_traceable(&[7], "", |_| Ok(nothing("app", "why"))).expect_err("none");
        assert_eq!(
            err.downcast_ref::<Failure>().expect("a Failure").message,
            "found no allocator function to probe in pid 7: why"
        );
    }

    /// An error of an attempt (the kernel refused a probe) ends the search.
    #[test]
    fn an_attach_error_is_not_skipped() {
        let mut tried = Vec::new();
        let result = first_traceable(&[1, 2], "named x", |pid| {
            tried.push(pid);
            Err(anyhow::anyhow!("kernel says no"))
        });
        assert!(result.is_err());
        assert_eq!(tried, vec![1]);
    }

    #[test]
    fn own_start_is_some_time_ago() {
        let start = tracee::start_time(std::process::id()).expect("start time");
        assert!(started_ms_ago(start).is_some());
    }
}
