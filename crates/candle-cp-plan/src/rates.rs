//! Measured attention rates by sequence length: the planner's attention time at the length
//! each layout's kernel calls actually run, instead of one rate for every chunk.
//!
//! A flash-attention kernel runs slower on short blocks (less work per launch and per tile
//! row), which is what a large CP degree hands it. With a table of measured rates
//! ([`AttnRates`], e.g. `gpu_bench`'s JSON lines via [`AttnRates::from_bench_jsonl`]) the
//! planner prices attention at the rate of the length `T` each kernel call sees
//! ([`kernel_tokens`]): the chunk `s/cp` for the ring and all-gather, the whole sequence for
//! Ulysses (heads are split, not tokens), `s/R` for 2-D with a ring of `R`.
//!
//! Between measured lengths the rates are interpolated linearly in `log T`; outside they are
//! held at the nearest measurement. Forward and backward combine into one rate for the
//! `1 + 2.5` FLOPs of a forward and its backward: `3.5 / (1/fwd + 2.5/bwd)`.

use crate::layout::{CpKind, Layout};
use crate::{plan_bail, Result, TFLOP};
use serde::Serialize;

/// One measurement: forward and backward FLOP/s at sequence length `tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RatePoint {
    /// Sequence length of the measured call, `T`.
    pub tokens: usize,
    /// Forward FLOP/s (FlashAttention convention: `4·B·H·T²·D`, halved when causal).
    pub fwd_flops: f64,
    /// Backward FLOP/s (2.5× the forward's FLOPs).
    pub bwd_flops: f64,
}

/// Attention rates by sequence length, sorted by `tokens`, one point per length.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AttnRates {
    /// The points.
    pub points: Vec<RatePoint>,
    /// Where they came from (a file name, "gpu_bench kernel WgmmaTma, non-causal" ...).
    pub source: String,
}

impl AttnRates {
    /// Builds the table; at a length measured more than once (several kernels) the fastest
    /// combined rate is kept. Errors on no points or on a rate that is not positive.
    pub fn new(mut points: Vec<RatePoint>, source: impl Into<String>) -> Result<Self> {
        if points.is_empty() {
            plan_bail!("attention rates: no measurements")
        }
        for p in &points {
            let ok = |x: f64| x.is_finite() && x > 0.0;
            if p.tokens == 0 || !ok(p.fwd_flops) || !ok(p.bwd_flops) {
                plan_bail!(
                    "attention rates: T = {} with forward {} and backward {} FLOP/s: lengths and rates must be positive",
                    p.tokens,
                    p.fwd_flops,
                    p.bwd_flops
                )
            }
        }
        let rate = |p: &RatePoint| combine(p.fwd_flops, p.bwd_flops);
        points.sort_by(|a, b| a.tokens.cmp(&b.tokens).then(rate(b).total_cmp(&rate(a))));
        points.dedup_by_key(|p| p.tokens);
        Ok(Self {
            points,
            source: source.into(),
        })
    }

    /// Reads `gpu_bench`'s JSON lines: the `"impl":"candle-cp"` rows with both `fwd_tflops`
    /// and `bwd_tflops` measured at the model's `head_dim` (their `"d"`; a row without one
    /// counts for any head dim). Non-causal rows when there are any (a ring step's blocks are
    /// mostly full), else the causal ones. Other lines (skips, ring and band rows, SDPA) are
    /// ignored. A file with no row at `head_dim` (e.g. a D = 128 run for a model with heads of
    /// 256) is read at the measured head dim nearest to it, and [`AttnRates::source`] says so.
    pub fn from_bench_jsonl(text: &str, source: &str, head_dim: usize) -> Result<Self> {
        let mut rows = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                plan_bail!("{source}: line {} is not JSON: {line}", n + 1)
            };
            if v.get("impl").and_then(|x| x.as_str()) != Some("candle-cp") {
                continue;
            }
            let num = |k: &str| v.get(k).and_then(|x| x.as_f64());
            let (Some(t), Some(f), Some(b)) = (num("t"), num("fwd_tflops"), num("bwd_tflops"))
            else {
                continue;
            };
            let p = RatePoint {
                tokens: t as usize,
                fwd_flops: f * TFLOP,
                bwd_flops: b * TFLOP,
            };
            let d = num("d").map(|d| d as usize);
            rows.push((d, v.get("causal").and_then(|x| x.as_bool()) == Some(true), p));
        }
        // the head dim to read: the model's if measured (or a row says none), else the nearest
        let measured: Vec<usize> = rows.iter().filter_map(|r| r.0).collect();
        let d_read = if measured.is_empty() || rows.iter().any(|r| r.0.is_none_or(|d| d == head_dim)) {
            head_dim
        } else {
            measured.iter().copied().min_by_key(|&d| (d.abs_diff(head_dim), d)).unwrap_or(head_dim)
        };
        let (mut full, mut causal) = (Vec::new(), Vec::new());
        for (d, is_causal, p) in rows {
            if d.is_some_and(|d| d != d_read) {
                continue;
            }
            if is_causal {
                causal.push(p);
            } else {
                full.push(p);
            }
        }
        let note = if d_read == head_dim {
            String::new()
        } else {
            format!("; measured at head dim {d_read}, none at the model's {head_dim}")
        };
        let (points, kind) = if full.is_empty() {
            (causal, "causal")
        } else {
            (full, "non-causal")
        };
        if points.is_empty() {
            plan_bail!("{source}: no \"impl\":\"candle-cp\" line with fwd_tflops and bwd_tflops (gpu_bench's kernel rows)")
        }
        Self::new(points, format!("{source} ({kind} rows{note})"))
    }

    /// Forward and backward FLOP/s at length `tokens` (module docs).
    pub fn at(&self, tokens: usize) -> (f64, f64) {
        let p = &self.points;
        let t = tokens.max(1);
        if t <= p[0].tokens {
            return (p[0].fwd_flops, p[0].bwd_flops);
        }
        let last = p[p.len() - 1];
        if t >= last.tokens {
            return (last.fwd_flops, last.bwd_flops);
        }
        let j = p.partition_point(|q| q.tokens <= t);
        let (a, b) = (p[j - 1], p[j]);
        let w = ((t as f64).ln() - (a.tokens as f64).ln())
            / ((b.tokens as f64).ln() - (a.tokens as f64).ln());
        let lerp = |x: f64, y: f64| x + w * (y - x);
        (lerp(a.fwd_flops, b.fwd_flops), lerp(a.bwd_flops, b.bwd_flops))
    }

    /// One rate for a forward and its backward at length `tokens`.
    pub fn combined(&self, tokens: usize) -> f64 {
        let (f, b) = self.at(tokens);
        combine(f, b)
    }
}

/// One rate for the `1 + 2.5` FLOPs of a forward at `fwd` and its backward at `bwd`.
fn combine(fwd: f64, bwd: f64) -> f64 {
    3.5 / (1.0 / fwd + 2.5 / bwd)
}

/// Sequence length of one attention kernel call under `l` for a global sequence `s`: the chunk
/// `s/cp` (ring, all-gather: queries of one chunk), `s` (Ulysses: all tokens, a share of the
/// heads), `s/R` (2-D, ring of `R`).
pub fn kernel_tokens(l: &Layout, s: usize) -> usize {
    match l.cp_kind {
        CpKind::Ulysses => s,
        CpKind::TwoD => s / l.ring_degree().max(1),
        CpKind::Ring | CpKind::Allgather => s / l.cp.max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(tokens: usize, f: f64, b: f64) -> RatePoint {
        RatePoint { tokens, fwd_flops: f * TFLOP, bwd_flops: b * TFLOP }
    }

    /// Exact at the points, linear in log T between (4096 → 8192 → 16384 halfway is 8192),
    /// held outside; the fastest of two measurements at one length is kept.
    #[test]
    fn interpolates_in_log_length() {
        let r = AttnRates::new(vec![pt(16384, 500.0, 400.0), pt(4096, 300.0, 200.0), pt(4096, 100.0, 100.0)], "t").unwrap();
        assert_eq!(r.points.len(), 2);
        assert_eq!(r.at(4096), (300.0 * TFLOP, 200.0 * TFLOP));
        assert_eq!(r.at(16384), (500.0 * TFLOP, 400.0 * TFLOP));
        let (f, b) = r.at(8192);
        assert!((f - 400.0 * TFLOP).abs() < 1e3 && (b - 300.0 * TFLOP).abs() < 1e3, "{f} {b}");
        assert_eq!(r.at(1024), r.at(4096));
        assert_eq!(r.at(1 << 20), r.at(16384));
        // 3.5 / (1/500 + 2.5/400) = 424.24 TFLOP/s
        assert!((r.combined(16384) / TFLOP - 3.5 / (1.0 / 500.0 + 2.5 / 400.0)).abs() < 1e-9);
        assert!(AttnRates::new(vec![], "t").is_err());
        assert!(AttnRates::new(vec![pt(4096, 0.0, 1.0)], "t").unwrap_err().0.contains("must be positive"));
    }

    #[test]
    fn reads_gpu_bench_lines() {
        let text = r#"
{"impl":"candle-cp","kernel":"WgmmaTma","dtype":"bf16","b":1,"h":16,"d":128,"t":4096,"causal":false,"fwd_ms":1.0,"fwd_tflops":300.00,"bwd_ms":3.0,"bwd_tflops":250.00}
{"impl":"candle-cp","kernel":"WgmmaTma","dtype":"bf16","b":1,"h":16,"d":128,"t":4096,"causal":true,"fwd_ms":1.0,"fwd_tflops":200.00,"bwd_ms":3.0,"bwd_tflops":150.00}
{"impl":"candle-cp","kernel":"Pipelined","t":8192,"causal":false,"fwd_tflops":350.0}
{"skipped":"budget","t":32768,"causal":false}
{"impl":"torch-sdpa","t":8192,"causal":false,"fwd_tflops":600.0,"bwd_tflops":500.0}
{"impl":"candle-cp","kernel":"WgmmaTma","t":16384,"causal":false,"fwd_tflops":400.0,"bwd_tflops":300.0}
"#;
        let r = AttnRates::from_bench_jsonl(text, "bench.jsonl", 128).unwrap();
        // the non-causal rows with a backward: 4096 and 16384
        assert_eq!(r.points, vec![pt(4096, 300.0, 250.0), pt(16384, 400.0, 300.0)]);
        assert!(r.source.contains("non-causal"));
        let causal_only = text.lines().filter(|l| !l.contains("\"causal\":false")).collect::<Vec<_>>().join("\n");
        let c = AttnRates::from_bench_jsonl(&causal_only, "b", 128).unwrap();
        assert_eq!(c.points, vec![pt(4096, 200.0, 150.0)]);
        assert!(AttnRates::from_bench_jsonl("{\"impl\":\"torch-sdpa\"}", "b", 128).unwrap_err().0.contains("no \"impl\""));
        assert!(AttnRates::from_bench_jsonl("not json", "b", 128).unwrap_err().0.contains("line 1 is not JSON"));
    }

    /// Rows of another head dim (gpu-check.sh's D = 256 step beside its D = 128 runs) are not
    /// read for a model of head dim 128, and are for one of 256; a model whose head dim has no
    /// row is read at the nearest measured one, and the source says so.
    #[test]
    fn reads_the_models_head_dim() {
        let text = r#"
{"impl":"candle-cp","kernel":"Pipelined","d":128,"t":4096,"causal":false,"fwd_tflops":300.0,"bwd_tflops":250.0}
{"impl":"candle-cp","kernel":"Pipelined","d":256,"t":4096,"causal":false,"fwd_tflops":500.0,"bwd_tflops":400.0}
{"impl":"candle-cp","kernel":"Simple","d":256,"t":4096,"causal":false,"fwd_tflops":20.0,"bwd_tflops":10.0}
{"impl":"candle-cp","kernel":"Pipelined","d":256,"t":16384,"causal":false,"fwd_tflops":450.0,"bwd_tflops":350.0}
"#;
        let r128 = AttnRates::from_bench_jsonl(text, "b", 128).unwrap();
        assert_eq!(r128.points, vec![pt(4096, 300.0, 250.0)]);
        assert!(!r128.source.contains("head dim"), "{}", r128.source);
        let r256 = AttnRates::from_bench_jsonl(text, "b", 256).unwrap();
        assert_eq!(r256.points, vec![pt(4096, 500.0, 400.0), pt(16384, 450.0, 350.0)]);
        let r64 = AttnRates::from_bench_jsonl(text, "b", 64).unwrap();
        assert_eq!(r64.points, r128.points);
        assert!(r64.source.contains("measured at head dim 128, none at the model's 64"), "{}", r64.source);
        let r192 = AttnRates::from_bench_jsonl(text, "b", 192).unwrap();
        assert_eq!(r192.points, r128.points, "equally near: the smaller head dim");
    }

    #[test]
    fn kernel_lengths_per_cp_kind() {
        let s = 131072;
        let l = |cp_kind, cp, ulysses| Layout { cp_kind, cp, ulysses, ..Layout::default() };
        assert_eq!(kernel_tokens(&l(CpKind::Ring, 16, 1), s), 8192);
        assert_eq!(kernel_tokens(&l(CpKind::Allgather, 16, 1), s), 8192);
        assert_eq!(kernel_tokens(&l(CpKind::Ulysses, 16, 1), s), s);
        assert_eq!(kernel_tokens(&l(CpKind::TwoD, 16, 4), s), 32768);
    }
}
