//! PEFT adapter files written here element by element, as PEFT writes them, for tests that read
//! them (no PEFT on this machine).

use candle_core::{Device, Result, Tensor};
use candle_cp_llama::LlamaConfig;
use std::collections::HashMap;
use std::path::Path;

/// PEFT's conversion of a transformers 4 adapter (`adapters4`: the model's stacked per-expert
/// factors of rank `r` on every expert's gate, up and down projections and the router, by
/// `base`'s names) for transformers 5's fused experts, as PEFT saves it again: per sparse layer
/// `….mlp.experts.base_layer.lora_{A,B}.weight` (gate_up_proj at rank `2r`: `A` `[2r·E, h]`,
/// row `e·2r + j` gate's for `j < r`, up's after; `B` `[2I, 2r·E]` block-diagonal, column
/// `j·E + e`), `….mlp.experts.lora_{A,B}.weight` (down_proj, rank `r`), the router's under
/// transformers 5's `….mlp.gate`, and the attention's as they are. Names without PEFT's prefix.
pub fn peft_converted(base: &LlamaConfig, adapters4: &HashMap<String, Tensor>, r: usize) -> Result<HashMap<String, Tensor>> {
    let m = base.moe.as_ref().map_or("mlp", |m| m.module());
    let e = base.moe.as_ref().map_or(0, |m| m.num_experts);
    let v = |n: &str| -> Result<Vec<Vec<Vec<f32>>>> {
        match adapters4.get(n) {
            Some(t) => t.to_vec3::<f32>(),
            None => candle_core::bail!("peft_converted: no {n}"),
        }
    };
    let mut file: HashMap<String, Tensor> = HashMap::new();
    for l in (0..base.num_hidden_layers).filter(|&l| base.is_moe_layer(l)) {
        let p = format!("model.layers.{l}.{m}.experts.");
        if !adapters4.contains_key(&format!("{p}gate_proj.lora_A.weight")) {
            continue;
        }
        let (ag, au, bg, bu) = (v(&format!("{p}gate_proj.lora_A.weight"))?, v(&format!("{p}up_proj.lora_A.weight"))?, v(&format!("{p}gate_proj.lora_B.weight"))?, v(&format!("{p}up_proj.lora_B.weight"))?);
        let (h, i) = (ag[0][0].len(), bg[0].len());
        let mut a = vec![0f32; 2 * r * e * h];
        let mut b = vec![0f32; 2 * i * 2 * r * e];
        for ex in 0..e {
            for j in 0..2 * r {
                let src = if j < r { &ag[ex][j] } else { &au[ex][j - r] };
                a[(ex * 2 * r + j) * h..(ex * 2 * r + j + 1) * h].copy_from_slice(src);
                for o in 0..i {
                    let (row, val) = if j < r { (o, bg[ex][o][j]) } else { (i + o, bu[ex][o][j - r]) };
                    b[row * 2 * r * e + j * e + ex] = val;
                }
            }
        }
        let q = format!("model.layers.{l}.mlp.experts.");
        file.insert(format!("{q}base_layer.lora_A.weight"), Tensor::from_vec(a, (2 * r * e, h), &Device::Cpu)?);
        file.insert(format!("{q}base_layer.lora_B.weight"), Tensor::from_vec(b, (2 * i, 2 * r * e), &Device::Cpu)?);
        // down_proj: A [r·E, I] row e·r + j; B [h, r·E] column j·E + e
        let (ad, bd) = (v(&format!("{p}down_proj.lora_A.weight"))?, v(&format!("{p}down_proj.lora_B.weight"))?);
        let a: Vec<f32> = (0..e).flat_map(|ex| (0..r).flat_map(|j| ad[ex][j].clone()).collect::<Vec<_>>()).collect();
        let b: Vec<f32> = (0..h).flat_map(|o| (0..r).flat_map(|j| (0..e).map(|ex| bd[ex][o][j]).collect::<Vec<_>>()).collect::<Vec<_>>()).collect();
        file.insert(format!("{q}lora_A.weight"), Tensor::from_vec(a, (r * e, i), &Device::Cpu)?);
        file.insert(format!("{q}lora_B.weight"), Tensor::from_vec(b, (h, r * e), &Device::Cpu)?);
        // the router: transformers 5's `mlp.gate`
        for f in ["lora_A", "lora_B"] {
            if let Some(t) = adapters4.get(&format!("model.layers.{l}.{m}.gate.{f}.weight")) {
                file.insert(format!("model.layers.{l}.mlp.gate.{f}.weight"), t.clone());
            }
        }
    }
    for (n, t) in adapters4.iter().filter(|(n, _)| n.contains("self_attn.")) {
        file.insert(n.clone(), t.clone());
    }
    Ok(file)
}

/// Write `file` (names without PEFT's prefix) and `config` as a PEFT adapter into `dir`.
pub fn write_adapter(dir: &Path, file: HashMap<String, Tensor>, config: &serde_json::Value) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let named: HashMap<String, Tensor> = file.into_iter().map(|(n, t)| (format!("base_model.model.{n}"), t)).collect();
    candle_core::safetensors::save(&named, dir.join("adapter_model.safetensors"))?;
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).map_err(|e| candle_core::Error::Msg(e.to_string()))
}
