//! The `candle-cp verify llama` binary: PASS (exit 0) on the tiny-llama oracle, FAIL (exit 1)
//! on a corrupted reference, exit 2 on bad input.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::candle_cp;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle/tiny-llama")
}

/// `candle-cp verify llama <args>`.
fn verify(args: &[&str]) -> Output {
    candle_cp(&[&["verify", "llama"], args].concat())
}

/// `verify llama --model <model> --reference <reference>` plus `args`.
fn verify_with(model: &Path, reference: &Path, args: &[&str]) -> Output {
    let (m, r) = (model.to_str().unwrap(), reference.to_str().unwrap());
    let mut all = vec!["--model", m, "--reference", r];
    all.extend_from_slice(args);
    verify(&all)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// Assert the exit code (showing stdout and stderr on failure); returns stdout.
fn expect_exit(o: &Output, code: i32) -> String {
    let out = stdout(o);
    assert_eq!(
        o.status.code(),
        Some(code),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

#[test]
fn pass_on_oracle_zigzag_cp2() {
    let (m, r) = (tiny(), tiny().join("reference.safetensors"));
    let o = verify_with(&m, &r, &["--layout", "zigzag", "--cp", "2"]);
    let out = expect_exit(&o, 0);
    for k in ["logits_abs", "loss_abs", "grad_rel_max", "worst:", "tol"] {
        assert!(out.contains(k), "{out}");
    }
    assert_eq!(out.lines().last(), Some("PASS"), "{out}");
}

#[test]
fn pass_on_oracle_with_recompute() {
    let (m, r) = (tiny(), tiny().join("reference.safetensors"));
    let o = verify_with(&m, &r, &["--layout", "zigzag", "--cp", "2", "--tp", "2", "--sp", "--recompute"]);
    let out = expect_exit(&o, 0);
    assert!(out.contains("layers recomputed in backward"), "{out}");
    assert_eq!(out.lines().last(), Some("PASS"), "{out}");
}

#[test]
fn fail_on_corrupted_reference() {
    // the file ends with `loss` then the last logits: add 0.5 to the last 64 f32 values
    let mut bytes = std::fs::read(tiny().join("reference.safetensors")).unwrap();
    let n = bytes.len();
    for i in 0..64 {
        let o = n - 4 * (i + 1);
        let x = f32::from_le_bytes(bytes[o..o + 4].try_into().unwrap()) + 0.5;
        bytes[o..o + 4].copy_from_slice(&x.to_le_bytes());
    }
    let dir = std::env::temp_dir().join(format!("candle-cp-verify-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("reference.safetensors");
    std::fs::write(&bad, bytes).unwrap();
    let m = tiny();
    let o = verify_with(&m, &bad, &["--layout", "single"]);
    std::fs::remove_dir_all(&dir).unwrap();
    let out = expect_exit(&o, 1);
    assert_eq!(out.lines().last(), Some("FAIL"), "{out}");
}

#[test]
fn bad_input_exits_2() {
    let r = tiny().join("reference.safetensors");
    let m = tiny();
    // missing checkpoint directory
    let o = verify_with(
        Path::new("/nonexistent/model"),
        &r,
        &["--layout", "zigzag", "--cp", "2"],
    );
    assert_eq!(o.status.code(), Some(2));
    // 8 heads cannot be split over 3 Ulysses ranks: the error names the degrees
    let o = verify_with(&m, &r, &["--layout", "ulysses", "--cp", "3"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("ulysses degree 3"));
    // unknown layout, and a 2d layout without its degrees
    let o = verify_with(&m, &r, &["--layout", "diagonal", "--cp", "2"]);
    assert_eq!(o.status.code(), Some(2));
    let o = verify_with(&m, &r, &["--layout", "2d", "--cp", "4"]);
    assert_eq!(o.status.code(), Some(2));
}
