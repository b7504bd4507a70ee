//! Learning-rate schedule: linear warmup, then cosine decay to a floor.

/// Linear warmup over `warmup` steps to `peak`, then cosine decay to `peak · min_ratio` at
/// step `total` (and constant after). Steps are 0-based optimizer steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupCosine {
    /// Peak learning rate.
    pub peak: f64,
    /// Warmup steps (0 = start at the peak).
    pub warmup: usize,
    /// Total optimizer steps of the run.
    pub total: usize,
    /// Final learning rate as a fraction of `peak`.
    pub min_ratio: f64,
}

impl WarmupCosine {
    /// Check the schedule: `peak` finite and >= 0, `min_ratio` in `[0, 1]`. Errors name the
    /// value.
    pub fn validate(&self) -> candle_core::Result<()> {
        if !(self.peak.is_finite() && self.peak >= 0.0) {
            candle_core::bail!("schedule: the peak learning rate must be finite and >= 0, got {}", self.peak)
        }
        if !(0.0..=1.0).contains(&self.min_ratio) {
            candle_core::bail!("schedule: min_ratio (the final learning rate as a fraction of the peak) must be in [0, 1], got {}", self.min_ratio)
        }
        Ok(())
    }

    /// Learning rate of optimizer step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1);
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.peak * (self.min_ratio + (1.0 - self.min_ratio) * cos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        let s = WarmupCosine {
            peak: 1e-3,
            warmup: 10,
            total: 110,
            min_ratio: 0.1,
        };
        // Linear warmup reaching the peak at the last warmup step.
        assert!((s.lr(0) - 1e-4).abs() < 1e-12);
        assert!((s.lr(4) - 5e-4).abs() < 1e-12);
        assert!((s.lr(9) - 1e-3).abs() < 1e-12);
        // Cosine: peak at the start, half-way value at the midpoint, floor at the end.
        assert!((s.lr(10) - 1e-3).abs() < 1e-12);
        assert!((s.lr(60) - 1e-3 * (0.1 + 0.9 * 0.5)).abs() < 1e-12);
        assert!((s.lr(110) - 1e-4).abs() < 1e-12);
        assert!((s.lr(500) - 1e-4).abs() < 1e-12);
        // Monotone non-increasing after warmup.
        for k in 10..120 {
            assert!(s.lr(k + 1) <= s.lr(k) + 1e-15, "step {k}");
        }
        // No warmup.
        let s0 = WarmupCosine {
            peak: 2.0,
            warmup: 0,
            total: 4,
            min_ratio: 0.0,
        };
        assert_eq!(s0.lr(0), 2.0);
        assert!((s0.lr(2) - 1.0).abs() < 1e-12);
        assert!(s0.lr(4).abs() < 1e-12);
    }
}
