//! Shared helpers for the workspace-level integration tests (oracle loading, comparisons).

use std::path::PathBuf;

pub mod dense_llama;
pub mod moe_model;
pub mod mla_ref;
pub mod lora_ref;
pub mod peft_files;
pub mod multimodal;
pub mod draws;
pub mod train_draws;
pub mod packed_run;

/// `tests/data/oracle/<sub>` (`sub` = `attn`, `tiny-llama`, or a file below them).
pub fn oracle_dir(sub: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("data/oracle")
        .join(sub)
}

/// `tests/data/oracle/attn/<file>` (e.g. `b2_t256_h8_kv2_d64_causal.safetensors`).
pub fn oracle_attn(file: &str) -> PathBuf {
    oracle_dir("attn").join(file)
}

/// The oracle attention cases `tests/data/oracle/attn/*.safetensors`, sorted by name.
/// Panics unless all 7 are there (or the folder cannot be read).
pub fn oracle_attn_files() -> Vec<PathBuf> {
    let dir = oracle_dir("attn");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    assert_eq!(
        v.len(),
        7,
        "expected the 7 oracle attention cases in {}",
        dir.display()
    );
    v
}

/// The oracle attention case `tests/data/oracle/attn/<name>.safetensors`.
pub fn load_attn_case(name: &str) -> candle_core::Result<candle_cp_ops::oracle::AttnCase> {
    candle_cp_ops::oracle::AttnCase::load(oracle_attn(&format!("{name}.safetensors")))
}

/// Assert that `got` is within `tol` of `reference` (every metric), naming `what` and the
/// metrics over their bound.
pub fn assert_attn_close(
    got: &candle_cp_ops::oracle::AttnOutputs,
    reference: &candle_cp_ops::oracle::AttnOutputs,
    tol: &candle_cp_ops::oracle::AttnTol,
    what: &str,
) -> candle_core::Result<()> {
    let m = candle_cp_ops::oracle::AttnMetrics::compute(got, reference)?;
    assert!(m.passes(tol), "{what}: {:?} over tolerance\n{}", m.failures(tol), m.report(tol));
    Ok(())
}

/// A single-device attention `(q, k, v) -> (out, lse)`, for [`fwd_bwd`].
pub type AttnFn<'a> = dyn Fn(&candle_core::Tensor, &candle_core::Tensor, &candle_core::Tensor) -> candle_core::Result<(candle_core::Tensor, candle_core::Tensor)> + 'a;

/// out, lse and the gradients of `sum(out · dout)` of `f` on `case`'s inputs (candle autograd;
/// `candle_cp_ops::oracle::run_single_with`).
pub fn fwd_bwd(case: &candle_cp_ops::oracle::AttnCase, f: &AttnFn<'_>) -> candle_core::Result<candle_cp_ops::oracle::AttnOutputs> {
    candle_cp_ops::oracle::run_single_with(case, f)
}

/// Uniform in `[-1, 1)`, deterministic for (seed, name) (the randomized tests' inputs).
pub fn rand_t(seed: u64, name: &str, shape: &[usize]) -> candle_core::Result<candle_core::Tensor> {
    use candle_cp_nn::{Region, RngStreams};
    let u = RngStreams::new(seed).uniform(name, 0, &candle_core::Shape::from(shape), &Region::Replicated, &candle_core::Device::Cpu)?;
    (u * 2.0)? - 1.0
}

/// `full`'s tensors as the variables of a `VarMap`, under their names.
pub fn varmap_of<'a>(full: impl IntoIterator<Item = (&'a String, &'a candle_core::Tensor)>) -> candle_core::Result<candle_nn::VarMap> {
    let vm = candle_nn::VarMap::new();
    {
        let mut data = vm.data().lock().map_err(|_| candle_core::Error::Msg("VarMap lock poisoned".into()))?;
        for (k, t) in full {
            data.insert(k.clone(), candle_core::Var::from_tensor(t)?);
        }
    }
    Ok(vm)
}

/// The gradient of `v` in `g`, or an error naming `what`.
pub fn grad(g: &candle_core::backprop::GradStore, v: &candle_core::Tensor, what: &str) -> candle_core::Result<candle_core::Tensor> {
    g.get(v).cloned().ok_or_else(|| candle_core::Error::Msg(format!("no gradient for {what}")))
}
