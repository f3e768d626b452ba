//! "Where a pair's time goes": the kernel time of each of memtrace's BPF
//! programs per `mallocbench` pair, under the placed floor, `--stack-depth 0`
//! and the default, read from memtrace's own `--bpf-stats` report
//! (`bpf_programs`). Measured in runs of their own, after the timed rounds:
//! the kernel's statistics cost each program run some tens of ns, which the
//! per-pair table must not carry.

use std::fmt::Write as _;
use std::time::Duration;

use super::common::{median, memtrace_env, traced_run, Env, Tracer, HASHED_SLOTS};

/// Rounds of each configuration (interleaved).
const ROUNDS: usize = 3;

/// The configurations compared, as named in the per-pair table, with their
/// memtrace flags and environment.
type Config = (
    &'static str,
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
);
const CONFIGS: [Config; 4] = [
    ("placed floor", &["--null-probes"], &[]),
    ("memtrace --stack-depth 0", &["--stack-depth", "0"], &[]),
    (
        "memtrace --stack-depth 0, hashed in-flight slots",
        &["--stack-depth", "0"],
        &[HASHED_SLOTS],
    ),
    ("memtrace default", &[], &[]),
];

/// One run's programs as memtrace reported them: (program, runs, run_ns).
type Programs = Vec<(String, u64, u64)>;
/// One round of a configuration: its loop size (pairs) and its programs.
type Round = (u64, Programs);

/// One program's kernel time in one configuration.
pub(super) struct ProgramTime {
    pub(super) program: String,
    /// Runs per pair (median over the rounds).
    pub(super) runs_per_pair: f64,
    /// Kernel ns per run (median over the rounds).
    pub(super) ns_per_run: f64,
}

impl ProgramTime {
    fn ns_per_pair(&self) -> f64 {
        self.runs_per_pair * self.ns_per_run
    }
}

/// One configuration's programs, or why it could not be measured.
pub(super) struct ConfigTime {
    name: &'static str,
    programs: Vec<ProgramTime>,
    error: Option<String>,
}

impl ConfigTime {
    fn ns_per_pair(&self) -> f64 {
        self.programs.iter().map(ProgramTime::ns_per_pair).sum()
    }

    fn program(&self, name: &str) -> Option<&ProgramTime> {
        self.programs.iter().find(|p| p.program == name)
    }
}

/// Runs each configuration [`ROUNDS`] times with `--bpf-stats`; `pairs_of`
/// gives a configuration's loop size (the per-pair rounds' last one).
pub(super) fn measure(env: &Env, pairs_of: impl Fn(&str) -> Option<u64>) -> Vec<ConfigTime> {
    let mut samples: Vec<Vec<Round>> = vec![Vec::new(); CONFIGS.len()];
    let mut errors: Vec<Option<String>> = vec![None; CONFIGS.len()];
    for round in 0..ROUNDS {
        for (i, (name, flags, vars)) in CONFIGS.iter().enumerate() {
            let pairs = pairs_of(name).unwrap_or(400_000);
            eprintln!(
                "xtask bench:   kernel time, round {} {name} ({pairs} pairs)",
                round + 1
            );
            let mut with_stats: Vec<&str> = flags.to_vec();
            with_stats.push("--bpf-stats");
            let tracer: Tracer = memtrace_env(&with_stats, vars);
            let mut cmd = env.program("mallocbench");
            cmd.arg(pairs.to_string()).arg("60").arg("30");
            let run = traced_run(
                env,
                "mallocbench",
                &mut cmd,
                &tracer,
                "ns_per_pair",
                Duration::from_secs(120),
            );
            match run {
                Ok(sample) => match sample.report {
                    Some(report) if !report.programs.is_empty() => {
                        samples[i].push((pairs, report.programs));
                    }
                    _ => errors[i] = Some("no `bpf_programs` in memtrace's report".into()),
                },
                Err(err) => errors[i] = Some(format!("{err:#}")),
            }
        }
    }
    CONFIGS
        .iter()
        .zip(samples)
        .zip(errors)
        .map(|(((name, _, _), rounds), error)| ConfigTime {
            name,
            programs: per_program(&rounds),
            error,
        })
        .collect()
}

/// Medians over the rounds, per program that ran.
fn per_program(rounds: &[Round]) -> Vec<ProgramTime> {
    let mut names: Vec<&String> = rounds
        .iter()
        .flat_map(|(_, programs)| programs.iter().filter(|p| p.1 > 0).map(|p| &p.0))
        .collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter_map(|name| {
            let (mut per_pair, mut per_run) = (Vec::new(), Vec::new());
            for (pairs, programs) in rounds {
                if let Some((_, runs, ns)) = programs.iter().find(|p| &p.0 == name && p.1 > 0) {
                    per_pair.push(*runs as f64 / (*pairs).max(1) as f64);
                    per_run.push(*ns as f64 / *runs as f64);
                }
            }
            Some(ProgramTime {
                program: name.clone(),
                runs_per_pair: median(&per_pair)?,
                ns_per_run: median(&per_run)?,
            })
        })
        .collect()
}

/// The section's table and what it says about the 1.1x goal.
pub(super) fn render(configs: &[ConfigTime], placed_ns_per_pair: Option<f64>, s: &mut String) {
    let _ = writeln!(s, "### Where a pair's time goes\n");
    let _ = writeln!(
        s,
        "Kernel time of memtrace's BPF programs per `mallocbench` pair, from memtrace's own \
         `--bpf-stats` report (`bpf_programs`: the kernel's run counts and run time), {ROUNDS} \
         interleaved runs of each configuration after the rounds above (the statistics cost every \
         program run some tens of ns, so these runs are not in the table above); medians. The \
         floor's programs return at once: what they show is the statistics' own cost and the \
         program dispatch, which every configuration pays alike, so the work of each is its \
         figure minus the floor's.\n"
    );
    let _ = writeln!(
        s,
        "| Configuration | call_enter runs/pair | call_enter ns/run | call_exit runs/pair | call_exit ns/run | BPF ns/pair | work over the floor, ns/pair |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|");
    let floor = configs
        .iter()
        .find(|c| c.name == "placed floor" && c.error.is_none())
        .map(ConfigTime::ns_per_pair);
    let cell = |c: &ConfigTime, program: &str, pick: fn(&ProgramTime) -> f64, digits: usize| {
        c.program(program)
            .map_or("-".to_string(), |p| format!("{:.*}", digits, pick(p)))
    };
    for c in configs {
        if let Some(err) = &c.error {
            let _ = writeln!(
                s,
                "| {} | - | - | - | - | - | failed: {} |",
                c.name,
                super::common::one_line(err)
            );
            continue;
        }
        let total = c.ns_per_pair();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.0} | {} |",
            c.name,
            cell(c, "call_enter", |p| p.runs_per_pair, 2),
            cell(c, "call_enter", |p| p.ns_per_run, 0),
            cell(c, "call_exit", |p| p.runs_per_pair, 2),
            cell(c, "call_exit", |p| p.ns_per_run, 0),
            total,
            floor.map_or("-".into(), |f| format!("{:.0}", total - f)),
        );
    }
    let work = |name: &str| {
        let c = configs
            .iter()
            .find(|c| c.name == name && c.error.is_none())?;
        Some(c.ns_per_pair() - floor?)
    };
    if let (Some(placed), Some(default), Some(depth0)) = (
        placed_ns_per_pair,
        work("memtrace default"),
        work("memtrace --stack-depth 0"),
    ) {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "- 1.1x the placed floor leaves {:.0} ns per pair (a tenth of the floor's {placed:.0} \
             ns above) for all of memtrace's work; here it measures {default:.0} ns with stacks \
             and {depth0:.0} ns without, so the stack of a pair (the default's remembered walk, \
             replayed after one copy of the stack words it read) costs {:.0} ns.",
            placed * 0.1,
            default - depth0
        );
    }
    if let (Some(own), Some(hashed)) = (
        work("memtrace --stack-depth 0"),
        work("memtrace --stack-depth 0, hashed in-flight slots"),
    ) {
        let _ = writeln!(
            s,
            "- In-flight calls in each thread's task-local storage: {own:.0} ns of work per pair \
             with `--stack-depth 0`; in hashed slots claimed by compare-and-swap: {hashed:.0} ns. \
             The record costs two helper calls (the task, its storage) where the slot cost a hash, \
             an inlined array access and one locked compare-and-swap."
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(pairs: u64, programs: &[(&str, u64, u64)]) -> Round {
        (
            pairs,
            programs
                .iter()
                .map(|(n, r, t)| (n.to_string(), *r, *t))
                .collect(),
        )
    }

    #[test]
    fn medians_per_program_skip_programs_that_never_ran() {
        let rounds = [
            round(
                100,
                &[
                    ("call_enter", 200, 6000),
                    ("call_exit", 100, 9000),
                    ("task_new", 0, 0),
                ],
            ),
            round(
                200,
                &[("call_enter", 400, 10000), ("call_exit", 200, 20000)],
            ),
            round(100, &[("call_enter", 200, 5000), ("call_exit", 100, 11000)]),
        ];
        let programs = per_program(&rounds);
        assert_eq!(programs.len(), 2, "task_new never ran");
        let enter = &programs[0];
        assert_eq!(enter.program, "call_enter");
        assert_eq!(enter.runs_per_pair, 2.0);
        assert_eq!(enter.ns_per_run, 25.0);
        let exit = &programs[1];
        assert_eq!(exit.ns_per_run, 100.0);
        let config = ConfigTime {
            name: "memtrace default",
            programs,
            error: None,
        };
        assert_eq!(config.ns_per_pair(), 150.0);
    }

    #[test]
    fn the_table_subtracts_the_floor_and_names_the_budget() {
        let config = |name, enter: f64, exit: f64| ConfigTime {
            name,
            programs: vec![
                ProgramTime {
                    program: "call_enter".into(),
                    runs_per_pair: 2.0,
                    ns_per_run: enter,
                },
                ProgramTime {
                    program: "call_exit".into(),
                    runs_per_pair: 1.0,
                    ns_per_run: exit,
                },
            ],
            error: None,
        };
        let configs = [
            config("placed floor", 30.0, 30.0),
            config("memtrace --stack-depth 0", 55.0, 60.0),
            config("memtrace default", 55.0, 130.0),
        ];
        let mut s = String::new();
        render(&configs, Some(1000.0), &mut s);
        assert!(
            s.contains("| placed floor | 2.00 | 30 | 1.00 | 30 | 90 | 0 |"),
            "{s}"
        );
        assert!(
            s.contains("| memtrace default | 2.00 | 55 | 1.00 | 130 | 240 | 150 |"),
            "{s}"
        );
        assert!(s.contains("leaves 100 ns per pair"), "{s}");
        assert!(
            s.contains("measures 150 ns with stacks and 80 ns without"),
            "{s}"
        );
        assert!(s.contains("costs 70 ns"), "{s}");
    }
}
