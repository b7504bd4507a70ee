#!/usr/bin/env python3
"""Mutation check of the CPU emulation: plants known bugs in the real kernel source one at a time,
runs emu/run.sh on the affected checks, and reports under which (schedule/landing) combinations
each was caught. Every kernel file is restored byte-identical afterwards (also on an error or
Ctrl-C). It edits candle-cp-kernels/kernels/*.cu in place while it runs, so do not build or run
the kernels from this checkout meanwhile.

Usage: python3 candle-cp-kernels/emu/mutate.py [mutation-id ...]   (default: all; env as run.sh)
       python3 candle-cp-kernels/emu/mutate.py --check   (only: does every mutation still find its
       original text in the kernels, as often as it expects? no edit, no emulator run; CI runs it)
Exit status 1 if a mutation was not caught by any combination (or, with --check, no longer
applies), or a file differs afterwards.
"""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(HERE, "..", "kernels")

# wgmma atomic dQ: the transposed dS^T store (reads dsa) and the dK += dS^T Q issue (dsa = its A
# fragments); the mutation swaps them, so the store reads A-fragment registers of an in-flight wgmma.
_DS_STORE_HEAD = "    if constexpr (ATOMIC) {\n      // dS^T (the rounded values of dsa) into the dS tile"
_DK_ISSUE = ("    reg_fence(dsa);\n    reg_fence(acc_k);\n    wg_fence();\n    // dK += dS^T Q: B = Q MN-major.\n"
             "#pragma unroll\n    for (int kk = 0; kk < BQ / 16; ++kk)\n"
             "      wg_rs<D, T>(acc_k, dsa[kk], sw128_desc(qa + (uint32_t)(kk * 2048), BQ * 128, 1024), 1);\n"
             "    wg_commit();\n")


def _ds_store_block():
    with open(os.path.join(KERNELS, "flash_bwd_sm90.cu")) as f:
        text = f.read()
    i = text.find(_DS_STORE_HEAD)
    j = text.find(_DK_ISSUE, i)
    return text[i:j] if 0 <= i < j else "<dS store block not found>"


_DS_STORE = _ds_store_block()

# (id, file, original text (must occur once), mutated text, run.sh filter, what it plants[, how many
# times the original occurs: every occurrence is mutated])
MUTATIONS = [
    ("fused-prefetch-before-barrier", "flash_bwd_fused.cu",
     "    __syncthreads();     // ... and everyone's; every warp is done with iteration it - 1, so\n"
     "                         // buffer buf ^ 1 (its Q/dO, staging and lse/delta) and dS^T are free\n"
     "    float nl = 0.f, nd = 0.f;\n"
     "    if (more) issue(it + 1, buf ^ 1, nl, nd);  // lands while this tile is computed\n"
     "    cp_async_commit();\n",
     "    float nl = 0.f, nd = 0.f;\n"
     "    if (more) issue(it + 1, buf ^ 1, nl, nd);  // lands while this tile is computed\n"
     "    cp_async_commit();\n"
     "    __syncthreads();\n",
     "flash_bwd_fused", "fused backward: next tile's prefetch issued before the barrier that frees its buffer"),
    ("fused-ds-barrier", "flash_bwd_fused.cu",
     "    __syncthreads();  // the whole dS^T tile is in shared memory; Q and dO of `buf` are free\n", "",
     "flash_bwd_fused", "fused backward: barrier publishing dS^T removed"),
    ("fwd-pipe-prefetch-before-barrier", "flash_fwd.cu",
     "    __syncthreads();  // tile j (and Q) visible to all; every warp is done with tile j-1\n"
     "    if (j + 1 < n_tiles) {\n"
     "      fwd_pipe_load<BK, D, NTH>(k_sa + nxt, k + kv_off, kv_rs, k0 + BK, s_rel, tid);\n"
     "      fwd_pipe_load<BK, D, NTH>(v_sa + nxt, v + kv_off, kv_rs, k0 + BK, s_rel, tid);\n"
     "      cp_async_commit();\n"
     "    }\n",
     "    if (j + 1 < n_tiles) {\n"
     "      fwd_pipe_load<BK, D, NTH>(k_sa + nxt, k + kv_off, kv_rs, k0 + BK, s_rel, tid);\n"
     "      fwd_pipe_load<BK, D, NTH>(v_sa + nxt, v + kv_off, kv_rs, k0 + BK, s_rel, tid);\n"
     "      cp_async_commit();\n"
     "    }\n"
     "    __syncthreads();\n",
     "flash_fwd_pipe", "forward pipeline: K/V prefetch issued before the per-tile barrier"),
    ("fwd-fold-syncwarp", "common.cuh",
     "    if (dst.merge) __syncwarp();  // the quad's 4 lanes read the old lse before lane t = 0 replaces it\n", "",
     "flash_fwd_pipe", "forward fold: lane 0 may replace a row's lse before the quad's other lanes read it"),
    ("fwd-fold-old-weight", "common.cuh",
     "  return CpFold{ea / sum, eb / sum, mx + __logf(sum)};", "  return CpFold{0.f, eb / sum, mx + __logf(sum)};",
     "flash_fwd_wgmma_tma", "forward fold: the state's old rows dropped (weight 0)"),
    ("fwd-pipe-barrier", "flash_fwd.cu",
     "    __syncthreads();  // tile j (and Q) visible to all; every warp is done with tile j-1\n", "",
     "flash_fwd_pipe", "forward pipeline: per-tile barrier removed"),
    ("fwd-pipe-wait", "flash_fwd.cu",
     "    cp_async_wait<0>();\n    __syncthreads();  // tile j (and Q)",
     "    cp_async_wait<1>();\n    __syncthreads();  // tile j (and Q)",
     "flash_fwd_pipe", "forward pipeline: wait_group 0 -> 1"),
    ("fwd-pipe-d96-tail-rows", "flash_fwd.cu",
     "ITER = (ROWS + RSTEP - 1) / RSTEP;", "ITER = ROWS / RSTEP;",
     "flash_fwd_pipe", "pipelined forward: a tile's last partial step of rows never copied (d96: 10 rows a step)"),
    ("fwd-pipe-full-tile", "flash_fwd.cu",
     ": k0 + BK <= w_full;", ": k0 + BK <= w_full + 1;",
     "flash_fwd_pipe", "forward pipeline: off-by-one in full_tile (mask skipped)"),
    ("bwd-pipe-kv-trailing-barrier", "flash_bwd_pipe.cu",
     "    if (more && tid < BQ) lse_s[(buf ^ 1) * BQ + tid] = nl, dl_s[(buf ^ 1) * BQ + tid] = nd;\n"
     "    __syncthreads();  // buffer `buf` is free for the prefetch of the next iteration\n",
     "    if (more && tid < BQ) lse_s[(buf ^ 1) * BQ + tid] = nl, dl_s[(buf ^ 1) * BQ + tid] = nd;\n",
     "flash_bwd_pipe", "backward pipeline dK/dV: trailing barrier removed"),
    ("bwd-pipe-q-trailing-barrier", "flash_bwd_pipe.cu",
     "      }\n    }\n    __syncthreads();  // buffer `buf` is free for the prefetch of the next iteration\n  }\n",
     "      }\n    }\n  }\n",
     "flash_bwd_pipe", "backward pipeline dQ: trailing barrier removed"),
    ("bwd-pipe-wait", "flash_bwd_pipe.cu",
     "    cp_async_wait<1>();  // everything but the prefetch just issued has landed",
     "    cp_async_wait<2>();  // everything but the prefetch just issued has landed",
     "flash_bwd_pipe", "backward pipeline dK/dV: wait_group 1 -> 2"),
    ("pipe-ldmatrix-rows", "flash_bwd_pipe.cuh",
     "  return ((lane & 7) + 8 * ((lane >> 3) & 1)) * dpb + (lane >> 4) * 16;",
     "  return ((lane & 7) + 8 * ((lane >> 3) & 1)) * dpb + ((lane >> 3) & 1) * 16;",
     "flash_bwd_pipe", "backward pipeline: wrong ldmatrix row-address mapping (A operand)"),
    ("bwd-mma-fragment-row", "flash_bwd_mma.cu",
     "const T* kr = k_s + (nt * 8 + g) * DP + kc * 16 + 2 * t;",
     "const T* kr = k_s + (nt * 8 + (g ^ 1)) * DP + kc * 16 + 2 * t;",
     "flash_bwd_mma", "mma backward: wrong fragment row of K"),
    ("wgmma-wait", "flash_fwd_sm90.cu",
     "      wg_wait<1>();  // groups retire in order", "      wg_wait<2>();  // groups retire in order",
     "flash_fwd_wgmma", "wgmma forward: wait_group 1 -> 2 before the softmax"),
    ("wgmma-v-desc", "flash_sm90.cuh",
     "sw128_desc(va_st + (uint32_t)(kk * 2048), BK * 128, 1024)",
     "sw128_desc(va_st + (uint32_t)(kk * 2048), 1024, BK * 128)",
     "flash_fwd_wgmma", "wgmma forward: LBO / SBO swapped in the V descriptor"),
    ("wgmma-v-stage", "flash_fwd_sm90.cu",
     "if (j < n_tiles) sw_load<BK, D, NTH>(v_st(j & 1)", "if (j < n_tiles) sw_load<BK, D, NTH>(v_st((j + 1) & 1)",
     "flash_fwd_wgmma", "wgmma forward: V copied into the wrong stage"),
    ("wgmma-bwd-wait", "flash_bwd_sm90.cu",
     "    wg_wait<1>();  // dP^T done", "    wg_wait<2>();  // dP^T done",
     "flash_bwd_wgmma", "wgmma dK/dV: wait_group 1 -> 2 before dS^T (dP^T read while in flight)"),
    ("wgmma-bwd-prefetch-before-barrier", "flash_bwd_sm90.cu",
     "    __syncthreads();\n    const bool more = it + 1 < n_it;\n    float nl = 0.f, nd = 0.f;\n"
     "    if (more) issue(it + 1, st ^ 1, nl, nd);\n    cp_async_commit();\n",
     "    const bool more = it + 1 < n_it;\n    float nl = 0.f, nd = 0.f;\n"
     "    if (more) issue(it + 1, st ^ 1, nl, nd);\n    cp_async_commit();\n    __syncthreads();\n",
     "flash_bwd_wgmma", "wgmma dK/dV: next Q/dO prefetch issued before the barrier that frees its stage"),
    ("wgmma-bwd-do-desc", "flash_bwd_sm90.cu",
     "sw128_desc(da + (uint32_t)(kk * 2048), BQ * 128, 1024)", "sw128_desc(da + (uint32_t)(kk * 2048), 1024, BQ * 128)",
     "flash_bwd_wgmma", "wgmma dK/dV: LBO / SBO swapped in the MN-major dO descriptor"),
    ("wgmma-bwd-lse-column", "flash_bwd_sm90.cu",
     "*reinterpret_cast<const float2*>(ls + 8 * i + 2 * t)", "*reinterpret_cast<const float2*>(ls + 8 * i + 2 * (t ^ 1))",
     "flash_bwd_wgmma", "wgmma dK/dV: lse2 read for the wrong query columns"),
    ("wgmma-dq-wait", "flash_bwd_sm90.cu",
     "      wg_wait<1>();  // S done, dP may still run", "      wg_wait<2>();  // S done, dP may still run",
     "flash_bwd_wgmma", "wgmma dQ: wait_group 1 -> 2 before P (S read while in flight)"),
    ("wgmma-dq-full-tile", "flash_bwd_sm90.cu",
     "const bool full_tile = k0 + BK <= w_full && (!M::BAND", "const bool full_tile = k0 + BK <= w_full + 1 && (!M::BAND",
     "flash_bwd_wgmma", "wgmma dQ: off-by-one in full_tile (mask skipped)"),
    ("wgmma-dq-k-stage", "flash_bwd_sm90.cu",
     "sw_load<BK, D, NTH>(k_st(st ^ 1), kg, kv_rs, (j + 1) * BK, s_rel, tid);",
     "sw_load<BK, D, NTH>(k_st(st), kg, kv_rs, (j + 1) * BK, s_rel, tid);",
     "flash_bwd_wgmma", "wgmma dQ: next K tile copied into the stage in use"),
    ("wgmma-atomic-ds-barrier", "flash_bwd_sm90.cu",
     "      __syncthreads();  // the whole dS tile (both warpgroups) visible to the async proxy\n", "",
     "flash_bwd_wgmma_atomic", "wgmma atomic dQ: barrier publishing the dS tile removed"),
    ("wgmma-atomic-ragged-keys", "flash_bwd_sm90.cu",
     "        if (ragged && !(e < 2 ? kok_a : kok_b)) p = 0.f;\n", "",
     "flash_bwd_wgmma_atomic", "wgmma atomic dQ: keys past S not masked (0 * inf in dQ)"),
    ("wgmma-atomic-ds-swizzle", "flash_sm90.cuh",
     "((((2 * wr + (i & 1)) ^ j) & 7) << 4)", "((((2 * wr + (i & 1)) ^ (j >> 1)) & 7) << 4)",
     "flash_bwd_wgmma_atomic", "wgmma atomic dQ: wrong swizzle in the transposed dS store (stmatrix rows)"),
    ("ds-stsm-matrix-order", "flash_sm90.cuh",
     "(8 * (i >> 1) + j) * 128 + ((((2 * wr + (i & 1))", "(8 * (i & 1) + j) * 128 + ((((2 * wr + (i >> 1))",
     "flash_bwd_wgmma_ws", "Hopper backwards: stmatrix of dS^T with matrices 1 and 2 swapped (keys and queries "
     "blocks exchanged)"),
    ("wgmma-proxy-fence", "flash_fwd_sm90.cu",
     "    cp_async_wait<0>();\n    fence_proxy_async();\n    // K_j", "    cp_async_wait<0>();\n    // K_j",
     "flash_fwd_wgmma", "wgmma forward: fence.proxy.async after the cp.async wait removed (copies not "
     "visible to the async proxy)"),
    ("wgmma-atomic-ds-fence", "flash_bwd_sm90.cu",
     "    if constexpr (ATOMIC) {\n      fence_proxy_async();\n      __syncthreads();",
     "    if constexpr (ATOMIC) {\n      __syncthreads();",
     "flash_bwd_wgmma_atomic", "wgmma atomic dQ: fence.proxy.async before the barrier publishing the dS "
     "tile removed (st.shared not visible to the async proxy)"),
    ("wgmma-atomic-ds-store-in-flight", "flash_bwd_sm90.cu",
     _DS_STORE + _DK_ISSUE, _DK_ISSUE + _DS_STORE,
     "flash_bwd_wgmma_atomic", "wgmma atomic dQ: dS^T stored from dsa after dK += dS^T Q is issued "
     "(A-fragment registers read while that wgmma is in flight)"),
    # warp-specialized forward (flash_fwd_sm90_ws.cu): producer / consumer ring on mbarriers
    ("ws-producer-fence", "flash_fwd_sm90_ws.cu",
     "        cp_async_wait<LAG>();  // operation n - LAG (and older) landed\n        fence_proxy_async();\n",
     "        cp_async_wait<LAG>();  // operation n - LAG (and older) landed\n",
     "flash_fwd_wgmma_ws", "ws forward: producer signals FULL without fence.proxy.async (copies not visible to wgmma)"),
    ("merge-rows-lse-window", "merge.cu",
     "size_t la_i = ((size_t)b * H + h) * T_ + row0 + i,", "size_t la_i = ((size_t)b * H + h) * T_ + i,",
     "merge_rows", "in-place ring-state merge: the state's lse read and written at the block's row, not row0 + i"),
    ("add-rows-plane", "merge.cu",
     "acc[(((size_t)plane * B + b) * R + row0 + i) * hd + c]", "acc[(((size_t)b) * R + row0 + i) * hd + c]",
     "add_rows", "in-place gradient accumulator: the block added to plane 0 whatever its plane"),
    ("ws-signal-before-wait", "flash_fwd_sm90_ws.cu",
     "        cp_async_wait<LAG>();  // operation n - LAG (and older) landed\n        fence_proxy_async();\n"
     "        signal(n - LAG);\n",
     "        signal(n - LAG);\n        cp_async_wait<LAG>();  // operation n - LAG (and older) landed\n"
     "        fence_proxy_async();\n",
     "flash_fwd_wgmma_ws", "ws forward: producer arrives on FULL before its copies landed (wait_group and fence after)"),
    ("ws-unbalanced-turn", "flash_fwd_sm90_ws.cu",
     "    if (cw == 0) pass_turn();\n", "    pass_turn();\n",
     "flash_fwd_wgmma_ws", "ws forward: both consumers hand the turn on after the drain (a bar.arrive nobody waits for)"),
    ("ws-empty-wait-k", "flash_fwd_sm90_ws.cu",
     "        if (j >= NST) cp_mbar_wait(&empty_k[st], (uint32_t)((j / NST - 1) & 1));\n", "",
     "flash_fwd_wgmma_ws", "ws forward: producer refills a K stage without waiting for its EMPTY barrier"),
    ("ws-release-k-early", "flash_fwd_sm90_ws.cu",
     "      wg_commit();\n      pass_turn();\n      wg_wait<1>();  // groups retire in order: S_j is done, P V may still run\n"
     "      cp_mbar_arrive(&empty_k[st]);\n",
     "      cp_mbar_arrive(&empty_k[st]);\n      wg_commit();\n      pass_turn();\n"
     "      wg_wait<1>();  // groups retire in order: S_j is done, P V may still run\n",
     "flash_fwd_wgmma_ws", "ws forward: consumer releases K_j before the wgmma reading it (S_j) retired"),
    ("wsb-producer-fence", "flash_bwd_sm90_ws.cu",
     "        cp_async_wait<LAG>();  // tile n - LAG (and older, K / V) landed\n        fence_proxy_async();\n",
     "        cp_async_wait<LAG>();  // tile n - LAG (and older, K / V) landed\n",
     "flash_bwd_wgmma_ws", "ws backward: producer signals FULL without fence.proxy.async (copies not visible to wgmma)"),
    ("wsb-signal-before-wait", "flash_bwd_sm90_ws.cu",
     "        cp_async_wait<LAG>();  // tile n - LAG (and older, K / V) landed\n        fence_proxy_async();\n"
     "        cp_mbar_arrive(&full[(n - LAG) % NST]);\n",
     "        cp_mbar_arrive(&full[(n - LAG) % NST]);\n"
     "        cp_async_wait<LAG>();  // tile n - LAG (and older, K / V) landed\n        fence_proxy_async();\n",
     "flash_bwd_wgmma_ws", "ws backward: producer arrives on FULL before its copies landed (wait_group and fence after)"),
    ("wsb-dq-pair-swap", "flash_bwd_sm90_ws.cu",
     "odd ? make_float4(r0, r1, y0, y1) : make_float4(x0, x1, r0, r1)",
     "odd ? make_float4(y0, y1, r0, r1) : make_float4(x0, x1, r0, r1)",
     "flash_bwd_wgmma_ws", "ws backward: odd lanes put their own dQ pair first in the v4 reduction (d columns swapped)"),
    ("wsb-empty-wait", "flash_bwd_sm90_ws.cu",
     "      if (n >= NST) cp_mbar_wait(&empty[st], (uint32_t)((n / NST - 1) & 1));\n      // Tile n:",
     "      // Tile n:",
     "flash_bwd_wgmma_ws", "ws backward: producer refills a Q / dO stage without waiting for its EMPTY barrier"),
    ("wsb-release-early", "flash_bwd_sm90_ws.cu",
     "    wg_commit();\n    wg_wait<0>();  // every product of this tile retired: Q / dO / lse2 / delta of stage st are free\n",
     "    wg_commit();\n    cp_mbar_arrive(&empty[st]);\n"
     "    wg_wait<0>();  // every product of this tile retired: Q / dO / lse2 / delta of stage st are free\n",
     "flash_bwd_wgmma_ws", "ws backward: consumer releases a stage before the products reading it (dV, dK) retired"),
    ("wsb-ds-barrier", "flash_bwd_sm90_ws.cu",
     "    if constexpr (D == 128) cp_named_bar_sync(1, 256);\n    else cp_named_bar_sync(2 + cw, 128);\n",
     "    if constexpr (D != 128) cp_named_bar_sync(2 + cw, 128);\n",
     "flash_bwd_wgmma_ws", "ws backward: no consumer barrier before dQ = dS K reads both consumers' dS halves (d128)"),
    ("wsb-ds-barrier-d64", "flash_bwd_sm90_ws.cu",
     "    if constexpr (D == 128) cp_named_bar_sync(1, 256);\n    else cp_named_bar_sync(2 + cw, 128);\n",
     "    if constexpr (D == 128) cp_named_bar_sync(1, 256);\n",
     "flash_bwd_wgmma_ws", "ws backward: no warpgroup barrier before dQ = dS K reads the dS rows of all four warps (d64; "
     "wgmma's .sync waits only for the issuing warp)"),
    ("wsb-ds-single-buffer", "flash_bwd_sm90_ws.cu",
     "    const uint32_t dsb = ds_sa + (uint32_t)(it & 1) * DS_BYTES;\n",
     "    const uint32_t dsb = ds_sa;\n",
     "flash_bwd_wgmma_ws", "ws backward: one dS buffer (a consumer rewrites dS while the other's dQ product reads it)"),
    # consumers that skip their FULL waits (caught by warps-asc pausing the producer warpgroup at each arrival)
    ("ws-full-wait-k", "flash_fwd_sm90_ws.cu",
     "      cp_mbar_wait(&full_k[st], (uint32_t)((j / NST) & 1));\n", "",
     "flash_fwd_wgmma_ws", "ws forward: consumer reads K_j without waiting on its FULL barrier"),
    ("ws-full-wait-v", "flash_fwd_sm90_ws.cu",
     "      cp_mbar_wait(&full_v[sv], (uint32_t)((jv / NST) & 1));\n      cp_mbar_wait(&full_k[st]",
     "      cp_mbar_wait(&full_k[st]",
     "flash_fwd_wgmma_ws", "ws forward: consumer reads V_{j-1} without waiting on its FULL barrier"),
    ("wsb-full-wait", "flash_bwd_sm90_ws.cu",
     "    cp_mbar_wait(&full[st], (uint32_t)((it / NST) & 1));  // tile it (and K, V) landed and fenced\n", "",
     "flash_bwd_wgmma_ws", "ws backward: consumer reads stage it (Q, dO, lse2, delta) without waiting on its FULL barrier"),
    # band masks (emu/check_band.cpp): the per-warp tile skips of the pipelined band kernels and
    # the band tests of the warp-specialized Hopper band entries
    ("band-fwd-pipe-warp-skip", "flash_fwd.cu",
     "k0 + BK <= lo_s[warp * MT * 16] ||", "k0 + BK <= lo_s[warp * MT * 16 + MT * 16 - 1] ||",
     "band", "pipe band forward: a warp skips key tiles from its LAST row's lo (its first rows need them)"),
    ("band-dq-warp-skip", "flash_bwd_pipe.cu",
     "if (wf < T_) w_lo = mask.kbegin(wf), w_hi", "if (wf < T_) w_lo = mask.kbegin(min(wf + 16 * MT, T_) - 1), w_hi",
     "band", "pipe band dQ: a warp skips key tiles from its last row's lo"),
    ("band-dkdv-warp-skip", "flash_bwd_pipe.cu",
     "wq_end = mask.qend(min(k0 + kr0 + 16, S), T_);", "wq_end = mask.qend(min(k0 + kr0 + 8, S), T_);",
     "band", "pipe band dK/dV: a warp's query range from 8 of its 16 keys"),
    ("band-ws-fwd-no-lower", "flash_fwd_sm90_ws.cu",
     "fwd_sm90_softmax<BK, M::BAND>(", "fwd_sm90_softmax<BK, false>(",
     "wgmma_ws", "ws band forward: no lower-bound test (keys before lo visible)"),
    ("band-tile-partial", "common.cuh",
     "return (int)lo[i1 - 1] > k0 || (int)hi[i0] < min(k1, S);", "return (int)lo[i1 - 1] > k0;",
     "bwd_band", "band backward (pipelined, wgmma, wgmma-ws): tiles whose rows end before the block's keys end taken as unmasked"),
    ("band-wgmma-fwd-no-lower", "flash_fwd_sm90.cu",
     "fwd_sm90_softmax<BK, M::BAND>(", "fwd_sm90_softmax<BK, false>(",
     "band wgmma ", "wgmma band forward: no lower-bound test (keys before lo visible)"),
    ("band-wgmma-dq-full-tile", "flash_bwd_sm90.cu",
     "const bool full_tile = k0 + BK <= w_full && (!M::BAND || w_lo <= k0);", "const bool full_tile = k0 + BK <= w_full;",
     "bwd_band wgmma ", "wgmma band dQ: a tile taken as seen whole without the warpgroup's last lo"),
    ("band-key-rows", "flash_sm90.cuh",
     "q_lo = band.qbegin(j, T_), q_hi = band.qend(j + 1, T_);", "q_lo = band.qbegin(j, T_), q_hi = band.qend(j, T_);",
     "bwd_band wgmma", "Hopper band backward: a key's query rows end one key early"),
    ("tma-empty-wait", "flash_fwd_sm90_ws.cu",
     "          if (j >= NST) cp_mbar_wait(isv ? &empty_v[st] : &empty_k[st], (uint32_t)((j / NST - 1) & 1));\n", "",
     "wgmma_tma", "TMA forward: a stage refilled without waiting for its EMPTY barrier"),
    ("tma-expect-q", "flash_fwd_sm90_ws.cu",
     "cp_mbar_arrive_expect_tx(full, KV_BYTES + (n == 0 ? Q_BYTES : 0u));", "cp_mbar_arrive_expect_tx(full, KV_BYTES);",
     "wgmma_tma", "TMA forward: the first stage's expect_tx leaves out Q's bytes (its phase completes early)"),
    ("tma-col-block", "flash_fwd_sm90_ws.cu",
     "cp_tma_load_4d(dst + (uint32_t)c * BK * 128,", "cp_tma_load_4d(dst + (uint32_t)c * BK * 64,",
     "wgmma_tma", "TMA forward: the second 64-column block of a K/V tile at the wrong offset"),
    ("tma-band-kb", "flash_fwd_sm90_ws.cu",
     "isv ? tv : tk, 64 * c, kvh, kb + j * BK, b, full);", "isv ? tv : tk, 64 * c, kvh, j * BK, b, full);",
     "band wgmma_tma", "TMA band forward: K/V tiles not shifted by the block's first key tile kb"),
    ("tma-gqa-head", "flash_fwd_sm90_ws.cu",
     "isv ? tv : tk, 64 * c, kvh, kb + j * BK, b, full);", "isv ? tv : tk, 64 * c, h, kb + j * BK, b, full);",
     "wgmma_tma", "TMA forward: K/V loaded from the query head instead of its KV head (GQA)"),
    ("tma-bwd-expect-kv", "flash_bwd_sm90_ws.cu",
     "cp_mbar_arrive_expect_tx(&full[st], 2 * Q_BYTES + (n == 0 ? 2 * KV_BYTES : 0u));",
     "cp_mbar_arrive_expect_tx(&full[st], 2 * Q_BYTES);",
     "wgmma_tma", "TMA backward: tile 0's expect_tx leaves out K and V (its phase completes before they land)"),
    ("tma-bwd-empty-wait", "flash_bwd_sm90_ws.cu",
     "          if (n >= NST) cp_mbar_wait(&empty[st], (uint32_t)((n / NST - 1) & 1));\n"
     "          const int hq = kvh * G + n / n_qt, i0 = i_begin + (n % n_qt) * BQ;\n          const int i = i0 + tid;\n",
     "          const int hq = kvh * G + n / n_qt, i0 = i_begin + (n % n_qt) * BQ;\n          const int i = i0 + tid;\n",
     "wgmma_tma", "TMA backward: a Q / dO stage (and its lse / delta) refilled without waiting for its EMPTY barrier"),
    ("tma-bwd-q-head", "flash_bwd_sm90_ws.cu",
     "tm[0], 64 * c, hq, i0, b, &full[st]);", "tm[0], 64 * c, kvh, i0, b, &full[st]);",
     "wgmma_tma", "TMA backward: Q loaded from the KV head instead of the tile's query head (GQA)"),
    ("tma-dq-no-fence", "flash_bwd_sm90_ws.cu",
     "      fence_proxy_async();  // the stores visible to the async proxy the reduction reads through\n", "",
     "wgmma_tma", "TMA backward: dQ buffer stores not fenced for the async proxy before the reduction"),
    ("tma-dq-no-wait-read", "flash_bwd_sm90_ws.cu",
     "      if ((tid & 127) == 0) cp_bulk_wait_read<0>();  // the last reduction from this buffer has read it\n", "",
     "wgmma_tma", "TMA backward: the dQ buffer rewritten without waiting for the last reduction to read it"),
    ("tma-dq-second-barrier", "flash_bwd_sm90_ws.cu",
     "      fence_proxy_async();  // the stores visible to the async proxy the reduction reads through\n"
     "      cp_named_bar_sync(5 + cw, 128);\n",
     "      fence_proxy_async();  // the stores visible to the async proxy the reduction reads through\n",
     "wgmma_tma", "TMA backward: the reduction issued without the barrier after the warpgroup's dQ stores"),
    ("tma-dq-col", "flash_bwd_sm90_ws.cu",
     "cp_tma_reduce_add_4d(tm[4], dc0, hq, i0, b, dqb);", "cp_tma_reduce_add_4d(tm[4], 0, hq, i0, b, dqb);",
     "wgmma_tma", "TMA backward: both consumers' dQ columns added at column 0"),
    ("pipe-fwd-unpadded-rows", "flash_fwd.cu",
     "DP = D + 8", "DP = D", "flash_fwd_pipe",
     "mma and pipelined forwards: shared rows of D elements, no padding (right values; ldmatrix bank conflicts)", 3),
    ("tma-dq-pair-swap", "flash_bwd_sm90_ws.cu",
     "      const bool odd_g = g & 1;\n", "      const bool odd_g = false;\n",
     "wgmma_tma", "TMA backward: dQ buffer stores without the odd-row column-pair swap (right values, 2-way bank conflicts)"),
    ("tma-dq-swizzle", "tma.cuh",
     "r * 128 + ((((c >> 2) ^ r) & 7) << 4)", "r * 128 + (((c >> 2) & 7) << 4)",
     "wgmma_tma", "TMA backward: dQ buffer stored unswizzled while the map reads it swizzled"),
    ("tma-dq-second-box", "flash_bwd_sm90_ws.cu",
     "cp_tma_reduce_add_4d(tm[4], dc0 + 32, hq, i0, b, dqb + DQB_BYTES / 2);",
     "cp_tma_reduce_add_4d(tm[4], dc0 + 32, hq, i0, b, dqb);",
     "wgmma_tma", "TMA backward: the second dQ box (columns 32..63) reduced from the first box's buffer"),
    # dequantization (quant.cu)
    ("dequant-nibble-order", "quant.cu",
     "      a = lv[c & 15u] * s;\n      b = lv[c >> 4] * s;\n", "      a = lv[c >> 4] * s;\n      b = lv[c & 15u] * s;\n",
     "dequant_nf4", "NF4 dequantization: element 2j read from the high nibble (PEFT / bitsandbytes order is not ours)"),
    ("dequant-group", "quant.cu",
     "const float s = scales[j / half_g];", "const float s = scales[j / g];",
     "dequant_", "dequantization: the scale of group j / g for pair j (pairs counted as elements)"),
    ("dequant-levels-sync", "quant.cu",
     "    if (threadIdx.x < 16) lv[threadIdx.x] = cp_nf4_level(threadIdx.x);\n    __syncthreads();\n",
     "    if (threadIdx.x < 16) lv[threadIdx.x] = cp_nf4_level(threadIdx.x);\n",
     "dequant_nf4", "NF4 dequantization: the level table read before every thread has written it (no barrier)"),
    # top-K routing (moe.cu)
    ("top-k-ties", "moe.cu",
     "(unsigned long long)(0xFFFFFFFFu - (uint32_t)e);", "(unsigned long long)(uint32_t)e;",
     "moe_top_k", "top-K routing: ties broken by the higher expert index (the CPU takes the lower)"),
    ("top-k-negative-order", "moe.cu",
     "return (b & 0x80000000u) ? ~b : (b | 0x80000000u);", "return b | 0x80000000u;",
     "moe_top_k", "top-K routing: negative values ranked by their raw bits (above every positive)"),
    ("top-k-bad-warp", "moe.cu",
     "  for (int o = 16; o > 0; o >>= 1) bad = min(bad, __shfl_xor_sync(CP_FULL_MASK, bad, o));\n", "",
     "moe_top_k", "top-K routing: a non-finite probability seen only by its own lane (no warp minimum)"),
    # the experts' grouped products (grouped_gemm.cu)
    ("grouped-tile-rows", "grouped_gemm.cu",
     "const int rows = (int)min((long long)GG_BM, (long long)offs[e + 1] - r0);",
     "const int rows = GG_BM;",
     "grouped_gemm_n", "grouped products: a row tile runs past its expert's last row (the next expert's rows by this expert's weight)", 2),
    ("grouped-dw-rows", "grouped_gemm.cu",
     "const int k_len = (int)((long long)offs[e + 1] - r0);", "const int k_len = (int)offs[e + 1];",
     "grouped_gemm_tn", "grouped dW: an expert's sum over the rows before its own too"),
    ("grouped-trans", "grouped_gemm.cu",
     "else cp_ldsm_x4_trans(b, ", "else cp_ldsm_x4(b, ",
     "grouped_gemm", "grouped products: B's fragments from its row-contiguous tile read without .trans"),
    ("grouped-wait", "grouped_gemm.cu",
     "      load((s + 1) & 1, (s + 1) * GG_BK);\n      cp_async_wait<1>();\n", "      load((s + 1) & 1, (s + 1) * GG_BK);\n",
     "grouped_gemm", "grouped products: a step computed before its cp.async tiles have landed (no wait)"),
    ("grouped-stage-sync", "grouped_gemm.cu",
     "    gg_step<T, AKC, BKC>(acc, as[s & 1], bs[s & 1]);\n    __syncthreads();\n", "    gg_step<T, AKC, BKC>(acc, as[s & 1], bs[s & 1]);\n",
     "grouped_gemm", "grouped products: the next step's loads overwrite a stage other warps still read (no barrier after the step)"),
    ("grouped-bias-column", "grouped_gemm.cu",
     "cp_to_f32(be[col - col0])", "cp_to_f32(be[col])",
     "grouped_gemm_nt", "grouped forward: a TP rank's bias slice read from its first column at every column"),
    # dropout keep masks (dropout.cu)
    ("dropout-bits", "dropout.cu",
     "(float)(unsigned)(h >> 40) * (1.0f / 16777216.0f)", "(float)(unsigned)(h >> 41) * (1.0f / 16777216.0f)",
     "dropout_keep", "dropout keep mask: the uniform value from the wrong 24 bits of the hash"),
    ("dropout-col0", "dropout.cu",
     "* total_cols + col0 + (unsigned long long)j;", "* total_cols + (unsigned long long)j;",
     "dropout_keep", "dropout keep mask: a column window numbered from the tensor's first column"),
    ("dropout-rows", "dropout.cu",
     "(unsigned long long)rows[r] * total_cols", "(unsigned long long)r * total_cols",
     "dropout_keep", "dropout keep mask: local row numbers instead of the global row indices (a shard's mask = rank 0's)"),
]


def run(filt):
    p = subprocess.run([os.path.join(HERE, "run.sh"), filt], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    combos = []
    fails = {}
    for line in p.stdout.splitlines():
        if line.startswith("emu: combinations"):
            combos = line.split("):", 1)[1].split()
        m = re.match(r"FAIL \[([^\]]+)\]", line)
        if m:
            fails[m.group(1)] = fails.get(m.group(1), 0) + 1
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    return combos, fails, last


def check():
    """Every mutation's original text occurs as often as the entry expects (0 on success)."""
    stale = []
    for mid, fname, old, _new, _filt, _what, *count in MUTATIONS:
        with open(os.path.join(KERNELS, fname)) as f:
            found = f.read().count(old)
        if found != (count[0] if count else 1):
            stale.append(f"{mid} ({fname}: found {found} times)")
    if stale:
        print("mutate --check: mutations whose original text no longer matches the kernels: " + ", ".join(stale))
        return 1
    print(f"mutate --check: all {len(MUTATIONS)} mutations apply")
    return 0


def main():
    if sys.argv[1:] == ["--check"]:
        return check()
    wanted = set(sys.argv[1:])
    missed = []
    # every kernel source (.cu and .cuh), to check that each is restored byte-identical (a git diff
    # would flag uncommitted work and miss an untracked header)
    snap = {}
    for fn in sorted(os.listdir(KERNELS)):
        with open(os.path.join(KERNELS, fn), "rb") as f:
            snap[fn] = f.read()
    for mid, fname, old, new, filt, what, *count in MUTATIONS:
        if wanted and mid not in wanted:
            continue
        path = os.path.join(KERNELS, fname)
        with open(path, "rb") as f:
            orig = f.read()
        text = orig.decode()
        if text.count(old) != (count[0] if count else 1):
            print(f"{mid}: SKIP (original text found {text.count(old)} times in {fname}; update mutate.py)")
            missed.append(mid)
            continue
        try:
            with open(path, "wb") as f:
                f.write(text.replace(old, new).encode())
            combos, fails, last = run(filt)
        finally:
            with open(path, "wb") as f:
                f.write(orig)
        caught = [c for c in combos if fails.get(c)]
        verdict = "CAUGHT" if caught else "MISSED"
        if not caught:
            missed.append(mid)
        per = ", ".join(f"{c} {fails.get(c, 0)}" for c in combos)
        print(f"{verdict} {mid} ({what}) [{fname}, filter '{filt}']: failing checks per combination: {per}; {last}")
        sys.stdout.flush()
    diff = []
    for fn, data in snap.items():
        with open(os.path.join(KERNELS, fn), "rb") as f:
            if f.read() != data:
                diff.append(fn)
    if diff:
        print("kernel files differ after the run: " + ", ".join(diff))
    print(f"mutate: {len(missed)} not caught" + (f" ({', '.join(missed)})" if missed else ""))
    return 1 if missed or diff else 0


if __name__ == "__main__":
    sys.exit(main())
