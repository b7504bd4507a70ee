//! Shared helpers for the workspace-level integration tests (oracle loading, comparisons).

use std::path::PathBuf;

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
