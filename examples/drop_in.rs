//! Drop-in: context parallelism for an EXISTING candle model.
//!
//! `Attn` below is written the way candle-transformers' `llama.rs` writes
//! `CausalSelfAttention` (q/k/v/o `Linear`s, a RoPE cache indexed by `index_pos`, `[B, H, T, D]`
//! after a transpose, `repeat_kv`, an explicit causal mask, softmax, matmul). Its
//! `forward_single` is that code, unchanged in spirit; `forward_cp` is the same block with
//! the few lines a user changes (marked `CHANGED`). The example trains nothing: it runs a
//! one-block LM on one device over the whole sequence, then on P thread ranks with each rank
//! holding T/P tokens, and checks that the loss and every weight gradient agree.
//!
//! ```text
//! cargo run --release --example drop_in                       # zigzag ring, P = 4, T = 1024
//! cargo run --release --example drop_in -- --layout ulysses --cp 2 --seq 512
//! cargo run --release --features cuda --example drop_in -- --device cuda   # ranks share GPU 0
//! cargo run --release --example drop_in -- --recompute     # the block recomputed in backward
//! ```
//! See docs/drop-in.md for the list of changes.

use candle_core::{DType, Device, Result, Tensor, Var, D};
use candle_cp_comm::{run_ranks, Group};
use candle_cp_llama::{global_mean, local_nll, IGNORE};
use candle_cp_ops::cp::{self, ring_attention, CpOpts, Layout};
use candle_cp_ops::recompute::Recompute;
use candle_cp_ops::ulysses::{ulysses_attention, UlyssesOpts};
use candle_nn::{Linear, Module};
use clap::Parser;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Parser)]
struct Args {
    /// ring | zigzag | striped | ulysses
    #[arg(long, default_value = "zigzag")]
    layout: String,
    /// Number of ranks (threads).
    #[arg(long, default_value_t = 4)]
    cp: usize,
    /// Global sequence length.
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    /// cpu, or cuda (build with `--features cuda`): the single-device run and every rank on
    /// GPU 0 (thread ranks sharing it).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Checkpoint the attention block on the ranks (`candle_cp_ops::recompute::Recompute`):
    /// keep only its input, rerun it (and its ring / all-to-all) in backward.
    #[arg(long)]
    recompute: bool,
}

const VOCAB: usize = 256;
const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;

/// RoPE tables for every position `[T_max, D]` (candle-transformers' `Cache::cos/sin`).
#[derive(Clone)]
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    fn new(t_max: usize, d: usize, dev: &Device) -> Result<Self> {
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / d as f32))
            .collect();
        let inv = Tensor::new(inv, dev)?;
        let pos = Tensor::arange(0u32, t_max as u32, dev)?.to_dtype(DType::F32)?;
        let f = pos.unsqueeze(1)?.broadcast_mul(&inv.unsqueeze(0)?)?;
        let f = Tensor::cat(&[&f, &f], 1)?;
        Ok(Self {
            cos: f.cos()?,
            sin: f.sin()?,
        })
    }
}

fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let rot = Tensor::cat(
        &[
            &x.narrow(D::Minus1, d / 2, d / 2)?.neg()?,
            &x.narrow(D::Minus1, 0, d / 2)?,
        ],
        D::Minus1,
    )?;
    x.broadcast_mul(cos)? + rot.broadcast_mul(sin)?
}

#[derive(Clone)]
struct Attn {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
}

/// How the CP version attends (owned: a checkpointed block reruns in backward).
#[derive(Clone)]
enum Cp {
    Ring(Group, CpOpts),
    Ulysses(Group),
}

impl Attn {
    /// BEFORE — candle-transformers style, one device, positions `index_pos..index_pos+T`.
    fn forward_single(&self, x: &Tensor, index_pos: usize, rope: &Rope) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let d = c / HEADS;
        let q = self.q.forward(x)?.reshape((b, t, HEADS, d))?.transpose(1, 2)?; // [B, H, T, D]
        let k = self.k.forward(x)?.reshape((b, t, KV_HEADS, d))?.transpose(1, 2)?;
        let v = self
            .v
            .forward(x)?
            .reshape((b, t, KV_HEADS, d))?
            .transpose(1, 2)?
            .contiguous()?;
        let cos = rope.cos.narrow(0, index_pos, t)?; // positions are contiguous here
        let sin = rope.sin.narrow(0, index_pos, t)?;
        let q = rotate(&q, &cos, &sin)?;
        let k = rotate(&k, &cos, &sin)?;
        let rep = |x: Tensor| -> Result<Tensor> {
            // repeat_kv: [B, Hkv, T, D] -> [B, H, T, D]
            let (b, hkv, t, d) = x.dims4()?;
            x.unsqueeze(2)?
                .broadcast_as((b, hkv, HEADS / hkv, t, d))?
                .reshape((b, HEADS, t, d))
        };
        let (k, v) = (rep(k)?, rep(v)?);
        let att = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
        let mask: Vec<u8> = (0..t).flat_map(|i| (0..t).map(move |j| u8::from(j > i))).collect();
        let mask = Tensor::from_vec(mask, (t, t), x.device())?.broadcast_as(att.shape())?;
        let att = mask.where_cond(
            &Tensor::new(f32::NEG_INFINITY, x.device())?.broadcast_as(att.shape())?,
            &att,
        )?;
        let att = candle_nn::ops::softmax(&att, D::Minus1)?; // (softmax_last_dim has no backward)
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        self.o.forward(&y)
    }

    /// AFTER — this rank's `T/P` tokens with their GLOBAL positions.
    fn forward_cp(&self, x: &Tensor, positions: &Tensor, rope: &Rope, cp: &Cp) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let d = c / HEADS;
        // CHANGED: keep [B, T, H, D] (our ops' layout), no transpose
        let q = self.q.forward(x)?.reshape((b, t, HEADS, d))?;
        let k = self.k.forward(x)?.reshape((b, t, KV_HEADS, d))?;
        let v = self.v.forward(x)?.reshape((b, t, KV_HEADS, d))?;
        // CHANGED: RoPE at each token's global position (index_select, not narrow)
        let cos = rope.cos.index_select(positions, 0)?.unsqueeze(1)?; // [T, 1, D]
        let sin = rope.sin.index_select(positions, 0)?.unsqueeze(1)?;
        let q = rotate(&q, &cos, &sin)?;
        let k = rotate(&k, &cos, &sin)?;
        // CHANGED: one call replaces repeat_kv + mask + softmax + matmul (GQA handled inside)
        let (y, _lse) = match cp {
            Cp::Ring(group, opts) => ring_attention(&q, &k, &v, group, opts)?,
            Cp::Ulysses(group) => {
                ulysses_attention(&q, &k, &v, group, &UlyssesOpts::new(true, 1.0 / (d as f64).sqrt()))?
            }
        };
        self.o.forward(&y.reshape((b, t, c))?)
    }
}

/// Embedding → attention block (residual) → head. Weights from shared tensors.
struct Lm {
    emb: Var,
    attn: Attn,
    head: Linear,
    vars: Vec<(String, Var)>,
}

impl Lm {
    fn new(w: &HashMap<String, Tensor>) -> Result<Self> {
        let mut vars = Vec::new();
        let mut var = |n: &str| -> Result<Var> {
            let v = Var::from_tensor(&w[n].copy()?)?; // own storage per rank
            vars.push((n.to_string(), v.clone()));
            Ok(v)
        };
        let lin = |v: Var| Linear::new(v.as_tensor().clone(), None);
        let emb = var("emb")?;
        let attn = Attn {
            q: lin(var("q")?),
            k: lin(var("k")?),
            v: lin(var("v")?),
            o: lin(var("o")?),
        };
        let head = lin(var("head")?);
        Ok(Self { emb, attn, head, vars })
    }
    fn logits(&self, ids: &Tensor, f: impl Fn(&Attn, &Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let x = self
            .emb
            .as_tensor()
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, HIDDEN))?;
        let x = (&x + f(&self.attn, &x)?)?;
        self.head.forward(&x)
    }
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let (p, t) = (a.cp, a.seq);
    if p == 0 || t == 0 {
        anyhow::bail!("--cp ({p}) and --seq ({t}) must be at least 1")
    }
    let t0 = std::time::Instant::now();
    let dev = match a.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)?,
        other => anyhow::bail!("--device {other}: expected cpu or cuda"),
    };
    let d = HIDDEN / HEADS;
    let mut w = HashMap::new();
    // Seeded: the same weights and tokens every run.
    for (i, (n, shape)) in [
        ("emb", (VOCAB, HIDDEN)),
        ("q", (HIDDEN, HIDDEN)),
        ("k", (KV_HEADS * d, HIDDEN)),
        ("v", (KV_HEADS * d, HIDDEN)),
        ("o", (HIDDEN, HIDDEN)),
        ("head", (VOCAB, HIDDEN)),
    ]
    .into_iter()
    .enumerate()
    {
        w.insert(n.to_string(), candle_cp_ops::oracle::randn(i as u64 + 1, &[shape.0, shape.1], 0.3)?.to_device(&dev)?);
    }
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let ids: Vec<u32> = (0..t)
        .map(|_| {
            // xorshift64: uniform token ids in [0, VOCAB).
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % VOCAB as u64) as u32
        })
        .collect();
    let ids = Tensor::from_vec(ids, (1, t), &dev)?;
    let labels = Tensor::cat(&[&ids.narrow(1, 1, t - 1)?, &Tensor::full(IGNORE, (1, 1), &dev)?], 1)?;
    let rope = Rope::new(t, d, &dev)?;

    // ---- one device, the whole sequence ----
    let lm = Lm::new(&w)?;
    let logits = lm.logits(&ids, |attn, x| attn.forward_single(x, 0, &rope))?;
    let (terms, n) = local_nll(&logits, &labels)?;
    let loss_single = (terms.sum_all()? / n as f64)?;
    let g = loss_single.backward()?;
    let mut grads_single = Vec::new();
    for (k, v) in &lm.vars {
        let Some(gk) = g.get(v.as_tensor()) else {
            anyhow::bail!("no gradient for {k}")
        };
        grads_single.push((k.clone(), gk.clone()));
    }
    let loss_single = loss_single.to_scalar::<f32>()?;

    // ---- P ranks, T/P tokens each ----
    let (layout, ulysses) = match a.layout.as_str() {
        "ulysses" => (Layout::Contiguous, true),
        other => (other.parse::<Layout>()?, false),
    };
    let res = run_ranks(p, |group| {
        let r = group.rank();
        // CHANGED: shard ids, labels (shifted globally first) and positions by the layout
        let ids_l = cp::shard(&ids, layout, r, p, 1)?;
        let labels_l = cp::shard(&labels, layout, r, p, 1)?;
        let pos_l = cp::position_ids(layout, r, p, t, &dev)?;
        let lm = Lm::new(&w)?; // same initial weights on every rank
        let cpk = if ulysses {
            Cp::Ulysses(group.clone())
        } else {
            Cp::Ring(group.clone(), CpOpts::new(layout, true))
        };
        // optional: recompute the block in backward (keeps only its input; see docs/drop-in.md)
        let rc = Recompute::new();
        let logits = lm.logits(&ids_l, |attn, x| {
            if !a.recompute {
                return attn.forward_cp(x, &pos_l, &rope, &cpk);
            }
            let (attn, pos, rope, cpk) = (attn.clone(), pos_l.clone(), rope.clone(), cpk.clone());
            rc.checkpoint("attention block", x, Arc::new(move |x: &Tensor| attn.forward_cp(x, &pos, &rope, &cpk)))
        })?;
        // CHANGED: global mean over all ranks' targets (sum + count all-reduced)
        let (terms, n) = local_nll(&logits, &labels_l)?;
        let loss = global_mean(&terms, n, &group)?;
        let g = rc.backward(&loss)?; // = loss.backward() + the checkpointed block's weights
        // CHANGED: sum every replicated weight's gradient over the CP group
        let mut grads = Vec::new();
        for (k, v) in &lm.vars {
            let gi = g.get(v.as_tensor()).cloned().unwrap_or(v.as_tensor().zeros_like()?);
            grads.push((k.clone(), group.all_reduce(&gi)?));
        }
        Ok((loss.to_scalar::<f32>()?, grads))
    });
    let mut worst = (0f32, String::new());
    for (r, out) in res.into_iter().enumerate() {
        let (loss, grads) = out?;
        anyhow::ensure!(
            (loss - loss_single).abs() < 1e-5,
            "rank {r}: loss {loss} vs single {loss_single}"
        );
        for ((k, g1), (_, gp)) in grads_single.iter().zip(&grads) {
            let rel =
                ((g1 - gp)?.abs()?.max_all()?.to_scalar::<f32>()? / g1.abs()?.max_all()?.to_scalar::<f32>()?).max(0.0);
            if rel >= worst.0 {
                worst = (rel, k.clone());
            }
        }
    }
    let rc = if a.recompute { ", block recomputed in backward" } else { "" };
    println!("layout {} P = {p}, T = {t}: {} tokens per rank, on {:?}{rc}", a.layout, t / p, dev);
    println!("loss single device {loss_single:.6}, every rank agrees within 1e-5");
    println!("worst gradient rel. error {:.2e} ({})", worst.0, worst.1);
    anyhow::ensure!(worst.0 < 1e-4, "gradients differ");
    println!("OK in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}
