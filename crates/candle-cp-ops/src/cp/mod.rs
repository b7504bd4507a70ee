//! Context parallelism: sharding layouts, ring / zigzag / striped ring attention, all-gather KV.
//!
//! One sequence of global length `T` is split over the `P` ranks of a group; every rank holds
//! local shards `q [B, T/P, H, D]`, `k, v [B, T/P, Hkv, D]` laid out by a [`Layout`]. The
//! attention stays exact:
//!
//! - [`ring_attention`]: K/V chunks travel around the ring (P-1 hops), each rank merges the
//!   partial results of its queries through the log-sum-exp in f32; fully masked blocks are
//!   skipped. Backward: a second ring carries f32 dK/dV accumulators back to their owners.
//! - [`allgather_attention`]: Llama 3 style — all-gather K/V once, attend locally with
//!   offset masks, reduce-scatter dK/dV in backward.
//! - [`balance()`]: attention work per rank and the imbalance of a layout.
//! - [`sharded_decode_attention`]: generation against a KV cache sharded over the ranks
//!   (module [`decode`]).
//!
//! Module map: [`shard`](mod@shard) layouts and position ids, [`ring_comm`] the ring transport
//! helper, [`ring`] the ring engine (block schedule, forward, backward), [`state`] the f32
//! running (out, lse) state and gradient accumulators, [`allgather`], [`balance`](mod@balance),
//! [`verify`] (run an oracle case on thread ranks and gather).

pub mod allgather;
pub mod balance;
pub mod decode;
pub mod halo;
pub mod ring;
pub mod ring_comm;
pub mod shard;
pub mod state;
pub mod verify;

pub use allgather::{allgather_attention, allgather_attention_bwd_raw, allgather_attention_stats};
pub use balance::{balance, balance_docs, balance_mask, best_layout, BalanceReport};
pub use decode::{decode_owner, sharded_decode_attention, sharded_decode_attention_sinks, KvShard};
pub use ring::{ring_attention, ring_attention_bwd_raw, ring_attention_fwd_raw, MaskSpec};
pub use ring_comm::{RingStats, StepStats};
pub use shard::{gather, position_ids, positions, shard, unshard, Layout, Segment};
pub use verify::{run_case_cp, run_case_cp_on, run_case_cp_with, CpMethod, CpRun, RankBody};

use crate::packing::Documents;
use crate::Group;
use crate::attention::{RowSums, Scores, Sinks};
use candle_core::{bail, DType, Device, Result, Tensor};

/// Options of the context-parallel attention ops.
#[derive(Clone, Debug, PartialEq)]
pub struct CpOpts {
    /// How the sequence is split over the ranks (must match how q, k, v were sharded).
    pub layout: Layout,
    /// Causal mask on global positions (else every query sees every key).
    pub causal: bool,
    /// Softmax scale; `None` = `1/sqrt(D)`.
    pub scale: Option<f64>,
    /// Logit soft cap (Gemma 2's `attn_logit_softcapping`, see [`crate::attention::Scores`]);
    /// `None`: uncapped.
    pub softcap: Option<f64>,
    /// Start the next chunk's transfer before computing the current one (double buffer).
    /// `false` waits for each transfer before computing (for measuring the overlap).
    pub overlap: bool,
    /// Most query rows per attention call: a block with more query rows is computed in row
    /// chunks, bounding per-call outputs and scratch. `0` (the default) is automatic, see
    /// [`CpOpts::rows_per_call`]: [`DEFAULT_BLOCK_ROWS`] on the CPU, unchunked on CUDA (a flash
    /// kernel call needs O(rows) memory anyway, and 1024-row chunks would leave much of a large
    /// GPU idle: 1024 / 128 rows per thread block x 16 heads = 128 blocks for 132 SMs).
    pub block_rows: usize,
    /// Check at every call that all ranks pass the same local shapes, dtype, layout and mask
    /// (default `true`): one small all-gather per call, which on a GPU also makes the host
    /// wait for the device once per call (never per ring step). A mismatch is an error on
    /// every rank; unchecked, mismatched ranks would exchange garbage or time out. Training
    /// loops whose shapes are fixed can turn it off after a first checked step.
    pub check_ranks: bool,
    /// Packed documents of the global sequence (`None`: one document). With documents, a
    /// query sees only keys of its own document (causal within it when `causal`); the
    /// boundaries may fall anywhere in the shards (no padding). Same for every batch row; must
    /// cover the global `T` and be the same on every rank (checked with the shapes). See
    /// [`crate::packing`].
    pub documents: Option<Documents>,
    /// Packed documents per batch row (`B` entries, each covering the global `T`), for batches
    /// whose rows pack different documents; exclusive with `documents`. Every ring step is
    /// still one band call for all rows (a band per row), and one ring pass serves the batch.
    pub row_documents: Option<Vec<Documents>>,
    /// Causal sliding window (Mistral-style `sliding_window`): a query sees itself and the
    /// `window - 1` keys before it (global positions; within its document when `documents` is
    /// set). Needs `causal`. `None`: no window. Blocks wholly outside the window are skipped
    /// (the ring still rotates every K/V chunk; all-gather KV attends each row chunk to its
    /// window's keys only).
    pub window: Option<usize>,
    /// A window that reaches at most one chunk back (`w − 1 ≤ T/(2P)` zigzag, `≤ T/P`
    /// contiguous) runs as a halo exchange (default `true`, [`halo`]): each rank receives only
    /// the `w − 1` K/V rows before each of its chunks from its neighbours and attends locally,
    /// instead of rotating every chunk around the ring. `false` keeps the ring.
    pub halo: bool,
    /// Where the backward's row sums take the output from (default [`RowSums::F32`]: the
    /// returned output plus its bf16 rounding residual, kept until the backward, 2 bytes per
    /// output element for a 16-bit output; [`RowSums::Output`]: the returned output alone,
    /// as FlashAttention and the single-device op by default, nothing kept).
    pub row_sums: RowSums,
    /// Attention sinks, one logit per query head of the local q (`[H]`, gpt-oss's
    /// `self_attn.sinks`, see [`crate::attention::sinks`]), applied once to each row's finished
    /// result; the ops return their gradient (this rank's rows' share). `None`: no sinks.
    pub sinks: Option<Sinks>,
}

/// Query rows per attention call on the CPU when [`CpOpts::block_rows`] is `0` (automatic).
pub const DEFAULT_BLOCK_ROWS: usize = 1024;

impl Default for CpOpts {
    /// Zigzag, causal, scale `1/sqrt(D)`, overlap on, automatic rows per call (1024 on the
    /// CPU, unchunked on CUDA), ranks checked.
    fn default() -> Self {
        Self {
            layout: Layout::Zigzag,
            causal: true,
            scale: None,
            softcap: None,
            overlap: true,
            block_rows: 0,
            check_ranks: true,
            documents: None,
            row_documents: None,
            window: None,
            halo: true,
            row_sums: RowSums::F32,
            sinks: None,
        }
    }
}

impl CpOpts {
    /// Options for `layout` and mask, default scale, overlap on.
    pub fn new(layout: Layout, causal: bool) -> Self {
        Self {
            layout,
            causal,
            ..Default::default()
        }
    }
    /// Same options with attention kept inside the packed `documents` (see
    /// [`CpOpts::documents`]).
    pub fn with_documents(mut self, documents: Documents) -> Self {
        self.documents = Some(documents);
        self
    }
    /// Same options with one set of packed documents per batch row (see
    /// [`CpOpts::row_documents`]).
    pub fn with_row_documents(mut self, rows: Vec<Documents>) -> Self {
        self.row_documents = Some(rows);
        self
    }
    /// The mask of batch row `b`: [`CpOpts::mask_spec`] with that row's documents when
    /// [`CpOpts::row_documents`] is set.
    pub fn row_mask_spec(&self, b: usize) -> MaskSpec<'_> {
        match &self.row_documents {
            Some(rows) => MaskSpec { causal: self.causal, window: self.window, docs: rows.get(b) },
            None => self.mask_spec(),
        }
    }
    /// Number of distinct row masks: `B` entries of [`CpOpts::row_documents`], else 1.
    pub fn mask_rows(&self) -> usize {
        self.row_documents.as_ref().map_or(1, |r| r.len().max(1))
    }
    /// Same options with the backward's row sums taken as `row_sums` says (see
    /// [`CpOpts::row_sums`]).
    pub fn with_row_sums(mut self, row_sums: RowSums) -> Self {
        self.row_sums = row_sums;
        self
    }
    /// Same options with the halo exchange for short windows on or off (see [`CpOpts::halo`]).
    pub fn with_halo(mut self, halo: bool) -> Self {
        self.halo = halo;
        self
    }
    /// Same options with a causal sliding window of `window` keys (see [`CpOpts::window`]).
    pub fn with_window(mut self, window: usize) -> Self {
        self.window = Some(window);
        self
    }
    /// The mask these options describe (causal flag, window, documents), for the schedule.
    pub fn mask_spec(&self) -> MaskSpec<'_> {
        MaskSpec { causal: self.causal, window: self.window, docs: self.documents.as_ref() }
    }
    /// Same options with an explicit softmax scale.
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }
    /// Same options with the logits soft-capped at `cap` (`None`: uncapped; see
    /// [`CpOpts::softcap`]).
    pub fn with_softcap(mut self, cap: Option<f64>) -> Self {
        self.softcap = cap;
        self
    }
    /// Same options with attention sinks ([`CpOpts::sinks`]; `None`: none).
    pub fn with_sinks(mut self, sinks: Option<Sinks>) -> Self {
        self.sinks = sinks;
        self
    }
    /// Query rows per attention call for tensors on `device`: [`CpOpts::block_rows`] when it
    /// is set (non-zero), else [`DEFAULT_BLOCK_ROWS`] on the CPU and unbounded on CUDA.
    pub fn rows_per_call(&self, device: &Device) -> usize {
        match (self.block_rows, device) {
            (0, Device::Cuda(_)) => usize::MAX,
            (0, _) => DEFAULT_BLOCK_ROWS,
            (n, _) => n,
        }
    }
}

/// Local shapes of a CP attention call, checked locally and across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub b: usize,
    pub tl: usize,
    pub h: usize,
    pub hkv: usize,
    pub d: usize,
    pub t: usize,
}

fn dtype_code(d: DType) -> f32 {
    match d {
        DType::F32 => 1.0,
        DType::F16 => 2.0,
        DType::BF16 => 3.0,
        DType::F64 => 4.0,
        _ => 5.0,
    }
}

/// The logits of `opts`: its scale (else `1/sqrt(D)`) and soft cap.
pub(crate) fn scale_of(opts: &CpOpts, d: usize) -> Scores {
    Scores::new(opts.scale.unwrap_or(1.0 / (d as f64).sqrt())).with_softcap(opts.softcap)
}

/// [`check_inputs`] for a backward pass, plus: `out` and `dout` must match q's shape
/// `[B, T/P, H, D]` and `lse` must be `[B, H, T/P]`. Errors name the shapes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_bwd_inputs(
    name: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    group: &Group,
    opts: &CpOpts,
) -> Result<Dims> {
    let dims = check_inputs(name, q, k, v, group, opts)?;
    if out.dims() != q.dims() || dout.dims() != q.dims() || lse.dims() != [dims.b, dims.h, dims.tl]
    {
        bail!(
            "{name}: out {:?} and dout {:?} must match q {:?}, lse {:?} must be [B, H, T/P]",
            out.shape(),
            dout.shape(),
            q.shape(),
            lse.shape()
        )
    }
    Ok(dims)
}

/// Check local shapes (`q [B,T/P,H,D]`, `k, v [B,T/P,Hkv,D]`, `H % Hkv == 0`, same device and
/// dtype of k and v), the layout's divisibility, and that every rank passed the same shapes,
/// dtypes and options (one small all-gather). Errors name the shapes and the ranks.
pub(crate) fn check_inputs(
    name: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    group: &Group,
    opts: &CpOpts,
) -> Result<Dims> {
    let p = group.size();
    let (b, tl, h, d) = match q.dims() {
        &[b, tl, h, d] => (b, tl, h, d),
        _ => bail!("{name}: q must be [B, T/P, H, D], got {:?}", q.shape()),
    };
    let (kb, ktl, hkv, kd) = match k.dims() {
        &[b, t, h, d] => (b, t, h, d),
        _ => bail!("{name}: k must be [B, T/P, Hkv, D], got {:?}", k.shape()),
    };
    if k.shape() != v.shape() {
        bail!(
            "{name}: k {:?} and v {:?} must have the same shape",
            k.shape(),
            v.shape()
        )
    }
    candle_cp_comm::ensure_nonempty(name, "q", q)?;
    candle_cp_comm::ensure_nonempty(name, "k/v", k)?;
    if kb != b || ktl != tl || kd != d {
        bail!(
            "{name}: q {:?} and k/v {:?} disagree on B, T/P or D",
            q.shape(),
            k.shape()
        )
    }
    if hkv == 0 || h % hkv != 0 {
        bail!(
            "{name}: query heads H = {h} not a multiple of KV heads Hkv = {hkv} (q {:?}, k {:?})",
            q.shape(),
            k.shape()
        )
    }
    if k.dtype() != v.dtype() || q.dtype() != k.dtype() {
        bail!(
            "{name}: dtypes differ: q {:?}, k {:?}, v {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )
    }
    if !q.device().same_device(k.device()) || !q.device().same_device(v.device()) {
        bail!("{name}: q, k, v must be on the same device")
    }
    let t = tl * p;
    opts.layout.local_len(t, p)?;
    if let Some(docs) = &opts.documents {
        docs.check_len(&format!("{name} (q {:?} on each of P = {p} ranks)", q.shape()), t)?;
    }
    if let Some(rows) = &opts.row_documents {
        if opts.documents.is_some() {
            bail!("{name}: set documents (shared by every row) or row_documents (one per row), not both (q {:?})", q.shape())
        }
        if rows.len() != b {
            bail!("{name}: {} row_documents for q {:?}: one per batch row (B = {b})", rows.len(), q.shape())
        }
        for (i, docs) in rows.iter().enumerate() {
            docs.check_len(&format!("{name} (row {i} of q {:?} on each of P = {p} ranks)", q.shape()), t)?;
        }
    }
    let scores = scale_of(opts, d);
    scores.check(name)?;
    match opts.window {
        Some(0) => bail!("{name}: a sliding window must hold at least 1 key (q {:?})", q.shape()),
        Some(w) if !opts.causal => bail!("{name}: a sliding window ({w}) needs the causal mask (q {:?})", q.shape()),
        _ => {}
    }
    if let Some(z) = &opts.sinks {
        z.check(name, q)?;
    }
    if p > 1 && opts.check_ranks {
        let mine = [b, tl, h, hkv, d].map(|x| x as f32);
        // sinks: none = 0, else 1 and the sum of their values (the same parameter everywhere)
        let sinks = match &opts.sinks {
            Some(z) => [1.0, z.tensor().to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?],
            None => [0.0, 0.0],
        };
        // documents: none, or their fingerprint in four exact 16-bit pieces
        let fp = match (&opts.documents, &opts.row_documents) {
            (Some(x), _) => x.fingerprint(),
            (None, Some(rows)) => rows.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, x| h.rotate_left(17) ^ x.fingerprint()),
            (None, None) => 0,
        };
        let extra = [
            dtype_code(q.dtype()),
            opts.layout as u8 as f32,
            opts.causal as u8 as f32,
            (opts.documents.is_some() as u8 + 2 * opts.row_documents.is_some() as u8) as f32,
            (fp & 0xffff) as f32,
            ((fp >> 16) & 0xffff) as f32,
            ((fp >> 32) & 0xffff) as f32,
            (fp >> 48) as f32,
            // window: none = 0, else its size in two exact 16-bit pieces (+1 marks presence)
            opts.window.map_or(0.0, |w| 1.0 + (w & 0xffff) as f32),
            opts.window.map_or(0.0, |w| ((w >> 16) & 0xffff) as f32),
            scores.scale as f32,
            scores.softcap.map_or(0.0, |c| c as f32),
            sinks[0],
            sinks[1],
        ];
        let row: Vec<f32> = mine.iter().chain(extra.iter()).copied().collect();
        let n = row.len();
        // a host tensor: every group takes one, and an NCCL group checks its health after the
        // copy back (a dead peer is an error here, not a garbage row)
        let local = Tensor::from_vec(row, (1, n), &Device::Cpu)?;
        let all = group.all_gather(&local, 0)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
        for (r, other) in all.iter().enumerate() {
            if other[..5] != mine[..] {
                let s = |x: &[f32]| x.iter().map(|v| *v as usize).collect::<Vec<_>>();
                bail!(
                    "{name}: ranks disagree on local shapes [B, T/P, H, Hkv, D]: rank {} has {:?}, rank {r} has {:?} ({})",
                    group.rank(),
                    s(&mine),
                    s(&other[..5]),
                    group.describe()
                )
            }
            if other[5..] != extra[..] {
                bail!("{name}: ranks disagree on dtype, layout, causal flag, packed documents, sliding window, scale, soft cap or attention sinks (rank {} vs rank {r}, {})", group.rank(), group.describe())
            }
        }
    }
    Ok(Dims {
        b,
        tl,
        h,
        hkv,
        d,
        t,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_per_call_is_automatic_unless_set() {
        let cpu = Device::Cpu;
        let auto = CpOpts::default();
        assert_eq!(auto.block_rows, 0);
        assert_eq!(auto.rows_per_call(&cpu), DEFAULT_BLOCK_ROWS);
        let set = CpOpts { block_rows: 13, ..auto };
        assert_eq!(set.rows_per_call(&cpu), 13);
        assert_eq!(CpOpts::new(Layout::Striped, false).rows_per_call(&cpu), DEFAULT_BLOCK_ROWS);
    }
}
