//! `generate --best-of N --reward-model DIR`: best-of-N sampling (rejection sampling with a
//! reward model, `candle_cp_llama::train::reward::best_of_n`; a process reward model judging
//! each completion's steps, `--step-separator`, `--step-aggregate`) on one device and on the layout,
//! compared: the same completions and picks, the rewards within 1e-4 (relative above 1).

use anyhow::{bail, Context};
use candle_core::{DType, Device};
use candle_cp_comm::run_ranks;
use candle_cp_llama::train::reward::{best_of_n, BestOfN, Judge};
use candle_cp_llama::{load_hf_sharded, Layout, Llama, ParallelCtx, Sampling};
use candle_nn::VarBuilder;
use std::path::Path;

/// What [`run`] needs beside the layout: the policy's and the reward model's directories, the
/// prompts, N, and generation's settings.
pub struct BestOf<'a> {
    pub dev: &'a Device,
    pub policy: &'a Path,
    pub reward_model: &'a Path,
    pub judge: Judge<'a>,
    pub rows: &'a [Vec<u32>],
    pub n: usize,
    pub new: usize,
    pub sampling: Sampling,
    pub stop: &'a [u32],
}

/// Rank 0's best-of-N picks on `layout` (each rank its shards of both models).
fn on_layout(b: &BestOf, layout: Layout) -> anyhow::Result<Vec<BestOfN>> {
    let out = run_ranks(layout.world_size(), |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        let (vm, cfg) = load_hf_sharded(b.policy, &ctx, b.dev, DType::F32)?;
        let policy = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, b.dev), &cfg, &ctx)?;
        let rm = candle_cp_llama::reward::load_reward_model(b.reward_model, &ctx, b.dev, DType::F32)?;
        best_of_n(&policy, (&rm, b.judge), b.rows, b.n, b.new, b.sampling, b.stop, layout.dp)
    });
    out.into_iter().next().context("no rank")?.with_context(|| format!("best-of-{} on {layout}", b.n))
}

/// Best-of-N on one device and on `layout`; prints each prompt's pick (`text` decodes tokens)
/// and every sample's reward; errors if the two disagree.
pub fn run(b: &BestOf, layout: Layout, text: &dyn Fn(&[u32]) -> String) -> anyhow::Result<()> {
    let t0 = std::time::Instant::now();
    let one = on_layout(b, Layout::single())?;
    let s1 = t0.elapsed().as_secs_f64();
    let t0 = std::time::Instant::now();
    let par = on_layout(b, layout)?;
    let sl = t0.elapsed().as_secs_f64();
    println!("best of {} by {} ({:.2}s on one device, {sl:.2}s on {layout})", b.n, b.reward_model.display(), s1);
    for (i, (x, y)) in one.iter().zip(&par).enumerate() {
        let rewards: Vec<String> = x.rewards.iter().map(|r| format!("{r:.3}")).collect();
        println!("  prompt {i}: sample {} of [{}]", x.best, rewards.join(", "));
        println!("    tokens {:?}", x.completions[x.best]);
        println!("    text   {:?}", text(&x.completions[x.best]));
        if let Some(k) = (0..b.n).find(|&k| x.completions[k] != y.completions[k]) {
            bail!("{layout}: prompt {i}'s sample {k} is {:?}, one device's {:?}", y.completions[k], x.completions[k])
        }
        if x.best != y.best {
            bail!("{layout}: prompt {i}'s pick is sample {} of rewards {:?}, one device's {} of {:?}", y.best, y.rewards, x.best, x.rewards)
        }
        let worst = x.rewards.iter().zip(&y.rewards).map(|(p, q)| (p - q).abs() / p.abs().max(1.0)).fold(0.0, f64::max);
        if worst > 1e-4 {
            bail!("{layout}: prompt {i}'s rewards {:?} vs one device's {:?}", y.rewards, x.rewards)
        }
    }
    println!("samples, rewards and picks: the same on {layout} as on one device");
    Ok(())
}
