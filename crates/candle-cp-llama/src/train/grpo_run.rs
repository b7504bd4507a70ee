//! A GRPO run beside the trainer ([`super::grpo`] has the objective): the completions it trains
//! on until the next generation (`steps_per_generation · num_iterations` steps: one slice of
//! micro-batches per step of `steps_per_generation`), `π_old`'s per-token losses, the clipped
//! loss of a micro-batch, and the completions' place in checkpoints.
//!
//! ```text
//! step      s            s+1          …   s+μ−1        s+μ
//!           sample ──►   (kept)           (kept)       sample ──► …
//!           forward: ρ=1, records π_old's nll for every target (summed over the ranks
//!           holding distinct tokens, so every rank keeps all of them, by b·T + t)
//!                        ρ_t = e^(nll_old − nll)   clipped to [1 − ε, 1 + ε_high]
//! ```

use super::grpo::{GrpoConfig, ImportanceLevel, PromptSet, Rollout};
use crate::{shard_batch, Llama, ParallelCtx, IGNORE};
use candle_core::{bail, DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The clipped surrogate of one ratio `r` with advantage `a`, clip range `(ε, ε_high)` and
/// two-sided cap `delta`: the derivative of `−min(min(r, δ)·a, clip(r, 1 − ε, 1 + ε_high)·a)`
/// with respect to `nll = −log π` (`r·a`, or 0 where the clip or the cap holds), its value,
/// and whether the clip holds.
pub fn clipped_surrogate(r: f64, a: f64, (lo, hi): (f64, f64), delta: Option<f64>) -> (f64, f64, bool) {
    let c = r.clamp(1.0 - lo, 1.0 + hi);
    let r1 = delta.map_or(r, |d| r.min(d));
    let clipped = (a > 0.0 && r > 1.0 + hi) || (a < 0.0 && r < 1.0 - lo);
    let capped = delta.is_some_and(|d| r > d);
    (if clipped || capped { 0.0 } else { r * a }, -(r1 * a).min(c * a), clipped)
}

/// The relative distance below the entropy threshold within which a token counts as at it
/// ([`GrpoConfig::top_entropy_quantile`]).
pub const ENTROPY_TIE: f64 = 1e-6;

/// The `q` quantile of `x` (linear between the order statistics, as `torch.quantile`);
/// `None` for no value.
pub fn quantile(mut x: Vec<f64>, q: f64) -> Option<f64> {
    if x.is_empty() {
        return None;
    }
    x.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (x.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    Some(x[lo] + (x[hi] - x[lo]) * (pos - lo as f64))
}

/// CISPO's term of one token with ratio `r`, advantage `a`, cap `cap` and loss `nll`: the
/// derivative of `−sg(min(r, cap))·a·log π = sg(min(r, cap))·a·nll` with respect to `nll`, its
/// value, and whether the cap holds on a positive advantage (TRL's `cispo_clip_ratio`).
pub fn cispo_term(r: f64, a: f64, cap: f64, nll: f64) -> (f64, f64, bool) {
    let c = r.min(cap);
    (c * a, c * a * nll, r > cap && a > 0.0)
}

/// SAPO's term of one token with ratio `r`, advantage `a` and temperatures `(τ_pos, τ_neg)`:
/// the derivative of `−σ(τ·(r − 1))·(4/τ)·a` with respect to `nll = −log π` (`r = e^(old −
/// nll)`: `a·r·4σ(1 − σ)`), its value, and `false` (no clip: the gate fades the term).
pub fn sapo_term(r: f64, a: f64, (tau_pos, tau_neg): (f64, f64)) -> (f64, f64, bool) {
    let tau = if a > 0.0 { tau_pos } else { tau_neg };
    let s = 1.0 / (1.0 + (-tau * (r - 1.0)).exp());
    (a * r * 4.0 * s * (1.0 - s), -s * 4.0 / tau * a, false)
}

/// What a micro-batch's GRPO loss reports ([`Rollout::loss`]).
pub(crate) struct GrpoTerms {
    /// The node to back-propagate (its value TRL's loss).
    pub node: Tensor,
    /// TRL's loss.
    pub value: f64,
    /// The mean per-token KL over the completions (0 without the term).
    pub kl: f64,
    /// The fraction of completion tokens whose ratio is clipped (`None` at the ratio 1).
    pub clipped: Option<f64>,
}

impl Rollout {
    /// The global index `b·T + t` of each of this rank's positions (as its per-token losses
    /// are laid out: the token shard of [`shard_batch`]).
    fn positions(&self, ctx: &ParallelCtx) -> Result<Vec<u32>> {
        let (b, t) = self.slots.dims2()?;
        let idx = Tensor::arange(0u32, (b * t) as u32, &Device::Cpu)?.reshape((b, t))?;
        let pos = Tensor::arange(0u32, t as u32, &Device::Cpu)?;
        match crate::layout::shard_tokens(&[idx], &pos, b, t, ctx)?.first() {
            Some(mine) => mine.flatten_all()?.to_vec1(),
            None => bail!("grpo: no shard of the positions"),
        }
    }

    /// Keeps this rank's per-token losses `values` (the forward of the step that sampled the
    /// rollout) as `π_old`'s, by global position, summed over `group` (the ranks holding
    /// distinct tokens) so that every rank has every target's. Collective over `group`.
    pub(crate) fn record_old(&mut self, values: &[f32], ctx: &ParallelCtx, group: &candle_cp_comm::Group) -> Result<()> {
        let pos = self.positions(ctx)?;
        if pos.len() != values.len() {
            bail!("grpo: {} per-token losses for {} positions", values.len(), pos.len())
        }
        let mut all = vec![0f64; self.slots.elem_count()];
        for (&p, &v) in pos.iter().zip(values) {
            all[p as usize] = v as f64;
        }
        // (each position held by one rank of the group: x + 0 + … is x exactly)
        self.old = Some(super::dpo::sum_over(&all, group)?.into_iter().map(|x| x as f32).collect());
        Ok(())
    }

    /// The micro-batch's loss node: `Σ_t w_t·nll_t` over this rank's completion targets (`nll`
    /// its per-token losses, flattened, on the compute device, `values` the same on the host;
    /// `labels` and `marks` the shard's, as the trainer has them), `w_t` the clipped surrogate's derivative
    /// `k_i·A_i·ρ` (or `k_i·A_i` before `π_old` is recorded: the ratio 1; 0 for a token below
    /// the entropy quantile, `entropy` the policy's per-token entropies, with
    /// `top_entropy_quantile` < 1) plus, with `beta` > 0 and the reference's per-token losses
    /// `ref_nll`, the KL term's `k_i·β·(e^(ref − log π) − 1)`, shifted so that its value is
    /// TRL's loss. Collective over `group` (the ranks holding distinct tokens) with the KL
    /// term, a ratio or the entropy quantile.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn loss(&self, (nll, values): (&Tensor, &[f32]), (ref_nll, entropy): (Option<&[f32]>, Option<&[f32]>), cfg: &GrpoConfig, (labels, marks): (&[u32], &[u32]), ctx: &ParallelCtx, group: &candle_cp_comm::Group) -> Result<GrpoTerms> {
        let slots: Vec<u32> = shard_batch(&self.slots, ctx)?.labels.flatten_all()?.to_vec1()?;
        let n = slots.len();
        if n != nll.elem_count() || values.len() != n || labels.len() != n || marks.len() != n || ref_nll.is_some_and(|r| r.len() != n) || entropy.is_some_and(|e| e.len() != n) {
            bail!("grpo: {} per-token losses for {} labels, {} marks, {} slots, {:?} reference losses and {:?} entropies", nll.elem_count(), labels.len(), marks.len(), n, ref_nll.map(<[f32]>::len), entropy.map(<[f32]>::len))
        }
        let beta = cfg.beta;
        let kl_on = beta > 0.0;
        if kl_on && ref_nll.is_none() {
            bail!("grpo: the KL term (beta {beta}) needs the reference's per-token losses")
        }
        // (π_old's losses at this rank's positions)
        let old: Option<Vec<f32>> = match &self.old {
            Some(o) => Some(self.positions(ctx)?.iter().map(|&p| o.get(p as usize).copied().unwrap_or(0.0)).collect()),
            None => None,
        };
        let cispo = cfg.loss_type == super::grpo::GrpoLoss::Cispo;
        let sapo = cfg.loss_type == super::grpo::GrpoLoss::Sapo;
        // this rank's targets: (position, completion)
        let targets: Vec<(usize, usize)> = (0..n).filter(|&i| slots[i] > 0 && labels[i] != IGNORE && marks[i] == 1).map(|i| (i, slots[i] as usize - 1)).collect();
        let c = self.rewards.len();
        // (the tokens trained: those not below the entropy quantile, over the group's)
        let high: Option<Vec<bool>> = match (cfg.top_entropy_quantile < 1.0, entropy) {
            (false, _) => None,
            (true, None) => bail!("grpo: top_entropy_quantile {} needs the policy's per-token entropies", cfg.top_entropy_quantile),
            (true, Some(e)) => {
                let mut mine = vec![-1f32; n];
                for &(i, k) in &targets {
                    if self.norms[k] > 0.0 {
                        mine[i] = e[i].max(0.0);
                    }
                }
                let all = match group.size() {
                    1 => mine.clone(),
                    _ => group.all_gather(&Tensor::from_slice(&mine, (1, n), &Device::Cpu)?, 0)?.flatten_all()?.to_vec1()?,
                };
                let threshold = quantile(all.iter().copied().filter(|&x| x >= 0.0).map(f64::from).collect(), 1.0 - cfg.top_entropy_quantile);
                // (a token within 1e-6 of the threshold, relative, counts as at it: the layouts'
                // rounding must not split tokens of equal entropy — the same completion twice —
                // that the threshold falls on)
                Some(mine.iter().map(|&x| x >= 0.0 && threshold.is_some_and(|t| x as f64 >= t - ENTROPY_TIE * t.abs())).collect())
            }
        };
        // GSPO: each completion's ratio from its tokens' mean log-ratio over the group
        let seq_ratio: Option<Vec<f64>> = match (&old, cfg.importance_sampling_level) {
            (Some(o), ImportanceLevel::Sequence) => {
                let mut s = vec![0f64; 2 * c];
                for &(i, k) in &targets {
                    s[k] += o[i] as f64 - values[i] as f64;
                    s[c + k] += 1.0;
                }
                let s = super::dpo::sum_over(&s, group)?;
                Some((0..c).map(|k| (s[k] / s[c + k].max(1.0)).exp()).collect())
            }
            _ => None,
        };
        // (sums: Σ k_i·kl_t, Σ kl_t, tokens, Σ k_i·surrogate_t, clipped tokens)
        let mut sums = [0f64; 5];
        let mut w = vec![0f32; n];
        // (a masked completion, k_i 0: out of the loss, the KL and the token counts, as TRL's
        // completion mask)
        // (the policy term token by token: with a ratio or an entropy mask)
        let per_token = old.is_some() || high.is_some() || cispo || sapo;
        for &(i, k) in targets.iter().filter(|&&(_, k)| self.norms[k] > 0.0) {
            let mut wt = match (per_token, high.as_ref().is_none_or(|h| h[i])) {
                (false, _) => self.weight(k),
                (true, false) => 0.0,
                (true, true) => {
                    let r = match (&old, &seq_ratio) {
                        (None, _) => 1.0,
                        (Some(_), Some(r)) => r[k],
                        (Some(o), None) => (o[i] as f64 - values[i] as f64).exp(),
                    };
                    let (g, v, clipped) = match (cispo, sapo) {
                        (true, _) => cispo_term(r, self.advantages[k], cfg.epsilon_high, values[i] as f64),
                        (_, true) => sapo_term(r, self.advantages[k], cfg.sapo_temperatures),
                        _ => clipped_surrogate(r, self.advantages[k], (cfg.epsilon, cfg.epsilon_high), cfg.delta),
                    };
                    sums[3] += self.norms[k] * v;
                    sums[4] += clipped as u8 as f64;
                    self.norms[k] * g
                }
            };
            sums[2] += 1.0;
            if let (true, Some(r)) = (kl_on, ref_nll) {
                // ref − log π = nll − ref_nll
                let d = values[i] as f64 - r[i] as f64;
                let k3 = d.exp() - d - 1.0;
                sums[0] += self.norms[k] * k3;
                sums[1] += k3;
                wt += self.norms[k] * beta * (d.exp() - 1.0);
            }
            w[i] = wt as f32;
        }
        let sums = match kl_on || per_token {
            true => super::dpo::sum_over(&sums, group)?,
            false => sums.to_vec(),
        };
        let value = if per_token { sums[3] } else { self.value } + beta * sums[0];
        let graph = (nll.to_dtype(DType::F32)? * Tensor::from_vec(w, nll.shape(), nll.device())?)?.sum_all()?;
        // (each rank's node has the loss's value, as every loss's; its gradient is its share)
        let gv = graph.to_scalar::<f32>()? as f64;
        Ok(GrpoTerms {
            node: (graph + (value - gv))?,
            value,
            kl: if kl_on { sums[1] / sums[2].max(1.0) } else { 0.0 },
            clipped: self.old.as_ref().map(|_| sums[4] / sums[2].max(1.0)),
        })
    }
}

/// This rank's per-token losses of `r`'s rows under `model` as it is (the trainer's sharding
/// and forward, without dropout or a backward): `π_old` of a slice trained after the sampling
/// step. Collective over the world.
fn old_losses(model: &Llama, r: &Rollout, (cfg, step, micro): (&super::TrainConfig, usize, usize), (ctx, dev): (&ParallelCtx, &Device)) -> Result<Vec<f32>> {
    // (the rows as the trainer batches them)
    let (ids, _, docs) = super::batches::rows_batch(&r.rows, cfg, (step, micro), &Device::Cpu)?;
    let docs = docs.ok_or_else(|| candle_core::Error::Msg("grpo: a rollout row without documents".into()))?;
    let sb = crate::shard_batch_packed(&ids, &docs, ctx)?;
    let nll = model.token_nll_packed(&sb.input_ids.to_device(dev)?, &sb.labels.to_device(dev)?, &sb.positions.to_device(dev)?, &sb.documents)?;
    nll.detach().flatten_all()?.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec1()
}

/// The completions a run trains on until its next generation.
pub(crate) struct Kept {
    /// The step that sampled them.
    pub at: usize,
    /// One per micro-batch.
    pub rollouts: Vec<Rollout>,
}

/// The file in a checkpoint that keeps the completions of a generation not yet used up.
const KEPT_FILE: &str = "grpo_rollouts.json";

/// [`Kept`] as a checkpoint holds it (floats by their bits: read back exactly).
#[derive(Serialize, Deserialize)]
struct SavedRollouts {
    generated_at: usize,
    micro_batches: Vec<SavedMicro>,
}

#[derive(Serialize, Deserialize)]
struct SavedMicro {
    prompts: Vec<Vec<u32>>,
    completions: Vec<Vec<u32>>,
    rewards: Vec<u64>,
    old: Option<Vec<u32>>,
}

/// A GRPO run beside the trainer: its settings, prompts, (with the KL term) reference and the
/// completions of its latest generation.
pub(crate) struct GrpoRun {
    pub cfg: GrpoConfig,
    pub set: PromptSet,
    /// The reference's weights (kept in checkpoints; `None` for a LoRA run's, its frozen base)
    /// and model (with `beta` > 0).
    pub reference: Option<(Option<super::tr_dpo::RefModel>, Llama)>,
    /// The held-out prompts (with [`super::TrainConfig::eval`]).
    pub eval: Option<PromptSet>,
    /// The latest generation's completions (`None` before the first).
    pub kept: Option<Kept>,
    /// The reward model ([`GrpoConfig::reward_model`]), frozen on the run's layout.
    pub reward_model: Option<super::reward::RunRewardModel>,
}

impl GrpoRun {
    /// Whether step `step` samples completions (a multiple of `steps_per_generation ·
    /// num_iterations`); errors when it trains on an earlier generation's that the run does not
    /// hold (a resumed checkpoint without them).
    pub(crate) fn samples_at(&self, step: usize) -> Result<bool> {
        let from = step - step % self.cfg.cycle();
        match (&self.kept, from == step) {
            (_, true) => Ok(true),
            (Some(k), false) if k.at == from => Ok(false),
            (k, false) => bail!("grpo: step {} trains on the completions sampled at step {} (steps_per_generation {} × num_iterations {}), but the run holds {}: resume from a checkpoint written with them, or with the cycle dividing its step", step + 1, from + 1, self.cfg.steps_per_generation, self.cfg.num_iterations, match k {
                Some(k) => format!("step {}'s", k.at + 1),
                None => "none".into(),
            }),
        }
    }

    /// Samples, rewards and weighs the completions of the `steps_per_generation` steps from
    /// `step` on (`cfg.grad_accum` micro-batches each, each step's slice weighed as a step) by
    /// `model` as it is and keeps them; the slices trained after this step get `π_old` from a
    /// forward of `model` over their rows now (on `dev`). Collective over the world.
    pub(crate) fn sample(&mut self, model: &Llama, cfg: &super::TrainConfig, step: usize, (ctx, dev): (&ParallelCtx, &Device)) -> Result<()> {
        let s = self.cfg.steps_per_generation;
        let mut r = super::grpo_sample::rollouts(model, &self.cfg, &self.set, cfg.seed, (step, s * cfg.grad_accum), (cfg.batch, cfg.seq_len), self.reward_model.as_ref())?;
        // (every rank must weigh the same rewards: a reward function that is not a function of
        // its completion would part them silently)
        let all: Vec<f64> = r.iter().flat_map(|x| x.rewards.iter().copied()).collect();
        if ctx.world.size() > 1 {
            let rows = ctx.world.all_gather(&Tensor::from_slice(&all, (1, all.len()), &Device::Cpu)?, 0)?.to_vec2::<f64>()?;
            for (rank, row) in rows.iter().enumerate() {
                if let Some(i) = row.iter().zip(&all).position(|(a, b)| a.to_bits() != b.to_bits()) {
                    bail!("grpo: step {}: rank {rank} scored completion {i} {} where rank {} scored it {}: the reward function must give every rank the same reward for the same completion", step + 1, row[i], ctx.world.rank(), all[i])
                }
            }
        }
        for slice in r.chunks_mut(cfg.grad_accum) {
            super::grpo::weigh_step(slice, &self.cfg)?;
        }
        // (the later slices' π_old: the sampling policy's losses of their rows, now)
        for (k, later) in r.iter_mut().enumerate().skip(cfg.grad_accum) {
            let values = old_losses(model, later, (cfg, step + k / cfg.grad_accum, k % cfg.grad_accum), (ctx, dev))?;
            later.record_old(&values, ctx, ctx.token_group())?;
        }
        self.kept = Some(Kept { at: step, rollouts: r });
        Ok(())
    }

    /// The kept rollouts' index of micro-batch `micro` of step `step` (slice `(step − at) mod
    /// steps_per_generation`).
    fn index(&self, step: usize, micro: usize, grad_accum: usize) -> Option<usize> {
        let k = self.kept.as_ref()?;
        let slice = step.checked_sub(k.at)? % self.cfg.steps_per_generation;
        Some(slice * grad_accum + micro)
    }

    /// Micro-batch `micro`'s rollout for step `step` (of `grad_accum` micro-batches) in the
    /// kept generation.
    pub(crate) fn rollout(&self, step: usize, (micro, grad_accum): (usize, usize)) -> Result<&Rollout> {
        self.index(step, micro, grad_accum)
            .and_then(|i| self.kept.as_ref()?.rollouts.get(i))
            .ok_or_else(|| candle_core::Error::Msg(format!("grpo: no rollout for step {} micro-batch {micro}", step + 1)))
    }

    /// Keeps the `π_old` of step `step`'s micro-batch `micro` (this rank's per-token losses
    /// `values` of its forward) when later steps train on it (a cycle of more than one step)
    /// and it has none yet. Collective over `group`.
    pub(crate) fn record_old(&mut self, step: usize, (micro, grad_accum): (usize, usize), values: &[f32], ctx: &ParallelCtx, group: &candle_cp_comm::Group) -> Result<()> {
        if self.cfg.num_iterations < 2 {
            return Ok(());
        }
        let Some(i) = self.index(step, micro, grad_accum) else { return Ok(()) };
        match self.kept.as_mut().and_then(|k| k.rollouts.get_mut(i)) {
            Some(r) if r.old.is_none() => r.record_old(values, ctx, group),
            _ => Ok(()),
        }
    }

    /// Writes the kept completions into checkpoint `dir` (by `write`: the main rank) when the
    /// step after `done` steps still trains on them.
    pub(crate) fn save(&self, dir: &Path, done: usize, write: bool) -> Result<()> {
        let Some(k) = self.kept.as_ref().filter(|_| write && !done.is_multiple_of(self.cfg.cycle())) else { return Ok(()) };
        let saved = SavedRollouts {
            generated_at: k.at,
            micro_batches: k
                .rollouts
                .iter()
                .map(|r| SavedMicro {
                    prompts: r.docs.iter().map(|d| d.0.clone()).collect(),
                    completions: r.docs.iter().map(|d| d.1.clone()).collect(),
                    rewards: r.rewards.iter().map(|x| x.to_bits()).collect(),
                    old: r.old.as_ref().map(|o| o.iter().map(|x| x.to_bits()).collect()),
                })
                .collect(),
        };
        let p = dir.join(KEPT_FILE);
        let text = serde_json::to_string(&saved).map_err(|e| candle_core::Error::Msg(format!("grpo: {e}")))?;
        std::fs::write(&p, text).map_err(|e| candle_core::Error::Msg(format!("grpo: writing {}: {e}", p.display())))
    }

    /// The completions checkpoint `dir` kept (`None` where it holds none), packed into `cfg`'s
    /// rows and weighed again.
    fn resumed(dir: &Path, g: &GrpoConfig, cfg: &super::TrainConfig) -> Result<Option<Kept>> {
        let p = dir.join(KEPT_FILE);
        if !p.exists() {
            return Ok(None);
        }
        let e = |x: String| candle_core::Error::Msg(format!("grpo: reading {}: {x}", p.display()));
        let text = std::fs::read_to_string(&p).map_err(|x| e(x.to_string()))?;
        let saved: SavedRollouts = serde_json::from_str(&text).map_err(|x| e(x.to_string()))?;
        if saved.micro_batches.len() != g.steps_per_generation * cfg.grad_accum {
            return Err(e(format!("{} micro-batches kept, the run takes {} per step and {} steps per generation", saved.micro_batches.len(), cfg.grad_accum, g.steps_per_generation)));
        }
        let mut rollouts = Vec::new();
        for m in saved.micro_batches {
            if m.prompts.len() != m.completions.len() || m.old.as_ref().is_some_and(|o| o.len() != cfg.batch * cfg.seq_len) {
                return Err(e(format!("{} prompts, {} completions and {:?} old losses for rows [{}, {}]", m.prompts.len(), m.completions.len(), m.old.as_ref().map(Vec::len), cfg.batch, cfg.seq_len)));
            }
            let mut r = Rollout::packed(m.prompts.into_iter().zip(m.completions).collect(), m.rewards.into_iter().map(f64::from_bits).collect(), g, (cfg.batch, cfg.seq_len))?;
            r.old = m.old.map(|o| o.into_iter().map(f32::from_bits).collect());
            rollouts.push(r);
        }
        for slice in rollouts.chunks_mut(cfg.grad_accum) {
            super::grpo::weigh_step(slice, g)?;
        }
        Ok(Some(Kept { at: saved.generated_at, rollouts }))
    }

    /// The held-out reward: the mean reward of one greedy completion of every held-out prompt
    /// (at most `max_completion_length` tokens, ending at the stop tokens) under `model` as it
    /// is; `None` without held-out prompts. The prompts are generated in batches of a
    /// rollout's rows (`prompts · num_generations`, [`Llama::generate_ragged`]), each batch
    /// filled up to a multiple of `dp` with copies of its last prompt. Collective over the
    /// world.
    pub(crate) fn evaluate(&self, model: &Llama, ctx: &ParallelCtx) -> Result<Option<f64>> {
        let Some(set) = &self.eval else { return Ok(None) };
        model.set_lora_dropout(None)?;
        let dp = ctx.layout.dp.max(1);
        let per_batch = (self.cfg.prompts * self.cfg.num_generations).max(dp);
        let mut total = 0.0;
        for first in (0..set.len()).step_by(per_batch) {
            let held = (first..set.len().min(first + per_batch))
                .map(|i| set.get(i).ok_or_else(|| candle_core::Error::Msg(format!("grpo: no held-out prompt {i}"))))
                .collect::<Result<Vec<_>>>()?;
            let mut rows: Vec<Vec<u32>> = held.iter().map(|(p, _)| p.to_vec()).collect();
            while !rows.len().is_multiple_of(dp) {
                rows.push(rows[rows.len() - 1].clone());
            }
            let out = model.generate_ragged(&rows, self.cfg.max_completion_length, crate::sampling::Sampling::Greedy, &self.cfg.stop)?;
            let scored = match &self.reward_model {
                Some(m) => m.rewards(&held.iter().zip(&out.tokens).map(|((p, _), c)| (*p, c.as_slice())).collect::<Vec<_>>())?,
                None => vec![0.0; held.len()],
            };
            for (((prompt, answer), completion), s) in held.iter().zip(&out.tokens).zip(scored) {
                total += (self.cfg.reward)(prompt, completion, answer)? + s;
            }
        }
        Ok(Some(total / set.len().max(1) as f64))
    }

    /// The reference's per-token losses of the rows `sb` (this rank's shard, as the policy's
    /// forward takes them), flattened; `None` without the KL term. Collective over the world.
    pub(crate) fn reference_nll(&self, sb: &crate::ShardedBatch, dev: &Device) -> Result<Option<Vec<f32>>> {
        let Some((_, m)) = &self.reference else { return Ok(None) };
        let nll = m.token_nll_packed(&sb.input_ids.to_device(dev)?, &sb.labels.to_device(dev)?, &sb.positions.to_device(dev)?, &sb.documents)?;
        Ok(Some(nll.detach().flatten_all()?.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.to_vec1()?))
    }
}

/// A run's GRPO (`None` without [`super::TrainConfig::grpo`]): its settings checked against
/// the data, the layout and the rows; with the KL term, the reference — this rank's copy of the
/// model as the run starts, or a resumed run's from its checkpoint (`resume_dir/reference`);
/// a resumed run's kept completions.
pub(crate) fn prepare(cfg: &super::TrainConfig, mcfg: &crate::LlamaConfig, (policy, model, ctx, dev): (&candle_nn::VarMap, &Llama, &ParallelCtx, &Device), resume_dir: Option<&Path>) -> Result<Option<GrpoRun>> {
    let (g, set) = match (&cfg.grpo, &cfg.data) {
        (None, super::DataSource::Prompts(_)) => bail!("train: prompts train by GRPO: set grpo"),
        (None, _) => return Ok(None),
        (Some(g), super::DataSource::Prompts(set)) => (g, set),
        (Some(_), _) => bail!("train: GRPO samples completions of prompts (DataSource::Prompts)"),
    };
    g.validate()?;
    if cfg.dpo.is_some() {
        bail!("train: a GRPO run takes no dpo")
    }
    let eval = match cfg.eval.as_ref().map(|e| &e.data) {
        None => None,
        Some(super::DataSource::Prompts(s)) => Some(s.clone()),
        Some(_) => bail!("train: a GRPO run's held-out data must be prompts too"),
    };
    if !(g.prompts * g.num_generations).is_multiple_of(ctx.layout.dp) {
        bail!("train: GRPO's {} prompts × {} completions per micro-batch are generated split over DP: dp = {} must divide their product", g.prompts, g.num_generations, ctx.layout.dp)
    }
    if set.vocab_needed() > mcfg.vocab_size {
        bail!("train: the prompts use {} token ids, the model's vocabulary is {}", set.vocab_needed(), mcfg.vocab_size)
    }
    g.check_fits(set, cfg.batch, cfg.seq_len)?;
    let reference = match g.beta > 0.0 {
        false => None,
        // (a LoRA run's reference: its frozen base, the same tensors read without the adapters,
        // as PEFT's disabled adapters — nothing copied, nothing to checkpoint; a quantized
        // base's codes, the policy's own)
        true if cfg.lora.is_some() => {
            if mcfg.lora.as_ref().is_some_and(|l| !l.modules_to_save.is_empty()) {
                bail!("train: GRPO's KL term (beta {}) with LoRA takes the frozen base as its reference: not with modules trained whole (modules_to_save): set beta 0", g.beta)
            }
            let base = crate::LlamaConfig { lora: None, ..mcfg.clone() };
            match (cfg.quantize_base, model.quantized_base()?) {
                (Some(_), Some(m)) => Some((None, m)),
                (Some(_), None) => bail!("train: GRPO's KL reference: the quantized base could not be read without its adapters"),
                (None, _) => Some((None, Llama::new(super::lora::frozen_builder(policy, &base, cfg.dtype, dev)?, &base, ctx)?)),
            }
        }
        true => {
            let r = match resume_dir {
                Some(d) => super::tr_dpo::RefModel::resumed(d, "GRPO", ctx, dev, cfg.dtype, cfg.sliding_window)?,
                None => super::tr_dpo::RefModel::copy_of(policy, mcfg)?,
            };
            r.check_matches(policy)?;
            let m = r.model(cfg.dtype, dev, ctx)?;
            Some((Some(r), m))
        }
    };
    let kept = resume_dir.map(|d| GrpoRun::resumed(d, g, cfg)).transpose()?.flatten();
    let reward_model = g.reward_model.as_ref().map(|spec| super::reward::RunRewardModel::load(spec, cfg, mcfg, ctx, dev)).transpose()?;
    Ok(Some(GrpoRun { cfg: g.clone(), set: set.clone(), reference, eval, kept, reward_model }))
}

#[cfg(test)]
#[path = "grpo_run_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "grpo_reward_model_tests.rs"]
mod reward_model_tests;
