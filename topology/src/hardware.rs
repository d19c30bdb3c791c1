//! Hardware presets and the figures the virtual-time model reads: per-link one-way ICI
//! bandwidth and per-hop latency, per-chip DCN egress bandwidth and latency, bf16 peak flops,
//! HBM size and bandwidth. Every field can be overridden.

use serde::{Deserialize, Serialize};

use crate::TopologyError;

const GB: f64 = 1e9;
const GIB: f64 = (1u64 << 30) as f64;

/// The modelled accelerator and its interconnect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hardware {
    pub name: String,
    /// One-way bandwidth of one ICI link, bytes/s.
    pub ici_bandwidth: f64,
    /// Latency of one ICI hop, ns.
    pub ici_latency_ns: f64,
    /// Per-chip DCN egress bandwidth shared by all its DCN traffic, bytes/s.
    pub dcn_bandwidth: f64,
    /// DCN latency, ns.
    pub dcn_latency_ns: f64,
    /// Peak bf16 flop/s.
    pub peak_flops: f64,
    /// HBM capacity, bytes.
    pub hbm_bytes: f64,
    /// HBM bandwidth, bytes/s.
    pub hbm_bandwidth: f64,
}

/// Optional replacements for any field of a preset (a config's `[hardware]` table).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareOverrides {
    pub ici_bandwidth: Option<f64>,
    pub ici_latency_ns: Option<f64>,
    pub dcn_bandwidth: Option<f64>,
    pub dcn_latency_ns: Option<f64>,
    pub peak_flops: Option<f64>,
    pub hbm_bytes: Option<f64>,
    pub hbm_bandwidth: Option<f64>,
}

/// Names of the built-in presets.
pub const PRESETS: [&str; 4] = ["v4", "v5e", "v5p", "v6e"];

impl Hardware {
    /// A preset with the public figures (see DESIGN.md). ICI latency 1 µs per hop; DCN
    /// latency 10 µs is an assumption to override.
    pub fn preset(name: &str) -> Result<Hardware, TopologyError> {
        let (ici, dcn, flops, hbm_gib, hbm_bw) = match name {
            "v4" => (45.0, 6.25, 275e12, 32.0, 1.2e12),
            "v5e" => (45.0, 3.125, 197e12, 16.0, 0.82e12),
            "v5p" => (90.0, 6.25, 459e12, 95.0, 2.76e12),
            "v6e" => (90.0, 12.5, 918e12, 32.0, 1.64e12),
            other => return Err(TopologyError::UnknownHardware(other.to_string())),
        };
        Ok(Hardware {
            name: name.to_string(),
            ici_bandwidth: ici * GB,
            ici_latency_ns: 1_000.0,
            dcn_bandwidth: dcn * GB,
            dcn_latency_ns: 10_000.0,
            peak_flops: flops,
            hbm_bytes: hbm_gib * GIB,
            hbm_bandwidth: hbm_bw,
        })
    }

    /// This hardware with the given fields replaced; rejects non-positive or non-finite values
    /// (latencies may be zero).
    pub fn with_overrides(mut self, o: &HardwareOverrides) -> Result<Hardware, TopologyError> {
        let fields: [(&'static str, Option<f64>, &mut f64, bool); 7] = [
            (
                "ici_bandwidth",
                o.ici_bandwidth,
                &mut self.ici_bandwidth,
                false,
            ),
            (
                "ici_latency_ns",
                o.ici_latency_ns,
                &mut self.ici_latency_ns,
                true,
            ),
            (
                "dcn_bandwidth",
                o.dcn_bandwidth,
                &mut self.dcn_bandwidth,
                false,
            ),
            (
                "dcn_latency_ns",
                o.dcn_latency_ns,
                &mut self.dcn_latency_ns,
                true,
            ),
            ("peak_flops", o.peak_flops, &mut self.peak_flops, false),
            ("hbm_bytes", o.hbm_bytes, &mut self.hbm_bytes, false),
            (
                "hbm_bandwidth",
                o.hbm_bandwidth,
                &mut self.hbm_bandwidth,
                false,
            ),
        ];
        let mut changed = false;
        for (field, value, slot, zero_ok) in fields {
            if let Some(v) = value {
                let ok = v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0));
                if !ok {
                    return Err(TopologyError::BadHardwareValue { field, value: v });
                }
                *slot = v;
                changed = true;
            }
        }
        if changed && !self.name.ends_with("(custom)") {
            self.name.push_str(" (custom)");
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_overrides() {
        let v5p = Hardware::preset("v5p").unwrap();
        assert_eq!(v5p.ici_bandwidth, 90e9);
        let o = HardwareOverrides {
            ici_latency_ns: Some(0.0),
            ..Default::default()
        };
        assert_eq!(v5p.clone().with_overrides(&o).unwrap().ici_latency_ns, 0.0);
        let bad = HardwareOverrides {
            ici_bandwidth: Some(-1.0),
            ..Default::default()
        };
        assert!(matches!(
            v5p.with_overrides(&bad),
            Err(TopologyError::BadHardwareValue {
                field: "ici_bandwidth",
                ..
            })
        ));
        assert!(Hardware::preset("h100").is_err());
    }
}
