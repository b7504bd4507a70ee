//! Seeded random configurations through every context-parallel attention, outputs and
//! gradients against the dense single-device reference (plain candle ops).
//!
//! The fixed tests (`packed_attention.rs`, `window_attention.rs`, `cp_oracle.rs`) pin chosen
//! shapes; this one draws many small ones so that the less travelled corners are covered too:
//! document boundaries anywhere (length-1 documents, one document per shard, boundaries on
//! chunk edges), windows of 1 key up to more than `T`, full and causal masks, GQA ratios,
//! degrees 2..4 on every layout, odd `block_rows`, different documents per batch row, Ulysses
//! with fewer KV heads than the degree, and the 2-D Ulysses x ring split (both half the time with
//! the head layout regathered in the backward; half the Ulysses ones, and then the
//! single-device op, with the backward's row sums from the f32 output, half the ring and
//! all-gather ones from the returned output; a third of all with Gemma 2's logit soft cap).
//! Every configuration that the methods accept must match
//! the reference within `AttnTol::for_sigma(1)`; the ones they refuse must be refused for a
//! reason the configuration explains (a length the layout cannot split, a window without the
//! causal mask, heads that do not split), never with a panic.

use candle_core::{Result, Tensor};
use candle_cp_ops::attention::{attention_band_sinks, attention_band_sinks_slow, attention_docs_mask_slow, attention_docs_mask_with, Band, Mask, RowSums, Scores, Sinks};
use candle_cp_ops::cp::{run_case_cp_with, CpMethod, CpOpts, Layout};
use candle_cp_ops::oracle::AttnTol;
use candle_cp_ops::packing::Documents;
use candle_cp_ops::ulysses::{HeadLayout, UlyssesOpts};
use candle_cp_ops::usp::{run_case_ulysses_opts, run_case_usp_opts, UspOpts};
use candle_cp_tests::draws::{doc_lengths, pick, random_case, rng, seeds};
use candle_cp_tests::{assert_attn_close as check, fwd_bwd};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(60);
const CONFIGS: u64 = 400;

#[derive(Debug)]
enum Method {
    Cp(CpMethod),
    Ulysses(Layout),
    Usp { u: usize, r: usize },
}

#[test]
fn random_configurations_match_the_dense_reference() -> Result<()> {
    let tol = AttnTol::for_sigma(1.0);
    let (mut checked, mut refused) = (0, 0);
    // corners that the checked configurations must have reached
    let (mut len_one, mut one_doc, mut windowed, mut full, mut ulysses, mut usp, mut allgather, mut per_row) = (0, 0, 0, 0, 0, 0, 0, 0);
    let (mut regathered, mut f32_rows, mut out_rows, mut capped, mut sunk) = (0, 0, 0, 0, 0);
    let range = seeds(CONFIGS)?;
    let n_configs = range.end - range.start;
    // (the corners are asserted for draws at least as many as the suite's)
    let corners = n_configs >= CONFIGS;
    for seed in range {
        let mut d = rng(seed);
        let b = pick(&mut d, &[1, 2]);
        let t = pick(&mut d, &[8, 12, 16, 24, 32, 40, 48]);
        let hkv = pick(&mut d, &[1, 2]);
        let h = hkv * pick(&mut d, &[1, 2, 4]);
        let hd = pick(&mut d, &[4, 8]);
        let causal = d.below(4) != 0;
        let window = (causal && d.below(3) == 0).then(|| 1 + d.below(t + 4));
        let lens = doc_lengths(&mut d, t);
        let docs = Documents::from_lengths(&lens)?;
        // sometimes each batch row has its own documents (ring / all-gather only)
        let row_lens = (b == 2 && d.below(3) == 0).then(|| doc_lengths(&mut d, t));
        let p = pick(&mut d, &[2, 3, 4]);
        let layout = pick(&mut d, &[Layout::Contiguous, Layout::Zigzag, Layout::Striped]);
        let method = match d.below(6) {
            0 => Method::Ulysses(layout),
            1 => Method::Usp { u: 2, r: pick(&mut d, &[1, 2]) },
            2 => Method::Cp(CpMethod::AllGather(layout)),
            _ => Method::Cp(CpMethod::Ring(layout)),
        };
        let block_rows = pick(&mut d, &[0, 3, 5, 7]);
        // Ulysses / 2-D: half of them regather the head layout in the backward (a stream of
        // its own, so the other draws of every seed stay what they were)
        let uly = matches!(method, Method::Ulysses(_) | Method::Usp { .. });
        let heads = if uly && rng(700_000 + seed).below(2) == 0 { HeadLayout::Regathered } else { HeadLayout::Kept };
        // Ulysses: half of them take the backward's row sums from the f32 output (own stream;
        // f32 inputs: the same values through the attached raw forward and backward), and then
        // the single-device op does too
        let row_sums = match method {
            Method::Ulysses(_) if rng(710_000 + seed).below(2) == 0 => RowSums::F32,
            Method::Ulysses(_) => RowSums::Output,
            // ring / all-gather: half of them from the returned output (no residual kept)
            _ if rng(710_000 + seed).below(2) == 0 => RowSums::Output,
            _ => RowSums::F32,
        };
        // a third of them with a logit soft cap (own stream), small enough to bend the logits
        let softcap = (rng(720_000 + seed).below(3) == 0).then(|| pick(&mut rng(730_000 + seed), &[0.5, 1.0, 2.5]));
        // a quarter of them with attention sinks around ln T (gpt-oss; own stream)
        let sinks = match rng(740_000 + seed).below(4) == 0 {
            true => Some(Sinks::new(&(candle_cp_ops::oracle::randn(750_000 + seed, &[h], 1.5)? + (t as f64).ln())?)?),
            false => None,
        };
        let ranks = match method {
            Method::Usp { u, r } => format!("U {u} x R {r} ranks"),
            _ => format!("P {p}"),
        };
        let what = format!(
            "config {seed}: {method:?} {ranks}{}{}, B {b} T {t} H {h} Hkv {hkv} D {hd}, causal {causal}, window {window:?}, documents {lens:?} (row 1: {row_lens:?}), block_rows {block_rows}, softcap {softcap:?}, sinks {}",
            if heads == HeadLayout::Regathered { " heads regathered" } else { "" },
            match (&method, row_sums) {
                (Method::Ulysses(_), RowSums::F32) => " f32 row sums",
                (Method::Cp(_), RowSums::Output) => " output row sums",
                _ => "",
            },
            sinks.is_some()
        );

        let mut case = random_case(what.clone(), seed, [b, t, h, hkv, hd], causal, Ok)?;
        let scores = Scores::new(case.scale).with_softcap(softcap);
        let mask = match window {
            Some(w) => Mask::sliding_window(w),
            None if causal => Mask::causal(),
            None => Mask::Full,
        };
        let rows: Vec<Documents> = match &row_lens {
            Some(second) => vec![docs.clone(), Documents::from_lengths(second)?],
            None => vec![docs.clone(); b],
        };
        // the reference: each batch row with its own documents, rows concatenated
        case.reference = fwd_bwd(&case, &|q, k, v| {
            let mut outs = vec![];
            let mut lses = vec![];
            for (i, row_docs) in rows.iter().enumerate() {
                let r = |x: &Tensor| x.narrow(0, i, 1);
                let (o, l) = match &sinks {
                    // with sinks: the row's documents, mask and window as one band
                    Some(z) => attention_band_sinks_slow(&r(q)?, &r(k)?, &r(v)?, z.tensor(), &Band::documents(t, std::slice::from_ref(row_docs), causal, window)?, scores)?,
                    None => attention_docs_mask_slow(&r(q)?, &r(k)?, &r(v)?, row_docs, &mask, scores)?,
                };
                outs.push(o);
                lses.push(l);
            }
            Ok((Tensor::cat(&outs, 0)?, Tensor::cat(&lses, 0)?))
        })?;

        let run = match method {
            Method::Cp(m) => {
                let opts = CpOpts { block_rows, ..CpOpts::default() }.with_row_sums(row_sums).with_softcap(softcap).with_sinks(sinks.clone());
                let mut opts = match row_lens {
                    Some(_) => opts.with_row_documents(rows.clone()),
                    None => opts.with_documents(docs.clone()),
                };
                if let Some(w) = window {
                    opts = opts.with_window(w);
                }
                run_case_cp_with(&case, m, p, TIMEOUT, opts)
            }
            Method::Ulysses(_) | Method::Usp { .. } if row_lens.is_some() => continue,
            Method::Ulysses(l) => {
                let o = UlyssesOpts { documents: Some(docs.clone()), window, ..UlyssesOpts::new(case.causal, case.scale).with_softcap(softcap) };
                if row_sums == RowSums::F32 {
                    let single = fwd_bwd(&case, &|q, k, v| match &sinks {
                        Some(z) => attention_band_sinks(q, k, v, z, &Band::documents(t, std::slice::from_ref(&docs), causal, window)?, scores, RowSums::F32),
                        None => attention_docs_mask_with(q, k, v, &docs, &mask, scores, RowSums::F32),
                    })?;
                    check(&single, &case.reference, &tol, &format!("{what}, single-device op with f32 row sums"))?;
                }
                run_case_ulysses_opts(&case, p, l, TIMEOUT, o.with_head_layout(heads).with_row_sums(row_sums).with_sinks(sinks.clone()))
            }
            Method::Usp { u, r } => {
                let o = UspOpts { documents: Some(docs.clone()), window, ..UspOpts::new(case.causal, case.scale).with_softcap(softcap) };
                run_case_usp_opts(&case, u, r, TIMEOUT, o.with_head_layout(heads).with_sinks(sinks.clone()))
            }
        };
        match run {
            Ok(run) => {
                check(&run.outputs, &case.reference, &tol, &what)?;
                checked += 1;
                len_one += lens.contains(&1) as usize;
                one_doc += (lens.len() == 1) as usize;
                windowed += window.is_some() as usize;
                full += !causal as usize;
                ulysses += matches!(method, Method::Ulysses(_)) as usize;
                usp += matches!(method, Method::Usp { .. }) as usize;
                allgather += matches!(method, Method::Cp(CpMethod::AllGather(_))) as usize;
                per_row += row_lens.is_some() as usize;
                regathered += (heads == HeadLayout::Regathered) as usize;
                f32_rows += matches!(method, Method::Ulysses(_) if row_sums == RowSums::F32) as usize;
                out_rows += matches!(method, Method::Cp(_) if row_sums == RowSums::Output) as usize;
                capped += softcap.is_some() as usize;
                sunk += sinks.is_some() as usize;
            }
            Err(e) => {
                let msg = e.to_string();
                let explained = ["not divisible", "must divide"].iter().any(|k| msg.contains(k));
                assert!(explained && !msg.contains("panicked"), "{what}: refused for an unexpected reason: {msg}");
                refused += 1;
            }
        }
    }
    // the draws must mostly produce configurations the methods accept
    println!(
        "{checked} configurations checked, {refused} refused; length-1 documents {len_one}, one document {one_doc}, window {windowed}, full mask {full}, ulysses {ulysses}, 2-D {usp}, all-gather {allgather}, documents per row {per_row}, heads regathered {regathered}, f32 row sums {f32_rows}, ring / all-gather with output row sums {out_rows}, soft cap {capped}, sinks {sunk}"
    );
    assert!(checked >= n_configs as usize / 2, "only {checked} of {n_configs} configurations ran ({refused} refused)");
    for (corner, n) in [("length-1 documents", len_one), ("one document", one_doc), ("window", windowed), ("full mask", full), ("ulysses", ulysses), ("2-D", usp), ("all-gather", allgather), ("documents per row", per_row), ("heads regathered", regathered), ("f32 row sums", f32_rows), ("output row sums", out_rows), ("soft cap", capped), ("sinks", sunk)] {
        assert!(!corners || n >= 3, "only {n} checked configurations with {corner}");
    }
    Ok(())
}
