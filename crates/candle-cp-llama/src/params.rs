//! Parameter table of the model: HF names, full shapes, how each is split over TP ranks,
//! seeded initialisation, sharding a full `VarMap` for one rank, and gathering shards back.
//!
//! | parameter                                   | full shape       | TP shard        |
//! |---------------------------------------------|------------------|-----------------|
//! | `model.embed_tokens.weight`                 | `[V, h]`         | rows (vocabulary), `⌈V/tp⌉` per rank, zero padding past `V` ([`Shard::RowsPadded`]) |
//! | `model.layers.{i}.{input,post_attention}_layernorm.weight`, `model.norm.weight` | `[h]` | replicated |
//! | `self_attn.q_proj.weight`                   | `[H·D, h]`       | rows (heads)    |
//! | `self_attn.{k,v}_proj.weight`               | `[Hkv·D, h]`     | rows (KV heads); with `Hkv < tp` one KV head per rank, each on `tp/Hkv` ranks; when neither divides the other `lcm(Hkv, tp)/tp` KV-head copies per rank ([`Shard::RowBlocks`]) |
//! | `self_attn.{q,k,v}_proj.bias` (Qwen2, [`LlamaConfig::qkv_bias`]) | `[H·D]`, `[Hkv·D]` | as the weight's rows |
//! | `self_attn.{q,k}_norm.weight` (Qwen3, Gemma 3, [`LlamaConfig::qk_norm`]) | `[D]` | replicated (each TP rank's heads give part of the gradient: summed over TP) |
//! | `{pre,post}_feedforward_layernorm.weight` (Gemma 3, [`LlamaConfig::gemma3`]; its `post_attention_layernorm` follows the attention) | `[h]` | replicated |
//! | OLMo ([`LlamaConfig::olmo`]): `self_attn.q_norm.weight`, `self_attn.k_norm.weight`; `post_feedforward_layernorm.weight` (its `post_attention_layernorm` follows the attention; no `input_layernorm`) | `[H·D]`, `[Hkv·D]`; `[h]` | as q_proj's, k_proj's rows; replicated |
//! | `self_attn.o_proj.weight`                   | `[h, H·D]`       | columns (heads) |
//! | DeepSeek-V3 instead of q, k, v, o ([`crate::config::deepseek`]): `self_attn.{q_a_proj,q_a_layernorm,kv_a_proj_with_mqa,kv_a_layernorm}.weight` | `[rq, h]`, `[rq]`, `[rkv + rope, h]`, `[rkv]` | replicated (its TP ranks' gradients summed under SP) |
//! | `self_attn.{q_b_proj,q_proj,kv_b_proj}.weight`, `self_attn.o_proj.weight` (DeepSeek-V3) | `[H·(nope + rope), rq \| h]`, `[H·(nope + v), rkv]`, `[h, H·v]` | rows (heads); columns (heads) |
//! | `self_attn.o_proj.bias` (gpt-oss)           | `[h]`            | replicated (added after the sum) |
//! | `self_attn.sinks` (gpt-oss)                 | `[H]`            | rows (heads)    |
//! | `mlp.{gate,up}_proj.weight`                 | `[I, h]`         | rows            |
//! | `mlp.down_proj.weight`                      | `[h, I]`         | columns         |
//!
//! A sparse layer (Qwen3-MoE, Mixtral: [`LlamaConfig::is_moe_layer`]) has instead, under its
//! module `m` (`mlp`, Mixtral's `block_sparse_moe`: [`crate::MoeConfig::module`]):
//!
//! | parameter                                   | full shape       | TP shard        |
//! |---------------------------------------------|------------------|-----------------|
//! | `m.gate.weight`                             | `[E, h]`         | replicated (the router) |
//! | `m.experts.{gate,up}_proj`                  | `[E, Ie, h]`     | dim 1 (each expert's rows, [`Shard::Dim`]) |
//! | `m.experts.down_proj`                       | `[E, h, Ie]`     | dim 2 (each expert's columns) |
//! | `mlp.router.bias` (gpt-oss, whose router is `mlp.router`) | `[E]`  | replicated      |
//! | `mlp.experts.{gate,up}_proj.bias` (gpt-oss) | `[E, Ie]`        | dim 1           |
//! | `mlp.experts.down_proj.bias` (gpt-oss)      | `[E, h]`         | dim 1 (each TP rank adds its columns to its partial sums) |
//! | `mlp.shared_expert.{gate,up}_proj.weight` (Qwen2-MoE) | `[Is, h]` | rows            |
//! | `mlp.shared_expert.down_proj.weight` (Qwen2-MoE) | `[h, Is]`   | columns         |
//! | `mlp.shared_expert_gate.weight` (Qwen2-MoE) | `[1, h]`         | replicated      |
//! | `mlp.gate.e_score_correction_bias` (GLM-4.5, f32, [`ParamSpec::keeps_f32`]) | `[E]` | replicated |
//! | `mlp.shared_experts.{gate,up,down}_proj.weight` (GLM-4.5) | as Qwen2-MoE's shared expert | as it |
//!
//! and the model ends with `lm_head.weight` `[V, h]` (absent when tied), rows (vocabulary) as
//! the embedding; a reward model ([`LlamaConfig::num_labels`]) with `score.weight` `[n, h]`,
//! replicated, instead.
//!
//! A sparse layer's experts are stacked: one `[E, ·, ·]` tensor per projection (the layout of
//! transformers 5's fused experts), which the experts' grouped matmul reads without a copy.
//! Checkpoints hold them per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`; Mixtral's
//! `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`):
//! [`crate::hf`] splits and stacks them at the boundary ([`checkpoint_tensors`]).

use crate::config::LlamaConfig;
use crate::layout::ParallelCtx;
use candle_core::{bail, DType, Device, Result, Shape, Tensor, Var};
use candle_cp_nn::{ColumnParallelLinear, RmsNorm, RowParallelLinear};
use candle_nn::VarMap;

/// How a parameter is split over the TP group: the split the candle-cp-nn layer that uses
/// it applies ([`ColumnParallelLinear::WEIGHT_SHARD`], [`RowParallelLinear::WEIGHT_SHARD`],
/// [`RmsNorm::WEIGHT_SHARD`]).
pub use candle_cp_nn::Shard;

/// One parameter of the model.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// HF name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    /// Full (unsharded) shape.
    pub shape: Vec<usize>,
    /// TP split.
    pub shard: Shard,
}

/// GLM-4.5's router bias that chooses the experts (`….gate.e_score_correction_bias`).
pub const CORRECTION_BIAS: &str = "e_score_correction_bias";

impl ParamSpec {
    /// Whether the parameter is held in f32 whatever the model's dtype: GLM-4.5's correction
    /// bias ([`crate::config::glm4_moe`]), which transformers keeps in f32 too.
    pub fn keeps_f32(&self) -> bool {
        self.name.ends_with(CORRECTION_BIAS)
    }

    /// The dtype the parameter is held in within a model of `dtype`.
    pub fn dtype_in(&self, dtype: DType) -> DType {
        if self.keeps_f32() { DType::F32 } else { dtype }
    }

    /// Whether this is a LoRA adapter factor ([`crate::lora`]).
    pub fn is_lora(&self) -> bool {
        crate::lora::is_lora_name(&self.name)
    }

    /// The shape one of `tp` ranks holds. Errors if `tp` does not divide the split dim.
    pub fn local_shape(&self, tp: usize) -> Result<Shape> {
        self.shard
            .local_shape(&self.shape, tp)
            .map_err(|e| candle_core::Error::Msg(format!("parameter {}: {e}", self.name)))
    }

    /// This TP rank's slice of the full tensor ([`Shard::slice`], the split of the layer that
    /// uses the parameter).
    pub fn slice(&self, full: &Tensor, tp: usize, tp_rank: usize) -> Result<Tensor> {
        self.check_full(full)?;
        self.shard
            .slice(full, tp, tp_rank)
            .map_err(|e| candle_core::Error::Msg(format!("parameter {}: {e}", self.name)))
    }

    /// Rebuild the full tensor from the local shard (collective over `ctx.tp` for split
    /// parameters, keeping one copy of replicated KV heads, then over `ctx.ep` for the
    /// stacked experts under expert parallelism; replicated parameters are returned as is).
    pub fn gather(&self, local: &Tensor, ctx: &ParallelCtx) -> Result<Tensor> {
        let t = self.shard.gather(local, &ctx.tp)?;
        match &ctx.ep {
            Some(ep) if self.is_expert() => ep.all_gather(&t, 0),
            _ => Ok(t),
        }
    }

    fn check_full(&self, full: &Tensor) -> Result<()> {
        if full.dims() != self.shape.as_slice() {
            bail!(
                "parameter {}: checkpoint tensor {:?}, expected {:?}",
                self.name,
                full.dims(),
                self.shape
            )
        }
        Ok(())
    }

    /// Whether this is a sparse layer's stacked expert weight (`[E, ·, ·]`,
    /// `*.experts.{gate,up,down}_proj`) or one of its stacked LoRA factors
    /// (`….lora_{A,B}.weight`, see [`crate::lora`]), split over the EP group along dim 0 under
    /// expert parallelism ([`crate::Layout::ep`]).
    pub fn is_expert(&self) -> bool {
        // gpt-oss's expert biases `….experts.{gate,up,down}_proj.bias` [E, ·]
        if let Some(stem) = self.name.strip_suffix(".bias").filter(|_| self.shape.len() == 2) {
            return ["experts.gate_proj", "experts.up_proj", "experts.down_proj"].iter().any(|s| stem.ends_with(s));
        }
        let magnitude = self.name.strip_suffix(crate::lora::MAGNITUDE);
        let stem = magnitude.or_else(|| self.name.strip_suffix(".lora_A.weight")).or_else(|| self.name.strip_suffix(".lora_B.weight")).unwrap_or(&self.name);
        // (a stacked DoRA magnitude is [E, out])
        let rank = if magnitude.is_some() { 2 } else { 3 };
        // (gpt-oss's gate and up share `….experts.gate_up_proj.lora_A.weight`: crate::expert_params)
        self.shape.len() == rank && ["experts.gate_proj", "experts.up_proj", "experts.down_proj", "experts.gate_up_proj"].iter().any(|s| stem.ends_with(s))
    }

    /// The shape this rank of `ctx` holds: [`ParamSpec::local_shape`] of its TP degree, and
    /// the experts `E/ep` under expert parallelism. Errors if a degree does not divide.
    pub fn local_shape_in(&self, ctx: &ParallelCtx) -> Result<Shape> {
        let s = self.local_shape(ctx.layout.tp)?;
        let (_, ep) = ctx.ep_coords();
        if !self.is_expert() || ep == 1 {
            return Ok(s);
        }
        let mut d = s.dims().to_vec();
        if !d[0].is_multiple_of(ep) {
            bail!("parameter {}: {} experts ({:?}) do not split over ep = {ep} ranks", self.name, d[0], self.shape)
        }
        d[0] /= ep;
        Ok(Shape::from(d))
    }

    /// This rank's slice of the full tensor: its EP rank's experts under expert parallelism
    /// ([`candle_cp_ops::moe_ep::local_experts`]), then its TP slice ([`ParamSpec::slice`]).
    pub fn slice_for(&self, full: &Tensor, ctx: &ParallelCtx) -> Result<Tensor> {
        let (tp, tp_rank) = (ctx.layout.tp, ctx.coords.2);
        let (ep_rank, ep) = ctx.ep_coords();
        if !self.is_expert() || ep == 1 {
            return self.slice(full, tp, tp_rank);
        }
        self.check_full(full)?;
        if !self.shape[0].is_multiple_of(ep) {
            bail!("parameter {}: {} experts ({:?}) do not split over ep = {ep} ranks", self.name, self.shape[0], self.shape)
        }
        let mine = candle_cp_ops::moe_ep::local_experts(full, ep_rank, ep)
            .map_err(|e| candle_core::Error::Msg(format!("parameter {}: {e}", self.name)))?;
        self.shard
            .slice(&mine, tp, tp_rank)
            .map_err(|e| candle_core::Error::Msg(format!("parameter {}: {e}", self.name)))
    }
}

/// Every parameter of `cfg`, in HF order (embedding, layers, final norm, head).
pub fn param_specs(cfg: &LlamaConfig) -> Vec<ParamSpec> {
    let (v, h, i) = (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size);
    let (qd, kd) = (
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
    );
    let (col, row, norm) = (
        ColumnParallelLinear::WEIGHT_SHARD,
        RowParallelLinear::WEIGHT_SHARD,
        RmsNorm::WEIGHT_SHARD,
    );
    // K/V rows split by KV head: like `col` when tp divides Hkv, else one head per rank (Hkv
    // dividing tp) or lcm(Hkv, tp)/tp copies (neither dividing the other)
    let kv = Shard::RowBlocks(cfg.num_key_value_heads);
    let mut out = Vec::new();
    let lora = cfg.lora.clone();
    let mut add = |name: String, shape: Vec<usize>, shard: Shard| {
        // a LoRA target's adapters follow its weight: A [r, in], B [out, r], split as
        // candle_cp_nn::lora says (column: A replicated, B as the weight's rows; row: A as
        // its columns, B replicated)
        // a sparse layer's stacked experts `[E, out, in]` (names without `.weight`) get stacked
        // factors `[E, r, in]`, `[E, out, r]` split as theirs (crate::moe_lora)
        let target = lora.as_ref().and_then(|l| {
            let stem = name.strip_suffix(".weight").unwrap_or(&name);
            let stacked = shape.len() == 3 && stem.contains(".experts.");
            // (its layer among the adapted ones, its rank the pattern's: crate::lora_select)
            (l.adapts_weight(stem) && (stacked || (shape.len() == 2 && name.ends_with(".weight")))).then(|| (l.config_for(stem).rank, l.dora))
        });
        out.push(ParamSpec { name: name.clone(), shape: shape.clone(), shard });
        if let Some((r, dora)) = target {
            let base = name.strip_suffix(".weight").unwrap_or(&name).to_string();
            let (a, b) = match shard {
                RowParallelLinear::WEIGHT_SHARD | Shard::Dim(2) => (shard, Shard::Replicated),
                _ => (Shard::Replicated, shard),
            };
            let (outer, (o, i)) = (&shape[..shape.len() - 2], (shape[shape.len() - 2], shape[shape.len() - 1]));
            // a Phi-3's fused module, gpt-oss's experts' gate_up_proj: one A (listed after its
            // first part), each part's B rows
            let a_name = match lora.as_ref().and_then(|l| l.shared_a(&base)) {
                Some((_, part)) if part > 0 => None,
                Some((fused, _)) => Some(format!("{fused}.lora_A.weight")),
                None => Some(format!("{base}.lora_A.weight")),
            };
            if let Some(a_name) = a_name {
                out.push(ParamSpec { name: a_name, shape: [outer, &[r, i]].concat(), shard: a });
            }
            out.push(ParamSpec { name: format!("{base}.lora_B.weight"), shape: [outer, &[o, r]].concat(), shard: b });
            if dora {
                // DoRA's magnitude [.., out]: split as the weight's rows, replicated with its columns
                out.push(ParamSpec { name: format!("{base}{}", crate::lora::MAGNITUDE), shape: [outer, &[o]].concat(), shard: b });
            }
        }
    };
    // vocabulary-parallel embedding and head (padded to tp·⌈V/tp⌉ rows when tp does not
    // divide V; replicated when V < tp)
    let vocab = Shard::RowsPadded(v);
    add("model.embed_tokens.weight".into(), vec![v, h], vocab);
    for l in 0..cfg.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        // (OLMo 2 and 3: no norm before the attention)
        if !cfg.post_norms_only() {
            add(p("input_layernorm.weight"), vec![h], norm);
        }
        // DeepSeek-V3: the latent attention's projections and norms instead of q, k, v, o
        if let Some(a) = &cfg.mla {
            for (name, shape, shard) in crate::config::deepseek::attention_specs(cfg, a, l) {
                add(name, shape, shard);
            }
        }
        for (proj, rows, shard) in [("q_proj", qd, col), ("k_proj", kd, kv), ("v_proj", kd, kv)].into_iter().filter(|_| cfg.mla.is_none()) {
            add(p(&format!("self_attn.{proj}.weight")), vec![rows, h], shard);
            if cfg.qkv_bias {
                add(p(&format!("self_attn.{proj}.bias")), vec![rows], shard);
            }
        }
        if cfg.qk_norm {
            add(p("self_attn.q_norm.weight"), vec![cfg.head_dim], norm);
            add(p("self_attn.k_norm.weight"), vec![cfg.head_dim], norm);
        }
        if cfg.olmo.is_some() {
            // OLMo: norms over the whole q and k projections, split as their rows
            add(p("self_attn.q_norm.weight"), vec![qd], col);
            add(p("self_attn.k_norm.weight"), vec![kd], kv);
        }
        if cfg.mla.is_none() {
            add(p("self_attn.o_proj.weight"), vec![h, qd], row);
        }
        if cfg.gpt_oss {
            // gpt-oss: the o_proj bias (added after the row-parallel sum) and a sink per head
            add(p("self_attn.o_proj.bias"), vec![h], norm);
            add(p("self_attn.sinks"), vec![cfg.num_attention_heads], col);
        }
        add(p("post_attention_layernorm.weight"), vec![h], norm);
        if cfg.pre_and_post_norms() {
            add(p("pre_feedforward_layernorm.weight"), vec![h], norm);
        }
        if cfg.pre_and_post_norms() || cfg.post_norms_only() {
            add(p("post_feedforward_layernorm.weight"), vec![h], norm);
        }
        match &cfg.moe {
            Some(m) if cfg.is_moe_layer(l) => {
                let (e, ie) = (m.num_experts, m.moe_intermediate_size);
                let q = |s: &str| p(&format!("{}.{s}", m.module()));
                add(q(&format!("{}.weight", m.router())), vec![e, h], norm);
                if m.biases() {
                    add(q(&format!("{}.bias", m.router())), vec![e], norm);
                }
                if m.sigmoid_scores() {
                    // GLM-4.5: the bias that chooses the experts (a zero gradient; f32)
                    add(q(&format!("{}.{CORRECTION_BIAS}", m.router())), vec![e], norm);
                }
                add(q("experts.gate_proj"), vec![e, ie, h], Shard::Dim(1));
                add(q("experts.up_proj"), vec![e, ie, h], Shard::Dim(1));
                add(q("experts.down_proj"), vec![e, h, ie], Shard::Dim(2));
                if m.biases() {
                    // gpt-oss: each expert's biases, split as its weights' output rows (the
                    // down bias by columns of h: each TP rank adds its slice to its partial sums)
                    add(q("experts.gate_proj.bias"), vec![e, ie], Shard::Dim(1));
                    add(q("experts.up_proj.bias"), vec![e, ie], Shard::Dim(1));
                    add(q("experts.down_proj.bias"), vec![e, h], Shard::Dim(1));
                }
                let is = m.shared_expert_intermediate_size;
                if is > 0 {
                    let s = m.shared_module();
                    add(q(&format!("{s}.gate_proj.weight")), vec![is, h], col);
                    add(q(&format!("{s}.up_proj.weight")), vec![is, h], col);
                    add(q(&format!("{s}.down_proj.weight")), vec![h, is], row);
                    if m.shared_gate() {
                        add(q("shared_expert_gate.weight"), vec![1, h], norm);
                    }
                }
            }
            _ => {
                add(p("mlp.gate_proj.weight"), vec![i, h], col);
                add(p("mlp.up_proj.weight"), vec![i, h], col);
                add(p("mlp.down_proj.weight"), vec![h, i], row);
            }
        }
    }
    add("model.norm.weight".into(), vec![h], norm);
    match cfg.num_labels {
        // a reward model: transformers' score head, no LM head (replicated: it is tiny)
        Some(n) => {
            add(crate::reward::SCORE.into(), vec![n, h], norm);
            // (a token classifier's head has a bias: crate::prm)
            if cfg.token_classifier.is_some_and(|t| t.bias) {
                add(crate::prm::SCORE_BIAS.into(), vec![n], norm);
            }
        }
        None if !cfg.tie_word_embeddings => add("lm_head.weight".into(), vec![v, h], vocab),
        None => {}
    }
    out
}

/// The stacked expert projections and their checkpoints' per-expert modules: (MLP module,
/// stacked name, the checkpoint's per-expert name).
pub(crate) const EXPERT_NAMES: [(&str, &str, &str); 6] = [
    ("mlp", "gate_proj", "gate_proj"),
    ("mlp", "up_proj", "up_proj"),
    ("mlp", "down_proj", "down_proj"),
    ("block_sparse_moe", "gate_proj", "w1"),
    ("block_sparse_moe", "up_proj", "w3"),
    ("block_sparse_moe", "down_proj", "w2"),
];

/// The checkpoint tensors of parameter `spec`: `(name, index)` pairs, `index` the expert of a
/// stacked expert tensor (`mlp.experts.{gate,up,down}_proj` `[E, ·, ·]` is held in a checkpoint
/// as `mlp.experts.{e}.{gate,up,down}_proj.weight`, `e` in `0..E`), `None` for a parameter
/// held whole under its own name.
pub fn checkpoint_tensors(spec: &ParamSpec) -> Vec<(String, Option<usize>)> {
    // a stacked LoRA factor: `….experts.{proj}.lora_A.weight` ↔ `….experts.{e}.{proj}.lora_A.weight`
    // (and a stacked DoRA magnitude [E, out] ↔ `….experts.{e}.{proj}.lora_magnitude_vector`)
    let (stem, tail, rank) = match ["lora_A.weight", "lora_B.weight", "lora_magnitude_vector"].iter().find_map(|f| Some((spec.name.strip_suffix(&format!(".{f}"))?, f))) {
        Some((stem, f)) => (stem, f.to_string(), if f.starts_with("lora_magnitude") { 2 } else { 3 }),
        None => (spec.name.as_str(), "weight".to_string(), 3),
    };
    for (module, proj, per_expert) in EXPERT_NAMES {
        let suffix = format!("{module}.experts.{proj}");
        if let Some(prefix) = stem.strip_suffix(&suffix).filter(|_| spec.shape.len() == rank) {
            let e = spec.shape.first().copied().unwrap_or(0);
            return (0..e).map(|i| (format!("{prefix}{module}.experts.{i}.{per_expert}.{tail}"), Some(i))).collect();
        }
    }
    vec![(spec.name.clone(), None)]
}

/// The name and the rows `(start, len)` along dim 1 of a stacked expert parameter in
/// transformers 5's fused layout (`mlp.experts.gate_up_proj` `[E, 2·Ie, h]`, gate then up;
/// `mlp.experts.down_proj` `[E, h, Ie]` whole: `None`), or `None` for another parameter.
/// transformers 5 names a Mixtral's sparse layer `mlp` too: its `block_sparse_moe.experts.*`
/// are read from `mlp.experts.*` and its router `block_sparse_moe.gate.weight` from
/// `mlp.gate.weight` (whole), where a checkpoint holds those names (`save_pretrained` with
/// `save_original_format=False`, and models released in that layout).
pub fn fused_checkpoint_tensor(spec: &ParamSpec) -> Option<(String, Option<(usize, usize)>)> {
    let ie = spec.shape.get(1).copied().unwrap_or(0);
    for module in ["mlp", "block_sparse_moe"] {
        if let Some(prefix) = spec.name.strip_suffix(&format!("{module}.experts.gate_proj")) {
            return Some((format!("{prefix}mlp.experts.gate_up_proj"), Some((0, ie))));
        }
        if let Some(prefix) = spec.name.strip_suffix(&format!("{module}.experts.up_proj")) {
            return Some((format!("{prefix}mlp.experts.gate_up_proj"), Some((ie, ie))));
        }
        if let Some(prefix) = spec.name.strip_suffix(&format!("{module}.experts.down_proj")) {
            return Some((format!("{prefix}mlp.experts.down_proj"), None));
        }
    }
    spec.name.strip_suffix("block_sparse_moe.gate.weight").map(|prefix| (format!("{prefix}mlp.gate.weight"), None))
}

/// The forward-order group of parameter `name` of a model with `layers` decoder layers, for
/// [`crate::Llama::set_param_hook`]: 0 the embedding (and a tied head), `1 + i` the
/// parameters of layer `i` (`model.layers.{i}.*`), `layers + 1` the final norm and the head.
/// `None` for a name that is none of these.
pub fn param_group(name: &str, layers: usize) -> Option<usize> {
    match name {
        "model.embed_tokens.weight" => Some(0),
        "model.norm.weight" | "lm_head.weight" | crate::reward::SCORE => Some(layers + 1),
        _ => {
            let i: usize = name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()?;
            (i < layers).then_some(1 + i)
        }
    }
}

/// SplitMix64 → standard normals (Box–Muller), for seeded, rank-independent init.
struct Normal(u64);

impl Normal {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn sample(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// Lock the `VarMap`'s name → `Var` table (an error, not a panic, if the lock is poisoned).
pub(crate) fn lock_vars(
    vm: &VarMap,
) -> Result<std::sync::MutexGuard<'_, std::collections::HashMap<String, Var>>> {
    vm.data()
        .lock()
        .map_err(|_| candle_core::Error::Msg("varmap lock poisoned".into()))
}

/// A full (unsharded) model with HF's default init — N(0, 0.02²) matrices, norms 1 (Gemma
/// 3's, whose weights enter as `1 + w`, 0) —
/// drawn from `seed` (each tensor from its own stream keyed by its name), so every rank
/// that calls it gets the same weights. Vars in `dtype` on `device`. Qwen2's q, k, v biases
/// are drawn like the matrices (HF starts them at 0), so that a seeded model exercises them.
pub fn init_params(cfg: &LlamaConfig, seed: u64, dtype: DType, device: &Device) -> Result<VarMap> {
    cfg.validate()?;
    let vm = VarMap::new();
    {
        let mut data = lock_vars(&vm)?;
        for s in param_specs(cfg) {
            let t = init_tensor(&s, seed, cfg)?;
            data.insert(
                s.name.clone(),
                Var::from_tensor(&t.to_dtype(s.dtype_in(dtype))?.to_device(device)?)?,
            );
        }
    }
    Ok(vm)
}

/// The parameters a run trains: the LoRA adapters alone when `cfg.lora` is set
/// ([`crate::lora`]), else every parameter ([`param_specs`]).
pub fn trainable_specs(cfg: &LlamaConfig) -> Vec<ParamSpec> {
    let all = param_specs(cfg);
    match &cfg.lora {
        Some(l) => all.into_iter().filter(|s| l.trains(&s.name)).collect(),
        None => all,
    }
}

/// The full f32 host tensor [`init_params`] draws for `spec`.
pub(crate) fn init_tensor(spec: &ParamSpec, seed: u64, cfg: &LlamaConfig) -> Result<Tensor> {
    let n: usize = spec.shape.iter().product();
    if spec.name.ends_with(".lora_B.weight") || spec.keeps_f32() || spec.name == crate::prm::SCORE_BIAS {
        // B starts at zero: the adapted model starts as the base model (GLM-4.5's correction
        // bias and a token classifier's score bias at zero too, as transformers starts them)
        return Tensor::zeros(spec.shape.as_slice(), DType::F32, &Device::Cpu);
    }
    if spec.shape.len() == 1 && !spec.name.ends_with(".bias") {
        let one = if cfg.is_gemma() { 0.0 } else { 1.0 };
        return Tensor::full(one as f32, spec.shape.as_slice(), &Device::Cpu);
    }
    let mut key = seed ^ 0xD1B5_4A32_D192_ED03;
    for b in spec.name.bytes() {
        key = (key ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    if let Some(stem) = spec.name.strip_suffix(crate::lora::MAGNITUDE) {
        // DoRA's magnitude starts at the rows' norms of the weight it adapts (as drawn here)
        let Some(w) = param_specs(cfg).into_iter().find(|s| s.name == format!("{stem}.weight") || s.name == stem) else {
            bail!("init: no weight for the DoRA magnitude {}", spec.name)
        };
        return init_tensor(&w, seed, cfg)?.sqr()?.sum(candle_core::D::Minus1)?.sqrt();
    }
    let mut rng = Normal(key);
    if spec.name.ends_with(".lora_A.weight") {
        // uniform in ±1/√in, PEFT's Kaiming init of A
        // (the input features: the last dim, of `[r, in]` or a stacked `[E, r, in]`)
        let bound = 1.0 / (spec.shape.last().copied().unwrap_or(1).max(1) as f64).sqrt();
        let v: Vec<f32> = (0..n).map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32).collect();
        return Tensor::from_vec(v, spec.shape.as_slice(), &Device::Cpu);
    }
    let v: Vec<f32> = (0..n).map(|_| (0.02 * rng.sample()) as f32).collect();
    Tensor::from_vec(v, spec.shape.as_slice(), &Device::Cpu)
}

/// This rank's shards of [`init_params`]' model (bit for bit what [`shard_params`] of it
/// gives), drawn one full tensor at a time on the host, sliced, then moved to `device`: the
/// whole model never exists in memory.
pub fn init_params_sharded(cfg: &LlamaConfig, seed: u64, dtype: DType, ctx: &ParallelCtx, device: &Device) -> Result<VarMap> {
    cfg.validate()?;
    sharded_params(cfg, ctx, dtype, device, |spec| init_tensor(spec, seed, cfg))
}

/// This rank's `VarMap`: for each parameter, `full_of` gives the full tensor (on the host,
/// any float dtype), which is checked, sliced for this TP rank, cast to `dtype` and moved to
/// `device`; one full tensor is alive at a time.
pub(crate) fn sharded_params(
    cfg: &LlamaConfig,
    ctx: &ParallelCtx,
    dtype: DType,
    device: &Device,
    mut full_of: impl FnMut(&ParamSpec) -> Result<Tensor>,
) -> Result<VarMap> {
    let vm = VarMap::new();
    {
        let mut data = lock_vars(&vm)?;
        for s in param_specs(cfg) {
            let local = s.slice_for(&full_of(&s)?, ctx)?;
            data.insert(s.name.clone(), Var::from_tensor(&local.to_dtype(s.dtype_in(dtype))?.to_device(device)?)?);
        }
    }
    Ok(vm)
}

/// Full tensor of every parameter in `full` by name (cheap clones of the Vars' tensors).
pub fn varmap_tensors(vm: &VarMap) -> Result<std::collections::HashMap<String, Tensor>> {
    let data = lock_vars(vm)?;
    Ok(data
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect())
}

/// This rank's `VarMap`: fresh Vars (own storage, safe to update in place on each rank)
/// holding its TP slice of every parameter of the full model `full` (e.g. from
/// [`crate::load_hf`] or [`init_params`]). Errors name a missing or mis-shaped tensor.
pub fn shard_params(full: &VarMap, cfg: &LlamaConfig, ctx: &ParallelCtx) -> Result<VarMap> {
    let tensors = varmap_tensors(full)?;
    shard_tensors(&tensors, cfg, ctx)
}

/// [`shard_params`] from a name → full tensor map.
pub fn shard_tensors(
    full: &std::collections::HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    ctx: &ParallelCtx,
) -> Result<VarMap> {
    let vm = VarMap::new();
    {
        let mut data = lock_vars(&vm)?;
        for s in param_specs(cfg) {
            let Some(t) = full.get(&s.name) else {
                bail!("shard_params: missing parameter {} {:?}", s.name, s.shape)
            };
            let local = s.slice_for(t, ctx)?;
            data.insert(s.name.clone(), Var::from_tensor(&local.detach())?);
        }
    }
    Ok(vm)
}

/// Full tensors of every parameter (collective over the TP group: all ranks call it),
/// in [`param_specs`] order. `local` maps names to this rank's shards (Vars or gradients).
pub fn gather_full(
    local: &std::collections::HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    ctx: &ParallelCtx,
) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for s in param_specs(cfg) {
        let Some(t) = local.get(&s.name) else {
            bail!("gather_full: missing parameter {}", s.name)
        };
        out.push((s.name.clone(), s.gather(t, ctx)?));
    }
    Ok(out)
}

/// [`gather_full`] for writing a checkpoint: one parameter at a time is gathered (collective
/// over the TP group: all ranks call it), and moved to the host when `keep` (the writing
/// rank), dropped otherwise. A device never holds more than one full tensor; [`gather_full`]
/// holds the whole model on every rank's device.
pub fn gather_full_to_host(
    local: &std::collections::HashMap<String, Tensor>,
    cfg: &LlamaConfig,
    ctx: &ParallelCtx,
    keep: bool,
) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for s in param_specs(cfg) {
        let Some(t) = local.get(&s.name) else {
            bail!("gather_full_to_host: missing parameter {}", s.name)
        };
        let full = s.gather(t, ctx)?;
        if keep {
            out.push((s.name.clone(), full.to_device(&Device::Cpu)?));
        }
    }
    Ok(out)
}

#[cfg(test)]
#[path = "params_tests.rs"]
mod tests;
