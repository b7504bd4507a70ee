//! Column- and row-parallel linear layers (Megatron-LM), with or without sequence parallelism.
//!
//! Weights follow candle-nn / PyTorch: `weight` `[out, in]`, `bias` `[out]`, `y = x·Wᵀ + b`.
//! Both layers are built from the *full* weight (a `VarBuilder` or tensors) and keep only
//! this rank's shard, as a fresh [`Var`] owned by the layer (see [`ColumnParallelLinear::vars`]):
//! the `VarBuilder` only supplies initial values.

use crate::Tp;
use candle_core::{Module, Result, Tensor, Var};
use candle_cp_ops::mappings::{self, SEQ_DIM};
use candle_nn::VarBuilder;

/// Rows or columns `[r·n/P, (r+1)·n/P)` of `full` along `dim`, as a new Var.
pub(crate) fn shard_var(full: &Tensor, dim: usize, tp: &Tp, what: &str) -> Result<Var> {
    let (p, r) = (tp.size(), tp.rank());
    let n = full.dim(dim)?;
    if n % p != 0 {
        candle_core::bail!(
            "{what}: dim {dim} of the full weight {:?} has size {n}, not divisible by the TP size {p}",
            full.dims()
        )
    }
    Var::from_tensor(&full.detach().narrow(dim, r * (n / p), n / p)?.contiguous()?)
}

fn check_input(what: &str, x: &Tensor, in_dim: usize) -> Result<()> {
    if x.rank() < 2 || x.dim(x.rank() - 1)? != in_dim {
        candle_core::bail!("{what}: input {:?} must be [.., {in_dim}]", x.dims())
    }
    Ok(())
}

/// Linear layer with the output features split over the TP group.
///
/// Rank `r` holds weight rows `[r·out/P, (r+1)·out/P)` (`[out/P, in]`) and the same slice of
/// the bias. Forward:
/// - SP on: `x` `[B, T/P, in]` (sequence shard) → all-gather along T (backward
///   reduce-scatter) → `[B, T, in]` → `y` `[B, T, out/P]`.
/// - SP off: `x` `[B, T, in]` (replicated) → `copy_to_tp_region` (backward all-reduce) →
///   `y` `[B, T, out/P]`.
///
/// The output is feature-sharded (e.g. this rank's attention heads when `out = H·D`).
#[derive(Clone)]
pub struct ColumnParallelLinear {
    weight: Var,
    bias: Option<Var>,
    in_dim: usize,
    /// Local output features of each fused part (one part unless built from parts).
    parts: Vec<usize>,
    tp: Tp,
}

impl ColumnParallelLinear {
    /// Load the full `weight` `[out_dim, in_dim]` (and `bias` `[out_dim]` if `bias`) from `vb`
    /// and keep this rank's rows. `out_dim % P == 0` required.
    pub fn load(vb: VarBuilder, in_dim: usize, out_dim: usize, bias: bool, tp: &Tp) -> Result<Self> {
        let w = vb.get((out_dim, in_dim), "weight")?;
        let b = if bias { Some(vb.get(out_dim, "bias")?) } else { None };
        Self::from_full(&w, b.as_ref(), tp)
    }

    /// Build from the full `weight` `[out, in]` and optional `bias` `[out]`.
    pub fn from_full(weight: &Tensor, bias: Option<&Tensor>, tp: &Tp) -> Result<Self> {
        Self::from_full_parts(&[weight], bias.map(|b| vec![b]).as_deref(), tp)
    }

    /// One layer from several full weights `[out_i, in]` sharing the input (e.g. the Q, K, V
    /// projections): rank `r` holds `[rows r of W₀; rows r of W₁; ...]` (`[Σ out_i/P, in]`),
    /// so with SP a single all-gather of the input serves every part. Split the output with
    /// [`Self::forward_parts`]. Each `out_i % P == 0` required.
    pub fn from_full_parts(weights: &[&Tensor], biases: Option<&[&Tensor]>, tp: &Tp) -> Result<Self> {
        let Some(first) = weights.first() else { candle_core::bail!("ColumnParallelLinear: no weights given") };
        let in_dim = first.dims2()?.1;
        if let Some(bs) = biases {
            if bs.len() != weights.len() {
                candle_core::bail!("ColumnParallelLinear: {} biases for {} weights", bs.len(), weights.len())
            }
        }
        let (mut ws, mut bs, mut parts) = (vec![], vec![], vec![]);
        for (i, w) in weights.iter().enumerate() {
            let (out_dim, in_i) = w.dims2()?;
            if in_i != in_dim {
                candle_core::bail!("ColumnParallelLinear: part {i} weight {:?} has in = {in_i}, part 0 has {in_dim}", w.dims())
            }
            ws.push(shard_var(w, 0, tp, "ColumnParallelLinear")?.as_tensor().clone());
            parts.push(out_dim / tp.size());
            if let Some(b) = biases.map(|bs| bs[i]) {
                if b.dims() != [out_dim] {
                    candle_core::bail!("ColumnParallelLinear: bias {:?} does not match weight {:?}", b.dims(), w.dims())
                }
                bs.push(shard_var(b, 0, tp, "ColumnParallelLinear bias")?.as_tensor().clone());
            }
        }
        let weight = if ws.len() == 1 { Var::from_tensor(&ws[0])? } else { Var::from_tensor(&Tensor::cat(&ws, 0)?)? };
        let bias = match bs.len() {
            0 => None,
            1 => Some(Var::from_tensor(&bs[0])?),
            _ => Some(Var::from_tensor(&Tensor::cat(&bs, 0)?)?),
        };
        Ok(Self { weight, bias, in_dim, parts, tp: tp.clone() })
    }

    /// Load several full weights (`(vb, out_i)` each holding `weight` `[out_i, in_dim]` and,
    /// if `bias`, `bias` `[out_i]`) into one fused layer; see [`Self::from_full_parts`].
    pub fn load_parts(vbs: &[(VarBuilder, usize)], in_dim: usize, bias: bool, tp: &Tp) -> Result<Self> {
        let ws = vbs.iter().map(|(vb, o)| vb.get((*o, in_dim), "weight")).collect::<Result<Vec<_>>>()?;
        let bs = if bias { Some(vbs.iter().map(|(vb, o)| vb.get(*o, "bias")).collect::<Result<Vec<_>>>()?) } else { None };
        let wr: Vec<&Tensor> = ws.iter().collect();
        let br: Option<Vec<&Tensor>> = bs.as_ref().map(|b| b.iter().collect());
        Self::from_full_parts(&wr, br.as_deref(), tp)
    }

    /// Local output features of each part (`out_i/P`).
    pub fn part_sizes(&self) -> &[usize] {
        &self.parts
    }

    /// Forward, then split the output `[.., Σ out_i/P]` into the parts `[.., out_i/P]`.
    pub fn forward_parts(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let y = self.forward(x)?;
        let last = y.rank() - 1;
        let mut off = 0;
        self.parts
            .iter()
            .map(|&n| {
                let t = y.narrow(last, off, n);
                off += n;
                t
            })
            .collect()
    }

    /// This rank's weight shard `[out/P, in]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }
    /// This rank's bias shard `[out/P]`.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }
    /// The layer's parameters (weight, then bias if any), for an optimizer.
    pub fn vars(&self) -> Vec<Var> {
        std::iter::once(self.weight.clone()).chain(self.bias.clone()).collect()
    }
    /// Local output features `out/P`.
    pub fn out_local(&self) -> Result<usize> {
        self.weight.dim(0)
    }
}

impl Module for ColumnParallelLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("ColumnParallelLinear", x, self.in_dim)?;
        let x = if self.tp.sequence_parallel {
            mappings::gather_from_sp_region(x, &self.tp.group, SEQ_DIM)?
        } else {
            mappings::copy_to_tp_region(x, &self.tp.group)?
        };
        let lin = candle_nn::Linear::new(self.weight.as_tensor().clone(), self.bias.as_ref().map(|b| b.as_tensor().clone()));
        lin.forward(&x)
    }
}

/// Linear layer with the input features split over the TP group.
///
/// Rank `r` holds weight columns `[r·in/P, (r+1)·in/P)` (`[out, in/P]`) and the full bias
/// (replicated). Forward: `x` `[B, T, in/P]` (feature shard, e.g. the output of a
/// [`ColumnParallelLinear`]) → partial `x·Wᵣᵀ` `[B, T, out]`, then
/// - SP on: reduce-scatter along T (backward all-gather) → `[B, T/P, out]`;
/// - SP off: all-reduce (backward identity) → `[B, T, out]` replicated.
///
/// The bias is added after the reduction. With SP each rank adds it to its own rows only,
/// so the bias goes through `copy_to_tp_region` (backward all-reduce) and every rank gets the
/// full bias gradient.
#[derive(Clone)]
pub struct RowParallelLinear {
    weight: Var,
    bias: Option<Var>,
    tp: Tp,
}

impl RowParallelLinear {
    /// Load the full `weight` `[out_dim, in_dim]` (and `bias` `[out_dim]` if `bias`) from `vb`
    /// and keep this rank's columns. `in_dim % P == 0` required.
    pub fn load(vb: VarBuilder, in_dim: usize, out_dim: usize, bias: bool, tp: &Tp) -> Result<Self> {
        let w = vb.get((out_dim, in_dim), "weight")?;
        let b = if bias { Some(vb.get(out_dim, "bias")?) } else { None };
        Self::from_full(&w, b.as_ref(), tp)
    }

    /// Build from the full `weight` `[out, in]` and optional `bias` `[out]`.
    pub fn from_full(weight: &Tensor, bias: Option<&Tensor>, tp: &Tp) -> Result<Self> {
        let (out_dim, _) = weight.dims2()?;
        if let Some(b) = bias {
            if b.dims() != [out_dim] {
                candle_core::bail!("RowParallelLinear: bias {:?} does not match weight {:?}", b.dims(), weight.dims())
            }
        }
        Ok(Self {
            weight: shard_var(weight, 1, tp, "RowParallelLinear")?,
            bias: bias.map(|b| Var::from_tensor(&b.detach().contiguous()?)).transpose()?,
            tp: tp.clone(),
        })
    }

    /// This rank's weight shard `[out, in/P]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }
    /// The (replicated) bias `[out]`.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }
    /// The layer's parameters (weight, then bias if any), for an optimizer.
    pub fn vars(&self) -> Vec<Var> {
        std::iter::once(self.weight.clone()).chain(self.bias.clone()).collect()
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_input("RowParallelLinear", x, self.weight.dim(1)?)?;
        let partial = candle_nn::Linear::new(self.weight.as_tensor().clone(), None).forward(x)?;
        let y = if self.tp.sequence_parallel {
            if x.rank() < 3 {
                candle_core::bail!("RowParallelLinear with SP: input {:?} must be [B, T, in/P]", x.dims())
            }
            mappings::reduce_scatter_to_sp_region(&partial, &self.tp.group, SEQ_DIM)?
        } else {
            mappings::reduce_from_tp_region(&partial, &self.tp.group)?
        };
        match &self.bias {
            None => Ok(y),
            Some(b) if self.tp.sequence_parallel => y.broadcast_add(&mappings::copy_to_tp_region(b.as_tensor(), &self.tp.group)?),
            Some(b) => y.broadcast_add(b.as_tensor()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use candle_cp_comm::{run_ranks, Group};

    fn t(shape: &[usize], seed: f64) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| ((i as f64 * 0.37 + seed).sin()) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
    }

    #[test]
    fn one_rank_equals_candle_linear() -> Result<()> {
        let (w, b, x) = (t(&[6, 4], 0.1)?, t(&[6], 0.2)?, t(&[2, 3, 4], 0.3)?);
        let w2 = t(&[4, 6], 0.4)?;
        for r in run_ranks(1, |g: Group| {
            let mut worst = 0f32;
            for sp in [false, true] {
                let tp = Tp::new(g.clone(), sp);
                let col = ColumnParallelLinear::from_full(&w, Some(&b), &tp)?.forward(&x)?;
                let want = candle_nn::Linear::new(w.clone(), Some(b.clone())).forward(&x)?;
                worst = worst.max((&col - &want)?.abs()?.max_all()?.to_scalar::<f32>()?);
                let row = RowParallelLinear::from_full(&w2, None, &tp)?.forward(&col)?;
                let want2 = candle_nn::Linear::new(w2.clone(), None).forward(&want)?;
                worst = worst.max((row - want2)?.abs()?.max_all()?.to_scalar::<f32>()?);
            }
            Ok(worst)
        }) {
            assert!(r? < 1e-6);
        }
        Ok(())
    }

    #[test]
    fn indivisible_shards_and_bad_inputs_are_errors() -> Result<()> {
        for r in run_ranks(4, |g: Group| {
            let tp = Tp::new(g, true);
            let w = Tensor::zeros((6, 8), DType::F32, &Device::Cpu)?;
            let e1 = ColumnParallelLinear::from_full(&w, None, &tp).err().map(|e| e.to_string()).unwrap_or_default();
            let e2 = RowParallelLinear::from_full(&Tensor::zeros((8, 6), DType::F32, &Device::Cpu)?, None, &tp)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            let col = ColumnParallelLinear::from_full(&Tensor::zeros((8, 8), DType::F32, &Device::Cpu)?, None, &tp)?;
            let e3 = col.forward(&Tensor::zeros((1, 2, 5), DType::F32, &Device::Cpu)?).err().map(|e| e.to_string()).unwrap_or_default();
            Ok([e1, e2, e3])
        }) {
            let [e1, e2, e3] = r?;
            assert!(e1.contains("[6, 8]") && e1.contains("TP size 4"), "{e1}");
            assert!(e2.contains("[8, 6]") && e2.contains("TP size 4"), "{e2}");
            assert!(e3.contains("[1, 2, 5]") && e3.contains("8"), "{e3}");
        }
        Ok(())
    }
}
