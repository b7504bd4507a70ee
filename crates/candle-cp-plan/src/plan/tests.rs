//! Tests of [`super::plan`].

use super::*;
use crate::MIB;

fn input(layout: Layout) -> PlanInput {
    PlanInput::new(
        ModelConfig::preset("llama3-405b").unwrap(),
        Hardware::preset("h100").unwrap(),
        layout,
        131072,
    )
}

#[test]
fn reproduces_405b_128k() -> Result<()> {
    let p = plan(&input(Layout {
        tp: 8,
        sp: true,
        cp: 16,
        ..Layout::default()
    }))?;
    assert_eq!(p.tokens_per_gpu, 8192);
    assert_eq!(p.activation_bytes_per_layer, 34.0 * 2f64.powi(31));
    assert!((p.activation_bytes_per_layer / GB - 73.0).abs() < 0.05);
    assert!((p.activation_bytes_per_layer_per_gpu / GB - 0.570).abs() < 0.0005);
    assert!(
        (p.activation_bytes_per_layer_llama / p.activation_bytes_per_layer - 31.75 / 34.0)
            .abs()
            < 1e-12
    );
    // what our Llama keeps on one GPU: the Llama count + f32 lse (128 heads) + 2 norms' r
    assert_eq!(
        p.activation_bytes_per_layer_candle_cp,
        p.activation_bytes_per_layer_llama + 131072.0 * (4.0 * 128.0 + 8.0)
    );
    assert_eq!(p.ring.step_bytes, 4.0 * MIB);
    assert!((p.flops.attention_fwd / 1e12 - 563.0).abs() < 0.5);
    assert!((p.ring.min_chunk_fwd_ib - 1500.0).abs() < 1e-6);
    assert!(p.ring.hides_fwd);
    assert_eq!(p.world_size, 128);
    // 405B without PP: 101 GB of bf16 weights per GPU alone, so it does not fit on H100.
    assert!(
        !p.fits && p.bottleneck.starts_with("memory"),
        "{}",
        p.bottleneck
    );
    assert_eq!(p.min_cp_that_fits, None);
    Ok(())
}

#[test]
fn min_cp_search() -> Result<()> {
    // PP16 on H200: CP = 1 needs ~16·8·9.13 GB of activations; the search finds the
    // smallest power of two that fits, and that CP and only that one fits.
    let mut inp = input(Layout {
        tp: 8,
        sp: true,
        pp: 16,
        dp: 1,
        cp: 1,
        ..Layout::default()
    });
    inp.hardware = Hardware::preset("h200")?;
    let p = plan(&inp)?;
    assert!(!p.fits);
    let c = p.min_cp_that_fits.expect("some CP fits");
    let at = |cp: usize| {
        plan(&PlanInput {
            layout: Layout {
                cp,
                ..inp.layout.clone()
            },
            ..inp.clone()
        })
    };
    assert!(at(c)?.fits);
    assert!(!at(c / 2)?.fits);
    assert_eq!(at(c)?.min_cp_that_fits, Some(c));
    // Full recompute needs less CP.
    let full = PlanInput {
        layout: Layout {
            recompute: Recompute::Full,
            ..inp.layout.clone()
        },
        ..inp.clone()
    };
    assert!(plan(&full)?.min_cp_that_fits.unwrap() < c);
    Ok(())
}

#[test]
fn bottleneck_is_cp_comm_for_short_chunks_on_ib() -> Result<()> {
    // 8B, TP8, CP64 ring at 32k: 512-token chunks over IB cannot hide (< 1,500/... tokens).
    let mut inp = input(Layout {
        tp: 8,
        sp: true,
        cp: 64,
        ..Layout::default()
    });
    inp.model = ModelConfig::preset("llama3-8b")?;
    inp.seq = 32768;
    // 32 micro-batches per step, so that the once-per-step gradient sync (75% of a
    // one-micro-batch step) does not dominate
    inp.micro_batches = Some(32);
    let p = plan(&inp)?;
    assert!(p.fits);
    assert!(!p.ring.hides_fwd);
    assert!(p.layer_time.cp_exposed_s > 0.0);
    assert!(
        p.bottleneck.starts_with("CP communication (ring)"),
        "{}",
        p.bottleneck
    );
    Ok(())
}

/// Measured rates: the plan is the one with the constant rate the table gives at the
/// layout's kernel length (the chunk for the ring, the whole sequence for Ulysses).
#[test]
fn measured_rates_price_attention_at_the_kernel_length() -> Result<()> {
    use crate::rates::RatePoint;
    let pts = [(2048, 200.0, 150.0), (8192, 450.0, 350.0), (32768, 600.0, 500.0)];
    let rates = AttnRates::new(
        pts.iter().map(|&(t, f, b)| RatePoint { tokens: t, fwd_flops: f * 1e12, bwd_flops: b * 1e12 }).collect(),
        "test",
    )?;
    for (kind, t) in [(CpKind::Ring, 8192), (CpKind::Ulysses, 131072)] {
        let mut with = input(Layout { tp: 8, sp: true, cp: 16, cp_kind: kind, ..Layout::default() });
        with.attn_rates = Some(rates.clone());
        let p = plan(&with)?;
        assert_eq!(p.attn_kernel_tokens, t);
        let mut flat = with.clone();
        flat.attn_rates = None;
        flat.attn_flops = rates.combined(t);
        let q = plan(&flat)?;
        assert_eq!((p.attn_flops_used, &p.layer_time, &p.ring, &p.step), (q.attn_flops_used, &q.layer_time, &q.ring, &q.step));
    }
    // the ring's 8k chunks at 3.5/(1/450 + 2.5/350) = 374 TFLOP/s, slower than at 600
    let mut ring = input(Layout { tp: 8, sp: true, cp: 16, ..Layout::default() });
    let fast = plan(&ring)?.layer_time.attention_s;
    ring.attn_rates = Some(rates);
    assert!((plan(&ring)?.layer_time.attention_s / fast - 600.0 / (3.5 / (1.0 / 450.0 + 2.5 / 350.0))).abs() < 1e-9);
    Ok(())
}

/// Over a step: PP 16 with one micro-batch is mostly bubble; short sequences on 64 DP
/// replicas over InfiniBand with nothing overlapped wait on the gradient sync.
#[test]
fn bottleneck_names_the_bubble_and_the_sync() -> Result<()> {
    let mut inp = input(Layout { tp: 8, sp: true, cp: 16, pp: 16, ..Layout::default() });
    inp.hardware = Hardware::preset("h200")?;
    inp.micro_batches = Some(1);
    let p = plan(&inp)?;
    assert!(p.fits, "{}", p.verdict);
    // 15 of 16 stage-times idle, less the small exposed sync
    assert!(p.bottleneck.starts_with("pipeline bubble (93% of the"), "{}", p.bottleneck);
    let mut inp = input(Layout { dp: 64, ..Layout::default() });
    inp.model = ModelConfig::preset("llama3-8b")?;
    inp.seq = 1024;
    inp.overlap = Overlap::None;
    let p = plan(&inp)?;
    assert!(p.bottleneck.starts_with("gradient sync not hidden"), "{}", p.bottleneck);
    Ok(())
}

#[test]
fn error_paths() {
    let e = plan(&input(Layout {
        cp: 3,
        ..Layout::default()
    }))
    .unwrap_err();
    assert!(
        e.0.contains("CP degree 3 does not divide the sequence length 131072"),
        "{e}"
    );
    let e = plan(&input(Layout {
        tp: 6,
        ..Layout::default()
    }))
    .unwrap_err();
    assert!(
        e.0.contains("TP degree 6 does not divide the 128 attention heads"),
        "{e}"
    );
    let mut i = input(Layout::default());
    i.micro_batch = 0;
    assert!(plan(&i).unwrap_err().0.contains("--micro-batch"));
    i.micro_batch = 1;
    i.attn_flops = 0.0;
    assert!(plan(&i)
        .unwrap_err()
        .0
        .contains("attention FLOP/s must be positive"));
}

/// Collectives on the gradient sync's own link leave it less time to overlap: only those on
/// that link count, the backward reruns the forward's under full recompute, and a plan whose
/// ring shares the sync's InfiniBand exposes at least as much as the formula without it.
#[test]
fn collectives_on_the_sync_link_shrink_its_overlap() -> Result<()> {
    let hw = Hardware::preset("h100")?;
    let parts = [(Link::Ib, 50e9, 100e9), (Link::Nvlink, 450e9, 450e9)];
    assert_eq!(link_busy_per_layer(&parts, Link::Ib, &hw, false), (1.0, 2.0));
    assert_eq!(link_busy_per_layer(&parts, Link::Ib, &hw, true), (1.0, 3.0));
    assert_eq!(link_busy_per_layer(&parts, Link::Nvlink, &hw, false), (1.0, 1.0));
    // 405B, TP 8 x CP 16 x DP 8 ZeRO-1: ring and sync both on InfiniBand
    let mut inp = input(Layout { tp: 8, sp: true, cp: 16, dp: 8, pp: 16, ..Layout::default() });
    inp.micro_batches = Some(16);
    // 64k tokens: layers short enough that the windows, not the first layer's share, bound
    // what the sync can hide
    inp.seq = 65536;
    let p = plan(&inp)?;
    assert_eq!((p.ring.link, p.grad_sync.link), (Link::Ib, Link::Ib));
    let f = &p.flops;
    let bwd = f.linear_bwd + f.attention_bwd + f.recompute;
    let share = bwd / (bwd + f.linear_fwd + f.attention_fwd);
    let t = p.layer_time.total_s;
    let g = GradSync { exposed_overlapped_s: None, exposed_gather_overlapped_s: None, exposed_gather_only_s: None, ..p.grad_sync.clone() };
    let free = g.clone().overlapped(8, t * share, t * (1.0 - share));
    let (bf, bb) = (p.ring.fwd_bytes_per_layer / hw.ib_bw, p.ring.bwd_bytes_per_layer / hw.ib_bw);
    let busy = g.overlapped(8, t * share - bb, t * (1.0 - share) - bf);
    assert_eq!(p.grad_sync.exposed_overlapped_s, busy.exposed_overlapped_s);
    assert_eq!(p.grad_sync.exposed_gather_overlapped_s, busy.exposed_gather_overlapped_s);
    assert!(busy.exposed_gather_overlapped_s.unwrap() > free.exposed_gather_overlapped_s.unwrap());
    Ok(())
}


/// Phi-3-medium's 10 KV heads: TP 4 and 8 are planned with 5 KV-head copies per GPU (named in
/// a note, K/V weights counted for 5 heads), TP 2 and TP 10 (an even split, one head each) without
/// the note; 40 query heads over TP 16 are refused.
#[test]
fn kv_heads_tp_does_not_divide_are_planned_as_copies() -> Result<()> {
    let m = ModelConfig::preset("phi3-medium")?;
    let at = |tp: usize| -> Result<Plan> {
        plan(&PlanInput::new(m.clone(), Hardware::preset("h200")?, Layout { tp, sp: true, cp: 2, ..Layout::default() }, 131072))
    };
    for tp in [4usize, 8] {
        let p = at(tp)?;
        assert_eq!(p.input.layout.kv_heads_per_tp_rank(&m), 5);
        assert!(p.notes.iter().any(|n| n.contains(&format!("TP {tp} over 10 KV heads: each GPU holds 5 KV-head copies"))), "{:?}", p.notes);
    }
    for tp in [2usize, 10] {
        let p = at(tp)?;
        assert_eq!(p.input.layout.kv_heads_per_tp_rank(&m), 10 / tp);
        assert!(!p.notes.iter().any(|n| n.contains("KV-head copies")), "{:?}", p.notes);
    }
    // the copies' K/V weights: 5 heads' rows where an even split would hold 2.5
    let (p4, p2) = (memory::params_per_gpu(&m, &at(4)?.input.layout), memory::params_per_gpu(&m, &at(2)?.input.layout));
    let kv_rows = |heads: f64| 2.0 * heads * 128.0 * 5120.0 * 40.0;
    assert!((p4 - (p2 - kv_rows(5.0)) / 2.0 - kv_rows(5.0)).abs() < 1e3 * 5120.0, "{p4} vs {p2}");
    assert!(at(16).is_err());
    Ok(())
}
