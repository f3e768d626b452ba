//! The catalogue of functions memtrace knows how to probe: their C prototypes,
//! which allocator and kind of memory they belong to, and the [`ProbeSpec`]
//! that tells the generic eBPF programs where to find size, pointer and result.

use memtrace_common::{ProbeSpec, RetKind, SpecKind, SpecQuirk, ARG_NONE};
use serde::Serialize;

/// An allocator family as reported to users (serialized as its name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Allocator {
    /// The C library's heap (`malloc` and friends, C++ `operator new`/`delete`
    /// over it): glibc, or any object not identified as another allocator.
    Libc,
    /// jemalloc (Debian's `libjemalloc2`, redis, Rust's tikv-jemallocator).
    Jemalloc,
    /// gperftools' tcmalloc (`libtcmalloc*.so`).
    Tcmalloc,
    /// Microsoft's mimalloc (`libmimalloc.so`, Rust's mimalloc crate).
    Mimalloc,
    /// Anonymous `mmap`/`munmap`.
    Mmap,
    /// CUDA runtime (`cudaMalloc` ...).
    Cuda,
    /// CUDA driver (`cuMemAlloc_v2` ...).
    CudaDriver,
    /// Ascend ACL (`aclrtMalloc` ...).
    Acl,
    /// CPython's object allocator (`PyObject_Malloc` ...: pymalloc's small
    /// blocks, larger ones through `malloc`); only with `--allocators python`.
    Python,
    /// A user-declared resource pair (`--pairs`, `--preset`), with its nesting family.
    Custom { name: &'static str, family: u8 },
}

impl Serialize for Allocator {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

/// Serialized as its name: a string in the JSON schema.
impl schemars::JsonSchema for Allocator {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Allocator".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "description": "The allocator family: `libc`, `jemalloc`, `tcmalloc`, `mimalloc`, \
                `mmap`, `cuda`, `cuda-driver`, `acl`, `python`, or a resource pair's name \
                (`--pairs`, `--preset`)."
        })
    }
}

impl Allocator {
    pub fn name(self) -> &'static str {
        match self {
            Allocator::Libc => "libc",
            Allocator::Jemalloc => "jemalloc",
            Allocator::Tcmalloc => "tcmalloc",
            Allocator::Mimalloc => "mimalloc",
            Allocator::Mmap => "mmap",
            Allocator::Cuda => "cuda",
            Allocator::CudaDriver => "cuda-driver",
            Allocator::Acl => "acl",
            Allocator::Python => "python",
            Allocator::Custom { name, .. } => name,
        }
    }

    /// Parses a built-in allocator name (`--allocators`).
    pub fn parse_builtin(name: &str) -> Option<Allocator> {
        [
            Allocator::Libc,
            Allocator::Jemalloc,
            Allocator::Tcmalloc,
            Allocator::Mimalloc,
            Allocator::Mmap,
            Allocator::Cuda,
            Allocator::CudaDriver,
            Allocator::Acl,
            Allocator::Python,
        ]
        .into_iter()
        .find(|a| a.name() == name)
    }

    /// Whether this is a heap allocator (`malloc`-like, C++ `new`): these
    /// share one address domain and one nesting family, so `operator new`
    /// over a traced `malloc`, or jemalloc's `mmap` under its `malloc`, is
    /// counted once.
    pub fn is_heap(self) -> bool {
        matches!(
            self,
            Allocator::Libc | Allocator::Jemalloc | Allocator::Tcmalloc | Allocator::Mimalloc
        )
    }

    /// Whether it is traced when `--allocators` is not given.
    pub fn by_default(self) -> bool {
        self != Allocator::Python
    }

    /// Nesting family used by the eBPF programs (see [`ProbeSpec::family`]).
    pub fn family(self) -> u8 {
        match self {
            Allocator::Libc | Allocator::Jemalloc | Allocator::Tcmalloc | Allocator::Mimalloc => 0,
            Allocator::Mmap => 1,
            Allocator::Cuda => 2,
            Allocator::CudaDriver => 3,
            Allocator::Acl => 4,
            Allocator::Python => 5,
            Allocator::Custom { family, .. } => family,
        }
    }

    /// The family whose in-flight call makes a call of this one an internal detail.
    fn parent_family(self) -> u8 {
        match self {
            Allocator::Mmap => Allocator::Libc.family(),
            Allocator::CudaDriver => Allocator::Cuda.family(),
            _ => ARG_NONE,
        }
    }
}

/// Which memory a block lives in.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum Memory {
    Host,
    Device,
    Pinned,
    Managed,
    /// Not memory: a handle or descriptor of a user-declared resource pair.
    Handle,
}

impl Memory {
    pub fn name(self) -> &'static str {
        match self {
            Memory::Host => "host",
            Memory::Device => "device",
            Memory::Pinned => "pinned",
            Memory::Managed => "managed",
            Memory::Handle => "handle",
        }
    }
}

/// Address space in which a block's address is unique: blocks are matched to
/// their release within one domain only.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
pub enum Domain {
    Heap,
    Mapping,
    CudaMemory,
    CudaVmmHandle,
    AclMemory,
    /// A user-declared pair's own handles (by its family).
    Custom(u8),
}

/// One probed function.
#[derive(Clone, Copy, Debug)]
pub struct FuncDef {
    pub name: &'static str,
    pub allocator: Allocator,
    pub memory: Memory,
    pub domain: Domain,
    pub kind: SpecKind,
    pub ret: RetKind,
    pub size_arg: u8,
    pub count_arg: u8,
    pub ptr_arg: u8,
    pub out_arg: u8,
    pub quirk: SpecQuirk,
    /// Status meaning success when `ret` is [`RetKind::Status`].
    pub success_code: i64,
    /// The symbol prefix this definition was made with (`je_`, `_rjem_`,
    /// `--symbol-prefix`), empty for the catalogue's own names.
    pub prefix: &'static str,
    /// A parent family other than the allocator's own (libc under
    /// `--allocators python`: its calls inside `PyObject_Malloc` are nested).
    pub parent_family: u8,
    /// A USDT probe (`usdt = "provider:name"` in a pair), not a function:
    /// `name` is then `provider:name` and the arguments are the probe's.
    pub usdt: Option<UsdtPoint>,
}

const N: u8 = ARG_NONE;

/// What a USDT pair reads at its probe: argument indices (0-based, as in
/// the note), [`N`] for none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsdtPoint {
    /// `provider` of `provider:name`.
    pub provider: &'static str,
    /// `name` of `provider:name`.
    pub probe: &'static str,
    /// The block's pointer (or handle).
    pub ptr_arg: u8,
    /// Its size in bytes (allocations; none: each block weighs 1).
    pub size_arg: u8,
    /// Sent along as the event's aux value (PyTorch: the stream).
    pub aux_arg: u8,
    /// Sent along as the event's tag (PyTorch: the device index).
    pub tag_arg: u8,
    /// The size is an estimate (a sampler's `weighted_bytes`).
    pub estimate: bool,
}

impl UsdtPoint {
    /// A point at `provider:name` reading only the pointer.
    pub fn new(provider: &'static str, probe: &'static str, ptr_arg: u8) -> Self {
        UsdtPoint {
            provider,
            probe,
            ptr_arg,
            size_arg: N,
            aux_arg: N,
            tag_arg: N,
            estimate: false,
        }
    }
}

impl FuncDef {
    pub(crate) const fn new(
        name: &'static str,
        allocator: Allocator,
        memory: Memory,
        domain: Domain,
    ) -> Self {
        FuncDef {
            name,
            allocator,
            memory,
            domain,
            kind: SpecKind::Alloc,
            ret: RetKind::Pointer,
            size_arg: N,
            count_arg: N,
            ptr_arg: N,
            out_arg: N,
            quirk: SpecQuirk::None,
            success_code: 0,
            prefix: "",
            parent_family: N,
            usdt: None,
        }
    }

    /// The same function, nested under `family` when called inside it.
    pub fn nested_under(mut self, family: u8) -> Self {
        self.parent_family = family;
        self
    }

    /// `void *f(..., size_t size @ size_arg, ...)`
    pub(crate) const fn returns_ptr(mut self, size_arg: u8) -> Self {
        self.size_arg = size_arg;
        self
    }

    /// `status f(void **out @ out_arg, size_t size @ size_arg, ...)`
    pub(crate) const fn out_status(mut self, out_arg: u8, size_arg: u8) -> Self {
        self.ret = RetKind::Status;
        self.out_arg = out_arg;
        self.size_arg = size_arg;
        self
    }

    pub(crate) const fn count(mut self, count_arg: u8) -> Self {
        self.count_arg = count_arg;
        self
    }

    pub(crate) const fn quirk(mut self, quirk: SpecQuirk) -> Self {
        self.quirk = quirk;
        self
    }

    /// `void f(void *ptr @ ptr_arg)`: released at entry, no result to check.
    pub(crate) const fn release(mut self, ptr_arg: u8) -> Self {
        self.kind = SpecKind::Free;
        self.ret = RetKind::Void;
        self.ptr_arg = ptr_arg;
        self
    }

    /// `status f(void *ptr @ ptr_arg)`: released only when the call succeeds.
    pub(crate) const fn release_checked(mut self, ptr_arg: u8) -> Self {
        self.kind = SpecKind::Free;
        self.ret = RetKind::Status;
        self.ptr_arg = ptr_arg;
        self
    }

    /// `void *f(void *old @ ptr_arg, size_t size @ size_arg)`
    pub(crate) const fn realloc(mut self, ptr_arg: u8, size_arg: u8) -> Self {
        self.kind = SpecKind::Realloc;
        self.ptr_arg = ptr_arg;
        self.size_arg = size_arg;
        self
    }

    /// Whether the function needs a return probe.
    pub fn needs_return_probe(&self) -> bool {
        self.ret != RetKind::Void
    }

    /// Whether only the pointer argument matters at entry, so the probe may be
    /// placed past a leading NULL check.
    pub fn is_plain_release(&self) -> bool {
        self.kind == SpecKind::Free && self.ret == RetKind::Void
    }

    /// Which group of names a missing function is reported within: the C
    /// interface, the C++ operators, or one allocator's own API, per prefix.
    pub fn group(&self) -> (Allocator, bool, &'static str) {
        (self.allocator, self.name.starts_with("_Z"), self.prefix)
    }

    /// The eBPF-side description of this function, stored at `index`.
    pub fn spec(&self, index: u16) -> ProbeSpec {
        let mut spec = ProbeSpec::empty();
        spec.index = index;
        spec.kind = self.kind as u8;
        spec.ret = self.ret as u8;
        spec.size_arg = self.size_arg;
        spec.count_arg = self.count_arg;
        spec.ptr_arg = self.ptr_arg;
        spec.out_arg = self.out_arg;
        spec.family = self.allocator.family();
        spec.parent_family = if self.parent_family == N {
            self.allocator.parent_family()
        } else {
            self.parent_family
        };
        spec.quirk = self.quirk as u8;
        spec.heap = u8::from(self.domain == Domain::Heap);
        spec.success_code = self.success_code;
        spec
    }
}

use Allocator::{Acl, Cuda, CudaDriver, Jemalloc, Libc, Mimalloc, Mmap, Python, Tcmalloc};
use Domain::{AclMemory, CudaMemory, CudaVmmHandle, Heap, Mapping};
use Memory::{Device, Host, Managed, Pinned};

/// Every function memtrace probes, in attach-plan order.
pub static CATALOG: &[FuncDef] = &[
    // ---- C library heap ----
    // `void *malloc(size_t size)`
    FuncDef::new("malloc", Libc, Host, Heap).returns_ptr(0),
    // `void *calloc(size_t nmemb, size_t size)`
    FuncDef::new("calloc", Libc, Host, Heap)
        .returns_ptr(1)
        .count(0),
    // `void *realloc(void *ptr, size_t size)`
    FuncDef::new("realloc", Libc, Host, Heap).realloc(0, 1),
    // `void *reallocarray(void *ptr, size_t nmemb, size_t size)`
    FuncDef::new("reallocarray", Libc, Host, Heap)
        .realloc(0, 2)
        .count(1),
    // `int posix_memalign(void **memptr, size_t alignment, size_t size)`
    FuncDef::new("posix_memalign", Libc, Host, Heap).out_status(0, 2),
    // `void *aligned_alloc(size_t alignment, size_t size)`
    FuncDef::new("aligned_alloc", Libc, Host, Heap).returns_ptr(1),
    // `void *memalign(size_t alignment, size_t size)`
    FuncDef::new("memalign", Libc, Host, Heap).returns_ptr(1),
    // `void *valloc(size_t size)`
    FuncDef::new("valloc", Libc, Host, Heap).returns_ptr(0),
    // `void *pvalloc(size_t size)`
    FuncDef::new("pvalloc", Libc, Host, Heap).returns_ptr(0),
    // `void free(void *ptr)`
    FuncDef::new("free", Libc, Host, Heap).release(0),
    // ---- C++ operators, in whichever object defines them (libstdc++,
    // libc++, an allocator, the executable) ----
    // `void *operator new(size_t)`, `new[]`, nothrow and `align_val_t` forms
    FuncDef::new("_Znwm", Libc, Host, Heap).returns_ptr(0),
    FuncDef::new("_Znam", Libc, Host, Heap).returns_ptr(0),
    FuncDef::new("_ZnwmRKSt9nothrow_t", Libc, Host, Heap).returns_ptr(0),
    FuncDef::new("_ZnamRKSt9nothrow_t", Libc, Host, Heap).returns_ptr(0),
    FuncDef::new("_ZnwmSt11align_val_t", Libc, Host, Heap).returns_ptr(0),
    FuncDef::new("_ZnamSt11align_val_t", Libc, Host, Heap).returns_ptr(0),
    FuncDef::new("_ZnwmSt11align_val_tRKSt9nothrow_t", Libc, Host, Heap).returns_ptr(0),
    FuncDef::new("_ZnamSt11align_val_tRKSt9nothrow_t", Libc, Host, Heap).returns_ptr(0),
    // `void operator delete(void *, ...)`, `delete[]`: plain, sized, aligned,
    // sized+aligned, nothrow
    FuncDef::new("_ZdlPv", Libc, Host, Heap).release(0),
    FuncDef::new("_ZdaPv", Libc, Host, Heap).release(0),
    FuncDef::new("_ZdlPvm", Libc, Host, Heap).release(0),
    FuncDef::new("_ZdaPvm", Libc, Host, Heap).release(0),
    FuncDef::new("_ZdlPvSt11align_val_t", Libc, Host, Heap).release(0),
    FuncDef::new("_ZdaPvSt11align_val_t", Libc, Host, Heap).release(0),
    FuncDef::new("_ZdlPvmSt11align_val_t", Libc, Host, Heap).release(0),
    FuncDef::new("_ZdaPvmSt11align_val_t", Libc, Host, Heap).release(0),
    FuncDef::new("_ZdlPvRKSt9nothrow_t", Libc, Host, Heap).release(0),
    FuncDef::new("_ZdaPvRKSt9nothrow_t", Libc, Host, Heap).release(0),
    FuncDef::new("_ZdlPvSt11align_val_tRKSt9nothrow_t", Libc, Host, Heap).release(0),
    FuncDef::new("_ZdaPvSt11align_val_tRKSt9nothrow_t", Libc, Host, Heap).release(0),
    // ---- jemalloc's own API ----
    // `void *mallocx(size_t size, int flags)`
    FuncDef::new("mallocx", Jemalloc, Host, Heap).returns_ptr(0),
    // `void *rallocx(void *ptr, size_t size, int flags)`
    FuncDef::new("rallocx", Jemalloc, Host, Heap).realloc(0, 1),
    // `size_t xallocx(void *ptr, size_t size, size_t extra, int flags)`: resizes
    // in place and returns the new real size.
    FuncDef::new("xallocx", Jemalloc, Host, Heap)
        .realloc(0, 1)
        .quirk(SpecQuirk::ResizeInPlace),
    // `void sdallocx(void *ptr, size_t size, int flags)`
    FuncDef::new("sdallocx", Jemalloc, Host, Heap).release(0),
    // `void dallocx(void *ptr, int flags)`
    FuncDef::new("dallocx", Jemalloc, Host, Heap).release(0),
    // ---- tcmalloc's `tc_*` entry points ----
    FuncDef::new("tc_malloc", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_malloc_skip_new_handler", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_calloc", Tcmalloc, Host, Heap)
        .returns_ptr(1)
        .count(0),
    FuncDef::new("tc_realloc", Tcmalloc, Host, Heap).realloc(0, 1),
    FuncDef::new("tc_memalign", Tcmalloc, Host, Heap).returns_ptr(1),
    FuncDef::new("tc_posix_memalign", Tcmalloc, Host, Heap).out_status(0, 2),
    FuncDef::new("tc_valloc", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_pvalloc", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_new", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_newarray", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_new_nothrow", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_newarray_nothrow", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_new_aligned", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_newarray_aligned", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_new_aligned_nothrow", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_newarray_aligned_nothrow", Tcmalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("tc_free", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_cfree", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_free_sized", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_delete", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_deletearray", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_delete_sized", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_deletearray_sized", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_delete_aligned", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_deletearray_aligned", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_delete_sized_aligned", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_deletearray_sized_aligned", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_delete_nothrow", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_deletearray_nothrow", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_delete_aligned_nothrow", Tcmalloc, Host, Heap).release(0),
    FuncDef::new("tc_deletearray_aligned_nothrow", Tcmalloc, Host, Heap).release(0),
    // ---- mimalloc's `mi_*` API (not the `mi_heap_*` one) ----
    FuncDef::new("mi_malloc", Mimalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("mi_zalloc", Mimalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("mi_malloc_small", Mimalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("mi_zalloc_small", Mimalloc, Host, Heap).returns_ptr(0),
    // `void *mi_calloc(size_t count, size_t size)`, `mi_mallocn` alike
    FuncDef::new("mi_calloc", Mimalloc, Host, Heap)
        .returns_ptr(1)
        .count(0),
    FuncDef::new("mi_mallocn", Mimalloc, Host, Heap)
        .returns_ptr(1)
        .count(0),
    FuncDef::new("mi_realloc", Mimalloc, Host, Heap).realloc(0, 1),
    // `void *mi_reallocn(void *p, size_t count, size_t size)`, `mi_reallocarray` alike
    FuncDef::new("mi_reallocn", Mimalloc, Host, Heap)
        .realloc(0, 2)
        .count(1),
    FuncDef::new("mi_reallocarray", Mimalloc, Host, Heap)
        .realloc(0, 2)
        .count(1),
    // `void *mi_malloc_aligned(size_t size, size_t alignment)` and the `_at` forms
    FuncDef::new("mi_malloc_aligned", Mimalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("mi_malloc_aligned_at", Mimalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("mi_zalloc_aligned", Mimalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("mi_zalloc_aligned_at", Mimalloc, Host, Heap).returns_ptr(0),
    // `void *mi_calloc_aligned(size_t count, size_t size, size_t alignment)`
    FuncDef::new("mi_calloc_aligned", Mimalloc, Host, Heap)
        .returns_ptr(1)
        .count(0),
    FuncDef::new("mi_calloc_aligned_at", Mimalloc, Host, Heap)
        .returns_ptr(1)
        .count(0),
    // `void *mi_realloc_aligned(void *p, size_t newsize, size_t alignment)`
    FuncDef::new("mi_realloc_aligned", Mimalloc, Host, Heap).realloc(0, 1),
    FuncDef::new("mi_realloc_aligned_at", Mimalloc, Host, Heap).realloc(0, 1),
    // `void *mi_new(size_t size)` and the rest of the `new` family
    FuncDef::new("mi_new", Mimalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("mi_new_aligned", Mimalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("mi_new_nothrow", Mimalloc, Host, Heap).returns_ptr(0),
    FuncDef::new("mi_new_aligned_nothrow", Mimalloc, Host, Heap).returns_ptr(0),
    // `void *mi_new_n(size_t count, size_t size)`
    FuncDef::new("mi_new_n", Mimalloc, Host, Heap)
        .returns_ptr(1)
        .count(0),
    FuncDef::new("mi_new_realloc", Mimalloc, Host, Heap).realloc(0, 1),
    // `void *mi_new_reallocn(void *p, size_t newcount, size_t size)`
    FuncDef::new("mi_new_reallocn", Mimalloc, Host, Heap)
        .realloc(0, 2)
        .count(1),
    // `void mi_free(void *p)`, sized and aligned forms
    FuncDef::new("mi_free", Mimalloc, Host, Heap).release(0),
    FuncDef::new("mi_free_size", Mimalloc, Host, Heap).release(0),
    FuncDef::new("mi_free_aligned", Mimalloc, Host, Heap).release(0),
    FuncDef::new("mi_free_size_aligned", Mimalloc, Host, Heap).release(0),
    // ---- anonymous mappings ----
    // `void *mmap(void *addr, size_t length, int prot, int flags, int fd, off_t offset)`
    FuncDef::new("mmap", Mmap, Host, Mapping)
        .returns_ptr(1)
        .quirk(SpecQuirk::AnonMmap)
        .mmap_ret(),
    // `int munmap(void *addr, size_t length)`
    FuncDef::new("munmap", Mmap, Host, Mapping)
        .release(0)
        .quirk(SpecQuirk::Munmap),
    // ---- CUDA runtime ----
    // `cudaError_t cudaMalloc(void **devPtr, size_t size)`
    FuncDef::new("cudaMalloc", Cuda, Device, CudaMemory).out_status(0, 1),
    // `cudaError_t cudaMallocManaged(void **devPtr, size_t size, unsigned int flags)`
    FuncDef::new("cudaMallocManaged", Cuda, Managed, CudaMemory).out_status(0, 1),
    // `cudaError_t cudaMallocHost(void **ptr, size_t size)`
    FuncDef::new("cudaMallocHost", Cuda, Pinned, CudaMemory).out_status(0, 1),
    // `cudaError_t cudaHostAlloc(void **pHost, size_t size, unsigned int flags)`
    FuncDef::new("cudaHostAlloc", Cuda, Pinned, CudaMemory).out_status(0, 1),
    // `cudaError_t cudaMallocPitch(void **devPtr, size_t *pitch, size_t width, size_t height)`
    FuncDef::new("cudaMallocPitch", Cuda, Device, CudaMemory)
        .out_status(0, 1)
        .count(3)
        .quirk(SpecQuirk::SizeOutParam),
    // `cudaError_t cudaMalloc3D(cudaPitchedPtr *pitchedDevPtr, cudaExtent extent)`
    FuncDef::new("cudaMalloc3D", Cuda, Device, CudaMemory)
        .out_status(0, N)
        .quirk(SpecQuirk::Malloc3D),
    // `cudaError_t cudaMallocAsync(void **devPtr, size_t size, cudaStream_t stream)`
    FuncDef::new("cudaMallocAsync", Cuda, Device, CudaMemory).out_status(0, 1),
    // `cudaError_t cudaMallocFromPoolAsync(void **ptr, size_t size, cudaMemPool_t pool, cudaStream_t stream)`
    FuncDef::new("cudaMallocFromPoolAsync", Cuda, Device, CudaMemory).out_status(0, 1),
    // `cudaError_t cudaFree(void *devPtr)`
    FuncDef::new("cudaFree", Cuda, Device, CudaMemory).release_checked(0),
    // `cudaError_t cudaFreeHost(void *ptr)`
    FuncDef::new("cudaFreeHost", Cuda, Pinned, CudaMemory).release_checked(0),
    // `cudaError_t cudaFreeAsync(void *devPtr, cudaStream_t hStream)`
    FuncDef::new("cudaFreeAsync", Cuda, Device, CudaMemory).release_checked(0),
    // ---- CUDA driver ----
    // `CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)`
    FuncDef::new("cuMemAlloc_v2", CudaDriver, Device, CudaMemory).out_status(0, 1),
    // `CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)`
    FuncDef::new("cuMemAllocManaged", CudaDriver, Managed, CudaMemory).out_status(0, 1),
    // `CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height, unsigned int ElementSizeBytes)`
    FuncDef::new("cuMemAllocPitch_v2", CudaDriver, Device, CudaMemory)
        .out_status(0, 1)
        .count(3)
        .quirk(SpecQuirk::SizeOutParam),
    // `CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)`
    FuncDef::new("cuMemAllocHost_v2", CudaDriver, Pinned, CudaMemory).out_status(0, 1),
    // `CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)`
    FuncDef::new("cuMemHostAlloc", CudaDriver, Pinned, CudaMemory).out_status(0, 1),
    // `CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)`
    FuncDef::new("cuMemAllocAsync", CudaDriver, Device, CudaMemory).out_status(0, 1),
    // `CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)`
    FuncDef::new("cuMemAllocFromPoolAsync", CudaDriver, Device, CudaMemory).out_status(0, 1),
    // `CUresult cuMemFree_v2(CUdeviceptr dptr)`
    FuncDef::new("cuMemFree_v2", CudaDriver, Device, CudaMemory).release_checked(0),
    // `CUresult cuMemFreeHost(void *p)`
    FuncDef::new("cuMemFreeHost", CudaDriver, Pinned, CudaMemory).release_checked(0),
    // `CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)`
    FuncDef::new("cuMemFreeAsync", CudaDriver, Device, CudaMemory).release_checked(0),
    // `CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop, unsigned long long flags)`
    FuncDef::new("cuMemCreate", CudaDriver, Device, CudaVmmHandle).out_status(0, 1),
    // `CUresult cuMemRelease(CUmemGenericAllocationHandle handle)`
    FuncDef::new("cuMemRelease", CudaDriver, Device, CudaVmmHandle).release_checked(0),
    // ---- Ascend ACL ----
    // `aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy)`
    FuncDef::new("aclrtMalloc", Acl, Device, AclMemory).out_status(0, 1),
    // `aclError aclrtMallocCached(void **devPtr, size_t size, aclrtMemMallocPolicy policy)`
    FuncDef::new("aclrtMallocCached", Acl, Device, AclMemory).out_status(0, 1),
    // `aclError aclrtMallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy)`
    FuncDef::new("aclrtMallocAlign32", Acl, Device, AclMemory).out_status(0, 1),
    // `aclError aclrtMallocHost(void **hostPtr, size_t size)`
    FuncDef::new("aclrtMallocHost", Acl, Pinned, AclMemory).out_status(0, 1),
    // `aclError aclrtFree(void *devPtr)`
    FuncDef::new("aclrtFree", Acl, Device, AclMemory).release_checked(0),
    // `aclError aclrtFreeHost(void *hostPtr)`
    FuncDef::new("aclrtFreeHost", Acl, Pinned, AclMemory).release_checked(0),
    // ---- CPython's object allocator (exported by libpython, or a static python) ----
    // `void *PyObject_Malloc(size_t size)`
    FuncDef::new("PyObject_Malloc", Python, Host, Heap).returns_ptr(0),
    // `void *PyObject_Calloc(size_t nelem, size_t elsize)`
    FuncDef::new("PyObject_Calloc", Python, Host, Heap)
        .returns_ptr(1)
        .count(0),
    // `void *PyObject_Realloc(void *ptr, size_t new_size)`
    FuncDef::new("PyObject_Realloc", Python, Host, Heap).realloc(0, 1),
    // `void PyObject_Free(void *ptr)`
    FuncDef::new("PyObject_Free", Python, Host, Heap).release(0),
    // pymalloc itself, where the symbol table names it: builds that inline
    // the exported functions into their callers (LTO) call these directly;
    // under an exported one they are nested and counted once.
    // `static void *_PyObject_Malloc(void *ctx, size_t nbytes)`
    FuncDef::new("_PyObject_Malloc", Python, Host, Heap).returns_ptr(1),
    // `static void *_PyObject_Calloc(void *ctx, size_t nelem, size_t elsize)`
    FuncDef::new("_PyObject_Calloc", Python, Host, Heap)
        .returns_ptr(2)
        .count(1),
    // `static void *_PyObject_Realloc(void *ctx, void *ptr, size_t nbytes)`
    FuncDef::new("_PyObject_Realloc", Python, Host, Heap).realloc(1, 2),
    // `static void _PyObject_Free(void *ctx, void *p)`
    FuncDef::new("_PyObject_Free", Python, Host, Heap).release(1),
];

impl FuncDef {
    pub(crate) const fn mmap_ret(mut self) -> Self {
        self.ret = RetKind::MmapPointer;
        self
    }
}

/// Symbol prefixes of jemalloc builds made not to replace `malloc`:
/// `je_` (`--with-jemalloc-prefix=je_`, redis's bundled copy) and `_rjem_`
/// (Rust's tikv-jemallocator).
pub const JEMALLOC_PREFIXES: [&str; 2] = ["je_", "_rjem_"];

/// The catalogue's C heap functions (the standard names and jemalloc's own)
/// again under `prefix`: what a prefixed allocator build exports. Made once
/// per session (the copies live as long as the process).
pub fn prefixed(prefix: &str, base: &[&'static FuncDef]) -> Vec<&'static FuncDef> {
    let jemalloc = JEMALLOC_PREFIXES.contains(&prefix);
    let prefix: &'static str = Box::leak(prefix.to_string().into_boxed_str());
    base.iter()
        .filter(|def| {
            def.prefix.is_empty()
                && !def.name.starts_with("_Z")
                && matches!(def.allocator, Libc | Jemalloc)
        })
        .map(|def| {
            let name: &'static str = Box::leak(format!("{prefix}{}", def.name).into_boxed_str());
            let allocator = if jemalloc { Jemalloc } else { def.allocator };
            let copy: &'static FuncDef = Box::leak(Box::new(FuncDef {
                name,
                allocator,
                prefix,
                ..**def
            }));
            copy
        })
        .collect()
}

/// Which heap allocator an object is, from its file name and the catalogue
/// functions it defines: the standard names (`malloc`, `operator new`) are
/// reported under it.
pub fn heap_allocator<'a>(
    path: &std::path::Path,
    defined: impl Iterator<Item = &'a FuncDef>,
) -> Allocator {
    let mut own = None;
    for def in defined {
        if matches!(def.allocator, Jemalloc | Tcmalloc | Mimalloc) {
            own = Some(def.allocator);
            break;
        }
    }
    if let Some(own) = own {
        return own;
    }
    let file = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    [
        ("jemalloc", Jemalloc),
        ("tcmalloc", Tcmalloc),
        ("mimalloc", Mimalloc),
    ]
    .into_iter()
    .find(|(word, _)| file.contains(word))
    .map_or(Libc, |(_, allocator)| allocator)
}

/// Looks a function up by name.
#[cfg(test)]
pub fn find(name: &str) -> Option<&'static FuncDef> {
    CATALOG.iter().find(|def| def.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique() {
        for (i, a) in CATALOG.iter().enumerate() {
            for b in &CATALOG[i + 1..] {
                assert_ne!(a.name, b.name);
            }
        }
    }

    #[test]
    fn specs_describe_the_prototypes() {
        let calloc = find("calloc").expect("calloc").spec(3);
        assert_eq!((calloc.size_arg, calloc.count_arg, calloc.index), (1, 0, 3));
        let free = find("free").expect("free");
        assert!(free.is_plain_release() && !free.needs_return_probe());
        let cuda_free = find("cudaFree").expect("cudaFree");
        assert!(cuda_free.needs_return_probe() && !cuda_free.is_plain_release());
        let driver = find("cuMemAlloc_v2").expect("driver").spec(0);
        assert_eq!(driver.parent_family, Allocator::Cuda.family());
        let mmap = find("mmap").expect("mmap").spec(0);
        assert_eq!(mmap.ret, RetKind::MmapPointer as u8);
        assert_eq!(mmap.parent_family, Allocator::Libc.family());
    }
}
