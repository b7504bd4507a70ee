//! `candle-cp verify attn --layout ulysses --cp P` and `--layout usp --ulysses U --ring R`:
//! PASS (exit 0) on oracle cases (incl. KV-head replication), exit 2 with a message naming
//! the heads and the degrees that work on bad degrees or flags.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::candle_cp;

fn oracle(name: &str) -> String {
    let p: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/oracle/attn").join(name);
    p.to_string_lossy().into_owned()
}

/// `candle-cp verify attn <args>`.
fn verify(args: &[&str]) -> Output {
    candle_cp(&[&["verify", "attn"], args].concat())
}

fn show(o: &Output) -> String {
    format!("stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn ulysses_and_usp_pass_on_oracle_cases() {
    let case = oracle("b2_t256_h8_kv2_d64_causal.safetensors");
    for args in [
        vec!["--case", &case, "--layout", "ulysses", "--cp", "2"],
        vec!["--case", &case, "--layout", "ulysses", "--cp", "4"], // KV heads replicated 2x
        vec!["--case", &case, "--layout", "usp", "--ulysses", "2", "--ring", "2"],
        vec!["--case", &case, "--layout", "usp", "--ulysses", "4", "--ring", "2"], // replicated
    ] {
        let o = verify(&args);
        assert_eq!(o.status.code(), Some(0), "{args:?}\n{}", show(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        for m in ["out_abs", "lse_abs", "dq_rel", "dk_rel", "dv_rel"] {
            assert!(out.contains(m), "missing {m}: {args:?}\n{out}");
        }
        assert!(out.lines().last().unwrap_or("").starts_with("PASS"), "{args:?}\n{out}");
    }
}

#[test]
fn ulysses_and_usp_bad_degrees_exit_2() {
    let case = oracle("b1_t1000_h6_kv1_d64_causal.safetensors");
    let cases: [(Vec<&str>, &[&str]); 4] = [
        (vec!["--layout", "ulysses", "--cp", "4"], &["H = 6", "P = 4", "[1, 2, 3, 6]"]),
        (vec!["--layout", "ulysses"], &["--cp"]),
        (vec!["--layout", "usp", "--ulysses", "2"], &["--ring"]),
        (vec!["--layout", "usp", "--ulysses", "2", "--ring", "2", "--cp", "3"], &["--cp 3", "4"]),
    ];
    for (args, needles) in cases {
        let mut all = vec!["--case", case.as_str()];
        all.extend(args.iter());
        let o = verify(&all);
        assert_eq!(o.status.code(), Some(2), "{all:?}\n{}", show(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        for n in needles {
            assert!(err.contains(n), "{all:?}: stderr lacks {n:?}\n{err}");
        }
    }
}
