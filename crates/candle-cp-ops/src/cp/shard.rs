//! Sequence sharding layouts for context parallelism, their inverse, and position ids.
//!
//! A global sequence of `T` tokens is split over `P` ranks; each rank holds `T/P` tokens.
//!
//! ```text
//! T = 8, P = 2 (token index shown in each cell)
//!
//! contiguous   rank 0: [0 1 2 3]          rank 1: [4 5 6 7]
//! zigzag       rank 0: [0 1 | 6 7]        rank 1: [2 3 | 4 5]     (2P chunks; rank i holds
//!                                                                  chunks i and 2P-1-i)
//! striped      rank 0: [0 2 4 6]          rank 1: [1 3 5 7]       (token j on rank j mod P)
//! ```
//!
//! Every layout is described per rank by a short list of [`Segment`]s (arithmetic progressions
//! of global positions). The ring engine builds its block masks from these segments.

use candle_core::{bail, DType, Device, Result, Tensor};
use std::fmt;
use std::str::FromStr;

#[cfg(feature = "cuda")]
#[path = "shard_cuda.rs"]
mod cuda;

/// How a global sequence is split over the ranks of a context-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Rank `r` holds tokens `r·T/P .. (r+1)·T/P`. Causal work is unbalanced: the last rank
    /// does `(2P-1)/P` times the mean.
    Contiguous,
    /// `T` is split into `2P` chunks of `T/(2P)` tokens; rank `i` holds chunks `i` and
    /// `2P-1-i` (in that order). Causal work is balanced exactly. Needs `T % 2P == 0`.
    Zigzag,
    /// Token `j` lives on rank `j mod P` (local row `l` of rank `r` is token `r + l·P`).
    /// Causal work is balanced up to one diagonal. Needs `T % P == 0`.
    Striped,
}

impl Layout {
    /// All layouts, for tests and reports.
    pub const ALL: [Layout; 3] = [Layout::Contiguous, Layout::Zigzag, Layout::Striped];

    /// Lower-case name (`contiguous`, `zigzag`, `striped`).
    pub fn name(&self) -> &'static str {
        match self {
            Layout::Contiguous => "contiguous",
            Layout::Zigzag => "zigzag",
            Layout::Striped => "striped",
        }
    }

    /// The factor `T` must be divisible by: `P` (contiguous, striped) or `2P` (zigzag).
    pub fn divisor(&self, p: usize) -> usize {
        match self {
            Layout::Zigzag => 2 * p,
            _ => p,
        }
    }

    /// Check that a global length `t` can be split over `p` ranks; returns the local length
    /// `T/P`. The error names `T`, `P` and the layout.
    pub fn local_len(&self, t: usize, p: usize) -> Result<usize> {
        if p == 0 {
            bail!(
                "{} layout: the number of ranks P must be at least 1 (T = {t})",
                self.name()
            )
        }
        let d = self.divisor(p);
        if !t.is_multiple_of(d) {
            bail!(
                "{} layout: sequence length T = {t} is not divisible by {} (P = {p}{})",
                self.name(),
                d,
                if matches!(self, Layout::Zigzag) {
                    ", zigzag needs 2P chunks"
                } else {
                    ""
                }
            )
        }
        Ok(t / p)
    }

    /// The global positions held by `rank`, as segments in local order. `t` is the global
    /// length. Contiguous and striped give one segment, zigzag two.
    pub fn segments(&self, rank: usize, p: usize, t: usize) -> Result<Vec<Segment>> {
        let tl = self.local_len(t, p)?;
        if rank >= p {
            bail!(
                "{} layout: rank {rank} out of range for P = {p} (T = {t})",
                self.name()
            )
        }
        Ok(match self {
            Layout::Contiguous => vec![Segment {
                offset: rank * tl,
                stride: 1,
                len: tl,
                local: 0,
            }],
            Layout::Zigzag => {
                let c = tl / 2;
                vec![
                    Segment {
                        offset: rank * c,
                        stride: 1,
                        len: c,
                        local: 0,
                    },
                    Segment {
                        offset: (2 * p - 1 - rank) * c,
                        stride: 1,
                        len: c,
                        local: c,
                    },
                ]
            }
            Layout::Striped => vec![Segment {
                offset: rank,
                stride: p,
                len: tl,
                local: 0,
            }],
        })
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Layout {
    type Err = candle_core::Error;
    /// Parses `contiguous` (alias `ring`), `zigzag`, `striped` (alias `stripe`).
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "contiguous" | "ring" => Ok(Layout::Contiguous),
            "zigzag" => Ok(Layout::Zigzag),
            "striped" | "stripe" => Ok(Layout::Striped),
            _ => bail!("unknown CP layout '{s}' (expected contiguous|ring, zigzag or striped)"),
        }
    }
}

/// A run of local rows whose global positions form an arithmetic progression:
/// local row `local + i` holds global position `offset + i·stride`, for `i < len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Global position of the first row.
    pub offset: usize,
    /// Distance between consecutive rows' global positions (1, or `P` for striped).
    pub stride: usize,
    /// Number of rows.
    pub len: usize,
    /// Index of the first row in the local shard.
    pub local: usize,
}

impl Segment {
    /// Global position of the last row (`offset` when empty).
    pub fn last(&self) -> usize {
        self.offset + self.len.saturating_sub(1) * self.stride
    }
}

fn check_dim(global: &Tensor, dim: usize, what: &str) -> Result<usize> {
    candle_cp_comm::ensure_nonempty(what, "tensor", global)?;
    if dim >= global.rank() {
        bail!(
            "{what}: dim {dim} out of range for a tensor of shape {:?}",
            global.shape()
        )
    }
    global.dim(dim)
}

/// This rank's shard of `global` along `dim` (the sequence dimension, length `T`).
///
/// `global` `[.., T, ..]` → `[.., T/P, ..]`, rows in the layout's local order (see
/// [`Layout::segments`]). Errors if `T` is not divisible by what the layout needs.
pub fn shard(global: &Tensor, layout: Layout, rank: usize, p: usize, dim: usize) -> Result<Tensor> {
    let t = check_dim(global, dim, "shard")?;
    let tl = layout.local_len(t, p)?;
    if rank >= p {
        bail!("shard: rank {rank} out of range for P = {p} ({layout} layout, T = {t})")
    }
    #[cfg(feature = "cuda")]
    if let Some(x) = cuda::shard(global, layout, rank, p, dim)? {
        return Ok(x);
    }
    match layout {
        Layout::Contiguous => global.narrow(dim, rank * tl, tl)?.contiguous(),
        Layout::Zigzag => {
            let c = tl / 2;
            let a = global.narrow(dim, rank * c, c)?;
            let b = global.narrow(dim, (2 * p - 1 - rank) * c, c)?;
            Tensor::cat(&[a, b], dim)
        }
        Layout::Striped => {
            let mut dims = global.dims().to_vec();
            dims.splice(dim..=dim, [tl, p]);
            global
                .reshape(dims)?
                .narrow(dim + 1, rank, 1)?
                .squeeze(dim + 1)?
                .contiguous()
        }
    }
}

/// Inverse of [`shard`]: rebuild the global tensor from every rank's shard (in rank order).
///
/// Each shard is `[.., T/P, ..]`; the result is `[.., T, ..]` with `T = P · T/P`.
pub fn unshard(shards: &[Tensor], layout: Layout, dim: usize) -> Result<Tensor> {
    let p = shards.len();
    if p == 0 {
        bail!("unshard: no shards given ({layout} layout)")
    }
    let first = shards[0].shape().clone();
    for (r, s) in shards.iter().enumerate() {
        if s.shape() != &first {
            bail!(
                "unshard: shard {r} has shape {:?}, shard 0 has {:?} ({layout} layout)",
                s.shape(),
                first
            )
        }
    }
    let tl = check_dim(&shards[0], dim, "unshard")?;
    layout.local_len(tl * p, p)?;
    #[cfg(feature = "cuda")]
    if let Some(x) = cuda::unshard(shards, layout, dim)? {
        return Ok(x);
    }
    match layout {
        Layout::Contiguous => Tensor::cat(shards, dim),
        Layout::Zigzag => {
            let c = tl / 2;
            let mut chunks = vec![None; 2 * p];
            for (r, s) in shards.iter().enumerate() {
                chunks[r] = Some(s.narrow(dim, 0, c)?);
                chunks[2 * p - 1 - r] = Some(s.narrow(dim, c, c)?);
            }
            let chunks: Vec<Tensor> = chunks.into_iter().flatten().collect();
            Tensor::cat(&chunks, dim)
        }
        Layout::Striped => {
            let mut dims = shards[0].dims().to_vec();
            dims[dim] = tl * p;
            Tensor::stack(shards, dim + 1)?.reshape(dims)
        }
    }
}

/// Split a tensor laid out as the concatenation of all ranks' shards (rank order) back into
/// its `P` shards. Helper for gathering collectives.
pub fn split_shards(cat: &Tensor, p: usize, dim: usize) -> Result<Vec<Tensor>> {
    let t = check_dim(cat, dim, "split_shards")?;
    if p == 0 || t % p != 0 {
        bail!(
            "split_shards: length {t} along dim {dim} not divisible by P = {p} (shape {:?})",
            cat.shape()
        )
    }
    let tl = t / p;
    (0..p).map(|r| cat.narrow(dim, r * tl, tl)).collect()
}

/// The global positions of `rank`'s local rows, in local order (length `T/P`).
pub fn positions(layout: Layout, rank: usize, p: usize, t: usize) -> Result<Vec<usize>> {
    let segs = layout.segments(rank, p, t)?;
    Ok(segs
        .iter()
        .flat_map(|s| (0..s.len).map(move |i| s.offset + i * s.stride))
        .collect())
}

/// [`positions`] as a `u32` tensor `[T/P]` on `device` (e.g. for RoPE).
pub fn position_ids(
    layout: Layout,
    rank: usize,
    p: usize,
    t: usize,
    device: &Device,
) -> Result<Tensor> {
    let pos: Vec<u32> = positions(layout, rank, p, t)?
        .into_iter()
        .map(|x| x as u32)
        .collect();
    Tensor::from_vec(pos, t / p, device)?.to_dtype(DType::U32)
}

/// Gather every rank's shard along `dim` and rebuild the global tensor in token order.
/// Collective over `group`. `local` is `[.., T/P, ..]`, result `[.., T, ..]` on every rank.
pub fn gather(local: &Tensor, group: &crate::Group, layout: Layout, dim: usize) -> Result<Tensor> {
    let p = group.size();
    check_dim(local, dim, "gather")?;
    let all = group.all_gather(&local.contiguous()?, dim)?;
    #[cfg(feature = "cuda")]
    if let Some(x) = cuda::unshard_cat(&all, layout, p, dim)? {
        return Ok(x);
    }
    unshard(&split_shards(&all, p, dim)?, layout, dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arange(t: usize) -> Result<Tensor> {
        // [2, T, 3]: value = 100·b + 10·pos ... distinct per element.
        let v: Vec<f32> = (0..2 * t * 3).map(|x| x as f32).collect();
        Tensor::from_vec(v, (2, t, 3), &Device::Cpu)
    }

    #[test]
    fn round_trip_all_layouts() -> Result<()> {
        for layout in Layout::ALL {
            for p in [1usize, 2, 3, 4, 8] {
                let t = 2 * p * 3;
                let g = arange(t)?;
                let shards: Vec<Tensor> = (0..p)
                    .map(|r| shard(&g, layout, r, p, 1))
                    .collect::<Result<_>>()?;
                for s in &shards {
                    assert_eq!(s.dims(), &[2, t / p, 3]);
                }
                let back = unshard(&shards, layout, 1)?;
                assert_eq!(
                    back.to_vec3::<f32>()?,
                    g.to_vec3::<f32>()?,
                    "{layout} P={p}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn shard_rows_match_positions() -> Result<()> {
        let t = 24;
        let g = Tensor::arange(0u32, t as u32, &Device::Cpu)?;
        for layout in Layout::ALL {
            for p in [1usize, 2, 3, 4] {
                let mut seen = vec![0usize; t];
                for r in 0..p {
                    let s = shard(&g, layout, r, p, 0)?.to_vec1::<u32>()?;
                    let pos = positions(layout, r, p, t)?;
                    assert_eq!(
                        s.iter().map(|&x| x as usize).collect::<Vec<_>>(),
                        pos,
                        "{layout} P={p} r={r}"
                    );
                    let ids = position_ids(layout, r, p, t, &Device::Cpu)?.to_vec1::<u32>()?;
                    assert_eq!(ids, s);
                    pos.iter().for_each(|&x| seen[x] += 1);
                }
                assert!(
                    seen.iter().all(|&c| c == 1),
                    "{layout} P={p}: every token on exactly one rank"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn layouts_as_documented() -> Result<()> {
        assert_eq!(positions(Layout::Contiguous, 1, 2, 8)?, vec![4, 5, 6, 7]);
        assert_eq!(positions(Layout::Zigzag, 0, 2, 8)?, vec![0, 1, 6, 7]);
        assert_eq!(positions(Layout::Zigzag, 1, 2, 8)?, vec![2, 3, 4, 5]);
        assert_eq!(positions(Layout::Striped, 1, 2, 8)?, vec![1, 3, 5, 7]);
        Ok(())
    }

    #[test]
    fn bad_divisibility_names_t_p_layout() -> Result<()> {
        let g = arange(10)?;
        let e = shard(&g, Layout::Zigzag, 0, 3, 1).unwrap_err().to_string();
        assert!(
            e.contains("T = 10") && e.contains("P = 3") && e.contains("zigzag"),
            "{e}"
        );
        let e = shard(&g, Layout::Contiguous, 0, 4, 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("T = 10") && e.contains("P = 4") && e.contains("contiguous"),
            "{e}"
        );
        let e = shard(&g, Layout::Striped, 0, 3, 1).unwrap_err().to_string();
        assert!(
            e.contains("T = 10") && e.contains("P = 3") && e.contains("striped"),
            "{e}"
        );
        // 2P divides for contiguous but zigzag needs 2P = 4 | T.
        assert!(shard(&arange(6)?, Layout::Contiguous, 0, 2, 1).is_ok());
        assert!(shard(&arange(6)?, Layout::Zigzag, 0, 2, 1).is_err());
        assert!(shard(&g, Layout::Contiguous, 2, 2, 1).is_err());
        assert!(shard(&g, Layout::Contiguous, 0, 2, 3).is_err());
        Ok(())
    }

    #[test]
    fn gather_inverts_shard_on_thread_ranks() -> Result<()> {
        for layout in Layout::ALL {
            for p in [1usize, 3, 4] {
                let g = arange(2 * p * 2)?;
                let res = candle_cp_comm::run_ranks(p, |grp: crate::Group| {
                    let local = shard(&g, layout, grp.rank(), p, 1)?;
                    gather(&local, &grp, layout, 1)
                });
                for r in res {
                    assert_eq!(r?.to_vec3::<f32>()?, g.to_vec3::<f32>()?, "{layout} P={p}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn parse_layouts() -> Result<()> {
        assert_eq!("ring".parse::<Layout>()?, Layout::Contiguous);
        assert_eq!("zigzag".parse::<Layout>()?, Layout::Zigzag);
        assert_eq!("striped".parse::<Layout>()?, Layout::Striped);
        assert!("diagonal".parse::<Layout>().is_err());
        Ok(())
    }
}
