//! The instruction-set architectures memtrace traces: x86-64 and arm64
//! (aarch64). A traced process always runs the architecture memtrace itself
//! was built for ([`Arch::HOST`]); the pure logic that depends on it (probe
//! placement, USDT argument specs, CFI rules, TLS layouts) takes an [`Arch`]
//! so that both are tested on whichever host runs the unit tests.

use std::fmt;

/// An instruction-set architecture memtrace can trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    X86_64,
    Aarch64,
}

impl Arch {
    /// The architecture this binary runs on (and so traces).
    pub const HOST: Arch = if cfg!(target_arch = "aarch64") {
        Arch::Aarch64
    } else {
        Arch::X86_64
    };

    /// The name `uname -m` prints.
    pub fn name(self) -> &'static str {
        match self {
            Self::X86_64 => "x86_64",
            Self::Aarch64 => "aarch64",
        }
    }

    /// The architecture of an ELF `e_machine`, when memtrace traces it.
    pub fn from_elf_machine(machine: u16) -> Option<Self> {
        match machine {
            62 => Some(Self::X86_64),
            183 => Some(Self::Aarch64),
            _ => None,
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_and_elf_machines() {
        assert_eq!(Arch::from_elf_machine(62), Some(Arch::X86_64));
        assert_eq!(Arch::from_elf_machine(183), Some(Arch::Aarch64));
        assert_eq!(Arch::from_elf_machine(3), None);
        assert_eq!(Arch::HOST.name(), std::env::consts::ARCH);
    }
}
