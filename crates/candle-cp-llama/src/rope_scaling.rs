//! [`RopeScaling`]: how a config scales RoPE's frequencies, and its parsing from a scaling
//! object of `config.json` (its writing: [`crate::LlamaConfig::to_hf_json`]).

use super::{get_f64, get_usize, phi3};
use candle_core::{bail, Result};
use serde_json::{Map, Value};

/// How RoPE frequencies are scaled (`rope_type` / `rope_scaling.type`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq[i] = theta^(-2i/d)`.
    Default,
    /// Positions divided by `factor` (equivalently every frequency divided by `factor`).
    Linear {
        /// Divisor of every frequency.
        factor: f64,
    },
    /// Llama 3.1 frequency-dependent scaling (HF `_compute_llama3_parameters`): wavelengths
    /// longer than `original_max_position_embeddings / low_freq_factor` are divided by
    /// `factor`, shorter than `original / high_freq_factor` kept, in between interpolated.
    Llama3 {
        /// Scale of the low frequencies.
        factor: f64,
        /// Long-wavelength threshold divisor (HF default 1).
        low_freq_factor: f64,
        /// Short-wavelength threshold divisor (HF default 4).
        high_freq_factor: f64,
        /// Context length the frequencies were trained for (HF default 8192).
        original_max_position_embeddings: usize,
    },
    /// YaRN (HF `_compute_yarn_parameters`; Qwen2.5's long-context setting): the frequencies
    /// that turn fewer than `beta_slow` times over `original_max_position_embeddings` are
    /// divided by `factor`, those that turn more than `beta_fast` times kept, a linear ramp
    /// over the dimensions in between; cos and sin are multiplied by
    /// [`RopeScaling::attention_factor`].
    Yarn {
        /// Divisor of the low frequencies.
        factor: f64,
        /// Context length the frequencies were trained for (config.json's
        /// `max_position_embeddings` when the scaling object has none).
        original_max_position_embeddings: usize,
        /// Rotations above which a frequency is kept (HF default 32).
        beta_fast: f64,
        /// Rotations below which a frequency is divided by `factor` (HF default 1).
        beta_slow: f64,
        /// `attention_factor` as configured (`None`: from `factor` and the mscales).
        attention_factor: Option<f64>,
        /// DeepSeek-style `mscale` / `mscale_all_dim` (the attention factor is the ratio of
        /// their `0.1·m·ln(factor) + 1` when both are set and non-zero).
        mscale: Option<f64>,
        /// See `mscale`.
        mscale_all_dim: Option<f64>,
        /// Round the ramp's ends to whole dimensions (HF `truncate`, default true).
        truncate: bool,
    },
    /// LongRoPE (HF `_compute_longrope_parameters`; Phi-3's long-context models, `type`
    /// `longrope`, formerly `su`): frequency `i` divided by `short_factor[i]` while the
    /// sequence fits in `original_max_position_embeddings`, by `long_factor[i]` beyond it;
    /// cos and sin multiplied by [`RopeScaling::attention_factor`]. The sequence's length is
    /// its largest position + 1 over the WHOLE sequence, however it is sharded
    /// ([`crate::rope::inv_freq_at`]; [`crate::config::phi3`]).
    LongRope {
        /// Divisors of the `D/2` frequencies for sequences up to the original length.
        short_factor: Vec<f64>,
        /// Divisors of the `D/2` frequencies for longer sequences.
        long_factor: Vec<f64>,
        /// Context length the model was pretrained for (the scaling object's, else the
        /// top-level key of Phi-3 configs, else `max_position_embeddings`).
        original_max_position_embeddings: usize,
        /// The context extension: `factor` as configured, else `max_position_embeddings /
        /// original_max_position_embeddings` (Phi-3 configs name none).
        factor: f64,
        /// `attention_factor` as configured (`None`: `sqrt(1 + ln(factor) / ln(original))`, 1
        /// for a factor <= 1).
        attention_factor: Option<f64>,
    },
}

impl RopeScaling {
    /// The factor cos and sin are multiplied by: 1, or YaRN's `attention_factor` (given, or
    /// `0.1·ln(factor) + 1`; with both mscales the ratio of those with `mscale` and with
    /// `mscale_all_dim`; 1 for a factor <= 1).
    pub fn attention_factor(&self) -> f64 {
        let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
        match self {
            RopeScaling::Yarn { attention_factor: Some(a), .. } => *a,
            RopeScaling::Yarn { factor, mscale: Some(m), mscale_all_dim: Some(md), .. } if *m != 0.0 && *md != 0.0 => {
                get_mscale(*factor, *m) / get_mscale(*factor, *md)
            }
            RopeScaling::Yarn { factor, .. } => get_mscale(*factor, 1.0),
            RopeScaling::LongRope { attention_factor: Some(a), .. } => *a,
            RopeScaling::LongRope { factor, original_max_position_embeddings, .. } => phi3::longrope_attention_factor(*factor, *original_max_position_embeddings),
            _ => 1.0,
        }
    }
}

/// transformers 5's `rope_parameters` keyed by layer type (Gemma 3, OLMo 3): the
/// `full_attention` and `sliding_attention` objects (an absent one empty), or `None` when `p`
/// is not keyed so. Errors name an entry that is not an object.
#[allow(clippy::type_complexity)]
pub(super) fn rope_by_layer_type(p: &Map<String, Value>) -> Result<Option<(Map<String, Value>, Map<String, Value>)>> {
    if !(p.contains_key("full_attention") || p.contains_key("sliding_attention")) {
        return Ok(None);
    }
    let of = |k: &str| -> Result<Map<String, Value>> {
        match p.get(k) {
            Some(Value::Object(o)) => Ok(o.clone()),
            None | Some(Value::Null) => Ok(Map::new()),
            Some(v) => bail!("config.json: `rope_parameters.{k}` must be an object, got {v}"),
        }
    };
    Ok(Some((of("full_attention")?, of("sliding_attention")?)))
}

/// Parse a RoPE scaling object (legacy `rope_scaling` or `rope_parameters`); `max_pos` is
/// config.json's `max_position_embeddings` (YaRN's default original length), `orig` its
/// top-level `original_max_position_embeddings` (Phi-3's, LongRoPE's default).
pub(super) fn parse_scaling(obj: &Map<String, Value>, max_pos: usize, orig: Option<usize>) -> Result<RopeScaling> {
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let factor = || -> Result<f64> {
        match get_f64(obj, "factor")? {
            Some(f) if f > 0.0 => Ok(f),
            Some(f) => bail!("config.json: rope scaling `factor` must be > 0, got {f}"),
            None => bail!("config.json: rope scaling `{kind}` needs `factor`"),
        }
    };
    match kind {
        "default" => Ok(RopeScaling::Default),
        "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
        "llama3" => {
            let low = get_f64(obj, "low_freq_factor")?.unwrap_or(1.0);
            let high = get_f64(obj, "high_freq_factor")?.unwrap_or(4.0);
            let orig = get_usize(obj, "original_max_position_embeddings")?.unwrap_or(8192);
            if high <= low {
                bail!("config.json: llama3 rope needs high_freq_factor ({high}) > low_freq_factor ({low})")
            }
            Ok(RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: orig,
            })
        }
        "yarn" => Ok(RopeScaling::Yarn {
            factor: factor()?,
            original_max_position_embeddings: get_usize(obj, "original_max_position_embeddings")?.unwrap_or(max_pos),
            // HF: `get("beta_fast") or 32` (a 0 or null means the default too)
            beta_fast: get_f64(obj, "beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
            beta_slow: get_f64(obj, "beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
            attention_factor: get_f64(obj, "attention_factor")?,
            mscale: get_f64(obj, "mscale")?,
            mscale_all_dim: get_f64(obj, "mscale_all_dim")?,
            truncate: match obj.get("truncate") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(v) => bail!("config.json: yarn `truncate` must be true or false, got {v}"),
            },
        }),
        "longrope" | "su" => phi3::parse_longrope(obj, max_pos, orig),
        other => bail!("config.json: unsupported rope_type `{other}` (supported: default, linear, llama3, yarn, longrope)"),
    }
}
