//! The watcher's memory across its own restarts: the state file in the
//! reports directory (episode numbering, the episodes kept, the back-off),
//! retention (`--keep`), and the duty-cycle accounting (`--max-duty` over a
//! sliding day). The accounting is pure; only [`load`] and [`save`] touch
//! the file system. Times are Unix milliseconds.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::watch::WatchError;

/// Name of the state file inside the reports directory.
pub const STATE_FILE: &str = "watch-state.json";
/// The sliding period the duty cycle is measured over.
pub const DAY_MS: u64 = 24 * 3600 * 1000;
/// Format tag of the state file.
const FORMAT: &str = "memtrace-watch-state/1";

/// One episode, as remembered.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EpisodeEntry {
    pub number: u64,
    /// Its directory, relative to the reports directory.
    pub dir: String,
    pub started_unix_ms: u64,
    /// How long the tracer was attached (0 while it runs).
    pub traced_ms: u64,
    /// The metric that started it.
    pub metric: String,
    pub pid: u32,
    /// `running`, `done`, `failed`, or `interrupted` (the watcher stopped
    /// without seeing its end).
    pub outcome: String,
}

/// Everything the state file holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub format: String,
    /// The number the next episode gets.
    pub next_episode: u64,
    /// Episodes whose reports are kept (oldest first), plus the duty record
    /// of the last day (directories already pruned keep `dir` empty).
    pub episodes: Vec<EpisodeEntry>,
    /// No episode starts before this time.
    pub backoff_until_unix_ms: u64,
    /// Episodes since the metrics were last judged healthy.
    pub consecutive: u32,
}

impl Default for State {
    fn default() -> State {
        State {
            format: FORMAT.to_string(),
            next_episode: 1,
            episodes: Vec::new(),
            backoff_until_unix_ms: 0,
            consecutive: 0,
        }
    }
}

/// Why an episode may not start now.
#[derive(Clone, Debug, PartialEq)]
pub enum Hold {
    /// Back-off after the previous episode, until this time.
    Backoff { until_unix_ms: u64 },
    /// The duty cycle would pass `--max-duty`; room again at this time.
    Duty { until_unix_ms: u64, used_ms: u64 },
}

impl State {
    /// Attached time within the day before `now`, counting a running
    /// episode as lasting `window_ms`.
    pub fn duty_used_ms(&self, now: u64, window_ms: u64) -> u64 {
        let from = now.saturating_sub(DAY_MS);
        self.episodes
            .iter()
            .map(|e| {
                let len = if e.outcome == "running" {
                    window_ms
                } else {
                    e.traced_ms
                };
                let end = e.started_unix_ms.saturating_add(len);
                end.min(now).saturating_sub(e.started_unix_ms.max(from))
            })
            .sum()
    }

    /// Whether an episode of `window_ms` may start at `now` under a duty
    /// cap of `max_duty` (a fraction of the day).
    pub fn may_start(&self, now: u64, window_ms: u64, max_duty: f64) -> Result<(), Hold> {
        if now < self.backoff_until_unix_ms {
            return Err(Hold::Backoff {
                until_unix_ms: self.backoff_until_unix_ms,
            });
        }
        let budget = (max_duty * DAY_MS as f64) as u64;
        let used = self.duty_used_ms(now, window_ms);
        if used + window_ms <= budget {
            return Ok(());
        }
        // Find when enough of the day's attached time has slid out.
        let mut at = now;
        for e in &self.episodes {
            let end = e.started_unix_ms.saturating_add(e.traced_ms);
            let probe = end.saturating_add(DAY_MS);
            if probe > at && self.duty_used_ms(probe, window_ms) + window_ms <= budget {
                at = probe;
                break;
            }
        }
        Err(Hold::Duty {
            until_unix_ms: if at == now {
                now.saturating_add(DAY_MS)
            } else {
                at
            },
            used_ms: used,
        })
    }

    /// Starts an episode: returns its number and directory name.
    pub fn begin(&mut self, now: u64, metric: &str, pid: u32) -> (u64, String) {
        let number = self.next_episode;
        self.next_episode += 1;
        let dir = format!("episode-{number:04}");
        self.episodes.push(EpisodeEntry {
            number,
            dir: dir.clone(),
            started_unix_ms: now,
            traced_ms: 0,
            metric: metric.to_string(),
            pid,
            outcome: "running".to_string(),
        });
        (number, dir)
    }

    /// Ends episode `number` and sets the back-off: `base_ms` doubled for
    /// each episode since the metrics were last healthy, at most `max_ms`.
    pub fn end(
        &mut self,
        number: u64,
        now: u64,
        traced_ms: u64,
        outcome: &str,
        base_ms: u64,
        max_ms: u64,
    ) {
        if let Some(e) = self.episodes.iter_mut().find(|e| e.number == number) {
            e.traced_ms = traced_ms;
            e.outcome = outcome.to_string();
        }
        self.consecutive = self.consecutive.saturating_add(1);
        let factor = 1u64 << (self.consecutive - 1).min(16);
        let delay = base_ms.saturating_mul(factor).min(max_ms.max(base_ms));
        self.backoff_until_unix_ms = now.saturating_add(delay);
    }

    /// The metrics were judged healthy: the next back-off starts from the base.
    pub fn healthy(&mut self) {
        self.consecutive = 0;
    }

    /// After a restart: an episode still marked running was cut short.
    pub fn recover(&mut self) -> Vec<u64> {
        let mut cut = Vec::new();
        for e in &mut self.episodes {
            if e.outcome == "running" {
                e.outcome = "interrupted".to_string();
                cut.push(e.number);
            }
        }
        cut
    }

    /// Applies `--keep`: the directories of all but the newest `keep`
    /// episodes are to be deleted (returned); entries older than a day with
    /// no directory are forgotten.
    pub fn prune(&mut self, keep: usize, now: u64) -> Vec<String> {
        let with_dir: Vec<usize> = (0..self.episodes.len())
            .filter(|i| !self.episodes[*i].dir.is_empty() && self.episodes[*i].outcome != "running")
            .collect();
        let excess = with_dir.len().saturating_sub(keep);
        let mut doomed = Vec::new();
        for i in with_dir.into_iter().take(excess) {
            doomed.push(std::mem::take(&mut self.episodes[i].dir));
        }
        let from = now.saturating_sub(DAY_MS);
        self.episodes.retain(|e| {
            !e.dir.is_empty()
                || e.outcome == "running"
                || e.started_unix_ms.saturating_add(e.traced_ms) >= from
        });
        doomed
    }
}

/// Path of the state file in `dir`.
pub fn path(dir: &Path) -> PathBuf {
    dir.join(STATE_FILE)
}

/// Loads the state file; a missing one is a fresh state.
pub fn load(dir: &Path) -> Result<State, WatchError> {
    let file = path(dir);
    let text = match std::fs::read_to_string(&file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(State::default()),
        Err(source) => return Err(WatchError::Io { path: file, source }),
    };
    let state: State = serde_json::from_str(&text).map_err(|e| WatchError::State {
        path: file.clone(),
        why: e.to_string(),
    })?;
    if state.format != FORMAT {
        return Err(WatchError::State {
            path: file,
            why: format!("format '{}', expected '{FORMAT}'", state.format),
        });
    }
    Ok(state)
}

/// Writes `value` as JSON to `file` whole (a temporary file renamed over
/// it), created 0600.
pub fn write_json<T: Serialize>(file: &Path, value: &T) -> Result<(), WatchError> {
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| WatchError::Io {
        path: file.to_path_buf(),
        source,
    };
    let tmp = file.with_extension("json.tmp");
    let text = serde_json::to_vec_pretty(value).map_err(|e| io(std::io::Error::other(e)))?;
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io)?;
    out.write_all(&text).map_err(io)?;
    out.write_all(b"\n").map_err(io)?;
    out.sync_all().map_err(io)?;
    std::fs::rename(&tmp, file).map_err(io)
}

/// Saves the state file in `dir`.
pub fn save(dir: &Path, state: &State) -> Result<(), WatchError> {
    write_json(&path(dir), state)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: u64 = 60_000;

    fn ended(state: &mut State, start: u64, len: u64) {
        let (n, _) = state.begin(start, "RssAnon", 1);
        state.end(n, start + len, len, "done", MIN, 64 * MIN);
    }

    #[test]
    fn duty_counts_only_the_last_day() {
        let mut s = State::default();
        ended(&mut s, 0, MIN);
        ended(&mut s, 10 * MIN, MIN);
        assert_eq!(s.duty_used_ms(20 * MIN, MIN), 2 * MIN);
        // A day later, the first has slid out and the second half out.
        assert_eq!(s.duty_used_ms(DAY_MS + 10 * MIN + MIN / 2, MIN), MIN / 2);
        assert_eq!(s.duty_used_ms(3 * DAY_MS, MIN), 0);
    }

    #[test]
    fn duty_cap_holds_episodes_until_room_slides_free() {
        let mut s = State::default();
        // 1% of a day is 14.4 minutes: fourteen 1-minute episodes fit.
        for i in 0..14 {
            ended(&mut s, i * 10 * MIN, MIN);
        }
        s.backoff_until_unix_ms = 0;
        let now = 200 * MIN;
        match s.may_start(now, MIN, 0.01) {
            Err(Hold::Duty {
                until_unix_ms,
                used_ms,
            }) => {
                assert_eq!(used_ms, 14 * MIN);
                assert_eq!(until_unix_ms, MIN + DAY_MS);
            }
            other => panic!("{other:?}"),
        }
        assert!(s.may_start(now, MIN, 0.05).is_ok());
        assert!(s.may_start(DAY_MS + MIN, MIN, 0.01).is_ok());
    }

    #[test]
    fn backoff_doubles_until_healthy() {
        let mut s = State::default();
        ended(&mut s, 0, MIN);
        assert_eq!(s.backoff_until_unix_ms, 2 * MIN);
        assert!(matches!(
            s.may_start(MIN, MIN, 1.0),
            Err(Hold::Backoff { .. })
        ));
        ended(&mut s, 10 * MIN, MIN);
        assert_eq!(s.backoff_until_unix_ms, 13 * MIN);
        ended(&mut s, 20 * MIN, MIN);
        assert_eq!(s.backoff_until_unix_ms, 25 * MIN);
        for i in 0..10 {
            ended(&mut s, (30 + i) * MIN * 100, MIN);
        }
        let last = s
            .episodes
            .last()
            .map(|e| e.started_unix_ms + MIN)
            .unwrap_or(0);
        assert_eq!(s.backoff_until_unix_ms, last + 64 * MIN);
        s.healthy();
        ended(&mut s, 100 * DAY_MS, MIN);
        assert_eq!(s.backoff_until_unix_ms, 100 * DAY_MS + 2 * MIN);
    }

    #[test]
    fn keep_prunes_the_oldest_directories() {
        let mut s = State::default();
        for i in 0..5 {
            ended(&mut s, i * MIN * 2, MIN);
        }
        let doomed = s.prune(2, 10 * MIN);
        assert_eq!(doomed, vec!["episode-0001", "episode-0002", "episode-0003"]);
        // Still remembered for the duty cycle.
        assert_eq!(s.episodes.len(), 5);
        assert_eq!(s.duty_used_ms(10 * MIN, MIN), 5 * MIN);
        // After a day the pruned ones are forgotten.
        assert!(s.prune(2, 2 * DAY_MS).is_empty());
        assert_eq!(s.episodes.len(), 2);
    }

    #[test]
    fn a_running_episode_counts_and_is_recovered() {
        let mut s = State::default();
        let (n, dir) = s.begin(0, "nvml.used", 7);
        assert_eq!((n, dir.as_str()), (1, "episode-0001"));
        assert_eq!(s.duty_used_ms(30_000, MIN), 30_000);
        assert!(s.prune(0, 1).is_empty(), "a running episode is kept");
        assert_eq!(s.recover(), vec![1]);
        assert_eq!(s.episodes[0].outcome, "interrupted");
        assert_eq!(s.begin(1, "x", 7).0, 2);
    }

    #[test]
    fn state_round_trips_through_its_file() {
        let dir = std::env::temp_dir().join(format!("memtrace-watch-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp dir");
        assert_eq!(load(&dir).expect("fresh"), State::default());
        let mut s = State::default();
        ended(&mut s, 5, MIN);
        save(&dir, &s).expect("save");
        assert_eq!(load(&dir).expect("load"), s);
        std::fs::write(path(&dir), "{not json").expect("write");
        assert!(load(&dir).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
