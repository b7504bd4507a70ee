//! [`super::AdamW`]'s state on disk: gathered (over ZeRO's ranks, then the experts' EP group)
//! and streamed into a safetensors file, and read back, each rank taking its slices.

use super::*;
use super::super::zero::gather;

impl AdamW {
    /// The whole state as named tensors: `m.<name>`, `v.<name>`, `w.<name>` (the f32 master
    /// copy of a low-precision parameter) and `step` (u32 `[1]`), full shapes on the host.
    /// With ZeRO-1 the slices are all-gathered: collective over the replica ranks.
    pub fn state_tensors(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for s in &self.slots {
            out.insert(format!("m.{}", s.name), self.full_state(s, &s.m)?);
            out.insert(format!("v.{}", s.name), self.full_state(s, &s.v)?);
            if let Some(w) = &s.master {
                out.insert(format!("w.{}", s.name), self.full_state(s, w)?);
            }
        }
        out.insert(
            "step".to_string(),
            Tensor::new(&[self.step as u32], &Device::Cpu)?,
        );
        Ok(out)
    }

    /// Save the state ([`AdamW::state_tensors`]) to a safetensors file (with ZeRO-1:
    /// collective, see [`AdamW::save_from`]).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        self.save_from(path, true)
    }

    /// [`AdamW::save`] where only the ranks with `write` write the file; with ZeRO-1 every
    /// replica rank must call it. The file is the same as without ZeRO, so a run can resume
    /// with or without it. The state is gathered one tensor at a time and streamed into the
    /// file, so no rank ever holds the whole (unsharded) state, on a device or on the host.
    pub fn save_from(&self, path: impl AsRef<Path>, write: bool) -> Result<()> {
        if self.zero.is_none() && self.experts.is_none() && !write {
            return Ok(());
        }
        let split = |name: &str| self.experts.as_ref().filter(|e| e.names.contains(name)).map(|e| &e.group);
        // (key, slot, which): 0 = m, 1 = v, 2 = master copy; "step" is the last slot index
        let mut keys: Vec<(String, usize, u8)> = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            keys.push((format!("m.{}", s.name), i, 0));
            keys.push((format!("v.{}", s.name), i, 1));
            if s.master.is_some() {
                keys.push((format!("w.{}", s.name), i, 2));
            }
        }
        keys.push(("step".to_string(), usize::MAX, 0));
        keys.sort_by(|a, b| a.0.cmp(&b.0));
        let entries: Vec<(String, Vec<usize>, DType)> = keys
            .iter()
            .map(|(k, i, _)| match self.slots.get(*i) {
                Some(s) => {
                    let mut d = s.var.dims().to_vec();
                    if let (Some(g), Some(d0)) = (split(&s.name), d.first_mut()) {
                        *d0 *= g.size();
                    }
                    (k.clone(), d, DType::F32)
                }
                None => (k.clone(), vec![1], DType::U32),
            })
            .collect();
        crate::hf::stream_safetensors(path.as_ref(), &entries, write, |j| {
            let (_, i, which) = &keys[j];
            let Some(s) = self.slots.get(*i) else { return Tensor::new(&[self.step as u32], &Device::Cpu) };
            let t = match (which, &s.master) {
                (0, _) => &s.m,
                (1, _) => &s.v,
                (_, Some(w)) => w,
                (_, None) => bail!("AdamW: {} has no master copy", s.name),
            };
            match split(&s.name) {
                Some(g) => g.all_gather(&self.full_state(s, t)?, 0)?.to_device(&Device::Cpu),
                None => self.full_state(s, t),
            }
        })
    }

    /// The full (parameter-shaped) f32 state tensor `t` of slot `s` on the host: all-gathered
    /// over the ranks it is split over with ZeRO (collective).
    fn full_state(&self, s: &Slot, t: &Tensor) -> Result<Tensor> {
        let t = match &s.zero {
            Some(z) => gather(z, t, s.var.elem_count())?.reshape(s.var.shape())?,
            None => t.clone(),
        };
        t.to_device(&Device::Cpu)
    }

    /// Restore the state saved by [`AdamW::save`] (with or without ZeRO-1; this rank takes
    /// its slice). Every parameter must have its moments in the file, with the same shape. A
    /// low-precision parameter's master copy comes from the file (`w.<name>`), or, in a file
    /// without one (written before master copies existed, or by an f32 run), from the
    /// parameter's current value. Under expert parallelism ([`AdamW::with_expert_parallel`])
    /// the experts' state may hold every expert, as [`AdamW::save_from`] writes it: this EP
    /// rank takes its experts.
    ///
    /// The file is memory-mapped and read one tensor at a time, each cut to this rank's
    /// ZeRO slice before the next is read.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let p = path.as_ref();
        let err = |e: candle_core::Error| candle_core::Error::Msg(format!("reading optimizer state {}: {e}", p.display()));
        // SAFETY: mapped read-only while this call runs; checkpoints are published once
        // (renamed into place) and never rewritten
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(p) }.map_err(err)?;
        self.load_with(|k| match st.get(k) {
            Err(_) => Ok(None),
            Ok(_) => st.load(k, &Device::Cpu).map(Some).map_err(err),
        }, p)
    }

    /// [`AdamW::load`] from the tensors of such a file (`step`, `m.<name>`, `v.<name>`,
    /// optionally `w.<name>`), e.g. state resharded for another layout; `p` names their
    /// origin in errors.
    pub fn load_tensors(&mut self, t: &std::collections::HashMap<String, Tensor>, p: &Path) -> Result<()> {
        self.load_with(|k| Ok(t.get(k).cloned()), p)
    }

    /// [`AdamW::load_tensors`] with the tensors from `get` (name → tensor, `None` when
    /// absent), asked for one at a time.
    fn load_with(&mut self, get: impl Fn(&str) -> Result<Option<Tensor>>, p: &Path) -> Result<()> {
        let step = get("step")?
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: no 'step' tensor", p.display())))?;
        let step = step.to_vec1::<u32>()?;
        let Some(&step) = step.first() else {
            bail!("{}: empty 'step' tensor", p.display())
        };
        // the experts under expert parallelism: this EP rank's slice of a file holding every expert
        let ep = self.experts.as_ref().map(|e| (e.group.rank(), e.group.size(), e.names.clone()));
        for s in self.slots.iter_mut() {
            let sharded = s.zero.is_some();
            let ep_slice = |x: Option<Tensor>| -> Result<Option<Tensor>> {
                let (Some(x), Some((r, size, names))) = (x.clone(), &ep) else { return Ok(x) };
                let (d, want) = (x.dims(), s.var.dims());
                match (d.split_first(), want.split_first()) {
                    (Some((&d0, rest)), Some((&w0, wrest))) if names.contains(&s.name) && d0 == w0 * size && rest == wrest => Ok(Some(x.narrow(0, r * w0, w0)?)),
                    _ => Ok(Some(x)),
                }
            };
            let (Some(m), Some(v)) = (
                ep_slice(get(&format!("m.{}", s.name))?)?,
                ep_slice(get(&format!("v.{}", s.name))?)?,
            ) else {
                bail!(
                    "{}: no optimizer state for parameter '{}'",
                    p.display(),
                    s.name
                )
            };
            let w = ep_slice(get(&format!("w.{}", s.name))?)?;
            for (what, x) in [("state", Some(&m)), ("state", Some(&v)), ("master copy", w.as_ref())] {
                if let Some(x) = x {
                    if x.shape() != s.var.shape() {
                        bail!(
                            "{}: {what} of '{}' has shape {:?}, parameter {:?}",
                            p.display(),
                            s.name,
                            x.dims(),
                            s.var.dims()
                        )
                    }
                }
            }
            let dev = s.var.device().clone();
            s.m = s.own(&m, sharded)?.to_dtype(DType::F32)?.to_device(&dev)?;
            s.v = s.own(&v, sharded)?.to_dtype(DType::F32)?.to_device(&dev)?;
            if s.master.is_some() {
                s.master = match &w {
                    Some(w) => Some(s.own(w, sharded)?.to_dtype(DType::F32)?.to_device(&dev)?),
                    None => s.master_init(sharded)?,
                };
            }
        }
        self.step = step as usize;
        Ok(())
    }
}
