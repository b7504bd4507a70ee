//! The ring attention engine, shared by the contiguous, zigzag and striped layouts.
//!
//! Every rank keeps its queries; K/V chunks (only the `Hkv` KV heads) rotate around the ring.
//! At step `s` rank `i` holds the K/V of source rank `j = (i - s) mod P` and computes, for each
//! (query segment, key segment) pair of the two layouts' [`Segment`](crate::cp::Segment)s, one block:
//! skipped when fully masked, plain (`Mask::Full`) when fully visible, and with the
//! offset/stride causal mask when it straddles the diagonal. [`step_schedule`] fuses them into
//! fewer, larger calls: fully visible blocks adjacent in local rows go in one call, and the
//! causal step on a rank's own K/V is one plain causal call over local indices (every zigzag
//! step is a single attention call). The partial (out, lse) of each
//! block merge, through the LSE, into an f32 running state of all local rows
//! ([`super::state::LocalState`]: in place on the host for CPU queries, as f32 device tensors
//! updated in place otherwise, so nothing goes through the host between steps; the backward's
//! dQ/dK/dV accumulators likewise, [`super::state::RowAccum`]). Blocks with more than
//! [`CpOpts::rows_per_call`] query rows are computed in row chunks (each chunk re-classified),
//! which bounds the memory of one attention call.
//!
//! Zigzag schedule (P = 4, 2P = 8 chunks of c = T/8 tokens; rank i holds chunks i, 7-i).
//! Rows: rank 1's query chunks; columns: key chunks; `█` full block, `◣` diagonal block,
//! `.` skipped. Each step computes exactly 2c² (step 0: two half diagonals + one full):
//!
//! ```text
//!  key chunk →     0  1  2  3  4  5  6  7
//!  q chunk 1       █  ◣  .  .  .  .  .  .     step s, source j = (1 - s) mod 4:
//!  q chunk 6       █  █  █  █  █  █  ◣  .       s=0 j=1: (1,1)◣ (6,1)█ (6,6)◣   [j = i]
//!                                               s=1 j=0: (1,0)█ (6,0)█          [j < i: both
//!                                                        query chunks × key chunk j only]
//!                                               s=2 j=3: (6,3)█ (6,4)█          [j > i: query
//!                                               s=3 j=2: (6,2)█ (6,5)█           chunk 2P-1-i ×
//!                                                                                both key chunks]
//! ```
//!
//! With packed documents or a sliding window ([`CpOpts::documents`], [`CpOpts::window`]) a
//! step is not scheduled block by block: it is ONE call under a [`crate::attention::Band`]
//! (module `bands`: per local query row, the interval of the held chunk's key rows it sees),
//! however many documents or window edges cut it, and a step with an empty band is skipped.
//!
//! Contiguous: step `s` with `j > i` is fully masked (skipped; the rank idles, whence the
//! `(2P-1)/P` imbalance). Striped: every block straddles the diagonal (`j <= i`: lower
//! triangle with diagonal, `j > i`: strictly lower) — balanced, but no block is skipped.
//!
//! Backward (no re-run of the forward ring): with the global `out` and `lse`, K/V rotate again;
//! each rank adds its dK/dV contribution for the chunk it holds into an f32 accumulator that
//! travels with the chunk, and after `P` hops the accumulator is back at its owner. dQ stays
//! local. Transfers of the next K/V chunk and of the previous accumulator overlap the compute.
//! The key-independent part of every step's backward — delta = rowsum(dO ∘ O) and, on CUDA,
//! dO rounded to the input dtype — is made once before the first step
//! ([`crate::attention::BwdPrep`]); each call reads its rows of it. On CUDA each call's dQ is
//! added by the kernels straight into the rank's dQ accumulator (`RowAccum::add_bwd`), a
//! one-call step's dK/dV into the accumulator received from the previous rank, the
//! forward's first call over all rows writes the running state's buffer itself, and the later
//! calls are folded into it by the forward kernels' epilogue (no partial result, no merge pass;
//! [`LocalState::merge_fwd`](super::state::LocalState)).

mod bands;
mod schedule;
pub use bands::{local_positions, row_chunks, step_band};
pub use schedule::{
    block_schedule, block_schedule_mask, call_pairs, classify, classify_mask, fuse_full_blocks, split_rows, step_schedule, step_schedule_mask,
    sub_blocks, sub_blocks_window, Block, MaskSpec, Scheduled,
};
use schedule::mask_of;

use super::ring_comm::{InFlight, Ring, RingStats, StepStats};
use super::state::{LocalState, Residency, RowAccum};
use super::{check_bwd_inputs, check_inputs, scale_of, CpOpts, Dims};
use crate::attention::{BwdCall, BwdPrep};
use crate::attention::sinks::{self, RawBwd};
use crate::Group;
use candle_core::{Result, Tensor};
use std::time::{Duration, Instant};

/// Number of ring steps any rank has work in (`1 + ` the largest such step; every rank
/// computes the same number from the shared options): `P` for a plain causal or full mask;
/// fewer with a sliding window or packed documents on a contiguous layout, where later steps
/// would only carry chunks nobody attends to. The ring stops after it, which saves the
/// remaining transfers: a window of `w` keys over shards of `T/P` tokens needs
/// `1 + ceil((w - 1) / (T/P))` steps (a halo exchange instead of a full ring).
pub fn active_steps(opts: &CpOpts, p: usize, t: usize) -> Result<usize> {
    if !uses_bands(opts) {
        return Ok(p);
    }
    for s in (1..p).rev() {
        for r in 0..p {
            for row in 0..opts.mask_rows() {
                if !block_schedule_mask(opts.layout, r, (r + p - s) % p, p, t, opts.row_mask_spec(row))?.is_empty() {
                    return Ok(s + 1);
                }
            }
        }
    }
    Ok(1)
}

/// The band of one ring step ([`step_band`]): shared by every batch row, or one per row with
/// [`CpOpts::row_documents`].
fn step_band_of(opts: &CpOpts, rank: usize, src: usize, p: usize, t: usize) -> Result<crate::attention::Band> {
    if opts.row_documents.is_none() {
        return step_band(opts.layout, rank, src, p, t, opts.mask_spec());
    }
    let rows = (0..opts.mask_rows())
        .map(|b| step_band(opts.layout, rank, src, p, t, opts.row_mask_spec(b)))
        .collect::<Result<Vec<_>>>()?;
    crate::attention::Band::stack(&rows)
}

/// Do this ring's calls go through [`step_band`] (packed documents or a sliding window: one
/// band call per step and row chunk) rather than the block schedule?
fn uses_bands(opts: &CpOpts) -> bool {
    opts.documents.is_some() || opts.row_documents.is_some() || opts.window.is_some()
}

/// Visibility of one attention call of a ring step.
enum CallMask {
    /// A full / offset-causal / window mask (the block schedule).
    Mask(crate::attention::Mask),
    /// Per-row key intervals (packed documents, windows: module `bands`).
    Band(crate::attention::Band),
}

impl CallMask {
    /// The attention layer's view of it.
    fn as_call(&self) -> crate::attention::CallMask<'_> {
        match self {
            CallMask::Mask(m) => crate::attention::CallMask::Mask(m),
            CallMask::Band(b) => crate::attention::CallMask::Band(b),
        }
    }
}

/// One attention call of a ring step: local query rows `[q0, q0 + qn)` against the held
/// chunk's local key rows `[k0, k0 + kn)`, computing `pairs` visible pairs.
struct StepCall {
    q0: usize,
    qn: usize,
    k0: usize,
    kn: usize,
    mask: CallMask,
    pairs: u64,
}

/// The attention calls rank `rank` makes when holding source `src`'s K/V (the same for the
/// forward and the backward): with documents or a window one band call per row chunk
/// ([`step_band`], rows seeing nothing left out, keys trimmed to those seen); otherwise the
/// block schedule ([`step_schedule_mask`]) in row chunks of at most `rows_per_call`.
fn step_calls(opts: &CpOpts, rank: usize, src: usize, p: usize, dims: &Dims, rows_per_call: usize) -> Result<Vec<StepCall>> {
    let mut calls = Vec::new();
    if uses_bands(opts) {
        let band = step_band_of(opts, rank, src, p, dims.t)?;
        for (q0, qn) in row_chunks(dims.tl, rows_per_call) {
            let (k0, band) = band.narrow_rows(q0, qn)?.trim_keys();
            if !band.is_empty() {
                calls.push(StepCall { q0, qn, k0, kn: band.keys(), pairs: band.pairs(), mask: CallMask::Band(band) });
            }
        }
        return Ok(calls);
    }
    for sb in step_schedule_mask(opts.layout, rank, src, p, dims.t, opts.mask_spec())? {
        for (qs, block) in sub_blocks_window(&sb, opts.causal, opts.window, rows_per_call) {
            let pairs = call_pairs(&qs, &sb.k, &block);
            calls.push(StepCall { q0: qs.local, qn: qs.len, k0: sb.k.local, kn: sb.k.len, mask: CallMask::Mask(mask_of(&block)), pairs });
        }
    }
    Ok(calls)
}

/// Every attention call of a ring pass, per step ([`step_calls`] for the sources the rank
/// holds at steps `0..active_steps`), built before the first step. On CUDA the bands of all
/// steps are copied to the device in one transfer here ([`crate::attention::Band::upload_all`]),
/// so no step waits for a host-to-device copy. [`ring_attention`] builds one plan and its
/// forward and backward share it.
pub(super) struct StepPlan {
    steps: Vec<Vec<StepCall>>,
}

impl StepPlan {
    /// The plan of rank `group.rank()` for a ring over `group` with `opts` and `dims` on `dev`.
    pub(super) fn new(group: &Group, opts: &CpOpts, dims: &Dims, dev: &candle_core::Device) -> Result<Self> {
        let (p, rank) = (group.size(), group.rank());
        let rows_per_call = opts.rows_per_call(dev);
        let mut steps = (0..active_steps(opts, p, dims.t)?)
            .map(|s| step_calls(opts, rank, (rank + p - s) % p, p, dims, rows_per_call))
            .collect::<Result<Vec<_>>>()?;
        let bands = steps.iter_mut().flatten().filter_map(|c| match &mut c.mask {
            CallMask::Band(band) => Some(band),
            CallMask::Mask(_) => None,
        });
        crate::attention::Band::upload_all(bands, dev)?;
        Ok(Self { steps })
    }
}

/// K and V rows `[k0, k0 + kn)` of the held chunk, reused while consecutive calls share them.
struct KeyRows<'a> {
    k: &'a Tensor,
    v: &'a Tensor,
    last: Option<((usize, usize), Tensor, Tensor)>,
}

impl<'a> KeyRows<'a> {
    fn new(k: &'a Tensor, v: &'a Tensor) -> Self {
        Self { k, v, last: None }
    }
    fn get(&mut self, k0: usize, kn: usize) -> Result<(Tensor, Tensor)> {
        if let Some((r, kb, vb)) = &self.last {
            if *r == (k0, kn) {
                return Ok((kb.clone(), vb.clone()));
            }
        }
        let (kb, vb) = (self.k.narrow(1, k0, kn)?.contiguous()?, self.v.narrow(1, k0, kn)?.contiguous()?);
        self.last = Some(((k0, kn), kb.clone(), vb.clone()));
        Ok((kb, vb))
    }
}

/// Forward ring without autograd: local shards in, f32 `out [B, T/P, H, D]` and f32
/// `lse [B, H, T/P]` of the *global* attention for this rank's queries out (with
/// `opts.sinks` applied to the merged rows), plus timings. Collective over `group`.
pub fn ring_attention_fwd_raw(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    group: &Group,
    opts: &CpOpts,
) -> Result<(Tensor, Tensor, RingStats)> {
    let dims = check_inputs("ring_attention", q, k, v, group, opts)?;
    let plan = StepPlan::new(group, opts, &dims, q.device())?;
    let (out, lse, stats) = fwd(q, k, v, group, opts, &dims, &plan, Residency::Auto)?;
    let (out, lse) = match &opts.sinks {
        Some(z) => crate::attention::apply_sinks(&out, &lse, z.tensor())?,
        None => (out, lse),
    };
    Ok((out, lse, stats))
}

/// The forward ring, making the calls of `plan` ([`StepPlan::new`] with the same group, options
/// and dims); `residency` picks the running state's form (tests force the device form on CPU).
#[allow(clippy::too_many_arguments)]
pub(super) fn fwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    group: &Group,
    opts: &CpOpts,
    dims: &Dims,
    plan: &StepPlan,
    residency: Residency,
) -> Result<(Tensor, Tensor, RingStats)> {
    let ring = Ring::new(group);
    let scale = scale_of(opts, dims.d);
    let (b, tl, h, d) = (dims.b, dims.tl, dims.h, dims.d);
    let mut state = LocalState::with_residency(b, tl, h, d, q.device(), residency)?;
    let mut stats = RingStats::default();
    let mut kv = Tensor::stack(&[k, v], 0)?;
    let steps = plan.steps.len();
    for (s, calls) in plan.steps.iter().enumerate() {
        let mut st = StepStats::default();
        let mut next: Option<InFlight> = None;
        if s + 1 < steps {
            let f = ring.start(&kv, &mut stats)?;
            if opts.overlap {
                next = Some(f);
            } else {
                // No overlap: wait for the transfer before computing; keep the current chunk.
                let recv = f.wait(&mut st.wait)?;
                next = Some(InFlight::ready(recv));
            }
        }
        let t0 = Instant::now();
        let (kc, vc) = (kv.get(0)?, kv.get(1)?);
        let mut keys = KeyRows::new(&kc, &vc);
        for c in calls {
            let (kb, vb) = keys.get(c.k0, c.kn)?;
            let qr = q.narrow(1, c.q0, c.qn)?.contiguous()?;
            // the first call over all rows (the in-place form) becomes the state; on CUDA the
            // later ones are folded in by the forward kernels (no partial result, no merge pass)
            state.merge_fwd(c.q0, &qr, &kb, &vb, c.mask.as_call(), scale)?;
            st.blocks += 1;
            st.area += (c.qn * c.kn) as u64;
            st.pairs += c.pairs;
        }
        st.compute = t0.elapsed();
        if let Some(f) = next {
            kv = f.wait(&mut st.wait)?;
        }
        stats.steps.push(st);
    }
    // Rows with no visible key (impossible for causal/full) keep out 0, lse -inf.
    let (out, lse) = state.finish(q.device())?;
    Ok((out, lse, stats))
}

/// Backward ring without autograd. `out` (f32) and `lse` are the forward's *global* results
/// for this rank's queries, `dout [B, T/P, H, D]` the upstream gradient. Returns f32
/// `dq [B, T/P, H, D]`, `dk, dv [B, T/P, Hkv, D]` for this rank's own shards, plus timings.
/// Collective over `group`.
#[allow(clippy::too_many_arguments)]
pub fn ring_attention_bwd_raw(
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
        "ring_attention backward",
        q,
        k,
        v,
        out,
        lse,
        dout,
        group,
        opts,
    )?;
    let plan = StepPlan::new(group, opts, &dims, q.device())?;
    bwd(q, k, v, out, lse, dout, group, opts, &dims, &plan, Residency::Auto)
}

/// The backward ring, making the calls of `plan` (the forward's); `residency` picks the
/// dQ/dK/dV accumulators' form (tests force the device form on CPU).
#[allow(clippy::too_many_arguments)]
pub(super) fn bwd(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    group: &Group,
    opts: &CpOpts,
    dims: &Dims,
    plan: &StepPlan,
    residency: Residency,
) -> Result<(Tensor, Tensor, Tensor, RingStats)> {
    let ring = Ring::new(group);
    let p = ring.size();
    let scale = scale_of(opts, dims.d);
    let dev = q.device();
    let accum = |planes: usize, h: usize| {
        RowAccum::with_residency(planes, dims.b, dims.tl, h, dims.d, dev, residency)
    };
    let mut dq = accum(1, dims.h)?;
    // delta and dO's kernel form, once for every step's calls over this rank's query rows.
    let prep = BwdPrep::new(q, out, dout)?;
    let mut stats = RingStats::default();
    let mut kv = Tensor::stack(&[k, v], 0)?;
    let mut acc_in: Option<InFlight> = None;
    let steps = plan.steps.len();
    for (s, calls) in plan.steps.iter().enumerate() {
        let mut st = StepStats::default();
        let mut next = if s + 1 < steps {
            Some(ring.start(&kv, &mut stats)?)
        } else {
            None
        };
        if !opts.overlap {
            if let Some(f) = next.take() {
                next = Some(InFlight::ready(f.wait(&mut st.wait)?));
            }
        }
        let t0 = Instant::now();
        let (kc, vc) = (kv.get(0)?, kv.get(1)?);
        // dK / dV of the chunk held at this step (see `StepKv`).
        let mut dkv = StepKv::None;
        let mut keys = KeyRows::new(&kc, &vc);
        for c in calls {
            let (kb, vb) = keys.get(c.k0, c.kn)?;
            let r = |x: &Tensor, dim: usize| x.narrow(dim, c.q0, c.qn)?.contiguous();
            let (qr, lr, pr) = (r(q, 1)?, r(lse, 2)?, prep.narrow_rows(c.q0, c.qn)?);
            let call = BwdCall { q: &qr, k: &kb, v: &vb, lse: &lr, prep: &pr, mask: c.mask.as_call(), scale };
            // dQ added to this rank's accumulator (on CUDA by the kernels themselves)
            let (dkb, dvb) = dq.add_bwd(c.q0, &call)?;
            dkv.push(c.k0, dkb, dvb, || accum(2, dims.hkv))?;
            st.blocks += 1;
            st.area += (c.qn * c.kn) as u64;
            st.pairs += c.pairs;
        }
        st.compute = t0.elapsed();
        // The accumulator of the chunk, from the previous rank (none at the first step), plus
        // this step's dK / dV.
        let received = match acc_in.take() {
            Some(f) => Some(f.wait(&mut st.wait)?),
            None => None,
        };
        let t1 = Instant::now();
        let acc = dkv.add_to(received, [dims.b, dims.tl, dims.hkv, dims.d], || accum(2, dims.hkv), residency, dev)?;
        st.compute += t1.elapsed();
        // The accumulator for source `src` goes to the next rank, which holds `src` next step;
        // after the last step it is complete and goes home, to `src` itself (`steps - 1` ranks
        // back: the next rank when the ring runs all `P` steps).
        acc_in = Some(if s + 1 < steps {
            ring.start(&acc, &mut stats)?
        } else {
            ring.shift_back(&acc, steps - 1, &mut stats)?
        });
        if let Some(f) = next {
            kv = f.wait(&mut st.wait)?;
        }
        stats.steps.push(st);
    }
    // The accumulator that arrives last is this rank's own dK/dV.
    let mut last_wait = Duration::ZERO;
    let own = match acc_in {
        Some(f) => f.wait(&mut last_wait)?,
        None => candle_core::bail!("ring_attention backward: no dK/dV accumulator (P = {p})"),
    };
    if let Some(st) = stats.steps.last_mut() {
        st.wait += last_wait;
    }
    Ok((dq.finish(dev)?.squeeze(0)?, own.get(0)?, own.get(1)?, stats))
}

/// The dK / dV blocks of one backward step, `[B, kn, Hkv, D]` each at key row `k0` of the held
/// chunk. One call (every zigzag step on CUDA): the blocks are kept and added, once the
/// accumulator from the previous rank has arrived, straight into it (in place on the device),
/// so the step neither zero-fills a chunk-sized buffer nor sums two of them. Several calls
/// (row chunks): summed into a step accumulator as they come, which bounds the memory held.
enum StepKv {
    None,
    One(usize, Tensor, Tensor),
    Acc(RowAccum),
}

impl StepKv {
    /// Adds the blocks of one call (`zeros` makes a step accumulator `[2, B, T/P, Hkv, D]`).
    fn push(&mut self, k0: usize, dk: Tensor, dv: Tensor, zeros: impl Fn() -> Result<RowAccum>) -> Result<()> {
        *self = match std::mem::replace(self, StepKv::None) {
            StepKv::None => StepKv::One(k0, dk, dv),
            StepKv::One(k1, dk1, dv1) => {
                let mut acc = zeros()?;
                for (k, a, b) in [(k1, &dk1, &dv1), (k0, &dk, &dv)] {
                    acc.add_rows(0, k, a)?;
                    acc.add_rows(1, k, b)?;
                }
                StepKv::Acc(acc)
            }
            StepKv::Acc(mut acc) => {
                acc.add_rows(0, k0, &dk)?;
                acc.add_rows(1, k0, &dv)?;
                StepKv::Acc(acc)
            }
        };
        Ok(())
    }

    /// The chunk's accumulator after this step: `received` (none at the first step: zeros)
    /// plus the step's blocks. `chunk` = `[B, T/P, Hkv, D]`, the shape of a whole plane.
    fn add_to(self, received: Option<Tensor>, chunk: [usize; 4], zeros: impl Fn() -> Result<RowAccum>, residency: Residency, dev: &candle_core::Device) -> Result<Tensor> {
        match (self, received) {
            // the first step's one call over all the chunk's keys: its blocks are the
            // accumulator (no zero fill, no add)
            (StepKv::One(0, dk, dv), None) if dk.dims() == chunk && dv.dims() == chunk => {
                Tensor::stack(&[dk.to_dtype(candle_core::DType::F32)?, dv.to_dtype(candle_core::DType::F32)?], 0)?.to_device(dev)
            }
            (StepKv::None, Some(r)) => Ok(r),
            (StepKv::None, None) => zeros()?.finish(dev),
            (StepKv::Acc(acc), None) => acc.finish(dev),
            (StepKv::Acc(acc), Some(r)) => r + acc.finish(dev)?,
            (StepKv::One(k0, dk, dv), r) => {
                let mut acc = match r {
                    Some(r) => RowAccum::from_tensor(r, residency)?,
                    None => zeros()?,
                };
                acc.add_rows(0, k0, &dk)?;
                acc.add_rows(1, k0, &dv)?;
                acc.finish(dev)
            }
        }
    }
}

/// Ring attention over the `P` ranks of `group` (context parallelism).
///
/// Inputs are this rank's shards, laid out by `opts.layout`: `q [B, T/P, H, D]`,
/// `k, v [B, T/P, Hkv, D]` (`H % Hkv == 0`, GQA: only the Hkv heads travel). Returns
/// `out [B, T/P, H, D]` in q's dtype, differentiable w.r.t. q, k, v (backward = the dK/dV ring,
/// a collective: every rank must run the backward), and `lse [B, H, T/P]` f32 (not
/// differentiable), both equal to the rows of single-device attention over the global `T`.
/// Collective over `group`; errors (on every rank) if ranks pass different shapes.
pub fn ring_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    group: &Group,
    opts: &CpOpts,
) -> Result<(Tensor, Tensor)> {
    let dims = check_inputs("ring_attention", q, k, v, group, opts)?;
    if super::halo::applies(opts, group.size(), dims.t) {
        // a window reaching at most one chunk back: a halo exchange, not the ring
        return super::halo::halo_attention(q, k, v, group, opts, &dims);
    }
    let (qd, kd, vd) = (q.detach(), k.detach(), v.detach());
    let plan = StepPlan::new(group, opts, &dims, q.device())?;
    let (out32, lse, _) = fwd(&qd, &kd, &vd, group, opts, &dims, &plan, Residency::Auto)?;
    let (g, o) = (group.clone(), opts.clone());
    // the backward gets the f32 output (sinks applied) back from the returned one (+ a bf16
    // residual, unless opts.row_sums is RowSums::Output) and the lse (sinks included)
    let bwd_fn: RawBwd = Box::new(move |out32: &Tensor, lse: &Tensor, dout: &Tensor| {
        let (dq, dk, dv, _) = bwd(&qd, &kd, &vd, out32, lse, dout, &g, &o, &dims, &plan, Residency::Auto)?;
        Ok((dq, dk, dv))
    });
    sinks::attach("ring_attention", q, k, v, opts.sinks.as_ref(), out32, lse, opts.row_sums, bwd_fn)
}

#[cfg(test)]
mod device_form_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cp::shard::Layout;

    /// Run the forward ring on P thread ranks and return each rank's stats.
    fn ring_stats(layout: Layout, p: usize, t: usize) -> Result<Vec<RingStats>> {
        let res = candle_cp_comm::run_ranks(p, |g: Group| {
            let dev = candle_core::Device::Cpu;
            let q = Tensor::ones((1, t / p, 2, 8), candle_core::DType::F32, &dev)?;
            let k = Tensor::ones((1, t / p, 1, 8), candle_core::DType::F32, &dev)?;
            let (_, _, st) = ring_attention_fwd_raw(&q, &k, &k, &g, &CpOpts::new(layout, true))?;
            Ok(st)
        });
        res.into_iter().collect()
    }

    /// Every layout, causal and full, plain / packed documents / sliding window / both: the
    /// pairs each rank's calls cover (ring and all-gather KV, fused blocks, row chunks) are
    /// the exact counts of `cp::balance_mask`, which sum to the mask's visible pairs (no pair
    /// across documents or outside the window is computed).
    #[test]
    fn engines_compute_exactly_the_balance_pairs() -> Result<()> {
        let (p, t) = (4usize, 64usize);
        let docs = crate::packing::Documents::from_lengths(&[5, 17, 1, 30, 11])?;
        for layout in Layout::ALL {
            for causal in [true, false] {
                for (d, window, rows) in [(None, None, 0), (Some(&docs), None, 6), (None, Some(9), 5), (Some(&docs), Some(7), 0)] {
                    let window = window.filter(|_| causal);
                    let spec = MaskSpec { causal, window, docs: d };
                    let want = crate::cp::balance_mask(layout, p, t, spec)?.pairs;
                    let visible = |i: usize, j: usize| {
                        (!causal || j <= i) && window.is_none_or(|w| i < j + w) && d.is_none_or(|d| d.doc_of(i) == d.doc_of(j))
                    };
                    let total = (0..t).flat_map(|i| (0..t).map(move |j| (i, j))).filter(|&(i, j)| visible(i, j)).count() as u64;
                    let what = format!("{layout:?} causal={causal} docs={} window={window:?}", d.is_some());
                    assert_eq!(want.iter().sum::<u64>(), total, "{what}");
                    let opts = CpOpts { block_rows: rows, documents: d.cloned(), window, ..CpOpts::new(layout, causal) };
                    let res = candle_cp_comm::run_ranks(p, |g: Group| {
                        let dev = candle_core::Device::Cpu;
                        let q = Tensor::ones((1, t / p, 2, 8), candle_core::DType::F32, &dev)?;
                        let k = Tensor::ones((1, t / p, 1, 8), candle_core::DType::F32, &dev)?;
                        let (_, _, ring) = ring_attention_fwd_raw(&q, &k, &k, &g, &opts)?;
                        let (_, _, ag) = crate::cp::allgather_attention_stats(&q, &k, &k, &g, &opts)?;
                        Ok((ring.pairs(), ag.pairs()))
                    });
                    for (r, x) in res.into_iter().enumerate() {
                        let (ring, ag) = x?;
                        assert_eq!(ring, want[r], "ring {what} rank {r}");
                        assert_eq!(ag, want[r], "allgather {what} rank {r}");
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn runtime_zigzag_equal_work_contiguous_skips() -> Result<()> {
        let (p, t) = (4usize, 64usize);
        let c = t / (2 * p);
        // Zigzag: every step is one call. Step 0 (own K/V) is one causal call over the rank's
        // 2c local rows (dense area 4c², visible pairs c² + c(c+1): two diagonal blocks and
        // a full one); every later step is one full call of 2c² pairs.
        for st in ring_stats(Layout::Zigzag, p, t)? {
            assert_eq!(st.steps.len(), p);
            assert!(st.steps.iter().all(|s| s.blocks == 1), "{:?}", st.steps);
            let areas: Vec<u64> = st.steps.iter().map(|s| s.area).collect();
            let pairs: Vec<u64> = st.steps.iter().map(|s| s.pairs).collect();
            assert_eq!(areas[0], (4 * c * c) as u64);
            assert_eq!(pairs[0], (c * c + c * (c + 1)) as u64);
            assert!(areas[1..].iter().all(|&a| a == (2 * c * c) as u64), "{areas:?}");
            assert!(pairs[1..].iter().all(|&a| a == (2 * c * c) as u64), "{pairs:?}");
            // K/V only (one KV head of the [B, T/P, Hkv, D] shards): P-1 hops of 2·T/P·8 f32.
            assert_eq!(st.bytes_sent, ((p - 1) * 2 * (t / p) * 8 * 4) as u64);
        }
        // Contiguous: rank r computes r+1 blocks; steps whose source is a later rank are skipped.
        for (r, st) in ring_stats(Layout::Contiguous, p, t)?.iter().enumerate() {
            let blocks: usize = st.steps.iter().map(|s| s.blocks).sum();
            assert_eq!(blocks, r + 1, "rank {r}");
        }
        Ok(())
    }

}
