//! The yardstick: the same model trained on one chip on the global batch (every sample every
//! data-parallel rank saw in a step, mean loss), with no strategy and no collective. A
//! strategy is correct when its final parameters match these.

use crate::error::ProgramError;
use crate::train::mlp::{self, Dataset};
use crate::train::optim::ParamState;
use crate::train::tensor::Tensor;
use crate::train::trainer::TrainSpec;

/// Final parameters (weight and bias of each layer in order) of single-chip training with
/// `data_parallel` replicas' worth of samples per step.
pub fn train(spec: &TrainSpec, data_parallel: usize) -> Result<Vec<Tensor>, ProgramError> {
    train_from(spec, data_parallel, false)
}

/// The same training from initial parameters one unit in the last place away (the lowest
/// bit of each flipped): how far rounding alone takes this run's parameters by its last
/// step. A short run stays within a few units of rounding; a long one whose updates amplify
/// small differences (a large learning rate, momentum) can end far apart, and then so can a
/// strategy that sums in another order than one chip.
pub fn train_nudged(spec: &TrainSpec, data_parallel: usize) -> Result<Vec<Tensor>, ProgramError> {
    train_from(spec, data_parallel, true)
}

fn train_from(
    spec: &TrainSpec,
    data_parallel: usize,
    nudge: bool,
) -> Result<Vec<Tensor>, ProgramError> {
    let model = spec.model.mlp().ok_or_else(|| {
        ProgramError::Invalid("the single-chip reference trains the MLP only".into())
    })?;
    let layers = model.layers();
    let mut params: Vec<Tensor> = (0..layers)
        .flat_map(|l| model.init_layer(l, spec.seed, 0, false))
        .collect();
    if nudge {
        for p in &mut params {
            if let Some(values) = p.values_mut() {
                values
                    .iter_mut()
                    .for_each(|v| *v = f32::from_bits(v.to_bits() ^ 1));
            }
        }
    }
    let mut states: Vec<ParamState> = params.iter().map(|_| ParamState::new()).collect();
    let data = Dataset::new(model, spec.seed);
    let global = spec.batch * data_parallel * spec.grad_accum.max(1) as usize;
    for step in 0..u64::from(spec.steps) {
        let (x, labels) = data.batch(step * global as u64, global);
        let mut acts = vec![Tensor::Data(x.into_dyn())];
        for l in 0..layers {
            let (mut z, _) = mlp::linear(&acts[l], &params[2 * l], Some(&params[2 * l + 1]))?;
            if l + 1 < layers {
                mlp::relu(&mut z);
            }
            acts.push(z);
        }
        let (_, mut dz, _) = mlp::cross_entropy(&acts[layers], &labels, 1.0)?;
        let mut grads = vec![None; 2 * layers];
        for l in (0..layers).rev() {
            if l + 1 < layers {
                mlp::relu_backward(&mut dz, &acts[l + 1]);
            }
            let g = mlp::linear_backward(&acts[l], &params[2 * l], &dz, l > 0, true)?;
            grads[2 * l] = Some(g.dw);
            grads[2 * l + 1] = Some(g.db);
            if let Some(dx) = g.dx {
                dz = dx;
            }
        }
        for ((p, g), s) in params.iter_mut().zip(grads).zip(&mut states) {
            if let (Some(p), Some(g @ Tensor::Data(_))) = (p.values_mut(), g)
                && let Some(g) = g.into_payload().as_rope()
            {
                s.step(&spec.optimizer, p, g);
            }
        }
    }
    Ok(params)
}

/// Largest absolute difference, and largest `max |a - b| / max |b|` over the tensors. A NaN
/// on one side only counts as an infinite difference, so it can never pass as agreement.
pub fn compare(got: &[Tensor], want: &[Tensor]) -> (f64, f64) {
    let mut abs = 0.0f64;
    let mut rel = 0.0f64;
    for (a, b) in got.iter().zip(want) {
        let d = f64::from(a.max_abs_diff(b));
        let d = if d.is_nan() { f64::INFINITY } else { d };
        let scale = b
            .values()
            .map_or(0.0, |v| v.iter().fold(0.0f32, |m, x| m.max(x.abs())));
        abs = abs.max(d);
        if scale > 0.0 {
            rel = rel.max(d / f64::from(scale));
        } else if d > 0.0 {
            rel = f64::INFINITY;
        }
    }
    if got.len() != want.len() {
        return (f64::INFINITY, f64::INFINITY);
    }
    (abs, rel)
}
