//! Per-site live bytes over time: the live table is snapshotted at every
//! interval into bounded per-site series, from which trends are judged.

use std::collections::HashMap;

use super::SiteSeries;
use crate::event::StackRef;
use crate::probe::catalog::{Allocator, Memory};
use crate::probe::SpecEntry;
use crate::report::TimelineSample;
use crate::table::LiveTable;

/// A site: one stack, allocator and kind of memory.
pub type SiteKey = (Allocator, Memory, StackRef);

/// Snapshots of the live table, one per interval.
#[derive(Default)]
pub struct History {
    series: SiteSeries<SiteKey>,
    /// Seconds since start at each snapshot.
    pub interval_ends: Vec<f64>,
    pub timeline: Vec<TimelineSample>,
}

impl History {
    /// Records the table as it is `t_s` seconds after tracing started.
    pub fn record(&mut self, table: &LiveTable, specs: &[SpecEntry], t_s: f64) {
        let mut sites: HashMap<SiteKey, (u64, u64)> = HashMap::new();
        let mut totals: HashMap<(Allocator, Memory), (u64, u64)> = HashMap::new();
        for (_, _, _, block) in table.blocks() {
            let Some(spec) = specs.get(usize::from(block.spec)) else {
                continue;
            };
            let site = sites
                .entry((spec.allocator, spec.memory, block.stack))
                .or_default();
            site.0 += block.size;
            site.1 += 1;
            let total = totals.entry((spec.allocator, spec.memory)).or_default();
            total.0 += block.size;
            total.1 += 1;
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
    }

    /// The live-bytes series of a site.
    pub fn series(&self, key: &SiteKey) -> &[(f64, f64)] {
        self.series.series(key).unwrap_or(&[])
    }
}
