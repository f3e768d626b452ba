//! Errors of the monitor. `Usage` variants map to exit code 2, the rest to 1.

use std::path::PathBuf;

/// Everything that can stop `memtrace monitor`.
#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    /// Bad or missing command-line input (exit code 2).
    #[error("{0}")]
    Usage(String),
    /// The target process does not exist (exit code 2).
    #[error("no such process: pid {0}")]
    NoSuchPid(u32),
    /// A root directory given for the readers cannot be read.
    #[error("cannot read {what} root {path}: {source}")]
    Root {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The command to launch could not be started.
    #[error("cannot start '{cmd}': {source}")]
    Spawn { cmd: String, source: std::io::Error },
    /// An output file cannot be written.
    #[error("cannot write {path}: {reason}")]
    Write { path: PathBuf, reason: String },
    /// A saved recording cannot be read back.
    #[error("cannot read recording {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    /// The plot could not be drawn.
    #[error("cannot draw plot {path}: {reason}")]
    Plot { path: PathBuf, reason: String },
}

impl MonitorError {
    /// True for errors that exit with code 2 (usage errors).
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            MonitorError::Usage(_) | MonitorError::NoSuchPid(_) | MonitorError::Spawn { .. }
        )
    }
}
