//! The whole plan: memory, FLOPs, communication, verdict (fits, smallest CP, bottleneck).

use crate::comm::{self, AllgatherComm, CommCtx, EpComm, RingComm, TpComm, UlyssesComm};
use crate::grad_sync::{grad_sync, GradSync};
use crate::compute::{layer_compute_seconds, layer_flops_packed, LayerFlops};
use crate::partial::{self, SlidingLayers};
use crate::hardware::{Hardware, Link};
use crate::layout::{ActivationModel, CpKind, Dtype, Layout, Recompute};
use crate::memory::{self, ActivationTotals, ModelStates};
use crate::model::ModelConfig;
use crate::packed::{self, effective_doc_len};
use crate::rates::{kernel_tokens, AttnRates};
use crate::step::{step_time, Overlap, StepInput, StepTime};
use crate::{plan_bail, Result, GB};
use serde::Serialize;

mod notes;
use notes::notes;

/// Everything the planner needs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanInput {
    /// Model shape.
    pub model: ModelConfig,
    /// GPU and links.
    pub hardware: Hardware,
    /// Parallel layout.
    pub layout: Layout,
    /// Global sequence length `s` (tokens per sequence, all CP ranks together).
    pub seq: usize,
    /// Packed documents of `L` tokens from position 0 (the last one `s mod L` when `L` does
    /// not divide `s`), attention inside each document; `None` (or `L ≥ s`): one document.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub doc_len: Option<usize>,
    /// Sequences per micro-batch `b` (per data-parallel replica).
    pub micro_batch: usize,
    /// Micro-batches per optimizer step per data-parallel replica, `k` (gradient
    /// accumulation; the pipeline's micro-batches); `None`: `pp`, the fewest that fill a 1F1B
    /// pipeline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub micro_batches: Option<usize>,
    /// How much of the gradient synchronisation the step time takes as hidden.
    pub overlap: Overlap,
    /// Training dtype.
    pub dtype: Dtype,
    /// Accumulate / send dK, dV in fp32 in the CP backward.
    pub dkv_fp32: bool,
    /// Which activation count drives the per-GPU totals.
    pub activation_model: ActivationModel,
    /// Achieved attention FLOP/s (overlap check, attention time); ignored when
    /// [`PlanInput::attn_rates`] is given.
    pub attn_flops: f64,
    /// Measured attention rates by sequence length: attention priced at the rate of the
    /// layout's kernel calls ([`crate::rates`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attn_rates: Option<AttnRates>,
    /// Achieved FLOP/s of the linear layers.
    pub linear_flops: f64,
}

impl PlanInput {
    /// Defaults: bf16, micro-batch 1, `pp` micro-batches per step, gradient sync overlapped
    /// ([`Overlap::All`]), Korthikanti count, attention at 600 TFLOP/s, linear layers at 70%
    /// of the hardware peak.
    pub fn new(model: ModelConfig, hardware: Hardware, layout: Layout, seq: usize) -> Self {
        let linear_flops = 0.7 * hardware.peak_flops;
        Self {
            model,
            hardware,
            layout,
            seq,
            doc_len: None,
            micro_batch: 1,
            micro_batches: None,
            overlap: Overlap::All,
            dtype: Dtype::Bf16,
            dkv_fp32: false,
            activation_model: ActivationModel::Korthikanti,
            attn_flops: 600e12,
            attn_rates: None,
            linear_flops,
        }
    }

    /// Micro-batches per optimizer step, `k`: [`PlanInput::micro_batches`] or `pp`.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches.unwrap_or(self.layout.pp).max(1)
    }
}

/// Per-layer activation bytes per GPU under each recompute policy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ByRecompute {
    /// No recomputation.
    pub none: f64,
    /// Attention core recomputed.
    pub selective: f64,
    /// Only the layer input stored.
    pub full: f64,
}

/// Per-layer time of one GPU (forward + backward), seconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerTime {
    /// Linear layers at the linear rate.
    pub linear_s: f64,
    /// Attention at the attention rate.
    pub attention_s: f64,
    /// CP communication not hidden behind compute.
    pub cp_exposed_s: f64,
    /// TP/SP collectives.
    pub tp_s: f64,
    /// Expert-parallel all-to-alls ([`Plan::ep_comm`]; 0 without EP).
    pub ep_s: f64,
    /// Sum.
    pub total_s: f64,
}

/// The planner's answer. All bytes are per GPU unless the name says otherwise.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// The inputs.
    pub input: PlanInput,
    /// `tp·cp·pp·dp`.
    pub world_size: usize,
    /// Tokens per GPU, `s / cp`.
    pub tokens_per_gpu: usize,
    /// Activations of one layer for one sequence (`b = 1`), unsharded, under the chosen
    /// activation model (73.0 GB = `34·s·h` for Llama 3 405B at 128k with flash).
    pub activation_bytes_per_layer: f64,
    /// Korthikanti count with flash attention, per sequence: `34·s·h` (bf16).
    pub activation_bytes_per_layer_korthikanti: f64,
    /// Korthikanti count without flash attention: `s·h·(34 + 5·a·s/h)` (bf16).
    pub activation_bytes_per_layer_no_flash: f64,
    /// Exact Llama count, per sequence (`31.75·s·h` for 405B).
    pub activation_bytes_per_layer_llama: f64,
    /// What candle-cp's Llama keeps, per sequence, one GPU (`memory::candle_cp_layer_bytes`,
    /// measured by `tests/plan_activations.rs`).
    pub activation_bytes_per_layer_candle_cp: f64,
    /// Stored activations of one layer on one GPU under the layout and recompute policy
    /// (micro-batch `b`).
    pub activation_bytes_per_layer_per_gpu: f64,
    /// The same under each recompute policy.
    pub activation_bytes_per_layer_per_gpu_by_recompute: ByRecompute,
    /// Activation totals on the busiest GPU.
    pub activations: ActivationTotals,
    /// Weights, gradients, optimizer state.
    pub model_states: ModelStates,
    /// Model states + activations.
    pub memory_per_gpu_bytes: f64,
    /// GPU memory.
    pub gpu_memory_bytes: f64,
    /// `memory_per_gpu_bytes <= gpu_memory_bytes`.
    pub fits: bool,
    /// Smallest power-of-two CP (other degrees fixed) that fits, if any up to `s`.
    pub min_cp_that_fits: Option<usize>,
    /// FLOPs per layer (with a window on some layers only, [`Plan::sliding`], those of a
    /// full-attention layer).
    pub flops: LayerFlops,
    /// With a window on some layers only: the sliding layers' FLOPs, ring and times
    /// ([`crate::partial`]; [`Plan::layer_time`] and the step average the two kinds).
    pub sliding: Option<SlidingLayers>,
    /// Ring over the CP group (the ring part for 2-D; a plain ring over `cp` otherwise,
    /// for comparison).
    pub ring: RingComm,
    /// Ulysses over the CP group (the Ulysses part for 2-D).
    pub ulysses: UlyssesComm,
    /// All-gather-KV over the CP group.
    pub allgather: AllgatherComm,
    /// TP/SP collectives.
    pub tp_comm: TpComm,
    /// Expert-parallel all-to-alls (zero bytes with `ep = 1`).
    pub ep_comm: EpComm,
    /// Gradient synchronisation over the `dp·cp` replicas, once per optimizer step.
    pub grad_sync: GradSync,
    /// Sequence length of one attention kernel call under this layout
    /// ([`crate::rates::kernel_tokens`]).
    pub attn_kernel_tokens: usize,
    /// The attention rate applied, FLOP/s: [`PlanInput::attn_flops`], or the measured rates
    /// at `attn_kernel_tokens`.
    pub attn_flops_used: f64,
    /// Per-layer time on one GPU for the chosen CP kind (averaged over the full and sliding
    /// layers with [`Plan::sliding`]).
    pub layer_time: LayerTime,
    /// One optimizer step: pipeline, gradient sync, throughput, MFU.
    pub step: StepTime,
    /// What limits this layout.
    pub bottleneck: String,
    /// One-line verdict; with packed documents on a ring, followed by the ring's compute per
    /// step against one K/V transfer and whether it still hides
    /// ([`crate::packed::ring_verdict`]).
    pub verdict: String,
    /// Caveats (ignored inputs, assumptions that matter here).
    pub notes: Vec<String>,
}

/// Model states + activations per GPU for `input` (the layout must be valid).
fn memory_total(input: &PlanInput) -> (ActivationTotals, ModelStates, f64) {
    let e = input.dtype.bytes();
    let a = memory::activation_totals(
        input.activation_model,
        &input.model,
        &input.layout,
        input.seq,
        input.micro_batch,
        e,
        input.micro_batches(),
    );
    let st = memory::model_states(&input.model, &input.layout, e);
    let total = a.total + st.total;
    (a, st, total)
}

/// Smallest power-of-two CP (other degrees fixed) whose memory fits; `None` if none up to
/// the sequence length does. Layouts invalid for a CP value (e.g. Ulysses heads) are skipped.
pub fn min_cp_that_fits(input: &PlanInput) -> Option<usize> {
    let mut cp = 1usize;
    while cp <= input.seq {
        let layout = Layout {
            cp,
            ..input.layout.clone()
        };
        let trial = PlanInput {
            layout,
            ..input.clone()
        };
        if trial.layout.validate(&trial.model, trial.seq).is_ok() {
            let (_, _, total) = memory_total(&trial);
            if total <= trial.hardware.mem_bytes {
                return Some(cp);
            }
        }
        cp = match cp.checked_mul(2) {
            Some(c) => c,
            None => break,
        };
    }
    None
}

/// Computes the plan; errors name the offending inputs.
pub fn plan(input: &PlanInput) -> Result<Plan> {
    let (m, l, hw) = (&input.model, &input.layout, &input.hardware);
    m.validate()?;
    hw.validate()?;
    l.validate(m, input.seq)?;
    if input.micro_batch == 0 {
        plan_bail!("--micro-batch must be at least 1")
    }
    if input.micro_batches == Some(0) {
        plan_bail!("--micro-batches must be at least 1")
    }
    if input.doc_len == Some(0) {
        plan_bail!("document length (--doc-len) must be at least 1 token, got 0")
    }
    for (what, x) in [
        ("attention", input.attn_flops),
        ("linear", input.linear_flops),
    ] {
        if !(x.is_finite() && x > 0.0) {
            plan_bail!("{what} FLOP/s must be positive, got {x}")
        }
    }
    let (s, b, e) = (input.seq, input.micro_batch, input.dtype.bytes());
    let am = input.activation_model;
    let flash = l.flash;
    let kor = memory::korthikanti_layer_bytes(m, s, 1, e, true);
    let kor_nf = memory::korthikanti_layer_bytes(m, s, 1, e, false);
    let llama = memory::llama_layer_bytes(m, s, 1, e, flash);
    let per_seq = match am {
        ActivationModel::Korthikanti => memory::korthikanti_layer_bytes(m, s, 1, e, flash),
        ActivationModel::Llama => llama,
        ActivationModel::CandleCp => memory::candle_cp_layer_bytes(m, s, 1, e),
    };
    let by = |r: Recompute| memory::layer_per_gpu(am, m, l, s, b, e, r);
    let by_recompute = ByRecompute {
        none: by(Recompute::None),
        selective: by(Recompute::Selective),
        full: by(Recompute::Full),
    };
    let (activations, model_states, mem_total) = memory_total(input);
    let fits = mem_total <= hw.mem_bytes;
    let min_cp = min_cp_that_fits(input);

    let flops = layer_flops_packed(m, l, s, b, input.doc_len);
    let attn_kernel_tokens = kernel_tokens(l, s);
    let attn_rate = match &input.attn_rates {
        Some(r) => r.combined(attn_kernel_tokens),
        None => input.attn_flops,
    };
    let cx = CommCtx {
        model: m,
        layout: l,
        hw,
        seq: s,
        micro_batch: b,
        elem: e,
        grad_elem: if input.dkv_fp32 { 4 } else { e },
        attn_rate,
        doc_len: input.doc_len,
    };
    let (ring, ulysses) = match l.cp_kind {
        CpKind::TwoD => (
            comm::ring(&cx, l.ring_degree(), l.ulysses),
            comm::ulysses(&cx, l.ulysses),
        ),
        _ => (comm::ring(&cx, l.cp, 1), comm::ulysses(&cx, l.cp)),
    };
    let allgather = comm::allgather(&cx);
    let tp_comm = comm::tp(&cx);
    let ep_comm = comm::ep(&cx);
    let k = input.micro_batches();
    let grad_sync = grad_sync(l, hw, model_states.params, input.dtype.bytes(), k);
    let (linear_s, attention_s) =
        layer_compute_seconds(&flops, l, input.linear_flops, attn_rate);
    let cp_exposed_s = match l.cp_kind {
        CpKind::Ring => ring.exposed_s_per_layer,
        CpKind::Allgather => allgather.exposed_s_per_layer,
        CpKind::Ulysses => ulysses.exposed_s_per_layer,
        CpKind::TwoD => ring.exposed_s_per_layer + ulysses.exposed_s_per_layer,
    };
    // a window on some layers only: the sliding layers priced apart, the layer averaged
    let sliding = partial::sliding_layers(&cx, input.linear_flops, ulysses.exposed_s_per_layer, allgather.exposed_s_per_layer);
    let (attention_s, cp_exposed_s, avg_flops) = match &sliding {
        Some(sl) => (
            partial::average(m.layers, sl, attention_s, sl.attention_s),
            partial::average(m.layers, sl, cp_exposed_s, sl.cp_exposed_s),
            partial::average_flops(m.layers, &flops, sl),
        ),
        None => (attention_s, cp_exposed_s, flops.clone()),
    };
    let tp_s = if l.tp > 1 {
        tp_comm.exposed_s_per_layer
    } else {
        0.0
    };
    let layer_time = LayerTime {
        linear_s,
        attention_s,
        cp_exposed_s,
        tp_s,
        ep_s: ep_comm.exposed_s_per_layer,
        total_s: linear_s + attention_s + cp_exposed_s + tp_s + ep_comm.exposed_s_per_layer,
    };
    // the backward's share of a layer's time (recompute included), by FLOPs
    let f = &avg_flops;
    let bwd = f.linear_bwd + f.attention_bwd + f.recompute;
    let bwd_share = bwd / (bwd + f.linear_fwd + f.attention_fwd).max(f64::MIN_POSITIVE);
    let stage_layers = memory::layers_per_stage(m, l);
    // the CP and TP collectives that use the gradient sync's link keep it busy for part of
    // each layer: the overlapped sync has only the rest
    let mut parts = vec![
        (tp_comm.link, tp_comm.fwd_bytes_per_layer, tp_comm.bwd_bytes_per_layer),
        (ep_comm.link, ep_comm.fwd_bytes_per_layer, ep_comm.bwd_bytes_per_layer),
    ];
    match l.cp_kind {
        CpKind::Ring => parts.push((ring.link, ring.fwd_bytes_per_layer, ring.bwd_bytes_per_layer)),
        CpKind::Allgather => parts.push((allgather.link, allgather.fwd_bytes_per_layer, allgather.bwd_bytes_per_layer)),
        CpKind::Ulysses => parts.push((ulysses.link, ulysses.fwd_bytes_per_layer, ulysses.bwd_bytes_per_layer)),
        CpKind::TwoD => {
            parts.push((ring.link, ring.fwd_bytes_per_layer, ring.bwd_bytes_per_layer));
            parts.push((ulysses.link, ulysses.fwd_bytes_per_layer, ulysses.bwd_bytes_per_layer));
        }
    }
    let (busy_fwd, busy_bwd) = link_busy_per_layer(&parts, grad_sync.link, hw, l.recompute == Recompute::Full);
    let grad_sync = grad_sync.overlapped(
        stage_layers,
        (layer_time.total_s * bwd_share - busy_bwd).max(0.0),
        (layer_time.total_s * (1.0 - bwd_share) - busy_fwd).max(0.0),
    );
    // the head: output projection + loss, forward and backward, vocab-parallel over TP
    let head_model_flops = 3.0 * f.logits_fwd;
    let step = step_time(&StepInput {
        micro_batches: k,
        pp: l.pp,
        virtual_stages: l.virtual_stages,
        dp: l.dp,
        world: l.world(),
        layers: m.layers,
        stage_layers,
        layer_s: layer_time.total_s,
        head_s: head_model_flops / (l.tp * l.cp) as f64 / input.linear_flops,
        // (a latent attention's padding is work the GPU does, not the model's)
        layer_model_flops: f.linear_fwd + f.linear_bwd + (f.attention_fwd + f.attention_bwd) * m.attn_model_fraction(),
        head_model_flops,
        tokens: s as f64 * b as f64,
        peak_flops: hw.peak_flops,
        grad_sync: &grad_sync,
        overlap: input.overlap,
        pp_sends_bytes: if l.pp > 1 {
            2.0 * l.virtual_stages as f64 * (s / l.cp) as f64 * b as f64 * e as f64 * m.hidden as f64
                / l.tp as f64
        } else {
            0.0
        },
        pp_link_bw: Link::for_group(l.tp * l.cp, l.pp, hw).bandwidth(hw),
    });

    let bottleneck = bottleneck(
        fits,
        mem_total,
        hw,
        &activations,
        &model_states,
        &layer_time,
        &step,
        l,
    );
    let mut verdict = if fits {
        format!(
            "fits: {:.1} GB of {:.0} GB per GPU (smallest CP that fits: {})",
            mem_total / GB,
            hw.mem_bytes / GB,
            min_cp.map_or("none".to_string(), |c| c.to_string())
        )
    } else {
        format!(
            "does not fit: {:.1} GB needed, {:.0} GB per GPU; {}",
            mem_total / GB,
            hw.mem_bytes / GB,
            match min_cp {
                Some(c) => format!("CP = {c} fits with the other degrees unchanged"),
                None => "no power-of-two CP fits with the other degrees unchanged".to_string(),
            }
        )
    };
    let ring_kind = matches!(l.cp_kind, CpKind::Ring | CpKind::TwoD) && ring.degree > 1;
    if let (Some(d), true) = (effective_doc_len(input.doc_len, s), ring_kind) {
        let plain = CommCtx {
            doc_len: None,
            ..cx.clone()
        };
        let r_plain = match l.cp_kind {
            CpKind::TwoD => comm::ring(&plain, l.ring_degree(), l.ulysses),
            _ => comm::ring(&plain, l.cp, 1),
        };
        verdict.push_str("; ");
        verdict.push_str(&packed::ring_verdict(d, &ring, &r_plain));
    }
    let notes = notes(input, &ring, sliding.as_ref());
    Ok(Plan {
        input: input.clone(),
        world_size: l.world(),
        tokens_per_gpu: s / l.cp,
        activation_bytes_per_layer: per_seq,
        activation_bytes_per_layer_korthikanti: kor,
        activation_bytes_per_layer_no_flash: kor_nf,
        activation_bytes_per_layer_llama: llama,
        activation_bytes_per_layer_candle_cp: memory::candle_cp_layer_bytes(m, s, 1, e),
        activation_bytes_per_layer_per_gpu: activations.per_layer_per_gpu,
        activation_bytes_per_layer_per_gpu_by_recompute: by_recompute,
        activations,
        model_states,
        memory_per_gpu_bytes: mem_total,
        gpu_memory_bytes: hw.mem_bytes,
        fits,
        min_cp_that_fits: min_cp,
        flops,
        sliding,
        ring,
        ulysses,
        allgather,
        tp_comm,
        ep_comm,
        grad_sync,
        attn_kernel_tokens,
        attn_flops_used: attn_rate,
        layer_time,
        step,
        bottleneck,
        verdict,
        notes,
    })
}

/// Seconds per layer (forward, backward) that the collectives in `parts` (link, forward bytes,
/// backward bytes per layer) keep `link` busy; with full recompute the backward reruns the
/// forward's collectives too. Those seconds are not available to the overlapped gradient sync
/// on the same link.
pub fn link_busy_per_layer(parts: &[(Link, f64, f64)], link: Link, hw: &Hardware, recompute: bool) -> (f64, f64) {
    let bw = link.bandwidth(hw);
    let (mut fwd, mut bwd) = (0.0, 0.0);
    for &(l, f, b) in parts {
        if l == link {
            fwd += f / bw;
            bwd += b / bw + if recompute { f / bw } else { 0.0 };
        }
    }
    (fwd, bwd)
}

/// Memory when it does not fit (naming the larger part), else the largest share of the
/// optimizer step on the busiest GPU: the per-layer parts over its layers and micro-batches
/// (the head counted with the linear layers), the pipeline bubble and its exposed sends, the
/// gradient sync left exposed.
#[allow(clippy::too_many_arguments)]
fn bottleneck(
    fits: bool,
    total: f64,
    hw: &Hardware,
    a: &ActivationTotals,
    st: &ModelStates,
    t: &LayerTime,
    step: &StepTime,
    l: &Layout,
) -> String {
    if !fits {
        let (big, what) = if a.total >= st.total {
            (a.total, "activations")
        } else {
            (st.total, "weights + gradients + optimizer state")
        };
        return format!(
            "memory: {:.1} GB needed of {:.0} GB; the larger part is {what} ({:.1} GB)",
            total / GB,
            hw.mem_bytes / GB,
            big / GB
        );
    }
    let kind = match l.cp_kind {
        CpKind::Ring => "ring",
        CpKind::Allgather => "all-gather",
        CpKind::Ulysses => "Ulysses all-to-all",
        CpKind::TwoD => "2-D Ulysses+ring",
    };
    // seconds per step of each part: k micro-batches of the busiest stage's layers
    let per_step = step.micro_batches as f64 * step.stage_layers as f64;
    let k = step.micro_batches as f64;
    let parts = [
        (per_step * t.linear_s + k * step.head_s, "compute: linear layers and head".to_string()),
        (per_step * t.attention_s, "compute: attention".to_string()),
        (
            per_step * t.cp_exposed_s,
            format!("CP communication ({kind}) not hidden by compute"),
        ),
        (per_step * t.tp_s, "TP/SP collectives".to_string()),
        (per_step * t.ep_s, "expert-parallel all-to-alls".to_string()),
        (step.compute_s - k * step.stage_s, "pipeline bubble".to_string()),
        (step.pp_exposed_s, "pipeline sends on the fill and drain".to_string()),
        (step.sync_exposed_s, "gradient sync not hidden".to_string()),
    ];
    let (v, name) =
        parts.iter().cloned().fold(
            (f64::MIN, String::new()),
            |acc, p| if p.0 > acc.0 { p } else { acc },
        );
    let secs = if step.step_s >= 1.0 {
        format!("{:.2} s", step.step_s)
    } else {
        format!("{:.1} ms", 1e3 * step.step_s)
    };
    format!(
        "{name} ({:.0}% of the {secs} step)",
        100.0 * v / step.step_s.max(f64::MIN_POSITIVE),
    )
}

#[cfg(test)]
mod tests;
