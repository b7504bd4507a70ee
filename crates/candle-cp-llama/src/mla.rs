//! DeepSeek's multi-head latent attention on the layout's ranks ([`crate::config::deepseek`]):
//! the query, key and value of one layer from the compressed latents, ready for
//! [`crate::attn`] (every CP kind, Ulysses, 2-D) and for generation's KV cache.
//!
//! Shapes on one rank (`Ts` the tokens it holds, `Tc` its CP shard's: `Ts = Tc / tp` under
//! SP; `Hl = H / tp` heads):
//!
//! ```text
//!  x [B, Ts, h] ─ q_a_proj (replicated) ─ rms ─ q_b_proj (column-parallel: gather) ─ q [B, Tc, Hl, nope+rope]
//!               └ kv_a_proj_with_mqa (replicated) ─┬ c [B, Ts, rkv] ─ rms ─ kv_b_proj (column-parallel) ─ k_nope, v [B, Tc, Hl, ·]
//!                                                  └ kr [B, Ts, rope] ─ gather (SP) ─ RoPE ─ one key part for every head
//! ```
//!
//! The down-projections run on the rank's own tokens (its sequence shard under SP; Megatron's
//! form, which moves the narrow latents rather than `h`-wide rows) with replicated weights,
//! whose gradient each TP rank holds for its tokens and [`crate::reduce_gradients`] sums over TP
//! with the norms'. Without SP the column-parallel inputs and the shared key part go through
//! `copy_to_tp_region`, so every TP rank holds the whole gradient, as a norm's there.
//!
//! The attention runs at `D = max(nope + rope, v)` (on CUDA the next head dim the kernels take,
//! [`candle_cp_ops::attention::kernel_head_dim`]: DeepSeek's 192 at 256): the narrower of the
//! value or the query and key is padded with zeros (they change neither the scores nor the
//! output), the output's first `v` dimensions kept — transformers' padding for flash attention.
//!
//! Generation caches the latent rows instead of k and v (`MlaAttn::latent_rows`: `rkv + rope`
//! values per token, shared by the heads) and decodes in DeepSeek's absorbed form
//! (`MlaAttn::absorbed_query`, `absorbed_out`): every query head attends to the one latent "KV
//! head" at width `rkv + rope`, `W_uk` folded into the query and `W_uv` applied to the output.

use crate::config::deepseek::Mla;
use crate::model::linear;
use candle_core::{bail, DType, Module, Result, Tensor, D};
use candle_cp_nn::{ColumnParallelLinear, Lora, PartMap, PartPost, RmsNorm, Tp};
use candle_cp_ops::autograd::{attach1, attach2, BackwardFn};
use candle_cp_ops::mappings;
use std::sync::Arc;

/// The latent attention's own weights of one layer (the query's up-projection is the block's
/// `qkv` linear, o_proj its `o`).
#[derive(Clone)]
pub(crate) struct MlaAttn {
    /// `q_a_proj` `[rq, h]` (replicated), its LoRA adapter if a target, and `q_a_layernorm`
    /// (`None`: `q_proj` from `x`).
    pub(crate) q_down: Option<(Tensor, Option<Lora>, RmsNorm)>,
    /// `kv_a_proj_with_mqa` `[rkv + rope, h]` (replicated).
    pub(crate) kv_down: Tensor,
    /// `kv_a_proj_with_mqa`'s LoRA adapter, if a target.
    pub(crate) kv_down_lora: Option<Lora>,
    /// `kv_a_layernorm` `[rkv]`.
    pub(crate) kv_norm: RmsNorm,
    /// `kv_b_proj`, this rank's heads `[Hl·(nope + v), rkv]`.
    pub(crate) kv_up: ColumnParallelLinear,
    /// The widths.
    pub(crate) dims: Mla,
    /// This TP rank's heads `Hl`.
    pub(crate) heads: usize,
    /// The TP group and whether SP is on.
    pub(crate) tp: Tp,
}

impl MlaAttn {
    /// The same layer with sequence parallelism off (generation).
    pub(crate) fn without_sp(&self) -> MlaAttn {
        MlaAttn { kv_up: self.kv_up.clone().with_sequence_parallel(false), tp: Tp::new(self.tp.group.clone(), false), ..self.clone() }
    }

    /// The same layer with every adapter merged into its weight (`W + s·B·A`, detached).
    pub(crate) fn with_adapters_merged(&self) -> Result<MlaAttn> {
        let merge = |w: &Tensor, l: &Option<Lora>| -> Result<Tensor> {
            match l {
                Some(l) => candle_cp_nn::lora::merged_weight(w, l.a(), l.b(), l.magnitude(), l.scale(), candle_cp_nn::WeightSplit::Rows, &self.tp),
                None => Ok(w.clone()),
            }
        };
        let q_down = match &self.q_down {
            Some((w, l, n)) => Some((merge(w, l)?, None, n.clone())),
            None => None,
        };
        Ok(MlaAttn { q_down, kv_down: merge(&self.kv_down, &self.kv_down_lora)?, kv_down_lora: None, kv_up: self.kv_up.with_adapters_merged()?, ..self.clone() })
    }

    /// A replicated down-projection of the rows `x` this rank holds, with its adapter
    /// (LoRA or DoRA, [`candle_cp_nn::replicated_forward`]).
    fn down(&self, x: &Tensor, w: &Tensor, lora: &Option<Lora>) -> Result<Tensor> {
        match lora {
            Some(l) => candle_cp_nn::replicated_forward(x, w, l, &self.tp),
            None => linear(x, w),
        }
    }

    /// q, k, v `[B, Tc, Hl, D]` (`D` = [`Mla::attn_dim`]) of the normed input `x` `[B, Ts, h]`
    /// with `q_up` the query's up-projection (`q_b_proj`, or `q_proj` from `x`) and RoPE tables
    /// `cos`, `sin` `[Tc, rope]` (or `[B, Tc, rope]`) of the CP shard's positions. `regather`
    /// (training): the column-parallel layers keep only their input's shard for the backward.
    ///
    /// What the graph keeps (a candle node keeps its inputs): the latents and their norms'
    /// outputs (`[B, Ts, ·]`), `kv_b_proj`'s output, the key's rotated part `[B, Tc, 1, rope]`
    /// and q, k, v. The query is rotated, reordered and padded inside `q_up`'s node
    /// ([`candle_cp_nn::PartPost`]: its output is not kept), k and v are one node each over
    /// `kv_b_proj`'s output, with hand-written transposes.
    pub(crate) fn qkv(&self, x: &Tensor, q_up: &ColumnParallelLinear, heads: usize, tables: (&Tensor, &Tensor), regather: bool) -> Result<(Tensor, Tensor, Tensor)> {
        let (q, k, v, _) = self.qkv_inner(x, q_up, heads, tables, regather, false)?;
        Ok((q, k, v))
    }

    /// Generation's prefill: [`MlaAttn::qkv`] (no regathering) and the latent rows of the same
    /// input (what [`MlaAttn::latent_rows`] returns for it) from the same `kv_a_proj_with_mqa`
    /// output, which runs once. The rows are part of the graph; detach them to keep them.
    pub(crate) fn qkv_rows(&self, x: &Tensor, q_up: &ColumnParallelLinear, heads: usize, tables: (&Tensor, &Tensor)) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        match self.qkv_inner(x, q_up, heads, tables, false, true)? {
            (q, k, v, Some(rows)) => Ok((q, k, v, rows)),
            (q, k, v, None) => Ok((q, k, v, self.latent_rows(x, tables)?)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn qkv_inner(&self, x: &Tensor, q_up: &ColumnParallelLinear, heads: usize, (cos, sin): (&Tensor, &Tensor), regather: bool, rows: bool) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
        let a = self.dims;
        // (on CUDA a width the kernels take: 192 runs at 256)
        let d = candle_cp_ops::attention::kernel_head_dim(a.attn_dim(), x.device());
        let (nope, dr, dv, r) = (a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank);
        let (b, _, hidden) = x.dims3()?;
        if self.kv_down.dims() != [r + dr, hidden] {
            bail!("latent attention: x {:?} does not fit kv_a_proj_with_mqa {:?} ([{} + {dr}, h])", x.dims(), self.kv_down.dims(), r)
        }
        let tc = cos.dim(cos.rank() - 2)?;
        let (c4, s4) = crate::fused::tables4(cos, sin, tc, dr, x.dtype())?;
        let up = |lin: &ColumnParallelLinear, x: &Tensor, post: Option<PartPost>| -> Result<Tensor> {
            let mut parts = match (regather, &post) {
                (true, _) => lin.forward_parts_regathered(x, std::slice::from_ref(&post))?,
                // (no backward: the map on the output)
                (false, Some(p)) => lin.forward_parts(x)?.iter().map(|y| (p.fwd)(y)).collect::<Result<Vec<_>>>()?,
                (false, None) => lin.forward_parts(x)?,
            };
            match parts.len() {
                1 => Ok(parts.remove(0)),
                n => bail!("latent attention: an up-projection of {n} parts (x {:?})", x.dims()),
            }
        };
        // the query: [nope | RoPE(rope)] per head, padded to D, inside q_up's node
        let (cf, sf, cb, sb) = (c4.clone(), s4.clone(), c4, s4);
        let fwd: PartMap = Arc::new(move |y: &Tensor| {
            let (yb, yt, o) = y.dims3()?;
            if o != heads * a.qk_head_dim() || yt != tc {
                bail!("latent attention: q projection {:?} does not fit {heads} heads of {} over {tc} positions", y.dims(), a.qk_head_dim())
            }
            let q = y.reshape((yb, yt, heads, a.qk_head_dim()))?;
            let rot = crate::fused::rope4(&rope_order(&q.narrow(3, nope, dr)?, a.rope_interleave, false)?, &cf, &sf)?;
            pad(Tensor::cat(&[&q.narrow(3, 0, nope)?, &rot], 3)?, d)
        });
        let bwd: PartMap = Arc::new(move |dq: &Tensor| {
            let rot = rope_order(&crate::fused::rope4_t(&dq.narrow(3, nope, dr)?, &cb, &sb)?, a.rope_interleave, true)?;
            Tensor::cat(&[&dq.narrow(3, 0, nope)?, &rot], 3)
        });
        let post = PartPost { fwd, bwd };
        let q = match &self.q_down {
            Some((w, lora, norm)) => up(q_up, &norm.forward(&self.down(x, w, lora)?)?, Some(post))?,
            None => up(q_up, x, Some(post))?,
        };
        let ckv = self.down(x, &self.kv_down, &self.kv_down_lora)?;
        let c = self.kv_norm.forward(&ckv.narrow(2, 0, r)?)?;
        let kv = up(&self.kv_up, &c, None)?.reshape((b, tc, heads, nope + dv))?;
        // the key's RoPE part: the whole CP shard on every TP rank (gathered under SP; without
        // SP each rank's heads give part of its gradient, summed in the backward)
        let kr = ckv.narrow(2, r, dr)?;
        let kr = match (self.tp.size() > 1, self.tp.sequence_parallel) {
            (false, _) => kr,
            (true, true) => mappings::gather_from_sp_region(&kr.contiguous()?, &self.tp.group, mappings::SEQ_DIM)?,
            (true, false) => mappings::copy_to_tp_region(&kr, &self.tp.group)?,
        };
        let kr = crate::fused::apply_rope(&rope_order(&kr.reshape((b, tc, 1, dr))?, a.rope_interleave, false)?, cos, sin)?;
        // k = [k_nope | kr for every head], v: each padded to D, one node each over kv
        let (kvd, krd) = (kv.detach(), kr.detach());
        let k = pad(Tensor::cat(&[&kvd.narrow(3, 0, nope)?, &krd.broadcast_as((b, tc, heads, dr))?], 3)?, d)?;
        let k_bwd: BackwardFn = Arc::new(move |dk: &Tensor| {
            let dkv = Tensor::cat(&[&dk.narrow(3, 0, nope)?, &Tensor::zeros((b, tc, heads, dv), dk.dtype(), dk.device())?], 3)?;
            // (the key's shared part: its heads' gradients summed, in f32)
            let dkr = dk.narrow(3, nope, dr)?.to_dtype(DType::F32)?.sum_keepdim(2)?.to_dtype(dk.dtype())?;
            Ok(vec![Some(dkv), Some(dkr)])
        });
        let k = attach2("mla_key", &kv, &kr, k, k_bwd)?;
        let v = pad(kvd.narrow(3, nope, dv)?, d)?;
        let v_bwd: BackwardFn = Arc::new(move |dvv: &Tensor| {
            Ok(vec![Some(Tensor::cat(&[&Tensor::zeros((b, tc, heads, nope), dvv.dtype(), dvv.device())?, &dvv.narrow(3, 0, dv)?], 3)?)])
        });
        let v = attach1("mla_value", &kv, v, v_bwd)?;
        // the latent rows from the same c and kr (not under SP: c is the rank's sequence shard
        // there, kr the gathered CP shard; qkv_rows makes them afresh)
        let rows = match (rows && !(self.tp.size() > 1 && self.tp.sequence_parallel), c.dims3()?) {
            (true, (cb, ct, _)) => Some(Tensor::cat(&[&c.reshape((cb, ct, 1, r))?, &kr], 3)?),
            (false, _) => None,
        };
        Ok((q, k, v, rows))
    }

    /// Generation's cache rows of the latent attention: `[c | RoPE(kr)]` `[B, T, 1, rkv + rope]`
    /// of the normed input `x` `[B, T, h]` (the whole sequence, SP off) at the positions of
    /// `cos`, `sin` — one row for every head, the same on every TP rank: DeepSeek-V3's 576 values
    /// per token and layer where k and v at the padded width would be `2·H·256`.
    pub(crate) fn latent_rows(&self, x: &Tensor, (cos, sin): (&Tensor, &Tensor)) -> Result<Tensor> {
        let (r, dr) = (self.dims.kv_lora_rank, self.dims.qk_rope_head_dim);
        let (b, t, _) = x.dims3()?;
        let ckv = self.down(x, &self.kv_down, &self.kv_down_lora)?;
        let c = self.kv_norm.forward(&ckv.narrow(2, 0, r)?)?.reshape((b, t, 1, r))?;
        let kr = crate::fused::apply_rope(&rope_order(&ckv.narrow(2, r, dr)?.reshape((b, t, 1, dr))?, self.dims.rope_interleave, false)?, cos, sin)?;
        Tensor::cat(&[&c, &kr], 3)
    }

    /// The absorbed form's weights: this rank's heads of `kv_b_proj` (adapters merged) split
    /// into `W_uk` `[Hl, nope, rkv]` and `W_uvᵀ` `[Hl, rkv, v]` (contiguous), for
    /// [`MlaAttn::absorbed_query`] and [`MlaAttn::absorbed_out`]; made once per generation
    /// (its prefill), not per decode step.
    pub(crate) fn absorbed_weights(&self, heads: usize) -> Result<Absorbed> {
        let a = self.dims;
        let (nope, dv, r) = (a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank);
        let w = self.kv_up.with_adapters_merged()?.weight().detach();
        if w.elem_count() != heads * (nope + dv) * r {
            bail!("latent attention: kv_b_proj {:?} is not {heads} heads of [{nope} + {dv}, {r}]", w.dims())
        }
        let w = w.reshape((heads, nope + dv, r))?;
        Ok(Absorbed { w_uk: w.narrow(1, 0, nope)?.contiguous()?, w_uv_t: w.narrow(1, nope, dv)?.transpose(1, 2)?.contiguous()? })
    }

    /// Generation's decode query against [`MlaAttn::latent_rows`] (DeepSeek's absorbed form:
    /// `q·k = (W_ukᵀ·q_nope)·c + q_rot·kr`): `[W_ukᵀ·q_nope | RoPE(q_rot)]` `[B, T, Hl, rkv +
    /// rope]` of the normed input `x`, `W_uk` from [`MlaAttn::absorbed_weights`].
    pub(crate) fn absorbed_query(&self, x: &Tensor, q_up: &ColumnParallelLinear, heads: usize, (cos, sin): (&Tensor, &Tensor), w: &Absorbed) -> Result<Tensor> {
        let a = self.dims;
        let (nope, dr, r) = (a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank);
        let q_in = match &self.q_down {
            Some((w, lora, norm)) => norm.forward(&self.down(x, w, lora)?)?,
            None => x.clone(),
        };
        let mut parts = q_up.forward_parts(&q_in)?;
        if parts.len() != 1 {
            bail!("latent attention: a query projection of {} parts (x {:?})", parts.len(), x.dims())
        }
        let q = parts.remove(0);
        let (b, t, _) = q.dims3()?;
        let q = q.reshape((b, t, heads, a.qk_head_dim()))?;
        let q_rot = crate::fused::apply_rope(&rope_order(&q.narrow(3, nope, dr)?, a.rope_interleave, false)?, cos, sin)?;
        if w.w_uk.dims() != [heads, nope, r] {
            bail!("latent attention: W_uk {:?} does not fit {heads} heads of [{nope}, {r}] (x {:?})", w.w_uk.dims(), x.dims())
        }
        // per head: q_nope [B·T, nope] · W_uk [nope, rkv]
        let qn = q.narrow(3, 0, nope)?.permute((2, 0, 1, 3))?.contiguous()?.reshape((heads, b * t, nope))?;
        let q_lat = qn.matmul(&w.w_uk)?.reshape((heads, b, t, r))?.permute((1, 2, 0, 3))?.contiguous()?;
        Tensor::cat(&[&q_lat, &q_rot], 3)
    }

    /// The decode attention's output `[B, T, Hl, rkv + rope]` over the latent rows → o_proj's
    /// input `[B, T, Hl·v]`: each head's first `rkv` values (its weighted `c`) through its
    /// `W_uv` ([`MlaAttn::absorbed_weights`]).
    pub(crate) fn absorbed_out(&self, a: &Tensor, w: &Absorbed) -> Result<Tensor> {
        let (r, dv) = (self.dims.kv_lora_rank, self.dims.v_head_dim);
        let (b, t, h, _) = a.dims4()?;
        if w.w_uv_t.dims() != [h, r, dv] {
            bail!("latent attention: W_uvᵀ {:?} does not fit {h} heads of [{r}, {dv}] (output {:?})", w.w_uv_t.dims(), a.dims())
        }
        let o_lat = a.narrow(3, 0, r)?.permute((2, 0, 1, 3))?.contiguous()?.reshape((h, b * t, r))?;
        o_lat.matmul(&w.w_uv_t)?.reshape((h, b, t, dv))?.permute((1, 2, 0, 3))?.contiguous()?.reshape((b, t, h * dv))
    }

    /// The attention's output `[B, T, Hl, D]` (or `[B, T, Hl·D]`; `D` the width it ran at,
    /// [`MlaAttn::qkv`]'s) → o_proj's input `[B, T, Hl·v]` (each head's first `v` dimensions).
    pub(crate) fn attn_out(&self, a: &Tensor, heads: usize) -> Result<Tensor> {
        let (b, t) = (a.dim(0)?, a.dim(1)?);
        let (dv, d) = (self.dims.v_head_dim, a.elem_count() / (b * t * heads).max(1));
        if d < dv || a.elem_count() != b * t * heads * d {
            bail!("latent attention: output {:?} is not {heads} heads of at least {dv}", a.dims())
        }
        let a = a.reshape((b, t, heads, d))?;
        let a = if dv == d { a } else { a.narrow(3, 0, dv)?.contiguous()? };
        a.reshape((b, t, heads * dv))
    }
}

/// The absorbed decode's weights of one layer ([`MlaAttn::absorbed_weights`]).
#[derive(Clone, Debug)]
pub(crate) struct Absorbed {
    /// `W_uk` `[Hl, nope, rkv]`: folded into the query.
    pub(crate) w_uk: Tensor,
    /// `W_uvᵀ` `[Hl, rkv, v]`: applied to the attention's latent output.
    pub(crate) w_uv_t: Tensor,
}

/// `t` `[.., w]` padded with zeros to `[.., d]` (contiguous).
fn pad(t: Tensor, d: usize) -> Result<Tensor> {
    let w = t.dim(D::Minus1)?;
    if w == d {
        return t.contiguous();
    }
    let mut shape = t.dims().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = d - w;
    }
    Tensor::cat(&[&t, &Tensor::zeros(shape, t.dtype(), t.device())?], D::Minus1)
}

/// `x` `[B, T, H, rope]` in `rotate_half`'s order when `interleaved`: the pairs `(2i, 2i + 1)`
/// split into the even then the odd dimensions, as transformers reorders them (`inverse`: back
/// to the pairs); `x` as it is otherwise.
fn rope_order(x: &Tensor, interleaved: bool, inverse: bool) -> Result<Tensor> {
    if !interleaved {
        return Ok(x.clone());
    }
    let (b, t, h, dr) = x.dims4()?;
    let (rows, cols) = if inverse { (2, dr / 2) } else { (dr / 2, 2) };
    x.contiguous()?.reshape((b, t, h, rows, cols))?.transpose(3, 4)?.contiguous()?.reshape((b, t, h, dr))
}
