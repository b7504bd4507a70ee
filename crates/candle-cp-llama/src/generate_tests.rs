use super::*;
use crate::layout::{CpKind, Layout, ParallelCtx};
use crate::params::{init_params, shard_params};
use crate::LlamaConfig;
use candle_core::Device;
use candle_cp_comm::run_ranks;
use candle_nn::VarBuilder;

fn model(cfg: &LlamaConfig, ctx: &ParallelCtx) -> Result<Llama> {
    let vm = shard_params(&init_params(cfg, 5, DType::F32, &Device::Cpu)?, cfg, ctx)?;
    Llama::new(
        VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu),
        cfg,
        ctx,
    )
}

/// Decode logits equal the full forward's last row on the grown sequence (single device,
/// random init, B = 2), and zigzag CP = 2 gives the same tokens, logits within 1e-5 and
/// ranks that agree bitwise.
#[test]
fn cached_decode_equals_full_forward() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
    let prompt = Tensor::arange(0u32, 32, &Device::Cpu)?.reshape((2, 16))?;
    let single = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let m = model(&cfg, &ctx)?;
        let gen = m.generate_greedy(&prompt, 4)?;
        // oracle: full forward on the prompt + generated tokens so far
        let mut seq = prompt.clone();
        for (i, l) in gen.logits.iter().enumerate() {
            let t = seq.dim(1)?;
            let full = m.forward(&seq, &Tensor::arange(0u32, t as u32, &Device::Cpu)?)?;
            let want = full.narrow(1, t - 1, 1)?.squeeze(1)?;
            let e = (l - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(e < 1e-5, "step {i}: {e}");
            let toks: Vec<u32> = gen.tokens.iter().map(|r| r[i]).collect();
            seq = Tensor::cat(&[seq, Tensor::new(toks, &Device::Cpu)?.unsqueeze(1)?], 1)?;
        }
        Ok(gen)
    });
    let single = single
        .into_iter()
        .next()
        .unwrap_or_else(|| Err(candle_core::Error::Msg("no rank".into())))?;
    assert_eq!(single.cache_rows, 16 + 3);
    let cp = run_ranks(2, |g| {
        model(&cfg, &ParallelCtx::new(g, Layout::cp(CpKind::Zigzag, 2))?)?
            .generate_greedy(&prompt, 4)
    });
    let mut first: Option<Vec<f32>> = None;
    for r in cp {
        let g = r?;
        assert_eq!(g.tokens, single.tokens);
        for (a, b) in g.logits.iter().zip(&single.logits) {
            assert!((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-5);
        }
        let bits = Tensor::cat(&g.logits, 0)?.flatten_all()?.to_vec1::<f32>()?;
        match &first {
            None => first = Some(bits),
            Some(f) => assert_eq!(f, &bits, "ranks differ"),
        }
    }
    Ok(())
}

/// bf16 weights: the cache is bf16 (half the f32 bytes), CP ranks agree bitwise and
/// follow the single-device bf16 tokens' logits closely.
#[test]
fn bf16_cache_is_half_the_bytes() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
    let prompt = Tensor::arange(0u32, 16, &Device::Cpu)?.reshape((1, 16))?;
    let mut bytes = Vec::new();
    for dt in [DType::F32, DType::BF16] {
        let gen = |layout: Layout| -> Result<Vec<Generation>> {
            run_ranks(layout.world_size(), |g| {
                let ctx = ParallelCtx::new(g, layout)?;
                let vm = shard_params(&init_params(&cfg, 5, dt, &Device::Cpu)?, &cfg, &ctx)?;
                Llama::new(VarBuilder::from_varmap(&vm, dt, &Device::Cpu), &cfg, &ctx)?
                    .generate_greedy(&prompt, 3)
            })
            .into_iter()
            .collect()
        };
        let single = gen(Layout::single())?;
        let cp = gen(Layout::cp(CpKind::Ring, 2))?;
        let bits = |g: &Generation| -> Result<Vec<f32>> {
            Tensor::cat(&g.logits, 0)?.flatten_all()?.to_vec1::<f32>()
        };
        assert_eq!(bits(&cp[0])?, bits(&cp[1])?, "{dt:?}: ranks differ");
        for (a, b) in cp[0].logits.iter().zip(&single[0].logits) {
            let e = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                e < if dt == DType::F32 { 1e-5 } else { 5e-2 },
                "{dt:?}: {e}"
            );
        }
        bytes.push(single[0].cache_bytes);
    }
    assert_eq!(bytes[0], 2 * bytes[1]);
    Ok(())
}

/// A batch that DP does not divide, a bad token id or decode shape is an error naming it.
#[test]
fn bad_input_is_an_error() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
    let prompt = Tensor::arange(0u32, 16, &Device::Cpu)?.reshape((1, 16))?;
    for r in run_ranks(2, |g| {
        let m = model(&cfg, &ParallelCtx::new(g, Layout::single().with_dp(2))?)?;
        Ok(m.generate_greedy(&prompt, 2).err().map(|e| e.to_string()))
    }) {
        let e = r?.unwrap_or_default();
        assert!(e.contains("not divisible by dp = 2") && e.contains("[1, 16]"), "{e}");
    }
    let r = run_ranks(1, |g| {
        let m = model(&cfg, &ParallelCtx::single(g)?)?;
        let bad = Tensor::new(&[[3u32, 64]], &Device::Cpu)?;
        let e1 = m
            .prefill(&bad)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        let (mut cache, _) = m.prefill(&prompt)?;
        let e2 = m
            .decode_step(&mut cache, &Tensor::new(&[1u32, 2], &Device::Cpu)?)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        Ok((e1, e2, cache.next_position()))
    });
    let (e1, e2, next) = r
        .into_iter()
        .next()
        .unwrap_or_else(|| Err(candle_core::Error::Msg("no rank".into())))?;
    assert!(e1.contains("token id 64"), "{e1}");
    assert!(e2.contains("[2]") && e2.contains("[1]"), "{e2}");
    assert_eq!(next, 16, "a failed step does not advance the cache");
    Ok(())
}

/// Stop tokens: each row ends at its first stop token (kept), its tokens before it those of the
/// run without stops (greedy and sampled: the same draws); generation ends when every row has
/// stopped (one `[B, V]` of logits per step taken); the same rows on a CP, a TP and a DP layout;
/// a stop id outside the vocabulary is an error naming it.
#[test]
fn generation_stops_at_stop_tokens() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
    let prompt = Tensor::arange(0u32, 32, &Device::Cpu)?.reshape((2, 16))?;
    let sampled = Sampling::Sample { temperature: 1.5, top_k: 0, top_p: 1.0, seed: 7 };
    for sampling in [Sampling::Greedy, sampled] {
        let free = run_ranks(1, |g| model(&cfg, &ParallelCtx::single(g)?)?.generate(&prompt, 12, sampling))
            .remove(0)?;
        assert!(free.stopped.iter().all(|&s| !s));
        // stop at row 0's fifth token and row 1's third (each row at its first token of the
        // set, at most those): every row stops, generation ends after at most 5 steps
        let stop = [63, free.tokens[0][4], free.tokens[1][2]];
        let cut = |row: &[u32]| -> Vec<u32> {
            match row.iter().position(|t| stop.contains(t)) {
                Some(i) => row[..=i].to_vec(),
                None => row.to_vec(),
            }
        };
        let want: Vec<Vec<u32>> = free.tokens.iter().map(|r| cut(r)).collect();
        let steps = want.iter().map(Vec::len).max().unwrap_or(0);
        assert!(steps <= 5 && want[0].len() <= 5 && want[1].len() <= 3, "{want:?}");
        for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2), Layout::single().with_tp(2, false), Layout::cp(CpKind::Ring, 2).with_dp(2)] {
            for (r, g) in run_ranks(layout.world_size(), |g| {
                model(&cfg, &ParallelCtx::new(g, layout)?)?.generate_until(&prompt, 12, sampling, &stop)
            })
            .into_iter()
            .enumerate()
            {
                let g = g?;
                assert_eq!(g.tokens, want, "{sampling:?} {layout} rank {r}");
                assert_eq!(g.logits.len(), steps, "{sampling:?} {layout} rank {r}");
                assert_eq!(g.stopped, vec![true, true]);
                // a row's logits up to its last token are the free run's (a stopped row's later
                // ones follow its stop token, not its free draw)
                for (j, (a, b)) in g.logits.iter().zip(&free.logits).enumerate() {
                    for (i, w) in want.iter().enumerate().filter(|(_, w)| j < w.len()) {
                        let e = (a.get(i)? - b.get(i)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                        assert!(e < 1e-5, "{sampling:?} {layout} step {j} row {i} ({} tokens): {e}", w.len());
                    }
                }
            }
        }
    }
    let e = run_ranks(1, |g| model(&cfg, &ParallelCtx::single(g)?)?.generate_until(&prompt, 4, Sampling::Greedy, &[64]).map(|_| ()))
        .remove(0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("stop token 64") && e.contains("vocab 64"), "{e}");
    Ok(())
}

/// A prompt whose length does not suit the layout: the longest suitable prefix prefilled, the
/// rest decoded (none prefilled when it is shorter than the layout's multiple); the tokens and
/// logits of one device (which prefills it whole) on zigzag CP 2 (multiple 4), 2-D (8) and
/// ring CP 2 × DP 2, sampled; the multiples.
#[test]
fn any_prompt_length_on_every_layout() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
    let sampling = Sampling::Sample { temperature: 1.2, top_k: 0, top_p: 1.0, seed: 3 };
    for t in [3usize, 7, 13] {
        let prompt = Tensor::arange(0u32, 2 * t as u32, &Device::Cpu)?.reshape((2, t))?;
        let one = run_ranks(1, |g| model(&cfg, &ParallelCtx::single(g)?)?.generate(&prompt, 5, sampling)).remove(0)?;
        for (layout, multiple) in [(Layout::cp(CpKind::Zigzag, 2), 4), (Layout::two_d(2, 2), 8), (Layout::cp(CpKind::Ring, 2).with_dp(2), 2)] {
            for (r, g) in run_ranks(layout.world_size(), |g| {
                let m = model(&cfg, &ParallelCtx::new(g, layout)?)?;
                assert_eq!(m.prompt_multiple(), multiple, "{layout}");
                m.generate(&prompt, 5, sampling)
            })
            .into_iter()
            .enumerate()
            {
                let g = g?;
                assert_eq!(g.tokens, one.tokens, "T = {t} {layout} rank {r}");
                for (a, b) in g.logits.iter().zip(&one.logits) {
                    let e = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(e < 1e-5, "T = {t} {layout} rank {r}: {e}");
                }
            }
        }
    }
    Ok(())
}

/// Prompts of lengths 5, 13, 1 and 9 in one batch ([`Llama::generate_ragged`], a stop token):
/// on one device each row gives the tokens of its prompt generated alone and the logits within
/// 1e-5 while it runs; on zigzag CP 2 × TP 2, ring CP 4, 2-D and Ulysses CP 2 × DP 2 the
/// batch gives the single device's. For a Llama, a sliding window over Gemma 3's local RoPE,
/// LongRoPE past its original length (each row's factors its own), DeepSeek's latent
/// attention and gpt-oss's sinks. Bad input is refused by name.
#[test]
fn ragged_batch_follows_each_prompt_alone() -> Result<()> {
    use crate::config::deepseek::Mla;
    use crate::config::RopeScaling;
    let base = LlamaConfig::tiny(64, 32, 2, 4, 2);
    let mut longrope = base.clone();
    longrope.max_position_embeddings = 256;
    longrope.rope_scaling = RopeScaling::LongRope {
        short_factor: vec![1.0, 1.1, 1.5, 2.0],
        long_factor: vec![1.0, 2.0, 5.0, 9.0],
        original_max_position_embeddings: 12,
        factor: 16.0,
        attention_factor: None,
    };
    let mla = Mla { q_lora_rank: None, kv_lora_rank: 8, qk_nope_head_dim: 4, qk_rope_head_dim: 4, v_head_dim: 8, rope_interleave: false };
    let models = [
        ("llama", base.clone()),
        ("gemma3 window", base.clone().with_gemma3(true).with_sliding_window(Some(6)).with_sliding_layers(Some(vec![true, false]))),
        ("longrope", longrope),
        ("mla", base.clone().with_mla(Some(mla))),
        ("gpt-oss", base.clone().with_moe(Some(crate::MoeConfig::gpt_oss(4, 2, 32)))),
    ];
    let prompts: Vec<Vec<u32>> = [5usize, 13, 1, 9].iter().enumerate().map(|(i, &n)| (0..n).map(|j| ((j * 5 + i * 11 + 3) % 60) as u32 + 4).collect()).collect();
    let (new, stop) = (6usize, [7u32]);
    for (name, cfg) in models {
        cfg.validate()?;
        let one = run_ranks(1, |g| {
            let m = model(&cfg, &ParallelCtx::single(g)?)?;
            let batch = m.generate_ragged(&prompts, new, Sampling::Greedy, &stop)?;
            for (i, p) in prompts.iter().enumerate() {
                let alone = m.generate_until(&Tensor::new(p.as_slice(), &Device::Cpu)?.unsqueeze(0)?, new, Sampling::Greedy, &stop)?;
                assert_eq!(batch.tokens[i], alone.tokens[0], "{name}: prompt {i}");
                assert_eq!(batch.stopped[i], alone.stopped[0], "{name}: prompt {i}");
                for (s, l) in alone.logits.iter().enumerate() {
                    let e = (batch.logits[s].get(i)? - l.get(0)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(e < 1e-5, "{name}: prompt {i} token {s}: {e}");
                }
            }
            Ok(batch)
        })
        .remove(0)?;
        assert!(one.stopped.iter().any(|&s| s) || one.tokens.iter().any(|t| t.len() == new), "{name}");
        for layout in [Layout::cp(CpKind::Zigzag, 2).with_tp(2, true), Layout::cp(CpKind::Ring, 4), Layout::two_d(2, 2), Layout::cp(CpKind::Ulysses, 2).with_dp(2)] {
            for (r, g) in run_ranks(layout.world_size(), |g| model(&cfg, &ParallelCtx::new(g, layout)?)?.generate_ragged(&prompts, new, Sampling::Greedy, &stop)).into_iter().enumerate() {
                let g = g?;
                assert_eq!(g.tokens, one.tokens, "{name} {layout} rank {r}");
                for (a, b) in g.logits.iter().zip(&one.logits) {
                    let e = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(e < 1e-4, "{name} {layout} rank {r}: {e}");
                }
            }
        }
    }
    // refusals
    let errs = run_ranks(2, |g| {
        let m = model(&base, &ParallelCtx::new(g, Layout::single().with_dp(2))?)?;
        let e = |r: Result<Generation>| r.map(|_| ()).err().map(|e| e.to_string()).unwrap_or_default();
        Ok([
            e(m.generate_ragged(&prompts[..3], 2, Sampling::Greedy, &[])),
            e(m.generate_ragged(&[vec![1, 2], vec![]], 2, Sampling::Greedy, &[])),
            e(m.generate_ragged(&[], 2, Sampling::Greedy, &[])),
            e(m.generate_ragged(&[vec![1], vec![2, 3]], 2, Sampling::Greedy, &[64])),
        ])
    });
    for r in errs {
        let [dp, empty, none, stop] = r?;
        assert!(dp.contains("3 prompts not divisible by dp = 2"), "{dp}");
        assert!(empty.contains("prompt 1 of 2 is empty"), "{empty}");
        assert!(none.contains("no prompt"), "{none}");
        assert!(stop.contains("stop token 64"), "{stop}");
    }
    Ok(())
}
