//! Local tensors: dense f32 arrays in data mode, shapes only in meta mode (like PyTorch's meta
//! device), with the `torch.chunk` arithmetic and the block layouts that collectives move.
//!
//! Collectives move flat buffers cut into equal blocks, one per group rank. To shard a tensor
//! along any dimension `d`, [`Tensor::blocks`] pads `d` to whole chunks and moves it to the
//! front, so that chunk `r` is the contiguous block `r`; [`Tensor::from_blocks`] undoes it.

use ndarray::{ArrayD, Axis, IxDyn, Slice};
use podsim_collectives::Payload;

use crate::error::ProgramError;

/// Length of `torch.chunk` piece `i` when `size` is cut into `n`: pieces of `ceil(size / n)`,
/// the last ones shorter or empty (the collectives' own block rule).
pub fn chunk_len(size: usize, n: usize, i: usize) -> usize {
    podsim_collectives::chunk_len(size, size.div_ceil(n.max(1)), i)
}

/// Where `torch.chunk` piece `i` starts.
pub fn chunk_start(size: usize, n: usize, i: usize) -> usize {
    (i * size.div_ceil(n.max(1))).min(size)
}

/// A chip-local tensor.
#[derive(Debug, Clone, PartialEq)]
pub enum Tensor {
    Data(ArrayD<f32>),
    Meta(Vec<usize>),
}

/// The values of `a` in row-major order, in a pooled buffer: one copy of the memory when `a`
/// is laid out row-major (an element-by-element walk of a dynamic-rank array cost as much as
/// the matrix products of a small model's step), a walk otherwise.
fn row_major_payload(a: &ArrayD<f32>) -> Payload {
    match a.as_slice() {
        Some(values) => Payload::copy_of(values),
        None => Payload::collect_from(a.len(), a.iter().copied()),
    }
}

impl Tensor {
    pub fn zeros(shape: &[usize], meta: bool) -> Tensor {
        if meta {
            Tensor::Meta(shape.to_vec())
        } else {
            Tensor::Data(ArrayD::zeros(IxDyn(shape)))
        }
    }

    /// A data tensor from row-major values.
    pub fn from_vec(shape: &[usize], values: Vec<f32>) -> Result<Tensor, ProgramError> {
        let n = values.len();
        ArrayD::from_shape_vec(IxDyn(shape), values)
            .map(Tensor::Data)
            .map_err(|_| {
                ProgramError::Invalid(format!(
                    "{n} values do not make a tensor of shape {shape:?}"
                ))
            })
    }

    /// Rebuilds a tensor of `shape` from a collective's result.
    pub fn from_payload(payload: Payload, shape: &[usize]) -> Result<Tensor, ProgramError> {
        let numel: usize = shape.iter().product();
        if payload.len() != numel {
            return Err(ProgramError::Invalid(format!(
                "a collective returned {} elements for a tensor of shape {shape:?} ({numel})",
                payload.len()
            )));
        }
        match payload.into_vec() {
            Some(values) => Tensor::from_vec(shape, values),
            None => Ok(Tensor::Meta(shape.to_vec())),
        }
    }

    pub fn shape(&self) -> &[usize] {
        match self {
            Tensor::Data(a) => a.shape(),
            Tensor::Meta(s) => s,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape().iter().product()
    }

    /// Bytes the tensor occupies in HBM with elements of `elem` bytes.
    pub fn bytes(&self, elem: u64) -> u64 {
        self.numel() as u64 * elem
    }

    pub fn is_meta(&self) -> bool {
        matches!(self, Tensor::Meta(_))
    }

    pub fn values(&self) -> Option<&ArrayD<f32>> {
        match self {
            Tensor::Data(a) => Some(a),
            Tensor::Meta(_) => None,
        }
    }

    pub fn values_mut(&mut self) -> Option<&mut ArrayD<f32>> {
        match self {
            Tensor::Data(a) => Some(a),
            Tensor::Meta(_) => None,
        }
    }

    /// The values in row-major order as a collective payload.
    pub fn to_payload(&self) -> Payload {
        match self {
            Tensor::Data(a) => row_major_payload(a),
            Tensor::Meta(s) => Payload::Meta(s.iter().product()),
        }
    }

    /// The values as a payload, handing over the array's own buffer when it holds exactly
    /// them in row-major order (no copy), copying otherwise.
    pub fn into_payload(self) -> Payload {
        match self {
            Tensor::Data(a) if a.is_standard_layout() => {
                let len = a.len();
                match a.into_raw_vec_and_offset() {
                    (values, Some(0) | None) if values.len() == len => Payload::from_vec(values),
                    (values, offset) => {
                        let start = offset.unwrap_or(0);
                        Payload::copy_of(&values[start..start + len])
                    }
                }
            }
            other => other.to_payload(),
        }
    }

    fn with_dim(&self, dim: usize, len: usize) -> Vec<usize> {
        let mut s = self.shape().to_vec();
        s[dim] = len;
        s
    }

    /// Elements `start..start + len` along `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Tensor {
        match self {
            Tensor::Data(a) => Tensor::Data(
                a.slice_axis(Axis(dim), Slice::from(start..start + len))
                    .to_owned(),
            ),
            Tensor::Meta(_) => Tensor::Meta(self.with_dim(dim, len)),
        }
    }

    /// `torch.chunk` piece `i` of `n` along `dim` (possibly empty).
    pub fn chunk(&self, dim: usize, n: usize, i: usize) -> Tensor {
        let size = self.shape()[dim];
        self.narrow(dim, chunk_start(size, n, i), chunk_len(size, n, i))
    }

    /// Zero-pads `dim` up to `len` (no-op when it is already that long).
    pub fn pad(&self, dim: usize, len: usize) -> Tensor {
        let have = self.shape()[dim];
        if have >= len {
            return self.clone();
        }
        match self {
            Tensor::Data(a) => {
                let zeros = ArrayD::zeros(IxDyn(&self.with_dim(dim, len - have)));
                Tensor::Data(
                    ndarray::concatenate(Axis(dim), &[a.view(), zeros.view()])
                        .unwrap_or_else(|_| a.clone()),
                )
            }
            Tensor::Meta(_) => Tensor::Meta(self.with_dim(dim, len)),
        }
    }

    /// Concatenates `parts` along `dim` (all other dimensions equal).
    pub fn cat(dim: usize, parts: &[Tensor]) -> Result<Tensor, ProgramError> {
        let first = parts
            .first()
            .ok_or_else(|| ProgramError::Invalid("concatenation of no tensors".into()))?;
        let total = parts.iter().map(|p| p.shape()[dim]).sum();
        let views: Option<Vec<_>> = parts.iter().map(|p| p.values().map(|a| a.view())).collect();
        match views {
            Some(views) => ndarray::concatenate(Axis(dim), &views)
                .map(Tensor::Data)
                .map_err(|e| ProgramError::Invalid(format!("concatenation along {dim}: {e}"))),
            None => Ok(Tensor::Meta(first.with_dim(dim, total))),
        }
    }

    /// The tensor as `n` equal contiguous blocks of `torch.chunk` pieces along `dim`: `dim`
    /// zero-padded to `n * ceil(len / n)`, moved to the front, flattened.
    pub fn blocks(&self, dim: usize, n: usize) -> Payload {
        let len = self.shape()[dim];
        let padded = self.pad(dim, n * len.div_ceil(n.max(1)));
        match padded {
            Tensor::Data(mut a) => {
                for d in (0..dim).rev() {
                    a.swap_axes(d, d + 1);
                }
                row_major_payload(&a)
            }
            Tensor::Meta(s) => Payload::Meta(s.iter().product()),
        }
    }

    /// Inverse of [`Tensor::blocks`] for one or more whole blocks: `payload` holds a tensor of
    /// `shape` (with `dim` as padded) laid out with `dim` first.
    pub fn from_blocks(
        payload: Payload,
        dim: usize,
        shape: &[usize],
    ) -> Result<Tensor, ProgramError> {
        let mut moved = shape.to_vec();
        let d = moved.remove(dim);
        moved.insert(0, d);
        match Tensor::from_payload(payload, &moved)? {
            Tensor::Data(mut a) => {
                for d in 0..dim {
                    a.swap_axes(d, d + 1);
                }
                Ok(Tensor::Data(a.as_standard_layout().into_owned()))
            }
            Tensor::Meta(_) => Ok(Tensor::Meta(shape.to_vec())),
        }
    }

    /// The largest `|a - b|` over the elements; NaN where one side is NaN and the other is
    /// not bit-identical to it (`f32::max` would pass over it, and a NaN that crept into
    /// one run must not compare as equal). 0 for meta tensors.
    pub fn max_abs_diff(&self, other: &Tensor) -> f32 {
        match (self.values(), other.values()) {
            (Some(a), Some(b)) => a
                .iter()
                .zip(b.iter())
                .map(|(x, y)| {
                    if x.to_bits() == y.to_bits() {
                        0.0
                    } else {
                        (x - y).abs()
                    }
                })
                .fold(0.0, |m: f32, d| {
                    if m.is_nan() || d.is_nan() {
                        f32::NAN
                    } else {
                        m.max(d)
                    }
                }),
            _ => 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arange(shape: &[usize]) -> Tensor {
        let n = shape.iter().product::<usize>();
        Tensor::from_vec(shape, (0..n).map(|v| v as f32).collect()).unwrap()
    }

    #[test]
    fn into_payload_hands_over_a_row_major_buffer_and_copies_anything_else() {
        let t = arange(&[4, 8]);
        let given = t.clone();
        let address = given.values().unwrap().as_ptr();
        let p = given.into_payload();
        let runs: Vec<&[f32]> = p
            .as_rope()
            .unwrap()
            .runs()
            .filter_map(|r| match r {
                podsim_collectives::Run::Values(v) => Some(v),
                podsim_collectives::Run::Zeros(_) => None,
            })
            .collect();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].as_ptr(), address, "the buffer itself, not a copy");
        assert_eq!(p.to_vec(), t.to_payload().to_vec());
        // A transposed array is not row-major: its values are copied in row-major order.
        let Tensor::Data(a) = arange(&[4, 8]) else {
            unreachable!()
        };
        let transposed = Tensor::Data(a.reversed_axes());
        let want: Vec<f32> = (0..8)
            .flat_map(|c| (0..4).map(move |r| (r * 8 + c) as f32))
            .collect();
        assert_eq!(transposed.into_payload().to_vec(), Some(want));
        // A row-major slice of a larger buffer: only its own values.
        let Tensor::Data(a) = arange(&[4, 8]) else {
            unreachable!()
        };
        let rows = Tensor::Data(
            a.slice_axis_move(ndarray::Axis(0), ndarray::Slice::from(2..))
                .into_dyn(),
        );
        let want: Vec<f32> = (16..32).map(|v| v as f32).collect();
        assert_eq!(rows.into_payload().to_vec(), Some(want));
    }

    #[test]
    fn chunks_follow_torch_chunk() {
        // torch.arange(10).chunk(4) -> sizes 3, 3, 3, 1; torch.arange(5).chunk(4) -> 2, 2, 1.
        assert_eq!(
            (0..4).map(|i| chunk_len(10, 4, i)).collect::<Vec<_>>(),
            [3, 3, 3, 1]
        );
        assert_eq!(
            (0..4).map(|i| chunk_len(5, 4, i)).collect::<Vec<_>>(),
            [2, 2, 1, 0]
        );
        assert_eq!(chunk_start(5, 4, 3), 5);
    }

    #[test]
    fn blocks_round_trip_along_every_dim() {
        let t = arange(&[3, 5, 2]);
        for dim in 0..3 {
            let n = 2;
            let p = t.blocks(dim, n);
            let mut shape = t.shape().to_vec();
            shape[dim] = n * shape[dim].div_ceil(n);
            assert_eq!(p.len(), shape.iter().product::<usize>());
            let back = Tensor::from_blocks(p, dim, &shape).unwrap();
            assert_eq!(back.narrow(dim, 0, t.shape()[dim]), t);
        }
    }

    #[test]
    fn block_r_is_chunk_r() {
        let t = arange(&[4, 6]);
        let p = t.blocks(1, 3);
        let blocks = p.split_even(3);
        for (r, b) in blocks.into_iter().enumerate() {
            let got = Tensor::from_blocks(b, 1, &[4, 2]).unwrap();
            assert_eq!(got, t.chunk(1, 3, r));
        }
    }
}
