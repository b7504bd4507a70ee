//! Column- and row-parallel linear layers (Megatron-LM), with or without sequence parallelism.
//!
//! Weights follow candle-nn / PyTorch: `weight` `[out, in]`, `bias` `[out]`, `y = x·Wᵀ + b`.
//! A layer holds **only this rank's shard** and takes it from a `VarBuilder` under the usual
//! candle names (`weight`, `bias`), with the *local* shape:
//!
//! | layer                    | `weight`     | `bias`                 |
//! |--------------------------|--------------|------------------------|
//! | [`ColumnParallelLinear`] | `[out/P, in]`| `[out/P]` (rows)       |
//! | [`RowParallelLinear`]    | `[out, in/P]`| `[out]` (replicated)   |
//!
//! With `VarBuilder::from_varmap` the shards are `Var`s of the caller's `VarMap` (what an
//! optimizer or a checkpoint saver walks); fill that `VarMap` from a full checkpoint with
//! [`crate::shard_for_tp`] and the layer's `WEIGHT_SHARD` / `BIAS_SHARD`. `from_full`
//! slices full tensors into a layer of constants (inference, tests).
//!
//! Gradients after `backward()` (TP group of size `P`, with or without SP): every weight
//! shard and the column-parallel bias hold the full gradient of this rank's slice (nothing
//! to sum over TP; sum over data-parallel replicas as usual). The replicated row-parallel
//! bias: without SP every rank holds the full gradient; with SP see [`GradSync`].

use crate::{GradSync, Shard, Tp};
use candle_core::{bail, Module, Result, Tensor};
use candle_cp_ops::autograd::{attach_n, BackwardFn, MaskFn};
use candle_cp_ops::mappings::{self, SEQ_DIM};
use std::sync::Arc;
use candle_nn::{Init, VarBuilder};

/// Construction options of [`ColumnParallelLinear`] and [`RowParallelLinear`].
#[derive(Clone, Copy, Debug)]
pub struct LinearConfig {
    /// Whether the layer has a bias.
    pub bias: bool,
    /// Init of a weight shard the `VarBuilder` creates (fresh `VarMap`); `None`: Kaiming
    /// normal over the *global* fan-in, `N(0, 2/in)`, as candle-nn's `linear`. Biases the
    /// builder creates start at zero (so the replicated row-parallel bias agrees on ranks).
    pub init: Option<Init>,
}

impl LinearConfig {
    /// With or without bias, default init.
    pub fn new(bias: bool) -> Self {
        Self { bias, init: None }
    }
    /// Set the weight init used when the builder creates the shard.
    pub fn with_init(mut self, init: Init) -> Self {
        self.init = Some(init);
        self
    }
    fn weight_init(&self, in_dim: usize) -> Init {
        self.init.unwrap_or(Init::Randn { mean: 0.0, stdev: (2.0 / in_dim.max(1) as f64).sqrt() })
    }
    /// `weight` `[out, in]` from `vb` (`in_dim` global, for the init) and, if `self.bias`,
    /// `bias` `[out]` (zeros).
    fn load(&self, vb: &VarBuilder, out: usize, in_local: usize, in_dim: usize) -> Result<(Tensor, Option<Tensor>)> {
        let weight = vb.get_with_hints((out, in_local), "weight", self.weight_init(in_dim))?;
        let bias = if self.bias { Some(vb.get_with_hints(out, "bias", Init::Const(0.0))?) } else { None };
        Ok((weight, bias))
    }
}

/// The input and weight gradients of `x·wᵀ`: `g·w` and `gᵀ·x`, for `g` `[lead, out]`, `x`
/// `[lead, in]` (flattened leading dims), `w` `[out, in]`.
pub(crate) fn affine_grads(g: &Tensor, x: &Tensor, w: &Tensor) -> Result<(Tensor, Tensor)> {
    Ok((g.matmul(w)?, g.t()?.matmul(x)?))
}

/// `x·wᵀ (+ b)` for `x` `[.., in]`, `w` `[out, in]`: one GEMM over the flattened leading dims.
pub(crate) fn affine(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let last = dims.len() - 1;
    let (o, i) = w.dims2()?;
    let lead: usize = dims[..last].iter().product();
    let y = x.reshape((lead, i))?.matmul(&w.t()?)?;
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    dims[last] = o;
    y.reshape(dims)
}

fn check_input(what: &str, x: &Tensor, in_dim: usize, sp: bool) -> Result<()> {
    candle_cp_comm::ensure_nonempty(what, "input", x)?;
    let ok = if sp { x.rank() >= 3 } else { x.rank() >= 2 };
    if !ok || x.dim(x.rank() - 1)? != in_dim {
        let shape = if sp { format!("[B, T, .., {in_dim}]") } else { format!("[.., {in_dim}]") };
        bail!("{what}: input {:?} must be {shape}", x.dims())
    }
    Ok(())
}

fn check_divisible(what: &str, n: usize, dim_name: &str, tp: &Tp) -> Result<usize> {
    if !n.is_multiple_of(tp.size()) {
        bail!("{what}: {dim_name} = {n} is not divisible by the TP size {}", tp.size())
    }
    Ok(n / tp.size())
}

#[derive(Clone)]
struct Part {
    weight: Tensor,
    bias: Option<Tensor>,
}

/// Linear layer with the output features split over the TP group.
///
/// Rank `r` holds weight rows `[r·out/P, (r+1)·out/P)` (`[out/P, in]`) and the same slice of
/// the bias. Forward:
/// - SP on: `x` `[B, T/P, in]` (sequence shard) → all-gather along T (backward
///   reduce-scatter) → `[B, T, in]` → `y` `[B, T, out/P]`.
/// - SP off: `x` `[.., in]` (replicated) → `copy_to_tp_region` (backward all-reduce) →
///   `y` `[.., out/P]`.
///
/// The output is feature-sharded (e.g. this rank's attention heads when `out = H·D`).
///
/// A layer may be *fused* from several parts sharing the input (Q, K, V projections; gate and
/// up of a gated MLP), each with its own `weight` `[out_i/P, in]` under its own name: the
/// input is gathered once for all parts ([`Self::new_fused`], [`Self::forward_parts`]).
///
/// Memory: `Module::forward` and [`Self::forward_parts_regathered`] keep only the input
/// shard for the backward, which gathers it again (Megatron-LM); [`Self::forward_parts`]
/// keeps the gathered input.
#[derive(Clone)]
pub struct ColumnParallelLinear {
    parts: Vec<Part>,
    in_dim: usize,
    tp: Tp,
    /// LoRA adapters, one per part (empty: none; [`Self::with_lora`]).
    lora: Vec<Option<crate::Lora>>,
}

impl ColumnParallelLinear {
    /// How the weight is split over TP (to shard a full checkpoint, [`crate::shard_for_tp`]).
    pub const WEIGHT_SHARD: Shard = Shard::Rows;
    /// How the bias is split over TP.
    pub const BIAS_SHARD: Shard = Shard::Rows;

    /// This rank's shard from `vb`: `weight` `[out_dim/P, in_dim]` (and `bias` `[out_dim/P]`
    /// if `cfg.bias`). `out_dim` is the *global* output size; `out_dim % P == 0` required.
    pub fn new(vb: VarBuilder, in_dim: usize, out_dim: usize, cfg: LinearConfig, tp: &Tp) -> Result<Self> {
        Self::new_fused(&[(vb, out_dim)], in_dim, cfg, tp)
    }

    /// One layer of several parts sharing the input: part `i` takes `weight`
    /// `[out_i/P, in_dim]` (and `bias` `[out_i/P]`) from its own builder `vbs[i].0`
    /// (`vbs[i].1 = out_i`, global). Split the output with [`Self::forward_parts`].
    pub fn new_fused(vbs: &[(VarBuilder, usize)], in_dim: usize, cfg: LinearConfig, tp: &Tp) -> Result<Self> {
        let parts: Vec<_> = vbs.iter().map(|(vb, o)| (vb.clone(), *o, Self::WEIGHT_SHARD)).collect();
        Self::new_fused_sharded(&parts, in_dim, cfg, tp)
    }

    /// [`Self::new_fused`] with each part's own row split: [`Shard::Rows`], or
    /// [`Shard::RowBlocks`]`(n)` for a part made of `n` heads, which replicates each head over
    /// `P/n` ranks when there are fewer heads than ranks (K/V of a GQA model with fewer KV
    /// heads than the TP size), and copies each `lcm(n, P)/n` times when neither divides the
    /// other. Part `i` then takes `weight` `[out_i/P, in]` or, with copies,
    /// `[out_i/n · lcm(n, P)/P, in]` ([`crate::blocks_per_rank`]). A copied part's weight (and
    /// bias) gradient is this copy's share: sum it over the ranks holding the same block
    /// ([`Shard::copies`], [`Shard::slice_index`]) or, with [`Shard::mixed_copies`], by
    /// [`Shard::fold_copies`].
    pub fn new_fused_sharded(vbs: &[(VarBuilder, usize, Shard)], in_dim: usize, cfg: LinearConfig, tp: &Tp) -> Result<Self> {
        if vbs.is_empty() {
            bail!("ColumnParallelLinear: no parts given")
        }
        let mut parts = Vec::with_capacity(vbs.len());
        for (vb, out_dim, shard) in vbs {
            let ol = match shard {
                Shard::Rows => check_divisible("ColumnParallelLinear", *out_dim, "out_dim", tp)?,
                Shard::RowBlocks(_) => shard
                    .local_shape(&[*out_dim, in_dim], tp.size())
                    .map_err(|e| candle_core::Error::Msg(format!("ColumnParallelLinear: out_dim = {out_dim}: {e}")))?
                    .dims()[0],
                other => bail!("ColumnParallelLinear: a part split as {other:?}; parts are split by rows"),
            };
            let (weight, bias) = cfg.load(vb, ol, in_dim, in_dim)?;
            parts.push(Part { weight, bias });
        }
        Ok(Self { parts, in_dim, tp: tp.clone(), lora: Vec::new() })
    }

    /// The same layer with LoRA adapters, `adapters[i]` on part `i` (`None`: none), each
    /// `A` `[r, in]` (replicated over TP) and `B` `[out_i/P, r]` (this rank's rows of the part,
    /// split as its weight): part `i`'s output gains `s·(x·Aᵀ)·Bᵀ` before its output map.
    /// See [`crate::lora`] for the split and the factors' gradients.
    pub fn with_lora(mut self, adapters: Vec<Option<crate::Lora>>) -> Result<Self> {
        if adapters.len() != self.parts.len() {
            bail!("ColumnParallelLinear: {} LoRA adapters for {} parts", adapters.len(), self.parts.len())
        }
        for (p, l) in self.parts.iter().zip(&adapters) {
            if let Some(l) = l {
                l.check("ColumnParallelLinear", self.in_dim, p.weight.dims()[0])?;
            }
        }
        self.lora = if adapters.iter().any(|l| l.is_some()) { adapters } else { Vec::new() };
        Ok(self)
    }

    /// Part `i`'s LoRA adapter, if any.
    pub fn lora(&self, i: usize) -> Option<&crate::Lora> {
        self.lora.get(i).and_then(|l| l.as_ref())
    }

    /// The same layer for inference with each part's adapter merged into its weight (`W +
    /// s·B·A`, or DoRA's weight; detached: no parameter is left to train) and no adapters: the
    /// same outputs without the adapters' work in every forward. Itself without adapters.
    pub fn with_adapters_merged(&self) -> Result<Self> {
        let mut out = self.clone();
        for (i, p) in out.parts.iter_mut().enumerate() {
            if let Some(l) = self.lora(i) {
                p.weight = l.merged(&p.weight, crate::WeightSplit::Rows, &self.tp)?;
            }
        }
        out.lora = Vec::new();
        Ok(out)
    }

    /// A layer of constants from the full `weight` `[out, in]` and optional `bias` `[out]`,
    /// keeping this rank's rows (not trainable: for training put the shards in a `VarMap`).
    pub fn from_full(weight: &Tensor, bias: Option<&Tensor>, tp: &Tp) -> Result<Self> {
        Self::from_full_parts(&[weight], bias.map(|b| vec![b]).as_deref(), tp)
    }

    /// [`Self::from_full`] for several parts: full weights `[out_i, in]` (and biases `[out_i]`).
    pub fn from_full_parts(weights: &[&Tensor], biases: Option<&[&Tensor]>, tp: &Tp) -> Result<Self> {
        let Some(first) = weights.first() else { bail!("ColumnParallelLinear: no weights given") };
        let in_dim = first.dims2()?.1;
        if let Some(bs) = biases {
            if bs.len() != weights.len() {
                bail!("ColumnParallelLinear: {} biases for {} weights", bs.len(), weights.len())
            }
        }
        let mut parts = Vec::with_capacity(weights.len());
        for (i, w) in weights.iter().enumerate() {
            let (out_dim, in_i) = w.dims2()?;
            if in_i != in_dim {
                bail!("ColumnParallelLinear: part {i} weight {:?} has in = {in_i}, part 0 has {in_dim}", w.dims())
            }
            if !out_dim.is_multiple_of(tp.size()) {
                bail!("ColumnParallelLinear: weight {:?} has out = {out_dim}, not divisible by the TP size {}", w.dims(), tp.size())
            }
            let bias = match biases.map(|bs| bs[i]) {
                Some(b) if b.dims() != [out_dim] => {
                    bail!("ColumnParallelLinear: bias {:?} does not match weight {:?}", b.dims(), w.dims())
                }
                Some(b) => Some(crate::shard_for_tp(b, Self::BIAS_SHARD, tp)?),
                None => None,
            };
            parts.push(Part { weight: crate::shard_for_tp(w, Self::WEIGHT_SHARD, tp)?, bias });
        }
        Ok(Self { parts, in_dim, tp: tp.clone(), lora: Vec::new() })
    }

    /// The same layer (same weight tensors) with sequence parallelism `on` or off. Off, the
    /// input is the whole sequence, replicated on the TP ranks: what one-token decode steps
    /// need after SP training, whose `T = 1` cannot be split.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.tp.sequence_parallel = on;
        self
    }

    /// Local output features of each part (`out_i/P`).
    pub fn part_sizes(&self) -> Vec<usize> {
        self.parts.iter().map(|p| p.weight.dims()[0]).collect()
    }

    /// Forward (one input gather for all parts), returning each part's output `[.., out_i/P]`.
    /// The plain graph: it keeps the gathered input until the backward (`P` times the shard
    /// under SP); [`ColumnParallelLinear::forward_parts_regathered`] keeps only the shard.
    pub fn forward_parts(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        check_input("ColumnParallelLinear", x, self.in_dim, self.tp.sequence_parallel)?;
        let xg = if self.tp.sequence_parallel {
            mappings::gather_from_sp_region(x, &self.tp.group, SEQ_DIM)?
        } else {
            mappings::copy_to_tp_region(x, &self.tp.group)?
        };
        let ws = self.weights()?;
        let ys: Vec<Tensor> = self.parts.iter().zip(&ws).map(|(p, w)| affine(&xg, w, p.bias.as_ref())).collect::<Result<_>>()?;
        self.add_lora(x, ys)
    }

    /// The parts' weights the forward computes with: each DoRA part's DoRA weight
    /// ([`crate::dora`]), the others' as they are.
    fn weights(&self) -> Result<Vec<Tensor>> {
        self.parts
            .iter()
            .enumerate()
            .map(|(i, p)| match self.lora(i) {
                Some(l) => Ok(l.dora_weight(&p.weight, crate::WeightSplit::Rows, &self.tp)?.unwrap_or_else(|| p.weight.clone())),
                None => Ok(p.weight.clone()),
            })
            .collect()
    }

    /// Each adapted part's output plus its LoRA update (computed from the input `x` as given;
    /// a DoRA part's adapter is in its weight already, but while it drops its `(W' - W)·x̃`).
    fn add_lora(&self, x: &Tensor, ys: Vec<Tensor>) -> Result<Vec<Tensor>> {
        if self.lora.is_empty() {
            return Ok(ys);
        }
        ys.into_iter()
            .enumerate()
            .map(|(i, y)| match self.lora(i) {
                Some(l) if l.magnitude().is_none() => y + crate::lora::column_delta(x, l, &self.tp)?,
                Some(l) if l.dora_drops() => crate::lora::plus(y, crate::lora::column_dora_delta(x, l, &self.parts[i].weight, &self.tp)?),
                _ => Ok(y),
            })
            .collect()
    }

    /// [`ColumnParallelLinear::forward_parts`] whose graph keeps only `x` (the sequence shard
    /// with SP), not the gathered input, and applies `posts[i]` (if any) to part `i`'s output
    /// inside its node (Megatron-LM's re-gather in the backward; see the `regather` module
    /// doc). `posts` is empty or one entry per part. Same values and gradients as
    /// [`ColumnParallelLinear::forward_parts`] (parts whose output is unused add nothing).
    pub fn forward_parts_regathered(&self, x: &Tensor, posts: &[Option<crate::PartPost>]) -> Result<Vec<Tensor>> {
        check_input("ColumnParallelLinear", x, self.in_dim, self.tp.sequence_parallel)?;
        if !posts.is_empty() && posts.len() != self.parts.len() {
            bail!("ColumnParallelLinear: {} output maps for {} parts", posts.len(), self.parts.len())
        }
        let ws = self.weights()?;
        // an adapter's update inside its part's node, before the output map, from the gathered
        // input: LoRA's s·(x̃·Aᵀ)·Bᵀ, or DoRA's (W' - W)·x̃ while it drops; the graph keeps the
        // adapter's weights only (no [T, out] tensor, no mask)
        let updates = (0..self.parts.len())
            .map(|i| match self.lora(i) {
                Some(l) => crate::lora::column_update(x, l, &self.parts[i].weight, &self.tp),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        crate::regather::regathered_parts(x, self.part_refs(&ws, posts, updates), &self.tp.group, self.tp.sequence_parallel)
    }

    /// The parts for [`crate::regather::regathered_parts`] with weights `ws` ([`Self::weights`]),
    /// `posts` (empty or one each) and `updates` (one each).
    fn part_refs<'a>(&'a self, ws: &'a [Tensor], posts: &[Option<crate::PartPost>], updates: Vec<Option<crate::regather::PartUpdate>>) -> Vec<crate::regather::PartRef<'a>> {
        self
            .parts
            .iter()
            .zip(ws)
            .zip(updates)
            .enumerate()
            .map(|(i, ((p, w), update))| crate::regather::PartRef { weight: w, bias: p.bias.as_ref(), post: posts.get(i).cloned().flatten(), update })
            .collect()
    }

    /// This rank's weight shard `[out/P, in]` (of part 0 when fused).
    pub fn weight(&self) -> &Tensor {
        &self.parts[0].weight
    }
    /// This rank's bias shard `[out/P]` (of part 0 when fused).
    pub fn bias(&self) -> Option<&Tensor> {
        self.parts[0].bias.as_ref()
    }
    /// Weight `[out_i/P, in]` and bias `[out_i/P]` of part `i`.
    pub fn part(&self, i: usize) -> Option<(&Tensor, Option<&Tensor>)> {
        self.parts.get(i).map(|p| (&p.weight, p.bias.as_ref()))
    }
    /// Local output features `Σ out_i/P`.
    pub fn out_local(&self) -> usize {
        self.part_sizes().iter().sum()
    }
}

impl Module for ColumnParallelLinear {
    /// `x` `[B, T/P, in]` (SP) or `[.., in]` → `[B, T, out/P]` / `[.., out/P]` (parts
    /// concatenated along the last dim when fused).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // every part reaches the output (concatenated): the re-gathering form is safe
        let mut ys = self.forward_parts_regathered(x, &[])?;
        if ys.len() == 1 {
            return Ok(ys.remove(0));
        }
        let last = ys[0].rank() - 1;
        Tensor::cat(&ys, last)
    }
}

#[path = "linear_row.rs"]
mod row;
pub use row::RowParallelLinear;
