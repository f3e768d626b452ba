//! What is generated from the code for the user: the man pages and shell
//! completions (`clap_mangen`, `clap_complete`) packaged by `cargo xtask
//! dist`, and the guide's reference chapters (every flag, every JSON key)
//! kept in `docs/src/reference/`, so none of them can drift from the binary.
//!
//! Reached by the hidden `memtrace generate-docs --out DIR` command.

mod cli_markdown;
mod json_markdown;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::CommandFactory;

use crate::cli::{Cli, GenerateDocsArgs};

/// The shells completions are written for.
const SHELLS: [clap_complete::Shell; 4] = [
    clap_complete::Shell::Bash,
    clap_complete::Shell::Zsh,
    clap_complete::Shell::Fish,
    clap_complete::Shell::Elvish,
];

/// Writes `man/`, `completions/` and `reference/` under `args.out`.
pub fn run(args: &GenerateDocsArgs) -> Result<ExitCode> {
    let written = generate(&args.out)?;
    for path in written {
        println!("{}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// Generates every file; returns their paths.
pub fn generate(out: &Path) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let mut command = Cli::command();
    command.build();

    let man = out.join("man");
    create_dir(&man)?;
    for page in man_pages(&command)? {
        let path = man.join(&page.0);
        write(&path, &page.1)?;
        written.push(path);
    }

    let completions = out.join("completions");
    create_dir(&completions)?;
    for shell in SHELLS {
        let mut text = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "memtrace", &mut text);
        let path = completions.join(completion_file(shell));
        write(&path, &text)?;
        written.push(path);
    }

    let reference = out.join("reference");
    create_dir(&reference)?;
    for (name, text) in [
        ("cli.md", cli_markdown::render(&command)),
        ("json.md", json_markdown::render()),
    ] {
        let path = reference.join(name);
        write(&path, text.as_bytes())?;
        written.push(path);
    }
    Ok(written)
}

/// `memtrace.1` and one page per visible subcommand (`memtrace-watch.1`).
fn man_pages(command: &clap::Command) -> Result<Vec<(String, Vec<u8>)>> {
    let mut pages = Vec::new();
    let mut root = Vec::new();
    clap_mangen::Man::new(command.clone()).render(&mut root)?;
    pages.push(("memtrace.1".to_string(), root));
    for sub in command
        .get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
    {
        let name = format!("memtrace-{}", sub.get_name());
        let mut text = Vec::new();
        clap_mangen::Man::new(
            sub.clone()
                .display_name(name.clone())
                .bin_name(format!("memtrace {}", sub.get_name())),
        )
        .render(&mut text)?;
        pages.push((format!("{name}.1"), text));
    }
    Ok(pages)
}

/// The file name each shell looks for.
fn completion_file(shell: clap_complete::Shell) -> &'static str {
    match shell {
        clap_complete::Shell::Bash => "memtrace.bash",
        clap_complete::Shell::Zsh => "_memtrace",
        clap_complete::Shell::Fish => "memtrace.fish",
        clap_complete::Shell::Elvish => "memtrace.elv",
        _ => "memtrace.completion",
    }
}

fn create_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests;
