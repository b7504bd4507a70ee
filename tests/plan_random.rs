//! Seeded random planner inputs: `plan` never panics, refuses bad inputs with a message that
//! names the values, and every plan it returns is consistent with itself.
//!
//! The unit tests in `candle-cp-plan` pin each formula on chosen layouts; this draws the
//! inputs (model preset, sliding window, GPU, TP / SP / CP kind and degree / Ulysses degree /
//! PP / virtual stages / DP / ZeRO / recompute / flash, sequence length from 1 token to 1M,
//! packed document length, micro-batch size and count, overlap, dtype, activation model, a
//! reward model's score head) and
//! checks, on every plan:
//! - every number in its JSON is finite and non-negative;
//! - the totals are the sums of their parts (activations: the busier pipeline stage; model
//!   states, memory per GPU, the per-layer time, the step), `fits` says whether the memory fits, the bubble is
//!   `(pp−1)/(v·k+pp−1)`, tokens per step `b·k·s·dp`, `0 < MFU ≤ 1`, and overlap never makes
//!   the step slower;
//! - `min_cp_that_fits` is the smallest power-of-two CP that fits (the plans at that CP and at
//!   each smaller power of two say so), and doubling CP never adds activation memory.
//!
//! `CANDLE_CP_RANDOM_SEEDS=A..B` draws configurations `A..B`.

use candle_cp_plan::layout::BaseQuant;
use candle_cp_plan::{plan, ActivationModel, CpKind, Dtype, Hardware, Layout, ModelConfig, Overlap, PlanInput, Recompute};
use candle_cp_tests::draws::{pick, rng, seeds};
use serde_json::Value;

const CONFIGS: u64 = 3000;

/// Every numeric leaf of `v` that is not finite or negative, and every null that is not an
/// absent option (`None` of the listed optional fields), by path.
fn bad_numbers(v: &Value, path: &str, out: &mut Vec<String>) {
    match v {
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            if !x.is_finite() || x < 0.0 {
                out.push(format!("{path} = {x}"));
            }
        }
        Value::Object(m) => m.iter().for_each(|(k, x)| bad_numbers(x, &format!("{path}/{k}"), out)),
        Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| bad_numbers(x, &format!("{path}/{i}"), out)),
        // serde_json writes NaN and infinities as null: only options may be null
        Value::Null => {
            let optional = ["window", "sliding_window", "partial_window", "moe", "mla", "doc_len", "f32_row_sums", "micro_batches", "min_cp_that_fits", "attn_rates", "exposed_gather_only_s", "exposed_gather_overlapped_s", "sliding", "halo_rows", "base_quant", "score_head"];
            if !optional.iter().any(|k| path.ends_with(&format!("/{k}"))) {
                out.push(format!("{path} = null"));
            }
        }
        _ => {}
    }
}

/// The number at JSON pointer `p` of `v` (panics naming the pointer when absent).
fn num(v: &Value, p: &str) -> f64 {
    v.pointer(p).and_then(Value::as_f64).unwrap_or_else(|| panic!("no number at {p}"))
}

/// `a == b` to 1e-9 relative.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-30)
}

/// The plan of `inp` with CP degree `cp`, as JSON (`None` when refused).
fn plan_at_cp(inp: &PlanInput, cp: usize) -> Option<Value> {
    let mut i = inp.clone();
    i.layout.cp = cp;
    plan(&i).ok().map(|p| serde_json::to_value(&p).expect("a plan serialises"))
}

#[test]
fn random_plans_are_consistent() {
    let (mut ok, mut refused, mut fitting, mut with_min, mut sliding, mut quantized) = (0, 0, 0, 0, 0, 0);
    let range = seeds(CONFIGS).expect("seed range");
    let n_configs = range.end - range.start;
    for seed in range {
        let mut d = rng(11000 + seed);
        let mut model = ModelConfig::preset(pick(&mut d, &["llama3-8b", "llama3-70b", "llama3-405b", "qwen3-30b-a3b"])).expect("preset");
        if d.below(4) == 0 {
            model.sliding_window = Some(pick(&mut d, &[512, 4096, 100_000]));
        }
        let hw = Hardware::preset(pick(&mut d, &["h100", "h200"])).expect("preset");
        let layout = Layout {
            tp: pick(&mut d, &[1, 2, 4, 8, 16]),
            sp: d.below(2) == 0,
            cp: pick(&mut d, &[1, 2, 3, 4, 8, 16, 64]),
            cp_kind: pick(&mut d, &[CpKind::Ring, CpKind::Allgather, CpKind::Ulysses, CpKind::TwoD]),
            ulysses: pick(&mut d, &[1, 2, 4, 8]),
            pp: pick(&mut d, &[1, 2, 4, 16]),
            virtual_stages: pick(&mut d, &[1, 1, 2, 3]),
            dp: pick(&mut d, &[1, 2, 8, 64]),
            ep: 1,
            zero: pick(&mut d, &[0, 1, 2, 3]),
            recompute: pick(&mut d, &[Recompute::None, Recompute::Selective, Recompute::Full]),
            flash: d.below(8) != 0,
            regather_heads: false,
            f32_row_sums: None,
            lora_rank: 0,
            lora_mlp: false,
            lora_dora: false,
            lora_save_embed: false,
            lora_save_head: false,
            base_quant: None,
        };
        let seq = pick(&mut d, &[1, 7, 1000, 4096, 8192, 131072, 1 << 20]);
        let mut inp = PlanInput::new(model, hw, layout, seq);
        inp.doc_len = (d.below(4) == 0).then(|| pick(&mut d, &[1, 100, 4096, 1 << 21]));
        inp.micro_batch = pick(&mut d, &[1, 2, 3]);
        inp.micro_batches = (d.below(2) == 0).then(|| pick(&mut d, &[1, 2, 5, 32]));
        inp.overlap = pick(&mut d, &[Overlap::None, Overlap::Grad, Overlap::Gather, Overlap::All]);
        inp.dtype = pick(&mut d, &[Dtype::Bf16, Dtype::Fp16, Dtype::Fp32]);
        inp.dkv_fp32 = d.below(2) == 0;
        inp.activation_model = pick(&mut d, &[ActivationModel::Korthikanti, ActivationModel::Llama]);
        // drawn last, so the earlier draws of each seed stay what they were
        inp.layout.regather_heads = d.below(2) == 0;
        if d.below(3) == 0 {
            inp.activation_model = ActivationModel::CandleCp;
        }
        inp.layout.f32_row_sums = pick(&mut d, &[None, Some(true), Some(false)]);
        // a window on some layers only (Gemma 3's five of six, Qwen's max_window_layers)
        if d.below(4) == 0 {
            let layers = inp.model.layers;
            inp.model.sliding_window = None;
            inp.model.partial_window = Some((pick(&mut d, &[1, 512, 4096, 100_000]), pick(&mut d, &[1, layers / 2, layers - layers / 6, layers - 1])));
        }
        // expert parallelism on a mixture of experts (drawn after the rest, as above)
        if inp.model.moe.is_some() {
            inp.layout.ep = pick(&mut d, &[1, 2, 4, 8, 16]);
        }
        // LoRA, its frozen base quantized or not (drawn after the rest, as above)
        if d.below(4) == 0 {
            inp.layout.lora_rank = pick(&mut d, &[8, 64]);
            inp.layout.lora_mlp = d.below(2) == 0;
            inp.layout.base_quant = pick(&mut d, &[None, Some(BaseQuant { bits: 4, group: 64, double: None }), Some(BaseQuant { bits: 8, group: 128, double: None }), Some(BaseQuant { bits: 4, group: 64, double: Some(16) })]);
        }
        // a reward model's score head (a sequence or a token classifier; drawn after the rest)
        if d.below(6) == 0 {
            inp.model.score_head = Some(candle_cp_plan::ScoreHead { labels: pick(&mut d, &[1, 2, 3]), bias: d.below(2) == 0 });
        }
        let what = format!("config {seed}: {inp:?}");
        let p = match plan(&inp) {
            Ok(p) => serde_json::to_value(&p).expect("a plan serialises"),
            Err(e) => {
                assert!(e.0.chars().any(|c| c.is_ascii_digit()), "{what}: refused without naming a value: {}", e.0);
                refused += 1;
                continue;
            }
        };
        ok += 1;
        let mut bad = vec![];
        bad_numbers(&p, "", &mut bad);
        assert!(bad.is_empty(), "{what}: {bad:?}");

        let n = |ptr: &str| num(&p, ptr);
        let sum = |ptrs: &[&str]| ptrs.iter().map(|x| n(x)).sum::<f64>();
        // activations: the peak of the first stage (layers in flight + working set) and, under
        // PP, the last stage (one micro-batch's layers + working set + the logits)
        let first = sum(&["/activations/layers", "/activations/recompute_working_set"]);
        let (total, logits) = (n("/activations/total"), n("/activations/logits"));
        if inp.layout.pp == 1 {
            assert!(close(total, first + logits), "{what}: activations {total} vs {first} + logits {logits}");
        } else {
            assert!(total >= first * (1.0 - 1e-12) && total <= (first + logits) * (1.0 + 1e-12), "{what}: activations {total} vs first stage {first}, logits {logits}");
        }
        assert!(close(n("/model_states/total"), sum(&["/model_states/weights", "/model_states/grads", "/model_states/optimizer", "/model_states/zero3_gathered", "/model_states/dequantized"])), "{what}: model states");
        if let Some(q) = inp.layout.base_quant {
            // against the same plan with the base unquantized: fewer weight bytes (below e bytes
            // per weight), the dequantized copies on top, nothing else changed
            let mut plain = inp.clone();
            plain.layout.base_quant = None;
            let c = serde_json::to_value(plan(&plain).expect("the unquantized plan")).expect("serialises");
            let saved = num(&c, "/model_states/weights") - n("/model_states/weights");
            let e = inp.dtype.bytes() as f64;
            assert!((saved > 0.0) == (q.bytes_per_weight() < e), "{what}: quantized weights save {saved} bytes at {} bytes each", q.bytes_per_weight());
            assert!(n("/model_states/dequantized") > 0.0, "{what}: dequantized copies");
            assert!(close(n("/memory_per_gpu_bytes") - num(&c, "/memory_per_gpu_bytes"), n("/model_states/dequantized") - saved), "{what}: memory per GPU");
            quantized += 1;
        }
        let mem = n("/memory_per_gpu_bytes");
        assert!(close(mem, sum(&["/activations/total", "/model_states/total"])), "{what}: memory per GPU");
        let fits = p["fits"].as_bool().expect("fits");
        assert_eq!(fits, mem <= n("/gpu_memory_bytes"), "{what}: fits");
        fitting += fits as usize;
        assert!(close(n("/layer_time/total_s"), sum(&["/layer_time/linear_s", "/layer_time/attention_s", "/layer_time/cp_exposed_s", "/layer_time/tp_s", "/layer_time/ep_s"])), "{what}: layer time");
        if !p["sliding"].is_null() {
            sliding += 1;
            // the sliding layers' attention is the window's, and the layer averages the two
            // kinds: against the same plan with every layer causal
            let mut causal = inp.clone();
            causal.model.partial_window = None;
            let c = serde_json::to_value(plan(&causal).expect("the causal plan")).expect("serialises");
            let (l, sl) = (inp.model.layers as f64, n("/sliding/layers"));
            assert!(n("/sliding/flops/attention_fwd") <= n("/flops/attention_fwd"), "{what}: sliding attention");
            assert_eq!(n("/flops/attention_fwd"), num(&c, "/flops/attention_fwd"), "{what}: full layers' FLOPs");
            let avg = ((l - sl) * num(&c, "/layer_time/attention_s") + sl * n("/sliding/attention_s")) / l;
            assert!(close(n("/layer_time/attention_s"), avg), "{what}: averaged attention {} vs {avg}", n("/layer_time/attention_s"));
            assert!(n("/step/model_flops_per_step") <= num(&c, "/step/model_flops_per_step") * (1.0 + 1e-12), "{what}: model FLOPs");
            // on zigzag shards: a halo exchange when w − 1 fits in a chunk of T/(2R), else the full ring
            let (r, w) = (num(&c, "/ring/degree"), n("/sliding/window"));
            if r > 1.0 && w - 1.0 <= (inp.seq / (2 * r as usize)) as f64 {
                assert_eq!((n("/sliding/ring/halo_rows"), n("/sliding/ring/active_steps")), (w - 1.0, 1.0), "{what}: the sliding layers' halo");
            } else {
                assert_eq!(n("/sliding/ring/hops"), r - 1.0, "{what}: the sliding layers' full ring");
            }
        }

        let (pp, v, k) = (inp.layout.pp as f64, inp.layout.virtual_stages as f64, n("/step/micro_batches"));
        assert_eq!(k as usize, inp.micro_batches.unwrap_or(inp.layout.pp), "{what}: micro-batches");
        assert!(close(n("/step/bubble_fraction"), (pp - 1.0) / (v * k + pp - 1.0)), "{what}: bubble");
        assert!(close(n("/step/step_s"), sum(&["/step/compute_s", "/step/pp_exposed_s", "/step/sync_exposed_s"])), "{what}: step");
        assert!(n("/step/step_s") <= n("/step/step_s_no_overlap") * (1.0 + 1e-12), "{what}: overlap made the step slower");
        assert!(close(n("/step/tokens_per_step"), (inp.micro_batch * inp.seq * inp.layout.dp) as f64 * k), "{what}: tokens per step");
        let mfu = n("/step/mfu");
        assert!(mfu > 0.0 && mfu <= 1.0, "{what}: MFU {mfu}");

        // the smallest power-of-two CP that fits
        match p["min_cp_that_fits"].as_u64() {
            Some(c) => {
                let c = c as usize;
                with_min += 1;
                assert!(c.is_power_of_two(), "{what}: min CP {c}");
                let at = plan_at_cp(&inp, c).unwrap_or_else(|| panic!("{what}: min CP {c} is refused"));
                assert!(at["fits"].as_bool() == Some(true), "{what}: min CP {c} does not fit");
                let mut smaller = 1;
                while smaller < c {
                    if let Some(q) = plan_at_cp(&inp, smaller) {
                        assert!(q["fits"].as_bool() == Some(false), "{what}: CP {smaller} < min CP {c} fits");
                    }
                    smaller *= 2;
                }
            }
            None => {
                let mut c = 1;
                while c <= inp.seq {
                    if let Some(q) = plan_at_cp(&inp, c) {
                        assert!(q["fits"].as_bool() == Some(false), "{what}: no min CP, but CP {c} fits");
                    }
                    c *= 2;
                }
            }
        }
        // doubling CP never adds activation memory per GPU
        if let Some(q) = plan_at_cp(&inp, inp.layout.cp * 2) {
            let (a, b) = (n("/activations/per_layer_per_gpu"), num(&q, "/activations/per_layer_per_gpu"));
            assert!(b <= a * (1.0 + 1e-12), "{what}: CP x2 raises activations per layer per GPU {a} -> {b}");
        }
    }
    println!("{ok} plans checked ({fitting} fit, {with_min} with a smallest fitting CP, {sliding} with a window on some layers, {quantized} with a quantized base), {refused} refused");
    assert!(n_configs < 100 || sliding > 0, "no plan with a window on some layers");
    assert!(ok as u64 >= n_configs / 5, "only {ok} of {n_configs} drawn inputs were planned");
}
