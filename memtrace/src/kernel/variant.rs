//! Which build of the eBPF programs the running kernel gets.
//!
//! The full object needs attach cookies (5.15), BPF atomics with fetch (5.12)
//! and `bpf_loop` (5.17). The `tailcall` object (memtrace-ebpf's `tailcall`
//! feature) needs cookies and atomics, not `bpf_loop`: its DWARF walks and
//! Python frame reads run as bounded loops split across tail calls, a few
//! frames per program; everything else is the full object's, heap pairs
//! settled in the kernel included. The `compat` object (the `compat`
//! feature) needs none of the three: it walks as `tailcall` does, finds each
//! probe's spec by the probed address, each return's call by its stack
//! pointer, and sends every heap event (no settling in the kernel). The
//! choice follows what the kernel was probed for, never its version;
//! `MEMTRACE_EBPF_VARIANT=full|tailcall|compat` overrides it (tests).
//!
//! The full and tailcall objects declare a task-local storage map (5.11), so
//! they need the map type; they keep each thread's in-flight calls in it
//! where uprobe programs may call its helpers (probed), and in hashed slots
//! elsewhere, or with `MEMTRACE_THREAD_STORAGE=0` (tests of that path).

use crate::kernel::features::{probe_feature, Feature, Presence};

/// A build of the eBPF programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Full,
    TailCall,
    Compat,
}

impl Variant {
    /// The stable name (`memtrace doctor`'s `ebpf_object`).
    pub fn key(self) -> &'static str {
        match self {
            Variant::Full => "full",
            Variant::TailCall => "tailcall",
            Variant::Compat => "compat",
        }
    }

    /// The variant named `key` ([`Variant::key`]).
    pub fn from_key(key: &str) -> Option<Variant> {
        [Variant::Full, Variant::TailCall, Variant::Compat]
            .into_iter()
            .find(|variant| variant.key() == key)
    }

    /// Finds each entry probe's spec by its attach cookie (not by address).
    pub fn has_cookies(self) -> bool {
        self != Variant::Compat
    }

    /// Runs its stack walks and Python reads in tail-called programs.
    pub fn tail_calls(self) -> bool {
        self != Variant::Full
    }
}

/// The features the full object needs (its programs call global BPF
/// functions and hold a tail call, which arm64 allows from 6.0).
pub const FULL_NEEDS: [Feature; 5] = [
    Feature::AttachCookie,
    Feature::AtomicsFetch,
    Feature::BpfLoop,
    Feature::TailCallsWithCalls,
    Feature::TaskStorage,
];

/// The features the `tailcall` object needs.
pub const TAILCALL_NEEDS: [Feature; 3] = [
    Feature::AttachCookie,
    Feature::AtomicsFetch,
    Feature::TaskStorage,
];

/// The variant chosen, and the features whose absence chose it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub variant: Variant,
    /// Features of the full object's the kernel lacks.
    pub missing: Vec<Feature>,
    /// Chosen by `MEMTRACE_EBPF_VARIANT`, not by the kernel.
    pub forced: bool,
    /// Each thread's in-flight calls are kept in its task-local storage
    /// (else in hashed slots).
    pub thread_storage: bool,
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
        let variant = if missing.is_empty() {
            Variant::Full
        } else if TAILCALL_NEEDS.iter().all(|need| !missing.contains(need)) {
            Variant::TailCall
        } else {
            Variant::Compat
        };
        Choice {
            variant,
            missing,
            forced: false,
            thread_storage: thread_storage(variant, presence(Feature::TaskStorageInUprobes)),
        }
    }

    /// Why this variant, in a few words: the features the kernel lacks, or
    /// the override.
    pub fn reason(&self) -> String {
        if self.forced {
            return format!("MEMTRACE_EBPF_VARIANT={}", self.variant.key());
        }
        if self.missing.is_empty() {
            return "this kernel has attach cookies, atomics with fetch and bpf_loop".to_string();
        }
        let lacks: Vec<String> = self
            .missing
            .iter()
            .map(|feature| format!("{} ({}+)", feature.key(), feature.since()))
            .collect();
        format!("this kernel lacks {}", lacks.join(", "))
    }

    /// What the object does differently from the full one, in one line
    /// (`None` for the full object). `settle`: settling in the kernel was
    /// asked for.
    pub fn notice(&self, settle: bool) -> Option<String> {
        let mut instead = Vec::new();
        match self.variant {
            Variant::Full => return None,
            Variant::TailCall => {}
            Variant::Compat => {
                instead.push("probes found by address");
                if settle {
                    instead.push("every heap event sent (none settled in the kernel)");
                }
            }
        }
        instead.push("stack walks and Python frames split across tail calls instead of bpf_loop");
        Some(format!(
            "{}: the {} eBPF programs are loaded: {}",
            self.reason(),
            self.variant.key(),
            instead.join("; ")
        ))
    }
}

/// Chooses the variant for the running kernel (`privileged`: this process
/// may load BPF programs, which the probes need).
pub fn choose(privileged: bool) -> Choice {
    let presence = |feature| probe_feature(feature, privileged);
    forced(presence).unwrap_or_else(|| Choice::from_presence(presence))
}

/// The variant `MEMTRACE_EBPF_VARIANT` names, if any (its in-flight calls
/// where `presence` says).
pub fn forced(presence: impl Fn(Feature) -> Presence) -> Option<Choice> {
    let variant = std::env::var("MEMTRACE_EBPF_VARIANT")
        .ok()
        .as_deref()
        .and_then(Variant::from_key)?;
    Some(Choice {
        variant,
        missing: Vec::new(),
        forced: true,
        thread_storage: thread_storage(variant, presence(Feature::TaskStorageInUprobes)),
    })
}

/// Whether `variant` keeps in-flight calls in task-local storage, where the
/// helpers' use from uprobe programs is `in_uprobes` (unknown: taken as
/// there, the load then says) and `MEMTRACE_THREAD_STORAGE` is not `0`.
fn thread_storage(variant: Variant, in_uprobes: Presence) -> bool {
    variant != Variant::Compat
        && in_uprobes != Presence::Missing
        && std::env::var("MEMTRACE_THREAD_STORAGE").as_deref() != Ok("0")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lacking(features: &[Feature]) -> Choice {
        Choice::from_presence(|feature| {
            if features.contains(&feature) {
                Presence::Missing
            } else {
                Presence::Found
            }
        })
    }

    #[test]
    fn a_kernel_with_everything_gets_the_full_object() {
        let choice = Choice::from_presence(|_| Presence::Found);
        assert_eq!(choice.variant, Variant::Full);
        assert!(choice.missing.is_empty());
        assert_eq!(choice.notice(true), None);
    }

    #[test]
    fn unknown_features_are_taken_as_present() {
        let choice = Choice::from_presence(|_| Presence::Unknown);
        assert_eq!(choice.variant, Variant::Full);
    }

    #[test]
    fn a_5_15_kernel_without_bpf_loop_gets_tail_calls_and_settles_in_the_kernel() {
        let choice = lacking(&[Feature::BpfLoop]);
        assert_eq!(choice.variant, Variant::TailCall);
        assert_eq!(choice.missing, vec![Feature::BpfLoop]);
        assert!(choice.variant.has_cookies() && choice.variant.tail_calls());
        let notice = choice.notice(true).expect("a notice");
        assert!(notice.contains("bpf_loop (5.17+)"), "{notice}");
        assert!(notice.contains("tailcall eBPF programs"), "{notice}");
        assert!(!notice.contains("settled"), "{notice}");
        assert!(!notice.contains("by address"), "{notice}");
    }

    #[test]
    fn a_kernel_with_atomics_but_no_cookies_gets_compat() {
        let choice = lacking(&[Feature::AttachCookie, Feature::BpfLoop]);
        assert_eq!(choice.variant, Variant::Compat);
        let notice = choice.notice(true).expect("a notice");
        assert!(notice.contains("attach_cookie (5.15+)"), "{notice}");
        assert!(notice.contains("none settled"), "{notice}");
    }

    #[test]
    fn a_5_10_kernel_lacks_all_three() {
        let choice = lacking(&[
            Feature::AttachCookie,
            Feature::AtomicsFetch,
            Feature::BpfLoop,
        ]);
        assert_eq!(choice.variant, Variant::Compat);
        assert_eq!(choice.missing.len(), 3);
        assert!(!choice.variant.has_cookies() && choice.variant.tail_calls());
        let notice = choice.notice(false).expect("a notice");
        assert!(!notice.contains("settled"), "{notice}");
        assert!(notice.contains("tail calls"), "{notice}");
    }

    #[test]
    fn an_arm64_kernel_before_6_0_with_bpf_loop_gets_tail_calls() {
        // 5.17-5.19 on arm64: bpf_loop, but no tail call from a program
        // that calls BPF functions, as the full object's do.
        let choice = lacking(&[Feature::TailCallsWithCalls]);
        assert_eq!(choice.variant, Variant::TailCall);
        let notice = choice.notice(true).expect("a notice");
        assert!(notice.contains("tail_calls_with_calls"), "{notice}");
    }

    #[test]
    fn in_flight_calls_go_to_thread_storage_where_uprobe_programs_may_use_it() {
        assert!(Choice::from_presence(|_| Presence::Found).thread_storage);
        assert!(Choice::from_presence(|_| Presence::Unknown).thread_storage);
        let without = lacking(&[Feature::TaskStorageInUprobes]);
        assert_eq!(without.variant, Variant::Full, "hashed slots instead");
        assert!(!without.thread_storage);
        // The compat object declares no task storage map.
        assert!(!lacking(&[Feature::AttachCookie]).thread_storage);
    }

    #[test]
    fn a_kernel_without_the_task_storage_map_gets_compat() {
        // The full and tailcall objects declare the map: the kernel must
        // create it for them to load.
        let choice = lacking(&[Feature::TaskStorage]);
        assert_eq!(choice.variant, Variant::Compat);
        assert!(!choice.thread_storage);
        let notice = choice.notice(true).expect("a notice");
        assert!(notice.contains("task_storage (5.11+)"), "{notice}");
    }

    #[test]
    fn variants_round_trip_by_key() {
        for variant in [Variant::Full, Variant::TailCall, Variant::Compat] {
            assert_eq!(Variant::from_key(variant.key()), Some(variant));
        }
        assert_eq!(Variant::from_key("fast"), None);
    }
}
