//! Parallel layout (TP, SP, CP kind, PP, DP, ZeRO), dtype, recompute policy; validation.

use crate::model::ModelConfig;
use crate::{plan_bail, Result};
use serde::Serialize;

/// Training dtype of weights and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// bfloat16 (2 bytes), with fp32 master weights in the optimizer.
    Bf16,
    /// float16 (2 bytes), with fp32 master weights in the optimizer.
    Fp16,
    /// float32 (4 bytes), no separate master copy.
    Fp32,
}

impl Dtype {
    /// Bytes per element `e`.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
        }
    }

    /// Parses `bf16`, `fp16` (`f16`) or `fp32` (`f32`).
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "bf16" => Dtype::Bf16,
            "fp16" | "f16" => Dtype::Fp16,
            "fp32" | "f32" => Dtype::Fp32,
            _ => plan_bail!("unknown dtype '{s}' (known: bf16, fp16, fp32)"),
        })
    }
}

/// How the sequence dimension is split across the CP group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CpKind {
    /// Ring attention (zigzag balanced): K/V chunks rotate, P-1 steps overlapped with compute.
    Ring,
    /// Llama 3 style: all-gather K/V of the whole sequence, reduce-scatter dK/dV.
    Allgather,
    /// DeepSpeed Ulysses: all-to-all sequence<->heads around attention.
    Ulysses,
    /// Ulysses over `ulysses` ranks inside a ring over `cp / ulysses` ranks.
    #[serde(rename = "2d")]
    TwoD,
}

impl CpKind {
    /// Parses `ring`, `allgather` (`all-gather`), `ulysses` or `2d` (`usp`).
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "ring" | "zigzag" => CpKind::Ring,
            "allgather" | "all-gather" | "ag" => CpKind::Allgather,
            "ulysses" | "a2a" => CpKind::Ulysses,
            "2d" | "usp" => CpKind::TwoD,
            _ => plan_bail!("unknown CP kind '{s}' (known: ring, allgather, ulysses, 2d)"),
        })
    }
}

/// Activation recomputation policy (Korthikanti et al. 2022).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Store everything the backward needs.
    None,
    /// Recompute the attention core (scores, softmax, dropout): drops the `5·a·s/h` term.
    Selective,
    /// Store only each layer's input; recompute the layer in backward.
    Full,
}

impl Recompute {
    /// Parses `none`, `selective` or `full`.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "none" => Recompute::None,
            "selective" => Recompute::Selective,
            "full" => Recompute::Full,
            _ => plan_bail!("unknown recompute policy '{s}' (known: none, selective, full)"),
        })
    }
}

/// Which per-layer activation count drives the per-GPU totals and the verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ActivationModel {
    /// Korthikanti et al. eq. 1 (GPT layer, 4h GeLU MLP, dropout): `sbh·(34 + 5as/h)`.
    Korthikanti,
    /// Exact count for Llama (RMSNorm, GQA, SwiGLU, no dropout).
    Llama,
    /// What candle-cp's own Llama keeps: the Llama count plus the terms of its
    /// implementation (`memory::candle_cp_extra_per_gpu`), measured by
    /// `tests/plan_activations.rs`.
    #[serde(rename = "candle-cp")]
    CandleCp,
}

impl ActivationModel {
    /// Parses `korthikanti`, `llama` or `candle-cp`.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "korthikanti" | "megatron" => ActivationModel::Korthikanti,
            "llama" | "exact" => ActivationModel::Llama,
            "candle-cp" | "candle_cp" | "candlecp" | "implemented" => ActivationModel::CandleCp,
            _ => plan_bail!("unknown activation model '{s}' (known: korthikanti, llama, candle-cp)"),
        })
    }
}

/// A parallel layout. World size = `tp·cp·pp·dp`; ranks are ordered TP fastest, then CP.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Layout {
    /// Tensor-parallel degree `t`.
    pub tp: usize,
    /// Megatron sequence parallelism on the TP group (norms/dropout sharded over `t`).
    pub sp: bool,
    /// Context-parallel degree (sequence split over this many ranks).
    pub cp: usize,
    /// How CP communicates.
    pub cp_kind: CpKind,
    /// Ulysses degree `U` for [`CpKind::TwoD`] (ring degree `cp / U`); ignored otherwise.
    pub ulysses: usize,
    /// Pipeline-parallel degree.
    pub pp: usize,
    /// Model chunks per pipeline rank, `v` (Megatron's interleaved 1F1B schedule; 1: the
    /// plain 1F1B schedule). Each GPU holds `v` chunks of `⌈L/(pp·v)⌉` layers; the bubble
    /// shrinks `v`-fold and the first stage stores `1 + (pp−1)/(pp·v)` times more
    /// activations (Korthikanti et al. 2022, §4.2).
    pub virtual_stages: usize,
    /// Data-parallel degree.
    pub dp: usize,
    /// Expert-parallel degree (a mixture of experts): each sparse layer's experts split over
    /// `ep` of the `dp·cp` ranks of one TP rank (consecutive: `tp` apart), the routed tokens
    /// exchanged by all-to-all ([`crate::comm::ep`]). Must divide `dp·cp` and the experts.
    pub ep: usize,
    /// ZeRO stage 0..=3, sharding over the `dp·cp` ranks that hold the same weights.
    pub zero: u8,
    /// Activation recomputation policy.
    pub recompute: Recompute,
    /// Flash attention (scores never stored): default true.
    pub flash: bool,
    /// Ulysses and 2-D CP: the backward all-to-alls q, k, v and the attention output to
    /// heads again instead of keeping their head layout (candle-cp's `HeadLayout::Regathered`):
    /// the head-layout copies leave [`crate::memory::candle_cp_extra_per_gpu`] and the
    /// Ulysses backward sends the forward's bytes once more ([`crate::comm::ulysses`]).
    /// Ignored by the other kinds.
    pub regather_heads: bool,
    /// Whether the attention backward's row sums come from the f32 output (candle-cp's
    /// `RowSums`, `finetune_llama --row-sums f32|output`): then the output's bf16 rounding
    /// residual is in [`crate::memory::candle_cp_extra_per_gpu`] for 16-bit activations.
    /// `None`: each kind's default ([`Layout::f32_row_sums_or_default`]: yes for the ring kinds
    /// and 2-D, no on one device and for Ulysses).
    pub f32_row_sums: Option<bool>,
    /// LoRA fine-tuning (candle-cp's `TrainConfig::lora`): adapters of this rank on q, k, v,
    /// o of every layer (and gate, up, down of the MLPs, experts included, with [`Layout::lora_mlp`]), the
    /// other weights frozen: gradients and Adam state for the adapters only
    /// ([`crate::memory::layer_lora_params_per_gpu`]). 0: every weight trained.
    pub lora_rank: usize,
    /// LoRA on the MLP projections too (PEFT's "all linear" targets; gpt-oss's experts as PEFT's
    /// `target_parameters` adapt them, one `A` for gate and up).
    pub lora_mlp: bool,
    /// DoRA (candle-cp's `LoraSpec::dora`): a magnitude per adapted weight's output row beside
    /// the factors, and each adapted weight's DoRA copy `m / ‖W + s·B·A‖ ⊙ (W + s·B·A)` built in
    /// the forward and kept for the backward ([`crate::memory::ModelStates::dora_weights`]).
    pub lora_dora: bool,
    /// LoRA with modules trained whole (candle-cp's `LoraSpec::modules_to_save`): the embedding
    /// and / or the head, their rows on this GPU counted with the adapters
    /// ([`crate::memory::lora_saved_params_per_gpu`]).
    pub lora_save_embed: bool,
    /// See [`Layout::lora_save_embed`]: the head (not of a model whose head is its embedding).
    pub lora_save_head: bool,
    /// A LoRA run's frozen base held quantized (candle-cp's `TrainConfig::quantize_base`): the
    /// decoder layers' dense projections as codes with per-group scales
    /// ([`crate::memory::layer_quantized_params_per_gpu`]). `None`: in the training dtype.
    pub base_quant: Option<BaseQuant>,
}

/// How a quantized frozen base stores its projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct BaseQuant {
    /// Bits per code: 8 (int8) or 4 (NF4).
    pub bits: u8,
    /// Inputs per scale.
    pub group: usize,
    /// Double-quantized scales (candle-cp's `QuantConfig::double`): u8 per scale plus two f32
    /// per block of this many rows of a scale column. `None`: f32 scales.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub double: Option<usize>,
}

impl BaseQuant {
    /// Bytes per quantized weight: `bits/8 + 4/group`, or with double-quantized scales
    /// `bits/8 + 1/group + 8/(group·rows)`.
    pub fn bytes_per_weight(&self) -> f64 {
        let g = self.group as f64;
        self.bits as f64 / 8.0
            + match self.double {
                None => 4.0 / g,
                Some(b) => 1.0 / g + 8.0 / (g * b as f64),
            }
    }

    /// `int8` or `nf4`, optionally `,GROUP` (default 64) and `,dq[ROWS]` (double-quantized
    /// scales, blocks of 16 rows by default), as finetune_llama's --quantize-base.
    pub fn parse(s: &str) -> Result<Self> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let bits = match parts[0] {
            "int8" => 8,
            "nf4" => 4,
            k => plan_bail!("quantized base '{k}': expected int8 or nf4"),
        };
        let group = match parts.get(1).map(|g| g.parse::<usize>()) {
            None => 64,
            Some(Ok(g)) if g > 0 && g.is_multiple_of(2) => g,
            _ => plan_bail!("quantized base '{s}': the group must be an even number > 0"),
        };
        let double = match parts.get(2..).unwrap_or(&[]) {
            [] => None,
            [dq] if dq.starts_with("dq") => match &dq[2..] {
                "" => Some(16),
                r => match r.parse::<usize>() {
                    Ok(b) if b > 0 => Some(b),
                    _ => plan_bail!("quantized base '{s}': 'dq{r}': expected dq or dqROWS (ROWS > 0)"),
                },
            },
            _ => plan_bail!("quantized base '{s}': expected KIND[,GROUP[,dq[ROWS]]], e.g. nf4,64,dq"),
        };
        Ok(Self { bits, group, double })
    }
}

impl std::fmt::Display for BaseQuant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{},{}", if self.bits == 8 { "int8" } else { "nf4" }, self.group)?;
        match self.double {
            Some(b) => write!(f, ",dq{b}"),
            None => Ok(()),
        }
    }
}

impl Default for Layout {
    fn default() -> Self {
        Self {
            tp: 1,
            sp: false,
            cp: 1,
            cp_kind: CpKind::Ring,
            ulysses: 1,
            pp: 1,
            virtual_stages: 1,
            dp: 1,
            ep: 1,
            zero: 1,
            recompute: Recompute::None,
            flash: true,
            regather_heads: false,
            f32_row_sums: None,
            lora_rank: 0,
            lora_mlp: false,
            lora_dora: false,
            lora_save_embed: false,
            lora_save_head: false,
            base_quant: None,
        }
    }
}

impl Layout {
    /// [`Layout::f32_row_sums`], else the kind's default: the ring kinds and 2-D take the
    /// backward's row sums from the f32 output, one device (`cp = 1`) and Ulysses from the
    /// returned one.
    pub fn f32_row_sums_or_default(&self) -> bool {
        self.f32_row_sums.unwrap_or(self.cp > 1 && self.cp_kind != CpKind::Ulysses)
    }

    /// World size `tp·cp·pp·dp`.
    pub fn world(&self) -> usize {
        self.tp * self.cp * self.pp * self.dp
    }

    /// KV heads (copies counted) each TP rank holds: `lcm(a_kv, t) / t` — `a_kv / t` when `t`
    /// divides them, 1 (each replicated `t / a_kv` times) when `a_kv` divides `t`, else the
    /// copies its query heads use (10 KV heads over `t = 4`: 5, each head copied twice;
    /// candle-cp's `Shard::RowBlocks`).
    pub fn kv_heads_per_tp_rank(&self, m: &ModelConfig) -> usize {
        let (k, t) = (m.kv_heads.max(1), self.tp.max(1));
        k / gcd(k, t)
    }

    /// Query heads per TP rank `a / t`.
    pub fn heads_per_tp_rank(&self, m: &ModelConfig) -> usize {
        m.heads / self.tp
    }

    /// Ulysses degree: `cp` for Ulysses, `ulysses` for 2-D, 1 otherwise.
    pub fn ulysses_degree(&self) -> usize {
        match self.cp_kind {
            CpKind::Ulysses => self.cp,
            CpKind::TwoD => self.ulysses,
            _ => 1,
        }
    }

    /// Ring degree: `cp` for ring, `cp / ulysses` for 2-D, 1 otherwise.
    pub fn ring_degree(&self) -> usize {
        match self.cp_kind {
            CpKind::Ring => self.cp,
            CpKind::TwoD => self.cp / self.ulysses.max(1),
            _ => 1,
        }
    }

    /// Checks the layout against the model and the global sequence length `seq`:
    /// degrees positive, `cp | seq`, `t | a`, `a_kv | a` (any `t` then fits the KV heads:
    /// [`Layout::kv_heads_per_tp_rank`]), `pp <= L`,
    /// Ulysses degree divides the per-TP-rank query heads (the KV heads are split or
    /// replicated to fit, [`kv_copies_per_ulysses_rank`]), 2-D: `ulysses | cp`.
    pub fn validate(&self, m: &ModelConfig, seq: usize) -> Result<()> {
        for (what, x) in [
            ("tp", self.tp),
            ("cp", self.cp),
            ("pp", self.pp),
            ("dp", self.dp),
        ] {
            if x == 0 {
                plan_bail!("--{what} must be at least 1")
            }
        }
        if seq == 0 {
            plan_bail!("--seq must be at least 1")
        }
        if self.ep == 0 {
            plan_bail!("--ep must be at least 1")
        }
        if self.ep > 1 {
            match &m.moe {
                None => plan_bail!("--ep {} needs a mixture of experts; {} is dense", self.ep, m.name),
                Some(x) if !x.experts.is_multiple_of(self.ep) => {
                    plan_bail!("EP degree {} does not divide the {} experts of {}", self.ep, x.experts, m.name)
                }
                _ => {}
            }
            if !(self.dp * self.cp).is_multiple_of(self.ep) {
                plan_bail!("EP degree {} does not divide dp·cp = {} (the experts split over DP × CP ranks)", self.ep, self.dp * self.cp)
            }
        }
        if self.zero > 3 {
            plan_bail!("--zero must be 0, 1, 2 or 3, got {}", self.zero)
        }
        if !seq.is_multiple_of(self.cp) {
            plan_bail!(
                "CP degree {} does not divide the sequence length {seq}",
                self.cp
            )
        }
        if !m.heads.is_multiple_of(self.tp) {
            plan_bail!(
                "TP degree {} does not divide the {} attention heads of {}",
                self.tp,
                m.heads,
                m.name
            )
        }
        if m.kv_heads == 0 || !m.heads.is_multiple_of(m.kv_heads) {
            plan_bail!("the {} KV heads of {} do not divide its {} attention heads", m.kv_heads, m.name, m.heads)
        }
        if self.pp > m.layers {
            plan_bail!(
                "PP degree {} exceeds the {} layers of {}",
                self.pp,
                m.layers,
                m.name
            )
        }
        if self.virtual_stages == 0 || (self.virtual_stages > 1 && self.pp == 1) {
            plan_bail!(
                "--virtual-stages {} needs to be at least 1, and 1 without pipeline parallelism (--pp {})",
                self.virtual_stages,
                self.pp
            )
        }
        if self.pp * self.virtual_stages > m.layers {
            plan_bail!(
                "PP {} x {} virtual stages exceeds the {} layers of {}",
                self.pp,
                self.virtual_stages,
                m.layers,
                m.name
            )
        }
        if self.cp_kind == CpKind::TwoD
            && (self.ulysses == 0 || !self.cp.is_multiple_of(self.ulysses))
        {
            plan_bail!(
                "2-D CP: Ulysses degree {} must divide the CP degree {}",
                self.ulysses,
                self.cp
            )
        }
        let u = self.ulysses_degree();
        if u > 1 {
            check_ulysses(m, self.tp, u)?;
        }
        Ok(())
    }
}

/// The Ulysses head constraint for degree `u` after TP `tp`: `u` divides the query heads
/// per TP rank `a/t`. The KV heads per TP rank are split when `u` divides them, else each is
/// replicated so that their `lcm(a_kv,t, u)` copies split evenly
/// ([`kv_copies_per_ulysses_rank`]; candle-cp's `ulysses::KvSpread`).
pub fn check_ulysses(m: &ModelConfig, tp: usize, u: usize) -> Result<()> {
    let hq = m.heads / tp;
    if u == 0 || !hq.is_multiple_of(u) {
        plan_bail!(
            "Ulysses degree {u} does not divide the {hq} query heads per TP rank ({} heads / TP {tp})",
            m.heads
        )
    }
    Ok(())
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// KV heads (copies included) each of `u` Ulysses ranks holds after the all-to-all, from
/// `kv_t` KV heads per TP rank: `lcm(kv_t, u) / u` (`kv_t/u` when `u` divides them, 1 when
/// they divide `u`).
pub fn kv_copies_per_ulysses_rank(kv_t: usize, u: usize) -> usize {
    let (k, u) = (kv_t.max(1), u.max(1));
    k / gcd(k, u)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m405() -> ModelConfig {
        ModelConfig::preset("llama3-405b").unwrap()
    }

    #[test]
    fn parse_errors_name_the_value() {
        assert!(Dtype::parse("int8").unwrap_err().0.contains("'int8'"));
        assert!(CpKind::parse("tree").unwrap_err().0.contains("'tree'"));
        assert!(Recompute::parse("some").unwrap_err().0.contains("'some'"));
        assert_eq!(CpKind::parse("all-gather").unwrap(), CpKind::Allgather);
        assert_eq!(Dtype::parse("fp32").unwrap().bytes(), 4);
    }

    /// `--quant-base KIND[,GROUP[,dq[ROWS]]]`: parsed, printed back as finetune_llama reads it,
    /// bytes per weight; bad values named.
    #[test]
    fn base_quant_strings() {
        let q = BaseQuant::parse("nf4,64,dq").unwrap();
        assert_eq!((q.bits, q.group, q.double, q.to_string()), (4, 64, Some(16), "nf4,64,dq16".to_string()));
        assert!((q.bytes_per_weight() - (0.5 + 1.0 / 64.0 + 8.0 / 1024.0)).abs() < 1e-12);
        let q = BaseQuant::parse("int8").unwrap();
        assert_eq!((q.bits, q.group, q.double, q.to_string()), (8, 64, None, "int8,64".to_string()));
        assert!((q.bytes_per_weight() - (1.0 + 4.0 / 64.0)).abs() < 1e-12);
        assert_eq!(BaseQuant::parse("nf4,32,dq8").unwrap().double, Some(8));
        for bad in ["nf4,64,dq0", "nf4,64,x", "nf4,3", "int4", "nf4,64,dq,2"] {
            assert!(BaseQuant::parse(bad).unwrap_err().0.contains(bad.split(',').next().unwrap()), "{bad}");
        }
    }

    #[test]
    fn virtual_stages_need_pipeline_and_layers() {
        let m = m405();
        let v = |pp, virtual_stages| Layout { pp, virtual_stages, ..Layout::default() }.validate(&m, 8192);
        assert!(v(16, 2).is_ok() && v(16, 1).is_ok() && v(1, 1).is_ok());
        assert!(v(1, 2).unwrap_err().0.contains("--virtual-stages 2"));
        assert!(v(16, 0).unwrap_err().0.contains("--virtual-stages 0"));
        assert!(v(16, 8).unwrap_err().0.contains("PP 16 x 8 virtual stages exceeds the 126 layers"));
    }

    #[test]
    fn cp_must_divide_seq_and_tp_must_divide_heads() {
        let l = Layout {
            cp: 3,
            ..Layout::default()
        };
        let e = l.validate(&m405(), 131072).unwrap_err();
        assert!(
            e.0.contains("CP degree 3 does not divide the sequence length 131072"),
            "{e}"
        );
        let l = Layout {
            tp: 3,
            ..Layout::default()
        };
        let e = l.validate(&m405(), 131072).unwrap_err();
        assert!(
            e.0.contains("TP degree 3 does not divide the 128 attention heads"),
            "{e}"
        );
        let l = Layout {
            tp: 16,
            ..Layout::default()
        };
        l.validate(&m405(), 131072).unwrap();
        assert_eq!(l.kv_heads_per_tp_rank(&m405()), 1);
    }

    #[test]
    fn ulysses_head_constraint() {
        let m = m405();
        // TP8 leaves 16 query heads, 1 KV head per rank: U=16 ok (KV replicated), U=32 not.
        let l = Layout {
            tp: 8,
            cp: 16,
            cp_kind: CpKind::Ulysses,
            ..Layout::default()
        };
        l.validate(&m, 131072).unwrap();
        let l = Layout {
            tp: 8,
            cp: 32,
            cp_kind: CpKind::Ulysses,
            ..Layout::default()
        };
        let e = l.validate(&m, 131072).unwrap_err();
        assert!(
            e.0.contains("Ulysses degree 32 does not divide the 16 query heads"),
            "{e}"
        );
        let l = Layout {
            cp: 16,
            cp_kind: CpKind::TwoD,
            ulysses: 3,
            ..Layout::default()
        };
        assert!(l
            .validate(&m, 131072)
            .unwrap_err()
            .0
            .contains("must divide the CP degree 16"));
        let l = Layout {
            cp: 16,
            cp_kind: CpKind::TwoD,
            ulysses: 4,
            ..Layout::default()
        };
        l.validate(&m, 131072).unwrap();
        assert_eq!((l.ulysses_degree(), l.ring_degree()), (4, 4));
    }
}
