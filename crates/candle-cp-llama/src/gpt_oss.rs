//! gpt-oss (`model_type` `gpt_oss`, `GptOssForCausalLM`: openai/gpt-oss-20b and -120b): what
//! its `config.json` and checkpoints hold beyond a Llama's, read and written back
//! ([`super::LlamaConfig::gpt_oss`]).
//!
//! A gpt-oss layer is a Llama layer with:
//! - biases on q, k, v **and o_proj** (`attention_bias`, which transformers forces on);
//! - **attention sinks**: one learned logit per query head (`self_attn.sinks` `[H]`) joining
//!   every row's softmax and attending to nothing ([`candle_cp_ops::attention::sinks`]): every
//!   CP layout applies it once to each finished row and returns its gradient;
//! - a 128-key window on every other layer (`layer_types`, else layers `0, 2, 4, …` as
//!   `GptOssConfig` builds them), YaRN RoPE (factor 32 over 4096 positions, `truncate: false`);
//! - a mixture of experts as every MLP ([`super::MoeStyle::GptOss`]): a router with a bias,
//!   whose top-`K` logits go through a softmax (the renormalised top `K` of the full softmax),
//!   experts with biases on their gate, up and down projections, and the clamped SwiGLU of
//!   [`clamped_swiglu`] (`α = 1.702`, limit 7, `(up + 1)` as the up factor).
//!
//! Checkpoints (transformers' layout): `mlp.router.{weight,bias}`, `mlp.experts.gate_up_proj`
//! `[E, h, 2·I]` (input-major; gate and up interleaved column by column), `gate_up_proj_bias`
//! `[E, 2·I]` (interleaved), `down_proj` `[E, I, h]`, `down_proj_bias` `[E, h]`. The model holds
//! the experts stacked as the other mixtures of experts do (`experts.{gate,up}_proj` `[E, I, h]`,
//! `experts.down_proj` `[E, h, I]`) with biases `experts.{gate,up,down}_proj.bias`: converted
//! on load and save ([`from_checkpoint`]; [`group`] and [`combine`] on save). openai's own release stores the
//! experts as MXFP4 (`*_blocks`, `*_scales`): those are dequantized on load ([`dequant_mxfp4`])
//! and saved back in bf16 layout as above (transformers reads both).

use candle_core::{bail, DType, Result, Tensor};
use candle_cp_ops::autograd::{attach2, BackwardFn};
use serde_json::{Map, Value};
use std::sync::Arc;

/// The gate's slope inside its sigmoid (`GptOssExperts.alpha`).
pub const ALPHA: f64 = 1.702;

/// The clamp of the gate (above) and the up projection (both sides) (`GptOssExperts.limit`,
/// config.json's `swiglu_limit`).
pub const LIMIT: f64 = 7.0;

/// gpt-oss's gated product as one graph node: with `g = min(gate, 7)` and
/// `u = clamp(up, −7, 7)`, `(u + 1) · g · σ(1.702 · g)`; keeps only its two inputs, the
/// backward in f32 (zero gradient where a clamp is active). Reference: [`clamped_swiglu_slow`].
pub fn clamped_swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() || gate.dtype() != up.dtype() {
        bail!("clamped_swiglu: gate {:?} ({:?}) and up {:?} ({:?}) must have one shape and dtype", gate.dims(), gate.dtype(), up.dims(), up.dtype())
    }
    let (g, u) = (gate.detach(), up.detach());
    let out = clamped_swiglu_slow(&g, &u)?;
    let dt = gate.dtype();
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let (g32, u32, dy32) = (g.to_dtype(DType::F32)?, u.to_dtype(DType::F32)?, dy.to_dtype(DType::F32)?);
        let gc = g32.minimum(LIMIT)?;
        let uc = u32.clamp(-LIMIT, LIMIT)?;
        // the clamps pass the gradient where they are not active (PyTorch: min <= x <= max)
        let g_in = g32.le(LIMIT)?.to_dtype(DType::F32)?;
        let u_in = u32.abs()?.le(LIMIT)?.to_dtype(DType::F32)?;
        let s = ((&gc * -ALPHA)?.exp()? + 1.0)?.recip()?;
        let glu = (&gc * &s)?;
        // d(g·σ(αg))/dg = σ + α·g·σ·(1 − σ)
        let dglu = (&s + ((&gc * ALPHA)? * (&s * (1.0 - &s)?)?)?)?;
        let dup = ((&dy32 * &glu)? * u_in)?.to_dtype(dt)?;
        let dgate = (((dy32 * (uc + 1.0)?)? * dglu)? * g_in)?.to_dtype(dt)?;
        Ok(vec![Some(dgate), Some(dup)])
    });
    attach2("clamped_swiglu", gate, up, out, bwd)
}

/// [`clamped_swiglu`] from candle's ops, as transformers' `GptOssExperts` writes it (computed
/// in f32, returned in gate's dtype; no backward of its own beyond candle's).
pub fn clamped_swiglu_slow(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let dt = gate.dtype();
    let g = gate.to_dtype(DType::F32)?.minimum(LIMIT)?;
    let u = up.to_dtype(DType::F32)?.clamp(-LIMIT, LIMIT)?;
    let glu = (&g * ((&g * -ALPHA)?.exp()? + 1.0)?.recip()?)?;
    ((u + 1.0)? * glu)?.to_dtype(dt)
}

/// Errors for `config.json` keys of a `gpt_oss` config this model would not compute as
/// transformers does (a `swiglu_limit` other than 7, which transformers ignores; the
/// load-balancing loss, which transformers takes from the routed top-`K` scores rather than
/// the router's probabilities).
pub(crate) fn refuse_unsupported(m: &Map<String, Value>) -> Result<()> {
    if let Some(v) = m.get("swiglu_limit").filter(|v| !v.is_null()) {
        if v.as_f64() != Some(LIMIT) {
            bail!("config.json: gpt_oss `swiglu_limit` {v}: transformers' GptOssExperts clamps at {LIMIT} whatever the config says; only {LIMIT} is supported")
        }
    }
    if m.get("output_router_logits").and_then(|v| v.as_bool()) == Some(true) {
        bail!("config.json: gpt_oss `output_router_logits: true` not supported (transformers computes its load-balancing loss from the routed top-K scores; train without it)")
    }
    Ok(())
}

/// `config.json` with `GptOssConfig`'s defaults for the keys it leaves out (the 120B's shape:
/// 36 layers, 128 experts, top 4, 2880 wide, 64 / 8 heads of 64, window 128 on every other
/// layer, YaRN factor 32 over 4096 positions), `attention_bias` forced on as transformers
/// does; `None` for other architectures.
pub(crate) fn with_defaults(m: &Map<String, Value>) -> Option<Map<String, Value>> {
    let classes: Vec<&str> = m.get("architectures").and_then(|a| a.as_array()).map(|a| a.iter().filter_map(|c| c.as_str()).collect()).unwrap_or_default();
    if m.get("model_type").and_then(|v| v.as_str()) != Some("gpt_oss") && !classes.contains(&"GptOssForCausalLM") {
        return None;
    }
    let mut t = m.clone();
    let mut default = |k: &str, v: Value| {
        if t.get(k).is_none_or(|x| x.is_null()) {
            t.insert(k.into(), v);
        }
    };
    default("num_hidden_layers", 36.into());
    default("num_local_experts", 128.into());
    default("vocab_size", 201_088.into());
    default("hidden_size", 2880.into());
    default("intermediate_size", 2880.into());
    default("head_dim", 64.into());
    default("num_attention_heads", 64.into());
    default("num_key_value_heads", 8.into());
    default("sliding_window", 128.into());
    default("rope_theta", 150_000.0.into());
    default("max_position_embeddings", 131_072.into());
    default("rms_norm_eps", 1e-5.into());
    default("num_experts_per_tok", 4.into());
    default("router_aux_loss_coef", 0.9.into());
    default(
        "rope_scaling",
        serde_json::json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 4096}),
    );
    t.insert("attention_bias".into(), true.into());
    Some(t)
}

/// Turn the keys `to_hf_json` wrote into a gpt-oss config: `attention_bias`, the clamp,
/// `layer_types` (the mixture of experts' keys come from `qwen3_moe::write`).
pub(crate) fn write(m: &mut Map<String, Value>, cfg: &super::LlamaConfig) {
    for k in ["mlp_bias", "pretraining_tp"] {
        m.remove(k);
    }
    m.insert("attention_bias".into(), true.into());
    m.insert("swiglu_limit".into(), LIMIT.into());
    let types: Vec<&str> = (0..cfg.num_hidden_layers).map(|i| if cfg.layer_window(i).is_some() { "sliding_attention" } else { "full_attention" }).collect();
    m.insert("layer_types".into(), serde_json::json!(types));
}

/// The stacked expert parameters (suffix of the model's name) and the checkpoint tensor each
/// is part of: (suffix, checkpoint suffix, part). Part 0 / 1: gate / up, interleaved column by
/// column in `gate_up_proj` and `gate_up_proj_bias`.
const PARTS: [(&str, &str, usize); 6] = [
    ("mlp.experts.gate_proj.bias", "mlp.experts.gate_up_proj_bias", 0),
    ("mlp.experts.up_proj.bias", "mlp.experts.gate_up_proj_bias", 1),
    ("mlp.experts.down_proj.bias", "mlp.experts.down_proj_bias", 0),
    ("mlp.experts.gate_proj", "mlp.experts.gate_up_proj", 0),
    ("mlp.experts.up_proj", "mlp.experts.gate_up_proj", 1),
    ("mlp.experts.down_proj", "mlp.experts.down_proj", 0),
];

/// The checkpoint tensor gpt-oss parameter `name` is part of, and which part (see the module
/// doc); `None` for a parameter held under its own name.
pub fn checkpoint_part(name: &str) -> Option<(String, usize)> {
    super::phi3::part_by_suffix(&PARTS, name)
}

/// Every checkpoint tensor name a gpt-oss parameter may be read from: its part's tensor and,
/// for the weights, openai's MXFP4 pair (`…_blocks`, `…_scales`).
pub fn checkpoint_names(name: &str) -> Vec<String> {
    match checkpoint_part(name) {
        None => vec![name.to_string()],
        Some((ck, _)) if ck.ends_with("_bias") => vec![ck],
        Some((ck, _)) => vec![format!("{ck}_blocks"), format!("{ck}_scales"), ck],
    }
}

/// The checkpoint's tensors of the model's `tensors` (by the model's names): the parts of each
/// [`checkpoint_part`] grouped under its checkpoint name in part order, every other tensor
/// alone under its own, in the order given (a group where its first part was). Errors name a
/// group missing a part.
pub fn group<T>(tensors: Vec<(String, T)>) -> Result<Vec<(String, Vec<T>)>> {
    super::phi3::group_parts(tensors, checkpoint_part, |ck| if ck.contains("gate_up_proj") { 2 } else { 1 })
}

/// The checkpoint tensor `ck` from the model's `parts` (full tensors, in part order): gate and
/// up `[E, I, h]` interleaved into `gate_up_proj` `[E, h, 2·I]`, their biases `[E, I]` into
/// `[E, 2·I]`, `down_proj` `[E, h, I]` transposed to `[E, I, h]`, `down_proj_bias` as it is.
pub fn combine(ck: &str, parts: &[Tensor]) -> Result<Tensor> {
    match parts {
        [g, u] if ck.ends_with("experts.gate_up_proj") => {
            let (e, i, h) = g.dims3()?;
            Tensor::stack(&[g.transpose(1, 2)?, u.transpose(1, 2)?], 3)?.reshape((e, h, 2 * i))
        }
        [g, u] if ck.ends_with("experts.gate_up_proj_bias") => {
            let (e, i) = g.dims2()?;
            Tensor::stack(&[g, u], 2)?.reshape((e, 2 * i))
        }
        [d] if ck.ends_with("experts.down_proj") => d.transpose(1, 2)?.contiguous(),
        [x] => Ok(x.clone()),
        _ => bail!("gpt-oss checkpoint tensor {ck}: {} parts", parts.len()),
    }
}

/// The shape [`combine`] gives from parts of shapes `parts`.
pub fn combined_shape(ck: &str, parts: &[Vec<usize>]) -> Vec<usize> {
    match parts {
        [g, _] if ck.ends_with("experts.gate_up_proj") && g.len() == 3 => vec![g[0], g[2], 2 * g[1]],
        [g, _] if g.len() == 2 => vec![g[0], 2 * g[1]],
        [d] if ck.ends_with("experts.down_proj") && d.len() == 3 => vec![d[0], d[2], d[1]],
        [x, ..] => x.clone(),
        [] => vec![],
    }
}

/// Parameter `name` (full shape `shape`) of a gpt-oss model from its checkpoint, whose tensor
/// `n` `get(n)` returns (`None`: absent): the part of the interleaved `gate_up_proj` (bf16, or
/// dequantized from MXFP4) and its bias, the transposed `down_proj`; `Ok(None)` for a
/// parameter held under its own name. Errors name a missing or mis-shaped tensor.
pub fn from_checkpoint(name: &str, shape: &[usize], get: &mut dyn FnMut(&str) -> Result<Option<Tensor>>) -> Result<Option<Tensor>> {
    from_checkpoint_cached(name, shape, get, &mut None)
}

/// [`from_checkpoint`] keeping the last whole `gate_up_proj` it read (dequantized, for MXFP4)
/// in `cache`, so that the up projection after the gate reads and dequantizes it once.
pub fn from_checkpoint_cached(name: &str, shape: &[usize], get: &mut dyn FnMut(&str) -> Result<Option<Tensor>>, cache: &mut Option<(String, Tensor)>) -> Result<Option<Tensor>> {
    let Some((ck, part)) = checkpoint_part(name) else { return Ok(None) };
    // the whole tensor `n` from the cache or from `read` (then cached)
    let mut whole = |n: &str, read: &mut dyn FnMut() -> Result<Option<Tensor>>| -> Result<Option<Tensor>> {
        if let Some((_, t)) = cache.as_ref().filter(|(c, _)| c == n) {
            return Ok(Some(t.clone()));
        }
        let t = read()?;
        if let Some(t) = &t {
            *cache = Some((n.to_string(), t.clone()));
        }
        Ok(t)
    };
    let half = |t: &Tensor, dim: usize| -> Result<Tensor> {
        // columns `part`, `part + 2`, … of dim `dim` (the last)
        let mut d = t.dims().to_vec();
        let n = d[dim] / 2;
        d[dim] = n;
        d.push(2);
        t.reshape(d.as_slice())?.narrow(dim + 1, part, 1)?.squeeze(dim + 1)?.contiguous()
    };
    let check = |t: &Tensor, want: &[usize], n: &str| -> Result<()> {
        if t.dims() != want {
            bail!("gpt-oss checkpoint tensor {n} has shape {:?}, the config implies {want:?} (for {name} {shape:?})", t.dims())
        }
        Ok(())
    };
    let t = if ck.ends_with("_bias") {
        let Some(t) = get(&ck)? else { bail!("gpt-oss checkpoint has no tensor {ck} (for {name} {shape:?})") };
        if ck.ends_with("gate_up_proj_bias") {
            check(&t, &[shape[0], 2 * shape[1]], &ck)?;
            half(&t, 1)?
        } else {
            check(&t, shape, &ck)?;
            t
        }
    } else if let Some(t) = whole(&ck, &mut || get(&ck))? {
        // bf16 layout: [E, in, out]
        let (e, out, inp) = (shape[0], shape[1], shape[2]);
        if ck.ends_with("gate_up_proj") {
            check(&t, &[e, inp, 2 * out], &ck)?;
            half(&t, 2)?.transpose(1, 2)?.contiguous()?
        } else {
            check(&t, &[e, inp, out], &ck)?;
            t.transpose(1, 2)?.contiguous()?
        }
    } else {
        // openai's MXFP4: [E, out, in] after dequantization
        let (bn, sn) = (format!("{ck}_blocks"), format!("{ck}_scales"));
        let mut read = || -> Result<Option<Tensor>> {
            match (get(&bn)?, get(&sn)?) {
                (Some(blocks), Some(scales)) => dequant_mxfp4(&blocks, &scales).map(Some),
                _ => Ok(None),
            }
        };
        let Some(w) = whole(&bn, &mut read)? else {
            bail!("gpt-oss checkpoint has neither {ck} nor {bn} / {sn} (for {name} {shape:?})")
        };
        if ck.ends_with("gate_up_proj") {
            check(&w, &[shape[0], 2 * shape[1], shape[2]], &bn)?;
            let (e, o2, i) = w.dims3()?;
            w.reshape((e, o2 / 2, 2, i))?.narrow(2, part, 1)?.squeeze(2)?.contiguous()?
        } else {
            check(&w, shape, &bn)?;
            w
        }
    };
    Ok(Some(t))
}

/// The FP4 (E2M1) values of codes 0–15.
const FP4: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// MXFP4 (openai's checkpoint layout, as transformers' `convert_moe_packed_tensors` reads it):
/// `blocks` u8 `[.., G, 16]` (two FP4 codes per byte, the low nibble first) and `scales` u8
/// `[.., G]` (a power-of-two exponent per block of 32 values, biased by 127) to bf16
/// `[.., G·32]` (exact: an FP4 value times a power of two within bf16's exponent range, as
/// transformers dequantizes them; half the host memory of f32).
pub fn dequant_mxfp4(blocks: &Tensor, scales: &Tensor) -> Result<Tensor> {
    let bd = blocks.dims();
    if blocks.dtype() != DType::U8 || scales.dtype() != DType::U8 || bd.len() < 2 || bd[bd.len() - 1] != 16 || scales.dims() != &bd[..bd.len() - 1] {
        bail!("dequant_mxfp4: blocks {:?} {:?} must be u8 [.., G, 16] and scales {:?} {:?} u8 [.., G]", bd, blocks.dtype(), scales.dims(), scales.dtype())
    }
    let b = blocks.flatten_all()?.to_device(&candle_core::Device::Cpu)?.to_vec1::<u8>()?;
    let s = scales.flatten_all()?.to_device(&candle_core::Device::Cpu)?.to_vec1::<u8>()?;
    let mut out = Vec::with_capacity(b.len() * 2);
    for (g, &e) in s.iter().enumerate() {
        let m = 2f32.powi(e as i32 - 127);
        for &x in &b[g * 16..(g + 1) * 16] {
            out.push(half::bf16::from_f32(FP4[(x & 0x0f) as usize] * m));
            out.push(half::bf16::from_f32(FP4[(x >> 4) as usize] * m));
        }
    }
    let mut shape = bd[..bd.len() - 1].to_vec();
    let last = shape.len() - 1;
    shape[last] *= 32;
    Tensor::from_vec(out, shape.as_slice(), blocks.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The node's value is the plain ops'; its gradients are the plain ops' autograd ones, with
    /// inputs on both sides of both clamps.
    #[test]
    fn clamped_swiglu_matches_plain_ops() -> Result<()> {
        let g = Var::new(&[[-9.0f32, -1.0, 0.3, 2.0, 6.9, 7.5, 12.0]], &Device::Cpu)?;
        let u = Var::new(&[[8.0f32, -8.0, 0.5, -2.0, 1.0, 3.0, -6.5]], &Device::Cpu)?;
        let dy = Tensor::new(&[[1.0f32, -0.5, 2.0, 0.25, -1.5, 0.75, 1.25]], &Device::Cpu)?;
        let node = clamped_swiglu(g.as_tensor(), u.as_tensor())?;
        let plain = clamped_swiglu_slow(g.as_tensor(), u.as_tensor())?;
        assert_eq!(node.to_vec2::<f32>()?, plain.to_vec2::<f32>()?);
        let a = (node * &dy)?.sum_all()?.backward()?;
        let b = (plain * &dy)?.sum_all()?.backward()?;
        for v in [&g, &u] {
            let (x, y) = (a.get(v).expect("grad").to_vec2::<f32>()?, b.get(v).expect("grad").to_vec2::<f32>()?);
            for (p, q) in x[0].iter().zip(&y[0]) {
                assert!((p - q).abs() < 1e-5, "{x:?} vs {y:?}");
            }
        }
        // the clamps: no gradient past them
        let dg = a.get(&g).expect("grad").to_vec2::<f32>()?;
        let du = a.get(&u).expect("grad").to_vec2::<f32>()?;
        assert_eq!((dg[0][5], dg[0][6], du[0][0], du[0][1]), (0.0, 0.0, 0.0, 0.0));
        Ok(())
    }

    /// Load then save is the identity on the checkpoint's tensors (gate and up interleaved,
    /// `down_proj` transposed), and the parts are the columns / rows the module doc says.
    #[test]
    fn checkpoint_round_trip() -> Result<()> {
        let (e, i, h) = (2usize, 3usize, 4usize);
        let dev = Device::Cpu;
        let gate_up = Tensor::arange(0f32, (e * h * 2 * i) as f32, &dev)?.reshape((e, h, 2 * i))?;
        let down = Tensor::arange(0f32, (e * i * h) as f32, &dev)?.reshape((e, i, h))?;
        let gub = Tensor::arange(0f32, (e * 2 * i) as f32, &dev)?.reshape((e, 2 * i))?;
        let p = "model.layers.0.";
        let mut get = |n: &str| -> Result<Option<Tensor>> {
            Ok(match n.strip_prefix(p) {
                Some("mlp.experts.gate_up_proj") => Some(gate_up.clone()),
                Some("mlp.experts.down_proj") => Some(down.clone()),
                Some("mlp.experts.gate_up_proj_bias") => Some(gub.clone()),
                _ => None,
            })
        };
        let g = from_checkpoint(&format!("{p}mlp.experts.gate_proj"), &[e, i, h], &mut get)?.expect("gate");
        let u = from_checkpoint(&format!("{p}mlp.experts.up_proj"), &[e, i, h], &mut get)?.expect("up");
        let d = from_checkpoint(&format!("{p}mlp.experts.down_proj"), &[e, h, i], &mut get)?.expect("down");
        let gb = from_checkpoint(&format!("{p}mlp.experts.gate_proj.bias"), &[e, i], &mut get)?.expect("gate bias");
        let ub = from_checkpoint(&format!("{p}mlp.experts.up_proj.bias"), &[e, i], &mut get)?.expect("up bias");
        // expert 1, gate row 2 = checkpoint column 4 (even: gate), up row 2 = column 5
        let col = |t: &Tensor, c: usize| -> Result<Vec<f32>> { t.get(1)?.narrow(1, c, 1)?.flatten_all()?.to_vec1::<f32>() };
        assert_eq!(g.get(1)?.get(2)?.to_vec1::<f32>()?, col(&gate_up, 4)?);
        assert_eq!(u.get(1)?.get(2)?.to_vec1::<f32>()?, col(&gate_up, 5)?);
        assert_eq!(gb.to_vec2::<f32>()?[1][2], gub.to_vec2::<f32>()?[1][4]);
        assert_eq!(ub.to_vec2::<f32>()?[1][2], gub.to_vec2::<f32>()?[1][5]);
        let ck = format!("{p}mlp.experts.gate_up_proj");
        assert_eq!(combine(&ck, &[g.clone(), u.clone()])?.to_vec3::<f32>()?, gate_up.to_vec3::<f32>()?);
        assert_eq!(combined_shape(&ck, &[g.dims().to_vec(), u.dims().to_vec()]), gate_up.dims());
        let ckb = format!("{p}mlp.experts.gate_up_proj_bias");
        assert_eq!(combine(&ckb, &[gb.clone(), ub.clone()])?.to_vec2::<f32>()?, gub.to_vec2::<f32>()?);
        assert_eq!(combined_shape(&ckb, &[gb.dims().to_vec(), ub.dims().to_vec()]), gub.dims());
        let ckd = format!("{p}mlp.experts.down_proj");
        assert_eq!(combine(&ckd, std::slice::from_ref(&d))?.to_vec3::<f32>()?, down.to_vec3::<f32>()?);
        assert_eq!(combined_shape(&ckd, &[d.dims().to_vec()]), down.dims());
        assert!(from_checkpoint(&format!("{p}self_attn.sinks"), &[4], &mut get)?.is_none());
        Ok(())
    }

    /// MXFP4 by hand: codes and exponents of two blocks, the low nibble first; the gate / up
    /// rows of a dequantized `gate_up_proj_blocks` (out-major) alternate.
    #[test]
    fn mxfp4_dequantizes_as_transformers() -> Result<()> {
        let dev = Device::Cpu;
        let mut bytes = vec![0u8; 32];
        bytes[0] = 0x21; // codes 1 (0.5), 2 (1.0)
        bytes[1] = 0xf7; // codes 7 (6.0), 15 (-6.0)
        bytes[16] = 0x9c; // codes 12 (-2.0), 9 (-0.5)
        let blocks = Tensor::from_vec(bytes, (1, 2, 16), &dev)?;
        let scales = Tensor::from_vec(vec![127u8, 129], (1, 2), &dev)?;
        let w = dequant_mxfp4(&blocks, &scales)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        assert_eq!(&w[0][..4], &[0.5, 1.0, 6.0, -6.0]);
        assert_eq!(&w[0][32..34], &[-8.0, -2.0]);
        assert!(w[0][4..32].iter().chain(&w[0][34..]).all(|&x| x == 0.0));
        assert!(dequant_mxfp4(&blocks.to_dtype(DType::F32)?, &scales).is_err());
        // gate_up_proj_blocks [E=1, 2I=2, G=1, 16]: row 0 gate, row 1 up
        let b2 = Tensor::from_vec((0..32u8).map(|i| if i < 16 { 0x22u8 } else { 0x44u8 }).collect::<Vec<_>>(), (1, 2, 1, 16), &dev)?;
        let s2 = Tensor::from_vec(vec![127u8, 127], (1, 2, 1), &dev)?;
        let mut get = |n: &str| -> Result<Option<Tensor>> {
            Ok(match n {
                "mlp.experts.gate_up_proj_blocks" => Some(b2.clone()),
                "mlp.experts.gate_up_proj_scales" => Some(s2.clone()),
                _ => None,
            })
        };
        let g = from_checkpoint("mlp.experts.gate_proj", &[1, 1, 32], &mut get)?.expect("gate");
        let u = from_checkpoint("mlp.experts.up_proj", &[1, 1, 32], &mut get)?.expect("up");
        assert!(g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().all(|&x| x == 1.0));
        assert!(u.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().all(|&x| x == 2.0));
        // cached: the gate and then the up projection read (and dequantize) the blocks once
        let (mut reads, mut cache) = (0, None);
        let mut counted = |n: &str| -> Result<Option<Tensor>> {
            reads += n.ends_with("_blocks") as usize;
            get(n)
        };
        from_checkpoint_cached("mlp.experts.gate_proj", &[1, 1, 32], &mut counted, &mut cache)?;
        let u2 = from_checkpoint_cached("mlp.experts.up_proj", &[1, 1, 32], &mut counted, &mut cache)?.expect("up");
        assert_eq!((reads, u2.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?), (1, vec![2.0; 32]));
        Ok(())
    }
}
