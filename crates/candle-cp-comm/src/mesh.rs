//! [`Mesh`]: named sub-groups of a world laid out as an N-dimensional grid.
//!
//! Rank order is row-major: the **last** dim varies fastest. For
//! `Mesh::new(world, &[("dp", 2), ("cp", 2), ("tp", 2)])`:
//!
//! ```text
//! world rank | dp cp tp | tp group    | cp group    | dp group
//! -----------+----------+-------------+-------------+------------
//!      0     |  0  0  0 | {0,1}       | {0,2}       | {0,4}
//!      1     |  0  0  1 | {0,1}       | {1,3}       | {1,5}
//!      2     |  0  1  0 | {2,3}       | {0,2}       | {2,6}
//!      3     |  0  1  1 | {2,3}       | {1,3}       | {3,7}
//!      4     |  1  0  0 | {4,5}       | {4,6}       | {0,4}
//!      5     |  1  0  1 | {4,5}       | {5,7}       | {1,5}
//!      6     |  1  1  0 | {6,7}       | {4,6}       | {2,6}
//!      7     |  1  1  1 | {6,7}       | {5,7}       | {3,7}
//! ```
//!
//! `world rank = (dp * 2 + cp) * 2 + tp`. The group along a dim holds the ranks that differ
//! only in that coordinate; a rank's index inside it is its coordinate along the dim. So TP
//! ranks are adjacent (the fastest dim should be the one with the most traffic).
//!
//! 2-D context parallelism (Ulysses × ring, U·R ranks) uses
//! `Mesh::new(world, &[("ring", R), ("ulysses", U)])`: Ulysses ranks (all-to-all, the heavier
//! traffic) are adjacent, ring groups stride by U. For R = 2, U = 2:
//!
//! ```text
//! world rank | ring ulysses | ulysses group | ring group
//! -----------+--------------+---------------+-----------
//!      0     |   0     0    | {0,1}         | {0,2}
//!      1     |   0     1    | {0,1}         | {1,3}
//!      2     |   1     0    | {2,3}         | {0,2}
//!      3     |   1     1    | {2,3}         | {1,3}
//! ```

use crate::Group;
use candle_core::{bail, Result};

/// A world split into a grid of named dims, with one sub-group per dim for this rank.
#[derive(Clone)]
pub struct Mesh {
    world: Group,
    names: Vec<String>,
    sizes: Vec<usize>,
    coords: Vec<usize>,
    groups: Vec<Group>,
}

impl Mesh {
    /// Lay `world` out as a grid with `dims` = `[(name, size), ...]` (last dim fastest) and
    /// create the sub-group along every dim. Collective: every rank of `world` must call it
    /// with the same `dims`. Errors if the product of sizes differs from `world.size()`, a
    /// size is 0, or a name is repeated or empty.
    pub fn new(world: Group, dims: &[(&str, usize)]) -> Result<Mesh> {
        let product: usize = dims.iter().map(|&(_, s)| s).product();
        if dims.is_empty() || product != world.size() || dims.iter().any(|&(_, s)| s == 0) {
            bail!(
                "Mesh::new: dims {dims:?} (product {product}) do not match the world size {}",
                world.size()
            )
        }
        for (i, &(name, _)) in dims.iter().enumerate() {
            if name.is_empty() || dims[..i].iter().any(|&(n, _)| n == name) {
                bail!("Mesh::new: dim names must be unique and non-empty, got {dims:?}")
            }
        }
        let sizes: Vec<usize> = dims.iter().map(|&(_, s)| s).collect();
        let coords = coords_of(world.rank(), &sizes);
        let mut groups = Vec::with_capacity(dims.len());
        for d in 0..dims.len() {
            let (color, key) = color_key(&coords, &sizes, &[d]);
            groups.push(world.split(color, key)?);
        }
        Ok(Mesh {
            world,
            names: dims.iter().map(|&(n, _)| n.to_string()).collect(),
            sizes,
            coords,
            groups,
        })
    }

    fn index(&self, name: &str) -> Result<usize> {
        match self.names.iter().position(|n| n == name) {
            Some(i) => Ok(i),
            None => bail!("Mesh: no dim named {name:?}; dims are {:?}", self.names),
        }
    }

    /// This rank's sub-group along dim `name`: the ranks whose coordinates differ only in
    /// `name`, ordered by their `name` coordinate (so `group.rank() == coord(name)`).
    pub fn group(&self, name: &str) -> Result<Group> {
        Ok(self.groups[self.index(name)?].clone())
    }

    /// This rank's coordinate along dim `name`, in `0..size(name)`.
    pub fn coord(&self, name: &str) -> Result<usize> {
        Ok(self.coords[self.index(name)?])
    }

    /// Size of dim `name`.
    pub fn size(&self, name: &str) -> Result<usize> {
        Ok(self.sizes[self.index(name)?])
    }

    /// The world group the mesh was built on.
    pub fn world(&self) -> &Group {
        &self.world
    }

    /// `(name, size)` of every dim, slowest first.
    pub fn dims(&self) -> Vec<(String, usize)> {
        self.names
            .iter()
            .cloned()
            .zip(self.sizes.iter().copied())
            .collect()
    }

    /// Collective: the sub-group of ranks that differ only in the coordinates of `names`,
    /// flattened row-major in mesh order (e.g. `["cp", "tp"]` on a dp×cp×tp mesh gives the
    /// cp·tp ranks sharing this rank's dp coordinate, tp fastest). Every rank of the world
    /// must call it with the same `names`.
    pub fn split_over(&self, names: &[&str]) -> Result<Group> {
        let mut idx = names
            .iter()
            .map(|n| self.index(n))
            .collect::<Result<Vec<_>>>()?;
        idx.sort();
        if idx.windows(2).any(|w| w[0] == w[1]) {
            bail!("Mesh::split_over: repeated dim in {names:?}")
        }
        let (color, key) = color_key(&self.coords, &self.sizes, &idx);
        self.world.split(color, key)
    }
}

/// Row-major coordinates of `rank` (last dim fastest).
pub(crate) fn coords_of(rank: usize, sizes: &[usize]) -> Vec<usize> {
    let mut coords = vec![0; sizes.len()];
    let mut rest = rank;
    for d in (0..sizes.len()).rev() {
        coords[d] = rest % sizes[d];
        rest /= sizes[d];
    }
    coords
}

/// Split color (row-major index over the dims *not* in `inner`) and key (row-major index over
/// the dims in `inner`) of a rank with `coords`.
fn color_key(coords: &[usize], sizes: &[usize], inner: &[usize]) -> (usize, usize) {
    let (mut color, mut key) = (0, 0);
    for d in 0..sizes.len() {
        if inner.contains(&d) {
            key = key * sizes[d] + coords[d];
        } else {
            color = color * sizes[d] + coords[d];
        }
    }
    (color, key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coords_are_row_major_last_fastest() {
        let sizes = [2, 2, 2];
        assert_eq!(coords_of(5, &sizes), vec![1, 0, 1]);
        assert_eq!(coords_of(6, &sizes), vec![1, 1, 0]);
        // tp groups: ranks 4 and 5 share color, keys 0 and 1
        assert_eq!(color_key(&coords_of(4, &sizes), &sizes, &[2]), (2, 0));
        assert_eq!(color_key(&coords_of(5, &sizes), &sizes, &[2]), (2, 1));
        // cp group of rank 5 is {5, 7}
        assert_eq!(color_key(&coords_of(5, &sizes), &sizes, &[1]), (3, 0));
        assert_eq!(color_key(&coords_of(7, &sizes), &sizes, &[1]), (3, 1));
    }
}
