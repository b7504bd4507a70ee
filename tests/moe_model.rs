//! A tiny mixture-of-experts model for the tests: the tiny-llama oracle's weights with its MLPs
//! turned into experts (Qwen3-MoE, Mixtral or Qwen2-MoE style), the new weights seeded.

use candle_core::{Device, Result, Tensor};
use candle_cp_llama::hf::load_safetensors_dir;
use candle_cp_llama::{LlamaConfig, MoeConfig, MoeStyle};
use std::collections::HashMap;

/// The tiny Llama as a `style` mixture of 8 experts, top 2, expert width 48 (Qwen3-MoE: a dense
/// first layer and normalised top-K; Mixtral: both layers sparse, a window of 40; Qwen2-MoE: a
/// dense first layer and a shared expert of width 64; gpt-oss: both layers sparse, a window of
/// 40 on layer 0, YaRN over 64 positions, sinks around 3, biases everywhere, gate and up biases
/// of std 3 so that the clamps act; GraniteMoE: both layers sparse, Granite's multipliers 3,
/// 1/8, 0.5 and 4; GLM-4.5: a dense first layer, a shared expert 48 wide, sigmoid scores in 4
/// groups of which 2 are kept, scaled by 2.5, q, k, v biases with head norms, RoPE on half of
/// each head, correction biases of std 0.3), the load-balancing loss at `coef`; its config and
/// full weights.
pub fn moe_model(style: MoeStyle, coef: Option<f64>) -> Result<(LlamaConfig, HashMap<String, Tensor>)> {
    let dir = crate::oracle_dir("tiny-llama");
    let base = LlamaConfig::from_file(dir.join("config.json"))?;
    let mut moe = match style {
        MoeStyle::Qwen3Moe => {
            let mut m = MoeConfig::new(8, 2, 48);
            (m.norm_topk_prob, m.mlp_only_layers) = (true, vec![0]);
            m
        }
        MoeStyle::Mixtral => MoeConfig::mixtral(8, 2, 48),
        MoeStyle::Qwen2Moe => {
            let mut m = MoeConfig::qwen2_moe(8, 2, 48, 64);
            m.mlp_only_layers = vec![0];
            m
        }
        MoeStyle::GptOss => MoeConfig::gpt_oss(8, 2, 48),
        MoeStyle::GraniteMoe => MoeConfig::granite_moe(8, 2, 48),
        MoeStyle::DeepseekV2 => candle_core::bail!("moe_model: DeepSeek-V2's experts come with its latent attention (mla_ref::deepseek_v2_model)"),
        MoeStyle::Glm4Moe => {
            let mut m = MoeConfig::glm4_moe(8, 2, 48, 1, 2.5);
            (m.mlp_only_layers, m.groups) = (vec![0], (4, 2));
            m
        }
    };
    moe.output_router_logits = coef.is_some();
    moe.router_aux_loss_coef = coef.unwrap_or(0.0);
    let mut cfg = base.with_moe(Some(moe));
    if style == MoeStyle::GraniteMoe {
        cfg = cfg.with_granite(Some(candle_cp_llama::Granite { embedding_multiplier: 3.0, attention_multiplier: 0.125, residual_multiplier: 0.5, logits_scaling: 4.0 }));
    }
    if style == MoeStyle::Mixtral {
        cfg = cfg.with_sliding_window(Some(40));
    }
    if style == MoeStyle::Glm4Moe {
        cfg = cfg.with_qkv_bias(true).with_qk_norm(true);
    }
    if style == MoeStyle::GptOss {
        // a window of 40 on layer 0 only (gpt-oss slides every other layer), YaRN acting at T = 256
        cfg = cfg.with_sliding_window(Some(40)).with_sliding_layers(Some(vec![true, false]));
        cfg.rope_scaling = candle_cp_llama::RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: false,
        };
    }
    cfg.validate()?;
    let oracle = load_safetensors_dir(&dir, &Device::Cpu)?;
    let mut full = HashMap::new();
    for spec in candle_cp_llama::param_specs(&cfg) {
        let name = &spec.name;
        let t = if let Some(t) = oracle.get(name) {
            t.clone()
        } else if name.contains("self_attn") && name.ends_with("_norm.weight") {
            ((crate::rand_t(23, name, &spec.shape)? * 0.5)? + 1.0)?
        } else if name.ends_with(".gate.weight") || name.ends_with(".router.weight") {
            (crate::rand_t(if style == MoeStyle::Mixtral { 43 } else { 37 }, name, &spec.shape)? * 0.1)?
        } else if name.ends_with(".sinks") {
            // gpt-oss: sinks worth a row's mass (ln of the keys a row sees is 0..5.5)
            ((crate::rand_t(47, name, &spec.shape)? * 1.5)? + 3.0)?
        } else if name.ends_with("experts.gate_proj.bias") || name.ends_with("experts.up_proj.bias") {
            // gpt-oss: wide enough that some gates and ups pass the clamps at 7 (and ±7)
            (crate::rand_t(53, name, &spec.shape)? * 3.0)?
        } else if name.ends_with(candle_cp_llama::params::CORRECTION_BIAS) {
            (crate::rand_t(61, name, &spec.shape)? * 0.3)?
        } else if name.ends_with(".bias") {
            (crate::rand_t(59, name, &spec.shape)? * 0.3)?
        } else {
            (crate::rand_t(41, name, &spec.shape)? * 0.08)?
        };
        full.insert(name.clone(), t);
    }
    Ok((cfg, full))
}

