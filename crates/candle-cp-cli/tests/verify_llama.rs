//! The `candle-cp verify llama` binary: PASS (exit 0) on the tiny-llama oracle, FAIL (exit 1)
//! on a corrupted reference, exit 2 on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle/tiny-llama")
}

fn verify(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_candle-cp"))
        .args(["verify", "llama"])
        .args(args)
        .output()
        .expect("cannot run candle-cp")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

#[test]
fn pass_on_oracle_zigzag_cp2() {
    let (m, r) = (tiny(), tiny().join("reference.safetensors"));
    let o = verify(&[
        "--model",
        m.to_str().unwrap(),
        "--reference",
        r.to_str().unwrap(),
        "--layout",
        "zigzag",
        "--cp",
        "2",
    ]);
    let out = stdout(&o);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for k in ["logits_abs", "loss_abs", "grad_rel_max", "worst:", "tol"] {
        assert!(out.contains(k), "{out}");
    }
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
    let o = verify(&[
        "--model",
        m.to_str().unwrap(),
        "--reference",
        bad.to_str().unwrap(),
        "--layout",
        "single",
    ]);
    std::fs::remove_dir_all(&dir).unwrap();
    let out = stdout(&o);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(out.lines().last(), Some("FAIL"), "{out}");
}

#[test]
fn bad_input_exits_2() {
    let r = tiny().join("reference.safetensors");
    let m = tiny();
    // missing checkpoint directory
    let o = verify(&[
        "--model",
        "/nonexistent/model",
        "--reference",
        r.to_str().unwrap(),
        "--layout",
        "zigzag",
        "--cp",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(2));
    // 8 heads cannot be split over 3 Ulysses ranks: the error names the degrees
    let o = verify(&[
        "--model",
        m.to_str().unwrap(),
        "--reference",
        r.to_str().unwrap(),
        "--layout",
        "ulysses",
        "--cp",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("ulysses degree 3"));
    // unknown layout, and a 2d layout without its degrees
    let o = verify(&[
        "--model",
        m.to_str().unwrap(),
        "--reference",
        r.to_str().unwrap(),
        "--layout",
        "diagonal",
        "--cp",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let o = verify(&[
        "--model",
        m.to_str().unwrap(),
        "--reference",
        r.to_str().unwrap(),
        "--layout",
        "2d",
        "--cp",
        "4",
    ]);
    assert_eq!(o.status.code(), Some(2));
}
