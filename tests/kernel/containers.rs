//! Containers: a no-frame-pointer leaking program in its own mount and pid
//! namespaces, `pivot_root`ed into a root file system holding it and the
//! libraries it links, traced from the host by its host pid. Its files are
//! read as it sees them (symbols, unwind tables, probes), never the host's
//! file at the same path; the report shows its pid inside the namespace.
//! Its `--record` replayed once the program and its root are gone is the
//! live report frame by frame (the symbols travel in the record).
//! Debian's python3.11 at a prefix the host lacks, its standard library and
//! /usr bind-mounted into the container's root: its leak at its Python
//! lines, its own native frames named from its file as on the host, and so
//! in its record replayed once the root is gone (as the leaking program's).
//! `--follow-forks` in a container: children and grandchildren started in
//! its pid namespace traced exactly, each with its host and namespace pid.
//! A pod's container in a cgroup v2 hierarchy named as the systemd driver
//! and containerd name it, selected by `--cgroup` (memtrace in its own mount
//! namespace, the host's files under `MEMTRACE_HOST_ROOT`) and by
//! `--container`: exact bytes, pod name, namespace and container name from
//! the kubelet's files; and by `--pod NAMESPACE/NAME` and `--pod NAME`, a
//! process that joins the pod after the start found too.

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

/// Held while a file is open for writing and while a contained program is
/// forked: a fork of another test's thread would otherwise inherit the
/// writer of a program being copied, and its exec fail with ETXTBSY.
static FILES: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Copies `from` to `root` + `inside`, creating directories.
fn place(root: &Path, inside: &Path, from: &Path) {
    let to = root.join(inside.strip_prefix("/").unwrap_or(inside));
    fs::create_dir_all(to.parent().expect("a parent")).expect("mkdir");
    let _files = FILES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
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
        let dir = Contained::new_dir();
        let root = dir.0.join("root");
        let program = fixture(name);
        place(&root, inside, &program);
        for (loaded, real) in linked_files(&program) {
            place(&root, &loaded, &real);
        }
        Contained::spawn(dir, inside, &["30", "30"], &[])
    }

    /// A fresh directory for a root file system (`root` under it).
    fn new_dir() -> Removed {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = Removed(std::env::temp_dir().join(format!(
            "memtrace-container-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        )));
        let _ = fs::remove_dir_all(&dir.0);
        dir
    }

    /// Starts `program` (a path inside the root `dir`/root) with `args` as
    /// pid 1 of new mount and pid namespaces; `binds` (host directory, path
    /// inside the root) are bind-mounted in the new mount namespace only.
    fn spawn(dir: Removed, program: &Path, args: &[&str], binds: &[(&str, &str)]) -> Contained {
        let root = dir.0.join("root");
        fs::create_dir_all(root.join("old")).expect("mkdir old");
        let root_c = std::ffi::CString::new(root.as_os_str().as_encoded_bytes()).expect("path");
        let binds: Vec<(std::ffi::CString, std::ffi::CString)> = binds
            .iter()
            .map(|(host, inside)| {
                let target = root.join(inside.trim_start_matches('/'));
                fs::create_dir_all(&target).expect("bind target");
                (
                    std::ffi::CString::new(*host).expect("path"),
                    std::ffi::CString::new(target.as_os_str().as_encoded_bytes()).expect("path"),
                )
            })
            .collect();
        let mut command = Command::new(program);
        command
            .args(args)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: the closure runs in the forked child before exec and only
        // makes raw system calls (unshare, fork, waitpid, close_range,
        // mount, chdir, pivot_root, umount2, _exit) on pointers to
        // NUL-terminated strings that live until after the spawn.
        unsafe {
            command.pre_exec(move || enter(&root_c, &binds));
        }
        let spawned = {
            let _files = FILES
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            command.spawn()
        };
        let mut waiter = spawned.expect("the contained program starts");
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
            .unwrap_or_else(|| panic!("contained {} said {line:?}", program.display()));
        let children = format!("/proc/{0}/task/{0}/children", contained.waiter.id());
        contained.host_pid = fs::read_to_string(&children)
            .ok()
            .and_then(|text| text.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no child of the waiter in {children}"));
        contained
    }

    /// Sends one line to the program.
    fn send(&mut self) {
        let stdin = self.waiter.stdin.as_mut().expect("stdin piped");
        stdin.write_all(b"\n").expect("line");
        stdin.flush().expect("flush");
    }

    /// Reads the program's output until a line starting with `prefix`;
    /// returns the rest of it.
    fn line_starting(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).expect("program output");
            assert!(n > 0, "exited before a `{prefix}` line");
            if let Some(rest) = line.trim().strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
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
fn enter(
    root: &std::ffi::CStr,
    binds: &[(std::ffi::CString, std::ffi::CString)],
) -> std::io::Result<()> {
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
        for (host, inside) in binds {
            check(libc::mount(
                host.as_ptr(),
                inside.as_ptr(),
                none,
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            ))?;
        }
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

/// Traces the contained program by its host pid, with `extra` arguments;
/// returns the JSON report. `exit`: the program is killed after its work,
/// so memtrace reads its files only after it is gone (the report comes
/// when it exits).
fn trace(contained: &mut Contained, exit: bool, extra: &[&str]) -> Value {
    let pid = contained.host_pid.to_string();
    let mut args = vec!["--pid", &pid, "--format", "json", "--top", "500"];
    args.extend_from_slice(extra);
    let tracer = Tracer::attach(&args);
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
    let report = trace(&mut contained, false, &[]);
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
    let report = trace(&mut contained, true, &[]);
    assert_contained(&report, &contained, &inside);
    // Nothing of the planted program was read.
    let libraries = report["libraries"].to_string();
    assert!(!libraries.contains("balanced"), "{libraries}");
}

/// A record of a contained program replayed after the program and its
/// root file system are gone: the report is the live one, every site frame
/// by frame, its own frames named from the record. The same record without
/// its symbols (as memtrace wrote it before format 3) is symbolized from
/// this host's files, which lack the program: its frames go unnamed, and
/// the report says where they were looked up.
#[test]
fn a_record_of_a_contained_program_replays_as_the_live_trace_once_its_files_are_gone() {
    if !privileged() {
        return;
    }
    let inside = PathBuf::from(format!(
        "/memtrace-ct-record-{}/app/leak",
        std::process::id()
    ));
    assert!(!inside.exists());
    let dir = Contained::new_dir();
    fs::create_dir_all(&dir.0).expect("mkdir");
    let record = dir.0.join("trace.jsonl");
    let record_arg = record.to_str().expect("utf-8 path");
    let mut contained = Contained::start("leak_sites_nofp", &inside);
    let live = trace(&mut contained, false, &["--record", record_arg]);
    assert_contained(&live, &contained, &inside);
    // The program, its libraries and its root go.
    drop(contained);
    let report = |file: &str| {
        crate::support::run_json(&["report", file, "--format", "json", "--top", "500"])
    };
    let replayed = report(record_arg);
    assert_eq!(
        replayed["sites"], live["sites"],
        "every site, frame by frame"
    );
    assert_eq!(replayed["totals"], live["totals"]);
    assert_eq!(replayed["notes"], live["notes"]);
    assert_eq!(
        symbols(sites_of(&replayed, "leak_a")[0]).get(..2),
        Some(&["leak_a".to_string(), "main".to_string()][..])
    );
    // As an older record: no symbols carried.
    let text = fs::read_to_string(&record).expect("the record");
    assert!(text.starts_with(r#"{"type":"header","format":"memtrace-record/3""#));
    let older: String = text
        .lines()
        .filter(|line| {
            !line.starts_with(r#"{"type":"object""#) && !line.starts_with(r#"{"type":"sym""#)
        })
        .map(|line| line.replace("memtrace-record/3", "memtrace-record/2") + "\n")
        .collect();
    let older_path = dir.0.join("older.jsonl");
    fs::write(&older_path, older).expect("write");
    let old = report(older_path.to_str().expect("utf-8 path"));
    assert_eq!(old["totals"], live["totals"]);
    let own_frames: Vec<&Value> = old["sites"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|site| site["frames"].as_array().into_iter().flatten())
        .filter(|frame| frame["module"].as_str() == inside.to_str())
        .collect();
    assert!(!own_frames.is_empty(), "{}", old["sites"]);
    assert!(
        own_frames.iter().all(|frame| frame["symbol"].is_null()),
        "the host has no file at the program's path: {own_frames:?}"
    );
    let notes = old["notes"].to_string();
    assert!(
        notes.contains("were symbolized from this host's files")
            && notes.contains(inside.to_str().expect("utf-8")),
        "{notes}"
    );
}

/// The native frames of a site as (symbol, module), innermost first.
fn native_frames(site: &Value) -> Vec<(String, String)> {
    site["frames"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["kind"] == "native")
        .map(|f| {
            (
                f["symbol"].as_str().unwrap_or("??").to_string(),
                f["module"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// The one site whose innermost Python frame is `render` (leaky.py).
fn render_site(report: &Value) -> &Value {
    let sites = crate::python::sites_in(report, "render");
    assert_eq!(sites.len(), 1, "one render site: {}", report["sites"]);
    sites[0]
}

#[test]
fn python_in_a_container_gets_its_lines_and_its_own_native_frames() {
    if !privileged() {
        return;
    }
    let python = Path::new("/usr/bin/python3.11");
    assert!(
        python.exists(),
        "Debian's python3.11 is required (apt-get install python3.11)"
    );
    // Debian's python3.11 (static libpython) at a prefix the host does not
    // have, its standard library bind-mounted beside it, /usr (libc,
    // libffi, ld.so) bind-mounted from the host, as an image would hold it.
    let prefix = PathBuf::from(format!("/opt/memtrace-py-{}", std::process::id()));
    assert!(!prefix.exists());
    let dir = Contained::new_dir();
    let root = dir.0.join("root");
    let inside = prefix.join("bin/python3.11");
    place(&root, &inside, python);
    place(
        &root,
        Path::new("/app/leaky.py"),
        &crate::python::script_named("leaky.py"),
    );
    for (link, to) in [
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
        ("bin", "usr/bin"),
    ] {
        std::os::unix::fs::symlink(to, root.join(link)).expect("symlink");
    }
    let stdlib = prefix.join("lib/python3.11");
    let binds = [
        ("/usr", "/usr"),
        ("/usr/lib/python3.11", stdlib.to_str().expect("path")),
    ];
    let recorded = Contained::new_dir();
    fs::create_dir_all(&recorded.0).expect("mkdir");
    let record = recorded.0.join("trace.jsonl");
    let record_arg = record.to_str().expect("utf-8 path");
    let mut contained = Contained::spawn(dir, &inside, &["/app/leaky.py", "30"], &binds);
    let report = trace(&mut contained, false, &["--record", record_arg]);
    assert_eq!(report["target"]["ns_pid"], 1);
    assert_eq!(report["target"]["pid"], u64::from(contained.host_pid));
    let found = &report["python"][0];
    assert_eq!(found["frames_read"], true, "{found}");
    assert!(
        found["version"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.11")),
        "{found}"
    );
    // The leak at its Python lines.
    let site = render_site(&report);
    assert_eq!(
        crate::python::py_frames(site),
        vec![
            crate::python::expect("render", "render"),
            crate::python::expect("handle", "handle"),
            crate::python::expect("<module>", "module_handle"),
        ]
    );
    assert_eq!(site["live_count"], 10, "{site}");
    assert_eq!(site["live_bytes"], 10 * 100_001, "{site}");
    // The interpreter's own native frames are named from the container's
    // file, exactly as the same interpreter's are on the host.
    let contained_native = native_frames(site);
    let own: Vec<&(String, String)> = contained_native
        .iter()
        .filter(|(_, module)| Path::new(module) == inside)
        .collect();
    assert!(
        !own.is_empty(),
        "frames of the container's python3.11: {contained_native:?}"
    );
    assert!(
        own.iter().any(|(symbol, _)| symbol != "??"),
        "named, not ??: {contained_native:?}"
    );
    drop(contained);
    // Replayed once the container's root is gone: its interpreter's
    // frames named from the record, the Python frames where they were.
    let replayed =
        crate::support::run_json(&["report", record_arg, "--format", "json", "--top", "500"]);
    assert_eq!(
        render_site(&replayed),
        site,
        "the replayed site is the live one"
    );
    let host = crate::python::trace_by_pid(&python.to_path_buf());
    let symbols = |frames: Vec<(String, String)>| -> Vec<String> {
        frames.into_iter().map(|(symbol, _)| symbol).collect()
    };
    assert_eq!(
        symbols(contained_native),
        symbols(native_frames(render_site(&host))),
        "the container's native frames as the host's"
    );
    assert_eq!(report["stack_truncations_by_cause"]["no_table"], 0);
}

#[test]
fn follow_forks_in_a_container_traces_its_children_exactly() {
    if !privileged() {
        return;
    }
    let inside = PathBuf::from(format!(
        "/memtrace-ct-forks-{}/app/fork_leaks",
        std::process::id()
    ));
    let dir = Contained::new_dir();
    let root = dir.0.join("root");
    let program = fixture("fork_leaks");
    place(&root, &inside, &program);
    for (loaded, real) in linked_files(&program) {
        place(&root, &loaded, &real);
    }
    let mut family = Contained::spawn(dir, &inside, &["60", "30"], &[]);
    let parent = family.host_pid;
    let pid = parent.to_string();
    let mut tracer = Tracer::attach(&[
        "--pid",
        &pid,
        "--follow-forks",
        "--format",
        "json",
        "--top",
        "500",
    ]);
    family.send();
    let child_ns: u32 = family.line_starting("child ").parse().expect("ns pid");
    let child = host_child_of(parent);
    tracer.wait_for_stderr(&format!("following child pid {child} of pid {parent}"));
    family.send();
    let grandchild_ns: u32 = family.line_starting("grandchild ").parse().expect("ns pid");
    let grandchild = host_child_of(child);
    tracer.wait_for_stderr(&format!("following child pid {grandchild} of pid {child}"));
    family.send();
    family.line_starting("done");
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    // Each process's leaks, exactly, under its host pid.
    assert_eq!(site_totals(&report, "parent_leak"), (3000, 3), "{stderr}");
    assert_eq!(site_totals(&report, "child_leak"), (10000, 5));
    assert_eq!(site_totals(&report, "grandchild_leak"), (21000, 7));
    for (symbol, pid) in [
        ("parent_leak", parent),
        ("child_leak", child),
        ("grandchild_leak", grandchild),
    ] {
        let sites = sites_of(&report, symbol);
        assert_eq!(sites.len(), 1, "{symbol}");
        assert_eq!(sites[0]["pids"], serde_json::json!([pid]), "{symbol}");
        // Named from the container's file, down to main.
        let frames = symbols(sites[0]);
        assert!(frames.contains(&"main".to_string()), "{symbol}: {frames:?}");
    }
    // Both pids of each process: the host's and the namespace's.
    let process = |pid: u32| -> &Value {
        report["processes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["pid"].as_u64() == Some(u64::from(pid)))
            .unwrap_or_else(|| panic!("pid {pid} not in {}", report["processes"]))
    };
    assert_eq!(process(parent)["ns_pid"], 1);
    assert_eq!(process(child)["ns_pid"], child_ns);
    assert_eq!(process(grandchild)["ns_pid"], grandchild_ns);
    assert_eq!(process(child)["parent"], parent);
    assert_eq!(process(grandchild)["parent"], child);
    assert_ne!(child_ns, child);
    assert_eq!(report["events"]["lost"], 0);
}

/// The one child of host pid `pid`.
fn host_child_of(pid: u32) -> u32 {
    let path = format!("/proc/{pid}/task/{pid}/children");
    let text = fs::read_to_string(&path).unwrap_or_default();
    let children: Vec<u32> = text
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    assert_eq!(children.len(), 1, "{path}: {text:?}");
    children[0]
}

/// Where a cgroup v2 hierarchy is mounted (`/sys/fs/cgroup/unified` on a
/// hybrid host, `/sys/fs/cgroup` on a v2-only one).
fn cgroup2_mount() -> Option<PathBuf> {
    let text = fs::read_to_string("/proc/self/mountinfo").ok()?;
    text.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        if right.split_whitespace().next() != Some("cgroup2") {
            return None;
        }
        left.split_whitespace().nth(4).map(PathBuf::from)
    })
}

/// A Kubernetes pod's container as the systemd cgroup driver and containerd
/// name it, in the cgroup v2 hierarchy
/// (`/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope`),
/// and the files the kubelet leaves for it on the host
/// (`/var/log/pods/<namespace>_<pod>_<uid>/<container>/0.log`, the link
/// `/var/log/containers/<pod>_<namespace>_<container>-<id>.log`). Everything
/// made is removed on drop, processes moved back to the root cgroup first.
struct KubePod {
    v2: PathBuf,
    /// The cgroups made, outermost first.
    cgroups: Vec<PathBuf>,
    /// The container's cgroup path as `/proc/PID/cgroup` shows it.
    path: String,
    id: String,
    uid: String,
    namespace: String,
    /// The pod's name.
    name: String,
    /// Files, links and directories made on the host, removed in reverse.
    made: Vec<PathBuf>,
}

impl KubePod {
    fn create() -> Option<KubePod> {
        KubePod::create_named("web-0", 0)
    }

    /// A pod `name` (tests running at once each give their own `salt`: the
    /// uid and container id differ).
    fn create_named(name: &str, salt: u8) -> Option<KubePod> {
        let v2 = cgroup2_mount()?;
        let tag = format!("{:012x}", std::process::id());
        let uid = format!("0a1b2c{salt:02x}-4e5f-6789-abcd-{tag}");
        let id = format!("c0ffe{salt:x}{tag}").repeat(4)[..64].to_string();
        let namespace = format!("memtrace-test-{}", std::process::id());
        let path = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{id}.scope",
            uid.replace('-', "_")
        );
        let mut pod = KubePod {
            v2: v2.clone(),
            cgroups: Vec::new(),
            path: path.clone(),
            id,
            uid,
            namespace,
            name: name.to_string(),
            made: Vec::new(),
        };
        let mut dir = v2;
        for part in path.split('/').filter(|p| !p.is_empty()) {
            dir = dir.join(part);
            if !dir.exists() {
                fs::create_dir(&dir).ok()?;
                pod.cgroups.push(dir.clone());
            }
        }
        // The kubelet's files.
        for dir in ["/var/log/pods", "/var/log/containers"] {
            let dir = PathBuf::from(dir);
            if !dir.exists() {
                fs::create_dir_all(&dir).expect("kubelet log directory");
                pod.made.push(dir);
            }
        }
        let pod_dir = PathBuf::from(format!(
            "/var/log/pods/{}_{}_{}",
            pod.namespace, pod.name, pod.uid
        ));
        fs::create_dir_all(pod_dir.join("app")).expect("pod log directory");
        pod.made.push(pod_dir.clone());
        fs::write(pod_dir.join("app/0.log"), "").expect("container log");
        let link = PathBuf::from(format!(
            "/var/log/containers/{}_{}_app-{}.log",
            pod.name, pod.namespace, pod.id
        ));
        std::os::unix::fs::symlink(pod_dir.join("app/0.log"), &link).expect("log link");
        pod.made.push(link);
        Some(pod)
    }

    fn enter(&self, pid: u32) {
        let scope = self.cgroups.last().expect("the container's cgroup");
        fs::write(scope.join("cgroup.procs"), pid.to_string()).expect("join the cgroup");
    }
}

impl Drop for KubePod {
    fn drop(&mut self) {
        for dir in self.cgroups.iter().rev() {
            if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
                for pid in procs.lines() {
                    let _ = fs::write(self.v2.join("cgroup.procs"), pid);
                }
            }
            let _ = fs::remove_dir(dir);
        }
        for path in self.made.iter().rev() {
            if path.is_symlink() || path.is_file() {
                let _ = fs::remove_file(path);
            } else {
                let _ = fs::remove_dir_all(path);
            }
        }
    }
}

#[test]
fn a_pod_in_cgroup_v2_is_named_from_the_kubelets_files_on_the_host() {
    if !privileged() {
        return;
    }
    let Some(pod) = KubePod::create() else {
        eprintln!("SKIPPED: no writable cgroup v2 hierarchy");
        return;
    };
    let mut first = crate::support::Fixture::start("leak_sites", &["30", "30"]);
    pod.enter(first.pid);
    let line = format!("0::{}", pod.path);
    let cgroup = fs::read_to_string(format!("/proc/{}/cgroup", first.pid)).expect("cgroup");
    assert!(cgroup.lines().any(|l| l == line), "{cgroup}");
    // memtrace in a mount namespace of its own whose /var/log is empty, as
    // in a DaemonSet's container, the host's /var/log mounted under
    // MEMTRACE_HOST_ROOT (as agents mount the host's / at /host).
    let host =
        Removed(std::env::temp_dir().join(format!("memtrace-host-root-{}", std::process::id())));
    fs::create_dir_all(host.0.join("var/log")).expect("host root");
    let mut command = Command::new("unshare");
    command.env("MEMTRACE_HOST_ROOT", &host.0).args([
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        "mount --bind /var/log \"$MEMTRACE_HOST_ROOT/var/log\" && mount -t tmpfs memtrace-test /var/log && exec \"$0\" \"$@\"",
        crate::support::MEMTRACE,
        "--cgroup",
        &line,
        "--format",
        "json",
        "--top",
        "500",
    ]);
    let tracer = Tracer::attach_command(command);
    first.go();
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100), "{stderr}");
    let target = &report["target"];
    assert_eq!(target["pid"], first.pid, "{stderr}");
    assert_eq!(target["cgroup"], pod.path.as_str());
    assert_eq!(target["container_id"], pod.id.as_str());
    assert_eq!(target["container_runtime"], "containerd");
    assert_eq!(target["pod_uid"], pod.uid.as_str());
    assert_eq!(target["pod_name"], "web-0", "{target}");
    assert_eq!(target["pod_namespace"], pod.namespace.as_str());
    assert_eq!(target["container_name"], "app");
    assert_eq!(report["processes"][0]["pod_name"], "web-0");
    // By container id prefix, memtrace in the host's mount namespace: the
    // same names, read from the host's own /var/log.
    drop(first);
    let mut second = crate::support::Fixture::start("leak_sites", &["30", "30"]);
    pod.enter(second.pid);
    let tracer = Tracer::attach(&[
        "--container",
        &pod.id[..12],
        "--format",
        "json",
        "--top",
        "500",
    ]);
    second.go();
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100), "{stderr}");
    let target = &report["target"];
    assert_eq!(target["pid"], second.pid, "{stderr}");
    assert_eq!(target["container_id"], pod.id.as_str());
    assert_eq!(
        (
            &target["pod_namespace"],
            &target["pod_name"],
            &target["container_name"]
        ),
        (
            &Value::from(pod.namespace.as_str()),
            &Value::from("web-0"),
            &Value::from("app")
        ),
        "{target}"
    );
}

#[test]
fn a_pod_is_selected_by_namespace_and_name_and_later_processes_join() {
    if !privileged() {
        return;
    }
    let Some(pod) = KubePod::create_named("api-1", 1) else {
        eprintln!("SKIPPED: no writable cgroup v2 hierarchy");
        return;
    };
    let given = format!("{}/{}", pod.namespace, pod.name);
    let mut first = crate::support::Fixture::start("leak_sites", &["30", "30"]);
    pod.enter(first.pid);
    let mut tracer = Tracer::attach(&["--pod", &given, "--format", "json", "--top", "500"]);
    // A process that joins the pod after the start is found by the poll.
    let mut second = crate::support::Fixture::start("leak_sites", &["30", "30"]);
    pod.enter(second.pid);
    tracer.wait_for_stderr(&format!("too: it is in pod {given}"));
    first.go();
    second.go();
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    // Both processes' leaks, merged by call path.
    assert_eq!(site_totals(&report, "leak_a"), (9600, 200), "{stderr}");
    let target = &report["target"];
    assert_eq!(target["pid"], first.pid, "{stderr}");
    let processes: Vec<&Value> = report["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    let pids: Vec<u64> = processes.iter().filter_map(|p| p["pid"].as_u64()).collect();
    assert!(
        pids.contains(&u64::from(first.pid)) && pids.contains(&u64::from(second.pid)),
        "{pids:?}"
    );
    for process in &processes {
        assert_eq!(process["pod_name"], pod.name.as_str(), "{process}");
        assert_eq!(
            process["pod_namespace"],
            pod.namespace.as_str(),
            "{process}"
        );
        assert_eq!(process["container_name"], "app", "{process}");
    }
    // NAME alone, no other namespace having such a pod: the same pod.
    drop((first, second));
    let mut third = crate::support::Fixture::start("leak_sites", &["30", "30"]);
    pod.enter(third.pid);
    let tracer = Tracer::attach(&["--pod", &pod.name, "--format", "json", "--top", "500"]);
    third.go();
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100), "{stderr}");
    assert_eq!(report["target"]["pid"], third.pid, "{stderr}");
    assert_eq!(
        report["processes"][0]["pod_namespace"],
        pod.namespace.as_str()
    );
    // A pod not on this node, and a namespace without it: one line, exit 2.
    for missing in [
        format!("{}/memtrace-no-such-pod", pod.namespace),
        format!("memtrace-no-such-namespace/{}", pod.name),
    ] {
        let out = crate::support::memtrace(&["--pod", &missing]);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("--pod {missing}: no such pod on this node")),
            "{stderr}"
        );
    }
}
