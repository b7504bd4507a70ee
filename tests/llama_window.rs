//! Sliding-window attention (Mistral `sliding_window`) in the Llama, on every layout.
//!
//! - A window at least as long as the sequence never binds: logits, loss and every gradient
//!   still equal the float64 oracle (`tests/data/oracle/tiny-llama`, T = 2048).
//! - A small window (100 keys at T = 256, oracle weights) binds: rows < 100 keep the
//!   no-window logits, later rows differ; with a window of 1 every row's logits are those of
//!   its token alone (no window code in that reference). Every CP layout (ring, zigzag,
//!   striped, all-gather, Ulysses, 2-D, TP + SP) gives the single-device window model's
//!   logits, per-token NLL, loss and gradients, and its ranks agree.
//! - Window + packed documents: the window applies inside each document; every layout gives
//!   the single-device packed window model, which equals each document run alone.

use candle_core::{bail, DType, Device, Result, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::layout::{CpKind, Layout};
use candle_cp_llama::params::varmap_tensors;
use candle_cp_llama::verify::{compare, load_reference, run_layout, LayoutRun, Reference, Tolerances};
use candle_cp_llama::{
    gather_full, hf::load_safetensors_dir, init_params, named_grads, reduce_gradients, shard_batch, shard_batch_packed,
    shard_tensors, Documents, Llama, LlamaConfig, ParallelCtx,
};
use candle_nn::VarBuilder;
use std::collections::HashMap;
use std::sync::OnceLock;

struct Data {
    cfg: LlamaConfig,
    full: HashMap<String, Tensor>,
    reference: Reference,
}

fn data() -> &'static Data {
    static D: OnceLock<Data> = OnceLock::new();
    D.get_or_init(|| {
        let dir = candle_cp_tests::oracle_dir("tiny-llama");
        let load = || -> Result<Data> {
            let cfg = LlamaConfig::from_file(dir.join("config.json"))?;
            let full = load_safetensors_dir(&dir, &Device::Cpu)?;
            let reference = load_reference(dir.join("reference.safetensors"))?;
            Ok(Data { cfg, full, reference })
        };
        load().expect("loading tiny-llama oracle")
    })
}

fn max_abs(a: &Tensor) -> Result<f64> {
    a.to_dtype(DType::F64)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()
}

/// A run as the reference for other runs (`compare` takes a [`Reference`]).
fn as_reference(run: &LayoutRun, ids: &Tensor) -> Reference {
    Reference {
        input_ids: ids.clone(),
        logits: run.logits.clone(),
        loss: run.loss,
        grads: run.grads.iter().cloned().collect(),
    }
}

/// Per-token next-token NLL `[B·(T-1)]` from global logits `[B, T, V]` (labels `ids[t+1]`).
fn nll(logits: &Tensor, ids: &Tensor) -> Result<Vec<f32>> {
    let (b, t, v) = logits.dims3()?;
    let lg = logits.flatten_all()?.to_vec1::<f32>()?;
    let ids = ids.to_vec2::<u32>()?;
    let mut out = Vec::with_capacity(b * (t - 1));
    for (r, row) in ids.iter().enumerate() {
        for j in 0..t - 1 {
            let x = &lg[(r * t + j) * v..(r * t + j + 1) * v];
            let m = x.iter().fold(f32::NEG_INFINITY, |a, &y| a.max(y)) as f64;
            let lse = m + x.iter().map(|&y| (y as f64 - m).exp()).sum::<f64>().ln();
            out.push((lse - x[row[j + 1] as usize] as f64) as f32);
        }
    }
    Ok(out)
}

fn max_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max)
}

/// A window of T (query T-1 still sees key 0) and one far beyond T: the oracle's numbers.
#[test]
fn window_not_shorter_than_sequence_equals_oracle() -> Result<()> {
    let d = data();
    let ids = &d.reference.input_ids;
    let t = ids.dim(1)?;
    for (w, layout) in [
        (t, Layout::single()),
        (t, Layout::cp(CpKind::Zigzag, 2)),
        (4 * t, Layout::cp(CpKind::Ulysses, 2)),
    ] {
        let t0 = std::time::Instant::now();
        let cfg = d.cfg.clone().with_sliding_window(Some(w));
        let run = run_layout(&d.full, &cfg, ids, layout, &Device::Cpu)?;
        let rep = compare(&run, &d.reference, Tolerances::default())?;
        println!(
            "window {w} {layout}: logits {:.1e} loss {:.1e} grad {:.1e} ({}) spread {:.1e} [{:.1}s]",
            rep.logits_abs,
            rep.loss_abs,
            rep.grad_rel_max,
            rep.worst_param,
            rep.rank_spread,
            t0.elapsed().as_secs_f64()
        );
        assert_eq!(rep.grad_rel.len(), d.reference.grads.len());
        assert!(rep.pass(), "window {w} on {layout}: out of oracle tolerance: {rep:?}");
    }
    Ok(())
}

/// The first `n` oracle tokens `[1, n]`.
fn oracle_prefix(n: usize) -> Result<Tensor> {
    data().reference.input_ids.narrow(1, 0, n)
}

const T_SMALL: usize = 256;
const W: usize = 100;

/// The window binds: rows < W equal the plain causal model, later rows differ; a window of 1
/// makes every row's logits those of its token run alone.
#[test]
fn small_window_binds_and_is_exact_at_its_edges() -> Result<()> {
    let d = data();
    let ids = oracle_prefix(T_SMALL)?;
    let v = d.cfg.vocab_size;
    let plain = run_layout(&d.full, &d.cfg, &ids, Layout::single(), &Device::Cpu)?;
    let win = run_layout(&d.full, &d.cfg.clone().with_sliding_window(Some(W)), &ids, Layout::single(), &Device::Cpu)?;
    let head = max_abs(&(plain.logits.narrow(1, 0, W)? - win.logits.narrow(1, 0, W)?)?)?;
    let tail = (plain.logits.narrow(1, W, T_SMALL - W)? - win.logits.narrow(1, W, T_SMALL - W)?)?
        .abs()?
        .max(2)?
        .squeeze(0)?
        .to_vec1::<f32>()?;
    println!("window {W}: rows < {W} differ by {head:.1e}, later rows by {:.1e} .. {:.1e}", tail.iter().cloned().fold(f32::INFINITY, f32::min), tail.iter().cloned().fold(0.0, f32::max));
    assert!(head < 1e-5, "rows inside the window: {head:.2e}");
    // every row past the window changes (the first one only by the key it lost)
    assert!(tail.iter().all(|&x| x > 1e-5), "some row past the window is unchanged: {tail:?}");
    assert!(tail.iter().cloned().fold(0.0, f32::max) > 1e-2);
    assert!((plain.loss - win.loss).abs() > 1e-4, "loss {} vs {}", plain.loss, win.loss);
    // window 1: attention returns the token's own value, so row j = the model on [ids[j]]
    let one = run_layout(&d.full, &d.cfg.clone().with_sliding_window(Some(1)), &ids, Layout::cp(CpKind::Zigzag, 2), &Device::Cpu)?;
    let toks = ids.to_vec2::<u32>()?[0].clone();
    let mut alone: HashMap<u32, Vec<f32>> = HashMap::new();
    let res = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let vm = shard_tensors(&d.full, &d.cfg, &ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &d.cfg, &ctx)?;
        let mut out = Vec::new();
        for &tok in toks.iter().take(64) {
            let x = Tensor::new(&[[tok]], &Device::Cpu)?;
            let pos = Tensor::new(&[0u32], &Device::Cpu)?;
            out.push((tok, m.forward(&x, &pos)?.flatten_all()?.to_vec1::<f32>()?));
        }
        Ok(out)
    });
    for r in res {
        alone.extend(r?);
    }
    let lg = one.logits.flatten_all()?.to_vec1::<f32>()?;
    let mut worst = 0f64;
    for (j, tok) in toks.iter().take(64).enumerate() {
        worst = worst.max(max_diff(&lg[j * v..(j + 1) * v], &alone[tok]));
    }
    println!("window 1 (zigzag 2) vs each token alone: {worst:.1e}");
    assert!(worst < 1e-5, "window 1: {worst:.2e}");
    Ok(())
}

/// THE parity test: every CP layout (and TP + SP) with a binding window equals the
/// single-device window model (logits, per-token NLL, loss, gradients; ranks agree). Window
/// 100 spans several CP chunks (64 tokens per rank at ring 4, 32 per zigzag chunk); window 7
/// is shorter than every chunk (most ring blocks are skipped).
#[test]
fn small_window_every_layout_equals_single_device() -> Result<()> {
    let d = data();
    let ids = oracle_prefix(T_SMALL)?;
    for w in [W, 7] {
        let cfg = d.cfg.clone().with_sliding_window(Some(w));
        let single = run_layout(&d.full, &cfg, &ids, Layout::single(), &Device::Cpu)?;
        let reference = as_reference(&single, &ids);
        let want_nll = nll(&single.logits, &ids)?;
        let mut layouts = vec![
            Layout::cp(CpKind::Ring, 4),
            Layout::cp(CpKind::Zigzag, 4),
            Layout::cp(CpKind::Striped, 4),
            Layout::cp(CpKind::AllGather, 4),
            Layout::cp(CpKind::Ulysses, 2),
            Layout::two_d(2, 2),
        ];
        if w == W {
            layouts.extend([
                Layout::cp(CpKind::Ulysses, 4),
                Layout::single().with_tp(2, true),
                Layout::cp(CpKind::Zigzag, 2).with_tp(2, true),
            ]);
        }
        for layout in layouts {
            let t0 = std::time::Instant::now();
            let run = run_layout(&d.full, &cfg, &ids, layout, &Device::Cpu)?;
            let rep = compare(&run, &reference, Tolerances::default())?;
            let dn = max_diff(&nll(&run.logits, &ids)?, &want_nll);
            println!(
                "window {w} {layout}: logits {:.1e} nll {dn:.1e} loss {:.1e} grad {:.1e} ({}) spread {:.1e} [{:.2}s]",
                rep.logits_abs,
                rep.loss_abs,
                rep.grad_rel_max,
                rep.worst_param,
                rep.rank_spread,
                t0.elapsed().as_secs_f64()
            );
            assert!(rep.pass(), "window {w} on {layout}: differs from single device: {rep:?}");
            assert!(dn < 1e-5, "window {w} on {layout}: per-token NLL {dn:.2e}");
        }
    }
    Ok(())
}

// ---- window + packed documents ------------------------------------------------------------

const TP: usize = 48;
const WP: usize = 6;

fn packed_cfg() -> LlamaConfig {
    LlamaConfig::tiny(61, 32, 2, 4, 2).with_sliding_window(Some(WP))
}

/// Global logits `[B·T·V]`, loss, gradients and rank spread of packed rows `ids` `[B, T]`
/// (`docs`: one shared or one per row) on `layout` (no DP).
type PackedRun = (Vec<f32>, f64, Vec<(String, Tensor)>, f64);

fn run_packed(full: &HashMap<String, Tensor>, ids: &Tensor, docs: &[Documents], layout: Layout) -> Result<PackedRun> {
    let cfg = packed_cfg();
    let v = cfg.vocab_size;
    let b = ids.dim(0)?;
    let gpos = Tensor::arange(0u32, TP as u32, &Device::Cpu)?.unsqueeze(0)?.repeat((b, 1))?;
    let outs = run_ranks(layout.world_size(), |g| {
        let ctx = ParallelCtx::new(g, layout)?;
        let vm = shard_tensors(full, &cfg, &ctx)?;
        let model = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
        let sb = shard_batch_packed(ids, docs, &ctx)?;
        let pos = shard_batch(&gpos, &ctx)?.input_ids.to_vec2::<u32>()?;
        let (loss, logits) = model.loss_packed(&sb.input_ids, &sb.labels, &sb.positions, &sb.documents)?;
        let mut grads = model.backward(&loss)?;
        reduce_gradients(&mut grads, &vm, &cfg, &ctx)?;
        let full_grads = gather_full(&named_grads(&grads, &vm)?, &cfg, &ctx)?;
        Ok((pos, logits.flatten_all()?.to_vec1::<f32>()?, loss.to_scalar::<f32>()? as f64, full_grads))
    })
    .into_iter()
    .collect::<Result<Vec<_>>>()?;
    let mut logits = vec![f32::NAN; b * TP * v];
    for (pos, lg, _, _) in &outs {
        for (r, row) in pos.iter().enumerate() {
            let tl = row.len();
            for (j, &p) in row.iter().enumerate() {
                let (src, dst) = (r * tl + j, r * TP + p as usize);
                logits[dst * v..(dst + 1) * v].copy_from_slice(&lg[src * v..(src + 1) * v]);
            }
        }
    }
    if logits.iter().any(|x| x.is_nan()) {
        bail!("{layout}: some logits uncovered")
    }
    let (loss, grads) = (outs[0].2, outs[0].3.clone());
    let mut spread = 0f64;
    for o in &outs[1..] {
        spread = spread.max((o.2 - loss).abs());
        for ((_, a), (_, b)) in grads.iter().zip(&o.3) {
            spread = spread.max(max_abs(&(a - b)?)?);
        }
    }
    Ok((logits, loss, grads, spread))
}

fn grad_rel(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> Result<(f64, String)> {
    assert_eq!(a.len(), b.len());
    let mut worst = (0f64, String::new());
    for ((na, ga), (nb, gb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let rel = max_abs(&(ga - gb)?)? / max_abs(gb)?.max(1e-30);
        if rel >= worst.0 {
            worst = (rel, na.clone());
        }
    }
    Ok(worst)
}

/// `[b, TP]` token ids from a small LCG.
fn packed_ids(b: usize, seed: u64) -> Result<Tensor> {
    let v = packed_cfg().vocab_size as u64;
    let mut s = seed;
    let toks: Vec<u32> = (0..b * TP)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % v) as u32
        })
        .collect();
    Tensor::from_vec(toks, (b, TP), &Device::Cpu)
}

/// Two rows with different documents (attended row by row under CP) and the window: zigzag
/// CP 2 and striped CP 2 × TP 2 + SP equal the single-device packed window model.
#[test]
fn window_with_per_row_documents_equals_single_device() -> Result<()> {
    let cfg = packed_cfg();
    let full = varmap_tensors(&init_params(&cfg, 11, DType::F32, &Device::Cpu)?)?;
    let ids = packed_ids(2, 9)?;
    let docs = [Documents::from_lengths(&[13, 22, 13])?, Documents::from_lengths(&[5, 30, 1, 12])?];
    let single = run_packed(&full, &ids, &docs, Layout::single())?;
    for layout in [Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Striped, 2).with_tp(2, true)] {
        let run = run_packed(&full, &ids, &docs, layout)?;
        let dl = max_diff(&run.0, &single.0);
        let (gr, worst) = grad_rel(&run.2, &single.2)?;
        let dloss = (run.1 - single.1).abs();
        println!("per-row packed window {WP} {layout}: logits {dl:.1e} loss {dloss:.1e} grad {gr:.1e} ({worst}) spread {:.1e}", run.3);
        assert!(dl < 1e-5 && dloss < 5e-6 && gr < 5e-5, "{layout}: logits {dl:.2e}, loss {dloss:.2e}, grad {gr:.2e} ({worst})");
        assert!(run.3 < 1e-5, "{layout}: ranks disagree by {:.2e}", run.3);
    }
    Ok(())
}

/// Packed row `[13 | 22 | 13]`, window 6: the single-device packed window model equals each
/// document run alone with the window (so the window restarts with every document); zigzag
/// CP 4, Ulysses 2 and 2-D 2×2 equal it (logits, loss, gradients), ranks agree; the packed
/// window model differs from the packed model without the window.
#[test]
fn window_with_packed_documents_on_cp_equals_single_device() -> Result<()> {
    let cfg = packed_cfg();
    let v = cfg.vocab_size;
    let full = varmap_tensors(&init_params(&cfg, 11, DType::F32, &Device::Cpu)?)?;
    let ids = packed_ids(1, 5)?;
    let docs = Documents::from_lengths(&[13, 22, 13])?;
    let single = run_packed(&full, &ids, std::slice::from_ref(&docs), Layout::single())?;
    // each document alone (plain rows, positions from 0), with the window
    let res = run_ranks(1, |g| {
        let ctx = ParallelCtx::single(g)?;
        let vm = shard_tensors(&full, &cfg, &ctx)?;
        let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
        let mut sep = Vec::new();
        for di in 0..docs.count() {
            let (a, e) = docs.range(di);
            let sb = shard_batch(&ids.narrow(1, a, e - a)?, &ctx)?;
            sep.extend(m.forward(&sb.input_ids, &sb.positions)?.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(sep)
    });
    let sep = res.into_iter().next().expect("one rank")?;
    let ds = max_diff(&single.0, &sep);
    println!("packed window {WP}: single device vs documents alone {ds:.1e}");
    assert!(ds < 1e-5, "packed window vs separate documents: {ds:.2e}");
    // control: without the window the packed row differs (documents longer than the window)
    let nowin = {
        let c = cfg.clone().with_sliding_window(None);
        let r = run_ranks(1, |g| {
            let ctx = ParallelCtx::single(g)?;
            let vm = shard_tensors(&full, &c, &ctx)?;
            let m = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &c, &ctx)?;
            let sb = shard_batch_packed(&ids, std::slice::from_ref(&docs), &ctx)?;
            m.forward_packed(&sb.input_ids, &sb.positions, &sb.documents)?.flatten_all()?.to_vec1::<f32>()
        });
        r.into_iter().next().expect("one rank")?
    };
    // rows 0..WP of the first document are inside the window: unchanged; later rows change
    let head = max_diff(&nowin[..WP * v], &single.0[..WP * v]);
    let tail = max_diff(&nowin[WP * v..13 * v], &single.0[WP * v..13 * v]);
    assert!(head < 1e-5 && tail > 1e-3, "window inside document 0: head {head:.2e}, tail {tail:.2e}");
    for layout in [Layout::cp(CpKind::Zigzag, 4), Layout::cp(CpKind::Ulysses, 2), Layout::two_d(2, 2)] {
        let run = run_packed(&full, &ids, std::slice::from_ref(&docs), layout)?;
        let dl = max_diff(&run.0, &single.0);
        let (gr, worst) = grad_rel(&run.2, &single.2)?;
        let dloss = (run.1 - single.1).abs();
        println!("packed window {WP} {layout}: logits {dl:.1e} loss {dloss:.1e} grad {gr:.1e} ({worst}) spread {:.1e}", run.3);
        assert!(dl < 1e-5, "{layout}: logits {dl:.2e}");
        assert!(dloss < 5e-6, "{layout}: loss {} vs {}", run.1, single.1);
        assert!(gr < 5e-5, "{layout}: grad rel {gr:.2e} ({worst})");
        assert!(run.3 < 1e-5, "{layout}: ranks disagree by {:.2e}", run.3);
    }
    Ok(())
}
