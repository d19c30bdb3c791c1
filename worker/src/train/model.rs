//! The models the trainer runs, lowered to one list of layers it executes.
//!
//! A model is either the MLP of [`MlpSpec`] (real values or meta) or a decoder-only transformer
//! described by its shape ([`TransformerSpec`], meta mode only: its parameters are meta tensors
//! and every kernel is charged from its shape). Both lower to [`LayerSpec`]s: a parameterised
//! op (a linear layer or an embedding table, weight `(out, in)` and bias `(out)`), how tensor
//! parallelism cuts it, and the parameter-free op that follows it (ReLU, the attention core,
//! the MLP activation, residual + layer norm). Strategies place and sync each layer's two
//! parameters exactly as for the MLP, so every strategy runs on every model unchanged.
//!
//! A transformer block lowers to four linear layers (Megatron pairs: `qkv` column-parallel,
//! attention core, `proj` row-parallel, residual + norm; `up` column-parallel, GELU or SwiGLU,
//! `down` row-parallel, residual + norm); before the blocks an embedding table, after them the
//! LM head (both replicated over tensor parallelism), then softmax cross-entropy over the
//! vocabulary. Layer-norm gains are not parameters here (2·d_model per norm, under 0.01% of
//! any realistic model).

use podsim_collectives::DType;
use serde::{Deserialize, Serialize};

use crate::error::WorkerError;
use crate::train::mlp::{Cost, MlpSpec};
use crate::train::strategy::Style;
use crate::train::tensor::Tensor;

/// A model as a job describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ModelSpec {
    Mlp(MlpSpec),
    Transformer(TransformerSpec),
}

/// A decoder-only transformer by its shape (GPT-style blocks; `kv_heads < heads` is
/// grouped-query attention, `gated` a SwiGLU MLP with `ffn` hidden units).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransformerSpec {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub vocab: usize,
    /// Tokens per sequence.
    pub seq: usize,
    pub gated: bool,
    pub dtype: DType,
}

/// What a layer's parameters do to its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// `x W^T + b`.
    Linear,
    /// A lookup of one row of `W` per token (the input holds token ids).
    Embedding,
}

/// The parameter-free op after a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    None,
    Relu,
    /// Scaled dot-product attention over sequences of `seq` tokens: `(T, q + k + v)` in,
    /// `(T, q)` out.
    Attention {
        seq: usize,
    },
    Gelu,
    /// `silu(gate) * up`: `(T, 2f)` in, `(T, f)` out.
    SwiGlu,
    /// Residual add and layer norm.
    ResidualNorm,
}

/// One layer of a lowered model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSpec {
    /// Parameter-name prefix (`layers.0`, `blocks.3.attn.qkv`).
    pub name: String,
    pub kind: LayerKind,
    pub inputs: usize,
    pub outputs: usize,
    /// How tensor parallelism cuts it.
    pub style: Style,
    pub after: After,
}

impl std::fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSpec::Mlp(m) => write!(f, "MLP {:?}", m.widths),
            ModelSpec::Transformer(t) => write!(
                f,
                "transformer {} layers, d_model {}, {} heads ({} kv), ffn {}{}, vocab {}, seq {}, {}",
                t.layers,
                t.d_model,
                t.heads,
                t.kv_heads,
                t.ffn,
                if t.gated { " (SwiGLU)" } else { "" },
                t.vocab,
                t.seq,
                t.dtype.name()
            ),
        }
    }
}

impl LayerSpec {
    /// The layer's weight `(out, in)` and bias `(out)` as meta tensors.
    pub fn meta_params(&self) -> [Tensor; 2] {
        [
            Tensor::Meta(vec![self.outputs, self.inputs]),
            Tensor::Meta(vec![self.outputs]),
        ]
    }
}

impl TransformerSpec {
    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads.max(1)
    }

    /// Width of the fused query/key/value projection.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim()
    }

    fn up_width(&self) -> usize {
        if self.gated { 2 * self.ffn } else { self.ffn }
    }

    /// Weights of one block's matrix products.
    pub fn block_matrix_params(&self) -> usize {
        let d = self.d_model;
        d * self.qkv_width() + d * d + d * self.up_width() + self.ffn * d
    }

    /// Every parameter: embedding, blocks (weights and biases), LM head.
    pub fn parameters(&self) -> usize {
        let d = self.d_model;
        let block_biases = self.qkv_width() + d + self.up_width() + d;
        let embedding = self.vocab * d + d;
        let head = self.vocab * d + self.vocab;
        embedding + self.layers * (self.block_matrix_params() + block_biases) + head
    }

    /// Model flops of one training step on `tokens` tokens, the usual way of counting them for
    /// MFU: `6` per matrix-product weight per token (forward `2`, backward `4`; the embedding
    /// lookup is no product) plus attention's `12 * seq * d_model` per token per block
    /// (`QK^T` and `AV`, forward and backward). Element-wise work is not counted.
    pub fn step_flops(&self, tokens: f64) -> f64 {
        let matrix = (self.layers * self.block_matrix_params() + self.vocab * self.d_model) as f64;
        let attention = 12.0 * (self.layers * self.seq * self.d_model) as f64;
        (6.0 * matrix + attention) * tokens
    }

    /// Problems with the shape, one sentence each.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (name, v) in [
            ("layers", self.layers),
            ("d_model", self.d_model),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
            ("seq", self.seq),
        ] {
            if v == 0 {
                out.push(format!("{name} must be at least 1"));
            }
        }
        if self.heads > 0 && !self.d_model.is_multiple_of(self.heads) {
            out.push(format!(
                "d_model = {} is not a multiple of heads = {}",
                self.d_model, self.heads
            ));
        }
        if self.kv_heads > 0 && !self.heads.is_multiple_of(self.kv_heads) {
            out.push(format!(
                "heads = {} is not a multiple of kv_heads = {}",
                self.heads, self.kv_heads
            ));
        }
        out
    }

    fn lower(&self) -> Vec<LayerSpec> {
        let d = self.d_model;
        let layer = |name: String, kind, inputs, outputs, style, after| LayerSpec {
            name,
            kind,
            inputs,
            outputs,
            style,
            after,
        };
        let mut out = vec![layer(
            "embedding".into(),
            LayerKind::Embedding,
            self.vocab,
            d,
            Style::Replicated,
            After::None,
        )];
        let act = if self.gated {
            After::SwiGlu
        } else {
            After::Gelu
        };
        for b in 0..self.layers {
            let p = format!("blocks.{b}");
            out.extend([
                layer(
                    format!("{p}.attn.qkv"),
                    LayerKind::Linear,
                    d,
                    self.qkv_width(),
                    Style::Column,
                    After::Attention { seq: self.seq },
                ),
                layer(
                    format!("{p}.attn.proj"),
                    LayerKind::Linear,
                    d,
                    d,
                    Style::Row,
                    After::ResidualNorm,
                ),
                layer(
                    format!("{p}.mlp.up"),
                    LayerKind::Linear,
                    d,
                    self.up_width(),
                    Style::Column,
                    act,
                ),
                layer(
                    format!("{p}.mlp.down"),
                    LayerKind::Linear,
                    self.ffn,
                    d,
                    Style::Row,
                    After::ResidualNorm,
                ),
            ]);
        }
        out.push(layer(
            "lm_head".into(),
            LayerKind::Linear,
            d,
            self.vocab,
            Style::Replicated,
            After::None,
        ));
        out
    }
}

impl ModelSpec {
    /// The layers the trainer runs, in order.
    pub fn lower(&self) -> Vec<LayerSpec> {
        match self {
            ModelSpec::Mlp(m) => {
                let n = m.layers();
                (0..n)
                    .map(|l| LayerSpec {
                        name: format!("layers.{l}"),
                        kind: LayerKind::Linear,
                        inputs: m.widths[l],
                        outputs: m.widths[l + 1],
                        // Megatron pairs; an odd last layer stays whole.
                        style: match (l % 2, l + 1 < n) {
                            (0, true) => Style::Column,
                            (0, false) => Style::Replicated,
                            _ => Style::Row,
                        },
                        after: if l + 1 < n { After::Relu } else { After::None },
                    })
                    .collect()
            }
            ModelSpec::Transformer(t) => t.lower(),
        }
    }

    /// How tensor parallelism cuts each layer, in order (what `Plan::new` takes).
    pub fn tp_styles(&self) -> Vec<Style> {
        self.lower().iter().map(|l| l.style).collect()
    }

    pub fn parameters(&self) -> usize {
        match self {
            ModelSpec::Mlp(m) => m.parameters(),
            ModelSpec::Transformer(t) => t.parameters(),
        }
    }

    /// Element type of parameters, activations and gradients (and of their collectives).
    pub fn dtype(&self) -> DType {
        match self {
            ModelSpec::Mlp(_) => DType::F32,
            ModelSpec::Transformer(t) => t.dtype,
        }
    }

    /// The MLP, for what only it supports (real data, the single-chip reference).
    pub fn mlp(&self) -> Option<&MlpSpec> {
        match self {
            ModelSpec::Mlp(m) => Some(m),
            ModelSpec::Transformer(_) => None,
        }
    }

    /// Shape of one micro-batch of `batch` samples as the first layer takes it.
    pub fn input_shape(&self, batch: usize) -> Vec<usize> {
        match self {
            ModelSpec::Mlp(m) => vec![batch, m.inputs()],
            // One token id per row.
            ModelSpec::Transformer(t) => vec![batch * t.seq, 1],
        }
    }

    /// Model flops of one training step over `samples` samples (MFU's numerator): for the MLP
    /// `6` per weight per sample, for the transformer [`TransformerSpec::step_flops`].
    pub fn step_flops(&self, samples: f64) -> f64 {
        match self {
            ModelSpec::Mlp(m) => {
                let weights: usize = (0..m.layers()).map(|l| m.widths[l] * m.widths[l + 1]).sum();
                6.0 * weights as f64 * samples
            }
            ModelSpec::Transformer(t) => t.step_flops(samples * t.seq as f64),
        }
    }
}

/// Forward of an embedding lookup: `(T, 1)` token ids and a `(d, vocab)` table (stored like a
/// linear layer's weight, so strategies cut it the same way) give `(T, d)` (meta only). Reads
/// one column per token and writes it.
pub fn embedding(x: &Tensor, w: &Tensor) -> Result<(Tensor, Cost), WorkerError> {
    if !(x.is_meta() && w.is_meta()) {
        return Err(WorkerError::Invalid(
            "embedding layers run in meta mode only".into(),
        ));
    }
    let (t, d) = (x.shape()[0], w.shape()[0]);
    Ok((Tensor::Meta(vec![t, d]), Cost::elementwise(t * d, 0.0, 1.0)))
}

/// Backward of an embedding lookup: the rows' gradients scatter-added into a dense `(vocab, d)`
/// gradient (as `torch.nn.Embedding` does without `sparse=True`).
pub fn embedding_backward(x: &Tensor, w: &Tensor) -> (Tensor, Tensor, Cost) {
    let (t, d) = (x.shape()[0], w.shape()[0]);
    (
        Tensor::Meta(w.shape().to_vec()),
        Tensor::Meta(vec![d]),
        Cost::elementwise(t * d, 1.0, 1.0),
    )
}

/// Forward of a transformer's parameter-free op on `z` `(T, width)`; `out_width` is the width
/// the next layer takes on this chip. Returns the op's cost; `z` takes the output shape.
pub fn after_forward(after: After, z: &mut Tensor, out_width: usize) -> Cost {
    let (t, w) = (z.shape()[0], z.shape()[1]);
    let cost = match after {
        After::None | After::Relu => Cost::default(),
        // Flash-style: Q, K, V read once, the output written; `QK^T` and `AV` are `2 * seq`
        // flops per output element each.
        After::Attention { seq } => Cost {
            flops: 4.0 * (t * seq * out_width) as f64,
            bytes: 4.0 * (t * (w + out_width)) as f64,
        },
        After::Gelu => Cost::elementwise(t * w, 8.0, 1.0),
        After::SwiGlu => Cost::elementwise(t * out_width, 6.0, 2.0),
        After::ResidualNorm => Cost::elementwise(t * w, 8.0, 2.0),
    };
    *z = Tensor::Meta(vec![t, out_width]);
    cost
}

/// Backward of [`after_forward`]: `dz` arrives with the op's output shape and leaves with its
/// input shape `(T, in_width)`.
pub fn after_backward(after: After, dz: &mut Tensor, in_width: usize) -> Cost {
    let (t, w) = (dz.shape()[0], dz.shape()[1]);
    let cost = match after {
        After::None | After::Relu => Cost::default(),
        // Recomputes the scores (flash attention) and forms dQ, dK, dV: twice the forward.
        After::Attention { seq } => Cost {
            flops: 8.0 * (t * seq * w) as f64,
            bytes: 4.0 * (2 * t * (w + in_width)) as f64,
        },
        After::Gelu => Cost::elementwise(t * w, 10.0, 2.0),
        After::SwiGlu => Cost::elementwise(t * in_width, 8.0, 3.0),
        After::ResidualNorm => Cost::elementwise(t * w, 10.0, 3.0),
    };
    *dz = Tensor::Meta(vec![t, in_width]);
    cost
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama2_70b() -> TransformerSpec {
        TransformerSpec {
            layers: 80,
            d_model: 8192,
            heads: 64,
            kv_heads: 8,
            ffn: 28672,
            vocab: 32000,
            seq: 4096,
            gated: true,
            dtype: DType::Bf16,
        }
    }

    #[test]
    fn a_llama2_70b_shape_has_about_69_billion_parameters() {
        let m = llama2_70b();
        // Hand count: per block 8192 * (8192 + 2 * 1024) + 8192^2 + 3 * 8192 * 28672 weights;
        // two vocabulary tables.
        let block = 8192 * (8192 + 2048) + 8192 * 8192 + 3 * 8192 * 28672;
        assert_eq!(m.block_matrix_params(), block);
        let weights = 80 * block + 2 * 32000 * 8192;
        let p = m.parameters();
        assert!(p > weights && p - weights < 80 * 100_000 + 50_000, "{p}");
        assert!((68.9e9..69.1e9).contains(&(p as f64)), "{p}");
    }

    #[test]
    fn lowering_chains_widths_and_pairs_column_with_row() {
        let m = ModelSpec::Transformer(TransformerSpec {
            layers: 2,
            d_model: 64,
            heads: 4,
            kv_heads: 2,
            ffn: 128,
            vocab: 100,
            seq: 16,
            gated: false,
            dtype: DType::F32,
        });
        let layers = m.lower();
        assert_eq!(layers.len(), 4 * 2 + 2);
        let params: usize = layers.iter().map(|l| l.outputs * (l.inputs + 1)).sum();
        assert_eq!(params, m.parameters());
        for pair in layers[1..layers.len() - 1].chunks(2) {
            assert_eq!((pair[0].style, pair[1].style), (Style::Column, Style::Row));
        }
        assert_eq!(layers[1].outputs, (4 + 2 * 2) * 16);
    }
}
