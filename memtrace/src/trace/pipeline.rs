//! The event pipeline: ring-buffer records decoded into events, applied to
//! the live table, with each new stack read once and normalized against the
//! address map of the process that made it. Fork reports (`--follow-forks`)
//! are queued for the session, which attaches the children.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use aya::maps::{MapData, RingBuf};
use memtrace_common::{EventKind, WireEvent, HELD_SLOTS};

use crate::event::{self, Action, Event, StackRef};
use crate::probe::maps::{self, AddressSpace};
use crate::record::Recorder;
use crate::stacks::StackStore;
use crate::table::LiveTable;
use crate::trace::held::Take;
use crate::trace::loader::Probes;

/// Allocations the kernel held from one scan of its held table to the
/// next, this far apart, are taken from it (see `held`): the live table is
/// at most twice this much (one block per thread) behind.
const HELD_AGE: Duration = Duration::from_millis(50);

/// Mappings are re-read at most this often when a stack has unknown frames.
const MAPS_REFRESH: Duration = Duration::from_millis(200);

/// The address map of one traced process, re-read when needed.
#[derive(Default)]
struct ProcessSpace {
    space: AddressSpace,
    read_at: Option<Instant>,
    /// The image the process ran when the map was read: an `exec` since
    /// makes the map stale at once, whatever the rate limit.
    exe: Option<std::path::PathBuf>,
    /// Stacks of this process learned with frames the map did not cover
    /// (it was read before an exec or a dlopen): normalized again at the
    /// next read of the map. Bounded by [`MAX_UNRESOLVED`].
    unresolved: Vec<(u32, Vec<u64>)>,
}

/// Most stacks a process keeps waiting for a better map.
const MAX_UNRESOLVED: usize = 4096;

pub struct Pipeline {
    table: LiveTable,
    stacks: StackStore,
    spaces: HashMap<u32, ProcessSpace>,
    thread_names: HashMap<u32, String>,
    /// The process of each thread seen allocating.
    thread_process: HashMap<u32, u32>,
    /// Traced processes that reported a fork, with when (monotonic ns), not
    /// yet handled.
    pub forks: Vec<(u32, u64)>,
    /// Fork reports received since the session last took the count.
    pub forks_reported: u64,
    /// Processes whose mappings the kernel's unwinder found out of date.
    pub stale_maps: Vec<u32>,
    /// Where the stream is recorded (`--record`).
    pub recorder: Option<Recorder>,
    pub decode_errors: u64,
    /// When the first record was read from the ring (`-v`'s attach phases).
    pub first_event_at: Option<Instant>,
    /// When held allocations were last taken from the kernel.
    held_taken: Option<Instant>,
    /// Held allocations taken and not yet applied, in time order (see
    /// `read_ring`).
    held_buf: Vec<WireEvent>,
    /// The held table's states at its previous scan (see `Take::Unchanged`).
    held_seen: Vec<u64>,
    /// Held allocations of an old image's threads dropped before its
    /// exec's event is applied.
    held_dropped_at_exec: (u64, u64),
    /// Execs met in the stream, not yet taken ([`Pipeline::take_execs`]).
    execs: Vec<crate::table::ExecDrop>,
    /// Device index and stream of live USDT allocations that carry them.
    pub usdt_tags: crate::trace::usdt_probes::UsdtTags,
}

impl Pipeline {
    /// `max_live`: most live blocks tracked before new ones are counted as `table_full`.
    pub fn new(max_live: usize) -> Self {
        Pipeline {
            table: LiveTable::new(max_live),
            stacks: StackStore::default(),
            spaces: HashMap::new(),
            thread_names: HashMap::new(),
            thread_process: HashMap::new(),
            forks: Vec::new(),
            forks_reported: 0,
            stale_maps: Vec::new(),
            recorder: None,
            decode_errors: 0,
            first_event_at: None,
            held_taken: None,
            held_buf: Vec::new(),
            held_seen: Vec::new(),
            held_dropped_at_exec: (0, 0),
            execs: Vec::new(),
            usdt_tags: Default::default(),
        }
    }

    /// Marks the end of the trace (see [`LiveTable::close`]).
    pub fn close(&mut self, ended_ns: u64) {
        self.table.close(ended_ns);
        if let Some(recorder) = self.recorder.as_mut() {
            recorder.end(ended_ns);
        }
    }

    pub fn table(&self) -> &LiveTable {
        &self.table
    }

    pub fn stacks(&self) -> &StackStore {
        &self.stacks
    }

    pub fn stacks_mut(&mut self) -> &mut StackStore {
        &mut self.stacks
    }

    /// Names of the threads seen allocating.
    pub fn thread_names(&self) -> &HashMap<u32, String> {
        &self.thread_names
    }

    /// Threads seen allocating that have exited while their process runs on.
    pub fn exited_threads(&self) -> Vec<u32> {
        let mut gone: Vec<u32> = self
            .thread_process
            .iter()
            .filter(|&(&tid, &pid)| {
                tid != pid
                    && std::path::Path::new(&format!("/proc/{pid}")).exists()
                    && !std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
            })
            .map(|(&tid, _)| tid)
            .collect();
        gone.sort_unstable();
        gone
    }

    /// Takes the allocations the kernel has held for [`HELD_AGE`] (when
    /// that long has passed since the last look), then drains every record
    /// waiting in the ring buffer, in time order with the taken ones.
    pub fn drain(&mut self, ring: &mut RingBuf<MapData>, probes: &Probes) {
        if self.held_taken.is_none_or(|at| at.elapsed() >= HELD_AGE) {
            self.held_taken = Some(Instant::now());
            self.take_held(probes, false);
        }
        self.read_ring(ring, probes);
    }

    /// Takes every allocation the kernel holds and drains the ring buffer
    /// (the end of a trace, a process gone).
    pub fn drain_all(&mut self, ring: &mut RingBuf<MapData>, probes: &Probes) {
        self.take_held(probes, true);
        self.read_ring(ring, probes);
    }

    /// Applies the ring buffer's records, each taken allocation (see
    /// [`Pipeline::take_held`]) before the first record stamped after it,
    /// and the taken ones left at the end.
    ///
    /// A taken allocation is stamped when taken, so it can be later than
    /// records still in the ring: a release of an earlier block at the same
    /// address, made before the allocation (which reused the address) and
    /// so before the take, is in the ring by then, and must come first;
    /// applied after, it would find the later block and count as
    /// unmatched. A release of the taken block itself reads the clock
    /// after it sees the slot taken, so it comes after.
    fn read_ring(&mut self, ring: &mut RingBuf<MapData>, probes: &Probes) {
        if let Some(recorder) = self.recorder.as_mut() {
            recorder.specs(probes.specs());
        }
        let mut taken = std::mem::take(&mut self.held_buf);
        let mut next_taken = 0;
        while let Some(record) = ring.next() {
            self.first_event_at.get_or_insert_with(Instant::now);
            match event::decode_wire(&record) {
                Ok(wire) => {
                    while let Some(held) = taken.get(next_taken).filter(|h| h.ts_ns <= wire.ts_ns) {
                        let held = *held;
                        self.take(&held, probes);
                        next_taken += 1;
                    }
                    if wire.kind == EventKind::Exec as u8 {
                        self.before_exec(&wire, &mut taken, next_taken, probes);
                    }
                    self.take(&wire, probes);
                }
                Err(err) => {
                    self.decode_errors += 1;
                    log::debug!("undecodable event: {err}");
                }
            }
        }
        for held in taken.drain(..).skip(next_taken) {
            self.take(&held, probes);
        }
        self.held_buf = taken;
    }

    /// Process `wire.pid` ran exec (its event is next): what its other
    /// threads held in the kernel when they died with the old image is
    /// taken now and dropped, like every block of it, from the taken
    /// events still to apply too. The exec'ing thread and the leader sent
    /// theirs before the event; held events of the process's thread `pid`
    /// taken from now on are the new image's. (A thread the new image
    /// made in the moment since the exec, holding a block, loses it here;
    /// its release is then an unmatched free, counted.)
    fn before_exec(
        &mut self,
        wire: &WireEvent,
        taken: &mut Vec<WireEvent>,
        next_taken: usize,
        probes: &Probes,
    ) {
        let pid = wire.pid;
        let of_old_image = |h: &WireEvent| h.pid == pid && h.tid != pid;
        if let Some(held) = probes.held() {
            let mut now = Vec::new();
            held.take(Take::All, &mut now);
            // Stamped now: after every event taken before.
            taken.extend(now);
        }
        let mut kept = next_taken;
        for k in next_taken..taken.len() {
            if of_old_image(&taken[k]) {
                self.held_dropped_at_exec.0 += 1;
                self.held_dropped_at_exec.1 += taken[k].size;
            } else {
                taken[kept] = taken[k];
                kept += 1;
            }
        }
        taken.truncate(kept);
    }

    /// Takes held allocations, to be applied by the next
    /// [`Pipeline::read_ring`]: every one (`all`), or those held since the
    /// previous scan (at least [`HELD_AGE`]). They are stamped when taken,
    /// one after another, so in time order; they come late, after events of
    /// other threads made later, and the live table orders a block's events
    /// by time (see `LiveTable::apply`).
    fn take_held(&mut self, probes: &Probes, all: bool) {
        let Some(held) = probes.held() else {
            return;
        };
        if all {
            held.take(Take::All, &mut self.held_buf);
        } else {
            self.held_seen.resize(HELD_SLOTS as usize, 0);
            held.take(Take::Unchanged(&mut self.held_seen), &mut self.held_buf);
        }
    }

    fn take(&mut self, wire: &WireEvent, probes: &Probes) {
        if let Some(recorder) = self.recorder.as_mut() {
            recorder.event(wire);
        }
        self.usdt_tags.observe(wire, probes.specs());
        match event::from_wire(wire) {
            Ok(event) => self.handle(&event, probes),
            Err(err) => {
                self.decode_errors += 1;
                log::debug!("undecodable event: {err}");
            }
        }
    }

    fn handle(&mut self, event: &Event, probes: &Probes) {
        if let Action::MapsStale = event.action {
            if !self.stale_maps.contains(&event.pid) {
                self.stale_maps.push(event.pid);
            }
            return;
        }
        if let Action::Exec { old_tid } = event.action {
            log::debug!(
                "exec of pid {} (thread {}, {old_tid} before), at {} ns",
                event.pid,
                event.tid,
                event.ts_ns
            );
            // Every block of the old image goes (whatever its domain); the
            // new image's mappings are read at once.
            self.table.apply(event, crate::probe::catalog::Domain::Heap);
            let (held, held_bytes) = std::mem::take(&mut self.held_dropped_at_exec);
            for mut drop in self.table.take_execs() {
                drop.held = held;
                drop.blocks += held;
                drop.bytes += held_bytes;
                self.execs.push(drop);
            }
            if !self.stale_maps.contains(&event.pid) {
                self.stale_maps.push(event.pid);
            }
            // The old image's map goes (and its stacks still waiting for a
            // better one): the next stack reads the new image's.
            self.spaces.remove(&event.pid);
            // Its threads are named anew (the new image's `comm`).
            let (pid, threads) = (event.pid, &self.thread_process);
            self.thread_names
                .retain(|tid, _| threads.get(tid) != Some(&pid));
            return;
        }
        if let Action::Fork { .. } = event.action {
            self.forks_reported += 1;
            if !self.forks.iter().any(|&(pid, _)| pid == event.pid) {
                self.forks.push((event.pid, event.ts_ns));
            }
            return;
        }
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
            self.learn_stack(event.pid, id, probes);
        }
        if event.py_stack != 0 && !self.stacks.python.contains(event.py_stack) {
            self.learn_python_stack(event.pid, event.py_stack, probes);
        }
        self.table.apply(event, spec.domain);
        self.thread_process.entry(event.tid).or_insert(event.pid);
        self.thread_names.entry(event.tid).or_insert_with(|| {
            std::fs::read_to_string(format!("/proc/{}/task/{}/comm", event.pid, event.tid))
                .map(|n| n.trim().to_string())
                .unwrap_or_default()
        });
    }

    fn learn_stack(&mut self, pid: u32, id: u32, probes: &Probes) {
        if self.stacks.contains(id) {
            return;
        }
        let Some(ips) = probes.stack(id) else {
            return;
        };
        // A stack cut at an object whose table is still being built ends
        // in it: that table goes next.
        if let Some(&outermost) = ips.last() {
            probes.promote_unwind(pid, outermost);
        }
        let process = self.spaces.entry(pid).or_default();
        if process.space.is_empty() {
            process.refresh(pid);
        }
        self.stacks.insert(id, &ips, &process.space);
        if self.stacks.has_unresolved(id) && process.refresh(pid) {
            self.stacks.insert(id, &ips, &process.space);
            self.renormalize(pid);
        }
        if self.stacks.has_unresolved(id) {
            let process = self.spaces.entry(pid).or_default();
            if process.unresolved.len() < MAX_UNRESOLVED {
                process.unresolved.push((id, ips));
            }
        }
        if let (Some(recorder), Some(frames)) = (self.recorder.as_mut(), self.stacks.get(id)) {
            recorder.stack(id, frames);
        }
    }

    /// Resolves a Python stack the kernel stored, reading its code objects
    /// from the process now, while it runs.
    fn learn_python_stack(&mut self, pid: u32, id: u32, probes: &Probes) {
        let Some(raw) = probes.python_stack(id) else {
            log::debug!("pid {pid}: Python stack {id:#x} not in the kernel's map");
            return;
        };
        match crate::interp::python::resolve::ProcMem::open(pid) {
            Ok(mem) => self.stacks.python.learn(pid, id, &raw, &mem),
            Err(err) => log::debug!("pid {pid}: cannot read its memory: {err}"),
        }
        // The record keeps the frames: the code objects go with the target.
        if let (Some(recorder), Some(frames)) =
            (self.recorder.as_mut(), self.stacks.python.frames(id))
        {
            recorder.py_stack(id, frames, self.stacks.python.is_truncated(id));
        }
    }

    /// Normalizes again, against a map just read, the stacks of `pid` that
    /// an older map did not cover; the ones now complete leave the list.
    fn renormalize(&mut self, pid: u32) {
        let Some(process) = self.spaces.get_mut(&pid) else {
            return;
        };
        let waiting = std::mem::take(&mut process.unresolved);
        for (id, ips) in waiting {
            self.stacks.insert(id, &ips, &process.space);
            if let (Some(recorder), Some(frames)) = (self.recorder.as_mut(), self.stacks.get(id)) {
                recorder.stack(id, frames);
            }
            if self.stacks.has_unresolved(id) {
                process.unresolved.push((id, ips));
            }
        }
    }

    /// Re-reads a process's mappings now (it is about to exit, or exec'd).
    pub fn refresh_space_now(&mut self, pid: u32) {
        let process = self.spaces.entry(pid).or_default();
        process.read_at = None;
        if process.refresh(pid) {
            self.renormalize(pid);
        }
    }

    /// Takes mappings of `pid` just read for the kernel's unwinder: the
    /// stacks the unwinder walks through them must be symbolized against
    /// them too, even when the process is gone (or the rate-limited
    /// re-read skipped) by the time its events are read.
    pub fn observe_mappings(&mut self, pid: u32, mappings: &[maps::Mapping]) {
        let process = self.spaces.entry(pid).or_default();
        process.space = AddressSpace::new(mappings.to_vec());
        process.read_at = Some(Instant::now());
        process.exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        self.renormalize(pid);
    }

    /// Starts a child with its own mappings, or its parent's when it cannot
    /// be read (gone already): a forked child has its parent's layout until
    /// it execs.
    pub fn start_space(&mut self, child: u32, parent: u32) {
        self.refresh_space_now(child);
        let empty = self.spaces.get(&child).is_none_or(|c| c.space.is_empty());
        if empty {
            if let Some(space) = self.spaces.get(&parent).map(|p| p.space.clone()) {
                self.spaces.entry(child).or_default().space = space;
            }
        }
    }

    /// The execs met in the stream since the last call, each with the
    /// blocks of the old image it dropped.
    pub fn take_execs(&mut self) -> Vec<crate::table::ExecDrop> {
        std::mem::take(&mut self.execs)
    }

    /// `pid` ran `exec`: the blocks of its old image are gone (see
    /// [`LiveTable::forget_process`]).
    pub fn forget_blocks(&mut self, pid: u32) -> (u64, u64) {
        // (Blocks an exec event already dropped are in `take_execs`.)
        self.table.forget_process(pid)
    }

    /// Forgets the mappings of a process that is gone.
    pub fn forget_space(&mut self, pid: u32) {
        self.spaces.remove(&pid);
    }
}

impl ProcessSpace {
    /// Re-reads the mappings of `pid` (rate-limited); true when it did.
    fn refresh(&mut self, pid: u32) -> bool {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        if self.read_at.is_some_and(|at| at.elapsed() < MAPS_REFRESH) && exe == self.exe {
            return false;
        }
        self.read_at = Some(Instant::now());
        self.exe = exe;
        match maps::read(pid) {
            Ok(mappings) => {
                self.space = AddressSpace::new(mappings);
                true
            }
            Err(_) => false,
        }
    }
}
