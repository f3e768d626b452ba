//! valgrind memcheck's four default heuristics for interior pointers
//! (`--leak-check-heuristics=all`, its default since 3.11), by behaviour:
//! an interior pointer that one of them accepts counts as a start pointer
//! ("reachable via heuristic"). Each reads only the pointed-to block's
//! first words (and, for multiple inheritance, the word the pointer points
//! at); a word that cannot be read matches nothing.

use super::Heuristic;

const WORD: u64 = 8;
/// Addresses below this are never vtables (the zero page).
const PAGE: u64 = 4096;

/// The words a heuristic may read: the block's first two, and the one
/// the pointer points at.
pub struct Words {
    pub first: Option<u64>,
    pub second: Option<u64>,
    pub at_pointer: Option<u64>,
}

/// The heuristic that accepts `pointer` into the block `[start, start +
/// size)` (an interior pointer), if any, in valgrind's order.
pub fn accepts(
    pointer: u64,
    start: u64,
    size: u64,
    words: &Words,
    vtable: &dyn Fn(u64) -> bool,
) -> Option<Heuristic> {
    // stdstring: libstdc++'s reference-counted string, `length, capacity,
    // refcount, chars[capacity + 1]`, pointed at its chars.
    if pointer == start + 3 * WORD {
        if let (Some(length), Some(capacity)) = (words.first, words.second) {
            if capacity.checked_add(3 * WORD + 1) == Some(size) && length <= capacity {
                return Some(Heuristic::StdString);
            }
        }
    }
    if pointer == start + WORD {
        if let Some(first) = words.first {
            // length64: a 64-bit length of the rest before the data
            // (sqlite's allocations).
            if first > 0 && size.checked_sub(WORD) == Some(first) {
                return Some(Heuristic::Length64);
            }
            // newarray: `new T[n]` of a class with a destructor stores n
            // before the array.
            if first > 0 && size >= WORD && (size - WORD).is_multiple_of(first) {
                return Some(Heuristic::NewArray);
            }
        }
    }
    // multipleinheritance: a pointer to a second base, both it and the
    // object's first word vtable pointers.
    if pointer.is_multiple_of(WORD) {
        if let (Some(inner), Some(first)) = (words.at_pointer, words.first) {
            let plausible = |p: u64| p.is_multiple_of(WORD) && p >= PAGE && vtable(p);
            if plausible(inner) && plausible(first) {
                return Some(Heuristic::MultipleInheritance);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(first: u64, second: u64, at: u64) -> Words {
        Words {
            first: Some(first),
            second: Some(second),
            at_pointer: Some(at),
        }
    }

    const NO_VTABLE: &dyn Fn(u64) -> bool = &|_| false;

    #[test]
    fn stdstring_needs_the_exact_layout() {
        // capacity 40: size = 24 + 40 + 1.
        let w = words(10, 40, 0);
        assert_eq!(
            accepts(0x1018, 0x1000, 65, &w, NO_VTABLE),
            Some(Heuristic::StdString)
        );
        assert_eq!(accepts(0x1018, 0x1000, 66, &w, NO_VTABLE), None);
        assert_eq!(
            accepts(0x1018, 0x1000, 65, &words(41, 40, 0), NO_VTABLE),
            None
        );
        assert_eq!(accepts(0x1010, 0x1000, 65, &w, NO_VTABLE), None);
    }

    #[test]
    fn length64_and_newarray_read_the_first_word() {
        assert_eq!(
            accepts(0x1008, 0x1000, 108, &words(100, 0, 0), NO_VTABLE),
            Some(Heuristic::Length64)
        );
        // 3 elements of 16 bytes after the count.
        assert_eq!(
            accepts(0x1008, 0x1000, 56, &words(3, 0, 0), NO_VTABLE),
            Some(Heuristic::NewArray)
        );
        assert_eq!(
            accepts(0x1008, 0x1000, 57, &words(3, 0, 0), NO_VTABLE),
            None
        );
        assert_eq!(
            accepts(0x1008, 0x1000, 56, &words(0, 0, 0), NO_VTABLE),
            None
        );
        let unread = Words {
            first: None,
            second: None,
            at_pointer: None,
        };
        assert_eq!(accepts(0x1008, 0x1000, 56, &unread, NO_VTABLE), None);
    }

    #[test]
    fn multiple_inheritance_needs_two_vtables() {
        let vtable = |p: u64| (0x40_0000..0x41_0000).contains(&p);
        let w = words(0x40_1000, 0, 0x40_2000);
        assert_eq!(
            accepts(0x1010, 0x1000, 32, &w, &vtable),
            Some(Heuristic::MultipleInheritance)
        );
        assert_eq!(
            accepts(0x1010, 0x1000, 32, &words(0x40_1000, 0, 7), &vtable),
            None
        );
        assert_eq!(accepts(0x1011, 0x1000, 32, &w, &vtable), None);
        assert_eq!(accepts(0x1010, 0x1000, 32, &w, NO_VTABLE), None);
    }
}
