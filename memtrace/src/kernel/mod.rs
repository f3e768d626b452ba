//! The running kernel as memtrace sees it: what it offers ([`features`]:
//! probed, never assumed from the version), how the verifier's refusals read
//! ([`verifier`]: one line and a saved log), the eBPF object's stack budget
//! per call chain ([`stack_budget`]: static, from the ELF), and
//! `memtrace doctor` ([`doctor`]), which puts them on one screen with a load
//! test of every program in every stack mode; which build of the eBPF
//! programs the kernel gets ([`variant`]); the capabilities memtrace needs
//! ([`privilege`]: checked up front, the missing one named).

pub mod doctor;
pub mod features;
pub mod privilege;
pub mod stack_budget;
pub mod variant;
pub mod verifier;
