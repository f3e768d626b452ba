//! The failures a user sees, each with its documented exit code:
//! 1 runtime failure, 2 bad input or usage, 4 insufficient privilege, 5
//! the leak check failed a `--fail-on` gate.

use std::process::ExitCode;

/// An error carrying the exit code it maps to.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    pub code: u8,
    pub message: String,
}

pub const EXIT_RUNTIME: u8 = 1;
pub const EXIT_USAGE: u8 = 2;
pub const EXIT_PERMISSION: u8 = 4;
/// The leak check found bytes in a `--fail-on` category.
pub const EXIT_LEAKS: u8 = 5;

impl Failure {
    pub fn usage(message: impl Into<String>) -> Self {
        Failure {
            code: EXIT_USAGE,
            message: message.into(),
        }
    }

    pub fn permission(message: impl Into<String>) -> Self {
        Failure {
            code: EXIT_PERMISSION,
            message: message.into(),
        }
    }

    pub fn runtime(message: impl Into<String>) -> Self {
        Failure {
            code: EXIT_RUNTIME,
            message: message.into(),
        }
    }
}

/// Prints an error as one line on stderr and picks its exit code.
pub fn report(err: &anyhow::Error) -> ExitCode {
    let code = err
        .downcast_ref::<Failure>()
        .map_or(EXIT_RUNTIME, |failure| failure.code);
    eprintln!("memtrace: {err:#}");
    ExitCode::from(code)
}
