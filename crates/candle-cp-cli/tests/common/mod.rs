//! Shared by the binary's integration tests: run the built `candle-cp`.

use std::process::{Command, Output};

/// Run the `candle-cp` binary with `args`, capturing its exit status, stdout and stderr.
pub fn candle_cp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_candle-cp"))
        .args(args)
        .output()
        .expect("cannot run candle-cp")
}

/// Run `candle-cp` with `args` and `--json`; asserts exit 0 and returns the one JSON object it
/// printed.
#[allow(dead_code)] // not every test binary prints JSON
pub fn json(args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = candle_cp(&all);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}
