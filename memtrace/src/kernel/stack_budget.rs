//! The eBPF object's stack budget, computed statically from its ELF: every
//! call chain's combined stack, as the verifier sums it (program ->
//! bpf-to-bpf or global function -> `bpf_loop` callback -> nested callback),
//! against the 512-byte limit.
//!
//! The verifier prints stack depths only in a successful load's statistics,
//! which aya 0.14 does not hand back; so this reads the code instead:
//! - a function's frame is its deepest r10-relative access, direct
//!   (`*(u64 *)(r10 - 8)`) or through a pointer derived from r10
//!   (`r1 = r10; r1 += -16`, a helper's argument), rounded up to 32 bytes as
//!   the interpreter and kernels before 6.9 round it (6.9+ with the JIT round
//!   to 16: 32 is the stricter of the two);
//! - edges are `call` with `src_reg = BPF_PSEUDO_CALL` (bpf-to-bpf and global
//!   functions) and `ld_imm64` with `src_reg = BPF_PSEUDO_FUNC` (a callback's
//!   address, as passed to `bpf_loop`: the callback runs as a frame on top of
//!   the function that passed it);
//! - cross-section calls are resolved through the object's relocations.
//!
//! It is an upper bound: code the verifier proves dead under a mode's
//! constants (`STACK_MODE`) counts here in every mode.

use std::collections::{BTreeMap, BTreeSet};

use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionKind, SymbolKind};
use serde::Serialize;

/// The verifier's limit on a chain's combined stack.
pub const STACK_LIMIT: u64 = 512;
/// The budget memtrace's programs are held to: the limit less 64 B of headroom.
pub const STACK_GOAL: u64 = 448;
/// Frame rounding used for the sums.
pub const ROUNDING: u64 = 32;

const BPF_PSEUDO_CALL: u8 = 1;
const BPF_PSEUDO_FUNC: u8 = 4;
const CALL: u8 = 0x85;
/// `BPF_FUNC_tail_call`.
const HELPER_TAIL_CALL: i32 = 12;
const LD_IMM64: u8 = 0x18;

/// Why an object could not be analysed.
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error("the eBPF object is empty (built without `cargo xtask build-ebpf`)")]
    Empty,
    #[error("cannot parse the eBPF object: {0}")]
    Parse(#[from] object::Error),
    #[error("the eBPF object has no programs")]
    NoPrograms,
}

/// One decoded instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insn {
    pub code: u8,
    pub dst: u8,
    pub src: u8,
    pub off: i16,
    pub imm: i32,
}

impl Insn {
    pub fn decode(bytes: &[u8]) -> Option<Insn> {
        let b: &[u8; 8] = bytes.get(..8)?.try_into().ok()?;
        Some(Insn {
            code: b[0],
            dst: b[1] & 0x0f,
            src: b[1] >> 4,
            off: i16::from_le_bytes([b[2], b[3]]),
            imm: i32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        })
    }
}

/// One function of the object: where its code is and what it is.
#[derive(Clone, Debug)]
pub struct Function {
    pub name: String,
    /// Index into the code sections given to [`analyze`].
    pub section: usize,
    /// First instruction (index in its section) and one past its last.
    pub start: usize,
    pub end: usize,
    /// A program (an entry point) rather than a subprogram.
    pub program: bool,
}

/// A code section's instructions and the call targets its relocations name
/// (instruction index -> (section, instruction index)).
#[derive(Clone, Debug, Default)]
pub struct Code {
    pub insns: Vec<Insn>,
    pub targets: BTreeMap<usize, (usize, usize)>,
}

/// One call chain and its combined stack.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct Chain {
    /// Program first.
    pub functions: Vec<String>,
    /// Each function's frame, rounded.
    pub frames: Vec<u64>,
    /// The chain's combined stack, in bytes: the sum of `frames`.
    pub bytes: u64,
}

impl Chain {
    /// `call_exit -> walk -> frame_callback = 600 B (288+192+128)`.
    pub fn describe(&self) -> String {
        let frames: Vec<String> = self.frames.iter().map(u64::to_string).collect();
        format!(
            "{} = {} B ({})",
            self.functions.join(" -> "),
            self.bytes,
            frames.join("+")
        )
    }
}

/// The whole object's budget.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Budget {
    /// The verifier's limit on a chain's combined stack, in bytes (512).
    pub limit: u64,
    /// The budget memtrace's programs are held to, in bytes: the limit less
    /// 64 bytes of headroom (448).
    pub goal: u64,
    /// What each frame is rounded up to in the sums, in bytes (32).
    pub rounding: u64,
    /// Each function's deepest stack access, unrounded.
    pub frames: BTreeMap<String, u64>,
    /// Every chain from a program to a leaf, largest first.
    pub chains: Vec<Chain>,
    /// Programs holding a tail call in their own code: kernels from 6.13
    /// never give them a private (per-CPU) stack, which a preemptible
    /// uprobe program must not have (see `no_private_stack` in the eBPF
    /// crate). The sums above are then the verifier's for them.
    pub private_stack_refused: Vec<String>,
}

impl Budget {
    /// The chains at or over [`STACK_GOAL`].
    pub fn over_goal(&self) -> Vec<&Chain> {
        self.chains
            .iter()
            .filter(|c| c.bytes >= self.goal)
            .collect()
    }

    /// The largest chain of each program.
    pub fn worst_per_program(&self) -> Vec<&Chain> {
        let mut seen = BTreeSet::new();
        self.chains
            .iter()
            .filter(|chain| {
                chain
                    .functions
                    .first()
                    .is_some_and(|p| seen.insert(p.clone()))
            })
            .collect()
    }
}

/// Reads an eBPF ELF object and computes its budget.
pub fn of_object(data: &[u8]) -> Result<Budget, BudgetError> {
    if data.is_empty() {
        return Err(BudgetError::Empty);
    }
    let file = object::File::parse(data)?;
    // Code sections, by ELF section index.
    let mut index_of = BTreeMap::new();
    let mut codes = Vec::new();
    let mut names = Vec::new();
    for section in file.sections() {
        if section.kind() != SectionKind::Text || section.size() == 0 {
            continue;
        }
        let bytes = section.data()?;
        let insns = bytes.chunks_exact(8).filter_map(Insn::decode).collect();
        index_of.insert(section.index().0, codes.len());
        codes.push(Code {
            insns,
            targets: BTreeMap::new(),
        });
        names.push(section.name().unwrap_or("").to_string());
    }
    // Relocated calls and callback references.
    for section in file.sections() {
        let Some(&here) = index_of.get(&section.index().0) else {
            continue;
        };
        for (offset, relocation) in section.relocations() {
            let RelocationTarget::Symbol(symbol) = relocation.target() else {
                continue;
            };
            let Ok(symbol) = file.symbol_by_index(symbol) else {
                continue;
            };
            let Some(&there) = symbol.section_index().and_then(|s| index_of.get(&s.0)) else {
                continue;
            };
            let at = usize::try_from(offset / 8).unwrap_or(usize::MAX);
            let Some(insn) = codes[here].insns.get(at).copied() else {
                continue;
            };
            let base = i64::try_from(symbol.address() / 8).unwrap_or(0);
            // As libbpf resolves them: a call's imm counts instructions from
            // the symbol, less one; an ld_imm64 of a code address (a
            // callback; `src_reg` is set to BPF_PSEUDO_FUNC only at load)
            // holds a byte offset from it.
            let target = match (insn.code, insn.src) {
                (CALL, BPF_PSEUDO_CALL) => base + i64::from(insn.imm) + 1,
                (LD_IMM64, _) => base + i64::from(insn.imm) / 8,
                _ => continue,
            };
            if let Ok(target) = usize::try_from(target) {
                codes[here].targets.insert(at, (there, target));
            }
        }
    }
    // Functions: the FUNC symbols; a program is one outside `.text`.
    let mut functions = Vec::new();
    for symbol in file.symbols() {
        if symbol.kind() != SymbolKind::Text {
            continue;
        }
        let Some(&section) = symbol.section_index().and_then(|s| index_of.get(&s.0)) else {
            continue;
        };
        let start = usize::try_from(symbol.address() / 8).unwrap_or(0);
        let len = usize::try_from(symbol.size() / 8).unwrap_or(0);
        let end = if len == 0 {
            codes[section].insns.len()
        } else {
            start + len
        };
        functions.push(Function {
            name: readable(symbol.name().unwrap_or("?")),
            section,
            start,
            end: end.min(codes[section].insns.len()),
            program: names[section] != ".text",
        });
    }
    analyze(&codes, &functions)
}

/// A Rust v0 symbol (`_RNvNtCs8Ub9xRen6Os_8memtrace6unwind14frame_callback`)
/// as its path (`memtrace::unwind::frame_callback`); other names as they are.
pub fn readable(name: &str) -> String {
    let Some(rest) = name.strip_prefix("_R") else {
        return name.to_string();
    };
    let bytes = rest.as_bytes();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        // A crate's disambiguator, `Cs<base62>_`, is not an identifier.
        if bytes[i] == b'C' && bytes.get(i + 1) == Some(&b's') {
            i = rest[i..].find('_').map_or(bytes.len(), |end| i + end + 1);
            continue;
        }
        if !bytes[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        let len: usize = rest[start..i].parse().unwrap_or(0);
        match rest.get(i..i + len) {
            Some(ident)
                if len > 0
                    && ident
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_') =>
            {
                parts.push(ident);
                i += len;
            }
            _ => {}
        }
    }
    if parts.is_empty() {
        name.to_string()
    } else {
        parts.join("::")
    }
}

/// The budget of `functions` over `codes` (pure).
pub fn analyze(codes: &[Code], functions: &[Function]) -> Result<Budget, BudgetError> {
    if !functions.iter().any(|f| f.program) {
        return Err(BudgetError::NoPrograms);
    }
    let by_start: BTreeMap<(usize, usize), usize> = functions
        .iter()
        .enumerate()
        .map(|(i, f)| ((f.section, f.start), i))
        .collect();
    let mut depth = Vec::with_capacity(functions.len());
    let mut callees: Vec<Vec<usize>> = Vec::with_capacity(functions.len());
    for function in functions {
        let code = &codes[function.section];
        let insns = code.insns.get(function.start..function.end).unwrap_or(&[]);
        depth.push(stack_depth(insns));
        let mut called = Vec::new();
        for (i, insn) in insns.iter().enumerate() {
            let at = function.start + i;
            let is_ref = match (insn.code, insn.src) {
                (CALL, BPF_PSEUDO_CALL) | (LD_IMM64, BPF_PSEUDO_FUNC) => true,
                // A relocated ld_imm64 of a code address: a callback.
                (LD_IMM64, _) => code.targets.contains_key(&at),
                _ => false,
            };
            if !is_ref {
                continue;
            }
            let target = code.targets.get(&at).copied().or_else(|| {
                // Resolved in place: relative to the next instruction.
                let target = i64::try_from(at).ok()? + i64::from(insn.imm) + 1;
                Some((function.section, usize::try_from(target).ok()?))
            });
            if let Some(callee) = target.and_then(|t| by_start.get(&t)) {
                if !called.contains(callee) {
                    called.push(*callee);
                }
            }
        }
        callees.push(called);
    }
    let round = |bytes: u64| bytes.max(1).div_ceil(ROUNDING) * ROUNDING;
    let mut chains = Vec::new();
    for (root, function) in functions.iter().enumerate() {
        if !function.program {
            continue;
        }
        let mut path = vec![root];
        walk(&callees, &mut path, &mut |path| {
            let frames: Vec<u64> = path.iter().map(|&f| round(depth[f])).collect();
            chains.push(Chain {
                functions: path.iter().map(|&f| functions[f].name.clone()).collect(),
                bytes: frames.iter().sum(),
                frames,
            });
        });
    }
    let private_stack_refused = functions
        .iter()
        .filter(|f| f.program)
        .filter(|f| {
            codes[f.section]
                .insns
                .get(f.start..f.end)
                .unwrap_or(&[])
                .iter()
                .any(|insn| insn.code == CALL && insn.src == 0 && insn.imm == HELPER_TAIL_CALL)
        })
        .map(|f| f.name.clone())
        .collect();
    chains.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.functions.cmp(&b.functions)));
    chains.dedup();
    Ok(Budget {
        limit: STACK_LIMIT,
        goal: STACK_GOAL,
        rounding: ROUNDING,
        frames: functions
            .iter()
            .zip(&depth)
            .map(|(f, &d)| (f.name.clone(), d))
            .collect(),
        chains,
        private_stack_refused,
    })
}

/// Calls `leaf` with every path from `path`'s last function to a function
/// that calls nothing (a cycle, which the verifier refuses, ends a path).
fn walk(callees: &[Vec<usize>], path: &mut Vec<usize>, leaf: &mut impl FnMut(&[usize])) {
    let Some(&last) = path.last() else {
        return;
    };
    let next: Vec<usize> = callees[last]
        .iter()
        .copied()
        .filter(|c| !path.contains(c))
        .collect();
    if next.is_empty() {
        leaf(path);
        return;
    }
    for callee in next {
        path.push(callee);
        walk(callees, path, leaf);
        path.pop();
    }
}

/// The deepest stack byte a function touches: r10-relative accesses, and
/// pointers derived from r10 (tracked through moves and constant adds).
pub fn stack_depth(insns: &[Insn]) -> u64 {
    const R10: usize = 10;
    let mut fp: [Option<i64>; 11] = [None; 11];
    fp[R10] = Some(0);
    let mut deepest: i64 = 0;
    let mut note = |offset: i64| {
        if offset < 0 {
            deepest = deepest.max(-offset);
        }
    };
    let mut skip = false;
    for insn in insns {
        if skip {
            skip = false;
            continue;
        }
        let dst = usize::from(insn.dst).min(R10);
        let src = usize::from(insn.src).min(R10);
        let off = i64::from(insn.off);
        let imm = i64::from(insn.imm);
        match insn.code & 0x07 {
            // LD: ld_imm64 takes two slots.
            0x00 => {
                if insn.code == LD_IMM64 {
                    skip = true;
                }
                if dst != R10 {
                    fp[dst] = None;
                }
            }
            // LDX: dst = *(src + off)
            0x01 => {
                if let Some(base) = fp[src] {
                    note(base + off);
                }
                if dst != R10 {
                    fp[dst] = None;
                }
            }
            // ST / STX: *(dst + off) = ...
            0x02 | 0x03 => {
                if let Some(base) = fp[dst] {
                    note(base + off);
                }
                // Atomics with fetch write the old value to src (cmpxchg to r0).
                if insn.code & 0xe0 == 0xc0 && insn.imm & 0x01 != 0 {
                    fp[src.min(9)] = None;
                    fp[0] = None;
                }
            }
            // ALU64
            0x07 if dst != R10 => {
                let from_reg = insn.code & 0x08 != 0;
                fp[dst] = match (insn.code & 0xf0, from_reg) {
                    (0xb0, true) => fp[src],
                    (0x00, false) => fp[dst].map(|base| base + imm),
                    (0x10, false) => fp[dst].map(|base| base - imm),
                    _ => None,
                };
                if let Some(offset) = fp[dst] {
                    note(offset);
                }
            }
            // JMP/JMP32: a call clobbers r0-r5.
            0x05 | 0x06 => {
                if insn.code == CALL {
                    for reg in fp.iter_mut().take(6) {
                        *reg = None;
                    }
                }
            }
            // ALU (32-bit) and anything else writing dst.
            _ => {
                if dst != R10 {
                    fp[dst] = None;
                }
            }
        }
    }
    u64::try_from(deepest).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn i(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
        Insn {
            code,
            dst,
            src,
            off,
            imm,
        }
    }

    const EXIT: Insn = Insn {
        code: 0x95,
        dst: 0,
        src: 0,
        off: 0,
        imm: 0,
    };

    /// The kernel suite's headroom test (tests/kernel/headroom.rs) holds the
    /// objects embedded for this host; this holds both architectures' full,
    /// tailcall and compat objects to the same budget (< 448 B per call
    /// chain), which matters more on arm64: no arm64 kernel gives BPF
    /// programs private stacks. The tailcall and compat objects' programs
    /// tail-call, so they must hold no BPF-to-BPF calls at all: arm64 kernels
    /// before 6.0 refuse a program with both (x86-64 allows it from 5.10).
    /// `cargo xtask test` builds all six objects first.
    #[test]
    fn every_architectures_objects_keep_64_bytes_of_stack_headroom() {
        let ebpf = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../memtrace-ebpf/target");
        let mut checked = 0;
        let dirs = [
            ("", false),
            ("tailcall", true),
            ("compat", true),
            ("aarch64", false),
            ("tailcall-aarch64", true),
            ("compat-aarch64", true),
        ];
        for (dir, tail_calls) in dirs {
            let path = ebpf.join(dir).join("bpfel-unknown-none/release/memtrace");
            let Ok(data) = std::fs::read(&path) else {
                continue;
            };
            let budget = of_object(&data).expect("the object's call chains");
            for chain in &budget.chains {
                assert!(
                    chain.bytes < 448,
                    "{}: {} = {} B",
                    path.display(),
                    chain.functions.join(" -> "),
                    chain.bytes
                );
                assert!(
                    !tail_calls || chain.functions.len() == 1,
                    "{}: a tail-calling program calls a BPF function: {}",
                    path.display(),
                    chain.functions.join(" -> ")
                );
            }
            checked += 1;
        }
        if checked < dirs.len() && std::env::var_os("MEMTRACE_REQUIRE_KERNEL_TESTS").is_some() {
            panic!("only {checked} of {} eBPF objects built: run `cargo xtask build-ebpf` and `cargo xtask build-ebpf --target aarch64-unknown-linux-gnu`", dirs.len());
        }
    }

    #[test]
    fn depth_counts_direct_and_derived_stack_pointers() {
        // *(u64 *)(r10 - 24) = r1; r2 = r10; r2 += -200; call helper; exit
        let insns = [
            i(0x7b, 10, 1, -24, 0),
            i(0xbf, 2, 10, 0, 0),
            i(0x07, 2, 0, 0, -200),
            i(0x85, 0, 0, 0, 1),
            EXIT,
        ];
        assert_eq!(stack_depth(&insns), 200);
        // A load through a derived pointer below its creation point.
        let insns = [
            i(0xbf, 3, 10, 0, 0),
            i(0x07, 3, 0, 0, -16),
            i(0x79, 4, 3, -8, 0),
            EXIT,
        ];
        assert_eq!(stack_depth(&insns), 24);
        // r2 is no longer a stack pointer after a call or a new value.
        let insns = [
            i(0xbf, 2, 10, 0, 0),
            i(0x85, 0, 0, 0, 1),
            i(0x07, 2, 0, 0, -400),
            i(0xb7, 3, 0, 0, 0),
            EXIT,
        ];
        assert_eq!(stack_depth(&insns), 0);
        // The second half of a ld_imm64 is not an instruction.
        let insns = [i(0x18, 1, 0, 0, 0), i(0x7b, 10, 1, -500, 0), EXIT];
        assert_eq!(stack_depth(&insns), 0);
    }

    /// prog (section 1) calls walk (.text at 0) via a relocation; walk passes
    /// callback (.text at 3) to a helper with ld_imm64 resolved in place.
    fn sample() -> (Vec<Code>, Vec<Function>) {
        let text = Code {
            insns: vec![
                i(0x7a, 10, 0, -200, 0), // walk: *(u64 *)(r10 - 200) = 0
                i(0x18, 2, 0, 0, 24),    // r2 = callback, through a relocation
                i(0, 0, 0, 0, 0),
                i(0x7a, 10, 0, -100, 0), // callback
                EXIT,
            ],
            targets: BTreeMap::from([(1, (0, 3))]),
        };
        let prog = Code {
            insns: vec![
                i(0x7a, 10, 0, -280, 0),
                i(0x85, 0, BPF_PSEUDO_CALL, 0, -1),
                i(0x85, 0, BPF_PSEUDO_CALL, 0, 0), // in place: to insn 3 (leaf)
                i(0x7a, 10, 0, -8, 0),
                EXIT,
            ],
            targets: BTreeMap::from([(1, (0, 0))]),
        };
        let functions = vec![
            Function {
                name: "walk".into(),
                section: 0,
                start: 0,
                end: 3,
                program: false,
            },
            Function {
                name: "callback".into(),
                section: 0,
                start: 3,
                end: 5,
                program: false,
            },
            Function {
                name: "call_exit".into(),
                section: 1,
                start: 0,
                end: 3,
                program: true,
            },
            Function {
                name: "leaf".into(),
                section: 1,
                start: 3,
                end: 5,
                program: false,
            },
        ];
        (vec![text, prog], functions)
    }

    #[test]
    fn chains_sum_rounded_frames_through_callbacks() {
        let (codes, functions) = sample();
        let budget = analyze(&codes, &functions).expect("analysed");
        assert_eq!(budget.frames["call_exit"], 280);
        assert_eq!(budget.frames["walk"], 200);
        assert_eq!(budget.frames["callback"], 100);
        let described: Vec<String> = budget.chains.iter().map(Chain::describe).collect();
        assert_eq!(
            described,
            vec![
                "call_exit -> walk -> callback = 640 B (288+224+128)".to_string(),
                "call_exit -> leaf = 320 B (288+32)".to_string(),
            ]
        );
        assert_eq!(budget.over_goal().len(), 1);
        assert_eq!(budget.worst_per_program().len(), 1);
    }

    #[test]
    fn rust_symbols_read_as_paths() {
        assert_eq!(
            readable("_RNvNtCs8Ub9xRen6Os_8memtrace6unwind14frame_callback"),
            "memtrace::unwind::frame_callback"
        );
        assert_eq!(
            readable("_RNvNtCs8Ub9xRen6Os_8memtrace4held6settle"),
            "memtrace::held::settle"
        );
        assert_eq!(readable("memtrace_walk_stack"), "memtrace_walk_stack");
        assert_eq!(readable("_R"), "_R");
    }

    #[test]
    fn objects_without_programs_or_bytes_are_errors() {
        let (codes, mut functions) = sample();
        for f in &mut functions {
            f.program = false;
        }
        assert!(matches!(
            analyze(&codes, &functions),
            Err(BudgetError::NoPrograms)
        ));
        assert!(matches!(of_object(&[]), Err(BudgetError::Empty)));
        assert!(matches!(of_object(b"not elf"), Err(BudgetError::Parse(_))));
    }

    /// The object this build embeds, when it was built: every program is
    /// found and has chains (the 448 B goal is checked by the kernel suite's
    /// headroom test, which names the chains over it).
    #[test]
    fn embedded_object_has_a_budget() {
        let object = crate::trace::loader::object(crate::kernel::variant::Variant::Full);
        if object.is_empty() {
            return;
        }
        let budget = of_object(object).expect("the embedded object parses");
        for program in ["call_enter", "call_exit", "usdt_fire", "task_new"] {
            assert!(
                budget.chains.iter().any(|c| c.functions[0] == program),
                "no chain from {program}: {:?}",
                budget.chains
            );
        }
        for chain in &budget.chains {
            assert!(chain.bytes >= 32 * chain.functions.len() as u64);
        }
        // Preemptible programs must never get a per-CPU private stack.
        for program in ["call_enter", "call_exit", "usdt_fire"] {
            assert!(
                budget.private_stack_refused.iter().any(|p| p == program),
                "{program} holds no tail call: 6.13+ kernels may run it on a private stack \
                 shared by every run on its CPU ({:?})",
                budget.private_stack_refused
            );
        }
    }

    #[test]
    fn a_tail_call_in_a_program_refuses_the_private_stack() {
        let (mut codes, functions) = sample();
        let budget = analyze(&codes, &functions).expect("analysed");
        assert!(budget.private_stack_refused.is_empty());
        // `leaf` (a subprogram) calling bpf_tail_call does not count: the
        // program's own code must hold it.
        codes[1].insns[3] = i(CALL, 0, 0, 0, HELPER_TAIL_CALL);
        let budget = analyze(&codes, &functions).expect("analysed");
        assert!(budget.private_stack_refused.is_empty());
        codes[1].insns[1] = i(CALL, 0, 0, 0, HELPER_TAIL_CALL);
        let budget = analyze(&codes, &functions).expect("analysed");
        assert_eq!(budget.private_stack_refused, vec!["call_exit".to_string()]);
    }
}
