//! Stopping a live process for the leak check, and reading it while it is
//! stopped: every thread is seized and interrupted (`PTRACE_SEIZE` +
//! `PTRACE_INTERRUPT`: no SIGSTOP is sent, so neither the process nor its
//! parent sees a stop), the thread list is read again until no new thread
//! appears (a thread born meanwhile is caught), each thread's registers
//! are read (`PTRACE_GETREGSET NT_PRSTATUS`), and [`Stopped`] resumes them
//! all when it drops (`PTRACE_DETACH`, re-injecting any signal that arrived
//! during the stop).
//!
//! Every request is made from the thread that seized: ptrace binds a
//! tracee to one tracer thread. If memtrace dies mid-check, the kernel
//! detaches the tracees and they run on (no group stop is pending, since no
//! SIGSTOP was sent). A thread in a blocking system call returns to it after
//! the stop (the kernel restarts it, or returns EINTR where the call cannot
//! be restarted, as for any ptrace stop).

use std::time::{Duration, Instant};

/// Why a process could not be stopped.
#[derive(Debug, thiserror::Error)]
pub enum StopError {
    #[error("pid {pid} is already traced by pid {tracer} (a debugger or strace): it cannot be stopped for the check")]
    Traced { pid: u32, tracer: u32 },
    #[error("pid {0} exited")]
    Gone(u32),
    #[error("cannot stop pid {pid}: {message}")]
    Other { pid: u32, message: String },
}

/// One stopped thread.
#[derive(Clone, Debug, Default)]
pub struct StoppedThread {
    /// Its thread id.
    pub tid: i32,
    /// Its stack pointer.
    pub sp: u64,
    /// Every general-purpose register (and the thread pointer), as words
    /// (`NT_PRSTATUS`).
    pub registers: Vec<u64>,
    /// Its vector registers as words (`NT_PRFPREG`: x86-64's xmm0-15, arm64's
    /// v0-31): compilers keep pointers there too (a struct copied by SSE).
    pub vector: Vec<u64>,
    /// The signal it stopped with, given back when it resumes (0: none).
    pub signal: i32,
}

/// A process with every thread stopped; resumed on drop.
pub struct Stopped {
    pub threads: Vec<StoppedThread>,
    /// Seized threads and the signal to give back to each on detach.
    seized: Vec<(libc::pid_t, i32)>,
    /// How long stopping took.
    pub stop_time: Duration,
}

/// The stack pointer's index among the words of `NT_PRSTATUS`
/// (`user_regs_struct.rsp` on x86-64, `user_pt_regs.sp` on arm64).
#[cfg(target_arch = "x86_64")]
const SP_INDEX: usize = 19;
#[cfg(target_arch = "aarch64")]
const SP_INDEX: usize = 31;

/// The stack pointer among register words read with `NT_PRSTATUS`.
pub fn stack_pointer(registers: &[u64]) -> u64 {
    registers.get(SP_INDEX).copied().unwrap_or(0)
}

/// Bytes below the stack pointer a leaf function may still use (the x86-64
/// System V red zone; arm64 has none).
#[cfg(target_arch = "x86_64")]
const RED_ZONE: u64 = 128;
#[cfg(not(target_arch = "x86_64"))]
const RED_ZONE: u64 = 0;

/// Whether the thread was stopped inside a system call (`orig_rax` is -1
/// outside one, on x86-64).
fn in_system_call(registers: &[u64]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        registers
            .get(15)
            .is_some_and(|&orig_rax| orig_rax != u64::MAX)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = registers;
        true
    }
}

impl StoppedThread {
    /// The words its registers hold, general-purpose then vector: roots of
    /// the leak check.
    pub fn root_words(&self) -> impl Iterator<Item = u64> + '_ {
        self.registers.iter().chain(&self.vector).copied()
    }

    /// Whether it was stopped inside a system call.
    pub fn in_system_call(&self) -> bool {
        in_system_call(&self.registers)
    }

    /// The lowest address of its stack that may hold live data: the stack
    /// pointer, less the red zone when it was stopped in user code (a leaf
    /// function may keep data there; below a system call's stack pointer
    /// lie only dead frames, which valgrind would not scan either).
    pub fn stack_from(&self) -> u64 {
        if in_system_call(&self.registers) {
            self.sp
        } else {
            self.sp.saturating_sub(RED_ZONE)
        }
    }
}

/// Words of the register set read (larger than either architecture's).
const REGISTER_WORDS: usize = 64;

impl Stopped {
    /// Stops every thread of `pid`; gives up (resuming what it stopped)
    /// after `timeout` (a thread that never reaches a stop: uninterruptible
    /// sleep on a hung file system).
    pub fn stop(pid: u32, timeout: Duration) -> Result<Stopped, StopError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut stopped = Stopped {
            threads: Vec::new(),
            seized: Vec::new(),
            stop_time: Duration::ZERO,
        };
        loop {
            let tids = list_threads(pid).ok_or(StopError::Gone(pid))?;
            let new: Vec<libc::pid_t> = tids
                .into_iter()
                .filter(|tid| !stopped.seized.iter().any(|(t, _)| t == tid))
                .collect();
            if new.is_empty() {
                break;
            }
            for tid in new {
                match seize(tid) {
                    Ok(()) => {}
                    // It exited between the listing and the seize.
                    Err(libc::ESRCH) => continue,
                    Err(libc::EPERM) => {
                        if let Some(tracer) = tracer_of(pid, tid) {
                            return Err(StopError::Traced { pid, tracer });
                        }
                        let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope");
                        let message = if yama.is_ok_and(|v| v.trim() == "3") {
                            "ptrace is disabled on this machine (kernel.yama.ptrace_scope = 3)"
                        } else {
                            "permission denied (needs CAP_SYS_PTRACE)"
                        };
                        return Err(StopError::Other {
                            pid,
                            message: message.to_string(),
                        });
                    }
                    Err(errno) => {
                        return Err(StopError::Other {
                            pid,
                            message: std::io::Error::from_raw_os_error(errno).to_string(),
                        })
                    }
                }
                match wait_stopped(tid, deadline) {
                    Waited::Stopped(signal) => stopped.seized.push((tid, signal)),
                    Waited::Exited => {}
                    Waited::TimedOut => {
                        stopped.seized.push((tid, 0));
                        return Err(StopError::Other {
                            pid,
                            message: format!(
                                "thread {tid} did not stop within {} ms",
                                timeout.as_millis()
                            ),
                        });
                    }
                }
            }
        }
        if stopped.seized.is_empty() {
            return Err(StopError::Gone(pid));
        }
        for &(tid, signal) in &stopped.seized {
            if let Some(registers) = registers(tid) {
                stopped.threads.push(StoppedThread {
                    tid,
                    sp: stack_pointer(&registers),
                    registers,
                    vector: vector_registers(tid).unwrap_or_default(),
                    signal,
                });
            }
        }
        stopped.stop_time = started.elapsed();
        Ok(stopped)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for &(tid, signal) in &self.seized {
            detach(tid, signal);
        }
    }
}

/// Detaches stopped tracee `tid` (this thread's), giving it `signal`.
pub(crate) fn detach(tid: libc::pid_t, signal: i32) {
    // SAFETY: detaching our own stopped tracee; the signal to deliver is
    // passed as data.
    unsafe {
        libc::ptrace(
            libc::PTRACE_DETACH,
            tid,
            std::ptr::null_mut::<libc::c_void>(),
            signal as usize as *mut libc::c_void,
        )
    };
}

/// The message of a tracee's ptrace event stop (`PTRACE_GETEVENTMSG`: a
/// new child's pid at a fork or clone event).
pub(crate) fn event_message(tid: libc::pid_t) -> u64 {
    let mut message: libc::c_ulong = 0;
    // SAFETY: PTRACE_GETEVENTMSG writes one unsigned long into `message`.
    unsafe {
        libc::ptrace(
            libc::PTRACE_GETEVENTMSG,
            tid,
            std::ptr::null_mut::<libc::c_void>(),
            (&mut message as *mut libc::c_ulong).cast::<libc::c_void>(),
        )
    };
    message
}

/// The thread ids of `pid` (`/proc/PID/task`).
fn list_threads(pid: u32) -> Option<Vec<libc::pid_t>> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    Some(
        dir.filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect(),
    )
}

/// `PTRACE_SEIZE` + `PTRACE_INTERRUPT`; the errno on failure.
pub(crate) fn seize(tid: libc::pid_t) -> Result<(), i32> {
    // SAFETY: PTRACE_SEIZE with no options; no memory is passed.
    let seized = unsafe {
        libc::ptrace(
            libc::PTRACE_SEIZE,
            tid,
            std::ptr::null_mut::<libc::c_void>(),
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    if seized != 0 {
        return Err(errno());
    }
    // SAFETY: PTRACE_INTERRUPT on the tracee just seized; no memory passed.
    let interrupted = unsafe {
        libc::ptrace(
            libc::PTRACE_INTERRUPT,
            tid,
            std::ptr::null_mut::<libc::c_void>(),
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    if interrupted != 0 {
        let err = errno();
        // SAFETY: undoing the seize of our own tracee.
        unsafe {
            libc::ptrace(
                libc::PTRACE_DETACH,
                tid,
                std::ptr::null_mut::<libc::c_void>(),
                std::ptr::null_mut::<libc::c_void>(),
            )
        };
        return Err(err);
    }
    Ok(())
}

pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

pub(crate) enum Waited {
    /// Stopped; the signal it stopped for, to give back (0: our interrupt).
    Stopped(i32),
    Exited,
    TimedOut,
}

/// Waits for a traced thread's next stop.
pub(crate) fn wait_stopped(tid: libc::pid_t, deadline: Instant) -> Waited {
    let mut pause = Duration::from_micros(20);
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own tracee with a valid status pointer.
        let who = unsafe { libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG) };
        if who == tid {
            if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                return Waited::Exited;
            }
            if libc::WIFSTOPPED(status) {
                // A signal-delivery stop's signal is given back; an event
                // stop (our interrupt, or an event of a thread traced with
                // options) or a system-call stop has none.
                let event = (status >> 16) & 0xff;
                let signal = if event == 0 && libc::WSTOPSIG(status) != libc::SIGTRAP | 0x80 {
                    libc::WSTOPSIG(status)
                } else {
                    0
                };
                return Waited::Stopped(signal);
            }
        } else if who < 0 && errno() != libc::EINTR {
            return Waited::Exited;
        }
        if Instant::now() >= deadline {
            return Waited::TimedOut;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
}

/// The register words of a stopped tracee (`NT_PRSTATUS`).
pub fn registers(tid: libc::pid_t) -> Option<Vec<u64>> {
    let mut words = vec![0u64; REGISTER_WORDS];
    let read = read_regset(tid, libc::NT_PRSTATUS as u32, &mut words)?;
    words.truncate(read);
    Some(words)
}

/// Reads register set `note_type` of a stopped tracee into `words`;
/// the words the kernel wrote.
fn read_regset(tid: libc::pid_t, note_type: u32, words: &mut [u64]) -> Option<usize> {
    let mut iov = libc::iovec {
        iov_base: words.as_mut_ptr().cast(),
        iov_len: std::mem::size_of_val(words),
    };
    // SAFETY: PTRACE_GETREGSET on our stopped tracee; the kernel writes at
    // most `iov_len` bytes into `words` and shrinks `iov_len` to what it
    // wrote. The address argument is the note type, a number.
    let read = unsafe {
        libc::ptrace(
            libc::PTRACE_GETREGSET,
            tid,
            note_type as usize as *mut libc::c_void,
            (&mut iov as *mut libc::iovec).cast::<libc::c_void>(),
        )
    };
    (read == 0).then_some(iov.iov_len / 8)
}

/// A stopped tracee's registers (general-purpose and vector) as a
/// [`StoppedThread`]; `signal` is the one to give back when it resumes.
pub(crate) fn read_thread(tid: libc::pid_t, signal: i32) -> Option<StoppedThread> {
    let registers = registers(tid)?;
    Some(StoppedThread {
        tid,
        sp: stack_pointer(&registers),
        vector: vector_registers(tid).unwrap_or_default(),
        registers,
        signal,
    })
}

/// The `exit` system call's number: a thread ending itself
/// (`pthread_exit`), not its process.
#[cfg(target_arch = "x86_64")]
const EXIT_CALL: i64 = 60;
#[cfg(target_arch = "aarch64")]
const EXIT_CALL: i64 = 93;

/// At its exit stop, whether a thread ends by itself (inside the `exit`
/// system call) rather than with its whole process (killed by another
/// thread's `exit_group`, or by a fatal signal): then its registers are
/// no process's roots any more.
pub(crate) fn ends_by_itself(thread: &StoppedThread) -> bool {
    system_call_number(thread) == Some(EXIT_CALL)
}

#[cfg(target_arch = "x86_64")]
fn system_call_number(thread: &StoppedThread) -> Option<i64> {
    // `orig_rax`: the call it is in, -1 outside one.
    thread.registers.get(15).map(|&n| n as i64)
}

#[cfg(target_arch = "aarch64")]
fn system_call_number(thread: &StoppedThread) -> Option<i64> {
    const NT_ARM_SYSTEM_CALL: u32 = 0x404;
    let mut words = [0u64; 1];
    let mut iov = libc::iovec {
        iov_base: words.as_mut_ptr().cast(),
        iov_len: 4,
    };
    // SAFETY: PTRACE_GETREGSET of the 4-byte system-call number of our
    // stopped tracee into `words`; the address argument is the note type.
    let read = unsafe {
        libc::ptrace(
            libc::PTRACE_GETREGSET,
            thread.tid,
            NT_ARM_SYSTEM_CALL as usize as *mut libc::c_void,
            (&mut iov as *mut libc::iovec).cast::<libc::c_void>(),
        )
    };
    (read == 0).then(|| i64::from(words[0] as u32 as i32))
}

/// `execve` and `execveat`'s numbers.
#[cfg(target_arch = "x86_64")]
const EXEC_CALLS: [i64; 2] = [59, 322];
#[cfg(target_arch = "aarch64")]
const EXEC_CALLS: [i64; 2] = [221, 281];

/// Whether thread `tid` of `pid` is inside `execve` (`/proc/.../syscall`):
/// it replaces its process rather than exiting with it.
pub(crate) fn in_exec(pid: libc::pid_t, tid: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall"))
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse::<i64>().ok())
        .is_some_and(|call| EXEC_CALLS.contains(&call))
}

/// The process a thread belongs to (`Tgid:` in its status).
pub(crate) fn thread_group(tid: libc::pid_t) -> Option<libc::pid_t> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The vector registers of a stopped tracee, as words: x86-64's xmm0-15
/// (bytes 160..416 of the FXSAVE area), arm64's v0-31.
pub fn vector_registers(tid: libc::pid_t) -> Option<Vec<u64>> {
    let mut words = vec![0u64; 72];
    let read = read_regset(tid, libc::NT_PRFPREG as u32, &mut words)?;
    #[cfg(target_arch = "x86_64")]
    let range = 20..52;
    #[cfg(not(target_arch = "x86_64"))]
    let range = 0..64;
    (read >= range.end).then(|| words[range].to_vec())
}

/// The tracer of a thread of `pid` (`TracerPid:` in its status), if any.
fn tracer_of(pid: u32, tid: libc::pid_t) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).ok()?;
    parse_tracer(&status)
}

/// `TracerPid:` of a `/proc/.../status` text, when non-zero.
pub fn parse_tracer(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|v| v.trim().parse().ok())
        .filter(|&t| t != 0)
}

/// Reads another process's memory (`process_vm_readv`) while it is stopped:
/// holes (pages unmapped or unreadable) read as zeros, counted.
pub struct ProcessMemory {
    pub pid: u32,
    /// Bytes that could not be read (zeros given instead).
    pub unreadable: u64,
    /// Whether the process was gone at some read (every read failed with ESRCH).
    pub gone: bool,
    /// Past this instant nothing more is read (`--leak-check-max-pause`).
    deadline: Option<Instant>,
    /// Bytes not read because the deadline had passed.
    pub skipped: u64,
    /// Ranges read from elsewhere (a snapshot's: copied from the service
    /// during the stop), sorted, disjoint: served instead of `pid`'s.
    copies: Vec<(u64, Vec<u8>)>,
    /// `/proc/PID/mem`, read instead of `process_vm_readv` (a snapshot's
    /// child: see [`ProcessMemory::through_proc_mem`]).
    mem_file: Option<std::sync::Arc<std::fs::File>>,
    /// Blocks read ahead on helper threads ([`crate::reach::Memory::prefetch`]),
    /// started at the first request.
    ahead: Option<super::read_ahead::ReadAhead>,
    /// The buffer neighbours are read into, kept: a fresh megabyte per
    /// read was a fresh mapping (glibc's mmap threshold), a page fault and
    /// a cleared page for every 4 KiB read (a tenth of a 10M-block check).
    scratch: Vec<u8>,
}

impl ProcessMemory {
    pub fn new(pid: u32) -> Self {
        ProcessMemory {
            pid,
            unreadable: 0,
            gone: false,
            deadline: None,
            skipped: 0,
            copies: Vec::new(),
            mem_file: None,
            ahead: None,
            scratch: Vec::new(),
        }
    }

    /// Reads through `/proc/PID/mem` instead of `process_vm_readv`. A
    /// snapshot's child must be read so: `process_vm_readv` pins the pages
    /// it reads (`FOLL_PIN`), and a pinned anonymous page shared with the
    /// service is unshared first, copied into the child (`do_wp_page`):
    /// the scan would copy the whole heap, charged to the service's
    /// memory cgroup. `/proc/PID/mem` takes plain references, which leave
    /// a shared page shared.
    pub fn through_proc_mem(mut self) -> std::io::Result<Self> {
        self.mem_file = Some(std::sync::Arc::new(std::fs::File::open(format!(
            "/proc/{}/mem",
            self.pid
        ))?));
        Ok(self)
    }

    /// Bytes served from blocks read ahead.
    pub fn read_ahead(&self) -> u64 {
        self.ahead.as_ref().map_or(0, |a| a.served)
    }

    /// Serves reads of these ranges from the bytes given (sorted, disjoint).
    pub fn with_copies(mut self, copies: Vec<(u64, Vec<u8>)>) -> Self {
        self.copies = copies;
        self
    }

    /// Copies `ranges` of this process into memory (for
    /// [`ProcessMemory::with_copies`] of another reader).
    pub fn copy_ranges(&mut self, ranges: &[(u64, u64)]) -> Vec<(u64, Vec<u8>)> {
        ranges
            .iter()
            .map(|&(start, end)| {
                let mut bytes = vec![0u8; (end - start) as usize];
                crate::reach::Memory::read(self, start, &mut bytes);
                (start, bytes)
            })
            .collect()
    }

    /// The copy holding `addr`, or the next one's start.
    fn copy_at(&self, addr: u64) -> Result<usize, Option<u64>> {
        let k = self
            .copies
            .partition_point(|(start, bytes)| start + bytes.len() as u64 <= addr);
        match self.copies.get(k) {
            Some((start, _)) if *start <= addr => Ok(k),
            Some((start, _)) => Err(Some(*start)),
            None => Err(None),
        }
    }

    fn touches_copy(&self, addr: u64, len: usize) -> bool {
        match self.copy_at(addr) {
            Ok(_) => true,
            Err(next) => next.is_some_and(|n| n < addr + len as u64),
        }
    }

    /// Reads nothing more after `deadline`: the rest is counted as skipped.
    pub fn with_deadline(mut self, deadline: Instant) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Reads `buf.len()` bytes at `addr`; returns how many were really read.
    fn read_some(&mut self, addr: u64, buf: &mut [u8]) -> usize {
        if let Some(file) = &self.mem_file {
            use std::os::unix::fs::FileExt;
            return match file.read_at(buf, addr) {
                Ok(n) => n,
                Err(err) => {
                    if err.raw_os_error() == Some(libc::ESRCH) {
                        self.gone = true;
                    }
                    0
                }
            };
        }
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: `local` describes `buf`, writable for its length; the
        // remote range is only read by the kernel, which checks it.
        let n = unsafe { libc::process_vm_readv(self.pid as i32, &local, 1, &remote, 1, 0) };
        if n < 0 {
            if errno() == libc::ESRCH {
                self.gone = true;
            }
            return 0;
        }
        n as usize
    }
}

const PAGE: u64 = 4096;

impl crate::reach::Memory for ProcessMemory {
    fn prefetch(&mut self, addr: u64, len: u64) {
        if self.gone || self.deadline.is_some_and(|d| Instant::now() >= d) {
            return;
        }
        let source = match &self.mem_file {
            Some(file) => super::read_ahead::Source::File(std::sync::Arc::clone(file)),
            None => super::read_ahead::Source::Pid(self.pid),
        };
        self.ahead
            .get_or_insert_with(|| super::read_ahead::ReadAhead::new(source))
            .request(addr, len);
    }

    /// Up to 1024 ranges per `process_vm_readv`; a batch that fails part
    /// way is read again range by range (holes as zeros).
    fn read_many(&mut self, ranges: &[(u64, usize)], buf: &mut [u8]) {
        let mut at = 0usize;
        for group in ranges.chunks(1024) {
            let total: usize = group.iter().map(|r| r.1).sum();
            if self.mem_file.is_some() {
                self.read_neighbours(group, &mut buf[at..at + total]);
                at += total;
                continue;
            }
            if !self.copies.is_empty() && group.iter().any(|&(a, l)| self.touches_copy(a, l)) {
                let mut offset = at;
                for &(addr, len) in group {
                    self.read(addr, &mut buf[offset..offset + len]);
                    offset += len;
                }
                at += total;
                continue;
            }
            if self.deadline.is_some_and(|d| Instant::now() >= d) || self.gone {
                buf[at..at + total].fill(0);
                self.skipped += total as u64;
                at += total;
                continue;
            }
            let local = libc::iovec {
                iov_base: buf[at..].as_mut_ptr().cast(),
                iov_len: total,
            };
            let remote: Vec<libc::iovec> = group
                .iter()
                .map(|&(addr, len)| libc::iovec {
                    iov_base: addr as *mut libc::c_void,
                    iov_len: len,
                })
                .collect();
            // SAFETY: `local` describes `total` writable bytes of `buf`;
            // the remote ranges are only read, and checked, by the kernel.
            let n = unsafe {
                libc::process_vm_readv(
                    self.pid as i32,
                    &local,
                    1,
                    remote.as_ptr(),
                    remote.len() as libc::c_ulong,
                    0,
                )
            };
            if n < 0 || (n as usize) < total {
                // Some range failed: each again on its own.
                let mut offset = at;
                for &(addr, len) in group {
                    self.read(addr, &mut buf[offset..offset + len]);
                    offset += len;
                }
            }
            at += total;
        }
    }

    fn read(&mut self, addr: u64, buf: &mut [u8]) -> usize {
        if !self.copies.is_empty() && self.touches_copy(addr, buf.len()) {
            let mut done = 0usize;
            while done < buf.len() {
                let at = addr + done as u64;
                let left = buf.len() - done;
                match self.copy_at(at) {
                    Ok(k) => {
                        let (start, bytes) = &self.copies[k];
                        let from = (at - start) as usize;
                        let n = (bytes.len() - from).min(left);
                        buf[done..done + n].copy_from_slice(&bytes[from..from + n]);
                        done += n;
                    }
                    Err(next) => {
                        let n = next.map_or(left, |n| ((n - at) as usize).min(left));
                        self.read_process(at, &mut buf[done..done + n]);
                        done += n;
                    }
                }
            }
            return if self.gone { 0 } else { done };
        }
        self.read_process(addr, buf)
    }
}

impl ProcessMemory {
    /// Reads `ranges` into consecutive parts of `buf`, one read for each
    /// run of ranges close together (a read of `/proc/PID/mem` takes one
    /// range: neighbours are read with the gaps between them).
    fn read_neighbours(&mut self, ranges: &[(u64, usize)], buf: &mut [u8]) {
        const GAP: u64 = 4096;
        const SPAN: u64 = 1 << 20;
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut first = 0;
        let mut at = 0;
        while first < ranges.len() {
            let start = ranges[first].0;
            let mut end = start + ranges[first].1 as u64;
            let mut last = first;
            while let Some(&(next, len)) = ranges.get(last + 1) {
                let next_end = next + len as u64;
                if next < end || next - end > GAP || next_end - start > SPAN {
                    break;
                }
                end = next_end;
                last += 1;
            }
            let count: usize = ranges[first..=last].iter().map(|r| r.1).sum();
            if last == first {
                crate::reach::Memory::read(self, start, &mut buf[at..at + count]);
            } else {
                let span = (end - start) as usize;
                if scratch.len() < span {
                    scratch.resize(span, 0);
                }
                crate::reach::Memory::read(self, start, &mut scratch[..span]);
                let mut out = at;
                for &(addr, len) in &ranges[first..=last] {
                    let from = (addr - start) as usize;
                    buf[out..out + len].copy_from_slice(&scratch[from..from + len]);
                    out += len;
                }
            }
            at += count;
            first = last + 1;
        }
        self.scratch = scratch;
    }

    /// Reads `buf.len()` bytes of the process at `addr` (holes as zeros).
    fn read_process(&mut self, addr: u64, buf: &mut [u8]) -> usize {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            self.skipped += buf.len() as u64;
            buf.fill(0);
            return 0;
        }
        if !self.gone && self.ahead.as_mut().is_some_and(|a| a.serve(addr, buf)) {
            return buf.len();
        }
        let mut done = 0usize;
        while done < buf.len() && !self.gone {
            let at = addr + done as u64;
            let n = self.read_some(at, &mut buf[done..]);
            if n > 0 {
                done += n;
                continue;
            }
            // A hole: skip to the next page, zero-filled.
            let next = ((at / PAGE) + 1) * PAGE;
            let skip = ((next - at) as usize).min(buf.len() - done);
            buf[done..done + skip].fill(0);
            self.unreadable += skip as u64;
            done += skip;
        }
        if self.gone {
            buf[done..].fill(0);
            return 0;
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_tracer_pid() {
        assert_eq!(parse_tracer("Name:\tx\nTracerPid:\t4242\n"), Some(4242));
        assert_eq!(parse_tracer("TracerPid:\t0\n"), None);
        assert_eq!(parse_tracer("garbage"), None);
    }

    #[test]
    fn reads_through_proc_mem_and_neighbours_together() {
        let data: Vec<u8> = (0..=255u8).cycle().take(3 * 4096).collect();
        let base = data.as_ptr() as u64;
        let mut memory = ProcessMemory::new(std::process::id())
            .through_proc_mem()
            .expect("own /proc/self/mem");
        let ranges = [
            (base, 16),
            (base + 100, 8),
            (base + 8000, 32),
            (base + 5, 3),
        ];
        let mut buf = vec![0u8; 59];
        crate::reach::Memory::read_many(&mut memory, &ranges, &mut buf);
        let mut expected = Vec::new();
        for &(addr, len) in &ranges {
            let from = (addr - base) as usize;
            expected.extend_from_slice(&data[from..from + len]);
        }
        assert_eq!(buf, expected);
        // Page 0: a hole, zeros, counted.
        let mut low = vec![1u8; 4096];
        crate::reach::Memory::read(&mut memory, 0, &mut low);
        assert!(low.iter().all(|&b| b == 0));
        assert_eq!(memory.unreadable, 4096);
    }

    #[test]
    fn reads_its_own_memory_and_counts_holes() {
        let data: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let mut memory = ProcessMemory::new(std::process::id());
        let mut buf = vec![0u8; data.len()];
        let n = crate::reach::Memory::read(&mut memory, data.as_ptr() as u64, &mut buf);
        assert_eq!(n, data.len());
        assert_eq!(buf, data);
        // Page 0 is never mapped: read as zeros, counted.
        let mut low = vec![1u8; 8192];
        crate::reach::Memory::read(&mut memory, 0, &mut low);
        assert!(low.iter().all(|&b| b == 0));
        assert_eq!(memory.unreadable, 8192);
    }
}
