//! The [`Pusher`]: reports offered by the trace go into a bounded queue (the
//! oldest waiting one makes room for a newer one, counted as dropped) that a
//! thread of its own drains, building each request and sending it with
//! retries and backoff. The trace only clones the report and wakes the
//! thread: a slow or dead store never holds it up. At the end,
//! [`Pusher::finish`] gives the queue a bounded time to drain. One pusher
//! serves one [`Endpoint`]: Pyroscope's push API or an OTLP Collector; only
//! the request's body and headers differ.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::otlp::export_request;
use super::request::{host_name, profile_id, push_request, random_id};
use super::{Endpoint, PushStats};
use crate::report::Report;

/// How the pusher queues, waits and retries.
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    /// Most reports waiting at once.
    pub queue: usize,
    /// Tries of one report, the first included.
    pub attempts: u32,
    /// Wait before the first retry; it doubles with each further one.
    pub backoff: Duration,
    /// Longest wait between tries.
    pub max_backoff: Duration,
    /// Connecting to the store.
    pub connect_timeout: Duration,
    /// One whole request, connecting included.
    pub request_timeout: Duration,
    /// How long [`Pusher::finish`] waits for the queue to drain.
    pub finish_within: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            queue: 8,
            attempts: 4,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(15),
            finish_within: Duration::from_secs(20),
        }
    }
}

/// Why one try failed, and whether another may do better.
#[derive(Debug, thiserror::Error)]
enum TryError {
    #[error("HTTP {status}{body}")]
    Status { status: u16, body: String },
    #[error("{0}")]
    Transport(String),
    #[error("cannot build the request: {0}")]
    Build(String),
}

impl TryError {
    /// Whether a later try may succeed: the store unreachable or slow, a
    /// 5xx, 408 or 429. Other answers (a bad token, a rejected profile) will
    /// not change.
    fn retryable(&self) -> bool {
        match self {
            TryError::Status { status, .. } => *status >= 500 || *status == 408 || *status == 429,
            TryError::Transport(_) => true,
            TryError::Build(_) => false,
        }
    }
}

/// Pushes reports from a thread of its own.
pub struct Pusher {
    shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a report is queued or the pusher is ending.
    wake: Condvar,
    /// Signalled when the worker has finished a report.
    done: Condvar,
    config: Endpoint,
    policy: Policy,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Report>,
    /// The worker holds a report now.
    busy: bool,
    /// Set by [`Pusher::finish`]: tries stop by then.
    deadline: Option<Instant>,
    /// Nothing more is counted (the report's figures are written).
    closed: bool,
    stats: PushStats,
    /// The failing endpoint was warned about (once).
    warned: bool,
}

impl Pusher {
    /// Starts the thread. Plain http with credentials is warned about here.
    pub fn start(config: impl Into<Endpoint>, policy: Policy) -> std::io::Result<Pusher> {
        let config = config.into();
        if let Endpoint::Pyroscope(pyroscope) = &config {
            if pyroscope.credentials_in_clear() {
                eprintln!(
                    "memtrace: warning: --pyroscope {} is plain http: its credentials travel unencrypted",
                    pyroscope.endpoint
                );
            }
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                stats: PushStats {
                    endpoint: config.url().to_string(),
                    ..PushStats::default()
                },
                ..State::default()
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
            config,
            policy,
        });
        let worker = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("memtrace-push".into())
                .spawn(move || run(&shared))?
        };
        Ok(Pusher {
            shared,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// Queues `report` for pushing and returns at once; when the queue is
    /// full, the oldest waiting report is dropped (and counted).
    pub fn offer(&self, report: Report) {
        let mut state = self.shared.lock();
        if state.closed {
            state.stats.dropped += 1;
            return;
        }
        if state.queue.len() >= self.shared.policy.queue.max(1) {
            state.queue.pop_front();
            state.stats.dropped += 1;
        }
        state.queue.push_back(report);
        drop(state);
        self.shared.wake.notify_all();
    }

    /// What became of the reports so far.
    pub fn stats(&self) -> PushStats {
        self.shared.lock().stats.clone()
    }

    /// Waits up to the policy's `finish_within` for every queued report to
    /// be pushed (or given up), then stops: what is still waiting or under
    /// way then is counted as dropped. Returns the final figures.
    pub fn finish(&self) -> PushStats {
        let within = self.shared.policy.finish_within;
        let deadline = Instant::now() + within;
        let mut state = self.shared.lock();
        state.deadline = Some(deadline);
        self.shared.wake.notify_all();
        while !state.queue.is_empty() || state.busy {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            state = match self.shared.done.wait_timeout(state, deadline - now) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
        let left = state.queue.len() as u64 + u64::from(state.busy);
        if left > 0 {
            state.stats.dropped += left;
            state.stats.last_error = Some(format!(
                "{left} report(s) not pushed: still pending when memtrace ended ({} s allowed)",
                within.as_secs()
            ));
            state.queue.clear();
        }
        state.closed = true;
        let stats = state.stats.clone();
        drop(state);
        self.shared.wake.notify_all();
        if left == 0 {
            if let Some(worker) = self.worker.lock().ok().and_then(|mut w| w.take()) {
                let _ = worker.join();
            }
        }
        stats
    }
}

impl Drop for Pusher {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.closed = true;
        state.queue.clear();
        drop(state);
        self.shared.wake.notify_all();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The worker: one report at a time, until the pusher is closed.
fn run(shared: &Shared) {
    let agent = agent(&shared.policy);
    let host = host_name();
    let node = std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty());
    loop {
        let report = {
            let mut state = shared.lock();
            loop {
                if state.closed {
                    return;
                }
                if let Some(report) = state.queue.pop_front() {
                    state.busy = true;
                    break report;
                }
                state = match shared.wake.wait(state) {
                    Ok(guard) => guard,
                    Err(poisoned) => poisoned.into_inner(),
                };
            }
        };
        let outcome = push_one(shared, &agent, &report, host.as_deref(), node.as_deref());
        let mut state = shared.lock();
        state.busy = false;
        if !state.closed {
            match outcome {
                Outcome::Sent => state.stats.sent += 1,
                Outcome::Empty => state.stats.skipped_empty += 1,
                Outcome::Failed(why) => {
                    state.stats.failed += 1;
                    if !state.warned {
                        state.warned = true;
                        eprintln!(
                            "memtrace: warning: pushing to {} failed: {why} (later failures are counted in the report's `{}` and in /metrics, not logged)",
                            shared.config.url(),
                            match shared.config {
                                Endpoint::Pyroscope(_) => "push",
                                Endpoint::Otlp(_) => "otlp",
                            }
                        );
                    }
                    state.stats.last_error = Some(why);
                }
            }
        }
        drop(state);
        shared.done.notify_all();
    }
}

enum Outcome {
    Sent,
    Empty,
    Failed(String),
}

/// One report, tried up to `attempts` times with doubling waits between
/// tries (cut short by [`Pusher::finish`]'s deadline).
fn push_one(
    shared: &Shared,
    agent: &ureq::Agent,
    report: &Report,
    host: Option<&str>,
    node: Option<&str>,
) -> Outcome {
    let built = match &shared.config {
        Endpoint::Pyroscope(config) => push_request(report, config, host, node, profile_id()),
        Endpoint::Otlp(config) => export_request(report, config, host, node, random_id()),
    };
    let body = match built {
        Ok(Some(body)) => body,
        Ok(None) => return Outcome::Empty,
        Err(err) => return Outcome::Failed(TryError::Build(err.to_string()).to_string()),
    };
    let policy = &shared.policy;
    let mut wait = policy.backoff;
    let mut attempt = 1;
    loop {
        let error = match send(agent, &shared.config, &body) {
            Ok(()) => return Outcome::Sent,
            Err(error) => error,
        };
        if !error.retryable() || attempt >= policy.attempts {
            return Outcome::Failed(error.to_string());
        }
        // Wait, unless the pusher is ending and the wait would pass its
        // deadline.
        let mut state = shared.lock();
        let until = Instant::now() + wait;
        if state.closed || state.deadline.is_some_and(|d| d < until) {
            return Outcome::Failed(format!("{error} (no time left to retry)"));
        }
        state.stats.retries += 1;
        while Instant::now() < until && !state.closed {
            let left = until.saturating_duration_since(Instant::now());
            state = match shared.wake.wait_timeout(state, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
            if state.deadline.is_some_and(|d| d < until) {
                return Outcome::Failed(format!("{error} (no time left to retry)"));
            }
        }
        if state.closed {
            return Outcome::Failed(error.to_string());
        }
        drop(state);
        wait = (wait * 2).min(policy.max_backoff);
        attempt += 1;
    }
}

fn agent(policy: &Policy) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_connect(Some(policy.connect_timeout))
        .timeout_global(Some(policy.request_timeout))
        .http_status_as_error(false)
        // A redirect would carry the credentials elsewhere: not followed.
        .max_redirects(0)
        .max_redirects_will_error(false)
        .user_agent(concat!("memtrace/", env!("CARGO_PKG_VERSION")))
        .build()
        .into()
}

/// One try: the request, and the store's answer judged.
fn send(agent: &ureq::Agent, endpoint: &Endpoint, body: &[u8]) -> Result<(), TryError> {
    let mut request = agent.post(endpoint.url());
    match endpoint {
        Endpoint::Pyroscope(config) => {
            request = request
                .header("Content-Type", "application/proto")
                .header("Connect-Protocol-Version", "1");
            if let Some(auth) = config.auth.header() {
                request = request.header("Authorization", auth);
            }
            if let Some(tenant) = &config.tenant {
                request = request.header("X-Scope-OrgID", tenant);
            }
        }
        Endpoint::Otlp(_) => {
            request = request.header("Content-Type", "application/x-protobuf");
        }
    }
    let mut response = request
        .send(body)
        .map_err(|err| TryError::Transport(err.to_string()))?;
    let status = response.status().as_u16();
    if (200..300).contains(&status) {
        return Ok(());
    }
    // The store's own words, briefly (a Connect error is a small JSON).
    let text = response
        .body_mut()
        .with_config()
        .limit(4096)
        .read_to_string()
        .unwrap_or_default();
    let text: String = text.chars().filter(|c| !c.is_control()).take(200).collect();
    let body = if text.trim().is_empty() {
        String::new()
    } else {
        format!(": {}", text.trim())
    };
    Err(TryError::Status { status, body })
}
