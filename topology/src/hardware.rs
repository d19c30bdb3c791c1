//! Hardware presets and the figures the virtual-time model reads: the interconnect (per-link
//! one-way ICI bandwidth and per-hop latency, per-chip DCN egress bandwidth and latency, the
//! host link), the chip (bf16 peak flops, HBM size and bandwidth) and the kernel model's
//! constants (MXU tile, the achievable fractions of peak, flash attention's block, the fixed
//! cost of a kernel). Every field can be overridden in a config's `[hardware]` table.
//!
//! Each preset value says where it comes from in [`Hardware::preset`]. The kernel-model
//! constants that no data sheet gives (`matmul_efficiency`, `hbm_efficiency`,
//! `attention_efficiency`, `kernel_overhead_ns`) are one value for every chip generation and
//! every model: they describe how close a kernel gets to the hardware's limits, not a model.
//! Two of them, the matmul and attention efficiencies, are set against published step times.

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
    /// Edge of the MXU's systolic array: matmul dimensions are padded to a multiple of it.
    pub mxu_tile: f64,
    /// Fraction of `peak_flops` a large, tile-aligned matmul sustains.
    pub matmul_efficiency: f64,
    /// Edge of the output block a matmul keeps in on-chip memory: each input panel is read
    /// from HBM once per block of the other operand, which sets a matmul's HBM traffic.
    pub matmul_block: f64,
    /// Fraction of `hbm_bandwidth` a streaming (element-wise, normalisation) kernel sustains.
    pub hbm_efficiency: f64,
    /// Fraction of `peak_flops` the flash-attention kernel sustains on the blocks it computes
    /// (the softmax between its two matmuls runs on the vector unit).
    pub attention_efficiency: f64,
    /// Query and key block of flash attention; causal attention skips fully masked blocks.
    pub attention_block: f64,
    /// Fixed cost of launching one kernel, ns.
    pub kernel_overhead_ns: f64,
    /// Host link (PCIe) bandwidth per chip, each way, bytes/s: offloaded activations cross it.
    pub host_bandwidth: f64,
    /// Chips that share one host (a TPU VM): the ranks a launcher starts on one machine,
    /// whose `LOCAL_RANK` and `LOCAL_WORLD_SIZE` a PyTorch program reads.
    pub chips_per_host: f64,
    /// Fraction of `ici_bandwidth` a transfer over an ICI link sustains (DMA descriptors,
    /// packet headers, flow control).
    pub ici_efficiency: f64,
    /// Fixed cost of one collective on a chip, ns: its launch and the synchronisation of the
    /// group before data moves, paid once per collective whatever its size.
    pub collective_overhead_ns: f64,
    /// Fraction of a chip's share of its host's NICs (`dcn_bandwidth`) that a cross-slice
    /// transfer sustains (host networking stack, congestion in the data-centre network).
    pub dcn_efficiency: f64,
    /// TensorCores per chip: each is one device to JAX, so a published benchmark that gives
    /// bytes per device moves this many times that per chip.
    pub tensorcores_per_chip: f64,
}

/// Defines [`HardwareOverrides`] and its application from one list of field names, so a new
/// field of [`Hardware`] is declared once. `zero_ok` fields (latencies, overheads) may be 0.
macro_rules! overridable {
    ($($field:ident: $zero_ok:expr),* $(,)?) => {
        /// Optional replacements for any field of a preset (a config's `[hardware]` table).
        #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct HardwareOverrides {
            $(pub $field: Option<f64>,)*
        }

        /// Keys of a config's `[hardware]` table.
        pub const HARDWARE_KEYS: &[&str] = &[$(stringify!($field)),*];

        impl Hardware {
            /// This hardware with the given fields replaced; rejects non-positive or
            /// non-finite values (latencies and the kernel overhead may be zero; fractions of
            /// peak may not exceed 1; counts of chips are whole).
            pub fn with_overrides(mut self, o: &HardwareOverrides) -> Result<Hardware, TopologyError> {
                let mut changed = false;
                $(
                    if let Some(v) = o.$field {
                        let field = stringify!($field);
                        let fraction = field.ends_with("_efficiency");
                        let count = field.starts_with("chips_") || field.starts_with("tensorcores_");
                        let ok = v.is_finite()
                            && (v > 0.0 || ($zero_ok && v == 0.0))
                            && (!fraction || v <= 1.0)
                            && (!count || v.fract() == 0.0);
                        if !ok {
                            return Err(TopologyError::BadHardwareValue { field, value: v });
                        }
                        self.$field = v;
                        changed = true;
                    }
                )*
                if changed && !self.name.ends_with("(custom)") {
                    self.name.push_str(" (custom)");
                }
                Ok(self)
            }
        }
    };
}

overridable! {
    ici_bandwidth: false,
    ici_latency_ns: true,
    dcn_bandwidth: false,
    dcn_latency_ns: true,
    peak_flops: false,
    hbm_bytes: false,
    hbm_bandwidth: false,
    mxu_tile: false,
    matmul_efficiency: false,
    matmul_block: false,
    hbm_efficiency: false,
    attention_efficiency: false,
    attention_block: false,
    kernel_overhead_ns: true,
    host_bandwidth: false,
    chips_per_host: false,
    ici_efficiency: false,
    collective_overhead_ns: true,
    dcn_efficiency: false,
    tensorcores_per_chip: false,
}

/// Names of the built-in presets.
pub const PRESETS: [&str; 5] = ["v4", "v5e", "v5p", "v6e", "tpu7x"];

impl Hardware {
    /// A preset. Sources:
    /// - ICI, DCN, peak bf16 flops, HBM size and bandwidth: the vendor's public per-chip
    ///   figures (see docs/DESIGN.md), ICI per link one way as the JAX scaling book gives it
    ///   (TPU7x: MaxText's 180 GB/s per ICI axis, both ways), DCN as the host's NICs over its
    ///   chips; ICI latency 1 µs per hop (the scaling book) and DCN latency 10 µs (an
    ///   assumption to override).
    /// - `mxu_tile`: 128x128 MXUs on v4, v5e and v5p, 256x256 on v6e (the vendor's
    ///   architecture descriptions) and TPU7x (MaxText's sizing guidance for it).
    /// - `tensorcores_per_chip`: 2 on TPU7x (its data sheet), 1 on the others.
    /// - `ici_efficiency`, `collective_overhead_ns`, `dcn_efficiency`: set against published
    ///   collective timings (the constants below).
    /// - `attention_block`: 512, the query and key block sizes of the Pallas flash-attention
    ///   kernel as the published training recipes configure it.
    /// - `matmul_block`: 1024, the output block a 16-128 MiB on-chip vector memory holds with
    ///   its f32 accumulator (4 MiB) and double-buffered input panels; it makes a matmul on v6e
    ///   (918 TFLOP/s over 1.64 TB/s: 560 flops per byte) HBM-bound where v4-v5p are not.
    /// - `host_bandwidth`: a PCIe Gen3 x16 link on v4 and Gen4 x16 on the later chips, each
    ///   way (assumption: the vendor publishes no host-link figure).
    /// - `chips_per_host`: 4, the host of every multi-host slice of these generations (the
    ///   vendor's machine types: v4 and v5p hosts, `ct5lp-hightpu-4t`, `ct6e-standard-4t`,
    ///   `tpu7x-standard-4t`).
    /// - `hbm_efficiency` 0.85, `kernel_overhead_ns` 1 µs: how close streaming kernels get to
    ///   the limits above (DMA, issue overheads), assumptions made before looking at any
    ///   measurement, the same for every chip and model.
    /// - `matmul_efficiency` 0.79 and `attention_efficiency` 0.65: what a matmul and the
    ///   flash-attention kernel sustain inside a training step, which no data sheet rates
    ///   (for attention, the softmax between its matmuls runs on the vector unit). Both are
    ///   set against the published step times of `configs/validation/published.csv`, one value
    ///   each for every chip and model: of a grid (0.74-0.82 by 0.01, 0.45-0.75 by 0.05), the
    ///   points that meet the calibration's aims on those rows (each within 10%, the median
    ///   within 5%, none out of memory) and, among them, the one with the smallest mean error
    ///   (`scripts/calibrate.py` runs the grid). The other files of `configs/validation/`
    ///   stay out of the choice, to check it (docs/PERFORMANCE.md has both).
    pub fn preset(name: &str) -> Result<Hardware, TopologyError> {
        let (ici, dcn, flops, hbm_gib, hbm_bw, tile, host) = match name {
            "v4" => (45.0, 6.25, 275e12, 32.0, 1.2e12, 128.0, 16.0),
            "v5e" => (45.0, 3.125, 197e12, 16.0, 0.82e12, 128.0, 32.0),
            "v5p" => (90.0, 6.25, 459e12, 95.0, 2.76e12, 128.0, 32.0),
            "v6e" => (90.0, 12.5, 918e12, 32.0, 1.64e12, 256.0, 32.0),
            "tpu7x" => (90.0, 12.5, 2307e12, 192.0, 7.38e12, 256.0, 32.0),
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
            mxu_tile: tile,
            matmul_efficiency: 0.79,
            matmul_block: 1024.0,
            hbm_efficiency: 0.85,
            attention_efficiency: 0.65,
            attention_block: 512.0,
            kernel_overhead_ns: 1_000.0,
            host_bandwidth: host * GB,
            chips_per_host: 4.0,
            ici_efficiency: ICI_EFFICIENCY,
            collective_overhead_ns: if name == "tpu7x" {
                TPU7X_COLLECTIVE_OVERHEAD_NS
            } else {
                COLLECTIVE_OVERHEAD_NS
            },
            dcn_efficiency: DCN_EFFICIENCY,
            tensorcores_per_chip: if name == "tpu7x" { 2.0 } else { 1.0 },
        })
    }
}

impl Hardware {
    /// How long a message of `bytes` holds the sender's link (the first value, ns) and how
    /// long after that it arrives (the second). ICI: the link at `ici_efficiency` of its
    /// bandwidth, then one hop's latency. DCN goes through the hosts, as it is built: the
    /// sender's PCIe link into host memory and its share of the host's NICs (at
    /// `dcn_efficiency`) hold the chip's DCN egress one after the other (the host stages the
    /// buffer before it sends it); the network's latency and the receiver's PCIe link into
    /// HBM follow.
    pub fn link_time_ns(&self, dcn: bool, bytes: f64) -> (f64, f64) {
        if dcn {
            let pcie = bytes / self.host_bandwidth * 1e9;
            let nic = bytes / (self.dcn_bandwidth * self.dcn_efficiency) * 1e9;
            (pcie + nic, self.dcn_latency_ns + pcie)
        } else {
            let wire = bytes / (self.ici_bandwidth * self.ici_efficiency) * 1e9;
            (wire, self.ici_latency_ns)
        }
    }

    /// How long a collective's reduction of `bytes` received takes on a chip where `sharing`
    /// lanes of the collective reduce at once, ns: it reads both operands and writes the sum
    /// through HBM (at `hbm_efficiency`), and the lanes share that bandwidth.
    pub fn reduction_ns(&self, bytes: f64, sharing: f64) -> f64 {
        3.0 * bytes * sharing.max(1.0) / (self.hbm_bandwidth * self.hbm_efficiency) * 1e9
    }
}

// The link model's constants that no data sheet gives, one value for every generation where
// the data does not say otherwise: set against the published collective timings of
// `configs/validation/collectives.csv` by `scripts/calibrate_links.py` (its rule and the rows
// that check it: docs/DESIGN.md, "The link model").
const ICI_EFFICIENCY: f64 = 0.91;
const COLLECTIVE_OVERHEAD_NS: f64 = 3_000.0;
// TPU7x's all-gathers were measured offloaded to its SparseCores, a launch the other
// generations' collectives do not make.
const TPU7X_COLLECTIVE_OVERHEAD_NS: f64 = 8_500.0;
const DCN_EFFICIENCY: f64 = 0.45;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_preset_is_refused_naming_every_known_one() {
        let err = Hardware::preset("v9").unwrap_err().to_string();
        assert!(err.contains("\"v9\""), "{err}");
        for known in PRESETS {
            assert!(Hardware::preset(known).is_ok(), "{known}");
            assert!(err.contains(known), "{err} does not name {known}");
        }
    }

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
        let refused = |preset: &str, o: HardwareOverrides| {
            Hardware::preset(preset)
                .unwrap()
                .with_overrides(&o)
                .is_err()
        };
        assert!(refused(
            "v4",
            HardwareOverrides {
                matmul_efficiency: Some(1.5),
                ..Default::default()
            }
        ));
        assert_eq!(Hardware::preset("v6e").unwrap().mxu_tile, 256.0);
        assert!(refused(
            "v5p",
            HardwareOverrides {
                chips_per_host: Some(2.5),
                ..Default::default()
            }
        ));
    }
}
