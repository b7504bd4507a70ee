//! Check a parallel layout against reference data: a HF checkpoint directory plus a
//! `reference.safetensors` holding `input_ids [B, T]` (int), `logits [B, T, V]`, `loss []`
//! and `grad.<name>` for every parameter (the oracle format of `tests/data/oracle/`).
//!
//! [`run_layout`] runs the layout on thread ranks (forward, global loss, backward, gradient
//! reduction), gathers the global logits (unsharding by each rank's global positions) and
//! the full gradients; [`compare`] measures it against the reference.

use crate::config::LlamaConfig;
use crate::grads::{named_grads, reduce_gradients};
use crate::hf::load_safetensors_dir;
use crate::layout::{shard_batch, Layout, ParallelCtx};
use crate::model::Llama;
use crate::params::{gather_full_to_host, param_specs};
use candle_core::{bail, DType, Device, Result, Tensor};
use candle_cp_comm::{run_ranks_with, Group, ThreadGroupOptions};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::path::Path;

/// Reference data of one checkpoint.
pub struct Reference {
    /// `[B, T]` u32 token ids.
    pub input_ids: Tensor,
    /// `[B, T, V]` f32.
    pub logits: Tensor,
    /// Mean next-token loss.
    pub loss: f64,
    /// `d loss / d parameter` by parameter name, full shapes, f32.
    pub grads: HashMap<String, Tensor>,
}

/// Load `reference.safetensors` (see the module doc) on the CPU.
pub fn load_reference(path: impl AsRef<Path>) -> Result<Reference> {
    let path = path.as_ref();
    let mut t = candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| candle_core::Error::Msg(format!("reading reference {}: {e}", path.display())))?;
    let mut take = |k: &str| {
        t.remove(k)
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: no tensor `{k}`", path.display())))
    };
    let ids = take("input_ids")?;
    let logits = take("logits")?.to_dtype(DType::F32)?;
    let loss = take("loss")?.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    if ids.rank() != 2 || logits.rank() != 3 || loss.len() != 1 {
        bail!(
            "{}: need input_ids [B, T], logits [B, T, V], loss [] (got {:?}, {:?}, {} values)",
            path.display(),
            ids.dims(),
            logits.dims(),
            loss.len()
        )
    }
    let ids = ids.to_dtype(DType::I64)?.to_dtype(DType::U32)?;
    let grads = t
        .into_iter()
        .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n.to_string(), v)))
        .map(|(k, v)| Ok((k, v.to_dtype(DType::F32)?)))
        .collect::<Result<HashMap<_, _>>>()?;
    Ok(Reference {
        input_ids: ids,
        logits,
        loss: loss[0],
        grads,
    })
}

/// Result of one layout run, gathered on the host.
pub struct LayoutRun {
    /// Global logits `[B, T, V]` f32, rebuilt from every rank's shard.
    pub logits: Tensor,
    /// Loss reported by rank 0.
    pub loss: f64,
    /// Largest difference between ranks' losses.
    pub loss_spread: f64,
    /// Full reduced gradients (rank 0's), in [`param_specs`] order.
    pub grads: Vec<(String, Tensor)>,
    /// Largest |difference| between any rank's full gradient and rank 0's.
    pub grad_spread: f64,
}

/// One rank's results in [`run_layout_on`] (opaque: made by the rank body, read by the gather).
pub struct RankOut {
    logits: Vec<f32>,
    positions: Vec<u32>,
    rows: (usize, usize),
    loss: f64,
    grads: Vec<(String, Tensor)>,
}

/// Run `layout` on `layout.world_size()` thread ranks: every rank shards `full` (name → full
/// f32 tensor) and the global batch `ids [B, T]`, computes logits and the global loss,
/// backpropagates, reduces and gathers the gradients. Compute runs on `device`.
pub fn run_layout(
    full: &HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    ids: &Tensor,
    layout: Layout,
    device: &Device,
) -> Result<LayoutRun> {
    run_layout_recompute(full, cfg, ids, layout, device, false)
}

/// One rank's part of [`run_layout_on`], given its world group.
pub type LayoutRankBody<'a> = dyn Fn(Group) -> Result<RankOut> + Send + Sync + 'a;

/// [`run_layout`] on ranks started by `spawn`, which must call the body once per rank
/// `0..layout.world_size()` (each on its own thread, with the rank's world group) and return
/// the results in rank order: thread ranks, or NCCL ranks one GPU each
/// (`candle_cp_comm::nccl::run_nccl_ranks`). A rank computes on its group's
/// [`home_device`](candle_cp_comm::ProcessGroup::home_device), else on `device`.
pub fn run_layout_on(
    full: &HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    ids: &Tensor,
    layout: Layout,
    device: &Device,
    spawn: impl FnOnce(&LayoutRankBody) -> Result<Vec<Result<RankOut>>>,
) -> Result<LayoutRun> {
    run_layout_recompute_on(full, cfg, ids, layout, device, false, spawn)
}

/// [`run_layout`] with every decoder layer recomputed in backward when `recompute`
/// ([`Llama::with_recompute`]).
pub fn run_layout_recompute(
    full: &HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    ids: &Tensor,
    layout: Layout,
    device: &Device,
    recompute: bool,
) -> Result<LayoutRun> {
    on_threads(full, cfg, ids, layout, device, RunOpts { recompute, quant: None })
}

/// How [`run_layout_impl`] builds the model: recomputed layers, a quantized base.
#[derive(Clone, Copy)]
struct RunOpts {
    recompute: bool,
    quant: Option<candle_cp_nn::QuantConfig>,
}

/// [`run_layout_impl`] on thread ranks computing on `device`.
fn on_threads(full: &HashMap<String, Tensor>, cfg: &LlamaConfig, ids: &Tensor, layout: Layout, device: &Device, opts: RunOpts) -> Result<LayoutRun> {
    let groups = ThreadGroupOptions { device: device.clone(), ..Default::default() };
    let n = layout.world_size();
    run_layout_impl(full, cfg, ids, layout, device, opts, |body| Ok(run_ranks_with(n, groups, body)))
}

/// [`run_layout_on`] with the choice of [`run_layout_recompute`].
pub fn run_layout_recompute_on(
    full: &HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    ids: &Tensor,
    layout: Layout,
    device: &Device,
    recompute: bool,
    spawn: impl FnOnce(&LayoutRankBody) -> Result<Vec<Result<RankOut>>>,
) -> Result<LayoutRun> {
    run_layout_impl(full, cfg, ids, layout, device, RunOpts { recompute, quant: None }, spawn)
}

/// [`run_layout_recompute`] of a LoRA model (`cfg.lora` set) whose frozen base each rank
/// quantizes from its shards ([`crate::quant::QuantBase`], [`Llama::new_quantized`]).
pub fn run_layout_quantized(
    full: &HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    ids: &Tensor,
    layout: Layout,
    device: &Device,
    recompute: bool,
    quant: candle_cp_nn::QuantConfig,
) -> Result<LayoutRun> {
    on_threads(full, cfg, ids, layout, device, RunOpts { recompute, quant: Some(quant) })
}

fn run_layout_impl(
    full: &HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    ids: &Tensor,
    layout: Layout,
    device: &Device,
    RunOpts { recompute, quant }: RunOpts,
    spawn: impl FnOnce(&LayoutRankBody) -> Result<Vec<Result<RankOut>>>,
) -> Result<LayoutRun> {
    layout.validate(cfg.num_attention_heads, cfg.num_key_value_heads)?;
    let (b, t) = ids.dims2()?;
    let v = cfg.vocab_size;
    let body = |world: Group| -> Result<RankOut> {
        let device = &world.home_device().unwrap_or_else(|| device.clone());
        let ids_dev = ids.to_device(device)?;
        let ctx = ParallelCtx::new(world, layout)?;
        // this rank's slices only go to its device (f32), one parameter at a time
        let vm = crate::params::sharded_params(cfg, &ctx, DType::F32, device, |s| match full.get(&s.name) {
            Some(t) => Ok(t.clone()),
            None => bail!("run_layout: missing parameter {} {:?}", s.name, s.shape),
        })?;
        // (a LoRA model over its frozen base, as the trainer builds it: the base plain tensors)
        let lora = cfg.lora.is_some();
        let model = match quant {
            None if lora => Llama::new(crate::train::lora::frozen_builder(&vm, cfg, DType::F32, device)?, cfg, &ctx)?,
            None => Llama::new(VarBuilder::from_varmap(&vm, DType::F32, device), cfg, &ctx)?,
            Some(q) => Llama::new_quantized(&crate::quant::QuantBase::from_varmap(&vm, cfg, q)?, DType::F32, device, cfg, &ctx)?,
        }
        .with_recompute(recompute);
        let batch = shard_batch(&ids_dev, &ctx)?;
        let (loss, logits) = model.loss(&batch.input_ids, &batch.labels, &batch.positions)?;
        let mut grads = model.backward(&loss)?;
        reduce_gradients(&mut grads, &vm, cfg, &ctx)?;
        let named = named_grads(&grads, &vm)?;
        let mut full_grads = match quant {
            None if !lora => gather_full_to_host(&named, cfg, &ctx, true)?,
            // (the frozen base's weights have no gradient: the adapters' alone)
            _ => crate::params::trainable_specs(cfg)
                .into_iter()
                .map(|s| match named.get(&s.name) {
                    Some(g) => Ok((s.name.clone(), s.gather(g, &ctx)?.to_device(&Device::Cpu)?)),
                    None => bail!("run_layout: no gradient for adapter {}", s.name),
                })
                .collect::<Result<_>>()?,
        };
        // (a LoRA model: its adapters' gradients only; the frozen weights' are not summed)
        if cfg.lora.is_some() {
            full_grads.retain(|(n, _)| cfg.lora.as_ref().is_some_and(|l| l.trains(n)));
        }
        let bl = b / layout.dp;
        Ok(RankOut {
            logits: logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
            positions: batch.positions.to_vec1()?,
            rows: (ctx.coords.0 * bl, bl),
            loss: loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            grads: full_grads
                .into_iter()
                .map(|(k, g)| Ok((k, g.to_dtype(DType::F32)?)))
                .collect::<Result<_>>()?,
        })
    };
    let outs = spawn(&body)?;
    if outs.len() != layout.world_size() {
        bail!("run_layout: {} ranks returned, layout {layout} has {}", outs.len(), layout.world_size())
    }
    let outs: Vec<RankOut> = outs.into_iter().collect::<Result<_>>()?;
    let mut glob = vec![f32::NAN; b * t * v];
    for o in &outs {
        let (r0, bl) = o.rows;
        let tl = o.positions.len();
        if o.logits.len() != bl * tl * v {
            bail!(
                "run_layout: a rank returned {} logits for [{bl}, {tl}, {v}]",
                o.logits.len()
            )
        }
        for bi in 0..bl {
            for (li, &p) in o.positions.iter().enumerate() {
                let src = (bi * tl + li) * v;
                let dst = ((r0 + bi) * t + p as usize) * v;
                glob[dst..dst + v].copy_from_slice(&o.logits[src..src + v]);
            }
        }
    }
    if glob.iter().any(|x| x.is_nan()) {
        bail!("run_layout: layout {layout} left some global logits uncovered (or NaN)")
    }
    let logits = Tensor::from_vec(glob, (b, t, v), &Device::Cpu)?;
    let loss = outs[0].loss;
    let loss_spread = outs.iter().map(|o| (o.loss - loss).abs()).fold(0.0, f64::max);
    let mut grad_spread = 0f64;
    for o in &outs[1..] {
        for ((_, a), (_, g)) in outs[0].grads.iter().zip(&o.grads) {
            grad_spread = grad_spread.max(max_abs_diff(a, g)?);
        }
    }
    let grads = outs.into_iter().next().map(|o| o.grads).unwrap_or_default();
    Ok(LayoutRun {
        logits,
        loss,
        loss_spread,
        grads,
        grad_spread,
    })
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f64>()
}

/// Tolerances (defaults: the oracle README's float32 bounds).
#[derive(Clone, Copy, Debug)]
pub struct Tolerances {
    /// Max |logits error|.
    pub logits_abs: f64,
    /// |loss error|.
    pub loss_abs: f64,
    /// Max over parameters of max|grad error| / max|reference grad|.
    pub grad_rel: f64,
}

impl Default for Tolerances {
    fn default() -> Self {
        Self {
            logits_abs: 1e-5,
            loss_abs: 5e-6,
            grad_rel: 5e-5,
        }
    }
}

/// Errors of a run against a reference.
#[derive(Clone, Debug)]
pub struct Report {
    /// Max |logits - ref|.
    pub logits_abs: f64,
    /// |loss - ref|.
    pub loss_abs: f64,
    /// Worst per-parameter relative gradient error.
    pub grad_rel_max: f64,
    /// Parameter with the worst relative gradient error.
    pub worst_param: String,
    /// Relative error of every parameter, [`param_specs`] order.
    pub grad_rel: Vec<(String, f64)>,
    /// Max disagreement between ranks (loss, gradients), should be ~0.
    pub rank_spread: f64,
    /// Tolerances applied.
    pub tol: Tolerances,
}

impl Report {
    /// All metrics within tolerance (ranks agreeing to `grad_rel`-level too).
    pub fn pass(&self) -> bool {
        self.logits_abs <= self.tol.logits_abs
            && self.loss_abs <= self.tol.loss_abs
            && self.grad_rel_max <= self.tol.grad_rel
            && self.rank_spread <= self.tol.loss_abs
    }
}

/// Compare a run with the reference. Errors if parameter names or shapes differ.
pub fn compare(run: &LayoutRun, reference: &Reference, tol: Tolerances) -> Result<Report> {
    if run.logits.dims() != reference.logits.dims() {
        bail!(
            "compare: logits {:?} vs reference {:?}",
            run.logits.dims(),
            reference.logits.dims()
        )
    }
    let logits_abs = max_abs_diff(&run.logits, &reference.logits)?;
    let loss_abs = (run.loss - reference.loss).abs();
    let mut grad_rel = Vec::new();
    let (mut worst, mut worst_param) = (0f64, String::new());
    if run.grads.len() != reference.grads.len() {
        let ours: Vec<&String> = run.grads.iter().map(|(k, _)| k).collect();
        let mut theirs: Vec<&String> = reference.grads.keys().collect();
        theirs.sort();
        bail!(
            "compare: model has {} parameters {ours:?}, reference has {} gradients {theirs:?}",
            ours.len(),
            theirs.len()
        )
    }
    for (name, g) in &run.grads {
        let Some(r) = reference.grads.get(name) else {
            bail!("compare: reference has no grad.{name}")
        };
        if r.dims() != g.dims() {
            bail!("compare: grad.{name} {:?} vs reference {:?}", g.dims(), r.dims())
        }
        let scale = r
            .to_dtype(DType::F64)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?
            .max(f64::MIN_POSITIVE);
        let rel = max_abs_diff(g, r)? / scale;
        if rel >= worst || worst_param.is_empty() {
            worst = rel;
            worst_param = name.clone();
        }
        grad_rel.push((name.clone(), rel));
    }
    Ok(Report {
        logits_abs,
        loss_abs,
        grad_rel_max: worst,
        worst_param,
        grad_rel,
        rank_spread: run.loss_spread.max(run.grad_spread),
        tol,
    })
}

/// Load the checkpoint in `model_dir` and the reference file, run `layout` on `device`,
/// compare with the default tolerances.
pub fn verify_reference(
    model_dir: impl AsRef<Path>,
    reference: impl AsRef<Path>,
    layout: Layout,
    device: &Device,
) -> Result<Report> {
    verify_reference_recompute(model_dir, reference, layout, device, false)
}

/// [`verify_reference`] with every decoder layer recomputed in backward when `recompute`.
pub fn verify_reference_recompute(
    model_dir: impl AsRef<Path>,
    reference: impl AsRef<Path>,
    layout: Layout,
    device: &Device,
    recompute: bool,
) -> Result<Report> {
    let (cfg, full) = load_checked(model_dir.as_ref())?;
    let r = load_reference(reference)?;
    let run = run_layout_recompute(&full, &cfg, &r.input_ids, layout, device, recompute)?;
    compare(&run, &r, Tolerances::default())
}

/// The config and the full parameters of the checkpoint in `dir`, checked against each other.
fn load_checked(dir: &Path) -> Result<(LlamaConfig, HashMap<String, Tensor>)> {
    let cfg = LlamaConfig::from_file(dir.join("config.json"))?;
    let full = load_safetensors_dir(dir, &Device::Cpu)?;
    for s in param_specs(&cfg) {
        match full.get(&s.name) {
            Some(t) if t.dims() == s.shape.as_slice() => {}
            Some(t) => bail!(
                "{}: {} has shape {:?}, config implies {:?}",
                dir.display(),
                s.name,
                t.dims(),
                s.shape
            ),
            None => bail!("{}: checkpoint has no {}", dir.display(), s.name),
        }
    }
    Ok((cfg, full))
}

/// [`verify_reference`] with the ranks started by `spawn` (see [`run_layout_on`]), e.g. NCCL
/// ranks one GPU each.
pub fn verify_reference_on(
    model_dir: impl AsRef<Path>,
    reference: impl AsRef<Path>,
    layout: Layout,
    device: &Device,
    spawn: impl FnOnce(&LayoutRankBody) -> Result<Vec<Result<RankOut>>>,
) -> Result<Report> {
    let (cfg, full) = load_checked(model_dir.as_ref())?;
    let r = load_reference(reference)?;
    let run = run_layout_on(&full, &cfg, &r.input_ids, layout, device, spawn)?;
    compare(&run, &r, Tolerances::default())
}

/// [`verify_reference_on`] over the first `tokens` tokens of the reference's sequence, against
/// the single-device CPU run of those tokens (the oracle holds the whole sequence only; the
/// CPU run is itself checked against it, e.g. by `tests/llama_parity.rs`). For slow devices
/// (the CPU emulation of CUDA) that cannot afford the whole sequence.
pub fn verify_prefix_on(
    model_dir: impl AsRef<Path>,
    reference: impl AsRef<Path>,
    tokens: usize,
    layout: Layout,
    device: &Device,
    spawn: impl FnOnce(&LayoutRankBody) -> Result<Vec<Result<RankOut>>>,
) -> Result<Report> {
    let (cfg, full) = load_checked(model_dir.as_ref())?;
    let r = load_reference(reference)?;
    let t = r.input_ids.dim(1)?;
    if tokens == 0 || tokens > t {
        bail!("verify_prefix_on: {tokens} tokens of a reference sequence of {t} (input_ids {:?})", r.input_ids.dims())
    }
    let ids = r.input_ids.narrow(1, 0, tokens)?;
    let cpu = run_layout(&full, &cfg, &ids, Layout::single(), &Device::Cpu)?;
    let want = Reference {
        input_ids: ids.clone(),
        logits: cpu.logits,
        loss: cpu.loss,
        grads: cpu.grads.into_iter().collect(),
    };
    let run = run_layout_on(&full, &cfg, &ids, layout, device, spawn)?;
    compare(&run, &want, Tolerances::default())
}
