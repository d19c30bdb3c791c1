//! Activation rematerialisation: which of a block's activations stay in HBM for backward,
//! which go to host memory, and which backward recomputes (`jax.checkpoint` semantics).
//!
//! A block (a transformer decoder layer; a Megatron pair of the MLP) produces named tensors:
//! its input (`decoder_layer_input`), the outputs of its weight matmuls (`query_proj`,
//! `key_proj`, `value_proj`, `out_proj`, `mlpwi`, `mlpwo`), the attention output (`context`)
//! and unnamed element-wise results (norms, activations). A policy says where each named tensor
//! lives between forward and backward: on the device, offloaded to host memory (copied over the
//! host link in forward and back before the block's backward), or nowhere, in which case
//! backward runs the forward again from the block's input to get it back. The block's last
//! matmul (`mlpwo`, or a parallel block's fused `[out | wo]`) is never run again: its output
//! only makes the block's output, which the next block keeps as its input, and its backward
//! reads its input, not its output (XLA drops such a recomputation as dead code).
//!
//! | policy | kept | recomputed in backward |
//! |---|---|---|
//! | `none` | every activation | nothing |
//! | `full` | each block's input | the block's forward but its last matmul |
//! | `minimal` | every weight-matmul output | element-wise ops, attention |
//! | `minimal_with_context` (`minimal_flash`) | `minimal`'s and the attention output | element-wise ops |
//! | `save_dot_except_mlpwi` | weight-matmul outputs but the MLP input projection | the MLP input projection, element-wise ops, attention |
//! | `save_dot_except_mlp` | q, k, v and the attention's output projection | the MLP, element-wise ops, attention |
//! | `save_dot_with_context_except_mlp` | those and the attention output | the MLP, element-wise ops |
//! | `save_qkv_proj` | q, k, v projections | the rest |
//! | `save_out_proj` | the attention's output projection | the rest |
//! | `qkv_proj_offloaded` | q, k, v projections, in host memory | the rest |
//! | `minimal_offloaded` | every weight-matmul output, in host memory | element-wise ops, attention |
//! | `custom:NAME=device\|offload+...` | each named tensor where it says | every tensor not named |
//!
//! The named policies, and the tensors each keeps, are MaxText's (`remat_policy` and its decoder's
//! checkpoint names). Dot-product attention recomputes its scores under every policy: none names
//! them. PyTorch's words for the same things map onto these: `checkpoint` (each block wrapped in
//! `torch.utils.checkpoint` / `checkpoint_wrapper`) keeps what `full` keeps; `selective:OP,...`
//! (selective activation checkpointing that saves the named ops' outputs) saves `mm` (every
//! matmul, i.e. `minimal`) or the projections by their usual module names (`q_proj`/`wq`,
//! `k_proj`/`wk`, `v_proj`/`wv`, `o_proj`, `gate_proj`/`up_proj`/`w1`/`w3`, `down_proj`/`w2`).
//! They differ from MaxText's in one thing, how the recomputation holds memory: PyTorch's
//! recomputed forward saves what each op's backward reads, all at once (autograd), where XLA
//! schedules recomputation with the backward ([`Remat::autograd`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A named activation of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Name {
    DecoderLayerInput,
    QueryProj,
    KeyProj,
    ValueProj,
    OutProj,
    Context,
    MlpWi,
    MlpWo,
}

impl Name {
    pub const ALL: [Name; 8] = [
        Name::DecoderLayerInput,
        Name::QueryProj,
        Name::KeyProj,
        Name::ValueProj,
        Name::OutProj,
        Name::Context,
        Name::MlpWi,
        Name::MlpWo,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Name::DecoderLayerInput => "decoder_layer_input",
            Name::QueryProj => "query_proj",
            Name::KeyProj => "key_proj",
            Name::ValueProj => "value_proj",
            Name::OutProj => "out_proj",
            Name::Context => "context",
            Name::MlpWi => "mlpwi",
            Name::MlpWo => "mlpwo",
        }
    }

    /// Outputs of weight matmuls (what `minimal` keeps).
    fn is_weight_matmul(self) -> bool {
        !matches!(self, Name::DecoderLayerInput | Name::Context)
    }

    /// A name as a policy or a PyTorch program spells it (`qkv_proj` names three).
    fn parse(text: &str) -> Option<&'static [Name]> {
        const QKV: &[Name] = &[Name::QueryProj, Name::KeyProj, Name::ValueProj];
        Some(match text {
            "qkv_proj" => QKV,
            "kv_proj" => &[Name::KeyProj, Name::ValueProj],
            "query_proj" | "q_proj" | "wq" => &[Name::QueryProj],
            "key_proj" | "k_proj" | "wk" => &[Name::KeyProj],
            "value_proj" | "v_proj" | "wv" => &[Name::ValueProj],
            "out_proj" | "o_proj" => &[Name::OutProj],
            "context" => &[Name::Context],
            "mlpwi" | "gate_proj" | "up_proj" | "w1" | "w3" => &[Name::MlpWi],
            "mlpwo" | "down_proj" | "w2" => &[Name::MlpWo],
            "decoder_layer_input" => &[Name::DecoderLayerInput],
            _ => return None,
        })
    }
}

/// Where a kept tensor lives until backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Keep {
    Device,
    Offload,
}

podsim_collectives::named_enum!(Keep, "place", {
    Device => "device",
    Offload => "offload",
});

/// A rematerialisation policy: where each named tensor lives (absent: recomputed), or
/// `everything` for no rematerialisation at all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remat {
    /// The policy as written (for reports).
    pub text: String,
    /// No rematerialisation: every activation, named or not, stays on the device.
    pub everything: bool,
    kept: Vec<(Name, Keep)>,
    /// Recomputation as PyTorch's `torch.utils.checkpoint` runs it (the `checkpoint` and
    /// `selective:` policies): the block's forward again as its backward begins, each op of it
    /// saving what its own backward reads (autograd's saved tensors), held until that op's
    /// backward. Under the others (`jax.checkpoint`), the compiler schedules recomputation
    /// with the backward and only the recomputed outputs are counted.
    #[serde(default)]
    pub autograd: bool,
}

impl Default for Remat {
    fn default() -> Remat {
        Remat {
            text: "none".into(),
            everything: true,
            kept: Name::ALL.iter().map(|n| (*n, Keep::Device)).collect(),
            autograd: false,
        }
    }
}

impl Remat {
    /// Where `name` lives until backward; `None`: recomputed. A block's input is kept on
    /// the device unless a policy sends it to the host (the block cannot be recomputed
    /// without it).
    pub fn keep(&self, name: Name) -> Option<Keep> {
        self.kept
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, k)| *k)
            .or((name == Name::DecoderLayerInput).then_some(Keep::Device))
    }

    fn of(text: &str, kept: impl IntoIterator<Item = (Name, Keep)>) -> Remat {
        Remat {
            text: text.into(),
            everything: false,
            kept: kept.into_iter().collect(),
            autograd: false,
        }
    }

    /// The policy keeping every tensor `names` selects, all in the one place `keep`.
    fn all_in(text: &str, keep: Keep, names: impl Fn(Name) -> bool) -> Remat {
        Remat::of(
            text,
            Name::ALL
                .into_iter()
                .filter(|n| names(*n))
                .map(|n| (n, keep)),
        )
    }

    fn on_device(text: &str, names: impl Fn(Name) -> bool) -> Remat {
        Remat::all_in(text, Keep::Device, names)
    }
}

impl fmt::Display for Remat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

const QKV: [Name; 3] = [Name::QueryProj, Name::KeyProj, Name::ValueProj];

impl FromStr for Remat {
    type Err = String;

    fn from_str(text: &str) -> Result<Remat, String> {
        let t = text.trim();
        Ok(match t {
            "none" => Remat {
                text: t.into(),
                ..Remat::default()
            },
            "full" => Remat::on_device(t, |_| false),
            "checkpoint" => Remat {
                autograd: true,
                ..Remat::on_device(t, |_| false)
            },
            "minimal" => Remat::on_device(t, Name::is_weight_matmul),
            "save_dot_except_mlpwi" => {
                Remat::on_device(t, |n| n.is_weight_matmul() && n != Name::MlpWi)
            }
            "minimal_with_context" | "minimal_flash" => {
                Remat::on_device(t, |n| n.is_weight_matmul() || n == Name::Context)
            }
            "save_dot_except_mlp" => {
                Remat::on_device(t, |n| QKV.contains(&n) || n == Name::OutProj)
            }
            "save_dot_with_context_except_mlp" => Remat::on_device(t, |n| {
                QKV.contains(&n) || matches!(n, Name::OutProj | Name::Context)
            }),
            "save_qkv_proj" => Remat::on_device(t, |n| QKV.contains(&n)),
            "save_out_proj" => Remat::on_device(t, |n| n == Name::OutProj),
            "qkv_proj_offloaded" => Remat::all_in(t, Keep::Offload, |n| QKV.contains(&n)),
            "minimal_offloaded" => Remat::all_in(t, Keep::Offload, Name::is_weight_matmul),
            _ => {
                if let Some(list) = t.strip_prefix("custom:") {
                    let mut kept = Vec::new();
                    for item in list.split('+').map(str::trim) {
                        let (name, place) = item.split_once('=').ok_or_else(|| {
                            format!(
                                "custom remat entry {item:?}: expected NAME=device or NAME=offload"
                            )
                        })?;
                        let names = Name::parse(name.trim()).ok_or_else(|| {
                            format!(
                                "custom remat entry {item:?}: unknown tensor {name:?} ({})",
                                known_names()
                            )
                        })?;
                        let keep: Keep = place
                            .trim()
                            .parse()
                            .map_err(|e| format!("custom remat entry {item:?}: {e}"))?;
                        kept.extend(names.iter().map(|n| (*n, keep)));
                    }
                    Remat::of(t, kept)
                } else if let Some(list) = t.strip_prefix("selective:") {
                    Remat {
                        autograd: true,
                        ..Remat::of(t, selectively_saved(list)?)
                    }
                } else {
                    return Err(format!(
                        "unknown remat policy {t:?} (none, full, minimal, minimal_with_context, \
                         save_dot_except_mlpwi, save_dot_except_mlp, \
                         save_dot_with_context_except_mlp, save_qkv_proj, save_out_proj, \
                         qkv_proj_offloaded, minimal_offloaded, custom:NAME=device|offload+..., \
                         checkpoint, selective:OP,...)"
                    ));
                }
            }
        })
    }
}

/// What PyTorch's selective activation checkpointing of the ops in `list` (`mm`, or module
/// names) saves.
fn selectively_saved(list: &str) -> Result<Vec<(Name, Keep)>, String> {
    let mut kept = Vec::new();
    for op in list.split(',').map(str::trim) {
        if op == "mm" || op == "aten.mm" {
            kept.extend(
                Name::ALL
                    .into_iter()
                    .filter(|n| n.is_weight_matmul())
                    .map(|n| (n, Keep::Device)),
            );
            continue;
        }
        let names = Name::parse(op).ok_or_else(|| {
            format!(
                "selective checkpointing of {op:?}: not an op podsim knows (mm, {})",
                known_names()
            )
        })?;
        kept.extend(names.iter().map(|n| (*n, Keep::Device)));
    }
    Ok(kept)
}

fn known_names() -> String {
    let mut names: Vec<&str> = Name::ALL.iter().map(|n| n.as_str()).collect();
    names.extend(["qkv_proj", "kv_proj"]);
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remat(s: &str) -> Remat {
        s.parse().unwrap()
    }

    #[test]
    fn policies_keep_what_their_table_says() {
        assert!(remat("none").everything);
        let full = remat("full");
        assert_eq!(full.keep(Name::DecoderLayerInput), Some(Keep::Device));
        assert!(Name::ALL[1..].iter().all(|n| full.keep(*n).is_none()));
        let minimal = remat("minimal");
        assert_eq!(minimal.keep(Name::MlpWi), Some(Keep::Device));
        assert_eq!(minimal.keep(Name::Context), None);
        let except = remat("save_dot_except_mlpwi");
        assert_eq!(except.keep(Name::MlpWi), None);
        assert_eq!(except.keep(Name::MlpWo), Some(Keep::Device));
        let off = remat("qkv_proj_offloaded");
        assert_eq!(off.keep(Name::KeyProj), Some(Keep::Offload));
        assert_eq!(off.keep(Name::OutProj), None);
        let with_context = remat("minimal_with_context");
        assert_eq!(with_context.keep(Name::Context), Some(Keep::Device));
        assert_eq!(with_context.keep(Name::MlpWi), Some(Keep::Device));
        assert_eq!(remat("minimal_flash").kept, with_context.kept);
        let except_mlp = remat("save_dot_except_mlp");
        assert_eq!(except_mlp.keep(Name::OutProj), Some(Keep::Device));
        assert_eq!(except_mlp.keep(Name::MlpWo), None);
        assert_eq!(except_mlp.keep(Name::Context), None);
        let context_except_mlp = remat("save_dot_with_context_except_mlp");
        assert_eq!(context_except_mlp.keep(Name::Context), Some(Keep::Device));
        assert_eq!(context_except_mlp.keep(Name::MlpWi), None);
        let out = remat("save_out_proj");
        assert_eq!(out.keep(Name::OutProj), Some(Keep::Device));
        assert_eq!(out.keep(Name::QueryProj), None);
        let offloaded = remat("minimal_offloaded");
        assert_eq!(offloaded.keep(Name::MlpWo), Some(Keep::Offload));
        assert_eq!(offloaded.keep(Name::Context), None);
        assert_eq!(offloaded.keep(Name::DecoderLayerInput), Some(Keep::Device));
        let kv = remat("custom:kv_proj=offload");
        assert_eq!(kv.keep(Name::ValueProj), Some(Keep::Offload));
        assert_eq!(kv.keep(Name::QueryProj), None);
        let custom = remat("custom:decoder_layer_input=offload+qkv_proj=device+out_proj=offload");
        assert_eq!(custom.keep(Name::DecoderLayerInput), Some(Keep::Offload));
        assert_eq!(custom.keep(Name::ValueProj), Some(Keep::Device));
        assert_eq!(custom.keep(Name::MlpWo), None);
    }

    #[test]
    fn pytorch_words_map_onto_policies() {
        assert_eq!(remat("checkpoint").kept, remat("full").kept);
        assert_eq!(remat("selective:mm").kept, remat("minimal").kept);
        let sac = remat("selective:q_proj,k_proj,v_proj");
        assert_eq!(sac.kept, remat("save_qkv_proj").kept);
    }

    #[test]
    fn bad_policies_name_what_is_wrong() {
        let e = "custom:qkv=device".parse::<Remat>().unwrap_err();
        assert!(e.contains("unknown tensor \"qkv\""), "{e}");
        let e = "custom:mlpwo=disk".parse::<Remat>().unwrap_err();
        assert!(
            e.contains("unknown place \"disk\" (expected one of device, offload)"),
            "{e}"
        );
        assert!(
            "sometimes"
                .parse::<Remat>()
                .unwrap_err()
                .contains("unknown remat policy")
        );
    }
}
