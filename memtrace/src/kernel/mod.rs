//! The running kernel as memtrace sees it: what it offers ([`features`]:
//! probed, never assumed from the version), how the verifier's refusals read
//! ([`verifier`]: one line and a saved log), the eBPF object's stack budget
//! per call chain ([`stack_budget`]: static, from the ELF), which build of
//! the eBPF programs the kernel gets ([`variant`]), and the capabilities
//! memtrace needs ([`privilege`]: checked up front, the missing one named),
//! and `uprobe_multi` links ([`uprobe_multi`]: probed and created here);
//! [`syscall_fd`] owns the descriptors raw `bpf(2)` calls return, and
//! [`pac`] the arm64 pointer-authentication mask of return addresses.
//! `memtrace doctor` (the `doctor` module) puts them on one screen.

pub mod features;
pub mod pac;
pub mod privilege;
pub mod stack_budget;
pub mod syscall_fd;
pub mod uprobe_multi;
pub mod variant;
pub mod verifier;
