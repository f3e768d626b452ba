//! JSON sink: each report as one JSON document on one line, so interim
//! reports and the final one form a JSON Lines stream.

use std::io::Write;

use super::Sink;
use crate::report::Report;

pub struct JsonSink;

impl Sink for JsonSink {
    fn write(&self, report: &Report, _interim: bool, out: &mut dyn Write) -> std::io::Result<()> {
        serde_json::to_writer(&mut *out, report)?;
        writeln!(out)
    }
}
