//! `candle-cp plan`'s optimizer-step model and `candle-cp search` end to end: the step of
//! Llama 3's own 405B / 128k layout, a search whose winner `plan` reproduces, and exit code 2
//! with a message on bad input.

mod common;
use common::{candle_cp, json};

fn num(v: &serde_json::Value, p: &str) -> f64 {
    v.pointer(p).and_then(|x| x.as_f64()).unwrap_or_else(|| panic!("{p} missing in {v}"))
}

/// Llama 3 405B's 128k layout on 16,384 GPUs (TP 8 + SP, CP 16, PP 16 interleaved with 2
/// model chunks per GPU, DP 8; 128 sequences per step, so k = 16): the step is
/// k + (pp − 1)/v stages plus the exposed sync, 2^24 tokens, and the MFU follows from the
/// model FLOPs.
#[test]
fn plan_step_of_the_llama3_layout() {
    let v = json(&[
        "plan", "--model", "llama3-405b", "--seq", "131072", "--tp", "8", "--sp", "--cp", "16",
        "--pp", "16", "--virtual-stages", "2", "--dp", "8", "--micro-batches", "16",
    ]);
    let s = |p: &str| num(&v, &format!("/step/{p}"));
    assert_eq!(s("micro_batches"), 16.0);
    assert_eq!(s("stage_layers"), 8.0); // 2 chunks of ceil(126/32) = 4 layers
    assert!((s("bubble_fraction") - 15.0 / 47.0).abs() < 1e-12);
    assert!((s("compute_s") - 23.5 * s("stage_s")).abs() < 1e-9);
    assert!((s("step_s") - s("compute_s") - s("pp_exposed_s") - s("sync_exposed_s")).abs() < 1e-9);
    // the default overlap is "all": the sync left is the planner's overlapped gather figure
    assert_eq!(s("sync_exposed_s"), num(&v, "/grad_sync/exposed_gather_overlapped_s"));
    assert!(s("step_s") <= s("step_s_no_overlap"));
    assert_eq!(s("tokens_per_step"), 16_777_216.0);
    // 2 chunks x (activation forward + gradient backward) of 8192 tokens x 16384 x bf16 / TP 8
    assert_eq!(s("pp_sends_bytes"), 134_217_728.0);
    let world = 16384.0;
    assert!((s("mfu") - s("model_flops_per_step") / (world * s("step_s") * 989e12)).abs() < 1e-12);
    assert!(s("mfu") > 0.2 && s("mfu") < 0.6, "{}", s("mfu"));
    // k defaults to pp; --overlap none charges the whole sync
    let d = json(&["plan", "--model", "llama3-405b", "--seq", "131072", "--tp", "8", "--sp", "--cp", "16", "--pp", "16", "--overlap", "none"]);
    assert_eq!(num(&d, "/step/micro_batches"), 16.0);
    assert_eq!(num(&d, "/step/step_s"), num(&d, "/step/step_s_no_overlap"));
    // fewer micro-batches than stages: fewer in flight, and a note on the bubble
    let few = json(&["plan", "--model", "llama3-405b", "--seq", "131072", "--tp", "8", "--sp", "--cp", "16", "--pp", "16", "--micro-batches", "4"]);
    assert_eq!(num(&few, "/activations/in_flight_microbatches"), 4.0);
    let notes = few["notes"].to_string();
    assert!(notes.contains("the pipeline never fills"), "{notes}");
}

/// The search's rows are layouts of exactly the GPUs asked for, that split the batch, fit and
/// are ranked; `plan` with the winner's flags gives the same step.
#[test]
fn search_ranks_and_plan_reproduces_the_winner() {
    let common = ["--model", "llama3-70b", "--seq", "65536", "--hardware", "h200"];
    let mut args = vec!["search"];
    args.extend_from_slice(&common);
    args.extend_from_slice(&["--gpus", "256", "--global-batch", "64", "--top", "5"]);
    let v = json(&args);
    let best = v["best"].as_array().expect("best is a list");
    assert_eq!(best.len(), 5);
    assert!(num(&v, "/fitting") >= 5.0 && num(&v, "/evaluated") >= num(&v, "/fitting"));
    let steps: Vec<f64> = best.iter().map(|c| num(c, "/step/step_s")).collect();
    for (n, c) in best.iter().enumerate() {
        let l = |k: &str| num(c, &format!("/layout/{k}"));
        assert_eq!(l("tp") * l("cp") * l("pp") * l("dp"), 256.0, "{c}");
        assert_eq!(l("dp") * num(c, "/micro_batches"), 64.0, "{c}");
        assert!(num(c, "/memory_per_gpu_bytes") <= 141e9);
        // ranked by step; steps within 0.5% of each other simplest first
        let rest = steps[n..].iter().cloned().fold(f64::INFINITY, f64::min);
        assert!(steps[n] <= rest * 1.005, "row {n}: {steps:?}");
    }
    let w = &best[0];
    let l = |k: &str| num(w, &format!("/layout/{k}")).to_string();
    let (tp, cp, pp, dp, k, zero) = (l("tp"), l("cp"), l("pp"), l("dp"), num(w, "/micro_batches").to_string(), l("zero"));
    let kind = w.pointer("/layout/cp_kind").and_then(|x| x.as_str()).unwrap().to_string();
    let (u, v) = (l("ulysses"), l("virtual_stages"));
    let recompute = w.pointer("/layout/recompute").and_then(|x| x.as_str()).unwrap().to_string();
    let mut plan = vec!["plan"];
    plan.extend_from_slice(&common);
    plan.extend_from_slice(&["--tp", &tp, "--cp", &cp, "--pp", &pp, "--dp", &dp, "--micro-batches", &k, "--zero", &zero, "--cp-kind", &kind, "--ulysses", &u, "--virtual-stages", &v, "--recompute", &recompute]);
    if w.pointer("/layout/sp").and_then(|x| x.as_bool()).unwrap() {
        plan.push("--sp");
    }
    let p = json(&plan);
    assert_eq!(p["step"], w["step"]);
    assert_eq!(p["fits"], serde_json::Value::Bool(true));

    // the table for people names the winner's flags
    let mut t = vec!["search"];
    t.extend_from_slice(&common);
    t.extend_from_slice(&["--gpus", "256", "--global-batch", "64", "--top", "5"]);
    let out = candle_cp(&t);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    assert!(text.contains("tok/s/GPU") && text.contains(&format!("--tp {tp} --cp {cp} --pp {pp} --dp {dp}")), "{text}");
}

#[test]
fn search_bad_input_exits_2_with_message() {
    let base = ["search", "--model", "llama3-8b", "--seq", "8192"];
    let cases: [(&[&str], &str); 6] = [
        (&["--gpus", "0", "--global-batch", "8"], "--gpus (0)"),
        (&["--gpus", "8", "--global-batch", "8", "--zero", "1,7"], "got 7"),
        (&["--gpus", "8", "--global-batch", "8", "--zero", "x"], "'x' is not a ZeRO stage"),
        (&["--gpus", "8", "--global-batch", "8", "--cp-kinds", "ring,tree"], "unknown CP kind 'tree'"),
        (&["--gpus", "6", "--global-batch", "5", "--max-tp", "1"], "no layout of 6 GPUs"),
        (&["--gpus", "8", "--global-batch", "8", "--overlap", "sideways"], "unknown overlap 'sideways'"),
    ];
    for (args, msg) in cases {
        let mut all = base.to_vec();
        all.extend_from_slice(args);
        let out = candle_cp(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(msg), "{args:?}: stderr {stderr:?} lacks {msg:?}");
    }
    let out = candle_cp(&["plan", "--model", "llama3-8b", "--seq", "8192", "--micro-batches", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--micro-batches must be at least 1"), "{stderr}");
}

/// `--finetune-llama`: every row is a layout the trainer runs, and every flag it prints is one
/// of `examples/finetune_llama`'s (read from its `Args` in `finetune_args.rs`, so a renamed flag
/// fails here).
#[test]
fn search_for_finetune_llama_prints_its_flags() {
    let v = json(&[
        "search", "--model", "llama3-8b", "--seq", "131072", "--hardware", "h200", "--gpus", "16",
        "--global-batch", "16", "--finetune-llama", "--zero", "0,1,2,3", "--top", "40",
    ]);
    let src = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/finetune_args.rs")).unwrap();
    let start = src.find("struct Args {").expect("finetune_llama has an Args struct");
    let body = &src[start..start + src[start..].find("\n}").unwrap()];
    let known: Vec<String> = body
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
            let (name, _) = l.split_once(": ")?;
            (!name.starts_with("//") && !name.starts_with('#') && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .then(|| format!("--{}", name.replace('_', "-")))
        })
        .collect();
    assert!(known.contains(&"--grad-accum".to_string()) && known.contains(&"--overlap-param-gather".to_string()), "{known:?}");
    let best = v["best"].as_array().unwrap();
    assert!(best.len() > 5);
    for c in best {
        assert_eq!(num(c, "/layout/pp"), 1.0, "{c}");
        assert!(num(c, "/layout/zero") <= 2.0, "{c}");
        let f = c["finetune_llama_flags"].as_str().expect("flags on every row");
        for flag in f.split_whitespace().filter(|w| w.starts_with("--")) {
            assert!(known.iter().any(|k| k == flag), "{flag} is not a finetune_llama flag ({f})");
        }
    }
    // the trainer's layouts are judged by what our Llama keeps, unless --activations says
    assert_eq!(v["activation_model"], "candle-cp");
    let asked = json(&["search", "--model", "llama3-8b", "--seq", "131072", "--gpus", "16", "--global-batch", "16", "--finetune-llama", "--activations", "llama"]);
    assert_eq!(asked["activation_model"], "llama");
    // without --finetune-llama, no trainer flags and the default count
    let plain = json(&["search", "--model", "llama3-8b", "--seq", "131072", "--gpus", "16", "--global-batch", "16"]);
    assert!(plain["best"][0].get("finetune_llama_flags").is_none());
    assert_eq!(plain["activation_model"], "korthikanti");
}

/// `--attn-rates bench.jsonl` (gpu_bench's lines): attention at the rate measured for the
/// layout's kernel length, in `plan` and in `search`; bad files and `--attn-tflops` beside it
/// are refused.
#[test]
fn measured_attention_rates_from_gpu_bench_lines() {
    let dir = std::env::temp_dir().join(format!("candle-cp-rates-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bench.jsonl");
    std::fs::write(
        &file,
        concat!(
            "{\"impl\":\"candle-cp\",\"kernel\":\"WgmmaTma\",\"t\":4096,\"causal\":false,\"fwd_tflops\":300.0,\"bwd_tflops\":250.0}\n",
            "{\"impl\":\"candle-cp\",\"kernel\":\"WgmmaTma\",\"t\":16384,\"causal\":false,\"fwd_tflops\":500.0,\"bwd_tflops\":400.0}\n",
            "{\"skipped\":\"budget\",\"t\":32768,\"causal\":false}\n",
        ),
    )
    .unwrap();
    let f = file.to_str().unwrap();
    // ring CP 16 at 128k: 8192-token chunks, halfway (in log T) between the two rows
    let v = json(&["plan", "--model", "llama3-8b", "--seq", "131072", "--cp", "16", "--attn-rates", f]);
    assert_eq!(num(&v, "/attn_kernel_tokens"), 8192.0);
    let want = 3.5 / (1.0 / 400.0 + 2.5 / 325.0) * 1e12;
    assert!((num(&v, "/attn_flops_used") / want - 1.0).abs() < 1e-9, "{}", num(&v, "/attn_flops_used"));
    let s = json(&["search", "--model", "llama3-8b", "--seq", "131072", "--gpus", "16", "--global-batch", "16", "--attn-rates", f]);
    assert!(!s["best"].as_array().unwrap().is_empty());
    for (args, msg) in [
        (vec!["--attn-rates", "/nonexistent/bench.jsonl"], "--attn-rates /nonexistent/bench.jsonl"),
        (vec!["--attn-rates", f, "--attn-tflops", "500"], "cannot be used with"),
    ] {
        let mut all = vec!["plan", "--model", "llama3-8b", "--seq", "8192"];
        all.extend(args);
        let out = candle_cp(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(msg), "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
