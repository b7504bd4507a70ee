use candle_core::{DType, Device, Tensor};
use candle_cp_comm::run_ranks;
use candle_cp_llama::*;
use candle_nn::VarBuilder;
use std::time::Instant;
fn main() -> candle_core::Result<()> {
    let cfg = LlamaConfig::from_file("tests/data/oracle/tiny-llama/config.json")?;
    let t = 2048;
    let ids = Tensor::rand(0f32, 500., (1, t), &Device::Cpu)?.to_dtype(DType::U32)?;
    for layout in [Layout::single(), Layout::cp(CpKind::Zigzag, 2), Layout::cp(CpKind::Zigzag, 4)] {
        let r = run_ranks(layout.world_size(), |world| {
            let ctx = ParallelCtx::new(world, layout)?;
            let full = init_params(&cfg, 42, DType::F32, &Device::Cpu)?;
            let vm = shard_params(&full, &cfg, &ctx)?;
            let model = Llama::new(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &cfg, &ctx)?;
            let b = shard_batch(&ids, &ctx)?;
            let mut out = vec![];
            for _ in 0..3 {
                let t0 = Instant::now();
                let (loss, _l) = model.loss(&b.input_ids, &b.labels, &b.positions)?;
                let t1 = t0.elapsed().as_secs_f64();
                let mut grads = loss.backward()?;
                let t2 = t0.elapsed().as_secs_f64();
                reduce_gradients(&mut grads, &vm, &cfg, &ctx)?;
                let t3 = t0.elapsed().as_secs_f64();
                out.push((t1, t2 - t1, t3 - t2));
            }
            Ok(out)
        });
        println!("{layout}: {:?}", r[0].as_ref().unwrap());
    }
    Ok(())
}
