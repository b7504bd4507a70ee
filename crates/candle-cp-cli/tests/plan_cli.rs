//! `candle-cp plan` end to end: the 405B / 128k numbers through the binary, and exit code 2
//! with a message on bad input.

mod common;
use common::candle_cp;

/// `plan` for Llama-3 405B at 128k tokens with TP8 + SP + CP16, as JSON.
const PLAN_405B_128K: [&str; 11] = [
    "plan",
    "--model",
    "llama3-405b",
    "--seq",
    "131072",
    "--tp",
    "8",
    "--cp",
    "16",
    "--sp",
    "--json",
];

fn close(x: f64, want: f64, rel: f64) {
    assert!((x - want).abs() <= rel * want.abs(), "got {x}, want {want}");
}

#[test]
fn plan_405b_128k_json() {
    let out = candle_cp(&PLAN_405B_128K);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    let f = |path: &str| -> f64 {
        v.pointer(path)
            .and_then(|x| x.as_f64())
            .unwrap_or_else(|| panic!("no number at {path}"))
    };
    // 34·s·h = 34·2^31 bytes = 73.0 GB per layer per sequence (flash attention).
    assert_eq!(f("/activation_bytes_per_layer"), 34.0 * 2f64.powi(31));
    close(f("/activation_bytes_per_layer") / 1e9, 73.0, 1e-3);
    // TP8 + SP + CP16: 0.570 GB per layer per GPU.
    close(f("/activation_bytes_per_layer_per_gpu") / 1e9, 0.570, 1e-3);
    close(
        f("/activation_bytes_per_layer_llama") / f("/activation_bytes_per_layer"),
        31.75 / 34.0,
        1e-12,
    );
    assert_eq!(f("/tokens_per_gpu"), 8192.0);
    assert_eq!(f("/world_size"), 128.0);
    // 4 MiB of K/V per ring step with TP8 (32 MiB without).
    assert_eq!(f("/ring/step_bytes"), 4.0 * 1024.0 * 1024.0);
    // 2·s²·h ≈ 563 TFLOP causal forward attention per layer per sequence.
    close(f("/flops/attention_fwd") / 1e12, 562.95, 1e-4);
    // Hides on InfiniBand above ~1,500 tokens at 600 TFLOP/s.
    close(f("/ring/min_chunk_fwd_ib"), 1500.0, 1e-9);
    assert_eq!(
        v.pointer("/ring/hides_fwd").and_then(|x| x.as_bool()),
        Some(true)
    );
    assert_eq!(v.pointer("/ring/link").and_then(|x| x.as_str()), Some("ib"));
    // Gradient sync over the 16 CP replicas (128 GPUs: across nodes), ZeRO-1: reduce-scatter
    // in f32 + all-gather in bf16 = 15/16·N·6 bytes for the N parameters of this GPU.
    assert_eq!(f("/grad_sync/replicas"), 16.0);
    assert_eq!(f("/grad_sync/params_per_gpu"), f("/model_states/params"));
    close(f("/grad_sync/bytes_per_step"), 15.0 / 16.0 * f("/model_states/params") * 6.0, 1e-12);
    close(f("/grad_sync/seconds_per_step"), f("/grad_sync/bytes_per_step") / 50e9, 1e-12);
    assert_eq!(v.pointer("/grad_sync/link").and_then(|x| x.as_str()), Some("ib"));
    // Overlapped layer by layer: the reduce-scatter (4 of the 6 bytes) hides behind the
    // backward of 126 layers but one layer's share; the bf16 all-gather (2 of 6) stays.
    close(f("/grad_sync/reduce_bytes_per_step"), f("/grad_sync/bytes_per_step") * 4.0 / 6.0, 1e-12);
    let (t, gather) = (f("/grad_sync/seconds_per_step") * 4.0 / 6.0, f("/grad_sync/seconds_per_step") * 2.0 / 6.0);
    let exposed = f("/grad_sync/exposed_overlapped_s");
    assert!(exposed >= t / 126.0 + gather - 1e-12 && exposed < t + gather, "exposed {exposed}");
    // ... unless it overlaps the next forward too: less of it is left, at least a layer's share
    let both = f("/grad_sync/exposed_gather_overlapped_s");
    assert!(both >= exposed - gather + gather / 126.0 - 1e-12 && both < exposed, "exposed with the gather overlapped {both}");
    // Without PP the 405B weights alone exceed 80 GB.
    assert_eq!(v.pointer("/fits").and_then(|x| x.as_bool()), Some(false));
    assert!(v
        .pointer("/bottleneck")
        .and_then(|x| x.as_str())
        .unwrap()
        .starts_with("memory"));
}

#[test]
fn plan_tables_for_people() {
    let out = candle_cp(&[
        "plan",
        "--model",
        "llama3-70b",
        "--seq",
        "32768",
        "--tp",
        "8",
        "--cp",
        "4",
        "--sp",
        "--pp",
        "4",
        "--hardware",
        "h200",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "Activations per layer",
        "Memory per GPU",
        "Ring over 4 ranks",
        "Gradient sync per optimizer step (ZeRO-1 over dp*cp = 4 replicas, InfiniBand)",
        "Verdict:",
        "Bottleneck:",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
}

#[test]
fn plan_bad_input_exits_2_with_message() {
    let cases: [(&[&str], &str); 4] = [
        (
            &["--model", "llama3-405b", "--seq", "131072", "--cp", "3"],
            "CP degree 3 does not divide the sequence length 131072",
        ),
        (
            &["--model", "llama3-405b", "--seq", "131072", "--tp", "3"],
            "TP degree 3 does not divide the 128 attention heads",
        ),
        (
            &["--model", "gpt5", "--seq", "1024"],
            "unknown model preset 'gpt5'",
        ),
        (
            &["--model", "llama3-8b", "--seq", "1024", "--cp-kind", "tree"],
            "unknown CP kind 'tree'",
        ),
    ];
    for (args, msg) in cases {
        let mut all = vec!["plan"];
        all.extend_from_slice(args);
        let out = candle_cp(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(msg),
            "{args:?}: stderr {stderr:?} lacks {msg:?}"
        );
    }
    let dir = std::env::temp_dir().join(format!("candle-cp-plan-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("config.json");
    std::fs::write(&bad, "{\"hidden_size\": 4096,").unwrap();
    let out = candle_cp(&["plan", "--model", bad.to_str().unwrap(), "--seq", "1024"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is not valid JSON"), "{stderr}");
    let good = dir.join("good.json");
    std::fs::write(
        &good,
        r#"{"hidden_size":4096,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
           "intermediate_size":14336,"vocab_size":128256}"#,
    )
    .unwrap();
    let out = candle_cp(&[
        "plan",
        "--model",
        good.to_str().unwrap(),
        "--seq",
        "8192",
        "--json",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v.pointer("/input/model/hidden").and_then(|x| x.as_u64()),
        Some(4096)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plan_hardware_and_rate_overrides() {
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = PLAN_405B_128K.to_vec();
        args.extend_from_slice(extra);
        let out = candle_cp(&args);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let min_ib = |v: &serde_json::Value| {
        v.pointer("/ring/min_chunk_fwd_ib")
            .and_then(|x| x.as_f64())
            .unwrap()
    };
    // Minimum chunk scales with R_attn / BW: half the IB bandwidth or twice the rate doubles it.
    close(min_ib(&run(&["--ib-gbps", "25"])), 3000.0, 1e-9);
    close(min_ib(&run(&["--attn-tflops", "1200"])), 3000.0, 1e-9);
    // --gpu-mem-gb decides the verdict: 400 GB holds the 313 GB this layout needs.
    let v = run(&["--gpu-mem-gb", "400"]);
    assert_eq!(v.pointer("/fits").and_then(|x| x.as_bool()), Some(true));
    // fp32: 66 bytes per s·h instead of 34.
    let v = run(&["--dtype", "fp32"]);
    assert_eq!(
        v.pointer("/activation_bytes_per_layer")
            .and_then(|x| x.as_f64()),
        Some(66.0 * 2f64.powi(31))
    );
    // --activations llama: the exact count (31.75·sbh/128 per GPU) drives the totals.
    let v = run(&["--activations", "llama"]);
    let per_gpu = v
        .pointer("/activation_bytes_per_layer_per_gpu")
        .and_then(|x| x.as_f64())
        .unwrap();
    assert_eq!(per_gpu, 31.75 * 2f64.powi(31) / 128.0);
}

/// A Mistral-7B-like `config.json` (window 4096) in a fresh temp dir; returns its path.
fn mistral_config(tag: &str, window: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("candle-cp-plan-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.json");
    std::fs::write(
        &path,
        format!(
            r#"{{"architectures":["MistralForCausalLM"],"hidden_size":4096,"num_hidden_layers":32,
               "num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,
               "vocab_size":32000,"sliding_window":{window}}}"#
        ),
    )
    .unwrap();
    path
}

fn plan_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["plan"];
    all.extend_from_slice(args);
    common::json(&all)
}

#[test]
fn plan_sliding_window_flag_and_config() {
    let num = |v: &serde_json::Value, p: &str| {
        v.pointer(p)
            .and_then(|x| x.as_f64())
            .unwrap_or_else(|| panic!("no number at {p}"))
    };
    let base = ["--model", "llama3-8b", "--seq", "131072", "--cp", "8"];
    let causal = plan_json(&base);
    let mut with = base.to_vec();
    with.extend_from_slice(&["--sliding-window", "4096"]);
    let w = plan_json(&with);
    // Visible pairs 131072·4096 − 4096·4095/2 = 528,484,352; forward 4·pairs·a·d.
    assert_eq!(
        num(&w, "/flops/attention_fwd"),
        4.0 * 528_484_352.0 * 4096.0
    );
    assert_eq!(
        num(&w, "/flops/attention_fwd_causal"),
        num(&causal, "/flops/attention_fwd")
    );
    assert_eq!(num(&w, "/flops/window"), 4096.0);
    assert!(causal.pointer("/flops/window").unwrap().is_null());
    // Chunk 16384 ≥ w − 1: the halo exchange of the 4095 rows before each shard (K and V of
    // the 8 KV heads of 128, bf16) with the previous rank, and their dK/dV back.
    assert_eq!((num(&w, "/ring/halo_rows"), num(&w, "/ring/hops"), num(&w, "/ring/active_steps")), (4095.0, 1.0, 1.0));
    assert_eq!(num(&causal, "/ring/hops"), 7.0);
    let halo = 4095.0 * 2.0 * 8.0 * 128.0 * 2.0;
    assert_eq!((num(&w, "/ring/fwd_bytes_per_layer"), num(&w, "/ring/bwd_bytes_per_layer")), (halo, halo));
    assert_eq!(num(&causal, "/ring/fwd_bytes_per_layer"), 7.0 * num(&causal, "/ring/step_bytes"));
    assert!(causal.pointer("/ring/halo_rows").unwrap().is_null());
    // All-gather still gathers everything.
    assert_eq!(
        num(&w, "/allgather/fwd_bytes_per_layer"),
        num(&causal, "/allgather/fwd_bytes_per_layer")
    );
    assert_eq!(num(&w, "/input/model/sliding_window"), 4096.0);

    // The text report says it.
    let out = candle_cp(&[
        "plan",
        "--model",
        "llama3-8b",
        "--seq",
        "131072",
        "--cp",
        "8",
        "--sliding-window",
        "4096",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "sliding window 4096: attention 8.66 TFLOP/layer (vs 141 TFLOP without)",
        "ring: a halo exchange of the 4095 K/V rows before each shard, no ring (7 hops without the window)",
        "Note: sliding window 4096: a halo exchange of the 4095 K/V rows",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }

    // A config.json with sliding_window is picked up, and the flag overrides it.
    let cfg = mistral_config("window", "4096");
    let c = cfg.to_str().unwrap();
    let v = plan_json(&["--model", c, "--seq", "131072", "--cp", "8"]);
    assert_eq!(
        num(&v, "/flops/attention_fwd"),
        num(&w, "/flops/attention_fwd")
    );
    assert_eq!(num(&v, "/ring/hops"), 1.0);
    let v = plan_json(&[
        "--model",
        c,
        "--seq",
        "131072",
        "--cp",
        "8",
        "--sliding-window",
        "40000",
    ]);
    assert_eq!(num(&v, "/ring/hops"), 3.0);
    let nul = mistral_config("nowindow", "null");
    let v = plan_json(&[
        "--model",
        nul.to_str().unwrap(),
        "--seq",
        "131072",
        "--cp",
        "8",
    ]);
    assert_eq!(num(&v, "/ring/hops"), 7.0);

    // Zero is an error naming the flag, or the config field.
    let out = candle_cp(&[
        "plan",
        "--model",
        "llama3-8b",
        "--seq",
        "8192",
        "--sliding-window",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--sliding-window must be at least 1"),
        "{stderr}"
    );
    let zero = mistral_config("zero", "0");
    let out = candle_cp(&["plan", "--model", zero.to_str().unwrap(), "--seq", "8192"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("'sliding_window' must be a positive integer"),
        "{stderr}"
    );
    for p in [cfg, nul, zero] {
        if let Some(d) = p.parent() {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[test]
fn plan_doc_len_flag() {
    let num = |v: &serde_json::Value, p: &str| {
        v.pointer(p)
            .and_then(|x| x.as_f64())
            .unwrap_or_else(|| panic!("no number at {p}"))
    };
    let base = ["--model", "llama3-8b", "--seq", "131072", "--cp", "16"];
    let causal = plan_json(&base);
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        plan_json(&a)
    };
    let d = with(&["--doc-len", "4096"]);
    // 32 documents of 4096: 32·4096·4097/2 pairs; forward 4·pairs·a·d.
    assert_eq!(
        num(&d, "/flops/attention_fwd"),
        4.0 * 32.0 * (4096.0 * 4097.0 / 2.0) * 4096.0
    );
    assert_eq!(num(&d, "/flops/doc_len"), 4096.0);
    assert_eq!(num(&d, "/input/doc_len"), 4096.0);
    assert!(causal.pointer("/input/doc_len").is_none());
    // c = 8192 ≥ L − 1: one hop instead of 15, the same bytes per hop.
    assert_eq!(num(&d, "/ring/hops"), 1.0);
    assert_eq!(num(&causal, "/ring/hops"), 15.0);
    let step = num(&d, "/ring/step_bytes");
    assert_eq!(step, num(&causal, "/ring/step_bytes"));
    assert_eq!(num(&d, "/ring/bwd_bytes_per_layer"), 3.0 * step);
    // Across nodes the step no longer hides (it does without documents).
    assert_eq!(
        d.pointer("/ring/hides_fwd").and_then(|x| x.as_bool()),
        Some(false)
    );
    assert_eq!(
        causal.pointer("/ring/hides_fwd").and_then(|x| x.as_bool()),
        Some(true)
    );
    // L ≥ s: the numbers without documents.
    let one = with(&["--doc-len", "131072"]);
    for p in ["/flops", "/ring", "/layer_time", "/verdict"] {
        assert_eq!(one.pointer(p), causal.pointer(p), "{p}");
    }
    // A window inside the documents: m = min(L, w).
    let dw = with(&["--doc-len", "20000", "--sliding-window", "9000"]);
    assert_eq!(num(&dw, "/ring/hops"), 2.0);
    assert_eq!(num(&with(&["--doc-len", "20000"]), "/ring/hops"), 3.0);

    let out = candle_cp(&[
        "plan",
        "--model",
        "llama3-8b",
        "--seq",
        "131072",
        "--cp",
        "16",
        "--doc-len",
        "4096",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "packed documents of 4096 (32 per sequence): attention 4.40 TFLOP/layer (vs 141 TFLOP causal, 32.0x less); ring: halo of 1 hop(s) on contiguous shards (15 for the full ring)",
        "against 671.1 us / 1.34 ms per K/V transfer, 1 hop(s) (15 without): NOT hidden",
        "zigzag would keep the full ring (15 hops)",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    let out = candle_cp(&[
        "plan",
        "--model",
        "llama3-8b",
        "--seq",
        "8192",
        "--doc-len",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--doc-len must be at least 1 token, got 0"),
        "{stderr}"
    );
}

/// `--regather-heads`: the layout says so, the candle-cp count drops the head-layout copies
/// and the Ulysses backward sends the forward's bytes once more.
#[test]
fn plan_regather_heads_flag() {
    let base = ["--model", "llama3-405b", "--seq", "131072", "--tp", "8", "--sp", "--cp", "16", "--cp-kind", "ulysses", "--activations", "candle-cp"];
    let kept = plan_json(&base);
    let mut args = base.to_vec();
    args.push("--regather-heads");
    let re = plan_json(&args);
    let num = |v: &serde_json::Value, p: &str| v.pointer(p).and_then(|x| x.as_f64()).unwrap_or_else(|| panic!("no number at {p}"));
    assert_eq!(re.pointer("/input/layout/regather_heads").and_then(|x| x.as_bool()), Some(true));
    assert_eq!(kept.pointer("/input/layout/regather_heads").and_then(|x| x.as_bool()), Some(false));
    let per_gpu = "/activation_bytes_per_layer_per_gpu";
    assert!(num(&re, per_gpu) < num(&kept, per_gpu), "{} vs {}", num(&re, per_gpu), num(&kept, per_gpu));
    assert_eq!(num(&re, "/ulysses/fwd_bytes_per_layer"), num(&kept, "/ulysses/fwd_bytes_per_layer"));
    assert_eq!(
        num(&re, "/ulysses/bwd_bytes_per_layer"),
        num(&kept, "/ulysses/bwd_bytes_per_layer") + num(&kept, "/ulysses/fwd_bytes_per_layer")
    );
}

/// `plan --row-sums f32|output`: Ulysses 16 at 405B / 128k (bf16, candle-cp count) keeps the
/// output's bf16 residual with `f32`, `2·a_t·d·c` bytes per layer and GPU (16 heads per TP
/// rank, d = 128, c = 8192 tokens), the Ulysses bytes unchanged; the ring keeps it by default
/// and drops it with `output`.
#[test]
fn plan_row_sums_flag() {
    let base = ["--model", "llama3-405b", "--seq", "131072", "--tp", "8", "--sp", "--cp", "16", "--activations", "candle-cp"];
    let num = |v: &serde_json::Value, p: &str| v.pointer(p).and_then(|x| x.as_f64()).unwrap_or_else(|| panic!("no number at {p}"));
    let per_gpu = "/activation_bytes_per_layer_per_gpu";
    let residual = 2.0 * 16.0 * 128.0 * 8192.0;
    for (kind, rows, added) in [("ulysses", "f32", residual), ("ulysses", "output", 0.0), ("ring", "f32", 0.0), ("ring", "output", -residual)] {
        let mut args = base.to_vec();
        args.extend(["--cp-kind", kind]);
        let default = plan_json(&args);
        assert!(default.pointer("/input/layout/f32_row_sums").is_some_and(|x| x.is_null()));
        args.extend(["--row-sums", rows]);
        let set = plan_json(&args);
        assert_eq!(set.pointer("/input/layout/f32_row_sums").and_then(|x| x.as_bool()), Some(rows == "f32"));
        assert_eq!(num(&set, per_gpu) - num(&default, per_gpu), added, "{kind} {rows}");
        if kind == "ulysses" {
            assert_eq!(num(&set, "/ulysses/bwd_bytes_per_layer"), num(&default, "/ulysses/bwd_bytes_per_layer"));
        }
    }
}

/// Qwen2.5 and Qwen3 presets and a Qwen2 `config.json`: q, k, v biases, no window unless the config
/// turns it on for every layer, and the 28 heads of the 7B refusing a Ulysses degree of 8.
#[test]
fn plan_qwen_presets_and_config() {
    let preset = plan_json(&["--model", "qwen2.5-7b", "--seq", "8192"]);
    let model = |v: &serde_json::Value, k: &str| v.pointer(&format!("/input/model/{k}")).cloned().unwrap_or_default();
    assert_eq!(model(&preset, "qkv_bias"), serde_json::json!(true));
    assert_eq!((model(&preset, "heads"), model(&preset, "kv_heads"), model(&preset, "vocab")), (28.into(), 4.into(), 152064.into()));
    let dir = std::env::temp_dir().join(format!("candle-cp-plan-cli-qwen2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = |tag: &str, extra: &str| {
        let p = dir.join(format!("{tag}.json"));
        std::fs::write(
            &p,
            format!(
                r#"{{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":3584,"intermediate_size":18944,
                "num_hidden_layers":28,"num_attention_heads":28,"num_key_value_heads":4,"vocab_size":152064,
                "tie_word_embeddings":false,"sliding_window":131072{extra}}}"#
            ),
        )
        .unwrap();
        p
    };
    // as Qwen2.5-7B ships it: the window is off (use_sliding_window false, max_window_layers 28)
    let shipped = cfg("shipped", r#","use_sliding_window":false,"max_window_layers":28"#);
    let v = plan_json(&["--model", shipped.to_str().unwrap(), "--seq", "8192"]);
    for k in ["hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "qkv_bias"] {
        assert_eq!(model(&v, k), model(&preset, k), "{k}");
    }
    assert!(model(&v, "sliding_window").is_null());
    let all = cfg("all", r#","use_sliding_window":true,"max_window_layers":0"#);
    let v = plan_json(&["--model", all.to_str().unwrap(), "--seq", "8192"]);
    assert_eq!(model(&v, "sliding_window"), serde_json::json!(131072));
    // a window on the layers from 20 on (or as layer_types says): the sliding layers priced
    // apart (the window's attention FLOPs), the layer time the average of the two kinds
    let none = plan_json(&["--model", shipped.to_str().unwrap(), "--seq", "262144"]);
    let num = |v: &serde_json::Value, p: &str| v.pointer(p).and_then(|x| x.as_f64()).unwrap_or_else(|| panic!("no number at {p}"));
    let types: Vec<&str> = (0..28).map(|i| if i % 4 == 3 { "full_attention" } else { "sliding_attention" }).collect();
    let listed = format!(r#","use_sliding_window":true,"layer_types":{}"#, serde_json::json!(types));
    for (tag, extra, k) in [("some", r#","use_sliding_window":true,"max_window_layers":20"#.to_string(), 8), ("listed", listed, 21)] {
        let v = plan_json(&["--model", cfg(tag, &extra).to_str().unwrap(), "--seq", "262144"]);
        assert!(model(&v, "sliding_window").is_null());
        assert_eq!(model(&v, "partial_window"), serde_json::json!([131072, k]), "{tag}");
        let notes = v["notes"].to_string();
        assert!(notes.contains(&format!("sliding window 131072 on {k} of 28 layers: their attention is the window's")), "{tag}: {notes}");
        assert_eq!((num(&v, "/sliding/window"), num(&v, "/sliding/layers")), (131072.0, k as f64), "{tag}");
        // 4·q_dim·(s·w − w·(w−1)/2) per sequence: 3/4 of the causal 2·s²·q_dim at w = s/2
        let (sf, w) = (262144f64, 131072f64);
        assert_eq!(num(&v, "/sliding/flops/attention_fwd"), 4.0 * 3584.0 * (sf * w - w * (w - 1.0) / 2.0), "{tag}");
        assert_eq!(num(&v, "/flops/attention_fwd"), num(&none, "/flops/attention_fwd"), "{tag}");
        let (full_s, slide_s) = (num(&none, "/layer_time/attention_s"), num(&v, "/sliding/attention_s"));
        assert!(slide_s < 0.76 * full_s && slide_s > 0.74 * full_s, "{tag}: {slide_s} vs {full_s}");
        let avg = ((28 - k) as f64 * full_s + k as f64 * slide_s) / 28.0;
        assert!((num(&v, "/layer_time/attention_s") - avg).abs() <= 1e-12 * avg, "{tag}");
        assert!(num(&v, "/step/compute_s") < num(&none, "/step/compute_s"), "{tag}");
    }
    assert!(none.pointer("/sliding").is_some_and(|x| x.is_null()));
    let out = candle_cp(&["plan", "--model", "qwen2.5-7b", "--seq", "131072", "--cp", "8", "--cp-kind", "ulysses"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let msg = "Ulysses degree 8 does not divide the 28 query heads";
    assert!(stderr.contains(msg), "{stderr:?} lacks {msg:?}");
    // Qwen3: head norms, D = 128 on the 32B's 5120-wide model
    let q3 = plan_json(&["--model", "qwen3-32b", "--seq", "8192"]);
    assert_eq!((model(&q3, "qk_norm"), model(&q3, "head_dim"), model(&q3, "hidden")), (true.into(), 128.into(), 5120.into()));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A reward model's config plans its score head: `--lora-modules-to-save score` trains it whole
/// (its `n·h` parameters, not a vocabulary's rows), `lm_head` is refused for it and `score` for a
/// causal LM.
#[test]
fn plan_reward_model_score_head() {
    let dir = std::env::temp_dir().join(format!("candle-cp-plan-rm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.json");
    std::fs::write(
        &path,
        r#"{"architectures":["LlamaForSequenceClassification"],"hidden_size":4096,"num_hidden_layers":32,
           "num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"vocab_size":128256,"num_labels":1}"#,
    )
    .unwrap();
    let rm = path.to_str().unwrap();
    let v = plan_json(&["--model", rm, "--seq", "8192", "--lora", "8", "--lora-modules-to-save", "score"]);
    assert_eq!(v.pointer("/input/model/score_head/labels").and_then(|x| x.as_u64()), Some(1), "{v}");
    let lm = plan_json(&["--model", "llama3-8b", "--seq", "8192", "--lora", "8", "--lora-modules-to-save", "lm_head"]);
    let params = |v: &serde_json::Value| v.pointer("/model_states/params").and_then(|x| x.as_f64()).unwrap_or(f64::NAN);
    // (the reward model: the LM head's 128256·4096 gone, a score head of 4096 in its place)
    assert_eq!(params(&lm) - params(&v), (128256.0 - 1.0) * 4096.0, "{} vs {}", params(&lm), params(&v));
    for (model, module, msg) in [(rm, "lm_head", "is a reward model, its head is score"), ("llama3-8b", "score", "is a causal LM, its head is lm_head")] {
        let out = candle_cp(&["plan", "--model", model, "--seq", "8192", "--lora", "8", "--lora-modules-to-save", module]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.code() == Some(2) && stderr.contains(msg), "{module}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
