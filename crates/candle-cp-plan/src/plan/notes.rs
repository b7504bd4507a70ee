//! The plan's caveats ([`super::Plan::notes`]): what the figures leave out or assume for this
//! model and layout.

use super::PlanInput;
use crate::comm::RingComm;
use crate::layout::{CpKind, Recompute};
use crate::memory;
use crate::packed::{self, effective_doc_len};
use crate::step::Overlap;
use crate::partial::{self, SlidingLayers};
use crate::window::effective_window;

/// The plan's caveats; `ring` and `sliding` as priced (whether a window's ring is a halo
/// exchange is theirs to say, [`crate::comm::ring`]).
pub(super) fn notes(input: &PlanInput, ring: &RingComm, sliding: Option<&SlidingLayers>) -> Vec<String> {
    let (m, l) = (&input.model, &input.layout);
    let mut n = Vec::new();
    if l.flash && l.recompute == Recompute::Selective {
        n.push("selective recompute only drops attention scores, which flash attention never stores: same memory as none".into());
    }
    if l.sp && l.tp == 1 {
        n.push("--sp has no effect with --tp 1".into());
    }
    let kv_t = l.kv_heads_per_tp_rank(m);
    if l.tp > 1 && !m.kv_heads.is_multiple_of(l.tp) && !l.tp.is_multiple_of(m.kv_heads) {
        n.push(format!(
            "TP {} over {} KV heads: each GPU holds {kv_t} KV-head copies (lcm({}, {}) / {}), the KV heads its {} query heads use; K/V projections, activations and ring bytes are counted for {kv_t} heads ({:.2}x an even split), and each step sums the copies' weight gradients with one all-gather over TP",
            l.tp,
            m.kv_heads,
            m.kv_heads,
            l.tp,
            l.tp,
            m.heads / l.tp,
            kv_t as f64 * l.tp as f64 / m.kv_heads as f64
        ));
    }
    if l.lora_rank > 0 {
        n.push(format!(
            "LoRA rank {} on q, k, v, o{}: {:.1} M adapter parameters per GPU hold the gradients and the Adam state; the other weights are frozen (their e bytes only); activations as full fine-tuning keeps them",
            l.lora_rank,
            match (l.lora_mlp, m.moe.is_some()) {
                (true, true) => " and the MLPs' gate, up, down (every expert's too)",
                (true, false) => " and the MLPs' gate, up, down",
                _ => "",
            },
            crate::memory::layers_per_stage(m, l) as f64 * crate::memory::layer_lora_params_per_gpu(m, l) / 1e6
        ));
        if l.lora_dora {
            n.push(format!(
                "DoRA: a magnitude per adapted output row beside the factors; each adapted weight's DoRA copy m/|W + sBA| (W + sBA), {:.1} M weights per layer per GPU, {} (e bytes each)",
                crate::memory::layer_adapted_params_per_gpu(m, l) / 1e6,
                if l.recompute == Recompute::Full { "one layer's at a time (built in its forward, again in its backward)" } else { "every layer's kept for the backward: add --recompute full" }
            ));
        }
        if let Some(q) = l.base_quant {
            n.push(format!(
                "quantized base {q}: {:.1} M projection weights per GPU at {:.3} bytes each; {} dequantized at a time ({})",
                crate::memory::layers_per_stage(m, l) as f64 * crate::memory::layer_quantized_params_per_gpu(m, l) / 1e6,
                q.bytes_per_weight(),
                if l.recompute == Recompute::Full { "one layer's" } else { "every layer's" },
                if l.recompute == Recompute::Full { "built in its forward, again in its backward" } else { "the graph keeps them for the backward: add --recompute full" }
            ));
        }
    }
    if l.ep > 1 {
        n.push(format!(
            "expert parallelism {}: each GPU holds {} of the experts; the all-to-alls assume balanced routing (skewed routing sends more to and from the busiest rank, which sets the exchange's time)",
            l.ep,
            m.moe.as_ref().map_or(0, |x| x.experts / l.ep)
        ));
        if l.zero > 0 {
            n.push(format!(
                "ZeRO with expert parallelism: the dense parameters' states split over dp·cp = {}, the experts' over the dp·cp/ep = {} ranks holding the same experts",
                l.dp * l.cp,
                l.dp * l.cp / l.ep
            ));
        }
    }
    if m.layers % (l.pp * l.virtual_stages.max(1)) != 0 {
        n.push(format!(
            "{} layers do not split evenly over PP {} x {} virtual stages: the busiest stage has {}",
            m.layers,
            l.pp,
            l.virtual_stages,
            memory::layers_per_stage(m, l)
        ));
    }
    let window = effective_window(m.sliding_window, input.seq);
    let docs = effective_doc_len(input.doc_len, input.seq);
    let ring_degree = match l.cp_kind {
        CpKind::Ring => l.cp,
        CpKind::TwoD => l.ring_degree(),
        _ => 1,
    };
    if let Some((w, k)) = m.partial_window {
        n.push(match partial::effective_partial(m, input.seq) {
            None => format!("sliding window {w} on {k} of {} layers >= sequence {}: every layer attends causally", m.layers, input.seq),
            Some(_) if ring_degree > 1 && sliding.is_some_and(|sl| sl.ring.halo_rows.is_some()) => format!(
                "sliding window {w} on {k} of {} layers: their attention is the window's, priced apart and averaged with the full layers'; on the full layers' zigzag shards each exchanges the {} K/V rows before each of its two chunks with its neighbours (a halo exchange, no ring)",
                m.layers,
                w - 1
            ),
            Some(_) if ring_degree > 1 => format!(
                "sliding window {w} on {k} of {} layers: their attention is the window's, priced apart and averaged with the full layers'; on the ring they keep the full layers' zigzag shards, so their K/V rotate the whole ring ({} hops) for a window's worth of work",
                m.layers,
                ring_degree - 1
            ),
            Some(_) => format!("sliding window {w} on {k} of {} layers: their attention is the window's, priced apart and averaged with the full layers'", m.layers),
        });
    }
    match (m.sliding_window, window) {
        (Some(w), None) => n.push(format!(
            "sliding window {w} >= sequence {}: the same as causal attention",
            input.seq
        )),
        (_, Some(w)) if ring_degree > 1 && ring.halo_rows.is_some() => n.push(format!(
            "sliding window {w}: a halo exchange of the {} K/V rows before each shard with the previous rank replaces the ring (candle-cp's ring_attention, for windows reaching at most one chunk back: on zigzag shards with both neighbours, for w - 1 <= T/(2·CP))",
            w - 1
        )),
        (_, Some(w)) if ring_degree > 1 && docs.is_none() => n.push(format!(
            "sliding window {w}: the planner models contiguous shards for a window (a halo of {} hop(s)); zigzag would keep the full ring ({} hops)",
            packed::ring_hops(input.seq, ring_degree, None, Some(w)),
            ring_degree - 1
        )),
        _ => {}
    }
    n.extend(packed::notes(input.seq, input.doc_len, window, ring_degree));
    if l.cp_kind == CpKind::Ring
        && l.cp > 1
        && window.is_none()
        && docs.is_none()
        && !input.seq.is_multiple_of(2 * l.cp)
    {
        n.push(format!(
            "zigzag needs 2·CP = {} to divide the sequence {}; a contiguous split costs (2P-1)/P",
            2 * l.cp,
            input.seq
        ));
    }
    if l.cp_kind != CpKind::TwoD && l.ulysses > 1 {
        n.push("--ulysses only applies to --cp-kind 2d".into());
    }
    if l.pp > 1 {
        let k = input.micro_batches();
        if l.virtual_stages > 1 {
            n.push(format!(
                "PP: interleaved 1F1B schedule with {} model chunks per GPU; the first stage holds min(pp, k) = {} micro-batches in flight, x{:.3} for the interleaving",
                l.virtual_stages,
                l.pp.min(k),
                memory::interleave_factor(l)
            ));
            if !k.is_multiple_of(l.pp) {
                n.push(format!("Megatron's interleaved schedule needs the micro-batches per step (k = {k}) to be a multiple of PP {}", l.pp));
            }
        } else {
            n.push(format!(
                "PP: non-interleaved 1F1B schedule assumed; the first stage holds min(pp, k) = {} micro-batches in flight",
                l.pp.min(k)
            ));
        }
        if k < l.pp {
            n.push(format!(
                "only k = {k} micro-batches per step for PP {}: the pipeline never fills (bubble {:.0}%)",
                l.pp,
                100.0 * (l.pp - 1) as f64 / (k + l.pp - 1) as f64
            ));
        }
    }
    if l.dp * l.cp > 1 && l.zero == 3 {
        n.push(match input.overlap {
            Overlap::Gather | Overlap::All => "ZeRO-3: each micro-batch's parameter gathers are taken as prefetched one layer ahead (as FSDP and DeepSpeed do), hidden behind the layers before them as far as the link keeps up".into(),
            _ => "ZeRO-3: each micro-batch's parameter gathers are counted as exposed (--overlap none or grad)".into(),
        });
    }
    n
}

