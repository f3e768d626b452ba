//! Readers of memory figures: procfs (process and system) and GPU sources.
//! Readers take a root directory so tests can point them at fixture trees.

pub mod gpu;
pub mod procfs;
