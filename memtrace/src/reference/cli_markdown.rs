//! The guide's command-line reference (`docs/src/reference/cli.md`): every
//! visible command and flag of the clap definitions, grouped under the
//! headings `--help` prints, with help, values and defaults.

use std::fmt::Write as _;

use clap::{Arg, Command};

/// The whole chapter for the built root command.
pub fn render(root: &Command) -> String {
    let mut out = String::new();
    out.push_str("# Reference: command line\n\n");
    out.push_str(
        "Generated from memtrace's own command-line definitions by \
         `memtrace generate-docs` (a unit test fails when this page is stale); \
         `memtrace --help` and `memtrace COMMAND --help` print the same text.\n\n",
    );
    let visible: Vec<&Command> = root
        .get_subcommands()
        .filter(|sub| !sub.is_hide_set() && sub.get_name() != "help")
        .collect();
    out.push_str("- [memtrace](#memtrace): trace a process (the default command)\n");
    for sub in &visible {
        let _ = writeln!(
            out,
            "- [memtrace {name}](#memtrace-{name}): {about}",
            name = sub.get_name(),
            about = escape(&first_line(sub)),
        );
    }
    out.push('\n');
    command_section(&mut out, root, "memtrace");
    for sub in visible {
        command_section(&mut out, sub, &format!("memtrace {}", sub.get_name()));
    }
    out
}

/// One command: its description, usage and arguments by heading.
fn command_section(out: &mut String, command: &Command, title: &str) {
    let _ = writeln!(out, "## {title}\n");
    if let Some(about) = command.get_long_about().or_else(|| command.get_about()) {
        let _ = writeln!(out, "{}\n", escape(&about.to_string()));
    }
    let usage = command.clone().render_usage().to_string();
    let usage: Vec<&str> = usage
        .trim_start_matches("Usage:")
        .lines()
        .map(str::trim)
        .collect();
    let _ = writeln!(out, "```text\n{}\n```\n", usage.join("\n"));
    for (heading, args) in grouped(command) {
        let _ = writeln!(out, "### {title}: {heading}\n");
        for arg in args {
            argument(out, arg);
        }
    }
    if let Some(after) = command.get_after_long_help().or(command.get_after_help()) {
        let _ = writeln!(out, "```text\n{}\n```\n", after.to_string().trim_end());
    }
}

/// The visible arguments under their `--help` headings, in `--help`'s order:
/// positionals ("Arguments"), the unheaded options ("Options"), then each
/// heading in the order it first appears.
fn grouped(command: &Command) -> Vec<(String, Vec<&Arg>)> {
    let mut groups: Vec<(String, Vec<&Arg>)> = Vec::new();
    let visible = command
        .get_arguments()
        .filter(|arg| !arg.is_hide_set() && !matches!(arg.get_id().as_str(), "help" | "version"));
    let mut positionals = Vec::new();
    let mut unheaded = Vec::new();
    let mut headed: Vec<(String, Vec<&Arg>)> = Vec::new();
    for arg in visible {
        if arg.is_positional() {
            positionals.push(arg);
        } else if let Some(heading) = arg.get_help_heading() {
            match headed.iter_mut().find(|(h, _)| h == heading) {
                Some((_, group)) => group.push(arg),
                None => headed.push((heading.to_string(), vec![arg])),
            }
        } else {
            unheaded.push(arg);
        }
    }
    if !positionals.is_empty() {
        groups.push(("Arguments".to_string(), positionals));
    }
    if !unheaded.is_empty() {
        groups.push(("Options".to_string(), unheaded));
    }
    groups.extend(headed);
    groups
}

/// One argument: its spelling as a heading of its own (a link target), its
/// help, its values and its default.
fn argument(out: &mut String, arg: &Arg) {
    let _ = writeln!(out, "#### `{}`\n", spelling(arg));
    if let Some(help) = arg.get_long_help().or_else(|| arg.get_help()) {
        let _ = writeln!(out, "{}\n", escape(help.to_string().trim_end()));
    }
    let values: Vec<_> = arg
        .get_possible_values()
        .into_iter()
        .filter(|value| !value.is_hide_set())
        .collect();
    if !values.is_empty() && arg.get_action().takes_values() {
        out.push_str("Values:\n\n");
        for value in values {
            match value.get_help() {
                Some(help) => {
                    let _ = writeln!(
                        out,
                        "- `{}`: {}",
                        value.get_name(),
                        escape(&help.to_string())
                    );
                }
                None => {
                    let _ = writeln!(out, "- `{}`", value.get_name());
                }
            }
        }
        out.push('\n');
    }
    let defaults: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|value| value.to_string_lossy().into_owned())
        .collect();
    if !defaults.is_empty() && arg.get_action().takes_values() {
        let _ = writeln!(out, "Default: `{}`\n", defaults.join(","));
    }
    if let Some(env) = arg.get_env() {
        let _ = writeln!(out, "Environment: `{}`\n", env.to_string_lossy());
    }
}

/// `-p, --pid <PID>`, `[COMMAND]...`.
fn spelling(arg: &Arg) -> String {
    let names = value_names(arg);
    if arg.is_positional() {
        return names;
    }
    let mut spelled = Vec::new();
    if let Some(short) = arg.get_short() {
        spelled.push(format!("-{short}"));
    }
    if let Some(long) = arg.get_long() {
        spelled.push(format!("--{long}"));
    }
    let mut text = spelled.join(", ");
    if arg.get_action().takes_values() && !names.is_empty() {
        text.push(' ');
        text.push_str(&names);
    }
    text
}

fn value_names(arg: &Arg) -> String {
    let names: Vec<String> = match arg.get_value_names() {
        Some(names) => names.iter().map(|n| format!("<{n}>")).collect(),
        None => vec![format!("<{}>", arg.get_id().as_str().to_uppercase())],
    };
    let mut text = names.join(" ");
    if arg
        .get_num_args()
        .is_some_and(|range| range.max_values() > 1)
    {
        text.push_str("...");
    }
    text
}

/// A command's one-line summary.
fn first_line(command: &Command) -> String {
    command
        .get_about()
        .map(|about| about.to_string())
        .unwrap_or_default()
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Escapes what Markdown would take for HTML or emphasis, outside code
/// spans (`` `...` ``), which keep their text as written.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_code = false;
    for c in text.chars() {
        if c == '`' {
            in_code = !in_code;
            out.push(c);
            continue;
        }
        if in_code {
            out.push(c);
            continue;
        }
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '*' | '_' | '[' | ']' | '|' => {
                out.push('\\');
                out.push(c);
            }
            _ => out.push(c),
        }
    }
    out
}
