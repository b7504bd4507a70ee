#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention baseline for scripts/gpu-check.sh (run on the GPU machine).

Same problem as examples/gpu_bench.rs: q, k, v [B, H, T, D] bf16, causal and full, forward and
backward TFLOP/s with the FlashAttention FLOP convention (forward 4*B*H*T^2*D, halved when causal;
backward 2.5x forward). Prints one JSON object per line.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F


def timed(fn, iters):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    n = 1 if warm > 1.0 else max(1, iters)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", default="4096,8192,16384,32768")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=90.0)
    a = ap.parse_args()
    t_start = time.perf_counter()
    b, h, d = a.batch, a.heads, a.d
    for t in [int(x) for x in a.t.split(",")]:
        for causal in (True, False):
            if time.perf_counter() - t_start > a.budget_s:
                print(json.dumps({"skipped": "budget", "t": t, "causal": causal}), flush=True)
                continue
            mk = lambda: torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            q, k, v = mk(), mk(), mk()
            dout = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
            flops = 4.0 * b * h * d * t * t * (0.5 if causal else 1.0)
            with torch.no_grad():
                fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), a.iters)

            def fwd_bwd():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                torch.autograd.grad(out, (q, k, v), dout)

            both = timed(fwd_bwd, a.iters)
            bwd = max(both - fwd, 1e-9)
            print(json.dumps({
                "impl": "torch-sdpa", "torch": torch.__version__, "dtype": "bf16", "b": b, "h": h, "d": d,
                "t": t, "causal": causal, "fwd_ms": round(fwd * 1e3, 3), "fwd_tflops": round(flops / fwd / 1e12, 2),
                "bwd_ms": round(bwd * 1e3, 3), "bwd_tflops": round(2.5 * flops / bwd / 1e12, 2),
            }), flush=True)
            del q, k, v, dout
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
