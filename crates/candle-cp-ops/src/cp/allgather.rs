//! All-gather-KV context parallelism (Llama 3 style).
//!
//! Every rank all-gathers K and V (cheap with GQA: only `Hkv` heads), rebuilds the global
//! K/V in token order, and attends its local query segments against the key *prefix* each
//! segment can see (causal) or against all keys (full), with the segment's global offset and
//! stride in the mask (segments longer than [`CpOpts::rows_per_call`] go in row chunks, each
//! against its own prefix; with packed documents each chunk is one band call
//! ([`crate::attention::Band`]) against the keys of the documents it touches, every row
//! against its own document's keys only). Backward: K/V are all-gathered again
//! (not kept between forward and backward), per-chunk attention backward gives dQ locally and
//! a global-length f32 dK/dV contribution; a reduce-scatter (in the layout's shard order)
//! returns each rank the sum for its own shard.
//!
//! ```text
//! zigzag, P = 2, chunks of c = T/4:     rank 0 holds q chunks 0, 3; rank 1 holds 1, 2
//!   rank 0: q chunk 0 × keys [0, c)      q chunk 3 × keys [0, 4c)
//!   rank 1: q chunk 1 × keys [0, 2c)     q chunk 2 × keys [0, 3c)     → 5c keys each
//! ```

use super::ring::split_rows;
use super::ring_comm::{RingStats, StepStats};
use super::shard::{shard, split_shards, unshard, Segment};
use super::state::{Residency, RowAccum};
use super::{check_bwd_inputs, check_inputs, scale_of, CpOpts, Dims};
use crate::attention::{attention_fwd, attention_fwd_band, Band, BwdCall, BwdPrep, CallMask, Mask};
use crate::attention::sinks::{self, RawBwd};
use crate::Group;
use candle_core::{Device, Result, Tensor};
use std::time::Instant;

/// One attention call: query rows `q` against the global keys `[k0, k0 + n)` with `mask`, or
/// with `band` (over those `n` keys) when set.
#[derive(Clone, Debug)]
struct Call {
    q: Segment,
    k0: usize,
    n: usize,
    mask: Mask,
    band: Option<Band>,
}

impl Call {
    /// Visible (query, key) pairs of the call.
    fn pairs(&self, causal: bool) -> u64 {
        if let Some(b) = &self.band {
            return b.pairs();
        }
        let keys = Segment { offset: self.k0, stride: 1, len: self.n, local: 0 };
        match self.mask {
            Mask::Window { window, .. } => crate::cp::balance::visible_pairs_window(&self.q, &keys, window),
            _ => crate::cp::balance::visible_pairs(&self.q, &keys, causal),
        }
    }
}

/// The call of query rows `seg` against the keys `[k0, end)` they may see: causal → up to
/// the segment's last position (the mask carries the offsets), with a sliding window from
/// the first row's oldest key on, full → all of them.
fn call_for(seg: Segment, k0: usize, end: usize, causal: bool, window: Option<usize>) -> Call {
    if let (true, Some(w)) = (causal, window) {
        let k0 = k0.max((seg.offset + 1).saturating_sub(w));
        let mask = Mask::Window { q_offset: seg.offset, q_stride: seg.stride, k_offset: k0, k_stride: 1, window: w };
        return Call { q: seg, k0, n: seg.last() + 1 - k0, mask, band: None };
    }
    if causal {
        let mask = Mask::Causal { q_offset: seg.offset, q_stride: seg.stride, k_offset: k0, k_stride: 1 };
        Call { q: seg, k0, n: seg.last() + 1 - k0, mask, band: None }
    } else {
        Call { q: seg, k0, n: end - k0, mask: Mask::Full, band: None }
    }
}

/// With packed documents: the band call of query rows `seg` against the global keys their
/// documents (and window) let them see (every row sees at least itself or its document).
fn band_call(seg: Segment, t: usize, opts: &CpOpts) -> Result<Call> {
    let q: Vec<usize> = (0..seg.len).map(|i| seg.offset + i * seg.stride).collect();
    let keys: Vec<usize> = (0..t).collect();
    let rows = (0..opts.mask_rows())
        .map(|b| Band::from_positions(&q, &keys, opts.row_mask_spec(b)))
        .collect::<Result<Vec<_>>>()?;
    // one row: a band shared by the batch; row_documents: one band per batch row
    let (k0, band) = Band::stack(&rows)?.trim_keys();
    Ok(Call { q: seg, k0, n: band.keys(), mask: Mask::Full, band: Some(band) })
}

/// All-gather K/V and rebuild them in token order: `[2, B, T, Hkv, D]` (k, v stacked).
pub(super) fn gather_kv(k: &Tensor, v: &Tensor, group: &Group, opts: &CpOpts) -> Result<Tensor> {
    let kv = Tensor::stack(&[k, v], 0)?.contiguous()?;
    let all = group.all_gather(&kv, 2)?;
    unshard(&split_shards(&all, group.size(), 2)?, opts.layout, 2)
}

/// This rank's attention calls: the layout's segments split into runs of at most
/// [`CpOpts::rows_per_call`] rows on `dev`, each against its own key prefix; with packed
/// documents one band call per run. The calls' query rows cover the local rows once, in
/// order.
fn calls(rank: usize, p: usize, opts: &CpOpts, dims: &Dims, dev: &Device) -> Result<Vec<Call>> {
    let rows = opts.rows_per_call(dev);
    let mut out = Vec::new();
    for seg in opts.layout.segments(rank, p, dims.t)?.iter().flat_map(|s| split_rows(s, rows)) {
        if opts.documents.is_some() || opts.row_documents.is_some() {
            out.push(band_call(seg, dims.t, opts)?);
        } else {
            out.push(call_for(seg, 0, dims.t, opts.causal, opts.window));
        }
    }
    Ok(out)
}

/// The forward on the gathered `kv [2, B, T, Hkv, D]`: f32 `out [B, T/P, H, D]`,
/// `lse [B, H, T/P]` (one attention call per row chunk, concatenated on the device).
pub(super) fn fwd(
    q: &Tensor,
    kv: &Tensor,
    rank: usize,
    p: usize,
    opts: &CpOpts,
    dims: &Dims,
    st: &mut StepStats,
) -> Result<(Tensor, Tensor)> {
    let t0 = Instant::now();
    let scale = scale_of(opts, dims.d);
    let (kg, vg) = (kv.get(0)?, kv.get(1)?);
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for c in calls(rank, p, opts, dims, q.device())? {
        let qs = q.narrow(1, c.q.local, c.q.len)?.contiguous()?;
        let (kn, vn) = (kg.narrow(1, c.k0, c.n)?.contiguous()?, vg.narrow(1, c.k0, c.n)?.contiguous()?);
        let (o, l) = match &c.band {
            Some(band) => attention_fwd_band(&qs, &kn, &vn, band, scale)?,
            None => attention_fwd(&qs, &kn, &vn, &c.mask, scale)?,
        };
        outs.push(o);
        lses.push(l);
        st.blocks += 1;
        st.area += (c.q.len * c.n) as u64;
        st.pairs += c.pairs(opts.causal);
    }
    st.compute += t0.elapsed();
    Ok((Tensor::cat(&outs, 1)?, Tensor::cat(&lses, 2)?))
}

/// The backward on the gathered `kv [2, B, T, Hkv, D]`; `residency` picks the dQ/dK/dV
/// accumulators' form (tests force the device form on CPU).
#[allow(clippy::too_many_arguments)]
pub(super) fn bwd(
    q: &Tensor,
    kv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    group: &Group,
    opts: &CpOpts,
    dims: &Dims,
    residency: Residency,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (p, rank) = (group.size(), group.rank());
    let scale = scale_of(opts, dims.d);
    let (kg, vg) = (kv.get(0)?, kv.get(1)?);
    let dev = q.device();
    let (b, d) = (dims.b, dims.d);
    let mut dq = RowAccum::with_residency(1, b, dims.tl, dims.h, d, dev, residency)?;
    // Global-length dK (plane 0) / dV (plane 1) contributions of this rank's queries.
    let mut dkv = RowAccum::with_residency(2, b, dims.t, dims.hkv, d, dev, residency)?;
    let prep = BwdPrep::new(q, out, dout)?;
    for c in calls(rank, p, opts, dims, q.device())? {
        let r = |x: &Tensor, dim: usize| x.narrow(dim, c.q.local, c.q.len)?.contiguous();
        let (kn, vn) = (
            kg.narrow(1, c.k0, c.n)?.contiguous()?,
            vg.narrow(1, c.k0, c.n)?.contiguous()?,
        );
        let (qr, lr, pr) = (r(q, 1)?, r(lse, 2)?, prep.narrow_rows(c.q.local, c.q.len)?);
        let mask = match &c.band {
            Some(band) => CallMask::Band(band),
            None => CallMask::Mask(&c.mask),
        };
        let call = BwdCall { q: &qr, k: &kn, v: &vn, lse: &lr, prep: &pr, mask, scale };
        // dQ added to this rank's accumulator (on CUDA by the kernels themselves)
        let (dk, dv) = dq.add_bwd(c.q.local, &call)?;
        dkv.add_rows(0, c.k0, &dk)?;
        dkv.add_rows(1, c.k0, &dv)?;
    }
    let dkv = dkv.finish(dev)?;
    // Reorder the global dK/dV into shard order (rank 0's shard, rank 1's, ...) and
    // reduce-scatter: rank r gets the sum over ranks of its own shard's gradient.
    let shards: Vec<Tensor> = (0..p)
        .map(|r| shard(&dkv, opts.layout, r, p, 2))
        .collect::<Result<_>>()?;
    let mine = group.reduce_scatter(&Tensor::cat(&shards, 2)?, 2)?;
    Ok((dq.finish(dev)?.squeeze(0)?, mine.get(0)?, mine.get(1)?))
}

/// All-gather-KV attention with timings: like [`allgather_attention`] (not differentiable),
/// returning f32 `out`, `lse` and one [`StepStats`] (compute time, time in the all-gather).
pub fn allgather_attention_stats(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    group: &Group,
    opts: &CpOpts,
) -> Result<(Tensor, Tensor, RingStats)> {
    let dims = check_inputs("allgather_attention", q, k, v, group, opts)?;
    let mut st = StepStats::default();
    let t0 = Instant::now();
    let kv = gather_kv(k, v, group, opts)?;
    st.wait = t0.elapsed();
    let (o, l) = fwd(q, &kv, group.rank(), group.size(), opts, &dims, &mut st)?;
    let (o, l) = match &opts.sinks {
        Some(z) => crate::attention::apply_sinks(&o, &l, z.tensor())?,
        None => (o, l),
    };
    let bytes = (k.elem_count() * 2 * k.dtype().size_in_bytes()) as u64;
    Ok((
        o,
        l,
        RingStats {
            steps: vec![st],
            bytes_sent: bytes,
        },
    ))
}

/// Backward of all-gather-KV attention without autograd: all-gathers K/V again, runs the
/// per-segment attention backward with the global `out` (f32) and `lse` of this rank's
/// queries, and reduce-scatters dK/dV. Returns f32 `dq [B, T/P, H, D]`, `dk, dv
/// [B, T/P, Hkv, D]` and one [`StepStats`] (wait = the all-gather; compute includes the
/// reduce-scatter).
#[allow(clippy::too_many_arguments)]
pub fn allgather_attention_bwd_raw(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    group: &Group,
    opts: &CpOpts,
) -> Result<(Tensor, Tensor, Tensor, RingStats)> {
    let dims = check_bwd_inputs(
        "allgather_attention backward",
        q,
        k,
        v,
        out,
        lse,
        dout,
        group,
        opts,
    )?;
    let mut st = StepStats::default();
    let t0 = Instant::now();
    let kv = gather_kv(k, v, group, opts)?;
    st.wait = t0.elapsed();
    let t1 = Instant::now();
    let (dq, dk, dv) = bwd(q, &kv, out, lse, dout, group, opts, &dims, Residency::Auto)?;
    st.compute = t1.elapsed();
    let bytes = (k.elem_count() * 2 * (k.dtype().size_in_bytes() + 4)) as u64;
    Ok((
        dq,
        dk,
        dv,
        RingStats {
            steps: vec![st],
            bytes_sent: bytes,
        },
    ))
}

/// Context-parallel attention by all-gathering K/V (Llama 3 style; use with the zigzag
/// layout for balanced causal work, any [`super::Layout`] works).
///
/// Inputs are this rank's shards `q [B, T/P, H, D]`, `k, v [B, T/P, Hkv, D]` laid out by
/// `opts.layout`. Returns `out [B, T/P, H, D]` in q's dtype (differentiable w.r.t. q, k, v;
/// backward reduce-scatters dK/dV, a collective every rank must run) and `lse [B, H, T/P]`
/// f32. While the forward and the backward run, each rank holds the global K/V
/// `[B, T, Hkv, D]`; between them only its shards (the backward all-gathers again).
pub fn allgather_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    group: &Group,
    opts: &CpOpts,
) -> Result<(Tensor, Tensor)> {
    let dims = check_inputs("allgather_attention", q, k, v, group, opts)?;
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let kv = gather_kv(&kd, &vd, group, opts)?;
    let mut st = StepStats::default();
    let (out32, lse) = fwd(&qd, &kv, group.rank(), group.size(), opts, &dims, &mut st)?;
    // The global K/V are not kept for the backward (that would hold O(T) memory per layer
    // until the backward runs): the backward all-gathers them again.
    drop(kv);
    let (g, o) = (group.clone(), opts.clone());
    // the backward gets the f32 output (sinks applied) back from the returned one (+ a bf16
    // residual, unless opts.row_sums is RowSums::Output) and the lse (sinks included)
    let bwd_fn: RawBwd = Box::new(move |out32: &Tensor, lse: &Tensor, dout: &Tensor| {
        let kv = gather_kv(&kd, &vd, &g, &o)?;
        bwd(&qd, &kv, out32, lse, dout, &g, &o, &dims, Residency::Auto)
    });
    sinks::attach("allgather_attention", q, k, v, opts.sinks.as_ref(), out32, lse, opts.row_sums, bwd_fn)
}
