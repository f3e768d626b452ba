//! Huge pages for the marking's large work arrays. A radix pass scatters
//! into 4096 places at once, and a bitmap over a heap is read at random:
//! with 4 KiB pages nearly every such access misses the TLB (a few
//! thousand entries cover a few MiB), with 2 MiB pages none does. Asked
//! of the kernel (`MADV_HUGEPAGE`) before the array is first touched;
//! where transparent huge pages are off the advice does nothing.

/// Arrays smaller than this keep their pages.
const MIN_BYTES: usize = 4 << 20;
const HUGE_PAGE: usize = 2 << 20;

/// Advises huge pages for `vec`'s allocation (its capacity), the 2 MiB
/// pages wholly inside it. Call it before the memory is first written.
pub fn advise<T>(vec: &mut Vec<T>) {
    let bytes = vec.capacity().saturating_mul(std::mem::size_of::<T>());
    if bytes < MIN_BYTES {
        return;
    }
    let start = vec.as_mut_ptr() as usize;
    let from = start.next_multiple_of(HUGE_PAGE);
    let to = (start + bytes) / HUGE_PAGE * HUGE_PAGE;
    if to <= from {
        return;
    }
    // SAFETY: [from, to) lies inside the vector's own allocation; the
    // advice changes how its pages are backed, never their contents.
    unsafe {
        libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE);
    }
}

/// A vector of `len` zeros, advised before it is touched.
pub fn zeroed<T: Copy + Default>(len: usize) -> Vec<T> {
    let mut vec = Vec::with_capacity(len);
    advise(&mut vec);
    vec.resize(len, T::default());
    vec
}
