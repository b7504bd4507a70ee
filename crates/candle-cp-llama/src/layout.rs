//! Parallel layouts of the Llama model: [`Layout`] (the degrees and the CP algorithm, chosen
//! at construction), [`ParallelCtx`] (the process groups of one rank) and [`shard_batch`]
//! (this rank's input ids, labels and global positions).
//!
//! Rank order in the world group (last dimension fastest):
//! `world rank = ((dp_i · CP) + cp_i) · TP + tp_i`, and for 2-D CP `cp_i = ring_i · U + uly_i`
//! (Ulysses ranks adjacent). Tokens are split first over DP (batch rows), then over the CP
//! group by the CP layout (contiguous / zigzag / striped), then — with Megatron sequence
//! parallelism (`sp`) — contiguously over the TP group.

use candle_core::{bail, DType, Result, Tensor};
use candle_cp_comm::Group;
use candle_cp_nn::Shard;
use candle_cp_ops::cp::shard::{self as cpshard, Layout as SeqLayout};
pub use candle_cp_ops::attention::RowSums;
pub use candle_cp_ops::ulysses::HeadLayout;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::str::FromStr;

/// Label value that contributes no loss (the last position of the global sequence, padding).
pub const IGNORE: u32 = u32::MAX;

/// The context-parallel algorithm (how attention sees tokens held by other CP ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpKind {
    /// Ring attention on contiguous shards (unbalanced causal work).
    Ring,
    /// Ring attention on zigzag shards (2P chunks, rank i holds i and 2P-1-i).
    Zigzag,
    /// Ring attention on striped shards (token t on rank t mod P).
    Striped,
    /// All-gather K/V then local attention (Llama 3 style), zigzag shards.
    AllGather,
    /// DeepSpeed-Ulysses all-to-all (sequence ↔ heads), contiguous shards.
    Ulysses,
    /// 2-D: Ulysses (degree `ulysses`) × ring (degree `ring`), `cp = ulysses · ring`.
    TwoD,
}

impl CpKind {
    /// All kinds, for tests and reports.
    pub const ALL: [CpKind; 6] = [
        CpKind::Ring,
        CpKind::Zigzag,
        CpKind::Striped,
        CpKind::AllGather,
        CpKind::Ulysses,
        CpKind::TwoD,
    ];

    /// Lower-case name as accepted by [`CpKind::from_str`].
    pub fn name(&self) -> &'static str {
        match self {
            CpKind::Ring => "ring",
            CpKind::Zigzag => "zigzag",
            CpKind::Striped => "striped",
            CpKind::AllGather => "allgather",
            CpKind::Ulysses => "ulysses",
            CpKind::TwoD => "2d",
        }
    }

    /// How the CP group's tokens are laid out over its ranks.
    pub fn seq_layout(&self) -> SeqLayout {
        match self {
            CpKind::Ring | CpKind::Ulysses => SeqLayout::Contiguous,
            CpKind::Zigzag | CpKind::AllGather | CpKind::TwoD => SeqLayout::Zigzag,
            CpKind::Striped => SeqLayout::Striped,
        }
    }
}

impl fmt::Display for CpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CpKind {
    type Err = candle_core::Error;
    /// `ring` (alias `contiguous`), `zigzag`, `striped` (`stripe`), `allgather` (`all-gather`,
    /// `all_gather`), `ulysses`, `2d` (`usp`, `2-d`).
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "ring" | "contiguous" => CpKind::Ring,
            "zigzag" => CpKind::Zigzag,
            "striped" | "stripe" => CpKind::Striped,
            "allgather" | "all-gather" | "all_gather" => CpKind::AllGather,
            "ulysses" => CpKind::Ulysses,
            "2d" | "2-d" | "usp" => CpKind::TwoD,
            _ => bail!("unknown CP layout '{s}' (expected ring, zigzag, striped, allgather, ulysses or 2d)"),
        })
    }
}

/// Parallel degrees of a run. World size = `dp · cp · tp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Tensor-parallel degree (heads and MLP columns split over TP ranks).
    pub tp: usize,
    /// Context-parallel degree (sequence split over CP ranks).
    pub cp: usize,
    /// CP algorithm.
    pub cp_kind: CpKind,
    /// Megatron sequence parallelism inside the TP group (norms, residuals, embeddings and
    /// the head run on `T/(cp·tp)` tokens). Only meaningful with `tp > 1`.
    pub sp: bool,
    /// Data-parallel degree (batch rows split over DP ranks).
    pub dp: usize,
    /// Ulysses degree: `cp` for [`CpKind::Ulysses`], the inner degree for [`CpKind::TwoD`].
    pub ulysses: usize,
    /// Ring degree of [`CpKind::TwoD`] (`cp = ulysses · ring`); `cp` for ring kinds.
    pub ring: usize,
    /// What the Ulysses and 2-D attention backward keeps of the head layout (see
    /// [`HeadLayout`]): [`HeadLayout::Regathered`] keeps only the sequence layout and
    /// all-to-alls q, k, v and the output again in the backward. Ignored by the other kinds.
    pub head_layout: HeadLayout,
    /// Expert-parallel degree: each sparse layer's experts split over `ep` ranks of the DP × CP
    /// group (consecutive ones, same TP rank; [`ParallelCtx::ep`]), the routed tokens sent to
    /// the ranks holding their experts and back ([`candle_cp_ops::moe_ep`]). 1: every rank
    /// holds every expert (its TP slice). `ep` must divide `dp · cp` and the experts.
    pub ep: usize,
    /// Where the attention backward's row sums take the output from (see [`RowSums`]);
    /// `None`: each kind's default ([`Layout::default_row_sums`]: from the f32 output for the
    /// ring kinds and 2-D, from the returned output on one device and under Ulysses). Changes
    /// nothing for f32 weights.
    pub row_sums: Option<RowSums>,
}

impl Default for Layout {
    fn default() -> Self {
        Self::single()
    }
}

impl Layout {
    /// One device: every degree 1.
    pub fn single() -> Self {
        Self {
            tp: 1,
            cp: 1,
            cp_kind: CpKind::Zigzag,
            sp: false,
            dp: 1,
            ulysses: 1,
            ring: 1,
            head_layout: HeadLayout::Kept,
            row_sums: None,
            ep: 1,
        }
    }
    /// Pure CP of degree `cp` with algorithm `kind` (for [`CpKind::TwoD`] use [`Layout::two_d`]).
    pub fn cp(kind: CpKind, cp: usize) -> Self {
        let (ulysses, ring) = match kind {
            CpKind::Ulysses => (cp, 1),
            CpKind::TwoD => (1, cp),
            _ => (1, cp),
        };
        Self {
            cp,
            cp_kind: kind,
            ulysses,
            ring,
            ..Self::single()
        }
    }
    /// 2-D CP: Ulysses degree `ulysses` × ring degree `ring`.
    pub fn two_d(ulysses: usize, ring: usize) -> Self {
        Self {
            cp: ulysses * ring,
            cp_kind: CpKind::TwoD,
            ulysses,
            ring,
            ..Self::single()
        }
    }
    /// Same layout with tensor parallelism `tp` (and sequence parallelism if `sp`).
    pub fn with_tp(mut self, tp: usize, sp: bool) -> Self {
        self.tp = tp;
        self.sp = sp;
        self
    }
    /// Same layout with the Ulysses / 2-D backward keeping `head_layout`.
    pub fn with_head_layout(mut self, head_layout: HeadLayout) -> Self {
        self.head_layout = head_layout;
        self
    }
    /// Same layout with the attention backward's row sums taken as `row_sums` says (see
    /// [`Layout::row_sums`]).
    pub fn with_row_sums(mut self, row_sums: RowSums) -> Self {
        self.row_sums = Some(row_sums);
        self
    }
    /// Where this kind's attention backward takes its row sums from unless told:
    /// [`RowSums::F32`] for the ring kinds and 2-D (their output's bf16 residual kept),
    /// [`RowSums::Output`] on one device and under Ulysses (FlashAttention's choice).
    pub fn default_row_sums(&self) -> RowSums {
        match self.cp_kind {
            _ if self.cp == 1 => RowSums::Output,
            CpKind::Ulysses => RowSums::Output,
            _ => RowSums::F32,
        }
    }
    /// Where this layout's attention backward takes its row sums from: [`Layout::row_sums`],
    /// else [`Layout::default_row_sums`].
    pub fn effective_row_sums(&self) -> RowSums {
        self.row_sums.unwrap_or_else(|| self.default_row_sums())
    }
    /// Same layout with expert parallelism `ep` (see [`Layout::ep`]).
    pub fn with_ep(mut self, ep: usize) -> Self {
        self.ep = ep;
        self
    }
    /// Same layout with data parallelism `dp`.
    pub fn with_dp(mut self, dp: usize) -> Self {
        self.dp = dp;
        self
    }
    /// Number of ranks: `dp · cp · tp`.
    pub fn world_size(&self) -> usize {
        self.dp * self.cp * self.tp
    }
    /// Is SP actually active (`sp` and `tp > 1`)?
    pub fn seq_parallel(&self) -> bool {
        self.sp && self.tp > 1
    }

    /// Check the degrees against each other: every degree at least 1, and the Ulysses / ring
    /// split that the CP kind needs. [`Layout::validate`] adds the model's head counts.
    pub fn check_degrees(&self) -> Result<()> {
        if self.tp == 0 || self.cp == 0 || self.dp == 0 || self.ulysses == 0 || self.ring == 0 || self.ep == 0 {
            bail!("layout {self}: every degree must be at least 1")
        }
        if !(self.dp * self.cp).is_multiple_of(self.ep) {
            bail!("layout {self}: ep = {} must divide dp · cp = {} (the experts split over DP × CP ranks)", self.ep, self.dp * self.cp)
        }
        match self.cp_kind {
            CpKind::Ulysses if self.ulysses != self.cp || self.ring != 1 => {
                bail!("layout {self}: ulysses needs ulysses = cp and ring = 1")
            }
            CpKind::TwoD if self.ulysses * self.ring != self.cp => {
                bail!("layout {self}: 2d needs cp = ulysses · ring")
            }
            CpKind::Ring | CpKind::Zigzag | CpKind::Striped | CpKind::AllGather if self.ulysses != 1 => {
                bail!("layout {self}: ulysses degree must be 1 for {}", self.cp_kind)
            }
            _ => Ok(()),
        }
    }

    /// Check the degrees against each other ([`Layout::check_degrees`]) and the model
    /// (`heads`, `kv_heads`): `tp` must divide `heads`, and `kv_heads` divide `heads`. When
    /// `tp` does not divide `kv_heads` each KV head is copied `lcm(kv_heads, tp) / kv_heads`
    /// times and each TP rank holds `lcm(kv_heads, tp) / tp` of the copies, those its query
    /// heads use: with fewer KV heads than ranks, one on `tp / kv_heads` adjacent ranks; with
    /// 10 KV heads over 4 ranks (Phi-3-medium, Phi-4), 5 copies of 3 distinct heads each, one
    /// head shared with a neighbour ([`candle_cp_nn::Shard::RowBlocks`], [`ParallelCtx::grad_group`]).
    pub fn validate(&self, heads: usize, kv_heads: usize) -> Result<()> {
        self.check_degrees()?;
        if !heads.is_multiple_of(self.tp) {
            bail!("layout {self}: tp = {} must divide heads ({heads})", self.tp)
        }
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            bail!("layout {self}: kv heads ({kv_heads}) must divide heads ({heads})")
        }
        let lh = heads / self.tp;
        if self.ulysses > 1 && !lh.is_multiple_of(self.ulysses) {
            bail!(
                "layout {self}: ulysses degree {} must divide the {lh} query heads per TP rank",
                self.ulysses
            )
        }
        Ok(())
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} cp={}", self.cp_kind, self.cp)?;
        if self.cp_kind == CpKind::TwoD {
            write!(f, " (ulysses={} x ring={})", self.ulysses, self.ring)?;
        }
        if self.head_layout == HeadLayout::Regathered && matches!(self.cp_kind, CpKind::Ulysses | CpKind::TwoD) {
            f.write_str(" heads-regathered")?;
        }
        match self.effective_row_sums() {
            r if r == self.default_row_sums() => {}
            RowSums::F32 => f.write_str(" f32-row-sums")?,
            RowSums::Output => f.write_str(" output-row-sums")?,
        }
        write!(f, " tp={}{} dp={}", self.tp, if self.sp { "+sp" } else { "" }, self.dp)?;
        if self.ep > 1 {
            write!(f, " ep={}", self.ep)?;
        }
        Ok(())
    }
}

/// One rank's view of a [`Layout`]: its coordinates and process groups.
#[derive(Clone)]
pub struct ParallelCtx {
    /// The layout.
    pub layout: Layout,
    /// All `dp · cp · tp` ranks.
    pub world: Group,
    /// Ranks that hold the same batch rows and TP shard: size `cp`.
    pub cp: Group,
    /// Ranks that hold the same tokens and different weight shards: size `tp`.
    pub tp: Group,
    /// Ranks that hold different batch rows: size `dp`.
    pub dp: Group,
    /// DP × CP ranks of the same TP rank (gradient reduction of TP-sharded weights).
    pub dp_cp: Group,
    /// Ulysses sub-group of the CP group (size `ulysses`; 2-D only, else the CP group).
    pub ulysses: Group,
    /// Ring sub-group of the CP group (size `ring`; 2-D only, else the CP group).
    pub ring: Group,
    /// The expert-parallel group (size `ep`: the `ep` consecutive DP × CP ranks of this TP
    /// rank, `dp_cp` index `q` with the same `q / ep`); `None` when `ep = 1`.
    pub ep: Option<Group>,
    /// The ranks that hold the same experts (same TP rank and `q mod ep`, size
    /// `dp · cp / ep`): the gradient group of the stacked experts. `dp_cp` when `ep = 1`.
    pub ep_dp: Group,
    /// Coordinates of this rank: `(dp_i, cp_i, tp_i)`.
    pub coords: (usize, usize, usize),
    /// Gradient groups of replicated row blocks, by copies per block, made on first use.
    block_groups: Arc<Mutex<Vec<(usize, Group)>>>,
}

impl ParallelCtx {
    /// Build the groups of `layout` from the world group (collective: every rank calls it).
    /// `world.size()` must equal `layout.world_size()`.
    pub fn new(world: Group, layout: Layout) -> Result<Self> {
        let (cp, tp) = (layout.cp, layout.tp);
        if world.size() != layout.world_size() {
            bail!(
                "ParallelCtx: world has {} ranks, layout {layout} needs dp·cp·tp = {}",
                world.size(),
                layout.world_size()
            )
        }
        if layout.cp_kind == CpKind::TwoD && layout.ulysses * layout.ring != cp {
            bail!("ParallelCtx: layout {layout}: 2d needs cp = ulysses · ring")
        }
        let r = world.rank();
        let (tp_i, cp_i, dp_i) = (r % tp, (r / tp) % cp, r / (tp * cp));
        let tp_g = world.split(dp_i * cp + cp_i, tp_i)?;
        let cp_g = world.split(dp_i * tp + tp_i, cp_i)?;
        let dp_g = world.split(cp_i * tp + tp_i, dp_i)?;
        let dp_cp = world.split(tp_i, dp_i * cp + cp_i)?;
        let (ulysses, ring) = if layout.cp_kind == CpKind::TwoD {
            let u = layout.ulysses;
            let (ring_i, uly_i) = (cp_i / u, cp_i % u);
            let outer = dp_i * tp + tp_i;
            let ug = world.split(outer * layout.ring + ring_i, uly_i)?;
            let rg = world.split(outer * u + uly_i, ring_i)?;
            (ug, rg)
        } else {
            (cp_g.clone(), cp_g.clone())
        };
        let (ep, ep_dp) = if layout.ep > 1 {
            if !(layout.dp * cp).is_multiple_of(layout.ep) {
                bail!("ParallelCtx: layout {layout}: ep = {} must divide dp · cp = {}", layout.ep, layout.dp * cp)
            }
            let (q, e) = (dp_i * cp + cp_i, layout.ep);
            let ep = world.split((q / e) * tp + tp_i, q % e)?;
            let ep_dp = world.split((q % e) * tp + tp_i, q / e)?;
            (Some(ep), ep_dp)
        } else {
            (None, dp_cp.clone())
        };
        Ok(Self {
            layout,
            world,
            cp: cp_g,
            tp: tp_g,
            dp: dp_g,
            dp_cp,
            ulysses,
            ring,
            ep,
            ep_dp,
            coords: (dp_i, cp_i, tp_i),
            block_groups: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// The group over which the gradient shares of a parameter split as `shard` over the TP
    /// group are summed: the ranks that hold the same slice of it but different tokens or
    /// different heads.
    ///
    /// | shard | group |
    /// |-------|-------|
    /// | [`Shard::Rows`], [`Shard::Cols`], [`Shard::RowBlocks`] with one copy | `dp_cp` |
    /// | [`Shard::Replicated`] (and [`Shard::RowsPadded`] with `V < tp`) | `dp_cp`, or `world` under sequence parallelism |
    /// | [`Shard::RowBlocks`]`(n)`, `n < tp` (KV heads replicated over `tp/n` TP ranks) | `dp_cp` × the `tp/n` TP ranks holding the block |
    /// | [`Shard::RowBlocks`]`(n)`, [`Shard::mixed_copies`] (10 KV heads over `tp = 4`) | `dp_cp`, after [`Shard::fold_copies`] over `tp` has summed each block's copies |
    ///
    /// The last group is made on first use, by a collective over `world` (every rank must ask
    /// for it at the same point, as [`crate::reduce_gradients`] does), and kept for reuse.
    pub fn grad_group(&self, shard: Shard) -> Result<Group> {
        let shard = shard.resolve(self.layout.tp);
        let copies = shard.copies(self.layout.tp);
        if self.grad_group_is_dp_cp(shard) {
            return Ok(self.dp_cp.clone());
        }
        if shard == Shard::Replicated {
            return Ok(self.world.clone());
        }
        if shard.mixed_copies(self.layout.tp) {
            return Ok(self.dp_cp.clone());
        }
        let mut cache = self
            .block_groups
            .lock()
            .map_err(|_| candle_core::Error::Msg("ParallelCtx: group cache lock poisoned".into()))?;
        if let Some((_, g)) = cache.iter().find(|(c, _)| *c == copies) {
            return Ok(g.clone());
        }
        let (dp_i, cp_i, tp_i) = self.coords;
        let key = (dp_i * self.layout.cp + cp_i) * copies + tp_i % copies;
        let g = self.world.split(shard.slice_index(self.layout.tp, tp_i), key)?;
        cache.push((copies, g.clone()));
        Ok(g)
    }

    /// Whether the sum of `shard`'s gradient shares is exactly one over `dp_cp` (the ZeRO-1
    /// replica group, whose sum a reduce-scatter can do:
    /// [`crate::train::AdamW::reduce_scatter_grads`]). Not for mixed KV-head copies, whose
    /// [`ParallelCtx::grad_group`] is `dp_cp` but after a fold over `tp`.
    pub fn grad_group_is_dp_cp(&self, shard: Shard) -> bool {
        let shard = shard.resolve(self.layout.tp);
        match shard {
            Shard::Replicated => !self.layout.seq_parallel(),
            _ => shard.copies(self.layout.tp) == 1,
        }
    }

    /// This rank's index in the EP group and the group's size (`(0, 1)` without EP): it holds
    /// experts `[i·E/ep, (i+1)·E/ep)`.
    pub fn ep_coords(&self) -> (usize, usize) {
        match &self.ep {
            Some(g) => (g.rank(), g.size()),
            None => (0, 1),
        }
    }

    /// The group over which the gradient shares of parameter `spec` are summed:
    /// [`ParallelCtx::grad_group`] of its TP split, except the stacked experts under expert
    /// parallelism ([`crate::params::ParamSpec::is_expert`]), summed over
    /// [`ParallelCtx::ep_dp`] (the ranks holding the same experts: the EP exchange's backward
    /// has already brought every EP rank's tokens to them).
    pub fn param_grad_group(&self, spec: &crate::params::ParamSpec) -> Result<Group> {
        if spec.is_expert() && self.ep.is_some() {
            return Ok(self.ep_dp.clone());
        }
        self.grad_group(spec.shard)
    }

    /// Whether [`ParallelCtx::param_grad_group`] of `spec` is `dp_cp` (see
    /// [`ParallelCtx::grad_group_is_dp_cp`]; never for the experts under expert parallelism).
    pub fn param_grad_group_is_dp_cp(&self, spec: &crate::params::ParamSpec) -> bool {
        !(spec.is_expert() && self.ep.is_some()) && self.grad_group_is_dp_cp(spec.shard)
    }

    /// A context for one device (`world` of size 1).
    pub fn single(world: Group) -> Result<Self> {
        Self::new(world, Layout::single())
    }

    /// The group over which token counts and losses are summed: ranks holding disjoint
    /// tokens (DP × CP, and TP too under sequence parallelism).
    pub fn token_group(&self) -> &Group {
        if self.layout.seq_parallel() {
            &self.world
        } else {
            &self.dp_cp
        }
    }
}

/// One rank's share of a global batch (see [`shard_batch`]).
#[derive(Clone, Debug)]
pub struct ShardedBatch {
    /// Token ids this rank embeds, `[B/dp, T_local]` u32.
    pub input_ids: Tensor,
    /// Next-token targets of those tokens, `[B/dp, T_local]` u32 (the global `input_ids`
    /// shifted left by one before sharding; [`IGNORE`] at the last global position).
    pub labels: Tensor,
    /// Global positions of those tokens, `[T_local]` u32. From
    /// [`crate::packed::shard_batch_packed`]: the RoPE position ids instead (position within
    /// the document), `[T_local]` when the documents are shared by all rows, else
    /// `[B/dp, T_local]`.
    pub positions: Tensor,
    /// Packed documents of this rank's rows (from [`crate::packed::shard_batch_packed`]):
    /// one entry shared by every row, or one per row (`B/dp`), each covering the GLOBAL
    /// length `T`. Empty for [`shard_batch`] (each row is one sequence).
    pub documents: Vec<candle_cp_ops::packing::Documents>,
}

/// Split a global batch `[B, T]` (u32 token ids, positions `0..T`) for this rank.
///
/// `T_local = T / (cp · tp)` under SP, `T / cp` otherwise; `B` must be divisible by `dp`,
/// `T` by what the CP layout needs (`2·cp` for zigzag) times `tp` under SP. Labels are built
/// from the GLOBAL sequence, so the target of a rank's last token (which lives on another
/// rank) is still right.
pub fn shard_batch(global_ids: &Tensor, ctx: &ParallelCtx) -> Result<ShardedBatch> {
    let (b, t) = global_ids.dims2()?;
    let ids = global_ids.to_dtype(DType::U32)?;
    let labels = if t > 1 {
        let tail = Tensor::full(IGNORE, (b, 1), ids.device())?;
        Tensor::cat(&[&ids.narrow(1, 1, t - 1)?, &tail], 1)?
    } else {
        Tensor::full(IGNORE, (b, t), ids.device())?
    };
    let pos = Tensor::arange(0u32, t as u32, ids.device())?;
    let mut parts = shard_tokens(&[ids, labels], &pos, b, t, ctx)?.into_iter();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(input_ids), Some(labels), Some(positions)) => Ok(ShardedBatch {
            input_ids,
            labels,
            positions,
            documents: Vec::new(),
        }),
        _ => bail!("shard_batch: internal error"),
    }
}

/// Shard `[B, T]` tensors (and `[T]` positions) for this rank; returns them in order, the
/// positions last: `[B/dp, T_local]` each, positions `[T_local]`.
pub(crate) fn shard_tokens(xs: &[Tensor], pos: &Tensor, b: usize, t: usize, ctx: &ParallelCtx) -> Result<Vec<Tensor>> {
    shard_tokens_sp(xs, pos, b, t, ctx, ctx.layout.seq_parallel())
}

/// The index `b·T + t` in the global batch `[B, T]` of each token of this rank's CP shard
/// (its TP region: the whole CP shard, not its SP piece), `[B/dp, Tc]` row-major, as
/// [`shard_batch`] places the tokens: what the LoRA adapters' dropout masks are keyed on.
pub fn token_indices(b: usize, t: usize, ctx: &ParallelCtx) -> Result<Vec<u64>> {
    indices_of(b, t, ctx, false)
}

/// [`token_indices`] of this rank's own tokens (its sequence piece under SP, as
/// [`shard_batch`] gives it the ids): what a token classifier's dropout is keyed on.
pub fn local_token_indices(b: usize, t: usize, ctx: &ParallelCtx) -> Result<Vec<u64>> {
    indices_of(b, t, ctx, ctx.layout.seq_parallel())
}

fn indices_of(b: usize, t: usize, ctx: &ParallelCtx, sp: bool) -> Result<Vec<u64>> {
    let n = b.checked_mul(t).filter(|&n| n <= u32::MAX as usize);
    let Some(n) = n else { bail!("token_indices: a [{b}, {t}] batch has more tokens than u32 indices") };
    let dev = candle_core::Device::Cpu;
    let idx = Tensor::arange(0u32, n as u32, &dev)?.reshape((b, t))?;
    let pos = Tensor::arange(0u32, t as u32, &dev)?;
    let parts = shard_tokens_sp(&[idx], &pos, b, t, ctx, sp)?;
    Ok(parts[0].flatten_all()?.to_vec1::<u32>()?.into_iter().map(u64::from).collect())
}

fn shard_tokens_sp(xs: &[Tensor], pos: &Tensor, b: usize, t: usize, ctx: &ParallelCtx, sp: bool) -> Result<Vec<Tensor>> {
    let l = &ctx.layout;
    let (dp_i, cp_i, tp_i) = ctx.coords;
    if !b.is_multiple_of(l.dp) {
        bail!("shard_batch: batch {b} (ids [{b}, {t}]) not divisible by dp = {}", l.dp)
    }
    let two_d = l.cp_kind == CpKind::TwoD;
    // 2-D: zigzag over the ring index, then contiguous over the Ulysses index
    let (outer, outer_i) = if two_d {
        (l.ring, cp_i / l.ulysses)
    } else {
        (l.cp, cp_i)
    };
    // one shard holds every token in order whatever the layout (zigzag of one rank is the
    // identity): no divisibility constraint on T (e.g. a single document of odd length)
    let seq = if outer == 1 { SeqLayout::Contiguous } else { l.cp_kind.seq_layout() };
    let tr = seq.local_len(t, outer)?;
    if two_d && tr % l.ulysses != 0 {
        bail!(
            "shard_batch: ring shard {tr} (T = {t}, ring = {}) not divisible by ulysses = {}",
            l.ring,
            l.ulysses
        )
    }
    let tc = if two_d { tr / l.ulysses } else { tr };
    if sp && tc % l.tp != 0 {
        bail!(
            "shard_batch: local length {tc} (T = {t}, cp = {}) not divisible by tp = {} for sequence parallelism",
            l.cp,
            l.tp
        )
    }
    let bl = b / l.dp;
    let split = |x: &Tensor, dim: usize| -> Result<Tensor> {
        let mut y = cpshard::shard(x, seq, outer_i, outer, dim)?;
        if two_d {
            y = y.narrow(dim, (cp_i % l.ulysses) * tc, tc)?.contiguous()?;
        }
        if sp {
            y = y.narrow(dim, tp_i * (tc / l.tp), tc / l.tp)?.contiguous()?;
        }
        Ok(y)
    };
    let mut out = Vec::with_capacity(xs.len() + 1);
    for x in xs {
        out.push(split(&x.narrow(0, dp_i * bl, bl)?, 1)?);
    }
    out.push(split(pos, 0)?);
    Ok(out)
}

#[cfg(test)]
#[path = "layout_tests.rs"]
mod tests;
