//! The one-line live status on stderr while tracing (terminals only).

use std::io::Write;
use std::time::Duration;

use crate::sink::human_bytes;

pub struct StatusLine {
    enabled: bool,
    last_events: u64,
    last_elapsed: Duration,
}

impl StatusLine {
    pub fn new(enabled: bool) -> Self {
        StatusLine {
            enabled,
            last_events: 0,
            last_elapsed: Duration::ZERO,
        }
    }

    pub fn update(&mut self, elapsed: Duration, events: u64, live_bytes: u64, lost: u64) {
        if !self.enabled {
            return;
        }
        let window = elapsed
            .saturating_sub(self.last_elapsed)
            .as_secs_f64()
            .max(1e-3);
        let rate = events.saturating_sub(self.last_events) as f64 / window;
        self.last_events = events;
        self.last_elapsed = elapsed;
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r\x1b[2K[memtrace] {:>6.1}s  {:>9.0} events/s  live {:>10}  lost {}",
            elapsed.as_secs_f64(),
            rate,
            human_bytes(live_bytes),
            lost
        );
        let _ = err.flush();
    }

    pub fn clear(&self) {
        if self.enabled {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K");
            let _ = err.flush();
        }
    }
}
