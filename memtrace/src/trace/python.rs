//! Watching traced processes for a CPython interpreter: each running
//! process is checked soon after it is traced (every 20 ms for its first
//! 3 s, so a launched `python3` is found before its script runs, then every
//! 500 ms, so an interpreter loaded later with `dlopen` is found too), and
//! again after an `exec`; a launched command is also checked at each of its
//! stops while `ld.so` maps its libraries, before its own code runs. A process found to be CPython 3.11+ gets its
//! reading recipe in the kernel's `PY_PROCS` map; any other version is
//! named in the report with why its frames are not read.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::interp::python::{self, detect, resolve::ProcMem, Interpreter};
use crate::stacks::StackStore;
use crate::trace::loader::Probes;

const EARLY: Duration = Duration::from_secs(3);
const EARLY_EVERY: Duration = Duration::from_millis(20);
const LATER_EVERY: Duration = Duration::from_millis(500);

struct Watched {
    first_seen: Instant,
    checked_at: Instant,
    exe: Option<PathBuf>,
    /// An interpreter was found (read or not): only an exec changes that.
    found: bool,
}

/// How long after a process (or its new image) is first seen a failed
/// interpreter read is retried rather than reported.
const RETRY_FOR: Duration = Duration::from_secs(3);

/// Per-process detection state.
pub struct PythonWatch {
    procs: HashMap<u32, Watched>,
    /// The offset of a task's thread pointer in the kernel's
    /// `task_struct`, when its BTF says.
    thread_pointer: Option<u64>,
    /// Objects already read (most processes are no Python: their files
    /// are read once, not at every check).
    exports: detect::ExportCache,
}

impl Default for PythonWatch {
    fn default() -> Self {
        let thread_pointer = crate::btf::thread_pointer_offset();
        if thread_pointer.is_none() {
            log::info!("no thread pointer in the kernel's BTF task_struct: Python threads are matched by native_thread_id (3.11+ only)");
        }
        PythonWatch {
            procs: HashMap::new(),
            thread_pointer,
            exports: detect::ExportCache::new(),
        }
    }
}

impl PythonWatch {
    /// Where the kernel finds the `pthread_t` of a thread of `pid`.
    fn thread(&self, pid: u32) -> Option<python::layout::ThreadPointer> {
        let task_offset = self.thread_pointer?;
        let below = crate::tracee::tls::pthread_below_tp(pid, crate::arch::Arch::HOST);
        if below.is_none() {
            log::info!("pid {pid}: glibc's pthread size is unknown (no _thread_db_sizeof_pthread): Python threads are matched by native_thread_id (3.11+ only)");
        }
        Some(python::layout::ThreadPointer {
            task_offset,
            pthread_below_tp: below?,
        })
    }

    /// Checks `pid` if it is due.
    pub fn poll(&mut self, pid: u32, probes: &mut Probes, stacks: &mut StackStore) {
        self.check(pid, false, probes, stacks);
    }

    /// Checks `pid` now, due or not: launch mode's stops while `ld.so`
    /// loads a command's libraries, so a short script's first allocations
    /// already carry their Python frames (a timer can miss all of them).
    pub fn check_now(&mut self, pid: u32, probes: &mut Probes, stacks: &mut StackStore) {
        self.check(pid, true, probes, stacks);
    }

    fn check(&mut self, pid: u32, now_anyway: bool, probes: &mut Probes, stacks: &mut StackStore) {
        let now = Instant::now();
        let watched = self.procs.entry(pid).or_insert_with(|| Watched {
            first_seen: now,
            checked_at: now - LATER_EVERY,
            exe: None,
            found: false,
        });
        let every = if now.duration_since(watched.first_seen) < EARLY {
            EARLY_EVERY
        } else {
            LATER_EVERY
        };
        if !now_anyway && now.duration_since(watched.checked_at) < every {
            return;
        }
        watched.checked_at = now;
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        if exe != watched.exe {
            log::debug!("pid {pid}: image {:?} (was {:?})", exe, watched.exe);
            if watched.found {
                probes.clear_python(pid);
                stacks.python.forget(pid);
            }
            watched.exe = exe;
            watched.found = false;
            watched.first_seen = now;
        }
        if watched.found {
            return;
        }
        let first_seen = watched.first_seen;
        let Ok(Some(found)) = detect::find(pid, &mut self.exports) else {
            return;
        };
        watched.found = true;
        let mut info = Interpreter {
            pid,
            version: found.version(),
            object: found.object.display().to_string(),
            frames_read: false,
            reason: None,
            stacks: 0,
            unresolved_frames: 0,
            stacks_rejected: 0,
        };
        let planned = ProcMem::open(pid)
            .map_err(|err| format!("cannot read /proc/{pid}/mem: {err}"))
            .and_then(|mem| python::plan(&found, &mem, self.thread(pid)));
        match planned {
            Ok(attached) => {
                stacks
                    .python
                    .set_interpreter(info.clone(), Some(attached.layout));
                match probes.set_python(pid, &attached.config) {
                    Ok(()) => {
                        info.frames_read = true;
                        log::info!(
                            "pid {pid}: Python {} in {}, frames read",
                            info.version,
                            info.object
                        );
                        stacks.python.set_interpreter(info, Some(attached.layout));
                    }
                    Err(err) => {
                        info.reason = Some(format!("{err:#}"));
                        stacks.python.set_interpreter(info, None);
                    }
                }
            }
            Err(reason) if now.duration_since(first_seen) < RETRY_FOR => {
                // Likely caught mid-load (ld.so maps and relocates libpython
                // in steps, and launch mode stops the command at each
                // mapping): try again at the next poll.
                log::debug!("pid {pid}: Python {}: {reason} (will retry)", info.version);
                if let Some(watched) = self.procs.get_mut(&pid) {
                    watched.found = false;
                }
            }
            Err(reason) => {
                log::info!("pid {pid}: Python {}: {reason}", info.version);
                info.reason = Some(reason);
                stacks.python.set_interpreter(info, None);
            }
        }
    }

    /// Forgets a process that is gone.
    pub fn forget(&mut self, pid: u32, probes: &mut Probes) {
        if self.procs.remove(&pid).is_some_and(|w| w.found) {
            probes.clear_python(pid);
        }
    }
}
