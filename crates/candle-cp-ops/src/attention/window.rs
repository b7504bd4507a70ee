//! Sliding-window attention ([`Mask::Window`]) from the kernels' full and causal masks.
//!
//! A query at position `qp` sees keys at `kp` with `qp - window < kp <= qp`. The CPU kernels
//! and the CUDA `Simple`/`Pipelined` kernels take a window directly as a [`super::Band`] (one
//! call); this module is the path for kernels that take only full and (offset, strided) causal
//! masks (devices without band kernels): a window call is split
//! into query tiles whose positions span at most `window - 1` (`(m - 1)·q_stride <= window -
//! 1`), and each tile into at most three kernel calls over key ranges (positions `qa..=qb` of
//! the tile's first and last rows):
//!
//! ```text
//!  keys:   qa-w+1 ....... qb-w | qb-w+1 ...... qa | qa+1 ...... qb
//!          (A) upper edge      | (B) all visible  | (C) lower edge
//!          qp - kp <= w-1      |  full mask       | kp <= qp: causal mask
//! ```
//!
//! (A) is a causal mask read backwards: with both row orders reversed and positions mapped to
//! `q' = C - qp`, `k' = C - kp - (w - 1)`, "`qp - kp <= w - 1`" becomes "`k' <= q'`" with
//! positive strides, which the kernels take; the rows are flipped in and out. The three
//! partial results merge through the LSE (in place, [`LocalState`]); the backward runs the
//! same calls with the tile's global out and lse and sums dK/dV over the tiles. Calls per
//! tile: at most 3, so `3·T/w` calls for `T` queries (fewer when the window exceeds `T`).

use super::Scores;
use super::{attention_bwd_prepared, attention_fwd, AttnDims, BwdPrep, Mask};
use crate::cp::state::{LocalState, RowAccum};
use candle_core::{bail, Result, Tensor};

/// One kernel call: local query rows `[q0, q0 + qn)` against key rows `[k0, k0 + kn)` with
/// `mask` (full or causal), rows reversed when `reversed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    pub q0: usize,
    pub qn: usize,
    pub k0: usize,
    pub kn: usize,
    pub mask: Mask,
    pub reversed: bool,
}

/// Key rows `j` (of `s`) with `lo <= k_offset + j·k_stride <= hi` (`hi` inclusive), as
/// `(first, count)`.
fn key_rows(lo: i128, hi: i128, k_offset: usize, k_stride: usize, s: usize) -> (usize, usize) {
    let (ko, ks) = (k_offset as i128, k_stride as i128);
    let first = if lo <= ko { 0 } else { (lo - ko + ks - 1) / ks };
    let last = if hi < ko { -1 } else { (hi - ko) / ks };
    let last = last.min(s as i128 - 1);
    if first > last {
        (0, 0)
    } else {
        (first as usize, (last - first + 1) as usize)
    }
}

/// The kernel calls covering a window mask for `t` query rows and `s` key rows (see the module
/// docs), tiles in query order. Every visible pair is in exactly one call.
pub(crate) fn calls(mask: &Mask, t: usize, s: usize) -> Result<Vec<Call>> {
    let Mask::Window { q_offset, q_stride, k_offset, k_stride, window } = *mask else {
        bail!("window::calls: not a window mask: {mask:?}")
    };
    if window == 0 || q_stride == 0 || k_stride == 0 {
        bail!("window attention: window and strides must be >= 1, got {mask:?}")
    }
    let w = window as i128;
    let tile = (window - 1) / q_stride + 1;
    let mut out = Vec::new();
    for q0 in (0..t).step_by(tile) {
        let qn = tile.min(t - q0);
        let qa = (q_offset + q0 * q_stride) as i128;
        let qb = qa + ((qn - 1) * q_stride) as i128;
        // (A) keys qa-w+1 ..= qb-w: only the window edge binds (kp <= qb-w < qa <= qp)
        let (a0, an) = key_rows(qa - w + 1, qb - w, k_offset, k_stride, s);
        if an > 0 {
            let kb = (k_offset + (a0 + an - 1) * k_stride) as i128;
            let c = qb + kb + w; // keeps the mapped positions >= 0
            let mask = Mask::Causal {
                q_offset: (c - qb) as usize,
                q_stride,
                k_offset: (c - kb - (w - 1)) as usize,
                k_stride,
            };
            out.push(Call { q0, qn, k0: a0, kn: an, mask, reversed: true });
        }
        // (B) keys qb-w+1 ..= qa: every row sees every key
        let (b0, bn) = key_rows(qb - w + 1, qa, k_offset, k_stride, s);
        if bn > 0 {
            out.push(Call { q0, qn, k0: b0, kn: bn, mask: Mask::Full, reversed: false });
        }
        // (C) keys qa+1 ..= qb: only causality binds (qp - kp <= qb - qa - 1 < w)
        let (c0, cn) = key_rows(qa + 1, qb, k_offset, k_stride, s);
        if cn > 0 {
            let kp0 = k_offset + c0 * k_stride;
            let mask = Mask::Causal { q_offset: qa as usize, q_stride, k_offset: kp0, k_stride };
            out.push(Call { q0, qn, k0: c0, kn: cn, mask, reversed: false });
        }
    }
    Ok(out)
}

/// Rows of `x` along `dim` in reverse order.
fn flip(x: &Tensor, dim: usize) -> Result<Tensor> {
    let n = x.dim(dim)?;
    let idx: Vec<u32> = (0..n as u32).rev().collect();
    x.contiguous()?.index_select(&Tensor::new(idx, x.device())?, dim)
}

/// Rows `[a, a + n)` along `dim`, reversed when `rev`.
fn rows(x: &Tensor, dim: usize, a: usize, n: usize, rev: bool) -> Result<Tensor> {
    let r = x.narrow(dim, a, n)?;
    if rev {
        flip(&r, dim)
    } else {
        r.contiguous()
    }
}

/// Forward of a window mask: f32 out `[B, T, H, D]`, lse `[B, H, T]` (see
/// [`super::attention_fwd`]). The calls' partial results merge in place into an f32 running
/// state of all rows ([`LocalState`]); rows no call covers keep out 0, lse `-inf`.
pub(crate) fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Mask, scale: Scores, dims: AttnDims) -> Result<(Tensor, Tensor)> {
    let AttnDims { b, t, s, h, d, .. } = dims;
    let mut state = LocalState::on_device(b, t, h, d, q.device())?;
    for c in calls(mask, t, s)? {
        if !c.reversed {
            // (folded into the state by the CUDA kernels where they can: LocalState::merge_fwd)
            let (qr, kr, vr) = (rows(q, 1, c.q0, c.qn, false)?, rows(k, 1, c.k0, c.kn, false)?, rows(v, 1, c.k0, c.kn, false)?);
            state.merge_fwd(c.q0, &qr, &kr, &vr, super::CallMask::Mask(&c.mask), scale)?;
            continue;
        }
        let (o, l) = attention_fwd(
            &rows(q, 1, c.q0, c.qn, c.reversed)?,
            &rows(k, 1, c.k0, c.kn, c.reversed)?,
            &rows(v, 1, c.k0, c.kn, c.reversed)?,
            &c.mask,
            scale,
        )?;
        let (o, l) = if c.reversed { (flip(&o, 1)?, flip(&l, 2)?) } else { (o, l) };
        state.merge_rows(c.q0, &o, &l)?;
    }
    state.finish(q.device())
}

/// Backward of a window mask: f32 dq `[B, T, H, D]`, dk/dv `[B, S, Hkv, D]` (see
/// [`super::attention_bwd`]) on the rows' prepared backward, accumulated in place ([`RowAccum`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    lse: &Tensor,
    prep: &BwdPrep,
    mask: &Mask,
    scale: Scores,
    dims: AttnDims,
) -> Result<(Tensor, Tensor, Tensor)> {
    let AttnDims { b, t, s, h, hkv, d } = dims;
    let dev = q.device();
    let mut dq = RowAccum::on_device(1, b, t, h, d, dev)?;
    let mut dkv = RowAccum::on_device(2, b, s, hkv, d, dev)?;
    for c in calls(mask, t, s)? {
        let r = c.reversed;
        let (g_q, g_k, g_v) = attention_bwd_prepared(
            &rows(q, 1, c.q0, c.qn, r)?,
            &rows(k, 1, c.k0, c.kn, r)?,
            &rows(v, 1, c.k0, c.kn, r)?,
            &rows(lse, 2, c.q0, c.qn, r)?,
            &prep.map_rows(|x, dim| rows(x, dim, c.q0, c.qn, r))?,
            &c.mask,
            scale,
        )?;
        let back = |x: Tensor| if r { flip(&x, 1) } else { Ok(x) };
        dq.add_rows(0, c.q0, &back(g_q)?)?;
        dkv.add_rows(0, c.k0, &back(g_k)?)?;
        dkv.add_rows(1, c.k0, &back(g_v)?)?;
    }
    let dkv = dkv.finish(dev)?;
    Ok((dq.finish(dev)?.squeeze(0)?, dkv.get(0)?, dkv.get(1)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (query, key) pair visible under the window is in exactly one call, and each
    /// call's (possibly reversed) mask sees exactly the window's pairs of its rows.
    #[test]
    fn calls_cover_exactly_the_window() -> Result<()> {
        for (qo, qs, ko, ks) in [(0usize, 1usize, 0usize, 1usize), (40, 1, 0, 1), (3, 4, 1, 4), (0, 2, 5, 3), (100, 1, 90, 1)] {
            for window in [1usize, 2, 3, 5, 8, 17, 64, 1000] {
                let (t, s) = (23usize, 31usize);
                let mask = Mask::Window { q_offset: qo, q_stride: qs, k_offset: ko, k_stride: ks, window };
                let mut seen = vec![0u8; t * s];
                for c in calls(&mask, t, s)? {
                    assert!(c.qn <= (window - 1) / qs + 1, "{c:?}");
                    for a in 0..c.qn {
                        for bb in 0..c.kn {
                            // local rows of the call (after the flip when reversed)
                            let (ia, jb) = if c.reversed { (c.qn - 1 - a, c.kn - 1 - bb) } else { (a, bb) };
                            if c.mask.visible(a, bb) {
                                seen[(c.q0 + ia) * s + c.k0 + jb] += 1;
                            }
                        }
                    }
                }
                for i in 0..t {
                    for j in 0..s {
                        let want = mask.visible(i, j) as u8;
                        assert_eq!(seen[i * s + j], want, "{mask:?} pair ({i}, {j})");
                    }
                }
            }
        }
        Ok(())
    }
}
