# Work model of the pipelined band kernels (kernels/flash_fwd.cu `fwd_pipe`, kernels/flash_bwd_pipe.cu
# `bwd_pipe_dq` / `bwd_pipe_dkdv`, `_band_` entries) under packed causal documents: the (query,
# key) pairs their warps run through the tensor cores, with and without the per-warp tile skip
# (a warp leaves out the tiles none of its rows / keys see), against the visible pairs.
# It replays the kernels' loop bounds at tile granularity, not their arithmetic (that is checked
# by emu/check_band.cpp). Tile shapes at D = 128 (PIPES in flash_fwd.cu, PipeCfg<128> in
# flash_bwd_pipe.cu): forward 4 warps x 32 rows, key tiles of 64; dQ 8 warps x 16 rows, key tiles
# of 64; dK/dV 8 warps x 16 keys, query tiles of 64.
# Also the warp-specialized Hopper band kernels (kernels/flash_fwd_sm90_ws.cu, flash_bwd_sm90_ws.cu,
# `_band_` entries of wgmma-ws and wgmma-tma), which have no skip below their tiles: forward blocks of
# 128 rows (two consumer warpgroups of 64) over 128-key tiles, every consumer every tile of the
# block; backward blocks of 128 keys (two consumers of 64) over 64-row query tiles, both consumers
# every tile.
# Run: python3 candle-cp-kernels/sim/band_work.py [--random] [T] [doc lengths...]
#      (default T = 16384, documents of 32 64 128 256 512 2048 tokens; --random: each document's
#      length drawn uniformly from [L/2, L] (seeded), so boundaries fall anywhere in a tile; exit 1
#      if a skip drops a visible pair, as a check of the model itself)
import random
import sys


def doc_band(t, length):
    """Causal packed documents of `length` tokens over 0..t: lo[i], hi[i] (keys lo <= j < hi)."""
    lo = [(i // length) * length for i in range(t)]
    hi = [i + 1 for i in range(t)]
    return lo, hi


def doc_band_random(t, length, seed=1):
    """Causal packed documents of lengths uniform in [length // 2, length] (seeded) over 0..t."""
    rng = random.Random(seed)
    lo, hi = [0] * t, [0] * t
    s = 0
    while s < t:
        e = min(t, s + rng.randint(max(1, length // 2), length))
        for i in range(s, e):
            lo[i], hi[i] = s, i + 1
        s = e
    return lo, hi


def first_at_least(xs, x):
    a, b = 0, len(xs)
    while a < b:
        m = (a + b) // 2
        if xs[m] >= x:
            b = m
        else:
            a = m + 1
    return a


def covered(lo, hi, r0, r1, k0, k1):
    """Visible pairs of rows [r0, r1) x keys [k0, k1)."""
    return sum(max(0, min(hi[i], k1) - max(lo[i], k0)) for i in range(r0, r1))


def fwd(lo, hi, t, skip, rows=128, wrows=32, bk=64, skip_past=True):
    """fwd_pipe: block of `rows` query rows, warps of `wrows`; tiles from the one holding lo of
    the block's first row to hi of its last; a warp skips tiles past hi of its last row (with
    `skip_past`, always in fwd_pipe) and, with `skip`, tiles ending at or before lo of its first
    row."""
    work = seen = 0
    for r0 in range(0, t, rows):
        r1 = min(r0 + rows, t)
        kb = lo[r0] // bk * bk
        for k0 in range(kb, hi[r1 - 1], bk):
            for w0 in range(r0, r1, wrows):
                w1 = min(w0 + wrows, t)
                if (skip_past and k0 >= hi[w1 - 1]) or (skip and k0 + bk <= lo[w0]):
                    continue
                work += wrows * bk
                seen += covered(lo, hi, w0, w1, k0, k0 + bk)
    return work, seen


def dq(lo, hi, t, skip, rows=128, wrows=16, bn=64):
    """bwd_pipe_dq: block of `rows` rows; key tiles from the one holding lo of the first row to hi
    of the last; every warp computed every tile before, with `skip` only tiles meeting
    [lo of its first row, hi of its last row)."""
    work = seen = 0
    for m0 in range(0, t, rows):
        last = min(m0 + rows, t) - 1
        for k0 in range(lo[m0] // bn * bn, hi[last], bn):
            for w0 in range(m0, last + 1, wrows):
                w1 = min(w0 + wrows, t)
                if skip and not (k0 < hi[w1 - 1] and k0 + bn > lo[w0]):
                    continue
                work += wrows * bn
                seen += covered(lo, hi, w0, w1, k0, k0 + bn)
    return work, seen


def dkdv(lo, hi, t, skip, keys=128, wkeys=16, bq=64):
    """bwd_pipe_dkdv: block of `keys` keys; query tiles from the first row with hi > k0 to the
    first with lo >= k0 + keys; every warp computed every tile before, with `skip` only tiles
    meeting the rows that see its 16 keys."""
    work = seen = 0
    for k0 in range(0, t, keys):
        k1 = min(k0 + keys, t)
        i_begin, i_end = first_at_least(hi, k0 + 1), first_at_least(lo, k1)
        for i0 in range(i_begin, i_end, bq):
            i1 = min(i0 + bq, t)
            for kw in range(k0, k1, wkeys):
                kw1 = min(kw + wkeys, t)
                wb, we = first_at_least(hi, kw + 1), first_at_least(lo, kw1)
                if skip and not (i0 < we and i1 > wb):
                    continue
                work += wkeys * bq
                seen += covered(lo, hi, i0, i1, kw, kw1)
    return work, seen


def fwd_ws(lo, hi, t):
    """fwd_wgmma_ws, band: blocks of 128 rows, tiles of 128 keys from the one holding lo of the
    first row to hi of the last; both consumers (64 rows each) run every tile."""
    return fwd(lo, hi, t, False, rows=128, wrows=64, bk=128, skip_past=False)


def bwd_ws(lo, hi, t, keys=128, ckeys=64, bq=64):
    """bwd_wgmma_ws, band: block of `keys` keys, query tiles of `bq` rows from the first row with
    hi > k0 to the first with lo >= k0 + keys; both consumers (`ckeys` keys each) run every tile."""
    work = seen = 0
    for k0 in range(0, t, keys):
        k1 = min(k0 + keys, t)
        i_begin, i_end = first_at_least(hi, k0 + 1), first_at_least(lo, k1)
        for i0 in range(i_begin, i_end, bq):
            for kc in range(k0, k1, ckeys):
                work += ckeys * bq
                seen += covered(lo, hi, i0, min(i0 + bq, t), kc, min(kc + ckeys, t))
    return work, seen


def main():
    argv = sys.argv[1:]
    rand = "--random" in argv
    args = [int(a) for a in argv if a != "--random"]
    t = args[0] if args else 16384
    lengths = args[1:] or [32, 64, 128, 256, 512, 2048]
    band = doc_band_random if rand else doc_band
    what = "lengths uniform in [L/2, L], seed 1" if rand else "all of length L"
    print(f"T = {t}, causal packed documents ({what}); work = pairs through the tensor cores, as a multiple of the visible pairs")
    print(f"{'doc len':>8} | {'fwd before':>10} {'after':>6} | {'dQ before':>9} {'after':>6} | {'dK/dV before':>12} {'after':>6}")
    ok = True
    hopper = []
    for length in lengths:
        lo, hi = band(t, length)
        visible = sum(h - l for l, h in zip(lo, hi))
        cells = []
        for kernel in (fwd, dq, dkdv):
            for skip in (False, True):
                work, seen = kernel(lo, hi, t, skip)
                ok &= seen == visible
                cells.append(work / visible)
        print(f"{length:>8} | {cells[0]:>10.2f} {cells[1]:>6.2f} | {cells[2]:>9.2f} {cells[3]:>6.2f} | {cells[4]:>12.2f} {cells[5]:>6.2f}")
        row = []
        for kernel in (fwd_ws, bwd_ws):
            work, seen = kernel(lo, hi, t)
            ok &= seen == visible
            row.append(work / visible)
        hopper.append((length, row, cells[1], (cells[3] + cells[5]) / 2))
    print("Hopper warp-specialized band kernels (wgmma-ws, wgmma-tma), against the pipelined ones with the skip:")
    print(f"{'doc len':>8} | {'fwd':>6} {'vs pipelined':>12} | {'bwd':>6} {'vs pipelined dQ+dK/dV':>21}")
    for length, (f, b), pf, pb in hopper:
        print(f"{length:>8} | {f:>6.2f} {f / pf:>11.2f}x | {b:>6.2f} {b / pb:>20.2f}x")
    if not ok:
        print("band_work: a schedule left out visible pairs")
        sys.exit(1)


if __name__ == "__main__":
    main()
