//! Where reports go: stdout, or a file created 0600 and written whole (to a
//! temporary name, then renamed), so a partial file never pretends to be a
//! report, and with `--pyroscope` a profile store too (the [`Pusher`], which
//! takes each report without holding up the trace, and whose counters the
//! report's `push` shows), and with `--otlp-profiles` an OpenTelemetry
//! Collector (a second [`Pusher`], counted in the report's `otlp`). Interim reports always go to stdout. A device, FIFO, socket or
//! symbolic link given as the file is written in place instead
//! ([`write_whole`], which `memtrace monitor`'s writers share).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::Failure;
use crate::push::Pusher;
use crate::report::Report;
use crate::sink::{self, Format, Names, Sink};

pub struct Output {
    path: Option<PathBuf>,
    sink: Box<dyn Sink>,
    push: Option<Pusher>,
    otlp: Option<Pusher>,
}

impl Output {
    /// Checks up front that the output file can be written. `names`: how
    /// the text and HTML formats show frame names (`--full-names`).
    pub fn open(path: Option<&Path>, format: Format, names: Names) -> Result<Self, Failure> {
        if let Some(path) = path {
            check_writable(path, REPORT_MODE)
                .map_err(|err| Failure::usage(format!("cannot write {}: {err}", path.display())))?;
        }
        Ok(Output {
            path: path.map(Path::to_path_buf),
            sink: sink::for_format(format, names),
            push: None,
            otlp: None,
        })
    }

    /// Reports go to a profile store as well (`--pyroscope`).
    pub fn push_to(mut self, pusher: Option<Pusher>) -> Self {
        self.push = pusher;
        self
    }

    /// Reports go to an OpenTelemetry Collector as well (`--otlp-profiles`).
    pub fn otlp_to(mut self, pusher: Option<Pusher>) -> Self {
        self.otlp = pusher;
        self
    }

    /// Whether reports go to a profile store or a Collector as well.
    pub fn pushes(&self) -> bool {
        self.push.is_some() || self.otlp.is_some()
    }

    /// Hands `report` to the profile store's queue, if there is one;
    /// returns at once.
    pub fn offer(&self, report: &Report) {
        for pusher in self.push.iter().chain(&self.otlp) {
            pusher.offer(report.clone());
        }
    }

    /// Puts the push counters so far in `report` (its `push` and `otlp`).
    pub fn stamp(&self, report: &mut Report) {
        if let Some(pusher) = &self.push {
            report.push = Some(pusher.stats());
        }
        if let Some(pusher) = &self.otlp {
            report.otlp = Some(pusher.stats());
        }
    }

    /// An interim report: pushed (queued), and written to stdout with the
    /// push counters so far.
    pub fn interim(&self, report: &mut Report) -> anyhow::Result<()> {
        self.offer(report);
        self.stamp(report);
        let mut out = std::io::stdout().lock();
        self.sink.write(report, true, &mut out)?;
        out.flush()?;
        Ok(())
    }

    /// The final report: pushed, waiting a bounded time for the queue to
    /// drain ([`Pusher::finish`]), then written with the push's outcome.
    pub fn finish(&self, report: &mut Report) -> anyhow::Result<()> {
        // Both queues drain at once: each is offered the report first.
        self.offer(report);
        if let Some(pusher) = &self.push {
            report.push = Some(pusher.finish());
        }
        if let Some(pusher) = &self.otlp {
            report.otlp = Some(pusher.finish());
        }
        match &self.path {
            None => {
                let mut out = std::io::stdout().lock();
                self.sink.write(report, false, &mut out)?;
                out.flush()?;
            }
            Some(path) => {
                write_whole(path, REPORT_MODE, |out| self.sink.write(report, false, out)).map_err(
                    |err| Failure::runtime(format!("cannot write {}: {err}", path.display())),
                )?;
            }
        }
        Ok(())
    }
}

/// Reports may name code and data of the traced process: created 0600.
const REPORT_MODE: u32 = 0o600;

/// Whether `path` is written in place rather than replaced by a renamed
/// temporary file: a device, FIFO or socket (`/dev/null`, `/dev/stdout`'s
/// target), or a symbolic link — replacing those would put a regular file
/// where the device or link was.
pub fn writes_through(path: &Path) -> bool {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => true,
        Ok(meta) => !meta.file_type().is_file(),
        Err(_) => false,
    }
}

/// Checks up front, without writing anything to it, that `path` can be
/// written by [`write_whole`]: a FIFO is checked for write permission only
/// (opening it would wait for a reader, and closing it would give that
/// reader an end of file), another in-place path is opened for writing
/// without truncation, and a regular path gets a temporary file created
/// (`mode`) and removed next to it.
pub fn check_writable(path: &Path, mode: u32) -> std::io::Result<()> {
    if writes_through(path) {
        let is_fifo = std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo());
        if is_fifo {
            let name = std::ffi::CString::new(path.as_os_str().as_bytes())
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
            // SAFETY: `name` is a valid C string for the call's duration.
            if unsafe { libc::access(name.as_ptr(), libc::W_OK) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            return Ok(());
        }
        // A link to nothing yet: its target is created, as the write would.
        return OpenOptions::new()
            .write(true)
            .create(true)
            .mode(mode)
            .open(path)
            .map(drop);
    }
    let probe = temp_path(path);
    create(&probe, mode)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Writes a whole file at `path` with `write`: in place (truncated) when
/// [`writes_through`] says so; otherwise to a temporary name next to it
/// (created with `mode`), synced, then renamed over `path`, so a partial
/// file never pretends to be complete (the temporary file is removed when
/// `write` fails).
pub fn write_whole<E: From<std::io::Error>>(
    path: &Path,
    mode: u32,
    write: impl FnOnce(&mut dyn Write) -> Result<(), E>,
) -> Result<(), E> {
    if writes_through(path) {
        let mut out = open_through(path)?;
        write(&mut out)?;
        out.flush()?;
        return Ok(());
    }
    let temp = temp_path(path);
    let written = (|| {
        let mut file = create(&temp, mode)?;
        write(&mut file)?;
        file.flush()?;
        file.sync_all()?;
        std::fs::rename(&temp, path)?;
        Ok(())
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written
}

fn open_through(path: &Path) -> std::io::Result<std::fs::File> {
    OpenOptions::new().write(true).truncate(true).open(path)
}

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".memtrace-{}.tmp", std::process::id()));
    path.with_file_name(name)
}

fn create(path: &Path, mode: u32) -> std::io::Result<std::fs::File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_links_are_written_in_place_not_replaced() {
        assert!(writes_through(Path::new("/dev/null")));
        let dir = std::env::temp_dir().join(format!("memtrace-output-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let target = dir.join("real.json");
        let link = dir.join("link.json");
        std::fs::write(&target, "old").expect("target");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        let output = Output::open(Some(&link), Format::Json, Names::Short).expect("opens");
        output
            .finish(&mut crate::sink::fixture::report())
            .expect("writes");
        let meta = std::fs::symlink_metadata(&link).expect("link stays");
        assert!(meta.file_type().is_symlink(), "the link is not replaced");
        let written = std::fs::read_to_string(&target).expect("through the link");
        assert!(written.starts_with('{'), "{written}");
        let null =
            Output::open(Some(Path::new("/dev/null")), Format::Text, Names::Short).expect("opens");
        null.finish(&mut crate::sink::fixture::report())
            .expect("writes");
        let meta = std::fs::metadata("/dev/null").expect("/dev/null");
        assert!(!meta.file_type().is_file(), "/dev/null stays a device");
        assert!(!writes_through(&target), "regular files are replaced whole");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
