//! What the live view shows and how keys change it: the latest interim
//! report reduced to rows, the sort order, the allocator filter, the
//! selection (kept on the same site across refreshes), pause and the
//! full-stack view. Pure: no terminal here, so every key is unit-tested.
//! Frame names are short ([`crate::symbolize::short`]: the top frame
//! elided, cut to its column when drawn; stack frames cut to
//! [`STACK_NAME_WIDTH`]) unless `--full-names` ([`Names::Full`]).

use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

use crate::analysis::Trend;
use crate::report::Report;
use crate::sink::{module_name, pattern_label, scaled, short_frame_name, site_live, Names};

/// Most points a row's sparkline keeps.
pub const SPARK_POINTS: usize = 64;

/// Most characters of a short frame name in a stack line.
pub const STACK_NAME_WIDTH: usize = 72;

/// How the sites are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortBy {
    /// As the report ranks them: growing first, then new, stable, shrinking.
    Suspicion,
    Bytes,
    Growth,
    Count,
}

impl SortBy {
    pub fn name(self) -> &'static str {
        match self {
            SortBy::Suspicion => "suspicion",
            SortBy::Bytes => "bytes",
            SortBy::Growth => "growth",
            SortBy::Count => "count",
        }
    }
}

/// One site as the view shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Identity across refreshes: allocator, memory and call path.
    pub id: String,
    /// Position in the report's suspicion ranking (1 = most suspicious).
    pub rank: usize,
    pub allocator: String,
    pub memory: String,
    pub bytes: u64,
    pub count: u64,
    pub growth: f64,
    pub trend: Trend,
    pub pattern: Option<String>,
    /// The function that called the allocator.
    pub top: String,
    /// Whether that frame is a Python function.
    pub top_python: bool,
    /// Every frame, one line each (`function  file:line  module+offset`).
    pub stack: Vec<String>,
    /// Whether each frame of `stack` is a Python function (drawn apart).
    pub stack_python: Vec<bool>,
    /// Why there is no stack, when there is none.
    pub note: Option<String>,
    /// Live bytes at each snapshot, oldest first.
    pub history: Vec<u64>,
}

/// The header's figures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Header {
    pub target: String,
    pub traced_ms: u64,
    pub events: u64,
    pub events_per_s: Option<f64>,
    pub lost: u64,
    pub complete: bool,
    pub sample_rate: u32,
    /// `(allocator memory, live bytes)`.
    pub totals: Vec<(String, u64)>,
    /// VmRSS now and RssAnon growth since attach.
    pub rss: Option<(u64, i64)>,
    pub notes: usize,
    /// Reports received so far (one per interval).
    pub refreshes: u64,
    /// The latest leak check in a few words, and whether it found lost bytes.
    pub leak: Option<(String, bool)>,
}

/// What a key asks of the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing changed.
    None,
    /// Draw again.
    Redraw,
    /// Leave the view and write the final report.
    Quit,
}

/// The whole view state.
#[derive(Debug)]
pub struct State {
    pub header: Header,
    /// Rows of the last report applied, in the report's order.
    rows: Vec<Row>,
    pub sort: SortBy,
    /// Only this allocator's sites, when set.
    pub allocator: Option<String>,
    /// The selected site's id.
    selected: Option<String>,
    /// The user moved the selection: it stays on that site across
    /// refreshes; until then it follows the top row.
    pinned: bool,
    pub paused: bool,
    /// Showing the selected site's stack full-screen, scrolled by this much.
    pub stack_view: Option<usize>,
    pub help: bool,
    /// A report that arrived while paused.
    pending: Option<(Header, Vec<Row>)>,
    /// Rows a page-up/down moves (set by the renderer).
    pub page: usize,
    /// Short or whole frame names (`--full-names`).
    pub names: Names,
}

impl Default for State {
    fn default() -> Self {
        State {
            header: Header::default(),
            rows: Vec::new(),
            sort: SortBy::Suspicion,
            allocator: None,
            selected: None,
            pinned: false,
            paused: false,
            stack_view: None,
            help: false,
            pending: None,
            page: 10,
            names: Names::Short,
        }
    }
}

impl State {
    /// Takes a new (interim) report; while paused it is kept for later.
    pub fn update(&mut self, report: &Report) {
        let previous = self
            .pending
            .as_ref()
            .map_or(&self.header, |(header, _)| header);
        let header = header_of(report, previous);
        let rows = rows_of(report, self.names);
        if self.paused {
            self.pending = Some((header, rows));
        } else {
            self.header = header;
            self.rows = rows;
            self.keep_selection();
        }
    }

    /// The rows shown, filtered and sorted.
    pub fn visible(&self) -> Vec<&Row> {
        let mut rows: Vec<&Row> = self
            .rows
            .iter()
            .filter(|r| self.allocator.as_ref().is_none_or(|a| *a == r.allocator))
            .collect();
        match self.sort {
            SortBy::Suspicion => rows.sort_by_key(|r| r.rank),
            SortBy::Bytes => rows.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.rank.cmp(&b.rank))),
            SortBy::Count => rows.sort_by(|a, b| b.count.cmp(&a.count).then(a.rank.cmp(&b.rank))),
            SortBy::Growth => {
                rows.sort_by(|a, b| b.growth.total_cmp(&a.growth).then(a.rank.cmp(&b.rank)))
            }
        }
        rows
    }

    /// Index of the selected row among [`State::visible`].
    pub fn selected_index(&self) -> Option<usize> {
        let visible = self.visible();
        if visible.is_empty() {
            return None;
        }
        Some(
            self.selected
                .as_ref()
                .and_then(|id| visible.iter().position(|r| &r.id == id))
                .unwrap_or(0),
        )
    }

    /// The selected row.
    pub fn selected(&self) -> Option<&Row> {
        let index = self.selected_index()?;
        self.visible().get(index).copied()
    }

    /// Every allocator with a site, in name order.
    pub fn allocators(&self) -> Vec<String> {
        let mut names: Vec<String> = self.rows.iter().map(|r| r.allocator.clone()).collect();
        names.sort();
        names.dedup();
        names
    }

    /// Applies one key.
    pub fn key(&mut self, key: KeyEvent) -> Action {
        if key.kind == KeyEventKind::Release {
            return Action::None;
        }
        let ctrl = key.modifiers.contains(KeyModifiers::CONTROL);
        if ctrl && matches!(key.code, KeyCode::Char('c') | KeyCode::Char('d')) {
            return Action::Quit;
        }
        if let Some(scroll) = self.stack_view {
            let frames = self.selected().map_or(0, |r| r.stack.len());
            let last = frames.saturating_sub(1);
            self.stack_view = match key.code {
                KeyCode::Char('q') => return Action::Quit,
                KeyCode::Esc | KeyCode::Enter | KeyCode::Left | KeyCode::Backspace => None,
                KeyCode::Down | KeyCode::Char('j') => Some((scroll + 1).min(last)),
                KeyCode::Up | KeyCode::Char('k') => Some(scroll.saturating_sub(1)),
                KeyCode::PageDown => Some((scroll + self.page.max(1)).min(last)),
                KeyCode::PageUp => Some(scroll.saturating_sub(self.page.max(1))),
                KeyCode::Home => Some(0),
                KeyCode::End => Some(last),
                _ => return self.common_key(key.code),
            };
            return Action::Redraw;
        }
        match key.code {
            KeyCode::Char('q') => Action::Quit,
            KeyCode::Esc if self.help => {
                self.help = false;
                Action::Redraw
            }
            KeyCode::Down | KeyCode::Char('j') => self.move_by(1),
            KeyCode::Up | KeyCode::Char('k') => self.move_by(-1),
            KeyCode::PageDown => self.move_by(self.page.max(1) as isize),
            KeyCode::PageUp => self.move_by(-(self.page.max(1) as isize)),
            KeyCode::Home => self.move_to(0),
            KeyCode::End => self.move_to(usize::MAX),
            KeyCode::Enter | KeyCode::Right => {
                if let Some(id) = self.selected().map(|r| r.id.clone()) {
                    self.selected = Some(id);
                    self.pinned = true;
                    self.stack_view = Some(0);
                    Action::Redraw
                } else {
                    Action::None
                }
            }
            code => self.common_key(code),
        }
    }

    /// Keys that work in every view.
    fn common_key(&mut self, code: KeyCode) -> Action {
        match code {
            KeyCode::Char('s') => self.sort_by(SortBy::Suspicion),
            KeyCode::Char('b') => self.sort_by(SortBy::Bytes),
            KeyCode::Char('g') => self.sort_by(SortBy::Growth),
            KeyCode::Char('c') => self.sort_by(SortBy::Count),
            KeyCode::Char('a') => {
                let names = self.allocators();
                self.allocator = match &self.allocator {
                    None => names.first().cloned(),
                    Some(current) => names
                        .iter()
                        .position(|n| n == current)
                        .and_then(|i| names.get(i + 1))
                        .cloned(),
                };
                self.keep_selection();
                Action::Redraw
            }
            KeyCode::Char('p') | KeyCode::Char(' ') => {
                self.paused = !self.paused;
                if !self.paused {
                    if let Some((header, rows)) = self.pending.take() {
                        self.header = header;
                        self.rows = rows;
                        self.keep_selection();
                    }
                }
                Action::Redraw
            }
            KeyCode::Char('?') | KeyCode::Char('h') => {
                self.help = !self.help;
                Action::Redraw
            }
            _ => Action::None,
        }
    }

    fn sort_by(&mut self, sort: SortBy) -> Action {
        self.sort = sort;
        Action::Redraw
    }

    fn move_by(&mut self, delta: isize) -> Action {
        let Some(current) = self.selected_index() else {
            return Action::None;
        };
        let target = if delta < 0 {
            current.saturating_sub(delta.unsigned_abs())
        } else {
            current.saturating_add(delta.unsigned_abs())
        };
        self.move_to(target)
    }

    fn move_to(&mut self, index: usize) -> Action {
        let visible = self.visible();
        let Some(last) = visible.len().checked_sub(1) else {
            return Action::None;
        };
        let id = visible[index.min(last)].id.clone();
        self.selected = Some(id);
        self.pinned = true;
        Action::Redraw
    }

    /// Keeps the selection on a visible site: the same one when the user
    /// chose it and it still is, else the top row.
    fn keep_selection(&mut self) {
        let visible = self.visible();
        let still = self.pinned
            && self
                .selected
                .as_ref()
                .is_some_and(|id| visible.iter().any(|r| &r.id == id));
        if !still {
            let top = visible.first().map(|r| r.id.clone());
            if top != self.selected {
                self.stack_view = None;
            }
            self.pinned = false;
            self.selected = top;
        }
    }
}

fn header_of(report: &Report, previous: &Header) -> Header {
    let events = report.events.allocs + report.events.frees;
    let dt = report.duration_ms.saturating_sub(previous.traced_ms);
    let events_per_s = if previous.traced_ms > 0 && dt > 0 && events >= previous.events {
        Some((events - previous.events) as f64 * 1000.0 / dt as f64)
    } else if previous.traced_ms == 0 && report.duration_ms > 0 {
        Some(events as f64 * 1000.0 / report.duration_ms as f64)
    } else {
        previous.events_per_s
    };
    Header {
        target: format!("{} (pid {})", report.target.comm, report.target.pid),
        traced_ms: report.duration_ms,
        events,
        events_per_s,
        lost: report.events.lost,
        complete: report.complete,
        sample_rate: report.settings.sample_rate.max(1),
        totals: report
            .totals
            .iter()
            .map(|t| {
                (
                    format!("{} {}", t.allocator.name(), t.memory.name()),
                    scaled(report, t.live_bytes),
                )
            })
            .collect(),
        rss: report
            .reconciliation
            .as_ref()
            .map(|r| (r.vm_rss_now, r.rss_anon_growth)),
        notes: report.notes.len(),
        refreshes: previous.refreshes + 1,
        leak: report.leak_check.as_ref().map(leak_words),
    }
}

/// The latest leak check for the header.
fn leak_words(check: &crate::report::LeakCheck) -> (String, bool) {
    if !check.ran {
        return (
            format!(
                "leak check not run: {}",
                check.reason.as_deref().unwrap_or("no reason given")
            ),
            false,
        );
    }
    let s = &check.split;
    let words = format!(
        "leak check: definitely lost {} ({}), indirectly {}, possibly {}, reachable {}; paused {:.1} ms",
        crate::sink::human_bytes(s.definitely_lost.bytes),
        s.definitely_lost.blocks,
        crate::sink::human_bytes(s.indirectly_lost.bytes),
        crate::sink::human_bytes(s.possibly_lost.bytes),
        crate::sink::human_bytes(s.still_reachable.bytes),
        check.pause_ms
    );
    (words, s.lost_bytes() > 0)
}

fn rows_of(report: &Report, names: Names) -> Vec<Row> {
    report
        .sites
        .iter()
        .enumerate()
        .map(|(i, site)| {
            let (bytes, count) = site_live(report, site);
            let mut id = format!("{}|{}", site.allocator.name(), site.memory.name());
            for frame in &site.frames {
                id.push('|');
                id.push_str(frame.offset.as_deref().unwrap_or(&frame.addr));
                id.push_str(frame.module.as_deref().unwrap_or(""));
            }
            if site.frames.is_empty() {
                id.push('|');
                id.push_str(&site.functions.join(","));
            }
            let mut history: Vec<u64> = site
                .history
                .iter()
                .map(|&(_, b)| scaled(report, b))
                .collect();
            if history.last() != Some(&bytes) {
                history.push(bytes);
            }
            let skip = history.len().saturating_sub(SPARK_POINTS);
            history.drain(..skip);
            Row {
                id,
                rank: i + 1,
                allocator: site.allocator.name().to_string(),
                memory: site.memory.name().to_string(),
                bytes,
                count,
                growth: if site.growth_bytes_per_s.is_finite() {
                    site.growth_bytes_per_s * f64::from(report.settings.sample_rate.max(1))
                } else {
                    0.0
                },
                trend: site.trend,
                pattern: site.pattern.as_ref().map(pattern_label),
                top: site.frames.first().map_or_else(
                    || site.functions.join(","),
                    |f| short_frame_name(f, names, usize::MAX),
                ),
                top_python: site.frames.first().is_some_and(is_python),
                stack_python: site.frames.iter().map(is_python).collect(),
                stack: site
                    .frames
                    .iter()
                    .map(|f| {
                        let place = match (&f.file, f.line) {
                            (Some(file), Some(line)) => format!("  {file}:{line}"),
                            (Some(file), None) => format!("  {file}"),
                            _ => String::new(),
                        };
                        let module = match (&f.module, &f.offset) {
                            (Some(m), Some(o)) => format!("  {}+{o}", module_name(m)),
                            (Some(m), None) => format!("  {}", module_name(m)),
                            _ => format!("  {}", f.addr),
                        };
                        let name = short_frame_name(f, names, STACK_NAME_WIDTH);
                        format!("{name}{place}{module}")
                    })
                    .collect(),
                note: site.stack_note.clone(),
                history,
            }
        })
        .collect()
}

fn is_python(frame: &crate::report::Frame) -> bool {
    frame.kind == crate::report::FrameKind::Python
}

/// Live bytes as a one-line bar chart of `width` cells (block characters),
/// the newest on the right; each cell is the maximum of the points it covers.
pub fn sparkline(points: &[u64], width: usize) -> String {
    const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    if width == 0 || points.is_empty() {
        return String::new();
    }
    let cells: Vec<u64> = if points.len() <= width {
        points.to_vec()
    } else {
        let per = points.len().div_ceil(width);
        points
            .chunks(per)
            .map(|c| c.iter().copied().max().unwrap_or(0))
            .collect()
    };
    let (lo, hi) = cells
        .iter()
        .fold((u64::MAX, 0), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    cells
        .iter()
        .map(|&v| {
            if hi == lo {
                if hi == 0 {
                    BARS[0]
                } else {
                    BARS[3]
                }
            } else {
                let step = ((v - lo) as f64 / (hi - lo) as f64 * 7.0).round() as usize;
                BARS[step.min(7)]
            }
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::sink::fixture;

    fn press(state: &mut State, code: KeyCode) -> Action {
        state.key(KeyEvent::new(code, KeyModifiers::NONE))
    }

    pub fn state() -> State {
        let mut state = State::default();
        state.update(&fixture::report());
        state
    }

    #[test]
    fn rows_follow_the_report_ranking_with_their_stacks() {
        let state = state();
        let rows = state.visible();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].top, "alloc_buffers");
        assert_eq!(rows[0].allocator, "cuda");
        assert_eq!(rows[0].stack[0], "alloc_buffers  app.c:42  app+0x600");
        assert_eq!(rows[0].history, vec![2048, 4096]);
        assert_eq!(rows[1].top, "app+0x100");
        assert_eq!(
            rows[2].note.as_deref(),
            Some("stacks not requested (--stack-depth 0)")
        );
        assert_eq!(state.header.target, "app (pid 4242)");
        assert_eq!(state.header.events, 15);
        assert_eq!(state.header.totals.len(), 2);
        assert_eq!(state.selected().map(|r| r.rank), Some(1));
    }

    #[test]
    fn arrows_move_the_selection_within_bounds_and_it_survives_refreshes() {
        let mut state = state();
        assert_eq!(press(&mut state, KeyCode::Up), Action::Redraw);
        assert_eq!(state.selected_index(), Some(0));
        press(&mut state, KeyCode::Down);
        press(&mut state, KeyCode::Down);
        press(&mut state, KeyCode::Down);
        assert_eq!(state.selected_index(), Some(2));
        press(&mut state, KeyCode::Up);
        let id = state.selected().map(|r| r.id.clone());
        // A refresh where the site moved in the ranking keeps it selected.
        let mut report = fixture::report();
        report.sites.swap(0, 1);
        state.update(&report);
        assert_eq!(state.selected().map(|r| r.id.clone()), id);
        assert_eq!(state.selected_index(), Some(0));
        press(&mut state, KeyCode::End);
        assert_eq!(state.selected_index(), Some(2));
        press(&mut state, KeyCode::Home);
        assert_eq!(state.selected_index(), Some(0));
    }

    #[test]
    fn until_the_user_moves_the_selection_follows_the_top_row() {
        let mut state = state();
        assert_eq!(
            state.selected().map(|r| r.top.as_str()),
            Some("alloc_buffers")
        );
        let mut report = fixture::report();
        report.sites.swap(0, 1);
        state.update(&report);
        assert_eq!(state.selected_index(), Some(0));
        assert_eq!(state.selected().map(|r| r.top.as_str()), Some("app+0x100"));
    }

    #[test]
    fn sort_keys_reorder_and_allocator_filter_cycles() {
        let mut state = state();
        press(&mut state, KeyCode::Char('c'));
        assert_eq!(state.sort, SortBy::Count);
        assert_eq!(state.visible()[0].count, 3);
        press(&mut state, KeyCode::Char('b'));
        assert_eq!(state.visible()[0].bytes, 4096);
        press(&mut state, KeyCode::Char('g'));
        assert_eq!(state.sort, SortBy::Growth);
        press(&mut state, KeyCode::Char('s'));
        assert_eq!(state.visible()[0].rank, 1);
        assert_eq!(state.allocators(), vec!["cuda", "libc"]);
        press(&mut state, KeyCode::Char('a'));
        assert_eq!(state.allocator.as_deref(), Some("cuda"));
        assert_eq!(state.visible().len(), 1);
        press(&mut state, KeyCode::Char('a'));
        assert_eq!(state.allocator.as_deref(), Some("libc"));
        assert_eq!(state.visible().len(), 2);
        assert_eq!(state.selected().map(|r| r.allocator.as_str()), Some("libc"));
        press(&mut state, KeyCode::Char('a'));
        assert_eq!(state.allocator, None);
        assert_eq!(state.visible().len(), 3);
    }

    #[test]
    fn pause_holds_the_view_until_resumed() {
        let mut state = state();
        press(&mut state, KeyCode::Char('p'));
        let mut report = fixture::report();
        report.sites.truncate(1);
        report.duration_ms = 5000;
        state.update(&report);
        assert_eq!(state.visible().len(), 3, "paused: unchanged");
        press(&mut state, KeyCode::Char('p'));
        assert_eq!(state.visible().len(), 1);
        assert_eq!(state.header.traced_ms, 5000);
    }

    #[test]
    fn enter_shows_the_stack_and_quit_keys_quit() {
        let mut state = state();
        assert_eq!(press(&mut state, KeyCode::Enter), Action::Redraw);
        assert_eq!(state.stack_view, Some(0));
        press(&mut state, KeyCode::Down);
        press(&mut state, KeyCode::Down);
        assert_eq!(state.stack_view, Some(1), "scroll stops at the last frame");
        press(&mut state, KeyCode::Esc);
        assert_eq!(state.stack_view, None);
        assert_eq!(press(&mut state, KeyCode::Char('q')), Action::Quit);
        let ctrl_c = KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL);
        assert_eq!(state.key(ctrl_c), Action::Quit);
        assert_eq!(press(&mut state, KeyCode::Char('x')), Action::None);
        let mut empty = State::default();
        assert_eq!(press(&mut empty, KeyCode::Down), Action::None);
        assert_eq!(press(&mut empty, KeyCode::Enter), Action::None);
    }

    #[test]
    fn events_per_second_come_from_successive_reports() {
        let mut state = state();
        // First report: 15 events in 2.5 s.
        assert_eq!(state.header.events_per_s, Some(6.0));
        let mut report = fixture::report();
        report.duration_ms = 3500;
        report.events.allocs += 100;
        state.update(&report);
        assert_eq!(state.header.events_per_s, Some(100.0));
        assert_eq!(state.header.refreshes, 2);
    }

    #[test]
    fn sparklines_scale_between_min_and_max() {
        assert_eq!(sparkline(&[0, 7, 14], 10), "▁▅█");
        assert_eq!(sparkline(&[5, 5], 10), "▄▄");
        assert_eq!(sparkline(&[0, 0], 10), "▁▁");
        assert_eq!(sparkline(&[1, 2, 3, 4], 0), "");
        assert_eq!(
            sparkline(&(0..100).collect::<Vec<u64>>(), 10)
                .chars()
                .count(),
            10
        );
    }
}
