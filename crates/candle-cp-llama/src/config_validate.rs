//! [`LlamaConfig::validate`]: every invariant the model needs, named in the errors.

use super::*;

impl LlamaConfig {
    /// Check the shape invariants (`H % Hkv == 0`, even `head_dim`, non-zero sizes).
    pub fn validate(&self) -> Result<()> {
        if let Some(ls) = self.lora.as_ref().and_then(|l| l.layers.as_ref()) {
            if ls.is_empty() || ls.iter().any(|&i| i >= self.num_hidden_layers) {
                bail!("LlamaConfig: LoRA layers_to_transform {ls:?} must name some of the {} decoder layers", self.num_hidden_layers)
            }
        }
        if self.tie_word_embeddings && self.lora.as_ref().is_some_and(|l| l.modules_to_save.iter().any(|m| m == "lm_head")) {
            bail!("LlamaConfig: LoRA modules_to_save names lm_head, which this model ties to embed_tokens (tie_word_embeddings): name embed_tokens")
        }
        crate::reward::validate(self)?;
        crate::prm::validate(self)?;
        phi3::validate(self)?;
        smollm3::validate(self)?;
        granite::validate(self)?;
        olmo::validate(self)?;
        exaone4::validate(self)?;
        glm4::validate(self)?;
        glm4_moe::validate(self)?;
        deepseek::validate(self)?;
        phi3::validate_partial_rotary(self)?;
        phi3::refuse_fused_targets(self)?;
        crate::expert_params::check(self)?;
        let (h, kv) = (self.num_attention_heads, self.num_key_value_heads);
        if h == 0 || kv == 0 || h % kv != 0 {
            bail!("LlamaConfig: num_attention_heads ({h}) must be a positive multiple of num_key_value_heads ({kv})")
        }
        // (latent attention: its RoPE width is checked even, the attention's may be odd)
        if self.head_dim == 0 || (!self.head_dim.is_multiple_of(2) && self.mla.is_none()) {
            bail!("LlamaConfig: head_dim ({}) must be even and > 0", self.head_dim)
        }
        if self.vocab_size == 0 || self.hidden_size == 0 || self.intermediate_size == 0 {
            bail!("LlamaConfig: vocab_size, hidden_size, intermediate_size must be > 0")
        }
        if self.sliding_window == Some(0) {
            bail!("LlamaConfig: sliding_window must be >= 1 (or None), got 0")
        }
        if let Some(l) = &self.sliding_layers {
            let n = self.num_hidden_layers;
            if l.len() != n {
                bail!("LlamaConfig: sliding_layers has {} entries for {n} layers", l.len())
            }
            if self.sliding_window.is_none() {
                bail!("LlamaConfig: sliding_layers {l:?} without a sliding_window")
            }
            if !matches!(self.arch(), Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen2Moe | Arch::Gemma3 | Arch::Gemma2 | Arch::GptOss | Arch::SmolLM3 | Arch::Olmo3 | Arch::Exaone4) {
                bail!(
                    "LlamaConfig: a window on some layers only ({} of {n}) is a Qwen2 or Qwen3 model (q, k, v biases or q, k norms): \
                     a {:?} config.json has one window for every layer, so a saved checkpoint would load as a different model",
                    l.iter().filter(|&&s| s).count(),
                    self.arch()
                )
            }
        }
        if self.qkv_bias && self.qk_norm && self.arch() != Arch::Glm4Moe {
            bail!("LlamaConfig: q, k, v biases (Qwen2) and q, k norms (Qwen3) together are no architecture this model writes")
        }
        if let Some(g) = &self.gemma3 {
            if !self.qk_norm || self.qkv_bias {
                bail!("LlamaConfig: Gemma 3 has q, k head norms and no q, k, v biases (qk_norm {}, qkv_bias {})", self.qk_norm, self.qkv_bias)
            }
            for (k, v) in [("query_pre_attn_scalar", g.query_pre_attn_scalar), ("rope_local_base_freq", g.rope_local_base_freq)] {
                if !(v.is_finite() && v > 0.0) {
                    bail!("LlamaConfig: Gemma 3 {k} must be finite and > 0, got {v}")
                }
            }
        }
        if let Some(g) = &self.gemma2 {
            if self.gemma3.is_some() || self.qk_norm || self.qkv_bias {
                bail!(
                    "LlamaConfig: Gemma 2 has no q, k head norms, no q, k, v biases and is not Gemma 3 (qk_norm {}, qkv_bias {}, gemma3 {})",
                    self.qk_norm,
                    self.qkv_bias,
                    self.gemma3.is_some()
                )
            }
            gemma2::validate(g)?;
        }
        if self.gpt_oss || self.moe.as_ref().is_some_and(|m| m.style == MoeStyle::GptOss) {
            gpt_oss_validate(self)?;
        } else if let Some(m) = self.moe.as_ref().filter(|m| !matches!(m.style, MoeStyle::Glm4Moe | MoeStyle::DeepseekV2)) {
            let mixtral = m.style == MoeStyle::Mixtral;
            // (OLMoE: Qwen3-MoE's experts with OLMo's q, k norms instead of the head norms)
            let (norms, biases) = (m.style == MoeStyle::Qwen3Moe && self.olmo.is_none(), m.style == MoeStyle::Qwen2Moe);
            if self.qk_norm != norms || self.qkv_bias != biases || self.is_gemma() || (m.shared_expert_intermediate_size > 0) != biases {
                bail!(
                    "LlamaConfig: a mixture of experts is a Qwen3-MoE model (q, k head norms), a Qwen2-MoE (q, k, v biases, a shared expert) or a Mixtral (neither), no Gemma (qk_norm {}, qkv_bias {}, {:?})",
                    self.qk_norm,
                    self.qkv_bias,
                    m.style
                )
            }
            if mixtral && (m.moe_intermediate_size != self.intermediate_size || !m.mlp_only_layers.is_empty() || m.decoder_sparse_step != 1) {
                bail!(
                    "LlamaConfig: a Mixtral's experts are intermediate_size ({}) wide ({} given) on every layer (mlp_only_layers {:?}, decoder_sparse_step {})",
                    self.intermediate_size,
                    m.moe_intermediate_size,
                    m.mlp_only_layers,
                    m.decoder_sparse_step
                )
            }
            qwen3_moe::validate(m, self.num_hidden_layers)?;
        }
        // (a theta of 0 or below, or a negative epsilon, gives NaN angles or norms: NaN logits
        // from the first step, with no error)
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            bail!("LlamaConfig: rope_theta must be finite and > 0, got {}", self.rope_theta)
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            bail!("LlamaConfig: rms_norm_eps must be finite and >= 0, got {}", self.rms_norm_eps)
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        match &self.rope_scaling {
            RopeScaling::Default => {}
            RopeScaling::Linear { factor } if positive(*factor) => {}
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }
                if positive(*factor)
                    && positive(*low_freq_factor)
                    && positive(*high_freq_factor)
                    && high_freq_factor > low_freq_factor
                    && *original_max_position_embeddings > 0 => {}
            RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, .. }
                if positive(*factor)
                    && *original_max_position_embeddings > 0
                    && positive(*beta_fast)
                    && positive(*beta_slow)
                    && attention_factor.is_none_or(positive)
                    && [mscale, mscale_all_dim].iter().all(|m| m.is_none_or(|x| x.is_finite())) => {}
            RopeScaling::LongRope { .. } => phi3::validate_longrope(&self.rope_scaling, self.rope_dim())?,
            other => bail!(
                "LlamaConfig: rope scaling {other:?} needs finite factors > 0 (llama3: high_freq_factor > low_freq_factor, original_max_position_embeddings > 0; yarn: beta_fast, beta_slow and an attention_factor > 0)"
            ),
        }
        Ok(())
    }
}

/// A gpt-oss config's invariants: every layer a [`MoeStyle::GptOss`] mixture of experts
/// `intermediate_size` wide, q, k, v biases, no head norms, no other architecture's options.
fn gpt_oss_validate(c: &LlamaConfig) -> Result<()> {
    let Some(m) = c.moe.as_ref().filter(|m| m.style == MoeStyle::GptOss && c.gpt_oss) else {
        bail!("LlamaConfig: gpt-oss (gpt_oss {}) goes with its own mixture of experts on every layer (MoeStyle::GptOss, {:?})", c.gpt_oss, c.moe.as_ref().map(|m| m.style))
    };
    if !c.qkv_bias || c.qk_norm || c.is_gemma() || c.phi3 {
        bail!("LlamaConfig: gpt-oss has q, k, v (and o) biases, no head norms, no Gemma or Phi-3 options (qkv_bias {}, qk_norm {})", c.qkv_bias, c.qk_norm)
    }
    if m.moe_intermediate_size != c.intermediate_size || !m.mlp_only_layers.is_empty() || m.decoder_sparse_step != 1 || !m.norm_topk_prob || m.shared_expert_intermediate_size > 0 {
        bail!(
            "LlamaConfig: gpt-oss's experts are intermediate_size ({}) wide ({} given) on every layer (mlp_only_layers {:?}, decoder_sparse_step {}), top-K renormalised, no shared expert",
            c.intermediate_size,
            m.moe_intermediate_size,
            m.mlp_only_layers,
            m.decoder_sparse_step
        )
    }
    if m.output_router_logits {
        bail!("LlamaConfig: gpt-oss's load-balancing loss (output_router_logits) is not supported")
    }
    qwen3_moe::validate(m, c.num_hidden_layers)
}
