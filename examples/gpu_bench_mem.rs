//! `gpu_bench --mem` (the memory-bound kernels' GB/s against a device copy) and `--docs` (a
//! packed sequence as one band call against one call per document).

use super::{randn_bf16, time, Args};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_cp_kernels::flash::{self, FwdImpl, KMask};

/// The memory-bound kernels on `[B, T, H, D]` (T = the largest `--t`): bytes each one reads
/// and writes over its time, against a device-to-device copy of the same bytes timed in the
/// same run (`ratio` = kernel GB/s / copy GB/s; the copy is the ceiling).
pub(crate) fn mem_kernels(a: &Args, dev: &Device) -> Result<()> {
    use candle_cp_kernels::{layout, merge};
    let (b, h, d) = (a.batch, a.heads, a.d);
    let t = a.ts.iter().copied().max().unwrap_or(16384);
    let p = 4usize;
    let o = Tensor::randn(0f32, 1f32, (b, t, h, d), dev)?;
    let o2 = Tensor::randn(0f32, 1f32, (b, t, h, d), dev)?;
    let l = Tensor::randn(0f32, 1f32, (b, h, t), dev)?;
    let l2 = Tensor::randn(0f32, 1f32, (b, h, t), dev)?;
    let x = o.to_dtype(DType::BF16)?;
    let packed = layout::a2a_pack(&x, 2, p)?;
    let (n_o, n_l) = ((b * t * h * d * 4) as f64, (b * h * t * 4) as f64);
    let n_x = n_o / 2.0;
    // A ring step's merge into the running state of the local rows when the step covers half of
    // them (a zigzag step after the first): in place in one buffer (the ring's CUDA form since
    // session 13), and as before (narrow + merge into fresh tensors + slice_set). Same useful
    // bytes (read the state rows and the block, write the state rows), so the GB/s compare.
    let (r0, nh) = (t / 2, t - t / 2);
    let (oh, lh) = (o2.narrow(1, r0, nh)?.contiguous()?, l2.narrow(2, r0, nh)?.contiguous()?);
    let state = std::cell::RefCell::new(candle_cp_ops::cp::state::LocalState::on_device(b, t, h, d, dev)?);
    state.borrow_mut().merge_rows(0, &o, &l)?;
    let (so, sl) = (o.copy()?, l.copy()?);
    let slice_set_merge = || -> candle_core::Result<()> {
        let (oa, la) = (so.narrow(1, r0, nh)?.contiguous()?, sl.narrow(2, r0, nh)?.contiguous()?);
        let (m, ml) = merge::merge(&oa, &la, &oh, &lh)?;
        so.slice_set(&m, 1, r0)?;
        sl.slice_set(&ml, 2, r0)
    };
    let half = 1.5 * (n_o + n_l);
    // A quantized frozen weight (a LoRA run's base) to bf16, as each layer's forward does: the
    // kernel (one pass) and the candle-op formulation it replaced on CUDA (`dequantize_ops`),
    // same useful bytes (codes + scales read, the bf16 weight written). [n / 4096, 4096], n the
    // element count of the attention output above, groups of 64.
    use candle_cp_nn::quant::{QuantConfig, QuantKind, QuantWeight};
    let wq_in = 4096usize;
    let w = Tensor::randn(0f32, 1f32, ((b * t * h * d / wq_in).max(1), wq_in), dev)?;
    let n_w = w.elem_count() as f64;
    let q_nf4 = QuantWeight::quantize(&w, QuantConfig::new(QuantKind::Nf4, 64)?)?;
    let q_int8 = QuantWeight::quantize(&w, QuantConfig::new(QuantKind::Int8, 64)?)?;
    let (b_nf4, b_int8) = (q_nf4.bytes() as f64 + 2.0 * n_w, q_int8.bytes() as f64 + 2.0 * n_w);
    // Mixture-of-experts routing of B·T tokens over 128 experts, top 8 (Qwen3-MoE): chosen on
    // the device (`kernels/moe.cu`, only the [N, 8] choices copied down) and on the host (the
    // [N, 128] probabilities copied down, the host loop: the path before the kernel), both to
    // the full `Routing`. Bytes: the probabilities read once.
    use candle_cp_ops::moe::Routing;
    let probs = Tensor::rand(0f32, 1f32, (b * t, 128), dev)?;
    let b_route = (b * t * 128 * 4) as f64;
    let host_route = || -> candle_core::Result<()> { Routing::top_k(&probs.to_device(&Device::Cpu)?, 8).map(|_| ()) };
    // (name, bytes read + written, the call)
    type Call<'a> = Box<dyn Fn() -> candle_core::Result<()> + 'a>;
    let cases: Vec<(&str, f64, Call)> = vec![
        ("merge f32", 3.0 * (n_o + n_l), Box::new(|| merge::merge(&o, &l, &o2, &l2).map(|_| ()))),
        ("ring state merge, half the rows, in place", half, Box::new(|| state.borrow_mut().merge_rows(r0, &oh, &lh))),
        ("ring state merge, half the rows, narrow + merge + slice_set", half, Box::new(slice_set_merge)),
        ("cast f32->bf16", n_o + n_x, Box::new(|| merge::cast_out(&o, DType::BF16).map(|_| ()))),
        ("zigzag shard bf16 (1 of 4)", 2.0 * n_x / p as f64, Box::new(|| layout::shard(&x, 1, layout::SeqLayout::Zigzag, p, 1).map(|_| ()))),
        ("zigzag unshard bf16", 2.0 * n_x, Box::new(|| layout::unshard(&x, 1, layout::SeqLayout::Zigzag, p).map(|_| ()))),
        ("a2a pack bf16 (heads)", 2.0 * n_x, Box::new(|| layout::a2a_pack(&x, 2, p).map(|_| ()))),
        ("a2a unpack bf16 (seq)", 2.0 * n_x, Box::new(|| layout::a2a_unpack(&packed, 1).map(|_| ()))),
        ("dequantize nf4 g64 -> bf16, kernel", b_nf4, Box::new(|| q_nf4.dequantize(DType::BF16).map(|_| ()))),
        ("dequantize nf4 g64 -> bf16, candle ops", b_nf4, Box::new(|| q_nf4.dequantize_ops(DType::BF16).map(|_| ()))),
        ("dequantize int8 g64 -> bf16, kernel", b_int8, Box::new(|| q_int8.dequantize(DType::BF16).map(|_| ()))),
        ("dequantize int8 g64 -> bf16, candle ops", b_int8, Box::new(|| q_int8.dequantize_ops(DType::BF16).map(|_| ()))),
        ("route top 8 of 128 experts, device", b_route, Box::new(|| Routing::top_k(&probs, 8).map(|_| ()))),
        ("route top 8 of 128 experts, host", b_route, Box::new(host_route)),
    ];
    let copy_s = time(dev, a.iters.max(5), || o.copy().map(|_| ()))?;
    let copy_gbps = 2.0 * n_o / copy_s / 1e9;
    for (name, bytes, f) in &cases {
        let s = time(dev, a.iters.max(5), f)?;
        let gbps = bytes / s / 1e9;
        println!(
            "{{\"impl\":\"candle-cp-mem\",\"kernel\":\"{name}\",\"t\":{t},\"bytes\":{bytes:.0},\"ms\":{:.3},\"gbps\":{gbps:.1},\"copy_gbps\":{copy_gbps:.1},\"ratio\":{:.3}}}",
            s * 1e3,
            gbps / copy_gbps
        );
    }
    Ok(())
}

/// Packed documents: one band call against one call per document, forward and backward, bf16,
/// with the first `--impl` family (see the module docs, `--docs`). The band's bounds are on the
/// device before the timing (`Band::upload_all`, as the CP engines do).
pub(crate) fn band_docs(a: &Args, dev: &Device) -> Result<()> {
    use candle_cp_kernels::flash::KBand;
    use candle_cp_ops::attention::Band;
    use candle_cp_ops::cp::MaskSpec;
    use candle_cp_ops::packing::Documents;
    let (b, h, d, t) = (a.batch, a.heads, a.d, a.docs_t);
    let imp = a.imps.first().copied().unwrap_or(FwdImpl::Auto);
    let scale = 1.0 / (d as f32).sqrt();
    let mk = |s: &[usize]| randn_bf16(dev, s);
    let (q, k, v) = (mk(&[b, t, h, d])?, mk(&[b, t, h, d])?, mk(&[b, t, h, d])?);
    let dout = Tensor::randn(0f32, 1f32, (b, t, h, d), dev)?;
    let pos: Vec<usize> = (0..t).collect();
    let causal = KMask::causal(0, 1, 0, 1);
    // The per-document calls run the family the band calls run: bands have Simple, Pipelined and
    // Hopper (Wgmma, WgmmaAtomic, WgmmaWs, WgmmaTma) kernels; Mma and AtomicDq fall back to Auto's (FwdImpl docs).
    let doc_imp = if matches!(imp, FwdImpl::Mma | FwdImpl::AtomicDq) { FwdImpl::Auto } else { imp };
    for &len in &a.docs {
        let lens: Vec<usize> = (0..t.div_ceil(len.max(1))).map(|i| len.min(t - i * len)).collect();
        let docs = Documents::from_lengths(&lens)?;
        let mut band = Band::from_positions(&pos, &pos, MaskSpec { causal: true, window: None, docs: Some(&docs) })?;
        Band::upload_all([&mut band], dev)?;
        let Some((lo, hi)) = band.device_bounds(dev) else { anyhow::bail!("gpu_bench --docs: the band has no device copy") };
        let kb = KBand { lo, hi };
        let flops = 4.0 * (b * h * d) as f64 * band.pairs() as f64;
        let (o, l) = flash::fwd_band(&q, &k, &v, kb, scale, imp)?;
        let band_f = time(dev, a.iters, || flash::fwd_band(&q, &k, &v, kb, scale, imp).map(|_| ()))?;
        let band_b = time(dev, a.iters, || flash::bwd_band(&q, &k, &v, &o, &l, &dout, kb, scale, imp).map(|_| ()))?;
        let piece = |x: &Tensor, i: usize| -> candle_core::Result<Tensor> {
            let (s, e) = docs.range(i);
            x.narrow(1, s, e - s)?.contiguous()
        };
        let parts: Vec<[Tensor; 4]> = (0..docs.count())
            .map(|i| Ok([piece(&q, i)?, piece(&k, i)?, piece(&v, i)?, piece(&dout, i)?]))
            .collect::<candle_core::Result<_>>()?;
        let outs: Vec<(Tensor, Tensor)> =
            parts.iter().map(|[q, k, v, _]| flash::fwd(q, k, v, causal, scale, doc_imp)).collect::<candle_core::Result<_>>()?;
        let doc_f = time(dev, a.iters, || {
            for [q, k, v, _] in &parts {
                flash::fwd(q, k, v, causal, scale, doc_imp)?;
            }
            Ok(())
        })?;
        let doc_b = time(dev, a.iters, || {
            for ([q, k, v, g], (o, l)) in parts.iter().zip(&outs) {
                flash::bwd_with(q, k, v, o, l, g, causal, scale, doc_imp)?;
            }
            Ok(())
        })?;
        println!(
            "{{\"impl\":\"candle-cp-band\",\"kernel\":\"{imp:?}\",\"dtype\":\"bf16\",\"b\":{b},\"h\":{h},\"d\":{d},\"t\":{t},\"doc_len\":{len},\"docs\":{},\"band_fwd_ms\":{:.3},\"band_bwd_ms\":{:.3},\"perdoc_fwd_ms\":{:.3},\"perdoc_bwd_ms\":{:.3},\"band_fwd_tflops\":{:.2},\"band_bwd_tflops\":{:.2},\"speedup\":{:.2}}}",
            docs.count(),
            band_f * 1e3,
            band_b * 1e3,
            doc_f * 1e3,
            doc_b * 1e3,
            flops / band_f / 1e12,
            2.5 * flops / band_b / 1e12,
            (doc_f + doc_b) / (band_f + band_b)
        );
    }
    Ok(())
}
