//! The traced process: checking that a pid can be traced, describing it, and
//! launching a command held before `exec` until the probes are attached.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

use crate::error::Failure;
use crate::report::TargetInfo;

/// Process flag marking kernel threads (`PF_KTHREAD` in `/proc/PID/stat`).
const PF_KTHREAD: u64 = 0x0020_0000;

/// Fields of `/proc/PID/stat` memtrace uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcStat {
    pub comm: String,
    pub state: char,
    pub flags: u64,
}

/// Parses `/proc/PID/stat` (the comm may hold spaces and parentheses).
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_string();
    let mut rest = text.get(close + 1..)?.split_whitespace();
    let state = rest.next()?.chars().next()?;
    // Fields after state: ppid pgrp session tty_nr tpgid flags.
    let flags = rest.nth(5)?.parse().ok()?;
    Some(ProcStat { comm, state, flags })
}

fn read_stat(pid: u32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Whether the process still runs (exists and is not a zombie).
pub fn is_alive(pid: u32) -> bool {
    read_stat(pid).is_some_and(|stat| !matches!(stat.state, 'Z' | 'X' | 'x'))
}

/// Checks that `pid` is a live user-space process and describes it.
pub fn inspect(pid: u32) -> Result<TargetInfo, Failure> {
    if pid == 0 {
        return Err(Failure::usage("pid 0 is not a process"));
    }
    let Some(stat) = read_stat(pid) else {
        return Err(Failure::usage(format!("no such process: pid {pid}")));
    };
    if stat.flags & PF_KTHREAD != 0 {
        return Err(Failure::usage(format!(
            "pid {pid} ({}) is a kernel thread: it has no user-space allocations to trace",
            stat.comm
        )));
    }
    if matches!(stat.state, 'Z' | 'X' | 'x') {
        return Err(Failure::usage(format!(
            "pid {pid} ({}) has exited (zombie): nothing to trace",
            stat.comm
        )));
    }
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .map(|p| p.display().to_string())
        .map_err(|err| {
            if err.kind() == std::io::ErrorKind::PermissionDenied {
                Failure::permission(format!(
                    "cannot inspect pid {pid}: permission denied (memtrace needs root or CAP_BPF+CAP_PERFMON+CAP_SYS_PTRACE)"
                ))
            } else {
                Failure::usage(format!("cannot inspect pid {pid}: {err}"))
            }
        })?;
    Ok(TargetInfo {
        pid,
        comm: stat.comm,
        exe,
    })
}

/// A launched command, stopped before `exec` until [`HeldChild::release`].
pub struct HeldChild {
    pub child: tokio::process::Child,
    pub pid: u32,
    /// The program that will be executed, resolved through `PATH`.
    pub program: Option<PathBuf>,
    release: Option<OwnedFd>,
}

impl HeldChild {
    /// Forks `command`; the child waits on a pipe before it execs.
    pub fn spawn(command: &[String]) -> Result<Self, Failure> {
        let Some((program, args)) = command.split_first() else {
            return Err(Failure::usage("no command given after --"));
        };
        let mut fds = [0; 2];
        // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(Failure::runtime(format!(
                "cannot create a pipe: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: pipe2 succeeded, so both descriptors are open and ours alone.
        let (read_end, write_end) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let read_fd = read_end.as_raw_fd();
        let write_fd = write_end.as_raw_fd();
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args).kill_on_drop(false);
        // SAFETY: the closure runs in the forked child before exec and only
        // makes async-signal-safe calls (close, read) on inherited descriptors.
        unsafe {
            cmd.pre_exec(move || {
                libc::close(write_fd);
                let mut byte = 0u8;
                loop {
                    let n = libc::read(read_fd, (&mut byte as *mut u8).cast(), 1);
                    if n == 1 {
                        return Ok(());
                    }
                    if n == 0 {
                        return Err(std::io::Error::other("memtrace went away before release"));
                    }
                    let err = std::io::Error::last_os_error();
                    if err.kind() != std::io::ErrorKind::Interrupted {
                        return Err(err);
                    }
                }
            });
        }
        let child = cmd
            .spawn()
            .map_err(|err| Failure::usage(format!("cannot run '{program}': {err}")))?;
        drop(read_end);
        let pid = child
            .id()
            .ok_or_else(|| Failure::runtime("the launched command exited at once"))?;
        Ok(HeldChild {
            child,
            pid,
            program: resolve_program(program),
            release: Some(write_end),
        })
    }

    /// Lets the child exec.
    pub fn release(&mut self) -> Result<(), Failure> {
        if let Some(fd) = self.release.take() {
            let byte = 1u8;
            // SAFETY: `fd` is the open write end of our pipe; one byte is written
            // from a valid buffer.
            let n = unsafe { libc::write(fd.as_raw_fd(), (&byte as *const u8).cast(), 1) };
            if n != 1 {
                return Err(Failure::runtime(format!(
                    "cannot release the launched command: {}",
                    std::io::Error::last_os_error()
                )));
            }
        }
        Ok(())
    }
}

/// Resolves a program name through `PATH` as `execvp` would.
fn resolve_program(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        return std::fs::canonicalize(program).ok();
    }
    let path: OsString = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
        .and_then(|p| std::fs::canonicalize(p).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_comm() {
        let stat = parse_stat("42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0").expect("parses");
        assert_eq!(stat.comm, "a (b) c");
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.flags, 4194560);
        let kthread = parse_stat("2 (kthreadd) S 0 0 0 0 -1 2129984 0 0").expect("parses");
        assert_ne!(kthread.flags & PF_KTHREAD, 0);
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn inspects_itself_and_rejects_bad_pids() {
        let me = inspect(std::process::id()).expect("own process");
        assert!(!me.comm.is_empty() && !me.exe.is_empty());
        assert!(inspect(0).is_err());
        assert!(inspect(u32::MAX - 1).is_err());
        assert!(is_alive(std::process::id()));
    }

    #[test]
    fn resolves_programs_on_path() {
        assert!(resolve_program("sh").is_some());
        assert!(resolve_program("no-such-program-memtrace").is_none());
    }
}
