//! Embeds the eBPF object built by `cargo xtask build-ebpf`.
//!
//! The object lives at `memtrace-ebpf/target/bpfel-unknown-none/release/memtrace`
//! (or wherever `MEMTRACE_EBPF_OBJECT` points), the compat object for older
//! kernels at `memtrace-ebpf/target/compat/...` (`MEMTRACE_EBPF_OBJECT_COMPAT`). When it has not been built the
//! binary still compiles (so unit tests and clippy need only stable Rust) and
//! says at run time how to build it.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let object = std::env::var_os("MEMTRACE_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            manifest.join("../memtrace-ebpf/target/bpfel-unknown-none/release/memtrace")
        });
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join("memtrace.bpf.o");
    println!("cargo:rerun-if-env-changed=MEMTRACE_EBPF_OBJECT");
    println!("cargo:rerun-if-changed={}", object.display());
    let bytes = match std::fs::read(&object) {
        Ok(bytes) => bytes,
        Err(_) => {
            println!(
                "cargo:warning=eBPF object {} not found: run `cargo xtask build-ebpf` (tracing will be unavailable in this build)",
                object.display()
            );
            Vec::new()
        }
    };
    if let Err(err) = std::fs::write(&out, bytes) {
        panic!("cannot write {}: {err}", out.display());
    }
    // The object for kernels without attach cookies, atomics with fetch or
    // bpf_loop (memtrace-ebpf's `compat` feature, its own target dir).
    let compat = std::env::var_os("MEMTRACE_EBPF_OBJECT_COMPAT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            manifest.join("../memtrace-ebpf/target/compat/bpfel-unknown-none/release/memtrace")
        });
    let compat_out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default())
        .join("memtrace-compat.bpf.o");
    println!("cargo:rerun-if-env-changed=MEMTRACE_EBPF_OBJECT_COMPAT");
    println!("cargo:rerun-if-changed={}", compat.display());
    let bytes = match std::fs::read(&compat) {
        Ok(bytes) => bytes,
        Err(_) => {
            println!(
                "cargo:warning=eBPF object {} not found: run `cargo xtask build-ebpf` (kernels before 5.17 will be unsupported in this build)",
                compat.display()
            );
            Vec::new()
        }
    };
    if let Err(err) = std::fs::write(&compat_out, bytes) {
        panic!("cannot write {}: {err}", compat_out.display());
    }
}
