//! LoRA on experts held as parameters, as PEFT adapts them: gpt-oss's experts are parameters,
//! not linear modules (`mlp.experts.gate_up_proj` `[E, h, 2·I]`, gate and up columns
//! interleaved; `mlp.experts.down_proj` `[E, I, h]`), and so are transformers 5's Qwen3-MoE's,
//! Qwen2-MoE's and Mixtral's (`gate_up_proj` `[E, 2·I, h]`, gate's rows then up's; `down_proj`
//! `[E, h, I]`: [`crate::lora::GateUp`]; transformers 5 names a Mixtral's sparse layer `mlp`, the
//! model here `block_sparse_moe`: `peft_param` at the file's boundary and for the keys), so
//! PEFT targets them by parameter name
//! (`target_parameters`, e.g. `["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`, or
//! `"7.mlp.experts.down_proj"` for one layer) and wraps each in a `ParamWrapper` whose factors
//! hold every expert at once:
//!
//! ```text
//!   lora_A.weight [r·E, in]     row    e·r + j   = expert e's A row j
//!   lora_B.weight [out, r·E]    column j·E + e   = expert e's B column j
//!   ΔW[e] = s · (B_e · A_e)ᵀ  [in, out]  (gpt-oss: einsum("o r e, e r i -> e i o"))
//!   ΔW[e] = s ·  B_e · A_e    [out, in]  (transformers 5's others: "... -> e o i")
//! ```
//!
//! with `r` the per-expert rank (`s = alpha / r`), no dropout (PEFT refuses it there), no DoRA.
//! transformers 5's routers are parameters too (`mlp.gate.weight`, `router_param`): a key
//! naming it adapts the router with a plain `[r, h]` / `[E, r]` pair under `….mlp.gate`, as a
//! linear router's adapter. PEFT's conversion of a transformers 4 adapter (per-expert modules)
//! writes `target_parameters` `gate_up_proj`, `down_proj`, `gate.weight` with gate_up_proj's
//! rank `2r` (`rank_pattern`, `alpha_pattern` `.*\.gate_up_proj`), its `A` gate's rows then up's
//! and its `B` block-diagonal: one shared `A` here, read as it is.
//! The model holds the same adapters as its other experts' (`moe_lora.rs`): `A` `[E, r, in]`,
//! `B` `[E, out, r]`; gate and up are the two parts of `gate_up_proj`, so they share one `A`
//! (`….experts.gate_up_proj.lora_A.weight`, its gradient the sum of both uses) and each holds
//! its rows of `B` (`….experts.{gate,up}_proj.lora_B.weight`: the even and odd rows of the
//! fused one, or its halves). `to_peft` and `from_peft` convert at the file's boundary
//! ([`crate::lora::save_peft_adapter`], [`crate::lora::model_adapters`]).
//!
//! PEFT before 0.19.1 (and 0.19.0 on gpt-oss) read a parameter `[E, d1, d2]` as `[E, in, out]`
//! whichever way the model holds it, so a transformers 5 adapter written by PEFT 0.18 has its
//! factors the other way round: `lora_A` `[r·E, out]`, `lora_B` `[in, r·E]`, `ΔW_e = s·(B_e·A_e)ᵀ`
//! (transformers' own patch of PEFT wrote the current layout with those versions too). Reading,
//! the shapes tell the two apart and a swapped file becomes the model's factors (`B_e = A_eᵀ`,
//! `A_e = B_eᵀ`: the same update); where a parameter's input and output widths are equal
//! (`h = 2·I` for gate_up_proj, `h = I` for down_proj) they cannot, and the file is read as PEFT
//! ≥ 0.19.1 writes it. Writing, the layout is PEFT ≥ 0.19.1's.
//!
//! In the file, the two wrappers on one `experts` module nest: PEFT wraps the parameters in
//! the order the module registers them (`gate_up_proj` before `down_proj`, in both models), so `down_proj`'s
//! factors are `….mlp.experts.lora_{A,B}.weight` and `gate_up_proj`'s
//! `….mlp.experts.base_layer.lora_{A,B}.weight` (one targeted alone: `….mlp.experts.lora_*`).
//! Reading, the shapes decide which is which (`B` has `2·I` rows for `gate_up_proj`, `h` for
//! `down_proj`), so another nesting reads too.

use crate::lora::GateUp;
use candle_core::{bail, Result, Tensor};
use std::collections::HashMap;

/// The fused parameter of an expert projection stem and its part: `….mlp.experts.gate_proj`
/// → (`….mlp.experts.gate_up_proj`, 0), `up_proj` → 1, `….mlp.experts.down_proj` → itself, 0;
/// a Mixtral's `….block_sparse_moe.experts.*` alike, under its own module (the model's name:
/// `peft_param` gives transformers 5's); `None` for another stem.
pub(crate) fn param_of(stem: &str) -> Option<(String, usize)> {
    for module in ["mlp", "block_sparse_moe"] {
        for (proj, part) in [("gate_proj", 0), ("up_proj", 1)] {
            if let Some(prefix) = stem.strip_suffix(&format!("{module}.experts.{proj}")) {
                return Some((format!("{prefix}{module}.experts.gate_up_proj"), part));
            }
        }
        if stem.ends_with(&format!("{module}.experts.down_proj")) {
            return Some((stem.to_string(), 0));
        }
    }
    None
}

/// An expert parameter's name as transformers 5 and PEFT name it: a Mixtral's sparse layer is
/// `mlp` there (`….block_sparse_moe.experts.gate_up_proj` → `….mlp.experts.gate_up_proj`);
/// other names as they are.
pub(crate) fn peft_param(name: &str) -> String {
    match name.split_once(".block_sparse_moe.experts.") {
        Some((layer, rest)) => format!("{layer}.mlp.experts.{rest}"),
        None => name.to_string(),
    }
}

/// Whether PEFT's `target_parameters` key `key` names parameter `name` (its whole name, or its
/// tail after a dot: PEFT's `key == name or name.endswith("." + key)`).
pub(crate) fn key_matches(key: &str, name: &str) -> bool {
    name == key || name.ends_with(&format!(".{key}"))
}

/// The router's weight of a sparse layer whose router stem is `stem` (`….mlp.gate`, a Mixtral's
/// `….block_sparse_moe.gate`) as a `target_parameters` key names it: transformers 5's
/// `….mlp.gate.weight` (its routers, `Qwen3MoeTopKRouter` and the like, hold a parameter, not a
/// linear module; PEFT's conversion of a transformers 4 adapter maps target module `gate` to
/// `gate.weight`); `None` for another stem.
pub(crate) fn router_param(stem: &str) -> Option<String> {
    ["mlp.gate", "block_sparse_moe.gate"].iter().find_map(|m| stem.strip_suffix(m)).filter(|p| p.is_empty() || p.ends_with('.')).map(|p| format!("{p}mlp.gate.weight"))
}

/// Refuse a `target_parameters` key that cannot name an expert parameter or a router's weight:
/// it ends in `gate_up_proj` or `down_proj` (bare, as PEFT's conversion of transformers 4
/// adapters writes them, or after a module path: `mlp.experts.down_proj`, `7.mlp.experts.down_proj`)
/// or in `gate.weight`.
pub(crate) fn check_key(key: &str) -> Result<()> {
    if !["gate_up_proj", "down_proj", "gate.weight"].iter().any(|p| key == *p || key.ends_with(&format!(".{p}"))) {
        bail!("LoRA target_parameters: '{key}' names no expert parameter or router weight (they are `mlp.experts.gate_up_proj`, `mlp.experts.down_proj` and `mlp.gate.weight`, or their last parts, optionally after a layer: `7.mlp.experts.down_proj`)")
    }
    Ok(())
}

/// Errors for LoRA on expert parameters (PEFT's `target_parameters`,
/// [`crate::expert_params`]) where PEFT refuses them or this model does not hold them: with
/// dropout or DoRA (PEFT's parameter wrappers take neither), on a dense model, or keys that
/// name no parameter of this model's sparse layers (PEFT: "no parameter was matched"; a
/// Mixtral's under transformers 5's names, `mlp.experts.*`).
///
/// On gpt-oss, target modules `gate_proj`, `up_proj`, `down_proj` adapt nothing (PEFT's
/// `all-linear` names every projection, and gpt-oss's experts are not linear modules): a list
/// naming some of them but not every projection is refused as a likely mistake; so is the
/// router (`gate`) named on a model whose experts are parameters (transformers 5's routers are
/// parameters too).
pub(crate) fn check(cfg: &crate::LlamaConfig) -> Result<()> {
    if let Some(l) = cfg.lora.as_ref().filter(|l| cfg.gpt_oss && l.target_regex.is_none()) {
        let all = crate::lora::TARGETS.iter().all(|t| l.adapts(t));
        if let Some(t) = ["gate_proj", "up_proj", "down_proj"].iter().find(|t| l.adapts(t) && !all) {
            bail!("LlamaConfig: LoRA target module {t} on gpt-oss, whose experts are parameters (PEFT's target_parameters: mlp.experts.gate_up_proj, mlp.experts.down_proj), not modules")
        }
    }
    // (the same for a router named on a model whose experts are parameters: transformers 5's
    // routers are parameters too, which PEFT refuses to adapt; all-linear leaves them out)
    if let Some(l) = cfg.lora.as_ref().filter(|l| l.expert_params.is_some() && l.target_regex.is_none() && l.adapts("gate")) {
        if !crate::lora::ALL_LINEAR.iter().all(|t| l.adapts(t)) {
            bail!("LlamaConfig: LoRA target module gate (the router) on a model whose experts are parameters (target_parameters): its router is a parameter too, not a linear module (target_parameters gate.weight adapts it)")
        }
    }
    let Some(l) = cfg.lora.as_ref().filter(|l| !l.target_parameters.is_empty()) else { return Ok(()) };
    let keys = l.target_parameters.join(", ");
    if cfg.moe.is_none() {
        bail!("LlamaConfig: LoRA target_parameters [{keys}] on a dense model (they name a mixture's experts, mlp.experts.gate_up_proj / down_proj)")
    }
    if l.dropout > 0.0 {
        bail!("LlamaConfig: LoRA target_parameters [{keys}] with lora_dropout {}: PEFT takes no dropout on parameters (it cannot be factored out of the weight)", l.dropout)
    }
    if l.dora {
        bail!("LlamaConfig: LoRA target_parameters [{keys}] with DoRA: PEFT adapts parameters with plain LoRA only")
    }
    // (the routers: transformers 5's `mlp.gate.weight`; gpt-oss's is `mlp.router`, not one)
    let params: &[&str] = if cfg.gpt_oss { &["experts.gate_up_proj", "experts.down_proj"] } else { &["experts.gate_up_proj", "experts.down_proj", "gate.weight"] };
    let sparse: Vec<usize> = (0..cfg.num_hidden_layers).filter(|&i| cfg.is_moe_layer(i)).collect();
    let names: Vec<String> = sparse.iter().flat_map(|i| params.iter().map(move |p| format!("model.layers.{i}.mlp.{p}"))).collect();
    if let Some(k) = l.target_parameters.iter().find(|k| !names.iter().any(|n| key_matches(k, n))) {
        bail!("LlamaConfig: LoRA target_parameters key '{k}' matches no expert parameter or router weight of the {} sparse layers", sparse.len())
    }
    Ok(())
}

/// The model's adapter tensors of experts held as parameters (full, by parameter name: the
/// shared `….experts.gate_up_proj.lora_A.weight` `[E, r, h]`,
/// `….experts.{gate,up}_proj.lora_B.weight` `[E, I, r]`, `….experts.down_proj.lora_{A,B}.weight`
/// `[E, r, I]` / `[E, h, r]`) as PEFT's wrappers hold them (see the module doc), gate's and up's
/// `B` joined as `layout` joins their outputs; other tensors pass as they are. Errors name parts
/// that do not fit together.
pub(crate) fn to_peft(tensors: HashMap<String, Tensor>, layout: GateUp) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    // the experts modules' prefixes (`….mlp.`) whose parameters are adapted
    let (mut gate_up, mut down) = (HashMap::new(), HashMap::new());
    for (name, t) in tensors {
        // (a Mixtral's under transformers 5's names, its sparse layer `mlp`: with the experts as
        // parameters its only adapters there are the experts' and the router's)
        let name = name.replace(".block_sparse_moe.", ".mlp.");
        if let Some(p) = name.strip_suffix("mlp.experts.gate_up_proj.lora_A.weight") {
            gate_up.entry(p.to_string()).or_insert([None, None, None])[0] = Some(t);
        } else if let Some(p) = name.strip_suffix("mlp.experts.gate_proj.lora_B.weight") {
            gate_up.entry(p.to_string()).or_insert([None, None, None])[1] = Some(t);
        } else if let Some(p) = name.strip_suffix("mlp.experts.up_proj.lora_B.weight") {
            gate_up.entry(p.to_string()).or_insert([None, None, None])[2] = Some(t);
        } else if let Some(p) = name.strip_suffix("mlp.experts.down_proj.lora_A.weight") {
            down.entry(p.to_string()).or_insert([None, None])[0] = Some(t);
        } else if let Some(p) = name.strip_suffix("mlp.experts.down_proj.lora_B.weight") {
            down.entry(p.to_string()).or_insert([None, None])[1] = Some(t);
        } else {
            out.insert(name, t);
        }
    }
    let missing = |p: &str, what: &str| candle_core::Error::Msg(format!("LoRA adapter: {p}mlp.experts.gate_up_proj has no {what}"));
    let mut wrappers: Vec<(String, &str, Tensor, Tensor)> = Vec::new();
    for (p, [a, bg, bu]) in gate_up {
        let (a, bg, bu) = (a.ok_or_else(|| missing(&p, "A"))?, bg.ok_or_else(|| missing(&p, "gate B"))?, bu.ok_or_else(|| missing(&p, "up B"))?);
        if bg.dims() != bu.dims() || bg.rank() != 3 || a.rank() != 3 || bg.dim(0)? != a.dim(0)? || bg.dim(2)? != a.dim(1)? {
            bail!("LoRA adapter: {p}mlp.experts gate_up_proj: A {:?}, gate B {:?}, up B {:?} do not fit ([E, r, h], [E, I, r] twice)", a.dims(), bg.dims(), bu.dims())
        }
        // gate's and up's rows joined as the fused parameter joins them: [E, 2I, r]
        let (e, i, r) = bg.dims3()?;
        let b = match layout {
            GateUp::Interleaved => Tensor::stack(&[&bg, &bu], 2)?.reshape((e, 2 * i, r))?,
            GateUp::Concatenated => Tensor::cat(&[&bg, &bu], 1)?,
        };
        wrappers.push((p, "gate_up_proj", a, b));
    }
    for (p, [a, b]) in down {
        let missing = |w: &str| candle_core::Error::Msg(format!("LoRA adapter: {p}mlp.experts.down_proj has no {w}"));
        wrappers.push((p.clone(), "down_proj", a.ok_or_else(|| missing("A"))?, b.ok_or_else(|| missing("B"))?));
    }
    let both: std::collections::HashSet<String> = wrappers.iter().filter(|w| w.1 == "down_proj").map(|w| w.0.clone()).collect();
    for (p, param, a, b) in wrappers {
        let (e, r, i) = a.dims3()?;
        let (eb, o, rb) = b.dims3()?;
        if (eb, rb) != (e, r) {
            bail!("LoRA adapter: {p}mlp.experts.{param}: A {:?} and B {:?} do not fit ([E, r, in], [E, out, r])", a.dims(), b.dims())
        }
        // gate_up_proj is the inner wrapper when down_proj is adapted too (see the module doc)
        let at = if param == "gate_up_proj" && both.contains(&p) { "mlp.experts.base_layer" } else { "mlp.experts" };
        out.insert(format!("{p}{at}.lora_A.weight"), a.reshape((e * r, i))?);
        // [E, out, r] → [out, r, E] → [out, r·E]: column j·E + e
        out.insert(format!("{p}{at}.lora_B.weight"), b.permute((1, 2, 0))?.contiguous()?.reshape((o, r * e))?);
    }
    Ok(out)
}

/// PEFT's wrapper factors of experts held as parameters in `tensors` (names without the
/// `base_model.model.` prefix: `….mlp.experts[.base_layer]*.lora_{A,B}.weight`) as the model's
/// (the reverse of [`to_peft`]); other tensors pass as they are. `experts`, `hidden`, `inter`:
/// the model's `E`, `h`, `I`; `E` splits `r·E`, and the shapes say which wrapper is which
/// (`gate_up_proj`: in `h`, out `2·I`; `down_proj`: in `I`, out `h`; never both). Errors name a
/// wrapper whose factors are neither. `layout`: how gate_up_proj's `B` joins gate's and up's;
/// `module`: the model's name of the sparse layer (`mlp`, a Mixtral's `block_sparse_moe`).
pub(crate) fn from_peft(tensors: HashMap<String, Tensor>, experts: usize, hidden: usize, inter: usize, layout: GateUp, module: &str) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    // experts module prefix (`….mlp.`) → (nesting depth → (A, B))
    let mut mods: HashMap<String, HashMap<usize, [Option<Tensor>; 2]>> = HashMap::new();
    for (name, t) in tensors {
        let split = ["lora_A.weight", "lora_B.weight"].iter().enumerate().find_map(|(k, f)| Some((k, name.strip_suffix(&format!(".{f}"))?)));
        let Some((k, stem)) = split else {
            out.insert(name, t);
            continue;
        };
        // (a router's adapter, transformers 5's `….mlp.gate`, under the model's module)
        if let Some(layer) = stem.strip_suffix(".mlp.gate").filter(|_| module != "mlp") {
            out.insert(format!("{layer}.{module}.gate.{}", if k == 0 { "lora_A.weight" } else { "lora_B.weight" }), t);
            continue;
        }
        let (mut head, mut depth) = (stem, 0);
        while let Some(h) = head.strip_suffix(".base_layer") {
            head = h;
            depth += 1;
        }
        match head.strip_suffix("mlp.experts") {
            Some(p) => mods.entry(p.to_string()).or_default().entry(depth).or_insert([None, None])[k] = Some(t),
            None => {
                out.insert(name, t);
            }
        }
    }
    for (p, wrappers) in mods {
        let mut fs = Vec::new();
        for (depth, [a, b]) in wrappers {
            let (Some(a), Some(b)) = (a, b) else { bail!("LoRA adapter: {p}mlp.experts (wrapper {depth}) has lora_A without lora_B or the reverse") };
            let ((ra, i), (o, rb)) = (a.dims2()?, b.dims2()?);
            if ra != rb || experts == 0 || !ra.is_multiple_of(experts) {
                bail!("LoRA adapter: {p}mlp.experts: lora_A {:?} and lora_B {:?} are not [r·E, in] and [out, r·E] with E = {experts}", a.dims(), b.dims())
            }
            fs.push((a, b, ra / experts, i, o));
        }
        for (a, b, r, i, o) in fs {
            let a = a.reshape((experts, r, i))?;
            // [out, r·E] → [out, r, E] → [E, out, r]
            let b = b.reshape((o, r, experts))?.permute((2, 0, 1))?.contiguous()?;
            // (in, out) as PEFT ≥ 0.19.1 writes them, or swapped (see the module doc)
            let (gate_up, down) = ((hidden, 2 * inter), (inter, hidden));
            let swapped = |(x, y): (usize, usize)| (y, x);
            let (a, b, gate_up) = if (i, o) == gate_up || (i, o) == down {
                (a, b, (i, o) == gate_up)
            } else if (i, o) == swapped(gate_up) || (i, o) == swapped(down) {
                // ΔW_e = (B_e·A_e)ᵀ = A_eᵀ·B_eᵀ: A_eᵀ is the model's B_e, B_eᵀ its A_e
                (b.transpose(1, 2)?.contiguous()?, a.transpose(1, 2)?.contiguous()?, (i, o) == swapped(gate_up))
            } else {
                bail!("LoRA adapter: {p}mlp.experts: lora_A {:?} / lora_B {:?} are neither gate_up_proj's ([r·E, {hidden}] / [{}, r·E], or PEFT 0.18's [r·E, {}] / [{hidden}, r·E]) nor down_proj's ([r·E, {inter}] / [{hidden}, r·E], or [r·E, {hidden}] / [{inter}, r·E])", [r * experts, i], [o, r * experts], 2 * inter, 2 * inter)
            };
            let a_name = format!("{p}{module}.experts.{}.lora_A.weight", if gate_up { "gate_up_proj" } else { "down_proj" });
            if out.contains_key(&a_name) {
                bail!("LoRA adapter: {p}mlp.experts wraps {a_name} twice")
            }
            if gate_up {
                out.insert(a_name, a);
                let (gate, up) = match layout {
                    GateUp::Interleaved => {
                        let b = b.reshape((experts, inter, 2, r))?;
                        (b.narrow(2, 0, 1)?.squeeze(2)?, b.narrow(2, 1, 1)?.squeeze(2)?)
                    }
                    GateUp::Concatenated => (b.narrow(1, 0, inter)?, b.narrow(1, inter, inter)?),
                };
                out.insert(format!("{p}{module}.experts.gate_proj.lora_B.weight"), gate.contiguous()?);
                out.insert(format!("{p}{module}.experts.up_proj.lora_B.weight"), up.contiguous()?);
            } else {
                out.insert(a_name, a);
                out.insert(format!("{p}{module}.experts.down_proj.lora_B.weight"), b);
            }
        }
    }
    Ok(out)
}

/// `spec`, read from a PEFT file holding the tensors `names`, for model `cfg`: with
/// its experts as parameters (transformers 5's layout, [`GateUp::Concatenated`]) when `cfg` is
/// a mixture (not gpt-oss, whose experts always are), the spec names no `target_parameters`,
/// read as a transformers 4 adapter it adapts experts (its `target_modules` name MLP
/// projections on a sparse layer), and the file holds no expert's adapter — a transformers 5
/// adapter, whose routed experts are parameters no target module reaches (its `gate_proj` /
/// `up_proj` / `down_proj` adapt the dense layers and a shared expert, its routers, parameters
/// too, nothing). Read as a transformers 4 adapter it would be refused for the experts' missing
/// tensors. Otherwise `spec` as it is (a transformers 4 adapter whose layers hold no expert it
/// adapts stays one).
pub fn transformers_5_spec(cfg: &crate::LlamaConfig, spec: crate::LoraSpec, names: impl IntoIterator<Item = impl AsRef<str>>) -> crate::LoraSpec {
    let fused = cfg.moe.is_some() && !cfg.gpt_oss && spec.target_parameters.is_empty() && spec.expert_params.is_none();
    if !fused {
        return spec;
    }
    let v4 = cfg.clone().with_lora(Some(spec.clone()));
    let adapts_experts = crate::param_specs(&v4).iter().any(|s| s.is_lora() && s.name.contains(".experts."));
    let experts = names.into_iter().any(|n| n.as_ref().contains(".experts."));
    match adapts_experts && !experts {
        true => spec.with_expert_params(Some(GateUp::Concatenated)),
        false => spec,
    }
}

/// The shared `A` of gate_up_proj's parts given to each part
/// (`….experts.{gate,up}_proj.lora_A.weight`), for merging the parts one at a time; other
/// tensors pass as they are.
pub(crate) fn untie(adapters: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    for (n, t) in adapters {
        match n.strip_suffix("experts.gate_up_proj.lora_A.weight") {
            Some(p) => {
                for part in ["gate_proj", "up_proj"] {
                    out.insert(format!("{p}experts.{part}.lora_A.weight"), t.clone());
                }
            }
            None => {
                out.insert(n.clone(), t.clone());
            }
        }
    }
    out
}

#[cfg(test)]
#[path = "expert_params_tests.rs"]
mod tests;
