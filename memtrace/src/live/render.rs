//! Drawing the live view's [`State`] into a ratatui frame: a header
//! (target, traced time, events/s, lost, live bytes per allocator, RSS and
//! its growth), the ranked sites (trend, bytes, growth, sparkline, pattern,
//! top frame), the selected site's stack and a key line. Any size works:
//! parts that do not fit are left out, never panicked over (tested on a
//! `TestBackend` down to 1x1). A short top frame is cut at its front to
//! the column's width (namespaces first), so its last name stays in view.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Clear, Paragraph, Row, Table, TableState, Wrap};
use ratatui::Frame;

use super::state::{sparkline, State};
use crate::analysis::Trend;
use crate::sink::{human_bytes, Names};
use crate::symbolize::short;

/// Columns of the sparkline.
const SPARK_WIDTH: u16 = 16;
const KEYS: &str = "↑↓ select  Enter stack  s/b/g/c sort  a allocator  p pause  ? help  q quit";

/// Draws the whole view. `message` is the latest stderr line, if any.
pub fn draw(frame: &mut Frame<'_>, state: &mut State, message: Option<&str>) {
    let area = frame.area();
    if area.width == 0 || area.height == 0 {
        return;
    }
    let header_lines = header(state, area.width);
    let header_height = (header_lines.len() as u16).min(area.height);
    let [top, middle, footer] = Layout::vertical([
        Constraint::Length(header_height),
        Constraint::Min(0),
        Constraint::Length(u16::from(area.height > header_height + 2)),
    ])
    .areas(area);
    frame.render_widget(Paragraph::new(header_lines), top);
    let footer_text = match message {
        Some(m) if !m.is_empty() => Line::from(vec![
            Span::styled(m.to_string(), Style::new().fg(Color::Yellow)),
            Span::raw("  "),
            Span::styled(KEYS, Style::new().fg(Color::DarkGray)),
        ]),
        _ => Line::from(Span::styled(KEYS, Style::new().fg(Color::DarkGray))),
    };
    frame.render_widget(Paragraph::new(footer_text), footer);
    if state.stack_view.is_some() {
        stack_full(frame, state, middle);
    } else {
        // The stack pane takes up to 40% when there is room for both.
        let stack_height = if middle.height >= 12 {
            (middle.height * 2 / 5).max(5)
        } else {
            0
        };
        let [table_area, stack_area] =
            Layout::vertical([Constraint::Min(0), Constraint::Length(stack_height)]).areas(middle);
        sites_table(frame, state, table_area);
        if stack_height > 0 {
            stack_pane(frame, state, stack_area);
        }
    }
    if state.help {
        help(frame, area);
    }
}

/// Below this width the header's first line is split in two, so the
/// figures are not cut off behind the target's name.
const NARROW: u16 = 80;

fn header(state: &State, width: u16) -> Vec<Line<'static>> {
    let h = &state.header;
    let bold = Style::new().add_modifier(Modifier::BOLD);
    let mut first = vec![
        Span::styled("memtrace ", bold.fg(Color::Cyan)),
        Span::styled(h.target.clone(), bold),
        Span::raw(format!(
            "  refresh {}  traced {:.1}s  {} events/s  lost ",
            h.refreshes,
            h.traced_ms as f64 / 1000.0,
            h.events_per_s
                .map_or_else(|| "-".to_string(), |r| format!("{r:.0}"))
        )),
        Span::styled(
            h.lost.to_string(),
            if h.lost > 0 {
                Style::new().fg(Color::Red).add_modifier(Modifier::BOLD)
            } else {
                Style::new()
            },
        ),
    ];
    if !h.complete {
        first.push(Span::styled(
            "  INCOMPLETE",
            Style::new().fg(Color::Red).add_modifier(Modifier::BOLD),
        ));
    }
    if state.paused {
        first.push(Span::styled(
            "  PAUSED",
            Style::new().fg(Color::Black).bg(Color::Yellow),
        ));
    }
    let mut second = vec![Span::raw(if h.sample_rate > 1 {
        format!("live (est., 1 in {} sampled): ", h.sample_rate)
    } else {
        "live: ".to_string()
    })];
    if h.totals.is_empty() {
        second.push(Span::raw("nothing yet"));
    }
    for (i, (name, bytes)) in h.totals.iter().enumerate() {
        if i > 0 {
            second.push(Span::raw("  "));
        }
        second.push(Span::raw(format!("{name} ")));
        second.push(Span::styled(human_bytes(*bytes), bold));
    }
    let mut third = match h.rss {
        Some((rss, growth)) => vec![
            Span::raw("RSS "),
            Span::styled(human_bytes(rss), bold),
            Span::raw(" ("),
            Span::styled(
                format!(
                    "{}{}",
                    if growth < 0 { "-" } else { "+" },
                    human_bytes(growth.unsigned_abs())
                ),
                if growth > 0 {
                    Style::new().fg(Color::Red)
                } else {
                    Style::new().fg(Color::Green)
                },
            ),
            Span::raw(" anon since attach)"),
        ],
        None => vec![Span::raw("RSS -")],
    };
    third.push(Span::raw(format!(
        "  sort: {}  allocator: {}{}",
        state.sort.name(),
        state.allocator.as_deref().unwrap_or("all"),
        if h.notes > 0 {
            format!("  notes: {} (in the final report)", h.notes)
        } else {
            String::new()
        }
    )));
    let leak = h.leak.as_ref().map(|(words, lost)| {
        Line::from(Span::styled(
            words.clone(),
            if *lost {
                Style::new().fg(Color::Red)
            } else {
                Style::new().fg(Color::Green)
            },
        ))
    });
    if width < NARROW {
        let figures = first.split_off(2);
        let mut figures_line: Vec<Span<'static>> = figures;
        if let Some(lead) = figures_line.first_mut() {
            lead.content = lead.content.trim_start().to_string().into();
        }
        let mut lines = vec![
            Line::from(first),
            Line::from(figures_line),
            Line::from(second),
            Line::from(third),
        ];
        lines.extend(leak);
        return lines;
    }
    let mut lines = vec![Line::from(first), Line::from(second), Line::from(third)];
    lines.extend(leak);
    lines
}

fn trend_style(trend: Trend) -> Style {
    match trend {
        Trend::Growing => Style::new().fg(Color::Red).add_modifier(Modifier::BOLD),
        Trend::New => Style::new().fg(Color::Yellow),
        Trend::Stable => Style::new(),
        Trend::Shrinking => Style::new().fg(Color::Green),
    }
}

fn trend_name(trend: Trend) -> &'static str {
    match trend {
        Trend::Growing => "growing",
        Trend::New => "new",
        Trend::Stable => "stable",
        Trend::Shrinking => "shrinking",
    }
}

/// A column of the sites table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Column {
    Rank,
    Trend,
    Bytes,
    Growth,
    Spark,
    Allocator,
    Pattern,
    Top,
}

impl Column {
    fn title(self) -> &'static str {
        match self {
            Column::Rank => "#",
            Column::Trend => "trend",
            Column::Bytes => "bytes",
            Column::Growth => "growth",
            Column::Spark => "live bytes",
            Column::Allocator => "alloc",
            Column::Pattern => "pattern",
            Column::Top => "top frame",
        }
    }
}

/// The columns that fit `width`: the less important ones (pattern,
/// allocator, sparkline, growth) go first as the terminal narrows, the top
/// frame always stays.
fn columns(width: u16) -> Vec<(Column, Constraint)> {
    let mut out = vec![
        (Column::Rank, Constraint::Length(3)),
        (Column::Trend, Constraint::Length(9)),
        (Column::Bytes, Constraint::Length(10)),
    ];
    if width >= 56 {
        out.push((Column::Growth, Constraint::Length(11)));
    }
    if width >= 76 {
        out.push((Column::Spark, Constraint::Length(SPARK_WIDTH)));
    }
    if width >= 96 {
        out.push((Column::Allocator, Constraint::Length(7)));
    }
    if width >= 120 {
        out.push((Column::Pattern, Constraint::Length(24)));
    }
    out.push((Column::Top, Constraint::Min(8)));
    out
}

/// The characters the top-frame column has when the table is `width`
/// wide: what the fixed columns, the spaces between columns and the
/// highlight symbol leave.
fn top_width(columns: &[(Column, Constraint)], width: u16) -> usize {
    let fixed: u16 = columns
        .iter()
        .map(|(_, c)| match c {
            Constraint::Length(n) => *n,
            _ => 0,
        })
        .sum();
    let spaces = u16::try_from(columns.len()).unwrap_or(u16::MAX);
    usize::from(width.saturating_sub(fixed).saturating_sub(spaces)).max(1)
}

/// The top frame as its column shows it.
fn top_text(r: &super::state::Row, names: Names, width: usize) -> String {
    match names {
        Names::Full => r.top.clone(),
        Names::Short if r.top_python => short::fit_plain(&r.top, width.saturating_sub(3)),
        Names::Short => short::short(&r.top, width),
    }
}

fn cell(column: Column, r: &super::state::Row, top: &str) -> Cell<'static> {
    match column {
        Column::Rank => Cell::from(r.rank.to_string()),
        Column::Trend => Cell::from(trend_name(r.trend)).style(trend_style(r.trend)),
        Column::Bytes => Cell::from(human_bytes(r.bytes)),
        Column::Growth => Cell::from(if r.trend == Trend::Growing {
            format!("{}/s", human_bytes(r.growth.max(0.0) as u64))
        } else {
            String::new()
        }),
        Column::Spark => Cell::from(sparkline(&r.history, usize::from(SPARK_WIDTH)))
            .style(Style::new().fg(Color::Cyan)),
        Column::Allocator => Cell::from(r.allocator.clone()),
        Column::Pattern => Cell::from(r.pattern.clone().unwrap_or_default()),
        Column::Top if r.top_python => Cell::from(Line::from(vec![
            py_tag(),
            Span::raw(" "),
            Span::styled(top.to_string(), py_style()),
        ])),
        Column::Top => Cell::from(top.to_string()),
    }
}

/// The tag in front of a Python frame (its kind, for any terminal).
fn py_tag() -> Span<'static> {
    Span::styled(
        "py",
        Style::new()
            .fg(Color::Black)
            .bg(Color::Yellow)
            .add_modifier(Modifier::BOLD),
    )
}

/// The colour of a Python frame's text.
fn py_style() -> Style {
    Style::new().fg(Color::LightBlue)
}

fn sites_table(frame: &mut Frame<'_>, state: &mut State, area: Rect) {
    if area.height == 0 {
        return;
    }
    let selected = state.selected_index();
    let visible = state.visible();
    let title = format!(" sites ({}) ", visible.len());
    let columns = columns(area.width);
    let rows: Vec<Row<'_>> = visible
        .iter()
        .map(|r| {
            let top = top_text(r, state.names, top_width(&columns, area.width));
            Row::new(columns.iter().map(|(c, _)| cell(*c, r, &top)))
        })
        .collect();
    let empty = rows.is_empty();
    let table = Table::new(rows, columns.iter().map(|(_, w)| *w))
        .header(
            Row::new(columns.iter().map(|(c, _)| c.title()))
                .style(Style::new().add_modifier(Modifier::BOLD | Modifier::UNDERLINED)),
        )
        .block(Block::new().borders(Borders::TOP).title(title))
        .row_highlight_style(Style::new().bg(Color::Blue).fg(Color::White))
        .highlight_symbol("▶");
    // Page up/down moves by what is visible.
    state.page = usize::from(area.height.saturating_sub(3)).max(1);
    let mut table_state = TableState::default().with_selected(selected);
    frame.render_stateful_widget(table, area, &mut table_state);
    if empty && area.height > 2 {
        let note = Rect {
            y: area.y + 2,
            height: 1,
            ..area
        };
        frame.render_widget(
            Paragraph::new("no live sites yet (waiting for the next interval)")
                .style(Style::new().fg(Color::DarkGray)),
            note,
        );
    }
}

fn stack_lines(state: &State) -> (String, Vec<Line<'static>>) {
    let Some(row) = state.selected() else {
        return (" stack ".into(), vec![Line::from("no site selected")]);
    };
    let title = format!(
        " #{} {} — {} in {} blocks ({} {}) ",
        row.rank,
        row.top,
        human_bytes(row.bytes),
        row.count,
        row.allocator,
        row.memory
    );
    let mut lines: Vec<Line<'static>> = row
        .stack
        .iter()
        .enumerate()
        .map(|(i, frame)| {
            if row.stack_python.get(i).copied().unwrap_or(false) {
                Line::from(vec![
                    Span::raw(format!("#{i:<2} ")),
                    py_tag(),
                    Span::raw(" "),
                    Span::styled(frame.clone(), py_style()),
                ])
            } else {
                Line::from(format!("#{i:<2} {frame}"))
            }
        })
        .collect();
    if lines.is_empty() {
        lines.push(Line::from(
            row.note
                .clone()
                .unwrap_or_else(|| "no stack captured".to_string()),
        ));
    }
    (title, lines)
}

fn stack_pane(frame: &mut Frame<'_>, state: &State, area: Rect) {
    let (title, mut lines) = stack_lines(state);
    let room = usize::from(area.height.saturating_sub(1));
    if lines.len() > room && room > 0 {
        let more = lines.len() - room + 1;
        lines.truncate(room - 1);
        lines.push(Line::from(Span::styled(
            format!("… {more} more frames (Enter: whole stack)"),
            Style::new().fg(Color::DarkGray),
        )));
    }
    frame.render_widget(
        Paragraph::new(lines).block(Block::new().borders(Borders::TOP).title(title)),
        area,
    );
}

fn stack_full(frame: &mut Frame<'_>, state: &State, area: Rect) {
    let (title, lines) = stack_lines(state);
    let scroll = state.stack_view.unwrap_or(0);
    let shown: Vec<Line<'static>> = lines.into_iter().skip(scroll).collect();
    frame.render_widget(
        Paragraph::new(shown)
            .wrap(Wrap { trim: false })
            .block(Block::new().borders(Borders::TOP).title(title)),
        area,
    );
}

fn help(frame: &mut Frame<'_>, area: Rect) {
    let text = vec![
        Line::from("↑/↓ j/k     select a site (PgUp/PgDn, Home/End)"),
        Line::from("Enter →     the selected site's whole stack (Esc: back)"),
        Line::from("s b g c     sort by suspicion, bytes, growth, count"),
        Line::from("a           next allocator filter (then all)"),
        Line::from("p space     pause the view (tracing goes on)"),
        Line::from("Ctrl-L      repaint the screen"),
        Line::from("q Ctrl-C    quit: the final report is written"),
    ];
    let width = area.width.min(62);
    let height = area.height.min(9);
    let popup = Rect {
        x: area.x + (area.width - width) / 2,
        y: area.y + (area.height - height) / 2,
        width,
        height,
    };
    frame.render_widget(Clear, popup);
    frame.render_widget(
        Paragraph::new(text).block(Block::new().borders(Borders::ALL).title(" keys ")),
        popup,
    );
}

#[cfg(test)]
mod tests {
    use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    use super::*;
    use crate::live::state::tests::state;

    fn screen(state: &mut State, width: u16, height: u16) -> String {
        let mut terminal = Terminal::new(TestBackend::new(width, height)).expect("terminal");
        terminal
            .draw(|frame| {
                draw(
                    frame,
                    state,
                    Some("memtrace: probing newly loaded libfoo.so"),
                )
            })
            .expect("draws");
        let buffer = terminal.backend().buffer();
        let mut text = String::new();
        for y in 0..buffer.area.height {
            for x in 0..buffer.area.width {
                text.push_str(buffer[(x, y)].symbol());
            }
            text.push('\n');
        }
        text
    }

    #[test]
    fn a_full_screen_shows_header_sites_and_the_selected_stack() {
        let mut state = state();
        let text = screen(&mut state, 140, 30);
        assert!(text.contains("app (pid 4242)"), "{text}");
        assert!(text.contains("lost 0"), "{text}");
        assert!(text.contains("libc host"), "{text}");
        assert!(text.contains("cuda device 4.0 KiB"), "{text}");
        assert!(text.contains("alloc_buffers"), "{text}");
        assert!(text.contains("growing"), "{text}");
        assert!(
            text.contains("#0  alloc_buffers  app.c:42  app+0x600"),
            "{text}"
        );
        assert!(text.contains("#1  main  app.c:7"), "{text}");
        assert!(text.contains("probing newly loaded"), "{text}");
        assert!(text.contains("sort: suspicion"), "{text}");
    }

    #[test]
    fn python_frames_carry_a_py_tag_and_their_colour() {
        let mut report = crate::sink::fixture::report();
        let python = crate::report::Frame {
            kind: crate::report::FrameKind::Python,
            addr: String::new(),
            symbol: Some("Cache.put".into()),
            module: None,
            file: Some("/srv/app/cache.py".into()),
            line: Some(41),
            offset: None,
            inlined: Vec::new(),
        };
        report.sites[0].frames.insert(0, python);
        let mut state = State::default();
        state.update(&report);
        let mut terminal = Terminal::new(TestBackend::new(140, 30)).expect("terminal");
        terminal
            .draw(|frame| draw(frame, &mut state, None))
            .expect("draws");
        let buffer = terminal.backend().buffer();
        let lines: Vec<String> = (0..buffer.area.height)
            .map(|y| {
                (0..buffer.area.width)
                    .map(|x| buffer[(x, y)].symbol())
                    .collect()
            })
            .collect();
        let find = |needle: &str| -> (u16, u16) {
            lines
                .iter()
                .enumerate()
                .find_map(|(y, l)| {
                    l.find(needle)
                        .map(|x| (l[..x].chars().count() as u16, y as u16))
                })
                .unwrap_or_else(|| panic!("{needle}:\n{}", lines.join("\n")))
        };
        // The stack pane: "#0  py Cache.put (cache.py:41)", native frames
        // below as before.
        let (x, y) = find("#0  py Cache.put (cache.py:41)");
        let tag = &buffer[(x + 4, y)];
        assert_eq!((tag.bg, tag.fg), (Color::Yellow, Color::Black));
        assert_eq!(buffer[(x + 7, y)].fg, Color::LightBlue);
        let (x, y) = find("#1  alloc_buffers  app.c:42");
        assert_eq!(
            buffer[(x + 4, y)].fg,
            Color::Reset,
            "native frames stay plain"
        );
        // The sites table's top frame too (the selected row's highlight
        // covers its colours).
        let (_, table_y) = find("py Cache.put");
        assert!(table_y < y, "the sites table shows the py tag");
    }

    #[test]
    fn long_cpp_names_keep_their_last_names_in_view() {
        let name = "c10::impl::wrap_kernel_functor_unboxed_<c10::impl::detail::WrapFunctionIntoFunctor_<c10::CompileTimeFunctionPointer<at::Tensor (c10::DispatchKeySet, at::Tensor const&), &at::empty_strided> > >::call(c10::OperatorKernel*, c10::DispatchKeySet, at::Tensor const&)";
        let mut report = crate::sink::fixture::report();
        report.sites[0].frames[0].symbol = Some(name.into());
        let mut state = State::default();
        state.update(&report);
        assert_eq!(
            state.visible()[0].top,
            "c10::impl::wrap_kernel_functor_unboxed_<…>::call(…)"
        );
        let text = screen(&mut state, 80, 24);
        // At 80 columns the top-frame column (25 wide) keeps the name's end.
        assert!(text.contains(" …tor_unboxed_<…>::call(…)\n"), "{text}");
        assert!(
            text.contains("#0  c10::impl::wrap_kernel_functor_unboxed_<…>::call(…)  app.c:42"),
            "{text}"
        );
        assert!(!text.contains("OperatorKernel"), "{text}");
        // Wide enough: whole.
        let text = screen(&mut state, 160, 24);
        assert!(
            text.contains(" c10::impl::wrap_kernel_functor_unboxed_<…>::call(…)"),
            "{text}"
        );
        // --full-names: as symbolized (cut by the terminal's edge only).
        let mut state = State::default();
        state.names = Names::Full;
        state.update(&report);
        assert_eq!(state.visible()[0].top, name);
        let text = screen(&mut state, 80, 24);
        assert!(
            text.contains("#0  c10::impl::wrap_kernel_functor_unboxed_<c10::impl::"),
            "{text}"
        );
        for (width, height) in [(1, 1), (10, 5), (30, 10)] {
            screen(&mut state, width, height);
        }
    }

    #[test]
    fn selecting_another_site_shows_its_stack() {
        let mut state = state();
        state.key(KeyEvent::new(KeyCode::Down, KeyModifiers::NONE));
        let text = screen(&mut state, 140, 30);
        assert!(text.contains("#0  app+0x100"), "{text}");
        state.key(KeyEvent::new(KeyCode::Enter, KeyModifiers::NONE));
        let text = screen(&mut state, 60, 8);
        assert!(text.contains("#1  main  app.c:9"), "{text}");
    }

    #[test]
    fn tiny_and_odd_sizes_never_panic() {
        let mut state = state();
        for (w, h) in [
            (1, 1),
            (2, 1),
            (1, 5),
            (10, 2),
            (40, 10),
            (20, 4),
            (200, 3),
            (3, 60),
        ] {
            screen(&mut state, w, h);
            state.help = true;
            screen(&mut state, w, h);
            state.help = false;
            state.stack_view = Some(0);
            screen(&mut state, w, h);
            state.stack_view = None;
        }
        let text = screen(&mut state, 40, 10);
        assert!(text.contains("memtrace"), "{text}");
        let mut empty = State::default();
        let text = screen(&mut empty, 80, 12);
        assert!(text.contains("no live sites yet"), "{text}");
    }

    #[test]
    fn narrow_terminals_drop_the_minor_columns_first() {
        let names = |w| -> Vec<Column> { columns(w).into_iter().map(|(c, _)| c).collect() };
        assert_eq!(
            names(40),
            vec![Column::Rank, Column::Trend, Column::Bytes, Column::Top]
        );
        assert_eq!(names(140).len(), 8);
        let mut state = state();
        let text = screen(&mut state, 40, 10);
        assert!(text.contains("alloc_buffers"), "{text}");
        assert!(text.contains("growing"), "{text}");
        // The figures get a line of their own.
        assert!(
            text.lines()
                .nth(1)
                .is_some_and(|l| l.starts_with("refresh 1  traced 2.5s")),
            "{text}"
        );
    }

    #[test]
    fn pause_and_incomplete_show_in_the_header() {
        let mut state = state();
        state.key(KeyEvent::new(KeyCode::Char('p'), KeyModifiers::NONE));
        let mut report = crate::sink::fixture::report();
        report.complete = false;
        report.events.lost = 3;
        state.update(&report);
        let text = screen(&mut state, 120, 20);
        assert!(text.contains("PAUSED"), "{text}");
        state.key(KeyEvent::new(KeyCode::Char('p'), KeyModifiers::NONE));
        let text = screen(&mut state, 120, 20);
        assert!(text.contains("INCOMPLETE"), "{text}");
        assert!(text.contains("lost 3"), "{text}");
    }
}
