//! What to probe and where: the function catalogue, `/proc/PID/maps`, ELF
//! symbol lookup, probe placement and the attach plan.

pub mod catalog;
pub mod elf;
pub mod maps;
pub mod pairs;
pub mod placement;
pub mod plan;
pub mod plan_cache;
pub mod usdt;
pub mod usdt_list;
pub mod usdt_plan;

use catalog::{Allocator, Domain, FuncDef, Memory};

/// What the user side knows of one attached spec (indexed like the `SPECS` map).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecEntry {
    pub function: &'static str,
    pub allocator: Allocator,
    pub memory: Memory,
    pub domain: Domain,
    /// The object defining the function, as the target names it (unknown in
    /// records of older versions).
    pub module: Option<&'static str>,
    /// Its sizes are estimates (a sampler's weighted bytes: `weight =` in
    /// a USDT pair, the `otel-memory` preset).
    pub estimate: bool,
}

impl From<&FuncDef> for SpecEntry {
    fn from(def: &FuncDef) -> Self {
        SpecEntry {
            function: def.name,
            allocator: def.allocator,
            memory: def.memory,
            domain: def.domain,
            module: None,
            estimate: def.usdt.is_some_and(|point| point.estimate),
        }
    }
}
