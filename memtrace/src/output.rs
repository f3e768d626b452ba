//! Where reports go: stdout, or a file created 0600 and written whole (to a
//! temporary name, then renamed), so a partial file never pretends to be a
//! report. Interim reports always go to stdout.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::cli::Format;
use crate::error::Failure;
use crate::report::Report;
use crate::sink::{self, Sink};

pub struct Output {
    path: Option<PathBuf>,
    sink: Box<dyn Sink>,
}

impl Output {
    /// Checks up front that the output file can be written.
    pub fn open(path: Option<&Path>, format: Format) -> Result<Self, Failure> {
        if let Some(path) = path.filter(|p| writes_through(p)) {
            open_through(path)
                .map_err(|err| Failure::usage(format!("cannot write {}: {err}", path.display())))?;
        } else if let Some(path) = path {
            let probe = temp_path(path);
            create(&probe)
                .map_err(|err| Failure::usage(format!("cannot write {}: {err}", path.display())))?;
            let _ = std::fs::remove_file(&probe);
        }
        Ok(Output {
            path: path.map(Path::to_path_buf),
            sink: sink::for_format(format),
        })
    }

    pub fn interim(&self, report: &Report) -> anyhow::Result<()> {
        let mut out = std::io::stdout().lock();
        self.sink.write(report, true, &mut out)?;
        out.flush()?;
        Ok(())
    }

    pub fn finish(&self, report: &Report) -> anyhow::Result<()> {
        match &self.path {
            None => {
                let mut out = std::io::stdout().lock();
                self.sink.write(report, false, &mut out)?;
                out.flush()?;
            }
            Some(path) if writes_through(path) => {
                let mut out = open_through(path).map_err(|err| {
                    Failure::runtime(format!("cannot write {}: {err}", path.display()))
                })?;
                self.sink.write(report, false, &mut out)?;
                out.flush()?;
            }
            Some(path) => {
                let temp = temp_path(path);
                let mut file = create(&temp).map_err(|err| {
                    Failure::runtime(format!("cannot write {}: {err}", path.display()))
                })?;
                self.sink.write(report, false, &mut file)?;
                file.sync_all()?;
                std::fs::rename(&temp, path).map_err(|err| {
                    Failure::runtime(format!("cannot write {}: {err}", path.display()))
                })?;
            }
        }
        Ok(())
    }
}

/// Whether `path` is written in place rather than replaced by a renamed
/// temporary file: a device, FIFO or socket (`/dev/null`, `/dev/stdout`'s
/// target), or a symbolic link — replacing those would put a regular file
/// where the device or link was.
fn writes_through(path: &Path) -> bool {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => true,
        Ok(meta) => !meta.file_type().is_file(),
        Err(_) => false,
    }
}

fn open_through(path: &Path) -> std::io::Result<std::fs::File> {
    OpenOptions::new().write(true).truncate(true).open(path)
}

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".memtrace-{}.tmp", std::process::id()));
    path.with_file_name(name)
}

fn create(path: &Path) -> std::io::Result<std::fs::File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
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
        let output = Output::open(Some(&link), Format::Json).expect("opens");
        output
            .finish(&crate::sink::fixture::report())
            .expect("writes");
        let meta = std::fs::symlink_metadata(&link).expect("link stays");
        assert!(meta.file_type().is_symlink(), "the link is not replaced");
        let written = std::fs::read_to_string(&target).expect("through the link");
        assert!(written.starts_with('{'), "{written}");
        let null = Output::open(Some(Path::new("/dev/null")), Format::Text).expect("opens");
        null.finish(&crate::sink::fixture::report())
            .expect("writes");
        let meta = std::fs::metadata("/dev/null").expect("/dev/null");
        assert!(!meta.file_type().is_file(), "/dev/null stays a device");
        assert!(!writes_through(&target), "regular files are replaced whole");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
