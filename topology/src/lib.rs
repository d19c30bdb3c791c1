//! Pure topology for podsim: no I/O, no processes, no sockets.
//!
//! - [`Torus`]: one slice's shape (1-3 axes, wraparound per axis), ranks <-> coordinates,
//!   neighbours and rings.
//! - [`Pod`] and [`Link`]: several slices joined by DCN, global chip ids, directed links.
//! - [`Hardware`]: presets (v4, v5e, v5p, v6e, tpu7x) and overrides for the virtual-time model.
//! - [`Placement`]: chips onto worker processes, minimising links that cross workers.
//! - [`Group`], [`DeviceMesh`]: which chips a collective spans; named mesh axes.
#![forbid(unsafe_code)]

mod error;
mod group;
mod hardware;
mod mesh;
mod placement;
mod pod;
mod torus;

pub use error::TopologyError;
pub use group::{AxisPart, Group, PodAxis};
pub use hardware::{HARDWARE_KEYS, Hardware, HardwareOverrides, PRESETS};
pub use mesh::{DeviceMesh, MeshAxis};
pub use placement::Placement;
pub use pod::{ChipId, Link, Path, Pod, Route};
pub use torus::{Coord, Dir, MAX_AXES, MAX_CHIPS, Torus};
