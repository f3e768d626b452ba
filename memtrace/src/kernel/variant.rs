//! Which build of the eBPF programs the running kernel gets.
//!
//! The full object needs attach cookies (5.15), BPF atomics with fetch (5.12)
//! and `bpf_loop` (5.17). The `compat` object (memtrace-ebpf's `compat`
//! feature) needs none of them: it finds each probe's spec by the probed
//! address, each return's call by its stack pointer, sends every heap event
//! (no settling in the kernel), and takes frame-pointer stacks without
//! Python frames. The choice follows what the kernel was probed for, never
//! its version; `MEMTRACE_EBPF_VARIANT=full|compat` overrides it (tests).

use crate::kernel::features::{probe_feature, Feature, Presence};

/// A build of the eBPF programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Full,
    Compat,
}

impl Variant {
    /// The stable name (`memtrace doctor`'s `ebpf_object`).
    pub fn key(self) -> &'static str {
        match self {
            Variant::Full => "full",
            Variant::Compat => "compat",
        }
    }
}

/// The features the full object needs.
pub const FULL_NEEDS: [Feature; 3] = [
    Feature::AttachCookie,
    Feature::AtomicsFetch,
    Feature::BpfLoop,
];

/// The variant chosen, and the features whose absence chose it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub variant: Variant,
    pub missing: Vec<Feature>,
    /// Chosen by `MEMTRACE_EBPF_VARIANT`, not by the kernel.
    pub forced: bool,
}

impl Choice {
    /// The variant for a kernel where `presence` tells each feature (an
    /// unknown one is taken as present: the load then says what is wrong).
    pub fn from_presence(presence: impl Fn(Feature) -> Presence) -> Choice {
        let missing: Vec<Feature> = FULL_NEEDS
            .iter()
            .copied()
            .filter(|&feature| presence(feature) == Presence::Missing)
            .collect();
        Choice {
            variant: if missing.is_empty() {
                Variant::Full
            } else {
                Variant::Compat
            },
            missing,
            forced: false,
        }
    }

    /// What the compat object does instead, in one line (`None` for the
    /// full object). `dwarf`: DWARF stacks were asked for; `settle`:
    /// settling in the kernel was.
    pub fn notice(&self, dwarf: bool, settle: bool) -> Option<String> {
        if self.variant == Variant::Full {
            return None;
        }
        let why = if self.forced {
            "MEMTRACE_EBPF_VARIANT=compat".to_string()
        } else {
            let lacks: Vec<String> = self
                .missing
                .iter()
                .map(|feature| format!("{} ({}+)", feature.key(), feature.since()))
                .collect();
            format!("this kernel lacks {}", lacks.join(", "))
        };
        let mut instead = vec!["probes found by address"];
        if dwarf {
            instead.push("frame-pointer stacks instead of DWARF ones, no Python frames");
        }
        if settle {
            instead.push("every heap event sent (none settled in the kernel)");
        }
        Some(format!(
            "{why}: the compat eBPF programs are loaded: {}",
            instead.join("; ")
        ))
    }
}

/// Chooses the variant for the running kernel (`privileged`: this process
/// may load BPF programs, which the probes need).
pub fn choose(privileged: bool) -> Choice {
    match std::env::var("MEMTRACE_EBPF_VARIANT").as_deref() {
        Ok("compat") => {
            return Choice {
                variant: Variant::Compat,
                missing: Vec::new(),
                forced: true,
            }
        }
        Ok("full") => {
            return Choice {
                variant: Variant::Full,
                missing: Vec::new(),
                forced: true,
            }
        }
        _ => {}
    }
    Choice::from_presence(|feature| probe_feature(feature, privileged))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_with_everything_gets_the_full_object() {
        let choice = Choice::from_presence(|_| Presence::Found);
        assert_eq!(choice.variant, Variant::Full);
        assert!(choice.missing.is_empty());
        assert_eq!(choice.notice(true, true), None);
    }

    #[test]
    fn unknown_features_are_taken_as_present() {
        let choice = Choice::from_presence(|_| Presence::Unknown);
        assert_eq!(choice.variant, Variant::Full);
    }

    #[test]
    fn a_5_15_kernel_without_bpf_loop_gets_compat_and_says_why() {
        let choice = Choice::from_presence(|feature| {
            if feature == Feature::BpfLoop {
                Presence::Missing
            } else {
                Presence::Found
            }
        });
        assert_eq!(choice.variant, Variant::Compat);
        assert_eq!(choice.missing, vec![Feature::BpfLoop]);
        let notice = choice.notice(true, false).expect("a notice");
        assert!(notice.contains("bpf_loop"), "{notice}");
        assert!(notice.contains("frame-pointer stacks"), "{notice}");
        assert!(!notice.contains("settled"), "{notice}");
    }

    #[test]
    fn a_5_10_kernel_lacks_all_three() {
        let choice = Choice::from_presence(|feature| {
            if FULL_NEEDS.contains(&feature) {
                Presence::Missing
            } else {
                Presence::Found
            }
        });
        assert_eq!(choice.variant, Variant::Compat);
        assert_eq!(choice.missing.len(), 3);
        let notice = choice.notice(false, true).expect("a notice");
        assert!(notice.contains("none settled"), "{notice}");
        assert!(!notice.contains("DWARF"), "{notice}");
    }
}
