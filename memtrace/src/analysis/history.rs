//! Per-site live bytes over time: the live table is snapshotted at every
//! interval into bounded per-site series, from which trends are judged.

use std::collections::HashMap;

use super::SiteSeries;
use crate::event::StackRef;
use crate::model::TimelineSample;
use crate::probe::catalog::{Allocator, Memory};
use crate::probe::SpecEntry;
use crate::stacks::StackStore;
use crate::table::LiveTable;

/// A site: one stack (native, and Python by canonical id, 0 for none),
/// allocator and kind of memory.
pub type SiteKey = (Allocator, Memory, StackRef, u32);

/// A site empty for this many intervals in a row is forgotten.
const FORGET_IDLE_AFTER: u64 = 60;
/// Most snapshot times kept in the timeline; past it every other one is
/// dropped, so a long trace keeps an even, bounded timeline.
const MAX_TIMELINE_SNAPSHOTS: usize = 2048;

/// Snapshots of the live table, one per interval.
#[derive(Default)]
pub struct History {
    series: SiteSeries<SiteKey>,
    /// Seconds since start at each snapshot.
    pub interval_ends: Vec<f64>,
    pub timeline: Vec<TimelineSample>,
    /// Snapshot times in `timeline`.
    timeline_snapshots: usize,
}

impl History {
    /// Records the table as it is `t_s` seconds after tracing started.
    pub fn record(
        &mut self,
        table: &LiveTable,
        specs: &[SpecEntry],
        stacks: &StackStore,
        t_s: f64,
    ) {
        let mut sites: HashMap<SiteKey, (u64, u64)> = HashMap::new();
        let mut totals: HashMap<(Allocator, Memory), (u64, u64)> = HashMap::new();
        for (origin, live) in table.origins() {
            let Some(spec) = specs.get(usize::from(origin.spec)) else {
                continue;
            };
            let site = sites
                .entry((
                    spec.allocator,
                    spec.memory,
                    stacks.canonical(origin.stack),
                    stacks.python.canonical(origin.py_stack),
                ))
                .or_default();
            site.0 += live.bytes;
            site.1 += live.blocks;
            let total = totals.entry((spec.allocator, spec.memory)).or_default();
            total.0 += live.bytes;
            total.1 += live.blocks;
        }
        // Sites that emptied since the last snapshot record a zero.
        let gone: Vec<SiteKey> = self
            .series
            .keys()
            .filter(|key| !sites.contains_key(*key))
            .cloned()
            .collect();
        for key in gone {
            self.series.record(&key, t_s, 0, 0);
        }
        for (key, (bytes, count)) in sites {
            self.series.record(&key, t_s, bytes, count);
        }
        self.series.forget_idle(FORGET_IDLE_AFTER);
        let mut totals: Vec<_> = totals.into_iter().collect();
        totals.sort();
        let t_ms = (t_s * 1000.0) as u64;
        self.timeline.extend(totals.into_iter().map(
            |((allocator, memory), (live_bytes, live_count))| TimelineSample {
                t_ms,
                allocator,
                memory,
                live_bytes,
                live_count,
            },
        ));
        self.interval_ends.push(t_s);
        self.timeline_snapshots += 1;
        if self.timeline_snapshots > MAX_TIMELINE_SNAPSHOTS {
            self.thin_timeline();
        }
    }

    /// Drops every other snapshot time from the timeline (oldest kept).
    fn thin_timeline(&mut self) {
        let mut times: Vec<u64> = self.timeline.iter().map(|s| s.t_ms).collect();
        times.dedup();
        let keep: std::collections::HashSet<u64> = times.iter().step_by(2).copied().collect();
        self.timeline.retain(|s| keep.contains(&s.t_ms));
        self.timeline_snapshots = keep.len();
    }

    /// The live-bytes series of a site.
    pub fn series(&self, key: &SiteKey) -> &[(f64, f64)] {
        self.series.series(key).unwrap_or(&[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Action, Event};
    use crate::probe::catalog::Domain;

    #[test]
    fn timeline_stays_bounded_over_a_long_trace() {
        let mut table = LiveTable::new(10);
        table.apply(
            &Event {
                ts_ns: 1,
                pid: 1,
                tid: 1,
                spec: 0,
                py_stack: 0,
                action: Action::Alloc {
                    addr: 0x10,
                    size: 8,
                    stack: StackRef::NotRequested,
                },
            },
            Domain::Heap,
        );
        let specs = [SpecEntry {
            function: "malloc",
            allocator: Allocator::Libc,
            memory: Memory::Host,
            domain: Domain::Heap,
            module: None,
            estimate: false,
        }];
        let stacks = StackStore::default();
        let mut history = History::default();
        for i in 0..10_000u32 {
            history.record(&table, &specs, &stacks, f64::from(i));
        }
        let mut times: Vec<u64> = history.timeline.iter().map(|s| s.t_ms).collect();
        times.dedup();
        assert!(times.len() <= MAX_TIMELINE_SNAPSHOTS, "{}", times.len());
        assert!(times.len() > MAX_TIMELINE_SNAPSHOTS / 2);
        assert_eq!(times.first(), Some(&0));
        assert!(times.windows(2).all(|w| w[0] < w[1]));
    }
}
