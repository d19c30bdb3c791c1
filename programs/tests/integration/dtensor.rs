#![allow(clippy::unwrap_used)]
//! DTensor redistribution: every transition between placements on 1D and 2D meshes, even
//! and uneven shapes, gives back the original tensor, and lands each chip on exactly the piece
//! that distributing the original directly would give it.

use crate::common::run_on_chips;
use podsim_collectives::{Algo, LocalFabric, ReduceOp};
use podsim_programs::ProgramError;
use podsim_programs::train::{DTensor, Mesh, Placement, Tensor};
use podsim_topology::{Hardware, Pod};
use proptest::prelude::*;

fn tensor(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    // Distinct, exactly representable values (sums of a few stay exact).
    Tensor::from_vec(shape, (0..n).map(|v| v as f32 * 0.5 - 3.0).collect()).unwrap()
}

fn options(ndim: usize) -> Vec<Placement> {
    let mut v: Vec<Placement> = (0..ndim).map(Placement::Shard).collect();
    v.extend([
        Placement::Replicate,
        Placement::Partial(ReduceOp::Sum),
        Placement::Partial(ReduceOp::Max),
    ]);
    v
}

/// Every placement list for a mesh of `dims` dimensions.
fn all_placements(ndim: usize, dims: usize) -> Vec<Vec<Placement>> {
    let mut out = vec![vec![]];
    for _ in 0..dims {
        out = out
            .into_iter()
            .flat_map(|p| {
                options(ndim).into_iter().map(move |o| {
                    let mut q = p.clone();
                    q.push(o);
                    q
                })
            })
            .collect();
    }
    out
}

/// On every chip: distribute `full` as `chain[0]`, redistribute through the rest, then check
/// the pieces and the whole.
fn check_chain(axes: &[(&'static str, u32)], shape: &[usize], chains: Vec<Vec<Vec<Placement>>>) {
    let pod = Pod::single("2x2x2".parse().unwrap());
    let mesh = Mesh::new(&pod, axes, Algo::Torus).unwrap();
    let fabric = LocalFabric::new(pod, Hardware::preset("v5p").unwrap());
    let full = tensor(shape);
    run_on_chips(fabric.chips(), move |mut chip| {
        let (mesh, full, chains) = (mesh.clone(), full.clone(), chains.clone());
        async move {
            for chain in &chains {
                let mut dt = DTensor::distribute(&chip, &mesh, &full, &chain[0])?;
                for target in &chain[1..] {
                    dt = dt.redistribute(&mut chip, target).await?;
                    assert_eq!(dt.placements(), target.as_slice());
                    if !target.iter().any(|p| matches!(p, Placement::Partial(_))) {
                        let direct = DTensor::distribute(&chip, &mesh, &full, target)?;
                        assert_eq!(dt.local(), direct.local(), "chip {} {chain:?}", chip.id());
                    }
                }
                let back = dt.full_tensor(&mut chip).await?;
                assert_eq!(back, full, "chip {} chain {chain:?}", chip.id());
            }
            Ok::<_, ProgramError>(())
        }
    })
    .unwrap();
}

fn every_pair(axes: &[(&'static str, u32)], shape: &[usize]) {
    let all = all_placements(shape.len(), axes.len());
    let pairs: Vec<Vec<Vec<Placement>>> = all
        .iter()
        .flat_map(|a| all.iter().map(move |b| vec![a.clone(), b.clone()]))
        .collect();
    check_chain(axes, shape, pairs);
}

#[test]
fn every_transition_on_a_1d_mesh() {
    every_pair(&[("dp", 8)], &[16, 4]); // even
    every_pair(&[("dp", 8)], &[5, 3]); // uneven: empty pieces
    every_pair(&[("dp", 8)], &[3, 10, 2]);
}

#[test]
fn every_transition_on_a_2d_mesh() {
    every_pair(&[("dp", 2), ("tp", 4)], &[8, 12]);
    every_pair(&[("dp", 2), ("tp", 4)], &[7, 5]);
    every_pair(&[("a", 4), ("b", 2)], &[6, 3, 3]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn any_chain_of_redistributions_keeps_the_tensor(
        rows in 1usize..11,
        cols in 1usize..7,
        picks in proptest::collection::vec(0usize..25, 2..6),
        mesh_2d in any::<bool>(),
    ) {
        let all = all_placements(2, 2);
        let chain: Vec<Vec<Placement>> = picks.iter().map(|&i| all[i % all.len()].clone()).collect();
        let axes: &[(&'static str, u32)] = if mesh_2d { &[("dp", 4), ("tp", 2)] } else { &[("x", 2), ("y", 4)] };
        check_chain(axes, &[rows, cols], vec![chain]);
    }
}
