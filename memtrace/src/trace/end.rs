//! Stage 4 of a trace, the end: the window closes in one step (the
//! programs stop recording allocations; releases of earlier blocks still
//! count for a short grace), what the ring buffer and the kernel hold is
//! read, and the report is the state at that moment: written to the output,
//! the `--record` file, the metrics endpoint and, with `--pyroscope`, the
//! profile store (the probes are then detached before the push is waited
//! for). Detaching the probes
//! (seconds for many) comes after; on a kernel where the window cannot be
//! closed, the probes are detached first, in a safe order, while the ring
//! is still read.

use std::sync::Arc;
use std::time::{Duration, Instant};

use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;

use super::event_loop::DRAIN_EVERY;
use super::loader::{self, DetachStage, Probes};
use super::session::{monotonic_ns, Session};
use super::Trace;
use crate::report::leak::CheckPoint;

/// At the end of a trace, releases are still watched this long after the
/// allocation probes are detached (and again after the reallocation probes),
/// so blocks made just before the end and released just after are not
/// reported live.
const DETACH_GRACE: Duration = Duration::from_millis(50);
/// How long after the window closes releases of blocks made before it are
/// still applied (a block in use at that moment and freed just after is not
/// reported live), and programs that read the flag just before it flipped
/// finish.
const WINDOW_SETTLE: Duration = Duration::from_millis(50);

impl Trace<'_> {
    /// Ends the trace and writes the final report; true when a `--fail-on`
    /// gate of the leak check failed.
    pub async fn end(mut self) -> anyhow::Result<bool> {
        // The terminal is given back before the final report is written.
        self.live = None;
        let session = &mut self.session;
        let probes = &mut self.probes;
        let ring = &mut self.ring;
        // By pid, the last check sees the processes as they are now, while
        // the table still follows them.
        session.leak_check_live(ring.get_mut(), probes, CheckPoint::End);
        session.leak_check_not_reached();
        session.ended = Some((Instant::now(), monotonic_ns()));
        let ended_ns = session.ended.map_or_else(monotonic_ns, |e| e.1);
        // The window closes in one step: the programs stop recording
        // allocations (releases of earlier blocks still count for a short
        // grace), what they sent is read and what the kernel holds is taken,
        // and the report is the state at this moment. Detaching (seconds for
        // many probes) comes after the report is written.
        let closed = probes.close_window();
        if closed {
            // A program that read the flag just before it flipped finishes
            // within microseconds.
            tokio::time::sleep(WINDOW_SETTLE).await;
            session.pipeline.drain_all(ring.get_mut(), probes);
        }
        session.pipeline.close(ended_ns);
        if !closed {
            let watched = session.family.running().next().is_some();
            probes.mark_ending();
            for stage in DetachStage::ORDER {
                let detaching = probes.detach_stage(stage);
                close_while_draining(detaching, session, ring, probes).await;
                if watched && stage != DetachStage::Releases {
                    tokio::time::sleep(DETACH_GRACE).await;
                    session.pipeline.drain(ring.get_mut(), probes);
                }
            }
            let detaching = probes.detach();
            close_while_draining(detaching, session, ring, probes).await;
        }
        session.snapshot(probes);
        let mut report = session.report(probes, &self.discovery);
        if let Some(recorder) = session.pipeline.recorder.take() {
            let ended_ns = session.ended.map_or_else(monotonic_ns, |e| e.1);
            recorder.finish(
                &report,
                ended_ns,
                session.pipeline.thread_names(),
                Some(&session.leak.verdicts),
                &mut session.symbolizer,
            )?;
        }
        // With a push to a profile store, the report waits for it (a bounded
        // time) to say what became of it: the probes go first, so that the
        // traced process does not keep trapping into them meanwhile.
        let detach_first = closed && self.output.pushes();
        if detach_first {
            let detaching = probes.detach();
            let _ = tokio::task::spawn_blocking(move || detaching.close_at_once()).await;
        }
        let written = self.output.finish(&mut report);
        if let Some(tx) = &self.metrics {
            let _ = tx.send(Arc::new(crate::prometheus::render(&report)));
        }
        written?;
        let failed_gates = report
            .leak_check
            .as_ref()
            .map(|check| check.failed_gates.clone())
            .unwrap_or_default();
        if !failed_gates.is_empty() {
            eprintln!(
                "memtrace: leak check failed --fail-on: {} (exit {})",
                failed_gates.join(", "),
                crate::error::EXIT_LEAKS
            );
        }
        if closed && !detach_first {
            // Nothing is recorded any more: the probes only need to go.
            let detaching = probes.detach();
            let _ = tokio::task::spawn_blocking(move || detaching.close_at_once()).await;
        }
        Ok(!failed_gates.is_empty())
    }
}

/// Detaches probes on a blocking thread while the event loop keeps reading
/// the ring buffer: closing a uprobe waits for an RCU grace period (seconds
/// for a few dozen in a VM), and a busy target fills the ring meanwhile, so
/// releases after the end would otherwise be lost.
async fn close_while_draining(
    detaching: loader::Detaching,
    session: &mut Session<'_>,
    ring: &mut AsyncFd<RingBuf<MapData>>,
    probes: &Probes,
) {
    let mut closing = tokio::task::spawn_blocking(move || detaching.close());
    loop {
        tokio::select! {
            _ = &mut closing => break,
            _ = tokio::time::sleep(DRAIN_EVERY) => session.pipeline.drain(ring.get_mut(), probes),
        }
    }
    session.pipeline.drain_all(ring.get_mut(), probes);
}
