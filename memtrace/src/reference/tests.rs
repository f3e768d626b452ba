use super::*;

use std::path::PathBuf;

/// The guide's committed reference chapters.
fn committed_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/reference")
}

/// The committed chapters are what the code generates now; with
/// `MEMTRACE_UPDATE_REFERENCE=1` the test rewrites them instead.
#[test]
fn the_guides_reference_chapters_are_current() {
    let out = tempfile::tempdir().expect("temporary directory");
    generate(out.path()).expect("generates");
    let update = std::env::var_os("MEMTRACE_UPDATE_REFERENCE").is_some();
    let mut stale = Vec::new();
    for name in ["cli.md", "json.md"] {
        let fresh = fs::read_to_string(out.path().join("reference").join(name)).expect("written");
        let path = committed_dir().join(name);
        if update {
            fs::create_dir_all(committed_dir()).expect("reference directory");
            fs::write(&path, &fresh).expect("rewritten");
            continue;
        }
        if fs::read_to_string(&path).ok().as_deref() != Some(fresh.as_str()) {
            stale.push(path.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "stale: {stale:?}; run `MEMTRACE_UPDATE_REFERENCE=1 cargo test -p memtrace --bin memtrace reference` and commit"
    );
}

/// Every visible flag of every command has its own entry in the chapter.
#[test]
fn every_visible_flag_is_in_the_cli_reference() {
    let mut command = Cli::command();
    command.build();
    let text = cli_markdown::render(&command);
    let mut commands = vec![&command];
    commands.extend(command.get_subcommands().filter(|s| !s.is_hide_set()));
    let mut checked = 0;
    for cmd in commands {
        for arg in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
            let Some(long) = arg.get_long() else { continue };
            if matches!(long, "help" | "version") {
                continue;
            }
            assert!(
                text.lines()
                    .any(|l| l.starts_with("#### `") && l.contains(&format!("--{long}"))),
                "--{long} of `{}` missing",
                cmd.get_name()
            );
            checked += 1;
        }
    }
    assert!(checked > 100, "only {checked} flags seen");
    assert!(
        !text.contains("## memtrace generate-docs"),
        "a hidden command leaked"
    );
}

/// The report's contract keys, nested ones included, are listed with their
/// doc comments; an optional key says so.
#[test]
fn the_json_reference_walks_nested_keys() {
    let text = json_markdown::render();
    for key in [
        "`target.pid`",
        "`sites[].live_bytes`",
        "`sites[].frames[].symbol`",
        "`sites[].allocator` | string",
        "`leak_check.definitely_lost.bytes`",
        "`lost_by_cause` | map of integer",
        "`events`",
        "`modes[].works`",
    ] {
        assert!(text.contains(key), "{key} missing");
    }
    let device_cache = text
        .lines()
        .find(|l| l.starts_with("| `device_cache` |"))
        .expect("device_cache row");
    assert!(device_cache.contains("*optional*"), "{device_cache}");
    let interim = text
        .lines()
        .find(|l| l.starts_with("| `interim` |"))
        .expect("interim row");
    assert!(
        interim.contains("True for the reports printed every"),
        "{interim}"
    );
}

#[test]
fn markdown_escapes_html_and_emphasis_outside_code() {
    assert_eq!(
        cli_markdown::escape("a <PID> `<kept>` *b* x_y [c]"),
        "a &lt;PID&gt; `<kept>` \\*b\\* x\\_y \\[c\\]"
    );
}

#[test]
fn man_pages_and_completions_are_written() {
    let out = tempfile::tempdir().expect("temporary directory");
    let written = generate(out.path()).expect("generates");
    let names: Vec<String> = written
        .iter()
        .filter_map(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    for expected in [
        "memtrace.1",
        "memtrace-watch.1",
        "memtrace.bash",
        "_memtrace",
        "memtrace.fish",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} in {names:?}"
        );
    }
    let man = fs::read_to_string(out.path().join("man/memtrace.1")).expect("man page");
    assert!(
        man.contains("\\-\\-pid") || man.contains("--pid"),
        "the man page names --pid"
    );
    let bash = fs::read_to_string(out.path().join("completions/memtrace.bash")).expect("bash");
    assert!(bash.contains("--leak-check"), "bash completes --leak-check");
}
