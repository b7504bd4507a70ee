//! Seeded random stacks of candle-cp-nn layers alone (no attention, no model) on a TP group,
//! against the same stack of plain candle ops on one device.
//!
//! The stack is the Megatron SP pattern around one MLP, from token ids to a residual output:
//!
//! ```text
//!   ids [B, T/P] (SP) or [B, T]  ── vocab_parallel_embedding (table [⌈V/P⌉, C] per rank) ──▶ x
//!   y = x + dropout( RowParallelLinear( gelu( ColumnParallelLinear( norm(x) ) ) ) )
//!       norm: RmsNorm or LayerNorm; biases drawn; dropout on the SP region's global indices
//! ```
//!
//! Each draw picks TP 1 to 4, SP on or off, who sums the replicated gradients
//! ([`GradSync`]), the vocabulary (often not divisible by TP: padded slices), hidden and
//! hidden-MLP sizes, batch, sequence, the norm and its epsilon, the biases, the dropout
//! probability and step. Every rank's output (its sequence shard under SP, the whole
//! replicated output without) must equal the single-device output to 1e-5, every gradient
//! its slice of the single-device gradient (embedding rows, column-parallel rows, row-parallel
//! columns) or the whole of it (norm weights, row-parallel bias; summed by the caller under
//! SP with `Deferred`) to 2e-5 of the whole gradient's largest entry (at least 1e-2 of the largest gradient's); ranks must agree bit for bit on what they replicate.
//! A draw with an MLP width that TP does not divide must be refused on every rank with an
//! error naming the width. `CANDLE_CP_RANDOM_SEEDS=A..B` draws configurations `A..B`.

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_nn::{
    padded_rows, shard_for_tp, vocab_parallel_embedding, ColumnParallelLinear, Dropout, GradSync, LayerNorm,
    LinearConfig, Region, RmsNorm, RngStreams, RowParallelLinear, Shard, Tp,
};
use candle_cp_tests::draws::{pick, rng, seeds};
use candle_cp_tests::{grad, rand_t};
use candle_cp_tests::packed_run::max_abs;
use candle_nn::{VarBuilder, VarMap};
use std::collections::BTreeMap;

const CONFIGS: u64 = 200;

/// One draw.
#[derive(Debug, Clone, Copy)]
struct Draw {
    tp: usize,
    sp: bool,
    sync: GradSync,
    batch: usize,
    seq: usize,
    vocab: usize,
    hidden: usize,
    ffn: usize,
    layer_norm: bool,
    eps: f64,
    col_bias: bool,
    row_bias: bool,
    p_drop: f64,
    step: u64,
}

impl Draw {
    fn new(seed: u64) -> Self {
        let mut d = rng(31000 + seed);
        let tp = 1 + d.below(4);
        let sp = tp > 1 && d.below(2) == 0;
        let sync = if d.below(2) == 0 { GradSync::InBackward } else { GradSync::Deferred };
        let batch = 1 + d.below(2);
        let seq = if sp { tp * (1 + d.below(4)) } else { 1 + d.below(9) };
        let vocab = tp + d.below(3 * tp + 4);
        let hidden = 2 + d.below(11);
        // an MLP width TP does not divide in an eighth of the draws
        let ffn = tp * (1 + d.below(4)) + usize::from(tp > 1 && d.below(8) == 0);
        Self {
            tp,
            sp,
            sync,
            batch,
            seq,
            vocab,
            hidden,
            ffn,
            layer_norm: d.below(2) == 0,
            eps: pick(&mut d, &[1e-5, 1e-6]),
            col_bias: d.below(2) == 0,
            row_bias: d.below(2) == 0,
            p_drop: pick(&mut d, &[0.0, 0.1, 0.5]),
            step: d.below(5) as u64,
        }
    }
}

/// The parameters' full tensors and how each is split over TP.
fn params(c: &Draw, seed: u64) -> Result<BTreeMap<String, (Tensor, Shard)>> {
    let (v, h, f) = (c.vocab, c.hidden, c.ffn);
    let mut m = BTreeMap::new();
    let mut add = |n: &str, s: &[usize], shard: Shard, offset: f64| -> Result<()> {
        m.insert(n.to_string(), ((rand_t(seed, n, s)? * 0.5)? + offset).map(|t| (t, shard))?);
        Ok(())
    };
    add("embed", &[v, h], Shard::RowsPadded(v), 0.0)?;
    add("norm.weight", &[h], Shard::Replicated, 1.0)?;
    if c.layer_norm {
        add("norm.bias", &[h], Shard::Replicated, 0.0)?;
    }
    add("up.weight", &[f, h], ColumnParallelLinear::WEIGHT_SHARD, 0.0)?;
    if c.col_bias {
        add("up.bias", &[f], ColumnParallelLinear::BIAS_SHARD, 0.0)?;
    }
    add("down.weight", &[h, f], RowParallelLinear::WEIGHT_SHARD, 0.0)?;
    if c.row_bias {
        add("down.bias", &[h], RowParallelLinear::BIAS_SHARD, 0.0)?;
    }
    Ok(m)
}

/// The single-device stack in plain candle ops: `(y, gradients by name)` for the loss
/// `Σ y·upstream`.
fn reference(c: &Draw, p: &BTreeMap<String, (Tensor, Shard)>, ids: &Tensor, up: &Tensor, rng: &RngStreams) -> Result<(Tensor, BTreeMap<String, Tensor>)> {
    let vars: BTreeMap<&str, Var> = p.iter().map(|(n, (t, _))| Ok((n.as_str(), Var::from_tensor(t)?))).collect::<Result<_>>()?;
    let w = |n: &str| vars[n].as_tensor();
    let x = w("embed").index_select(&ids.flatten_all()?, 0)?.reshape((c.batch, c.seq, c.hidden))?;
    let h = if c.layer_norm {
        let xc = x.broadcast_sub(&x.mean_keepdim(2)?)?;
        let var = xc.sqr()?.mean_keepdim(2)?;
        xc.broadcast_div(&(var + c.eps)?.sqrt()?)?.broadcast_mul(w("norm.weight"))?.broadcast_add(w("norm.bias"))?
    } else {
        x.broadcast_div(&(x.sqr()?.mean_keepdim(2)? + c.eps)?.sqrt()?)?.broadcast_mul(w("norm.weight"))?
    };
    let lin = |x: &Tensor, n: &str| {
        let b = vars.get(format!("{n}.bias").as_str()).map(|b| b.as_tensor().clone());
        candle_nn::Linear::new(w(&format!("{n}.weight")).clone(), b).forward(x)
    };
    let m = lin(&lin(&h, "up")?.gelu()?, "down")?;
    let m = Dropout::new(c.p_drop, "nn.drop")?.forward(&m, rng, c.step, &Region::Replicated, true)?;
    let y = (x + m)?;
    let g = (&y * up)?.sum_all()?.backward()?;
    let grads = vars.iter().map(|(n, v)| Ok((n.to_string(), grad(&g, v.as_tensor(), n)?))).collect::<Result<_>>()?;
    Ok((y, grads))
}

/// One rank's stack: layers from its own `VarMap` of shards; `(y, gradients by name)`.
fn rank_run(c: &Draw, p: &BTreeMap<String, (Tensor, Shard)>, ids: &Tensor, up: &Tensor, rng: &RngStreams, g: Group) -> Result<(Tensor, BTreeMap<String, Tensor>)> {
    let tp = Tp::new(g.clone(), c.sp);
    let mut vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    let norm: Box<dyn Module> = if c.layer_norm {
        Box::new(LayerNorm::new(vb.pp("norm"), c.hidden, c.eps, &tp)?.with_grad_sync(c.sync))
    } else {
        Box::new(RmsNorm::new(vb.pp("norm"), c.hidden, c.eps, &tp)?.with_grad_sync(c.sync))
    };
    let upl = ColumnParallelLinear::new(vb.pp("up"), c.hidden, c.ffn, LinearConfig::new(c.col_bias), &tp)?;
    let down = RowParallelLinear::new(vb.pp("down"), c.ffn, c.hidden, LinearConfig::new(c.row_bias), &tp)?.with_grad_sync(c.sync);
    for (n, (full, shard)) in p {
        if n != "embed" {
            vm.set_one(n, shard_for_tp(full, *shard, &tp)?)?;
        }
    }
    let (full_embed, embed_shard) = &p["embed"];
    let embed = Var::from_tensor(&shard_for_tp(full_embed, *embed_shard, &tp)?)?;
    let local = |t: &Tensor| if c.sp { t.narrow(1, tp.rank() * c.seq / c.tp, c.seq / c.tp) } else { Ok(t.clone()) };
    let x = vocab_parallel_embedding(&local(ids)?, embed.as_tensor(), c.vocab, &tp)?;
    let m = down.forward(&upl.forward(&norm.forward(&x)?)?.gelu()?)?;
    let m = Dropout::new(c.p_drop, "nn.drop")?.forward(&m, rng, c.step, &tp.activation_region(), true)?;
    let y = (x + m)?;
    let gs = (&y * local(up)?)?.sum_all()?.backward()?;
    let mut grads = BTreeMap::from([("embed".to_string(), grad(&gs, embed.as_tensor(), "embed")?)]);
    // (in name order: every rank must call the collectives below in the same order)
    let data: BTreeMap<String, Var> = vm.data().lock().map_err(|_| candle_core::Error::Msg("varmap lock".into()))?.clone().into_iter().collect();
    for (n, v) in data {
        let mut gr = grad(&gs, v.as_tensor(), &n)?;
        if c.sp && c.sync == GradSync::Deferred && p[&n].1 == Shard::Replicated {
            gr = g.all_reduce(&gr)?; // the caller's share under Deferred
        }
        grads.insert(n, gr);
    }
    Ok((y, grads))
}

/// `max |t|`.
fn max_of(t: &Tensor) -> Result<f64> {
    t.to_dtype(DType::F64)?.abs()?.max_all()?.to_scalar::<f64>()
}

#[test]
fn random_tp_sp_layer_stacks_match_one_device() -> Result<()> {
    let (mut checked, mut refused, mut sp_runs, mut padded, mut deferred) = (0, 0, 0, 0, 0);
    let (mut worst_y, mut worst_g) = (0f64, 0f64);
    let range = seeds(CONFIGS)?;
    let n_configs = range.end - range.start;
    for seed in range {
        let c = Draw::new(seed);
        let what = format!("config {seed}: {c:?}");
        let p = params(&c, seed)?;
        let ids = (rand_t(seed, "ids", &[c.batch, c.seq])?.affine(0.5, 0.5)? * c.vocab as f64)?
            .floor()?
            .clamp(0.0, (c.vocab - 1) as f64)?
            .to_dtype(DType::U32)?;
        let up = rand_t(seed, "upstream", &[c.batch, c.seq, c.hidden])?;
        let rng = RngStreams::new(seed);
        let results: Vec<Result<_>> = run_ranks(c.tp, |g| rank_run(&c, &p, &ids, &up, &rng, g));
        if !c.ffn.is_multiple_of(c.tp) {
            for (r, res) in results.iter().enumerate() {
                let msg = match res {
                    Ok(_) => panic!("{what}: rank {r} accepted an MLP width TP does not divide"),
                    Err(e) => e.to_string(),
                };
                assert!(msg.contains(&format!("= {} is not divisible by the TP size {}", c.ffn, c.tp)), "{what}: rank {r}: {msg}");
            }
            refused += 1;
            continue;
        }
        let outs: Vec<_> = results.into_iter().enumerate().map(|(r, x)| x.map_err(|e| candle_core::Error::Msg(format!("{what}: rank {r}: {e}")))).collect::<Result<_>>()?;
        let (y_ref, g_ref) = reference(&c, &p, &ids, &up, &rng)?;
        let take = |t: &Tensor, dim: usize, r: usize| {
            let n = t.dim(dim)? / c.tp;
            t.narrow(dim, r * n, n)
        };
        // A gradient's error is relative to its whole tensor's scale (a rank's slice may hold
        // only entries that cancel to near zero), floored at 1e-2 of the largest gradient (a
        // whole tensor may cancel too: with a one-token vocabulary the RMSNorm weight's
        // gradient, a sum of O(1) terms, came to 6e-3, and f32 rounding was 1.2e-7 of it).
        let largest = g_ref.values().map(max_of).collect::<Result<Vec<_>>>()?.into_iter().fold(0.0, f64::max);
        for (r, (y, grads)) in outs.iter().enumerate() {
            let want = if c.sp { take(&y_ref, 1, r)? } else { y_ref.clone() };
            let e = max_abs(y, &want)?;
            assert!(e < 1e-5, "{what}: rank {r}: output off by {e:.2e}");
            worst_y = worst_y.max(e);
            assert_eq!(grads.keys().collect::<Vec<_>>(), g_ref.keys().collect::<Vec<_>>(), "{what}: rank {r}: gradients");
            for (n, gr) in grads {
                let (_, shard) = &p[n];
                let want = shard.slice(&g_ref[n], c.tp, r)?;
                let e = max_abs(gr, &want)? / max_of(&g_ref[n])?.max(1e-2 * largest).max(1e-30);
                assert!(e < 2e-5, "{what}: rank {r}: gradient of {n} off by rel {e:.2e}");
                worst_g = worst_g.max(e);
            }
        }
        // what the ranks replicate they hold bit for bit alike: the replicated gradients, and
        // the whole output without SP
        for (r, (y, grads)) in outs.iter().enumerate().skip(1) {
            if !c.sp {
                assert_eq!(max_abs(y, &outs[0].0)?, 0.0, "{what}: ranks 0 and {r} disagree on the replicated output");
            }
            for (n, gr) in grads {
                if p[n].1 == Shard::Replicated {
                    assert_eq!(max_abs(gr, &outs[0].1[n])?, 0.0, "{what}: ranks 0 and {r} disagree on the gradient of {n}");
                }
            }
        }
        checked += 1;
        sp_runs += c.sp as usize;
        padded += (c.tp > 1 && padded_rows(c.vocab, c.tp) * c.tp != c.vocab) as usize;
        deferred += (c.sp && c.sync == GradSync::Deferred) as usize;
    }
    println!(
        "{checked} layer stacks checked ({sp_runs} with SP, {deferred} of them Deferred, {padded} with a padded vocabulary), {refused} refused; worst output error {worst_y:.1e}, worst gradient rel. error {worst_g:.1e}"
    );
    let corners = n_configs >= CONFIGS;
    assert!(
        checked >= n_configs as usize / 2 && (!corners || (sp_runs >= 20 && deferred >= 10 && padded >= 20 && refused >= 5)),
        "{checked} checked, {refused} refused, {sp_runs} SP, {deferred} Deferred, {padded} padded"
    );
    Ok(())
}
