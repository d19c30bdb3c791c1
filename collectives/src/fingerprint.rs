//! Collective fingerprints: the identity of one collective call. Every message carries its
//! sender's fingerprint, so a chip that receives a message from a different collective than
//! the one it is in reports a desync naming both, instead of reducing garbage or waiting.

use std::fmt;

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
    /// A point-to-point message (a PyTorch `send` and its matching `recv`).
    SendRecv,
}

crate::named_enum!(OpKind, "collective", {
    AllReduce => "all-reduce",
    AllGather => "all-gather",
    ReduceScatter => "reduce-scatter",
    Broadcast => "broadcast",
    AllToAll => "all-to-all",
    Barrier => "barrier",
    SendRecv => "send-recv",
});

impl OpKind {
    pub fn code(self) -> u32 {
        match self {
            OpKind::AllReduce => 1,
            OpKind::AllGather => 2,
            OpKind::ReduceScatter => 3,
            OpKind::Broadcast => 4,
            OpKind::AllToAll => 5,
            OpKind::Barrier => 6,
            OpKind::SendRecv => 7,
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
            OpKind::Broadcast | OpKind::SendRecv => 1.0,
            OpKind::Barrier => 0.0,
        }
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

crate::named_enum!(DType, "dtype", {
    F32 => "f32",
    Bf16 => "bf16",
});

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
        DType::ALL.into_iter().find(|d| d.code() == code)
    }
}

/// Marks the key of a point-to-point channel, outside the range of group ids (below
/// `2^Group::ID_BITS`) and of debug fingerprint exchanges (the bit just above).
const CHANNEL_BIT: u64 = 1 << 63;
/// A channel key holds its sending chip in the low 24 bits (`MAX_CHIPS` is `2^24`), the
/// receiving chip in the next 24 and the tag in the 15 bits above.
const CHIP_BITS: u32 = 24;
const CHIP_MASK: u64 = (1 << CHIP_BITS) - 1;

/// Largest tag a point-to-point message may carry.
pub const MAX_TAG: u32 = (1 << (63 - 2 * CHIP_BITS)) - 1;

/// The key of the point-to-point channel from `src` to `dst` under `tag` (at most
/// [`MAX_TAG`]): the calls on it are numbered in their own sequence, as a group's are.
pub(crate) fn channel(src: u32, dst: u32, tag: u32) -> u64 {
    CHANNEL_BIT
        | u64::from(tag) << (2 * CHIP_BITS)
        | (u64::from(dst) & CHIP_MASK) << CHIP_BITS
        | (u64::from(src) & CHIP_MASK)
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

impl Fingerprint {
    /// The sending chip, receiving chip and tag of a point-to-point call.
    pub fn channel(&self) -> Option<(u32, u32, u32)> {
        (self.op == OpKind::SendRecv && self.group & CHANNEL_BIT != 0).then(|| {
            let g = self.group & !CHANNEL_BIT;
            (
                (g & CHIP_MASK) as u32,
                (g >> CHIP_BITS & CHIP_MASK) as u32,
                (g >> (2 * CHIP_BITS)) as u32,
            )
        })
    }
}

/// Where a communicator's instance sits in its fingerprints' group key (see `Comm::key`):
/// above the group id and the debug-exchange bit, below the point-to-point channel bit.
pub(crate) const INSTANCE_SHIFT: u32 = podsim_topology::Group::ID_BITS + 1;

/// A group key as a reader knows the group: its axes (`{x,y}`) when it spans whole axes, its
/// number when it holds parts of them (their spans are hashed into it), then which instance
/// of a communicator over those chips it is, and a debug check's exchange.
fn group_name(key: u64) -> String {
    use podsim_topology::{Group, PodAxis};
    let id = key & ((1 << Group::ID_BITS) - 1);
    let mut name = match u8::try_from(id) {
        Ok(mask) => {
            let axes = [
                PodAxis::Torus(0),
                PodAxis::Torus(1),
                PodAxis::Torus(2),
                PodAxis::Slices,
            ];
            let group = (0..axes.len())
                .filter(|&i| mask & (1 << i) != 0)
                .fold(Group::of(&[]), |g, i| g.with(axes[i]));
            group.to_string()
        }
        Err(_) => format!("#{id}"),
    };
    let instance = (key & !CHANNEL_BIT) >> INSTANCE_SHIFT;
    if instance > 0 {
        name.push_str(&format!(" (instance {instance})"));
    }
    if key >> Group::ID_BITS & 1 == 1 {
        name.push_str(" (debug check)");
    }
    name
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((src, dst, tag)) = self.channel() {
            let tag = if tag == 0 {
                String::new()
            } else {
                format!(" tag {tag}")
            };
            return write!(
                f,
                "{}#{} from chip {src} to chip {dst}{tag} ({} x {})",
                self.op,
                self.seq,
                self.count,
                self.dtype.name()
            );
        }
        write!(
            f,
            "{}#{} on group {} ({} x {}",
            self.op,
            self.seq,
            group_name(self.group),
            self.count,
            self.dtype.name()
        )?;
        if let Some(r) = self.reduce {
            write!(f, ", {r}")?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_key_reads_as_its_axes_instance_and_check() {
        assert_eq!(group_name(0b011), "{x,y}");
        assert_eq!(group_name(0b1100), "{z,dcn}");
        assert_eq!(group_name(0b001 | 2 << INSTANCE_SHIFT), "{x} (instance 2)");
        let verify = 1 << podsim_topology::Group::ID_BITS;
        assert_eq!(group_name(0b111 | verify), "{x,y,z} (debug check)");
        // A group of parts of axes: its spans are hashed into the id.
        assert_eq!(group_name(0x0012_3401), "#1192961");
    }
}
