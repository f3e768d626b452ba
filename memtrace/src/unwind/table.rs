//! Packing an object's rows for the kernel: a dictionary of its distinct
//! rules, and per 4 KiB page of code the rows that start in it, each 4 bytes
//! (offset within the page, rule index), led by the rule covering the page's
//! first byte. A page index gives each page's first row.
//!
//! Objects have a few hundred to a few thousand distinct rules, so a row
//! takes half of what (address, rule) would, and the kernel's search within a
//! page touches at most 13 rows.

use std::collections::HashMap;

use memtrace_common::unwind::{PageRow, UnwindRule, PAGE_SHIFT};

use crate::unwind::cfi::UnwindRow;

const PAGE: u32 = 1 << PAGE_SHIFT;

/// One object's table as the kernel stores it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Packed {
    /// File offset of page 0 (page-aligned).
    pub base: u32,
    pub rules: Vec<UnwindRule>,
    pub rows: Vec<PageRow>,
    /// Per page, the index in `rows` of its first row.
    pub pages: Vec<u32>,
}

/// Packs sorted rows; `None` when the object has more than 65536 distinct
/// rules (a row's rule index is 16 bits).
pub fn pack(rows: &[UnwindRow]) -> Option<Packed> {
    let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
        return Some(Packed::default());
    };
    let base = first.pc & !(PAGE - 1);
    let page_count = ((last.pc - base) >> PAGE_SHIFT) + 1;
    let mut dictionary: HashMap<UnwindRule, u16> = HashMap::new();
    let mut rules = Vec::new();
    let mut rule_of = |row: &UnwindRow| -> Option<u16> {
        let rule = row.rule();
        if let Some(&index) = dictionary.get(&rule) {
            return Some(index);
        }
        let index = u16::try_from(rules.len()).ok()?;
        rules.push(rule);
        dictionary.insert(rule, index);
        Some(index)
    };
    let mut packed_rows = Vec::with_capacity(rows.len() + page_count as usize);
    let mut pages = Vec::with_capacity(page_count as usize);
    let mut next = 0usize;
    // The row covering the current position (None before the first row).
    let mut covering: Option<&UnwindRow> = None;
    for page in 0..page_count {
        let start = base + page * PAGE;
        let end = start.saturating_add(PAGE);
        while next < rows.len() && rows[next].pc <= start {
            covering = Some(&rows[next]);
            next += 1;
        }
        pages.push(u32::try_from(packed_rows.len()).ok()?);
        let lead = covering.copied().unwrap_or_default();
        packed_rows.push(PageRow {
            pc_in_page: 0,
            rule: rule_of(&lead)?,
        });
        while next < rows.len() && rows[next].pc < end {
            packed_rows.push(PageRow {
                pc_in_page: (rows[next].pc - start) as u16,
                rule: rule_of(&rows[next])?,
            });
            covering = Some(&rows[next]);
            next += 1;
        }
    }
    Some(Packed {
        base,
        rules,
        rows: packed_rows,
        pages,
    })
}

/// The rule the kernel's search finds for file offset `pc`: the page's rows,
/// then the last row at or before the offset within the page.
#[cfg(test)]
pub fn search(packed: &Packed, pc: u32) -> Option<UnwindRule> {
    if pc < packed.base {
        return None;
    }
    let page = ((pc - packed.base) >> PAGE_SHIFT) as usize;
    let first = *packed.pages.get(page)? as usize;
    let end = packed
        .pages
        .get(page + 1)
        .map_or(packed.rows.len(), |&next| next as usize);
    let rows = packed.rows.get(first..end)?;
    let within = (pc & (PAGE - 1)) as u16;
    let at = rows.partition_point(|r| r.pc_in_page <= within);
    let row = rows.get(at.checked_sub(1)?)?;
    packed.rules.get(usize::from(row.rule)).copied()
}

/// Rows at `pcs` cycling through three rules (for tests).
#[cfg(test)]
pub fn sample_rows(pcs: &[u32]) -> Vec<UnwindRow> {
    pcs.iter()
        .enumerate()
        .map(|(i, &pc)| UnwindRow {
            pc,
            cfa_offset8: (i % 3) as i16,
            rbp_offset8: 0,
            kind: 1,
            ra_offset8: -1,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::unwind::cfi;

    fn full_search(rows: &[UnwindRow], pc: u32) -> Option<UnwindRule> {
        cfi::lookup(rows, pc).map(UnwindRow::rule)
    }

    #[test]
    fn pages_lead_with_the_covering_rule() {
        let rows = sample_rows(&[0x1010, 0x1020, 0x3000, 0x3008, 0x5100]);
        let packed = pack(&rows).expect("packs");
        assert_eq!(packed.base, 0x1000);
        assert_eq!(packed.pages.len(), 5);
        assert_eq!(
            packed.rules.len(),
            4,
            "3 distinct + the 'no CFI' lead of page 0"
        );
        for pc in [
            0x1010, 0x1015, 0x1fff, 0x2500, 0x3000, 0x3007, 0x3009, 0x5000, 0x5100, 0x5200,
        ] {
            assert_eq!(search(&packed, pc), full_search(&rows, pc), "pc {pc:#x}");
        }
        assert_eq!(search(&packed, 0x100f).map(|r| r.kind), Some(0));
        assert_eq!(search(&packed, 0x0fff), None);
    }

    #[test]
    fn packed_libc_answers_like_a_full_search_in_half_the_bytes() {
        let Ok(data) = std::fs::read("/lib/x86_64-linux-gnu/libc.so.6") else {
            return;
        };
        let built = cfi::rows_from_elf(&data[..]).expect("libc CFI");
        let packed = pack(&built.rows).expect("packs");
        let end = built.rows.last().map_or(0, |r| r.pc);
        let mut pc = packed.base + 1;
        while pc < end {
            if pc >= built.rows[0].pc {
                assert_eq!(
                    search(&packed, pc),
                    full_search(&built.rows, pc),
                    "pc {pc:#x}"
                );
            }
            pc += 37;
        }
        let bytes = packed.rows.len() * 4 + packed.rules.len() * 4 + packed.pages.len() * 4;
        let eh_frame = cfi::eh_frame_size(&data) as usize;
        assert!(
            bytes < eh_frame,
            "{bytes} bytes of table for {eh_frame} of .eh_frame"
        );
    }
}
