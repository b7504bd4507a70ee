//! `gpu_check --sections dropout` (included by `gpu_check.rs` with `#[path]`): dropout keep
//! masks drawn on the device (`kernels/dropout.cu`, `candle_cp_kernels::dropout::keep_mask`: the
//! CUDA path of `RngStreams::keep_mask_rows` and `Dropout::mask`) against the host draws, bit
//! for bit: a replicated tensor and sequence shards (`Region`), rows out of order (a zigzag
//! shard's tokens) with a column window (a row-parallel layer's input slice), f32 / f16 / bf16,
//! p of 0.1 and 0.5; columns past the tensor refused.

use super::Report;
use crate::gpu_util::max_abs;
use anyhow::Result;
use candle_core::{DType, Device, Shape};
use candle_cp_nn::{Dropout, Region, RngStreams};

/// Section `dropout`.
pub fn check_dropout(rep: &mut Report, gpu: &Device) -> Result<()> {
    let rng = RngStreams::new(1234);
    for p in [0.1, 0.5] {
        let d = Dropout::new(p, "layers.0.drop")?;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (dims, region) in [
                (vec![2usize, 96, 24], Region::Replicated),
                (vec![2, 24, 24], Region::Sharded { dim: 1, rank: 3, world: 4 }),
                (vec![3, 8, 5, 7], Region::Sharded { dim: 2, rank: 1, world: 2 }),
            ] {
                let shape = Shape::from(dims.clone());
                let name = format!("Dropout::mask p {p} {dtype:?} {dims:?} {region:?}");
                let want = d.mask(&shape, &rng, 7, &region, dtype, &Device::Cpu)?;
                match d.mask(&shape, &rng, 7, &region, dtype, gpu) {
                    Ok(got) if got.device().same_device(gpu) && got.dtype() == dtype => rep.check(&name, max_abs(&got, &want)?, 0.0),
                    Ok(got) => rep.error(&name, format!("{:?} on {:?}", got.dtype(), got.device())),
                    Err(e) => rep.error(&name, e),
                }
            }
            // a zigzag shard's tokens of a 64-token sequence (P = 4, rank 1), features 24.. of 96
            let rows: Vec<u64> = (8..16).chain(48..56).map(|r| r as u64).collect();
            let name = format!("RngStreams::keep_mask_rows p {p} {dtype:?} zigzag rows, columns 24..48 of 96");
            let want = rng.keep_mask_rows("layers.0.q_proj.lora_dropout", 3, &rows, 24..48, 96, p, dtype, &Device::Cpu)?;
            match rng.keep_mask_rows("layers.0.q_proj.lora_dropout", 3, &rows, 24..48, 96, p, dtype, gpu) {
                Ok(got) => rep.check(&name, max_abs(&got, &want)?, 0.0),
                Err(e) => rep.error(&name, e),
            }
        }
    }
    let name = "keep_mask refuses columns past the tensor";
    match candle_cp_kernels::dropout::keep_mask(&[0, 1], 5, 90..100, 96, 0.5, 2.0, DType::F32, gpu) {
        Ok(_) => rep.error(name, "accepted"),
        Err(e) if e.to_string().contains("90..100") && e.to_string().contains("96") => rep.check(name, 0.0, 0.0),
        Err(e) => rep.error(name, e),
    }
    Ok(())
}
