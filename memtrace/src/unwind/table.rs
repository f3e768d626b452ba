//! Per-object unwind tables: rows built once per file (device, inode) and the
//! page index the kernel searches them through.

use memtrace_common::unwind::{UnwindRow, PAGE_SHIFT};

/// The page index of `rows`: for each 4 KiB page from `base` (the first
/// row's page), the index of the row covering the page's first byte.
pub fn page_index(rows: &[UnwindRow]) -> (u32, Vec<u32>) {
    let (Some(first), Some(last)) = (rows.first(), rows.last()) else {
        return (0, Vec::new());
    };
    let base = first.pc & !((1u32 << PAGE_SHIFT) - 1);
    let pages = ((last.pc - base) >> PAGE_SHIFT) + 1;
    let mut index = Vec::with_capacity(pages as usize);
    let mut row = 0usize;
    for page in 0..pages {
        let start = base + (page << PAGE_SHIFT);
        while row + 1 < rows.len() && rows[row + 1].pc <= start {
            row += 1;
        }
        index.push(row as u32);
    }
    (base, index)
}

/// The row the kernel's two-step search finds for file offset `pc`
/// (page index, then a binary search within the page): the same answer as a
/// search over all rows, which the tests check.
#[cfg(test)]
pub fn search(rows: &[UnwindRow], base: u32, pages: &[u32], pc: u32) -> Option<UnwindRow> {
    if pc < base || rows.is_empty() {
        return None;
    }
    let page = ((pc - base) >> PAGE_SHIFT) as usize;
    let first = *pages.get(page)? as usize;
    let last = pages
        .get(page + 1)
        .map_or(rows.len() - 1, |&next| next as usize);
    let slice = rows.get(first..=last)?;
    let at = slice.partition_point(|r| r.pc <= pc);
    let row = *slice.get(at.checked_sub(1)?)?;
    Some(row)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::unwind::cfi;

    fn rows(pcs: &[u32]) -> Vec<UnwindRow> {
        pcs.iter()
            .enumerate()
            .map(|(i, &pc)| UnwindRow {
                pc,
                cfa_offset8: i as i16,
                rbp_offset8: 0,
                kind: 1,
            })
            .collect()
    }

    #[test]
    fn page_index_points_at_the_covering_row() {
        let rows = rows(&[0x1010, 0x1020, 0x3000, 0x3008, 0x5100]);
        let (base, pages) = page_index(&rows);
        assert_eq!(base, 0x1000);
        // Pages 0x1000, 0x2000, 0x3000, 0x4000, 0x5000.
        assert_eq!(pages, vec![0, 1, 2, 3, 3]);
        for pc in [
            0x1010, 0x1015, 0x1fff, 0x2500, 0x3000, 0x3007, 0x3009, 0x5000, 0x5100, 0x5200,
        ] {
            assert_eq!(
                search(&rows, base, &pages, pc),
                cfi::lookup(&rows, pc).copied(),
                "pc {pc:#x}"
            );
        }
        assert_eq!(search(&rows, base, &pages, 0x100f), None);
    }

    #[test]
    fn two_step_search_matches_a_full_search_on_libc() {
        let Ok(data) = std::fs::read("/lib/x86_64-linux-gnu/libc.so.6") else {
            return;
        };
        let built = cfi::rows_from_elf(&data).expect("libc CFI");
        let (base, pages) = page_index(&built.rows);
        let end = built.rows.last().map_or(0, |r| r.pc);
        let mut pc = base;
        while pc < end {
            assert_eq!(
                search(&built.rows, base, &pages, pc),
                cfi::lookup(&built.rows, pc).copied(),
                "pc {pc:#x}"
            );
            pc += 37;
        }
    }
}
