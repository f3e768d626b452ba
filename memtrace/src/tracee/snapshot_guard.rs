//! The snapshot's guard: memtrace run again as `memtrace snapshot-guard`,
//! a process of its own group (no terminal signal reaches it), started at
//! the first snapshot and fed one line per step on its stdin. When memtrace
//! dies with a snapshot alive (SIGKILL, the OOM killer), the kernel kills
//! the child (`PTRACE_O_EXITKILL`), which is left a zombie of the service;
//! the guard sees its stdin close and has the service reap it (one
//! injected `wait4`), so nothing is left behind. A clean exit closes its
//! stdin with nothing armed: it just exits.
//!
//! Lines (sent by [`super::snapshot`]): `arm SERVICE INSTRUCTION SUSPEND
//! CHILD...` before the clone (the service's children then, so a child
//! born of the clone is told apart), `child SERVICE CHILD` once the clone
//! made it, `disarm SERVICE` once it is reaped.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::time::{Duration, Instant};

use super::snapshot::children;

/// What the guard knows of one service's snapshot in flight.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Armed {
    instruction: u64,
    suspend_seccomp: bool,
    /// The service's children before the clone.
    before: Vec<u32>,
    child: Option<u32>,
}

/// Applies one line to the armed set.
fn apply(line: &str, armed: &mut BTreeMap<u32, Armed>) {
    let mut words = line.split_whitespace();
    let (Some(verb), Some(service)) = (words.next(), words.next().and_then(|s| s.parse().ok()))
    else {
        return;
    };
    match verb {
        "arm" => {
            let instruction = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
            let suspend_seccomp = words.next() == Some("1");
            armed.insert(
                service,
                Armed {
                    instruction,
                    suspend_seccomp,
                    before: words.filter_map(|w| w.parse().ok()).collect(),
                    child: None,
                },
            );
        }
        "child" => {
            if let Some(entry) = armed.get_mut(&service) {
                entry.child = words.next().and_then(|w| w.parse().ok());
            }
        }
        "disarm" => {
            armed.remove(&service);
        }
        _ => {}
    }
}

/// `/proc/PID/stat`'s state letter and exit signal (field 38).
fn state_and_exit_signal(pid: u32) -> Option<(char, i64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    // Fields after the comm start at 3 (state): exit_signal is field 38.
    let exit_signal = fields.get(38 - 3)?.parse().ok()?;
    Some((state, exit_signal))
}

/// Whether `pid` is a zombie no tracer holds (or gone).
fn untraced_zombie(pid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return true;
    };
    let zombie = status
        .lines()
        .find_map(|l| l.strip_prefix("State:"))
        .is_some_and(|v| v.trim_start().starts_with('Z'));
    zombie && super::stop::parse_tracer(&status).is_none()
}

/// After memtrace died: the snapshot child of `service`, killed and
/// reaped.
fn clean_up(service: u32, armed: &Armed) {
    let candidates: Vec<u32> = match armed.child {
        Some(child) => vec![child],
        // Born of the clone: a child that was not there before, with no
        // exit signal.
        None => children(service)
            .into_iter()
            .filter(|c| !armed.before.contains(c))
            .filter(|&c| state_and_exit_signal(c).is_some_and(|(_, signal)| signal == 0))
            .collect(),
    };
    for child in candidates {
        super::snapshot::Snapshot::kill_now(child);
        // The guard may run before memtrace's exit has detached the child:
        // a zombie still traced is its tracer's to see, so the service's
        // wait4 finds nothing yet. Waited for, then retried.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !untraced_zombie(child) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        loop {
            match super::snapshot::reap(service, child, armed.instruction, armed.suspend_seccomp) {
                Ok(()) => break,
                Err(e) if Instant::now() >= deadline => {
                    eprintln!("memtrace snapshot-guard: {e}");
                    break;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// `memtrace snapshot-guard`: reads its lines until memtrace is gone, then
/// cleans up what is still armed.
pub fn run() -> anyhow::Result<std::process::ExitCode> {
    // SAFETY: ignoring SIGHUP for this process only (its terminal may go
    // with memtrace); no handler is installed.
    unsafe { libc::signal(libc::SIGHUP, libc::SIG_IGN) };
    let mut armed = BTreeMap::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else {
            break;
        };
        apply(&line, &mut armed);
    }
    for (service, entry) in &armed {
        clean_up(*service, entry);
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_arm_name_the_child_and_disarm() {
        let mut armed = BTreeMap::new();
        apply("arm 100 4096 1 7 8", &mut armed);
        apply("arm 200 8192 0", &mut armed);
        apply("child 100 300", &mut armed);
        apply("garbage", &mut armed);
        apply("disarm 200", &mut armed);
        assert_eq!(
            armed.get(&100),
            Some(&Armed {
                instruction: 4096,
                suspend_seccomp: true,
                before: vec![7, 8],
                child: Some(300),
            })
        );
        assert!(!armed.contains_key(&200));
    }

    #[test]
    fn reads_its_own_state_and_exit_signal() {
        let (state, signal) = state_and_exit_signal(std::process::id()).expect("own stat");
        assert!(matches!(state, 'R' | 'S'));
        assert_eq!(signal, i64::from(libc::SIGCHLD));
    }
}
