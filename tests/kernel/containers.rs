//! Containers: a no-frame-pointer leaking program in its own mount and pid
//! namespaces, `pivot_root`ed into a root file system holding it and the
//! libraries it links, traced from the host by its host pid. Its files are
//! read as it sees them (symbols, unwind tables, probes), never the host's
//! file at the same path; the report shows its pid inside the namespace.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::{fixture, privileged, site_totals, sites_of, Tracer};

/// The files `ldd` names for `binary` (libraries and the loader), as
/// (path the program loads, real file on the host).
fn linked_files(binary: &Path) -> Vec<(PathBuf, PathBuf)> {
    let out = Command::new("ldd").arg(binary).output().expect("ldd runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            let path = match line.split_once(" => ") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| {
                let real = fs::canonicalize(path).unwrap_or_else(|_| PathBuf::from(path));
                (PathBuf::from(path), real)
            })
        })
        .collect()
}

/// Copies `from` to `root` + `inside`, creating directories.
fn place(root: &Path, inside: &Path, from: &Path) {
    let to = root.join(inside.strip_prefix("/").unwrap_or(inside));
    fs::create_dir_all(to.parent().expect("a parent")).expect("mkdir");
    fs::copy(from, &to)
        .unwrap_or_else(|err| panic!("copy {} -> {}: {err}", from.display(), to.display()));
}

/// A directory removed (with what it holds) on drop.
struct Removed(PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A fixture running as pid 1 of its own pid namespace, in its own mount
/// namespace whose root is a private root file system. Everything is undone
/// on drop: the processes killed (the namespaces and their mounts go with
/// them), the root file system and any file planted on the host removed.
struct Contained {
    /// The waiting parent (as `unshare --fork` leaves it), outside the namespace.
    waiter: Child,
    stdout: BufReader<ChildStdout>,
    /// The program's pid on the host.
    host_pid: u32,
    /// Its pid inside its namespace (from its `ready` line).
    ns_pid: u32,
    /// Dropped after the processes are killed (fields drop in order).
    _dir: Removed,
}

impl Contained {
    /// Builds a root file system holding fixture `name` at `inside` plus its
    /// libraries and starts it there.
    fn start(name: &str, inside: &Path) -> Contained {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = Removed(std::env::temp_dir().join(format!(
            "memtrace-container-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        )));
        let _ = fs::remove_dir_all(&dir.0);
        let root = dir.0.join("root");
        let program = fixture(name);
        place(&root, inside, &program);
        for (loaded, real) in linked_files(&program) {
            place(&root, &loaded, &real);
        }
        fs::create_dir_all(root.join("old")).expect("mkdir old");
        let root_c = std::ffi::CString::new(root.as_os_str().as_encoded_bytes()).expect("path");
        let mut command = Command::new(inside);
        command
            .args(["30", "30"])
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: the closure runs in the forked child before exec and only
        // makes raw system calls (unshare, fork, waitpid, close_range,
        // mount, chdir, pivot_root, umount2, _exit) on pointers to
        // NUL-terminated strings that live until after the spawn.
        unsafe {
            command.pre_exec(move || enter(&root_c));
        }
        let mut waiter = command.spawn().expect("the contained program starts");
        let stdout = BufReader::new(waiter.stdout.take().expect("stdout piped"));
        let mut contained = Contained {
            waiter,
            stdout,
            host_pid: 0,
            ns_pid: 0,
            _dir: dir,
        };
        let mut line = String::new();
        contained.stdout.read_line(&mut line).expect("ready line");
        contained.ns_pid = line
            .strip_prefix("ready ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("contained {name} said {line:?}"));
        let children = format!("/proc/{0}/task/{0}/children", contained.waiter.id());
        contained.host_pid = fs::read_to_string(&children)
            .ok()
            .and_then(|text| text.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no child of the waiter in {children}"));
        contained
    }

    fn go(&mut self) {
        let stdin = self.waiter.stdin.as_mut().expect("stdin piped");
        stdin.write_all(b"\n").expect("go");
        stdin.flush().expect("flush");
        let mut line = String::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while line.trim() != "done" {
            line.clear();
            let n = self.stdout.read_line(&mut line).expect("program output");
            assert!(n > 0 && Instant::now() < deadline, "exited before `done`");
        }
    }
}

impl Drop for Contained {
    fn drop(&mut self) {
        // Pid 1 of the namespace: killing it ends the namespace's processes.
        if self.host_pid != 0 {
            // SAFETY: kill with the pid of a process this test started.
            unsafe { libc::kill(self.host_pid as i32, libc::SIGKILL) };
        }
        let _ = self.waiter.kill();
        let _ = self.waiter.wait();
    }
}

/// In the child before exec: new mount and pid namespaces; a waiting
/// parent stays outside (as `unshare --fork` does), the program becomes pid
/// 1 inside, with `root` as its root (`pivot_root`, the old root detached).
fn enter(root: &std::ffi::CStr) -> std::io::Result<()> {
    let check = |rc: libc::c_int| {
        if rc < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(rc)
        }
    };
    // SAFETY: raw system calls on valid NUL-terminated strings; in the
    // waiting parent only async-signal-safe calls follow the fork.
    unsafe {
        check(libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWPID))?;
        let pid = check(libc::fork())?;
        if pid > 0 {
            // Not the spawner's exec-error pipe: its end must close now.
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
            libc::_exit(if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                128 + libc::WTERMSIG(status)
            });
        }
        let none = std::ptr::null();
        check(libc::mount(
            none,
            c"/".as_ptr(),
            none,
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ))?;
        check(libc::mount(
            root.as_ptr(),
            root.as_ptr(),
            none,
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        ))?;
        check(libc::chdir(root.as_ptr()))?;
        check(libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c"old".as_ptr()) as libc::c_int)?;
        check(libc::chdir(c"/".as_ptr()))?;
        check(libc::umount2(c"/old".as_ptr(), libc::MNT_DETACH))?;
        libc::rmdir(c"/old".as_ptr());
    }
    Ok(())
}

/// The symbols of a site's frames, in order.
fn symbols(site: &Value) -> Vec<String> {
    site["frames"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| f["symbol"].as_str().unwrap_or("??").to_string())
        .collect()
}

/// Traces the contained program by its host pid; returns the JSON report.
/// `exit`: the program is killed after its work, so memtrace reads its
/// files only after it is gone (the report comes when it exits).
fn trace(contained: &mut Contained, exit: bool) -> Value {
    let pid = contained.host_pid.to_string();
    let tracer = Tracer::attach(&["--pid", &pid, "--format", "json", "--top", "500"]);
    contained.go();
    if exit {
        // SAFETY: kill with the pid of a process this test started.
        unsafe { libc::kill(contained.host_pid as i32, libc::SIGKILL) };
    } else {
        tracer.signal(libc::SIGINT);
    }
    tracer.report_last_line().0
}

/// What every contained trace must show: exact bytes, whole stacks
/// symbolized from the container's file, both pids.
fn assert_contained(report: &Value, contained: &Contained, inside: &Path) {
    assert_eq!(site_totals(report, "leak_a"), (4800, 100), "leak_a");
    assert_eq!(site_totals(report, "leak_b"), (10000, 10), "leak_b");
    assert_eq!(site_totals(report, "leak_calloc"), (1000, 5), "calloc");
    let site = sites_of(report, "leak_a")[0];
    let frames = symbols(site);
    assert_eq!(
        frames.get(..2),
        Some(&["leak_a".to_string(), "main".to_string()][..]),
        "the container's own symbols up to main (no frame pointers: DWARF): {frames:?}"
    );
    assert_eq!(
        site["frames"][0]["module"].as_str(),
        inside.to_str(),
        "modules are shown as the target sees them"
    );
    assert_eq!(report["stack_truncations_by_cause"]["no_table"], 0);
    assert_eq!(report["target"]["pid"], u64::from(contained.host_pid));
    assert_eq!(report["target"]["ns_pid"], u64::from(contained.ns_pid));
    assert_ne!(contained.ns_pid, contained.host_pid);
    assert!(
        report["target"]["cgroup"].is_string(),
        "{}",
        report["target"]
    );
    let process = &report["processes"][0];
    assert_eq!(process["ns_pid"], u64::from(contained.ns_pid));
    let notes = report["notes"].to_string();
    assert!(!notes.contains("could not be opened"), "{notes}");
}

#[test]
fn contained_program_is_read_as_it_sees_its_files() {
    if !privileged() {
        return;
    }
    // A path that does not exist on the host.
    let inside = PathBuf::from(format!(
        "/memtrace-ct-absent-{}/app/leak",
        std::process::id()
    ));
    assert!(!inside.exists());
    let mut contained = Contained::start("leak_sites_nofp", &inside);
    let report = trace(&mut contained, false);
    assert_contained(&report, &contained, &inside);
    assert_eq!(contained.ns_pid, 1);
}

#[test]
fn another_file_at_the_same_path_on_the_host_is_not_read() {
    if !privileged() {
        return;
    }
    // The host has another program at the container's path.
    let top = Removed(PathBuf::from(format!(
        "/memtrace-ct-planted-{}",
        std::process::id()
    )));
    let inside = top.0.join("app/leak");
    fs::create_dir_all(inside.parent().expect("parent")).expect("mkdir on the host");
    fs::copy(fixture("balanced_loop"), &inside).expect("plant a different file");
    let mut contained = Contained::start("leak_sites_nofp", &inside);
    // Symbols are read when the program is gone: still its own file, not
    // the host's at that path.
    let report = trace(&mut contained, true);
    assert_contained(&report, &contained, &inside);
    // Nothing of the planted program was read.
    let libraries = report["libraries"].to_string();
    assert!(!libraries.contains("balanced"), "{libraries}");
}
