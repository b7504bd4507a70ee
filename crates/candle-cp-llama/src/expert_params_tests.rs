//! The file layout of gpt-oss's expert adapters: PEFT's wrapper factors, their nesting, and the
//! update PEFT computes from them.

use super::*;
use candle_core::{DType, Device};

fn t(shape: &[usize], seed: f64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i as f64 * 0.37 + seed).sin() * 0.5) as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// PEFT's `get_delta_weight` of a 3-D parameter `[E, in, out]`, written from its einsum
/// `"o r e, e r i -> e i o"` on the file's factors `A` `[r·E, in]`, `B` `[out, r·E]`, element by
/// element (no reshapes shared with the code under test).
fn peft_delta(a: &Tensor, b: &Tensor, e: usize, scale: f64) -> Result<Vec<Vec<Vec<f64>>>> {
    let (a, b) = (a.to_dtype(DType::F64)?.to_vec2::<f64>()?, b.to_dtype(DType::F64)?.to_vec2::<f64>()?);
    let (re, i, o) = (a.len(), a[0].len(), b.len());
    let r = re / e;
    // weight_A.reshape(E, r, in)[e][j] = A[e·r + j]; weight_B.reshape(out, r, E)[o][j][e] = B[o][j·E + e]
    Ok((0..e).map(|ex| (0..i).map(|ii| (0..o).map(|oo| scale * (0..r).map(|j| b[oo][j * e + ex] * a[ex * r + j][ii]).sum::<f64>()).collect()).collect()).collect())
}

/// `file`'s wrappers (`lora_A` `[r·E, in]`, `lora_B` `[out, r·E]`) as PEFT 0.18 writes the same
/// update: `A'[e·r + j][o] = B[o][j·E + e]`, `B'[i][j·E + e] = A[e·r + j][i]`, element by element.
fn peft_018(file: &HashMap<String, Tensor>, e: usize) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for (n, t) in file {
        let Some(stem) = n.strip_suffix(".lora_A.weight").filter(|s| s.ends_with("experts") || s.ends_with("base_layer")) else {
            if !n.ends_with("experts.lora_B.weight") && !n.ends_with("base_layer.lora_B.weight") {
                out.insert(n.clone(), t.clone());
            }
            continue;
        };
        let a = t.to_vec2::<f32>()?;
        let b = file[&format!("{stem}.lora_B.weight")].to_vec2::<f32>()?;
        let (re, i, o) = (a.len(), a[0].len(), b.len());
        let r = re / e;
        let a2: Vec<f32> = (0..re).flat_map(|row| { let (ex, j) = (row / r, row % r); let b = &b; (0..o).map(move |oo| b[oo][j * e + ex]) }).collect();
        let b2: Vec<f32> = (0..i).flat_map(|ii| { let a = &a; (0..re).map(move |col| { let (j, ex) = (col / e, col % e); a[ex * r + j][ii] }) }).collect();
        out.insert(format!("{stem}.lora_A.weight"), Tensor::from_vec(a2, (re, o), &Device::Cpu)?);
        out.insert(format!("{stem}.lora_B.weight"), Tensor::from_vec(b2, (i, re), &Device::Cpu)?);
    }
    Ok(out)
}

/// The model's factors written as PEFT's wrappers: `down_proj` outer, `gate_up_proj` inner
/// (`base_layer`), flattened as PEFT's `[r·E, in]` / `[out, r·E]`; the update PEFT computes from
/// them is, expert by expert, gpt-oss's gate's `B_e·A_e` in the even columns of `gate_up_proj`
/// and up's in the odd ones (its `[E, h, 2·I]` layout), down's `(B_e·A_e)ᵀ`; transformers 5's
/// (`[E, 2·I, h]`, einsum `"o r e, e r i -> e o i"`) gate's in the first `I` rows, up's in the
/// next, down's `B_e·A_e`; reading gives the model's factors back, from either nesting, from
/// PEFT 0.18's order of the factors and for one wrapper alone; bad shapes are refused by name.
#[test]
fn wrappers_round_trip_and_give_pefts_update() -> Result<()> {
    for layout in [GateUp::Interleaved, GateUp::Concatenated] {
        wrappers_in(layout)?;
    }
    Ok(())
}

fn wrappers_in(layout: GateUp) -> Result<()> {
    let (e, r, h, i) = (3, 2, 5, 4);
    let p = "model.layers.1.";
    let model: HashMap<String, Tensor> = [
        ("mlp.experts.gate_up_proj.lora_A.weight", t(&[e, r, h], 0.1)?),
        ("mlp.experts.gate_proj.lora_B.weight", t(&[e, i, r], 1.3)?),
        ("mlp.experts.up_proj.lora_B.weight", t(&[e, i, r], 2.9)?),
        ("mlp.experts.down_proj.lora_A.weight", t(&[e, r, i], 4.1)?),
        ("mlp.experts.down_proj.lora_B.weight", t(&[e, h, r], 5.7)?),
        ("self_attn.q_proj.lora_A.weight", t(&[r, h], 6.2)?),
    ]
    .into_iter()
    .map(|(n, t)| (format!("{p}{n}"), t))
    .collect();
    let file = to_peft(model.clone(), layout)?;
    let mut names: Vec<&String> = file.keys().collect();
    names.sort();
    let want = ["mlp.experts.base_layer.lora_A.weight", "mlp.experts.base_layer.lora_B.weight", "mlp.experts.lora_A.weight", "mlp.experts.lora_B.weight", "self_attn.q_proj.lora_A.weight"];
    assert_eq!(names, want.iter().map(|n| format!("{p}{n}")).collect::<Vec<_>>().iter().collect::<Vec<_>>());
    let f = |n: &str| file[&format!("{p}{n}")].clone();
    assert_eq!(f("mlp.experts.base_layer.lora_A.weight").dims(), &[r * e, h]);
    assert_eq!(f("mlp.experts.base_layer.lora_B.weight").dims(), &[2 * i, r * e]);
    assert_eq!(f("mlp.experts.lora_A.weight").dims(), &[r * e, i]);
    assert_eq!(f("mlp.experts.lora_B.weight").dims(), &[h, r * e]);
    // PEFT's update against the model's per-expert products
    let m = |n: &str| model[&format!("{p}{n}")].clone();
    let gate_up = peft_delta(&f("mlp.experts.base_layer.lora_A.weight"), &f("mlp.experts.base_layer.lora_B.weight"), e, 1.0)?;
    let down = peft_delta(&f("mlp.experts.lora_A.weight"), &f("mlp.experts.lora_B.weight"), e, 1.0)?;
    let a = m("mlp.experts.gate_up_proj.lora_A.weight");
    let mut worst: f64 = 0.0;
    for ex in 0..e {
        let g = m("mlp.experts.gate_proj.lora_B.weight").get(ex)?.matmul(&a.get(ex)?)?.to_dtype(DType::F64)?.to_vec2::<f64>()?; // [I, h]
        let u = m("mlp.experts.up_proj.lora_B.weight").get(ex)?.matmul(&a.get(ex)?)?.to_dtype(DType::F64)?.to_vec2::<f64>()?;
        let d = m("mlp.experts.down_proj.lora_B.weight").get(ex)?.matmul(&m("mlp.experts.down_proj.lora_A.weight").get(ex)?)?.to_dtype(DType::F64)?.to_vec2::<f64>()?; // [h, I]
        // (PEFT's [E, in, out] read as the parameter holds it: gpt-oss's [E, h, 2·I] as it is;
        // transformers 5's [E, 2·I, h] swaps in and out, so the same array is its transpose)
        for c in 0..i {
            for k in 0..h {
                let (gc, uc) = match layout {
                    GateUp::Interleaved => (2 * c, 2 * c + 1),
                    GateUp::Concatenated => (c, i + c),
                };
                worst = worst.max((gate_up[ex][k][gc] - g[c][k]).abs()).max((gate_up[ex][k][uc] - u[c][k]).abs());
                worst = worst.max((down[ex][c][k] - d[k][c]).abs());
            }
        }
    }
    assert!(worst < 1e-6, "PEFT's update differs from the model's by {worst}");
    // reading back, from this nesting and from the other one
    let same = |got: &HashMap<String, Tensor>| -> Result<()> {
        assert_eq!(got.len(), model.len());
        for (n, t) in &model {
            let g = got.get(n).ok_or_else(|| candle_core::Error::Msg(format!("{n} not read back")))?;
            assert_eq!(g.dims(), t.dims(), "{n}");
            assert_eq!((g - t)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0, "{n}");
        }
        Ok(())
    };
    same(&from_peft(file.clone(), e, h, i, layout, "mlp")?)?;
    let swapped: HashMap<String, Tensor> = file.iter().map(|(n, t)| (n.replace("experts.base_layer.", "experts.X.").replace("experts.lora", "experts.base_layer.lora").replace("experts.X.", "experts."), t.clone())).collect();
    assert!(swapped.contains_key(&format!("{p}mlp.experts.base_layer.lora_B.weight")));
    same(&from_peft(swapped, e, h, i, layout, "mlp")?)?;
    // PEFT 0.18's order (lora_A [r·E, out], lora_B [in, r·E], ΔW_e = (B_e·A_e)ᵀ): the same
    // factors
    let old = peft_018(&file, e)?;
    assert_eq!(old[&format!("{p}mlp.experts.base_layer.lora_A.weight")].dims(), &[r * e, 2 * i]);
    assert_eq!(old[&format!("{p}mlp.experts.lora_B.weight")].dims(), &[i, r * e]);
    same(&from_peft(old, e, h, i, layout, "mlp")?)?;
    // one wrapper alone (gate_up_proj, not nested)
    let alone: HashMap<String, Tensor> = model.iter().filter(|(n, _)| !n.contains("down_proj")).map(|(n, t)| (n.clone(), t.clone())).collect();
    let file1 = to_peft(alone.clone(), layout)?;
    assert!(file1.contains_key(&format!("{p}mlp.experts.lora_A.weight")) && !file1.keys().any(|n| n.contains("base_layer")));
    assert_eq!(from_peft(file1.clone(), e, h, i, layout, "mlp")?.len(), alone.len());
    // refusals: another expert count, a wrapper of neither shape, A without B
    let err = |r: Result<HashMap<String, Tensor>>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err(from_peft(file1.clone(), 4, h, i, layout, "mlp")).contains("E = 4"));
    let e1 = err(from_peft(file1.clone(), e, h + 1, i, layout, "mlp"));
    assert!(e1.contains("neither gate_up_proj's"), "{e1}");
    let mut half = file1;
    half.remove(&format!("{p}mlp.experts.lora_B.weight"));
    assert!(err(from_peft(half, e, h, i, layout, "mlp")).contains("without lora_B"));
    let mut broken = model.clone();
    broken.remove(&format!("{p}mlp.experts.up_proj.lora_B.weight"));
    assert!(err(to_peft(broken, layout)).contains("no up B"));
    Ok(())
}

/// Keys: a whole name or its tail after a dot; names that cannot be an expert parameter are
/// refused; the parts of gate_up_proj share it, down_proj is its own.
#[test]
fn keys_and_parameters() -> Result<()> {
    assert!(key_matches("mlp.experts.gate_up_proj", "model.layers.7.mlp.experts.gate_up_proj"));
    assert!(key_matches("7.mlp.experts.down_proj", "model.layers.7.mlp.experts.down_proj"));
    assert!(!key_matches("7.mlp.experts.down_proj", "model.layers.17.mlp.experts.down_proj"));
    assert!(check_key("experts.gate_up_proj").is_ok() && check_key("mlp.experts.gate_proj").is_err() && check_key("q_proj").is_err());
    // PEFT's conversion of transformers 4 adapters: bare names, the router's weight
    assert!(check_key("gate_up_proj").is_ok() && check_key("down_proj").is_ok() && check_key("gate.weight").is_ok() && check_key("3.mlp.gate.weight").is_ok());
    assert!(check_key("gate").is_err() && check_key("mlp.gate_proj").is_err() && check_key("router.weight").is_err());
    assert!(key_matches("gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj") && key_matches("gate.weight", "model.layers.1.mlp.gate.weight"));
    assert!(!key_matches("gate.weight", "model.layers.1.mlp.shared_expert_gate.weight"));
    assert_eq!(router_param("model.layers.4.mlp.gate").as_deref(), Some("model.layers.4.mlp.gate.weight"));
    assert_eq!(router_param("model.layers.4.block_sparse_moe.gate").as_deref(), Some("model.layers.4.mlp.gate.weight"));
    assert_eq!(router_param("model.layers.4.mlp.shared_expert_gate"), None);
    assert_eq!(router_param("model.layers.4.mlp.router"), None);
    assert_eq!(param_of("model.layers.0.mlp.experts.up_proj"), Some(("model.layers.0.mlp.experts.gate_up_proj".into(), 1)));
    assert_eq!(param_of("model.layers.0.mlp.experts.down_proj"), Some(("model.layers.0.mlp.experts.down_proj".into(), 0)));
    assert_eq!(param_of("model.layers.0.mlp.down_proj"), None);
    // a Mixtral's, under its module here and transformers 5's `mlp` in PEFT's names
    assert_eq!(param_of("model.layers.2.block_sparse_moe.experts.gate_proj"), Some(("model.layers.2.block_sparse_moe.experts.gate_up_proj".into(), 0)));
    assert_eq!(param_of("model.layers.2.block_sparse_moe.experts.down_proj"), Some(("model.layers.2.block_sparse_moe.experts.down_proj".into(), 0)));
    assert_eq!(param_of("model.layers.2.block_sparse_moe.gate"), None);
    assert_eq!(peft_param("model.layers.2.block_sparse_moe.experts.gate_up_proj"), "model.layers.2.mlp.experts.gate_up_proj");
    assert_eq!(peft_param("model.layers.2.mlp.experts.down_proj"), "model.layers.2.mlp.experts.down_proj");
    Ok(())
}

/// A Mixtral's expert factors (`block_sparse_moe` here) go to the file under transformers 5's
/// names (`….mlp.experts[.base_layer].lora_*`: PEFT adapts its `mlp.experts` parameters) and
/// come back under the model's, bit for bit; its other adapters keep their names.
#[test]
fn mixtral_wrappers_take_transformers_5_names() -> Result<()> {
    let (e, r, h, i) = (4, 2, 6, 3);
    let p = "model.layers.0.";
    let model: HashMap<String, Tensor> = [
        ("block_sparse_moe.experts.gate_up_proj.lora_A.weight", t(&[e, r, h], 0.3)?),
        ("block_sparse_moe.experts.gate_proj.lora_B.weight", t(&[e, i, r], 1.1)?),
        ("block_sparse_moe.experts.up_proj.lora_B.weight", t(&[e, i, r], 2.3)?),
        ("block_sparse_moe.experts.down_proj.lora_A.weight", t(&[e, r, i], 3.7)?),
        ("block_sparse_moe.experts.down_proj.lora_B.weight", t(&[e, h, r], 4.9)?),
        ("self_attn.v_proj.lora_B.weight", t(&[h, r], 5.3)?),
    ]
    .into_iter()
    .map(|(n, t)| (format!("{p}{n}"), t))
    .collect();
    let file = to_peft(model.clone(), GateUp::Concatenated)?;
    let mut names: Vec<String> = file.keys().map(|n| n.trim_start_matches(p).to_string()).collect();
    names.sort();
    assert_eq!(names, ["mlp.experts.base_layer.lora_A.weight", "mlp.experts.base_layer.lora_B.weight", "mlp.experts.lora_A.weight", "mlp.experts.lora_B.weight", "self_attn.v_proj.lora_B.weight"]);
    let back = from_peft(file.clone(), e, h, i, GateUp::Concatenated, "block_sparse_moe")?;
    assert_eq!(back.len(), model.len());
    for (n, t) in &model {
        let g = back.get(n).ok_or_else(|| candle_core::Error::Msg(format!("{n} not read back")))?;
        assert_eq!((g - t)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0, "{n}");
    }
    // and read for a Qwen-style model, the same factors under `mlp`
    let qwen = from_peft(file, e, h, i, GateUp::Concatenated, "mlp")?;
    assert!(qwen.contains_key(&format!("{p}mlp.experts.gate_up_proj.lora_A.weight")) && !qwen.keys().any(|n| n.contains("block_sparse_moe")));
    Ok(())
}
