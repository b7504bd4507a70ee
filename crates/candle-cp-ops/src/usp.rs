//! 2-D (Ulysses × ring) attention, "unified sequence parallelism".
//!
//! A world of `W = U·R` ranks is a `R × U` grid ([`UspGroups::new`], built on
//! [`candle_cp_comm::Mesh`] with dims `[("ring", R), ("ulysses", U)]`, the last dim fastest):
//!
//! ```text
//!   world rank w = i·U + u      i = ring index (0..R), u = Ulysses index (0..U)
//!   Ulysses group of w: ranks {i·U + 0, .., i·U + U-1}  (adjacent ranks: the all-to-all is
//!                                                      the heavy traffic, keep it intra-node)
//!   ring group of w:    ranks {0·U + u, 1·U + u, .., (R-1)·U + u}
//!   e.g. U = 2, R = 2:  ulysses {0,1} {2,3};  ring {0,2} {1,3}
//! ```
//!
//! **Sequence sharding** (global length `T`): the sequence is first split over the ring
//! groups by a CP layout (zigzag by default: ring index `i` holds chunks `i` and `2R-1-i` of
//! `2R` chunks), then that ring shard of `T/R` rows is split *contiguously* over the Ulysses
//! group: rank `(i, u)` holds rows `[u·T/(RU), (u+1)·T/(RU))` of ring shard `i`
//! ([`usp_positions`], [`usp_shard`]).
//!
//! **Attention**:
//! ```text
//!   rank (i,u): q [B, T/(RU), H, D], k/v [B, T/(RU), Hkv, D]
//!     │ all_to_all_seq_to_head in the Ulysses group (KV heads replicated if U > Hkv)
//!   q [B, T/R, H/U, D], k/v [B, T/R, max(Hkv/U, 1), D]   = ring shard i, heads of u
//!     │ ring attention (zigzag) over the ring group: K/V rotate R-1 hops
//!   out [B, T/R, H/U, D], lse [B, H/U, T/R]
//!     │ all_to_all_head_to_seq in the Ulysses group
//!   out [B, T/(RU), H, D], lse [B, H, T/(RU)]
//! ```
//! GQA: KV heads are split over the Ulysses group when `Hkv % U == 0` and replicated when
//! `U % Hkv == 0` (the copies' f32 gradients are summed back before one rounding); the ring
//! then carries only the `max(Hkv/U, 1)` KV heads each rank needs. The backward is the raw
//! ring backward between the conjugate all-to-alls (one attached op: dK/dV stay f32 until the
//! copies are summed).

use crate::attention::sinks::{pad_heads, sinks_grad};
use crate::attention::{RowSums, Sinks};
use crate::cp::{self, CpOpts, CpRun, Layout};
use crate::oracle::{AttnCase, AttnOutputs};
use crate::packing::Documents;
use crate::autograd::{add_residual, attach_n, rounding_residual, BackwardFn};
use crate::ulysses::{
    check_qkv, head_to_seq_raw, kv_grad_head_to_seq, kv_spread, lse_head_to_seq, seq_to_head_raw, ulysses_attention,
    HeadLayout, HeadQkv, Kept, UlyssesOpts,
};
use candle_core::{Result, Tensor, Var};
use candle_cp_comm::{run_ranks_with, Group, Mesh, ThreadGroupOptions};
use std::sync::Arc;
use std::time::Duration;

/// The two sub-groups of a 2-D Ulysses × ring layout for this rank.
#[derive(Clone)]
pub struct UspGroups {
    /// The `U` ranks that exchange heads by all-to-all (same ring index).
    pub ulysses: Group,
    /// The `R` ranks that pass K/V around a ring (same Ulysses index).
    pub ring: Group,
}

impl UspGroups {
    /// Split `world` (size `U·R`) into Ulysses and ring groups; rank order as in the module
    /// docs (`w = i·U + u`). Collective over `world`.
    pub fn new(world: &Group, ulysses: usize, ring: usize) -> Result<Self> {
        if ulysses == 0 || ring == 0 || ulysses * ring != world.size() {
            candle_core::bail!(
                "usp: Ulysses degree U = {ulysses} × ring degree R = {ring} must equal the world size {}",
                world.size()
            )
        }
        let mesh = Mesh::new(world.clone(), &[("ring", ring), ("ulysses", ulysses)])?;
        Ok(Self { ulysses: mesh.group("ulysses")?, ring: mesh.group("ring")? })
    }

    /// Ulysses degree `U`.
    pub fn u(&self) -> usize {
        self.ulysses.size()
    }
    /// Ring degree `R`.
    pub fn r(&self) -> usize {
        self.ring.size()
    }
}

/// Options of [`usp_attention`].
#[derive(Clone, Debug, PartialEq)]
pub struct UspOpts {
    /// Causal mask over global positions.
    pub causal: bool,
    /// Softmax scale, usually `1/sqrt(D)`.
    pub scale: f64,
    /// Logit soft cap (Gemma 2; see [`crate::attention::Scores`]), `None` for none.
    pub softcap: Option<f64>,
    /// How the sequence is split over the ring groups (zigzag balances causal work).
    pub ring_layout: Layout,
    /// Packed documents of the global sequence (`None`: one document), passed to the ring
    /// ([`CpOpts::documents`]).
    pub documents: Option<Documents>,
    /// Packed documents per batch row, passed to the ring ([`CpOpts::row_documents`]).
    pub row_documents: Option<Vec<Documents>>,
    /// Causal sliding window of `window` keys, passed to the ring ([`CpOpts::window`]).
    pub window: Option<usize>,
    /// What the backward keeps of the Ulysses head layout (default [`HeadLayout::Kept`]:
    /// q, k, v and the output; [`HeadLayout::Regathered`]: none of them, the backward
    /// all-to-alls them again). Either way a 16-bit output's bf16 rounding residual is kept
    /// for the ring backward's f32 row sums (unless `row_sums` is [`RowSums::Output`]).
    pub head_layout: HeadLayout,
    /// Where the ring backward's row sums take the output from (default [`RowSums::F32`], as
    /// [`CpOpts::row_sums`]).
    pub row_sums: RowSums,
    /// Attention sinks, one logit per query head of the local q (`[H]`, see
    /// [`crate::attention::sinks`]): the ring of Ulysses rank `u` applies heads
    /// `[u·H/U, (u+1)·H/U)` to its finished rows. `None`: no sinks.
    pub sinks: Option<Sinks>,
}

impl UspOpts {
    /// Zigzag ring layout with the given mask type and scale.
    pub fn new(causal: bool, scale: f64) -> Self {
        Self {
            causal,
            scale,
            softcap: None,
            ring_layout: Layout::Zigzag,
            documents: None,
            row_documents: None,
            window: None,
            head_layout: HeadLayout::Kept,
            row_sums: RowSums::F32,
            sinks: None,
        }
    }

    /// Same options with attention sinks (see [`UspOpts::sinks`]; `None`: none).
    pub fn with_sinks(mut self, sinks: Option<Sinks>) -> Self {
        self.sinks = sinks;
        self
    }

    /// Same options with the logits soft-capped at `cap` (`None`: uncapped).
    pub fn with_softcap(mut self, cap: Option<f64>) -> Self {
        self.softcap = cap;
        self
    }

    /// Same options with the ring backward's row sums taken as `row_sums` says.
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
    /// [`UspOpts::row_documents`]).
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
}

/// Global positions of the rows held by rank `(ring_rank, uly_rank)` of an `R × U` layout,
/// in local order (length `T/(R·U)`). Errors if `T` does not split.
pub fn usp_positions(layout: Layout, t: usize, ring_rank: usize, r: usize, uly_rank: usize, u: usize) -> Result<Vec<usize>> {
    let ring_pos = cp::positions(layout, ring_rank, r, t)?;
    let tr = ring_pos.len();
    if u == 0 || tr % u != 0 || uly_rank >= u {
        candle_core::bail!("usp: ring shard of T/R = {tr} rows (T = {t}, R = {r}) cannot be split over U = {u} Ulysses ranks (rank {uly_rank})")
    }
    let n = tr / u;
    Ok(ring_pos[uly_rank * n..(uly_rank + 1) * n].to_vec())
}

/// This rank's shard `[.., T/(R·U), ..]` of `global` `[.., T, ..]` along `dim` for the
/// sharding described in the module docs.
pub fn usp_shard(global: &Tensor, layout: Layout, groups: &UspGroups, dim: usize) -> Result<Tensor> {
    let (u, r) = (groups.u(), groups.r());
    let ring_shard = cp::shard(global, layout, groups.ring.rank(), r, dim)?;
    let tr = ring_shard.dim(dim)?;
    if tr % u != 0 {
        candle_core::bail!("usp_shard: ring shard {:?} (T/R = {tr} along dim {dim}) not divisible by U = {u}", ring_shard.dims())
    }
    ring_shard.narrow(dim, groups.ulysses.rank() * (tr / u), tr / u)?.contiguous()
}

/// 2-D Ulysses × ring attention.
///
/// - `q` `[B, T/(R·U), H, D]`, `k`, `v` `[B, T/(R·U), Hkv, D]`: this rank's rows, sharded as
///   [`usp_shard`] does with `opts.ring_layout`.
/// - returns `out` `[B, T/(R·U), H, D]` (q's dtype, differentiable w.r.t. q, k, v) and `lse`
///   `[B, H, T/(R·U)]` (f32), equal to the rows of single-device attention over `T`.
///
/// A causal window within one chunk of the ring part (`T/(2R)` zigzag) runs that part as the
/// halo exchange of [`cp::halo`] instead of the ring.
///
/// Errors: `H % U != 0` (the message lists the Ulysses degrees that work; KV heads are split
/// or replicated for any of them, [`crate::ulysses::KvSpread`]), `T` not divisible by what the
/// ring layout needs. Collective over both groups.
pub fn usp_attention(q: &Tensor, k: &Tensor, v: &Tensor, groups: &UspGroups, opts: &UspOpts) -> Result<(Tensor, Tensor)> {
    let (_, _, h, hkv, _) = check_qkv("usp_attention", q, k, v)?;
    let spread = kv_spread(h, hkv, groups.u())?;
    let uly = &groups.ulysses;
    let same = |x: Tensor| Ok(x);
    // the sinks of this Ulysses rank's heads, [u·H/U, (u+1)·H/U), for its ring
    let h0 = uly.rank() * (h / groups.u());
    let sinks_h = match &opts.sinks {
        Some(z) => {
            z.check("usp_attention", q)?;
            Some(z.narrow(h0, h / groups.u())?)
        }
        None => None,
    };
    let heads = HeadQkv::gather(q, k, v, spread, uly, &same)?;
    let cp_opts = CpOpts {
        documents: opts.documents.clone(),
        row_documents: opts.row_documents.clone(),
        window: opts.window,
        sinks: sinks_h.clone(),
        ..CpOpts::new(opts.ring_layout, opts.causal).with_scale(opts.scale).with_softcap(opts.softcap)
    };
    let z_full = opts.sinks.as_ref().map(|z| (z.tensor().clone(), h0, h));
    if cp::halo::applies(&cp_opts, groups.r(), heads.q.dim(1)? * groups.r()) {
        // a window within one chunk of the ring part: its halo exchange, not the ring
        return usp_halo((q, k, v), heads, spread, groups, cp_opts, z_full);
    }
    let (out32, lse_h, _) = cp::ring_attention_fwd_raw(&heads.q, &heads.k, &heads.v, &groups.ring, &cp_opts)?;
    let out_h = out32.to_dtype(q.dtype())?;
    let out = head_to_seq_raw(&out_h, uly)?;
    let lse = lse_head_to_seq(&lse_h, uly)?;
    // The backward's row sums read the f32 output as the output in q's dtype plus its bf16
    // rounding residual (head layout; none for f32), whether the output is kept in the head
    // layout or all-to-alled back from the returned one: both modes compute the same bits.
    let residual = match opts.row_sums {
        RowSums::F32 => rounding_residual(&out32, &out_h)?,
        RowSums::Output => None,
    };
    drop(out32);
    let kept = Kept::new(opts.head_layout, heads, out_h, q, k, v);
    let slot = kept.slot();
    let (g, qdt, kdt) = (groups.clone(), q.dtype(), k.dtype());
    let zt = z_full.as_ref().map(|z| z.0.detach());
    // The ring's f32 dK/dV go back through the all-to-all as kv_grad_head_to_seq says (f32 and
    // summed before rounding when the KV heads were replicated), dQ in q's dtype.
    let bwd: BackwardFn = Arc::new(move |dout: &Tensor| {
        let (h, o) = kept.heads(spread, &g.ulysses, &same)?;
        let out32 = add_residual(&o, residual.as_ref())?;
        let dh = seq_to_head_raw(&dout.to_dtype(qdt)?, &g.ulysses)?;
        let (dq, dk, dv, _) = cp::ring_attention_bwd_raw(&h.q, &h.k, &h.v, &out32, &lse_h, &dh, &g.ring, &cp_opts)?;
        let mut grads = vec![
            Some(head_to_seq_raw(&dq.to_dtype(qdt)?, &g.ulysses)?),
            Some(kv_grad_head_to_seq(dk, spread, &g.ulysses, kdt)?),
            Some(kv_grad_head_to_seq(dv, spread, &g.ulysses, kdt)?),
        ];
        if let (Some(z), Some(zf)) = (&cp_opts.sinks, &zt) {
            grads.push(Some(pad_heads(&sinks_grad(&out32, &lse_h, &dh, z.tensor())?, h0, zf.dim(0)?, zf.dtype())?));
        }
        Ok(grads)
    });
    let out = attach_sinks("usp_attention", q, k, v, z_full.as_ref().map(|z| &z.0), out, bwd)?;
    if let Some(slot) = slot {
        slot.set(&out);
    }
    Ok((out, lse))
}

/// [`usp_attention`] whose ring part is the halo exchange of a short window ([`cp::halo`]): the
/// band attention of the head-layout rows runs with autograd on leaves of its own, and the
/// op's backward runs that graph's backward on the all-to-alled output gradient (the graph,
/// heads included, is kept until then, whatever `opts.head_layout`).
fn usp_halo(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    heads: HeadQkv,
    spread: crate::ulysses::KvSpread,
    groups: &UspGroups,
    mut cp_opts: CpOpts,
    z_full: Option<(Tensor, usize, usize)>,
) -> Result<(Tensor, Tensor)> {
    // the head slice's sinks as a leaf of the inner graph, so that its backward gives dz
    let zv = match &cp_opts.sinks {
        Some(z) => Some(Var::from_tensor(z.tensor())?),
        None => None,
    };
    if let Some(zv) = &zv {
        cp_opts.sinks = Some(Sinks::new(zv.as_tensor())?);
    }
    let cp_opts = &cp_opts;
    let dims = cp::check_inputs("usp_attention", &heads.q, &heads.k, &heads.v, &groups.ring, cp_opts)?;
    let (qv, kv, vv) = (Var::from_tensor(&heads.q)?, Var::from_tensor(&heads.k)?, Var::from_tensor(&heads.v)?);
    let (out_h, lse_h) = cp::halo::halo_attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), &groups.ring, cp_opts, &dims)?;
    let out = head_to_seq_raw(&out_h.detach(), &groups.ulysses)?;
    let lse = lse_head_to_seq(&lse_h, &groups.ulysses)?;
    let (g, qdt, kdt) = (groups.clone(), q.dtype(), k.dtype());
    let zt = z_full.as_ref().map(|(z, h0, h)| (z.detach(), *h0, *h));
    let bwd: BackwardFn = Arc::new(move |dout: &Tensor| {
        let dh = seq_to_head_raw(&dout.to_dtype(qdt)?, &g.ulysses)?;
        let grads = (&out_h * &dh)?.sum_all()?.backward()?;
        let grad = |x: &Var, n: &str| -> Result<Tensor> {
            grads.get(x.as_tensor()).cloned().ok_or_else(|| candle_core::Error::Msg(format!("usp_attention (halo): no gradient for {n}")))
        };
        let f32 = candle_core::DType::F32;
        let mut out = vec![
            Some(head_to_seq_raw(&grad(&qv, "q")?.to_dtype(qdt)?, &g.ulysses)?),
            Some(kv_grad_head_to_seq(grad(&kv, "k")?.to_dtype(f32)?, spread, &g.ulysses, kdt)?),
            Some(kv_grad_head_to_seq(grad(&vv, "v")?.to_dtype(f32)?, spread, &g.ulysses, kdt)?),
        ];
        if let (Some(zv), Some((z, h0, h))) = (&zv, &zt) {
            out.push(Some(pad_heads(&grad(zv, "sinks")?.to_dtype(f32)?, *h0, *h, z.dtype())?));
        }
        Ok(out)
    });
    let out = attach_sinks("usp_attention", q, k, v, z_full.as_ref().map(|z| &z.0), out, bwd)?;
    Ok((out, lse))
}

/// [`attach_n`] over q, k, v and, when there are sinks, the sinks `[H]` as a fourth input.
fn attach_sinks(name: &'static str, q: &Tensor, k: &Tensor, v: &Tensor, sinks: Option<&Tensor>, out: Tensor, bwd: BackwardFn) -> Result<Tensor> {
    match sinks {
        Some(z) => attach_n(name, &[q, k, v, z], out, bwd),
        None => attach_n(name, &[q, k, v], out, bwd),
    }
}

/// Run an oracle case on thread ranks (forward + autograd backward of `sum(out · dout)`) and
/// gather the global results: each rank returns its rows' global positions and
/// `[out, lse, dq, dk, dv]`.
fn run_sharded(
    case: &AttnCase,
    world: usize,
    timeout: Duration,
    what: &str,
    rank_fn: impl Fn(&Group) -> Result<(Vec<usize>, [Tensor; 5])> + Send + Sync,
) -> Result<CpRun> {
    let res = run_ranks_with(world, ThreadGroupOptions::with_timeout(timeout), |g: Group| rank_fn(&g));
    let mut parts = Vec::with_capacity(world);
    let mut errs = Vec::new();
    for (r, x) in res.into_iter().enumerate() {
        match x {
            Ok(x) => parts.push(x),
            Err(e) => errs.push(format!("rank {r}: {e}")),
        }
    }
    if !errs.is_empty() {
        candle_core::bail!("{what} on {}: {}", case.name, errs.join("; "))
    }
    let shapes: Vec<Vec<Vec<usize>>> = parts.iter().map(|(_, xs)| xs.iter().map(|x| x.dims().to_vec()).collect()).collect();
    if let Some(r) = shapes.iter().position(|s| s != &shapes[0]) {
        candle_core::bail!("{what}: rank {r} output shapes {:?} differ from rank 0 {:?}", shapes[r], shapes[0])
    }
    let pos: Vec<usize> = parts.iter().flat_map(|(p, _)| p.iter().copied()).collect();
    let mut inv = vec![u32::MAX; pos.len()];
    for (i, &p) in pos.iter().enumerate() {
        if p >= inv.len() || inv[p] != u32::MAX {
            candle_core::bail!("{what}: rank rows do not cover 0..{} exactly once (position {p})", pos.len())
        }
        inv[p] = i as u32;
    }
    let inv = Tensor::new(inv, &candle_core::Device::Cpu)?;
    let col = |i: usize, dim: usize| -> Result<Tensor> {
        let ts: Vec<Tensor> = parts.iter().map(|(_, xs)| xs[i].to_device(&candle_core::Device::Cpu)).collect::<Result<_>>()?;
        Tensor::cat(&ts, dim)?.contiguous()?.index_select(&inv, dim)
    };
    let outputs = AttnOutputs { out: col(0, 1)?, lse: col(1, 2)?, dq: col(2, 1)?, dk: col(3, 1)?, dv: col(4, 1)? };
    Ok(CpRun { outputs, shapes })
}

/// Forward + backward of `sum(out · dout)` on local shards with a parallel attention op.
fn local_fwd_bwd(
    case: &AttnCase,
    shard: impl Fn(&Tensor) -> Result<Tensor>,
    attn: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<(Tensor, Tensor)>,
) -> Result<[Tensor; 5]> {
    let q = Var::from_tensor(&shard(&case.q)?)?;
    let k = Var::from_tensor(&shard(&case.k)?)?;
    let v = Var::from_tensor(&shard(&case.v)?)?;
    let (out, lse) = attn(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
    let grads = (&out * shard(&case.dout)?)?.sum_all()?.backward()?;
    let g = |x: &Var, n: &str| match grads.get(x.as_tensor()) {
        Some(t) => Ok(t.clone()),
        None => candle_core::bail!("no gradient for {n}"),
    };
    Ok([out, lse, g(&q, "q")?, g(&k, "k")?, g(&v, "v")?])
}

/// Run `case` with [`ulysses_attention`] on `p` thread ranks, q/k/v sharded with `layout`
/// (contiguous, zigzag or striped; see [`crate::ulysses::SeqOrder`]), and gather the results.
/// Errors (before starting ranks) name H, Hkv, P and the degrees that work, or T and the layout.
pub fn run_case_ulysses(case: &AttnCase, p: usize, layout: Layout, timeout: Duration) -> Result<CpRun> {
    run_case_ulysses_with(case, p, layout, timeout, None, None)
}

/// [`run_case_ulysses`] over a packed sequence and/or with a sliding window: attention kept
/// inside `documents` (covering the case's `T`) and within `window` keys when given.
pub fn run_case_ulysses_with(
    case: &AttnCase,
    p: usize,
    layout: Layout,
    timeout: Duration,
    documents: Option<Documents>,
    window: Option<usize>,
) -> Result<CpRun> {
    let opts = UlyssesOpts { documents, window, ..UlyssesOpts::new(case.causal, case.scale) };
    run_case_ulysses_opts(case, p, layout, timeout, opts)
}

/// [`run_case_ulysses`] with the given options (their mask, scale, documents, window and
/// [`crate::ulysses::HeadLayout`]; the sequence order is set from `layout`).
pub fn run_case_ulysses_opts(case: &AttnCase, p: usize, layout: Layout, timeout: Duration, opts: UlyssesOpts) -> Result<CpRun> {
    let (_, t, h, _) = case.q.dims4()?;
    let hkv = case.k.dim(2)?;
    kv_spread(h, hkv, p)?;
    layout.local_len(t, p)?;
    let opts = opts.with_layout(layout, t, p)?;
    run_sharded(case, p, timeout, &format!("ulysses P = {p} ({layout})"), |g| {
        let r = g.rank();
        let out = local_fwd_bwd(case, |x| cp::shard(x, layout, r, p, 1), |q, k, v| ulysses_attention(q, k, v, g, &opts))?;
        Ok((cp::positions(layout, r, p, t)?, out))
    })
}

/// Run `case` with [`usp_attention`] on `U·R` thread ranks (zigzag over the ring groups,
/// contiguous inside each Ulysses group; rank order in the module docs) and gather the results.
/// Errors (before starting ranks) name H, Hkv, U, R and T.
pub fn run_case_usp(case: &AttnCase, u: usize, r: usize, timeout: Duration) -> Result<CpRun> {
    run_case_usp_with(case, u, r, timeout, None, None)
}

/// [`run_case_usp`] over a packed sequence and/or with a sliding window: attention kept
/// inside `documents` (covering the case's `T`) and within `window` keys when given.
pub fn run_case_usp_with(
    case: &AttnCase,
    u: usize,
    r: usize,
    timeout: Duration,
    documents: Option<Documents>,
    window: Option<usize>,
) -> Result<CpRun> {
    run_case_usp_opts(case, u, r, timeout, UspOpts { documents, window, ..UspOpts::new(case.causal, case.scale) })
}

/// [`run_case_usp`] with the given options (their mask, scale, documents, window and
/// [`crate::ulysses::HeadLayout`]; the ring layout is zigzag).
pub fn run_case_usp_opts(case: &AttnCase, u: usize, r: usize, timeout: Duration, opts: UspOpts) -> Result<CpRun> {
    let (_, t, h, _) = case.q.dims4()?;
    let hkv = case.k.dim(2)?;
    if u == 0 || r == 0 {
        candle_core::bail!("usp: Ulysses degree U = {u} and ring degree R = {r} must be at least 1")
    }
    kv_spread(h, hkv, u)?;
    let layout = Layout::Zigzag;
    let tr = layout.local_len(t, r)?;
    if tr % u != 0 {
        candle_core::bail!("usp: T = {t} splits into ring shards of T/R = {tr} rows (R = {r}), not divisible by U = {u}")
    }
    let opts = UspOpts { ring_layout: layout, ..opts };
    run_sharded(case, u * r, timeout, &format!("usp U = {u} R = {r}"), |g| {
        let groups = UspGroups::new(g, u, r)?;
        let out = local_fwd_bwd(case, |x| usp_shard(x, layout, &groups, 1), |q, k, v| usp_attention(q, k, v, &groups, &opts))?;
        Ok((usp_positions(layout, t, groups.ring.rank(), r, groups.ulysses.rank(), u)?, out))
    })
}
