//! The sliding-window and packed-document rows and lines of [`super::render`].

use super::{ms, r, tflop};
use crate::layout::CpKind;
use crate::plan::Plan;

/// With a window or packed documents: the forward work per ring step expressed as the chunk
/// `c'` whose zigzag half block `2·c'·c·b·d·a` has the same FLOPs; the step hides when `c'`
/// is over the minimum chunk (for `w ≤ c`, `c' ≈ w`: the window, not the chunk, must beat the
/// bound; for documents of `L ≤ c` on one hop, `c' ≈ L/2`).
pub(super) fn window_chunk_row(p: &Plan) -> Option<(String, String, &'static str)> {
    let rg = &p.ring;
    if (rg.window.is_none() && rg.doc_len.is_none()) || rg.halo_rows.is_some() {
        return None;
    }
    let per_token = 2.0
        * rg.chunk_tokens as f64
        * p.input.micro_batch as f64
        * p.input.model.head_dim as f64
        * rg.q_heads as f64;
    Some(r(
        if rg.doc_len.is_some() {
            "document work per step, as a chunk"
        } else {
            "window work per step, as a chunk"
        },
        format!("{:.0} tokens", rg.step_flops_fwd / per_token),
        "step FLOPs/(2*c*b*d*a); hides above min chunk",
    ))
}

/// The sliding-window summary line, when the model has a window.
pub(super) fn window_line(p: &Plan) -> Option<String> {
    let (i, f) = (&p.input, &p.flops);
    let w = i.model.sliding_window?;
    if f.window.is_some() && f.doc_len.is_some() {
        return None; // the packed-documents line names the window
    }
    if f.window.is_none() {
        return Some(format!(
            "sliding window {w} >= seq {}: causal attention, nothing changes",
            i.seq
        ));
    }
    let cp = cp_note(p, "without the window");
    Some(format!(
        "sliding window {w}: attention {}/layer (vs {} without); {cp}",
        tflop(f.attention_fwd),
        tflop(f.attention_fwd_causal)
    ))
}

/// The packed-documents summary line, when `--doc-len` is given.
pub(super) fn docs_line(p: &Plan) -> Option<String> {
    let (i, f) = (&p.input, &p.flops);
    let l = i.doc_len?;
    let Some(d) = f.doc_len else {
        return Some(format!(
            "document length {l} >= seq {}: one document, nothing changes",
            i.seq
        ));
    };
    let (n, rest) = (i.seq / d, i.seq % d);
    let count = if rest == 0 {
        format!("{n} per sequence")
    } else {
        format!("{n} + one of {rest} per sequence")
    };
    let window = f.window.map_or(String::new(), |w| {
        format!(", sliding window {w} inside each")
    });
    let cp = cp_note(p, "for the full ring");
    Some(format!(
        "packed documents of {d} ({count}{window}): attention {}/layer (vs {} causal, {:.1}x less); {cp}",
        tflop(f.attention_fwd),
        tflop(f.attention_fwd_causal),
        f.attention_fwd_causal / f.attention_fwd
    ))
}

/// What the window or the documents change in the CP communication; `full` names the ring's
/// hop count without them.
fn cp_note(p: &Plan, full: &str) -> String {
    let (l, rg) = (&p.input.layout, &p.ring);
    match l.cp_kind {
        _ if l.cp == 1 => "no CP communication".to_string(),
        CpKind::Ring | CpKind::TwoD if rg.degree > 1 => match rg.halo_rows {
            Some(m) => format!("ring: a halo exchange of the {m} K/V rows before each shard, no ring ({} hops {full})", rg.degree - 1),
            None => format!("ring: halo of {} hop(s) on contiguous shards ({} {full})", rg.hops, rg.degree - 1),
        },
        CpKind::Allgather => "all-gather KV still gathers all K/V".to_string(),
        _ => "Ulysses all-to-all unchanged".to_string(),
    }
}

/// The line of a window on some layers only ([`Plan::sliding`]): the sliding layers' attention
/// and, on a ring, their full zigzag ring and what of it is exposed.
pub(super) fn partial_line(p: &Plan) -> Option<String> {
    let sl = p.sliding.as_ref()?;
    let (m, l) = (&p.input.model, &p.input.layout);
    let cp = match l.cp_kind {
        _ if l.cp == 1 => "no CP communication".to_string(),
        CpKind::Ring | CpKind::TwoD if sl.ring.degree > 1 => match sl.ring.halo_rows {
            Some(m) => format!(
                "on zigzag shards a halo exchange of the {m} K/V rows before each chunk with both neighbours (no ring), {} exposed per layer ({} on a full layer)",
                ms(sl.ring.exposed_s_per_layer),
                ms(p.ring.exposed_s_per_layer)
            ),
            None => format!(
                "ring: zigzag keeps the full ring for them ({} hops), {} compute vs {} transfer per forward step, {} exposed per layer ({} on a full layer)",
                sl.ring.hops,
                ms(sl.ring.step_compute_s_fwd),
                ms(sl.ring.step_transfer_s_fwd),
                ms(sl.ring.exposed_s_per_layer),
                ms(p.ring.exposed_s_per_layer)
            ),
        },
        CpKind::Allgather => "all-gather KV still gathers all K/V".to_string(),
        _ => "Ulysses all-to-all unchanged".to_string(),
    };
    Some(format!(
        "sliding window {} on {} of {} layers: their attention {}/layer (vs {} causal); {cp}; per layer, the two kinds averaged",
        sl.window,
        sl.layers,
        m.layers,
        tflop(sl.flops.attention_fwd),
        tflop(p.flops.attention_fwd)
    ))
}
