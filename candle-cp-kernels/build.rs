//! Compiles `kernels/*.cu` to PTX with nvcc, only when the `cuda` feature is on.
//!
//! PTX targets `compute_80` (runs on Ampere and Hopper; the driver JIT-compiles it), except the
//! files in `KERNELS_SM90A` (`compute_90a`, Hopper only). Build it
//! with nvcc 13.0.x: a CUDA 13.0 driver loads PTX only up to its own ISA (9.0). nvcc is
//! `$NVCC`, else `$CUDA_ROOT/bin/nvcc` (also `CUDA_HOME`, `CUDA_PATH`), else `nvcc` on `PATH`.
//! Extra flags: `CANDLE_CP_NVCC_FLAGS` (space separated).
use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: &[&str] = &["flash_fwd", "flash_bwd", "flash_bwd_mma", "flash_bwd_pipe", "flash_bwd_fused", "merge", "layout", "quant", "moe", "grouped_gemm", "dropout", "probe"];
/// Kernels that use Hopper-only instructions (wgmma): PTX for `compute_90a` (`.target sm_90a`),
/// loadable only on compute capability 9.x; the launchers check the device before loading them.
const KERNELS_SM90A: &[&str] = &["flash_fwd_sm90", "flash_fwd_sm90_ws", "flash_bwd_sm90", "flash_bwd_sm90_ws", "probe_sm90"];

fn nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return PathBuf::from(p);
    }
    for var in ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            let p = Path::new(&root).join("bin").join("nvcc");
            if p.exists() {
                return p;
            }
        }
    }
    PathBuf::from("nvcc")
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for var in ["NVCC", "CUDA_ROOT", "CUDA_HOME", "CUDA_PATH", "CANDLE_CP_NVCC_FLAGS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = nvcc();
    let extra: Vec<String> = std::env::var("CANDLE_CP_NVCC_FLAGS")
        .map(|s| s.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    println!("cargo:rerun-if-changed=kernels/common.cuh");
    println!("cargo:rerun-if-changed=kernels/flash_bwd_pipe.cuh");
    println!("cargo:rerun-if-changed=kernels/wgmma.cuh");
    println!("cargo:rerun-if-changed=kernels/mbarrier.cuh");
    println!("cargo:rerun-if-changed=kernels/flash_sm90.cuh");
    let sm80 = KERNELS.iter().map(|n| (n, "-arch=compute_80"));
    for (name, arch) in sm80.chain(KERNELS_SM90A.iter().map(|n| (n, "-arch=compute_90a"))) {
        let src = format!("kernels/{name}.cu");
        println!("cargo:rerun-if-changed={src}");
        let ptx = out_dir.join(format!("{name}.ptx"));
        let output = Command::new(&nvcc)
            .args(["--ptx", arch, "-O3", "-std=c++17", "-Ikernels"])
            .args(&extra)
            .arg("-o")
            .arg(&ptx)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("candle-cp-kernels: cannot run {} ({e}); install nvcc or set NVCC", nvcc.display()));
        if !output.status.success() {
            panic!(
                "candle-cp-kernels: nvcc failed on {src}\n{}\n{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
}
