//! Greedy generation with the KV cache sharded over the CP ranks
//! (`Llama::generate_greedy`, tiny-llama oracle weights, a seeded random prompt `[2, 64]`,
//! 8 new tokens):
//!
//! - single device: every generated token's logits equal the full forward of the grown
//!   sequence's last row (no cache at all) within 1e-4, and the tokens are its argmax;
//! - every CP kind (ring 2/4, zigzag 2/4, striped 4, all-gather 4, Ulysses 2, 2-D 2×2) gives
//!   the single-device tokens and logits within 1e-4, its ranks agree bitwise, and each rank's
//!   cache holds at most `1/P` of the single-device bytes plus one decoded token per layer;
//! - sliding window 16: the same on two layouts, and the logits differ from the no-window run;
//! - tensor parallelism (TP 2 with and without SP, with zigzag / Ulysses / ring CP, TP 4 and 8
//!   replicating the 2 KV heads): the same tokens and logits, each rank caching its own heads;
//! - data parallelism (DP 2, alone and with CP and TP): each replica decodes its row, every
//!   rank returns both rows, greedy and sampled tokens equal the single device's;
//! - a batch that DP does not divide and a prompt length the layout cannot shard are errors
//!   (naming them).

use candle_core::{DType, Device, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::{
    hf::load_safetensors_dir, shard_tensors, Generation, Llama, LlamaConfig, ParallelCtx,
};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::sync::OnceLock;

const T: usize = 64;
const NEW: usize = 8;
const TOL: f32 = 1e-4;

struct Data {
    cfg: LlamaConfig,
    full: HashMap<String, Tensor>,
}

fn data() -> &'static Data {
    static D: OnceLock<Data> = OnceLock::new();
    D.get_or_init(|| {
        let dir = candle_cp_tests::oracle_dir("tiny-llama");
        let load = || -> Result<Data> {
            Ok(Data {
                cfg: LlamaConfig::from_file(dir.join("config.json"))?,
                full: load_safetensors_dir(&dir, &Device::Cpu)?,
            })
        };
        load().expect("loading tiny-llama oracle")
    })
}

/// Seeded random ids `[b, t]` below `vocab` (the training SplitMix64 `Rng`).
fn prompt(b: usize, t: usize, vocab: usize, seed: u64) -> Result<Tensor> {
    let mut rng = candle_cp_llama::train::rng::Rng::new(seed);
    let ids: Vec<u32> = (0..b * t).map(|_| (rng.next_u64() % vocab as u64) as u32).collect();
    Tensor::from_vec(ids, (b, t), &Device::Cpu)
}

fn the_prompt(cfg: &LlamaConfig) -> Result<Tensor> {
    prompt(2, T, cfg.vocab_size, 7)
}

/// This rank's model of `layout`, oracle weights (the first `cfg.vocab_size` rows of the
/// embedding and head when `cfg` has a smaller vocabulary than the oracle's).
fn model(cfg: &LlamaConfig, ctx: &ParallelCtx) -> Result<Llama> {
    let mut full = data().full.clone();
    for name in ["model.embed_tokens.weight", "lm_head.weight"] {
        if let Some(t) = full.get_mut(name) {
            *t = t.narrow(0, 0, cfg.vocab_size)?;
        }
    }
    let vm = shard_tensors(&full, cfg, ctx)?;
    Llama::new(
        VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu),
        cfg,
        ctx,
    )
}

/// Generation of every rank of `layout`, in rank order.
fn generate(
    cfg: &LlamaConfig,
    layout: Layout,
    ids: &Tensor,
    new: usize,
) -> Result<Vec<Generation>> {
    run_ranks(layout.world_size(), |g| {
        model(cfg, &ParallelCtx::new(g, layout)?)?.generate_greedy(ids, new)
    })
    .into_iter()
    .collect()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// Single-device generation, computed once per config.
fn single(cfg: &LlamaConfig) -> Result<Generation> {
    let mut g = generate(cfg, Layout::single(), &the_prompt(cfg)?, NEW)?;
    g.pop()
        .ok_or_else(|| candle_core::Error::Msg("no rank".into()))
}

/// No cache: the full forward of prompt + tokens so far, its last row, per generated token.
fn assert_equals_full_forward(cfg: &LlamaConfig, gen: &Generation) -> Result<()> {
    let ids = the_prompt(cfg)?;
    let r = run_ranks(1, |g| {
        let m = model(cfg, &ParallelCtx::single(g)?)?;
        let mut seq = ids.clone();
        let mut worst = 0f32;
        for (i, l) in gen.logits.iter().enumerate() {
            let t = seq.dim(1)?;
            let full = m.forward(&seq, &Tensor::arange(0u32, t as u32, &Device::Cpu)?)?;
            let want = full.narrow(1, t - 1, 1)?.squeeze(1)?;
            let e = max_abs_diff(l, &want)?;
            assert!(
                e < TOL,
                "token {i}: cached logits differ from the full forward by {e:.2e}"
            );
            worst = worst.max(e);
            let argmax = want.argmax(1)?.to_vec1::<u32>()?;
            let toks: Vec<u32> = gen.tokens.iter().map(|row| row[i]).collect();
            assert_eq!(
                toks, argmax,
                "token {i}: not the argmax of the full forward"
            );
            seq = Tensor::cat(&[seq, Tensor::new(toks, &Device::Cpu)?.unsqueeze(1)?], 1)?;
        }
        Ok(worst)
    });
    for w in r {
        println!(
            "cached decode vs full forward: logits max |diff| {:.1e}",
            w?
        );
    }
    Ok(())
}

/// `layout`'s ranks give `want`'s tokens and logits (1e-4), agree bitwise, and hold `~1/P`
/// of its cache (`P` = CP degree), of their own KV heads only under TP. Returns the worst
/// logits difference.
fn assert_layout_matches(cfg: &LlamaConfig, layout: Layout, want: &Generation) -> Result<f32> {
    let gens = generate(cfg, layout, &the_prompt(cfg)?, NEW)?;
    let p = layout.cp;
    // one decoded token's k, v over all layers: 2 · L · B · Hkv · D · 4 bytes
    let per_token = 2 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4;
    // a TP rank caches its KV heads: lcm(Hkv, tp) / tp of them (Hkv / tp, or the one it holds
    // when tp > Hkv)
    let hkv = cfg.num_key_value_heads;
    // and a DP replica caches its B / dp rows
    let own = |bytes: usize| bytes * candle_cp_nn::blocks_per_rank(hkv, layout.tp) / hkv / layout.dp;
    let mut worst = 0f32;
    let rank0 = Tensor::cat(&gens[0].logits, 0)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    for (r, g) in gens.iter().enumerate() {
        assert_eq!(
            g.tokens, want.tokens,
            "{layout} rank {r}: tokens differ from single device"
        );
        assert_eq!(g.logits.len(), NEW);
        for (i, (a, b)) in g.logits.iter().zip(&want.logits).enumerate() {
            let e = max_abs_diff(a, b)?;
            assert!(
                e < TOL,
                "{layout} rank {r} token {i}: logits differ by {e:.2e}"
            );
            worst = worst.max(e);
        }
        let bits = Tensor::cat(&g.logits, 0)?.flatten_all()?.to_vec1::<f32>()?;
        assert!(
            bits == rank0,
            "{layout}: rank {r}'s logits differ from rank 0's"
        );
        match cfg.sliding_window {
            None => assert!(
                g.cache_bytes <= own(want.cache_bytes / p + per_token),
                "{layout} rank {r}: cache {} bytes > own heads of single {} / {p} + {per_token}",
                g.cache_bytes,
                want.cache_bytes
            ),
            // rows the window can no longer reach are evicted: the cache stays within ~2w rows
            // whatever T (here all on the rank holding the prompt's end, as on one device)
            Some(w) => assert!(
                g.cache_rows <= 2 * w + 1 && want.cache_rows <= 2 * w + 1,
                "{layout} rank {r}: {} cached rows (single device {}) for a window of {w}",
                g.cache_rows,
                want.cache_rows
            ),
        }
    }
    // without a window the CP shards together hold every cached token exactly once (per TP
    // rank and DP replica)
    if cfg.sliding_window.is_none() {
        assert_eq!(gens.iter().map(|g| g.cache_rows).sum::<usize>(), want.cache_rows * layout.tp * layout.dp, "{layout}");
    }
    println!(
        "{layout}: tokens = single device, logits max |diff| {worst:.1e}, cache {} B/rank vs {} B single",
        gens[0].cache_bytes, want.cache_bytes
    );
    Ok(worst)
}

#[test]
fn single_device_cached_decode_equals_full_forward() -> Result<()> {
    let cfg = &data().cfg;
    let g = single(cfg)?;
    assert_eq!(g.tokens.len(), 2);
    assert!(g.tokens.iter().all(|r| r.len() == NEW));
    assert_eq!(g.cache_rows, T + NEW - 1);
    let (l, b, hkv, d) = (
        cfg.num_hidden_layers,
        2,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    assert_eq!(g.cache_bytes, 2 * l * b * (T + NEW - 1) * hkv * d * 4);
    assert_equals_full_forward(cfg, &g)
}

#[test]
fn every_cp_kind_equals_single_device() -> Result<()> {
    let cfg = &data().cfg;
    let want = single(cfg)?;
    for layout in [
        Layout::cp(CpKind::Ring, 2),
        Layout::cp(CpKind::Ring, 4),
        Layout::cp(CpKind::Zigzag, 2),
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::Striped, 4),
        Layout::cp(CpKind::AllGather, 4),
        Layout::cp(CpKind::Ulysses, 2),
        Layout::two_d(2, 2),
    ] {
        assert_layout_matches(cfg, layout, &want)?;
    }
    Ok(())
}

/// Tensor parallelism (with and without SP, alone and with CP, and TP 4 / 8 beyond the 2 KV
/// heads, which replicates them): each TP rank decodes its own heads against its own KV cache;
/// data parallelism: each replica its own batch row. The tokens and logits are the single
/// device's on every rank.
#[test]
fn tensor_and_data_parallel_generation_equals_single_device() -> Result<()> {
    let cfg = &data().cfg;
    let want = single(cfg)?;
    for layout in [
        Layout::single().with_dp(2),
        Layout::cp(CpKind::Zigzag, 2).with_dp(2).with_tp(2, true),
        Layout::single().with_tp(2, false),
        Layout::single().with_tp(2, true),
        Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
        Layout::cp(CpKind::Ulysses, 2).with_tp(2, false),
        Layout::single().with_tp(4, true),
        Layout::cp(CpKind::Ring, 2).with_tp(8, false),
    ] {
        assert_layout_matches(cfg, layout, &want)?;
    }
    Ok(())
}

/// The oracle weights cut to a 509-token vocabulary (prime: padded to ⌈509/tp⌉ rows on every
/// TP rank): generation on TP 2, 4 (+ SP) and 8 × ring CP 2 equals the single device's, so the
/// padding columns never reach the logits or the greedy choice.
#[test]
fn padded_vocabulary_generation_equals_single_device() -> Result<()> {
    let mut cfg = data().cfg.clone();
    cfg.vocab_size = 509;
    let want = single(&cfg)?;
    assert_eq!(want.logits[0].dims(), [2, 509]);
    assert_equals_full_forward(&cfg, &want)?;
    for layout in [
        Layout::single().with_tp(2, false),
        Layout::single().with_tp(4, true),
        Layout::cp(CpKind::Ring, 2).with_tp(8, false),
    ] {
        assert_layout_matches(&cfg, layout, &want)?;
    }
    Ok(())
}

#[test]
fn sliding_window_equals_single_device_and_binds() -> Result<()> {
    let plain = single(&data().cfg)?;
    let cfg = &data().cfg.clone().with_sliding_window(Some(16));
    let want = single(cfg)?;
    // the window binds (T = 64 ≫ 16): every token's logits change
    for (i, (a, b)) in want.logits.iter().zip(&plain.logits).enumerate() {
        let e = max_abs_diff(a, b)?;
        assert!(
            e > 1e-3,
            "token {i}: window 16 logits equal the no-window ones ({e:.1e})"
        );
    }
    assert_equals_full_forward(cfg, &want)?;
    for layout in [Layout::cp(CpKind::Zigzag, 4), Layout::two_d(2, 2)] {
        assert_layout_matches(cfg, layout, &want)?;
    }
    Ok(())
}

#[test]
fn bad_layouts_and_lengths_are_errors() -> Result<()> {
    let cfg = &data().cfg;
    let ids = the_prompt(&data().cfg)?;
    // data parallelism that does not divide the batch (B = 2 over dp = 4)
    let layout = Layout::single().with_dp(4);
    for r in run_ranks(4, |g| {
        Ok(model(cfg, &ParallelCtx::new(g, layout)?)?
            .generate_greedy(&ids, 2)
            .err()
            .map(|e| e.to_string()))
    }) {
        let e = r?.unwrap_or_default();
        assert!(e.contains("dp = 4") && e.contains("[2, 64]"), "dp = 4 must be refused for B = 2: {e}");
    }
    // T = 60 is not a multiple of 2·4 (zigzag 4), T = 62 of 8 (2-D 2×2: zigzag ring shards
    // split over ulysses 2), T = 63 of 2 (ring 2): the prefill refuses them naming T;
    // generation prefills the longest prefix that suits and decodes the rest, the tokens of
    // one device
    for (t, layout) in [
        (60, Layout::cp(CpKind::Zigzag, 4)),
        (62, Layout::two_d(2, 2)),
        (63, Layout::cp(CpKind::Ring, 2)),
    ] {
        let short = ids.narrow(1, 0, t)?;
        let one = run_ranks(1, |g| model(cfg, &ParallelCtx::single(g)?)?.generate_greedy(&short, 3)).remove(0)?;
        for r in run_ranks(layout.world_size(), |g| {
            let m = model(cfg, &ParallelCtx::new(g, layout)?)?;
            Ok((m.prefill(&short).err().map(|e| e.to_string()), m.generate_greedy(&short, 3)?))
        }) {
            let (e, gen) = r?;
            let e = e.unwrap_or_default();
            assert!(
                e.contains(&format!("T = {t}")),
                "{layout}, T = {t} must be refused by the prefill naming T: {e}"
            );
            assert_eq!(gen.tokens, one.tokens, "{layout}, T = {t}");
        }
    }
    Ok(())
}

/// Sampled generation (temperature, top-k, top-p, seed): every CP kind draws the same tokens
/// as one device with the same seed, on every rank; each token is one the sampler may pick
/// (inside the top-k of its own logits); another seed draws another sequence, and the greedy
/// tokens are not what a hot sampler draws.
#[test]
fn sampled_generation_is_the_same_on_every_rank_and_layout() -> Result<()> {
    use candle_cp_llama::Sampling;
    let cfg = &data().cfg;
    let ids = the_prompt(&data().cfg)?;
    let sampling = |seed| Sampling::Sample { temperature: 1.5, top_k: 20, top_p: 0.95, seed };
    let run = |layout: Layout, s: Sampling| -> Result<Vec<Generation>> {
        run_ranks(layout.world_size(), |g| model(cfg, &ParallelCtx::new(g, layout)?)?.generate(&ids, NEW, s))
            .into_iter()
            .collect()
    };
    let single = run(Layout::single(), sampling(11))?.remove(0);
    // every token inside the top 20 of the logits it was drawn from
    for (i, l) in single.logits.iter().enumerate() {
        for (row, toks) in l.to_vec2::<f32>()?.iter().zip(&single.tokens) {
            let x = row[toks[i] as usize];
            let above = row.iter().filter(|&&y| y > x).count();
            assert!(above < 20, "token {i}: {above} logits above the drawn one");
        }
    }
    // (DP: each replica decodes one row, the rows' logits are shared before each draw)
    for layout in [
        Layout::cp(CpKind::Zigzag, 4),
        Layout::cp(CpKind::Ring, 2),
        Layout::cp(CpKind::AllGather, 2),
        Layout::cp(CpKind::Zigzag, 2).with_dp(2),
        Layout::single().with_tp(2, true).with_dp(2),
    ] {
        for (r, g) in run(layout, sampling(11))?.iter().enumerate() {
            assert_eq!(g.tokens, single.tokens, "{layout} rank {r}: sampled tokens differ from one device");
        }
    }
    let other = run(Layout::single(), sampling(12))?.remove(0);
    assert_ne!(other.tokens, single.tokens, "another seed must draw another sequence");
    let greedy = run(Layout::single(), Sampling::Greedy)?.remove(0);
    assert_ne!(greedy.tokens, single.tokens, "a hot sampler must not reproduce the greedy tokens");
    let bad = Sampling::Sample { temperature: -1.0, top_k: 0, top_p: 1.0, seed: 1 };
    let e = run(Layout::single(), bad).unwrap_err().to_string();
    assert!(e.contains("temperature"), "{e}");
    Ok(())
}
