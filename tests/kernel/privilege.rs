//! Least privilege and container selection (issue 23): memtrace run as
//! `nobody` with only the capabilities `kernel::privilege` checks for finds
//! the same exact leaks as root, as does one holding CAP_SYS_ADMIN and
//! CAP_SYS_PTRACE only (CAP_SYS_ADMIN stands for CAP_BPF and CAP_PERFMON,
//! as in the kernel); without CAP_BPF it refuses in one line naming it
//! (exit 4); `--container` and `--cgroup` trace the processes of a
//! cgroup named as a runtime names its containers, one that joins later
//! included. `memtrace doctor` names the kernel's uprobe rule (CAP_SYS_ADMIN on
//! 6.16+) as the tracer applies it.

use std::io::Read;
use std::process::{Command, Stdio};

use crate::support::{
    assert_one_clear_line, privileged, site_totals, FakeContainer, Fixture, Tracer, MEMTRACE,
};

/// A directory removed (with what it holds) on drop.
struct Removed(std::path::PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `setpriv` as `nobody` holding exactly `caps` (`bpf,perfmon,...`).
fn as_nobody(caps: &str) -> Command {
    let list: Vec<String> = caps.split(',').map(|c| format!("+{c}")).collect();
    let list = list.join(",");
    let mut command = Command::new("setpriv");
    command.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        &format!("--inh-caps={list}"),
        &format!("--ambient-caps={list}"),
    ]);
    command.arg(MEMTRACE);
    command
}

/// Runs memtrace (`command`, arguments appended) against a fresh
/// `leak_sites`, lets the fixture work once it traces, and returns the exit
/// code, stdout and stderr.
fn trace_leak_sites(mut command: Command) -> (Option<i32>, String, String) {
    // A copy nobody may read: the checkout (and its fixtures) may sit in a
    // directory only root can enter, and an unprivileged tracer then cannot
    // open the program to name its frames.
    use std::os::unix::fs::PermissionsExt;
    static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("memtrace-privilege-{}-{run}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let _removed = Removed(dir.clone());
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let program = dir.join("leak_sites");
    std::fs::copy(crate::support::fixture("leak_sites"), &program).expect("copy the fixture");
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut start = Command::new(&program);
    start.args(["30", "30"]);
    let mut fixture = Fixture::start_command(start);
    let mut child = command
        .args(["--pid", &fixture.pid.to_string()])
        .args(["--duration", "4s", "--format", "json", "--top", "500"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("memtrace starts");
    let mut stderr = child.stderr.take().expect("stderr piped");
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !String::from_utf8_lossy(&seen).contains("memtrace: tracing") {
        match stderr.read(&mut byte) {
            Ok(1) => seen.push(byte[0]),
            _ => break,
        }
    }
    if String::from_utf8_lossy(&seen).contains("memtrace: tracing") {
        fixture.go();
    }
    let _ = stderr.read_to_end(&mut seen);
    let out = child.wait_with_output().expect("memtrace ends");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&seen).to_string(),
    )
}

#[test]
fn nobody_with_the_checked_capabilities_finds_the_exact_leaks() {
    if !privileged() {
        return;
    }
    // The three named everywhere; CAP_SYS_ADMIN only where this kernel lets
    // nothing less create uprobes (then the refusal says so, in one line).
    let mut caps = "bpf,perfmon,sys_ptrace".to_string();
    let (code, stdout, stderr) = trace_leak_sites(as_nobody(&caps));
    if code == Some(4) {
        assert!(
            stderr.contains("missing CAP_SYS_ADMIN") && stderr.lines().count() == 1,
            "only CAP_SYS_ADMIN may be missing: {stderr}"
        );
        caps.push_str(",sys_admin");
    } else {
        assert_eq!(code, Some(0), "{stderr}");
        assert!(!stdout.is_empty());
    }
    let (code, stdout, stderr) = trace_leak_sites(as_nobody(&caps));
    assert_eq!(code, Some(0), "memtrace as nobody with {caps}: {stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100), "leak_a");
    assert_eq!(site_totals(&report, "leak_b"), (10000, 10), "leak_b");
    assert_eq!(site_totals(&report, "leak_calloc"), (1000, 5));
    assert_eq!(site_totals(&report, "leak_mmap"), (131072, 2));
    assert_eq!(report["events"]["lost"], 0);
    // Root in a container: uid 0 with every capability dropped but these.
    let root_caps: Vec<String> = caps.split(',').map(|c| format!("+{c}")).collect();
    let root_caps = format!("-all,{}", root_caps.join(","));
    let mut command = Command::new("setpriv");
    command
        .arg(format!("--inh-caps={root_caps}"))
        .arg(format!("--ambient-caps={root_caps}"))
        .arg(format!("--bounding-set={root_caps}"))
        .arg(MEMTRACE);
    let (code, stdout, stderr) = trace_leak_sites(command);
    assert_eq!(code, Some(0), "root holding only {caps}: {stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(
        site_totals(&report, "leak_a"),
        (4800, 100),
        "leak_a as root"
    );
}

/// What Docker 20.10 can grant (it knows CAP_BPF and CAP_PERFMON by no
/// name): CAP_SYS_ADMIN stands for both, as in the kernel.
#[test]
fn nobody_with_cap_sys_admin_and_cap_sys_ptrace_finds_the_exact_leaks() {
    if !privileged() {
        return;
    }
    let (code, stdout, stderr) = trace_leak_sites(as_nobody("sys_admin,sys_ptrace"));
    assert_eq!(code, Some(0), "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100), "leak_a");
    assert_eq!(site_totals(&report, "leak_b"), (10000, 10), "leak_b");
}

#[test]
fn without_cap_bpf_one_line_names_it_and_exit_4() {
    if !privileged() {
        return;
    }
    // Without CAP_SYS_ADMIN, which would stand for CAP_BPF.
    let out = as_nobody("perfmon,sys_ptrace")
        .args(["--pid", "1", "--duration", "1s"])
        .output()
        .expect("setpriv runs");
    assert_one_clear_line(&out, 4, "missing CAP_BPF");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // CAP_SYS_ADMIN too where this kernel lets only it create uprobes.
    assert!(
        stderr.contains("missing CAP_BPF (") || stderr.contains("missing CAP_BPF, CAP_SYS_ADMIN ("),
        "only the missing ones: {stderr}"
    );
    // Root without capabilities (a container's root) is refused the same way.
    let out = Command::new("setpriv")
        .args(["--inh-caps=-all", "--bounding-set=-all", MEMTRACE])
        .args(["--pid", "1", "--duration", "1s"])
        .output()
        .expect("setpriv runs");
    assert_one_clear_line(&out, 4, "missing CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE");
}

#[test]
fn container_prefix_traces_its_processes_and_one_that_joins_later() {
    if !privileged() {
        return;
    }
    let Some(container) = FakeContainer::create(0) else {
        eprintln!("SKIPPED: no writable v1 pids hierarchy at /sys/fs/cgroup/pids");
        return;
    };
    // Docker's state names the container (`docker run --name`).
    let state = std::path::PathBuf::from("/var/lib/docker/containers").join(&container.id);
    let made_docker = !std::path::Path::new("/var/lib/docker").exists();
    std::fs::create_dir_all(&state).expect("docker state directory");
    std::fs::write(
        state.join("config.v2.json"),
        format!(
            r#"{{"ID":"{}","Name":"/memtrace-test-web","Driver":"overlay2"}}"#,
            container.id
        ),
    )
    .expect("config.v2.json");
    let _state = Removed(if made_docker {
        std::path::PathBuf::from("/var/lib/docker")
    } else {
        state
    });
    let mut first = Fixture::start("leak_sites", &["30", "30"]);
    container.enter(first.pid);
    let prefix = &container.id[..12];
    let mut tracer = Tracer::attach(&["--container", prefix, "--format", "json", "--top", "500"]);
    let mut second = Fixture::start("leak_sites", &["30", "30"]);
    container.enter(second.pid);
    tracer.wait_for_stderr(&format!("too: it is in container {prefix}"));
    first.go();
    second.go();
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    assert_eq!(
        report["target"]["container_id"],
        container.id.as_str(),
        "{stderr}"
    );
    assert_eq!(report["target"]["container_runtime"], "docker");
    assert_eq!(report["target"]["container_name"], "memtrace-test-web");
    let pids: Vec<u64> = report["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["pid"].as_u64())
        .collect();
    assert!(pids.contains(&u64::from(first.pid)) && pids.contains(&u64::from(second.pid)));
    // Both processes' leaks, merged by call path.
    assert_eq!(site_totals(&report, "leak_a"), (9600, 200), "{stderr}");
    assert!(report["notes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str())
        .any(|n| n.starts_with(&format!("traced 2 processes in container {prefix}"))));
}

#[test]
fn cgroup_line_traces_that_cgroup_and_no_match_is_exit_2() {
    if !privileged() {
        return;
    }
    let Some(container) = FakeContainer::create(0) else {
        eprintln!("SKIPPED: no writable v1 pids hierarchy at /sys/fs/cgroup/pids");
        return;
    };
    let mut fixture = Fixture::start("leak_sites", &["30", "30"]);
    container.enter(fixture.pid);
    // The line exactly as /proc/PID/cgroup shows it.
    let line = std::fs::read_to_string(format!("/proc/{}/cgroup", fixture.pid))
        .expect("cgroup")
        .lines()
        .find(|l| l.contains(":pids:"))
        .expect("pids line")
        .to_string();
    let tracer = Tracer::attach(&["--cgroup", &line, "--format", "json", "--top", "500"]);
    fixture.go();
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    assert_eq!(report["target"]["pid"], fixture.pid, "{stderr}");
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100), "{stderr}");
    // Nothing there: one line, exit 2; an ambiguous container prefix too.
    let out = crate::support::memtrace(&["--cgroup", "/memtrace-no-such.slice"]);
    assert_one_clear_line(
        &out,
        2,
        "--cgroup /memtrace-no-such.slice: no running process",
    );
    let out = crate::support::memtrace(&["--container", "ffffffffffffffff0"]);
    assert_one_clear_line(&out, 2, "no running process is in a container");
}

#[test]
fn doctor_names_the_uprobe_rule_the_tracer_applies() {
    if !privileged() {
        return;
    }
    let doctor = |drop_admin: bool, format: &str| -> std::process::Output {
        let mut command = Command::new("setpriv");
        if drop_admin {
            command.arg("--bounding-set=-sys_admin");
        }
        command
            .args([MEMTRACE, "doctor", "--format", format])
            .output()
            .expect("setpriv runs")
    };
    let rule_of = |out: &std::process::Output| -> Option<bool> {
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor JSON");
        json["privileges"]["uprobes_need_sys_admin"].as_bool()
    };
    // Root asks from a thread without CAP_SYS_ADMIN: the same answer as a
    // process that lacks it.
    let rule = rule_of(&doctor(true, "json")).expect("probed: CAP_PERFMON is held");
    assert_eq!(rule_of(&doctor(false, "json")), Some(rule));
    let text = String::from_utf8_lossy(&doctor(true, "text").stdout).to_string();
    let blocked = text.contains("cannot trace: missing CAP_SYS_ADMIN");
    if rule {
        assert!(
            text.contains("uprobes     CAP_SYS_ADMIN needed") && text.contains("6.16"),
            "{text}"
        );
    } else {
        assert!(text.contains("uprobes     CAP_PERFMON is enough"), "{text}");
    }
    assert_eq!(blocked, rule, "{text}");
    // The tracer agrees with what doctor said.
    let out = Command::new("setpriv")
        .args(["--bounding-set=-sys_admin", MEMTRACE])
        .args(["--duration", "1s", "--format", "json", "--", "/bin/true"])
        .stdin(Stdio::null())
        .output()
        .expect("setpriv runs");
    if rule {
        assert_one_clear_line(&out, 4, "missing CAP_SYS_ADMIN");
    } else {
        assert!(out.status.success(), "{out:?}");
    }
}
