//! ELF call-frame information to compact unwind rows.
//!
//! Reads `.eh_frame` (and `.debug_frame` where an object has no `.eh_frame`)
//! with gimli, evaluates every FDE's row program, and keeps of each row only
//! what a return-address walk needs. On x86-64: how to compute the CFA (rsp
//! or rbp plus an offset, the PLT's expression, a stack-realigning
//! function's `*(rbp - 8)`, a signal frame), where rbp was saved, and
//! whether the return address is undefined (the outermost frame). On arm64
//! (the object's ELF machine says which): the CFA from sp or x29 plus an
//! offset, where x29 and x30 (the return address) were saved, or that x30
//! still holds it (a leaf, a prologue before its store), with
//! `DW_CFA_AARCH64_negate_ra_state` (pointer authentication) understood; the
//! kernel strips the authentication code from each return address. Rows
//! that differ only in other callee-saved registers merge. Addresses become file offsets, so one table
//! serves every process that maps the file, wherever it is loaded.
//!
//! Malformed CFI never panics: an FDE that does not parse is skipped and
//! counted, and the object's table covers the rest.

use gimli::{
    AArch64, BaseAddresses, CfaRule, CieOrFde, DebugFrame, EhFrame, LittleEndian, RegisterRule,
    UnwindContext, UnwindSection, Vendor, X86_64,
};
use memtrace_common::unwind::{RowKind, UnwindRule, RA_IN_LR};

use crate::arch::Arch;
use object::{Object, ObjectSection, ObjectSegment};

/// One row before it is packed for the kernel: from `pc` (file offset)
/// until the next row, the caller's frame is found this way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnwindRow {
    pub pc: u32,
    /// CFA offset in units of 8 bytes (signed).
    pub cfa_offset8: i16,
    /// Where rbp (x29) was saved, relative to the CFA in units of 8 bytes;
    /// 0: unchanged.
    pub rbp_offset8: i16,
    /// [`RowKind`] as `u8`.
    pub kind: u8,
    /// Where the return address was saved, relative to the CFA in units of
    /// 8 bytes (x86-64: always -1), or [`RA_IN_LR`] (arm64).
    pub ra_offset8: i16,
}

impl UnwindRow {
    /// The rule of this row, without its address.
    pub fn rule(&self) -> UnwindRule {
        UnwindRule {
            cfa_offset8: self.cfa_offset8,
            rbp_offset8: self.rbp_offset8,
            kind: self.kind,
            ra_offset8: self.ra_offset8,
            _pad: 0,
        }
    }
}

/// Gaps between FDEs up to this size are alignment padding (never a return
/// address): the previous rule runs on over them rather than a "no CFI" row.
const PADDING: u64 = 64;

/// Why an object has no table.
#[derive(Debug, thiserror::Error)]
pub enum CfiError {
    #[error("not an ELF object this unwinder reads: {0}")]
    Elf(#[from] object::Error),
    #[error("no .eh_frame or .debug_frame")]
    NoCfi,
    #[error("code beyond 4 GiB of file offsets")]
    TooLarge,
    #[error("an object of an architecture this unwinder does not read")]
    Architecture,
}

/// The rows of one object, sorted by `pc`, plus what building them found.
#[derive(Clone, Debug, Default)]
pub struct Rows {
    pub rows: Vec<UnwindRow>,
    /// FDEs read.
    pub fdes: usize,
    /// FDEs or CIEs skipped because they did not parse.
    pub malformed: usize,
    /// Rows whose rule the kernel cannot follow (the walk ends there).
    pub unsupported: usize,
}

/// A span of code with one rule, before merging.
struct Span {
    start: u64,
    end: u64,
    row: UnwindRow,
}

/// Bytes of the object's `.eh_frame` (or `.debug_frame`), 0 when it has none.
pub fn eh_frame_size(data: &[u8]) -> u64 {
    let Ok(file) = object::File::parse(data) else {
        return 0;
    };
    [".eh_frame", ".debug_frame"]
        .iter()
        .find_map(|name| file.section_by_name(name).map(|s| s.size()))
        .unwrap_or(0)
}

/// Builds the rows of the ELF object in `data` (a byte slice, or a file
/// read through [`object::ReadCache`]: only headers and CFI sections are read).
pub fn rows_from_elf<'d, R: object::ReadRef<'d>>(data: R) -> Result<Rows, CfiError> {
    let file = object::File::parse(data)?;
    let arch = match file.architecture() {
        object::Architecture::X86_64 => Arch::X86_64,
        object::Architecture::Aarch64 => Arch::Aarch64,
        _ => return Err(CfiError::Architecture),
    };
    let segments: Vec<(u64, u64, u64)> = file
        .segments()
        .map(|s| {
            let (offset, size) = s.file_range();
            (s.address(), size, offset)
        })
        .collect();
    let to_offset = |vaddr: u64| -> Option<u64> {
        segments
            .iter()
            .find(|&&(addr, size, _)| vaddr >= addr && vaddr - addr < size.max(1))
            .and_then(|&(addr, _, offset)| (vaddr - addr).checked_add(offset))
    };
    let mut bases = BaseAddresses::default();
    if let Some(text) = file.section_by_name(".text") {
        bases = bases.set_text(text.address());
    }
    if let Some(got) = file.section_by_name(".got") {
        bases = bases.set_got(got.address());
    }
    let mut out = Rows::default();
    let mut spans = Vec::new();
    if let Some(section) = file.section_by_name(".eh_frame") {
        let bytes = section.data()?;
        let bases = bases.clone().set_eh_frame(section.address());
        let mut eh = EhFrame::new(bytes, LittleEndian);
        if arch == Arch::Aarch64 {
            eh.set_vendor(Vendor::AArch64);
        }
        collect(&eh, arch, &bases, bytes, &to_offset, &mut spans, &mut out);
    }
    if spans.is_empty() {
        if let Some(section) = file.section_by_name(".debug_frame") {
            let bytes = section.data()?;
            let mut debug = DebugFrame::new(bytes, LittleEndian);
            debug.set_address_size(8);
            if arch == Arch::Aarch64 {
                debug.set_vendor(Vendor::AArch64);
            }
            collect(
                &debug, arch, &bases, bytes, &to_offset, &mut spans, &mut out,
            );
        }
    }
    if spans.is_empty() && out.fdes == 0 {
        return Err(CfiError::NoCfi);
    }
    if spans.iter().any(|s| s.end > u64::from(u32::MAX)) {
        return Err(CfiError::TooLarge);
    }
    out.rows = merge(spans);
    Ok(out)
}

/// Builds rows from a bare `.eh_frame` image loaded at address 0, file
/// offsets equal to addresses (the fuzz target's entry: no ELF around it).
#[allow(dead_code)] // the entry of fuzz/fuzz_targets/cfi_rows.rs and the tests
pub fn rows_from_eh_frame(bytes: &[u8]) -> Rows {
    let mut out = Rows::default();
    let mut spans = Vec::new();
    let bases = BaseAddresses::default().set_eh_frame(0).set_text(0);
    let eh = EhFrame::new(bytes, LittleEndian);
    collect(
        &eh,
        Arch::X86_64,
        &bases,
        bytes,
        &|addr| Some(addr),
        &mut spans,
        &mut out,
    );
    spans.retain(|s| s.end <= u64::from(u32::MAX));
    out.rows = merge(spans);
    out
}

fn collect<'a, S>(
    section: &S,
    arch: Arch,
    bases: &BaseAddresses,
    bytes: &'a [u8],
    to_offset: &dyn Fn(u64) -> Option<u64>,
    spans: &mut Vec<Span>,
    out: &mut Rows,
) where
    S: UnwindSection<gimli::EndianSlice<'a, LittleEndian>>,
{
    let mut ctx = Box::new(UnwindContext::new());
    let mut entries = section.entries(bases);
    // Bounded by the section size: each entry consumes at least 4 bytes.
    for _ in 0..=bytes.len() / 4 {
        let entry = match entries.next() {
            Ok(Some(entry)) => entry,
            Ok(None) => break,
            Err(_) => {
                // The entry list itself is broken: nothing after it is reliable.
                out.malformed += 1;
                break;
            }
        };
        let CieOrFde::Fde(partial) = entry else {
            continue;
        };
        let fde = match partial.parse(S::cie_from_offset) {
            Ok(fde) => fde,
            Err(_) => {
                out.malformed += 1;
                continue;
            }
        };
        out.fdes += 1;
        let signal = fde.is_signal_trampoline();
        let Ok(mut table) = fde.rows(section, bases, &mut ctx) else {
            out.malformed += 1;
            continue;
        };
        loop {
            match table.next_row() {
                Ok(Some(row)) => {
                    let (Some(start), Some(end)) = (
                        to_offset(row.start_address()),
                        to_offset(row.end_address().saturating_sub(1))
                            .and_then(|e| e.checked_add(1)),
                    ) else {
                        continue;
                    };
                    if end <= start {
                        continue;
                    }
                    let encoded = match arch {
                        Arch::X86_64 => encode(row, section, signal),
                        Arch::Aarch64 => encode_aarch64(row, signal),
                    };
                    if encoded.kind == RowKind::Unsupported as u8 {
                        out.unsupported += 1;
                    }
                    spans.push(Span {
                        start,
                        end,
                        row: encoded,
                    });
                }
                Ok(None) => break,
                Err(_) => {
                    out.malformed += 1;
                    break;
                }
            }
        }
    }
}

fn encode<'a, S>(row: &gimli::UnwindTableRow<usize>, section: &S, signal: bool) -> UnwindRow
where
    S: UnwindSection<gimli::EndianSlice<'a, LittleEndian>>,
{
    let rule = |kind: RowKind, cfa_offset8: i16, rbp_offset8: i8| UnwindRow {
        pc: 0,
        cfa_offset8,
        rbp_offset8: rbp_offset8.into(),
        kind: kind as u8,
        ra_offset8: -1,
    };
    if signal {
        return rule(RowKind::Signal, 0, 0);
    }
    match row.register(X86_64::RA) {
        Some(RegisterRule::Undefined) => return rule(RowKind::End, 0, 0),
        Some(RegisterRule::Offset(-8)) => {}
        _ => return rule(RowKind::Unsupported, 0, 0),
    }
    let rbp = match row.register(X86_64::RBP) {
        Some(RegisterRule::Offset(n))
            if n % 8 == 0 && (i64::from(i8::MIN)..0).contains(&(n / 8)) =>
        {
            (n / 8) as i8
        }
        _ => 0,
    };
    let eighths = |offset: i64| -> Option<i16> {
        (offset % 8 == 0)
            .then(|| i16::try_from(offset / 8).ok())
            .flatten()
    };
    match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => {
            let kind = if *register == X86_64::RSP {
                RowKind::Rsp
            } else if *register == X86_64::RBP {
                RowKind::Rbp
            } else {
                return rule(RowKind::Unsupported, 0, 0);
            };
            match eighths(*offset) {
                Some(off) => rule(kind, off, rbp),
                None => rule(RowKind::Unsupported, 0, 0),
            }
        }
        CfaRule::Expression(expr) => {
            let Ok(expr) = expr.get(section) else {
                return rule(RowKind::Unsupported, 0, 0);
            };
            match classify_expression(expr.0.slice()) {
                Some(CfaExpr::Plt { offset, threshold }) => match eighths(offset) {
                    Some(off) => rule(RowKind::Plt, off, threshold),
                    None => rule(RowKind::Unsupported, 0, 0),
                },
                Some(CfaExpr::RbpDeref { offset }) => match eighths(offset) {
                    Some(off) => rule(RowKind::RbpDeref, off, rbp),
                    None => rule(RowKind::Unsupported, 0, 0),
                },
                None => rule(RowKind::Unsupported, 0, 0),
            }
        }
    }
}

/// An arm64 row: the CFA from sp or x29 plus a multiple of 8, x29's save
/// slot, and x30's (the return address), or that x30 still holds it.
/// Anything else (an expression, another CFA register) is unsupported.
fn encode_aarch64(row: &gimli::UnwindTableRow<usize>, signal: bool) -> UnwindRow {
    let rule = |kind: RowKind, cfa_offset8: i16, rbp_offset8: i16, ra_offset8: i16| UnwindRow {
        pc: 0,
        cfa_offset8,
        rbp_offset8,
        kind: kind as u8,
        ra_offset8,
    };
    let unsupported = rule(RowKind::Unsupported, 0, 0, 0);
    if signal {
        return rule(RowKind::Signal, 0, 0, 0);
    }
    // A save slot below the CFA, in units of 8 bytes.
    let slot = |n: i64| -> Option<i16> {
        (n % 8 == 0 && (i64::from(i16::MIN)..0).contains(&(n / 8))).then_some((n / 8) as i16)
    };
    let ra = match row.register(AArch64::X30) {
        Some(RegisterRule::Undefined) => return rule(RowKind::End, 0, 0, 0),
        None | Some(RegisterRule::SameValue) => RA_IN_LR,
        Some(RegisterRule::Offset(n)) => match slot(n) {
            Some(at) => at,
            None => return unsupported,
        },
        _ => return unsupported,
    };
    let fp = match row.register(AArch64::X29) {
        Some(RegisterRule::Offset(n)) => slot(n).unwrap_or(0),
        _ => 0,
    };
    match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => {
            let kind = if *register == AArch64::SP {
                RowKind::Rsp
            } else if *register == AArch64::X29 {
                RowKind::Rbp
            } else {
                return unsupported;
            };
            match (offset % 8 == 0)
                .then(|| i16::try_from(offset / 8).ok())
                .flatten()
            {
                Some(off) => rule(kind, off, fp, ra),
                None => unsupported,
            }
        }
        CfaRule::Expression(_) => unsupported,
    }
}

/// The CFA expressions compilers and linkers emit in practice.
#[derive(Debug, PartialEq, Eq)]
enum CfaExpr {
    /// `rsp + offset + ((rip & 15) >= threshold ? 8 : 0)` (PLT entries).
    Plt { offset: i64, threshold: i8 },
    /// `*(rbp + offset)` (functions that realign their stack).
    RbpDeref { offset: i64 },
}

fn classify_expression(bytes: &[u8]) -> Option<CfaExpr> {
    const BREG_RSP: u8 = 0x77;
    const BREG_RBP: u8 = 0x76;
    const BREG_RIP: u8 = 0x80;
    const DEREF: u8 = 0x06;
    let (&op, rest) = bytes.split_first()?;
    let (offset, rest) = sleb128(rest)?;
    match (op, rest) {
        (BREG_RBP, [DEREF]) => Some(CfaExpr::RbpDeref { offset }),
        // breg16 0; lit15; and; litN; ge; lit3; shl; plus
        (BREG_RSP, [BREG_RIP, 0x00, 0x3f, 0x1a, lit, 0x2a, 0x33, 0x24, 0x22])
            if (0x30..=0x4f).contains(lit) =>
        {
            Some(CfaExpr::Plt {
                offset,
                threshold: (lit - 0x30) as i8,
            })
        }
        _ => None,
    }
}

fn sleb128(bytes: &[u8]) -> Option<(i64, &[u8])> {
    let mut result: i64 = 0;
    let mut shift = 0;
    for (i, &byte) in bytes.iter().enumerate().take(10) {
        result |= i64::from(byte & 0x7f) << shift;
        shift += 7;
        if byte & 0x80 == 0 {
            if shift < 64 && byte & 0x40 != 0 {
                result |= -1i64 << shift;
            }
            return Some((result, &bytes[i + 1..]));
        }
    }
    None
}

/// Sorts spans, fills gaps with "no CFI" rows, and merges neighbours with
/// the same rule.
fn merge(mut spans: Vec<Span>) -> Vec<UnwindRow> {
    spans.sort_by_key(|s| (s.start, s.end));
    let mut rows: Vec<UnwindRow> = Vec::with_capacity(spans.len() / 2 + 1);
    let mut covered_to = 0u64;
    let none = UnwindRow::default();
    let push = |rows: &mut Vec<UnwindRow>, pc: u64, row: UnwindRow| {
        let row = UnwindRow {
            pc: pc as u32,
            ..row
        };
        match rows.last_mut() {
            Some(last) if same_rule(last, &row) => {}
            Some(last) if last.pc == row.pc => *last = row,
            _ => rows.push(row),
        }
    };
    for span in spans {
        let start = span.start.max(covered_to);
        if start >= span.end {
            continue; // wholly covered by an earlier (overlapping) FDE
        }
        if start > covered_to + PADDING && !rows.is_empty() {
            push(&mut rows, covered_to, none);
        }
        push(&mut rows, start, span.row);
        covered_to = span.end;
    }
    if !rows.is_empty() {
        push(&mut rows, covered_to, none);
    }
    rows
}

fn same_rule(a: &UnwindRow, b: &UnwindRow) -> bool {
    a.kind == b.kind
        && a.cfa_offset8 == b.cfa_offset8
        && a.rbp_offset8 == b.rbp_offset8
        && a.ra_offset8 == b.ra_offset8
}

/// The row covering file offset `pc` (what the kernel's search finds), for tests.
#[cfg(test)]
pub fn lookup(rows: &[UnwindRow], pc: u32) -> Option<&UnwindRow> {
    let index = rows.partition_point(|r| r.pc <= pc);
    rows.get(index.checked_sub(1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn libc() -> Option<Vec<u8>> {
        [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
        ]
        .iter()
        .find_map(|p| std::fs::read(p).ok())
    }

    #[test]
    fn classifies_the_plt_and_realign_expressions() {
        // From `readelf --debug-dump=frames` of a PLT and a realigning main.
        let plt = [
            0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22,
        ];
        assert_eq!(
            classify_expression(&plt),
            Some(CfaExpr::Plt {
                offset: 8,
                threshold: 11
            })
        );
        assert_eq!(
            classify_expression(&[0x76, 0x78, 0x06]),
            Some(CfaExpr::RbpDeref { offset: -8 })
        );
        assert_eq!(classify_expression(&[0x77, 0x08]), None);
        assert_eq!(classify_expression(&[]), None);
        assert_eq!(classify_expression(&[0x77, 0xff]), None, "truncated sleb");
    }

    #[test]
    fn merges_equal_rules_and_marks_gaps() {
        let r = |kind: RowKind, off: i16| UnwindRow {
            pc: 0,
            cfa_offset8: off,
            rbp_offset8: 0,
            kind: kind as u8,
            ra_offset8: -1,
        };
        let spans = vec![
            Span {
                start: 0x1000,
                end: 0x1001,
                row: r(RowKind::Rsp, 1),
            },
            Span {
                start: 0x1001,
                end: 0x1010,
                row: r(RowKind::Rsp, 2),
            },
            Span {
                start: 0x1010,
                end: 0x1020,
                row: r(RowKind::Rsp, 2),
            },
            Span {
                start: 0x1030,
                end: 0x1040,
                row: r(RowKind::Rbp, 2),
            },
            Span {
                start: 0x1100,
                end: 0x1110,
                row: r(RowKind::Rsp, 1),
            },
        ];
        let rows = merge(spans);
        let pcs: Vec<(u32, u8)> = rows.iter().map(|r| (r.pc, r.kind)).collect();
        // The 16-byte gap is padding; a wider one has no CFI.
        assert_eq!(
            pcs,
            vec![
                (0x1000, RowKind::Rsp as u8),
                (0x1001, RowKind::Rsp as u8),
                (0x1030, RowKind::Rbp as u8),
                (0x1040, RowKind::None as u8),
                (0x1100, RowKind::Rsp as u8),
                (0x1110, RowKind::None as u8),
            ]
        );
        assert_eq!(lookup(&rows, 0x1015).map(|r| r.cfa_offset8), Some(2));
        assert_eq!(lookup(&rows, 0x1080).map(|r| r.kind), Some(0));
        assert_eq!(lookup(&rows, 0x0fff), None);
    }

    #[test]
    fn reads_the_system_libc() {
        let Some(data) = libc() else {
            eprintln!("no libc.so.6 to read");
            return;
        };
        let rows = rows_from_elf(&data[..]).expect("libc has CFI");
        assert!(rows.fdes > 1000, "{} FDEs", rows.fdes);
        assert_eq!(rows.malformed, 0);
        assert!(rows.rows.windows(2).all(|w| w[0].pc < w[1].pc), "sorted");
        // The signal trampoline and the outermost frames are recognised.
        assert!(rows.rows.iter().any(|r| r.kind == RowKind::Signal as u8));
        assert!(rows.rows.iter().any(|r| r.kind == RowKind::End as u8));
        // Most of libc is rsp-relative code without frame pointers.
        let rsp = rows
            .rows
            .iter()
            .filter(|r| r.kind == RowKind::Rsp as u8)
            .count();
        assert!(rsp * 2 > rows.rows.len());
    }

    /// The arm64 glibc of Debian's cross toolchain (`libc6-arm64-cross`,
    /// which `cargo xtask build --target aarch64-unknown-linux-gnu` installs).
    fn arm64_libc() -> Option<Vec<u8>> {
        std::fs::read("/usr/aarch64-linux-gnu/lib/libc.so.6").ok()
    }

    #[test]
    fn reads_an_arm64_libc() {
        let Some(data) = arm64_libc() else {
            eprintln!("skipping: no arm64 glibc (libc6-arm64-cross) here");
            return;
        };
        let rows = rows_from_elf(&data[..]).expect("arm64 libc has CFI");
        assert_eq!(rows.malformed, 0);
        assert!(rows.rows.len() > 1000, "{}", rows.rows.len());
        let with = |f: &dyn Fn(&UnwindRow) -> bool| rows.rows.iter().filter(|r| f(r)).count();
        // Function entries: CFA = sp, the return address still in x30.
        assert!(
            with(&|r| r.kind == RowKind::Rsp as u8
                && r.cfa_offset8 == 0
                && r.ra_offset8 == RA_IN_LR)
                > 500
        );
        // After `stp x29, x30, [sp, #-N]!`: the frame record, x30 just above x29.
        assert!(with(&|r| r.rbp_offset8 != 0 && r.ra_offset8 == r.rbp_offset8 + 1) > 500);
        // After `mov x29, sp`: CFA from x29.
        assert!(with(&|r| r.kind == RowKind::Rbp as u8) > 100);
        // _start marks x30 undefined.
        assert!(with(&|r| r.kind == RowKind::End as u8) >= 1);
        // Few rules this unwinder cannot follow.
        assert!(
            rows.unsupported * 100 < rows.fdes,
            "{} of {}",
            rows.unsupported,
            rows.fdes
        );
        // No row of arm64 takes the x86 PLT or realign expressions.
        assert_eq!(
            with(&|r| r.kind == RowKind::Plt as u8 || r.kind == RowKind::RbpDeref as u8),
            0
        );
    }

    #[test]
    fn arm64_malloc_entry_and_body() {
        let Some(data) = arm64_libc() else {
            eprintln!("skipping: no arm64 glibc here");
            return;
        };
        let file = object::File::parse(&*data).expect("elf");
        use object::ObjectSymbol;
        let malloc = file
            .dynamic_symbols()
            .find(|s| s.name() == Ok("malloc"))
            .expect("malloc")
            .address();
        let rows = rows_from_elf(&data[..]).expect("cfi").rows;
        // libc's text is mapped at file offset == address.
        let entry = lookup(&rows, malloc as u32).expect("a row at malloc");
        assert_eq!(
            (entry.kind, entry.cfa_offset8, entry.ra_offset8),
            (RowKind::Rsp as u8, 0, RA_IN_LR),
            "{entry:?}"
        );
    }

    #[test]
    fn garbage_and_truncated_objects_fail_cleanly() {
        assert!(rows_from_elf(&b"not an elf"[..]).is_err());
        if let Some(data) = libc() {
            for cut in [64, 4096, data.len() / 3, data.len() / 2] {
                let _ = rows_from_elf(&data[..cut]);
            }
            // Corrupt the middle of the file (where .eh_frame lives) too.
            let mut bad = data.clone();
            let mid = bad.len() / 5;
            for b in bad.iter_mut().skip(mid).step_by(7).take(20_000) {
                *b ^= 0x5a;
            }
            let _ = rows_from_elf(&bad[..]);
        }
        let _ = rows_from_eh_frame(&[0xff; 64]);
        let _ = rows_from_eh_frame(&[0x10, 0, 0, 0, 0, 0, 0, 0, 1, 0x7a, 0x52, 0]);
    }
}
