use super::*;
use crate::layout::Layout;

/// Every parameter of a 3-layer model (tied head or not) has a group, in forward order:
/// the embedding 0, layer `i` `1 + i`, the final norm and head 4; other names none.
#[test]
fn param_groups_follow_the_forward() {
    for tie in [false, true] {
        let mut cfg = LlamaConfig::tiny(37, 32, 3, 4, 2);
        cfg.tie_word_embeddings = tie;
        for s in param_specs(&cfg) {
            let want = match s.name.as_str() {
                "model.embed_tokens.weight" => 0,
                "model.norm.weight" | "lm_head.weight" => 4,
                n => 1 + n.split('.').nth(2).and_then(|i| i.parse::<usize>().ok()).expect("a layer parameter"),
            };
            assert_eq!(param_group(&s.name, 3), Some(want), "{}", s.name);
        }
    }
    for other in ["model.layers.3.mlp.up_proj.weight", "model.layers.x.mlp", "lm_head", "bias"] {
        assert_eq!(param_group(other, 3), None, "{other}");
    }
}

/// `init_params_sharded` is `shard_params(init_params(..))` bit for bit (TP 1, 2, 4; KV
/// heads replicated at 4; vocabulary 37 padded; f32 and bf16), and `gather_full_to_host`
/// gives the writing rank `gather_full`'s tensors on the host, the others nothing.
#[test]
fn sharded_init_and_host_gather_equal_the_whole_model_path() -> Result<()> {
    let cfg = LlamaConfig::tiny(37, 32, 2, 4, 2);
    for dtype in [DType::F32, DType::BF16] {
        let whole = init_params(&cfg, 11, dtype, &Device::Cpu)?;
        for tp in [1usize, 2, 4] {
            for r in candle_cp_comm::run_ranks(tp, |g| {
                let ctx = ParallelCtx::new(g, Layout::single().with_tp(tp, false))?;
                let want = varmap_tensors(&shard_params(&whole, &cfg, &ctx)?)?;
                let got = varmap_tensors(&init_params_sharded(&cfg, 11, dtype, &ctx, &Device::Cpu)?)?;
                let bits = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
                let mut same = got.len() == want.len();
                for (k, w) in &want {
                    same &= got[k].dims() == w.dims() && got[k].dtype() == dtype && bits(&got[k])? == bits(w)?;
                }
                let keep = ctx.coords.2 == 0;
                let host = gather_full_to_host(&got, &cfg, &ctx, keep)?;
                let dev = gather_full(&got, &cfg, &ctx)?;
                if keep {
                    same &= host.len() == dev.len();
                    for ((n1, a), (n2, b)) in host.iter().zip(&dev) {
                        same &= n1 == n2 && a.dims() == b.dims() && bits(a)? == bits(b)?;
                    }
                } else {
                    same &= host.is_empty();
                }
                Ok(same)
            }) {
                assert!(r?, "tp {tp} {dtype:?}: the sharded init or the host gather differs");
            }
        }
    }
    Ok(())
}
