use super::*;
use crate::layout::CpKind;
use crate::MIB;

const S: usize = 131072;

fn ctx<'a>(m: &'a ModelConfig, l: &'a Layout, hw: &'a Hardware) -> CommCtx<'a> {
    CommCtx {
        model: m,
        layout: l,
        hw,
        seq: S,
        micro_batch: 1,
        elem: 2,
        grad_elem: 2,
        attn_rate: 600e12,
        doc_len: None,
    }
}

#[test]
fn ring_405b_cp16() {
    let m = ModelConfig::preset("llama3-405b").unwrap();
    let hw = Hardware::preset("h100").unwrap();
    let l = Layout {
        cp: 16,
        ..Layout::default()
    };
    let r = ring(&ctx(&m, &l, &hw), 16, 1);
    assert_eq!(r.chunk_tokens, 8192);
    // K+V per token 2·8·128·2 = 4096 B; 8192 tokens: 32 MiB.
    assert_eq!(r.step_bytes, 32.0 * MIB);
    assert_eq!(r.fwd_bytes_per_layer, 480.0 * MIB);
    assert_eq!(r.bwd_bytes_per_layer, 15.0 * 32.0 * MIB + 16.0 * 32.0 * MIB);
    // Half a c×c block: 2·c²·d·a = 2.2 TFLOP.
    assert_eq!(r.step_flops_fwd, 2.0 * 8192f64.powi(2) * 128.0 * 128.0);
    assert!((r.step_flops_fwd / 1e12 - 2.2).abs() < 0.005);
    // c ≥ R/(8·BW): 1500 tokens on IB at 600 TFLOP/s, 167 on NVLink.
    assert!(
        (r.min_chunk_fwd_ib - 1500.0).abs() < 1e-6,
        "{}",
        r.min_chunk_fwd_ib
    );
    assert!((r.min_chunk_fwd_nvlink - 600e12 / (8.0 * 450e9)).abs() < 1e-9);
    assert_eq!(r.link, Link::Ib);
    assert!(r.hides_fwd && r.hides_bwd);
    assert_eq!(r.exposed_s_per_layer, 0.0);
    assert_eq!(r.contiguous_imbalance, 31.0 / 16.0);
    // With TP8: 4 MiB per step, 0.275 TFLOP per step, same minimum chunk.
    let l8 = Layout {
        tp: 8,
        cp: 16,
        ..Layout::default()
    };
    let r8 = ring(&ctx(&m, &l8, &hw), 16, 1);
    assert_eq!(r8.step_bytes, 4.0 * MIB);
    assert!((r8.step_flops_fwd / 1e12 - 0.275).abs() < 0.001);
    assert!((r8.min_chunk_fwd_ib - 1500.0).abs() < 1e-6);
    // Chunk 1024 < 1500 on IB: does not hide; exposed = 15·(transfer - compute) fwd.
    let short = CommCtx {
        seq: 16384,
        ..ctx(&m, &l8, &hw)
    };
    let rs = ring(&short, 16, 1);
    assert!(!rs.hides_fwd);
    let fwd_gap = rs.step_transfer_s_fwd - rs.step_compute_s_fwd;
    let bwd_gap = (rs.step_transfer_s_bwd - rs.step_compute_s_bwd).max(0.0);
    assert!((rs.exposed_s_per_layer - 15.0 * (fwd_gap + bwd_gap)).abs() < 1e-15);
    // fp32 dK/dV: backward moves step·(1 + 4/2), min chunk (2+4)/2.5 vs 2.
    let g4 = CommCtx {
        grad_elem: 4,
        ..ctx(&m, &l8, &hw)
    };
    let r4 = ring(&g4, 16, 1);
    assert_eq!(r4.bwd_bytes_per_layer, 15.0 * 4.0 * MIB + 16.0 * 8.0 * MIB);
    assert!((r4.min_chunk_bwd_ib - 1500.0 * 6.0 / 5.0).abs() < 1e-6);
}

#[test]
fn ulysses_and_allgather_bytes() {
    let m = ModelConfig::preset("llama3-405b").unwrap();
    let hw = Hardware::preset("h100").unwrap();
    // TP1, U = 8: (h + h_kv)/(P·h_kv) = 17/8 of the ring's bytes.
    let l = Layout {
        cp: 8,
        cp_kind: CpKind::Ulysses,
        ..Layout::default()
    };
    let u = ulysses(&ctx(&m, &l, &hw), 8);
    assert!(u.valid);
    assert!((u.ratio_vs_ring_fwd - 17.0 / 8.0).abs() < 1e-12);
    let c = (S / 8) as f64;
    assert_eq!(
        u.fwd_bytes_per_layer,
        7.0 / 8.0 * c * 2.0 * 2.0 * (16384.0 + 1024.0)
    );
    assert_eq!(u.link, Link::Nvlink);
    // TP8 leaves 1 KV head per rank: U = 16 replicates it 16 times.
    let l = Layout {
        tp: 8,
        cp: 16,
        cp_kind: CpKind::Ulysses,
        ..Layout::default()
    };
    let u = ulysses(&ctx(&m, &l, &hw), 16);
    assert!(u.valid && u.kv_replication == 16);
    // regathered head layout: the backward sends the forward's bytes once more
    let lr = Layout { regather_heads: true, ..l.clone() };
    let ur = ulysses(&ctx(&m, &lr, &hw), 16);
    assert_eq!(ur.fwd_bytes_per_layer, u.fwd_bytes_per_layer);
    assert_eq!(ur.bwd_bytes_per_layer, u.bwd_bytes_per_layer + u.fwd_bytes_per_layer);
    assert!(ur.exposed_s_per_layer > u.exposed_s_per_layer);
    assert_eq!(
        u.fwd_bytes_per_layer,
        15.0 / 16.0 * 8192.0 * 2.0 * 128.0 * (32.0 + 32.0)
    );
    // Qwen2.5-7B: 28 query / 4 KV heads. U = 7 and 14 neither divide nor are multiples of
    // the 4 KV heads: each is replicated to lcm(4, U) = 28 copies (7 each), 4 or 2 per rank
    let q7 = ModelConfig::preset("qwen2.5-7b").unwrap();
    let lq = Layout { cp: 14, cp_kind: CpKind::Ulysses, ..Layout::default() };
    for (deg, per_rank) in [(7, 4), (14, 2)] {
        let uq = ulysses(&ctx(&q7, &lq, &hw), deg);
        assert!(uq.valid && uq.kv_replication == 7, "{uq:?}");
        assert_eq!(crate::layout::kv_copies_per_ulysses_rank(4, deg), per_rank);
        let frac = (deg - 1) as f64 / deg as f64;
        assert_eq!(uq.fwd_bytes_per_layer, frac * (131072 / 14) as f64 * 2.0 * 128.0 * (2.0 * 28.0 + 2.0 * 28.0));
    }
    assert!(lq.validate(&q7, 14 * 8192).is_ok());
    let bad = ulysses(&ctx(&m, &l, &hw), 32);
    assert!(
        !bad.valid
            && bad
                .constraint
                .contains("does not divide the 16 query heads")
    );
    // All-gather moves what the ring moves, at once.
    let a = allgather(&ctx(&m, &l, &hw));
    assert_eq!(a.fwd_bytes_per_layer, 15.0 * 4.0 * MIB);
    assert_eq!(a.gathered_kv_bytes, S as f64 * 2.0 * 128.0 * 2.0);
    assert_eq!(a.exposed_s_per_layer, 2.0 * 60.0 * MIB / 50e9);
    // TP8 with SP: 4·7/8·c·h·e per direction on NVLink.
    let t = tp(&ctx(&m, &l, &hw));
    assert_eq!(t.fwd_bytes_per_layer, 3.5 * 8192.0 * 16384.0 * 2.0);
    assert_eq!(t.link, Link::Nvlink);
}

#[test]
fn two_d_ring_part() {
    let m = ModelConfig::preset("llama3-405b").unwrap();
    let hw = Hardware::preset("h100").unwrap();
    // TP1, CP16 = Ulysses 8 (NVLink) x ring 2: ring chunk s/2, 16 q heads, 1 kv head.
    let l = Layout {
        cp: 16,
        cp_kind: CpKind::TwoD,
        ulysses: 8,
        ..Layout::default()
    };
    let r = ring(&ctx(&m, &l, &hw), 2, 8);
    assert_eq!((r.chunk_tokens, r.q_heads, r.kv_heads), (65536, 16, 1));
    assert_eq!(r.step_bytes, 65536.0 * 2.0 * 128.0 * 2.0);
    assert_eq!(r.link, Link::Ib);
    assert_eq!(ulysses(&ctx(&m, &l, &hw), 8).link, Link::Nvlink);
}

/// The EP exchange: Qwen3-30B-A3B (every layer sparse, top 8, h 2048) at 128k over CP 8,
/// EP 8 sends `2·7/8·c·K·h·e` = 896 MiB each way per layer, in a node at TP 1 and across
/// nodes at TP 2; nothing with EP 1 or a dense model. The layout refuses EP that divides
/// neither the experts nor dp·cp, and EP on a dense model, by name. ZeRO splits the
/// experts' Adam state over the `dp·cp/ep` ranks holding them.
#[test]
fn ep_bytes_and_refusals() {
    let m = ModelConfig::preset("qwen3-30b-a3b").unwrap();
    let hw = Hardware::preset("h100").unwrap();
    let l = Layout { cp: 8, cp_kind: CpKind::Ring, ep: 8, zero: 0, ..Layout::default() };
    let x = ep(&ctx(&m, &l, &hw));
    assert_eq!(x.fwd_bytes_per_layer, 2.0 * 7.0 / 8.0 * 16384.0 * 8.0 * 2048.0 * 2.0);
    assert_eq!(x.fwd_bytes_per_layer, 896.0 * MIB);
    assert_eq!((x.bwd_bytes_per_layer, x.link), (x.fwd_bytes_per_layer, Link::Nvlink));
    assert_eq!(ep(&ctx(&m, &Layout { tp: 2, ..l.clone() }, &hw)).link, Link::Ib);
    assert_eq!(ep(&ctx(&m, &Layout { ep: 1, ..l.clone() }, &hw)).fwd_bytes_per_layer, 0.0);
    assert!(l.validate(&m, S).is_ok());
    let e = |l: Layout, m: &ModelConfig| format!("{:?}", l.validate(m, S).unwrap_err());
    assert!(e(Layout { ep: 3, cp: 6, ..l.clone() }, &m).contains("does not divide the 128 experts"));
    assert!(e(Layout { ep: 16, ..l.clone() }, &m).contains("does not divide dp·cp = 8"));
    let dense = ModelConfig::preset("llama3-8b").unwrap();
    assert!(e(l.clone(), &dense).contains("needs a mixture of experts"));
    // ZeRO-1 with EP 8 over dp·cp 16: the dense parameters' Adam state over the 16, the
    // experts' over the 2 ranks holding the same experts; with EP 16 whole
    let z = Layout { dp: 2, zero: 1, ..l.clone() };
    let st = crate::memory::model_states(&m, &z, 2);
    let ex = m.layers as f64 * crate::memory::layer_expert_params_per_gpu(&m, &z);
    assert_eq!(ex, 48.0 * 3.0 * 2048.0 * 768.0 * 128.0 / 8.0);
    assert!((st.optimizer - ((st.params - ex) * 12.0 / 16.0 + ex * 12.0 / 2.0)).abs() < 1.0, "{st:?}");
    let z16 = Layout { ep: 16, ..z.clone() };
    let (st, ex) = (crate::memory::model_states(&m, &z16, 2), ex / 2.0);
    assert!((st.optimizer - ((st.params - ex) * 12.0 / 16.0 + ex * 12.0)).abs() < 1.0, "{st:?}");
}
