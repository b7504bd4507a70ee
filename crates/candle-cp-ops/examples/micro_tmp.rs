use candle_core::{Device, Tensor};
use candle_cp_ops::attention::{attention_bwd, attention_fwd, Mask};
fn cpu_seconds() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = s.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}
fn main() {
    let t: usize = std::env::args().nth(1).map(|x| x.parse().unwrap()).unwrap_or(2048);
    let reps: usize = std::env::args().nth(2).map(|x| x.parse().unwrap()).unwrap_or(3);
    let (b, h, d) = (1, 8, 64);
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev).unwrap();
    let k = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev).unwrap();
    let v = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev).unwrap();
    let dout = Tensor::randn(0f32, 1.0, (b, t, h, d), &dev).unwrap();
    let m = Mask::causal();
    let fl = 2.0 * (t * t * d * h) as f64;
    for _ in 0..reps {
        let c0 = cpu_seconds(); let w0 = std::time::Instant::now();
        let (o, l) = attention_fwd(&q, &k, &v, &m, 0.125).unwrap();
        let c1 = cpu_seconds(); let w1 = w0.elapsed().as_secs_f64();
        let _g = attention_bwd(&q, &k, &v, &o, &l, &dout, &m, 0.125).unwrap();
        let c2 = cpu_seconds(); let w2 = w0.elapsed().as_secs_f64() - w1;
        println!("T={t} fwd cpu {:.3}s ({:.1} GF/cpu-s) wall {w1:.3} | bwd cpu {:.3}s ({:.1} GF/cpu-s) wall {w2:.3}", c1-c0, fl/(c1-c0)/1e9, c2-c1, 2.5*fl/(c2-c1)/1e9);
    }
}
