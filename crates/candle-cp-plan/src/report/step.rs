//! The "Optimizer step" table of [`super::render`].

use super::{ms, r, table};
use crate::plan::Plan;
use crate::step::Overlap;
use crate::TFLOP;

/// Seconds as `12.34 s`, or [`ms`] under one second.
pub(super) fn secs(x: f64) -> String {
    if x >= 1.0 {
        format!("{x:.2} s")
    } else {
        ms(x)
    }
}

/// A count as `2.10 M` / `12.3 k` / `950`.
pub(super) fn count(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if x >= 1e4 {
        format!("{:.1} k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// What `--overlap` means, for the row's formula column.
pub(super) fn overlap_label(o: Overlap) -> &'static str {
    match o {
        Overlap::None => "--overlap none: all of it after the backward",
        Overlap::Grad => "--overlap grad: reduction during the backward",
        Overlap::Gather => "--overlap gather: ZeRO's parameter gathers beside compute",
        Overlap::All => "--overlap all: reduction during the backward, ZeRO's parameter gathers beside compute",
    }
}

pub(super) fn section(o: &mut String, p: &Plan) {
    let (t, l) = (&p.step, &p.input.layout);
    let rows = vec![
        r(
            format!("busiest stage, one micro-batch ({} layers + head)", t.stage_layers),
            secs(t.stage_s),
            "v*ceil(L/(pp*v)) x layer + 3*2*s*b*h*V/(t*cp) at the linear rate",
        ),
        r(
            "PP sends per micro-batch",
            if t.pp_sends_bytes > 0.0 { format!("{} / {}", super::mib(t.pp_sends_bytes), ms(t.pp_sends_s)) } else { "-".into() },
            "2*v*(s/cp)*b*h*e/t, hidden in the steady phase",
        ),
        r("pipeline bubble", format!("{:.1}%", 100.0 * t.bubble_fraction), "(pp-1)/(v*k+pp-1), 1F1B (interleaved when v > 1)"),
        r("compute per step", secs(t.compute_s), "(k+(pp-1)/v) x stage"),
        r(
            "PP sends exposed (fill and drain)",
            if t.pp_sends_bytes > 0.0 { secs(t.pp_exposed_s) } else { "-".into() },
            "2*(pp-1) one-way sends of a chunk's activations: (pp-1)/v x the sends per micro-batch",
        ),
        r("gradient sync exposed", secs(t.sync_exposed_s), overlap_label(t.overlap)),
        r("step", secs(t.step_s), ""),
        r("step with nothing overlapped", secs(t.step_s_no_overlap), ""),
        r("tokens per step", count(t.tokens_per_step), "dp*k*b*s"),
        r("tokens per second per GPU", count(t.tokens_per_s_per_gpu), ""),
        r(
            "model FLOP/s per GPU",
            format!("{:.0} TFLOP/s", t.model_flops_per_s_per_gpu / TFLOP),
            "L*(linear + attention, fwd+bwd) + head; no recompute",
        ),
        r(
            "MFU",
            format!("{:.1}%", 100.0 * t.mfu),
            "of the hardware peak",
        ),
    ];
    table(
        o,
        &format!(
            "Optimizer step (k = {} micro-batches per replica, pp = {}, v = {}, dp = {})",
            t.micro_batches, l.pp, l.virtual_stages, l.dp
        ),
        &rows,
    );
}
