//! A bench subprocess ([`Proc`]): its output lines read by threads, waits
//! with deadlines, and a guard that stops it when dropped (SIGINT first for
//! tracers, which clean up and write their report, then SIGKILL).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The lines a child writes on one stream, read by a thread.
pub(crate) struct Lines {
    pub(crate) rx: Receiver<String>,
    pub(crate) seen: Vec<String>,
}

impl Lines {
    pub(crate) fn new<R: Read + Send + 'static>(stream: R) -> Lines {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Lines {
            rx,
            seen: Vec::new(),
        }
    }

    pub(crate) fn drain(&mut self) {
        while let Ok(line) = self.rx.try_recv() {
            self.seen.push(line);
        }
    }

    pub(crate) fn tail(&mut self) -> String {
        self.drain();
        let from = self.seen.len().saturating_sub(4);
        let tail = self.seen[from..].join(" | ");
        if tail.is_empty() {
            "(nothing)".into()
        } else {
            tail
        }
    }
}

#[derive(Clone, Copy)]
pub(crate) enum Stream {
    Out,
    Err,
}

/// A child process that is stopped when dropped.
pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) child: Child,
    pub(crate) stdin: Option<ChildStdin>,
    pub(crate) out: Lines,
    pub(crate) err: Lines,
    /// SIGINT first when stopping (tracers clean up and write their report).
    pub(crate) graceful: bool,
}

impl Proc {
    pub(crate) fn spawn(name: &str, cmd: &mut Command, graceful: bool) -> Result<Proc> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {name} ({cmd:?})"))?;
        let stdin = child.stdin.take();
        let out = Lines::new(child.stdout.take().context("no stdout")?);
        let err = Lines::new(child.stderr.take().context("no stderr")?);
        Ok(Proc {
            name: name.into(),
            child,
            stdin,
            out,
            err,
            graceful,
        })
    }

    pub(crate) fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits for a line on `stream` satisfying `pred`.
    pub(crate) fn wait_line(
        &mut self,
        stream: Stream,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let lines = match stream {
                Stream::Out => &mut self.out,
                Stream::Err => &mut self.err,
            };
            match lines.rx.recv_timeout(left) {
                Ok(line) => {
                    lines.seen.push(line.clone());
                    if pred(&line) {
                        return Ok(line);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    let outputs = self.outputs();
                    bail!(
                        "{}: no expected output within {timeout:?}; {outputs}",
                        self.name
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = self.wait_exit(Duration::from_secs(2));
                    let status = status.map_or("still running".into(), |s| s.to_string());
                    let outputs = self.outputs();
                    bail!(
                        "{} ended ({status}) before the expected output; {outputs}",
                        self.name
                    )
                }
            }
        }
    }

    pub(crate) fn outputs(&mut self) -> String {
        format!("stdout: {}; stderr: {}", self.out.tail(), self.err.tail())
    }

    pub(crate) fn send_line(&mut self) -> Result<()> {
        let stdin = self.stdin.as_mut().context("stdin closed")?;
        stdin
            .write_all(b"\n")
            .and_then(|_| stdin.flush())
            .with_context(|| format!("writing to {}", self.name))
    }

    pub(crate) fn signal(&self, sig: i32) {
        // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    pub(crate) fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => return None,
            }
        }
    }

    /// SIGINT, then SIGKILL after `timeout`; fails when the kill was needed.
    pub(crate) fn stop(&mut self, timeout: Duration) -> Result<ExitStatus> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Ok(status);
        }
        self.signal(libc::SIGINT);
        if let Some(status) = self.wait_exit(timeout) {
            return Ok(status);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        bail!(
            "{} ignored SIGINT for {timeout:?} and was killed",
            self.name
        )
    }

    /// Closes stdin (the bench programs exit on EOF after their work).
    pub(crate) fn finish(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let _ = self.send_line();
        self.stdin = None;
        if let Some(status) = self.wait_exit(timeout) {
            return Ok(status);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        bail!(
            "{} did not exit within {timeout:?} and was killed",
            self.name
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        if self.graceful {
            self.signal(libc::SIGINT);
            if self.wait_exit(Duration::from_secs(5)).is_some() {
                return;
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
