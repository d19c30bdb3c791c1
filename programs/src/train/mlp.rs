//! The model: a multi-layer perceptron (`Linear` layers with ReLU between them, softmax
//! cross-entropy on the last), its deterministic initialisation, a synthetic dataset whose
//! labels come from a fixed teacher network, and the forward/backward kernels with the
//! [`Cost`] (kernel shapes) each one is charged.
//!
//! Shapes follow `torch.nn.Linear`: weight `(out, in)`, bias `(out)`, `y = x W^T + b`. The
//! matrix products are ndarray's (matrixmultiply).

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis, Ix2};
use serde::{Deserialize, Serialize};

use crate::error::ProgramError;
pub use crate::train::kernels::Cost;
use crate::train::tensor::Tensor;

/// A deterministic stream of pseudo-random numbers (SplitMix64): the same `(seed, stream)`
/// gives the same numbers on every chip and in every process.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64, stream: u64) -> Rng {
        let mut r = Rng(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        r.next_u64();
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// The MLP's layer widths: input, hidden..., classes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlpSpec {
    pub widths: Vec<usize>,
}

impl MlpSpec {
    pub fn layers(&self) -> usize {
        self.widths.len().saturating_sub(1)
    }

    pub fn inputs(&self) -> usize {
        self.widths.first().copied().unwrap_or(0)
    }

    pub fn classes(&self) -> usize {
        self.widths.last().copied().unwrap_or(0)
    }

    /// Shapes of layer `l`'s weight and bias.
    pub fn shapes(&self, l: usize) -> [Vec<usize>; 2] {
        [
            vec![self.widths[l + 1], self.widths[l]],
            vec![self.widths[l + 1]],
        ]
    }

    pub fn parameters(&self) -> usize {
        (0..self.layers())
            .map(|l| self.widths[l + 1] * (self.widths[l] + 1))
            .sum()
    }

    /// Full initial weight and bias of layer `l` as `torch.nn.Linear` draws them
    /// (`U(-1/sqrt(in), 1/sqrt(in))` for both), from `(seed, stream)`.
    pub fn init_layer(&self, l: usize, seed: u64, stream: u64, meta: bool) -> [Tensor; 2] {
        let [ws, bs] = self.shapes(l);
        if meta {
            return [Tensor::Meta(ws), Tensor::Meta(bs)];
        }
        let bound = 1.0 / (self.widths[l] as f32).sqrt();
        let mut rng = Rng::new(seed, stream.wrapping_mul(1_000_003).wrapping_add(l as u64));
        let mut draw = |n: usize| {
            (0..n)
                .map(|_| (2.0 * rng.uniform() - 1.0) * bound)
                .collect::<Vec<_>>()
        };
        let w = Array2::from_shape_vec((ws[0], ws[1]), draw(ws[0] * ws[1])).unwrap_or_default();
        let b = Array1::from_vec(draw(bs[0]));
        [Tensor::Data(w.into_dyn()), Tensor::Data(b.into_dyn())]
    }
}

/// Synthetic classification data: inputs `N(0, 1)` drawn per sample index, labels the argmax
/// of a fixed random teacher MLP (`inputs -> 32 -> classes`), so a student can learn them.
#[derive(Debug, Clone)]
pub struct Dataset {
    seed: u64,
    inputs: usize,
    teacher: [(Array2<f32>, Array1<f32>); 2],
}

const TEACHER_HIDDEN: usize = 32;
const TEACHER_STREAM: u64 = 0x7EAC_4E12;

impl Dataset {
    pub fn new(spec: &MlpSpec, seed: u64) -> Dataset {
        let teacher = MlpSpec {
            widths: vec![spec.inputs(), TEACHER_HIDDEN, spec.classes()],
        };
        let layer = |l: usize| {
            let [w, b] = teacher.init_layer(l, seed, TEACHER_STREAM, false);
            // Scaled up so the teacher's classes are well separated.
            let w = w.values().map(|a| a.clone() * 3.0).unwrap_or_default();
            let b = b.values().cloned().unwrap_or_default();
            (
                w.into_dimensionality::<Ix2>().unwrap_or_default(),
                b.into_dimensionality().unwrap_or_default(),
            )
        };
        Dataset {
            seed,
            inputs: spec.inputs(),
            teacher: [layer(0), layer(1)],
        }
    }

    /// Samples `start..start + len` of the endless stream: inputs `(len, inputs)` and labels.
    pub fn batch(&self, start: u64, len: usize) -> (Array2<f32>, Vec<usize>) {
        let mut x = Array2::zeros((len, self.inputs));
        for (i, mut row) in x.axis_iter_mut(Axis(0)).enumerate() {
            let mut rng = Rng::new(self.seed, start + i as u64);
            row.iter_mut().for_each(|v| *v = rng.normal());
        }
        let [(w1, b1), (w2, b2)] = &self.teacher;
        let h = (x.dot(&w1.t()) + b1).mapv(|v| v.max(0.0));
        let logits = h.dot(&w2.t()) + b2;
        let labels = logits
            .axis_iter(Axis(0))
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |best, (k, &v)| {
                        if v > best.1 { (k, v) } else { best }
                    })
                    .0
            })
            .collect();
        (x, labels)
    }
}

fn view2(t: &Tensor) -> Result<ArrayView2<'_, f32>, ProgramError> {
    t.values()
        .ok_or_else(|| ProgramError::Internal("a meta tensor in a data kernel".into()))?
        .view()
        .into_dimensionality::<Ix2>()
        .map_err(|e| ProgramError::Internal(format!("expected a matrix: {e}")))
}

fn view1(t: &Tensor) -> Result<ArrayView1<'_, f32>, ProgramError> {
    t.values()
        .ok_or_else(|| ProgramError::Internal("a meta tensor in a data kernel".into()))?
        .view()
        .into_dimensionality()
        .map_err(|e| ProgramError::Internal(format!("expected a vector: {e}")))
}

/// `x W^T (+ b)`: `x` is `(batch, in)`, `w` is `(out, in)`.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<(Tensor, Cost), ProgramError> {
    let (m, k, n) = (x.shape()[0], x.shape()[1], w.shape()[0]);
    let cost = Cost::matmul(m, k, n).plus(if b.is_some() {
        Cost::elementwise(m * n, 1.0, 1.0)
    } else {
        Cost::default()
    });
    if x.is_meta() || w.is_meta() {
        return Ok((Tensor::Meta(vec![m, n]), cost));
    }
    let mut y = view2(x)?.dot(&view2(w)?.t());
    if let Some(b) = b {
        y += &view1(b)?;
    }
    Ok((Tensor::Data(y.into_dyn()), cost))
}

/// Adds a bias to `(batch, out)` activations.
pub fn add_bias(y: &mut Tensor, b: &Tensor) -> Result<Cost, ProgramError> {
    let cost = Cost::elementwise(y.numel(), 1.0, 1.0);
    if let (Tensor::Data(a), false) = (&mut *y, b.is_meta()) {
        *a += &view1(b)?;
    }
    Ok(cost)
}

/// A layer's backward: the gradients of its weight and bias, its input's gradient when asked
/// for, and the kernels of each (the weight gradient's apart from the input gradient's, which a
/// tensor-parallel collective may overlap with the former).
#[derive(Debug)]
pub struct Grads {
    pub dw: Tensor,
    pub db: Tensor,
    pub dx: Option<Tensor>,
    pub weight_cost: Cost,
    pub input_cost: Cost,
}

/// Gradients of `y = x W^T + b` given `dy`: `dW = dy^T x`, `db = sum_rows dy` (charged when
/// the layer has a bias) and, when asked, `dx = dy W`.
pub fn linear_backward(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    want_dx: bool,
    bias: bool,
) -> Result<Grads, ProgramError> {
    let (m, k, n) = (x.shape()[0], x.shape()[1], w.shape()[0]);
    let bias_cost = if bias {
        Cost::elementwise(m * n, 1.0, 0.0)
    } else {
        Cost::default()
    };
    let weight_cost = Cost::matmul(n, m, k).plus(bias_cost);
    let input_cost = if want_dx {
        Cost::matmul(m, n, k)
    } else {
        Cost::default()
    };
    if x.is_meta() || dy.is_meta() {
        return Ok(Grads {
            dw: Tensor::Meta(vec![n, k]),
            db: Tensor::Meta(vec![n]),
            dx: want_dx.then(|| Tensor::Meta(vec![m, k])),
            weight_cost,
            input_cost,
        });
    }
    let dyv = view2(dy)?;
    let dx = if want_dx {
        Some(Tensor::Data(dyv.dot(&view2(w)?).into_dyn()))
    } else {
        None
    };
    // The weight gradient is a fresh megabyte-scale result every step that goes on into a
    // collective: written into a pooled buffer it reuses the memory the last one gave back.
    let mut dw = Array2::from_shape_vec((n, k), podsim_collectives::buffer::scratch(n * k))
        .map_err(|e| ProgramError::Internal(format!("weight gradient buffer: {e}")))?;
    ndarray::linalg::general_mat_mul(1.0, &dyv.t(), &view2(x)?, 0.0, &mut dw);
    Ok(Grads {
        dw: Tensor::Data(dw.into_dyn()),
        db: Tensor::Data(dyv.sum_axis(Axis(0)).into_dyn()),
        dx,
        weight_cost,
        input_cost,
    })
}

/// ReLU in place.
pub fn relu(y: &mut Tensor) -> Cost {
    if let Tensor::Data(a) = y {
        a.mapv_inplace(|v| v.max(0.0));
    }
    Cost::elementwise(y.numel(), 1.0, 1.0)
}

/// Backward of ReLU given its output: `dy` where the output was positive, else 0.
pub fn relu_backward(dy: &mut Tensor, out: &Tensor) -> Cost {
    if let (Tensor::Data(g), Some(o)) = (&mut *dy, out.values()) {
        ndarray::Zip::from(g).and(o).for_each(|g, &o| {
            if o <= 0.0 {
                *g = 0.0;
            }
        });
    }
    Cost::elementwise(dy.numel(), 1.0, 2.0)
}

/// Mean softmax cross-entropy of `logits` `(batch, classes)` against `labels`, and its
/// gradient scaled by `scale` (1 / micro-batches when gradients accumulate). Meta mode gives
/// no loss value.
pub fn cross_entropy(
    logits: &Tensor,
    labels: &[usize],
    scale: f32,
) -> Result<(Option<f64>, Tensor, Cost), ProgramError> {
    let cost = Cost::elementwise(logits.numel(), 6.0, 1.0);
    let Tensor::Data(z) = logits else {
        return Ok((None, Tensor::Meta(logits.shape().to_vec()), cost));
    };
    let z = z
        .view()
        .into_dimensionality::<Ix2>()
        .map_err(|e| ProgramError::Internal(e.to_string()))?;
    let batch = z.nrows();
    let mut grad = Array2::zeros(z.raw_dim());
    let mut loss = 0.0f64;
    for ((row, mut g), &y) in z
        .axis_iter(Axis(0))
        .zip(grad.axis_iter_mut(Axis(0)))
        .zip(labels)
    {
        let max = row.fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let sum: f32 = row.iter().map(|&v| (v - max).exp()).sum();
        loss += f64::from(sum.ln() + max - row[y]);
        for (k, (gv, &v)) in g.iter_mut().zip(row.iter()).enumerate() {
            let p = (v - max).exp() / sum;
            *gv = (p - if k == y { 1.0 } else { 0.0 }) * scale / batch as f32;
        }
    }
    Ok((
        Some(loss / batch as f64),
        Tensor::Data(grad.into_dyn()),
        cost,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_backward_matches_finite_differences() {
        let spec = MlpSpec { widths: vec![3, 2] };
        let [w, b] = spec.init_layer(0, 7, 0, false);
        let x = Tensor::from_vec(&[2, 3], vec![0.5, -1.0, 2.0, 1.5, 0.3, -0.7]).unwrap();
        let labels = [1, 0];
        let loss_of = |w: &Tensor| {
            let (y, _) = linear(&x, w, Some(&b)).unwrap();
            cross_entropy(&y, &labels, 1.0).unwrap().0.unwrap()
        };
        let (y, _) = linear(&x, &w, Some(&b)).unwrap();
        let (_, dy, _) = cross_entropy(&y, &labels, 1.0).unwrap();
        let dw = linear_backward(&x, &w, &dy, false, true).unwrap().dw;
        let h = 1e-3;
        let mut wp = w.clone();
        wp.values_mut().unwrap()[[1, 2]] += h;
        let mut wm = w.clone();
        wm.values_mut().unwrap()[[1, 2]] -= h;
        let numeric = (loss_of(&wp) - loss_of(&wm)) / (2.0 * f64::from(h));
        let analytic = f64::from(dw.values().unwrap()[[1, 2]]);
        assert!((numeric - analytic).abs() < 1e-3, "{numeric} vs {analytic}");
    }

    #[test]
    fn data_is_deterministic_and_labels_vary() {
        let spec = MlpSpec {
            widths: vec![16, 8, 4],
        };
        let d = Dataset::new(&spec, 1);
        let (x1, y1) = d.batch(100, 64);
        let (x2, y2) = Dataset::new(&spec, 1).batch(100, 64);
        assert_eq!((x1.clone(), y1.clone()), (x2, y2));
        // Sample 101 is the same whichever batch it is drawn in.
        assert_eq!(d.batch(101, 1).0.row(0), x1.row(1));
        let distinct: std::collections::BTreeSet<_> = y1.iter().collect();
        assert!(distinct.len() >= 2, "labels {y1:?}");
    }
}
