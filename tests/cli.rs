//! Library side of `candle-cp verify attn` (the binary itself is tested in
//! `crates/candle-cp-cli/tests/verify_attn.rs`): load an oracle case, run the single-device
//! layout, compare; a corrupted copy fails, a missing file is an error.

use candle_cp_ops::oracle::{run_single, AttnCase, AttnMetrics};
use candle_cp_tests::oracle_attn as oracle;

#[test]
fn verify_attn_single_passes() {
    let case = AttnCase::load(oracle("b2_t256_h8_kv2_d64_causal.safetensors")).unwrap();
    assert!(case.causal && case.sigma == 1.0 && (case.scale - 0.125).abs() < 1e-12);
    assert_eq!(case.name, "b2_t256_h8_kv2_d64_causal");
    let m = AttnMetrics::compute(&run_single(&case).unwrap(), &case.reference).unwrap();
    let tol = case.tolerances();
    let report = m.report(&tol);
    for name in ["out_abs", "lse_abs", "dq_rel", "dk_rel", "dv_rel"] {
        assert!(report.contains(name), "{report}");
    }
    assert!(m.passes(&tol), "{report}");
}

#[test]
fn verify_attn_corrupted_copy_fails() {
    let src = oracle("b1_t64_h4_kv4_d32_causal.safetensors");
    let mut bytes = std::fs::read(&src).unwrap();
    // perturb the last 64 f32 values of the data section
    let n = bytes.len();
    for i in 0..64 {
        let o = n - 4 * (i + 1);
        let x = f32::from_le_bytes(bytes[o..o + 4].try_into().unwrap()) + 0.5;
        bytes[o..o + 4].copy_from_slice(&x.to_le_bytes());
    }
    let dir = std::env::temp_dir().join(format!("candle-cp-tests-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.safetensors");
    std::fs::write(&bad, bytes).unwrap();
    let case = AttnCase::load(&bad).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let m = AttnMetrics::compute(&run_single(&case).unwrap(), &case.reference).unwrap();
    assert!(!m.passes(&case.tolerances()), "corrupted case passed: {m:?}");
    assert!(!m.failures(&case.tolerances()).is_empty());
}

#[test]
fn verify_attn_missing_file_is_error() {
    let e = AttnCase::load("/nonexistent/x.safetensors").unwrap_err().to_string();
    assert!(e.contains("/nonexistent/x.safetensors"), "{e}");
}
