//! The models the trainer runs, lowered to one list of layers it executes.
//!
//! A model is either the MLP of [`MlpSpec`] (real values or meta) or a decoder-only transformer
//! described by its shape ([`TransformerSpec`], meta mode only: its parameters are meta tensors
//! and every kernel is charged from its shape). Both lower to [`LayerSpec`]s: a parameterised
//! op (a linear layer or an embedding table, weight `(out, in)` and bias `(out)`), how tensor
//! parallelism cuts it, and the parameter-free op that follows it (ReLU, the attention core,
//! the MLP activation, residual + norm). Strategies place and sync each layer's two
//! parameters exactly as for the MLP, so every strategy runs on every model unchanged.
//!
//! A sequential block (attention, then MLP: Llama, GPT) lowers to four linear layers in
//! column/row pairs: `attn.qkv` (column-parallel, then the attention core), `attn.out` (row,
//! then residual and norm), `mlp.wi` (column, then the activation), `mlp.wo` (row, then
//! residual and norm). A parallel block (PaLM: one pre-norm feeding attention and MLP, outputs
//! summed) lowers to the fused pair it is implemented as: `in` (`[qkv | wi]`, column, then
//! attention and activation side by side) and `out` (`[out | wo]`, row, then residual and
//! norm). Before the blocks an embedding table (replicated over tensor parallelism), after
//! them the LM head (vocabulary sharded over tensor parallelism; with tied embeddings it holds
//! the only copy of the table), then softmax cross-entropy over the vocabulary. Norm gains are
//! not parameters here (2·d_model per norm, under 0.01% of any realistic model).
//!
//! Each layer also says which of its outputs are named activations ([`Name`]) and which
//! rematerialisation block it belongs to, for [`crate::train::remat`].

use podsim_collectives::DType;
use serde::{Deserialize, Serialize};

use crate::error::ProgramError;
use crate::train::kernels::{Cost, Kernel};
use crate::train::mlp::{Grads, MlpSpec};
use crate::train::remat::Name;
use crate::train::strategy::Style;
use crate::train::tensor::Tensor;

/// A model as a job describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ModelSpec {
    Mlp(MlpSpec),
    Transformer(TransformerSpec),
}

/// The MLP of a transformer block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MlpKind {
    /// Two matrices, ReLU between.
    Relu,
    /// Two matrices, GELU between.
    Gelu,
    /// Three matrices: `silu(x W_gate) * (x W_up)`, then down.
    Swiglu,
    /// Three matrices: `gelu(x W_gate) * (x W_up)`, then down.
    Geglu,
}

podsim_collectives::named_enum!(MlpKind, "mlp", {
    Relu => "relu",
    Gelu => "gelu",
    Swiglu => "swiglu",
    Geglu => "geglu",
});

impl MlpKind {
    /// Gated MLPs have two input projections.
    pub fn gated(self) -> bool {
        matches!(self, MlpKind::Swiglu | MlpKind::Geglu)
    }
}

/// How attention and MLP are arranged in a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockKind {
    /// Attention, then MLP, each with its own pre-norm and residual.
    Sequential,
    /// One pre-norm feeding attention and MLP, their outputs summed into the residual.
    Parallel,
}

podsim_collectives::named_enum!(BlockKind, "block", {
    Sequential => "sequential",
    Parallel => "parallel",
});

/// How a block computes attention.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    /// Flash attention: scores block by block in on-chip memory, never in HBM; causal blocks
    /// above the diagonal skipped; backward recomputes the scores.
    #[default]
    Flash,
    /// Scores materialised in HBM (MaxText's `dot_product`, PyTorch's math attention): `QK^T`
    /// over the whole square (the causal mask is applied, not skipped), a softmax pass over
    /// it, then `PV`; backward reads the probabilities back.
    DotProduct,
}

podsim_collectives::named_enum!(AttentionKind, "attention", {
    Flash => "flash",
    DotProduct => "dot_product",
});

/// A decoder-only transformer by its shape (`kv_heads < heads` is grouped-query attention;
/// `heads * head_dim` need not equal `d_model`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransformerSpec {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub mlp: MlpKind,
    pub block: BlockKind,
    /// How attention is computed (flash unless said).
    #[serde(default)]
    pub attention: AttentionKind,
    pub vocab: usize,
    /// The LM head reuses the embedding table.
    pub tied_embeddings: bool,
    /// Tokens per sequence.
    pub seq: usize,
    /// Element type of the computation: activations, the weights a kernel reads, gradients
    /// as they flow, and the collectives that move them.
    pub dtype: DType,
    /// Element type the weights, their gradients and the optimizer state are kept in between
    /// steps (MaxText's `weight_dtype`). Wider than `dtype` is mixed precision: a `dtype`
    /// working copy beside master weights of this type.
    pub weight_dtype: DType,
    /// The matrix products add a bias (`true`, the default). GPT-3's linears do; MaxText's
    /// other models and Llama's have none (MaxText's `DenseGeneral` and `MlpBlock` default to
    /// `use_bias = False`), but the kernel model's calibrated constants were set with a bias
    /// add charged on every product (docs/PERFORMANCE.md, "Biases"), so the default keeps it.
    #[serde(default = "charged")]
    pub bias: bool,
    /// The model's code computes its norms in f32 (`x.float()`), as PyTorch's Llamas do
    /// (torchtitan's, Hugging Face's), and autograd keeps each norm's f32 input for backward.
    /// `false` (the default): norms save the model's dtype only, as XLA fuses MaxText's into
    /// their neighbours. Memory only: the copies' HBM traffic is not charged (see
    /// [`upcast_elems`]).
    #[serde(default)]
    pub upcast: bool,
}

fn charged() -> bool {
    true
}

/// What a layer's parameters do to its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// `x W^T + b`.
    Linear,
    /// A lookup of one row of `W` per token (the input holds token ids).
    Embedding,
}

/// The attention of a block, with global widths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub kind: AttentionKind,
}

impl AttentionShape {
    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// The parameter-free op after a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    None,
    /// The MLP's ReLU (real values).
    Relu,
    /// Causal attention with RoPE on `q` and `k`: `(T, q + k + v)` in, `(T, q)` out.
    Attention(AttentionShape),
    /// A transformer MLP's activation: `(T, f)` in and out, or gated `(T, 2f)` in.
    Activation(MlpKind),
    /// A parallel block's attention and activation side by side: `(T, qkv + up)` in,
    /// `(T, q + ffn)` out.
    ParallelCore {
        attention: AttentionShape,
        mlp: MlpKind,
        ffn: usize,
    },
    /// Residual add and norm.
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
    /// The rematerialisation block it belongs to (`None`: outside every block, its
    /// activations always kept).
    pub block: Option<usize>,
    /// Named parts of the matmul's output, with their global widths.
    pub out_names: Vec<(Name, usize)>,
    /// Named parts of the op-after's output, with their global widths.
    pub after_names: Vec<(Name, usize)>,
    /// The product adds a bias; without one the layer's bias parameter has no elements.
    pub bias: bool,
    /// Its op-after keeps f32 copies for backward ([`TransformerSpec::upcast`]).
    pub upcast: bool,
}

impl std::fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSpec::Mlp(m) => write!(f, "MLP {:?}", m.widths),
            ModelSpec::Transformer(t) => write!(
                f,
                "transformer {} layers ({} blocks), d_model {}, {} heads ({} kv) of {}{}, ffn {} ({}), vocab {}{}, seq {}, {}{}",
                t.layers,
                match t.block {
                    BlockKind::Sequential => "sequential",
                    BlockKind::Parallel => "parallel",
                },
                t.d_model,
                t.heads,
                t.kv_heads,
                t.head_dim,
                match t.attention {
                    AttentionKind::Flash => "",
                    AttentionKind::DotProduct => " (dot-product attention)",
                },
                t.ffn,
                t.mlp.name(),
                t.vocab,
                if t.tied_embeddings { " (tied)" } else { "" },
                t.seq,
                t.dtype.name(),
                if t.weight_dtype == t.dtype {
                    String::new()
                } else {
                    format!(" ({} weights)", t.weight_dtype.name())
                }
            ),
        }
    }
}

impl LayerSpec {
    /// The layer's weight `(out, in)` and bias `(out)` as meta tensors (a bias of no elements
    /// when the layer has none).
    pub fn meta_params(&self) -> [Tensor; 2] {
        [
            Tensor::Meta(vec![self.outputs, self.inputs]),
            Tensor::Meta(vec![self.bias_len()]),
        ]
    }

    /// Elements of the layer's bias.
    pub fn bias_len(&self) -> usize {
        if self.bias { self.outputs } else { 0 }
    }

    /// Whether the layer's op-after makes its rematerialisation block's output (the next
    /// block's input): the block's last layer, whose matmul output nothing but that reads.
    pub fn ends_block(&self) -> bool {
        self.after_names
            .iter()
            .any(|(n, _)| *n == Name::DecoderLayerInput)
    }
}

impl TransformerSpec {
    fn attention(&self) -> AttentionShape {
        AttentionShape {
            seq: self.seq,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            kind: self.attention,
        }
    }

    /// Width of the attention output (`heads * head_dim`).
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of the fused query/key/value projection.
    pub fn qkv_width(&self) -> usize {
        self.attention().qkv_width()
    }

    fn up_width(&self) -> usize {
        if self.mlp.gated() {
            2 * self.ffn
        } else {
            self.ffn
        }
    }

    /// Weights of one block's matrix products.
    pub fn block_matrix_params(&self) -> usize {
        let d = self.d_model;
        d * self.qkv_width() + self.q_width() * d + d * self.up_width() + self.ffn * d
    }

    /// Every parameter: embedding, blocks (weights, and biases where the model has them), LM
    /// head (one table when tied).
    pub fn parameters(&self) -> usize {
        self.lower()
            .iter()
            .map(|l| l.outputs * l.inputs + l.bias_len())
            .sum()
    }

    /// Model flops of one training step on `tokens` tokens, the usual way of counting them for
    /// MFU: `6` per matrix-product weight per token (forward `2`, backward `4`; the embedding
    /// lookup is no product, the LM head is) plus causal attention's `6 * seq * heads *
    /// head_dim` per token per block (`QK^T` and `AV` over half the score matrix, forward and
    /// backward). Element-wise work and rematerialisation are not counted.
    pub fn step_flops(&self, tokens: f64) -> f64 {
        let matrix = (self.layers * self.block_matrix_params() + self.vocab * self.d_model) as f64;
        let attention = 6.0 * (self.layers * self.seq * self.q_width()) as f64;
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
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
            ("seq", self.seq),
        ] {
            if v == 0 {
                out.push(format!("{name} must be at least 1"));
            }
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
        let mut embedding = layer_spec(
            "embedding".into(),
            LayerKind::Embedding,
            // Tied: the LM head holds the table.
            (if self.tied_embeddings { 0 } else { self.vocab }, d),
            Style::Replicated,
            After::None,
            None,
        );
        embedding.after_names = vec![(Name::DecoderLayerInput, d)];
        let mut out = vec![embedding];
        for b in 0..self.layers {
            match self.block {
                BlockKind::Sequential => out.extend(self.sequential_block(b)),
                BlockKind::Parallel => out.extend(self.parallel_block(b)),
            }
        }
        out.push(layer_spec(
            "lm_head".into(),
            LayerKind::Linear,
            (d, self.vocab),
            Style::Column,
            After::None,
            None,
        ));
        for layer in &mut out {
            layer.bias = self.bias;
            layer.upcast = self.upcast;
        }
        out
    }

    /// The names of the query, key and value projections' outputs (what remat policies name).
    fn qkv_names(&self) -> Vec<(Name, usize)> {
        let (q, kv) = (self.q_width(), self.kv_heads * self.head_dim);
        vec![
            (Name::QueryProj, q),
            (Name::KeyProj, kv),
            (Name::ValueProj, kv),
        ]
    }

    /// Block `b` as attention then MLP: qkv (and attention), the output projection (and the
    /// residual and norm), the MLP's input (and its activation), its output.
    fn sequential_block(&self, b: usize) -> [LayerSpec; 4] {
        let (d, q, p, block) = (self.d_model, self.q_width(), format!("blocks.{b}"), Some(b));
        let mut qkv = layer_spec(
            format!("{p}.attn.qkv"),
            LayerKind::Linear,
            (d, self.qkv_width()),
            Style::Column,
            After::Attention(self.attention()),
            block,
        );
        qkv.out_names = self.qkv_names();
        qkv.after_names = vec![(Name::Context, q)];
        let mut proj = layer_spec(
            format!("{p}.attn.out"),
            LayerKind::Linear,
            (q, d),
            Style::Row,
            After::ResidualNorm,
            block,
        );
        proj.out_names = vec![(Name::OutProj, d)];
        let mut wi = layer_spec(
            format!("{p}.mlp.wi"),
            LayerKind::Linear,
            (d, self.up_width()),
            Style::Column,
            After::Activation(self.mlp),
            block,
        );
        wi.out_names = vec![(Name::MlpWi, self.up_width())];
        let mut wo = layer_spec(
            format!("{p}.mlp.wo"),
            LayerKind::Linear,
            (self.ffn, d),
            Style::Row,
            After::ResidualNorm,
            block,
        );
        wo.out_names = vec![(Name::MlpWo, d)];
        wo.after_names = vec![(Name::DecoderLayerInput, d)];
        [qkv, proj, wi, wo]
    }

    /// Block `b` with attention and MLP side by side: one product for both inputs, one for
    /// both outputs (summed).
    fn parallel_block(&self, b: usize) -> [LayerSpec; 2] {
        let (d, q, p, block) = (self.d_model, self.q_width(), format!("blocks.{b}"), Some(b));
        let mut fused_in = layer_spec(
            format!("{p}.in"),
            LayerKind::Linear,
            (d, self.qkv_width() + self.up_width()),
            Style::Column,
            After::ParallelCore {
                attention: self.attention(),
                mlp: self.mlp,
                ffn: self.ffn,
            },
            block,
        );
        fused_in.out_names = self.qkv_names();
        fused_in.out_names.push((Name::MlpWi, self.up_width()));
        fused_in.after_names = vec![(Name::Context, q)];
        // The attention output and the MLP output are summed: one `[out | wo]` product over
        // the concatenated inputs.
        let mut fused_out = layer_spec(
            format!("{p}.out"),
            LayerKind::Linear,
            (q + self.ffn, d),
            Style::Row,
            After::ResidualNorm,
            block,
        );
        fused_out.out_names = vec![(Name::OutProj, d), (Name::MlpWo, d)];
        fused_out.after_names = vec![(Name::DecoderLayerInput, d)];
        [fused_in, fused_out]
    }
}

/// A layer with nothing named for remat policies yet.
fn layer_spec(
    name: String,
    kind: LayerKind,
    (inputs, outputs): (usize, usize),
    style: Style,
    after: After,
    block: Option<usize>,
) -> LayerSpec {
    LayerSpec {
        name,
        kind,
        inputs,
        outputs,
        style,
        after,
        block,
        out_names: Vec::new(),
        after_names: Vec::new(),
        bias: true,
        upcast: false,
    }
}

impl ModelSpec {
    /// The layers the trainer runs, in order.
    pub fn lower(&self) -> Vec<LayerSpec> {
        match self {
            ModelSpec::Mlp(m) => {
                let n = m.layers();
                (0..n)
                    .map(|l| {
                        let paired = l % 2 == 1 || l + 1 < n;
                        let relu = l + 1 < n;
                        LayerSpec {
                            name: format!("layers.{l}"),
                            kind: LayerKind::Linear,
                            inputs: m.widths[l],
                            outputs: m.widths[l + 1],
                            // Megatron pairs; an odd last layer stays whole.
                            style: match (l % 2, paired) {
                                (_, false) => Style::Replicated,
                                (0, true) => Style::Column,
                                _ => Style::Row,
                            },
                            after: if relu { After::Relu } else { After::None },
                            // A pair is a rematerialisation block: the first layer's output
                            // is the block's inner activation, the second's ends the block.
                            block: paired.then_some(l / 2),
                            out_names: if !paired {
                                Vec::new()
                            } else if l % 2 == 0 {
                                vec![(Name::MlpWi, m.widths[l + 1])]
                            } else {
                                vec![(Name::MlpWo, m.widths[l + 1])]
                            },
                            after_names: if relu && l % 2 == 1 {
                                vec![(Name::DecoderLayerInput, m.widths[l + 1])]
                            } else {
                                Vec::new()
                            },
                            bias: true,
                            upcast: false,
                        }
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

    /// Element type of the master weights and the optimizer state.
    pub fn weight_dtype(&self) -> DType {
        match self {
            ModelSpec::Mlp(_) => DType::F32,
            ModelSpec::Transformer(t) => t.weight_dtype,
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
pub fn embedding(x: &Tensor, w: &Tensor) -> Result<(Tensor, Cost), ProgramError> {
    if !(x.is_meta() && w.is_meta()) {
        return Err(ProgramError::Invalid(
            "embedding layers run in meta mode only".into(),
        ));
    }
    let (t, d) = (x.shape()[0], w.shape()[0]);
    Ok((Tensor::Meta(vec![t, d]), Cost::elementwise(t * d, 0.0, 1.0)))
}

/// Backward of an embedding lookup: the rows' gradients scatter-added into a dense `(vocab, d)`
/// gradient (as `torch.nn.Embedding` does without `sparse=True`).
pub fn embedding_backward(x: &Tensor, w: &Tensor) -> Grads {
    let (t, d) = (x.shape()[0], w.shape()[0]);
    Grads {
        dw: Tensor::Meta(w.shape().to_vec()),
        db: Tensor::Meta(vec![d]),
        dx: None,
        weight_cost: Cost::elementwise(t * d, 1.0, 1.0),
        input_cost: Cost::default(),
    }
}

/// The attention kernels on `t` tokens with `share` of the heads (tensor parallelism):
/// RoPE on `q` and `k`, then causal attention as the shape says.
fn attention_cost(a: &AttentionShape, t: usize, share: f64, backward: bool) -> Cost {
    let rope_width = ((a.heads + a.kv_heads) * a.head_dim) as f64 * share;
    let rope = Cost::elementwise(
        (t as f64 * rope_width) as usize,
        6.0,
        if backward { 2.0 } else { 1.0 },
    );
    let core = match a.kind {
        AttentionKind::Flash => Kernel::Attention {
            seqs: t / a.seq.max(1),
            seq: a.seq,
            heads: a.heads as f64 * share,
            head_dim: a.head_dim,
            causal: true,
            backward,
        }
        .into(),
        AttentionKind::DotProduct => materialized_attention(a, t, share, backward),
    };
    rope.plus(core)
}

/// Attention whose `(seq, seq)` score matrices go through HBM, one per sequence and query head
/// (grouped key/value heads are broadcast), as XLA runs a plain softmax-of-einsums. Stacked, the
/// score matrices of `t / seq` sequences and the local heads are one `(rows, seq)` array.
///
/// Forward: `S = QK^T` (written), a softmax pass (scale, mask, row max and sum: reads `S`
/// twice, writes `P`), `O = PV` (reads `P`). Backward, with `P` at hand (kept, or recomputed by
/// rematerialisation): `dP = dO V^T` (written), `dS = P * (dP - rowsum(dP * P))` (reads `P` and
/// `dP`, `dP` twice, writes `dS`), `dV = P^T dO`, `dQ = dS K`, `dK = dS^T Q` (each reads an
/// `(s, s)` matrix per row block).
fn materialized_attention(a: &AttentionShape, t: usize, share: f64, backward: bool) -> Cost {
    let (s, hd) = (a.seq.max(1), a.head_dim);
    let rows = score_rows(a, t, share);
    let scores = rows * s;
    // A product that reads one `(s, s)` matrix per block of rows: `PV`, `P^T dO`, `dS K`.
    let reads_square = || Cost::matmul(rows, s, hd);
    if backward {
        Cost::matmul(rows, hd, s)
            .plus(Cost::elementwise(scores, 4.0, 3.0))
            .plus(reads_square())
            .plus(reads_square())
            .plus(reads_square())
    } else {
        Cost::matmul(rows, hd, s)
            .plus(Cost::elementwise(scores, 5.0, 2.0))
            .plus(reads_square())
    }
}

/// Rows of the stacked `(seq, seq)` score matrices of `t` tokens at `share` of the heads: one
/// matrix per sequence and local query head.
fn score_rows(a: &AttentionShape, t: usize, share: f64) -> usize {
    let s = a.seq.max(1);
    ((t / s) as f64 * a.heads as f64 * share).round() as usize * s
}

/// The materialised attention of an op-after, if it has one.
fn materialized(after: After) -> Option<AttentionShape> {
    match after {
        After::Attention(a) | After::ParallelCore { attention: a, .. }
            if a.kind == AttentionKind::DotProduct =>
        {
            Some(a)
        }
        _ => None,
    }
}

/// Elements an op keeps for its backward beyond its input and output, on `t` tokens at `share`
/// of the op's width: the probabilities of materialised attention.
pub fn after_residual_elems(layer: &LayerSpec, t: usize, share: f64) -> usize {
    materialized(layer.after).map_or(0, |a| score_rows(&a, t, share) * a.seq.max(1))
}

/// f32 elements the op after `layer` keeps for backward beyond its output when the model
/// upcasts its norms ([`TransformerSpec::upcast`]), on `t` tokens with `width` of the layer's
/// output on this chip: a norm's f32 input (`x.float()`, which `pow` and the scaling `mul`
/// save). Rotary embeddings computed in f32 save nothing wider than their input (their
/// products save the cos and sin tables). Under torch's activation checkpointing a recomputed
/// block holds them again until its backward. Their HBM traffic (one more f32 write in
/// forward and read in backward per norm) is not charged: the kernel model's constants were
/// set on programs that fuse them.
pub fn upcast_elems(layer: &LayerSpec, t: usize, width: usize) -> usize {
    match layer.after {
        After::ResidualNorm if layer.upcast => t * width,
        _ => 0,
    }
}

/// Score-sized elements a materialised attention holds while it runs, beyond what it keeps for
/// backward, on `t` tokens with `in_width` of the op's input on this chip: `S` and `P` in
/// forward; `dP` and `dS` in backward, and `P` itself when rematerialisation recomputed it
/// instead of keeping it (`p_kept` false).
pub fn after_workspace_elems(
    layer: &LayerSpec,
    t: usize,
    in_width: usize,
    backward: bool,
    p_kept: bool,
) -> usize {
    let share = in_width as f64 / after_input_width(layer).max(1) as f64;
    let arrays = if backward && !p_kept { 3 } else { 2 };
    arrays * after_residual_elems(layer, t, share)
}

/// The op-after holds a tensor its backward needs that no remat policy names (the
/// probabilities of materialised attention): under any policy but `none`, backward runs the
/// op again.
pub fn after_needs_recompute(layer: &LayerSpec) -> bool {
    materialized(layer.after).is_some()
}

/// A transformer MLP activation over `t x out` outputs (gated: two inputs per output).
fn activation_cost(kind: MlpKind, t: usize, out: usize, backward: bool) -> Cost {
    let n = t * out;
    match (kind.gated(), backward) {
        (false, false) => Cost::elementwise(n, 8.0, 1.0),
        (false, true) => Cost::elementwise(n, 10.0, 2.0),
        (true, false) => Cost::elementwise(n, 6.0, 2.0),
        // Reads both inputs and the output gradient, writes two gradients.
        (true, true) => Cost::elementwise(2 * n, 8.0, 1.5),
    }
}

/// Cost of a transformer's parameter-free op on `(t, in_width)` in, `(t, out_width)` out, in
/// forward or backward; `in_global` is the op's input width before tensor parallelism.
fn after_cost(
    after: After,
    t: usize,
    in_width: usize,
    out_width: usize,
    in_global: usize,
    backward: bool,
) -> Cost {
    let share = in_width as f64 / in_global.max(1) as f64;
    match after {
        After::None | After::Relu => Cost::default(),
        After::Attention(a) => attention_cost(&a, t, share, backward),
        After::Activation(kind) => activation_cost(kind, t, out_width, backward),
        After::ParallelCore {
            attention,
            mlp,
            ffn,
            ..
        } => {
            let ffn_local = (ffn as f64 * share).round() as usize;
            attention_cost(&attention, t, share, backward)
                .plus(activation_cost(mlp, t, ffn_local, backward))
        }
        After::ResidualNorm => {
            if backward {
                Cost::elementwise(t * in_width, 10.0, 3.0)
            } else {
                Cost::elementwise(t * in_width, 8.0, 2.0)
            }
        }
    }
}

/// Forward of the parameter-free op after `layer` on `z` `(T, width)`; `out_width` is the
/// width the next layer takes on this chip. Returns the op's cost; `z` takes the output shape.
pub fn after_forward(layer: &LayerSpec, z: &mut Tensor, out_width: usize) -> Cost {
    let (t, w) = (z.shape()[0], z.shape()[1]);
    let cost = after_cost(
        layer.after,
        t,
        w,
        out_width,
        after_input_width(layer),
        false,
    );
    *z = Tensor::Meta(vec![t, out_width]);
    cost
}

/// Backward of [`after_forward`]: `dz` arrives with the op's output shape and leaves with its
/// input shape `(T, in_width)`.
pub fn after_backward(layer: &LayerSpec, dz: &mut Tensor, in_width: usize) -> Cost {
    let (t, w) = (dz.shape()[0], dz.shape()[1]);
    let cost = after_cost(layer.after, t, in_width, w, after_input_width(layer), true);
    *dz = Tensor::Meta(vec![t, in_width]);
    cost
}

/// The op-after's input width over all chips (what tensor parallelism divides).
fn after_input_width(layer: &LayerSpec) -> usize {
    match layer.after {
        After::Attention(a) => a.qkv_width(),
        After::ParallelCore {
            attention,
            mlp,
            ffn,
        } => attention.qkv_width() + if mlp.gated() { 2 * ffn } else { ffn },
        _ => layer.outputs,
    }
}

/// The op-after's output width over all chips.
pub fn after_output_width(layer: &LayerSpec) -> usize {
    match layer.after {
        After::Attention(a) => a.q_width(),
        After::Activation(kind) if kind.gated() => layer.outputs / 2,
        After::ParallelCore { attention, ffn, .. } => attention.q_width() + ffn,
        _ => layer.outputs,
    }
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
            head_dim: 128,
            ffn: 28672,
            mlp: MlpKind::Swiglu,
            block: BlockKind::Sequential,
            attention: AttentionKind::Flash,
            vocab: 32000,
            tied_embeddings: false,
            seq: 4096,
            dtype: DType::Bf16,
            weight_dtype: DType::F32,
            bias: false,
            upcast: false,
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
        // Llama has no biases: the weights are every parameter.
        let p = m.parameters();
        assert_eq!(p, weights);
        assert!((68.9e9..69.1e9).contains(&(p as f64)), "{p}");
    }

    #[test]
    fn tied_embeddings_keep_one_table_and_head_dim_is_free_of_d_model() {
        // A PaLM-like shape: 32 heads of 256 on d_model 10240, a parallel ReLU block.
        let m = TransformerSpec {
            layers: 2,
            d_model: 10240,
            heads: 32,
            kv_heads: 32,
            head_dim: 256,
            ffn: 32768,
            mlp: MlpKind::Relu,
            block: BlockKind::Parallel,
            attention: AttentionKind::Flash,
            vocab: 32768,
            tied_embeddings: true,
            seq: 2048,
            dtype: DType::Bf16,
            weight_dtype: DType::F32,
            bias: false,
            upcast: false,
        };
        let d = 10240;
        let block = d * 3 * 8192 + 8192 * d + 2 * d * 32768;
        assert_eq!(m.block_matrix_params(), block);
        let layers = ModelSpec::Transformer(m.clone()).lower();
        // Embedding, two fused layers per block, the head.
        assert_eq!(layers.len(), 1 + 2 * 2 + 1);
        assert_eq!(layers[0].inputs * layers[0].outputs, 0);
        assert_eq!((layers[1].inputs, layers[1].outputs), (d, 3 * 8192 + 32768));
        assert_eq!((layers[2].inputs, layers[2].outputs), (8192 + 32768, d));
        let weights: usize = layers.iter().map(|l| l.outputs * l.inputs).sum();
        assert_eq!(weights, 2 * block + 32768 * d);
        // Six flops per weight per token (the head included) plus causal attention.
        let tokens = 4096.0;
        let want =
            6.0 * (2 * block + 32768 * d) as f64 * tokens + 6.0 * (2 * 2048 * 8192) as f64 * tokens;
        assert_eq!(m.step_flops(tokens), want);
    }

    #[test]
    fn lowering_chains_widths_and_pairs_column_with_row() {
        let m = ModelSpec::Transformer(TransformerSpec {
            layers: 2,
            d_model: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 128,
            mlp: MlpKind::Gelu,
            block: BlockKind::Sequential,
            attention: AttentionKind::Flash,
            vocab: 100,
            tied_embeddings: false,
            seq: 16,
            dtype: DType::F32,
            weight_dtype: DType::F32,
            bias: true,
            upcast: false,
        });
        let layers = m.lower();
        assert_eq!(layers.len(), 4 * 2 + 2);
        let params: usize = layers.iter().map(|l| l.outputs * (l.inputs + 1)).sum();
        assert_eq!(params, m.parameters());
        for pair in layers[1..layers.len() - 1].chunks(2) {
            assert_eq!((pair[0].style, pair[1].style), (Style::Column, Style::Row));
        }
        assert_eq!(layers[1].outputs, (4 + 2 * 2) * 16);
        for (l, next) in layers.iter().zip(&layers[1..]) {
            assert_eq!(
                after_output_width(l),
                next.inputs,
                "{} -> {}",
                l.name,
                next.name
            );
        }
    }
}
