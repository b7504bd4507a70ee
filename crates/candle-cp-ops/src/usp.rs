//! 2-D (Ulysses × ring) attention, "unified sequence parallelism".
//!
//! A world of `W = U·R` ranks is a `R × U` grid ([`UspGroups::new`], built on
//! [`candle_cp_comm::Mesh`] with dims `[("ring", R), ("ulysses", U)]`, the last dim fastest):
//!
//! ```text
//!   world rank w = i·U + u      i = ring index (0..R), u = Ulysses index (0..U)
//!   Ulysses group of w: ranks {i·U + 0, .., i·U + U-1}  (adjacent ranks: the all-to-all is
//!                                                      the heavy traffic, keep it intra-node)
//!   ring group of w:    ranks {0·U + u, 1·U + u, .., (R-1)·U + u}
//!   e.g. U = 2, R = 2:  ulysses {0,1} {2,3};  ring {0,2} {1,3}
//! ```
//!
//! **Sequence sharding** (global length `T`): the sequence is first split over the ring
//! groups by a CP layout (zigzag by default: ring index `i` holds chunks `i` and `2R-1-i` of
//! `2R` chunks), then that ring shard of `T/R` rows is split *contiguously* over the Ulysses
//! group: rank `(i, u)` holds rows `[u·T/(RU), (u+1)·T/(RU))` of ring shard `i`
//! ([`usp_positions`], [`usp_shard`]).
//!
//! **Attention**:
//! ```text
//!   rank (i,u): q [B, T/(RU), H, D], k/v [B, T/(RU), Hkv, D]
//!     │ all_to_all_seq_to_head in the Ulysses group (KV heads replicated if U > Hkv)
//!   q [B, T/R, H/U, D], k/v [B, T/R, max(Hkv/U, 1), D]   = ring shard i, heads of u
//!     │ ring attention (zigzag) over the ring group: K/V rotate R-1 hops
//!   out [B, T/R, H/U, D], lse [B, H/U, T/R]
//!     │ all_to_all_head_to_seq in the Ulysses group
//!   out [B, T/(RU), H, D], lse [B, H, T/(RU)]
//! ```
//! GQA: KV heads are split over the Ulysses group when `Hkv % U == 0` and replicated when
//! `U % Hkv == 0` (the copies' gradients are summed back); the ring then carries only the
//! `max(Hkv/U, 1)` KV heads each rank needs.

use crate::cp::{self, CpOpts, Layout};
use crate::ulysses::{all_to_all_head_to_seq, all_to_all_seq_to_head, check_qkv, kv_seq_to_head, kv_spread, lse_head_to_seq};
use candle_core::{Result, Tensor};
use candle_cp_comm::{Group, Mesh};

/// The two sub-groups of a 2-D Ulysses × ring layout for this rank.
#[derive(Clone)]
pub struct UspGroups {
    /// The `U` ranks that exchange heads by all-to-all (same ring index).
    pub ulysses: Group,
    /// The `R` ranks that pass K/V around a ring (same Ulysses index).
    pub ring: Group,
}

impl UspGroups {
    /// Split `world` (size `U·R`) into Ulysses and ring groups; rank order as in the module
    /// docs (`w = i·U + u`). Collective over `world`.
    pub fn new(world: &Group, ulysses: usize, ring: usize) -> Result<Self> {
        if ulysses == 0 || ring == 0 || ulysses * ring != world.size() {
            candle_core::bail!(
                "usp: Ulysses degree U = {ulysses} × ring degree R = {ring} must equal the world size {}",
                world.size()
            )
        }
        let mesh = Mesh::new(world.clone(), &[("ring", ring), ("ulysses", ulysses)])?;
        Ok(Self { ulysses: mesh.group("ulysses")?, ring: mesh.group("ring")? })
    }

    /// Ulysses degree `U`.
    pub fn u(&self) -> usize {
        self.ulysses.size()
    }
    /// Ring degree `R`.
    pub fn r(&self) -> usize {
        self.ring.size()
    }
}

/// Options of [`usp_attention`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UspOpts {
    /// Causal mask over global positions.
    pub causal: bool,
    /// Softmax scale, usually `1/sqrt(D)`.
    pub scale: f64,
    /// How the sequence is split over the ring groups (zigzag balances causal work).
    pub ring_layout: Layout,
}

impl UspOpts {
    /// Zigzag ring layout with the given mask type and scale.
    pub fn new(causal: bool, scale: f64) -> Self {
        Self { causal, scale, ring_layout: Layout::Zigzag }
    }
}

/// Global positions of the rows held by rank `(ring_rank, uly_rank)` of an `R × U` layout,
/// in local order (length `T/(R·U)`). Errors if `T` does not split.
pub fn usp_positions(layout: Layout, t: usize, ring_rank: usize, r: usize, uly_rank: usize, u: usize) -> Result<Vec<usize>> {
    let ring_pos = cp::positions(layout, ring_rank, r, t)?;
    let tr = ring_pos.len();
    if u == 0 || tr % u != 0 || uly_rank >= u {
        candle_core::bail!("usp: ring shard of T/R = {tr} rows (T = {t}, R = {r}) cannot be split over U = {u} Ulysses ranks (rank {uly_rank})")
    }
    let n = tr / u;
    Ok(ring_pos[uly_rank * n..(uly_rank + 1) * n].to_vec())
}

/// This rank's shard `[.., T/(R·U), ..]` of `global` `[.., T, ..]` along `dim` for the
/// sharding described in the module docs.
pub fn usp_shard(global: &Tensor, layout: Layout, groups: &UspGroups, dim: usize) -> Result<Tensor> {
    let (u, r) = (groups.u(), groups.r());
    let ring_shard = cp::shard(global, layout, groups.ring.rank(), r, dim)?;
    let tr = ring_shard.dim(dim)?;
    if tr % u != 0 {
        candle_core::bail!("usp_shard: ring shard {:?} (T/R = {tr} along dim {dim}) not divisible by U = {u}", ring_shard.dims())
    }
    ring_shard.narrow(dim, groups.ulysses.rank() * (tr / u), tr / u)?.contiguous()
}

/// 2-D Ulysses × ring attention.
///
/// - `q` `[B, T/(R·U), H, D]`, `k`, `v` `[B, T/(R·U), Hkv, D]`: this rank's rows, sharded as
///   [`usp_shard`] does with `opts.ring_layout`.
/// - returns `out` `[B, T/(R·U), H, D]` (q's dtype, differentiable w.r.t. q, k, v) and `lse`
///   `[B, H, T/(R·U)]` (f32), equal to the rows of single-device attention over `T`.
///
/// Errors: `H % U != 0`, KV heads that can neither be split nor replicated over `U` (the
/// message lists the Ulysses degrees that work), `T` not divisible by what the ring layout
/// needs. Collective over both groups.
pub fn usp_attention(q: &Tensor, k: &Tensor, v: &Tensor, groups: &UspGroups, opts: &UspOpts) -> Result<(Tensor, Tensor)> {
    let (_, _, h, hkv, _) = check_qkv("usp_attention", q, k, v)?;
    let spread = kv_spread(h, hkv, groups.u())?;
    let qh = all_to_all_seq_to_head(q, &groups.ulysses)?;
    let kh = kv_seq_to_head(k, spread, &groups.ulysses)?;
    let vh = kv_seq_to_head(v, spread, &groups.ulysses)?;
    let cp_opts = CpOpts::new(opts.ring_layout, opts.causal).with_scale(opts.scale);
    let (out_h, lse_h) = cp::ring_attention(&qh, &kh, &vh, &groups.ring, &cp_opts)?;
    let out = all_to_all_head_to_seq(&out_h, &groups.ulysses)?;
    let lse = lse_head_to_seq(&lse_h, &groups.ulysses)?;
    Ok((out, lse))
}
