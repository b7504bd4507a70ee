//! Human-readable rendering of a [`Plan`]: a few aligned tables.

use crate::hardware::Link;
use crate::layout::{CpKind, Recompute};
use crate::plan::Plan;
use crate::{GB, MIB, TFLOP};
use std::fmt::Write;

fn gb(x: f64) -> String {
    if x >= 1000.0 * GB {
        format!("{:.1} TB", x / (1000.0 * GB))
    } else if x >= 100.0 * GB {
        format!("{:.0} GB", x / GB)
    } else if x >= 10.0 * GB {
        format!("{:.1} GB", x / GB)
    } else {
        format!("{:.3} GB", x / GB)
    }
}

fn mib(x: f64) -> String {
    format!("{:.1} MiB", x / MIB)
}

fn tflop(x: f64) -> String {
    let t = x / TFLOP;
    if t >= 100.0 {
        format!("{t:.0} TFLOP")
    } else if t >= 1.0 {
        format!("{t:.2} TFLOP")
    } else {
        format!("{t:.3} TFLOP")
    }
}

fn lower<T: std::fmt::Debug>(x: T) -> String {
    format!("{x:?}").to_ascii_lowercase()
}

/// Seconds as `12.34 ms` or `567.8 us`.
pub(crate) fn ms(x: f64) -> String {
    if x < 1e-3 {
        format!("{:.1} us", x * 1e6)
    } else {
        format!("{:.2} ms", x * 1e3)
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "NO"
    }
}

/// Section title followed by `label  value  formula` rows, aligned.
fn table(out: &mut String, title: &str, rows: &[(String, String, &str)]) {
    let w0 = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0);
    let w1 = rows.iter().map(|r| r.1.chars().count()).max().unwrap_or(0);
    let _ = writeln!(out, "\n{title}");
    for (a, b, c) in rows {
        let pad0 = w0 - a.chars().count();
        let pad1 = w1 - b.chars().count();
        let _ = writeln!(
            out,
            "  {a}{}  {}{b}  {c}",
            " ".repeat(pad0),
            " ".repeat(pad1)
        );
    }
}

fn r(
    label: impl Into<String>,
    value: impl Into<String>,
    formula: &'static str,
) -> (String, String, &'static str) {
    (label.into(), value.into(), formula)
}

/// Renders the plan as tables for people (the numbers of `--json`, formatted).
pub fn render(p: &Plan) -> String {
    let i = &p.input;
    let (m, l, hw) = (&i.model, &i.layout, &i.hardware);
    let mut o = String::new();
    let windowed = p.ring.window.is_some();
    let docs = p.ring.doc_len.is_some();
    let banded = windowed || docs;
    let kind = match l.cp_kind {
        CpKind::Ring if banded && l.cp > 1 => format!(
            "ring (contiguous{}{})",
            if docs { ", packed documents" } else { "" },
            if windowed { ", sliding window" } else { "" }
        ),
        CpKind::Ring => "ring (zigzag)".to_string(),
        CpKind::Allgather => "all-gather KV".to_string(),
        CpKind::Ulysses => "Ulysses".to_string(),
        CpKind::TwoD => format!("2-D: Ulysses {} x ring {}", l.ulysses, l.ring_degree()),
    };
    let kind = match l.cp_kind {
        CpKind::Ulysses | CpKind::TwoD if l.regather_heads => format!("{kind}, heads regathered in backward"),
        _ => kind,
    };
    let _ = writeln!(
        o,
        "candle-cp plan: {} (h {}, {} layers, {} heads / {} KV, ffn {}, {:.1}B params{}), seq {}{}, micro-batch {}, {}",
        m.name,
        m.hidden,
        m.layers,
        m.heads,
        m.kv_heads,
        m.ffn,
        m.total_params() as f64 / 1e9,
        m.sliding_window
            .map_or(String::new(), |w| format!(", sliding window {w}"))
            + &m.partial_window.map_or(String::new(), |(w, k)| format!(", sliding window {w} on {k} layers"))
            + if m.qkv_bias { ", q/k/v biases" } else { "" }
            + &m.moe.as_ref().map_or(String::new(), |x| format!(", {} experts ({} per token, {} wide) on {} layers, {:.1}B active", x.experts, x.top_k, x.expert_ffn, x.sparse_layers, m.active_params() as f64 / 1e9)),
        i.seq,
        i.doc_len
            .map_or(String::new(), |d| format!(" packed as documents of {d}")),
        i.micro_batch,
        lower(i.dtype)
    );
    let _ = writeln!(
        o,
        "layout: TP {}{} x CP {} [{}] x PP {} x DP {} = {} GPUs, ZeRO-{}, recompute {}{}; {} ({:.0} GB, {:.0} TFLOP/s, NVLink {:.0} GB/s, IB {:.0} GB/s)",
        l.tp,
        if l.sp { "+SP" } else { "" },
        l.cp,
        kind,
        l.pp,
        l.dp,
        p.world_size,
        l.zero,
        lower(l.recompute),
        if l.flash { ", flash attention" } else { ", no flash attention" },
        hw.name,
        hw.mem_bytes / GB,
        hw.peak_flops / TFLOP,
        hw.nvlink_bw / GB,
        hw.ib_bw / GB
    );

    for line in window_line(p).into_iter().chain(partial_line(p)).chain(docs_line(p)) {
        let _ = writeln!(o, "{line}");
    }

    let byr = &p.activation_bytes_per_layer_per_gpu_by_recompute;
    let mark = |x: Recompute| if x == l.recompute { " <-" } else { "" };
    table(
        &mut o,
        "Activations per layer",
        &[
            r(
                "per sequence, Korthikanti + flash",
                gb(p.activation_bytes_per_layer_korthikanti),
                "s*h*34 (bf16)",
            ),
            r(
                "per sequence, without flash",
                gb(p.activation_bytes_per_layer_no_flash),
                "s*h*(34 + 5*a*s/h)",
            ),
            r(
                "per sequence, Llama exact (GQA, SwiGLU)",
                gb(p.activation_bytes_per_layer_llama),
                if m.moe.is_some() { "s*e*(4h + 2*a*d + 2*a_kv*d + K*(3f_e + 2h))" } else { "s*e*(4h + 2*a*d + 2*a_kv*d + 3f)" },
            ),
            r(
                "per sequence, candle-cp's Llama (measured)",
                gb(p.activation_bytes_per_layer_candle_cp),
                "Llama + lse, norm stats (+ CP terms)",
            ),
            r(
                "tokens per GPU",
                format!("{}", p.tokens_per_gpu),
                "c = s/cp",
            ),
            r(
                format!("per GPU, recompute none{}", mark(Recompute::None)),
                gb(byr.none),
                "TP/SP/CP split, see docs",
            ),
            r(
                format!("per GPU, recompute selective{}", mark(Recompute::Selective)),
                gb(byr.selective),
                "minus the score term",
            ),
            r(
                format!("per GPU, recompute full{}", mark(Recompute::Full)),
                gb(byr.full),
                "c*b*h*e (/t with SP)",
            ),
        ],
    );

    let a = &p.activations;
    let st = &p.model_states;
    let mut rows = vec![
            r(
                "parameters on this GPU",
                format!("{:.2}B", st.params / 1e9),
                "busiest PP stage, /t",
            ),
            r(
                "weights",
                gb(st.weights),
                if p.input.layout.base_quant.is_some() { "e bytes/param; quantized projections: their codes + scales" } else { "e bytes/param (/dp*cp with ZeRO-3)" },
            ),
            r(
                "gradients",
                gb(st.grads),
                "e bytes/param (/dp*cp with ZeRO-2+)",
            ),
            r(
                "optimizer (Adam)",
                gb(st.optimizer),
                "12 bytes/param (/dp*cp with ZeRO-1+)",
            ),
        ];
    if st.dequantized > 0.0 {
        rows.push(r("dequantized base weights", gb(st.dequantized), "e bytes/projection weight: one layer (full recompute) or all"));
    }
    if st.dora_weights > 0.0 {
        rows.push(r("DoRA weights", gb(st.dora_weights), "e bytes/adapted weight: one layer (full recompute) or all"));
    }
    rows.extend([
            r(
                "activations, layers",
                gb(a.layers),
                "in-flight micro-batches * ceil(L/pp) * per layer",
            ),
            r(
                "activations, recompute working set",
                gb(a.recompute_working_set),
                "one full layer (full recompute)",
            ),
            r("logits (fp32)", gb(a.logits), "c*b*(v/t)*4"),
            r(
                "total",
                gb(p.memory_per_gpu_bytes),
                "peak of first/last stage",
            ),
            r("GPU memory", gb(p.gpu_memory_bytes), ""),
    ]);
    table(&mut o, "Memory per GPU", &rows);

    let f = &p.flops;
    table(
        &mut o,
        "FLOPs per layer (per micro-batch)",
        &[
            r(
                "linear forward",
                tflop(f.linear_fwd),
                if m.moe.is_some() { "2*s*b*(2h*a*d + 2h*a_kv*d + E*h + 3h*f_e*K)" } else { "2*s*b*(2h*a*d + 2h*a_kv*d + 3h*f)" },
            ),
            if f.doc_len.is_some() {
                r(
                    "packed attention forward",
                    tflop(f.attention_fwd),
                    "4*b*a*d*sum_docs P(len, w); P(n, w) = pairs of n queries",
                )
            } else if f.window.is_some() {
                r(
                    "windowed attention forward",
                    tflop(f.attention_fwd),
                    "4*b*a*d*(s*w - w*(w-1)/2)",
                )
            } else {
                r(
                    "causal attention forward",
                    tflop(f.attention_fwd),
                    "2*s^2*b*a*d",
                )
            },
        ]
        .into_iter()
        .chain(p.sliding.as_ref().map(|sl| {
            r(
                format!("windowed attention forward ({} sliding layers)", sl.layers),
                tflop(sl.flops.attention_fwd),
                "4*b*a*d*(s*w - w*(w-1)/2)",
            )
        }))
        .chain([
            r("linear backward", tflop(f.linear_bwd), "2x forward"),
            r("attention backward", tflop(f.attention_bwd), "2.5x forward"),
            r("recompute", tflop(f.recompute), "forward again (full)"),
            r("per GPU, fwd+bwd", tflop(f.per_gpu_fwd_bwd), "/ (t*cp)"),
        ])
        .collect::<Vec<_>>(),
    );

    let rg = &p.ring;
    let link = |x: Link| x.label();
    let role = match l.cp_kind {
        CpKind::Ring => "",
        CpKind::TwoD => ", the ring part of 2-D",
        _ => ", for comparison",
    };
    if rg.degree == 1 {
        let _ = writeln!(
            o,
            "\n{}. A ring would hide its transfers for chunks over {:.0} tokens on NVLink, {:.0} on InfiniBand (forward).",
            if l.cp == 1 { "CP = 1: no CP communication" } else { "Ring degree 1: no ring communication" },
            rg.min_chunk_fwd_nvlink,
            rg.min_chunk_fwd_ib
        );
    } else {
        table(
            &mut o,
            &format!(
                "Ring over {} ranks ({}{role}; chunk {} tokens, {} q / {} kv heads per rank{})",
                rg.degree,
                link(rg.link),
                rg.chunk_tokens,
                rg.q_heads,
                rg.kv_heads,
                match rg.halo_rows {
                    Some(m) => format!("; a halo exchange of the {m} K/V rows before the shard, no ring"),
                    None if banded => format!("; contiguous, halo of {} hop(s)", rg.hops),
                    None => String::new(),
                }
            ),
            &[
                r("K+V per step", mib(rg.step_bytes), if rg.halo_rows.is_some() { "(w-1)*b*2*a_kv*d*e per neighbour" } else { "c*b*2*a_kv*d*e" }),
                r(
                    "per layer forward",
                    mib(rg.fwd_bytes_per_layer),
                    if rg.halo_rows.is_some() {
                        "step, to the next rank (zigzag: each neighbour)"
                    } else if docs {
                        "h*step, h = min(R-1, ceil((m-1)/c)), m = min(L, w)"
                    } else if windowed {
                        "h*step, h = min(R-1, ceil((w-1)/c))"
                    } else {
                        "(R-1)*step"
                    },
                ),
                r(
                    "per layer backward",
                    mib(rg.bwd_bytes_per_layer),
                    if rg.halo_rows.is_some() {
                        "the halo rows' dK/dV back, e bytes"
                    } else if banded {
                        "h*step + (h+1)*step*g/e (dK/dV)"
                    } else {
                        "(R-1)*step + R*step*g/e (dK/dV)"
                    },
                ),
                r(
                    "attention per step (fwd)",
                    tflop(rg.step_flops_fwd),
                    if rg.halo_rows.is_some() {
                        "rank's windowed attention, one call"
                    } else if docs {
                        "rank's packed attention / (h+1) steps"
                    } else if windowed {
                        "rank's windowed attention / (h+1) steps"
                    } else {
                        "2*c^2*b*d*a (half block, zigzag)"
                    },
                ),
                r(
                    "step compute / transfer, fwd",
                    format!(
                        "{} / {} {}",
                        ms(rg.step_compute_s_fwd),
                        ms(rg.step_transfer_s_fwd),
                        if rg.halo_rows.is_some() { "exchanged before the call".to_string() } else { format!("hides: {}", yes(rg.hides_fwd)) }
                    ),
                    "",
                ),
                r(
                    "step compute / transfer, bwd",
                    format!(
                        "{} / {} {}",
                        ms(rg.step_compute_s_bwd),
                        ms(rg.step_transfer_s_bwd),
                        if rg.halo_rows.is_some() { "exchanged before the call".to_string() } else { format!("hides: {}", yes(rg.hides_bwd)) }
                    ),
                    "",
                ),
                r(
                    "min chunk to hide, NVLink",
                    format!(
                        "{:.0} fwd / {:.0} bwd tokens",
                        rg.min_chunk_fwd_nvlink, rg.min_chunk_bwd_nvlink
                    ),
                    "fwd: a_kv*e*R_attn/(a*BW)",
                ),
                r(
                    "min chunk to hide, InfiniBand",
                    format!(
                        "{:.0} fwd / {:.0} bwd tokens",
                        rg.min_chunk_fwd_ib, rg.min_chunk_bwd_ib
                    ),
                    "bwd: a_kv*(e+g)*R_attn/(2.5*a*BW)",
                ),
                r(
                    "contiguous split imbalance",
                    format!("{:.3}", rg.contiguous_imbalance),
                    if docs {
                        "busiest/mean packed pairs, documents from 0"
                    } else if windowed {
                        "busiest/mean windowed pairs"
                    } else {
                        "(2R-1)/R; zigzag 1.0"
                    },
                ),
            ]
            .into_iter()
            .chain(window_chunk_row(p))
            .collect::<Vec<_>>(),
        );
    }

    let u = &p.ulysses;
    let ag = &p.allgather;
    let u_state = if u.valid { "ok" } else { "INVALID" };
    if l.cp > 1 {
        table(
            &mut o,
            "Other CP communication (per layer per GPU)",
            &[
                r(
                    format!("Ulysses {} ({}, {})", u.degree, link(u.link), u_state),
                    format!(
                        "{} fwd / {} bwd",
                        mib(u.fwd_bytes_per_layer),
                        mib(u.bwd_bytes_per_layer)
                    ),
                    if l.regather_heads {
                        "(U-1)/U*c*b*d*e*(2a + 2max(a_kv,U)); bwd + fwd (heads regathered)"
                    } else {
                        "(U-1)/U*c*b*d*e*(2a + 2max(a_kv,U))"
                    },
                ),
                r(
                    "Ulysses KV replication",
                    format!("x{}", u.kv_replication),
                    "U/a_kv when U > a_kv",
                ),
                r(
                    if banded {
                        "Ulysses vs full ring bytes (fwd)"
                    } else {
                        "Ulysses vs ring bytes (fwd)"
                    },
                    format!("{:.2}x", u.ratio_vs_ring_fwd),
                    "(h+h_kv)/(U*h_kv) w/o KV replication",
                ),
                r(
                    format!("all-gather KV {} ({})", ag.degree, link(ag.link)),
                    format!(
                        "{} fwd / {} bwd",
                        mib(ag.fwd_bytes_per_layer),
                        mib(ag.bwd_bytes_per_layer)
                    ),
                    "(cp-1)*c*b*2*a_kv*d*e",
                ),
                r(
                    "all-gathered K/V held",
                    gb(ag.gathered_kv_bytes),
                    "s*b*2*a_kv*d*e",
                ),
                r(
                    format!(
                        "TP {} collectives ({})",
                        p.tp_comm.degree,
                        link(p.tp_comm.link)
                    ),
                    format!(
                        "{} fwd / {} bwd",
                        mib(p.tp_comm.fwd_bytes_per_layer),
                        mib(p.tp_comm.bwd_bytes_per_layer)
                    ),
                    "4*(t-1)/t*c*b*h*e",
                ),
            ],
        );

        let _ = writeln!(o, "  Ulysses heads: {}", u.constraint);
    }

    if l.ep > 1 {
        let x = &p.ep_comm;
        table(
            &mut o,
            "Expert-parallel all-to-alls (per layer per GPU, averaged over the layers)",
            &[r(
                format!("EP {} ({})", x.degree, link(x.link)),
                format!("{} fwd / {} bwd", mib(x.fwd_bytes_per_layer), mib(x.bwd_bytes_per_layer)),
                "sparse/L*2*(ep-1)/ep*c*b*K*h*e",
            )],
        );
    }

    let t = &p.layer_time;
    table(
        &mut o,
        &format!(
            "Time per layer per GPU, fwd+bwd (attention {:.0}{}, linear {:.0} TFLOP/s)",
            p.attn_flops_used / TFLOP,
            match &i.attn_rates {
                Some(r) => format!(" measured at T = {} by {}", p.attn_kernel_tokens, r.source),
                None => String::new(),
            },
            i.linear_flops / TFLOP
        ),
        &[
            r("linear", ms(t.linear_s), ""),
            r("attention", ms(t.attention_s), ""),
            r("CP communication not hidden", ms(t.cp_exposed_s), ""),
            r("TP/SP collectives", ms(t.tp_s), ""),
        ]
        .into_iter()
        .chain((l.ep > 1).then(|| r("EP all-to-alls", ms(t.ep_s), "")))
        .chain([r("total", ms(t.total_s), "")])
        .collect::<Vec<_>>(),
    );

    let g = &p.grad_sync;
    if g.replicas > 1 {
        let stage_s = p.step.stage_layers as f64 * t.total_s;
        let mut rows = vec![
            r(
                "sent per GPU",
                gb(g.bytes_per_step),
                match (g.zero, g.reductions > 1) {
                    (0, _) => "2*(R-1)/R*N*4 (all-reduce, f32)",
                    (1, _) | (2, false) => "(R-1)/R*N*(4+e) (reduce-scatter f32 + all-gather)",
                    (2, true) => "(R-1)/R*N*(4k+e) (a reduce-scatter per micro-batch + all-gather)",
                    (_, false) => "(R-1)/R*N*(4+2e) (reduce-scatter f32, gathers in fwd and bwd)",
                    (_, true) => "(R-1)/R*N*k*(4+2e) (per micro-batch: reduce-scatter, gathers)",
                },
            ),
            r("time if not overlapped", ms(g.seconds_per_step), ""),
            r(
                "vs one micro-batch on this GPU",
                format!("{:.1}%", 100.0 * g.seconds_per_step / stage_s.max(f64::MIN_POSITIVE)),
                "busiest stage's layers x total per layer",
            ),
            r(
                "exposed if overlapped layer by layer",
                ms(g.exposed_overlapped_s.unwrap_or(g.seconds_per_step)),
                "--overlap-grad-sync: max(T/L, T-(L-1)*bwd per layer) (+ the ZeRO all-gather)",
            ),
        ];
        if let Some(both) = g.exposed_gather_overlapped_s {
            if g.zero >= 3 {
                rows.push(r("+ gathers prefetched a layer ahead", ms(both), "per micro-batch: max(G/L, G-(L-1)*fwd) + max(B/L, B-(L-1)*bwd), B = G + its reduce-scatter"));
            } else {
                rows.push(r("+ all-gather during the next forward", ms(both), "--overlap-param-gather: + max(G/L, G-(L-1)*fwd per layer)"));
            }
        }
        table(
            &mut o,
            &format!("Gradient sync per optimizer step (ZeRO-{} over dp*cp = {} replicas, {})", g.zero, g.replicas, link(g.link)),
            &rows,
        );
    }

    step::section(&mut o, p);

    let _ = writeln!(o, "\nVerdict: {}", p.verdict);
    let _ = writeln!(o, "Bottleneck: {}", p.bottleneck);
    for n in &p.notes {
        let _ = writeln!(o, "Note: {n}");
    }
    o
}

#[cfg(test)]
mod tests;

mod masks;
mod search;
mod step;
use masks::{docs_line, partial_line, window_chunk_row, window_line};
pub use search::render_search;
