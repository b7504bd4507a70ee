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
//! The attention runs at `D = max(nope + rope, v)`: the narrower of the value or the query
//! and key is padded with zeros (they change neither the scores nor the output), the output's
//! first `v` dimensions kept — transformers' padding for flash attention.

use crate::config::deepseek::Mla;
use crate::model::linear;
use candle_core::{bail, Module, Result, Tensor, D};
use candle_cp_nn::{ColumnParallelLinear, Lora, RmsNorm, Tp};
use candle_cp_ops::mappings;

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
                Some(l) => candle_cp_nn::lora::merged_weight(w, l.a(), l.b(), None, l.scale(), candle_cp_nn::WeightSplit::Rows, &self.tp),
                None => Ok(w.clone()),
            }
        };
        let q_down = match &self.q_down {
            Some((w, l, n)) => Some((merge(w, l)?, None, n.clone())),
            None => None,
        };
        Ok(MlaAttn { q_down, kv_down: merge(&self.kv_down, &self.kv_down_lora)?, kv_down_lora: None, kv_up: self.kv_up.with_adapters_merged()?, ..self.clone() })
    }

    /// A replicated down-projection of the rows `x` this rank holds, with its adapter's update.
    fn down(&self, x: &Tensor, w: &Tensor, lora: &Option<Lora>) -> Result<Tensor> {
        let y = linear(x, w)?;
        match lora {
            Some(l) => y + candle_cp_nn::replicated_delta(x, l, &self.tp)?,
            None => Ok(y),
        }
    }

    /// q, k, v `[B, Tc, Hl, D]` (`D` = [`Mla::attn_dim`]) of the normed input `x` `[B, Ts, h]`
    /// with `q_up` the query's up-projection (`q_b_proj`, or `q_proj` from `x`) and `rope` the
    /// rotation of a `[B, Tc, ·, rope]` tensor at the CP shard's positions. `regather`: the
    /// column-parallel layers keep only their input's shard for the backward (training).
    pub(crate) fn qkv(&self, x: &Tensor, q_up: &ColumnParallelLinear, heads: usize, rope: &dyn Fn(&Tensor) -> Result<Tensor>, regather: bool) -> Result<(Tensor, Tensor, Tensor)> {
        let a = &self.dims;
        let (nope, dr, dv, r) = (a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank);
        let (b, _, hidden) = x.dims3()?;
        if self.kv_down.dims() != [r + dr, hidden] {
            bail!("latent attention: x {:?} does not fit kv_a_proj_with_mqa {:?} ([{} + {dr}, h])", x.dims(), self.kv_down.dims(), r)
        }
        let up = |lin: &ColumnParallelLinear, x: &Tensor| -> Result<Tensor> {
            let mut parts = if regather { lin.forward_parts_regathered(x, &[])? } else { lin.forward_parts(x)? };
            match parts.len() {
                1 => Ok(parts.remove(0)),
                n => bail!("latent attention: an up-projection of {n} parts (x {:?})", x.dims()),
            }
        };
        let q = match &self.q_down {
            Some((w, lora, norm)) => up(q_up, &norm.forward(&self.down(x, w, lora)?)?)?,
            None => up(q_up, x)?,
        };
        let tc = q.dim(1)?;
        let q = q.reshape((b, tc, heads, a.qk_head_dim()))?;
        let ckv = self.down(x, &self.kv_down, &self.kv_down_lora)?;
        let kv = up(&self.kv_up, &self.kv_norm.forward(&ckv.narrow(2, 0, r)?)?)?.reshape((b, tc, heads, nope + dv))?;
        // the key's RoPE part: the whole CP shard on every TP rank (gathered under SP; without
        // SP each rank's heads give part of its gradient, summed in the backward)
        let kr = ckv.narrow(2, r, dr)?;
        let kr = match (self.tp.size() > 1, self.tp.sequence_parallel) {
            (false, _) => kr,
            (true, true) => mappings::gather_from_sp_region(&kr.contiguous()?, &self.tp.group, mappings::SEQ_DIM)?,
            (true, false) => mappings::copy_to_tp_region(&kr, &self.tp.group)?,
        };
        let kr = rope(&self.rope_order(&kr.reshape((b, tc, 1, dr))?)?)?;
        let q_rot = rope(&self.rope_order(&q.narrow(3, nope, dr)?)?)?;
        let q = Tensor::cat(&[&q.narrow(3, 0, nope)?, &q_rot], 3)?;
        let k = Tensor::cat(&[&kv.narrow(3, 0, nope)?, &kr.broadcast_as((b, tc, heads, dr))?.contiguous()?], 3)?;
        let v = kv.narrow(3, nope, dv)?;
        let d = a.attn_dim();
        let pad = |t: Tensor| -> Result<Tensor> {
            let w = t.dim(D::Minus1)?;
            if w == d {
                return t.contiguous();
            }
            let (tb, tt, th, _) = t.dims4()?;
            Tensor::cat(&[&t, &Tensor::zeros((tb, tt, th, d - w), t.dtype(), t.device())?], 3)
        };
        Ok((pad(q)?, pad(k)?, pad(v)?))
    }

    /// `x` `[.., rope]` in `rotate_half`'s order: the interleaved pairs `(2i, 2i + 1)` split into
    /// the even then the odd dimensions (`rope_interleave`, as transformers reorders them), or
    /// `x` as it is.
    fn rope_order(&self, x: &Tensor) -> Result<Tensor> {
        if !self.dims.rope_interleave {
            return Ok(x.clone());
        }
        let (b, t, h, dr) = x.dims4()?;
        x.contiguous()?.reshape((b, t, h, dr / 2, 2))?.transpose(3, 4)?.contiguous()?.reshape((b, t, h, dr))
    }

    /// The attention's output `[B, T, Hl, D]` (or `[B, T, Hl·D]`) → o_proj's input
    /// `[B, T, Hl·v]` (each head's first `v` dimensions).
    pub(crate) fn attn_out(&self, a: &Tensor, heads: usize) -> Result<Tensor> {
        let (dv, d) = (self.dims.v_head_dim, self.dims.attn_dim());
        let (b, t) = (a.dim(0)?, a.dim(1)?);
        let a = a.reshape((b, t, heads, d))?;
        let a = if dv == d { a } else { a.narrow(3, 0, dv)?.contiguous()? };
        a.reshape((b, t, heads * dv))
    }
}
