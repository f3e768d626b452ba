//! BPF task-local storage (`BPF_MAP_TYPE_TASK_STORAGE`, 5.11; usable from
//! uprobe programs where `memtrace doctor`'s `task_storage_in_uprobes`
//! probe finds it): a value per thread, created on a thread's first
//! request and freed by the kernel when the thread exits.
//!
//! aya-ebpf 0.2 has no such map, and the kernel creates one only with BTF
//! for its key and value, so it is declared here the way libbpf declares a
//! BTF map: a `#[repr(C)]` struct in the `.maps` section whose fields are
//! pointers to the key and value types and to arrays whose lengths are the
//! map type and flags. bpf-linker writes its BTF (`--btf`) and aya creates
//! the map from it.

use core::ptr;

use aya_ebpf::helpers::generated::{bpf_get_current_task_btf, bpf_task_storage_get};

/// `BPF_MAP_TYPE_TASK_STORAGE`.
const MAP_TYPE: usize = 29;
/// `BPF_F_NO_PREALLOC`: local storage maps are never preallocated.
const NO_PREALLOC: usize = 1;
/// `BPF_LOCAL_STORAGE_GET_F_CREATE`.
const GET_F_CREATE: u64 = 1;

/// A task-local storage map of `V`: its BTF definition, whose field names
/// and types are what the loader reads (a static of it goes in `.maps`).
/// The program never reads or writes its memory: the loader replaces each
/// reference to it with the map.
#[repr(C)]
pub struct TaskStorage<V> {
    r#type: *const [i32; MAP_TYPE],
    key: *const i32,
    value: *const V,
    map_flags: *const [i32; NO_PREALLOC],
}

// SAFETY: the definition is only the map's description for the loader (see
// the type); nothing reads or writes it at run time.
unsafe impl<V> Sync for TaskStorage<V> {}

impl<V> TaskStorage<V> {
    pub const fn new() -> Self {
        TaskStorage {
            r#type: ptr::null(),
            key: ptr::null(),
            value: ptr::null(),
            map_flags: ptr::null(),
        }
    }

    /// The current thread's value, zeroed on creation when `create`; null
    /// when it has none (and `create` is false) or it could not be created
    /// (no memory, or the kernel's storage lock busy on this CPU).
    #[inline(always)]
    pub fn current(&self, create: bool) -> *mut V {
        let flags = if create { GET_F_CREATE } else { 0 };
        // SAFETY: `bpf_get_current_task_btf` has no preconditions and returns
        // the running task; `bpf_task_storage_get` takes this map (its
        // address is relocated to the map by the loader), that task and a
        // null initial value (zeroed), and returns its value or null.
        unsafe {
            bpf_task_storage_get(
                ptr::from_ref(self).cast_mut().cast(),
                bpf_get_current_task_btf(),
                ptr::null_mut(),
                flags,
            )
            .cast()
        }
    }
}
