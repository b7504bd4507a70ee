//! [`RowParallelLinear`]: the input features split over the TP group (a child module of
//! `linear.rs`, whose input checks and GEMM helpers it shares).

use super::*;

/// Linear layer with the input features split over the TP group.
///
/// Rank `r` holds weight columns `[r·in/P, (r+1)·in/P)` (`[out, in/P]`) and the full bias
/// (replicated). Forward: `x` `[B, T, in/P]` (feature shard, e.g. the output of a
/// [`ColumnParallelLinear`]) → partial `x·Wᵣᵀ` `[B, T, out]`, then
/// - SP on: reduce-scatter along T (backward all-gather) → `[B, T/P, out]`;
/// - SP off: all-reduce (backward identity) → `[.., out]` replicated.
///
/// The bias is added after the reduction. With SP each rank adds it to its own rows only, so
/// its gradient is partial: [`GradSync::InBackward`] (default) all-reduces it over the TP
/// group during backward, [`GradSync::Deferred`] leaves the sum to the caller.
#[derive(Clone)]
pub struct RowParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    sync: GradSync,
    tp: Tp,
    /// A LoRA adapter ([`Self::with_lora`]).
    lora: Option<crate::Lora>,
}

impl RowParallelLinear {
    /// How the weight is split over TP (to shard a full checkpoint, [`crate::shard_for_tp`]).
    pub const WEIGHT_SHARD: Shard = Shard::Cols;
    /// How the bias is split over TP.
    pub const BIAS_SHARD: Shard = Shard::Replicated;

    /// This rank's shard from `vb`: `weight` `[out_dim, in_dim/P]` (and `bias` `[out_dim]` if
    /// `cfg.bias`). `in_dim` is the *global* input size; `in_dim % P == 0` required.
    pub fn new(vb: VarBuilder, in_dim: usize, out_dim: usize, cfg: LinearConfig, tp: &Tp) -> Result<Self> {
        let il = check_divisible("RowParallelLinear", in_dim, "in_dim", tp)?;
        let (weight, bias) = cfg.load(&vb, out_dim, il, in_dim)?;
        Ok(Self { weight, bias, sync: GradSync::InBackward, tp: tp.clone(), lora: None })
    }

    /// A layer of constants from the full `weight` `[out, in]` and optional `bias` `[out]`,
    /// keeping this rank's columns (not trainable: for training put the shards in a `VarMap`).
    pub fn from_full(weight: &Tensor, bias: Option<&Tensor>, tp: &Tp) -> Result<Self> {
        let (out_dim, in_dim) = weight.dims2()?;
        if !in_dim.is_multiple_of(tp.size()) {
            bail!("RowParallelLinear: weight {:?} has in = {in_dim}, not divisible by the TP size {}", weight.dims(), tp.size())
        }
        if let Some(b) = bias {
            if b.dims() != [out_dim] {
                bail!("RowParallelLinear: bias {:?} does not match weight {:?}", b.dims(), weight.dims())
            }
        }
        Ok(Self {
            weight: crate::shard_for_tp(weight, Self::WEIGHT_SHARD, tp)?,
            bias: bias.map(|b| b.detach().contiguous()).transpose()?,
            sync: GradSync::InBackward,
            tp: tp.clone(),
            lora: None,
        })
    }

    /// The same layer with a LoRA adapter: `A` `[r, in/P]` (this rank's columns, split as the
    /// weight), `B` `[out, r]` (replicated); the output gains `s·(Σ_TP x·Aᵀ)·Bᵀ`, the `r`-wide
    /// partial sums reduced as the output is. See [`crate::lora`].
    pub fn with_lora(mut self, lora: crate::Lora) -> Result<Self> {
        lora.check("RowParallelLinear", self.weight.dims()[1], self.weight.dims()[0])?;
        self.lora = Some(lora);
        Ok(self)
    }

    /// The LoRA adapter, if any.
    pub fn lora(&self) -> Option<&crate::Lora> {
        self.lora.as_ref()
    }

    /// The same layer for inference with its adapter merged into the weight (see
    /// [`ColumnParallelLinear::with_adapters_merged`]; collective over TP for DoRA).
    pub fn with_adapters_merged(&self) -> Result<Self> {
        let mut out = self.clone();
        if let Some(l) = &self.lora {
            out.weight = l.merged(&self.weight, crate::WeightSplit::Cols, &self.tp)?;
            out.lora = None;
        }
        Ok(out)
    }

    /// `y` plus the LoRA update of input `x`, if any (a DoRA adapter's is in the weight, or
    /// while it drops in the partial product, [`Self::partial`]).
    fn add_lora(&self, x: &Tensor, y: Tensor) -> Result<Tensor> {
        match &self.lora {
            Some(l) if l.magnitude().is_none() => y + crate::lora::row_delta(x, l, &self.tp)?,
            _ => Ok(y),
        }
    }

    /// This rank's partial product `x·Wᵀ` before the reduction, with the weight the forward
    /// computes with ([`Self::weight_used`]); plus a DoRA adapter's `drop(x)·(W' - W)ᵀ` while it
    /// drops ([`crate::dora`]: one reduction for both).
    fn partial(&self, x: &Tensor) -> Result<Tensor> {
        let y = affine(x, &self.weight_used()?, None)?;
        match self.dora_extra(x)? {
            Some((dw, mask)) => y + crate::masked_matmul(x, &dw, mask.as_ref())?,
            None => Ok(y),
        }
    }

    /// The bias as the lean nodes add it (after the reduction), and its gradient from the
    /// output's `g`: the sum over the rows, summed over TP in the backward under SP with
    /// [`GradSync::InBackward`] (each rank saw its rows), else this rank's share.
    #[allow(clippy::type_complexity)]
    fn lean_bias(&self) -> Option<(Tensor, Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>)> {
        let b = self.bias.clone()?;
        let (group, sum_tp) = (self.tp.group.clone(), self.tp.sequence_parallel && self.sync == GradSync::InBackward && self.tp.group.size() > 1);
        let dt = b.dtype();
        let grad = move |g: &Tensor| -> Result<Tensor> {
            let n = g.dim(candle_core::D::Minus1)?;
            let db = g.to_dtype(candle_core::DType::F32)?.reshape(((), n))?.sum(0)?;
            let db = if sum_tp { group.all_reduce(&db)? } else { db };
            db.to_dtype(dt)
        };
        Some((b, Arc::new(grad)))
    }

    /// The weight the forward computes with: the DoRA weight with a DoRA adapter
    /// ([`crate::dora`]), else this rank's shard.
    fn weight_used(&self) -> Result<Tensor> {
        match &self.lora {
            Some(l) => Ok(l.dora_weight(&self.weight, crate::WeightSplit::Cols, &self.tp)?.unwrap_or_else(|| self.weight.clone())),
            None => Ok(self.weight.clone()),
        }
    }

    /// The same layer (same weight tensors) with sequence parallelism `on` or off (see
    /// [`ColumnParallelLinear::with_sequence_parallel`]). Off, the output is all-reduced and
    /// replicated instead of reduce-scattered along the sequence.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.tp.sequence_parallel = on;
        self
    }

    /// Who sums the bias gradient over the TP group under SP (default [`GradSync::InBackward`]).
    pub fn with_grad_sync(mut self, sync: GradSync) -> Self {
        self.sync = sync;
        self
    }
    /// This rank's weight shard `[out, in/P]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    /// The (replicated) bias `[out]`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// `residual + self.forward(x)` as one graph node (the pre-norm residual branch): `x`
    /// `[B, T, in/P]`, `residual` the output's shape (`[B, T/P, out]` with SP, else
    /// `[.., out]`).
    ///
    /// Same values as the two ops, but candle's `add` node would keep the layer's output
    /// alive until the backward, which does not need it; this node keeps `x`, the weight and
    /// the residual only (the residual stays alive anyway, as the next norm's input). The
    /// reduction's partial sums are not kept either. Backward: `dresidual = g`; `g` all-gathered
    /// along the sequence (SP; identity without) gives `dx = g·W`, `dW = gᵀ·x`. An adapter's
    /// update is added inside the node (LoRA's after the reduction, DoRA's `W' - W` on the
    /// dropped input before it). A bias is added inside the node too (its gradient the output
    /// gradient's row sums, summed over TP under SP as [`Module::forward`] sums it).
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        self.forward_residual_scaled(x, residual, 1.0)
    }

    /// `residual + scale · self.forward(x)` as one graph node (Granite's `residual_multiplier`
    /// on each branch): [`RowParallelLinear::forward_residual`] with the branch scaled, its
    /// gradients from `scale · g` (the residual's `g`).
    pub fn forward_residual_scaled(&self, x: &Tensor, residual: &Tensor, scale: f64) -> Result<Tensor> {
        let w = self.weight_used()?;
        let extra = self.dora_extra(x)?;
        let (y, grads) = self.lean_parts(x, &w, extra.as_ref())?;
        let up = self.lean_update(x)?;
        if residual.dims() != y.dims() || residual.dtype() != y.dtype() {
            bail!(
                "RowParallelLinear::forward_residual: residual {:?} ({:?}) must match the output {:?} ({:?}) of input {:?}",
                residual.dims(),
                residual.dtype(),
                y.dims(),
                y.dtype(),
                x.dims()
            )
        }
        let bias = self.lean_bias();
        let out = match scale == 1.0 {
            // (the residual, the branch, then the bias: the unscaled node's order, kept)
            true => {
                let out = (residual.detach() + up.add_to(y)?)?;
                match &bias {
                    Some((b, _)) => out.broadcast_add(b)?,
                    None => out,
                }
            }
            false => {
                let branch = up.add_to(y)?;
                let branch = match &bias {
                    Some((b, _)) => branch.broadcast_add(b)?,
                    None => branch,
                };
                (residual.detach() + branch.affine(scale, 0.0)?)?
            }
        };
        let ub = up.clone();
        let b_grad = bias.as_ref().map(|(_, f)| f.clone());
        let bwd: BackwardFn = Arc::new(move |g: &Tensor| {
            let gs = if scale == 1.0 { g.clone() } else { g.affine(scale, 0.0)? };
            let (dx, dw, de) = grads(&gs)?;
            let mut v = vec![Some(dx), Some(dw), Some(g.clone())];
            v.extend(de.map(Some));
            v.extend(ub.grads(&gs)?);
            if let Some(f) = &b_grad {
                v.push(Some(f(&gs)?));
            }
            Ok(v)
        });
        let mut inputs = vec![x, &w, residual];
        inputs.extend(extra.as_ref().map(|(d, _)| d));
        inputs.extend(up.inputs());
        inputs.extend(bias.as_ref().map(|(b, _)| b));
        attach_n("RowParallelLinear::forward_residual", &inputs, out, bwd)
    }

    /// `self.forward(x)` as one graph node that keeps `x` and the weight only: the SP / TP
    /// reduction's partial sums (`[B, T, out]`, full length), which the collective's node of
    /// [`Module::forward`] keeps until the backward, are not kept. Same values and gradients
    /// (see [`RowParallelLinear::forward_residual`]); a bias is added inside the node.
    pub fn forward_lean(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight_used()?;
        let extra = self.dora_extra(x)?;
        let (y, grads) = self.lean_parts(x, &w, extra.as_ref())?;
        let up = self.lean_update(x)?;
        let mut y = up.add_to(y)?;
        let bias = self.lean_bias();
        if let Some((b, _)) = &bias {
            y = y.broadcast_add(b)?;
        }
        let ub = up.clone();
        let b_grad = bias.as_ref().map(|(_, f)| f.clone());
        let bwd: BackwardFn = Arc::new(move |g: &Tensor| {
            let (dx, dw, de) = grads(g)?;
            let mut v = vec![Some(dx), Some(dw)];
            v.extend(de.map(Some));
            v.extend(ub.grads(g)?);
            if let Some(f) = &b_grad {
                v.push(Some(f(g)?));
            }
            Ok(v)
        });
        let mut inputs = vec![x, &w];
        inputs.extend(extra.as_ref().map(|(d, _)| d));
        inputs.extend(up.inputs());
        inputs.extend(bias.as_ref().map(|(b, _)| b));
        attach_n("RowParallelLinear::forward_lean", &inputs, y, bwd)
    }

    /// A DoRA adapter's term the lean nodes add before their reduction while its dropout draws
    /// masks: `W' - W` (in the graph) and the mask of this rank's input features.
    fn dora_extra(&self, x: &Tensor) -> Result<Option<(Tensor, Option<MaskFn>)>> {
        match self.lora.as_ref().filter(|l| l.dora_drops()) {
            Some(l) => crate::lora::row_dora_update(x, l, &self.weight, &self.tp),
            None => Ok(None),
        }
    }

    /// The LoRA update the lean nodes add inside themselves: `v` (the adapter's reduced r-wide
    /// activations, in the graph) and `B`, or none (no adapter, or DoRA's in the weight).
    fn lean_update(&self, x: &Tensor) -> Result<LeanUpdate> {
        match self.lora.as_ref().filter(|l| l.magnitude().is_none()) {
            Some(l) => Ok(LeanUpdate(Some((crate::lora::row_v(x, l, &self.tp)?, l.b().clone(), l.scale())))),
            None => Ok(LeanUpdate(None)),
        }
    }

    /// The reduced output of `x` without a graph, and the backward of `x ↦ y` (`g` ↦ `(dx,
    /// dW, dΔ)`: `g` all-gathered along the sequence under SP, then the matrix products). With
    /// `extra` `(Δ, M)` the partial product gains `(x ⊙ M)·Δᵀ` before the one reduction (a DoRA
    /// adapter's `W' - W` on its dropped input, the mask drawn again in the backward).
    #[allow(clippy::type_complexity)]
    fn lean_parts(&self, x: &Tensor, w: &Tensor, extra: Option<&(Tensor, Option<MaskFn>)>) -> Result<(Tensor, Box<dyn Fn(&Tensor) -> Result<(Tensor, Tensor, Option<Tensor>)> + Send + Sync>)> {
        let sp = self.tp.sequence_parallel;
        check_input("RowParallelLinear", x, self.weight.dim(1)?, sp)?;
        let (xd, wd) = (x.detach(), w.detach());
        let extra = extra.map(|(d, m)| (d.detach(), m.clone()));
        // x ⊙ M (x without a mask)
        let masked = |xd: &Tensor, m: &Option<MaskFn>| candle_cp_ops::autograd::apply_mask_opt("RowParallelLinear", xd, m.as_ref());
        let partial = affine(&xd, &wd, None)?;
        let partial = match &extra {
            Some((d, m)) => (partial + affine(&masked(&xd, m)?.0, d, None)?)?,
            None => partial,
        };
        let group = self.tp.group.clone();
        let p = group.size();
        let y = if p == 1 {
            partial
        } else if sp {
            let n = partial.dim(SEQ_DIM)?;
            if n % p != 0 {
                bail!("RowParallelLinear: input {:?} has {n} rows, not divisible by the TP size {p} (sequence parallel)", x.dims())
            }
            group.reduce_scatter(&partial, SEQ_DIM)?
        } else {
            group.all_reduce(&partial)?
        };
        let grads = move |g: &Tensor| -> Result<(Tensor, Tensor, Option<Tensor>)> {
            let gf = if p > 1 && sp { group.all_gather(&g.detach(), SEQ_DIM)? } else { g.detach() };
            let (o, i) = wd.dims2()?;
            let lead = gf.elem_count() / o;
            let g2 = gf.reshape((lead, o))?;
            let (dx, dw) = affine_grads(&g2, &xd.reshape((lead, i))?, &wd)?;
            let (dx, de) = match &extra {
                Some((d, m)) => {
                    let (xm, m) = masked(&xd, m)?;
                    let (dxe, de) = affine_grads(&g2, &xm.reshape((lead, i))?, d)?;
                    let dxe = match m {
                        Some(m) => (dxe.reshape(xd.dims())? * m)?,
                        None => dxe.reshape(xd.dims())?,
                    };
                    ((dx.reshape(xd.dims())? + dxe)?, Some(de))
                }
                None => (dx.reshape(xd.dims())?, None),
            };
            Ok((dx, dw, de))
        };
        Ok((y, Box::new(grads)))
    }
}

/// A LoRA update `s·v·Bᵀ` a row-parallel lean node adds inside itself (`v` `[.., r]` in the
/// output's layout, `B` `[out, r]`): the node keeps `v` and `B`, not the `[.., out]` update or
/// its own output beside the sum (as an add after it would).
#[derive(Clone)]
struct LeanUpdate(Option<(Tensor, Tensor, f64)>);

impl LeanUpdate {
    /// `y + s·v·Bᵀ` (values only; the node's backward gives the gradients).
    fn add_to(&self, y: Tensor) -> Result<Tensor> {
        match &self.0 {
            Some((v, b, s)) => {
                let d = affine(&(v.detach() * *s)?, &b.detach(), None)?;
                if d.dims() != y.dims() {
                    bail!("RowParallelLinear: LoRA update {:?} (v {:?}, B {:?}) does not match the output {:?}", d.dims(), v.dims(), b.dims(), y.dims())
                }
                let d = d.to_dtype(y.dtype())?;
                y + d
            }
            None => Ok(y),
        }
    }

    /// The node's extra inputs: `v`, `B`.
    fn inputs(&self) -> Vec<&Tensor> {
        self.0.as_ref().map_or_else(Vec::new, |(v, b, _)| vec![v, b])
    }

    /// The gradients of `v` and `B` from the output's gradient `g`: `dv = s·g·B`, `dB = s·gᵀ·v`.
    fn grads(&self, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let Some((v, b, s)) = &self.0 else { return Ok(Vec::new()) };
        let (o, r) = b.dims2()?;
        let lead = g.elem_count() / o.max(1);
        let g2 = g.reshape((lead, o))?;
        let dv = (g2.matmul(&b.detach())? * *s)?.reshape(v.dims())?;
        let db = (g2.t()?.matmul(&v.detach().reshape((lead, r))?)? * *s)?;
        Ok(vec![Some(dv), Some(db)])
    }
}

impl Module for RowParallelLinear {
    /// `x` `[B, T, in/P]` → `[B, T/P, out]` (SP) or `[.., in/P]` → `[.., out]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let sp = self.tp.sequence_parallel;
        check_input("RowParallelLinear", x, self.weight.dim(1)?, sp)?;
        let partial = self.partial(x)?;
        let y = if sp {
            mappings::reduce_scatter_to_sp_region(&partial, &self.tp.group, SEQ_DIM)?
        } else {
            mappings::reduce_from_tp_region(&partial, &self.tp.group)?
        };
        let y = self.add_lora(x, y)?;
        match &self.bias {
            None => Ok(y),
            Some(b) if sp && self.sync == GradSync::InBackward => {
                y.broadcast_add(&mappings::copy_to_tp_region(b, &self.tp.group)?)
            }
            Some(b) => y.broadcast_add(b),
        }
    }
}
