//! Ulysses: all-to-all sequence <-> head sharding and Ulysses attention (DeepSpeed-Ulysses).
//!
//! A group of `P` ranks holds the sequence sharded: rank `r` has `T/P` rows of q `[B, T/P, H, D]`
//! and k, v `[B, T/P, Hkv, D]`. One all-to-all per tensor re-shards from sequence to heads:
//!
//! ```text
//!   rank r: [B, T/P, H, D]  --all_to_all_seq_to_head-->  [B, T, H/P, D]  (heads r·H/P ..)
//!   attention on the full sequence, H/P heads per rank (no communication)
//!   rank r: [B, T, H/P, D]  --all_to_all_head_to_seq-->  [B, T/P, H, D]
//! ```
//!
//! The two all-to-alls are conjugate autograd ops: the backward of each is one call to the other.
//!
//! **Sequence order.** The all-to-all concatenates the shards in rank order. With contiguous
//! sharding (rank `r` holds rows `[r·T/P, (r+1)·T/P)`, [`SeqOrder::Contiguous`]) that is the
//! global sequence. Any other sharding (zigzag, striped, ...) is supported by passing the
//! global positions of the gathered rows ([`SeqOrder::Permuted`]): the gathered sequence is
//! permuted to natural order before attention and back after it (a local `index_select`,
//! differentiable), so causal masks see true positions.
//!
//! **GQA / MQA.** Query head `h` uses KV head `h / (H/Hkv)`. `H % P == 0` is the only
//! requirement on the degree. If `Hkv % P == 0` the KV heads are split like the query heads.
//! Otherwise every KV head is replicated `f = lcm(Hkv, P)/Hkv` times before the all-to-all:
//! the `L = lcm(Hkv, P)` copies split evenly, and rank `r` receives copies
//! `[r·L/P, (r+1)·L/P)`, exactly the KV heads its query heads use, in order (`H/L` query heads
//! per copy there). With `P % Hkv == 0` (fewer KV heads than ranks) that is one copy of KV
//! head `r / (P/Hkv)` per rank; with neither dividing the other (e.g. `H = 28`, `Hkv = 4`,
//! `P = 7` or `14`) several. The backward sums
//! the gradients of the copies, in f32 (the kernel's dK/dV travel back unrounded), and rounds
//! once. A degree that does not divide `H` is an error that lists the degrees that work.
//!
//! **Backward.** [`ulysses_attention`] is one attached op: its backward all-to-alls dO to
//! heads, runs the raw attention backward ([`attention::attention_bwd`], f32 gradients) and
//! sends dQ, dK, dV back; the two all-to-all functions above remain separate autograd ops
//! for models that put their own attention between them.

use crate::attention::sinks::{apply_sinks, pad_heads, sinks_grad};
use crate::attention::{self, Mask, RowSums, Scores, Sinks};
use crate::autograd::{attach1, attach_n, BackwardFn};
use crate::cp::Layout;
use crate::packing::Documents;
use candle_core::{Result, Tensor};
use candle_cp_comm::Group;
use std::sync::Arc;

mod kept;
pub(crate) use kept::{HeadQkv, Kept};

fn check4(op: &str, name: &str, x: &Tensor) -> Result<(usize, usize, usize, usize)> {
    match x.dims() {
        &[b, t, h, d] => {
            candle_cp_comm::ensure_nonempty(op, name, x)?;
            Ok((b, t, h, d))
        }
        d => candle_core::bail!("{op}: {name} must be [B, T, H, D], got shape {d:?}"),
    }
}

pub(crate) fn seq_to_head_raw(x: &Tensor, group: &Group) -> Result<Tensor> {
    let (_, _, h, _) = check4("all_to_all_seq_to_head", "x", x)?;
    let p = group.size();
    if h % p != 0 {
        candle_core::bail!(
            "all_to_all_seq_to_head: H = {h} heads (x shape {:?}) not divisible by the Ulysses degree P = {p}",
            x.dims()
        )
    }
    if p == 1 {
        return Ok(x.clone());
    }
    group.all_to_all(&x.detach(), 2, 1)
}

pub(crate) fn head_to_seq_raw(x: &Tensor, group: &Group) -> Result<Tensor> {
    let (_, t, _, _) = check4("all_to_all_head_to_seq", "x", x)?;
    let p = group.size();
    if t % p != 0 {
        candle_core::bail!(
            "all_to_all_head_to_seq: T = {t} rows (x shape {:?}) not divisible by the Ulysses degree P = {p}",
            x.dims()
        )
    }
    if p == 1 {
        return Ok(x.clone());
    }
    group.all_to_all(&x.detach(), 1, 2)
}

/// Re-shard from sequence to heads: `x` `[B, T/P, H, D]` (this rank's `T/P` rows, all `H`
/// heads) → `[B, T, H/P, D]` (all `T` rows in rank order, heads `[r·H/P, (r+1)·H/P)`).
///
/// Collective over `group` (size `P`); `H % P == 0` required. Differentiable: the backward
/// is [`all_to_all_head_to_seq`] of the gradient.
pub fn all_to_all_seq_to_head(x: &Tensor, group: &Group) -> Result<Tensor> {
    let out = seq_to_head_raw(x, group)?;
    if group.size() == 1 {
        return Ok(out);
    }
    let g = group.clone();
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| Ok(vec![Some(all_to_all_head_to_seq(&dy.detach(), &g)?)]));
    attach1("all_to_all_seq_to_head", x, out, bwd)
}

/// Re-shard from heads to sequence: `x` `[B, T, H/P, D]` (all `T` rows, this rank's heads) →
/// `[B, T/P, H, D]` (rows `[r·T/P, (r+1)·T/P)` of the `T` rows, all heads in rank order).
///
/// Collective over `group` (size `P`); `T % P == 0` required. Differentiable: the backward
/// is [`all_to_all_seq_to_head`] of the gradient.
pub fn all_to_all_head_to_seq(x: &Tensor, group: &Group) -> Result<Tensor> {
    let out = head_to_seq_raw(x, group)?;
    if group.size() == 1 {
        return Ok(out);
    }
    let g = group.clone();
    let bwd: BackwardFn = Arc::new(move |dy: &Tensor| Ok(vec![Some(all_to_all_seq_to_head(&dy.detach(), &g)?)]));
    attach1("all_to_all_head_to_seq", x, out, bwd)
}

/// How the `Hkv` KV heads are spread over a Ulysses group of `P` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvSpread {
    /// `Hkv % P == 0`: rank `r` gets KV heads `[r·Hkv/P, (r+1)·Hkv/P)`.
    Split,
    /// `Hkv % P != 0`: each KV head is replicated this many (`lcm(Hkv, P)/Hkv`) times; rank
    /// `r` gets copies `[r·L/P, (r+1)·L/P)` of the `L = lcm(Hkv, P)` (for `P % Hkv == 0` one
    /// copy, of KV head `r / (P/Hkv)`).
    Replicate(usize),
}

/// Ulysses degrees `P` that work for `H` query heads and `Hkv` KV heads (`Hkv` dividing
/// `H`): the divisors of `H` (KV heads split or replicated, [`KvSpread`]).
pub fn valid_ulysses_degrees(h: usize, hkv: usize) -> Vec<usize> {
    (1..=h).filter(|&p| h.is_multiple_of(p) && hkv > 0 && h.is_multiple_of(hkv)).collect()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Decide how KV heads are spread over `p` ranks; errors name `H`, `Hkv`, `P` and list the
/// degrees that would work.
pub fn kv_spread(h: usize, hkv: usize, p: usize) -> Result<KvSpread> {
    if p == 0 || hkv == 0 || !h.is_multiple_of(hkv) {
        candle_core::bail!("ulysses: H = {h} query heads, Hkv = {hkv} KV heads, P = {p}: need P > 0 and Hkv dividing H")
    }
    let ok = valid_ulysses_degrees(h, hkv);
    if !h.is_multiple_of(p) {
        candle_core::bail!(
            "ulysses: H = {h} query heads not divisible by the Ulysses degree P = {p}; degrees that work for H = {h}, Hkv = {hkv}: {ok:?}"
        )
    }
    if hkv.is_multiple_of(p) {
        Ok(KvSpread::Split)
    } else {
        // lcm(Hkv, P) copies (it divides H, since Hkv and P do): P/gcd per KV head
        Ok(KvSpread::Replicate(p / gcd(hkv, p)))
    }
}

/// Replicate every KV head `f` times along the head dim: `[B, T, Hkv, D]` → `[B, T, Hkv·f, D]`,
/// head `j·f + i` is a copy of head `j`. Built from candle ops (broadcast + reshape), so the
/// backward sums the gradients of the `f` copies back into head `j`.
pub fn replicate_kv_heads(x: &Tensor, f: usize) -> Result<Tensor> {
    let (b, t, hkv, d) = check4("replicate_kv_heads", "x", x)?;
    if f == 1 {
        return Ok(x.clone());
    }
    x.unsqueeze(3)?.broadcast_as((b, t, hkv, f, d))?.reshape((b, t, hkv * f, d))
}

/// Order of the rows of the gathered sequence (the rank shards concatenated in rank order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SeqOrder {
    /// Contiguous sharding: rank `r` holds global rows `[r·T/P, (r+1)·T/P)`, so the gathered
    /// rows are in natural order.
    Contiguous,
    /// Any other sharding: entry `i` is the global position of gathered row `i` (rank `r`'s
    /// local row `j` is gathered row `r·T/P + j`). Must be a permutation of `0..T`.
    Permuted(Vec<usize>),
}

impl SeqOrder {
    /// Build from the global positions of each rank's local rows, in rank order.
    pub fn from_shards(shards: &[Vec<usize>]) -> Self {
        let pos: Vec<usize> = shards.iter().flatten().copied().collect();
        if pos.iter().enumerate().all(|(i, &p)| i == p) {
            SeqOrder::Contiguous
        } else {
            SeqOrder::Permuted(pos)
        }
    }
}

/// What the backward of [`ulysses_attention`] / [`crate::usp::usp_attention`] keeps of the
/// head layout (`[B, T, H/P, D]`) of q, k, v and the output.
///
/// The graph keeps the op's inputs q, k, v in the sequence layout and the next layer keeps its
/// output anyway; the backward's attention needs them in the head layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HeadLayout {
    /// Keep the forward's head-layout q, k, v and output until the backward: no extra
    /// communication, a second copy of those four per layer.
    #[default]
    Kept,
    /// Keep nothing in the head layout: the backward all-to-alls q, k, v and the output to
    /// heads again (four more all-to-alls per layer, 50% more Ulysses volume per training
    /// step). The gradients are bit-identical to [`HeadLayout::Kept`]'s: the all-to-alls only
    /// move rows. (A 16-bit output's bf16 rounding residual, kept for f32 row sums, is kept in
    /// both modes: the 2-D op's by default, as the ring's; Ulysses' with [`RowSums::F32`].)
    Regathered,
}

/// Options of [`ulysses_attention`].
#[derive(Clone, Debug)]
pub struct UlyssesOpts {
    /// Causal mask over global positions (query at `i` sees keys at `j <= i`); else full.
    pub causal: bool,
    /// Softmax scale, usually `1/sqrt(D)`.
    pub scale: f64,
    /// Logit soft cap (Gemma 2; see [`attention::Scores`]), `None` for none.
    pub softcap: Option<f64>,
    /// Global positions of the gathered rows (see [`SeqOrder`]).
    pub order: SeqOrder,
    /// Packed documents of the global sequence (`None`: one document): a query sees only keys
    /// of its own document (see [`crate::packing`]); must cover the gathered `T`.
    pub documents: Option<Documents>,
    /// Packed documents per batch row (`B` entries, each covering the gathered `T`); exclusive
    /// with `documents`. One attention call for the batch (one band per row).
    pub row_documents: Option<Vec<Documents>>,
    /// Causal sliding window of `window` keys (needs `causal`; within each document when
    /// `documents` is set), `None` for none.
    pub window: Option<usize>,
    /// What the backward keeps of the head layout (default [`HeadLayout::Kept`]).
    pub head_layout: HeadLayout,
    /// Where the backward's row sums take the output from (default [`RowSums::Output`]; with
    /// [`RowSums::F32`] a 16-bit output's bf16 rounding residual is kept in the head layout,
    /// `[B, T, H/P, D]`, in either head layout mode).
    pub row_sums: RowSums,
    /// Attention sinks, one logit per query head of the local q (`[H]`, see
    /// [`attention::sinks`]): rank `r` applies heads `[r·H/P, (r+1)·H/P)` to its finished
    /// head-layout rows; their gradient is zero outside that slice. `None`: no sinks.
    pub sinks: Option<Sinks>,
}

impl UlyssesOpts {
    /// Contiguous sharding with the given mask type and scale.
    pub fn new(causal: bool, scale: f64) -> Self {
        Self {
            causal,
            scale,
            softcap: None,
            order: SeqOrder::Contiguous,
            documents: None,
            row_documents: None,
            window: None,
            head_layout: HeadLayout::Kept,
            row_sums: RowSums::Output,
            sinks: None,
        }
    }

    /// Same options with attention sinks (see [`UlyssesOpts::sinks`]; `None`: none).
    pub fn with_sinks(mut self, sinks: Option<Sinks>) -> Self {
        self.sinks = sinks;
        self
    }

    /// Same options with the logits soft-capped at `cap` (`None`: uncapped; see
    /// [`attention::Scores`]).
    pub fn with_softcap(mut self, cap: Option<f64>) -> Self {
        self.softcap = cap;
        self
    }

    /// The scale and soft cap as the attention ops take them.
    pub fn scores(&self) -> Scores {
        Scores::new(self.scale).with_softcap(self.softcap)
    }

    /// Same options with the backward's row sums taken as `row_sums` says (see [`RowSums`]).
    pub fn with_row_sums(mut self, row_sums: RowSums) -> Self {
        self.row_sums = row_sums;
        self
    }

    /// Same options with the backward keeping `head_layout` (see [`HeadLayout`]).
    pub fn with_head_layout(mut self, head_layout: HeadLayout) -> Self {
        self.head_layout = head_layout;
        self
    }

    /// Same options with one set of packed documents per batch row (see
    /// [`UlyssesOpts::row_documents`]).
    pub fn with_row_documents(mut self, rows: Vec<Documents>) -> Self {
        self.row_documents = Some(rows);
        self
    }

    /// Same options with attention kept inside the packed `documents`.
    pub fn with_documents(mut self, documents: Documents) -> Self {
        self.documents = Some(documents);
        self
    }

    /// Same options with a causal sliding window of `window` keys.
    pub fn with_window(mut self, window: usize) -> Self {
        self.window = Some(window);
        self
    }

    /// Same options for q/k/v sharded over `p` ranks with a CP [`Layout`] (global length
    /// `t`): sets [`SeqOrder`] from the layout's positions (contiguous needs no permutation).
    pub fn with_layout(mut self, layout: Layout, t: usize, p: usize) -> Result<Self> {
        let shards = (0..p).map(|r| crate::cp::positions(layout, r, p, t)).collect::<Result<Vec<_>>>()?;
        self.order = SeqOrder::from_shards(&shards);
        Ok(self)
    }
}

/// Permutation helpers: `to_nat` brings gathered rows to natural order, `to_gat` back.
struct Perm {
    to_nat: Tensor,
    to_gat: Tensor,
}

fn perm(order: &SeqOrder, t: usize, dev: &candle_core::Device) -> Result<Option<Perm>> {
    let pos = match order {
        SeqOrder::Contiguous => return Ok(None),
        SeqOrder::Permuted(p) => p,
    };
    if pos.len() != t {
        candle_core::bail!("ulysses: SeqOrder has {} positions for a gathered sequence of T = {t}", pos.len())
    }
    let mut inv = vec![u32::MAX; t];
    for (i, &p) in pos.iter().enumerate() {
        if p >= t || inv[p] != u32::MAX {
            candle_core::bail!("ulysses: SeqOrder is not a permutation of 0..{t} (position {p} at row {i})")
        }
        inv[p] = i as u32;
    }
    let fwd: Vec<u32> = pos.iter().map(|&p| p as u32).collect();
    Ok(Some(Perm { to_nat: Tensor::new(inv, dev)?, to_gat: Tensor::new(fwd, dev)? }))
}

/// Check q/k/v shapes for Ulysses-style attention; returns `(B, T_local, H, Hkv, D)`.
pub(crate) fn check_qkv(op: &str, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(usize, usize, usize, usize, usize)> {
    let (b, t, h, d) = check4(op, "q", q)?;
    let (bk, tk, hkv, dk) = check4(op, "k", k)?;
    if k.dims() != v.dims() || bk != b || tk != t || dk != d || hkv == 0 || h % hkv != 0 {
        candle_core::bail!(
            "{op}: q {:?}, k {:?}, v {:?}: need k, v = [B, T, Hkv, D] with q's B, T, D and Hkv dividing H",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    if q.dtype() != k.dtype() || k.dtype() != v.dtype() {
        candle_core::bail!("{op}: dtypes differ: q {:?} {:?}, k {:?}, v {:?}", q.dims(), q.dtype(), k.dtype(), v.dtype())
    }
    if !q.device().same_device(k.device()) || !q.device().same_device(v.device()) {
        candle_core::bail!("{op}: q {:?}, k {:?}, v {:?} must be on the same device", q.dims(), k.dims(), v.dims())
    }
    Ok((b, t, h, hkv, d))
}

/// Re-shard k or v from sequence to heads for `spread` without a graph: `[B, T/P, Hkv, D]` →
/// this rank's KV heads of the gathered sequence (every KV head copied first when `spread`
/// replicates, so rank `r` receives the one its query heads use).
pub(crate) fn kv_seq_to_head_raw(x: &Tensor, spread: KvSpread, group: &Group) -> Result<Tensor> {
    match spread {
        KvSpread::Split => seq_to_head_raw(&x.detach(), group),
        KvSpread::Replicate(f) => seq_to_head_raw(&replicate_kv_heads(&x.detach(), f)?, group),
    }
}

/// The conjugate of [`kv_seq_to_head_raw`] for an f32 gradient `x` `[B, T, Hkv/P or 1, D]`:
/// back to `[B, T/P, Hkv, D]` in `dtype`. Split heads travel in `dtype`; replicated heads
/// travel in f32 and their copies are summed in f32, so the result is rounded once.
pub(crate) fn kv_grad_head_to_seq(x: Tensor, spread: KvSpread, group: &Group, dtype: candle_core::DType) -> Result<Tensor> {
    match spread {
        KvSpread::Split => head_to_seq_raw(&x.to_dtype(dtype)?, group),
        KvSpread::Replicate(f) => {
            let x = head_to_seq_raw(&x, group)?;
            let (b, tl, hf, d) = x.dims4()?;
            x.reshape((b, tl, hf / f, f, d))?.sum(3)?.to_dtype(dtype)
        }
    }
}

/// Head-sharded LSE `[B, H/P, T]` → sequence-sharded `[B, H, T/P]` (no gradient; LSE is
/// an output, not differentiable).
pub(crate) fn lse_head_to_seq(lse: &Tensor, group: &Group) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(lse.clone());
    }
    group.all_to_all(&lse.detach(), 2, 1)
}

/// Ulysses attention over a group of `P` ranks.
///
/// - `q` `[B, T/P, H, D]`, `k`, `v` `[B, T/P, Hkv, D]`: this rank's `T/P` rows of the global
///   sequence of `T` rows (sharded as `opts.order` says; contiguous by default).
/// - returns `out` `[B, T/P, H, D]` (q's dtype, differentiable w.r.t. q, k, v) and `lse`
///   `[B, H, T/P]` (f32, not differentiable), for this rank's rows.
///
/// The backward is one call of the raw attention backward on the gathered heads (row sums as
/// [`UlyssesOpts::row_sums`] says, by default from the output in q's dtype, as the
/// single-device op takes them), between the conjugate
/// all-to-alls. Its dK/dV leave the kernel in f32; when KV heads are replicated
/// (`P > Hkv`) the copies' gradients travel back in f32 and are summed in f32 before the one
/// cast to k's dtype, so bf16 dK/dV are as accurate as the single-device op's (adding bf16
/// copies would round each copy and the sum: 1.4–1.5x the error at P = 2·Hkv, test
/// `bf16_precision`). Split KV heads travel back in k's dtype.
///
/// Errors: `H % P != 0` (the message lists the degrees that work), mismatched shapes.
/// Collective over `group`.
pub fn ulysses_attention(q: &Tensor, k: &Tensor, v: &Tensor, group: &Group, opts: &UlyssesOpts) -> Result<(Tensor, Tensor)> {
    let (_, t_local, h, hkv, _) = check_qkv("ulysses_attention", q, k, v)?;
    let p = group.size();
    let spread = kv_spread(h, hkv, p)?;
    // the sinks of this rank's heads in the head layout, [r·H/P, (r+1)·H/P)
    let h0 = group.rank() * (h / p);
    let sinks_h = match &opts.sinks {
        Some(z) => {
            z.check("ulysses_attention", q)?;
            Some(z.narrow(h0, h / p)?)
        }
        None => None,
    };
    let t = t_local * p;
    let mut vis = Visibility::new(opts, q.dim(0)?, t, q.dims())?;
    if let Visibility::Band(band) = &mut vis {
        // one device copy of the bounds for the forward and the backward
        if band.device_bounds(q.device()).is_none() {
            attention::Band::upload_all([band.as_mut()], q.device())?;
        }
    }
    let perm = perm(&opts.order, t, q.device())?.map(Arc::new);
    // to natural order (dim 1 of [B, T, H/P, D]) and back (`dim`: 1, or 2 for lse [B, H/P, T])
    let nat = {
        let perm = perm.clone();
        move |x: Tensor| -> Result<Tensor> {
            match &perm {
                None => Ok(x),
                Some(pm) => x.contiguous()?.index_select(&pm.to_nat, 1),
            }
        }
    };
    let gat = {
        let perm = perm.clone();
        move |x: Tensor, dim: usize| -> Result<Tensor> {
            match &perm {
                None => Ok(x),
                Some(pm) => x.contiguous()?.index_select(&pm.to_gat, dim),
            }
        }
    };
    let heads = HeadQkv::gather(q, k, v, spread, group, &nat)?;
    let (out32, lse_h) = vis.fwd(&heads.q, &heads.k, &heads.v, opts.scores())?;
    let (out32, lse_h) = match &sinks_h {
        Some(z) => apply_sinks(&out32, &lse_h, z.tensor())?,
        None => (out32, lse_h),
    };
    let out_h = out32.to_dtype(q.dtype())?;
    let residual = match opts.row_sums {
        RowSums::F32 => crate::autograd::rounding_residual(&out32, &out_h)?,
        RowSums::Output => None,
    };
    drop(out32);
    let out = head_to_seq_raw(&gat(out_h.clone(), 1)?, group)?;
    let lse = lse_head_to_seq(&gat(lse_h.clone(), 2)?, group)?;
    let (g, scale, qdt, kdt) = (group.clone(), opts.scores(), q.dtype(), k.dtype());
    let (hq, z_full) = (h, opts.sinks.as_ref().map(|z| z.tensor().detach()));
    let kept = Kept::new(opts.head_layout, heads, out_h, q, k, v);
    let slot = kept.slot();
    let bwd: BackwardFn = Arc::new(move |dout: &Tensor| {
        let (h, out_h) = kept.heads(spread, &g, &nat)?;
        // the f32 output for the row sums ([`RowSums::F32`]), else the 16-bit one
        let out_h = match &residual {
            Some(r) => crate::autograd::add_residual(&out_h, Some(r))?,
            None => out_h,
        };
        let dh = nat(seq_to_head_raw(&dout.to_dtype(qdt)?, &g)?)?;
        let (dq, dk, dv) = vis.bwd(&h.q, &h.k, &h.v, &out_h, &lse_h, &dh, scale)?;
        let dz = match (&sinks_h, &z_full) {
            (Some(z), Some(full)) => Some(pad_heads(&sinks_grad(&out_h, &lse_h, &dh, z.tensor())?, h0, hq, full.dtype())?),
            _ => None,
        };
        let dq = head_to_seq_raw(&gat(dq.to_dtype(qdt)?, 1)?, &g)?;
        let kv_back = |x: Tensor| kv_grad_head_to_seq(gat(x, 1)?, spread, &g, kdt);
        let mut grads = vec![Some(dq), Some(kv_back(dk)?), Some(kv_back(dv)?)];
        if dz.is_some() {
            grads.push(dz);
        }
        Ok(grads)
    });
    let out = match &opts.sinks {
        Some(z) => attach_n("ulysses_attention", &[q, k, v, z.tensor()], out, bwd)?,
        None => attach_n("ulysses_attention", &[q, k, v], out, bwd)?,
    };
    if let Some(slot) = slot {
        slot.set(&out);
    }
    Ok((out, lse))
}

/// What the gathered rows (natural order, `T` of them) see: a mask (full, causal, window),
/// or a band of packed documents (shared by the batch rows or one per row).
enum Visibility {
    Mask(Mask),
    Band(Box<attention::Band>),
}

impl Visibility {
    fn new(opts: &UlyssesOpts, b: usize, t: usize, q_dims: &[usize]) -> Result<Self> {
        let mask = match (opts.causal, opts.window) {
            (true, Some(w)) => Mask::sliding_window(w),
            (true, None) => Mask::causal(),
            (false, None) => Mask::Full,
            (false, Some(w)) => candle_core::bail!("ulysses_attention: a sliding window ({w}) needs the causal mask (q {q_dims:?})"),
        };
        let rows = match (&opts.documents, &opts.row_documents) {
            (None, None) => return Ok(Visibility::Mask(mask)),
            (Some(docs), None) => vec![docs.clone()],
            (None, Some(rows)) => {
                if rows.len() != b {
                    candle_core::bail!("ulysses_attention: {} row_documents for q {q_dims:?}: one per batch row (B = {b})", rows.len())
                }
                rows.clone()
            }
            (Some(_), Some(_)) => candle_core::bail!(
                "ulysses_attention: set documents (shared by every row) or row_documents (one per row), not both (q {q_dims:?})"
            ),
        };
        for (i, docs) in rows.iter().enumerate() {
            docs.check_len(&format!("ulysses_attention (documents of row {i}, q {q_dims:?}, gathered T = {t})"), t)?;
        }
        Ok(Visibility::Band(Box::new(attention::Band::documents(t, &rows, opts.causal, opts.window)?)))
    }

    /// Raw forward: out f32, lse f32.
    fn fwd(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: Scores) -> Result<(Tensor, Tensor)> {
        match self {
            Visibility::Mask(m) => attention::attention_fwd(q, k, v, m, scale),
            Visibility::Band(b) => attention::attention_fwd_band(q, k, v, b, scale),
        }
    }

    /// Raw backward: f32 dq, dk, dv.
    #[allow(clippy::too_many_arguments)]
    fn bwd(&self, q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, lse: &Tensor, dout: &Tensor, scale: Scores) -> Result<(Tensor, Tensor, Tensor)> {
        match self {
            Visibility::Mask(m) => attention::attention_bwd(q, k, v, out, lse, dout, m, scale),
            Visibility::Band(b) => attention::attention_bwd_band(q, k, v, out, lse, dout, b, scale),
        }
    }
}


/// Contiguous sequence shard `[B, T/P, ...]` of `x` `[B, T, ...]` for `rank` of `p`
/// (helper for tests and the CLI; no graph beyond `narrow`).
pub fn contiguous_shard(x: &Tensor, rank: usize, p: usize) -> Result<Tensor> {
    let t = x.dim(1)?;
    if p == 0 || t % p != 0 || rank >= p {
        candle_core::bail!("contiguous_shard: T = {t} (shape {:?}) cannot be split into P = {p} shards (rank {rank})", x.dims())
    }
    x.narrow(1, rank * (t / p), t / p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, IndexOp, Var};

    #[test]
    fn degrees_and_kv_spread() -> Result<()> {
        assert_eq!(valid_ulysses_degrees(8, 2), vec![1, 2, 4, 8]);
        assert_eq!(valid_ulysses_degrees(6, 1), vec![1, 2, 3, 6]);
        assert_eq!(valid_ulysses_degrees(12, 3), vec![1, 2, 3, 4, 6, 12]);
        assert_eq!(valid_ulysses_degrees(28, 4), vec![1, 2, 4, 7, 14, 28]);
        assert_eq!(valid_ulysses_degrees(4, 4), vec![1, 2, 4]);
        assert_eq!(kv_spread(8, 2, 2)?, KvSpread::Split);
        assert_eq!(kv_spread(8, 2, 4)?, KvSpread::Replicate(2));
        assert_eq!(kv_spread(8, 2, 8)?, KvSpread::Replicate(4));
        // neither dividing the other: lcm(Hkv, P) copies, L/P per rank
        assert_eq!(kv_spread(12, 3, 2)?, KvSpread::Replicate(2)); // 6 copies, 3 per rank
        assert_eq!(kv_spread(28, 4, 14)?, KvSpread::Replicate(7)); // 28 copies, 2 per rank
        assert_eq!(kv_spread(12, 4, 6)?, KvSpread::Replicate(3)); // 12 copies, 2 per rank
        let e = kv_spread(6, 6, 4).unwrap_err().to_string();
        assert!(e.contains("H = 6") && e.contains("P = 4") && e.contains("[1, 2, 3, 6]"), "{e}");
        Ok(())
    }

    #[test]
    fn replicated_kv_heads_copy_values_and_sum_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::arange(0f32, 12., &dev)?.reshape((1, 2, 2, 3))?)?;
        let y = replicate_kv_heads(x.as_tensor(), 3)?;
        assert_eq!(y.dims(), &[1, 2, 6, 3]);
        for h in 0..6 {
            let d = (y.i((.., .., h, ..))? - x.as_tensor().i((.., .., h / 3, ..))?)?.abs()?.sum_all()?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0, "copy {h}");
        }
        let w = Tensor::arange(0f32, 36., &dev)?.reshape((1, 2, 6, 3))?;
        let g = (&y * &w)?.sum_all()?.backward()?;
        let gx = g.get(x.as_tensor()).expect("gradient of x");
        let want = w.reshape((1, 2, 2, 3, 3))?.sum(3)?;
        assert_eq!((gx - want)?.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0);
        Ok(())
    }

    #[test]
    fn seq_order_from_shards() -> Result<()> {
        assert_eq!(SeqOrder::from_shards(&[vec![0, 1], vec![2, 3]]), SeqOrder::Contiguous);
        assert_eq!(SeqOrder::from_shards(&[vec![0, 3], vec![1, 2]]), SeqOrder::Permuted(vec![0, 3, 1, 2]));
        let o = UlyssesOpts::new(true, 1.0).with_layout(Layout::Striped, 4, 2)?;
        assert_eq!(o.order, SeqOrder::Permuted(vec![0, 2, 1, 3]));
        assert!(perm(&SeqOrder::Permuted(vec![0, 0]), 2, &Device::Cpu).is_err());
        Ok(())
    }
}
