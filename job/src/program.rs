//! What every kind of program shares: how its collectives are issued.

use serde::{Deserialize, Serialize};

/// How collectives are issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Eager {
    /// Strict, plus fingerprints compared across the group before every collective and
    /// replicas compared after every step.
    Debug,
    /// Each collective as written (one per parameter), waited for before going on.
    Strict,
    /// Coalesced (DDP buckets, FSDP per-layer groups) and overlapped with compute.
    Fused,
}

podsim_collectives::named_enum!(Eager, "eager mode", {
    Debug => "debug",
    Strict => "strict",
    Fused => "fused",
});
