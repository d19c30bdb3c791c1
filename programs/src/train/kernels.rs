//! The kernel model: what one kernel costs on the modelled chip.
//!
//! A training step is charged kernel by kernel. Each kernel is described by its shape, not by
//! a flop count alone, because the hardware does not run every flop at the same speed:
//!
//! - A **matmul** `(m, k) x (k, n)` runs on the MXU: every dimension is padded to a multiple of
//!   the MXU tile (a dimension of 129 costs as much as one of 256 on a 128-wide MXU), and the
//!   padded flops run at `matmul_efficiency` of peak. It also streams its operands from HBM:
//!   with output blocks of `matmul_block` held on chip, the left operand is read once per
//!   block column of the output and the right once per block row. The kernel takes the longer
//!   of the two (a roofline over the kernel's real traffic), so small matmuls are bound by
//!   memory and large ones by the MXU: the achievable fraction of peak grows with size.
//! - An **element-wise** or normalisation pass streams its arrays at `hbm_efficiency` of the
//!   HBM bandwidth.
//! - **Flash attention** computes scores block by block (`attention_block` queries by
//!   `attention_block` keys, head dimension padded to the MXU tile); causal attention skips
//!   the blocks above the diagonal. Forward runs two matmuls per block (`QK^T`, `PV`);
//!   backward recomputes the scores and runs five (`QK^T`, `dV`, `dP`, `dQ`, `dK`). The
//!   blocks run at `attention_efficiency` of peak (the softmax between the matmuls runs on
//!   the vector unit).
//!
//! Every kernel also pays `kernel_overhead_ns`. Flops reported for a kernel are the useful
//! ones (unpadded; causal attention counts the computed blocks), for the hardware flops of a
//! step; model flops (MFU) are counted separately from the model's shape.

use podsim_topology::Hardware;

/// One kernel, by its shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kernel {
    /// `(m, k) x (k, n)`.
    Matmul { m: usize, k: usize, n: usize },
    /// A pass over `elems` elements doing `flops_per` flops each, reading `reads` arrays of
    /// that many elements and writing `writes` (arrays of the compute type; a wider type
    /// counts as a fraction more).
    Elementwise {
        elems: usize,
        flops_per: f64,
        reads: f64,
        writes: f64,
    },
    /// Flash attention over `seqs` sequences of `seq` tokens with `heads` query heads of
    /// `head_dim` (fractional when tensor parallelism splits fewer heads than chips).
    Attention {
        seqs: usize,
        seq: usize,
        heads: f64,
        head_dim: usize,
        causal: bool,
        backward: bool,
    },
}

/// Matmuls per block of flash attention: `QK^T` and `PV` forward; backward recomputes `QK^T`
/// and forms `dV`, `dP`, `dQ` and `dK`.
const ATTENTION_FORWARD_MATMULS: f64 = 2.0;
const ATTENTION_BACKWARD_MATMULS: f64 = 5.0;

fn pad(x: f64, tile: f64) -> f64 {
    (x / tile).ceil() * tile
}

impl Kernel {
    /// Useful flops of the kernel.
    pub fn flops(&self) -> f64 {
        match *self {
            Kernel::Matmul { m, k, n } => 2.0 * m as f64 * k as f64 * n as f64,
            Kernel::Elementwise {
                elems, flops_per, ..
            } => flops_per * elems as f64,
            Kernel::Attention { head_dim, .. } => {
                let (blocks, edge) = self.attention_blocks(f64::INFINITY);
                self.attention_matmuls() * blocks * 2.0 * edge * edge * head_dim as f64
            }
        }
    }

    fn attention_matmuls(&self) -> f64 {
        match self {
            Kernel::Attention { backward: true, .. } => ATTENTION_BACKWARD_MATMULS,
            _ => ATTENTION_FORWARD_MATMULS,
        }
    }

    /// Query-by-key blocks computed (over every sequence and head) and the block edge, for
    /// blocks of `block` tokens (infinite: the exact count of causal pairs).
    fn attention_blocks(&self, block: f64) -> (f64, f64) {
        let Kernel::Attention {
            seqs,
            seq,
            heads,
            causal,
            ..
        } = *self
        else {
            return (0.0, 0.0);
        };
        if seq == 0 {
            return (0.0, 0.0); // an empty sequence: no block to compute
        }
        let seq = seq as f64;
        let edge = block.min(seq);
        let per_side = (seq / edge).ceil();
        let pairs = if !causal {
            per_side * per_side
        } else if block.is_finite() {
            // Blocks on and below the diagonal.
            per_side * (per_side + 1.0) / 2.0
        } else {
            // Exact: half the square (the useful work, whatever the blocking).
            0.5
        };
        (seqs as f64 * heads * pairs, edge)
    }

    /// Time on `hw`, ns, for elements of `elem_bytes` bytes, with HBM to itself.
    pub fn time_ns(&self, hw: &Hardware, elem_bytes: f64) -> f64 {
        self.work(hw, elem_bytes).time_ns(hw)
    }

    /// What the kernel asks of `hw`: its MXU time and its HBM traffic, each alone.
    pub fn work(&self, hw: &Hardware, elem_bytes: f64) -> Work {
        let (mxu_s, hbm_bytes) = match *self {
            Kernel::Matmul { m, k, n } => {
                let (m, k, n) = (m as f64, k as f64, n as f64);
                let tile = hw.mxu_tile;
                let padded = 2.0 * pad(m, tile) * pad(k, tile) * pad(n, tile);
                let block = hw.matmul_block;
                let traffic =
                    elem_bytes * (m * k * (n / block).ceil() + k * n * (m / block).ceil() + m * n);
                (padded / (hw.peak_flops * hw.matmul_efficiency), traffic)
            }
            Kernel::Elementwise {
                elems,
                reads,
                writes,
                ..
            } => (0.0, elem_bytes * (reads + writes) * elems as f64),
            Kernel::Attention { head_dim, .. } => {
                let (blocks, edge) = self.attention_blocks(hw.attention_block);
                let padded = self.attention_matmuls()
                    * blocks
                    * 2.0
                    * pad(edge, hw.mxu_tile)
                    * edge
                    * pad(head_dim as f64, hw.mxu_tile);
                (padded / (hw.peak_flops * hw.attention_efficiency), 0.0)
            }
        };
        Work {
            mxu_ns: mxu_s * 1e9,
            hbm_bytes,
            overhead_ns: hw.kernel_overhead_ns,
        }
    }
}

/// What one kernel (or a run of like kernels) asks of the chip: the kernel takes the longer
/// of its MXU time and the time its bytes take through HBM, plus its fixed cost. Kept apart
/// because HBM is shared with communication in flight ([`crate::train::hbm_share`]) and the
/// MXU is not.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Work {
    pub mxu_ns: f64,
    pub hbm_bytes: f64,
    pub overhead_ns: f64,
}

impl Work {
    /// Its time with HBM to itself, ns.
    pub fn time_ns(&self, hw: &Hardware) -> f64 {
        self.mxu_ns.max(hbm_stream_s(hw, self.hbm_bytes) * 1e9) + self.overhead_ns
    }

    /// `n` runs of it, as one.
    pub fn times(self, n: f64) -> Work {
        Work {
            mxu_ns: self.mxu_ns * n,
            hbm_bytes: self.hbm_bytes * n,
            overhead_ns: self.overhead_ns * n,
        }
    }
}

/// Seconds to stream `bytes` through HBM at the sustained fraction of its bandwidth: what an
/// element-wise or normalisation kernel's time is, before its fixed cost.
pub fn hbm_stream_s(hw: &Hardware, bytes: f64) -> f64 {
    bytes / hbm_sustained(hw)
}

/// The HBM bandwidth a streaming kernel sustains, bytes/s.
pub fn hbm_sustained(hw: &Hardware) -> f64 {
    hw.hbm_bandwidth * hw.hbm_efficiency
}

/// The kernels of one step of work (a layer's forward, an op's backward), in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Cost {
    pub kernels: Vec<Kernel>,
}

impl Cost {
    /// A `(m, k) x (k, n)` matrix product.
    pub fn matmul(m: usize, k: usize, n: usize) -> Cost {
        Kernel::Matmul { m, k, n }.into()
    }

    /// An element-wise pass over `n` elements reading `reads` arrays and writing one.
    pub fn elementwise(n: usize, flops_per: f64, reads: f64) -> Cost {
        Cost::elementwise_rw(n, flops_per, reads, 1.0)
    }

    /// An element-wise pass over `n` elements reading `reads` arrays and writing `writes`.
    pub fn elementwise_rw(n: usize, flops_per: f64, reads: f64, writes: f64) -> Cost {
        Kernel::Elementwise {
            elems: n,
            flops_per,
            reads,
            writes,
        }
        .into()
    }

    pub fn plus(mut self, o: Cost) -> Cost {
        self.kernels.extend(o.kernels);
        self
    }

    pub fn flops(&self) -> f64 {
        self.kernels.iter().map(Kernel::flops).sum()
    }

    /// What each kernel asks of `hw`, in order.
    pub fn works<'c>(
        &'c self,
        hw: &'c Hardware,
        elem_bytes: f64,
    ) -> impl Iterator<Item = Work> + 'c {
        self.kernels.iter().map(move |k| k.work(hw, elem_bytes))
    }
}

impl From<Kernel> for Cost {
    fn from(k: Kernel) -> Cost {
        Cost { kernels: vec![k] }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v5p() -> Hardware {
        Hardware::preset("v5p").unwrap()
    }

    #[test]
    fn a_dimension_of_129_costs_as_much_as_256_on_a_128_wide_mxu() {
        let hw = v5p();
        // 129 rows against 8192 x 8192 weights: bound by the MXU, not by streaming the weight.
        let t = |m| {
            Kernel::Matmul {
                m,
                k: 8192,
                n: 8192,
            }
            .time_ns(&hw, 2.0)
        };
        assert_eq!(t(129), t(256));
        assert!(t(128) < t(129));
        // The padded flops at the matmul efficiency, plus the kernel's fixed cost.
        let expected =
            2.0 * 256.0 * 8192.0 * 8192.0 / (459e12 * hw.matmul_efficiency) * 1e9 + 1000.0;
        assert!((t(256) - expected).abs() < 1e-6 * expected, "{}", t(256));
    }

    #[test]
    fn small_matmuls_are_bound_by_memory_and_large_ones_by_the_mxu() {
        let hw = v5p();
        let fraction = |m: usize| {
            let k = Kernel::Matmul {
                m,
                k: 4096,
                n: 4096,
            };
            k.flops() / (k.time_ns(&hw, 2.0) * 1e-9) / hw.peak_flops
        };
        // A matrix-vector-like product streams the weight and barely uses the MXU.
        assert!(fraction(8) < 0.05, "{}", fraction(8));
        assert!(fraction(256) < fraction(1024));
        // A large one comes within a few percent of the matmul efficiency, never above it.
        let large = fraction(16384);
        assert!(large > 0.94 * hw.matmul_efficiency && large <= hw.matmul_efficiency);
    }

    #[test]
    fn v6e_matmuls_are_hbm_bound_at_the_block_size() {
        let hw = Hardware::preset("v6e").unwrap();
        let k = Kernel::Matmul {
            m: 16384,
            k: 8192,
            n: 28672,
        };
        // Traffic: each operand re-read once per 1024-wide block of the other.
        let traffic = 2.0 * (16384.0 * 8192.0 * 28.0 + 8192.0 * 28672.0 * 16.0 + 16384.0 * 28672.0);
        let expected = traffic / (1.64e12 * 0.85) * 1e9 + 1000.0;
        assert!((k.time_ns(&hw, 2.0) - expected).abs() < 1e-6 * expected);
    }

    #[test]
    fn causal_attention_skips_blocks_above_the_diagonal() {
        let hw = v5p();
        let attn = |causal, backward| Kernel::Attention {
            seqs: 2,
            seq: 4096,
            heads: 8.0,
            head_dim: 128,
            causal,
            backward,
        };
        // 8 blocks a side: 36 of 64 computed.
        let full = attn(false, false).time_ns(&hw, 2.0) - 1000.0;
        let causal = attn(true, false).time_ns(&hw, 2.0) - 1000.0;
        assert!((causal / full - 36.0 / 64.0).abs() < 1e-12);
        // Backward: five matmuls per block against two.
        let back = attn(true, true).time_ns(&hw, 2.0) - 1000.0;
        assert!((back / causal - 2.5).abs() < 1e-12);
        // Useful flops: QK^T and PV over half the score matrix.
        let flops = 2.0 * 8.0 * 2.0 * 2.0 * 4096.0 * 4096.0 * 128.0 / 2.0;
        assert!((attn(true, false).flops() - flops).abs() < 1.0);
        // A head dimension of 128 pads to 256 on v6e's MXU: twice the time per flop.
        let v6e = Hardware::preset("v6e").unwrap();
        let k = attn(true, false);
        let per_flop = |hw: &Hardware| (k.time_ns(hw, 2.0) - 1000.0) * hw.peak_flops;
        assert!((per_flop(&v6e) / per_flop(&hw) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn attention_over_an_empty_sequence_is_its_fixed_cost() {
        let hw = v5p();
        for causal in [false, true] {
            let empty = Kernel::Attention {
                seqs: 2,
                seq: 0,
                heads: 8.0,
                head_dim: 128,
                causal,
                backward: false,
            };
            assert_eq!(empty.time_ns(&hw, 2.0), hw.kernel_overhead_ns);
            assert_eq!(empty.flops(), 0.0);
        }
    }
}
