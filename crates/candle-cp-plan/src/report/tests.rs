//! Tests of [`super::render`].

use super::*;
use crate::{plan, Hardware, Layout, ModelConfig, PlanInput};

#[test]
fn render_shows_key_numbers() {
    let inp = PlanInput::new(
        ModelConfig::preset("llama3-405b").unwrap(),
        Hardware::preset("h100").unwrap(),
        Layout {
            tp: 8,
            sp: true,
            cp: 16,
            ..Layout::default()
        },
        131072,
    );
    let txt = render(&plan(&inp).unwrap());
    for want in [
        "73.0 GB",
        "0.570 GB",
        "4.0 MiB",
        "563",
        "1500 fwd",
        "tokens per GPU",
        "Verdict: does not fit",
        "Optimizer step (k = 1 micro-batches per replica, pp = 1, v = 1, dp = 1)",
        "pipeline bubble",
        "MFU",
    ] {
        assert!(txt.contains(want), "missing {want:?} in\n{txt}");
    }
}

#[test]
fn render_with_a_sliding_window() {
    let mut m = ModelConfig::preset("llama3-8b").unwrap();
    let inp = |m: &ModelConfig, kind| {
        PlanInput::new(
            m.clone(),
            Hardware::preset("h100").unwrap(),
            Layout {
                cp: 8,
                cp_kind: kind,
                ..Layout::default()
            },
            131072,
        )
    };
    let causal = plan(&inp(&m, CpKind::Ring)).unwrap();
    m.sliding_window = Some(4096);
    let p = plan(&inp(&m, CpKind::Ring)).unwrap();
    let txt = render(&p);
    let line = format!(
        "sliding window 4096: attention {}/layer (vs {} without); ring: a halo exchange of the 4095 K/V rows before each shard, no ring (7 hops without the window)",
        tflop(p.flops.attention_fwd),
        tflop(causal.flops.attention_fwd)
    );
    assert!(txt.contains(&line), "missing {line:?} in\n{txt}");
    for want in [
        "windowed attention forward",
        "a halo exchange of the 4095 K/V rows before the shard, no ring",
        "the halo rows' dK/dV back",
        "Note: sliding window 4096: a halo exchange of the 4095 K/V rows before each shard",
        "Ulysses vs full ring bytes (fwd)",
    ] {
        assert!(txt.contains(want), "missing {want:?} in\n{txt}");
    }
    assert!(!render(&causal).contains("sliding window"));
    assert!(!txt.contains("window work per step, as a chunk"), "{txt}");
    // a window past one shard keeps the (contiguous) ring, a halo of 2 hops
    m.sliding_window = Some(16386);
    let far = render(&plan(&inp(&m, CpKind::Ring)).unwrap());
    for want in ["contiguous, halo of 2 hop(s)", "h*step + (h+1)*step*g/e", "Note: sliding window 16386: the planner models contiguous shards for a window", "zigzag would keep the full ring (7 hops)", "window work per step, as a chunk"] {
        assert!(far.contains(want), "missing {want:?} in
{far}");
    }
    let ag = render(&plan(&inp(&m, CpKind::Allgather)).unwrap());
    assert!(ag.contains("all-gather KV still gathers all K/V"), "{ag}");
    assert!(!ag.contains("Note: sliding window"), "{ag}");
    m.sliding_window = Some(131072);
    let same = render(&plan(&inp(&m, CpKind::Ring)).unwrap());
    assert!(
        same.contains("sliding window 131072 >= seq 131072"),
        "{same}"
    );
}

#[test]
fn render_with_packed_documents() {
    let inp = |doc_len: Option<usize>, window: Option<usize>, kind| {
        let mut m = ModelConfig::preset("llama3-8b").unwrap();
        m.sliding_window = window;
        let mut i = PlanInput::new(
            m,
            Hardware::preset("h100").unwrap(),
            Layout {
                cp: 16,
                cp_kind: kind,
                ..Layout::default()
            },
            131072,
        );
        i.doc_len = doc_len;
        i
    };
    let causal = plan(&inp(None, None, CpKind::Ring)).unwrap();
    let p = plan(&inp(Some(4096), None, CpKind::Ring)).unwrap();
    let txt = render(&p);
    let line = format!(
        "packed documents of 4096 (32 per sequence): attention {}/layer (vs {} causal, 32.0x less); ring: halo of 1 hop(s) on contiguous shards (15 for the full ring)",
        tflop(p.flops.attention_fwd),
        tflop(causal.flops.attention_fwd)
    );
    assert!(txt.contains(&line), "missing {line:?} in\n{txt}");
    let verdict = format!(
        "packed documents of 4096: attention per ring step {} fwd / {} bwd ({} / {} without documents) against {} / {} per K/V transfer, 1 hop(s) (15 without): NOT hidden",
        ms(p.ring.step_compute_s_fwd),
        ms(p.ring.step_compute_s_bwd),
        ms(causal.ring.step_compute_s_fwd),
        ms(causal.ring.step_compute_s_bwd),
        ms(p.ring.step_transfer_s_fwd),
        ms(p.ring.step_transfer_s_bwd),
    );
    for want in [
        "seq 131072 packed as documents of 4096,",
        "[ring (contiguous, packed documents)]",
        "packed attention forward",
        "contiguous, halo of 1 hop(s)",
        "h*step, h = min(R-1, ceil((m-1)/c)), m = min(L, w)",
        "h*step + (h+1)*step*g/e",
        "rank's packed attention / (h+1) steps",
        "busiest/mean packed pairs, documents from 0",
        "document work per step, as a chunk",
        verdict.as_str(),
        "Note: packed documents of 4096: the planner models contiguous shards",
        "zigzag would keep the full ring (15 hops)",
    ] {
        assert!(txt.contains(want), "missing {want:?} in\n{txt}");
    }
    assert!(!render(&causal).contains("packed"));
    // A window inside the documents: one line naming both, not the window line.
    let pw = render(&plan(&inp(Some(4096), Some(1024), CpKind::Ring)).unwrap());
    assert!(
        pw.contains("packed documents of 4096 (32 per sequence, sliding window 1024 inside each)"),
        "{pw}"
    );
    assert!(
        pw.contains("[ring (contiguous, packed documents, sliding window)]"),
        "{pw}"
    );
    assert!(!pw.contains("\nsliding window 1024:"), "{pw}");
    // A last, shorter document; all-gather keeps its bytes and gets no ring clause.
    let ag = render(&plan(&inp(Some(5000), None, CpKind::Allgather)).unwrap());
    assert!(ag.contains("(26 + one of 1072 per sequence)"), "{ag}");
    assert!(ag.contains("all-gather KV still gathers all K/V"), "{ag}");
    assert!(!ag.contains("attention per ring step"), "{ag}");
    // A document length of at least s: one document, said once.
    let one = render(&plan(&inp(Some(131072), None, CpKind::Ring)).unwrap());
    assert!(
        one.contains("document length 131072 >= seq 131072: one document, nothing changes"),
        "{one}"
    );
    assert!(one.contains("[ring (zigzag)]"), "{one}");
}
