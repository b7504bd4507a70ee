//! GPU presets: memory, dense bf16 FLOP/s, per-GPU NVLink and InfiniBand bandwidth.

use crate::{plan_bail, Result};
use serde::Serialize;

/// One GPU and its links. Bandwidths are per GPU, one direction, in bytes/s.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Hardware {
    /// Preset name (or "custom").
    pub name: String,
    /// GPU memory in bytes (decimal, as marketed: H100 80e9, H200 141e9).
    pub mem_bytes: f64,
    /// Dense bf16 peak, FLOP/s (H100/H200 SXM: 989e12).
    pub peak_flops: f64,
    /// Intra-node link per GPU, one direction, bytes/s (NVLink 4: 450e9).
    pub nvlink_bw: f64,
    /// Inter-node link per GPU, bytes/s (one 400 Gb/s NIC per GPU: 50e9).
    pub ib_bw: f64,
    /// GPUs sharing one NVLink domain (8 for an HGX node).
    pub gpus_per_node: usize,
}

/// Names accepted by [`Hardware::preset`].
pub const HARDWARE_PRESETS: [&str; 2] = ["h100", "h200"];

impl Hardware {
    /// `h100` (H100 SXM 80 GB) or `h200` (H200 SXM 141 GB); both 989 TFLOP/s dense bf16,
    /// NVLink 450 GB/s one way, InfiniBand 400 Gb/s = 50 GB/s per GPU, 8 GPUs per node.
    pub fn preset(name: &str) -> Result<Self> {
        let mem_gb = match name.to_ascii_lowercase().as_str() {
            "h100" => 80.0,
            "h200" => 141.0,
            _ => plan_bail!(
                "unknown hardware preset '{name}' (known: {})",
                HARDWARE_PRESETS.join(", ")
            ),
        };
        Ok(Self {
            name: name.to_ascii_lowercase(),
            mem_bytes: mem_gb * 1e9,
            peak_flops: 989e12,
            nvlink_bw: 450e9,
            ib_bw: 400e9 / 8.0,
            gpus_per_node: 8,
        })
    }

    /// Checks every quantity is positive and finite.
    pub fn validate(&self) -> Result<()> {
        for (what, x) in [
            ("GPU memory", self.mem_bytes),
            ("FLOP/s", self.peak_flops),
            ("NVLink bandwidth", self.nvlink_bw),
            ("InfiniBand bandwidth", self.ib_bw),
        ] {
            if !(x.is_finite() && x > 0.0) {
                plan_bail!("hardware {}: {what} must be positive, got {x}", self.name)
            }
        }
        if self.gpus_per_node == 0 {
            plan_bail!("hardware {}: gpus per node must be at least 1", self.name)
        }
        Ok(())
    }
}

/// Which link a communicator spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Link {
    /// All members inside one node.
    Nvlink,
    /// Members on different nodes: the slowest hop is InfiniBand.
    Ib,
}

impl Link {
    /// The link of a group whose members are `stride` ranks apart and `size` long, with
    /// ranks laid out TP fastest, then CP, then DP/PP (see `Mesh` in candle-cp-comm): the
    /// group stays in a node iff `stride·size <= gpus_per_node`.
    pub fn for_group(stride: usize, size: usize, hw: &Hardware) -> Self {
        if stride * size <= hw.gpus_per_node {
            Link::Nvlink
        } else {
            Link::Ib
        }
    }

    /// Bandwidth of this link on `hw`, bytes/s.
    pub fn bandwidth(self, hw: &Hardware) -> f64 {
        match self {
            Link::Nvlink => hw.nvlink_bw,
            Link::Ib => hw.ib_bw,
        }
    }

    /// "NVLink" or "InfiniBand".
    pub fn label(self) -> &'static str {
        match self {
            Link::Nvlink => "NVLink",
            Link::Ib => "InfiniBand",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_and_links() -> Result<()> {
        let h = Hardware::preset("H100")?;
        assert_eq!((h.mem_bytes, h.ib_bw, h.nvlink_bw), (80e9, 50e9, 450e9));
        assert_eq!(Hardware::preset("h200")?.mem_bytes, 141e9);
        assert!(Hardware::preset("a100")
            .unwrap_err()
            .0
            .contains("unknown hardware preset 'a100'"));
        assert_eq!(Link::for_group(1, 8, &h), Link::Nvlink);
        assert_eq!(Link::for_group(8, 16, &h), Link::Ib);
        assert_eq!(Link::for_group(2, 4, &h), Link::Nvlink);
        let mut bad = h.clone();
        bad.ib_bw = 0.0;
        assert!(bad
            .validate()
            .unwrap_err()
            .0
            .contains("InfiniBand bandwidth must be positive"));
        Ok(())
    }
}
