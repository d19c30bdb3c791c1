//! Hooks through which injected faults reach the fabric: before a chip starts a collective
//! and before it sends a message. The worker implements them from the job's `[[faults]]`;
//! without a hook nothing here costs anything.

use std::time::Duration;

use podsim_topology::ChipId;

use crate::fabric::Message;
use crate::fingerprint::Fingerprint;

/// What to do with the collective a chip is about to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BeforeCollective {
    Proceed,
    /// Stop making progress here, forever (a stalled chip).
    Stall,
    /// Behave as if the previous collective had been skipped (the chip runs one sequence
    /// number ahead of its group).
    Skip,
}

/// What to do with a message about to be sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OnSend {
    Deliver,
    /// Lose it silently (the sender believes it was sent).
    Drop,
    /// Deliver it late: `wall` of real time, `virtual_ns` of extra modelled latency.
    Delay {
        wall: Duration,
        virtual_ns: f64,
    },
}

/// Fault injection as the collectives see it.
pub trait FaultHook: Send + Sync + std::fmt::Debug {
    /// Chip `chip` starts training step (or script iteration) `step`: `Stall` stops it here.
    fn at_step(&self, chip: ChipId, step: u64) -> BeforeCollective;

    /// Chip `chip` is about to start its `index`-th collective; the hook may alter its
    /// fingerprint (a chip calling a different collective or size).
    fn before_collective(
        &self,
        chip: ChipId,
        index: u64,
        fingerprint: &mut Fingerprint,
    ) -> BeforeCollective;

    /// `msg` is about to leave; the hook may alter its payload (flipped bits). `busy` is the
    /// wall time the sender spent on its own work since its previous send.
    fn on_send(&self, msg: &mut Message, busy: Duration) -> OnSend;
}
