//! The verifier's refusal of a program, in one line.
//!
//! A refused program comes back with the verifier's whole log (thousands of
//! lines: every instruction of the path it walked). The user needs the limit
//! it hit, which the last lines name; [`classify`] reads them into a
//! [`Reason`] (pure, tested with real log tails), [`save_log`] keeps the whole
//! log in a private file, and [`one_line`] says which program, why, what to
//! try, and where the log is.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The verifier's limit on instructions processed per program.
pub const INSN_LIMIT: u64 = 1_000_000;
/// The verifier's limit on a call chain's combined stack.
pub const STACK_LIMIT: u64 = 512;

/// What the verifier refused, as far as its log says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// "combined stack size of N calls is B. Too large"
    CombinedStack { calls: u32, bytes: u64 },
    /// "BPF program is too large. Processed N insn"
    TooLarge { processed: u64 },
    /// "BPF_STX uses reserved fields" / "BPF_XADD uses reserved fields": an
    /// atomic instruction with fetch on a kernel before 5.12.
    NoAtomics { message: String },
    /// "unknown func NAME#ID" / "invalid func NAME#ID" / "program of this type
    /// cannot use helper NAME#ID".
    UnknownHelper { name: String, id: Option<u32> },
    /// "The sequence of N jumps is too complex."
    TooComplex { jumps: u64 },
    /// Anything else: the verifier's own last words.
    Other { line: String },
    /// An empty log (refused before the verifier ran).
    Empty,
}

impl Reason {
    /// The one-line description.
    pub fn describe(&self) -> String {
        match self {
            Reason::CombinedStack { calls, bytes } => {
                format!("combined stack size of {calls} calls is {bytes} B (limit {STACK_LIMIT})")
            }
            Reason::TooLarge { processed } => format!(
                "BPF program is too large: {processed} instructions processed (limit {INSN_LIMIT})"
            ),
            Reason::NoAtomics { message } => {
                format!("unknown instruction ({message}: the kernel lacks BPF atomics, 5.12+)")
            }
            Reason::UnknownHelper { name, .. } => match helper_since(name) {
                Some(since) => format!("unknown func {name} ({since}+)"),
                None => format!("unknown func {name} (the kernel lacks this helper)"),
            },
            Reason::TooComplex { jumps } => {
                format!("the sequence of {jumps} jumps is too complex (verifier state limit)")
            }
            Reason::Other { line } => format!("verifier: {line}"),
            Reason::Empty => "refused before verification (empty verifier log)".to_string(),
        }
    }

    /// Whether another stack mode may load where this one did not (limits of
    /// size and stack, which depend on the code the mode keeps).
    pub fn depends_on_mode(&self) -> bool {
        matches!(
            self,
            Reason::CombinedStack { .. } | Reason::TooLarge { .. } | Reason::TooComplex { .. }
        )
    }
}

/// The mainline release that brought a helper (the ones memtrace's programs call).
fn helper_since(name: &str) -> Option<&'static str> {
    Some(match name {
        "bpf_loop" => "5.17",
        "bpf_get_attach_cookie" => "5.15",
        "bpf_ringbuf_output"
        | "bpf_ringbuf_reserve"
        | "bpf_ringbuf_submit"
        | "bpf_ringbuf_discard"
        | "bpf_ringbuf_query" => "5.8",
        "bpf_task_storage_get" | "bpf_task_storage_delete" | "bpf_get_current_task_btf" => "5.11",
        "bpf_probe_read_user" | "bpf_probe_read_kernel" | "bpf_probe_read_user_str" => "5.5",
        "bpf_copy_from_user" => "5.10",
        "bpf_ktime_get_boot_ns" => "5.8",
        "bpf_find_vma" => "5.17",
        "bpf_get_func_ip" => "5.15",
        "bpf_ktime_get_coarse_ns" => "5.11",
        _ => return None,
    })
}

/// Lines of a log's tail that are statistics, not the refusal.
fn is_stats(line: &str) -> bool {
    line.is_empty()
        || line.starts_with("processed ")
        || line.starts_with("stack depth ")
        || line.starts_with("verification time ")
        || line.starts_with("-- END PROG LOAD LOG --")
}

/// How many lines from the end the refusal is looked for in.
const TAIL: usize = 40;

/// Reads the refusal out of a verifier log's last lines.
pub fn classify(log: &str) -> Reason {
    let tail: Vec<&str> = log
        .lines()
        .rev()
        .map(str::trim)
        .filter(|line| !is_stats(line))
        .take(TAIL)
        .collect();
    if tail.is_empty() {
        return Reason::Empty;
    }
    // Most specific first, newest line first within each.
    for line in &tail {
        if let Some(reason) = combined_stack(line) {
            return reason;
        }
    }
    for line in &tail {
        if let Some(rest) = line.strip_prefix("BPF program is too large. Processed ") {
            if let Some(processed) = leading_number(rest) {
                return Reason::TooLarge { processed };
            }
        }
    }
    for line in &tail {
        if line.contains("uses reserved fields")
            && (line.starts_with("BPF_STX") || line.starts_with("BPF_XADD"))
        {
            return Reason::NoAtomics {
                message: line.to_string(),
            };
        }
    }
    for line in &tail {
        if let Some(reason) = unknown_helper(line) {
            return reason;
        }
    }
    for line in &tail {
        if let Some(rest) = line.strip_prefix("The sequence of ") {
            if let Some(jumps) = leading_number(rest) {
                return Reason::TooComplex { jumps };
            }
        }
    }
    Reason::Other {
        line: tail[0].to_string(),
    }
}

fn combined_stack(line: &str) -> Option<Reason> {
    let rest = line.strip_prefix("combined stack size of ")?;
    let calls = u32::try_from(leading_number(rest)?).ok()?;
    let bytes = leading_number(rest.split(" is ").nth(1)?)?;
    Some(Reason::CombinedStack { calls, bytes })
}

fn unknown_helper(line: &str) -> Option<Reason> {
    let rest = [
        "unknown func ",
        "invalid func ",
        "program of this type cannot use helper ",
    ]
    .iter()
    .find_map(|prefix| line.strip_prefix(prefix))?;
    let token = rest.split_whitespace().next()?;
    let (name, id) = match token.split_once('#') {
        Some((name, id)) => (name, id.parse().ok()),
        None => (token, None),
    };
    // Very old kernels say "invalid func unknown#181".
    let name = match (name, id) {
        ("unknown", Some(181)) => "bpf_loop",
        ("unknown", Some(174)) => "bpf_get_attach_cookie",
        ("unknown", Some(156)) => "bpf_task_storage_get",
        ("unknown", Some(131)) => "bpf_ringbuf_reserve",
        _ => name,
    };
    Some(Reason::UnknownHelper {
        name: name.to_string(),
        id,
    })
}

fn leading_number(text: &str) -> Option<u64> {
    let end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    text[..end].parse().ok()
}

/// Where a program's verifier log goes: `$XDG_RUNTIME_DIR` when set (a
/// private directory), else `/tmp`.
pub fn log_path(program: &str, pid: u32) -> PathBuf {
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|dir| dir.is_dir())
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    let safe: String = program
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!("memtrace-verifier-{safe}-{pid}.log"))
}

/// Writes `log` to `path`, created anew with mode 0600 (an old file of that
/// name is removed first, never followed).
pub fn save_log_at(path: &Path, log: &str) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(err),
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(log.as_bytes())?;
    if !log.ends_with('\n') {
        file.write_all(b"\n")?;
    }
    Ok(())
}

/// Saves a program's verifier log to [`log_path`]; the path, or `None` (and
/// a debug log line) when it cannot be written.
pub fn save_log(program: &str, log: &str) -> Option<PathBuf> {
    let path = log_path(program, std::process::id());
    match save_log_at(&path, log) {
        Ok(()) => Some(path),
        Err(err) => {
            log::debug!("cannot write the verifier log to {}: {err}", path.display());
            None
        }
    }
}

/// The line a user sees when `program` is refused: the program (and the mode
/// it was loaded in), the reason, what to try (`alternatives`: the flags that
/// load here), and where the log is.
pub fn one_line(
    program: &str,
    mode: &str,
    reason: &Reason,
    alternatives: &[&str],
    log: Option<(&Path, usize)>,
) -> String {
    let mut line = format!(
        "the kernel's verifier refused eBPF program {program} ({mode}): {}",
        reason.describe()
    );
    match alternatives {
        [] => line.push_str("; run `memtrace doctor` to see what this kernel supports"),
        [one] => line.push_str(&format!(
            "; {one} loads on this kernel (see `memtrace doctor`)"
        )),
        many => line.push_str(&format!(
            "; {} load on this kernel (see `memtrace doctor`)",
            many.join(" and ")
        )),
    }
    if let Some((path, lines)) = log {
        line.push_str(&format!(
            "; the verifier's log ({lines} lines) is in {}",
            path.display()
        ));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `call_exit` refusal's tail in the kernel's format (`check_max_stack_depth`'s
    /// message, then the BPF_LOG_STATS lines), at the size DESIGN.md records
    /// for 6.18.44 (the object was fixed before a log could be kept here).
    const COMBINED_STACK_TAIL: &str = "\
; let found = unsafe { bpf_loop(MAX_DEPTH, frame_callback as *mut c_void, ctx, 0) }; @ unwind.rs:971
3351: (85) call bpf_loop#181
combined stack size of 3 calls is 608. Too large
verification time 10412 usec
stack depth 280+0+168+112
processed 15063 insns (limit 1000000) max_states_per_insn 4 total_states 801 peak_states 801 mark_read 106
";

    /// 6.12 and 7.x, from the kernel matrix in DESIGN.md.
    const TOO_LARGE_TAIL: &str = "\
3210: (bf) r1 = r6                      ; frame1: R1_w=scalar(id=1)
3211: (07) r1 += 8
BPF program is too large. Processed 1000001 insn
processed 1000001 insns (limit 1000000) max_states_per_insn 26 total_states 41268 peak_states 7912 mark_read 412
";

    /// 5.10 (bullseye): the atomics with fetch are refused before verification.
    const NO_ATOMICS_TAIL: &str = "BPF_STX uses reserved fields\nprocessed 0 insns (limit 1000000) max_states_per_insn 0 total_states 0 peak_states 0 mark_read 0\n";

    #[test]
    fn combined_stack_is_named_with_its_size() {
        let reason = classify(COMBINED_STACK_TAIL);
        assert_eq!(
            reason,
            Reason::CombinedStack {
                calls: 3,
                bytes: 608
            }
        );
        assert_eq!(
            reason.describe(),
            "combined stack size of 3 calls is 608 B (limit 512)"
        );
        assert!(reason.depends_on_mode());
    }

    #[test]
    fn too_large_names_the_processed_count() {
        let reason = classify(TOO_LARGE_TAIL);
        assert_eq!(
            reason,
            Reason::TooLarge {
                processed: 1_000_001
            }
        );
        assert_eq!(
            reason.describe(),
            "BPF program is too large: 1000001 instructions processed (limit 1000000)"
        );
    }

    #[test]
    fn reserved_fields_mean_no_atomics() {
        let reason = classify(NO_ATOMICS_TAIL);
        assert_eq!(
            reason.describe(),
            "unknown instruction (BPF_STX uses reserved fields: the kernel lacks BPF atomics, 5.12+)"
        );
        assert!(!reason.depends_on_mode());
        assert!(matches!(
            classify("BPF_XADD uses reserved fields\n"),
            Reason::NoAtomics { .. }
        ));
    }

    #[test]
    fn unknown_helpers_are_named_with_their_release() {
        let log = "0: R1=ctx() R10=fp0\n12: (85) call bpf_loop#181\nunknown func bpf_loop#181\nprocessed 12 insns (limit 1000000)\n";
        let reason = classify(log);
        assert_eq!(
            reason,
            Reason::UnknownHelper {
                name: "bpf_loop".into(),
                id: Some(181)
            }
        );
        assert_eq!(reason.describe(), "unknown func bpf_loop (5.17+)");
        assert_eq!(
            classify("invalid func unknown#181\n").describe(),
            "unknown func bpf_loop (5.17+)"
        );
        assert_eq!(
            classify("program of this type cannot use helper bpf_get_attach_cookie#174\n")
                .describe(),
            "unknown func bpf_get_attach_cookie (5.15+)"
        );
        assert_eq!(
            classify("unknown func bpf_something_new#999\n").describe(),
            "unknown func bpf_something_new (the kernel lacks this helper)"
        );
    }

    #[test]
    fn other_refusals_keep_the_verifier_line() {
        let log = "0: (b7) r0 = 0\n1: (79) r1 = *(u64 *)(r10 -8)\ninvalid read from stack off -8+0 size 8\nprocessed 2 insns (limit 1000000) max_states_per_insn 0 total_states 0 peak_states 0 mark_read 0\n";
        assert_eq!(
            classify(log).describe(),
            "verifier: invalid read from stack off -8+0 size 8"
        );
        assert_eq!(classify(""), Reason::Empty);
        assert_eq!(classify("\nprocessed 0 insns\n"), Reason::Empty);
        assert_eq!(
            classify("The sequence of 8193 jumps is too complex.\n"),
            Reason::TooComplex { jumps: 8193 }
        );
    }

    #[test]
    fn the_line_names_program_reason_alternatives_and_log() {
        let reason = Reason::CombinedStack {
            calls: 3,
            bytes: 608,
        };
        let path = Path::new("/tmp/memtrace-verifier-call_exit-42.log");
        let line = one_line(
            "call_exit",
            "--stacks dwarf",
            &reason,
            &["--stacks fp", "--stack-depth 0"],
            Some((path, 1432)),
        );
        assert_eq!(
            line,
            "the kernel's verifier refused eBPF program call_exit (--stacks dwarf): combined stack size of 3 calls is 608 B (limit 512); --stacks fp and --stack-depth 0 load on this kernel (see `memtrace doctor`); the verifier's log (1432 lines) is in /tmp/memtrace-verifier-call_exit-42.log"
        );
        assert!(!line.contains('\n'));
        let alone = one_line("task_new", "--stack-depth 0", &reason, &[], None);
        assert!(alone.ends_with("run `memtrace doctor` to see what this kernel supports"));
    }

    #[test]
    fn logs_are_private_files() {
        use std::os::unix::fs::PermissionsExt;
        let dir =
            std::env::temp_dir().join(format!("memtrace-verifier-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("log");
        std::fs::write(&path, "old").expect("old file");
        save_log_at(&path, "line 1\nline 2").expect("written");
        let meta = std::fs::metadata(&path).expect("exists");
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::read_to_string(&path).expect("read"),
            "line 1\nline 2\n"
        );
        let _ = std::fs::remove_dir_all(&dir);
        let named = log_path("call/exit", 7);
        assert!(named
            .to_string_lossy()
            .ends_with("memtrace-verifier-call_exit-7.log"));
    }
}
