//! Device meshes: named logical axes (`dp = 8, tp = 4`) laid onto pod axes. Each mesh axis is
//! the product of pod axes or parts of them; the chips along a mesh axis form a [`Group`].
//!
//! Automatic mapping follows the usual TPU convention: the last mesh axis is the one that
//! communicates most (tensor parallel), the first the one that communicates least (data
//! parallel across DCN slices). Two layouts, in this order of preference:
//! - *Whole axes* (`whole_axes`), as JAX's `mesh_utils.create_device_mesh` lays a mesh on a
//!   TPU torus: from the last mesh axis to the first, each takes the largest set of whole
//!   torus axes not yet taken whose product is its size (`tp = 8` on 4x4x8 is z, a ring with
//!   its wraparound link); the first mesh axis takes what is left, DCN slices included.
//! - *Device order*, when some mesh axis is not a product of whole axes: the mesh is a
//!   reshape of the device list (x fastest). The first mesh axis takes the outermost pod axes
//!   (DCN slices, then z, y) and the last the innermost (x); a mesh axis that needs only a
//!   factor of the next torus axis takes its high part (every `stride`-th chip: `dp = 32` on
//!   8x8x8 is z and every second y) and leaves the low part (a contiguous segment: two
//!   neighbours of y) to the next mesh axis. The DCN axis is never split.

use serde::{Deserialize, Serialize};

use crate::TopologyError;
use crate::group::{AxisPart, Group, PodAxis};
use crate::pod::{ChipId, Pod};

/// One named mesh axis and the pod axes it spans.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshAxis {
    pub name: String,
    pub size: u32,
    /// Outermost first.
    pub pod_axes: Vec<AxisPart>,
}

/// A device mesh over a whole pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMesh {
    axes: Vec<MeshAxis>,
}

/// What is wrong with a mesh's axes on their own (a size of 0, a name used twice), if
/// anything.
fn malformed(axes: &[(&str, u32)]) -> Option<String> {
    for (i, &(name, size)) in axes.iter().enumerate() {
        if size == 0 {
            return Some(format!("axis {name} has size 0"));
        }
        if axes[..i].iter().any(|(n, _)| *n == name) {
            return Some(format!("axis name {name} is used twice"));
        }
    }
    None
}

impl DeviceMesh {
    /// Lays `axes` (name, size), outermost first, onto the pod's axes.
    pub fn new(pod: &Pod, axes: &[(&str, u32)]) -> Result<DeviceMesh, TopologyError> {
        let describe = || {
            axes.iter()
                .map(|(n, s)| format!("{n}={s}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let err = |reason: String| TopologyError::Mesh {
            mesh: describe(),
            reason,
        };
        if let Some(why) = malformed(axes) {
            return Err(err(why));
        }
        if let Some(axes) = whole_axes(pod, axes) {
            return Ok(DeviceMesh { axes });
        }
        let mut outermost_first: Vec<AxisPart> = Group::world(pod).parts(pod);
        outermost_first.reverse();
        let mut next = outermost_first.into_iter().peekable();
        let mut mesh = Vec::with_capacity(axes.len());
        for &(name, size) in axes {
            let not_a_product = || {
                err(format!(
                    "axis {name}={size} is not a product of pod axes or of factors of them \
                     (torus {}, {} slices); the mesh does not factor the pod",
                    pod.torus(),
                    pod.slices()
                ))
            };
            let mut pod_axes = Vec::new();
            let mut product = 1u32;
            while product < size {
                let Some(part) = next.next() else { break };
                let need = size / product;
                if size % product != 0 {
                    return Err(not_a_product());
                }
                if part.extent <= need {
                    product *= part.extent;
                    pod_axes.push(part);
                } else if part.extent % need == 0 && part.axis != PodAxis::Slices {
                    // Take the high part, leave the low part for the next mesh axis.
                    let low = part.extent / need;
                    pod_axes.push(AxisPart {
                        axis: part.axis,
                        stride: part.stride * low,
                        extent: need,
                    });
                    product *= need;
                    let mut rest = vec![AxisPart {
                        extent: low,
                        ..part
                    }];
                    rest.extend(next);
                    next = rest.into_iter().peekable();
                } else {
                    return Err(not_a_product());
                }
            }
            if product != size {
                return Err(not_a_product());
            }
            mesh.push(MeshAxis {
                name: name.to_string(),
                size,
                pod_axes,
            });
        }
        if let Some(left) = next.next() {
            return Err(err(format!(
                "the mesh has {} chips but the pod has {}; pod axis {left} is not covered",
                axes.iter().map(|(_, s)| u64::from(*s)).product::<u64>(),
                pod.chips()
            )));
        }
        Ok(DeviceMesh { axes: mesh })
    }

    pub fn axes(&self) -> &[MeshAxis] {
        &self.axes
    }

    pub fn axis(&self, name: &str) -> Option<&MeshAxis> {
        self.axes.iter().find(|a| a.name == name)
    }

    /// The group of chips along the named mesh axes (their product).
    pub fn group(&self, pod: &Pod, names: &[&str]) -> Result<Group, TopologyError> {
        let mut g = Group::default();
        for name in names {
            let axis = self.axis(name).ok_or_else(|| TopologyError::Mesh {
                mesh: self.describe(),
                reason: format!("no axis named {name}"),
            })?;
            for &part in &axis.pod_axes {
                g = g
                    .with_part(part, pod)
                    .map_err(|reason| TopologyError::Mesh {
                        mesh: self.describe(),
                        reason,
                    })?;
            }
        }
        Ok(g)
    }

    /// `chip`'s coordinate along the named mesh axis (its rank in that axis's group).
    pub fn coord(&self, pod: &Pod, chip: ChipId, name: &str) -> Result<u32, TopologyError> {
        Ok(self.group(pod, &[name])?.rank_of(pod, chip))
    }

    pub fn describe(&self) -> String {
        self.axes
            .iter()
            .map(|a| format!("{}={}", a.name, a.size))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The whole-axes layout (see the module docs), or `None` when some mesh axis other than the
/// first is not the product of whole torus axes left to it. `axes` are checked (named once,
/// no size 0) and their product need not be the pod's: the first mesh axis must then match
/// what is left, or the layout is `None`.
fn whole_axes(pod: &Pod, axes: &[(&str, u32)]) -> Option<Vec<MeshAxis>> {
    let (first, rest) = axes.split_first()?;
    // Pod parts in device order (x, y, z, then DCN); `None` once taken.
    let mut free: Vec<Option<AxisPart>> =
        Group::world(pod).parts(pod).into_iter().map(Some).collect();
    let mut laid: Vec<MeshAxis> = Vec::with_capacity(axes.len());
    for &(name, size) in rest.iter().rev() {
        let torus: Vec<usize> = (0..free.len())
            .filter(|&i| matches!(free[i], Some(p) if p.axis != PodAxis::Slices))
            .collect();
        let chosen = subsets_largest_first(torus.len())
            .chain([vec![]])
            .find(|subset| {
                subset
                    .iter()
                    .map(|&k| free[torus[k]].map_or(0, |p| u64::from(p.extent)))
                    .product::<u64>()
                    == u64::from(size)
            })?;
        let mut pod_axes: Vec<AxisPart> = chosen
            .iter()
            .filter_map(|&k| free[torus[k]].take())
            .collect();
        pod_axes.reverse();
        laid.push(MeshAxis {
            name: name.to_string(),
            size,
            pod_axes,
        });
    }
    let mut left: Vec<AxisPart> = free.into_iter().flatten().collect();
    if left.iter().map(|p| u64::from(p.extent)).product::<u64>() != u64::from(first.1) {
        return None;
    }
    left.reverse();
    laid.push(MeshAxis {
        name: first.0.to_string(),
        size: first.1,
        pod_axes: left,
    });
    laid.reverse();
    Some(laid)
}

/// The non-empty subsets of `0..n` (as sorted index lists), largest first and, among subsets
/// of one size, in lexicographic order (as `itertools.combinations` lists them).
fn subsets_largest_first(n: usize) -> impl Iterator<Item = Vec<usize>> {
    let mut all: Vec<Vec<usize>> = (1u32..1 << n)
        .map(|bits| (0..n).filter(|&i| bits & (1 << i) != 0).collect())
        .collect();
    all.sort_by(|a: &Vec<usize>, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
    all.into_iter()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Torus;

    #[test]
    fn maps_tp_onto_the_fastest_axis() {
        let pod = Pod::single("4x4x2".parse::<Torus>().unwrap());
        let mesh = DeviceMesh::new(&pod, &[("dp", 8), ("tp", 4)]).unwrap();
        let whole = |a| AxisPart::whole(a, &pod);
        assert_eq!(
            mesh.axis("tp").unwrap().pod_axes,
            vec![whole(PodAxis::Torus(0))]
        );
        assert_eq!(
            mesh.axis("dp").unwrap().pod_axes,
            vec![whole(PodAxis::Torus(2)), whole(PodAxis::Torus(1))]
        );
        let tp = mesh.group(&pod, &["tp"]).unwrap();
        assert_eq!(tp.members(&pod, 5), vec![4, 5, 6, 7]);
    }

    #[test]
    fn splits_an_axis_the_mesh_needs_only_a_factor_of() {
        // 16-way tensor parallelism on 8x8x8: x and the low pair of y; dp = z and every
        // second y.
        let pod = Pod::single("8x8x8".parse::<Torus>().unwrap());
        let mesh = DeviceMesh::new(&pod, &[("dp", 32), ("tp", 16)]).unwrap();
        let y = |stride, extent| AxisPart {
            axis: PodAxis::Torus(1),
            stride,
            extent,
        };
        assert_eq!(
            mesh.axis("dp").unwrap().pod_axes,
            vec![AxisPart::whole(PodAxis::Torus(2), &pod), y(2, 4)]
        );
        assert_eq!(
            mesh.axis("tp").unwrap().pod_axes,
            vec![y(1, 2), AxisPart::whole(PodAxis::Torus(0), &pod)]
        );
        let tp = mesh.group(&pod, &["tp"]).unwrap();
        let dp = mesh.group(&pod, &["dp"]).unwrap();
        assert_eq!(tp.size(&pod), 16);
        assert_eq!(dp.size(&pod), 32);
        // Chip (3, 5, 0): its tp group is y in {4, 5}, every x; its dp group is y in
        // {1, 3, 5, 7}, every z.
        let chip = pod.chip_at(0, &[3, 5, 0]);
        let tp_members = tp.members(&pod, chip);
        assert!(
            tp_members
                .iter()
                .all(|&c| [4, 5].contains(&pod.coord(c)[1]))
        );
        assert_eq!(tp_members[tp.rank_of(&pod, chip) as usize], chip);
        let dp_members = dp.members(&pod, chip);
        assert!(
            dp_members
                .iter()
                .all(|&c| pod.coord(c)[1] % 2 == 1 && pod.coord(c)[0] == 3)
        );
        assert_eq!(dp_members[dp.rank_of(&pod, chip) as usize], chip);
        // The two parts of y join back into the whole axis.
        let world = mesh.group(&pod, &["dp", "tp"]).unwrap();
        assert_eq!(world, Group::world(&pod));
        assert_ne!(tp.id(), Group::of(&[PodAxis::Torus(0)]).id());
        assert!(tp.id() < 1 << Group::ID_BITS && dp.id() < 1 << Group::ID_BITS);
    }

    #[test]
    fn lays_each_mesh_axis_on_whole_torus_axes_where_it_can() {
        // 8-way tensor parallelism on 4x4x8 is the z ring (in device order it would be x and
        // a segment of two neighbours of y); dp takes x and y.
        let pod = Pod::single("4x4x8".parse::<Torus>().unwrap());
        let whole = |a| AxisPart::whole(PodAxis::Torus(a), &pod);
        let mesh = DeviceMesh::new(&pod, &[("dp", 16), ("tp", 8)]).unwrap();
        assert_eq!(mesh.axis("tp").unwrap().pod_axes, vec![whole(2)]);
        assert_eq!(mesh.axis("dp").unwrap().pod_axes, vec![whole(1), whole(0)]);
        // The largest set of axes first: 16 is x and y, not z and a part.
        let mesh = DeviceMesh::new(&pod, &[("dp", 8), ("tp", 16)]).unwrap();
        assert_eq!(mesh.axis("tp").unwrap().pod_axes, vec![whole(1), whole(0)]);
        assert_eq!(mesh.axis("dp").unwrap().pod_axes, vec![whole(2)]);
        let tp = mesh.group(&pod, &["tp"]).unwrap();
        assert_eq!(tp.size(&pod), 16);
        assert!(tp.parts(&pod).iter().all(|p| p.wraps(&pod)));
    }

    #[test]
    fn the_first_mesh_axis_takes_the_slices_and_what_is_left() {
        let pod = Pod::new("4x4x8".parse::<Torus>().unwrap(), 2).unwrap();
        let whole = |a| AxisPart::whole(a, &pod);
        let mesh = DeviceMesh::new(&pod, &[("replicate", 2), ("dp", 16), ("tp", 8)]).unwrap();
        assert_eq!(
            mesh.axis("replicate").unwrap().pod_axes,
            vec![whole(PodAxis::Slices)]
        );
        assert_eq!(
            mesh.axis("tp").unwrap().pod_axes,
            vec![whole(PodAxis::Torus(2))]
        );
        // An axis of one chip spans no pod axis.
        let mesh = DeviceMesh::new(&pod, &[("dp", 256), ("tp", 1)]).unwrap();
        assert!(mesh.axis("tp").unwrap().pod_axes.is_empty());
        assert_eq!(mesh.group(&pod, &["dp"]).unwrap(), Group::world(&pod));
        // Tensor parallelism never crosses DCN: 2-way tp has no whole torus axis here, so
        // the mesh falls back to device order (a pair of x neighbours).
        let mesh = DeviceMesh::new(&pod, &[("dp", 128), ("tp", 2)]).unwrap();
        let tp = mesh.axis("tp").unwrap().pod_axes.clone();
        assert_eq!(tp.len(), 1);
        assert_eq!(tp[0].axis, PodAxis::Torus(0));
    }

    #[test]
    fn rejects_meshes_that_do_not_factor() {
        let pod = Pod::single("4x4x2".parse::<Torus>().unwrap());
        assert!(DeviceMesh::new(&pod, &[("dp", 3), ("tp", 4)]).is_err());
        assert!(DeviceMesh::new(&pod, &[("dp", 4), ("tp", 4)]).is_err());
        assert!(DeviceMesh::new(&pod, &[("dp", 0)]).is_err());
        assert!(DeviceMesh::new(&pod, &[("a", 32), ("a", 1)]).is_err());
    }
}
