//! Exact blockwise (flash-style) attention that returns the log-sum-exp, its backward, the
//! LSE merge, and `attention_slow` built from plain candle ops for tests.
//!
//! Shapes: q `[B, T, H, D]`, k/v `[B, S, Hkv, D]`, out `[B, T, H, D]`, lse `[B, H, T]`
//! (natural log, f32). Query head `h` uses KV head `h / (H / Hkv)` (GQA/MQA).
//!
//! OWNER: attention helper — API fixed, bodies to be written.

use candle_core::{Result, Tensor};

/// Which (query, key) pairs are visible.
///
/// Positions are *global*: local query row `i` sits at `q_offset + i * q_stride`, local key row
/// `j` at `k_offset + j * k_stride`. Contiguous and zigzag chunks use stride 1; the striped
/// layout (token `t` on rank `t mod P`) uses stride `P`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mask {
    /// Every query sees every key.
    Full,
    /// Query at global position `qp` sees key at `kp` iff `kp <= qp`.
    Causal { q_offset: usize, q_stride: usize, k_offset: usize, k_stride: usize },
}

impl Mask {
    /// Plain causal mask, queries and keys both starting at position 0 with stride 1.
    pub fn causal() -> Self {
        Mask::Causal { q_offset: 0, q_stride: 1, k_offset: 0, k_stride: 1 }
    }
    /// Causal mask for a chunk of queries starting at global `q_offset` paired with a chunk
    /// of keys starting at global `k_offset` (both stride 1).
    pub fn causal_offsets(q_offset: usize, k_offset: usize) -> Self {
        Mask::Causal { q_offset, q_stride: 1, k_offset, k_stride: 1 }
    }
    /// Is key row `j` visible from query row `i` (local indices)?
    pub fn visible(&self, i: usize, j: usize) -> bool {
        match *self {
            Mask::Full => true,
            Mask::Causal { q_offset, q_stride, k_offset, k_stride } => {
                k_offset + j * k_stride <= q_offset + i * q_stride
            }
        }
    }
}
