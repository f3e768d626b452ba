//! Saving and loading recordings.
//!
//! * JSON (`.json`): one object `{format, meta, segments, runs, notes,
//!   series, verdicts, release}`; `series[].points` are `[t_s, value|null]`.
//! * CSV (`.csv`): a first comment line `# memtrace-monitor/1 {JSON of meta,
//!   segments, runs, notes}`, then the header
//!   `t_s,family,metric,unit,segment,pid,value,note` and one row per sample
//!   (an empty `value` with a `note` is a gap).
//!
//! Both are read back by `memtrace monitor analyze`.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::monitor::error::MonitorError;
use crate::monitor::release::ReleaseReport;
use crate::monitor::series::{Family, Meta, Note, Recording, Run, Segment, Series, Unit};
use crate::monitor::verdict::Verdict;

/// Format tag written in both files.
pub const FORMAT: &str = "memtrace-monitor/1";

/// File formats by extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Csv,
    Json,
}

impl FileKind {
    /// From the extension of `path` (`.csv`, `.json`).
    pub fn from_path(path: &Path) -> Option<FileKind> {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("csv") => Some(FileKind::Csv),
            Some("json") => Some(FileKind::Json),
            _ => None,
        }
    }
}

#[derive(Serialize)]
struct DocumentOut<'a> {
    format: &'a str,
    meta: &'a Meta,
    segments: &'a [Segment],
    runs: &'a [Run],
    notes: &'a [Note],
    series: &'a [Series],
    verdicts: &'a [Verdict],
    release: Option<&'a ReleaseReport>,
}

#[derive(Deserialize)]
struct DocumentIn {
    format: String,
    meta: Meta,
    #[serde(default)]
    segments: Vec<Segment>,
    #[serde(default)]
    runs: Vec<Run>,
    #[serde(default)]
    notes: Vec<Note>,
    series: Vec<Series>,
}

#[derive(Serialize, Deserialize)]
struct CsvHead {
    meta: Meta,
    segments: Vec<Segment>,
    runs: Vec<Run>,
    notes: Vec<Note>,
}

#[derive(Serialize, Deserialize)]
struct CsvRow {
    t_s: f64,
    family: String,
    metric: String,
    unit: String,
    segment: u32,
    pid: Option<u32>,
    value: Option<f64>,
    note: String,
}

fn write_err(path: &Path, reason: impl ToString) -> MonitorError {
    MonitorError::Write {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn read_err(path: &Path, reason: impl ToString) -> MonitorError {
    MonitorError::Read {
        path: path.to_path_buf(),
        reason: reason.to_string().lines().next().unwrap_or("").to_string(),
    }
}

/// Mode of the files the monitor creates (recordings, plots, pages: no
/// secrets, shared as soak-test artifacts).
pub const FILE_MODE: u32 = 0o644;

/// Checks at start-up that `path` can be written, so a long run does not
/// fail at its end; nothing is written to it (a FIFO is not opened, see
/// [`crate::output::check_writable`]).
pub fn probe_writable(path: &Path) -> Result<(), MonitorError> {
    crate::output::check_writable(path, FILE_MODE).map_err(|e| write_err(path, e))
}

/// Writes `text` to `path` whole, or in place to a device, FIFO or through
/// a symbolic link, as the tracer's `--output` does
/// ([`crate::output::write_whole`]).
pub fn write_text(path: &Path, text: &str) -> Result<(), MonitorError> {
    crate::output::write_whole(path, FILE_MODE, |out| out.write_all(text.as_bytes()))
        .map_err(|e| write_err(path, e))
}

/// Writes `rec` (plus verdicts and release check for JSON) to `path`.
pub fn save(
    path: &Path,
    rec: &Recording,
    verdicts: &[Verdict],
    release: Option<&ReleaseReport>,
) -> Result<(), MonitorError> {
    let kind = FileKind::from_path(path)
        .ok_or_else(|| write_err(path, "unknown extension (use .csv or .json)"))?;
    let text = match kind {
        FileKind::Json => {
            let doc = DocumentOut {
                format: FORMAT,
                meta: &rec.meta,
                segments: &rec.segments,
                runs: &rec.runs,
                notes: &rec.notes,
                series: &rec.series,
                verdicts,
                release,
            };
            serde_json::to_string_pretty(&doc).map_err(|e| write_err(path, e))?
        }
        FileKind::Csv => to_csv(rec).map_err(|e| write_err(path, e))?,
    };
    write_text(path, &text)
}

fn to_csv(rec: &Recording) -> Result<String, String> {
    let head = CsvHead {
        meta: rec.meta.clone(),
        segments: rec.segments.clone(),
        runs: rec.runs.clone(),
        notes: rec.notes.clone(),
    };
    let head = serde_json::to_string(&head).map_err(|e| e.to_string())?;
    let mut rows: Vec<CsvRow> = Vec::new();
    for s in &rec.series {
        let mut gaps = s.gaps.iter();
        for (t, v) in &s.points {
            let note = if v.is_none() {
                gaps.next().map(|g| g.note.clone()).unwrap_or_default()
            } else {
                String::new()
            };
            rows.push(CsvRow {
                t_s: *t,
                family: s.family.as_str().to_string(),
                metric: s.metric.clone(),
                unit: s.unit.as_str().to_string(),
                segment: s.segment,
                pid: s.pid,
                value: *v,
                note,
            });
        }
    }
    rows.sort_by(|a, b| a.t_s.total_cmp(&b.t_s));
    let mut writer = csv::Writer::from_writer(Vec::new());
    for row in &rows {
        writer.serialize(row).map_err(|e| e.to_string())?;
    }
    let body = writer.into_inner().map_err(|e| e.to_string())?;
    let body = String::from_utf8(body).map_err(|e| e.to_string())?;
    Ok(format!("# {FORMAT} {head}\n{body}"))
}

/// Reads a recording saved by [`save`] (kind by extension, else by content).
pub fn load(path: &Path) -> Result<Recording, MonitorError> {
    let text = fs::read_to_string(path).map_err(|e| read_err(path, e))?;
    let kind = FileKind::from_path(path).unwrap_or(if text.trim_start().starts_with('{') {
        FileKind::Json
    } else {
        FileKind::Csv
    });
    match kind {
        FileKind::Json => load_json(path, &text),
        FileKind::Csv => load_csv(path, &text),
    }
}

fn load_json(path: &Path, text: &str) -> Result<Recording, MonitorError> {
    let doc: DocumentIn = serde_json::from_str(text).map_err(|e| read_err(path, e))?;
    if doc.format != FORMAT {
        return Err(read_err(
            path,
            format!("unsupported format '{}' (expected {FORMAT})", doc.format),
        ));
    }
    Ok(Recording::from_parts(
        doc.meta,
        doc.segments,
        doc.runs,
        doc.notes,
        doc.series,
    ))
}

fn load_csv(path: &Path, text: &str) -> Result<Recording, MonitorError> {
    let (first, body) = text.split_once('\n').unwrap_or((text, ""));
    let head_json = first
        .strip_prefix("# ")
        .and_then(|r| r.strip_prefix(FORMAT))
        .ok_or_else(|| read_err(path, format!("not a {FORMAT} CSV (first line)")))?;
    let head: CsvHead = serde_json::from_str(head_json.trim()).map_err(|e| read_err(path, e))?;
    let mut reader = csv::ReaderBuilder::new()
        .comment(Some(b'#'))
        .from_reader(body.as_bytes());
    let mut series: Vec<Series> = Vec::new();
    let mut index: HashMap<(Family, String, u32), usize> = HashMap::new();
    for (line, row) in reader.deserialize::<CsvRow>().enumerate() {
        let row = row.map_err(|e| read_err(path, e))?;
        let family = Family::parse(&row.family).ok_or_else(|| {
            read_err(
                path,
                format!("row {}: unknown family '{}'", line + 1, row.family),
            )
        })?;
        let unit = Unit::parse(&row.unit).ok_or_else(|| {
            read_err(
                path,
                format!("row {}: unknown unit '{}'", line + 1, row.unit),
            )
        })?;
        let key = (family, row.metric.clone(), row.segment);
        let idx = *index.entry(key).or_insert_with(|| {
            series.push(Series {
                family,
                metric: row.metric.clone(),
                unit,
                segment: row.segment,
                pid: row.pid,
                points: Vec::new(),
                gaps: Vec::new(),
            });
            series.len() - 1
        });
        let s = &mut series[idx];
        s.points.push((row.t_s, row.value));
        if row.value.is_none() {
            s.gaps.push(Note {
                t_s: row.t_s,
                note: row.note,
            });
        }
    }
    Ok(Recording::from_parts(
        head.meta,
        head.segments,
        head.runs,
        head.notes,
        series,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::testutil::TempDir;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::FileTypeExt;

    fn sample() -> Recording {
        let mut rec = Recording::new(Meta {
            target: "pid 1".into(),
            interval_s: 0.1,
            ..Meta::default()
        });
        let seg = rec.open_segment(1, "x, \"quoted\"", 0.0);
        for i in 0..5 {
            rec.record(Family::Process, "VmRSS", Unit::Bytes, seg, i as f64, 1e6);
            rec.record(Family::System, "Shmem", Unit::Bytes, 0, i as f64, 2e6);
        }
        rec.close_segment(seg, 5.0, "process exited, status 1");
        rec
    }

    #[test]
    fn csv_and_json_round_trip() {
        let dir = TempDir::new();
        for name in ["r.csv", "r.json"] {
            let path = dir.path().join(name);
            save(&path, &sample(), &[], None).expect("save");
            let back = load(&path).expect("load");
            assert_eq!(back.series.len(), 2, "{name}");
            let rss = back
                .series
                .iter()
                .find(|s| s.metric == "VmRSS")
                .expect("rss");
            assert_eq!(rss.points.len(), 6);
            assert_eq!(rss.points[5], (5.0, None));
            assert_eq!(rss.gaps[0].note, "process exited, status 1");
            assert_eq!(back.segments[0].name, "x, \"quoted\"");
            assert_eq!(back.meta.target, "pid 1");
        }
    }

    #[test]
    fn malformed_files_give_one_line_errors() {
        let dir = TempDir::new();
        let bad = dir.path().join("bad.json");
        fs::write(&bad, "{\"format\": 3,\n\"x\": [").expect("write");
        let err = load(&bad).expect_err("bad json").to_string();
        assert!(!err.contains('\n'), "{err}");
        let bad = dir.path().join("bad.csv");
        fs::write(&bad, "a,b\n1,2\n").expect("write");
        assert!(load(&bad).is_err());
        assert!(load(&dir.path().join("missing.csv")).is_err());
        assert!(save(Path::new("/nonexistent-dir/x.json"), &sample(), &[], None).is_err());
    }

    /// Every writer of `memtrace monitor`, writing `sample()` to `path`:
    /// (name, result).
    fn write_each(path: &Path, kind: &str) -> Result<(), MonitorError> {
        let rec = sample();
        match kind {
            "csv" | "json" => save(path, &rec, &[], None),
            "svg" | "png" => crate::monitor::plot::plot(path, &rec, &[]).map(drop),
            "html" => {
                let judged = crate::monitor::html::Judged {
                    verdicts: &[],
                    release: None,
                    failures: &[],
                    fail_on: &[],
                };
                crate::monitor::html::write(path, &rec, &judged)
            }
            other => panic!("{other}"),
        }
    }

    const KINDS: [&str; 5] = ["csv", "json", "svg", "png", "html"];

    #[test]
    fn writers_keep_dev_null_a_device() {
        let null = Path::new("/dev/null");
        for kind in KINDS {
            // The extension picks the format; /dev/null has none, so each
            // writer is reached through a link named for its format.
            let dir = TempDir::new();
            let link = dir.path().join(format!("out.{kind}"));
            std::os::unix::fs::symlink(null, &link).expect("symlink");
            probe_writable(&link).expect("probe");
            write_each(&link, kind).unwrap_or_else(|e| panic!("{kind}: {e}"));
            let meta = fs::metadata(null).expect("/dev/null");
            assert!(
                meta.file_type().is_char_device(),
                "{kind}: /dev/null stays a device"
            );
            assert!(
                fs::symlink_metadata(&link).expect("link").is_symlink(),
                "{kind}"
            );
        }
        // The text writer itself, straight at the device.
        probe_writable(null).expect("probe /dev/null");
        write_text(null, "x").expect("write /dev/null");
        assert!(fs::metadata(null)
            .expect("/dev/null")
            .file_type()
            .is_char_device());
    }

    #[test]
    fn writers_feed_a_fifo_read_by_a_thread() {
        for kind in KINDS {
            let dir = TempDir::new();
            let fifo = dir.path().join(format!("out.{kind}"));
            let name = std::ffi::CString::new(fifo.as_os_str().as_bytes()).expect("path");
            // SAFETY: `name` is a valid C string.
            assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0, "mkfifo");
            // Checking it neither blocks (no reader yet) nor writes.
            probe_writable(&fifo).expect("probe");
            let reader = {
                let fifo = fifo.clone();
                std::thread::spawn(move || fs::read(&fifo).expect("read fifo"))
            };
            write_each(&fifo, kind).unwrap_or_else(|e| panic!("{kind}: {e}"));
            let bytes = reader.join().expect("reader");
            assert!(!bytes.is_empty(), "{kind}: the reader got the file");
            let meta = fs::symlink_metadata(&fifo).expect("fifo");
            assert!(meta.file_type().is_fifo(), "{kind}: still a FIFO");
            match kind {
                "csv" => assert!(bytes.starts_with(b"# memtrace-monitor/1 "), "{kind}"),
                "json" => assert!(bytes.starts_with(b"{"), "{kind}"),
                "png" => assert!(bytes.starts_with(b"\x89PNG"), "{kind}"),
                _ => assert!(bytes.starts_with(b"<"), "{kind}"),
            }
        }
    }

    #[test]
    fn writers_write_through_a_symlink_and_keep_it() {
        for kind in KINDS {
            let dir = TempDir::new();
            let target = dir.path().join(format!("real.{kind}"));
            let link = dir.path().join(format!("link.{kind}"));
            fs::write(&target, "old").expect("target");
            std::os::unix::fs::symlink(&target, &link).expect("symlink");
            probe_writable(&link).expect("probe");
            write_each(&link, kind).unwrap_or_else(|e| panic!("{kind}: {e}"));
            let meta = fs::symlink_metadata(&link).expect("link");
            assert!(
                meta.file_type().is_symlink(),
                "{kind}: the link stays a link"
            );
            let written = fs::read(&target).expect("target");
            assert!(
                written.len() > 3 && written != b"old",
                "{kind}: target written"
            );
            // Nothing left next to them.
            let names: Vec<_> = fs::read_dir(dir.path())
                .expect("dir")
                .filter_map(|e| e.ok().map(|e| e.file_name()))
                .collect();
            assert_eq!(names.len(), 2, "{kind}: {names:?}");
        }
        // A regular file is replaced whole, and stays a regular file.
        let dir = TempDir::new();
        let plain = dir.path().join("plain.csv");
        fs::write(&plain, "old").expect("plain");
        save(&plain, &sample(), &[], None).expect("save");
        assert!(fs::symlink_metadata(&plain).expect("plain").is_file());
        assert!(load(&plain).is_ok());
    }
}
