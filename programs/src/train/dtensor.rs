//! DTensor: a tensor distributed over a device mesh, after PyTorch's `torch.distributed.tensor`.
//!
//! A [`Mesh`] is a list of named dimensions, each a [`Group`] of chips (whole torus axes, see
//! [`DeviceMesh`]). A [`DTensor`] holds, on each chip, the local piece of a global tensor that
//! its [`Placement`]s describe, one per mesh dimension:
//! - `Shard(d)`: tensor dimension `d` is cut into `torch.chunk` pieces along the mesh
//!   dimension (piece `r` on the chip of coordinate `r`; uneven sizes give shorter or empty
//!   last pieces). Several mesh dimensions sharding the same tensor dimension nest left to
//!   right: the first cuts the tensor, the next cuts each piece.
//! - `Replicate`: every chip along the mesh dimension holds the same values.
//! - `Partial(op)`: the global value is the `op`-reduction of the chips' values.
//!
//! [`DTensor::redistribute`] moves between any two placement lists with the collectives of
//! DESIGN.md: Partial -> Replicate all-reduce, Partial -> Shard reduce-scatter, Shard ->
//! Replicate all-gather, Shard(i) -> Shard(j) all-to-all, Replicate -> Shard a local chunk,
//! Replicate -> Partial a local partition. Pieces are zero-padded to equal size before a
//! collective and cut back after it, so uneven shapes work everywhere.
//!
//! ```
//! use podsim_collectives::{Algo, LocalFabric, ReduceOp, run_chips};
//! use podsim_topology::{Hardware, Pod};
//! use podsim_programs::ProgramError;
//! use podsim_programs::train::{DTensor, Mesh, Placement, Tensor};
//!
//! let pod = Pod::single("2x2".parse().unwrap());
//! let fabric = LocalFabric::new(pod.clone(), Hardware::preset("v5e").unwrap());
//! let mesh = Mesh::new(&pod, &[("dp", 2), ("tp", 2)], Algo::Ring).unwrap();
//! let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
//! let ok = rt.block_on(run_chips(fabric.chips(), move |mut chip| {
//!     let mesh = mesh.clone();
//!     async move {
//!         // A 5x3 matrix, rows sharded over dp, columns over tp (uneven: 3 rows + 2 rows).
//!         let full = Tensor::from_vec(&[5, 3], (0..15).map(|v| v as f32).collect())?;
//!         let dt = DTensor::distribute(&chip, &mesh, &full,
//!                                      &[Placement::Shard(0), Placement::Shard(1)])?;
//!         // Columns to rows on tp (all-to-all), then everything back (all-gathers).
//!         let moved = dt.redistribute(&mut chip, &[Placement::Shard(0), Placement::Shard(0)]).await?;
//!         let summed = moved.redistribute(&mut chip,
//!             &[Placement::Partial(ReduceOp::Sum), Placement::Shard(0)]).await?;
//!         Ok::<_, ProgramError>(summed.full_tensor(&mut chip).await? == full)
//!     }
//! })).unwrap();
//! assert!(ok.iter().all(|&same| same));
//! ```

use std::fmt;

use podsim_collectives::{Algo, Chip, Comm, DType, Payload, ReduceOp};
use podsim_topology::{DeviceMesh, Group, Pod};

use crate::error::ProgramError;
use crate::train::tensor::{Tensor, chunk_len, chunk_start};

/// How a tensor lies along one mesh dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Shard(usize),
    Replicate,
    Partial(ReduceOp),
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "Shard({d})"),
            Placement::Replicate => f.write_str("Replicate"),
            Placement::Partial(op) => write!(f, "Partial({op})"),
        }
    }
}

/// One mesh dimension: its name, its chips and their number.
#[derive(Debug, Clone, PartialEq)]
pub struct MeshDim {
    pub name: String,
    pub group: Group,
    pub size: usize,
}

/// Named mesh dimensions over a pod, with the algorithm and checks their collectives use.
#[derive(Debug, Clone, PartialEq)]
pub struct Mesh {
    dims: Vec<MeshDim>,
    algo: Algo,
    verify: bool,
    /// Element type of the tensors' collectives.
    dtype: DType,
}

impl Mesh {
    /// Lays `axes` (name, size), outermost first, onto the pod (see [`DeviceMesh::new`]).
    pub fn new(pod: &Pod, axes: &[(&str, u32)], algo: Algo) -> Result<Mesh, ProgramError> {
        let dm = DeviceMesh::new(pod, axes).map_err(|e| ProgramError::Invalid(e.to_string()))?;
        let names: Vec<&str> = axes.iter().map(|(n, _)| *n).collect();
        Mesh::over(pod, &dm, &names, algo)
    }

    /// The mesh dimensions `order` of `device_mesh`, in that order. The order is the nesting
    /// order of placements, independent of how the axes lie on the torus.
    pub fn over(
        pod: &Pod,
        device_mesh: &DeviceMesh,
        order: &[&str],
        algo: Algo,
    ) -> Result<Mesh, ProgramError> {
        let dims = order
            .iter()
            .map(|name| {
                let group = device_mesh
                    .group(pod, &[name])
                    .map_err(|e| ProgramError::Invalid(e.to_string()))?;
                Ok(MeshDim {
                    name: name.to_string(),
                    group,
                    size: group.size(pod) as usize,
                })
            })
            .collect::<Result<_, ProgramError>>()?;
        Ok(Mesh {
            dims,
            algo,
            verify: false,
            dtype: DType::F32,
        })
    }

    /// The same mesh with debug fingerprint checks on every collective.
    pub fn verified(self, verify: bool) -> Mesh {
        Mesh { verify, ..self }
    }

    /// Collectives move elements of `dtype` (bf16 halves the bytes; meta mode only).
    pub fn with_dtype(self, dtype: DType) -> Mesh {
        Mesh { dtype, ..self }
    }

    pub fn ndim(&self) -> usize {
        self.dims.len()
    }

    pub fn dims(&self) -> &[MeshDim] {
        &self.dims
    }

    pub fn dim(&self, name: &str) -> Option<usize> {
        self.dims.iter().position(|d| d.name == name)
    }

    /// How the collectives of mesh dimension `i` run.
    pub fn comm(&self, i: usize) -> Comm {
        let mut comm = Comm::new(self.dims[i].group, self.algo).verified(self.verify);
        comm.dtype = self.dtype;
        comm
    }

    /// `chip`'s coordinate along every mesh dimension.
    pub fn coords(&self, chip: &Chip) -> Vec<usize> {
        self.dims
            .iter()
            .map(|d| d.group.rank_of(chip.pod(), chip.id()) as usize)
            .collect()
    }
}

/// The extent of every tensor dimension on a chip at `coords`, after the placements of mesh
/// dimensions `0..upto` are applied (shards nest left to right).
fn extent(
    shape: &[usize],
    mesh: &Mesh,
    placements: &[Placement],
    coords: &[usize],
    upto: usize,
) -> Vec<usize> {
    let mut s = shape.to_vec();
    for i in 0..upto {
        if let Placement::Shard(d) = placements[i] {
            s[d] = chunk_len(s[d], mesh.dims[i].size, coords[i]);
        }
    }
    s
}

/// A tensor distributed over a mesh: this chip's piece and how the pieces make the whole.
#[derive(Debug, Clone, PartialEq)]
pub struct DTensor {
    mesh: Mesh,
    placements: Vec<Placement>,
    shape: Vec<usize>,
    local: Tensor,
}

impl DTensor {
    fn check_placements(
        mesh: &Mesh,
        placements: &[Placement],
        ndim: usize,
    ) -> Result<(), ProgramError> {
        if placements.len() != mesh.ndim() {
            return Err(ProgramError::Invalid(format!(
                "{} placements for a mesh of {} dimensions",
                placements.len(),
                mesh.ndim()
            )));
        }
        if let Some(p) = placements
            .iter()
            .find(|p| matches!(p, Placement::Shard(d) if *d >= ndim))
        {
            return Err(ProgramError::Invalid(format!(
                "{p} of a {ndim}-dimensional tensor"
            )));
        }
        Ok(())
    }

    /// Wraps this chip's piece of a global tensor of `shape`.
    pub fn from_local(
        chip: &Chip,
        mesh: &Mesh,
        local: Tensor,
        placements: &[Placement],
        shape: &[usize],
    ) -> Result<DTensor, ProgramError> {
        DTensor::check_placements(mesh, placements, shape.len())?;
        let want = extent(shape, mesh, placements, &mesh.coords(chip), mesh.ndim());
        if local.shape() != want.as_slice() {
            return Err(ProgramError::Invalid(format!(
                "chip {}: a local piece of shape {:?} does not fit {shape:?} placed as {}; expected {want:?}",
                chip.id(),
                local.shape(),
                describe(placements)
            )));
        }
        Ok(DTensor {
            mesh: mesh.clone(),
            placements: placements.to_vec(),
            shape: shape.to_vec(),
            local,
        })
    }

    /// Distributes `full` (the same on every chip) without communication: shards are cut
    /// locally, `Partial(sum)` keeps the value on coordinate 0 and zeros elsewhere (exact),
    /// other partial ops keep it everywhere.
    pub fn distribute(
        chip: &Chip,
        mesh: &Mesh,
        full: &Tensor,
        placements: &[Placement],
    ) -> Result<DTensor, ProgramError> {
        DTensor::check_placements(mesh, placements, full.shape().len())?;
        let replicated = DTensor {
            mesh: mesh.clone(),
            placements: vec![Placement::Replicate; mesh.ndim()],
            shape: full.shape().to_vec(),
            local: full.clone(),
        };
        replicated.place_locally(chip, placements)
    }

    pub fn local(&self) -> &Tensor {
        &self.local
    }

    pub fn local_mut(&mut self) -> &mut Tensor {
        &mut self.local
    }

    pub fn into_local(self) -> Tensor {
        self.local
    }

    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The same distribution with another local piece (e.g. a gradient of this parameter).
    pub fn with_local(&self, local: Tensor, placements: &[Placement]) -> DTensor {
        DTensor {
            mesh: self.mesh.clone(),
            placements: placements.to_vec(),
            shape: self.shape.clone(),
            local,
        }
    }

    /// The same tensor, its collectives moving elements of `dtype` (a gradient reduced in
    /// another dtype than it was computed in; bytes differ in meta mode only).
    pub fn in_dtype(self, dtype: DType) -> DTensor {
        DTensor {
            mesh: self.mesh.with_dtype(dtype),
            ..self
        }
    }

    /// The whole tensor on every chip.
    pub async fn full_tensor(&self, chip: &mut Chip) -> Result<Tensor, ProgramError> {
        let all = vec![Placement::Replicate; self.mesh.ndim()];
        Ok(self.redistribute(chip, &all).await?.local)
    }

    /// The same global tensor placed as `target`.
    pub async fn redistribute(
        &self,
        chip: &mut Chip,
        target: &[Placement],
    ) -> Result<DTensor, ProgramError> {
        DTensor::check_placements(&self.mesh, target, self.shape.len())?;
        let n = self.mesh.ndim();
        let mut cur = self.clone();
        // Mesh dimensions whose placement must be undone: those that change, and shards nested
        // inside (to the right of) a changing dimension that cuts the same tensor dimension.
        let mut leave: Vec<bool> = (0..n).map(|i| cur.placements[i] != target[i]).collect();
        loop {
            let mut changed = false;
            for j in 0..n {
                if let (false, Placement::Shard(d)) = (leave[j], cur.placements[j]) {
                    let nested = (0..j).any(|k| {
                        leave[k]
                            && (cur.placements[k] == Placement::Shard(d)
                                || target[k] == Placement::Shard(d))
                    });
                    if nested {
                        leave[j] = true;
                        changed = true;
                    }
                }
            }
            if !changed {
                break;
            }
        }
        // Innermost first: collectives that gather or reduce.
        for i in (0..n).rev() {
            if !leave[i] {
                continue;
            }
            // One collective along mesh dimension `i` is enough when no inner dimension
            // shards the same tensor dimensions and no outer one that does is changing (an
            // unchanged outer shard only narrows the extent the collective works on).
            let direct = |dims: &[usize]| {
                (0..n).filter(|&k| k != i).all(|k| {
                    dims.iter().all(|&d| {
                        let shards = cur.placements[k] == Placement::Shard(d)
                            || target[k] == Placement::Shard(d);
                        !shards || (k < i && cur.placements[k] == target[k])
                    })
                })
            };
            cur = match (cur.placements[i], target[i]) {
                (Placement::Shard(d), Placement::Shard(e)) if d != e && direct(&[d, e]) => {
                    cur.all_to_all(chip, i, e).await?
                }
                (Placement::Shard(_), _) => gather_shards(chip, &[&cur], i).await?.remove(0),
                (Placement::Partial(op), Placement::Shard(d)) if direct(&[d]) => {
                    reduce_scatter(chip, &[&cur], i, op, d).await?.remove(0)
                }
                (Placement::Partial(op), _) => all_reduce(chip, vec![cur], i, op).await?.remove(0),
                (Placement::Replicate, _) => cur,
            };
        }
        // Outermost first: local cuts and partitions.
        cur.place_locally(chip, target)
    }

    /// Applies `target` on every mesh dimension where this tensor is replicated (no
    /// communication); other dimensions must already match.
    fn place_locally(mut self, chip: &Chip, target: &[Placement]) -> Result<DTensor, ProgramError> {
        let coords = self.mesh.coords(chip);
        for i in 0..self.mesh.ndim() {
            match (self.placements[i], target[i]) {
                (a, b) if a == b => {}
                (Placement::Replicate, Placement::Shard(d)) => {
                    self.local = self.local.chunk(d, self.mesh.dims[i].size, coords[i]);
                }
                (Placement::Replicate, Placement::Partial(op)) => {
                    if op == ReduceOp::Sum && coords[i] != 0 {
                        self.local = Tensor::zeros(self.local.shape(), self.local.is_meta());
                    }
                }
                (from, to) => {
                    return Err(ProgramError::Internal(format!(
                        "mesh dimension {i}: {from} -> {to} left for a local step"
                    )));
                }
            }
            self.placements[i] = target[i];
        }
        Ok(self)
    }

    /// Shard(d) -> Shard(e) along mesh dimension `i`: every chip sends piece `j` of its
    /// dimension `e` to coordinate `j` and concatenates what it gets along `d`.
    async fn all_to_all(
        self,
        chip: &mut Chip,
        i: usize,
        e: usize,
    ) -> Result<DTensor, ProgramError> {
        let Placement::Shard(d) = self.placements[i] else {
            return Err(ProgramError::Internal(
                "all-to-all of a tensor that is not sharded".into(),
            ));
        };
        let n = self.mesh.dims[i].size;
        let coords = self.mesh.coords(chip);
        let before = extent(&self.shape, &self.mesh, &self.placements, &coords, i);
        let (td, te) = (before[d], before[e]);
        let (cd, ce) = (td.div_ceil(n), te.div_ceil(n));
        // Pad d to the common piece size so every chip sends blocks of one length.
        let input = self.local.pad(d, cd).blocks(e, n);
        let out = chip.all_to_all(&self.mesh.comm(i), &input).await?;
        let mut block_shape = self.local.shape().to_vec();
        block_shape[d] = cd;
        block_shape[e] = ce;
        let me = coords[i];
        let pieces = out
            .split_even(n)
            .into_iter()
            .enumerate()
            .map(|(src, block)| {
                let t = Tensor::from_blocks(block, e, &block_shape)?;
                Ok(t.narrow(d, 0, chunk_len(td, n, src))
                    .narrow(e, 0, chunk_len(te, n, me)))
            })
            .collect::<Result<Vec<_>, ProgramError>>()?;
        let mut placements = self.placements.clone();
        placements[i] = Placement::Shard(e);
        Ok(self.with_local(Tensor::cat(d, &pieces)?, &placements))
    }
}

fn describe(placements: &[Placement]) -> String {
    let parts: Vec<String> = placements.iter().map(|p| p.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// Checks that every item is on the same mesh with `want` at mesh dimension `i`.
fn expect_at(
    items: &[&DTensor],
    i: usize,
    want: impl Fn(Placement) -> bool,
    what: &str,
) -> Result<(), ProgramError> {
    for t in items {
        if i >= t.mesh.ndim() || !want(t.placements[i]) {
            return Err(ProgramError::Internal(format!(
                "{what} on mesh dimension {i} of a tensor placed as {}",
                describe(&t.placements)
            )));
        }
    }
    Ok(())
}

/// Shard -> Replicate along mesh dimension `i` for several tensors in one all-gather (FSDP's
/// per-layer unshard; one tensor is DTensor's plain all-gather). Each piece is zero-padded to
/// the common size, the concatenation of all pieces is gathered, and each tensor is rebuilt
/// from its rank-ordered pieces.
pub async fn gather_shards(
    chip: &mut Chip,
    items: &[&DTensor],
    i: usize,
) -> Result<Vec<DTensor>, ProgramError> {
    expect_at(items, i, |p| matches!(p, Placement::Shard(_)), "all-gather")?;
    let Some(first) = items.first() else {
        return Ok(Vec::new());
    };
    let mesh = &first.mesh;
    let n = mesh.dims[i].size;
    let coords = mesh.coords(chip);
    let mut plans = Vec::with_capacity(items.len());
    let mut parts = Vec::with_capacity(items.len());
    for t in items {
        let Placement::Shard(d) = t.placements[i] else {
            unreachable_shard()?
        };
        let whole = extent(&t.shape, mesh, &t.placements, &coords, i)[d];
        let piece = whole.div_ceil(n);
        let payload = t.local.pad(d, piece).blocks(d, 1);
        let mut padded_shape = t.local.shape().to_vec();
        padded_shape[d] = piece;
        plans.push((d, whole, payload.len(), padded_shape));
        parts.push(payload);
    }
    let per_rank: usize = plans.iter().map(|p| p.2).sum();
    let gathered = chip
        .all_gather(&mesh.comm(i), &Payload::concat(parts))
        .await?;
    let mut out = Vec::with_capacity(items.len());
    let mut offset = 0;
    for (t, (d, whole, len, padded_shape)) in items.iter().zip(plans) {
        let mut placements = t.placements.clone();
        placements[i] = Placement::Replicate;
        if gathered.is_meta() {
            // Shapes only: the pieces' lengths add up to the whole dimension. (Building `n`
            // meta pieces to concatenate them costs O(n) per tensor: minutes at 100k chips.)
            let mut shape = padded_shape;
            shape[d] = whole;
            out.push(t.with_local(Tensor::Meta(shape), &placements));
            continue;
        }
        let pieces = (0..n)
            .map(|r| {
                let block = gathered.slice(r * per_rank + offset, len);
                Ok(Tensor::from_blocks(block, d, &padded_shape)?.narrow(
                    d,
                    0,
                    chunk_len(whole, n, r),
                ))
            })
            .collect::<Result<Vec<_>, ProgramError>>()?;
        offset += len;
        out.push(t.with_local(Tensor::cat(d, &pieces)?, &placements));
    }
    Ok(out)
}

fn unreachable_shard<T>() -> Result<T, ProgramError> {
    Err(ProgramError::Internal(
        "placement changed under a collective".into(),
    ))
}

/// Partial(op) -> Shard(d) along mesh dimension `i` for several tensors in one reduce-scatter
/// (FSDP's gradient reduction): block `r` of the input is piece `r` of every tensor.
pub async fn reduce_scatter(
    chip: &mut Chip,
    items: &[&DTensor],
    i: usize,
    op: ReduceOp,
    d: usize,
) -> Result<Vec<DTensor>, ProgramError> {
    expect_at(items, i, |p| p == Placement::Partial(op), "reduce-scatter")?;
    let Some(first) = items.first() else {
        return Ok(Vec::new());
    };
    let mesh = &first.mesh;
    let n = mesh.dims[i].size;
    let me = mesh.coords(chip)[i];
    let (input, lens) = if items.iter().all(|t| t.local.is_meta()) {
        // Shapes only: `n` blocks of the summed piece lengths, without materialising `n`
        // pieces per tensor (O(n) each: minutes at 100k chips).
        let lens: Vec<usize> = items
            .iter()
            .map(|t| t.local.blocks(d, n).len() / n)
            .collect();
        (Payload::Meta(n * lens.iter().sum::<usize>()), lens)
    } else {
        let blocks: Vec<Vec<Payload>> = items
            .iter()
            .map(|t| t.local.blocks(d, n).split_even(n))
            .collect();
        let lens: Vec<usize> = blocks.iter().map(|b| b[0].len()).collect();
        let input = Payload::concat((0..n).flat_map(|r| blocks.iter().map(move |b| b[r].clone())));
        (input, lens)
    };
    let mine = chip.reduce_scatter(&mesh.comm(i), &input, op).await?;
    let mut out = Vec::with_capacity(items.len());
    let mut offset = 0;
    for (t, len) in items.iter().zip(lens) {
        let whole = t.local.shape()[d];
        let mut shape = t.local.shape().to_vec();
        shape[d] = whole.div_ceil(n);
        let piece = Tensor::from_blocks(mine.slice(offset, len), d, &shape)?.narrow(
            d,
            0,
            chunk_len(whole, n, me),
        );
        offset += len;
        let mut placements = t.placements.clone();
        placements[i] = Placement::Shard(d);
        out.push(t.with_local(piece, &placements));
    }
    Ok(out)
}

/// Partial(op) -> Replicate along mesh dimension `i` for several tensors in one all-reduce
/// (a DDP bucket; one tensor is DTensor's plain all-reduce).
pub async fn all_reduce(
    chip: &mut Chip,
    items: Vec<DTensor>,
    i: usize,
    op: ReduceOp,
) -> Result<Vec<DTensor>, ProgramError> {
    let (pieces, shells) = all_reduce_bucket(chip, items, i, op).await?;
    pieces
        .into_iter()
        .zip(shells)
        .map(|(piece, (mesh, placements, shape, local_shape))| {
            Ok(DTensor {
                mesh,
                placements,
                shape,
                local: Tensor::from_payload(piece, &local_shape)?,
            })
        })
        .collect()
}

/// [`all_reduce`] that leaves each tensor's reduced local values where the collective put
/// them (pieces of its own block and of received buffers), for a reader that takes them run
/// by run (the optimizer): making each a contiguous tensor would copy every value.
pub async fn all_reduce_in_place(
    chip: &mut Chip,
    items: Vec<DTensor>,
    i: usize,
    op: ReduceOp,
) -> Result<Vec<Payload>, ProgramError> {
    Ok(all_reduce_bucket(chip, items, i, op).await?.0)
}

/// What a reduced tensor is rebuilt from: its mesh, placements, global and local shapes.
type Shell = (Mesh, Vec<Placement>, Vec<usize>, Vec<usize>);

/// The one all-reduce of a bucket: each tensor's reduced local values and its shell.
async fn all_reduce_bucket(
    chip: &mut Chip,
    items: Vec<DTensor>,
    i: usize,
    op: ReduceOp,
) -> Result<(Vec<Payload>, Vec<Shell>), ProgramError> {
    let refs: Vec<&DTensor> = items.iter().collect();
    expect_at(&refs, i, |p| p == Placement::Partial(op), "all-reduce")?;
    let Some(first) = items.first() else {
        return Ok((Vec::new(), Vec::new()));
    };
    let comm = first.mesh.comm(i);
    // The inputs are the caller's to give up: their buffers become the collective's input
    // without a copy; each keeps its mesh, placements and shapes to be rebuilt from.
    let mut parts = Vec::with_capacity(items.len());
    let mut shells = Vec::with_capacity(items.len());
    for t in items {
        let local_shape = t.local.shape().to_vec();
        parts.push(t.local.into_payload());
        let mut placements = t.placements;
        placements[i] = Placement::Replicate;
        shells.push((t.mesh, placements, t.shape, local_shape));
    }
    let reduced = chip.all_reduce(&comm, &Payload::concat(parts), op).await?;
    let mut offset = 0;
    let pieces = shells
        .iter()
        .map(|(_, _, _, local_shape)| {
            let len: usize = local_shape.iter().product();
            offset += len;
            reduced.slice(offset - len, len)
        })
        .collect();
    Ok((pieces, shells))
}

/// Where `chip`'s piece of dimension `d` starts in the global tensor, for row-sliced
/// references (nested shards of the same dimension compose).
pub fn local_offset(chip: &Chip, t: &DTensor, d: usize) -> usize {
    let coords = t.mesh.coords(chip);
    let mut size = t.shape[d];
    let mut start = 0;
    for (i, p) in t.placements.iter().enumerate() {
        if *p == Placement::Shard(d) {
            let n = t.mesh.dims[i].size;
            start += chunk_start(size, n, coords[i]);
            size = chunk_len(size, n, coords[i]);
        }
    }
    start
}
