//! Training: chips run training steps of an MLP (real values) or a transformer (meta) under a parallel strategy (DDP, FSDP,
//! HSDP, tensor parallel, FSDP + TP), moving parameters and gradients with the collectives
//! and charging compute, communication and memory to the modelled hardware.
//!
//! - [`tensor`]: local tensors (values or, in meta mode, shapes) and `torch.chunk` layouts;
//! - [`dtensor`]: DeviceMesh / DTensor placements and redistribution;
//! - [`kernels`]: what a kernel (matmul, element-wise pass, flash attention) costs on the
//!   modelled chip; [`hbm_share`]: HBM shared by kernels and communication in flight;
//!   [`remat`]: activation rematerialisation policies;
//! - [`mlp`]: the MLP, its data and its kernels; [`model`]: the models (MLP, transformer by
//!   shape) lowered to the layers the trainer runs; [`optim`]: SGD and AdamW;
//! - [`memory`]: the per-chip HBM ledger; [`strategy`]: how each strategy places parameters
//!   and syncs gradients; [`trainer`]: the step loop with its compute and communication
//!   streams; [`reference`](mod@reference): single-chip training on the global batch, the yardstick.

pub mod checkpoint;
pub mod dtensor;
pub mod hbm_share;
pub mod kernels;
pub mod memory;
pub mod mlp;
pub mod model;
pub mod optim;
pub mod reference;
pub mod remat;
pub mod strategy;
pub mod tensor;
pub mod trainer;

pub use dtensor::{DTensor, Mesh, Placement};
pub use memory::{Hbm, HbmReport, MemKind};
pub use mlp::MlpSpec;
pub use model::{AttentionKind, BlockKind, MlpKind, ModelSpec, TransformerSpec};
pub use optim::OptimizerSpec;
pub use remat::Remat;
pub use strategy::{Eager, Strategy};
pub use tensor::Tensor;
pub use trainer::{
    ChipTrainReport, GradReduce, ReplicaSync, StepRecord, TpActivations, TrainSpec, train_chip,
    train_chip_with_parameters,
};
