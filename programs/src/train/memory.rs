//! Per-chip HBM accounting: every buffer a training step holds is charged to the chip's budget
//! by kind, the peak is tracked, and going over the budget is an out-of-memory error that names
//! the chip, what it was allocating and how much was in use.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::ProgramError;

/// What a buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum MemKind {
    /// The chip's own (possibly sharded) parameters.
    Params,
    /// Gradients of the chip's own parameters.
    Grads,
    /// Optimizer state (momentum, Adam moments).
    Optimizer,
    /// Activations saved for backward.
    Activations,
    /// Transient buffers: gathered (unsharded) parameters and unsharded gradients.
    Transient,
}

impl MemKind {
    const ALL: [MemKind; 5] = [
        MemKind::Params,
        MemKind::Grads,
        MemKind::Optimizer,
        MemKind::Activations,
        MemKind::Transient,
    ];

    pub fn name(self) -> &'static str {
        match self {
            MemKind::Params => "params",
            MemKind::Grads => "grads",
            MemKind::Optimizer => "optimizer",
            MemKind::Activations => "activations",
            MemKind::Transient => "transient",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One chip's HBM ledger.
#[derive(Debug, Clone)]
pub struct Hbm {
    chip: u32,
    capacity: u64,
    in_use: [u64; 5],
    peak: u64,
    peak_by_kind: [u64; 5],
    peak_state: u64,
    /// Record what does not fit and go on (meta mode's prediction) instead of failing.
    lenient: bool,
    oom: Option<String>,
}

/// What a chip's HBM held at its peaks, bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HbmReport {
    pub capacity_bytes: u64,
    pub peak_bytes: u64,
    /// Peak of parameters + gradients + optimizer state (the persistent training state).
    pub peak_state_bytes: u64,
    /// Peak of each kind on its own.
    pub peak_by_kind: BTreeMap<String, u64>,
    /// Meta mode: the first allocation that did not fit (the chip would be out of memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom: Option<String>,
}

impl Hbm {
    pub fn new(chip: u32, capacity: u64) -> Hbm {
        Hbm {
            chip,
            capacity,
            in_use: [0; 5],
            peak: 0,
            peak_by_kind: [0; 5],
            peak_state: 0,
            lenient: false,
            oom: None,
        }
    }

    /// When `lenient`, an allocation over capacity is recorded as the out-of-memory verdict
    /// and charged anyway, so the peak says how much the chip would need.
    pub fn lenient(self, lenient: bool) -> Hbm {
        Hbm { lenient, ..self }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn in_use(&self) -> u64 {
        self.in_use.iter().sum()
    }

    /// Charges `bytes` of `kind`; `what` names the buffer in the error when it does not fit.
    pub fn alloc(
        &mut self,
        kind: MemKind,
        bytes: u64,
        what: impl FnOnce() -> String,
    ) -> Result<(), ProgramError> {
        let in_use = self.in_use();
        if in_use + bytes > self.capacity {
            let err = ProgramError::OutOfMemory {
                chip: self.chip,
                what: what(),
                need: bytes,
                in_use,
                peak: self.peak.max(in_use),
                capacity: self.capacity,
            };
            if !self.lenient {
                return Err(err);
            }
            self.oom.get_or_insert_with(|| err.to_string());
        }
        let k = kind.index();
        self.in_use[k] += bytes;
        self.peak = self.peak.max(in_use + bytes);
        self.peak_by_kind[k] = self.peak_by_kind[k].max(self.in_use[k]);
        let state = self.in_use[MemKind::Params.index()]
            + self.in_use[MemKind::Grads.index()]
            + self.in_use[MemKind::Optimizer.index()];
        self.peak_state = self.peak_state.max(state);
        Ok(())
    }

    pub fn free(&mut self, kind: MemKind, bytes: u64) {
        let k = kind.index();
        self.in_use[k] = self.in_use[k].saturating_sub(bytes);
    }

    pub fn report(&self) -> HbmReport {
        HbmReport {
            capacity_bytes: self.capacity,
            peak_bytes: self.peak,
            peak_state_bytes: self.peak_state,
            peak_by_kind: MemKind::ALL
                .iter()
                .map(|k| (k.name().to_string(), self.peak_by_kind[k.index()]))
                .collect(),
            oom: self.oom.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracks_peaks_and_refuses_what_does_not_fit() {
        let mut hbm = Hbm::new(3, 100);
        hbm.alloc(MemKind::Params, 40, || "w".into()).unwrap();
        hbm.alloc(MemKind::Activations, 50, || "x".into()).unwrap();
        hbm.free(MemKind::Activations, 50);
        hbm.alloc(MemKind::Grads, 40, || "g".into()).unwrap();
        let err = hbm
            .alloc(MemKind::Transient, 30, || "gathered layer 2".into())
            .unwrap_err();
        assert_eq!(
            err,
            ProgramError::OutOfMemory {
                chip: 3,
                what: "gathered layer 2".into(),
                need: 30,
                in_use: 80,
                peak: 90,
                capacity: 100
            }
        );
        let r = hbm.report();
        assert_eq!((r.peak_bytes, r.peak_state_bytes), (90, 80));
        assert_eq!(r.peak_by_kind["activations"], 50);
    }
}
