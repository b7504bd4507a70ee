use super::*;
use candle_core::{Device, Var};
use candle_cp_ops::oracle::randn;

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// values and gradients (w.r.t. x and W) equal the full-logits reference, for chunks of
/// 1, 3 and all rows, with ignored labels, f32 and bf16, with and without a soft cap
#[test]
fn token_nll_matches_slow() -> Result<()> {
    let (n, h, v) = (7, 6, 11);
    let labels = Tensor::new(&[3u32, IGNORE, 0, 10, IGNORE, 5, 5], &Device::Cpu)?;
    for ((dt, tol), cap) in [(DType::F32, 2e-6f32), (DType::BF16, 2e-2)].into_iter().flat_map(|d| [(d, None), (d, Some(1.5))]) {
        let x = Var::from_tensor(&randn(1, &[n, h], 1.0)?.to_dtype(dt)?)?;
        let w = Var::from_tensor(&randn(2, &[v, h], 0.7)?.to_dtype(dt)?)?;
        let dy = randn(3, &[n], 1.0)?;
        let want = token_nll_slow(x.as_tensor(), w.as_tensor(), &labels, cap)?;
        if cap.is_some() {
            // the cap changes the loss at these logits
            let plain = token_nll_slow(x.as_tensor(), w.as_tensor(), &labels, None)?;
            assert!(max_diff(&plain, &want)? > 0.1, "the cap does not bend these logits");
        }
        let gw = (&want * &dy)?.sum_all()?.backward()?;
        for chunk in [1, 3, 64] {
            let got = token_nll(x.as_tensor(), w.as_tensor(), &labels, chunk, cap)?;
            assert_eq!(got.dims(), [n]);
            let d = max_diff(&got, &want)?;
            assert!(d <= tol, "{dt:?} cap {cap:?} chunk {chunk}: values differ by {d}");
            let g = (&got * &dy)?.sum_all()?.backward()?;
            for (name, t) in [("dx", x.as_tensor()), ("dW", w.as_tensor())] {
                let d = max_diff(g.get(t).expect("grad"), gw.get(t).expect("grad"))?;
                assert!(d <= tol * 4.0, "{dt:?} cap {cap:?} chunk {chunk}: {name} differs by {d}");
            }
        }
        // ignored rows are exactly zero
        let got = token_nll(x.as_tensor(), w.as_tensor(), &labels, 2, cap)?.to_vec1::<f32>()?;
        assert_eq!((got[1], got[4]), (0.0, 0.0));
    }
    Ok(())
}

/// The vocabulary-parallel loss over 2 and 4 ranks, with own rows (SP) and without,
/// chunks of 1 and all rows, for vocabularies of 12 (split evenly), 10 (padded: 3 rows per
/// rank) and 5 (over 4 ranks: the last rank holds padding only): values equal the
/// full-logits reference, and the input and head gradients (input partials summed over the
/// ranks, head slices, zero on padding) equal its gradients.
#[test]
fn vocab_parallel_matches_slow() -> Result<()> {
    for v in [12usize, 10, 5] {
        vocab_parallel_matches_slow_of(v, None)?;
    }
    vocab_parallel_matches_slow_of(10, Some(1.5))
}

fn vocab_parallel_matches_slow_of(v: usize, cap: Option<f64>) -> Result<()> {
    let (b, tc, h) = (2usize, 4usize, 5usize);
    let lab = [[3u32, IGNORE, 0, 11], [7, 7, IGNORE, 5]].map(|r| r.map(|l| if l == IGNORE { l } else { l % v as u32 }));
    let labels = Tensor::new(&lab, &Device::Cpu)?;
    let x = Var::from_tensor(&randn(1, &[b, tc, h], 1.0)?)?;
    let w = Var::from_tensor(&randn(2, &[v, h], 0.7)?)?;
    let dy = randn(3, &[b, tc], 1.0)?;
    let want = token_nll_slow(&x.as_tensor().reshape((b * tc, h))?, w.as_tensor(), &labels.flatten_all()?, cap)?.reshape((b, tc))?;
    let gw = (&want * &dy)?.sum_all()?.backward()?;
    let (gx_want, gw_want) = (gw.get(x.as_tensor()).cloned().expect("dx"), gw.get(w.as_tensor()).cloned().expect("dW"));
    let shard = candle_cp_nn::Shard::RowsPadded(v);
    for p in [2usize, 4] {
        for own in [false, true] {
            for chunk in [1usize, 64] {
                let res = candle_cp_comm::run_ranks(p, |g| {
                    let r = g.rank();
                    let wl = Var::from_tensor(&shard.slice(w.as_tensor(), p, r)?)?;
                    let xr = Var::from_tensor(x.as_tensor())?;
                    let got = token_nll_vocab_parallel(xr.as_tensor(), wl.as_tensor(), &labels, v, chunk, &g, own, cap)?;
                    let ts = if own { tc / p } else { tc };
                    let (want_l, dy_l) = if own {
                        (want.narrow(1, r * ts, ts)?, dy.narrow(1, r * ts, ts)?)
                    } else {
                        (want.clone(), dy.clone())
                    };
                    let e = max_diff(&got, &want_l)?;
                    let gr = (&got * &dy_l)?.sum_all()?.backward()?;
                    // each rank's input gradient is the part through its vocabulary
                    // slice: they add up to the whole (the model's gather / copy to the TP
                    // region sums them in backward); its head slice's gradient is complete
                    let gx = g.all_reduce(gr.get(xr.as_tensor()).expect("dx"))?;
                    let ex = max_diff(&gx, &gx_want)?;
                    let gwl = gr.get(wl.as_tensor()).expect("dW").clone();
                    let ew = max_diff(&gwl, &shard.slice(&gw_want, p, r)?)?;
                    Ok((e, ex, ew))
                });
                for res in res {
                    let (e, ex, ew) = res?;
                    assert!(e < 2e-6 && ex < 1e-5 && ew < 1e-5, "V {v} P {p} own {own} chunk {chunk} cap {cap:?}: values {e} dx {ex} dW {ew}");
                }
            }
        }
    }
    Ok(())
}

#[test]
fn no_valid_label_and_bad_input() -> Result<()> {
    let x = Var::from_tensor(&randn(1, &[3, 4], 1.0)?)?;
    let w = Var::from_tensor(&randn(2, &[5, 4], 1.0)?)?;
    let none = Tensor::new(&[IGNORE; 3], &Device::Cpu)?;
    let z = token_nll(x.as_tensor(), w.as_tensor(), &none, 4, None)?;
    assert_eq!(z.to_vec1::<f32>()?, vec![0.0; 3]);
    let g = z.sum_all()?.backward()?;
    assert_eq!(max_diff(g.get(x.as_tensor()).expect("still in the graph"), &Tensor::zeros((3, 4), DType::F32, &Device::Cpu)?)?, 0.0);
    let out_of_vocab = Tensor::new(&[1u32, 5, 0], &Device::Cpu)?;
    let e = token_nll(x.as_tensor(), w.as_tensor(), &out_of_vocab, 4, None).unwrap_err().to_string();
    assert!(e.contains("label 5 out of range for vocab 5"), "{e}");
    let short = Tensor::new(&[1u32, 2], &Device::Cpu)?;
    let e = token_nll(x.as_tensor(), w.as_tensor(), &short, 4, None).unwrap_err().to_string();
    assert!(e.contains("[3, 4]") && e.contains("[2]"), "{e}");
    for bad in [0.0, -1.0, f64::NAN] {
        let e = token_nll(x.as_tensor(), w.as_tensor(), &out_of_vocab.narrow(0, 0, 1)?.repeat(3)?, 4, Some(bad)).unwrap_err().to_string();
        assert!(e.contains("soft cap"), "{e}");
    }
    Ok(())
}

/// The statistics beside the losses equal the full logits' (capped or not, 0 on ignored rows):
/// WPO's `log Σ_v p_v² = logsumexp(2 · log_softmax(l))` and the entropy `−Σ_v p_v·log p_v`,
/// from [`token_nll_stat`] in chunks of 1 and all rows and from
/// [`token_nll_vocab_parallel_stat`] over 2 and 4 ranks (vocabularies of 12 and 5: a rank of
/// padding only), own rows or not; the losses beside them are [`token_nll`]'s.
#[test]
fn softmax_statistics_match_the_logits() -> Result<()> {
    let (b, tc, h) = (2usize, 4usize, 5usize);
    for stat in [HeadStat::SumSq, HeadStat::Entropy] {
        for (v, cap) in [(12usize, None), (5, None), (10, Some(1.5))] {
            let lab = [[3u32, IGNORE, 0, 11], [7, 7, IGNORE, 5]].map(|r| r.map(|l| if l == IGNORE { l } else { l % v as u32 }));
            let labels = Tensor::new(&lab, &Device::Cpu)?.flatten_all()?;
            let x = randn(1, &[b * tc, h], 1.0)?;
            let w = randn(2, &[v, h], 2.0)?;
            let logits = x.matmul(&w.t()?)?;
            let logits = match cap {
                Some(c) => cap_logits(&logits, c)?,
                None => logits,
            };
            let lsm = candle_nn::ops::log_softmax(&logits, 1)?;
            let keep: Vec<f32> = lab.iter().flatten().map(|&l| (l != IGNORE) as u8 as f32).collect();
            let full = match stat {
                HeadStat::SumSq => logsumexp_keepdim(&(lsm * 2.0)?, 1)?,
                HeadStat::Entropy => (lsm.exp()? * &lsm)?.sum_keepdim(1)?.neg()?,
            };
            let want = (full.reshape(b * tc)? * Tensor::new(keep, &Device::Cpu)?)?;
            // (the entropy `lse − Σ p·l` cancels logits of ~10: f32's 1e-6 of them)
            let tol = if stat == HeadStat::Entropy { 2e-5 } else { 2e-6 };
            for chunk in [1, 64] {
                let (nll, st) = token_nll_stat(&x, &w, &labels, chunk, cap, stat)?;
                let e = max_diff(&st, &want)?;
                assert!(e < tol && max_diff(&nll, &token_nll(&x, &w, &labels, chunk, cap)?)? == 0.0, "{stat:?} V {v} chunk {chunk}: {e}");
            }
            match stat {
                HeadStat::SumSq => assert!(want.to_vec1::<f32>()?.iter().any(|&q| q < -0.5), "a spread distribution somewhere"),
                HeadStat::Entropy => assert!(want.to_vec1::<f32>()?.iter().any(|&q| q > 0.5), "a spread distribution somewhere"),
            }
            for p in [2usize, 4] {
                for own in [false, true] {
                    let res = candle_cp_comm::run_ranks(p, |g| {
                        let wl = candle_cp_nn::Shard::RowsPadded(v).slice(&w, p, g.rank())?;
                        let x3 = x.reshape((b, tc, h))?;
                        let labels2 = labels.reshape((b, tc))?;
                        let (nll, st) = token_nll_vocab_parallel_stat(&x3, &wl, &labels2, v, 3, &g, (own, cap), stat)?;
                        let plain = token_nll_vocab_parallel(&x3, &wl, &labels2, v, 3, &g, own, cap)?;
                        let ts = if own { tc / p } else { tc };
                        let want = want.reshape((b, tc))?.narrow(1, if own { g.rank() * ts } else { 0 }, ts)?;
                        Ok((max_diff(&st, &want)?, max_diff(&nll, &plain)?))
                    });
                    for r in res {
                        let (e, n) = r?;
                        assert!(e < tol && n == 0.0, "{stat:?} V {v} P {p} own {own}: statistic {e}, losses {n}");
                    }
                }
            }
        }
    }
    Ok(())
}
