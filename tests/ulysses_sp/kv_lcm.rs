//! Ulysses and 2-D at degrees the KV heads neither divide nor are divided by (`H = 12`,
//! `Hkv = 3`, `P = 2`; `H = 12`, `Hkv = 4`, `P = 6`; `H = 28`, `Hkv = 4`, `P = 7` and `14`,
//! Qwen2.5-7B's head counts): every KV head is replicated `lcm(Hkv, P)/Hkv` times and each rank
//! receives the copies its query heads use. Outputs and gradients equal the dense single-device
//! reference (plain candle ops), in f32; the replicated copies' gradients are summed back
//! (dK, dV compared); the head layout regathered gives the same bits as kept.

use super::*;
use candle_cp_ops::attention::{attention_slow, Mask};
use candle_cp_ops::cp::Layout;
use candle_cp_ops::oracle::AttnTol;
use candle_cp_ops::ulysses::{kv_spread, HeadLayout, KvSpread, UlyssesOpts};
use candle_cp_ops::usp::{run_case_ulysses_opts, run_case_usp_opts, UspOpts};
use candle_cp_tests::draws::random_case;
use candle_cp_tests::{assert_attn_close, fwd_bwd};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(120);

#[test]
fn ulysses_and_2d_replicate_kv_heads_to_the_lcm() -> Result<()> {
    let tol = AttnTol::for_sigma(1.0);
    // (H, Hkv, Ulysses degree, ring degree, T)
    let cases = [(12, 3, 2, 1, 24), (12, 4, 6, 1, 24), (28, 4, 7, 1, 28), (28, 4, 14, 1, 28), (12, 3, 2, 2, 24), (12, 4, 6, 2, 24)];
    for (i, (h, hkv, u, r, t)) in cases.into_iter().enumerate() {
        let spread = kv_spread(h, hkv, u)?;
        if (hkv % u == 0) || (u % hkv == 0) || !matches!(spread, KvSpread::Replicate(_)) {
            bail!("case {i}: H {h} Hkv {hkv} P {u} is not a case of neither dividing the other ({spread:?})")
        }
        for causal in [true, false] {
            let what = format!("H {h} Hkv {hkv} U {u} R {r} causal {causal} ({spread:?})");
            let mut case = random_case(what.clone(), 700 + i as u64, [2, t, h, hkv, 8], causal, Ok)?;
            let mask = if causal { Mask::causal() } else { Mask::Full };
            case.reference = fwd_bwd(&case, &|q, k, v| attention_slow(q, k, v, &mask, case.scale))?;
            let runs = if r == 1 {
                let opts = |l| UlyssesOpts::new(causal, case.scale).with_head_layout(l);
                vec![
                    run_case_ulysses_opts(&case, u, Layout::Contiguous, TIMEOUT, opts(HeadLayout::Kept))?,
                    run_case_ulysses_opts(&case, u, Layout::Contiguous, TIMEOUT, opts(HeadLayout::Regathered))?,
                ]
            } else {
                let opts = |l| UspOpts::new(causal, case.scale).with_head_layout(l);
                vec![
                    run_case_usp_opts(&case, u, r, TIMEOUT, opts(HeadLayout::Kept))?,
                    run_case_usp_opts(&case, u, r, TIMEOUT, opts(HeadLayout::Regathered))?,
                ]
            };
            assert_attn_close(&runs[0].outputs, &case.reference, &tol, &what)?;
            let bits = |o: &candle_cp_ops::oracle::AttnOutputs| -> Result<Vec<Vec<f32>>> {
                [&o.out, &o.lse, &o.dq, &o.dk, &o.dv].iter().map(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?)).collect()
            };
            if bits(&runs[0].outputs)? != bits(&runs[1].outputs)? {
                bail!("{what}: the regathered head layout differs from the kept one")
            }
        }
    }
    Ok(())
}

/// The Llama at such degrees: 12 query / 4 KV heads on Ulysses 6 (KV heads replicated 3
/// times, 2 copies per rank) and on Ulysses 3 × TP 2 + SP (2 KV heads per TP rank, replicated
/// 3 times): logits, loss and every gradient equal the single-device run's.
#[test]
fn llama_at_ulysses_degrees_the_kv_heads_do_not_divide() -> Result<()> {
    use candle_core::Device;
    use candle_cp_llama::layout::{CpKind, Layout as LlamaLayout};
    use candle_cp_llama::verify::{compare, run_layout, Reference, Tolerances};
    use candle_cp_llama::{init_params, params::varmap_tensors, LlamaConfig};
    let cfg = LlamaConfig::tiny(64, 96, 2, 12, 4);
    let full = varmap_tensors(&init_params(&cfg, 3, DType::F32, &Device::Cpu)?)?;
    let ids: Vec<u32> = (0..2 * 48u32).map(|i| (i * 7 + 3) % 64).collect();
    let ids = Tensor::from_vec(ids, (2, 48), &Device::Cpu)?;
    let single = run_layout(&full, &cfg, &ids, LlamaLayout::single(), &Device::Cpu)?;
    let want = Reference { input_ids: ids.clone(), logits: single.logits.clone(), loss: single.loss, grads: single.grads.iter().cloned().collect() };
    for layout in [LlamaLayout::cp(CpKind::Ulysses, 6), LlamaLayout::cp(CpKind::Ulysses, 3).with_tp(2, true)] {
        let rep = compare(&run_layout(&full, &cfg, &ids, layout, &Device::Cpu)?, &want, Tolerances::default())?;
        eprintln!("llama 12/4 heads {layout}: logits {:.1e} loss {:.1e} grad rel {:.1e}", rep.logits_abs, rep.loss_abs, rep.grad_rel_max);
        if !rep.pass() || rep.grad_rel.len() != want.grads.len() {
            bail!("{layout}: {rep:?}")
        }
    }
    Ok(())
}
