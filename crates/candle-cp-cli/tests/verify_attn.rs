//! The `candle-cp verify attn` binary: PASS (exit 0) on a real oracle case, FAIL (exit 1) on
//! a corrupted copy, exit 2 on bad input.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::candle_cp;

fn oracle(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle/attn").join(name)
}

/// `candle-cp verify attn <args>`.
fn verify(args: &[&str]) -> Output {
    candle_cp(&[&["verify", "attn"], args].concat())
}

fn last_line(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).lines().last().unwrap_or("").to_string()
}

/// Copy of an oracle file with 0.5 added to the last 64 f32 values of the data section.
fn corrupted_copy(src: &Path, dir: &Path) -> PathBuf {
    let mut bytes = std::fs::read(src).unwrap();
    let n = bytes.len();
    for i in 0..64 {
        let o = n - 4 * (i + 1);
        let x = f32::from_le_bytes(bytes[o..o + 4].try_into().unwrap()) + 0.5;
        bytes[o..o + 4].copy_from_slice(&x.to_le_bytes());
    }
    let dst = dir.join("corrupted.safetensors");
    std::fs::write(&dst, bytes).unwrap();
    dst
}

#[test]
fn pass_on_oracle_case() {
    let case = oracle("b1_t64_h4_kv4_d32_causal.safetensors");
    let o = verify(&["--case", case.to_str().unwrap(), "--layout", "single"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "stdout:\n{out}\nstderr:\n{}", String::from_utf8_lossy(&o.stderr));
    for m in ["out_abs", "lse_abs", "dq_rel", "dk_rel", "dv_rel"] {
        assert!(out.contains(m), "missing {m} in\n{out}");
    }
    assert!(last_line(&o).starts_with("PASS"), "{out}");
}

#[test]
fn packed_passes_on_every_layout_family() {
    let case = oracle("b1_t64_h4_kv4_d32_causal.safetensors");
    let c = case.to_str().unwrap();
    for layout in [&["--layout", "zigzag", "--cp", "4"][..], &["--layout", "ulysses", "--cp", "2"], &["--layout", "single"]] {
        let o = verify(&[&["--case", c, "--packed"], layout].concat());
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(0), "{layout:?}\n{out}\n{}", String::from_utf8_lossy(&o.stderr));
        assert!(out.contains("documents [24, 64]"), "{out}");
        assert!(last_line(&o).starts_with("PASS"), "{out}");
    }
    // the corrupted copy fails packed too (the second document is compared with the oracle)
    let dir = std::env::temp_dir().join(format!("candle-cp-cli-attn-packed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = corrupted_copy(&oracle("b1_t64_h4_kv4_d32_full.safetensors"), &dir);
    let o = verify(&["--case", bad.to_str().unwrap(), "--packed", "--layout", "zigzag", "--cp", "2"]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stdout));
}

#[test]
fn fail_on_corrupted_copy() {
    let dir = std::env::temp_dir().join(format!("candle-cp-cli-attn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = corrupted_copy(&oracle("b1_t64_h4_kv4_d32_full.safetensors"), &dir);
    let o = verify(&["--case", bad.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stdout));
    assert!(last_line(&o).starts_with("FAIL"));
}

#[test]
fn bad_input_exits_2() {
    let o = verify(&["--case", "/nonexistent/case.safetensors"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/case.safetensors"));
    let case = oracle("b1_t64_h4_kv4_d32_causal.safetensors");
    let o = verify(&["--case", case.to_str().unwrap(), "--layout", "diagonal"]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("diagonal") && err.contains("zigzag") && err.contains("usp"), "{err}");
    let o = verify(&["--case", case.to_str().unwrap(), "--cp", "4"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn cp_layouts_pass_on_thread_ranks() {
    let case = oracle("b2_t256_h8_kv2_d64_causal.safetensors");
    for (layout, p) in [("ring", "2"), ("zigzag", "4"), ("striped", "4"), ("allgather", "2")] {
        let o = verify(&["--case", case.to_str().unwrap(), "--layout", layout, "--cp", p]);
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(0), "{layout} --cp {p}: stdout:\n{out}\nstderr:\n{}", String::from_utf8_lossy(&o.stderr));
        assert!(last_line(&o).starts_with("PASS"), "{layout}: {out}");
    }
    // zigzag needs T % 2P == 0: T = 256 with P = 3 is bad input (exit 2).
    let o = verify(&["--case", case.to_str().unwrap(), "--layout", "zigzag", "--cp", "3"]);
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stdout));
}
