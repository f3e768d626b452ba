//! Sets `bpf_target_arch` for this crate's own per-architecture layer
//! (`src/arch.rs`), as aya-ebpf's build script does for aya-ebpf: from
//! `AYA_BPF_TARGET_ARCH` when cross-building, else the host's architecture.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(bpf_target_arch, values(\"x86_64\", \"aarch64\"))");
    println!("cargo:rerun-if-env-changed=AYA_BPF_TARGET_ARCH");
    println!("cargo:rerun-if-env-changed=HOST");
    if std::env::var_os("CARGO_CFG_BPF_TARGET_ARCH").is_some() {
        return;
    }
    let arch = std::env::var("AYA_BPF_TARGET_ARCH").unwrap_or_else(|_| {
        let host = std::env::var("HOST").unwrap_or_default();
        host.split('-').next().unwrap_or("x86_64").to_string()
    });
    println!("cargo:rustc-cfg=bpf_target_arch=\"{arch}\"");
}
