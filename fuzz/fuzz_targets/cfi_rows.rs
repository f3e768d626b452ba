//! The unwind-table builder (`memtrace/src/unwind/cfi.rs`): arbitrary bytes,
//! as a whole ELF file or as a bare `.eh_frame`, never panic or hang, and
//! whatever rows come out are sorted and free of neighbours with equal rules
//! (what the kernel's binary search relies on).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../memtrace/src/unwind/cfi.rs"]
mod cfi;

fn check(rows: &[cfi::UnwindRow]) {
    for pair in rows.windows(2) {
        assert!(pair[0].pc < pair[1].pc, "rows sorted and distinct");
        assert!(
            pair[0].kind != pair[1].kind
                || pair[0].cfa_offset8 != pair[1].cfa_offset8
                || pair[0].rbp_offset8 != pair[1].rbp_offset8,
            "equal neighbours merged"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(rows) = cfi::rows_from_elf(data) {
        check(&rows.rows);
    }
    check(&cfi::rows_from_eh_frame(data).rows);
});
