//! [`Band`]: an attention mask given as one interval of key rows per query row.
//!
//! Query row `i` (of batch row `b`) sees the key rows `lo[b][i] <= j < hi[b][i]` (local
//! indices). Both bounds are non-decreasing in `i`, so the visible keys of a tile of query rows
//! `[i0, i1)` lie in `[lo[i0], hi[i1 - 1])`, and the kernels skip every tile outside that range
//! in one comparison. Every mask of this project is a band when the rows are in increasing
//! position order (all three layouts keep them so):
//!
//! ```text
//!   causal            lo = 0                      hi = last key at or before the query + 1
//!   sliding window w  lo = first key > qp - w     hi = as causal
//!   packed documents  lo = first key of the query's document (or of its window)
//!                     hi = as causal (causal) / end of the document (full)
//!
//!   T = 8, documents [0,3) [3,8), causal:      keys 0 1 2 3 4 5 6 7
//!                                        q0    █ . . . . . . .     lo hi
//!                                        q1    █ █ . . . . . .      0  2
//!                                        q2    █ █ █ . . . . .      0  3
//!                                        q3    . . . █ . . . .      3  4
//!                                        q4    . . . █ █ . . .      3  5   ...
//! ```
//!
//! So a ring step with packed documents and a window is ONE kernel call (the CPU kernels of
//! module `kernel` and the CUDA `Simple`/`Pipelined` kernels take bands), however many
//! documents it touches: no per-document launches, no per-document padding.

use super::Mask;
use crate::cp::ring::MaskSpec;
use crate::packing::Documents;
use candle_core::{bail, Device, Result, Tensor};

/// Per-query-row key intervals `[lo, hi)` of one attention call (see the module docs):
/// `batch` rows (1: the same band for every batch row, else one band per batch row) of `t`
/// query rows each, over `s` key rows. `lo`/`hi` are `[batch, t]` row-major, non-decreasing
/// along each row of `t`, `lo <= hi <= s`.
///
/// A band may also hold a copy of its bounds on a CUDA device ([`Band::upload_all`]); the
/// CUDA kernels then read that copy instead of copying the bounds at every call. Equality
/// compares the bounds only.
#[derive(Clone, Debug)]
pub struct Band {
    batch: usize,
    t: usize,
    s: usize,
    lo: Vec<u32>,
    hi: Vec<u32>,
    /// `lo`, `hi` as u32 `[batch, t]` on one device (views into one buffer shared by the bands
    /// uploaded together); `None` until uploaded.
    on_device: Option<(Tensor, Tensor)>,
}

impl PartialEq for Band {
    fn eq(&self, other: &Self) -> bool {
        (self.batch, self.t, self.s) == (other.batch, other.t, other.s) && self.lo == other.lo && self.hi == other.hi
    }
}

impl Eq for Band {}

impl Band {
    /// From explicit bounds `lo`, `hi` (`[batch, t]` row-major). Errors unless both have
    /// `batch * t` entries, `lo <= hi <= s` and both are non-decreasing along `t`.
    pub fn new(batch: usize, t: usize, s: usize, lo: Vec<u32>, hi: Vec<u32>) -> Result<Self> {
        if batch == 0 || lo.len() != batch * t || hi.len() != batch * t {
            bail!("Band: lo ({}) and hi ({}) must hold batch * t = {batch} * {t} entries (batch >= 1)", lo.len(), hi.len())
        }
        if s > u32::MAX as usize || t > u32::MAX as usize {
            bail!("Band: t = {t}, s = {s} exceed u32")
        }
        for b in 0..batch {
            for i in 0..t {
                let x = b * t + i;
                if lo[x] > hi[x] || hi[x] as usize > s {
                    bail!("Band: row {i} of batch row {b}: [lo, hi) = [{}, {}) is not inside [0, s = {s}]", lo[x], hi[x])
                }
                if i > 0 && (lo[x] < lo[x - 1] || hi[x] < hi[x - 1]) {
                    bail!(
                        "Band: bounds must be non-decreasing, batch row {b}: row {} [{}, {}) then row {i} [{}, {})",
                        i - 1, lo[x - 1], hi[x - 1], lo[x], hi[x]
                    )
                }
            }
        }
        Ok(Self::raw(batch, t, s, lo, hi))
    }

    /// The band of a [`Mask`] (`Full`, offset/strided `Causal`, `Window`) for `t` query rows
    /// and `s` key rows (shared by every batch row). Strides must be >= 1 and the window >= 1
    /// (checked by [`super::check_qkv`]; here a zero stride counts as 1).
    pub fn from_mask(mask: &Mask, t: usize, s: usize) -> Self {
        let (mut lo, mut hi) = (Vec::with_capacity(t), Vec::with_capacity(t));
        // first key row j with k_offset + j * k_stride >= p (s when none)
        let first_at = |p: usize, ko: usize, ks: usize| if p <= ko { 0 } else { (p - ko).div_ceil(ks.max(1)).min(s) };
        // number of key rows with position <= p
        let upto = |p: usize, ko: usize, ks: usize| if p < ko { 0 } else { ((p - ko) / ks.max(1)).saturating_add(1).min(s) };
        for i in 0..t {
            let (a, b) = match *mask {
                Mask::Full => (0, s),
                Mask::Causal { q_offset, q_stride, k_offset, k_stride } => {
                    (0, upto(q_offset.saturating_add(i.saturating_mul(q_stride)), k_offset, k_stride))
                }
                Mask::Window { q_offset, q_stride, k_offset, k_stride, window } => {
                    let qp = q_offset.saturating_add(i.saturating_mul(q_stride));
                    let b = upto(qp, k_offset, k_stride);
                    let a = first_at((qp + 1).saturating_sub(window.max(1)), k_offset, k_stride);
                    (a.min(b), b)
                }
            };
            lo.push(a as u32);
            hi.push(b as u32);
        }
        Self::raw(1, t, s, lo, hi)
    }

    /// The band of query rows at global positions `q_pos` against key rows at `k_pos` (both
    /// strictly increasing) under `spec` (causal or full, window, documents). Errors if the
    /// positions are not increasing, a position lies outside the documents, or a window is set
    /// without `causal`.
    pub fn from_positions(q_pos: &[usize], k_pos: &[usize], spec: MaskSpec) -> Result<Self> {
        for (what, p) in [("query", q_pos), ("key", k_pos)] {
            if let Some(i) = (1..p.len()).find(|&i| p[i] <= p[i - 1]) {
                bail!("Band::from_positions: {what} positions must increase: entry {i} = {} after {}", p[i], p[i - 1])
            }
        }
        if let (Some(w), false) = (spec.window, spec.causal) {
            bail!("Band::from_positions: a sliding window ({w}) needs the causal mask")
        }
        let (t, s) = (q_pos.len(), k_pos.len());
        let (mut lo, mut hi) = (Vec::with_capacity(t), Vec::with_capacity(t));
        for &qp in q_pos {
            // visible key positions: [first, last] (inclusive)
            let (mut first, mut last) = (0usize, if spec.causal { qp } else { usize::MAX });
            if let Some(w) = spec.window {
                first = first.max((qp + 1).saturating_sub(w.max(1)));
            }
            if let Some(docs) = spec.docs {
                let Some(d) = docs.doc_of(qp) else {
                    bail!("Band::from_positions: query position {qp} is outside the documents (T = {})", docs.total_len())
                };
                let (a, b) = docs.range(d);
                first = first.max(a);
                last = last.min(b - 1);
            }
            let a = k_pos.partition_point(|&kp| kp < first);
            let b = k_pos.partition_point(|&kp| kp <= last).max(a);
            lo.push(a as u32);
            hi.push(b as u32);
        }
        // lo and hi are non-decreasing because first and last are (positions increase);
        // `new` re-checks it.
        Self::new(1, t, s, lo, hi)
    }

    /// The band of packed documents over one packed sequence of `t` tokens (queries and keys
    /// both at positions `0..t`): one row per entry of `rows` (a single entry: shared by every
    /// batch row), each row's documents covering `t`, causal and/or a sliding `window` inside
    /// each document.
    pub fn documents(t: usize, rows: &[Documents], causal: bool, window: Option<usize>) -> Result<Self> {
        let pos: Vec<usize> = (0..t).collect();
        let bands = rows
            .iter()
            .enumerate()
            .map(|(i, docs)| {
                docs.check_len(&format!("Band::documents (row {i})"), t)?;
                Band::from_positions(&pos, &pos, MaskSpec { causal, window, docs: Some(docs) })
            })
            .collect::<Result<Vec<_>>>()?;
        Band::stack(&bands)
    }

    /// One band per batch row, stacked (`[B, t]`). Every part must have batch 1 and the same
    /// `t` and `s`.
    pub fn stack(parts: &[Band]) -> Result<Self> {
        let Some(first) = parts.first() else { bail!("Band::stack: no bands") };
        let (t, s) = (first.t, first.s);
        let (mut lo, mut hi) = (Vec::new(), Vec::new());
        for (n, p) in parts.iter().enumerate() {
            if p.batch != 1 || p.t != t || p.s != s {
                bail!("Band::stack: band {n} is [{}, {}] over {} keys, expected [1, {t}] over {s}", p.batch, p.t, p.s)
            }
            lo.extend_from_slice(&p.lo);
            hi.extend_from_slice(&p.hi);
        }
        Ok(Self::raw(parts.len(), t, s, lo, hi))
    }

    /// A band from checked bounds, with no device copy.
    fn raw(batch: usize, t: usize, s: usize, lo: Vec<u32>, hi: Vec<u32>) -> Self {
        Self { batch, t, s, lo, hi, on_device: None }
    }

    /// Copies the bounds of every band in `bands` to the CUDA device `dev` in ONE host-to-device
    /// transfer and keeps the copies with the bands (views into one buffer). The CUDA kernels
    /// then use them instead of copying the bounds at each call: a ring pass uploads the bands
    /// of all its steps before the first step, so no step waits for a copy. No-op on the CPU.
    /// A band derived later ([`Band::narrow_rows`], [`Band::trim_keys`], [`Band::stack`]) has no
    /// device copy; a clone shares its original's.
    pub fn upload_all<'a>(bands: impl IntoIterator<Item = &'a mut Band>, dev: &Device) -> Result<()> {
        if !dev.is_cuda() {
            return Ok(());
        }
        let mut bands: Vec<&mut Band> = bands.into_iter().collect();
        let total: usize = bands.iter().map(|b| 2 * b.lo.len()).sum();
        if total == 0 {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(total);
        for b in &bands {
            buf.extend_from_slice(&b.lo);
            buf.extend_from_slice(&b.hi);
        }
        let all = Tensor::from_vec(buf, total, dev)?;
        let mut at = 0;
        for b in bands.iter_mut() {
            let n = b.lo.len();
            let lo = all.narrow(0, at, n)?.reshape((b.batch, b.t))?;
            let hi = all.narrow(0, at + n, n)?.reshape((b.batch, b.t))?;
            b.on_device = Some((lo, hi));
            at += 2 * n;
        }
        Ok(())
    }

    /// The device copy of the bounds (u32 `[batch, t]` lo, hi) when the band was uploaded to
    /// `dev` ([`Band::upload_all`]).
    pub fn device_bounds(&self, dev: &Device) -> Option<(&Tensor, &Tensor)> {
        match &self.on_device {
            Some((lo, hi)) if lo.device().same_device(dev) => Some((lo, hi)),
            _ => None,
        }
    }

    /// Batch rows of the bounds: 1 (shared by every batch row) or `B`.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Query rows `t` (local).
    pub fn rows(&self) -> usize {
        self.t
    }
    /// Key rows `s` (local).
    pub fn keys(&self) -> usize {
        self.s
    }
    /// Lower bounds, `[batch, t]` row-major.
    pub fn lo(&self) -> &[u32] {
        &self.lo
    }
    /// Upper bounds (exclusive), `[batch, t]` row-major.
    pub fn hi(&self) -> &[u32] {
        &self.hi
    }
    /// The bounds of batch row `b` (any `b` reads a shared band's single row).
    ///
    /// # Panics
    /// If the band has one row per batch row and `b >= batch` (like slice indexing).
    pub fn row(&self, b: usize) -> (&[u32], &[u32]) {
        let b = if self.batch == 1 { 0 } else { b };
        (&self.lo[b * self.t..(b + 1) * self.t], &self.hi[b * self.t..(b + 1) * self.t])
    }
    /// Is key row `j` visible from query row `i` of batch row `b`? (`false` outside the band's
    /// rows.)
    pub fn visible(&self, b: usize, i: usize, j: usize) -> bool {
        if i >= self.t || (self.batch > 1 && b >= self.batch) {
            return false;
        }
        let (lo, hi) = self.row(b);
        (lo[i] as usize) <= j && j < hi[i] as usize
    }
    /// Visible (query, key) pairs over all batch rows of the band (a shared band counts once).
    pub fn pairs(&self) -> u64 {
        self.lo.iter().zip(&self.hi).map(|(&a, &b)| (b - a) as u64).sum()
    }
    /// No pair visible.
    pub fn is_empty(&self) -> bool {
        self.pairs() == 0
    }
    /// Query rows `[start, start + len)` of the band (same keys).
    pub fn narrow_rows(&self, start: usize, len: usize) -> Result<Self> {
        if start + len > self.t {
            bail!("Band::narrow_rows: rows [{start}, {}) outside t = {}", start + len, self.t)
        }
        let (mut lo, mut hi) = (Vec::with_capacity(self.batch * len), Vec::with_capacity(self.batch * len));
        for b in 0..self.batch {
            lo.extend_from_slice(&self.lo[b * self.t + start..b * self.t + start + len]);
            hi.extend_from_slice(&self.hi[b * self.t + start..b * self.t + start + len]);
        }
        Ok(Self::raw(self.batch, len, self.s, lo, hi))
    }
    /// The key rows any query row sees, `[k0, k1)`, and the band over just those keys (bounds
    /// shifted by `-k0`): call the kernels with keys `k0..k1` only. `(0, band over 0 keys)`
    /// when no pair is visible.
    pub fn trim_keys(&self) -> (usize, Band) {
        let t = self.t;
        let (mut k0, mut k1) = (u32::MAX, 0u32);
        for b in 0..self.batch {
            if t > 0 {
                k0 = k0.min(self.lo[b * t]);
                k1 = k1.max(self.hi[b * t + t - 1]);
            }
        }
        if self.is_empty() || k1 <= k0 {
            let z = vec![0; self.lo.len()];
            return (0, Band::raw(self.batch, t, 0, z.clone(), z));
        }
        let clamp = |x: u32| x.clamp(k0, k1) - k0;
        let lo = self.lo.iter().map(|&x| clamp(x)).collect();
        let hi = self.hi.iter().map(|&x| clamp(x)).collect();
        (k0 as usize, Band::raw(self.batch, t, (k1 - k0) as usize, lo, hi))
    }

    /// Check the band fits a call with batch `b`, `t` query rows and `s` key rows.
    pub fn check(&self, op: &str, b: usize, t: usize, s: usize) -> Result<()> {
        if self.t != t || self.s != s || (self.batch != 1 && self.batch != b) {
            bail!(
                "{op}: band of [{}, {}] query rows over {} keys does not fit q with B = {b}, T = {t} and k with S = {s} (band batch must be 1 or B)",
                self.batch, self.t, self.s
            )
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_mask_is_mask_visible() {
        let masks = [
            Mask::Full,
            Mask::causal(),
            Mask::causal_offsets(5, 0),
            Mask::causal_offsets(0, 7),
            Mask::Causal { q_offset: 1, q_stride: 4, k_offset: 3, k_stride: 4 },
            Mask::Causal { q_offset: 0, q_stride: 2, k_offset: 0, k_stride: 3 },
            Mask::sliding_window(1),
            Mask::sliding_window(4),
            Mask::Window { q_offset: 20, q_stride: 3, k_offset: 2, k_stride: 2, window: 9 },
            Mask::Window { q_offset: 0, q_stride: 1, k_offset: 30, k_stride: 1, window: 5 },
        ];
        let (t, s) = (13, 17);
        for m in masks {
            let band = Band::from_mask(&m, t, s);
            Band::new(1, t, s, band.lo.clone(), band.hi.clone()).unwrap();
            for i in 0..t {
                for j in 0..s {
                    assert_eq!(m.visible(i, j), band.visible(0, i, j), "{m:?} ({i}, {j})");
                }
            }
        }
    }

    #[test]
    fn from_positions_is_documents_visible() -> Result<()> {
        let docs = Documents::from_lengths(&[3, 1, 6, 2, 8])?;
        let q: Vec<usize> = (0..20).step_by(3).collect();
        let k: Vec<usize> = (1..20).step_by(2).collect();
        for (causal, window) in [(true, None), (false, None), (true, Some(1)), (true, Some(3)), (true, Some(50))] {
            let spec = MaskSpec { causal, window, docs: Some(&docs) };
            let band = Band::from_positions(&q, &k, spec)?;
            for (i, &qp) in q.iter().enumerate() {
                for (j, &kp) in k.iter().enumerate() {
                    let want = docs.visible(qp, kp, causal) && window.is_none_or(|w| qp - kp < w);
                    assert_eq!(band.visible(0, i, j), want, "{spec:?} q {qp} k {kp}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn bad_bands_are_errors() {
        assert!(Band::new(1, 2, 4, vec![0, 1], vec![2, 1]).is_err()); // hi decreases... and lo > hi
        assert!(Band::new(1, 2, 4, vec![1, 0], vec![2, 3]).is_err()); // lo decreases
        assert!(Band::new(1, 2, 4, vec![0, 0], vec![2, 5]).is_err()); // hi > s
        assert!(Band::new(2, 2, 4, vec![0, 0], vec![2, 3]).is_err()); // wrong length
        assert!(Band::from_positions(&[0, 2, 1], &[0, 1], MaskSpec::plain(true)).is_err());
        let spec = MaskSpec { causal: false, window: Some(2), docs: None };
        assert!(Band::from_positions(&[0, 1], &[0, 1], spec).is_err());
        let b = Band::from_mask(&Mask::causal(), 4, 4);
        assert!(b.check("t", 1, 4, 5).is_err());
        let st = Band::stack(&[b.clone(), Band::from_mask(&Mask::Full, 4, 4)]).unwrap();
        assert_eq!((st.batch(), st.pairs()), (2, 10 + 16));
        assert_eq!(st.narrow_rows(1, 2).unwrap().row(1).0, &[0, 0]);
        assert!(Band::stack(&[b, Band::from_mask(&Mask::Full, 4, 3)]).is_err());
        // trim: keys [2, 7) of 10
        let w = Band::new(1, 3, 10, vec![2, 2, 4], vec![3, 6, 7]).unwrap();
        let (k0, tw) = w.trim_keys();
        assert_eq!((k0, tw.keys(), tw.lo(), tw.hi()), (2, 5, &[0u32, 0, 2][..], &[1u32, 4, 5][..]));
        for i in 0..3 {
            for j in 0..5 {
                assert_eq!(tw.visible(0, i, j), w.visible(0, i, j + 2));
            }
        }
        let e = Band::new(1, 2, 4, vec![1, 3], vec![1, 3]).unwrap();
        assert_eq!(e.trim_keys().1.keys(), 0);
    }

    /// On the CPU `upload_all` keeps no device copy (the kernels read the host bounds), and a
    /// band equals another with the same bounds whatever their device copies. (The CUDA side:
    /// `gpu_check --sections band`, "Band::upload_all".)
    #[test]
    fn upload_all_is_a_no_op_on_the_cpu() {
        let mut a = Band::from_mask(&Mask::causal(), 5, 5);
        let mut b = Band::new(1, 5, 5, vec![0; 5], vec![1, 2, 3, 4, 5]).unwrap();
        Band::upload_all([&mut a, &mut b], &Device::Cpu).unwrap();
        assert!(a.device_bounds(&Device::Cpu).is_none());
        assert_eq!(a, b);
        assert_ne!(a, Band::from_mask(&Mask::Full, 5, 5));
    }
}
