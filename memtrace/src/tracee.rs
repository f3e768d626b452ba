//! The traced process: checking that a pid can be traced, describing it, and
//! launching a command held before `exec` until the probes are attached.
//! [`files`]: opening its files as it sees them (containers);
//! [`maps`]: its `/proc/PID/maps`, parsed;
//! [`container`]: its namespaces and container identity;
//! [`pod`]: its Kubernetes pod's and container's names, from the node's files;
//! [`select`]: which processes `--name`, `--container` and `--cgroup` mean.

pub mod container;
pub mod files;
pub mod fork_cost;
pub mod glibc_heap;
pub mod heap_walk;
pub mod maps;
pub mod pod;
pub mod read_ahead;
pub mod roots;
pub mod select;
pub mod snapshot;
pub mod snapshot_guard;
pub mod stop;
pub mod tls;
pub mod vtables;

use std::ffi::{CString, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use crate::error::Failure;

/// Process flag marking kernel threads (`PF_KTHREAD` in `/proc/PID/stat`).
const PF_KTHREAD: u64 = 0x0020_0000;

/// Fields of `/proc/PID/stat` memtrace uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcStat {
    pub comm: String,
    pub state: char,
    pub ppid: u32,
    pub flags: u64,
    /// Start time in clock ticks since boot: with the pid, it names one process
    /// (a reused pid has another).
    pub start_time: u64,
}

/// Parses `/proc/PID/stat` (the comm may hold spaces and parentheses).
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_string();
    let mut rest = text.get(close + 1..)?.split_whitespace();
    let state = rest.next()?.chars().next()?;
    let ppid = rest.next()?.parse().ok()?;
    // Fields after ppid: pgrp session tty_nr tpgid flags.
    let flags = rest.nth(4)?.parse().ok()?;
    // Fields after flags: minflt .. num_threads itrealvalue starttime.
    let start_time = rest.nth(12).and_then(|t| t.parse().ok()).unwrap_or(0);
    Some(ProcStat {
        comm,
        state,
        ppid,
        flags,
        start_time,
    })
}

fn read_stat(pid: u32) -> Option<ProcStat> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Whether the process still runs (exists and is not a zombie).
pub fn is_alive(pid: u32) -> bool {
    read_stat(pid).is_some_and(|stat| !matches!(stat.state, 'Z' | 'X' | 'x'))
}

/// The child processes of `pid`: from `/proc/PID/task/*/children` where the
/// kernel has it, else by scanning every process's parent.
pub fn children(pid: u32) -> Vec<u32> {
    let listed: Option<Vec<u32>> =
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .ok()
            .map(|tasks| {
                tasks
                    .filter_map(Result::ok)
                    .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
                    .flat_map(|text| {
                        text.split_whitespace()
                            .filter_map(|p| p.parse().ok())
                            .collect::<Vec<u32>>()
                    })
                    .collect()
            });
    if std::path::Path::new(&format!("/proc/{pid}/task/{pid}/children")).exists() {
        return listed.unwrap_or_default();
    }
    let Ok(all) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    all.filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&other| read_stat(other).is_some_and(|stat| stat.ppid == pid))
        .collect()
}

/// The parent of `pid`.
pub fn parent(pid: u32) -> Option<u32> {
    read_stat(pid).map(|stat| stat.ppid)
}

/// The start time of `pid`, to tell it from a later process given the same pid.
pub fn start_time(pid: u32) -> Option<u64> {
    read_stat(pid).map(|stat| stat.start_time)
}

/// The traced process as reports name it (`target` in the JSON report).
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct TargetInfo {
    /// Its pid as memtrace sees it (`ns_pid` is the one inside its own pid
    /// namespace).
    pub pid: u32,
    /// Its command name (`/proc/PID/stat`; for a launched command, its
    /// program's file name).
    pub comm: String,
    /// Its executable's path (`/proc/PID/exe`; for a launched command, the
    /// program as found in `PATH`).
    pub exe: String,
    /// Its pid in its own pid namespace and its container (keys `ns_pid`,
    /// `cgroup`, `container_id`, `container_runtime`, `pod_uid`,
    /// `pod_name`, `pod_namespace`, `container_name`).
    #[serde(flatten, default)]
    pub placement: container::Placement,
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
        placement: container::Placement::of(pid),
    })
}

/// A launched command, stopped before `exec` until [`HeldChild::release`].
pub struct HeldChild {
    pub pid: u32,
    /// The program that will be executed, resolved through `PATH`.
    pub program: Option<PathBuf>,
    release: Option<OwnedFd>,
    events: tokio::sync::mpsc::UnboundedReceiver<ChildEvent>,
    /// Leak checks asked of the supervisor ([`HeldChild::stop_for_check`]).
    checks: std::sync::Arc<CheckRequests>,
    check_stops: std::sync::mpsc::Receiver<CheckStop>,
}

/// The command stopped for a leak check at an interval: every thread of
/// its process, resumed when `ack` is answered (or dropped).
pub struct CheckStop {
    pub pid: u32,
    pub threads: Vec<stop::StoppedThread>,
    /// Which request it answers.
    request: u64,
    pub ack: std::sync::mpsc::Sender<()>,
}

/// The leak checks the session asked of the supervisor: each is a SIGSTOP
/// sent to the command's main thread, which the supervisor (its tracer)
/// catches at its signal-delivery stop and never delivers.
#[derive(Default)]
struct CheckRequests {
    /// Requests made (the latest's number).
    asked: std::sync::atomic::AtomicU64,
    /// SIGSTOPs sent and not yet caught.
    pending: std::sync::atomic::AtomicU64,
    /// The latest request the session stopped waiting for.
    abandoned: std::sync::atomic::AtomicU64,
}

/// What the supervisor of a launched command reports.
pub enum ChildEvent {
    /// A process of the command (`pid`) is about to exit, its mappings still
    /// in place; it stays stopped until the sender is answered (or dropped).
    Exiting {
        pid: u32,
        /// Its main thread's registers, then those of each thread that died
        /// with it (with all threads traced): the leak check's roots.
        threads: Vec<stop::StoppedThread>,
        ack: std::sync::mpsc::Sender<()>,
    },
    /// With fork following: `parent` forked `child`, which is held before its
    /// first instruction until the sender is answered (or dropped).
    Forked {
        parent: u32,
        child: u32,
        ack: std::sync::mpsc::Sender<()>,
    },
    /// A process of the command mapped executable code while `ld.so` loads
    /// its libraries after `exec`, or `ld.so` has mapped them all (its
    /// thread set-up: the program's own code has not run); it stays stopped
    /// until the sender is answered (or dropped), so the unwinder knows the
    /// code, and a CPython is found, before it runs.
    Mapped {
        pid: u32,
        ack: std::sync::mpsc::Sender<()>,
    },
    /// A process of the command ran `exec` (`pid`, stopped at its exec
    /// event: the new image has not run): the blocks of its old image are
    /// gone. It stays stopped until the sender is answered (or dropped).
    Exec {
        pid: u32,
        ack: std::sync::mpsc::Sender<()>,
    },
    /// The command itself ended, described the way a shell would.
    Exited(String),
}

impl HeldChild {
    /// Forks `command`; the child waits on a pipe before it execs, so probes
    /// attached to its pid see even its first instruction. With
    /// `follow_forks`, every process it forks is held at birth and reported
    /// ([`ChildEvent::Forked`]) so its probes are in place before it runs.
    /// With `all_threads`, every thread is traced, and each one's registers
    /// are read when it dies with its process ([`ChildEvent::Exiting`]).
    pub fn spawn(
        command: &[String],
        follow_forks: bool,
        all_threads: bool,
    ) -> Result<Self, Failure> {
        let Some(program) = command.first() else {
            return Err(Failure::usage("no command given after --"));
        };
        let Some(resolved) = resolve_program(program) else {
            return Err(Failure::usage(format!(
                "cannot run '{program}': no such executable"
            )));
        };
        let to_c = |text: &str| {
            CString::new(text)
                .map_err(|_| Failure::usage(format!("argument {text:?} contains a NUL byte")))
        };
        let path = CString::new(resolved.as_os_str().as_bytes())
            .map_err(|_| Failure::usage("program path contains a NUL byte"))?;
        let args: Vec<CString> = command.iter().map(|a| to_c(a)).collect::<Result<_, _>>()?;
        let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
        argv.push(std::ptr::null());

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
        // SAFETY: after fork the child only makes async-signal-safe calls
        // (close, read, execv, _exit) on memory prepared before the fork.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(Failure::runtime(format!(
                "cannot fork: {}",
                std::io::Error::last_os_error()
            )));
        }
        if pid == 0 {
            // SAFETY: see above; the child never returns from this block.
            unsafe {
                libc::close(write_end.as_raw_fd());
                let mut byte = 0u8;
                loop {
                    let n = libc::read(read_end.as_raw_fd(), (&mut byte as *mut u8).cast(), 1);
                    if n == 1 {
                        break;
                    }
                    if n == 0 || *libc::__errno_location() != libc::EINTR {
                        libc::_exit(126);
                    }
                }
                libc::execv(path.as_ptr(), argv.as_ptr());
                libc::_exit(127);
            }
        }
        drop(read_end);
        let pid = pid as u32;
        let (events_tx, events) = tokio::sync::mpsc::unbounded_channel();
        let (seized_tx, seized) = std::sync::mpsc::channel();
        let (check_tx, check_stops) = std::sync::mpsc::channel();
        let checks = std::sync::Arc::new(CheckRequests::default());
        let supervisor = Supervisor {
            pid,
            follow: follow_forks,
            all_threads,
            events: events_tx,
            checks: checks.clone(),
            check_stops: check_tx,
        };
        std::thread::Builder::new()
            .name("memtrace-child".into())
            .spawn(move || supervise(&supervisor, &seized_tx))
            .map_err(|err| Failure::runtime(format!("cannot start the child supervisor: {err}")))?;
        if seized.recv().is_err() {
            return Err(Failure::runtime("the child supervisor ended early"));
        }
        Ok(HeldChild {
            pid,
            program: Some(resolved),
            release: Some(write_end),
            events,
            checks,
            check_stops,
        })
    }

    /// Stops every thread of the command for a leak check at an interval:
    /// the supervisor holds its main thread with ptrace, so it makes the
    /// stop; `None` when it did not within `timeout` (the command is busy
    /// in a stop the session must answer first, or exiting).
    pub fn stop_for_check(&self, timeout: std::time::Duration) -> Option<CheckStop> {
        use std::sync::atomic::Ordering;
        // Stops of requests given up on: answered at once.
        while let Ok(stale) = self.check_stops.try_recv() {
            let _ = stale.ack.send(());
        }
        if !is_alive(self.pid) {
            return None;
        }
        let request = self.checks.asked.fetch_add(1, Ordering::SeqCst) + 1;
        self.checks.pending.fetch_add(1, Ordering::SeqCst);
        // SAFETY: tgkill of the command's main thread; the supervisor
        // catches this SIGSTOP at its delivery stop and suppresses it.
        let sent = unsafe {
            libc::syscall(
                libc::SYS_tgkill,
                self.pid as libc::pid_t,
                self.pid as libc::pid_t,
                libc::SIGSTOP,
            )
        } == 0;
        if !sent {
            self.checks.pending.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.check_stops.recv_timeout(left) {
                Ok(stop) if stop.request == request => return Some(stop),
                Ok(stale) => {
                    let _ = stale.ack.send(());
                }
                Err(_) => {
                    self.checks.abandoned.store(request, Ordering::SeqCst);
                    return None;
                }
            }
        }
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

    /// The next thing the command did (about to exit, exited).
    pub async fn next_event(&mut self) -> ChildEvent {
        match self.events.recv().await {
            Some(event) => event,
            None => ChildEvent::Exited("wait failed".to_string()),
        }
    }
}

impl Drop for HeldChild {
    fn drop(&mut self) {
        // A child never released (memtrace failed before attaching) must not
        // run untraced: closing the pipe makes it exit without exec.
        self.release = None;
    }
}

/// Supervises a launched command from its own thread (ptrace requests belong
/// to the thread that made them): it is seized with `PTRACE_O_TRACEEXIT` so
/// that it stops just before exiting, while its mappings can still be read;
/// every other stop is resumed at once with its signal, so the command runs
/// as it would untraced. With `all_threads` (the exit check) every thread is
/// traced (`PTRACE_O_TRACECLONE`): each one's registers are read at its exit
/// stop, for the exit check's roots; else only the main thread. With `follow`, forks
/// are traced too (`PTRACE_O_TRACEFORK`/`TRACEVFORK`): each new process starts
/// stopped, is reported, and is resumed once the session has answered, and
/// supervision goes on until every such process has ended.
/// What the supervisor thread is given.
struct Supervisor {
    pid: u32,
    follow: bool,
    /// Every thread traced (`PTRACE_O_TRACECLONE`), so that each one's
    /// registers are read at its exit stop (the exit check's roots).
    all_threads: bool,
    events: tokio::sync::mpsc::UnboundedSender<ChildEvent>,
    checks: std::sync::Arc<CheckRequests>,
    check_stops: std::sync::mpsc::Sender<CheckStop>,
}

impl Supervisor {
    /// The command's main thread is in the signal-delivery stop of a
    /// SIGSTOP: when memtrace sent it for a check, stops every other
    /// thread of the process, hands the stop to the session and resumes
    /// them once it answers; true when the SIGSTOP was memtrace's (it is
    /// then never delivered).
    fn check_stop(&self, main: libc::pid_t) -> bool {
        use std::sync::atomic::Ordering;
        let taken = self
            .checks
            .pending
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if taken.is_err() {
            return false;
        }
        let request = self.checks.asked.load(Ordering::SeqCst);
        if self.checks.abandoned.load(Ordering::SeqCst) >= request {
            return true;
        }
        let mut threads: Vec<stop::StoppedThread> =
            stop::read_thread(main, 0).into_iter().collect();
        // Threads stopped here: (tid, signal to give back, whether this
        // thread seized it for the check or traced it already).
        let mut held = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let tids: Vec<libc::pid_t> = std::fs::read_dir(format!("/proc/{}/task", self.pid))
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .filter(|&tid| tid != main)
            .collect();
        for tid in tids {
            let waited = if self.all_threads {
                interrupt_traced(tid, deadline)
            } else if stop::seize(tid).is_ok() {
                stop::wait_stopped(tid, deadline)
            } else {
                continue;
            };
            match waited {
                stop::Waited::Stopped(signal) => {
                    held.push((tid, signal));
                    threads.extend(stop::read_thread(tid, signal));
                }
                stop::Waited::Exited => {}
                stop::Waited::TimedOut => held.push((tid, 0)),
            }
        }
        let (ack, answered) = std::sync::mpsc::channel();
        let stop = CheckStop {
            pid: self.pid,
            threads,
            request,
            ack,
        };
        if self.check_stops.send(stop).is_ok() {
            let _ = answered.recv();
        }
        for (tid, signal) in held {
            if self.all_threads {
                resume(tid, libc::PTRACE_CONT, signal);
            } else {
                stop::detach(tid, signal);
            }
        }
        true
    }
}

/// Stops a thread the supervisor traces already (every thread, when it
/// holds them all for the exit check): its next stop, our interrupt or
/// another (a signal to give back; an event stop resumes plainly).
fn interrupt_traced(tid: libc::pid_t, deadline: std::time::Instant) -> stop::Waited {
    // SAFETY: PTRACE_INTERRUPT of our own tracee; no memory is passed.
    let interrupted = unsafe {
        libc::ptrace(
            libc::PTRACE_INTERRUPT,
            tid,
            std::ptr::null_mut::<libc::c_void>(),
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    if interrupted != 0 {
        return stop::Waited::Exited;
    }
    stop::wait_stopped(tid, deadline)
}

/// Registers of the threads that died with their process, by process,
/// read at each one's exit stop: the leak check at the process's own exit
/// stop takes them as roots (valgrind reads every thread's registers at
/// the exit).
#[derive(Default)]
struct DyingThreads {
    by_process: std::collections::HashMap<libc::pid_t, Vec<stop::StoppedThread>>,
}

impl DyingThreads {
    /// A thread (not its process's main one) at its exit stop: its
    /// registers kept when it dies with its process.
    fn exiting(&mut self, tid: libc::pid_t, process: libc::pid_t) {
        if let Some(thread) = stop::read_thread(tid, 0) {
            if !stop::ends_by_itself(&thread) {
                self.by_process.entry(process).or_default().push(thread);
            }
        }
    }

    /// The main thread of `process` at its exit stop: when the whole
    /// process exits (not the main thread alone), waits (up to a bound) for
    /// its other threads' exit stops, each resumed once read; then every
    /// thread that died with it.
    fn with_process(
        &mut self,
        process: libc::pid_t,
        main: &stop::StoppedThread,
    ) -> Vec<stop::StoppedThread> {
        if !stop::ends_by_itself(main) {
            let deadline = std::time::Instant::now() + EXIT_WAIT;
            let mut done: std::collections::HashSet<libc::pid_t> = [process].into();
            loop {
                let left: Vec<libc::pid_t> = std::fs::read_dir(format!("/proc/{process}/task"))
                    .into_iter()
                    .flatten()
                    .filter_map(Result::ok)
                    .filter_map(|e| e.file_name().to_str()?.parse().ok())
                    .filter(|tid| !done.contains(tid))
                    .collect();
                if left.is_empty() || std::time::Instant::now() >= deadline {
                    break;
                }
                for tid in left {
                    let mut status = 0;
                    // SAFETY: waitpid on our own tracee (a thread of the
                    // command) with a valid status pointer.
                    let who =
                        unsafe { libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG) };
                    if who == 0 {
                        // Running on: one in `execve` replaces the process
                        // (its other threads are killed): it never exits.
                        if stop::in_exec(process, tid) {
                            done.insert(tid);
                        }
                        continue;
                    }
                    if who < 0 || libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                        done.insert(tid);
                    } else if libc::WIFSTOPPED(status) {
                        let event = (status >> 16) & 0xff;
                        if event == libc::PTRACE_EVENT_EXIT {
                            self.exiting(tid, process);
                        }
                        let signal = if event == 0 {
                            libc::WSTOPSIG(status)
                        } else {
                            0
                        };
                        resume(tid, libc::PTRACE_CONT, signal);
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        let mut threads = vec![main.clone()];
        threads.extend(self.by_process.remove(&process).unwrap_or_default());
        threads
    }

    /// `process` ran `exec`: the threads it had are gone, and with them
    /// their registers.
    fn forget(&mut self, process: libc::pid_t) {
        self.by_process.remove(&process);
    }
}

/// How long the exit check waits for the other threads of a process to
/// reach their exit stops (killed by `exit_group`, they are there within
/// milliseconds; one in an uninterruptible sleep may never be).
const EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

fn supervise(supervisor: &Supervisor, seized: &std::sync::mpsc::Sender<bool>) {
    let (pid, follow, events) = (supervisor.pid, supervisor.follow, &supervisor.events);
    let all_threads = supervisor.all_threads;
    let main = pid as libc::pid_t;
    let mut options =
        libc::PTRACE_O_TRACEEXIT | libc::PTRACE_O_TRACEEXEC | libc::PTRACE_O_TRACESYSGOOD;
    if follow {
        options |= libc::PTRACE_O_TRACEFORK | libc::PTRACE_O_TRACEVFORK;
    }
    if all_threads {
        options |= libc::PTRACE_O_TRACECLONE;
    }
    let mut dying = DyingThreads::default();
    // SAFETY: PTRACE_SEIZE on our own child; the options word is passed as data.
    let traced = unsafe {
        libc::ptrace(
            libc::PTRACE_SEIZE,
            main,
            std::ptr::null_mut::<libc::c_void>(),
            options as usize as *mut libc::c_void,
        )
    } == 0;
    let _ = seized.send(traced);
    let mut forks = ForkHolds::default();
    let mut loading = Loading::default();
    let mut alive: std::collections::HashSet<libc::pid_t> = [main].into();
    // With every thread traced: each thread's process (from its clone
    // event; `/proc` when its first stop comes first), and the processes
    // made by `clone` without `CLONE_THREAD` (not forks: never followed).
    let mut thread_groups: std::collections::HashMap<libc::pid_t, libc::pid_t> =
        std::collections::HashMap::new();
    let mut cloned: std::collections::HashSet<libc::pid_t> = std::collections::HashSet::new();
    let mut status = 0;
    while !alive.is_empty() {
        // Without fork following (nor every thread traced) only the
        // command is waited for, as before.
        let wanted = if follow || all_threads { -1 } else { main };
        // SAFETY: waitpid on our own children with a valid status pointer.
        let who = unsafe { libc::waitpid(wanted, &mut status, libc::__WALL) };
        if who <= 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if alive.contains(&main) {
                let _ = events.send(ChildEvent::Exited("wait failed".to_string()));
            }
            return;
        }
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            alive.remove(&who);
            thread_groups.remove(&who);
            if who == main {
                let _ = events.send(ChildEvent::Exited(describe_status(status)));
            }
            continue;
        }
        if !libc::WIFSTOPPED(status) {
            continue;
        }
        let event = (status >> 16) & 0xff;
        let mut request = libc::PTRACE_CONT;
        let mut signal = 0;
        // A thread (not a process's main thread), with every thread traced.
        let thread_of = if all_threads && who != main && event != libc::PTRACE_EVENT_EXEC {
            thread_groups
                .get(&who)
                .copied()
                .or_else(|| stop::thread_group(who).filter(|&process| process != who))
        } else {
            None
        };
        if event == libc::PTRACE_EVENT_EXEC {
            // The new image and ld.so are mapped; ld.so maps the libraries
            // next: each is reported before the code runs (see `Loading`).
            dying.forget(who);
            let (ack, answered) = std::sync::mpsc::channel();
            if events
                .send(ChildEvent::Exec {
                    pid: who as u32,
                    ack,
                })
                .is_ok()
            {
                let _ = answered.recv();
            }
            loading.start(who);
        } else if event == libc::PTRACE_EVENT_CLONE {
            // A new thread runs from its first stop (below); a new process
            // made by `clone` (an exit signal other than SIGCHLD) is let go.
            let new = stop::event_message(who) as libc::pid_t;
            let parent = if alive.contains(&who) {
                Some(who)
            } else {
                thread_of
            };
            match stop::thread_group(new) {
                Some(process) if Some(process) == parent => {
                    thread_groups.insert(new, process);
                }
                Some(process) if process == new => {
                    if forks.waiting.remove(&new) {
                        stop::detach(new, 0);
                    } else {
                        cloned.insert(new);
                    }
                }
                _ => {}
            }
        } else if event == libc::PTRACE_EVENT_STOP && cloned.remove(&who) {
            stop::detach(who, 0);
            continue;
        } else if let (Some(process), libc::PTRACE_EVENT_EXIT) = (thread_of, event) {
            dying.exiting(who, process);
        } else if thread_of.is_some() && event == libc::PTRACE_EVENT_STOP {
            // A thread's first stop, or an interrupt's (SIGTRAP), runs on;
            // a group stop is listened through.
            if libc::WSTOPSIG(status) != libc::SIGTRAP {
                request = libc::PTRACE_LISTEN;
            }
        } else if libc::WSTOPSIG(status) == libc::SIGTRAP | 0x80 && event == 0 {
            if let Some(pid) = loading.syscall_stop(who) {
                let (ack, answered) = std::sync::mpsc::channel();
                if events.send(ChildEvent::Mapped { pid, ack }).is_ok() {
                    let _ = answered.recv();
                }
            }
        } else if event == libc::PTRACE_EVENT_EXIT {
            let (ack, answered) = std::sync::mpsc::channel();
            let threads = match stop::read_thread(who, 0) {
                Some(main) if all_threads => dying.with_process(who, &main),
                main => main.into_iter().collect(),
            };
            if events
                .send(ChildEvent::Exiting {
                    pid: who as u32,
                    threads,
                    ack,
                })
                .is_ok()
            {
                let _ = answered.recv();
            }
        } else if event == libc::PTRACE_EVENT_FORK || event == libc::PTRACE_EVENT_VFORK {
            let child = stop::event_message(who) as libc::pid_t;
            alive.insert(child);
            let (ack, answered) = std::sync::mpsc::channel();
            let forked = ChildEvent::Forked {
                parent: who as u32,
                child: child as u32,
                ack,
            };
            if events.send(forked).is_ok() {
                let _ = answered.recv();
            }
            if forks.probed(child) {
                resume(child, libc::PTRACE_CONT, 0);
            }
        } else if event == libc::PTRACE_EVENT_STOP && forks.born(who, &alive) {
            // A new process's first stop: it runs once its probes are in
            // place (now, or when its fork is reported).
            if !forks.may_run(who) {
                continue;
            }
        } else if event == libc::PTRACE_EVENT_STOP {
            // A group stop (SIGSTOP, SIGTSTP...) is listened through; the
            // trap that ends it (SIGCONT: SIGTRAP) runs on. Listening there
            // would hold the thread for good.
            if libc::WSTOPSIG(status) != libc::SIGTRAP {
                request = libc::PTRACE_LISTEN;
            }
        } else if who == main
            && libc::WSTOPSIG(status) == libc::SIGSTOP
            && supervisor.check_stop(main)
        {
            // memtrace's own SIGSTOP (a leak check): never delivered.
        } else {
            signal = libc::WSTOPSIG(status);
        }
        if loading.active(who) && request == libc::PTRACE_CONT {
            request = libc::PTRACE_SYSCALL;
        }
        resume(who, request, signal);
    }
}

/// Processes between `exec` and the end of `ld.so`'s work, stepped from
/// system call to system call: each `mmap` of executable code is reported
/// when it returns (the new library is in `/proc/PID/maps`, none of its code
/// has run). The stepping ends at glibc's thread set-up (`set_robust_list`,
/// `rseq`), which ld.so does once every library is mapped (reported too),
/// or after a bound for loaders that never make those calls.
#[derive(Default)]
struct Loading {
    /// pid -> system-call stops so far, and the call it is inside (number,
    /// third argument), from its entry stop
    pids: std::collections::HashMap<libc::pid_t, (u32, Option<(u64, u64)>)>,
}

impl Loading {
    const MAX_STOPS: u32 = 2000;

    fn start(&mut self, pid: libc::pid_t) {
        self.pids.insert(pid, (0, None));
    }

    fn active(&self, pid: libc::pid_t) -> bool {
        self.pids.contains_key(&pid)
    }

    /// Handles a system-call stop; returns the pid when it just mapped
    /// executable code, or ld.so's loading ended there. Read with `PTRACE_GET_SYSCALL_INFO` (Linux 5.3),
    /// which says entry or exit on every architecture.
    fn syscall_stop(&mut self, pid: libc::pid_t) -> Option<u32> {
        let (stops, inside) = self.pids.get_mut(&pid)?;
        *stops += 1;
        let too_many = *stops > Self::MAX_STOPS;
        let mut info = SyscallInfo::default();
        // SAFETY: PTRACE_GET_SYSCALL_INFO on our stopped tracee, writing at
        // most `size_of` bytes into a valid struct of plain integers.
        let read = unsafe {
            libc::ptrace(
                PTRACE_GET_SYSCALL_INFO,
                pid,
                std::mem::size_of::<SyscallInfo>() as *mut libc::c_void,
                (&mut info as *mut SyscallInfo).cast::<libc::c_void>(),
            )
        } > 0;
        if !read || too_many {
            self.pids.remove(&pid);
            return None;
        }
        match info.op {
            SYSCALL_INFO_ENTRY => {
                // The entry member: nr, then the six arguments.
                *inside = Some((info.data[0], info.data[3]));
                None
            }
            SYSCALL_INFO_EXIT => {
                // The exit member: the return value, then is_error.
                let (sval, is_error) = (info.data[0] as i64, info.data[1] as u8);
                let (nr, prot) = inside.take()?;
                let nr = nr as i64;
                if nr == libc::SYS_set_robust_list || nr == libc::SYS_rseq {
                    // Every library is in, data segments included: reported
                    // once more (a CPython is read from them).
                    self.pids.remove(&pid);
                    return Some(pid as u32);
                }
                let mapped_code = nr == libc::SYS_mmap
                    && prot & libc::PROT_EXEC as u64 != 0
                    && is_error == 0
                    && sval > 0;
                mapped_code.then_some(pid as u32)
            }
            _ => None,
        }
    }
}

// A held process waits for the session's answer however long attaching
// takes: a deadline (10 s until now) let a child run before its probes were
// in place while it was still reported as held at birth, on a machine loaded
// enough. The answer comes, or the session drops the event (it ended or
// failed), which ends the wait.

/// `PTRACE_GET_SYSCALL_INFO` (Linux 5.3) and its `op` values: defined
/// here because the libc crate has them for glibc only (a static musl
/// build needs them too).
const PTRACE_GET_SYSCALL_INFO: PtraceRequest = 0x420e;
const SYSCALL_INFO_ENTRY: u8 = 1;
const SYSCALL_INFO_EXIT: u8 = 2;

/// `struct ptrace_syscall_info` (`linux/ptrace.h`): its union as words
/// (`entry`: nr, args[6]; `exit`: rval, is_error; `seccomp`: nr, args[6],
/// ret_data).
#[repr(C)]
#[derive(Default)]
struct SyscallInfo {
    op: u8,
    pad: [u8; 3],
    arch: u32,
    instruction_pointer: u64,
    stack_pointer: u64,
    data: [u64; 8],
}

/// The type of ptrace's request argument: `c_uint` in glibc's prototype,
/// `c_int` in musl's.
#[cfg(target_env = "musl")]
type PtraceRequest = libc::c_int;
#[cfg(not(target_env = "musl"))]
type PtraceRequest = libc::c_uint;

/// Resumes a stopped tracee.
fn resume(pid: libc::pid_t, request: PtraceRequest, signal: i32) {
    // SAFETY: resuming our own stopped tracee; the signal is passed as data.
    unsafe {
        libc::ptrace(
            request,
            pid,
            std::ptr::null_mut::<libc::c_void>(),
            signal as usize as *mut libc::c_void,
        )
    };
}

/// The two things that must both happen before a forked process runs: its
/// fork was reported and answered (probes attached), and it reached its first
/// stop. They arrive in either order.
#[derive(Default)]
struct ForkHolds {
    /// Children whose fork was answered but whose first stop is still to come.
    answered: std::collections::HashSet<libc::pid_t>,
    /// Children stopped at birth whose fork is not answered yet.
    waiting: std::collections::HashSet<libc::pid_t>,
    /// Children past their first stop.
    started: std::collections::HashSet<libc::pid_t>,
}

impl ForkHolds {
    /// The fork of `child` was answered; true when it already waits at its
    /// first stop and can be resumed now.
    fn probed(&mut self, child: libc::pid_t) -> bool {
        if self.waiting.remove(&child) {
            self.started.insert(child);
            true
        } else {
            self.answered.insert(child);
            false
        }
    }

    /// Whether this event-stop of `pid` is a new process's first stop.
    fn born(&self, pid: libc::pid_t, alive: &std::collections::HashSet<libc::pid_t>) -> bool {
        !self.started.contains(&pid) && (self.answered.contains(&pid) || !alive.contains(&pid))
    }

    /// At a new process's first stop: true when its fork was answered (it
    /// runs now), else it waits for the answer.
    fn may_run(&mut self, pid: libc::pid_t) -> bool {
        self.started.insert(pid);
        if self.answered.remove(&pid) {
            true
        } else {
            self.started.remove(&pid);
            self.waiting.insert(pid);
            false
        }
    }
}

/// Describes a `waitpid` status the way a shell would.
pub fn describe_status(status: i32) -> String {
    if libc::WIFEXITED(status) {
        format!("exit status {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        let core = if libc::WCOREDUMP(status) {
            " (core dumped)"
        } else {
            ""
        };
        format!("killed by signal {}{core}", libc::WTERMSIG(status))
    } else {
        format!("status {status:#x}")
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
        let stat = parse_stat(
            "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 5 6 0 0 20 0 3 0 987654 1000 200",
        )
        .expect("parses");
        assert_eq!(stat.comm, "a (b) c");
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.flags, 4194560);
        assert_eq!(stat.start_time, 987654);
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
    fn lists_child_processes() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .expect("sleep runs");
        assert!(children(std::process::id()).contains(&child.id()));
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn resolves_programs_on_path() {
        assert!(resolve_program("sh").is_some());
        assert!(resolve_program("no-such-program-memtrace").is_none());
    }
}
