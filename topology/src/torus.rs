//! One slice's ICI torus: its shape, the bijection between ranks and coordinates, neighbours
//! across each link and the ring through a chip along an axis.
//!
//! Ranks are row-major with axis 0 varying fastest: `rank = x + X * (y + Y * z)`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::TopologyError;

/// Most axes a torus can have.
pub const MAX_AXES: usize = 3;
/// Largest pod podsim accepts (chips over all slices); far above the 100k-chip target.
pub const MAX_CHIPS: u64 = 1 << 24;

/// Direction along an axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Dir {
    Plus,
    Minus,
}

impl Dir {
    pub fn flip(self) -> Dir {
        match self {
            Dir::Plus => Dir::Minus,
            Dir::Minus => Dir::Plus,
        }
    }
    pub fn index(self) -> usize {
        match self {
            Dir::Plus => 0,
            Dir::Minus => 1,
        }
    }
    pub fn sign(self) -> char {
        match self {
            Dir::Plus => '+',
            Dir::Minus => '-',
        }
    }
}

/// Coordinates of a chip inside its slice; unused axes are 0.
pub type Coord = [u32; MAX_AXES];

/// The shape of one slice: 1 to 3 axes, each of size >= 1, each with or without wraparound.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Torus {
    dims: Vec<u32>,
    wrap: Vec<bool>,
}

impl Torus {
    /// A torus with wraparound on every axis.
    pub fn new(dims: &[u32]) -> Result<Torus, TopologyError> {
        Torus::with_wrap(dims, &vec![true; dims.len()])
    }

    /// A torus with wraparound chosen per axis (`false` makes that axis a line).
    pub fn with_wrap(dims: &[u32], wrap: &[bool]) -> Result<Torus, TopologyError> {
        if dims.is_empty() || dims.len() > MAX_AXES {
            return Err(TopologyError::AxisCount(dims.len()));
        }
        if wrap.len() != dims.len() {
            return Err(TopologyError::WrapLength {
                given: wrap.len(),
                axes: dims.len(),
            });
        }
        if let Some(axis) = dims.iter().position(|&d| d == 0) {
            return Err(TopologyError::ZeroAxis { axis });
        }
        let chips: u64 = dims.iter().map(|&d| u64::from(d)).product();
        if chips > MAX_CHIPS {
            return Err(TopologyError::TooManyChips {
                chips,
                max: MAX_CHIPS,
            });
        }
        Ok(Torus {
            dims: dims.to_vec(),
            wrap: wrap.to_vec(),
        })
    }

    /// The same shape with wraparound set on every axis to `wrap`.
    pub fn set_wrap_all(mut self, wrap: bool) -> Torus {
        self.wrap.iter_mut().for_each(|w| *w = wrap);
        self
    }

    pub fn dims(&self) -> &[u32] {
        &self.dims
    }
    pub fn ndims(&self) -> usize {
        self.dims.len()
    }
    pub fn dim(&self, axis: usize) -> u32 {
        self.dims.get(axis).copied().unwrap_or(1)
    }
    pub fn wraps(&self, axis: usize) -> bool {
        self.wrap.get(axis).copied().unwrap_or(false)
    }
    pub fn wrap(&self) -> &[bool] {
        &self.wrap
    }
    pub fn chips(&self) -> u32 {
        self.dims.iter().product()
    }

    /// Distance in ranks between neighbours along `axis`.
    pub fn stride(&self, axis: usize) -> u32 {
        self.dims[..axis].iter().product()
    }

    pub fn coord(&self, rank: u32) -> Coord {
        let mut c = [0; MAX_AXES];
        let mut r = rank;
        for (axis, &d) in self.dims.iter().enumerate() {
            c[axis] = r % d;
            r /= d;
        }
        c
    }

    pub fn rank(&self, coord: &Coord) -> u32 {
        self.dims
            .iter()
            .enumerate()
            .rev()
            .fold(0, |acc, (axis, &d)| acc * d + coord[axis])
    }

    /// The chip across link (`axis`, `dir`) from `rank`, or `None` at the edge of an axis
    /// without wraparound or on an axis of size 1.
    pub fn neighbor(&self, rank: u32, axis: usize, dir: Dir) -> Option<u32> {
        let d = self.dim(axis);
        if axis >= self.ndims() || d == 1 {
            return None;
        }
        let mut c = self.coord(rank);
        let x = c[axis];
        c[axis] = match dir {
            Dir::Plus if x + 1 < d => x + 1,
            Dir::Plus if self.wraps(axis) => 0,
            Dir::Minus if x > 0 => x - 1,
            Dir::Minus if self.wraps(axis) => d - 1,
            _ => return None,
        };
        Some(self.rank(&c))
    }

    /// The chips along `axis` through `rank`, in `+` order starting at coordinate 0.
    pub fn ring(&self, rank: u32, axis: usize) -> Vec<u32> {
        let mut c = self.coord(rank);
        (0..self.dim(axis))
            .map(|x| {
                c[axis] = x;
                self.rank(&c)
            })
            .collect()
    }
}

impl fmt::Display for Torus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str("x")?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

impl FromStr for Torus {
    type Err = TopologyError;

    /// Parses `"16"`, `"4x4"` or `"16x16x24"` (wraparound on every axis).
    fn from_str(text: &str) -> Result<Torus, TopologyError> {
        let bad = |reason: String| TopologyError::BadShape {
            text: text.to_string(),
            reason,
        };
        let dims = text
            .trim()
            .split(['x', 'X'])
            .map(|part| {
                part.trim()
                    .parse::<u32>()
                    .map_err(|e| bad(format!("axis {part:?}: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Torus::new(&dims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_shapes() {
        assert_eq!("4x4x4".parse::<Torus>().unwrap().chips(), 64);
        assert_eq!("16".parse::<Torus>().unwrap().dims(), &[16]);
        assert!(matches!(
            "4x0".parse::<Torus>(),
            Err(TopologyError::ZeroAxis { axis: 1 })
        ));
        assert!(matches!(
            "2x2x2x2".parse::<Torus>(),
            Err(TopologyError::AxisCount(4))
        ));
        assert!(matches!(
            "4xa".parse::<Torus>(),
            Err(TopologyError::BadShape { .. })
        ));
    }

    #[test]
    fn edges_without_wraparound() {
        let t = Torus::with_wrap(&[4, 3], &[false, true]).unwrap();
        assert_eq!(t.neighbor(3, 0, Dir::Plus), None);
        assert_eq!(t.neighbor(0, 0, Dir::Minus), None);
        assert_eq!(t.neighbor(0, 1, Dir::Minus), Some(8));
        assert_eq!(t.neighbor(0, 2, Dir::Plus), None);
    }
}
