//! Collective fingerprints: the identity of one collective call. Every message carries its
//! sender's fingerprint, so a chip that receives a message from a different collective than
//! the one it is in reports a desync naming both, instead of reducing garbage or waiting.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::reduce::ReduceOp;

/// The collective operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OpKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
    Barrier,
}

impl OpKind {
    pub const ALL: [OpKind; 6] = [
        OpKind::AllReduce,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::Broadcast,
        OpKind::AllToAll,
        OpKind::Barrier,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all-reduce",
            OpKind::AllGather => "all-gather",
            OpKind::ReduceScatter => "reduce-scatter",
            OpKind::Broadcast => "broadcast",
            OpKind::AllToAll => "all-to-all",
            OpKind::Barrier => "barrier",
        }
    }

    pub fn code(self) -> u32 {
        match self {
            OpKind::AllReduce => 1,
            OpKind::AllGather => 2,
            OpKind::ReduceScatter => 3,
            OpKind::Broadcast => 4,
            OpKind::AllToAll => 5,
            OpKind::Barrier => 6,
        }
    }

    pub fn from_code(code: u32) -> Option<OpKind> {
        OpKind::ALL.into_iter().find(|o| o.code() == code)
    }

    /// nccl-tests' bus-bandwidth factor: busbw = algbw * factor(n).
    pub fn busbw_factor(self, n: u32) -> f64 {
        let n = f64::from(n.max(1));
        match self {
            OpKind::AllReduce => 2.0 * (n - 1.0) / n,
            OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => (n - 1.0) / n,
            OpKind::Broadcast => 1.0,
            OpKind::Barrier => 0.0,
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for OpKind {
    type Err = String;
    fn from_str(s: &str) -> Result<OpKind, String> {
        OpKind::ALL
            .into_iter()
            .find(|op| op.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = OpKind::ALL.iter().map(|o| o.name()).collect();
                format!(
                    "unknown collective {s:?} (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// Element type, as the modelled links carry it. Data mode moves f32 values: a bf16
/// collective in data mode reduces them in f32 and charges 2 bytes per element (a PyTorch rank
/// widens its 16-bit tensors and rounds the result back; podsim's own programs stay f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    Bf16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 => 2,
        }
    }

    pub fn code(self) -> u32 {
        match self {
            DType::F32 => 1,
            DType::Bf16 => 2,
        }
    }

    pub fn from_code(code: u32) -> Option<DType> {
        [DType::F32, DType::Bf16]
            .into_iter()
            .find(|d| d.code() == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        }
    }
}

/// (group, seq, op, dtype, element count, reduce op): what every member of a collective agrees on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fingerprint {
    pub group: u64,
    pub seq: u64,
    pub op: OpKind,
    pub dtype: DType,
    pub count: u64,
    pub reduce: Option<ReduceOp>,
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}#{} on group {} ({} x {}",
            self.op,
            self.seq,
            self.group,
            self.count,
            self.dtype.name()
        )?;
        if let Some(r) = self.reduce {
            write!(f, ", {r}")?;
        }
        f.write_str(")")
    }
}
