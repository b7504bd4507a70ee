//! LoRA adapters on a sparse layer's experts, on its shared expert and on its routers: PEFT
//! adapts every linear whose name a target gives, so `gate_proj`, `up_proj`, `down_proj`
//! (Mixtral's `w1`, `w3`, `w2`) adapt each expert's projections, and Qwen2-MoE's shared
//! expert's; `gate` the router and `shared_expert_gate` Qwen2-MoE's shared expert's gate (PEFT's
//! `all-linear` includes them: [`crate::lora::ROUTER_TARGETS`]), replicated like the router,
//! their update inside the logits' node ([`MoeLora::router_logits`]), dropout keyed on the token.
//!
//! The experts' adapters are stacked like their weights ([`crate::params`]): per projection
//! `A` `[E, r, in]`, `B` `[E, out, r]` (`….experts.{gate,up,down}_proj.lora_{A,B}.weight`), and
//! run as two grouped matmuls inside the weight's node, on the rows grouped by expert
//! ([`candle_cp_ops::moe_update::grouped_matmul_update`]: the graph keeps `xs` and the weights,
//! no `[M, out]` term, no dropout mask):
//!
//! ```text
//!  xs [M, in] ─► grouped(xs, W)  +  s · grouped(grouped(drop(xs), A) [M, r], B)   [M, out]
//! ```
//!
//! On disk (PEFT) each expert has its own factors, `….experts.{e}.{proj}.lora_{A,B}.weight`
//! ([`stack_expert_adapters`] / [`split_expert_adapters`] at the boundary).
//!
//! TP splits the factors as the dense adapters ([`candle_cp_nn::lora`]): gate and up `A`
//! replicated, `B` as the weight's rows (dim 1); down `A` as the weight's columns (dim 2), `B`
//! replicated. Every TP rank computes its slice for the whole region's rows, so a replicated
//! factor's gradient on one TP rank is that rank's share: summed over TP in the graph
//! (`copy_to_tp_region`, as the router's) without SP and under expert parallelism, by
//! [`crate::reduce_gradients`] with SP otherwise (whose group of a replicated parameter spans TP;
//! the experts' group under EP, [`crate::ParallelCtx::ep_dp`], does not). EP splits the
//! stacked factors along `E` as the weights ([`crate::params::ParamSpec::is_expert`]).
//!
//! Dropout (PEFT's `lora_dropout`): a mask row is keyed on the (token, expert) pair,
//! `token · E + e` (`token` the global index the model's [`candle_cp_nn::DropoutRows`] holds),
//! so each expert drops its own elements, as PEFT's per-expert dropout modules do, and every
//! layout drops what one device drops; under EP the keys travel with the rows
//! ([`candle_cp_ops::moe_ep::ExpertExchange::dispatch_keys`]). The shared expert's rows are
//! keyed on the token alone, as a dense adapter's.
//!
//! DoRA ([`candle_cp_nn::dora`]): a magnitude per expert and output row (`[E, out]`,
//! `….lora_magnitude_vector`, split as `B`); the experts compute with their DoRA weights
//! (stacked) in place of the update, or, training with dropout, with their base weights and the
//! update `(W'_e - W_e)·drop(x)` inside the same node (PEFT's second base pass). The routers'
//! DoRA (a magnitude per expert, `[E]`; the router whole on every rank, so its rows' norms are
//! local) always takes the second form, inside the logits' node.

use candle_core::{bail, Result, Tensor};
use candle_cp_nn::{DropoutRows, Tp};
use candle_cp_ops::mappings;
use candle_cp_ops::autograd::MaskFn;
use candle_cp_ops::moe::{grouped_matmul, grouped_matmul_bias};
use candle_cp_ops::moe_update::{grouped_matmul_update, grouped_matmul_update_bias, GroupedUpdate};
use std::collections::HashMap;

/// One adapted projection: this rank's factors (stacked `[E_local, r, in_local]`,
/// `[E_local, out_local, r]` for the experts; `[r, in_local]`, `[out_local, r]` for the shared
/// expert) and the name of its dropout stream.
#[derive(Clone)]
pub(crate) struct Factors {
    pub(crate) a: Tensor,
    pub(crate) b: Tensor,
    /// DoRA's magnitude (`[E_local, out_local]` / `[out_local]`, replicated for down).
    pub(crate) m: Option<Tensor>,
    pub(crate) stream: String,
    /// `alpha / r` of this projection's adapter (or rsLoRA's `alpha / √r`; crate::lora_select).
    pub(crate) scale: f64,
}

/// A sparse layer's adapters: the experts' and the shared expert's gate, up, down (each
/// `None` when not a target), their scale and dropout.
#[derive(Clone)]
pub(crate) struct MoeLora {
    /// The experts' `[gate, up, down]`.
    pub(crate) experts: [Option<Factors>; 3],
    /// The shared expert's `[gate, up, down]`.
    pub(crate) shared: [Option<Factors>; 3],
    /// The routers' (PEFT's `gate`, `shared_expert_gate`: [`crate::lora::ROUTER_TARGETS`]):
    /// `[router, shared expert's gate]`, each `A` `[r, h]`, `B` `[E or 1, r]`, replicated.
    pub(crate) routers: [Option<Factors>; 2],
    /// Dropout on the adapters' inputs while training.
    pub(crate) dropout: f64,
    /// The model's token indices of the current forward (`None` inside: no dropout).
    pub(crate) rows: DropoutRows,
}

/// The projection index of `down_proj`, whose input is feature-sharded over TP.
const DOWN: usize = 2;

impl MoeLora {
    /// Whether any expert projection is adapted with dropout and the current forward draws
    /// masks: then the rows need keys ([`MoeLora::expert_keys`]).
    pub(crate) fn needs_keys(&self) -> bool {
        self.dropout > 0.0 && self.experts.iter().any(|f| f.is_some()) && self.rows.key().is_some()
    }

    /// The dropout keys `token · E + e` of the rows grouped by expert: `tokens` the region's
    /// token (row of `[B·Tc]`) of each, `counts` `[E]` the rows per expert. `None` without
    /// dropout this forward. Errors when the model's token indices do not cover the region.
    pub(crate) fn expert_keys(&self, tokens: &[u32], counts: &[usize], region_rows: usize) -> Result<Option<Vec<u64>>> {
        let Some(k) = self.rows.key().filter(|_| self.needs_keys()) else { return Ok(None) };
        if k.rows.len() != region_rows {
            bail!("MoE LoRA dropout: {} token indices for a region of {region_rows} rows", k.rows.len())
        }
        if tokens.len() != counts.iter().sum::<usize>() {
            bail!("MoE LoRA dropout: {} rows for the expert counts {counts:?}", tokens.len())
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= region_rows) {
            bail!("MoE LoRA dropout: token {t} outside a region of {region_rows} rows")
        }
        let e = counts.len() as u64;
        let mut keys = Vec::with_capacity(tokens.len());
        for (expert, &c) in counts.iter().enumerate() {
            for &t in &tokens[keys.len()..keys.len() + c] {
                keys.push(k.rows[t as usize].wrapping_mul(e).wrapping_add(expert as u64));
            }
        }
        Ok(Some(keys))
    }

    /// The keep mask of `x` `[R, f]` under the dropout of stream `stream` on rows keyed `keys`
    /// (a down projection's input: this TP rank's slice of the features), drawn again on each
    /// call (the products keep `x`, not the mask or the dropped rows); `None` without keys.
    fn mask(&self, x: &Tensor, stream: &str, keys: Option<&[u64]>, down: bool, tp: &Tp) -> Result<Option<MaskFn>> {
        let (Some(keys), Some(k)) = (keys, self.rows.key()) else { return Ok(None) };
        if self.dropout == 0.0 {
            return Ok(None);
        }
        let (r, f) = x.dims2()?;
        if keys.len() != r {
            bail!("MoE LoRA dropout ({stream}): {} row keys for an input {:?}", keys.len(), x.dims())
        }
        let (col0, total) = if down { (tp.group.rank() * f, f * tp.size()) } else { (0, f) };
        let (stream, keys, p, dtype, dev) = (stream.to_string(), keys.to_vec(), self.dropout, x.dtype(), x.device().clone());
        Ok(Some(std::sync::Arc::new(move || k.streams.keep_mask_rows(&stream, k.step, &keys, col0..col0 + f, total, p, dtype, &dev))))
    }

    /// Whether a replicated factor's gradient is summed over TP in the graph (copied into the
    /// TP region): without SP and under EP; else [`crate::reduce_gradients`] sums it.
    fn sums_in_graph(tp: &Tp, ep: bool) -> bool {
        tp.size() > 1 && (!tp.sequence_parallel || ep)
    }

    /// Projection `i`'s factors `(A, B)` as the graph uses them: the replicated one (down's `B`,
    /// the others' `A`) copied into the TP region when [`MoeLora::sums_in_graph`].
    fn in_graph(f: &Factors, i: usize, tp: &Tp, ep: bool) -> Result<(Tensor, Tensor)> {
        let copy = |t: &Tensor| if Self::sums_in_graph(tp, ep) { mappings::copy_to_tp_region(t, &tp.group) } else { Ok(t.clone()) };
        Ok(if i == DOWN { (f.a.clone(), copy(&f.b)?) } else { (copy(&f.a)?, f.b.clone()) })
    }

    /// How projection `i`'s weight is split over TP (down: by its input columns).
    fn split(i: usize) -> candle_cp_nn::WeightSplit {
        if i == DOWN {
            candle_cp_nn::WeightSplit::Cols
        } else {
            candle_cp_nn::WeightSplit::Rows
        }
    }

    /// Whether the adapters' dropout draws masks in this forward (a training forward).
    fn drops(&self) -> bool {
        self.dropout > 0.0 && self.rows.key().is_some()
    }

    /// The weight projection `i` of the experts (`shared` false) or the shared expert computes
    /// with: DoRA's `m / ‖W + s·B·A‖ ⊙ (W + s·B·A)` of this rank's slice `w` for a DoRA adapter
    /// ([`candle_cp_nn::dora`]), `None` otherwise (the weight as it is, the update beside it:
    /// LoRA's, or DoRA's `(W' - W)·drop(x)` while dropout draws masks).
    pub(crate) fn weight(&self, i: usize, shared: bool, w: &Tensor, tp: &Tp, ep: bool) -> Result<Option<Tensor>> {
        let f = if shared { &self.shared[i] } else { &self.experts[i] };
        let Some((f, m)) = f.as_ref().and_then(|f| Some((f, f.m.as_ref()?))) else { return Ok(None) };
        if self.drops() {
            return Ok(None);
        }
        Ok(Some(candle_cp_nn::dora_weight(w, &f.a, &f.b, m, f.scale, Self::split(i), tp, Self::sums_in_graph(tp, ep))?))
    }

    /// The update weight `W' - W` of a DoRA adapter training with dropout
    /// ([`candle_cp_nn::dora_update`]) on this rank's slice `w`; `None` for a LoRA adapter or
    /// while no masks are drawn (then [`MoeLora::weight`] is DoRA's).
    fn dora_update(&self, f: &Factors, i: usize, w: &Tensor, tp: &Tp, ep: bool) -> Result<Option<Tensor>> {
        match f.m.as_ref().filter(|_| self.drops()) {
            Some(m) => Ok(Some(candle_cp_nn::dora_update(w, &f.a, &f.b, m, f.scale, Self::split(i), tp, Self::sums_in_graph(tp, ep))?)),
            None => Ok(None),
        }
    }

    /// Projection `i`'s weight (this rank's slice `w`) with its adapter merged, detached, for
    /// inference (`W + s·B·A` per expert, or DoRA's weight); `None` when not adapted.
    pub(crate) fn merged(&self, i: usize, shared: bool, w: &Tensor, tp: &Tp) -> Result<Option<Tensor>> {
        let Some(f) = (if shared { &self.shared[i] } else { &self.experts[i] }) else { return Ok(None) };
        Ok(Some(candle_cp_nn::lora::merged_weight(w, &f.a, &f.b, f.m.as_ref(), f.scale, Self::split(i), tp)?))
    }

    /// Projection `i` (0 gate, 1 up, 2 down) of the experts for rows `x` `[R, in_local]` grouped
    /// by `counts` (this rank's experts), keyed `keys` for dropout, with this rank's stacked
    /// weights `w` `[E_local, out_local, in_local]`: `[R, out_local]`. The adapter's update is
    /// added inside the experts' node ([`grouped_matmul_update`]: LoRA's, or DoRA's
    /// `(W'_e - W_e)·drop(x)` while it drops; the graph keeps no `[R, out]` term or mask), or is
    /// in the weight (DoRA otherwise). `ep`: under expert parallelism.
    /// `bias`: the experts' biases and the first column they add to (gpt-oss; see
    /// [`candle_cp_ops::moe::grouped_matmul_bias`]), inside the same node.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn expert_proj(&self, i: usize, x: &Tensor, w: &Tensor, bias: Option<(&Tensor, usize)>, counts: &[usize], keys: Option<&[u64]>, tp: &Tp, ep: bool) -> Result<Tensor> {
        let plain = |w: &Tensor| match bias {
            Some((b, col0)) => grouped_matmul_bias(x, w, b, col0, counts),
            None => grouped_matmul(x, w, counts),
        };
        let Some(f) = self.experts[i].as_ref() else { return plain(w) };
        if let Some(wd) = self.weight(i, false, w, tp, ep)? {
            return plain(&wd);
        }
        let mask = self.mask(x, &f.stream, keys, i == DOWN, tp)?;
        let update = self.update(f, i, w, tp, ep, 3)?;
        match bias {
            Some((b, col0)) => grouped_matmul_update_bias(x, w, b, col0, counts, &update, mask.as_ref()),
            None => grouped_matmul_update(x, w, counts, &update, mask.as_ref()),
        }
    }

    /// Projection `i` of the shared expert for the region's rows `x` `[N, in_local]` (`tokens`:
    /// their global token indices for dropout, `None` without), this rank's weight slice `w`
    /// `[out_local, in_local]`: `[N, out_local]`, the adapter's update inside the node as the
    /// experts' ([`MoeLora::expert_proj`], one group of `N` rows).
    pub(crate) fn shared_proj(&self, i: usize, x: &Tensor, w: &Tensor, tokens: Option<&[u64]>, tp: &Tp) -> Result<Tensor> {
        let Some(f) = self.shared[i].as_ref() else { return x.matmul(&w.t()?) };
        if let Some(wd) = self.weight(i, true, w, tp, false)? {
            return x.matmul(&wd.t()?);
        }
        let mask = self.mask(x, &f.stream, tokens, i == DOWN, tp)?;
        let n = x.dim(0)?;
        grouped_matmul_update(x, &w.unsqueeze(0)?, &[n], &self.update(f, i, w, tp, false, 2)?, mask.as_ref())
    }

    /// The update of projection `i`'s adapter `f` (on this rank's weight `w`, stacked `rank` 3
    /// or 2-D for the shared expert, whose factors gain a leading axis of 1): LoRA's factors as
    /// the graph uses them ([`MoeLora::in_graph`]), or DoRA's `W' - W` (while it drops).
    fn update(&self, f: &Factors, i: usize, w: &Tensor, tp: &Tp, ep: bool, rank: usize) -> Result<GroupedUpdate> {
        let lift = |t: Tensor| if rank == 2 { t.unsqueeze(0) } else { Ok(t) };
        Ok(match self.dora_update(f, i, w, tp, ep)? {
            Some(dw) => GroupedUpdate::Full { w: lift(dw)? },
            None => {
                let (a, b) = Self::in_graph(f, i, tp, ep)?;
                GroupedUpdate::LowRank { a: lift(a)?, b: lift(b)?, scale: f.scale }
            }
        })
    }

    /// The region's global token indices when the shared expert's or the routers' adapters
    /// draw masks.
    pub(crate) fn region_tokens(&self, region_rows: usize) -> Result<Option<std::sync::Arc<Vec<u64>>>> {
        let some = self.shared.iter().chain(&self.routers).any(|f| f.is_some());
        let Some(k) = self.rows.key().filter(|_| self.dropout > 0.0 && some) else { return Ok(None) };
        if k.rows.len() != region_rows {
            bail!("MoE LoRA dropout: {} token indices for a region of {region_rows} rows", k.rows.len())
        }
        Ok(Some(k.rows.clone()))
    }
}

impl MoeLora {
    /// Router `i`'s logits (0 the router, 1 the shared expert's gate) for the region's rows `x`
    /// `[N, h]` (`tokens`: their global token indices for dropout, `None` without), its weight
    /// `w` `[E, h]` as the graph uses it (copied into the TP region without SP): `x·wᵀ` plus
    /// the adapter's update inside the same node, as the shared expert's
    /// ([`MoeLora::shared_proj`]). The router is replicated over TP and every TP rank routes the
    /// same rows, so its factors' gradients, partial per rank like the router's, are summed as
    /// its are: copied into the TP region without SP, by `reduce_gradients` with it.
    pub(crate) fn router_logits(&self, i: usize, x: &Tensor, w: &Tensor, tokens: Option<&[u64]>, tp: &Tp) -> Result<Tensor> {
        let Some(f) = self.routers[i].as_ref() else { return x.matmul(&w.t()?) };
        let copy = |t: &Tensor| if tp.size() > 1 && !tp.sequence_parallel { mappings::copy_to_tp_region(t, &tp.group) } else { Ok(t.clone()) };
        let mask = self.mask(x, &f.stream, tokens, false, tp)?;
        let update = match &f.m {
            // DoRA (PEFT's formula, with or without dropout): x·Wᵀ + drop(x)·(W' - W)ᵀ, the
            // router whole on every rank (its rows' norms local: WeightSplit::Rows, no sum)
            Some(m) => {
                let d = candle_cp_nn::dora_update(w, &copy(&f.a)?, &copy(&f.b)?, &copy(m)?, f.scale, candle_cp_nn::WeightSplit::Rows, tp, false)?;
                GroupedUpdate::Full { w: d.unsqueeze(0)? }
            }
            None => GroupedUpdate::LowRank { a: copy(&f.a)?.unsqueeze(0)?, b: copy(&f.b)?.unsqueeze(0)?, scale: f.scale },
        };
        grouped_matmul_update(x, &w.unsqueeze(0)?, &[x.dim(0)?], &update, mask.as_ref())
    }

    /// Router `i`'s weight (the whole of it, replicated) with its adapter merged, detached, for
    /// inference (as [`MoeLora::merged`] merges the others); `None` when not adapted.
    pub(crate) fn merged_router(&self, i: usize, w: &Tensor, tp: &Tp) -> Result<Option<Tensor>> {
        let Some(f) = self.routers[i].as_ref() else { return Ok(None) };
        Ok(Some(candle_cp_nn::lora::merged_weight(w, &f.a, &f.b, f.m.as_ref(), f.scale, candle_cp_nn::WeightSplit::Rows, tp)?))
    }
}

/// Per-expert adapter tensors as a PEFT file holds them
/// (`….{mlp,block_sparse_moe}.experts.{e}.{proj}.lora_{A,B}.weight`, `[r, in]` / `[out, r]`)
/// stacked into the model's parameters (`….experts.{gate,up,down}_proj.lora_{A,B}.weight`,
/// `[E, r, in]` / `[E, out, r]`); other tensors pass as they are. Errors name an expert missing
/// from `0..E` or factors of different shapes.
pub(crate) fn stack_expert_adapters(tensors: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    // stacked name → (expert, tensor)
    let mut groups: HashMap<String, Vec<(usize, Tensor)>> = HashMap::new();
    for (name, t) in tensors {
        match per_expert_name(&name) {
            Some((stacked, e)) => groups.entry(stacked).or_default().push((e, t)),
            None => {
                out.insert(name, t);
            }
        }
    }
    for (stacked, mut parts) in groups {
        parts.sort_by_key(|(e, _)| *e);
        if let Some((i, (e, _))) = parts.iter().enumerate().find(|(i, (e, _))| i != e) {
            bail!("LoRA adapter: {stacked} has expert {e} where expert {i} was expected (the {} experts' factors must be 0..{})", parts.len(), parts.len())
        }
        let dims = parts[0].1.dims().to_vec();
        if let Some((e, t)) = parts.iter().find(|(_, t)| t.dims() != dims.as_slice()) {
            bail!("LoRA adapter: {stacked}: expert {e}'s factor {:?} differs from expert 0's {dims:?}", t.dims())
        }
        let ts: Vec<Tensor> = parts.into_iter().map(|(_, t)| t).collect();
        out.insert(stacked, Tensor::stack(&ts, 0)?);
    }
    Ok(out)
}

/// `(stacked name, expert)` of a per-expert adapter factor's name, `None` for another name.
fn per_expert_name(name: &str) -> Option<(String, usize)> {
    let (factor, stem) = ["lora_A.weight", "lora_B.weight", "lora_magnitude_vector"].iter().find_map(|f| Some((*f, name.strip_suffix(&format!(".{f}"))?)))?;
    for (module, proj, per) in crate::params::EXPERT_NAMES {
        let Some(head) = stem.strip_suffix(&format!(".{per}")) else { continue };
        let Some((prefix, e)) = head.rsplit_once('.') else { continue };
        let (Some(prefix), Ok(e)) = (prefix.strip_suffix(&format!("{module}.experts")), e.parse::<usize>()) else { continue };
        return Some((format!("{prefix}{module}.experts.{proj}.{factor}"), e));
    }
    None
}

/// The model's stacked expert factors (3-D, `….experts.{gate,up,down}_proj.lora_{A,B}.weight`)
/// split into the per-expert tensors a PEFT file holds; other tensors pass as they are.
pub(crate) fn split_expert_adapters(tensors: &HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for (name, t) in tensors {
        let spec = crate::ParamSpec { name: name.clone(), shape: t.dims().to_vec(), shard: crate::params::Shard::Replicated };
        for (n, e) in crate::params::checkpoint_tensors(&spec) {
            let part = match e {
                Some(e) => t.get(e)?.contiguous()?,
                None => t.clone(),
            };
            out.insert(n, part);
        }
    }
    Ok(out)
}

/// PEFT's names of the target modules `targets` on a model whose adapter tensors are `names`:
/// Mixtral's experts are `w1`, `w3`, `w2` (it has no other gate, up, down projections).
pub(crate) fn peft_target_names(targets: &[String], names: impl Iterator<Item = impl AsRef<str>>) -> Vec<String> {
    let mixtral = names.into_iter().any(|n| n.as_ref().contains("block_sparse_moe.experts."));
    targets
        .iter()
        .map(|t| match (mixtral, t.as_str()) {
            (true, "gate_proj") => "w1".into(),
            (true, "up_proj") => "w3".into(),
            (true, "down_proj") => "w2".into(),
            _ => t.clone(),
        })
        .collect()
}

/// A PEFT target module name as [`crate::lora::TARGETS`] names it (Mixtral's expert names
/// `w1`, `w3`, `w2` are `gate_proj`, `up_proj`, `down_proj`).
pub(crate) fn target_from_peft(name: &str) -> &str {
    match name {
        "w1" => "gate_proj",
        "w3" => "up_proj",
        "w2" => "down_proj",
        n => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var, D};
    use candle_cp_comm::{run_ranks, Group};
    use candle_cp_nn::{DropoutKey, RngStreams};
    use std::sync::Arc;

    fn t(shape: &[usize], seed: f64) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| ((i as f64 * 0.61 + seed).sin() * 0.5) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
    }

    /// A DoRA adapter on 3 stacked experts training with dropout 0.3: the experts' gate output
    /// (`expert_proj`) is, expert by expert, PEFT's `W_e·x + (W'_e - W_e)·x̃_e`
    /// (`W'_e` DoRA's weight with the norm a constant, `x̃_e` the rows' masks keyed `token·E + e`),
    /// and so are the gradients of `x`, `A`, `B`, `m`; the masks matter (not DoRA's `W'_e·x`).
    #[test]
    fn expert_dora_with_dropout_is_pefts_formula() -> Result<()> {
        let (e, r, i, o, n) = (3, 2, 5, 4, 6);
        let (tokens, counts) = (vec![0u32, 3, 5, 1, 2, 4, 0, 5], vec![3usize, 2, 3]);
        let (w, a, b) = (t(&[e, o, i], 0.2)?, t(&[e, r, i], 1.1)?, t(&[e, o, r], 2.3)?);
        let m = (t(&[e, o], 3.7)?.abs()? + 0.8)?;
        let x = t(&[tokens.len(), i], 4.9)?;
        let rows = DropoutRows::default();
        rows.set(Some(DropoutKey { streams: RngStreams::new(5), step: 2, rows: Arc::new((10..10 + n as u64).collect()), batch: 1, tc: n }))?;
        let (p, s) = (0.3, 0.75);
        for res in run_ranks(1, |g: Group| {
            let tp = Tp::new(g, false);
            let (av, bv, mv, xv) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?, Var::from_tensor(&m)?, Var::from_tensor(&x)?);
            let f = Factors { a: av.as_tensor().clone(), b: bv.as_tensor().clone(), m: Some(mv.as_tensor().clone()), stream: "gate".into(), scale: s };
            let l = MoeLora { experts: [Some(f), None, None], shared: [None, None, None], routers: [None, None], dropout: p, rows: rows.clone() };
            let keys = l.expert_keys(&tokens, &counts, n)?.ok_or_else(|| candle_core::Error::Msg("keys expected".into()))?;
            assert!(l.weight(0, false, &w, &tp, false)?.is_none(), "dropping: the base weight");
            let y = l.expert_proj(0, xv.as_tensor(), &w, None, &counts, Some(&keys), &tp, false)?;
            let c = t(y.dims(), 6.1)?;
            let gy = (&y * &c)?.sum_all()?.backward()?;
            // the reference, expert by expert on plain tensors
            let (ar, br, mr, xr) = (Var::from_tensor(&a)?, Var::from_tensor(&b)?, Var::from_tensor(&m)?, Var::from_tensor(&x)?);
            let (mut outs, mut dora_only, mut row) = (Vec::new(), Vec::new(), 0);
            for (ex, &k) in counts.iter().enumerate() {
                let xe = xr.as_tensor().narrow(0, row, k)?;
                let keys_e: Vec<u64> = tokens[row..row + k].iter().map(|&tk| (10 + tk as u64) * e as u64 + ex as u64).collect();
                let keep = RngStreams::new(5).keep_mask_rows("gate", 2, &keys_e, 0..i, i, p, DType::F32, &Device::Cpu)?;
                let we = w.get(ex)?;
                let v = (&we + (br.as_tensor().get(ex)?.matmul(&ar.as_tensor().get(ex)?)? * s)?)?;
                let norm = v.detach().sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
                let wd = v.broadcast_mul(&mr.as_tensor().get(ex)?.unsqueeze(1)?.broadcast_div(&norm)?)?;
                outs.push((xe.matmul(&we.t()?)? + (&xe * &keep)?.matmul(&(&wd - &we)?.t()?)?)?);
                dora_only.push(xe.matmul(&wd.t()?)?);
                row += k;
            }
            let want = Tensor::cat(&outs, 0)?;
            let gr = (&want * &c)?.sum_all()?.backward()?;
            let diff = |u: &Tensor, v: &Tensor| -> Result<f32> { (u - v)?.abs()?.max_all()?.to_scalar::<f32>() };
            let grad = |gs: &candle_core::backprop::GradStore, v: &Var| gs.get(v.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg("no gradient".into()));
            let mut errs = vec![("y", diff(&y, &want)?)];
            for (name, (ours, theirs)) in [("x", (&xv, &xr)), ("A", (&av, &ar)), ("B", (&bv, &br)), ("m", (&mv, &mr))] {
                errs.push((name, diff(&grad(&gy, ours)?, &grad(&gr, theirs)?)?));
            }
            Ok((errs, diff(&y, &Tensor::cat(&dora_only, 0)?)?))
        }) {
            let (errs, moved) = res?;
            for (name, err) in errs {
                assert!(err < 1e-5, "{name} off by {err}");
            }
            assert!(moved > 1e-3, "the masks move the output by only {moved}");
        }
        Ok(())
    }
}
