//! JSON sink: the report as one JSON document (one line per interim report).

use std::io::Write;

use super::Sink;
use crate::report::Report;

pub struct JsonSink;

impl Sink for JsonSink {
    fn write(&self, report: &Report, interim: bool, out: &mut dyn Write) -> std::io::Result<()> {
        if interim {
            serde_json::to_writer(&mut *out, report)?;
        } else {
            serde_json::to_writer_pretty(&mut *out, report)?;
        }
        writeln!(out)
    }
}
