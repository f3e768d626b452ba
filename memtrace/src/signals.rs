//! Stop flags for the commands that run a plain loop (`memtrace monitor`,
//! `memtrace watch`): SIGINT and SIGTERM (and, when asked, SIGHUP) set an
//! [`AtomicBool`] from a thread of their own, which the loop reads between
//! ticks, so a Ctrl-C still ends in the outputs being written.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::signal::unix::{signal, Signal, SignalKind};

/// Sets `stop` on SIGINT or SIGTERM and, when given, `hangup` on SIGHUP.
/// When a handler cannot be installed, the flags are never set.
pub fn set_flags_on_signals(stop: Arc<AtomicBool>, hangup: Option<Arc<AtomicBool>>) {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    let signals = {
        let _guard = rt.enter();
        (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
            hangup
                .as_ref()
                .map(|_| signal(SignalKind::hangup()))
                .transpose(),
        )
    };
    let (Ok(mut int), Ok(mut term), Ok(mut hang)) = signals else {
        return;
    };
    std::thread::spawn(move || {
        rt.block_on(async {
            loop {
                tokio::select! {
                    _ = int.recv() => stop.store(true, Ordering::SeqCst),
                    _ = term.recv() => stop.store(true, Ordering::SeqCst),
                    _ = next(&mut hang) => {
                        if let Some(flag) = &hangup {
                            flag.store(true, Ordering::SeqCst);
                        }
                    }
                }
            }
        });
    });
}

/// The next delivery of `signal`; never, without one.
async fn next(signal: &mut Option<Signal>) -> Option<()> {
    match signal {
        Some(signal) => signal.recv().await,
        None => std::future::pending().await,
    }
}
