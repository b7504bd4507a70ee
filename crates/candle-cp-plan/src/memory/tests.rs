//! Tests of [`super`] (the activation and model-state counts).
use super::*;
use crate::layout::CpKind;
use crate::GB;

const S: usize = 131072;

fn m405() -> ModelConfig {
    ModelConfig::preset("llama3-405b").unwrap()
}

fn close(x: f64, want: f64, rel: f64) {
    assert!((x - want).abs() <= rel * want.abs(), "got {x}, want {want}");
}

#[test]
fn korthikanti_405b_128k() {
    let m = m405();
    let sbh = (S * 16384) as f64;
    // 34·s·h = 34·2^31 bytes = 73.0 GB with flash attention.
    assert_eq!(korthikanti_layer_bytes(&m, S, 1, 2, true), 34.0 * sbh);
    close(korthikanti_layer_bytes(&m, S, 1, 2, true) / GB, 73.0, 1e-3);
    // Without flash: + 5·a·s²·b = 11.0 TB.
    let scores = korthikanti_layer_bytes(&m, S, 1, 2, false) - 34.0 * sbh;
    assert_eq!(scores, 5.0 * 128.0 * (S as f64).powi(2));
    close(scores / 1e12, 11.0, 1e-2);
    // fp32: 16·4 + 2 = 66 per sbh.
    assert_eq!(korthikanti_layer_bytes(&m, S, 1, 4, true), 66.0 * sbh);
    // micro-batch scales linearly.
    assert_eq!(korthikanti_layer_bytes(&m, S, 2, 2, true), 68.0 * sbh);
}

#[test]
fn korthikanti_table2_under_tp_sp_cp() {
    let m = m405();
    let sbh = (S * 16384) as f64;
    let tp8 = Layout {
        tp: 8,
        ..Layout::default()
    };
    // TP without SP: sbh·(10 + 24/t).
    assert_eq!(
        korthikanti_per_gpu(&m, &tp8, S, 1, 2, Recompute::None),
        sbh * (10.0 + 3.0)
    );
    let tp8sp = Layout {
        sp: true,
        ..tp8.clone()
    };
    let v = korthikanti_per_gpu(&m, &tp8sp, S, 1, 2, Recompute::None);
    assert_eq!(v, 34.0 * sbh / 8.0);
    close(v / GB, 9.13, 1e-3);
    let cp16 = Layout {
        cp: 16,
        ..tp8sp.clone()
    };
    let v = korthikanti_per_gpu(&m, &cp16, S, 1, 2, Recompute::None);
    close(v / GB, 0.570, 1e-3);
    // Full recompute keeps 2·c·b·h/t.
    assert_eq!(
        korthikanti_per_gpu(&m, &cp16, S, 1, 2, Recompute::Full),
        2.0 * sbh / 128.0
    );
    // Without flash, selective drops exactly the score term 5·a·c·s·b/t.
    let nf = Layout {
        flash: false,
        ..cp16
    };
    let none = korthikanti_per_gpu(&m, &nf, S, 1, 2, Recompute::None);
    let sel = korthikanti_per_gpu(&m, &nf, S, 1, 2, Recompute::Selective);
    assert_eq!(sel, v);
    assert_eq!(none - sel, 5.0 * 128.0 * 8192.0 * S as f64 / 8.0);
}

/// The candle-cp count at 405B, 128k, TP 8 + SP + CP 16 (ring, bf16): the Llama count plus
/// the lse (16 heads per TP rank), the norms' statistics (over 8 with SP) and the ring's bf16
/// residual; f32 drops the residual, Ulysses 16 adds q, k, v and out in the head layout, and
/// full recompute adds nothing; f32 row sums add the residual to Ulysses and one device, and
/// output row sums take it from the ring kinds and 2-D. `ActivationModel::parse` knows the model.
#[test]
fn candle_cp_count_at_405b() {
    let m = m405();
    let l = Layout { tp: 8, sp: true, cp: 16, ..Layout::default() };
    let c = (S / 16) as f64;
    let llama = llama_per_gpu(&m, &l, S, 1, 2, Recompute::None);
    let (lse, norms, residual) = (4.0 * 16.0 * c, 8.0 * c / 8.0, 2.0 * 16.0 * 128.0 * c);
    assert_eq!(candle_cp_per_gpu(&m, &l, S, 1, 2, Recompute::None), llama + lse + norms + residual);
    close(candle_cp_per_gpu(&m, &l, S, 1, 2, Recompute::None) / GB, 0.567, 1e-3);
    assert_eq!(candle_cp_extra_per_gpu(&m, &l, S, 1, 4, Recompute::None), lse + norms);
    let u = Layout { cp_kind: CpKind::Ulysses, ulysses: 16, ..l.clone() };
    // 1 KV head per TP rank < 16: replicated, each Ulysses rank holds it for 16·c tokens
    let head = c * 2.0 * (2.0 * 16.0 * 128.0 + 2.0 * 16.0 * 128.0);
    assert_eq!(candle_cp_extra_per_gpu(&m, &u, S, 1, 2, Recompute::None), lse + norms + head);
    // regathered in the backward: Ulysses keeps no head layout; 2-D keeps the ring's residual
    let ur = Layout { regather_heads: true, ..u.clone() };
    assert_eq!(candle_cp_extra_per_gpu(&m, &ur, S, 1, 2, Recompute::None), lse + norms);
    let two_d = Layout { cp_kind: CpKind::TwoD, ulysses: 8, ..l.clone() };
    let two_d_re = Layout { regather_heads: true, ..two_d.clone() };
    assert!(candle_cp_extra_per_gpu(&m, &two_d, S, 1, 2, Recompute::None) > lse + norms + residual);
    assert_eq!(candle_cp_extra_per_gpu(&m, &two_d_re, S, 1, 2, Recompute::None), lse + norms + residual);
    assert_eq!(candle_cp_extra_per_gpu(&m, &two_d_re, S, 1, 4, Recompute::None), lse + norms);
    // ignored by the ring kinds
    assert_eq!(candle_cp_per_gpu(&m, &Layout { regather_heads: true, ..l.clone() }, S, 1, 2, Recompute::None), llama + lse + norms + residual);
    assert_eq!(candle_cp_extra_per_gpu(&m, &l, S, 1, 2, Recompute::Full), 0.0);
    // f32 row sums: Ulysses (kept or regathered) and one device keep the residual in 16 bits;
    // the ring kinds and 2-D have it by default and drop it with output row sums; f32
    // activations keep none
    let rs = |l: &Layout, f32_rows| Layout { f32_row_sums: Some(f32_rows), ..l.clone() };
    let extra = |l: &Layout, e| candle_cp_extra_per_gpu(&m, l, S, 1, e, Recompute::None);
    for x in [&u, &ur] {
        assert_eq!(extra(&rs(x, true), 2), extra(x, 2) + residual);
        assert_eq!(extra(&rs(x, false), 2), extra(x, 2));
        assert_eq!(extra(&rs(x, true), 4), extra(x, 4));
    }
    for x in [&l, &two_d, &two_d_re] {
        assert_eq!(extra(&rs(x, true), 2), extra(x, 2));
        assert_eq!(extra(&rs(x, false), 2), extra(x, 2) - residual);
        assert_eq!(extra(&rs(x, false), 4), extra(x, 4));
    }
    assert_eq!(extra(&rs(&l, false), 2), lse + norms);
    assert_eq!(extra(&rs(&two_d_re, false), 2), lse + norms);
    let tp_only = Layout { cp: 1, ..l.clone() };
    let c1 = S as f64; // one device holds every token
    assert_eq!(extra(&rs(&tp_only, true), 2), extra(&tp_only, 2) + 2.0 * 16.0 * 128.0 * c1);
    assert_eq!(extra(&rs(&tp_only, true), 2), 4.0 * 16.0 * c1 + 8.0 * c1 / 8.0 + 2.0 * 16.0 * 128.0 * c1);
    assert_eq!(crate::ActivationModel::parse("candle-cp").unwrap(), crate::ActivationModel::CandleCp);
    assert!(crate::ActivationModel::parse("cp").unwrap_err().to_string().contains("candle-cp"));
}

#[test]
fn llama_exact_count() {
    let m = m405();
    let sbh = (S * 16384) as f64;
    // 12 + 4·a_kv/a + 6·f/h = 12 + 0.25 + 19.5 = 31.75 (·sbh), 68.2 GB.
    let v = llama_layer_bytes(&m, S, 1, 2, true);
    assert_eq!(v, 31.75 * sbh);
    close(v / GB, 68.2, 1e-3);
    // TP8+SP: everything over 8 (8 KV heads: one per rank).
    let l = Layout {
        tp: 8,
        sp: true,
        ..Layout::default()
    };
    assert_eq!(
        llama_per_gpu(&m, &l, S, 1, 2, Recompute::None),
        31.75 * sbh / 8.0
    );
    // TP16: KV replicated (1 head per rank, not 0.5): K,V term is 2·c·d·e instead of /16.
    let l16 = Layout {
        tp: 16,
        sp: true,
        ..Layout::default()
    };
    let want = 31.75 * sbh / 16.0 + (S * 2 * 2 * 128) as f64 * (1.0 - 0.5);
    assert_eq!(llama_per_gpu(&m, &l16, S, 1, 2, Recompute::None), want);
    // Without SP the 4h replicated term stays whole: (8 + (31.75 - 8)/8)·sbh.
    let nsp = Layout {
        tp: 8,
        ..Layout::default()
    };
    assert_eq!(
        llama_per_gpu(&m, &nsp, S, 1, 2, Recompute::None),
        (8.0 + 23.75 / 8.0) * sbh
    );
    // 8B: 12 + 4·8/32 + 6·14336/4096 = 34.0.
    let m8 = ModelConfig::preset("llama3-8b").unwrap();
    assert_eq!(
        llama_layer_bytes(&m8, 8192, 1, 2, true),
        34.0 * (8192 * 4096) as f64
    );
}

#[test]
fn model_states_zero_stages() {
    let m = m405();
    let l = Layout {
        tp: 8,
        pp: 16,
        cp: 16,
        dp: 8,
        zero: 0,
        ..Layout::default()
    };
    let p = params_per_gpu(&m, &l);
    // 8 layers (ceil 126/16) of 1/8 matrices + norms, plus the 1/8 vocab matrix + final norm.
    let layer = (m.layer_matrix_params() / 8 + 2 * 16384) as f64;
    assert_eq!(p, 8.0 * layer + (128256 * 16384 / 8) as f64 + 16384.0);
    let z0 = model_states(&m, &l, 2);
    assert_eq!(z0.total, 16.0 * p);
    let z1 = model_states(
        &m,
        &Layout {
            zero: 1,
            ..l.clone()
        },
        2,
    );
    assert_eq!(
        (z1.weights, z1.grads, z1.optimizer),
        (2.0 * p, 2.0 * p, 12.0 * p / 128.0)
    );
    let z2 = model_states(
        &m,
        &Layout {
            zero: 2,
            ..l.clone()
        },
        2,
    );
    assert_eq!(z2.grads, 2.0 * p / 128.0);
    let z3 = model_states(
        &m,
        &Layout {
            zero: 3,
            ..l.clone()
        },
        2,
    );
    // + the working copies: two layers' weights and one layer's gradients, in bf16
    assert_eq!(z3.zero3_gathered, 3.0 * 2.0 * layer);
    assert_eq!(z3.total, 16.0 * p / 128.0 + 6.0 * layer);
    assert_eq!(z1.zero3_gathered, 0.0);
    let f32s = model_states(&m, &Layout { zero: 0, ..l }, 4);
    assert_eq!(f32s.total, 16.0 * p);
    // Unsharded, no parallelism: 16 bytes per parameter of the whole model.
    let all = model_states(
        &m,
        &Layout {
            zero: 0,
            ..Layout::default()
        },
        2,
    );
    assert_eq!(all.total, 16.0 * m.total_params() as f64);
}

#[test]
fn activation_totals_pipeline_and_recompute() {
    let m = m405();
    let l = Layout {
        tp: 8,
        sp: true,
        cp: 16,
        ..Layout::default()
    };
    let a = activation_totals(ActivationModel::Korthikanti, &m, &l, S, 1, 2, 1);
    let per = 34.0 * (S * 16384) as f64 / 128.0;
    assert_eq!(a.layers, 126.0 * per);
    assert_eq!(a.logits, 8192.0 * 128256.0 / 8.0 * 4.0);
    assert_eq!(a.total, a.layers + a.logits);
    // 1F1B with pp = 16: first stage holds 16 micro-batches of 8 layers.
    let lp = Layout {
        pp: 16,
        ..l.clone()
    };
    let a = activation_totals(ActivationModel::Korthikanti, &m, &lp, S, 1, 2, 16);
    assert_eq!(a.total, 16.0 * 8.0 * per);
    // fewer micro-batches than stages: only those are in flight (the last stage, with
    // one micro-batch plus the logits, is then the busier for k = 1)
    let a = activation_totals(ActivationModel::Korthikanti, &m, &lp, S, 1, 2, 4);
    assert_eq!((a.in_flight_microbatches, a.total), (4, 4.0 * 8.0 * per));
    let a = activation_totals(ActivationModel::Korthikanti, &m, &lp, S, 1, 2, 1);
    assert_eq!(a.total, 8.0 * per + a.logits);
    // interleaved, v = 2: 2 chunks of ceil(126/32) = 4 layers, and 1 + 15/32 times the
    // activations in flight
    let lv = Layout { virtual_stages: 2, ..lp.clone() };
    assert_eq!(layers_per_stage(&m, &lv), 8);
    let a = activation_totals(ActivationModel::Korthikanti, &m, &lv, S, 1, 2, 16);
    assert_eq!(a.total, 16.0 * 8.0 * per * (1.0 + 15.0 / 32.0));
    // v = 4: 4 chunks of ceil(126/64) = 2 layers; v = 3: 3 chunks of ceil(126/48) = 3 = 9
    assert_eq!(layers_per_stage(&m, &Layout { virtual_stages: 4, ..lp.clone() }), 8);
    assert_eq!(layers_per_stage(&m, &Layout { virtual_stages: 3, ..lp.clone() }), 9);
    let lf = Layout {
        recompute: Recompute::Full,
        cp_kind: CpKind::Ring,
        ..l
    };
    let a = activation_totals(ActivationModel::Korthikanti, &m, &lf, S, 1, 2, 1);
    assert_eq!(a.total, 126.0 * per * 2.0 / 34.0 + per + a.logits);
}
