//! Sliding-window attention by a halo exchange: each rank receives from its ring neighbours
//! only the K/V rows its window reaches before each of its chunks, then attends locally under
//! one band. What [`super::ring_attention`] runs for a window of `w` keys when `w − 1` is at
//! most one chunk (`T/(2P)` tokens zigzag, `T/P` contiguous; [`applies`]) instead of rotating
//! every K/V chunk around the ring.
//!
//! Zigzag, P = 4, rank 1 holds chunks 1 and 6 of 8; a query sees at most `m = w − 1` keys
//! before its own, so chunk 1 needs the last `m` rows of chunk 0 (rank 0) and chunk 6 the last
//! `m` rows of chunk 5 (rank 2, its second chunk):
//!
//! ```text
//!  chunk   0      1      2      3  |  4      5      6      7
//!  rank    0      1      2      3  |  3      2      1      0
//!  sends:  every rank its first chunk's tail to rank r + 1 ("next"),
//!          its second chunk's tail to rank r − 1 ("prev");
//!  rank 1 attends [tail 0 | chunk 1 | tail 5 | chunk 6] under one band
//!  (rank P−1's chunks P−1 and P are adjacent: its own first chunk's tail serves its second)
//! ```
//!
//! Two transfers (contiguous: one) of `m` rows of K and V, in flight together, whatever `P`,
//! against `P − 1` hops of whole chunks on the ring (zigzag keeps the full ring for a window,
//! since each rank's chunks border ranks on both sides). The exchange is one autograd op whose
//! backward sends the halo rows' dK/dV back to their owner (the same transfers in the other
//! direction), which adds them to its tail rows; the attention is the band op ([`crate::attention::attention_band_with`]),
//! so the backward is the band backward on the same rows. Every exchange is a collective over
//! the group: ranks whose halo has no predecessor (global chunk 0, rank `P − 1`'s second chunk)
//! still exchange, and keep the rows they receive masked out of the band (their gradient is
//! zero), so every rank runs the same exchanges in the forward and the backward.

use super::{CpOpts, Dims, Layout};
use crate::attention::{attention_band_with, Band};
use crate::autograd::{attach1, BackwardFn};
use crate::packing::Documents;
use crate::Group;
use candle_core::{bail, Result, Tensor};
use std::sync::Arc;

/// Whether [`super::ring_attention`] with `opts` over `p` ranks and a global length `t` runs
/// the halo exchange: a causal sliding window whose `w − 1` keys before a query reach at most
/// one chunk back (`w − 1 ≤ T/(2P)` zigzag, `≤ T/P` contiguous), on a zigzag or contiguous
/// layout, `P ≥ 2`, [`CpOpts::halo`] set. Striped shards border every other rank: no halo.
pub fn applies(opts: &CpOpts, p: usize, t: usize) -> bool {
    let chunk = match opts.layout {
        Layout::Zigzag => t / (2 * p.max(1)),
        Layout::Contiguous => t / p.max(1),
        Layout::Striped => return false,
    };
    match opts.window {
        Some(w) => opts.halo && opts.causal && p >= 2 && w >= 1 && w - 1 <= chunk,
        None => false,
    }
}

/// The halo rows of every part at once: `tails[i]` (`[B, m, 2·Hkv, D]`: K and V side by side)
/// goes to rank `routes[i].0` while part `i`'s halo is received from `routes[i].1`, all
/// transfers in flight together. Differentiable: the backward sends each received part's
/// gradient back to where it came from and receives its own tail's, in the same order on
/// every rank (one op for all parts, so no rank can run two exchanges' backwards in another
/// order than its neighbours, which matters at P = 2, where both go to the same rank).
/// Collective over `group`.
fn exchange(tails: &[Tensor], group: &Group, routes: Vec<(usize, usize)>) -> Result<Vec<Tensor>> {
    let run = move |g: &Group, xs: &[Tensor], back: bool| -> Result<Vec<Tensor>> {
        let mut pending = Vec::with_capacity(xs.len());
        for (x, &(dst, src)) in xs.iter().zip(&routes) {
            let (to, from) = if back { (src, dst) } else { (dst, src) };
            pending.push(g.send_recv(&x.contiguous()?, to, from)?);
        }
        let got = pending.into_iter().map(|p| p.wait()).collect::<Result<Vec<_>>>()?;
        for (x, y) in xs.iter().zip(&got) {
            if x.dims() != y.dims() {
                bail!("halo exchange: rank {} received {:?}, sent {:?} ({})", g.rank(), y.dims(), x.dims(), g.describe())
            }
        }
        Ok(got)
    };
    let got = Tensor::stack(&run(group, &tails.iter().map(Tensor::detach).collect::<Vec<_>>(), false)?, 0)?;
    let (g, n) = (group.clone(), tails.len());
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| {
        let parts = dy.detach().chunk(n, 0)?.iter().map(|t| t.squeeze(0)).collect::<Result<Vec<_>>>()?;
        Ok(vec![Some(Tensor::stack(&run(&g, &parts, true)?, 0)?)])
    });
    // one graph node for all parts (the stack of the tails is its input)
    let out = attach1("halo_exchange", &Tensor::stack(tails, 0)?, got, bwd)?;
    (0..n).map(|i| out.get(i)).collect()
}

/// One local chunk: its global start, length, and where its keys begin in the
/// extended K/V (its halo slot of `m` rows, then its own rows); `valid`: whether the halo slot
/// holds the `m` rows before the chunk (false for global chunk 0).
struct Part {
    start: usize,
    len: usize,
    base: usize,
    valid: bool,
}

/// The band of the local queries over the extended K/V `[halo | chunk]` per part: query at
/// global position `qp` of a part sees its part's keys at positions
/// `max(qp + 1 − w, doc_start(qp), start − m_valid) ..= qp`.
fn band(parts: &[Part], tl: usize, s: usize, m: usize, w: usize, docs: &[Option<&Documents>]) -> Result<Band> {
    let mut lo = Vec::with_capacity(docs.len() * tl);
    let mut hi = Vec::with_capacity(docs.len() * tl);
    for d in docs {
        for part in parts {
            let first = part.start - if part.valid { m } else { 0 };
            for i in 0..part.len {
                let qp = part.start + i;
                let doc_start = match d {
                    Some(d) => d.doc_of(qp).map_or(0, |x| d.range(x).0),
                    None => 0,
                };
                let from = (qp + 1).saturating_sub(w).max(doc_start).max(first);
                // key at position kp sits at base + m + (kp − start) of the extended K/V
                lo.push((part.base + m + from - part.start) as u32);
                hi.push((part.base + m + i + 1) as u32);
            }
        }
    }
    Band::new(docs.len(), tl, s, lo, hi)
}

/// Windowed attention of this rank's shards by the halo exchange (see the module docs):
/// `q [B, T/P, H, D]`, `k, v [B, T/P, Hkv, D]` laid out by `opts.layout`; returns out
/// `[B, T/P, H, D]` (differentiable w.r.t. q, k, v; the backward exchanges the halo rows'
/// gradients, a collective) and lse `[B, H, T/P]`. `dims` checked by the caller
/// ([`super::check_inputs`]); [`applies`] must hold.
pub(crate) fn halo_attention(q: &Tensor, k: &Tensor, v: &Tensor, group: &Group, opts: &CpOpts, dims: &Dims) -> Result<(Tensor, Tensor)> {
    let (p, r, t, tl) = (group.size(), group.rank(), dims.t, dims.tl);
    let Some(w) = opts.window.filter(|_| applies(opts, p, t)) else {
        bail!("halo_attention: needs a causal window reaching at most one chunk back on a zigzag or contiguous layout (window {:?}, layout {}, T = {t}, P = {p})", opts.window, opts.layout)
    };
    let m = w - 1;
    let segs = opts.layout.segments(r, p, t)?;
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    // the extended K/V: per part [halo slot | own rows], and (zigzag, rank P−1) the rows
    // received for a second chunk whose halo is local, masked out
    let hkv = dims.hkv;
    // every part's halo in one exchange: part 0 (the first chunk) from the previous rank's
    // first chunk, part 1 (zigzag's second chunk) from the next rank's second chunk
    let tail = |seg: usize| -> Result<Tensor> {
        let (a, n) = (segs[seg].local + segs[seg].len - m, m);
        Tensor::cat(&[k.narrow(1, a, n)?, v.narrow(1, a, n)?], 2)
    };
    let halos = if m > 0 {
        let routes: Vec<(usize, usize)> = (0..segs.len()).map(|i| if i == 0 { (next, prev) } else { (prev, next) }).collect();
        let tails = (0..segs.len()).map(tail).collect::<Result<Vec<_>>>()?;
        exchange(&tails, group, routes)?
    } else {
        vec![]
    };
    // the extended K/V: per part [halo slot | own rows], and (zigzag, rank P−1, whose chunks
    // P−1 and P are adjacent: its own first chunk's tail is the second's halo) the rows
    // received for the second chunk, kept in front of its slot and masked out
    let mut kv: Vec<Tensor> = Vec::new();
    let mut parts = Vec::with_capacity(segs.len());
    let rows = |x: &[Tensor]| x.iter().map(|t| t.dim(1)).sum::<Result<usize>>();
    for (i, seg) in segs.iter().enumerate() {
        let mut valid = seg.offset > 0;
        if m > 0 {
            let halo = if i == 1 && r == p - 1 {
                kv.push(halos[1].clone());
                valid = true;
                tail(0)?
            } else {
                halos[i].clone()
            };
            parts.push(Part { start: seg.offset, len: seg.len, base: rows(&kv)?, valid });
            kv.push(halo);
        } else {
            parts.push(Part { start: seg.offset, len: seg.len, base: rows(&kv)?, valid });
        }
        kv.push(Tensor::cat(&[k.narrow(1, seg.local, seg.len)?, v.narrow(1, seg.local, seg.len)?], 2)?);
    }
    let kv = Tensor::cat(&kv, 1)?;
    let (ks, vs) = (kv.narrow(2, 0, hkv)?, kv.narrow(2, hkv, hkv)?);
    let (kx, vx) = (ks.contiguous()?, vs.contiguous()?);
    let s = kx.dim(1)?;
    let docs: Vec<Option<&Documents>> = match (&opts.documents, &opts.row_documents) {
        (_, Some(rows)) => rows.iter().map(Some).collect(),
        (d, None) => vec![d.as_ref()],
    };
    let band = band(&parts, tl, s, m, w, &docs)?;
    let scores = super::scale_of(opts, dims.d);
    match &opts.sinks {
        // every row's keys are all here: its result is finished, the sinks apply to it
        Some(z) => crate::attention::attention_band_sinks(q, &kx, &vx, z, &band, scores, opts.row_sums),
        None => attention_band_with(q, &kx, &vx, &band, scores, opts.row_sums),
    }
}
