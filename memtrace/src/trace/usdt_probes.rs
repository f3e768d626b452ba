//! What the trace says about its USDT probes: the objects whose sites were
//! attached late (a `dlopen` after the start).

use crate::probe::usdt_plan::UsdtPlan;

/// Says which objects' USDT sites were just attached (a rescan found them).
pub fn say_new(plans: &[UsdtPlan]) {
    for plan in plans {
        eprintln!(
            "memtrace: probing USDT probes of newly loaded {} ({} sites)",
            plan.path.display(),
            plan.sites.len()
        );
    }
}
