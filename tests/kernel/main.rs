//! The privileged kernel suite: the real memtrace binary attaches real eBPF
//! uprobes to real C fixture processes, and the JSON report is checked against
//! what each fixture is known to leak. Needs root (see `support::privileged`).

mod support;

mod accuracy;
mod allocators;
mod analysis;
mod bad_input;
mod compat;
mod containers;
mod core_host;
mod counters;
mod docker;
mod forks;
mod gpu;
mod headroom;
mod in_flight;
mod leak;
mod outputs;
mod pairs;
mod privilege;
mod push;
mod python;
mod reference;
mod reliability;
mod settle;
mod snapshot;
mod unwind;
mod usdt;
mod visual;
mod watch;
