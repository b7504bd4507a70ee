//! Reference attention cases in the oracle format, and the metrics to compare against them.
//!
//! An oracle file (`tests/data/oracle/attn/*.safetensors`) holds q `[B, T, H, D]`,
//! k/v `[B, T, Hkv, D]`, dout `[B, T, H, D]` and the float64-computed (stored as f32) results
//! out `[B, T, H, D]`, lse `[B, H, T]`, dq, dk, dv (gradients of `sum(out * dout)`), plus header
//! metadata `causal`, `scale`, `sigma`, `case`.
//!
//! Metrics (README definitions): `abs = max|x - ref|`, `rel = max|x - ref| / max|ref|`.
//! Tolerances for f32 with `s = max(1, sigma²)`: out/lse abs `1e-5·s`, dq/dk/dv rel `2e-5·s`.
//! The metrics take *global* tensors: a parallel layout gathers its shards first.

#[path = "oracle_packed.rs"]
mod packed;
pub use packed::PackedOracle;

use crate::attention::{attention, Mask};
use candle_core::{DType, Device, Result, Tensor, Var};
use std::collections::HashMap;
use std::path::Path;

/// One oracle attention case (all tensors f32 on the CPU, global shapes).
#[derive(Clone, Debug)]
pub struct AttnCase {
    /// Case name (metadata `case`, else the file stem).
    pub name: String,
    /// Whether the mask is causal (query i sees keys j <= i) or full.
    pub causal: bool,
    /// Softmax scale (multiplies q·k).
    pub scale: f64,
    /// Input scale sigma (sets the tolerances).
    pub sigma: f64,
    /// Queries `[B, T, H, D]`.
    pub q: Tensor,
    /// Keys `[B, T, Hkv, D]`.
    pub k: Tensor,
    /// Values `[B, T, Hkv, D]`.
    pub v: Tensor,
    /// Upstream gradient `[B, T, H, D]`.
    pub dout: Tensor,
    /// Reference outputs and gradients.
    pub reference: AttnOutputs,
}

/// Results of one attention forward + backward (global tensors, any float dtype).
#[derive(Clone, Debug)]
pub struct AttnOutputs {
    /// `[B, T, H, D]`.
    pub out: Tensor,
    /// `[B, H, T]`, natural log.
    pub lse: Tensor,
    /// `[B, T, H, D]`.
    pub dq: Tensor,
    /// `[B, T, Hkv, D]`.
    pub dk: Tensor,
    /// `[B, T, Hkv, D]`.
    pub dv: Tensor,
}

fn meta_f64(meta: &HashMap<String, String>, key: &str, path: &Path) -> Result<f64> {
    let Some(s) = meta.get(key) else {
        candle_core::bail!("{}: header metadata has no `{key}`", path.display())
    };
    s.trim()
        .parse::<f64>()
        .map_err(|e| candle_core::Error::Msg(format!("{}: metadata {key} = {s:?} is not a number: {e}", path.display())))
}

impl AttnCase {
    /// Load a case from an oracle-format safetensors file; errors say which file and what is
    /// missing or malformed.
    pub fn load(path: impl AsRef<Path>) -> Result<AttnCase> {
        let path = path.as_ref();
        let bytes = std::fs::read(path)
            .map_err(|e| candle_core::Error::Msg(format!("cannot read {}: {e}", path.display())))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| candle_core::Error::Msg(format!("{}: not a safetensors file: {e}", path.display())))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let causal = match meta.get("causal").map(|s| s.trim().to_ascii_lowercase()) {
            Some(s) if s == "true" => true,
            Some(s) if s == "false" => false,
            other => candle_core::bail!("{}: metadata `causal` must be \"true\"/\"false\", got {other:?}", path.display()),
        };
        let scale = meta_f64(&meta, "scale", path)?;
        let sigma = meta_f64(&meta, "sigma", path)?;
        let name = meta.get("case").cloned().unwrap_or_else(|| {
            path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
        });
        let mut ts = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)?;
        let mut take = |n: &str| -> Result<Tensor> {
            match ts.remove(n) {
                Some(t) => t.to_dtype(DType::F32),
                None => candle_core::bail!("{}: missing tensor `{n}`", path.display()),
            }
        };
        let (q, k, v, dout) = (take("q")?, take("k")?, take("v")?, take("dout")?);
        let reference = AttnOutputs { out: take("out")?, lse: take("lse")?, dq: take("dq")?, dk: take("dk")?, dv: take("dv")? };
        let case = AttnCase { name, causal, scale, sigma, q, k, v, dout, reference };
        case.check_shapes(path)?;
        Ok(case)
    }

    fn check_shapes(&self, path: &Path) -> Result<()> {
        let (q, k, r) = (self.q.dims(), self.k.dims(), &self.reference);
        let ok = q.len() == 4
            && k.len() == 4
            && k[0] == q[0]
            && k[3] == q[3]
            && k[2] > 0
            && q[2] % k[2] == 0
            && self.v.dims() == k
            && self.dout.dims() == q
            && r.out.dims() == q
            && r.dq.dims() == q
            && r.dk.dims() == k
            && r.dv.dims() == k
            && r.lse.dims() == [q[0], q[2], q[1]];
        if !ok {
            candle_core::bail!(
                "{}: inconsistent shapes q {:?}, k {:?}, v {:?}, dout {:?}, out {:?}, lse {:?}, dq {:?}, dk {:?}, dv {:?} \
                 (want q/dout/out/dq [B,T,H,D], k/v/dk/dv [B,S,Hkv,D] with H % Hkv == 0, lse [B,H,T])",
                path.display(), self.q.shape(), self.k.shape(), self.v.shape(), self.dout.shape(),
                r.out.shape(), r.lse.shape(), r.dq.shape(), r.dk.shape(), r.dv.shape()
            )
        }
        Ok(())
    }

    /// The case's mask: plain causal or full (queries and keys share positions 0..T).
    pub fn mask(&self) -> Mask {
        if self.causal {
            Mask::causal()
        } else {
            Mask::Full
        }
    }

    /// The tolerances for this case (f32 implementation).
    pub fn tolerances(&self) -> AttnTol {
        AttnTol::for_sigma(self.sigma)
    }
}

/// Single-device run of a case through the autograd op [`attention`]: forward, then
/// backward of `sum(out * dout)`.
pub fn run_single(case: &AttnCase) -> Result<AttnOutputs> {
    run_single_with(case, |q, k, v| attention(q, k, v, &case.mask(), case.scale))
}

/// [`run_single`] with any single-device attention `attn(q, k, v) -> (out, lse)` (a packed or
/// windowed mask, a reference implementation): out, lse and the gradients of
/// `sum(out * dout)` through candle autograd.
pub fn run_single_with(case: &AttnCase, attn: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)>) -> Result<AttnOutputs> {
    let q = Var::from_tensor(&case.q)?;
    let k = Var::from_tensor(&case.k)?;
    let v = Var::from_tensor(&case.v)?;
    let (out, lse) = attn(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
    let loss = (&out * &case.dout)?.sum_all()?;
    let grads = loss.backward()?;
    let grad = |x: &Var, n: &str| -> Result<Tensor> {
        match grads.get(x.as_tensor()) {
            Some(g) => Ok(g.clone()),
            None => candle_core::bail!("run_single ({}): no gradient for {n}", case.name),
        }
    };
    Ok(AttnOutputs { out, lse, dq: grad(&q, "q")?, dk: grad(&k, "k")?, dv: grad(&v, "v")? })
}

/// Deterministic N(0, sigma²) f32 tensor of `shape` on the CPU from `seed` (xorshift +
/// Box–Muller), so tests, checks and benches get seeded inputs without a rand crate.
pub fn randn(seed: u64, shape: &[usize], sigma: f32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let v: Vec<f32> = (0..n)
        .map(|_| {
            let (u1, u2) = (next(), next());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32 * sigma
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
}

fn diff_stats(a: &Tensor, r: &Tensor, what: &str) -> Result<(f64, f64)> {
    if a.dims() != r.dims() {
        candle_core::bail!("{what}: shape {:?} differs from reference {:?}", a.shape(), r.shape())
    }
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let r = r.to_device(&Device::Cpu)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let (mut err, mut mag) = (0f64, 0f64);
    for (x, y) in a.iter().zip(&r) {
        // Equal values (including equal infinities, e.g. lse -inf of a fully masked row) are exact.
        let e = if x == y { 0.0 } else { (x - y).abs() };
        if e.is_nan() {
            return Ok((f64::NAN, mag));
        }
        err = err.max(e);
        if y.is_finite() {
            mag = mag.max(y.abs());
        }
    }
    Ok((err, mag))
}

/// `max |a - ref|` (NaN if any difference is NaN; infinite if infinities disagree).
/// Errors if the shapes differ.
pub fn abs_err(a: &Tensor, reference: &Tensor) -> Result<f64> {
    Ok(diff_stats(a, reference, "abs_err")?.0)
}

/// `max |a - ref| / max |ref|` (the plain abs error if the reference is all zero).
pub fn rel_err(a: &Tensor, reference: &Tensor) -> Result<f64> {
    let (e, m) = diff_stats(a, reference, "rel_err")?;
    Ok(if m > 0.0 { e / m } else { e })
}

/// Tolerances: out/lse absolute, dq/dk/dv relative (see [`rel_err`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnTol {
    /// Bound on `max|out - ref|`.
    pub out_abs: f64,
    /// Bound on `max|lse - ref|`.
    pub lse_abs: f64,
    /// Bound on `rel_err(dq)`.
    pub dq_rel: f64,
    /// Bound on `rel_err(dk)`.
    pub dk_rel: f64,
    /// Bound on `rel_err(dv)`.
    pub dv_rel: f64,
}

impl AttnTol {
    /// Oracle README tolerances for f32: `s = max(1, sigma²)`, out/lse abs `1e-5·s`,
    /// dq/dk/dv rel `2e-5·s`.
    pub fn for_sigma(sigma: f64) -> Self {
        let s = (sigma * sigma).max(1.0);
        Self { out_abs: 1e-5 * s, lse_abs: 1e-5 * s, dq_rel: 2e-5 * s, dk_rel: 2e-5 * s, dv_rel: 2e-5 * s }
    }

    /// Every bound multiplied by `f` (e.g. looser bounds for bf16/f16 runs).
    pub fn scaled(&self, f: f64) -> Self {
        Self {
            out_abs: self.out_abs * f,
            lse_abs: self.lse_abs * f,
            dq_rel: self.dq_rel * f,
            dk_rel: self.dk_rel * f,
            dv_rel: self.dv_rel * f,
        }
    }
}

/// Errors of one run against a reference (global tensors).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnMetrics {
    /// `max|out - ref|`.
    pub out_abs: f64,
    /// `max|lse - ref|`.
    pub lse_abs: f64,
    /// `max|dq - ref| / max|ref|`.
    pub dq_rel: f64,
    /// `max|dk - ref| / max|ref|`.
    pub dk_rel: f64,
    /// `max|dv - ref| / max|ref|`.
    pub dv_rel: f64,
}

impl AttnMetrics {
    /// Compare gathered global results with reference ones (shapes must match).
    pub fn compute(got: &AttnOutputs, reference: &AttnOutputs) -> Result<Self> {
        Ok(Self {
            out_abs: abs_err(&got.out, &reference.out)?,
            lse_abs: abs_err(&got.lse, &reference.lse)?,
            dq_rel: rel_err(&got.dq, &reference.dq)?,
            dk_rel: rel_err(&got.dk, &reference.dk)?,
            dv_rel: rel_err(&got.dv, &reference.dv)?,
        })
    }

    fn rows(&self, tol: &AttnTol) -> [(&'static str, f64, f64); 5] {
        [
            ("out_abs", self.out_abs, tol.out_abs),
            ("lse_abs", self.lse_abs, tol.lse_abs),
            ("dq_rel", self.dq_rel, tol.dq_rel),
            ("dk_rel", self.dk_rel, tol.dk_rel),
            ("dv_rel", self.dv_rel, tol.dv_rel),
        ]
    }

    /// Every metric within its bound (NaN fails).
    pub fn passes(&self, tol: &AttnTol) -> bool {
        self.rows(tol).iter().all(|(_, x, t)| *x <= *t)
    }

    /// Names of the metrics over their bound.
    pub fn failures(&self, tol: &AttnTol) -> Vec<&'static str> {
        use std::cmp::Ordering::{Equal, Less};
        // NaN compares as None: a failure.
        self.rows(tol)
            .iter()
            .filter(|(_, x, t)| !matches!(x.partial_cmp(t), Some(Less | Equal)))
            .map(|(n, _, _)| *n)
            .collect()
    }

    /// One line per metric: `name  value  (tol bound) ok|FAIL`.
    pub fn report(&self, tol: &AttnTol) -> String {
        self.rows(tol)
            .iter()
            .map(|(n, x, t)| format!("{n:<8} {x:.3e}  (tol {t:.1e}) {}\n", if *x <= *t { "ok" } else { "FAIL" }))
            .collect()
    }
}
