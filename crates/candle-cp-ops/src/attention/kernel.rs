//! CPU f32 kernels of blockwise attention (forward with LSE, backward with recomputation).
//!
//! All buffers are flat row-major f32: q/out/dout/dq `[B, T, H, D]`, k/v/dk/dv `[B, S, Hkv, D]`,
//! lse `[B, H, T]`. The mask enters only as a [`Band`]: query row `i` of batch row `b` sees
//! the key rows `lo[b][i] <= j < hi[b][i]`, both bounds non-decreasing in `i` (causal, window
//! and packed-document masks all are bands). Key tiles outside `[lo[i0], hi[i1 - 1])` of a
//! query tile `[i0, i1)` are skipped; only Bq×Bk tiles are ever materialised.
//!
//! Work is split with rayon (global pool): the forward over (batch, head, query block), the
//! backward over (batch, head, key chunk). Results are reduced in a fixed order, so the
//! output is deterministic for a given thread count.

use super::blas::{ds_row, dot, exp_f32, exp_sub, exp_sub_sum, matmul, row_max, scale_row, softcap_row, softcap_row_grad, Mat};
use super::Band;
use rayon::prelude::*;

/// Query rows per forward tile.
pub(crate) const FWD_BQ: usize = 128;
/// Key rows per forward tile.
pub(crate) const FWD_BK: usize = 128;
/// Query rows per backward tile.
pub(crate) const BWD_BQ: usize = 128;
/// Key rows per backward tile.
pub(crate) const BWD_BK: usize = 128;

/// Problem sizes: q `[b, t, h, d]`, k/v `[b, s, hkv, d]`.
pub(crate) use super::AttnDims as Dims;

impl Dims {
    fn g(&self) -> usize {
        self.h / self.hkv
    }
}

/// Forward. Returns `(out [B,T,H,D], lse [B,H,T])`; a row with no visible key gets out 0 and
/// lse `-inf`.
pub(crate) fn forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: Dims,
    band: &Band,
    (scale, cap): (f32, f32),
) -> (Vec<f32>, Vec<f32>) {
    let Dims { b: nb, t, h: nh, d, .. } = dims;
    // query tiles per band row (a shared band: the same tiles for every batch row)
    let tiles_of: Vec<Vec<(usize, usize)>> = (0..band.batch()).map(|b| {
        let (lo, hi) = band.row(b);
        query_tiles(lo, hi, FWD_BQ)
    }).collect();
    let units: Vec<(usize, usize, usize, usize)> = (0..nb)
        .flat_map(|b| {
            let tiles = &tiles_of[if band.batch() == 1 { 0 } else { b }];
            (0..nh).flat_map(move |h| tiles.iter().map(move |&(i0, i1)| (b, h, i0, i1)))
        })
        .collect();
    let tiles: Vec<(Vec<f32>, Vec<f32>)> = units
        .par_iter()
        .map(|&(b, h, i0, i1)| fwd_tile(q, k, v, dims, band.row(b), (scale, cap), b, h, (i0, i1)))
        .collect();
    let mut out = vec![0f32; nb * t * nh * d];
    let mut lse = vec![f32::NEG_INFINITY; nb * nh * t];
    for (&(b, h, i0, _), (o, l)) in units.iter().zip(tiles.iter()) {
        for (r, lr) in l.iter().enumerate() {
            let i = i0 + r;
            let dst = ((b * t + i) * nh + h) * d;
            out[dst..dst + d].copy_from_slice(&o[r * d..(r + 1) * d]);
            lse[(b * nh + h) * t + i] = *lr;
        }
    }
    (out, lse)
}

/// Rows (or keys) a band-aware tile holds at least before it may end early.
const MIN_TILE: usize = 16;

/// Query tiles `[i0, i1)` over the rows of one band row: at most `max` rows each, and a tile
/// also ends (once it holds [`MIN_TILE`] rows) before a row that sees none of the keys its
/// first row sees — a new packed document, or a window that moved past. So a tile of short
/// documents does not compute the dense (rows × keys) rectangle across document boundaries;
/// for a causal or full mask the tiles are the plain `max`-row tiles.
fn query_tiles(lo: &[u32], hi: &[u32], max: usize) -> Vec<(usize, usize)> {
    let t = lo.len();
    let mut out = Vec::with_capacity(t.div_ceil(max));
    let mut i0 = 0;
    while i0 < t {
        let cap = (i0 + max).min(t);
        let from = (i0 + MIN_TILE).min(cap);
        let edge = hi[i0].max(lo[i0] + 1); // an empty first row: wait for rows that see keys
        let i1 = from + lo[from..cap].partition_point(|&a| a < edge);
        out.push((i0, i1));
        i0 = i1;
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn fwd_tile(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: Dims,
    (lo, hi): (&[u32], &[u32]),
    (scale, cap): (f32, f32),
    b: usize,
    h: usize,
    (i0, i1): (usize, usize),
) -> (Vec<f32>, Vec<f32>) {
    let Dims { t, s, h: nh, hkv, d, .. } = dims;
    let qn = i1 - i0;
    let hk = h / dims.g();
    let (qrs, krs) = (nh * d, hkv * d);
    let qoff = ((b * t + i0) * nh + h) * d;
    let koff = (b * s * hkv + hk) * d;
    let kmax = hi[i1 - 1] as usize;
    let mut o = vec![0f32; qn * d];
    let mut m = vec![f32::NEG_INFINITY; qn];
    let mut l = vec![0f32; qn];
    let mut sb = vec![0f32; qn * FWD_BK];
    let mut j0 = lo[i0] as usize;
    while j0 < kmax {
        let j1 = (j0 + FWD_BK).min(kmax);
        let jn = j1 - j0;
        let kb = koff + j0 * krs;
        matmul(qn, jn, d, &mut sb, jn, false, Mat::new(q, qoff, qrs, 1), Mat::new(k, kb, 1, krs), scale);
        for r in 0..qn {
            let row = &mut sb[r * jn..(r + 1) * jn];
            // visible columns of this row in the tile: [va, vb)
            let va = (lo[i0 + r] as usize).saturating_sub(j0).min(jn);
            let vb = (hi[i0 + r] as usize).saturating_sub(j0).min(jn);
            if va >= vb {
                row.fill(0.0);
                continue;
            }
            if cap > 0.0 {
                softcap_row(&mut row[va..vb], cap);
            }
            let bm = row_max(&row[va..vb]);
            let mnew = m[r].max(bm);
            let alpha = exp_f32(m[r] - mnew);
            let sum = exp_sub_sum(&mut row[va..vb], mnew);
            row[..va].fill(0.0);
            row[vb..].fill(0.0);
            l[r] = l[r] * alpha + sum;
            m[r] = mnew;
            if alpha != 1.0 {
                scale_row(&mut o[r * d..(r + 1) * d], alpha);
            }
        }
        matmul(qn, d, jn, &mut o, d, true, Mat::new(&sb, 0, jn, 1), Mat::new(v, kb, krs, 1), 1.0);
        j0 = j1;
    }
    let mut lse = vec![f32::NEG_INFINITY; qn];
    for r in 0..qn {
        let orow = &mut o[r * d..(r + 1) * d];
        if l[r] > 0.0 {
            let inv = 1.0 / l[r];
            scale_row(orow, inv);
            lse[r] = m[r] + l[r].ln();
        } else {
            orow.fill(0.0);
        }
    }
    (o, lse)
}

/// delta `[B, H, T]` = rowsum(dout ∘ out) of out/dout `[B, T, H, D]`: the backward's
/// key-independent row term (made once per backward, `super::BwdPrep`).
pub(crate) fn delta(out: &[f32], dout: &[f32], (nb, t, nh, d): (usize, usize, usize, usize)) -> Vec<f32> {
    let mut delta = vec![0f32; nb * nh * t];
    for b in 0..nb {
        for i in 0..t {
            for h in 0..nh {
                let o = ((b * t + i) * nh + h) * d;
                delta[(b * nh + h) * t + i] = dot(&out[o..o + d], &dout[o..o + d]);
            }
        }
    }
    delta
}

/// Backward with recomputation of P from the given (global) `lse` and `delta` `[B, H, T]`
/// ([`delta`] of the whole attention's out and dout).
/// Returns `(dq [B,T,H,D], dk [B,S,Hkv,D], dv [B,S,Hkv,D])`; dk/dv are summed over the G
/// query heads that share a KV head.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    delta: &[f32],
    lse: &[f32],
    dout: &[f32],
    dims: Dims,
    band: &Band,
    (scale, cap): (f32, f32),
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let Dims { b: nb, t, s, h: nh, hkv, d } = dims;
    // Key chunks (in units of BWD_BK) so that there are enough work items for the pool.
    let nkb = s.div_ceil(BWD_BK).max(1);
    let want = (4 * rayon::current_num_threads()).div_ceil((nb * nh).max(1));
    let nchunks = want.clamp(1, nkb);
    let chunk_bounds: Vec<(usize, usize)> = (0..nchunks)
        .map(|c| ((c * nkb / nchunks * BWD_BK).min(s), ((c + 1) * nkb / nchunks * BWD_BK).min(s)))
        .filter(|(a, b)| a < b)
        .collect();
    let units: Vec<(usize, usize, usize, usize)> = (0..nb)
        .flat_map(|b| {
            let cb = &chunk_bounds;
            (0..nh).flat_map(move |h| cb.iter().map(move |&(c0, c1)| (b, h, c0, c1)))
        })
        .collect();
    let ctx = BwdCtx { q, k, v, dout, lse, delta, dims, band, scale, cap };
    let parts: Vec<BwdPart> = units.par_iter().map(|&(b, h, c0, c1)| ctx.unit(b, h, c0, c1)).collect();
    let mut dq = vec![0f32; nb * t * nh * d];
    let mut dk = vec![0f32; nb * s * hkv * d];
    let mut dv = vec![0f32; nb * s * hkv * d];
    let g = dims.g();
    for (&(b, h, c0, c1), p) in units.iter().zip(parts.iter()) {
        for (r, row) in p.dq.chunks_exact(d).enumerate() {
            let dst = ((b * t + p.iq0 + r) * nh + h) * d;
            dq[dst..dst + d].iter_mut().zip(row).for_each(|(a, x)| *a += x);
        }
        let hk = h / g;
        for j in c0..c1 {
            let dst = ((b * s + j) * hkv + hk) * d;
            let src = (j - c0) * d;
            dk[dst..dst + d].iter_mut().zip(&p.dk[src..src + d]).for_each(|(a, x)| *a += x);
            dv[dst..dst + d].iter_mut().zip(&p.dv[src..src + d]).for_each(|(a, x)| *a += x);
        }
    }
    (dq, dk, dv)
}

struct BwdPart {
    iq0: usize,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

struct BwdCtx<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    dout: &'a [f32],
    lse: &'a [f32],
    delta: &'a [f32],
    dims: Dims,
    band: &'a Band,
    scale: f32,
    /// Logit soft cap (0: none).
    cap: f32,
}

impl BwdCtx<'_> {
    /// First query row of batch row `b` that may see key `j` or a later key: the first with
    /// `hi > j` (`t` if none).
    fn first_query(&self, b: usize, j: usize) -> usize {
        self.band.row(b).1.partition_point(|&n| n as usize <= j)
    }

    /// End of the query rows of batch row `b` that may see a key before `j`: the first row
    /// with `lo >= j` (`t` if none).
    fn end_query(&self, b: usize, j: usize) -> usize {
        self.band.row(b).0.partition_point(|&n| (n as usize) < j)
    }

    /// End of the key tile starting at `j0` (at most `cap`): once it holds [`MIN_TILE`] keys,
    /// before the first key whose query rows are all past the rows that see key `j0` (a new
    /// packed document), mirroring [`query_tiles`].
    fn key_tile_end(&self, b: usize, j0: usize, cap: usize) -> usize {
        let rows_end = self.end_query(b, j0 + 1); // rows seeing key j0 end before this one
        let (mut a, mut z) = ((j0 + MIN_TILE).min(cap), cap);
        // first j in [a, z) with first_query(j) >= rows_end (first_query is non-decreasing)
        while a < z {
            let m = a + (z - a) / 2;
            if self.first_query(b, m) < rows_end {
                a = m + 1;
            } else {
                z = m;
            }
        }
        a.max(j0 + 1)
    }

    /// dk/dv for keys `c0..c1` of query head `h` and this chunk's contribution to dq.
    fn unit(&self, b: usize, h: usize, c0: usize, c1: usize) -> BwdPart {
        let Dims { t, s, h: nh, hkv, d, .. } = self.dims;
        let hk = h / self.dims.g();
        let (qrs, krs) = (nh * d, hkv * d);
        let qbase = (b * t * nh + h) * d;
        let kbase = (b * s * hkv + hk) * d;
        let rbase = (b * nh + h) * t;
        let (lo, hi) = self.band.row(b);
        let iq0 = self.first_query(b, c0).min(self.end_query(b, c1));
        let iq1 = self.end_query(b, c1).max(iq0);
        let mut dq = vec![0f32; (iq1 - iq0) * d];
        let mut dk = vec![0f32; (c1 - c0) * d];
        let mut dv = vec![0f32; (c1 - c0) * d];
        let mut pb = vec![0f32; BWD_BQ * BWD_BK];
        let mut db = vec![0f32; BWD_BQ * BWD_BK];
        // the soft cap's derivative 1 - tanh² per (row, key) of the tile
        let mut gb = if self.cap > 0.0 { vec![0f32; BWD_BQ * BWD_BK] } else { Vec::new() };
        let mut j0 = c0;
        while j0 < c1 {
            let j1 = self.key_tile_end(b, j0, (j0 + BWD_BK).min(c1));
            let jn = j1 - j0;
            let kb = kbase + j0 * krs;
            let dk_acc = &mut dk[(j0 - c0) * d..(j1 - c0) * d];
            let dv_acc = &mut dv[(j0 - c0) * d..(j1 - c0) * d];
            let mut i0 = self.first_query(b, j0);
            let iend = self.end_query(b, j1);
            while i0 < iend {
                let i1 = (i0 + BWD_BQ).min(iend);
                let qn = i1 - i0;
                let qo = qbase + i0 * qrs;
                let qm = Mat::new(self.q, qo, qrs, 1);
                let dom = Mat::new(self.dout, qo, qrs, 1);
                // P = exp(scale * Q K^T - lse), masked entries 0.
                matmul(qn, jn, d, &mut pb, jn, false, qm, Mat::new(self.k, kb, 1, krs), self.scale);
                for r in 0..qn {
                    let row = &mut pb[r * jn..(r + 1) * jn];
                    let l = self.lse[rbase + i0 + r];
                    let va = (lo[i0 + r] as usize).saturating_sub(j0).min(jn);
                    let vb = (hi[i0 + r] as usize).saturating_sub(j0).min(jn);
                    if va >= vb || l == f32::NEG_INFINITY {
                        row.fill(0.0);
                        continue;
                    }
                    if self.cap > 0.0 {
                        softcap_row_grad(&mut row[va..vb], &mut gb[r * jn + va..r * jn + vb], self.cap);
                    }
                    exp_sub(&mut row[va..vb], l);
                    row[..va].fill(0.0);
                    row[vb..].fill(0.0);
                }
                // dV += P^T dO
                matmul(jn, d, qn, dv_acc, d, true, Mat::new(&pb, 0, 1, jn), dom, 1.0);
                // dP = dO V^T ; dS = P * (dP - delta)
                matmul(qn, jn, d, &mut db, jn, false, dom, Mat::new(self.v, kb, 1, krs), 1.0);
                for r in 0..qn {
                    let dl = self.delta[rbase + i0 + r];
                    let prow = &pb[r * jn..(r + 1) * jn];
                    let drow = &mut db[r * jn..(r + 1) * jn];
                    ds_row(drow, prow, dl);
                    if self.cap > 0.0 {
                        // dS w.r.t. the uncapped logit (where P = 0, dS is 0 whatever gb holds:
                        // its entries are finite, in [0, 1])
                        drow.iter_mut().zip(&gb[r * jn..(r + 1) * jn]).for_each(|(x, g)| *x *= g);
                    }
                }
                // dK += scale * dS^T Q ; dQ += scale * dS K
                matmul(jn, d, qn, dk_acc, d, true, Mat::new(&db, 0, 1, jn), qm, self.scale);
                let dq_rows = &mut dq[(i0 - iq0) * d..(i1 - iq0) * d];
                matmul(qn, d, jn, dq_rows, d, true, Mat::new(&db, 0, jn, 1), Mat::new(self.k, kb, krs, 1), self.scale);
                i0 = i1;
            }
            j0 = j1;
        }
        BwdPart { iq0, dq, dk, dv }
    }
}
