//! Section "Inference-like workload": `inference` (small mallocs, a
//! cudaMalloc through the stub CUDA runtime, arithmetic per request)
//! untraced, under memtrace GPU-only and memtrace tracing everything.

use std::fmt::Write as _;
use std::time::Duration;

use super::common::{
    lost_summary, max, median, memtrace_flags, one_line, traced_run, value_after, Env, Report,
    Tracer, TARGET_LOOP_S,
};

struct InferenceConfig {
    name: &'static str,
    how: String,
    tracer: Tracer,
    samples: Vec<f64>,
    reports: Vec<Report>,
    unavailable: Option<String>,
    errors: Vec<String>,
}

pub(super) struct InferenceResult {
    work_iters: u64,
    requests: u64,
    configs: Vec<InferenceConfig>,
    error: Option<String>,
}

pub(super) fn bench(env: &Env) -> InferenceResult {
    let mut result = InferenceResult {
        work_iters: 0,
        requests: 0,
        configs: Vec::new(),
        error: None,
    };
    let cudart = env.fixtures.join("libcudart.so.12");
    if !cudart.is_file() {
        result.error = Some(format!(
            "{} missing (cargo xtask fixtures)",
            cudart.display()
        ));
        return result;
    }
    let calibrate = env.program("inference").arg("calibrate").output();
    let iters = calibrate
        .ok()
        .and_then(|o| value_after(&String::from_utf8_lossy(&o.stdout), "work_iters"))
        .map(|v| v as u64);
    let Some(work_iters) = iters else {
        result.error = Some("inference calibrate failed".into());
        return result;
    };
    result.work_iters = work_iters;
    let gpu_only = if env.has_allocators {
        (memtrace_flags(&["--allocators", "cuda,cuda-driver"]), None)
    } else {
        (
            Tracer::None,
            Some("needs --allocators (memtrace has no GPU-only mode yet)".to_string()),
        )
    };
    let mut configs = vec![
        InferenceConfig::new("untraced", "no tracer".into(), Tracer::None, None),
        InferenceConfig::new(
            "memtrace GPU-only",
            "`memtrace --allocators cuda,cuda-driver`".into(),
            gpu_only.0,
            gpu_only.1,
        ),
        InferenceConfig::new(
            "memtrace everything",
            "`memtrace` (default: every allocator, stacks)".into(),
            memtrace_flags(&[]),
            None,
        ),
    ];
    let mut requests: u64 = if env.quick { 1500 } else { 3000 };
    result.requests = requests;
    for round in 0..env.rounds {
        for config in configs.iter_mut() {
            if config.unavailable.is_some() {
                continue;
            }
            eprintln!(
                "xtask bench:   round {} inference {} ({requests} requests)",
                round + 1,
                config.name
            );
            let mut cmd = env.program("inference");
            cmd.arg(requests.to_string())
                .arg(work_iters.to_string())
                .arg(&cudart)
                .arg("60")
                .arg("30");
            match traced_run(
                env,
                "inference",
                &mut cmd,
                &config.tracer,
                "requests_per_s",
                Duration::from_secs(120),
            ) {
                Ok(sample) => {
                    config.samples.push(sample.value);
                    config.reports.extend(sample.report);
                }
                Err(err) => {
                    eprintln!("xtask bench:   inference {} failed: {err:#}", config.name);
                    config.errors.push(format!("{err:#}"));
                }
            }
        }
        // After the first round every config runs the same request count,
        // sized from the untraced rate (fixed from then on).
        if round == 0 {
            if let Some(rps) = median(&configs[0].samples) {
                requests = ((rps * 2.0 * TARGET_LOOP_S) as u64).clamp(200, 20_000);
                result.requests = requests;
            }
        }
    }
    result.configs = configs;
    result
}

impl InferenceConfig {
    fn new(
        name: &'static str,
        how: String,
        tracer: Tracer,
        unavailable: Option<String>,
    ) -> InferenceConfig {
        InferenceConfig {
            name,
            how,
            tracer,
            samples: Vec::new(),
            reports: Vec::new(),
            unavailable,
            errors: Vec::new(),
        }
    }
}

impl InferenceResult {
    /// memtrace GPU-only's overhead over untraced, in percent (medians).
    pub(super) fn gpu_overhead(&self) -> Option<f64> {
        if self.error.is_some() {
            return None;
        }
        let untraced = self.configs.first().and_then(|c| median(&c.samples));
        let gpu = self
            .configs
            .iter()
            .rfind(|c| c.name == "memtrace GPU-only" && c.unavailable.is_none())?;
        match (median(&gpu.samples), untraced) {
            (Some(t), Some(u)) if t > 0.0 => Some((u / t - 1.0) * 100.0),
            _ => None,
        }
    }
}

pub(super) fn render(inf: &InferenceResult, s: &mut String) {
    let _ = writeln!(s, "## Inference-like workload\n");
    let untraced_rps = inf.configs.first().and_then(|c| median(&c.samples));
    if let Some(err) = &inf.error {
        let _ = writeln!(s, "Not measured: {}\n", one_line(err));
    } else {
        let _ = writeln!(
            s,
            "`inference` (tests/fixtures/bench/inference.c): per request 50 small mallocs and frees, \
             one cudaMalloc(1 MiB)+cudaFree through the stub CUDA runtime (target/fixtures/libcudart.so.12, \
             dlopened), and {} arithmetic iterations (~200 us here); {} requests per run.\n",
            inf.work_iters, inf.requests
        );
        let _ = writeln!(s, "| Configuration | How | Runs | Median requests/s | Best requests/s | Overhead (median) | Lost events |");
        let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---|");
        for c in &inf.configs {
            if let Some(why) = &c.unavailable {
                let _ = writeln!(
                    s,
                    "| {} | {} | 0 | - | - | - | skipped: {} |",
                    c.name,
                    c.how,
                    one_line(why)
                );
                continue;
            }
            let med = median(&c.samples);
            let overhead = match (med, untraced_rps) {
                (Some(t), Some(u)) if t > 0.0 => Some((u / t - 1.0) * 100.0),
                _ => None,
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                c.name,
                c.how,
                c.samples.len(),
                med.map_or("-".into(), |v| format!("{v:.0}")),
                max(&c.samples).map_or("-".into(), |v| format!("{v:.0}")),
                overhead.map_or("-".into(), |v| format!("{v:+.1}%")),
                lost_summary(&c.reports)
            );
        }
        for c in &inf.configs {
            for err in &c.errors {
                let _ = writeln!(s, "\n- {}: a run failed: {}", c.name, one_line(err));
            }
        }
        let _ = writeln!(s);
    }
}
