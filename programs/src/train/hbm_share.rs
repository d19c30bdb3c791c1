//! HBM shared by a chip's kernels and its communication in flight.
//!
//! A collective moves its bytes through the HBM of the chips it connects: what a chip sends
//! is read from HBM, what it receives is written there, and a reduction reads both operands
//! and writes the sum (`ChipStats::hbm_traffic` counts them; the host link's copies of
//! offloaded activations count the same way). While communication overlaps compute, those
//! bytes take HBM bandwidth from the kernels. A kernel whose time is set by its MXU hides
//! them as long as its own traffic leaves room; one whose time is set by its HBM traffic (an
//! element-wise pass, or a matmul on a chip whose MXU outruns its HBM at the block size, as
//! v6e's does) runs as much longer as the bytes it was denied.
//!
//! The rule: a collective (or host transfer) takes HBM at its average rate, its bytes over
//! its duration, from its start to its end; over each stretch of a kernel's run the kernel
//! streams at the sustained bandwidth less what the communication in flight takes, but
//! never at less than half of it (when both want more than there is, the memory system
//! serves the cores and the DMA engines in turn). Communication keeps the times the link
//! model gave it: it is what a kernel waits for that moves, not the reverse.

use podsim_collectives::{Chip, Nanos};
use podsim_topology::Hardware;

use crate::train::kernels::{Work, hbm_sustained};

/// Communication in flight on one chip, as HBM bandwidth it takes over time.
#[derive(Debug, Default)]
pub struct HbmShare {
    busy: Vec<Busy>,
    /// What the kernels run so far lost to it, ns: their time beside it less their time alone.
    waited_ns: f64,
}

/// One collective or transfer: HBM taken at `rate` bytes per ns from `start` to `done`.
#[derive(Debug, Clone, Copy)]
struct Busy {
    start: Nanos,
    done: Nanos,
    rate: f64,
}

/// The least share of HBM bandwidth a kernel keeps when communication wants the rest.
const KERNEL_FLOOR: f64 = 0.5;

impl HbmShare {
    /// Communication that moved `bytes` through HBM between `start` and `done`.
    pub fn communicating(&mut self, start: Nanos, done: Nanos, bytes: u64) {
        if done > start && bytes > 0 {
            self.busy.push(Busy {
                start,
                done,
                rate: bytes as f64 / (done - start),
            });
        }
    }

    /// The collective `chip` ran from `start` until its clock now, `traffic_before` being its
    /// communication's HBM traffic (`ChipStats::hbm_traffic`) when the collective began.
    pub fn collective_ran(&mut self, chip: &Chip, start: Nanos, traffic_before: u64) {
        let moved = chip.stats().hbm_traffic().saturating_sub(traffic_before);
        self.communicating(start, chip.clock(), moved);
    }

    /// How long `work` takes when it starts at `start`, ns: its fixed cost, then the longer of
    /// its MXU time and the time its HBM traffic takes beside the communication in flight.
    /// Communication that ended before `start` is forgotten (kernels are charged in order).
    pub fn run(&mut self, hw: &Hardware, start: Nanos, work: &Work) -> Nanos {
        self.busy.retain(|b| b.done > start);
        let alone = work.time_ns(hw);
        // Nothing to share (and no bytes that could not be counted down).
        if self.busy.is_empty() || work.hbm_bytes.is_nan() || work.hbm_bytes <= 0.0 {
            return alone;
        }
        let bandwidth = hbm_sustained(hw) / 1e9;
        let from = start + work.overhead_ns;
        let mut t = from;
        let mut left = work.hbm_bytes;
        loop {
            let (taken, until) = self.taken_at(t);
            let own = (bandwidth - taken).max(bandwidth * KERNEL_FLOOR);
            if left <= own * (until - t) {
                t += left / own;
                break;
            }
            left -= own * (until - t);
            t = until;
        }
        let took = work.overhead_ns + work.mxu_ns.max(t - from);
        self.waited_ns += (took - alone).max(0.0);
        took
    }

    /// The time the kernels run so far lost to communication's HBM traffic, ns (part of their
    /// time).
    pub fn waited_ns(&self) -> f64 {
        self.waited_ns
    }

    /// How long `works`, run one after the other from `start`, take, ns.
    pub fn run_all(
        &mut self,
        hw: &Hardware,
        start: Nanos,
        works: impl IntoIterator<Item = Work>,
    ) -> Nanos {
        works
            .into_iter()
            .fold(0.0, |ns, work| ns + self.run(hw, start + ns, &work))
    }

    /// The HBM rate communication takes at `t` and when that rate next changes.
    fn taken_at(&self, t: Nanos) -> (f64, Nanos) {
        let mut taken = 0.0;
        let mut until = f64::INFINITY;
        for b in &self.busy {
            if b.start <= t && t < b.done {
                taken += b.rate;
                until = until.min(b.done);
            } else if b.start > t {
                until = until.min(b.start);
            }
        }
        (taken, until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v6e() -> Hardware {
        Hardware::preset("v6e").unwrap()
    }

    /// v6e, the bytes per ns a kernel streams there with HBM to itself, and communication
    /// taking `fraction` of that from `start` to `done` ns.
    fn beside(fraction: f64, start: f64, done: f64) -> (Hardware, f64, HbmShare) {
        let hw = v6e();
        let bw = hbm_sustained(&hw) / 1e9;
        let mut share = HbmShare::default();
        share.communicating(start, done, (fraction * bw * (done - start)) as u64);
        (hw, bw, share)
    }

    fn streaming(bytes: f64) -> Work {
        Work {
            mxu_ns: 0.0,
            hbm_bytes: bytes,
            overhead_ns: 0.0,
        }
    }

    #[test]
    fn without_communication_a_kernel_takes_its_own_time() {
        let hw = v6e();
        let work = Work {
            mxu_ns: 10.0,
            hbm_bytes: 1e6,
            overhead_ns: 1000.0,
        };
        assert_eq!(HbmShare::default().run(&hw, 0.0, &work), work.time_ns(&hw));
    }

    #[test]
    fn a_streaming_kernel_yields_what_communication_takes() {
        // A quarter of the bandwidth, for longer than the kernel runs.
        let (hw, bw, mut share) = beside(0.25, 0.0, 1e9);
        let alone = 1000.0;
        let got = share.run(&hw, 0.0, &streaming(bw * alone));
        assert!((got - alone * 4.0 / 3.0).abs() < 1e-6 * alone, "{got}");
        assert!((share.waited_ns() - alone / 3.0).abs() < 1e-6 * alone);
    }

    #[test]
    fn a_kernel_bound_by_its_mxu_hides_communication_its_traffic_leaves_room_for() {
        let (hw, bw, mut share) = beside(0.25, 0.0, 1e9);
        let work = Work {
            mxu_ns: 1000.0,
            hbm_bytes: bw * 500.0,
            overhead_ns: 0.0,
        };
        assert_eq!(share.run(&hw, 0.0, &work), 1000.0);
    }

    #[test]
    fn communication_that_ends_midway_slows_only_its_stretch() {
        // Half the bandwidth for the first 100 ns.
        let (hw, bw, mut share) = beside(0.5, 0.0, 100.0);
        let got = share.run(&hw, 0.0, &streaming(bw * 1000.0));
        // 100 ns at half speed move 50 ns of the kernel's bytes; 950 ns remain.
        assert!((got - 1050.0).abs() < 1e-3, "{got}");
        // Communication over before the kernel starts is forgotten.
        assert_eq!(
            share.run(&hw, 200.0, &streaming(bw * 10.0)),
            streaming(bw * 10.0).time_ns(&hw)
        );
    }

    #[test]
    fn a_kernel_keeps_half_of_hbm_however_much_communication_wants() {
        let (hw, bw, mut share) = beside(3.0, 0.0, 1e6);
        let got = share.run(&hw, 0.0, &streaming(bw * 100.0));
        assert!((got - 200.0).abs() < 1e-3, "{got}");
    }
}
