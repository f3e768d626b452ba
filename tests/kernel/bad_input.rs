//! Bad input gets one clear line on stderr and a documented non-zero exit,
//! never a panic or a backtrace.

use std::process::Command;

use crate::support::{assert_one_clear_line, memtrace, privileged, MEMTRACE};

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
