//! Optimizers with PyTorch's update rules (`torch.optim.SGD`, `torch.optim.AdamW`), applied
//! element-wise to whatever piece of a parameter a chip holds: a shard updates exactly as the
//! same elements of the whole tensor would.

use ndarray::ArrayD;
use podsim_collectives::Rope;
use serde::{Deserialize, Serialize};

/// Which optimizer and its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimizerSpec {
    Sgd {
        lr: f32,
        momentum: f32,
        weight_decay: f32,
    },
    Adamw {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    },
}

impl OptimizerSpec {
    /// State tensors kept per parameter element.
    pub fn state_per_param(&self) -> usize {
        match self {
            OptimizerSpec::Sgd { momentum, .. } if *momentum == 0.0 => 0,
            OptimizerSpec::Sgd { .. } => 1,
            OptimizerSpec::Adamw { .. } => 2,
        }
    }

    /// Flops per parameter element of one update (for the virtual-time charge).
    pub fn flops_per_param(&self) -> f64 {
        match self {
            OptimizerSpec::Sgd { .. } => 4.0,
            OptimizerSpec::Adamw { .. } => 12.0,
        }
    }
}

/// The optimizer state of one parameter piece.
#[derive(Debug, Clone)]
pub struct ParamState {
    step: u32,
    buffers: Vec<ArrayD<f32>>,
}

impl ParamState {
    /// Updates taken so far.
    pub fn steps(&self) -> u32 {
        self.step
    }

    /// The optimizer's buffers (none before the first update; SGD's momentum; AdamW's first
    /// and second moments), each shaped like the parameter.
    pub fn buffers(&self) -> &[ArrayD<f32>] {
        &self.buffers
    }

    /// A state from its parts (a checkpoint's).
    pub fn from_parts(step: u32, buffers: Vec<ArrayD<f32>>) -> ParamState {
        ParamState { step, buffers }
    }

    pub fn new() -> ParamState {
        ParamState {
            step: 0,
            buffers: Vec::new(),
        }
    }

    /// One update of `param` with gradient `grad`: its values in the parameter's order, as
    /// many as the parameter has (the caller checks; extra values are ignored).
    ///
    /// The gradient is read run by run where it lies (a collective's result is pieces of its
    /// own block and of received buffers): no copy into one array first.
    pub fn step(&mut self, spec: &OptimizerSpec, param: &mut ArrayD<f32>, grad: &Rope) {
        self.step += 1;
        if !param.is_standard_layout() {
            *param = param.as_standard_layout().into_owned();
        }
        while self.buffers.len() < spec.state_per_param() {
            self.buffers.push(ArrayD::zeros(param.raw_dim()));
        }
        let first = self.step == 1;
        let t = self.step as i32;
        let Some(param) = param.as_slice_mut() else {
            return;
        };
        let mut buffers: Vec<&mut [f32]> = self
            .buffers
            .iter_mut()
            .filter_map(|b| b.as_slice_mut())
            .collect();
        let mut at = 0;
        grad.for_each_run(|g| {
            let end = (at + g.len()).min(param.len());
            let p = &mut param[at..end];
            let g = &g[..end - at];
            match (*spec, buffers.as_mut_slice()) {
                (
                    OptimizerSpec::Sgd {
                        lr, weight_decay, ..
                    },
                    [],
                ) => {
                    for (p, &g) in p.iter_mut().zip(g) {
                        *p -= lr * (g + weight_decay * *p);
                    }
                }
                (
                    OptimizerSpec::Sgd {
                        lr,
                        momentum,
                        weight_decay,
                    },
                    [buf],
                ) => {
                    for ((p, &g), buf) in p.iter_mut().zip(g).zip(&mut buf[at..end]) {
                        let d = g + weight_decay * *p;
                        // torch: the first step initialises the buffer with the gradient itself.
                        *buf = if first { d } else { momentum * *buf + d };
                        *p -= lr * *buf;
                    }
                }
                (
                    OptimizerSpec::Adamw {
                        lr,
                        beta1,
                        beta2,
                        eps,
                        weight_decay,
                    },
                    [m, v],
                ) => {
                    let bc1 = 1.0 - beta1.powi(t);
                    let bc2 = 1.0 - beta2.powi(t);
                    let moments = m[at..end].iter_mut().zip(&mut v[at..end]);
                    for ((p, &g), (m, v)) in p.iter_mut().zip(g).zip(moments) {
                        *p *= 1.0 - lr * weight_decay;
                        *m = beta1 * *m + (1.0 - beta1) * g;
                        *v = beta2 * *v + (1.0 - beta2) * g * g;
                        let denom = (*v / bc2).sqrt() + eps;
                        *p -= lr / bc1 * *m / denom;
                    }
                }
                // The buffers are made above to match the optimizer.
                _ => {}
            }
            at = end;
        });
    }
}

impl Default for ParamState {
    fn default() -> Self {
        ParamState::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::IxDyn;
    use podsim_collectives::Payload;

    #[test]
    fn sgd_with_momentum_matches_torch() {
        // torch.optim.SGD([p], lr=0.1, momentum=0.9), p=1, grads 1 then 1: p = 0.9, then 0.71.
        let spec = OptimizerSpec::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        let mut p = ArrayD::from_elem(IxDyn(&[1]), 1.0f32);
        let g = Rope::from_vec(vec![1.0f32]);
        let mut s = ParamState::new();
        s.step(&spec, &mut p, &g);
        assert!((p[[0]] - 0.9).abs() < 1e-7);
        s.step(&spec, &mut p, &g);
        assert!((p[[0]] - 0.71).abs() < 1e-6);
    }

    #[test]
    fn a_gradient_in_pieces_updates_exactly_as_one_in_one_piece() {
        let g: Vec<f32> = (0..10).map(|i| (i as f32 - 4.5) * 0.37).collect();
        let whole = Payload::from_vec(g.clone());
        let pieces = Payload::concat([
            Payload::from_vec(g[..3].to_vec()),
            Payload::from_vec(g[3..].to_vec()),
        ]);
        let specs = [
            OptimizerSpec::Sgd {
                lr: 0.1,
                momentum: 0.0,
                weight_decay: 0.01,
            },
            OptimizerSpec::Sgd {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
            },
            OptimizerSpec::Adamw {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
            },
        ];
        for spec in specs {
            let run = |grad: &Payload| {
                let grad = grad.as_rope().expect("data");
                let mut p = ArrayD::from_shape_vec(IxDyn(&[2, 5]), vec![0.5f32; 10]).unwrap();
                let mut s = ParamState::new();
                for _ in 0..3 {
                    s.step(&spec, &mut p, grad);
                }
                (p, s.buffers().to_vec())
            };
            let (p1, b1) = run(&whole);
            let (p2, b2) = run(&pieces);
            assert_eq!(p1, p2, "{spec:?}");
            assert_eq!(b1, b2, "{spec:?}");
            assert!(
                p1.iter().all(|&x| x != 0.5),
                "{spec:?}: every element moved"
            );
        }
    }

    #[test]
    fn adamw_first_step_moves_by_lr() {
        // With bias correction the first Adam step is lr * g / (|g| + eps) ~ lr * sign(g).
        let spec = OptimizerSpec::Adamw {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut p = ArrayD::from_elem(IxDyn(&[2]), 0.5f32);
        let g = Rope::from_vec(vec![3.0, -0.2]);
        ParamState::new().step(&spec, &mut p, &g);
        assert!((p[[0]] - 0.49).abs() < 1e-6 && (p[[1]] - 0.51).abs() < 1e-6);
    }
}
