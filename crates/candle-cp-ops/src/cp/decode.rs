//! Decode-time context parallelism: generation against a KV cache sharded over the CP ranks.
//!
//! After a context-parallel prefill every rank holds the K/V of its shard of the prompt (any
//! layout: the rows carry their global positions). Decoding then never gathers the cache:
//!
//! ```text
//!   new token at position p (the same q on every rank)
//!   rank r: (out_r, lse_r) = attention(q, its cache shard)      keys with position <= p
//!           (the token's own K/V was appended to rank `decode_owner(p, P)` first)
//!   all-gather the P partial (out, lse): P·B·H·(D+1) floats per layer and token
//!   every rank merges them through the LSE (same order, same bits) → out
//! ```
//!
//! Each rank's cache holds `~T/P` tokens, so a 1M-token context decodes with `1/P` of the KV
//! memory per GPU, and per token only the tiny partial results travel (not K/V). New tokens'
//! entries go round-robin ([`decode_owner`]) so the shards stay balanced.

use crate::attention::{apply_sinks, Scores, Sinks};
use crate::attention::{attention_fwd, merge, Mask};
use crate::Group;
use candle_core::{bail, DType, Result, Tensor};

/// One rank's shard of one layer's KV cache: `k, v [B, S_r, Hkv, D]` and the global position
/// of each of the `S_r` rows (any order).
///
/// Rows live in buffers with spare capacity along `S` (doubled when full), written in place
/// ([`Tensor::slice_set`]): appending one decoded token copies one row, not the shard.
///
/// A shard filled through [`KvShard::append_shared`] holds one buffer that is both the keys
/// and the values (DeepSeek's latent rows, which every head attends to as key and value):
/// half the bytes of the same rows given twice to [`KvShard::append`].
#[derive(Clone, Debug, Default)]
pub struct KvShard {
    /// `k [B, capacity, Hkv, D]` and `v` alike (`None`: the values are the keys, shared
    /// rows); rows `0..positions.len()` are in use.
    buf: Option<(Tensor, Option<Tensor>)>,
    positions: Vec<usize>,
    /// Per batch row, the first position holding one of its keys (rows before it are left
    /// padding, seen by no query of that row); empty: every row starts at 0.
    starts: Vec<usize>,
}

impl KvShard {
    /// An empty shard.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rows `k, v [B, n, Hkv, D]` at global `positions` (`n` of them) appended to the shard
    /// (the first append fixes `B`, `Hkv`, `D`, dtype and device). Errors name the shapes.
    pub fn append(&mut self, k: &Tensor, v: &Tensor, positions: &[usize]) -> Result<()> {
        if k.shape() != v.shape() {
            bail!("KvShard::append: k {:?} and v {:?} must match ({} positions)", k.shape(), v.shape(), positions.len())
        }
        self.append_rows(k, Some(v), positions, "KvShard::append")
    }

    /// Rows `[B, n, Hkv, D]` at global `positions` appended as keys that are also the values
    /// (one buffer, [`KvShard::kv`] returns it twice). A shard takes one kind of append:
    /// shared rows into a shard of separate k, v (or the reverse) are an error.
    pub fn append_shared(&mut self, rows: &Tensor, positions: &[usize]) -> Result<()> {
        self.append_rows(rows, None, positions, "KvShard::append_shared")
    }

    fn append_rows(&mut self, k: &Tensor, v: Option<&Tensor>, positions: &[usize], what: &str) -> Result<()> {
        let n = match k.dims() {
            [_, n, _, _] => *n,
            _ => bail!("{what}: rows must be [B, n, Hkv, D], got {:?}", k.shape()),
        };
        if n != positions.len() {
            bail!("{what}: rows {:?} must hold one row per position ({} positions)", k.shape(), positions.len())
        }
        if let Some((_, vb)) = &self.buf {
            if vb.is_some() != v.is_some() {
                let kinds = if v.is_some() { "separate k, v into a shard of shared rows" } else { "shared rows into a shard of separate k, v" };
                bail!("{what}: {kinds} (rows {:?}, {} cached)", k.shape(), self.positions.len())
            }
        }
        if n == 0 {
            // nothing to append (a rank that holds no row of this prefill)
            return Ok(());
        }
        candle_cp_comm::ensure_nonempty(what, "k", k)?;
        let len = self.positions.len();
        let (kb, vb) = match self.buf.take() {
            None => (k.contiguous()?.copy()?, v.map(|v| v.contiguous()?.copy()).transpose()?),
            Some((kb, vb)) => {
                let (cd, nd) = (kb.dims(), k.dims());
                if cd[0] != nd[0] || cd[2..] != nd[2..] || kb.dtype() != k.dtype() || !kb.device().same_device(k.device()) {
                    let e = format!(
                        "{what}: rows k {:?} ({:?}) do not match the cache [{}, {len}, {}, {}] ({:?})",
                        k.shape(),
                        k.dtype(),
                        cd[0],
                        cd[2],
                        cd[3],
                        kb.dtype()
                    );
                    self.buf = Some((kb, vb));
                    bail!("{e}")
                }
                let cap = kb.dim(1)?;
                let (kb, vb) = if len + n > cap {
                    let new_cap = (2 * cap).max(len + n);
                    (grow(&kb, len, new_cap)?, vb.map(|vb| grow(&vb, len, new_cap)).transpose()?)
                } else {
                    (kb, vb)
                };
                kb.slice_set(&k.contiguous()?, 1, len)?;
                if let (Some(vb), Some(v)) = (&vb, v) {
                    vb.slice_set(&v.contiguous()?, 1, len)?;
                }
                (kb, vb)
            }
        };
        self.buf = Some((kb, vb));
        self.positions.extend_from_slice(positions);
        Ok(())
    }

    /// Marks batch row `b`'s keys at positions before `starts[b]` as padding: no query of row
    /// `b` sees them ([`sharded_decode_attention`]). A batch of prompts of different lengths,
    /// padded on the left to one length, keeps its padding's rows in the cache (every row of
    /// the buffer has the same positions) and masks them by this. `starts` must hold one entry
    /// per batch row (checked by the attention against `q`'s `B`); empty: no padding.
    pub fn set_row_starts(&mut self, starts: Vec<usize>) {
        self.starts = starts;
    }

    /// Per batch row, the first position holding one of its keys ([`KvShard::set_row_starts`];
    /// empty when no row is padded).
    pub fn row_starts(&self) -> &[usize] {
        &self.starts
    }

    /// Number of cached rows.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// No cached row.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Global positions of the cached rows, in cache order.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// The cached `k, v [B, S_r, Hkv, D]` (views of the rows in use, the same view twice for
    /// shared rows; `None` when empty).
    pub fn kv(&self) -> Option<(Tensor, Tensor)> {
        let (kb, vb) = self.buf.as_ref()?;
        let n = self.positions.len();
        let k = kb.narrow(1, 0, n).ok()?;
        let v = match vb {
            Some(vb) => vb.narrow(1, 0, n).ok()?,
            None => k.clone(),
        };
        Some((k, v))
    }

    /// Do the keys double as the values ([`KvShard::append_shared`])?
    pub fn shared(&self) -> bool {
        matches!(self.buf, Some((_, None)))
    }

    /// Bytes of the rows in use (k and v; shared rows once).
    pub fn bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |(k, v)| {
            let row = k.elem_count() / k.dim(1).unwrap_or(1).max(1) * k.dtype().size_in_bytes();
            row * self.positions.len() * if v.is_some() { 2 } else { 1 }
        })
    }

    /// Bytes of the buffers (rows in use plus spare capacity; shared rows once).
    pub fn allocated_bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |(k, v)| (k.elem_count() + v.as_ref().map_or(0, |v| v.elem_count())) * k.dtype().size_in_bytes())
    }

    /// Number of cached rows at positions before `pos`.
    pub fn count_before(&self, pos: usize) -> usize {
        self.positions.iter().filter(|&&p| p < pos).count()
    }

    /// Drop the rows at positions before `pos` (a sliding window no longer reaches them);
    /// returns how many were dropped. The kept rows are copied into buffers of their size.
    pub fn evict_before(&mut self, pos: usize) -> Result<usize> {
        let keep: Vec<u32> = self.positions.iter().enumerate().filter(|(_, &p)| p >= pos).map(|(i, _)| i as u32).collect();
        let dropped = self.positions.len() - keep.len();
        if dropped == 0 {
            return Ok(0);
        }
        let shared = self.shared();
        self.buf = match (self.kv(), keep.is_empty()) {
            (Some((k, v)), false) => {
                let idx = Tensor::new(keep.as_slice(), k.device())?;
                let k = k.contiguous()?.index_select(&idx, 1)?;
                let v = if shared { None } else { Some(v.contiguous()?.index_select(&idx, 1)?) };
                Some((k, v))
            }
            _ => None,
        };
        self.positions.retain(|&p| p >= pos);
        Ok(dropped)
    }
}

/// `x [B, cap, H, D]` with its first `len` rows copied into a zeroed `[B, new_cap, H, D]`.
fn grow(x: &Tensor, len: usize, new_cap: usize) -> Result<Tensor> {
    let (b, _, h, d) = x.dims4()?;
    let y = Tensor::zeros((b, new_cap, h, d), x.dtype(), x.device())?;
    if len > 0 {
        y.slice_set(&x.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
    }
    Ok(y)
}

/// The rank that stores the cache entry of the token decoded at global position `pos` over
/// `p` ranks: round-robin, so the shards grow evenly.
pub fn decode_owner(pos: usize, p: usize) -> usize {
    pos % p.max(1)
}

/// This rank's partial attention: f32 out `[B, Tq, H, D]`, lse `[B, H, Tq]` of `q` against
/// the shard's rows visible from each query (position `<= qp`, and `> qp - window`, and for
/// batch row `b` not before its start, [`KvShard::set_row_starts`]).
fn local_partial(q: &Tensor, q_positions: &[usize], shard: &KvShard, scale: Scores, window: Option<usize>) -> Result<(Tensor, Tensor)> {
    let Some((k, v)) = shard.kv() else { return no_keys(q) };
    let starts = shard.row_starts();
    let padded = starts.iter().any(|&s| shard.positions().iter().any(|&kp| kp < s));
    if !padded {
        return rows_partial(q, q_positions, (&k, &v), shard.positions(), scale, window, 0);
    }
    // left padding: the batch rows grouped by their start, each group against its own keys
    let mut groups: Vec<(usize, Vec<u32>)> = Vec::new();
    for (row, &s) in starts.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| *g == s) {
            Some((_, rows)) => rows.push(row as u32),
            None => groups.push((s, vec![row as u32])),
        }
    }
    let (mut outs, mut lses, mut order) = (Vec::new(), Vec::new(), Vec::new());
    for (s, rows) in &groups {
        let idx = Tensor::new(rows.as_slice(), q.device())?;
        let pick = |x: &Tensor| x.contiguous()?.index_select(&idx, 0);
        let (o, l) = rows_partial(&pick(q)?, q_positions, (&pick(&k)?, &pick(&v)?), shard.positions(), scale, window, *s)?;
        outs.push(o);
        lses.push(l);
        order.extend_from_slice(rows);
    }
    // back to batch order
    let mut inverse = vec![0u32; order.len()];
    for (i, &row) in order.iter().enumerate() {
        inverse[row as usize] = i as u32;
    }
    let inverse = Tensor::new(inverse.as_slice(), q.device())?;
    Ok((Tensor::cat(&outs, 0)?.index_select(&inverse, 0)?, Tensor::cat(&lses, 0)?.index_select(&inverse, 0)?))
}

/// The partial result of a query that sees no key: out 0 `[B, Tq, H, D]`, lse `-inf`
/// `[B, H, Tq]` (f32; the merge gives it no weight).
fn no_keys(q: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, tq, h, d) = q.dims4()?;
    Ok((Tensor::zeros((b, tq, h, d), DType::F32, q.device())?, Tensor::full(f32::NEG_INFINITY, (b, h, tq), q.device())?))
}

/// [`local_partial`] of the batch rows in `q` against keys `k, v` at `positions`, the keys
/// before `start` hidden from every query.
fn rows_partial(q: &Tensor, q_positions: &[usize], (k, v): (&Tensor, &Tensor), positions: &[usize], scale: Scores, window: Option<usize>, start: usize) -> Result<(Tensor, Tensor)> {
    let visible = |qp: usize, kp: usize| kp >= start && kp <= qp && window.is_none_or(|w| qp - kp < w);
    // common case: every row visible from every query (decode: all cached keys are older)
    if q_positions.iter().all(|&qp| positions.iter().all(|&kp| visible(qp, kp))) {
        return attention_fwd(q, k, v, &Mask::Full, scale);
    }
    // otherwise one query row at a time against its visible rows
    let (k, v) = (&k.contiguous()?, &v.contiguous()?);
    let mut outs = Vec::with_capacity(q_positions.len());
    let mut lses = Vec::with_capacity(q_positions.len());
    for (i, &qp) in q_positions.iter().enumerate() {
        let rows: Vec<u32> = positions.iter().enumerate().filter(|(_, &kp)| visible(qp, kp)).map(|(j, _)| j as u32).collect();
        let qi = q.narrow(1, i, 1)?;
        let (o, l) = if rows.is_empty() {
            no_keys(&qi)?
        } else {
            let idx = Tensor::new(rows, k.device())?;
            attention_fwd(&qi, &k.index_select(&idx, 1)?, &v.index_select(&idx, 1)?, &Mask::Full, scale)?
        };
        outs.push(o);
        lses.push(l);
    }
    Ok((Tensor::cat(&outs, 1)?, Tensor::cat(&lses, 2)?))
}

/// Attention of new queries against a KV cache sharded over the ranks of `group` (see the
/// module docs). Not differentiable (inference).
///
/// - `q [B, Tq, H, D]` and `q_positions` (`Tq` global positions): the same on every rank;
/// - `shard`: this rank's rows of the cache (with `Hkv` dividing `H`, GQA), already holding the
///   new tokens' own K/V wherever they were appended;
/// - a key at `kp` is visible from a query at `qp` iff `kp <= qp` (and `qp - kp < window`),
///   and, in batch row `b` of a left-padded cache, `kp >= starts[b]` ([`KvShard::set_row_starts`]).
///
/// Returns out `[B, Tq, H, D]` in q's dtype and lse f32 `[B, H, Tq]` of the attention over
/// the whole cache, identical (bitwise) on every rank. Collective over `group` (one small
/// all-gather); errors on every rank if ranks pass different query shapes.
pub fn sharded_decode_attention(
    q: &Tensor,
    q_positions: &[usize],
    shard: &KvShard,
    group: &Group,
    scale: impl Into<Scores>,
    window: Option<usize>,
) -> Result<(Tensor, Tensor)> {
    sharded_decode_attention_sinks(q, q_positions, shard, group, scale, window, None)
}

/// [`sharded_decode_attention`] with attention sinks (`[H]`, one per query head of q; see
/// [`crate::attention::sinks`]), applied once to the merged result of every rank's partial.
pub fn sharded_decode_attention_sinks(
    q: &Tensor,
    q_positions: &[usize],
    shard: &KvShard,
    group: &Group,
    scale: impl Into<Scores>,
    window: Option<usize>,
    sinks: Option<&Sinks>,
) -> Result<(Tensor, Tensor)> {
    let scale: Scores = scale.into();
    if let Some(z) = sinks {
        z.check("sharded_decode_attention", q)?;
    }
    scale.check("sharded_decode_attention")?;
    let (b, tq, h, d) = match q.dims() {
        &[b, tq, h, d] => (b, tq, h, d),
        _ => bail!("sharded_decode_attention: q must be [B, Tq, H, D], got {:?}", q.shape()),
    };
    if q_positions.len() != tq {
        bail!("sharded_decode_attention: {} query positions for q {:?}", q_positions.len(), q.shape())
    }
    candle_cp_comm::ensure_nonempty("sharded_decode_attention", "q", q)?;
    if window == Some(0) {
        bail!("sharded_decode_attention: a sliding window must hold at least 1 key (q {:?})", q.shape())
    }
    if let Some((k, _)) = shard.kv() {
        let kd = k.dims().to_vec();
        if kd[0] != b || kd[3] != d || kd[2] == 0 || h % kd[2] != 0 || k.dtype() != q.dtype() {
            bail!(
                "sharded_decode_attention: cache k {:?} ({:?}) does not fit q {:?} ({:?}): need the same B, D and dtype, Hkv dividing H",
                k.shape(),
                k.dtype(),
                q.shape(),
                q.dtype()
            )
        }
    }
    if !shard.row_starts().is_empty() && shard.row_starts().len() != b {
        bail!("sharded_decode_attention: {} row starts in the cache for q {:?} (one per batch row)", shard.row_starts().len(), q.shape())
    }
    let (o, l) = local_partial(q, q_positions, shard, scale, window)?;
    // one all-gather of [out | lse] per rank: [P, B, Tq, H, D + 1]
    let packed = Tensor::cat(&[o, l.transpose(1, 2)?.unsqueeze(3)?], 3)?.unsqueeze(0)?.contiguous()?;
    let all = group.all_gather(&packed, 0)?;
    let mut acc: Option<(Tensor, Tensor)> = None;
    for r in 0..group.size() {
        let x = all.get(r)?;
        let (o, l) = (x.narrow(3, 0, d)?, x.narrow(3, d, 1)?.squeeze(3)?.transpose(1, 2)?.contiguous()?);
        acc = Some(match acc {
            None => (o, l),
            Some((ao, al)) => merge(&ao, &al, &o, &l)?,
        });
    }
    match acc {
        Some((o, l)) => {
            // the sinks join each row's finished softmax once, after every rank's part
            let (o, l) = match sinks {
                Some(z) => apply_sinks(&o, &l, z.tensor())?,
                None => (o, l),
            };
            Ok((o.to_dtype(q.dtype())?, l))
        }
        None => bail!("sharded_decode_attention: empty group"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::attention_slow;
    use crate::oracle::randn;
    use candle_cp_comm::run_ranks;

    /// Rank `r` of `p`'s zigzag shard of the first `t` rows of `k, v` (a prefill's cache).
    fn prompt_shard(k: &Tensor, v: &Tensor, (r, p): (usize, usize), t: usize) -> Result<KvShard> {
        let layout = crate::cp::Layout::Zigzag;
        let mut shard = KvShard::new();
        let sh = |x: &Tensor| crate::cp::shard(&x.narrow(1, 0, t)?, layout, r, p, 1);
        shard.append(&sh(k)?, &sh(v)?, &crate::cp::positions(layout, r, p, t)?)?;
        Ok(shard)
    }

    /// A cache of `t` tokens sharded zigzag over P ranks plus decoded tokens appended
    /// round-robin: decoding the next tokens (each appended first) equals single-device
    /// causal attention of the whole sequence's last rows; with and without a window, GQA,
    /// and a query block (Tq = 3) at once.
    #[test]
    fn sharded_decode_equals_single_device() -> Result<()> {
        let (b, h, hkv, d, t) = (2usize, 4usize, 2usize, 8usize, 24usize);
        let total = t + 3;
        let q = randn(1, &[b, total, h, d], 1.0)?;
        let k = randn(2, &[b, total, hkv, d], 1.0)?;
        let v = randn(3, &[b, total, hkv, d], 1.0)?;
        let scale = 0.3;
        for window in [None, Some(5), Some(30)] {
            let mask = window.map_or(Mask::causal(), Mask::sliding_window);
            let (want, want_lse) = attention_slow(&q, &k, &v, &mask, scale)?;
            for p in [1usize, 2, 3, 4] {
                if t % (2 * p) != 0 {
                    continue;
                }
                let res = run_ranks(p, |g: Group| {
                    let r = g.rank();
                    let mut shard = prompt_shard(&k, &v, (r, p), t)?;
                    // one token at a time: positions t, t+1 (each appended to its owner first)
                    let mut outs = Vec::new();
                    for qp in [t, t + 1] {
                        if decode_owner(qp, p) == r {
                            shard.append(&k.narrow(1, qp, 1)?, &v.narrow(1, qp, 1)?, &[qp])?;
                        }
                        outs.push(sharded_decode_attention(&q.narrow(1, qp, 1)?, &[qp], &shard, &g, scale, window)?);
                    }
                    // then a block of one query (t+2) together with the two before it
                    if decode_owner(t + 2, p) == r {
                        shard.append(&k.narrow(1, t + 2, 1)?, &v.narrow(1, t + 2, 1)?, &[t + 2])?;
                    }
                    outs.push(sharded_decode_attention(&q.narrow(1, t, 3)?, &[t, t + 1, t + 2], &shard, &g, scale, window)?);
                    Ok(outs)
                });
                let mut first: Option<Vec<f32>> = None;
                for (r, x) in res.into_iter().enumerate() {
                    let outs = x?;
                    for (i, (o, l)) in outs.iter().enumerate() {
                        let (q0, n) = if i < 2 { (t + i, 1) } else { (t, 3) };
                        let e = (o - want.narrow(1, q0, n)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                        let el = (l - want_lse.narrow(2, q0, n)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                        assert!(e < 1e-5 && el < 1e-5, "window {window:?} P={p} rank {r} call {i}: out {e}, lse {el}");
                    }
                    // ranks agree bit for bit
                    let bits = outs[2].0.flatten_all()?.to_vec1::<f32>()?;
                    match &first {
                        None => first = Some(bits),
                        Some(f) => assert_eq!(f, &bits, "rank {r} differs from rank 0"),
                    }
                }
            }
        }
        Ok(())
    }

    /// Left-padded rows (starts 0, 5, 2 of a 12-token prompt, the padding's keys random):
    /// decoding equals each row's causal attention over its own keys alone, on 1, 2 and 3
    /// zigzag ranks, with and without a window; a wrong number of starts is an error.
    #[test]
    fn padded_rows_see_only_their_keys() -> Result<()> {
        let (b, h, hkv, d, t) = (3usize, 4usize, 2usize, 8usize, 12usize);
        let starts = [0usize, 5, 2];
        let total = t + 2;
        let q = randn(4, &[b, total, h, d], 1.0)?;
        let k = randn(5, &[b, total, hkv, d], 1.0)?;
        let v = randn(6, &[b, total, hkv, d], 1.0)?;
        for window in [None, Some(4)] {
            let mask = window.map_or(Mask::causal(), Mask::sliding_window);
            for p in [1usize, 2, 3] {
                let res = run_ranks(p, |g: Group| {
                    let r = g.rank();
                    let mut shard = prompt_shard(&k, &v, (r, p), t)?;
                    shard.set_row_starts(starts.to_vec());
                    let mut outs = Vec::new();
                    for qp in [t, t + 1] {
                        if decode_owner(qp, p) == r {
                            shard.append(&k.narrow(1, qp, 1)?, &v.narrow(1, qp, 1)?, &[qp])?;
                        }
                        outs.push(sharded_decode_attention(&q.narrow(1, qp, 1)?, &[qp], &shard, &g, 0.3, window)?);
                    }
                    // one start too few
                    shard.set_row_starts(starts[..2].to_vec());
                    let e = sharded_decode_attention(&q.narrow(1, t, 1)?, &[t], &shard, &g, 0.3, window).map(|_| ());
                    assert!(e.as_ref().is_err_and(|e| e.to_string().contains("row starts")), "{e:?}");
                    Ok(outs)
                });
                for (r, x) in res.into_iter().enumerate() {
                    for (i, (o, l)) in x?.iter().enumerate() {
                        for (row, &s) in starts.iter().enumerate() {
                            let own = |x: &Tensor| x.narrow(0, row, 1)?.narrow(1, s, total - s);
                            let (want, want_lse) = attention_slow(&own(&q)?, &own(&k)?, &own(&v)?, &mask, 0.3)?;
                            let at = t + i - s;
                            let e = (o.narrow(0, row, 1)? - want.narrow(1, at, 1)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                            let el = (l.narrow(0, row, 1)? - want_lse.narrow(2, at, 1)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                            assert!(e < 1e-5 && el < 1e-5, "window {window:?} P={p} rank {r} step {i} row {row}: out {e}, lse {el}");
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Appends grow the buffers geometrically and write rows in place; eviction drops exactly
    /// the rows before a position and keeps the others' contents.
    #[test]
    fn append_in_place_and_evict() -> Result<()> {
        let k = randn(1, &[1, 10, 2, 4], 1.0)?;
        let mut s = KvShard::new();
        s.append(&k.narrow(1, 0, 4)?, &k.narrow(1, 0, 4)?, &[0, 1, 2, 3])?;
        for i in 4..10 {
            s.append(&k.narrow(1, i, 1)?, &k.narrow(1, i, 1)?, &[i])?;
        }
        let (kc, _) = s.kv().ok_or_else(|| candle_core::Error::Msg("empty".into()))?;
        assert_eq!(kc.flatten_all()?.to_vec1::<f32>()?, k.flatten_all()?.to_vec1::<f32>()?);
        // capacity doubled from 4: 8, then 16
        assert_eq!(s.allocated_bytes(), 2 * 16 * 2 * 4 * 4);
        assert_eq!(s.count_before(6), 6);
        assert_eq!(s.evict_before(6)?, 6);
        assert_eq!(s.positions(), &[6, 7, 8, 9]);
        let (kc, _) = s.kv().ok_or_else(|| candle_core::Error::Msg("empty".into()))?;
        assert_eq!(kc.flatten_all()?.to_vec1::<f32>()?, k.narrow(1, 6, 4)?.flatten_all()?.to_vec1::<f32>()?);
        assert_eq!(s.evict_before(3)?, 0);
        s.append(&k.narrow(1, 0, 1)?, &k.narrow(1, 0, 1)?, &[10])?;
        assert_eq!(s.len(), 5);
        assert_eq!(s.evict_before(100)?, 5);
        assert!(s.is_empty() && s.kv().is_none());
        Ok(())
    }

    /// Shared rows (keys that are the values): one buffer, half the bytes of the same rows
    /// appended as k and v, the same views and the same attention; eviction keeps them
    /// shared; the two kinds of append do not mix.
    #[test]
    fn shared_rows_are_one_buffer() -> Result<()> {
        let k = randn(1, &[2, 9, 1, 6], 1.0)?;
        let (mut two, mut one) = (KvShard::new(), KvShard::new());
        two.append(&k.narrow(1, 0, 3)?, &k.narrow(1, 0, 3)?, &[0, 1, 2])?;
        one.append_shared(&k.narrow(1, 0, 3)?, &[0, 1, 2])?;
        for i in 3..9 {
            two.append(&k.narrow(1, i, 1)?, &k.narrow(1, i, 1)?, &[i])?;
            one.append_shared(&k.narrow(1, i, 1)?, &[i])?;
        }
        assert!(one.shared() && !two.shared());
        assert_eq!(one.bytes() * 2, two.bytes());
        assert_eq!(one.bytes(), 2 * 9 * 6 * 4);
        assert_eq!(one.allocated_bytes() * 2, two.allocated_bytes());
        let flat = |x: &Tensor| x.flatten_all()?.to_vec1::<f32>();
        let ((k1, v1), (k2, v2)) = (one.kv().expect("rows"), two.kv().expect("rows"));
        assert_eq!(flat(&k1)?, flat(&k2)?);
        assert_eq!(flat(&v1)?, flat(&v2)?);
        let q = randn(2, &[2, 1, 3, 6], 1.0)?;
        let res = run_ranks(1, |g: Group| {
            let a = sharded_decode_attention(&q, &[9], &one, &g, 0.4, Some(5))?;
            let b = sharded_decode_attention(&q, &[9], &two, &g, 0.4, Some(5))?;
            Ok((flat(&a.0)?, flat(&b.0)?))
        });
        for r in res {
            let (a, b) = r?;
            assert_eq!(a, b);
        }
        assert_eq!(one.evict_before(4)?, 4);
        assert!(one.shared());
        assert_eq!(flat(&one.kv().expect("rows").1)?, flat(&k.narrow(1, 4, 5)?)?);
        let e = one.append(&k.narrow(1, 0, 1)?, &k.narrow(1, 0, 1)?, &[9]).unwrap_err().to_string();
        assert!(e.contains("into a shard of shared rows"), "{e}");
        let e = two.append_shared(&k.narrow(1, 0, 1)?, &[9]).unwrap_err().to_string();
        assert!(e.contains("shared rows into a shard of separate k, v"), "{e}");
        assert_eq!((one.len(), two.len()), (5, 9));
        Ok(())
    }

    #[test]
    fn bad_input_is_an_error() -> Result<()> {
        let mut s = KvShard::new();
        let k = randn(1, &[1, 3, 2, 8], 1.0)?;
        assert!(s.append(&k, &k, &[0, 1]).is_err());
        s.append(&k, &k, &[0, 1, 2])?;
        let other = randn(2, &[1, 2, 4, 8], 1.0)?;
        let e = s.append(&other, &other, &[3, 4]).unwrap_err().to_string();
        assert!(e.contains("[1, 2, 4, 8]"), "{e}");
        assert_eq!(s.len(), 3);
        let res = run_ranks(1, |g: Group| {
            let q = randn(3, &[1, 1, 3, 8], 1.0)?; // H = 3 not a multiple of Hkv = 2
            sharded_decode_attention(&q, &[3], &s, &g, 0.5, None).map(|_| ())
        });
        assert!(res[0].is_err());
        Ok(())
    }
}
