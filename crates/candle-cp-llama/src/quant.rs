//! A quantized frozen base for LoRA fine-tuning (QLoRA-style): the decoder layers' projections
//! (`q_proj` … `down_proj`, and in a sparse layer the experts' stacked `[E, out, in]` weights and
//! the shared expert's — most of a mixture of experts' weights) held as int8 or NF4 codes with
//! per-group scales ([`candle_cp_nn::quant`]; a stacked weight as `[E·out, in]`), everything
//! else (embedding, norms, head, router, the adapters) as it was.
//!
//! A model over it ([`crate::Llama::new_quantized`]) builds each decoder layer anew in every
//! forward from weights dequantized on the fly, so between steps a rank holds the codes only
//! (int8 `1 + 4/g` bytes per weight, NF4 `0.5 + 4/g`, against 2 in bf16); with
//! [`crate::Llama::with_recompute`] the forward drops each layer's dequantized weights when the
//! layer is done and the backward dequantizes them again, so at most one layer's are alive at
//! a time. Without recompute the graph keeps every layer's until the backward.
//!
//! Each rank quantizes its own TP shards; the groups run along a row's inputs, so as long as
//! the group width divides every local input width the codes are those of the whole weight's
//! (`candle_cp_nn::quant`), and every layout computes with the same weights
//! (`tests/llama_qlora.rs`: a model over the quantized base equals the model over its
//! dequantized weights, logits and adapter gradients, on every layout).

use crate::LlamaConfig;
use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use candle_cp_nn::{QuantConfig, QuantWeight};
use candle_nn::{Init, VarMap};
use std::collections::HashMap;
use std::sync::Arc;

/// Whether parameter `name` is one the quantized base stores quantized: a decoder layer's
/// projection weight (`model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
/// `model.layers.{i}.mlp.{gate,up,down}_proj.weight`), a sparse layer's stacked experts
/// (`model.layers.{i}.{mlp,block_sparse_moe}.experts.{gate,up,down}_proj`) or its shared
/// expert's projections (`model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight`,
/// GLM-4.5's `shared_experts`); DeepSeek's latent projections
/// (`self_attn.{q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj}.weight`).
pub fn is_quantized_weight(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("model.layers.") else { return false };
    let Some((_, tail)) = rest.split_once('.') else { return false };
    const PROJ: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];
    ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"].iter().any(|m| tail == format!("{m}.weight"))
        || PROJ.iter().any(|p| {
            tail == format!("mlp.{p}.weight")
                || tail == format!("mlp.shared_expert.{p}.weight")
                || tail == format!("mlp.shared_experts.{p}.weight")
                || tail == format!("mlp.experts.{p}")
                || tail == format!("block_sparse_moe.experts.{p}")
        })
}

/// `t` quantized as a quantized base stores it: a stacked `[E, out, in]` as `[E·out, in]`
/// (groups along each row's inputs as ever).
fn quantize_rows(t: &Tensor, cfg: QuantConfig) -> Result<QuantWeight> {
    let dims = t.dims();
    let rows: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    QuantWeight::quantize(&t.reshape((rows, dims.last().copied().unwrap_or(1)))?, cfg)
}

/// The weight a quantized base's model computes with in place of `t` (its shape and dtype):
/// `t` quantized as [`QuantBase`] stores it, dequantized.
pub(crate) fn as_dequantized(t: &Tensor, cfg: QuantConfig) -> Result<Tensor> {
    quantize_rows(t, cfg)?.dequantize(t.dtype())?.reshape(t.shape())
}

/// One stored parameter of a quantized base.
#[derive(Clone)]
enum Stored {
    /// As it was (the adapters keep their variables' tensors, so gradients reach them).
    Plain(Tensor),
    /// Codes and scales, and the weight's dims (a stacked `[E, out, in]` is quantized as
    /// `[E·out, in]`).
    Quant(QuantWeight, Vec<usize>),
}

/// A rank's parameters with the frozen projections quantized: what
/// [`crate::Llama::new_quantized`] builds its layers from.
#[derive(Clone)]
pub struct QuantBase {
    tensors: Arc<HashMap<String, Stored>>,
    cfg: QuantConfig,
    /// The trained parameters (adapters, modules trained whole): not frozen bytes.
    trained: Arc<std::collections::HashSet<String>>,
}

impl QuantBase {
    /// Quantize this rank's shards in `varmap` (a LoRA model's: base weights and adapters,
    /// `model` naming them) and remove the quantized weights' full-precision shards from
    /// `varmap` (what is left: the adapters and the unquantized base weights). The adapters stay
    /// the variables' own tensors; the other plain weights are detached (frozen). Errors when
    /// `model` has no LoRA adapters (a quantized base is frozen: only adapters train), or when
    /// the group does not divide a local input width (named).
    pub fn from_varmap(varmap: &VarMap, model: &LlamaConfig, cfg: QuantConfig) -> Result<Self> {
        if model.lora.is_none() {
            bail!("quantized base: the model has no LoRA adapters (only a frozen base can be quantized; set LlamaConfig::lora)")
        }
        let mut vars = crate::params::lock_vars(varmap)?;
        let mut tensors = HashMap::with_capacity(vars.len());
        for (name, var) in vars.iter() {
            let t = var.as_tensor();
            let stored = if model.lora.as_ref().is_some_and(|l| l.trains(name)) {
                Stored::Plain(t.clone())
            } else if is_quantized_weight(name) {
                Stored::Quant(quantize_rows(t, cfg).map_err(|e| candle_core::Error::Msg(format!("quantized base: {name} {:?}: {e}", t.dims())))?, t.dims().to_vec())
            } else {
                Stored::Plain(t.detach())
            };
            tensors.insert(name.clone(), stored);
        }
        vars.retain(|n, _| !is_quantized_weight(n));
        let trained = tensors.keys().filter(|n| model.lora.as_ref().is_some_and(|l| l.trains(n))).cloned().collect();
        Ok(Self { tensors: Arc::new(tensors), cfg, trained: Arc::new(trained) })
    }

    /// The quantization.
    pub fn config(&self) -> QuantConfig {
        self.cfg
    }

    /// Bytes this rank holds for the frozen weights: (quantized ones' codes and scales, the
    /// plain frozen ones).
    pub fn frozen_bytes(&self) -> (usize, usize) {
        let (mut q, mut p) = (0, 0);
        for (n, s) in self.tensors.iter() {
            match s {
                Stored::Quant(w, _) => q += w.bytes(),
                Stored::Plain(t) if !self.trained.contains(n) => p += t.elem_count() * t.dtype().size_in_bytes(),
                Stored::Plain(_) => {}
            }
        }
        (q, p)
    }

    /// The `VarBuilder` backend over this base (weights dequantized when fetched).
    pub(crate) fn backend(&self) -> Box<dyn candle_nn::var_builder::SimpleBackend> {
        Box::new(self.clone())
    }
}

impl candle_nn::var_builder::SimpleBackend for QuantBase {
    fn get(&self, s: Shape, name: &str, _: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            bail!("quantized base: {name} is {:?}, the model asks for {:?}", t.dims(), s.dims())
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> Result<Tensor> {
        match self.tensors.get(name) {
            Some(Stored::Plain(t)) => t.to_dtype(dtype)?.to_device(dev),
            Some(Stored::Quant(w, dims)) => w.dequantize(dtype)?.reshape(dims.as_slice())?.to_device(dev),
            None => bail!("quantized base: no parameter {name}"),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}
