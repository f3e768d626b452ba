//! `--leak-check-explain`: why a block is in its category, in words. The
//! marking keeps, per block, the word that gave it its category
//! ([`crate::reach::Mark`]); this module follows those marks back to a
//! root or a register and names each holder: a register of a stopped
//! thread, a thread's stack (and where its stack pointer was), a mapped
//! object's writable segment, anonymous memory, or another block.

use std::path::Path;
use std::str::FromStr;

use crate::reach::{self, Category, Mark, Node, Source};
use crate::report::leak::{category_name, ExplainLink, Explanation};
use crate::tracee::maps::Mapping;
use crate::tracee::stop::StoppedThread;

/// At most this many blocks are explained for a category.
const PER_CATEGORY: usize = 10;

/// What a user asks to have explained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExplainTarget {
    /// The block holding this address.
    Address(u64),
    /// The largest blocks of a category (up to ten).
    Category(Category),
}

impl FromStr for ExplainTarget {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        for category in Category::ALL {
            if text == category_name(category) {
                return Ok(ExplainTarget::Category(category));
            }
        }
        let parsed = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
            Some(hex) => u64::from_str_radix(hex, 16),
            None => text.parse(),
        };
        parsed.map(ExplainTarget::Address).map_err(|_| {
            format!(
                "'{text}' is neither an address (0x5555deadbeef) nor a category (definitely-lost, indirectly-lost, possibly-lost, still-reachable)"
            )
        })
    }
}

/// A register's name by its index among the words of `NT_PRSTATUS`.
fn register_name(index: usize) -> String {
    #[cfg(target_arch = "x86_64")]
    const NAMES: &[&str] = &[
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx",
        "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base", "ds",
        "es", "fs", "gs",
    ];
    #[cfg(target_arch = "aarch64")]
    const NAMES: &[&str] = &[
        "x0", "x1", "x2", "x3", "x4", "x5", "x6", "x7", "x8", "x9", "x10", "x11", "x12", "x13",
        "x14", "x15", "x16", "x17", "x18", "x19", "x20", "x21", "x22", "x23", "x24", "x25", "x26",
        "x27", "x28", "x29", "x30", "sp", "pc", "pstate",
    ];
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    const NAMES: &[&str] = &[];
    NAMES
        .get(index)
        .map_or_else(|| format!("register word {index}"), |n| (*n).to_string())
}

/// A vector register's half by its index among the vector words read
/// (`xmm3.hi` is the upper 8 bytes of xmm3).
fn vector_name(index: usize) -> String {
    let prefix = if cfg!(target_arch = "x86_64") {
        "xmm"
    } else {
        "v"
    };
    let half = if index.is_multiple_of(2) { "lo" } else { "hi" };
    format!("{prefix}{}.{half}", index / 2)
}

/// What the explanation reads of the judged process.
pub struct Context<'a> {
    pub pid: u32,
    pub nodes: &'a [Node],
    pub categories: &'a [Category],
    pub marks: &'a [Option<Mark>],
    pub mappings: &'a [Mapping],
    pub threads: &'a [StoppedThread],
}

impl Context<'_> {
    /// Names what holds a word at `at` in root memory.
    fn root_holder(&self, at: u64) -> String {
        let Some(mapping) = self.mappings.iter().find(|m| m.start <= at && at < m.end) else {
            return format!("unmapped memory at {at:#x}");
        };
        let stack = self
            .threads
            .iter()
            .enumerate()
            .find(|(_, t)| t.sp >= mapping.start && t.sp < mapping.end);
        if let Some((k, thread)) = stack {
            return if at >= thread.sp {
                format!("stack of thread {} (sp+{:#x})", k + 1, at - thread.sp)
            } else {
                format!(
                    "stack of thread {}, {} bytes below its sp (a dead frame's word)",
                    k + 1,
                    thread.sp - at
                )
            };
        }
        let perms = format!(
            "{}{}{}{}",
            if mapping.readable { 'r' } else { '-' },
            if mapping.writable { 'w' } else { '-' },
            if mapping.executable { 'x' } else { '-' },
            if mapping.shared { 's' } else { 'p' },
        );
        match mapping.path.as_deref().map(Path::display) {
            Some(path) => format!(
                "{path} {perms} +{:#x} (mapped at {:#x})",
                at - mapping.start + mapping.file_offset,
                mapping.start
            ),
            None => format!(
                "anonymous memory {:#x}-{:#x} {perms} +{:#x}",
                mapping.start,
                mapping.end,
                at - mapping.start
            ),
        }
    }

    /// Names register `index` of the flattened register words (each
    /// thread's general-purpose words, then its vector words).
    fn register_holder(&self, mut index: usize) -> String {
        for (k, thread) in self.threads.iter().enumerate() {
            if index < thread.registers.len() {
                return format!("register {} of thread {}", register_name(index), k + 1);
            }
            index -= thread.registers.len();
            if index < thread.vector.len() {
                return format!("register {} of thread {}", vector_name(index), k + 1);
            }
            index -= thread.vector.len();
        }
        format!("register word {index}")
    }

    fn link(&self, node: usize, mark: Mark) -> ExplainLink {
        let (kind, at, holder) = match mark.source {
            Source::Register { index } => ("register", None, self.register_holder(index)),
            Source::Root { at } => ("root", Some(at), self.root_holder(at)),
            Source::Block { node, at } => {
                let holder = self.nodes[node];
                (
                    "block",
                    Some(at),
                    format!(
                        "block {:#x} ({} B, {}) +{:#x}",
                        holder.start,
                        holder.size(),
                        category_name(self.categories[node]),
                        at - holder.start
                    ),
                )
            }
        };
        ExplainLink {
            block: self.nodes[node].start,
            pointer: mark.value,
            kind: kind.to_string(),
            at,
            holder,
        }
    }

    /// Explains node `node`.
    fn explain_node(&self, asked: String, node: usize) -> Explanation {
        let block = self.nodes[node];
        let category = self.categories[node];
        let chain: Vec<ExplainLink> = reach::chain(self.marks, node)
            .into_iter()
            .map(|(n, mark)| self.link(n, mark))
            .collect();
        let mut lines = vec![format!(
            "pid {}: block {:#x} ({} B) is {}{}",
            self.pid,
            block.start,
            block.size(),
            category_name(category),
            match category {
                Category::DefinitelyLost =>
                    ": no pointer to it or into it was found in the registers, the roots or any block still reachable or possibly lost, and no other lost block points to it",
                Category::IndirectlyLost => ": only lost blocks point to it:",
                Category::PossiblyLost =>
                    ": the roots reach it only through a pointer into its middle:",
                Category::StillReachable => ": kept by",
            }
        )];
        for link in &chain {
            let start = link.block;
            let what = if link.pointer == start {
                format!("{:#x} (its start)", link.pointer)
            } else {
                format!(
                    "{:#x} (its start +{:#x})",
                    link.pointer,
                    link.pointer.wrapping_sub(start)
                )
            };
            let at = link.at.map(|a| format!(" at {a:#x}")).unwrap_or_default();
            lines.push(format!(
                "  <- pointer {what} to block {start:#x}{at} in {}",
                link.holder
            ));
        }
        Explanation {
            asked,
            pid: self.pid,
            block: Some(block.start),
            size: block.size(),
            category: Some(category_name(category).to_string()),
            chain,
            lines,
        }
    }

    /// The explanations of what `targets` ask.
    pub fn explain(&self, targets: &[ExplainTarget]) -> Vec<Explanation> {
        let mut out = Vec::new();
        for target in targets {
            match *target {
                ExplainTarget::Address(addr) => {
                    let holding = self.nodes.iter().position(|n| {
                        n.start == addr
                            || (addr > n.start && addr < n.start.saturating_add(n.size()))
                    });
                    out.push(match holding {
                        Some(node) => self.explain_node(format!("{addr:#x}"), node),
                        None => Explanation {
                            asked: format!("{addr:#x}"),
                            pid: self.pid,
                            lines: vec![format!(
                                "pid {}: {addr:#x} is in no judged block (its blocks are the live heap and device blocks memtrace traced)",
                                self.pid
                            )],
                            ..Explanation::default()
                        },
                    });
                }
                ExplainTarget::Category(category) => {
                    let mut members: Vec<usize> = (0..self.nodes.len())
                        .filter(|&n| self.categories[n] == category)
                        .collect();
                    members.sort_by_key(|&n| (std::cmp::Reverse(self.nodes[n].size()), n));
                    for node in members.into_iter().take(PER_CATEGORY) {
                        out.push(self.explain_node(category_name(category).to_string(), node));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracee::maps::parse;

    const MAPS: &str = "\
00400000-00401000 r--p 00000000 08:01 100 /app/prog
00402000-00403000 rw-p 00002000 08:01 100 /app/prog
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
7ffc00000000-7ffc00100000 rw-p 00000000 00:00 0 [stack]
";

    fn node(start: u64, size: u64) -> Node {
        Node::host(start, size)
    }

    #[test]
    fn targets_parse_as_addresses_or_categories() {
        assert_eq!(
            "0x10".parse::<ExplainTarget>(),
            Ok(ExplainTarget::Address(16))
        );
        assert_eq!("16".parse(), Ok(ExplainTarget::Address(16)));
        assert_eq!(
            "possibly-lost".parse(),
            Ok(ExplainTarget::Category(Category::PossiblyLost))
        );
        assert!("lost".parse::<ExplainTarget>().is_err());
    }

    #[test]
    fn a_chain_is_told_from_the_block_back_to_the_root() {
        let mappings = parse(MAPS);
        let nodes = [node(0x7f00_0000_1000, 64), node(0x7f00_0000_2000, 100)];
        let categories = [Category::StillReachable, Category::PossiblyLost];
        let marks = [
            Some(Mark {
                source: Source::Root {
                    at: 0x7ffc_0000_0f00,
                },
                value: 0x7f00_0000_1000,
            }),
            Some(Mark {
                source: Source::Block {
                    node: 0,
                    at: 0x7f00_0000_1008,
                },
                value: 0x7f00_0000_2008,
            }),
        ];
        let mut registers = vec![0; 27];
        registers[19] = 0x7ffc_0000_0f80;
        let threads = [StoppedThread {
            sp: crate::tracee::stop::stack_pointer(&registers),
            registers,
            ..StoppedThread::default()
        }];
        let context = Context {
            pid: 7,
            nodes: &nodes,
            categories: &categories,
            marks: &marks,
            mappings: &mappings,
            threads: &threads,
        };
        let told = context.explain(&[ExplainTarget::Address(0x7f00_0000_2010)]);
        assert_eq!(told.len(), 1);
        let one = &told[0];
        assert_eq!(one.block, Some(0x7f00_0000_2000));
        assert_eq!(one.category.as_deref(), Some("possibly-lost"));
        assert_eq!(one.chain.len(), 2);
        assert_eq!(one.chain[0].kind, "block");
        assert!(one.lines[1].contains("(its start +0x8)"), "{:?}", one.lines);
        assert!(
            one.chain[1]
                .holder
                .contains("stack of thread 1, 128 bytes below its sp"),
            "{:?}",
            one.chain[1]
        );
        // An address no block holds; a category.
        let none = context.explain(&[ExplainTarget::Address(0x10)]);
        assert_eq!(none[0].block, None);
        let reachable = context.explain(&[ExplainTarget::Category(Category::StillReachable)]);
        assert_eq!(reachable.len(), 1);
        assert_eq!(reachable[0].chain[0].kind, "root");
    }

    #[test]
    fn roots_are_named_by_their_mapping() {
        let mappings = parse(MAPS);
        let context = Context {
            pid: 1,
            nodes: &[],
            categories: &[],
            marks: &[],
            mappings: &mappings,
            threads: &[],
        };
        assert_eq!(
            context.root_holder(0x402010),
            "/app/prog rw-p +0x2010 (mapped at 0x402000)"
        );
        assert!(context
            .root_holder(0x7f00_0000_0010)
            .starts_with("anonymous memory"));
        assert_eq!(context.register_holder(3), "register word 3");
    }
}
