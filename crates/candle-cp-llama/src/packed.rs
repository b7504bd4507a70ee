//! Packed documents: many documents in one training sequence, attention kept inside each
//! document, RoPE positions restarting per document, and no target across a document
//! boundary.
//!
//! ```text
//! global ids [B, T], docs (1 shared, or B) ─shard_batch_packed─▶ ids, labels [B/dp, T_local],
//!     positions (RoPE ids) [T_local] or [B/dp, T_local], documents (this rank's rows)
//! llama.loss_packed(ids, labels, positions, &documents) ─▶ global mean loss
//! ```
//!
//! Under CP the documents are NOT padded: the CP layout (contiguous, zigzag, striped, 2-D)
//! cuts them anywhere, and the attention ops ([`candle_cp_ops::packing`]) apply the document
//! mask on global positions. A packed row gives the same per-token losses as running each
//! document on its own (test `packed_equals_separate_documents_on_every_layout` in
//! `tests/llama_packed.rs`).

use crate::layout::{shard_tokens, ParallelCtx, ShardedBatch, IGNORE};
use crate::model::Llama;
use candle_core::{bail, DType, Result, Tensor};
use candle_cp_ops::packing::Documents;

/// Check the documents against a local batch of `b` rows whose global length is `t`:
/// one shared entry or `b` entries, each covering `t`. Returns them with identical rows
/// folded into one shared entry. `ids` names the shapes in errors.
pub(crate) fn check_docs(docs: &[Documents], b: usize, t: usize, ids: &Tensor) -> Result<Vec<Documents>> {
    if docs.len() != 1 && docs.len() != b {
        bail!(
            "Llama packed: {} Documents for input_ids {:?}: pass one shared by every row or one per row ({b})",
            docs.len(),
            ids.dims()
        )
    }
    for (i, d) in docs.iter().enumerate() {
        d.check_len(&format!("Llama packed: documents of row {i} (input_ids {:?})", ids.dims()), t)?;
    }
    if docs.iter().all(|d| *d == docs[0]) {
        Ok(vec![docs[0].clone()])
    } else {
        Ok(docs.to_vec())
    }
}

/// Next-token labels of one packed row `ids` `[T]`: `ids[j + 1]`, but [`IGNORE`] at the last
/// token of every document (and so at `T - 1`).
pub fn packed_labels(ids: &[u32], docs: &Documents) -> Vec<u32> {
    let t = ids.len();
    let mut labels: Vec<u32> = (0..t).map(|j| if j + 1 < t { ids[j + 1] } else { IGNORE }).collect();
    for &end in &docs.cu_seqlens()[1..] {
        if end >= 1 && end <= t {
            labels[end - 1] = IGNORE;
        }
    }
    labels
}

/// Split a packed global batch for this rank, like [`crate::shard_batch`].
///
/// `global_ids` `[B, T]` (token ids); `docs`: one [`Documents`] shared by every row, or one
/// per row (`B` entries), each covering `T` tokens. Returns `input_ids`, `labels`
/// `[B/dp, T_local]` sharded exactly like [`crate::shard_batch`] shards them, with labels
/// [`IGNORE`] at the last token of every document (no target across documents); `positions`
/// are the RoPE position ids (position within the document, [`Documents::position_ids`])
/// sharded like [`crate::shard_batch`] shards positions: `[T_local]` when the documents are
/// shared, `[B/dp, T_local]` when given per row; `documents` this rank's rows' documents (one
/// shared entry, or its `B/dp` rows). Errors name the lengths when `docs` has neither 1 nor
/// `B` entries or a [`Documents`] does not cover `T`.
pub fn shard_batch_packed(global_ids: &Tensor, docs: &[Documents], ctx: &ParallelCtx) -> Result<ShardedBatch> {
    let (b, t) = global_ids.dims2()?;
    if docs.len() != 1 && docs.len() != b {
        bail!(
            "shard_batch_packed: {} Documents for ids [{b}, {t}]: pass 1 (shared by all rows) or B = {b}",
            docs.len()
        )
    }
    for (i, d) in docs.iter().enumerate() {
        d.check_len(&format!("shard_batch_packed: documents {i} (ids [{b}, {t}])"), t)?;
    }
    let dev = global_ids.device();
    let ids = global_ids.to_dtype(DType::U32)?;
    let rows = ids.to_vec2::<u32>()?;
    let doc_of_row = |r: usize| if docs.len() == 1 { &docs[0] } else { &docs[r] };
    let labels: Vec<u32> = rows
        .iter()
        .enumerate()
        .flat_map(|(r, row)| packed_labels(row, doc_of_row(r)))
        .collect();
    let labels = Tensor::from_vec(labels, (b, t), dev)?;
    let shared = docs.len() == 1;
    let parts = if shared {
        let pos = Tensor::from_vec(docs[0].position_ids(), t, dev)?;
        shard_tokens(&[ids, labels], &pos, b, t, ctx)?
    } else {
        let pos: Vec<u32> = docs.iter().flat_map(|d| d.position_ids()).collect();
        let pos = Tensor::from_vec(pos, (b, t), dev)?;
        let arange = Tensor::arange(0u32, t as u32, dev)?;
        let mut p = shard_tokens(&[ids, labels, pos], &arange, b, t, ctx)?;
        p.truncate(3);
        p
    };
    let documents = if shared {
        docs.to_vec()
    } else {
        let bl = b / ctx.layout.dp;
        docs[ctx.coords.0 * bl..(ctx.coords.0 + 1) * bl].to_vec()
    };
    let mut parts = parts.into_iter();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(input_ids), Some(labels), Some(positions)) => Ok(ShardedBatch {
            input_ids,
            labels,
            positions,
            documents,
        }),
        _ => bail!("shard_batch_packed: internal error"),
    }
}

impl Llama {
    /// [`Llama::hidden`] of packed rows: `[B, Ts, h]`. `input_ids` `[B, Ts]`, `positions` the
    /// RoPE ids `[Ts]` or `[B, Ts]` and `docs` (one shared, or one per row, each covering the
    /// global `T`) as returned by [`shard_batch_packed`]. Collective like [`Llama::hidden`].
    pub fn hidden_packed(&self, input_ids: &Tensor, positions: &Tensor, docs: &[Documents]) -> Result<Tensor> {
        self.hidden_with(input_ids, positions, Some(docs))
    }

    /// [`Llama::forward`] of packed rows: logits `[B, Ts, V]`; arguments as
    /// [`Llama::hidden_packed`].
    pub fn forward_packed(&self, input_ids: &Tensor, positions: &Tensor, docs: &[Documents]) -> Result<Tensor> {
        self.forward_with(input_ids, positions, Some(docs))
    }

    /// [`Llama::token_nll`] of packed rows: f32 `[B, Ts]` (0 where the label is [`IGNORE`],
    /// e.g. at every document's last token); `labels` `[B, Ts]` from [`shard_batch_packed`],
    /// the rest as [`Llama::hidden_packed`].
    pub fn token_nll_packed(
        &self,
        input_ids: &Tensor,
        labels: &Tensor,
        positions: &Tensor,
        docs: &[Documents],
    ) -> Result<Tensor> {
        self.token_nll_with(input_ids, labels, positions, Some(docs))
    }

    /// [`Llama::token_nll_packed`] and each token's `stat` under the model
    /// ([`crate::head_loss::HeadStat`]: `log Σ_v p_v²`, WPO's weight adjustment, or the entropy of GRPO's
    /// high-entropy tokens), f32 `[B, Ts]`, detached (0 where the label is [`IGNORE`]; over a
    /// vocabulary split by TP, one more small all-gather).
    pub fn token_nll_packed_stat(&self, input_ids: &Tensor, labels: &Tensor, positions: &Tensor, docs: &[Documents], stat: crate::head_loss::HeadStat) -> Result<(Tensor, Tensor)> {
        let (nll, st) = self.token_nll_stats_with(input_ids, labels, positions, Some(docs), Some(stat))?;
        Ok((nll, st.ok_or_else(|| candle_core::Error::Msg("Llama::token_nll_packed_stat: no statistics".into()))?))
    }

    /// [`Llama::loss`] of packed rows: `(loss, logits [B, Ts, V])`, the loss the global mean
    /// over every target (labels ≠ [`IGNORE`]) of every rank; arguments as
    /// [`Llama::token_nll_packed`].
    pub fn loss_packed(
        &self,
        input_ids: &Tensor,
        labels: &Tensor,
        positions: &Tensor,
        docs: &[Documents],
    ) -> Result<(Tensor, Tensor)> {
        self.loss_with(input_ids, labels, positions, Some(docs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{shard_batch, CpKind, Layout};
    use candle_core::Device;
    use candle_cp_comm::run_ranks;

    /// Every (layout, rank): tokens sharded like `shard_batch`, labels the next token of the
    /// same document and IGNORE exactly at document ends, positions restarting per document,
    /// per-row documents sliced by DP.
    #[test]
    fn shard_batch_packed_labels_stop_at_document_ends() -> Result<()> {
        let t = 48usize;
        let dev = Device::Cpu;
        let ids: Vec<u32> = (0..2 * t as u32).map(|i| 1000 + i).collect();
        let ids = Tensor::from_vec(ids, (2, t), &dev)?;
        let gpos = Tensor::arange(0u32, t as u32, &dev)?.unsqueeze(0)?.repeat((2, 1))?;
        let d0 = Documents::from_lengths(&[13, 22, 13])?;
        let d1 = Documents::from_lengths(&[5, 30, 1, 12])?;
        let layouts = [
            Layout::single(),
            Layout::cp(CpKind::Ring, 4),
            Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
            Layout::cp(CpKind::Zigzag, 4),
            Layout::cp(CpKind::Striped, 4),
            Layout::cp(CpKind::AllGather, 2).with_dp(2),
            Layout::cp(CpKind::Ulysses, 2).with_tp(2, false),
            Layout::two_d(2, 2),
        ];
        for shared in [true, false] {
            let docs = if shared { vec![d0.clone()] } else { vec![d0.clone(), d1.clone()] };
            for layout in layouts {
                let res = run_ranks(layout.world_size(), |g| {
                    let ctx = ParallelCtx::new(g, layout)?;
                    let b = shard_batch_packed(&ids, &docs, &ctx)?;
                    // the global position of every local token, from the plain sharding
                    let gp = shard_batch(&gpos, &ctx)?.input_ids.to_vec2::<u32>()?;
                    let plain = shard_batch(&ids, &ctx)?.input_ids.to_vec2::<u32>()?;
                    let pos = if shared {
                        vec![b.positions.to_vec1::<u32>()?; gp.len()]
                    } else {
                        b.positions.to_vec2::<u32>()?
                    };
                    Ok((ctx.coords.0, b.input_ids.to_vec2::<u32>()?, plain, b.labels.to_vec2::<u32>()?, pos, gp, b.documents))
                });
                let mut seen = vec![0usize; 2 * t];
                for r in res {
                    let (dp_i, ids_l, plain, lab, pos, gp, got_docs) = r?;
                    assert_eq!(ids_l, plain, "{layout}: tokens sharded like shard_batch");
                    let bl = 2 / layout.dp;
                    let want_docs: Vec<Documents> = if shared { vec![d0.clone()] } else { docs[dp_i * bl..(dp_i + 1) * bl].to_vec() };
                    assert_eq!(got_docs, want_docs, "{layout}");
                    for (bi, row) in gp.iter().enumerate() {
                        let grow = dp_i * bl + bi;
                        let d = if shared { &d0 } else { &docs[grow] };
                        for (j, &p) in row.iter().enumerate() {
                            let p = p as usize;
                            seen[grow * t + p] += 1;
                            let doc = d.doc_of(p).expect("position inside T");
                            let (start, end) = d.range(doc);
                            assert_eq!(pos[bi][j] as usize, p - start, "{layout} row {grow} pos {p}");
                            let want = if p + 1 == end { IGNORE } else { 1000 + (grow * t + p) as u32 + 1 };
                            assert_eq!(lab[bi][j], want, "{layout} row {grow} pos {p}");
                        }
                    }
                }
                let copies = if layout.seq_parallel() { 1 } else { layout.tp };
                assert!(seen.iter().all(|&c| c == copies), "{layout}: {seen:?}");
            }
        }
        // IGNORE count: one per document end
        let lab = packed_labels(&(0..48).collect::<Vec<u32>>(), &d1);
        assert_eq!(lab.iter().filter(|&&l| l == IGNORE).count(), 4);
        assert_eq!((lab[3], lab[4], lab[5], lab[34], lab[35], lab[47]), (4, IGNORE, 6, IGNORE, IGNORE, IGNORE));
        Ok(())
    }

    #[test]
    fn shard_batch_packed_rejects_mismatched_documents() -> Result<()> {
        let dev = Device::Cpu;
        let ids = Tensor::zeros((2, 16), DType::U32, &dev)?;
        let d = Documents::from_lengths(&[10, 6])?;
        let res = run_ranks(1, |g| {
            let ctx = ParallelCtx::single(g)?;
            let three = shard_batch_packed(&ids, &[d.clone(), d.clone(), d.clone()], &ctx).err().map(|e| e.to_string());
            let short = shard_batch_packed(&ids, &[Documents::from_lengths(&[10, 5])?], &ctx).err().map(|e| e.to_string());
            let ok = shard_batch_packed(&ids, &[d.clone(), d.clone()], &ctx)?.documents.len();
            Ok((three, short, ok))
        });
        let (three, short, ok) = res.into_iter().next().expect("one rank")?;
        let three = three.expect("3 documents for B = 2 must fail");
        assert!(three.contains("3 Documents") && three.contains("B = 2"), "{three}");
        let short = short.expect("documents of 15 tokens for T = 16 must fail");
        assert!(short.contains("15 tokens") && short.contains("T = 16"), "{short}");
        assert_eq!(ok, 2);
        Ok(())
    }
}
