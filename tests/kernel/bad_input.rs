//! Bad input gets one clear line on stderr and a documented non-zero exit,
//! never a panic or a backtrace. That includes a kernel lacking a feature
//! memtrace needs, simulated by running memtrace under the `deny_syscall`
//! fixture (a seccomp filter that fails chosen system calls with a chosen errno).

use std::process::Command;

use crate::support::{assert_one_clear_line, fixture, memtrace, privileged, Fixture, MEMTRACE};

#[test]
fn nonexistent_pid_is_a_usage_error() {
    if !privileged() {
        return;
    }
    assert_one_clear_line(&memtrace(&["--pid", "999999999"]), 2, "no such process");
}

#[test]
fn kernel_thread_is_refused() {
    if !privileged() {
        return;
    }
    // kthreadd is pid 2 on Linux.
    assert_one_clear_line(&memtrace(&["--pid", "2"]), 2, "kernel thread");
}

#[test]
fn unparsable_duration_is_a_usage_error() {
    let out = memtrace(&["--pid", "1", "--duration", "soon"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid duration"));
}

#[test]
fn nothing_to_trace_is_a_usage_error() {
    assert_one_clear_line(&memtrace(&[]), 2, "nothing to trace");
}

#[test]
fn missing_command_is_a_usage_error() {
    if !privileged() {
        return;
    }
    assert_one_clear_line(&memtrace(&["--", "/no/such/program"]), 2, "cannot run");
}

#[test]
fn unwritable_output_is_refused_before_attaching() {
    if !privileged() {
        return;
    }
    let out = memtrace(&[
        "--pid",
        &std::process::id().to_string(),
        "--output",
        "/proc/version/report.json",
    ]);
    assert_one_clear_line(&out, 2, "cannot write");
}

#[test]
fn running_without_privilege_says_so() {
    if !privileged() {
        return;
    }
    // Drop to `nobody` for this one run.
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(MEMTRACE)
        .args(["--pid", &std::process::id().to_string(), "--duration", "1s"])
        .output()
        .expect("setpriv runs");
    assert_one_clear_line(&out, 4, "permission denied");
}

/// Runs memtrace under `deny_syscall RULES` against a fixture waiting for its
/// go line, asserts exit `code` with exactly one stderr line containing
/// `needle`, then lets the fixture work and asserts it finishes normally.
fn assert_kernel_lacks(rules: &str, code: i32, needle: &str) {
    assert_kernel_lacks_with(rules, &[], code, needle);
}

/// [`assert_kernel_lacks`] with more memtrace arguments.
fn assert_kernel_lacks_with(rules: &str, extra: &[&str], code: i32, needle: &str) {
    let mut target = Fixture::start("leak_sites", &["60", "0"]);
    let pid = target.pid.to_string();
    let out = Command::new(fixture("deny_syscall"))
        .args([rules, "--", MEMTRACE, "--pid", &pid, "--duration", "5s"])
        .args(extra)
        .output()
        .expect("deny_syscall runs");
    assert_one_clear_line(&out, code, needle);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "exactly one line: {stderr}");
    assert!(stderr.starts_with("memtrace: "), "{stderr}");
    // The target is unharmed: it does its work and exits 0.
    target.go();
    let status = target.child.wait().expect("target waited for");
    assert!(status.success(), "target after the refusal: {status}");
}

#[test]
fn kernel_without_bpf_syscall_is_one_clear_line() {
    if !privileged() {
        return;
    }
    assert_kernel_lacks(
        "321:ENOSYS",
        1,
        "this kernel does not support BPF (bpf syscall: ENOSYS; needs CONFIG_BPF_SYSCALL)",
    );
}

#[test]
fn kernel_without_uprobe_events_is_one_clear_line_and_the_target_is_unharmed() {
    if !privileged() {
        return;
    }
    // Uprobe perf events only: a kernel with uprobe_multi links (6.6+)
    // traces through them without perf_event_open.
    for errno in ["ENOENT", "EOPNOTSUPP"] {
        assert_kernel_lacks_with(
            &format!("298:{errno}"),
            &["--attach", "perf"],
            1,
            &format!(
                "this kernel cannot create uprobes (perf_event_open: {errno}; needs CONFIG_UPROBE_EVENTS)"
            ),
        );
    }
}

#[test]
fn kernel_without_perf_events_is_one_clear_line() {
    if !privileged() {
        return;
    }
    assert_kernel_lacks_with(
        "298:ENOSYS",
        &["--attach", "perf"],
        1,
        "this kernel does not support perf events (perf_event_open: ENOSYS; needs CONFIG_PERF_EVENTS)",
    );
}

#[test]
fn kernel_without_attach_cookies_is_one_clear_line() {
    if !privileged() {
        return;
    }
    // bpf(BPF_LINK_CREATE) fails: no BPF perf links, so no attach cookies.
    assert_kernel_lacks(
        "321/28:EINVAL",
        1,
        "this kernel does not support BPF attach cookies on uprobes",
    );
}

#[test]
fn kernel_without_global_data_is_one_clear_line() {
    if !privileged() {
        return;
    }
    // bpf(BPF_PROG_LOAD) fails: aya's feature probes find no global data.
    assert_kernel_lacks(
        "321/5:EINVAL",
        1,
        "this kernel does not support BPF global data",
    );
}

#[test]
fn refused_bpf_map_creation_is_one_clear_line() {
    if !privileged() {
        return;
    }
    // bpf(BPF_MAP_CREATE) fails for every map; which one aya creates first
    // varies, so only the subject is checked.
    assert_kernel_lacks("321/0:EINVAL", 1, "map");
}

#[test]
fn bpf_refused_with_eperm_as_root_is_a_privilege_failure() {
    if !privileged() {
        return;
    }
    // What a lockdown LSM or a BPF-denying policy does to root.
    assert_kernel_lacks("321:EPERM", 4, "permission denied loading eBPF programs");
}
