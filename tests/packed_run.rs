//! One packed-documents run of the Llama on a layout (thread ranks), shared by
//! `tests/llama_packed.rs` (fixed documents) and `tests/llama_random.rs` (drawn ones).

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::Layout;
use candle_cp_llama::{
    gather_full, named_grads, reduce_gradients, shard_batch, shard_batch_packed, shard_tensors, Documents, Llama,
    LlamaConfig, ParallelCtx,
};
use candle_nn::VarBuilder;
use std::collections::HashMap;

/// Global results of one run, on the host.
pub struct Run {
    /// `[B·T·V]` global logits.
    pub logits: Vec<f32>,
    /// `[B·T]` per-token NLL from `token_nll_packed` (NaN when not computed).
    pub nll: Vec<f32>,
    /// The packed loss (rank 0's; every rank holds it).
    pub loss: f64,
    /// Every parameter's full gradient (rank 0's), in `named_grads` order.
    pub grads: Vec<(String, Tensor)>,
    /// Largest disagreement between ranks (loss, gradients).
    pub spread: f64,
}

/// `max |a - b|` as f64.
pub fn max_abs(a: &Tensor, b: &Tensor) -> Result<f64> {
    (a - b)?.abs()?.max_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()
}

/// `max |a - b|` of two host vectors of the same length, as f64.
pub fn max_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max)
}

/// Run the packed batch `ids [B, T]` with `docs` (one shared, or one per row) on `layout`
/// (thread ranks, CPU, f32 weights `full`): loss_packed, backward, reduced and gathered
/// gradients, logits unsharded by each token's global position, and (without recompute)
/// token_nll_packed.
pub fn run_packed(
    full: &HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    ids: &Tensor,
    docs: &[Documents],
    layout: Layout,
    recompute: bool,
) -> Result<Run> {
    let (b, t) = ids.dims2()?;
    let v = cfg.vocab_size;
    let gpos = Tensor::arange(0u32, t as u32, &Device::Cpu)?.unsqueeze(0)?.repeat((b, 1))?;
    type Out = (usize, Vec<Vec<u32>>, Vec<f32>, Vec<f32>, f64, Vec<(String, Tensor)>);
    let outs: Vec<Out> = run_ranks(layout.world_size(), |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        let vm = shard_tensors(full, cfg, &ctx)?;
        let model = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), cfg, &ctx)?.with_recompute(recompute);
        let sb = shard_batch_packed(ids, docs, &ctx)?;
        let rows = shard_batch(&gpos, &ctx)?.input_ids.to_vec2::<u32>()?;
        let nll = if recompute {
            vec![]
        } else {
            model
                .token_nll_packed(&sb.input_ids, &sb.labels, &sb.positions, &sb.documents)?
                .flatten_all()?
                .to_vec1()?
        };
        let (loss, logits) = model.loss_packed(&sb.input_ids, &sb.labels, &sb.positions, &sb.documents)?;
        let mut grads = model.backward(&loss)?;
        reduce_gradients(&mut grads, &vm, cfg, &ctx)?;
        let full_grads = gather_full(&named_grads(&grads, &vm)?, cfg, &ctx)?;
        Ok((ctx.coords.0, rows, logits.flatten_all()?.to_vec1()?, nll, loss.to_scalar::<f32>()? as f64, full_grads))
    })
    .into_iter()
    .collect::<Result<_>>()?;
    let mut logits = vec![f32::NAN; b * t * v];
    let mut nll = vec![f32::NAN; b * t];
    let bl = b / layout.dp;
    for (dp_i, rows, lg, nl, _, _) in &outs {
        for (bi, row) in rows.iter().enumerate() {
            let tl = row.len();
            for (j, &p) in row.iter().enumerate() {
                let (src, dst) = (bi * tl + j, (dp_i * bl + bi) * t + p as usize);
                logits[dst * v..(dst + 1) * v].copy_from_slice(&lg[src * v..(src + 1) * v]);
                if !nl.is_empty() {
                    nll[dst] = nl[src];
                }
            }
        }
    }
    if logits.iter().any(|x| x.is_nan()) {
        bail!("{layout}: some global logits uncovered")
    }
    let Some(first) = outs.first() else { bail!("{layout}: no rank") };
    let (loss, grads) = (first.4, first.5.clone());
    let mut spread = 0f64;
    for o in &outs[1..] {
        spread = spread.max((o.4 - loss).abs());
        for ((_, a), (_, g)) in grads.iter().zip(&o.5) {
            spread = spread.max(max_abs(a, g)?);
        }
    }
    Ok(Run { logits, nll, loss, grads, spread })
}
