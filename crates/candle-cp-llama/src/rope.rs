//! Rotary position embedding in the HF `rotate_half` form: dimension `i` pairs with
//! `i + R/2` over the first `R` = [`LlamaConfig::rope_dim`] dimensions of a head (`R = D`
//! unless the config's RoPE is partial, Phi-4-mini's; the others pass through). Angles are
//! computed on the host in f64 from each token's GLOBAL position, so every sharding layout
//! rotates a token exactly as the single-device model does.

use crate::config::{LlamaConfig, RopeScaling};
use candle_core::{DType, Device, Result, Tensor};
use std::cmp::Ordering;

/// Inverse frequencies `[R/2]` (`R` = [`LlamaConfig::rope_dim`]) of the config (theta, then the configured scaling), in f64;
/// a LongRoPE's for a sequence within its original length (its short factors, as
/// transformers initialises them). See [`inv_freq_at`].
pub fn inv_freq(cfg: &LlamaConfig) -> Vec<f64> {
    inv_freq_at(cfg, 0)
}

/// Inverse frequencies `[R/2]` for a sequence of `seq_len` tokens (its largest position +
/// 1, over the whole sequence: on a CP rank, not its shard's). Only
/// [`RopeScaling::LongRope`] depends on it: its long factors above the original length, the
/// short ones up to it (0: the short ones).
pub fn inv_freq_at(cfg: &LlamaConfig, seq_len: usize) -> Vec<f64> {
    // (a partial RoPE's frequencies over its rotated dimensions, as transformers' `dim`)
    let d = cfg.rope_dim();
    let base: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64))
        .collect();
    match &cfg.rope_scaling {
        RopeScaling::Default => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, .. } => {
            let ext = if seq_len > *original_max_position_embeddings { long_factor } else { short_factor };
            base.into_iter().zip(ext).map(|(f, e)| f / e).collect()
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let (factor, low_freq_factor, high_freq_factor) = (*factor, *low_freq_factor, *high_freq_factor);
            let old = *original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    let medium = wavelen.partial_cmp(&high_wavelen) != Some(Ordering::Less)
                        && wavelen.partial_cmp(&low_wavelen) != Some(Ordering::Greater);
                    if medium {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    }
                })
                .collect()
        }
        RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, .. } => {
            let (factor, original_max_position_embeddings, beta_fast, beta_slow, truncate) =
                (*factor, *original_max_position_embeddings, *beta_fast, *beta_slow, *truncate);
            // the dimension whose frequency turns `rot` times over the original length
            let dim_of = |rot: f64| {
                d as f64 * (original_max_position_embeddings as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * cfg.rope_theta.ln())
            };
            let (mut low, mut high) = (dim_of(beta_fast), dim_of(beta_slow));
            if truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(d as f64 - 1.0));
            if low == high {
                high += 0.001;
            }
            // ramp 0: the frequency kept (extrapolated), 1: divided by the factor (interpolated)
            base.into_iter()
                .enumerate()
                .map(|(i, f)| {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    f / factor * ramp + f * (1.0 - ramp)
                })
                .collect()
        }
    }
}

/// `cos`, `sin` tables `[T, R]` (`R` = [`LlamaConfig::rope_dim`], the head dim `D` unless
/// partial) for the given global positions (`[T]`), built in f64 on the host and converted to
/// `dtype` on `device`. Column `i` and `i + R/2` share an angle. Both
/// are multiplied by the scaling's [`RopeScaling::attention_factor`] (YaRN's, LongRoPE's; 1
/// otherwise). The sequence's length is taken as the largest of `positions` + 1, as
/// transformers does for one call: a shard of a longer sequence passes the whole
/// sequence's to [`rope_tables_at`].
pub fn rope_tables(cfg: &LlamaConfig, positions: &[u32], dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
    let seq_len = positions.iter().max().map_or(0, |&p| p as usize + 1);
    rope_tables_at(cfg, positions, seq_len, dtype, device)
}

/// [`rope_tables`] with the frequencies of a sequence of `seq_len` tokens ([`inv_freq_at`]).
pub fn rope_tables_at(cfg: &LlamaConfig, positions: &[u32], seq_len: usize, dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
    let f = inv_freq_at(cfg, seq_len);
    let scale = cfg.rope_scaling.attention_factor();
    let d = cfg.rope_dim();
    let t = positions.len();
    let mut cos = Vec::with_capacity(t * d);
    let mut sin = Vec::with_capacity(t * d);
    for &p in positions {
        for _ in 0..2 {
            for &fr in &f {
                let a = p as f64 * fr;
                cos.push(a.cos() * scale);
                sin.push(a.sin() * scale);
            }
        }
    }
    let cos = Tensor::from_vec(cos, (t, d), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?;
    let sin = Tensor::from_vec(sin, (t, d), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?;
    Ok((cos, sin))
}

pub use crate::fused::{apply_rope, apply_rope_slow};

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::D;

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() -> Result<()> {
        let cfg = LlamaConfig::tiny(16, 32, 1, 2, 1);
        let pos = [0u32, 5, 1000];
        let (cos, sin) = rope_tables(&cfg, &pos, DType::F32, &Device::Cpu)?;
        let x = Tensor::randn(0f32, 1., (1, 3, 2, 16), &Device::Cpu)?;
        let y = apply_rope(&x, &cos, &sin)?;
        // position 0 is the identity
        let d0 = (y.narrow(1, 0, 1)? - x.narrow(1, 0, 1)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(d0 < 1e-7);
        // a rotation keeps the norm of each (i, i + D/2) pair, hence of the vector
        let nx = x.sqr()?.sum(D::Minus1)?;
        let ny = y.sqr()?.sum(D::Minus1)?;
        let dn = (nx - ny)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(dn < 1e-4, "{dn}");
        // hand-computed pair (0, 8) at position 5: angle 5 * inv_freq[0] = 5
        let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let ys: Vec<f32> = y.flatten_all()?.to_vec1()?;
        let at = |v: &Vec<f32>, t: usize, h: usize, i: usize| v[(t * 2 + h) * 16 + i];
        let (c, s) = (5f64.cos() as f32, 5f64.sin() as f32);
        let want0 = at(&xs, 1, 1, 0) * c - at(&xs, 1, 1, 8) * s;
        let want8 = at(&xs, 1, 1, 8) * c + at(&xs, 1, 1, 0) * s;
        assert!((at(&ys, 1, 1, 0) - want0).abs() < 1e-5 && (at(&ys, 1, 1, 8) - want8).abs() < 1e-5);
        Ok(())
    }

    #[test]
    fn llama3_scaling_bands() {
        let mut cfg = LlamaConfig::tiny(16, 128, 1, 1, 1);
        cfg.rope_theta = 500000.0;
        let plain = inv_freq(&cfg);
        cfg.rope_scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let scaled = inv_freq(&cfg);
        // highest frequency (short wavelength) untouched, lowest divided by the factor
        assert_eq!(plain[0], scaled[0]);
        let last = plain.len() - 1;
        assert!((plain[last] / 8.0 - scaled[last]).abs() < 1e-18);
        // in between: scaled frequencies lie between f/8 and f
        for (p, s) in plain.iter().zip(&scaled) {
            assert!(*s <= *p && *s >= p / 8.0 - 1e-18);
        }
    }

    /// YaRN as Qwen2.5 configures it for 128k (theta 1e6, D = 128, 4 × 32768): the ramp runs
    /// over dimensions 23..40 (by hand: 128·ln(32768 / (β·2π)) / (2·ln 1e6) = 23.60 for β = 32,
    /// 39.66 for β = 1, floored and ceiled), frequencies below it kept, above it divided by 4,
    /// in between the linear mix; cos and sin carry 0.1·ln 4 + 1.
    #[test]
    fn yarn_ramp_and_attention_factor() -> Result<()> {
        let text = r#"{"vocab_size": 64, "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}"#;
        let cfg = LlamaConfig::from_json(text)?;
        assert_eq!(cfg.head_dim, 128);
        let yarn = inv_freq(&cfg);
        let plain = inv_freq(&LlamaConfig { rope_scaling: RopeScaling::Default, ..cfg.clone() });
        for (i, (y, p)) in yarn.iter().zip(&plain).enumerate() {
            let ramp = ((i as f64 - 23.0) / 17.0).clamp(0.0, 1.0);
            let want = p / 4.0 * ramp + p * (1.0 - ramp);
            assert!((y - want).abs() <= 1e-15 * p, "dim {i}: {y} vs {want}");
            match i {
                0..=23 => assert_eq!(y, p, "dim {i} kept"),
                40.. => assert_eq!(*y, p / 4.0, "dim {i} divided"),
                _ => assert!(*y < *p && *y > p / 4.0, "dim {i} between"),
            }
        }
        let af = 0.1 * 4f64.ln() + 1.0;
        assert!((cfg.rope_scaling.attention_factor() - af).abs() < 1e-15);
        let (cos, sin) = rope_tables(&cfg, &[0, 7], DType::F64, &Device::Cpu)?;
        assert_eq!(cos.get(0)?.to_vec1::<f64>()?, vec![af; 128]);
        let (c7, s7) = (cos.get(1)?.to_vec1::<f64>()?, sin.get(1)?.to_vec1::<f64>()?);
        for i in [0, 30, 63] {
            let a = 7.0 * yarn[i];
            assert!((c7[i] - af * a.cos()).abs() < 1e-15 && (s7[i + 64] - af * a.sin()).abs() < 1e-15, "dim {i}");
        }
        // written back (with the defaults made explicit) and read again: the same scaling
        let back = LlamaConfig::from_json(&cfg.to_hf_json("bfloat16"))?;
        assert_eq!(back, cfg);
        assert!(matches!(back.rope_scaling, RopeScaling::Yarn { beta_fast: 32.0, beta_slow: 1.0, truncate: true, attention_factor: None, .. }));
        Ok(())
    }

    /// YaRN's options: the original length from `max_position_embeddings` when absent, a given
    /// attention factor, the mscale ratio, no truncation (a wider ramp), bad values refused.
    #[test]
    fn yarn_options() -> Result<()> {
        let cfg = |scaling: &str| {
            LlamaConfig::from_json(&format!(
                r#"{{"vocab_size": 64, "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 1,
                "num_attention_heads": 2, "rope_theta": 1000000.0, "max_position_embeddings": 8192,
                "rope_parameters": {{"rope_type": "yarn", "rope_theta": 1000000.0, {scaling}}}}}"#
            ))
        };
        let c = cfg(r#""factor": 2.0"#)?;
        assert!(matches!(c.rope_scaling, RopeScaling::Yarn { original_max_position_embeddings: 8192, .. }));
        assert_eq!(cfg(r#""factor": 2.0, "attention_factor": 1.5"#)?.rope_scaling.attention_factor(), 1.5);
        let m = |x: f64| 0.1 * x * 40f64.ln() + 1.0;
        let r = cfg(r#""factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5"#)?.rope_scaling.attention_factor();
        assert!((r - m(1.0) / m(0.5)).abs() < 1e-15, "{r}");
        // factor <= 1: no attention scaling
        assert_eq!(cfg(r#""factor": 1.0"#)?.rope_scaling.attention_factor(), 1.0);
        // without truncation the ramp runs over 23.60..39.66 instead of 23..40: dimension 24
        // is divided less, dimension 39 more
        let (t, u) = (inv_freq(&cfg(r#""factor": 4.0, "original_max_position_embeddings": 32768"#)?), inv_freq(&cfg(r#""factor": 4.0, "original_max_position_embeddings": 32768, "truncate": false"#)?));
        assert!(u[24] > t[24] && u[39] < t[39] && u[23] == t[23] && u[40] == t[40]);
        for bad in [r#""factor": 0.0"#, r#""factor": 4.0, "beta_fast": -1.0"#, r#""factor": 4.0, "attention_factor": -2.0"#, r#""factor": 4.0, "truncate": 3"#] {
            let e = cfg(bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("factor") || e.contains("yarn") || e.contains("truncate"), "{bad}: {e:?}");
        }
        Ok(())
    }
}
