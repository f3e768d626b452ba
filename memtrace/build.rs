//! Embeds the eBPF objects built by `cargo xtask build-ebpf` for the
//! architecture this binary is built for (its probes read that
//! architecture's registers): the full object, the tailcall object for
//! kernels without `bpf_loop` and the compat object for kernels without
//! attach cookies or atomics with fetch either (`kernel::variant`).
//!
//! x86-64: `memtrace-ebpf/target/bpfel-unknown-none/release/memtrace`,
//! `memtrace-ebpf/target/tailcall/...` and `.../compat/...`; arm64:
//! `memtrace-ebpf/target/aarch64/...`, `.../tailcall-aarch64/...` and
//! `.../compat-aarch64/...` (`cargo xtask build-ebpf --target
//! aarch64-unknown-linux-gnu`). `MEMTRACE_EBPF_OBJECT`,
//! `MEMTRACE_EBPF_OBJECT_TAILCALL` and `MEMTRACE_EBPF_OBJECT_COMPAT` override
//! them. When an object has not been
//! built the binary still compiles (so unit tests and clippy need only
//! stable Rust) and says at run time how to build it.

use std::path::{Path, PathBuf};

/// Copies `object` (or an empty file when it is missing) to `OUT_DIR/name`.
fn embed(env: &str, object: PathBuf, name: &str, missing: &str) {
    let object = std::env::var_os(env).map(PathBuf::from).unwrap_or(object);
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join(name);
    println!("cargo:rerun-if-env-changed={env}");
    println!("cargo:rerun-if-changed={}", object.display());
    let bytes = match std::fs::read(&object) {
        Ok(bytes) => bytes,
        Err(_) => {
            println!(
                "cargo:warning=eBPF object {} not found: run `cargo xtask build-ebpf` ({missing})",
                object.display()
            );
            Vec::new()
        }
    };
    if let Err(err) = std::fs::write(&out, bytes) {
        panic!("cannot write {}: {err}", out.display());
    }
}

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let ebpf = manifest.join("../memtrace-ebpf/target");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let (full, tailcall, compat): (PathBuf, PathBuf, PathBuf) = match arch.as_str() {
        "aarch64" => (
            ebpf.join("aarch64"),
            ebpf.join("tailcall-aarch64"),
            ebpf.join("compat-aarch64"),
        ),
        _ => (ebpf.clone(), ebpf.join("tailcall"), ebpf.join("compat")),
    };
    let object = |dir: &Path| dir.join("bpfel-unknown-none/release/memtrace");
    embed(
        "MEMTRACE_EBPF_OBJECT",
        object(&full),
        "memtrace.bpf.o",
        "tracing will be unavailable in this build",
    );
    embed(
        "MEMTRACE_EBPF_OBJECT_TAILCALL",
        object(&tailcall),
        "memtrace-tailcall.bpf.o",
        "kernels with attach cookies but no bpf_loop (5.15, 5.16) will be unsupported in this build",
    );
    embed(
        "MEMTRACE_EBPF_OBJECT_COMPAT",
        object(&compat),
        "memtrace-compat.bpf.o",
        "kernels before 5.17 will be unsupported in this build",
    );
}
