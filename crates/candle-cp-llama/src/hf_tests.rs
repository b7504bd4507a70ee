//! Tests of `hf` (included by `hf.rs`).

use super::*;
use crate::params::init_params;

#[test]
fn save_then_load_round_trip_f32_and_bf16() -> Result<()> {
    let mut cfg = LlamaConfig::tiny(64, 32, 2, 4, 2);
    cfg.tie_word_embeddings = true;
    for dtype in [DType::F32, DType::BF16] {
        // a sliding window survives save + load (f32), and so does its absence (bf16)
        let cfg = cfg.clone().with_sliding_window((dtype == DType::F32).then_some(48));
        let dir = std::env::temp_dir().join(format!("candle-cp-llama-hf-{}-{dtype:?}", std::process::id()));
        let vm = init_params(&cfg, 7, dtype, &Device::Cpu)?;
        save_hf(&dir, &vm, &cfg)?;
        let (back, cfg2) = load_hf(&dir, &Device::Cpu, dtype)?;
        assert_eq!(cfg, cfg2);
        let (a, b) = (varmap_tensors(&vm)?, varmap_tensors(&back)?);
        assert_eq!(a.len(), b.len());
        assert!(!b.contains_key("lm_head.weight"), "tied: no lm_head tensor");
        for (k, t) in &a {
            let d = (t.to_dtype(DType::F32)? - b[k].to_dtype(DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert_eq!(d, 0.0, "{k}");
            assert_eq!(b[k].dtype(), dtype);
        }
        // the streamed file is byte for byte the in-memory serialisation, which candle's
        // reader accepts
        let file = std::fs::read(dir.join("model.safetensors")).map_err(|e| io_err("reading", &dir, e))?;
        let named: Vec<(String, Tensor)> = a.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
        assert!(file == safetensors_bytes(&named)?, "{dtype:?}: streamed file differs");
        // only the two files, no temporaries left behind
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        names.sort();
        assert_eq!(names, vec!["config.json", "model.safetensors"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

#[test]
fn oracle_checkpoint_round_trips_bit_exactly() -> Result<()> {
    let src = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/oracle/tiny-llama"
    ));
    let (vm, cfg) = load_hf(src, &Device::Cpu, DType::F32)?;
    let dir = std::env::temp_dir().join(format!("candle-cp-llama-hf-oracle-{}", std::process::id()));
    save_hf(&dir, &vm, &cfg)?;
    let orig = load_safetensors_dir(src, &Device::Cpu)?;
    let back = load_safetensors_dir(&dir, &Device::Cpu)?;
    assert_eq!(orig.len(), back.len());
    for (k, t) in &orig {
        let b = &back[k];
        assert_eq!((t.dims(), t.dtype()), (b.dims(), b.dtype()), "{k}");
        assert_eq!(
            t.flatten_all()?.to_vec1::<f32>()?,
            b.flatten_all()?.to_vec1::<f32>()?,
            "{k}"
        );
    }
    assert_eq!(LlamaConfig::from_file(dir.join("config.json"))?, cfg);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn missing_tensor_is_named() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 1, 4, 2);
    let dir = std::env::temp_dir().join(format!("candle-cp-llama-hf-missing-{}", std::process::id()));
    let vm = init_params(&cfg, 1, DType::F32, &Device::Cpu)?;
    let mut t: Vec<(String, Tensor)> = varmap_tensors(&vm)?.into_iter().collect();
    t.retain(|(k, _)| k != "model.norm.weight");
    save_hf_tensors(&dir, &t, &cfg)?;
    let e = load_hf(&dir, &Device::Cpu, DType::F32)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("model.norm.weight"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A damaged weights file (here cut in half) is an error that names the file.
#[test]
fn damaged_weights_file_is_named() -> Result<()> {
    let cfg = LlamaConfig::tiny(64, 32, 1, 4, 2);
    let dir = std::env::temp_dir().join(format!("candle-cp-llama-hf-damaged-{}", std::process::id()));
    save_hf(&dir, &init_params(&cfg, 1, DType::F32, &Device::Cpu)?, &cfg)?;
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).map_err(|e| io_err("reading", &file, e))?;
    std::fs::write(&file, &bytes[..bytes.len() / 2]).map_err(|e| io_err("writing", &file, e))?;
    let e = load_hf(&dir, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains(&file.display().to_string()), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Writes `cfg` and `tensors` as a HF checkpoint sharded over two files with a
/// `model.safetensors.index.json`, as transformers does for large models.
fn save_two_files(dir: &Path, tensors: &[(String, Tensor)], cfg: &LlamaConfig) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| io_err("creating", dir, e))?;
    let (a, b) = tensors.split_at(tensors.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [("model-00001-of-00002.safetensors", a), ("model-00002-of-00002.safetensors", b)] {
        write_atomic(&dir.join(file), &safetensors_bytes(part)?)?;
        for (k, _) in part {
            map.insert(k.clone(), serde_json::Value::String(file.into()));
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": map });
    write_atomic(&dir.join("model.safetensors.index.json"), index.to_string().as_bytes())?;
    write_atomic(&dir.join("config.json"), cfg.to_hf_json("float32").as_bytes())
}

/// Each rank's `load_hf_sharded` equals `shard_params` of the whole `load_hf`, bit for
/// bit, on the oracle checkpoint (one file; 8 heads / 2 KV heads, TP 1, 2, 4 and 8: KV
/// heads replicated at 4 and 8) and on a two-file checkpoint with an index whose vocabulary
/// (37) no TP degree divides (padded rows), in f32 and bf16.
#[test]
fn sharded_load_equals_sharding_the_whole_model() -> Result<()> {
    use crate::layout::Layout;
    let oracle = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/oracle/tiny-llama")).to_path_buf();
    let odd = LlamaConfig::tiny(37, 32, 2, 4, 2);
    let two = std::env::temp_dir().join(format!("candle-cp-llama-hf-two-files-{}", std::process::id()));
    let mut t: Vec<(String, Tensor)> = varmap_tensors(&init_params(&odd, 3, DType::F32, &Device::Cpu)?)?.into_iter().collect();
    t.sort_by(|x, y| x.0.cmp(&y.0));
    save_two_files(&two, &t, &odd)?;
    for (dir, tps) in [(&oracle, vec![1usize, 2, 4, 8]), (&two, vec![1, 2, 4])] {
        for dtype in [DType::F32, DType::BF16] {
            let (whole, cfg) = load_hf(dir, &Device::Cpu, dtype)?;
            for &tp in &tps {
                for r in candle_cp_comm::run_ranks(tp, |g| {
                    let ctx = ParallelCtx::new(g, Layout::single().with_tp(tp, true))?;
                    let want = varmap_tensors(&crate::shard_params(&whole, &cfg, &ctx)?)?;
                    let (got, cfg2) = load_hf_sharded(dir, &ctx, &Device::Cpu, dtype)?;
                    let got = varmap_tensors(&got)?;
                    let mut same = cfg2 == cfg && got.len() == want.len();
                    for (k, w) in &want {
                        let g = &got[k];
                        same &= g.dims() == w.dims() && g.dtype() == dtype;
                        same &= g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()? == w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    }
                    Ok(same)
                }) {
                    assert!(r?, "{} tp {tp} {dtype:?}: the sharded load differs", dir.display());
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&two);
    Ok(())
}

/// The sharded load refuses a layout the heads do not allow before reading, and names a
/// missing or mis-shaped tensor.
#[test]
fn sharded_load_errors_name_the_problem() -> Result<()> {
    use crate::layout::Layout;
    let cfg = LlamaConfig::tiny(64, 32, 1, 4, 2);
    let dir = std::env::temp_dir().join(format!("candle-cp-llama-hf-sharded-errors-{}", std::process::id()));
    let vm = init_params(&cfg, 1, DType::F32, &Device::Cpu)?;
    let mut t: Vec<(String, Tensor)> = varmap_tensors(&vm)?.into_iter().collect();
    t.retain(|(k, _)| k != "model.norm.weight");
    let shapes = [("model.norm.weight".to_string(), Tensor::ones(31, DType::F32, &Device::Cpu)?)];
    let errs = candle_cp_comm::run_ranks(1, |g| {
        let ctx = ParallelCtx::new(g, Layout::single())?;
        let err = |r: Result<(VarMap, LlamaConfig)>| r.err().map(|e| e.to_string()).unwrap_or_default();
        save_hf_tensors(&dir, &t, &cfg)?;
        let missing = err(load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32));
        let mut t2 = t.clone();
        t2.extend(shapes.iter().cloned());
        save_hf_tensors(&dir, &t2, &cfg)?;
        let shape = err(load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32));
        Ok((missing, shape))
    });
    for r in errs {
        let (missing, shape) = r?;
        assert!(missing.contains("model.norm.weight") && missing.contains("[32]"), "{missing}");
        assert!(shape.contains("model.norm.weight") && shape.contains("[31]") && shape.contains("[32]"), "{shape}");
    }
    // TP 3 does not divide 4 heads: refused from the config alone
    for r in candle_cp_comm::run_ranks(3, |g| {
        let ctx = ParallelCtx::new(g, Layout::single().with_tp(3, false));
        Ok(match ctx {
            Err(e) => e.to_string(),
            Ok(ctx) => load_hf_sharded(&dir, &ctx, &Device::Cpu, DType::F32).err().map(|e| e.to_string()).unwrap_or_default(),
        })
    }) {
        let e = r?;
        assert!(e.contains("tp = 3 must divide heads (4)"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// `save_hf_sharded` from the TP shards writes the same bytes as `save_hf_tensors` of the
/// whole model (TP 1, 2, 4; KV heads replicated at 4; V = 37 padded; f32 and bf16), and a
/// writer that cannot write returns the error while the other ranks finish (no hang).
#[test]
fn sharded_save_equals_saving_the_whole_model() -> Result<()> {
    use crate::layout::Layout;
    let cfg = LlamaConfig::tiny(37, 32, 2, 4, 2);
    let root = std::env::temp_dir().join(format!("candle-cp-llama-hf-sharded-save-{}", std::process::id()));
    for dtype in [DType::F32, DType::BF16] {
        let whole = init_params(&cfg, 5, dtype, &Device::Cpu)?;
        let want_dir = root.join(format!("whole-{dtype:?}"));
        save_hf(&want_dir, &whole, &cfg)?;
        let want = std::fs::read(want_dir.join("model.safetensors")).map_err(|e| io_err("reading", &want_dir, e))?;
        for tp in [1usize, 2, 4] {
            let dir = root.join(format!("tp{tp}-{dtype:?}"));
            for r in candle_cp_comm::run_ranks(tp, |g| {
                let ctx = ParallelCtx::new(g, Layout::single().with_tp(tp, true))?;
                let local = varmap_tensors(&crate::shard_params(&whole, &cfg, &ctx)?)?;
                save_hf_sharded(&dir, &local, &cfg, &ctx, ctx.coords.2 == 0)
            }) {
                r?;
            }
            let got = std::fs::read(dir.join("model.safetensors")).map_err(|e| io_err("reading", &dir, e))?;
            assert!(got == want, "tp {tp} {dtype:?}: the sharded save differs from the whole model's");
            assert_eq!(LlamaConfig::from_file(dir.join("config.json"))?, cfg);
        }
    }
    // the writer's directory is a file: its error, the others' Ok, nobody hangs
    let blocked = root.join("a-file");
    std::fs::write(&blocked, b"x").map_err(|e| io_err("writing", &blocked, e))?;
    let whole = init_params(&cfg, 5, DType::F32, &Device::Cpu)?;
    let res = candle_cp_comm::run_ranks(2, |g| {
        let ctx = ParallelCtx::new(g, Layout::single().with_tp(2, false))?;
        let local = varmap_tensors(&crate::shard_params(&whole, &cfg, &ctx)?)?;
        save_hf_sharded(&blocked, &local, &cfg, &ctx, ctx.coords.2 == 0)
    });
    let e = res[0].as_ref().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("a-file"), "{e}");
    assert!(res[1].is_ok(), "{:?}", res[1]);
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
