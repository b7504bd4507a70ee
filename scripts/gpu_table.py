#!/usr/bin/env python3
"""Side-by-side table of gpu_bench (candle-cp) and sdpa_bench (PyTorch) JSON lines, as Markdown.

usage: gpu_table.py bench.jsonl sdpa.jsonl
"""
import json
import sys


def load(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    except OSError as e:
        print(f"(cannot read {path}: {e})")
    return rows


def main():
    ours = {(r["t"], r["causal"]): r for r in load(sys.argv[1]) if r.get("impl") == "candle-cp"}
    ring = [r for r in load(sys.argv[1]) if r.get("impl") == "candle-cp-ring"]
    torch = {(r["t"], r["causal"]): r for r in load(sys.argv[2]) if r.get("impl") == "torch-sdpa"}
    print("| T | mask | candle-cp fwd TFLOP/s | SDPA fwd TFLOP/s | candle-cp bwd TFLOP/s | SDPA bwd TFLOP/s |")
    print("|---|---|---|---|---|---|")
    f = lambda r, k: f"{r[k]:.1f}" if r and k in r else "-"
    for key in sorted(set(ours) | set(torch)):
        o, t = ours.get(key), torch.get(key)
        print(f"| {key[0]} | {'causal' if key[1] else 'full'} | {f(o, 'fwd_tflops')} | {f(t, 'fwd_tflops')} "
              f"| {f(o, 'bwd_tflops')} | {f(t, 'bwd_tflops')} |")
    for r in ring:
        print(f"\nzigzag ring, P = {r['p']} virtual ranks, T = {r['t']}: {r['ring_ms']:.1f} ms vs single-GPU kernel "
              f"{r['single_ms']:.1f} ms, efficiency {r['efficiency']:.2f}")


if __name__ == "__main__":
    main()
