//! Rotary position embedding in the HF `rotate_half` form: dimension `i` pairs with
//! `i + D/2`. Angles are computed on the host in f64 from each token's GLOBAL position, so
//! every sharding layout rotates a token exactly as the single-device model does.

use crate::config::{LlamaConfig, RopeScaling};
use candle_core::{DType, Device, Result, Tensor};
use std::cmp::Ordering;

/// Inverse frequencies `[D/2]` of the config (theta, then the configured scaling), in f64.
pub fn inv_freq(cfg: &LlamaConfig) -> Vec<f64> {
    let d = cfg.head_dim;
    let base: Vec<f64> = (0..d / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f64 / d as f64))
        .collect();
    match cfg.rope_scaling {
        RopeScaling::Default => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let old = original_max_position_embeddings as f64;
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
    }
}

/// `cos`, `sin` tables `[T, D]` for the given global positions (`[T]`), built in f64 on the
/// host and converted to `dtype` on `device`. Column `i` and `i + D/2` share an angle.
pub fn rope_tables(cfg: &LlamaConfig, positions: &[u32], dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
    let f = inv_freq(cfg);
    let d = cfg.head_dim;
    let t = positions.len();
    let mut cos = Vec::with_capacity(t * d);
    let mut sin = Vec::with_capacity(t * d);
    for &p in positions {
        for _ in 0..2 {
            for &fr in &f {
                let a = p as f64 * fr;
                cos.push(a.cos());
                sin.push(a.sin());
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
}
