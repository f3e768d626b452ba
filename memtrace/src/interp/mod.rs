//! Interpreters whose own call stacks memtrace reads (CPython).

pub mod python;
