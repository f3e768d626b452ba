//! The verdicts' sensitivity options, shared by `memtrace monitor` (its
//! judging options) and `memtrace watch` (what triggers an episode).

use clap::Args;

use crate::monitor::units::parse_size;
use crate::monitor::verdict::Thresholds;

/// Thresholds of the verdict logic, as command-line options.
#[derive(Clone, Debug, Args)]
pub struct Sensitivity {
    /// Growth rate (per hour) from which growth of a byte metric is `growth`.
    #[arg(long, value_parser = parse_size, default_value = "10MiB", value_name = "SIZE")]
    pub growth_rate: f64,

    /// Growth rate (per hour) from which growth of a count (fds, threads) is `growth`.
    #[arg(long, default_value_t = 60.0, value_name = "N")]
    pub growth_rate_count: f64,

    /// Smallest change of a byte metric that counts (trend over the window or a step).
    #[arg(long, value_parser = parse_size, default_value = "1MiB", value_name = "SIZE")]
    pub min_change: f64,

    /// Smallest change of a count that counts.
    #[arg(long, default_value_t = 3.0, value_name = "N")]
    pub min_change_count: f64,

    /// Smallest change that counts, as a fraction of the level.
    #[arg(long, default_value_t = 0.01, value_name = "FRACTION")]
    pub min_change_rel: f64,

    /// A trend must exceed this many robust noise sigmas over the window.
    #[arg(long, default_value_t = 3.0, value_name = "K")]
    pub noise_k: f64,

    /// A step must exceed this many within-level noise sigmas.
    #[arg(long, default_value_t = 6.0, value_name = "K")]
    pub jump_k: f64,

    /// Noise relative to the level from which a flat metric is `jitter`.
    #[arg(long, default_value_t = 0.05, value_name = "FRACTION")]
    pub jitter_rel: f64,
}

impl Sensitivity {
    /// The verdict thresholds these options set.
    pub fn thresholds(&self) -> Thresholds {
        Thresholds {
            growth_rate_bytes: self.growth_rate,
            growth_rate_count: self.growth_rate_count,
            min_change_bytes: self.min_change,
            min_change_count: self.min_change_count,
            min_change_rel: self.min_change_rel,
            noise_k: self.noise_k,
            jump_k: self.jump_k,
            jitter_rel: self.jitter_rel,
        }
    }
}
