//! Weight-only quantization of frozen weights (a LoRA run's base, QLoRA-style): int8 or
//! 4-bit NormalFloat (NF4) codes with one f32 absmax scale per group of `group` consecutive
//! inputs of a row, dequantized on the fly by plain candle ops (any device).
//!
//! ```text
//! weight [out, in]  →  rows split into groups of g inputs:   w[o, k·g .. (k+1)·g]
//!   int8: code = round(127·w / absmax) + 128  (1 byte per weight)    w ≈ (code − 128)·s, s = absmax/127
//!   nf4:  code = nearest NF4 level of w / absmax  (2 codes per byte) w ≈ NF4[code]·s, s = absmax
//!   scales s [out, in/g] f32
//! ```
//!
//! The groups run along the input dimension inside a row, so a TP shard of the weight (rows for
//! a column-parallel layer, columns for a row-parallel one, whole groups as long as `g` divides
//! the local input width) quantizes to the same codes as the same slice of the whole weight
//! quantized: every layout computes with the same dequantized values (test
//! `shards_quantize_as_slices_of_the_whole`). Bytes per weight: int8 `1 + 4/g`, NF4 `0.5 + 4/g`
//! (`g = 64`: 1.06 and 0.56, against 2 for bf16). With double quantization
//! ([`QuantConfig::double`], QLoRA's idea in a form that shards) the f32 scales are themselves
//! stored as u8 codes on a grid per block of `R` rows of one scale column (`lo + code·step`):
//! `1/g + 8/(g·R)` bytes of scales per weight instead of `4/g` (NF4, `g = 64`, `R = 16`: 0.523).
//!
//! [`QuantWeight::dequantize`] runs host loops on the CPU ([`QuantWeight::dequantize_host`], the
//! reference), one kernel on CUDA (`candle_cp_kernels::quant`, kernels/quant.cu: reads the codes
//! and scales once, writes the weight once) and candle ops, a chunk of rows at a time, on other
//! devices ([`QuantWeight::dequantize_ops`]); all equal bit for bit (tested on the CPU; the kernel
//! against the host loops under the CUDA emulation and in `gpu_check --sections quant`, and the
//! CUDA path's fine-tune under the host CUDA shim in `.ci/run`).

use candle_core::{bail, DType, Device, Result, Tensor};

/// The 16 levels of 4-bit NormalFloat (Dettmers et al., QLoRA, 2023): quantiles of a standard
/// normal scaled to [-1, 1], with an exact 0.
pub const NF4_LEVELS: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// Elements per chunk of [`QuantWeight::dequantize_ops`] (bounds its f32 temporaries: about
/// 30 bytes per element for NF4).
pub const DEQUANT_CHUNK: usize = 1 << 22;

/// How frozen weights are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantKind {
    /// Symmetric int8 per group: 127 levels each side of 0.
    Int8,
    /// 4-bit NormalFloat per group ([`NF4_LEVELS`]), two codes per byte.
    Nf4,
}

impl std::str::FromStr for QuantKind {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "int8" => Ok(Self::Int8),
            "nf4" => Ok(Self::Nf4),
            _ => bail!("quantization '{s}': expected int8 or nf4"),
        }
    }
}

impl std::fmt::Display for QuantKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Int8 => "int8",
            Self::Nf4 => "nf4",
        })
    }
}

/// Kind and group width of a quantization, and whether its scales are quantized too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantConfig {
    /// Int8 or NF4.
    pub kind: QuantKind,
    /// Inputs per scale (even, > 0; must divide each quantized weight's local input width).
    pub group: usize,
    /// Double quantization (QLoRA's, in a form that shards): the f32 scales `[out, in/g]`
    /// stored as u8 codes on a grid per block of this many consecutive rows of one scale
    /// column (`s ≈ lo + code·step`, `lo` the block's least scale, `step` its range / 255; both
    /// f32 per block). Must divide each quantized weight's local output width (rows split by
    /// column-parallel TP keep whole blocks, columns split by row-parallel TP cut none). `None`:
    /// f32 scales.
    pub double: Option<usize>,
}

/// Rows per double-quantization block when `,dq` names none (`QuantConfig`'s `FromStr`).
pub const DQ_ROWS: usize = 16;

impl QuantConfig {
    /// `kind` with groups of `group` inputs, f32 scales.
    pub fn new(kind: QuantKind, group: usize) -> Result<Self> {
        if group == 0 || !group.is_multiple_of(2) {
            bail!("quantization: group {group} must be even and > 0")
        }
        Ok(Self { kind, group, double: None })
    }

    /// The same with the scales double-quantized in blocks of `rows` rows (> 0).
    pub fn with_double_quant(mut self, rows: usize) -> Result<Self> {
        if rows == 0 {
            bail!("quantization: double-quantization blocks of 0 rows")
        }
        self.double = Some(rows);
        Ok(self)
    }

    /// Bytes a quantized weight of `n` elements takes (codes and scales; with double
    /// quantization, whole blocks assumed).
    pub fn bytes(&self, n: usize) -> usize {
        let codes = match self.kind {
            QuantKind::Int8 => n,
            QuantKind::Nf4 => n / 2,
        };
        codes + match self.double {
            None => 4 * n / self.group,
            Some(b) => n / self.group + 8 * n / (self.group * b),
        }
    }
}

/// `KIND[,GROUP[,dq[ROWS]]]`: `int8` or `nf4`, groups of `GROUP` inputs (default 64), `dq` for
/// double-quantized scales in blocks of `ROWS` rows (default [`DQ_ROWS`]); e.g. `nf4,64,dq`.
impl std::str::FromStr for QuantConfig {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        let parts: Vec<&str> = s.split(',').map(str::trim).collect();
        let group = match parts.get(1) {
            None => 64,
            Some(g) => g.parse().map_err(|_| candle_core::Error::Msg(format!("quantization '{s}': group '{g}' is not a number")))?,
        };
        let cfg = Self::new(parts[0].parse()?, group)?;
        match parts.get(2..).unwrap_or(&[]) {
            [] => Ok(cfg),
            [dq] if dq.starts_with("dq") => {
                let rows = match &dq[2..] {
                    "" => DQ_ROWS,
                    r => r.parse().map_err(|_| candle_core::Error::Msg(format!("quantization '{s}': 'dq{r}': expected dq or dqROWS")))?,
                };
                cfg.with_double_quant(rows)
            }
            _ => bail!("quantization '{s}': expected KIND[,GROUP[,dq[ROWS]]], e.g. nf4,64,dq"),
        }
    }
}

impl std::fmt::Display for QuantConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{},{}", self.kind, self.group)?;
        match self.double {
            Some(b) => write!(f, ",dq{b}"),
            None => Ok(()),
        }
    }
}

/// How a [`QuantWeight`] holds its scales.
#[derive(Clone, Debug)]
enum Scales {
    /// f32 `[out, in/g]`.
    F32(Tensor),
    /// Double-quantized ([`QuantConfig::double`], `b` rows a block): u8 codes `[out, in/g]`,
    /// and per block its least scale `lo` and `step`, f32 `[out/b, in/g]` each.
    Double { codes: Tensor, lo: Tensor, step: Tensor },
}

/// A quantized 2-D weight `[out, in]`: codes (u8) and per-group scales (f32) on a device.
#[derive(Clone, Debug)]
pub struct QuantWeight {
    /// `[out, in]` (int8) or `[out, in/2]` (NF4, element `2j` in the low nibble).
    codes: Tensor,
    /// `[out, in/g]`: each group's absmax (NF4) or absmax / 127 (int8: one code's step), as f32
    /// or double-quantized.
    scales: Scales,
    cfg: QuantConfig,
    out_dim: usize,
    in_dim: usize,
}

impl QuantWeight {
    /// Quantize `w` `[out, in]` (any float dtype and device; the codes and scales go to `w`'s
    /// device). Errors when `w` is not 2-D, `cfg.group` does not divide `in`, or the
    /// double-quantization rows do not divide `out`.
    pub fn quantize(w: &Tensor, cfg: QuantConfig) -> Result<Self> {
        let (out_dim, in_dim) = w.dims2().map_err(|_| candle_core::Error::Msg(format!("quantize: weight {:?} is not [out, in]", w.dims())))?;
        let g = cfg.group;
        if in_dim % g != 0 {
            bail!("quantize: group {g} does not divide the input width of weight {:?} (under TP, of its local shard)", w.dims())
        }
        if let Some(b) = cfg.double.filter(|b| !out_dim.is_multiple_of(*b)) {
            bail!("quantize: double-quantization blocks of {b} rows do not divide the output width of weight {:?} (under TP, of its local shard)", w.dims())
        }
        let host = w.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        let n_groups = out_dim * in_dim / g;
        let mut scales = Vec::with_capacity(n_groups);
        let mut codes: Vec<u8> = match cfg.kind {
            QuantKind::Int8 => Vec::with_capacity(host.len()),
            QuantKind::Nf4 => vec![0; host.len() / 2],
        };
        for (k, grp) in host.chunks(g).enumerate() {
            let amax = grp.iter().fold(0f32, |m, x| m.max(x.abs()));
            // int8: the step of a code (one multiply to dequantize); NF4: the absmax
            scales.push(match cfg.kind {
                QuantKind::Int8 => amax / 127.0,
                QuantKind::Nf4 => amax,
            });
            let inv = if amax > 0.0 { 1.0 / amax } else { 0.0 };
            for (j, &x) in grp.iter().enumerate() {
                match cfg.kind {
                    QuantKind::Int8 => codes.push(((x * inv * 127.0).round().clamp(-127.0, 127.0) as i32 + 128) as u8),
                    QuantKind::Nf4 => {
                        let c = nearest_nf4(x * inv);
                        let e = k * g + j;
                        codes[e / 2] |= if e.is_multiple_of(2) { c } else { c << 4 };
                    }
                }
            }
        }
        let dev = w.device();
        let code_cols = match cfg.kind {
            QuantKind::Int8 => in_dim,
            QuantKind::Nf4 => in_dim / 2,
        };
        let cols = in_dim / g;
        let scales = match cfg.double {
            None => Scales::F32(Tensor::from_vec(scales, (out_dim, cols), &Device::Cpu)?.to_device(dev)?),
            Some(b) => {
                let (codes, lo, step) = double_quantize(&scales, cols, b);
                let blocks = (out_dim / b, cols);
                Scales::Double {
                    codes: Tensor::from_vec(codes, (out_dim, cols), &Device::Cpu)?.to_device(dev)?,
                    lo: Tensor::from_vec(lo, blocks, &Device::Cpu)?.to_device(dev)?,
                    step: Tensor::from_vec(step, blocks, &Device::Cpu)?.to_device(dev)?,
                }
            }
        };
        Ok(Self {
            codes: Tensor::from_vec(codes, (out_dim, code_cols), &Device::Cpu)?.to_device(dev)?,
            scales,
            cfg,
            out_dim,
            in_dim,
        })
    }

    /// The weight `[out, in]` in `dtype` on the codes' device: by host loops on the CPU
    /// ([`QuantWeight::dequantize_host`]), by one kernel on CUDA (feature `cuda`:
    /// `candle_cp_kernels::quant::dequantize`, one pass over the codes), by candle ops elsewhere
    /// ([`QuantWeight::dequantize_ops`]); the same values every way.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        match self.codes.device() {
            Device::Cpu => self.dequantize_host()?.to_dtype(dtype),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => {
                use candle_cp_kernels::quant::{dequantize, Codes};
                let kind = match self.cfg.kind {
                    QuantKind::Int8 => Codes::Int8,
                    QuantKind::Nf4 => Codes::Nf4,
                };
                dequantize(&self.codes, &self.scales()?, kind, self.cfg.group, (self.out_dim, self.in_dim), dtype)
            }
            _ => self.dequantize_ops(dtype),
        }
    }

    /// The codes: u8 `[out, in]` (int8) or `[out, in/2]` (NF4, element `2j` in the low nibble).
    pub fn codes(&self) -> &Tensor {
        &self.codes
    }

    /// The scales: f32 `[out, in/g]`, each group's absmax (NF4) or absmax / 127 (int8); when
    /// double-quantized, decoded by candle ops on their device (`lo + code·step`: a multiply,
    /// then an add, each rounded, as [`QuantWeight::dequantize_host`] computes them).
    pub fn scales(&self) -> Result<Tensor> {
        match &self.scales {
            Scales::F32(s) => Ok(s.clone()),
            Scales::Double { codes, lo, step } => {
                let (o, cols) = codes.dims2()?;
                let b = self.cfg.double.unwrap_or(1);
                let c = codes.to_dtype(DType::F32)?.reshape((o / b, b, cols))?;
                c.broadcast_mul(&step.unsqueeze(1)?)?.broadcast_add(&lo.unsqueeze(1)?)?.reshape((o, cols))
            }
        }
    }

    /// [`QuantWeight::scales`] on the host by loops (the reference).
    fn scales_host(&self) -> Result<Vec<f32>> {
        let host = |t: &Tensor| -> Result<Vec<f32>> { t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>() };
        match &self.scales {
            Scales::F32(s) => host(s),
            Scales::Double { codes, lo, step } => {
                let codes = codes.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u8>()?;
                let (lo, step) = (host(lo)?, host(step)?);
                let cols = self.in_dim / self.cfg.group;
                let b = self.cfg.double.unwrap_or(1);
                Ok(codes.iter().enumerate().map(|(k, &c)| {
                    let blk = (k / cols / b) * cols + k % cols;
                    lo[blk] + c as f32 * step[blk]
                }).collect())
            }
        }
    }

    /// [`QuantWeight::dequantize`] by candle ops on the codes' device (any device), in chunks of
    /// rows so that the f32 temporaries stay within [`DEQUANT_CHUNK`] elements whatever the
    /// weight's size; the output alone is full-size.
    pub fn dequantize_ops(&self, dtype: DType) -> Result<Tensor> {
        let (o, i) = (self.out_dim, self.in_dim);
        let rows = (DEQUANT_CHUNK / i.max(1)).clamp(1, o.max(1));
        // (decoded once: double-quantized scales are rebuilt by ops)
        let scales = self.scales()?;
        let mut parts = Vec::with_capacity(o.div_ceil(rows));
        let mut r = 0;
        while r < o {
            let n = rows.min(o - r);
            parts.push(self.dequantize_rows(r, n, &scales, dtype)?);
            r += n;
        }
        if parts.len() == 1 {
            return Ok(parts.remove(0));
        }
        Tensor::cat(&parts, 0)
    }

    /// Rows `r0 .. r0 + n` of the weight in `dtype`, by candle ops (`scales`: all of them, f32).
    fn dequantize_rows(&self, r0: usize, n: usize, scales: &Tensor, dtype: DType) -> Result<Tensor> {
        let (i, g) = (self.in_dim, self.cfg.group);
        let c = self.codes.narrow(0, r0, n)?.to_dtype(DType::F32)?;
        let unit = match self.cfg.kind {
            QuantKind::Int8 => (c - 128.0)?,
            QuantKind::Nf4 => {
                let hi = (&c / 16.0)?.floor()?;
                let lo = (c - (&hi * 16.0)?)?;
                let idx = Tensor::stack(&[lo, hi], 2)?.flatten_all()?.to_dtype(DType::U32)?;
                let levels = Tensor::new(&NF4_LEVELS, self.codes.device())?;
                levels.index_select(&idx, 0)?
            }
        };
        let scales = scales.narrow(0, r0, n)?;
        unit.reshape((n, i / g, g))?.broadcast_mul(&scales.unsqueeze(2)?)?.reshape((n, i))?.to_dtype(dtype)
    }

    /// The weight `[out, in]` in f32 on the host, by loops over the codes: the CPU path of
    /// [`QuantWeight::dequantize`] and the reference of [`QuantWeight::dequantize_ops`].
    pub fn dequantize_host(&self) -> Result<Tensor> {
        let codes = self.codes.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u8>()?;
        let scales = self.scales_host()?;
        let n = self.out_dim * self.in_dim;
        let w: Vec<f32> = (0..n)
            .map(|e| {
                let s = scales[e / self.cfg.group];
                match self.cfg.kind {
                    QuantKind::Int8 => (codes[e] as f32 - 128.0) * s,
                    QuantKind::Nf4 => NF4_LEVELS[((codes[e / 2] >> (4 * (e % 2))) & 15) as usize] * s,
                }
            })
            .collect();
        Tensor::from_vec(w, (self.out_dim, self.in_dim), &Device::Cpu)
    }

    /// `[out, in]`.
    pub fn dims(&self) -> (usize, usize) {
        (self.out_dim, self.in_dim)
    }

    /// Kind and group.
    pub fn config(&self) -> QuantConfig {
        self.cfg
    }

    /// Bytes held (codes and scales).
    pub fn bytes(&self) -> usize {
        self.codes.elem_count()
            + match &self.scales {
                Scales::F32(s) => 4 * s.elem_count(),
                Scales::Double { codes, lo, step } => codes.elem_count() + 4 * (lo.elem_count() + step.elem_count()),
            }
    }
}

/// Double quantization of `scales` (`[out, cols]` row-major, all >= 0) in blocks of `b` rows of
/// one column: u8 codes `[out, cols]`, and per block `[out/b, cols]` its least scale and step
/// (its range / 255; 0 for a block of equal scales, whose codes are all 0). A scale decodes to
/// `lo + code·step`, within half a step of its value.
fn double_quantize(scales: &[f32], cols: usize, b: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    let blocks = scales.len() / cols / b;
    let (mut lo, mut step) = (vec![0f32; blocks * cols], vec![0f32; blocks * cols]);
    let mut codes = vec![0u8; scales.len()];
    for r in 0..blocks {
        for c in 0..cols {
            let at = |i: usize| (r * b + i) * cols + c;
            let (mn, mx) = (0..b).map(|i| scales[at(i)]).fold((f32::INFINITY, f32::NEG_INFINITY), |(a, z), s| (a.min(s), z.max(s)));
            let st = (mx - mn) / 255.0;
            (lo[r * cols + c], step[r * cols + c]) = (mn, st);
            if st > 0.0 {
                for i in 0..b {
                    codes[at(i)] = ((scales[at(i)] - mn) / st).round().clamp(0.0, 255.0) as u8;
                }
            }
        }
    }
    (codes, lo, step)
}

/// The index of the NF4 level nearest `x` (in [-1, 1]); ties to the lower level.
fn nearest_nf4(x: f32) -> u8 {
    let mut best = 0;
    for (k, l) in NF4_LEVELS.iter().enumerate() {
        if (x - l).abs() < (x - NF4_LEVELS[best]).abs() {
            best = k;
        }
    }
    best as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_cp_ops::oracle::randn;

    fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
        (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// The candle-op dequantization equals the host loops bit for bit, and the error is within
    /// half a step of each group's grid: `absmax/254` (int8), half the widest NF4 gap times the
    /// absmax (NF4); each group's absmax is exact.
    #[test]
    fn dequantize_matches_the_reference_within_half_a_step() -> Result<()> {
        let w = randn(3, &[12, 64], 1.0)?;
        let nf4_gap = NF4_LEVELS.windows(2).map(|p| p[1] - p[0]).fold(0f32, f32::max);
        for (kind, step) in [(QuantKind::Int8, 1.0 / 254.0), (QuantKind::Nf4, nf4_gap / 2.0)] {
            let q = QuantWeight::quantize(&w, QuantConfig::new(kind, 16)?)?;
            let (fast, slow) = (q.dequantize_ops(DType::F32)?, q.dequantize_host()?);
            assert_eq!(max_abs(&fast, &slow)?, 0.0, "{kind}: candle ops vs host loops");
            assert_eq!(max_abs(&q.dequantize(DType::F32)?, &slow)?, 0.0, "{kind}: the CPU path");
            let err = (&fast - &w)?.abs()?.reshape((12, 4, 16))?;
            let amax = w.abs()?.reshape((12, 4, 16))?.max_keepdim(2)?;
            let worst = err.broadcast_div(&amax)?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(worst <= step + 1e-6, "{kind}: error {worst} of the absmax, bound {step}");
            let back = fast.abs()?.reshape((12, 4, 16))?.max_keepdim(2)?;
            assert!(max_abs(&back, &amax)? < 1e-6, "{kind}: each group's absmax is a level");
            assert_eq!(q.bytes(), QuantConfig::new(kind, 16)?.bytes(12 * 64));
        }
        // bf16 out, zeros stay zeros
        let z = QuantWeight::quantize(&Tensor::zeros((2, 8), DType::F32, &Device::Cpu)?, QuantConfig::new(QuantKind::Nf4, 8)?)?;
        assert_eq!(z.dequantize(DType::BF16)?.dtype(), DType::BF16);
        assert_eq!(z.dequantize(DType::F32)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        Ok(())
    }

    /// A weight wider than a chunk: one row per chunk of the candle-op path, the host loops'
    /// values bit for bit.
    #[test]
    fn chunked_dequantization_matches_the_host() -> Result<()> {
        let i = DEQUANT_CHUNK / 2 + 64;
        let w = (Tensor::arange(0f32, (3 * i) as f32, &Device::Cpu)? * 0.37)?.sin()?.reshape((3, i))?;
        for kind in [QuantKind::Int8, QuantKind::Nf4] {
            let q = QuantWeight::quantize(&w, QuantConfig::new(kind, 64)?)?;
            assert_eq!(max_abs(&q.dequantize_ops(DType::F32)?, &q.dequantize_host()?)?, 0.0, "{kind}");
        }
        Ok(())
    }

    /// A row shard and a column shard (whole groups) quantize to the matching slice of the whole
    /// weight's dequantized values, so every TP layout computes with the same weights.
    #[test]
    fn shards_quantize_as_slices_of_the_whole() -> Result<()> {
        let w = randn(5, &[8, 48], 0.5)?;
        for kind in [QuantKind::Int8, QuantKind::Nf4] {
            let cfg = QuantConfig::new(kind, 8)?;
            let whole = QuantWeight::quantize(&w, cfg)?.dequantize(DType::F32)?;
            let rows = QuantWeight::quantize(&w.narrow(0, 4, 4)?, cfg)?.dequantize(DType::F32)?;
            assert_eq!(max_abs(&rows, &whole.narrow(0, 4, 4)?)?, 0.0, "{kind}: rows");
            let cols = QuantWeight::quantize(&w.narrow(1, 24, 24)?, cfg)?.dequantize(DType::F32)?;
            assert_eq!(max_abs(&cols, &whole.narrow(1, 24, 24)?)?, 0.0, "{kind}: columns");
        }
        Ok(())
    }

    /// Double-quantized scales: the same weight codes as f32 scales, each scale within half a
    /// step of its block's grid, host loops and candle ops equal bit for bit, the bytes
    /// counted, shards of whole blocks (rows) and any columns equal to the whole's slices, and
    /// blocks that do not divide the rows refused by name.
    #[test]
    fn double_quantized_scales() -> Result<()> {
        let w = randn(7, &[32, 64], 0.5)?;
        for kind in [QuantKind::Int8, QuantKind::Nf4] {
            let plain = QuantWeight::quantize(&w, QuantConfig::new(kind, 16)?)?;
            let cfg = QuantConfig::new(kind, 16)?.with_double_quant(8)?;
            let dq = QuantWeight::quantize(&w, cfg)?;
            assert_eq!(max_abs(&dq.codes().to_dtype(DType::F32)?, &plain.codes().to_dtype(DType::F32)?)?, 0.0, "{kind}: weight codes");
            let (s, s0) = (dq.scales()?, plain.scales()?);
            // per block of 8 rows of a column: |s - s0| <= (max - min) / 255 / 2
            let blk = |t: &Tensor| t.reshape((4, 8, 4));
            let range = (blk(&s0)?.max_keepdim(1)? - blk(&s0)?.min_keepdim(1)?)?;
            let err = (blk(&s)? - blk(&s0)?)?.abs()?;
            let over = (err - range.broadcast_as((4, 8, 4))?.affine(0.5 / 255.0, 1e-7)?)?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(over <= 0.0, "{kind}: a scale off by {over} past half a step");
            assert!(max_abs(&s, &s0)? > 0.0, "{kind}: the scales are quantized");
            assert_eq!(max_abs(&Tensor::from_vec(dq.scales_host()?, (32, 4), &Device::Cpu)?, &s)?, 0.0, "{kind}: host scales vs ops");
            assert_eq!(max_abs(&dq.dequantize_ops(DType::F32)?, &dq.dequantize_host()?)?, 0.0, "{kind}: candle ops vs host loops");
            assert_eq!(dq.bytes(), cfg.bytes(32 * 64));
            assert_eq!(dq.bytes(), plain.bytes() - 3 * 32 * 4 + 8 * 4 * 4);
            let whole = dq.dequantize(DType::F32)?;
            let rows = QuantWeight::quantize(&w.narrow(0, 8, 16)?, cfg)?.dequantize(DType::F32)?;
            assert_eq!(max_abs(&rows, &whole.narrow(0, 8, 16)?)?, 0.0, "{kind}: rows");
            let cols = QuantWeight::quantize(&w.narrow(1, 16, 32)?, cfg)?.dequantize(DType::F32)?;
            assert_eq!(max_abs(&cols, &whole.narrow(1, 16, 32)?)?, 0.0, "{kind}: columns");
        }
        // a block of equal scales: step 0, decoded exactly
        let flat = QuantWeight::quantize(&Tensor::ones((4, 8), DType::F32, &Device::Cpu)?, QuantConfig::new(QuantKind::Nf4, 8)?.with_double_quant(4)?)?;
        assert_eq!(flat.dequantize(DType::F32)?.sum_all()?.to_scalar::<f32>()?, 32.0);
        let e = QuantWeight::quantize(&randn(1, &[12, 16], 1.0)?, QuantConfig::new(QuantKind::Nf4, 8)?.with_double_quant(8)?).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("8 rows") && e.contains("[12, 16]"), "{e}");
        Ok(())
    }

    /// `KIND[,GROUP[,dq[ROWS]]]` parsed and printed back.
    #[test]
    fn config_strings() -> Result<()> {
        let c: QuantConfig = "nf4,64,dq".parse()?;
        assert_eq!((c.kind, c.group, c.double), (QuantKind::Nf4, 64, Some(DQ_ROWS)));
        assert_eq!(c.to_string(), "nf4,64,dq16");
        assert_eq!("nf4,64,dq16".parse::<QuantConfig>()?, c);
        let c: QuantConfig = "int8".parse()?;
        assert_eq!((c.kind, c.group, c.double, c.to_string()), (QuantKind::Int8, 64, None, "int8,64".to_string()));
        assert_eq!("nf4, 32, dq8".parse::<QuantConfig>()?.double, Some(8));
        for bad in ["nf4,64,xx", "nf4,64,dq0", "nf4,x", "nf4,3", "int4", "nf4,64,dq,1"] {
            assert!(bad.parse::<QuantConfig>().is_err(), "{bad}");
        }
        Ok(())
    }

    #[test]
    fn bad_shapes_and_groups_are_refused() -> Result<()> {
        let w = randn(1, &[4, 12], 1.0)?;
        let e = QuantWeight::quantize(&w, QuantConfig::new(QuantKind::Int8, 8)?).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("group 8") && e.contains("[4, 12]"), "{e}");
        let e = QuantWeight::quantize(&randn(1, &[4, 4, 4], 1.0)?, QuantConfig::new(QuantKind::Int8, 4)?).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("[4, 4, 4]"), "{e}");
        assert!(QuantConfig::new(QuantKind::Nf4, 3).is_err() && QuantConfig::new(QuantKind::Nf4, 0).is_err());
        assert!("int4".parse::<QuantKind>().is_err());
        assert_eq!("nf4".parse::<QuantKind>()?, QuantKind::Nf4);
        Ok(())
    }
}
