//! Tests of `model.rs` (the Llama forward, its losses and its parameters).

use super::*;
use crate::params::param_specs;
use crate::layout::{shard_batch, Layout, IGNORE};
use crate::params::{init_params, shard_params};
use candle_core::Device;
use candle_cp_comm::run_ranks;

/// fused cross-entropy = candle-nn's cross_entropy (values and gradients), IGNORE skipped
#[test]
fn local_nll_matches_candle_nn() -> Result<()> {
    let dev = Device::Cpu;
    let x = candle_core::Var::randn(0f32, 3.0, (2, 5, 11), &dev)?;
    let lab = Tensor::new(&[[1u32, 4, IGNORE, 10, 0], [IGNORE, IGNORE, 7, 7, 3]], &dev)?;
    let (terms, n) = local_nll(x.as_tensor(), &lab)?;
    assert_eq!(n, 7);
    let sum = terms.sum_all()?;
    let keep: Vec<u32> = vec![0, 1, 3, 4, 7, 8, 9];
    let rows = x
        .as_tensor()
        .reshape((10, 11))?
        .index_select(&Tensor::new(keep, &dev)?, 0)?;
    let tg = Tensor::new(&[1u32, 4, 10, 0, 7, 7, 3], &dev)?;
    let want = (candle_nn::loss::cross_entropy(&rows, &tg)? * 7.0)?;
    let d = (sum.to_scalar::<f32>()? - want.to_scalar::<f32>()?).abs();
    assert!(d < 1e-5, "{d}");
    let (g, gw) = (sum.backward()?, want.backward()?);
    let (a, b) = (
        g.get(x.as_tensor()).unwrap(),
        gw.get(x.as_tensor()).unwrap(),
    );
    assert!((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
    // no target at all: one zero term, still connected
    let (t0, n0) = local_nll(x.as_tensor(), &Tensor::full(IGNORE, (2, 5), &dev)?)?;
    assert_eq!((n0, t0.to_vec1::<f32>()?), (0, vec![0.0]));
    Ok(())
}

/// With a fresh `VarMap` the model's layers create exactly the HF-named parameters of
/// [`param_specs`] with their TP-local shapes (nothing outside the `VarMap`), and every
/// one of them gets a gradient.
#[test]
fn fresh_varmap_holds_every_parameter_with_local_shapes() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
    let layout = Layout::single().with_tp(2, true);
    let ids = Tensor::arange(0u32, 16, &Device::Cpu)?.reshape((1, 16))?;
    for r in run_ranks(layout.world_size(), |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        let vm = candle_nn::VarMap::new();
        let m = Llama::new(
            VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu),
            &cfg,
            &ctx,
        )?;
        let mut got: Vec<(String, Vec<usize>)> = crate::params::varmap_tensors(&vm)?
            .into_iter()
            .map(|(k, t)| (k, t.dims().to_vec()))
            .collect();
        got.sort();
        let mut want = param_specs(&cfg)
            .into_iter()
            .map(|s| Ok((s.name.clone(), s.local_shape(2)?.dims().to_vec())))
            .collect::<Result<Vec<_>>>()?;
        want.sort();
        let b = shard_batch(&ids, &ctx)?;
        let grads = m
            .loss(&b.input_ids, &b.labels, &b.positions)?
            .0
            .backward()?;
        Ok((got, want, crate::grads::named_grads(&grads, &vm)?.len()))
    }) {
        let (got, want, n_grads) = r?;
        assert_eq!(got, want);
        assert_eq!(n_grads, want.len());
    }
    Ok(())
}

/// With recompute on, `loss.backward()` alone misses the layers' parameters (they are
/// outside candle's graph), `Llama::backward` has every one, and a forward after an
/// uncollected backward is refused.
#[test]
fn recompute_needs_llama_backward() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
    let ids = Tensor::arange(0u32, 32, &Device::Cpu)?.reshape((1, 32))?;
    for r in run_ranks(2, |g| {
        let layout = Layout::cp(crate::layout::CpKind::Zigzag, 2);
        let ctx = ParallelCtx::new(g, layout)?;
        let vm = shard_params(&init_params(&cfg, 3, DType::F32, &Device::Cpu)?, &cfg, &ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?
            .with_recompute(true);
        assert!(m.recomputes());
        let b = shard_batch(&ids, &ctx)?;
        let n = param_specs(&cfg).len();
        let (loss, _) = m.loss(&b.input_ids, &b.labels, &b.positions)?;
        let full = crate::grads::named_grads(&m.backward(&loss)?, &vm)?.len();
        let (loss, _) = m.loss(&b.input_ids, &b.labels, &b.positions)?;
        let plain = crate::grads::named_grads(&loss.backward()?, &vm)?;
        let refused = m.loss(&b.input_ids, &b.labels, &b.positions).err().map(|e| e.to_string());
        Ok((n, full, plain.len(), refused))
    }) {
        let (n, full, plain, refused) = r?;
        assert_eq!(full, n, "Llama::backward: every parameter");
        // embeddings, final norm, head only: 2 layers x 9 parameters are missing
        assert_eq!(plain, n - 2 * 9, "loss.backward() sees no layer parameter");
        let msg = refused.expect("forward after an uncollected backward must fail");
        assert!(msg.contains("Llama::backward"), "{msg}");
    }
    Ok(())
}

/// The chunked head + loss gives the logits path's loss and gradients (every parameter),
/// with a rank holding ignored labels, on CP and TP + SP layouts, for a vocabulary TP divides
/// (64) and two it does not (61: padded to 16 rows per rank at TP 4; 9: the fourth TP rank
/// holds padding only).
#[test]
fn token_nll_equals_the_logits_path() -> Result<()> {
    for vocab in [64usize, 61, 9] {
        token_nll_equals_the_logits_path_of(vocab)?;
    }
    Ok(())
}

fn token_nll_equals_the_logits_path_of(vocab: usize) -> Result<()> {
    let cfg = LlamaConfig::tiny(vocab, 32, 2, 4, 2);
    let ids = Tensor::from_vec((0..64u32).map(|i| i % vocab as u32).collect::<Vec<_>>(), (2, 32), &Device::Cpu)?;
    // (TP: the embedding and head split by vocabulary, ⌈V/tp⌉ rows per rank)
    for layout in [
        Layout::cp(crate::layout::CpKind::Zigzag, 2),
        Layout::single().with_tp(2, true),
        Layout::single().with_tp(2, false),
        Layout::cp(crate::layout::CpKind::Zigzag, 2).with_tp(4, true),
    ] {
        for r in run_ranks(layout.world_size(), |g| {
            let ctx = ParallelCtx::new(g, layout)?;
            let vm = shard_params(&init_params(&cfg, 3, DType::F32, &Device::Cpu)?, &cfg, &ctx)?;
            let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
            let rows = candle_cp_nn::padded_rows(vocab, layout.tp);
            assert_eq!((m.embed.dims()[0], m.lm_head.dims()[0]), (rows, rows), "{layout} V {vocab}");
            let b = shard_batch(&ids, &ctx)?;
            // ignore every third label
            let lab: Vec<u32> = b.labels.flatten_all()?.to_vec1()?;
            let lab: Vec<u32> = lab.iter().enumerate().map(|(i, &l)| if i % 3 == 0 { IGNORE } else { l }).collect();
            let labels = Tensor::from_vec(lab.clone(), b.labels.shape(), &Device::Cpu)?;
            let (loss_a, _) = m.loss(&b.input_ids, &labels, &b.positions)?;
            let ga = crate::grads::named_grads(&loss_a.backward()?, &vm)?;
            let nll = m.token_nll(&b.input_ids, &labels, &b.positions)?;
            let n = lab.iter().filter(|&&l| l != IGNORE).count();
            let loss_b = global_mean(&nll.flatten_all()?, n, m.ctx().token_group())?;
            let gb = crate::grads::named_grads(&loss_b.backward()?, &vm)?;
            let dl = (loss_a.to_scalar::<f32>()? - loss_b.to_scalar::<f32>()?).abs();
            let mut dg = 0f32;
            for (name, a) in &ga {
                let Some(b) = gb.get(name) else { bail!("token_nll path: no gradient for {name}") };
                dg = dg.max((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?);
            }
            Ok((dl, dg, ga.len()))
        }) {
            let (dl, dg, n) = r?;
            assert_eq!(n, param_specs(&cfg).len());
            assert!(dl <= 1e-6 && dg <= 1e-6, "{layout} V {vocab}: loss differs by {dl}, gradients by {dg}");
        }
    }
    Ok(())
}

/// bf16 weights run forward and backward and stay close to f32 (loose bf16 bound).
#[test]
fn bf16_close_to_f32() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
    let ids = Tensor::arange(0u32, 64, &Device::Cpu)?.reshape((1, 64))?;
    let mut losses = Vec::new();
    for dt in [DType::F32, DType::BF16] {
        let r = run_ranks(1, |g| {
            let ctx = ParallelCtx::new(g, Layout::single())?;
            let vm = shard_params(&init_params(&cfg, 3, dt, &Device::Cpu)?, &cfg, &ctx)?;
            let m = Llama::new(VarBuilder::from_varmap(&vm, dt, &Device::Cpu), &cfg, &ctx)?;
            let b = shard_batch(&ids, &ctx)?;
            let (loss, logits) = m.loss(&b.input_ids, &b.labels, &b.positions)?;
            assert_eq!(logits.dtype(), dt);
            let grads = loss.backward()?;
            assert_eq!(
                crate::grads::named_grads(&grads, &vm)?.len(),
                crate::params::param_specs(&cfg).len()
            );
            loss.to_scalar::<f32>()
        });
        losses.push(
            r.into_iter()
                .next()
                .unwrap_or_else(|| Err(candle_core::Error::Msg("no rank".into())))?,
        );
    }
    assert!(
        losses[0].is_finite() && (losses[0] - (64f32).ln()).abs() < 0.1,
        "{losses:?}"
    );
    assert!((losses[0] - losses[1]).abs() < 2e-2, "{losses:?}");
    Ok(())
}

/// An empty batch or an empty sequence is refused with an error naming the shape, on every
/// rank, for the forward and the losses.
#[test]
fn empty_input_ids_are_refused() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
    for r in run_ranks(2, |g| {
        let ctx = ParallelCtx::new(g, Layout::cp(crate::layout::CpKind::Zigzag, 2))?;
        let vm = shard_params(&init_params(&cfg, 3, DType::F32, &Device::Cpu)?, &cfg, &ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
        let mut msgs = vec![];
        for (b, t) in [(0usize, 16usize), (1, 0)] {
            let ids = Tensor::zeros((b, t), DType::U32, &Device::Cpu)?;
            let pos = Tensor::zeros(t, DType::U32, &Device::Cpu)?;
            for e in [m.forward(&ids, &pos).err(), m.token_nll(&ids, &ids, &pos).err()] {
                msgs.push(e.map(|e| e.to_string()));
            }
        }
        Ok(msgs)
    }) {
        for msg in r? {
            let msg = msg.expect("an empty input must be refused");
            assert!(msg.contains("Llama::hidden: input_ids") && msg.contains("empty"), "{msg}");
        }
    }
    Ok(())
}
