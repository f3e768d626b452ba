//! `--live`: a full-screen terminal view of the trace, redrawn at every
//! interval from the same interim [`Report`] the sinks render (see
//! [`state`] for what is shown and how keys change it, [`render`] for the
//! drawing). Keys are read on a thread of their own and handed to the event
//! loop; while the view is up, memtrace's own stderr lines are captured
//! (they would tear the screen), the latest is shown in the footer, and all
//! are written to stderr again once the terminal is restored. Quitting (`q`,
//! Ctrl-C) ends the trace like Ctrl-C does: the final report is written
//! after the alternate screen is left.
//!
//! When stdout is not a terminal the view is not started and tracing runs
//! as without `--live` (one warning says so).

mod render;
mod state;

use std::io::{IsTerminal, Read, Stdout, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use crossterm::event::Event;
use crossterm::terminal::{self, EnterAlternateScreen, LeaveAlternateScreen};
use crossterm::{cursor, execute};
use ratatui::backend::CrosstermBackend;
use ratatui::Terminal;

pub use state::Action;
use state::State;

use crate::report::Report;

/// Most captured stderr lines kept to be written again at the end.
const MAX_CAPTURED_LINES: usize = 10_000;

/// The descriptor of the real stderr while it is captured (-1 when not),
/// for the panic hook.
static SAVED_STDERR: AtomicI32 = AtomicI32::new(-1);

/// The running view.
pub struct LiveView {
    terminal: Terminal<CrosstermBackend<Stdout>>,
    state: State,
    keys: tokio::sync::mpsc::UnboundedReceiver<Event>,
    stop: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
    stderr: Option<StderrCapture>,
    restored: bool,
}

impl LiveView {
    /// Starts the view for `target`, showing frame names as `names` says;
    /// `None` (after a warning) when stdout is not a terminal.
    pub fn start(target: &str, names: crate::sink::Names) -> anyhow::Result<Option<LiveView>> {
        if !std::io::stdout().is_terminal() {
            eprintln!("memtrace: --live: stdout is not a terminal; tracing without the live view");
            return Ok(None);
        }
        install_panic_hook();
        terminal::enable_raw_mode()?;
        let mut stdout = std::io::stdout();
        if let Err(err) = execute!(stdout, EnterAlternateScreen, cursor::Hide) {
            restore_terminal();
            return Err(err.into());
        }
        let terminal = match Terminal::new(CrosstermBackend::new(stdout)) {
            Ok(terminal) => terminal,
            Err(err) => {
                restore_terminal();
                return Err(err.into());
            }
        };
        let (tx, keys) = tokio::sync::mpsc::unbounded_channel();
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("memtrace-keys".into())
                .spawn(move || read_keys(&stop, &tx))
                .inspect_err(|_| restore_terminal())?
        };
        let stderr = if std::io::stderr().is_terminal() {
            StderrCapture::start()
                .map_err(|err| log::debug!("stderr not captured: {err}"))
                .ok()
        } else {
            None
        };
        let mut state = State::default();
        state.header.target = target.to_string();
        state.header.complete = true;
        state.names = names;
        let mut view = LiveView {
            terminal,
            state,
            keys,
            stop,
            reader: Some(reader),
            stderr,
            restored: false,
        };
        view.draw()?;
        Ok(Some(view))
    }

    /// The next terminal event (key, resize); pending forever when the key
    /// reader has stopped.
    pub async fn next_event(&mut self) -> Event {
        match self.keys.recv().await {
            Some(event) => event,
            None => std::future::pending().await,
        }
    }

    /// Applies a terminal event.
    pub fn handle(&mut self, event: Event) -> Action {
        match event {
            // Ctrl-L repaints every cell (after other output tore the screen).
            Event::Key(key)
                if key.code == crossterm::event::KeyCode::Char('l')
                    && key
                        .modifiers
                        .contains(crossterm::event::KeyModifiers::CONTROL) =>
            {
                let _ = self.terminal.clear();
                Action::Redraw
            }
            Event::Key(key) => self.state.key(key),
            Event::Resize(..) => Action::Redraw,
            _ => Action::None,
        }
    }

    /// Shows a new interim report.
    pub fn update(&mut self, report: &Report) {
        self.state.update(report);
    }

    /// Draws the view.
    pub fn draw(&mut self) -> std::io::Result<()> {
        let message = self.stderr.as_ref().and_then(StderrCapture::last_line);
        let state = &mut self.state;
        self.terminal
            .draw(|frame| render::draw(frame, state, message.as_deref()))?;
        Ok(())
    }

    /// Leaves the alternate screen and writes the captured stderr lines.
    fn restore(&mut self) {
        if self.restored {
            return;
        }
        self.restored = true;
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.terminal.show_cursor();
        restore_terminal();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        if let Some(capture) = self.stderr.take() {
            capture.finish();
        }
    }
}

impl Drop for LiveView {
    fn drop(&mut self) {
        self.restore();
    }
}

/// Draws the view; on a failure (the terminal went away) the view is ended
/// and tracing goes on without it.
pub fn redraw(live: &mut Option<LiveView>) {
    if let Some(view) = live.as_mut() {
        if let Err(err) = view.draw() {
            *live = None;
            eprintln!("memtrace: --live: cannot draw ({err}); tracing without the live view");
        }
    }
}

/// Waits for the next terminal event of the view, if there is one.
pub async fn next_event(live: &mut Option<LiveView>) -> Event {
    match live {
        Some(view) => view.next_event().await,
        None => std::future::pending().await,
    }
}

fn read_keys(stop: &AtomicBool, tx: &tokio::sync::mpsc::UnboundedSender<Event>) {
    while !stop.load(Ordering::SeqCst) {
        match crossterm::event::poll(Duration::from_millis(100)) {
            Ok(true) => match crossterm::event::read() {
                Ok(event) => {
                    if tx.send(event).is_err() {
                        return;
                    }
                }
                Err(_) => return,
            },
            Ok(false) => {}
            Err(_) => return,
        }
    }
}

fn restore_terminal() {
    let _ = execute!(std::io::stdout(), LeaveAlternateScreen, cursor::Show);
    let _ = terminal::disable_raw_mode();
}

/// On a panic the terminal and stderr are given back first, so the message
/// is readable.
fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            restore_terminal();
            let saved = SAVED_STDERR.swap(-1, Ordering::SeqCst);
            if saved >= 0 {
                // SAFETY: `saved` is the open duplicate of the real stderr
                // that StderrCapture holds; dup2 only replaces fd 2.
                unsafe { libc::dup2(saved, 2) };
            }
            previous(info);
        }));
    });
}

/// memtrace's stderr redirected into a pipe while the view is up.
struct StderrCapture {
    saved: OwnedFd,
    reader: JoinHandle<()>,
    lines: Arc<Mutex<CapturedLines>>,
}

#[derive(Default)]
struct CapturedLines {
    lines: std::collections::VecDeque<String>,
    dropped: usize,
}

impl StderrCapture {
    fn start() -> std::io::Result<StderrCapture> {
        let mut fds = [0i32; 2];
        // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded: both descriptors are open and ours alone.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) on fd 2, which is open (a terminal).
        let saved = unsafe { libc::fcntl(2, libc::F_DUPFD_CLOEXEC, 3) };
        if saved < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `saved` was just returned by fcntl: open and ours alone.
        let saved = unsafe { OwnedFd::from_raw_fd(saved) };
        // SAFETY: both descriptors are open; dup2 atomically replaces fd 2.
        if unsafe { libc::dup2(write.as_raw_fd(), 2) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        drop(write);
        SAVED_STDERR.store(saved.as_raw_fd(), Ordering::SeqCst);
        let lines = Arc::new(Mutex::new(CapturedLines::default()));
        let reader = {
            let lines = lines.clone();
            let mut pipe = std::fs::File::from(read);
            std::thread::Builder::new()
                .name("memtrace-stderr".into())
                .spawn(move || {
                    let mut pending = Vec::new();
                    let mut buf = [0u8; 4096];
                    loop {
                        let n = match pipe.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        pending.extend_from_slice(&buf[..n]);
                        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                            let line: Vec<u8> = pending.drain(..=end).collect();
                            push_line(&lines, String::from_utf8_lossy(&line).trim_end());
                        }
                    }
                    if !pending.is_empty() {
                        push_line(&lines, String::from_utf8_lossy(&pending).trim_end());
                    }
                })?
        };
        Ok(StderrCapture {
            saved,
            reader,
            lines,
        })
    }

    fn last_line(&self) -> Option<String> {
        let lines = self.lines.lock().ok()?;
        lines.lines.back().cloned()
    }

    /// Gives fd 2 back and writes every captured line to it.
    fn finish(self) {
        SAVED_STDERR.store(-1, Ordering::SeqCst);
        // SAFETY: `saved` is open; dup2 replaces fd 2 (the pipe's last
        // writer), so the reader sees the end of the pipe.
        unsafe { libc::dup2(self.saved.as_raw_fd(), 2) };
        let _ = self.reader.join();
        if let Ok(captured) = self.lines.lock() {
            let mut err = std::io::stderr().lock();
            if captured.dropped > 0 {
                let _ = writeln!(
                    err,
                    "memtrace: ({} earlier stderr lines of the live view not kept)",
                    captured.dropped
                );
            }
            for line in &captured.lines {
                let _ = writeln!(err, "{line}");
            }
        }
    }
}

fn push_line(lines: &Mutex<CapturedLines>, line: &str) {
    if let Ok(mut captured) = lines.lock() {
        if captured.lines.len() >= MAX_CAPTURED_LINES {
            captured.lines.pop_front();
            captured.dropped += 1;
        }
        captured.lines.push_back(line.to_string());
    }
}
