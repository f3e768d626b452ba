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
        if let Some(path) = path {
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
