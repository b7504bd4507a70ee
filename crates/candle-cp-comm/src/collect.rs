//! Validation of a complete round and the serial computations behind each collective.
//!
//! Every rank runs the same validation on the same complete round, so a mismatch is reported
//! identically on all ranks. Reductions add the ranks' tensors in rank order (accumulating
//! f16/bf16/f32 in f32), so the result bits do not depend on thread timing.

use crate::world::{Entry, Op};
use candle_core::{bail, DType, Device, Result, Tensor};
use std::mem::discriminant;

/// `"rank 1: all_gather(dim=0) [2, 3] F32"` for each rank, joined with `"; "`.
fn describe_round(entries: &[Entry]) -> String {
    entries
        .iter()
        .enumerate()
        .map(|(r, e)| match &e.tensor {
            Some(t) => format!("rank {r}: {} {:?} {:?}", e.op, t.dims(), t.dtype()),
            None => format!("rank {r}: {}", e.op),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Check that a complete round is consistent: the same op with the same parameters on every
/// rank, the same shapes and dtypes where the op requires it, dims in range and divisible.
pub(crate) fn check_round(label: &str, seq: u64, entries: &[Entry]) -> Result<()> {
    let p = entries.len();
    let first = &entries[0].op;
    let same_kind = entries
        .iter()
        .all(|e| discriminant(&e.op) == discriminant(first));
    let free_params = matches!(first, Op::SendRecv { .. } | Op::Split { .. } | Op::AllToAllV { .. });
    if !same_kind || (!free_params && entries.iter().any(|e| &e.op != first)) {
        bail!(
            "thread group {label}: mismatched collectives in call #{seq}: {}",
            describe_round(entries)
        )
    }
    let needs_same_shape = matches!(
        first,
        Op::AllGather { .. }
            | Op::ReduceScatter { .. }
            | Op::AllReduce
            | Op::AllToAll { .. }
            | Op::Broadcast { .. }
    );
    if needs_same_shape {
        let t0 = entries[0].tensor.as_ref();
        let same = entries.iter().all(|e| match (e.tensor.as_ref(), t0) {
            (Some(a), Some(b)) => a.dims() == b.dims() && a.dtype() == b.dtype(),
            _ => false,
        });
        if !same {
            bail!(
                "thread group {label}: {first} in call #{seq} needs the same shape and dtype on every rank: {}",
                describe_round(entries)
            )
        }
    }
    let dims = entries[0]
        .tensor
        .as_ref()
        .map(|t| t.dims().to_vec())
        .unwrap_or_default();
    let check_dim = |name: &str, d: usize| -> Result<()> {
        if d >= dims.len() {
            bail!("thread group {label}: {first}: {name} {d} out of range for shape {dims:?}")
        }
        Ok(())
    };
    let check_div = |d: usize| -> Result<()> {
        if !dims[d].is_multiple_of(p) {
            bail!(
                "thread group {label}: {first}: dim {d} of shape {dims:?} has size {} which is not divisible by the group size {p}",
                dims[d]
            )
        }
        Ok(())
    };
    match first {
        Op::AllGather { dim } => check_dim("dim", *dim)?,
        Op::ReduceScatter { dim } => {
            check_dim("dim", *dim)?;
            check_div(*dim)?;
        }
        Op::AllToAll {
            split_dim,
            concat_dim,
        } => {
            check_dim("split_dim", *split_dim)?;
            check_dim("concat_dim", *concat_dim)?;
            check_div(*split_dim)?;
        }
        Op::Broadcast { root } => {
            if *root >= p {
                bail!("thread group {label}: broadcast root {root} out of range for group size {p}")
            }
        }
        Op::SendRecv { .. } => check_pairing(label, seq, entries)?,
        Op::AllToAllV { .. } => check_counts(label, seq, entries)?,
        Op::AllReduce | Op::Barrier | Op::Split { .. } => {}
    }
    Ok(())
}

/// `all_to_all_v`: what rank `i` sends rank `j` is what `j` receives from `i`, and every
/// rank's rows have the same trailing dims and dtype.
fn check_counts(label: &str, seq: u64, entries: &[Entry]) -> Result<()> {
    let counts: Vec<(&[usize], &[usize])> = entries
        .iter()
        .map(|e| match &e.op {
            Op::AllToAllV { send_rows, recv_rows } => (send_rows.as_slice(), recv_rows.as_slice()),
            _ => (&[][..], &[][..]),
        })
        .collect();
    for (i, (send, _)) in counts.iter().enumerate() {
        for (j, (_, recv)) in counts.iter().enumerate() {
            if send.get(j) != recv.get(i) {
                bail!(
                    "thread group {label}: all_to_all_v in call #{seq}: rank {i} sends rank {j} {:?} rows, rank {j} receives {:?} from rank {i}: {}",
                    send.get(j),
                    recv.get(i),
                    describe_round(entries)
                )
            }
        }
    }
    let rows = |e: &Entry| e.tensor.as_ref().map(|t| (t.dims().get(1..).map(|d| d.to_vec()), t.dtype()));
    if entries.iter().any(|e| rows(e) != rows(&entries[0])) {
        bail!("thread group {label}: all_to_all_v in call #{seq} needs rows of the same shape and dtype on every rank: {}", describe_round(entries))
    }
    Ok(())
}

/// `send_recv` must form a permutation: whoever rank `r` sends to must receive from `r`.
fn check_pairing(label: &str, seq: u64, entries: &[Entry]) -> Result<()> {
    let p = entries.len();
    let ends: Vec<(usize, usize)> = entries
        .iter()
        .map(|e| match e.op {
            Op::SendRecv { dst, src } => (dst, src),
            _ => (usize::MAX, usize::MAX),
        })
        .collect();
    for (r, &(dst, src)) in ends.iter().enumerate() {
        if dst >= p || src >= p {
            bail!(
                "thread group {label}: send_recv in call #{seq}: rank {r} has dst {dst} / src {src} out of range for group size {p}"
            )
        }
        if ends[dst].1 != r {
            bail!(
                "thread group {label}: send_recv in call #{seq}: rank {r} sends to rank {dst} but rank {dst} receives from rank {}: {}",
                ends[dst].1,
                describe_round(entries)
            )
        }
    }
    Ok(())
}

/// The tensor of entry `r`, which validation guarantees is present for tensor ops.
pub(crate) fn tensor_of(entries: &[Entry], r: usize) -> Result<&Tensor> {
    match entries.get(r).and_then(|e| e.tensor.as_ref()) {
        Some(t) => Ok(t),
        None => bail!("thread group: rank {r} contributed no tensor (internal error)"),
    }
}

/// Accumulation dtype: f32 for the float types up to f32, the dtype itself otherwise.
fn acc_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 | DType::F32 => DType::F32,
        d => d,
    }
}

/// `((parts[0] + parts[1]) + parts[2]) + ...` on `device`, accumulated in f32 for
/// f16/bf16/f32, cast back to the parts' dtype.
pub(crate) fn sum_in_order(parts: &[Tensor], device: &Device) -> Result<Tensor> {
    let Some(first) = parts.first() else {
        bail!("thread group: sum of zero tensors")
    };
    let dtype = first.dtype();
    let acc_dt = acc_dtype(dtype);
    let mut acc = first.to_device(device)?.to_dtype(acc_dt)?;
    for p in &parts[1..] {
        acc = (acc + p.to_device(device)?.to_dtype(acc_dt)?)?;
    }
    acc.to_dtype(dtype)
}

/// A copy of `t` with its own storage on `device`, so that the receiver never shares a
/// buffer with the sender.
pub(crate) fn fresh_on(t: &Tensor, device: &Device) -> Result<Tensor> {
    if t.device().same_device(device) {
        t.force_contiguous()
    } else {
        // a transfer to another device always allocates
        t.to_device(device)
    }
}

/// Chunk `j` of `size` equal chunks of `t` along `dim`.
pub(crate) fn chunk(t: &Tensor, dim: usize, j: usize, size: usize) -> Result<Tensor> {
    let len = t.dim(dim)? / size;
    t.narrow(dim, j * len, len)
}
