//! Shared by the binary's integration tests: run the built `candle-cp`.

use std::process::{Command, Output};

/// Run the `candle-cp` binary with `args`, capturing its exit status, stdout and stderr.
pub fn candle_cp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_candle-cp"))
        .args(args)
        .output()
        .expect("cannot run candle-cp")
}
