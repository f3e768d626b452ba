//! PLACEHOLDER until the real module lands (helper is writing it).
#![allow(dead_code)]
#[derive(Clone, Copy, Debug)]
pub struct Node {
    pub start: u64,
    pub size: u64,
    pub scan: bool,
    pub runtime_owned: bool,
}
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootRegion {
    pub start: u64,
    pub len: u64,
    pub runtime_owned: bool,
}
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Category {
    DefinitelyLost,
    IndirectlyLost,
    PossiblyLost,
    StillReachable,
}
impl Category {
    pub const ALL: [Category; 4] = [
        Category::DefinitelyLost,
        Category::IndirectlyLost,
        Category::PossiblyLost,
        Category::StillReachable,
    ];
}
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heuristic {
    StdString,
    Length64,
    NewArray,
    MultipleInheritance,
}
impl Heuristic {
    pub fn name(&self) -> &'static str {
        "x"
    }
}
#[derive(Clone, Copy, Debug)]
pub struct Verdict {
    pub category: Category,
    pub heuristic: Option<Heuristic>,
}
pub trait Memory {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> usize;
}
pub struct Input<'a> {
    pub nodes: &'a [Node],
    pub roots: &'a [RootRegion],
    pub registers: &'a [u64],
    pub vtable: &'a dyn Fn(u64) -> bool,
}
pub struct Outcome {
    pub verdicts: Vec<Verdict>,
    pub scanned_bytes: u64,
    pub unreadable_bytes: u64,
    pub words: u64,
}
pub fn classify(input: &Input, _memory: &mut dyn Memory) -> Outcome {
    Outcome {
        verdicts: input
            .nodes
            .iter()
            .map(|_| Verdict {
                category: Category::DefinitelyLost,
                heuristic: None,
            })
            .collect(),
        scanned_bytes: 0,
        unreadable_bytes: 0,
        words: 0,
    }
}
