//! Device meshes: named logical axes (`dp = 8, tp = 4`) laid onto pod axes. Each mesh axis is
//! the product of one or more whole pod axes; the chips along a mesh axis form a [`Group`].
//!
//! Automatic mapping follows the usual TPU convention: the first mesh axis takes the outermost
//! pod axes (DCN slices, then z, y) and the last takes the innermost (x), so that the axis
//! that communicates most (tensor parallel, listed last) rides the ICI links.

use serde::{Deserialize, Serialize};

use crate::TopologyError;
use crate::group::{Group, PodAxis};
use crate::pod::{ChipId, Pod};

/// One named mesh axis and the pod axes it spans.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshAxis {
    pub name: String,
    pub size: u32,
    pub pod_axes: Vec<PodAxis>,
}

/// A device mesh over a whole pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMesh {
    axes: Vec<MeshAxis>,
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
        let mut outermost_first: Vec<PodAxis> = Group::world(pod).axes(pod);
        outermost_first.reverse();
        let mut next = outermost_first.into_iter().peekable();
        let mut mesh = Vec::with_capacity(axes.len());
        for (i, &(name, size)) in axes.iter().enumerate() {
            if size == 0 {
                return Err(err(format!("axis {name} has size 0")));
            }
            if axes[..i].iter().any(|(n, _)| *n == name) {
                return Err(err(format!("axis name {name} is used twice")));
            }
            let mut pod_axes = Vec::new();
            let mut product = 1u64;
            while product < u64::from(size) {
                let Some(a) = next.next() else { break };
                product *= u64::from(a.size(pod));
                pod_axes.push(a);
            }
            if product != u64::from(size) {
                return Err(err(format!(
                    "axis {name}={size} is not a product of whole pod axes (torus {}, {} slices); \
                     the mesh does not factor the pod",
                    pod.torus(),
                    pod.slices()
                )));
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
    pub fn group(&self, names: &[&str]) -> Result<Group, TopologyError> {
        let mut g = Group::of(&[]);
        for name in names {
            let axis = self.axis(name).ok_or_else(|| TopologyError::Mesh {
                mesh: self.describe(),
                reason: format!("no axis named {name}"),
            })?;
            for &a in &axis.pod_axes {
                g = g.with(a);
            }
        }
        Ok(g)
    }

    /// `chip`'s coordinate along the named mesh axis (its rank in that axis's group).
    pub fn coord(&self, pod: &Pod, chip: ChipId, name: &str) -> Result<u32, TopologyError> {
        Ok(self.group(&[name])?.rank_of(pod, chip))
    }

    pub fn describe(&self) -> String {
        self.axes
            .iter()
            .map(|a| format!("{}={}", a.name, a.size))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Torus;

    #[test]
    fn maps_tp_onto_the_fastest_axis() {
        let pod = Pod::single("4x4x2".parse::<Torus>().unwrap());
        let mesh = DeviceMesh::new(&pod, &[("dp", 8), ("tp", 4)]).unwrap();
        assert_eq!(mesh.axis("tp").unwrap().pod_axes, vec![PodAxis::Torus(0)]);
        assert_eq!(
            mesh.axis("dp").unwrap().pod_axes,
            vec![PodAxis::Torus(2), PodAxis::Torus(1)]
        );
        let tp = mesh.group(&["tp"]).unwrap();
        assert_eq!(tp.members(&pod, 5), vec![4, 5, 6, 7]);
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
