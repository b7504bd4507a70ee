//! AdamW with an inspectable, serialisable state (candle-nn's `AdamW` keeps its moments
//! private, so a run using it could not be resumed without losing them).

use candle_core::{bail, DType, Device, Result, Tensor, Var};
use std::collections::HashMap;
use std::path::Path;

/// AdamW hyper-parameters (the learning rate is passed to every [`AdamW::step`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay, applied to parameters of rank ≥ 2 only (not norms / biases).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

struct Slot {
    name: String,
    var: Var,
    m: Tensor,
    v: Tensor,
    /// f32 master copy of a low-precision (bf16/f16) parameter: updates accumulate here and
    /// the parameter is its rounding (an update below the parameter's resolution, e.g. 1e-5
    /// on a bf16 weight of 0.02, would otherwise be lost at every step).
    master: Option<Tensor>,
    decay: bool,
}

/// AdamW over named parameters (names are the checkpoint keys, e.g. HF names).
///
/// Moments are f32 of the parameter's (local) shape; a bf16/f16 parameter also gets an f32
/// master copy (mixed precision: 12 bytes of state per parameter, 8 for f32 parameters).
/// Parameters are kept sorted by name so the update order — and the saved state — is
/// deterministic.
pub struct AdamW {
    /// Hyper-parameters.
    pub cfg: AdamWConfig,
    /// Number of optimizer steps taken (bias correction uses `step` after increment).
    pub step: usize,
    slots: Vec<Slot>,
}

impl AdamW {
    /// An optimizer over `params` (name, variable). Duplicate names are an error.
    pub fn new(mut params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        for w in params.windows(2) {
            if w[0].0 == w[1].0 {
                bail!("AdamW: parameter name '{}' appears twice", w[0].0)
            }
        }
        let slots = params
            .into_iter()
            .map(|(name, var)| {
                let z = Tensor::zeros(var.shape(), DType::F32, var.device())?;
                let decay = var.rank() >= 2;
                let master = master_of(&var)?;
                Ok(Slot {
                    name,
                    var,
                    m: z.clone(),
                    v: z,
                    master,
                    decay,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cfg,
            step: 0,
            slots,
        })
    }

    /// Parameter names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.slots.iter().map(|s| s.name.as_str()).collect()
    }

    /// (name, variable) pairs, sorted by name.
    pub fn params(&self) -> Vec<(&str, &Var)> {
        self.slots
            .iter()
            .map(|s| (s.name.as_str(), &s.var))
            .collect()
    }

    /// One update with learning rate `lr`. Each gradient is multiplied by `grad_scale` first
    /// (gradient clipping, 1/accumulation). A parameter absent from `grads` is left untouched
    /// (its moments too). Gradient shapes must match the parameters.
    pub fn step(
        &mut self,
        grads: &HashMap<String, Tensor>,
        lr: f64,
        grad_scale: f64,
    ) -> Result<()> {
        self.step += 1;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(self.step as i32);
        let bc2 = 1.0 - c.beta2.powi(self.step as i32);
        for s in self.slots.iter_mut() {
            let Some(g) = grads.get(&s.name) else {
                continue;
            };
            if g.shape() != s.var.shape() {
                bail!(
                    "AdamW: gradient of '{}' has shape {:?}, parameter {:?}",
                    s.name,
                    g.dims(),
                    s.var.dims()
                )
            }
            let g = (g.to_dtype(DType::F32)? * grad_scale)?;
            s.m = ((&s.m * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
            s.v = ((&s.v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let denom = ((&s.v / bc2)?.sqrt()? + c.eps)?;
            let upd = ((&s.m / bc1)? / denom)?;
            let p = match &s.master {
                Some(m) => m.clone(),
                None => s.var.as_tensor().to_dtype(DType::F32)?,
            };
            let p = if s.decay && c.weight_decay > 0.0 {
                (p * (1.0 - lr * c.weight_decay))?
            } else {
                p
            };
            let p = (p - (upd * lr)?)?;
            s.var.set(&p.to_dtype(s.var.dtype())?)?;
            if s.master.is_some() {
                s.master = Some(p);
            }
        }
        Ok(())
    }

    /// The state as named tensors: `m.<name>`, `v.<name>`, `w.<name>` (the f32 master copy
    /// of a low-precision parameter) and `step` (u32 `[1]`).
    pub fn state_tensors(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for s in &self.slots {
            out.insert(format!("m.{}", s.name), s.m.to_device(&Device::Cpu)?);
            out.insert(format!("v.{}", s.name), s.v.to_device(&Device::Cpu)?);
            if let Some(w) = &s.master {
                out.insert(format!("w.{}", s.name), w.to_device(&Device::Cpu)?);
            }
        }
        out.insert(
            "step".to_string(),
            Tensor::new(&[self.step as u32], &Device::Cpu)?,
        );
        Ok(out)
    }

    /// Save the state to a safetensors file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        candle_core::safetensors::save(&self.state_tensors()?, path)
    }

    /// Restore the state saved by [`AdamW::save`]. Every parameter must have its moments in
    /// the file, with the same shape. A low-precision parameter's master copy comes from the
    /// file (`w.<name>`), or, in a file without one (written before master copies existed, or
    /// by an f32 run), from the parameter's current value.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let p = path.as_ref();
        let t = candle_core::safetensors::load(p, &Device::Cpu)?;
        let step = t
            .get("step")
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: no 'step' tensor", p.display())))?;
        let step = step.to_vec1::<u32>()?;
        let Some(&step) = step.first() else {
            bail!("{}: empty 'step' tensor", p.display())
        };
        for s in self.slots.iter_mut() {
            let (Some(m), Some(v)) = (
                t.get(&format!("m.{}", s.name)),
                t.get(&format!("v.{}", s.name)),
            ) else {
                bail!(
                    "{}: no optimizer state for parameter '{}'",
                    p.display(),
                    s.name
                )
            };
            if m.shape() != s.var.shape() || v.shape() != s.var.shape() {
                bail!(
                    "{}: state of '{}' has shape {:?}, parameter {:?}",
                    p.display(),
                    s.name,
                    m.dims(),
                    s.var.dims()
                )
            }
            s.m = m.to_dtype(DType::F32)?.to_device(s.var.device())?;
            s.v = v.to_dtype(DType::F32)?.to_device(s.var.device())?;
            if s.master.is_some() {
                s.master = match t.get(&format!("w.{}", s.name)) {
                    Some(w) if w.shape() == s.var.shape() => Some(w.to_dtype(DType::F32)?.to_device(s.var.device())?),
                    Some(w) => bail!(
                        "{}: master copy of '{}' has shape {:?}, parameter {:?}",
                        p.display(),
                        s.name,
                        w.dims(),
                        s.var.dims()
                    ),
                    None => master_of(&s.var)?,
                };
            }
        }
        self.step = step as usize;
        Ok(())
    }
}

/// The f32 master copy a parameter needs: `Some` for bf16/f16 (low-precision) parameters.
fn master_of(var: &Var) -> Result<Option<Tensor>> {
    match var.dtype() {
        DType::BF16 | DType::F16 => Ok(Some(var.as_tensor().to_dtype(DType::F32)?)),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bf16 weight at 1.0 under updates of 1e-4 (far below bf16's 2^-8 spacing there): with
    /// the f32 master copy the weight moves once the updates add up; rounding every step
    /// (the old behaviour, no master) would leave it at 1.0 for ever. Save / load keeps the
    /// master copy, so a resumed run continues identically.
    #[test]
    fn bf16_updates_accumulate_in_the_master_copy() -> Result<()> {
        let mk = || -> Result<AdamW> {
            let w = Var::from_tensor(&Tensor::ones(4, DType::BF16, &Device::Cpu)?)?;
            AdamW::new(vec![("w".to_string(), w)], AdamWConfig::default())
        };
        let grads: HashMap<String, Tensor> = [("w".to_string(), Tensor::ones(4, DType::BF16, &Device::Cpu)?)].into();
        let value = |o: &AdamW| -> Result<f32> { o.slots[0].var.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>().map(|v| v[0]) };
        let mut a = mk()?;
        for _ in 0..10 {
            a.step(&grads, 1e-4, 1.0)?;
        }
        assert_eq!(value(&a)?, 1.0, "0.999 still rounds to 1.0 in bf16");
        let master = a.slots[0].master.as_ref().expect("bf16 gets a master copy").to_vec1::<f32>()?[0];
        assert!((master - 0.999).abs() < 1e-5, "master {master}");
        let dir = std::env::temp_dir().join(format!("cp-adamw-master-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let file = dir.join("opt.safetensors");
        a.save(&file)?;
        let mut b = mk()?;
        b.load(&file)?;
        b.slots[0].var.set(a.slots[0].var.as_tensor())?;
        for _ in 0..20 {
            a.step(&grads, 1e-4, 1.0)?;
            b.step(&grads, 1e-4, 1.0)?;
        }
        assert_eq!(value(&a)?, 0.99609375, "after 30 updates of 1e-4 the weight moved one bf16 step");
        assert_eq!(value(&b)?, value(&a)?, "resumed from the saved state: identical");
        let _ = std::fs::remove_dir_all(&dir);
        // f32 parameters need no copy
        let w = Var::from_tensor(&Tensor::ones(2, DType::F32, &Device::Cpu)?)?;
        assert!(AdamW::new(vec![("x".to_string(), w)], AdamWConfig::default())?.slots[0].master.is_none());
        Ok(())
    }

    /// One AdamW step computed by hand in f64 for a 2-element parameter.
    #[test]
    fn matches_hand_computed_update() -> Result<()> {
        let dev = Device::Cpu;
        let w = Var::from_tensor(&Tensor::new(&[[1.0f32, -2.0]], &dev)?)?;
        let n = Var::from_tensor(&Tensor::new(&[0.5f32], &dev)?)?;
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(vec![("w".into(), w.clone()), ("n".into(), n.clone())], cfg)?;
        let mut g = HashMap::new();
        g.insert("w".to_string(), Tensor::new(&[[0.5f32, 0.25]], &dev)?);
        g.insert("n".to_string(), Tensor::new(&[2.0f32], &dev)?);
        let (lr, scale) = (0.01, 0.5);
        let mut want_w = [1.0f64, -2.0];
        let mut m = [0.0f64; 2];
        let mut v = [0.0f64; 2];
        for t in 1..=2 {
            opt.step(&g, lr, scale)?;
            for i in 0..2 {
                let gi = [0.5, 0.25][i] * scale;
                m[i] = 0.9 * m[i] + 0.1 * gi;
                v[i] = 0.99 * v[i] + 0.01 * gi * gi;
                let upd = (m[i] / (1.0 - 0.9f64.powi(t)))
                    / ((v[i] / (1.0 - 0.99f64.powi(t))).sqrt() + 1e-8);
                want_w[i] = want_w[i] * (1.0 - lr * 0.1) - lr * upd;
            }
        }
        let got = w.as_tensor().to_vec2::<f32>()?;
        for i in 0..2 {
            assert!(
                (got[0][i] as f64 - want_w[i]).abs() < 1e-6,
                "{got:?} vs {want_w:?}"
            );
        }
        // Rank-1 parameter: no weight decay; first step of Adam moves it by ~lr.
        let nv = n.as_tensor().to_vec1::<f32>()?[0] as f64;
        assert!((nv - (0.5 - 2.0 * 0.01)).abs() < 1e-5, "{nv}");
        Ok(())
    }

    #[test]
    fn state_round_trips_and_bad_state_is_rejected() -> Result<()> {
        let dev = Device::Cpu;
        let dir = std::env::temp_dir().join(format!("adamw-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let mk = || -> Result<(Var, AdamW)> {
            let w = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0, 3.0], &dev)?)?;
            let opt = AdamW::new(vec![("w".into(), w.clone())], AdamWConfig::default())?;
            Ok((w, opt))
        };
        let mut g = HashMap::new();
        g.insert("w".to_string(), Tensor::new(&[0.1f32, -0.2, 0.3], &dev)?);
        let (wa, mut a) = mk()?;
        a.step(&g, 0.1, 1.0)?;
        a.save(dir.join("opt.safetensors"))?;
        let (wb, mut b) = mk()?;
        wb.set(wa.as_tensor())?;
        b.load(dir.join("opt.safetensors"))?;
        assert_eq!(b.step, 1);
        a.step(&g, 0.1, 1.0)?;
        b.step(&g, 0.1, 1.0)?;
        assert_eq!(
            wa.as_tensor().to_vec1::<f32>()?,
            wb.as_tensor().to_vec1::<f32>()?
        );
        // A parameter with another shape cannot take this state.
        let w2 = Var::from_tensor(&Tensor::new(&[1.0f32, 2.0], &dev)?)?;
        let mut c = AdamW::new(vec![("w".into(), w2)], AdamWConfig::default())?;
        assert!(c.load(dir.join("opt.safetensors")).is_err());
        // Wrong gradient shape is an error.
        let mut bad = HashMap::new();
        bad.insert("w".to_string(), Tensor::new(&[0.1f32], &dev)?);
        assert!(b.step(&bad, 0.1, 1.0).is_err());
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
