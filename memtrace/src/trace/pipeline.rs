//! The event pipeline: ring-buffer records decoded into events, applied to
//! the live table, with each new stack read once and normalized.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use aya::maps::{MapData, RingBuf};

use crate::event::{self, Action, Event, StackRef};
use crate::probe::maps::{self, AddressSpace};
use crate::record::Recorder;
use crate::stacks::StackStore;
use crate::table::LiveTable;
use crate::trace::loader::Probes;

/// Mappings are re-read at most this often when a stack has unknown frames.
const MAPS_REFRESH: Duration = Duration::from_millis(200);

pub struct Pipeline {
    pid: u32,
    table: LiveTable,
    stacks: StackStore,
    space: AddressSpace,
    space_read: Option<Instant>,
    thread_names: HashMap<u32, String>,
    /// Where the stream is recorded (`--record`).
    pub recorder: Option<Recorder>,
    pub decode_errors: u64,
}

impl Pipeline {
    /// `max_live`: most live blocks tracked before new ones are counted as `table_full`.
    pub fn new(pid: u32, max_live: usize) -> Self {
        Pipeline {
            pid,
            table: LiveTable::new(max_live),
            stacks: StackStore::default(),
            space: AddressSpace::default(),
            space_read: None,
            thread_names: HashMap::new(),
            recorder: None,
            decode_errors: 0,
        }
    }

    pub fn table(&self) -> &LiveTable {
        &self.table
    }

    pub fn stacks(&self) -> &StackStore {
        &self.stacks
    }

    /// Names of the threads seen allocating.
    pub fn thread_names(&self) -> &HashMap<u32, String> {
        &self.thread_names
    }

    /// Drains every record waiting in the ring buffer.
    pub fn drain(&mut self, ring: &mut RingBuf<MapData>, probes: &Probes) {
        if let Some(recorder) = self.recorder.as_mut() {
            recorder.specs(probes.specs());
        }
        while let Some(record) = ring.next() {
            match event::decode_wire(&record).and_then(|wire| {
                if let Some(recorder) = self.recorder.as_mut() {
                    recorder.event(&wire);
                }
                event::from_wire(&wire)
            }) {
                Ok(event) => self.handle(&event, probes),
                Err(err) => {
                    self.decode_errors += 1;
                    log::debug!("undecodable event: {err}");
                }
            }
        }
    }

    fn handle(&mut self, event: &Event, probes: &Probes) {
        let Some(spec) = probes.specs().get(usize::from(event.spec)) else {
            self.decode_errors += 1;
            return;
        };
        if let Action::Alloc {
            stack: StackRef::Id(id),
            ..
        }
        | Action::Realloc {
            stack: StackRef::Id(id),
            ..
        } = event.action
        {
            self.learn_stack(id, probes);
        }
        self.table.apply(event, spec.domain);
        if !self.thread_names.contains_key(&event.tid) {
            let name =
                std::fs::read_to_string(format!("/proc/{}/task/{}/comm", self.pid, event.tid))
                    .map(|n| n.trim().to_string())
                    .unwrap_or_default();
            self.thread_names.insert(event.tid, name);
        }
    }

    fn learn_stack(&mut self, id: u32, probes: &Probes) {
        if self.stacks.contains(id) {
            return;
        }
        let Some(ips) = probes.stack(id) else {
            return;
        };
        if self.space.is_empty() {
            self.refresh_space();
        }
        self.stacks.insert(id, &ips, &self.space);
        if self.stacks.has_unresolved(id) && self.refresh_space() {
            self.stacks.insert(id, &ips, &self.space);
        }
        if let (Some(recorder), Some(frames)) = (self.recorder.as_mut(), self.stacks.get(id)) {
            recorder.stack(id, frames);
        }
    }

    /// Re-reads the target's mappings now (the target is about to exit).
    pub fn refresh_space_now(&mut self) {
        self.space_read = None;
        self.refresh_space();
    }

    /// Re-reads the target's mappings (rate-limited); true when it did.
    fn refresh_space(&mut self) -> bool {
        if self
            .space_read
            .is_some_and(|at| at.elapsed() < MAPS_REFRESH)
        {
            return false;
        }
        self.space_read = Some(Instant::now());
        match maps::read(self.pid) {
            Ok(mappings) => {
                self.space = AddressSpace::new(mappings);
                true
            }
            Err(_) => false,
        }
    }
}
