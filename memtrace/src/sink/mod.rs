//! Output sinks: each renders a [`Report`] in one format behind one trait, so
//! the event pipeline is the same whatever the user asked for.

mod json;
mod text;

use std::io::Write;

use crate::cli::Format;
use crate::report::Report;

/// Renders reports in one format.
pub trait Sink {
    /// Writes one report; interim reports carry `interim = true`.
    fn write(&self, report: &Report, interim: bool, out: &mut dyn Write) -> std::io::Result<()>;
}

/// The sink for a `--format` value.
pub fn for_format(format: Format) -> Box<dyn Sink> {
    match format {
        Format::Text => Box::new(text::TextSink),
        Format::Json => Box::new(json::JsonSink),
    }
}

/// Human-readable byte count (binary units).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_human() {
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(8 << 20), "8.0 MiB");
    }
}
