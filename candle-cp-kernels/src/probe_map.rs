//! Inputs and predicted register contents of the probe kernels (`kernels/probe.cu`,
//! `kernels/probe_sm90.cu`), from the layouts our kernels are written against (the comment above
//! `cp_mma16816` and `cp_ldsm_x4` in common.cuh, `pipe_off_a` / `pipe_off_b` in flash_bwd_pipe.cuh,
//! the header of flash_fwd_sm90.cu), and the conversion of a raw dump into a [`Check`] for
//! [`crate::probe_diag`]. Plain Rust (no CUDA): `emu/check_probe.cpp` transcribes the same inputs
//! and layouts in C++ for the emulator.
//!
//! Inputs are small integers, exact in bf16 and f16 and in an f32 sum, chosen so that each output
//! value names its source: for mma16816, `A[m][k]` = 16m + k + 1 against a one-hot B (passes 0, 1:
//! D = `A[m][n + 8p]`) and a one-hot A against `B[k][n]` = 8k + n + 1 (pass 2: D = `B[m][n]`); for
//! wgmma, one nonzero per 16 k values in each row of A (at k % 16 = m % 16) and four passes
//! giving D = m + 1 (row), n + 1 (column), the A k-step read + 1, and the B k index + 1; for the
//! TMA load, a 16-bit code per tensor element (batch, head, row, column); for the stmatrix dS
//! store, a 16-bit code per dS element (query, key).

use crate::probe_diag::{Check, Item};

/// Passes of the mma16816 probe (grid of `probe_mma16816_*`).
pub const MMA_PASSES: usize = 3;
/// Passes of the wgmma probes (grid of `probe_wgmma_*`): row, column, A k-step, B k.
pub const WG_PASSES: usize = 4;
/// K extent of the wgmma probes (8 k-steps of 16: two 64-element column blocks).
pub const WG_K: usize = 128;
/// Rows of A in the wgmma probes (two warpgroups of 64).
pub const WG_M: usize = 128;
/// Threads per block of the wgmma probes.
pub const WG_THREADS: usize = 256;

/// An f32 output value as a 0-based code: `v - 1` when `v` is an integer in `1..=max`.
fn code(v: f32, max: i64) -> Result<i64, String> {
    if v.fract() == 0.0 && v >= 1.0 && (v as i64) <= max {
        Ok(v as i64 - 1)
    } else {
        Err(format!("{v}"))
    }
}

/// mma16816 accumulator register `r` of `lane`: D row g + 8 (r / 2), column 2t + r % 2.
pub fn mma_d_coord(lane: usize, r: usize) -> (i64, i64) {
    let (g, t) = (lane / 4, lane % 4);
    ((g + 8 * (r / 2)) as i64, (2 * t + r % 2) as i64)
}

/// Inputs of mma16816 pass `p`: A [16 x 16] row-major and B [16 x 8] (`B[k][n]` at 8k + n).
pub fn mma_inputs(p: usize) -> (Vec<f32>, Vec<f32>) {
    let a = (0..256).map(|e| if p < 2 { e as f32 + 1.0 } else if e / 16 == e % 16 { 1.0 } else { 0.0 }).collect();
    let b = (0..128)
        .map(|e| {
            let (k, n) = (e / 8, e % 8);
            match p {
                0 => (k == n) as u8 as f32,
                1 => (k == n + 8) as u8 as f32,
                _ => e as f32 + 1.0,
            }
        })
        .collect();
    (a, b)
}

/// Checks of an mma16816 dump `[MMA_PASSES][32 lanes][4]` f32: `A operand` (passes 0, 1: which A
/// element each register holds) and `B operand` (pass 2: which B element).
pub fn mma_checks(dump: &[f32]) -> Vec<Check> {
    let mut a = Check { name: "A operand".into(), axes: vec!["A row", "A col"], reg_name: "d", step_name: "pass", items: vec![] };
    let mut b = Check { name: "B operand".into(), axes: vec!["B k", "B n"], reg_name: "d", step_name: "pass", items: vec![] };
    for p in 0..MMA_PASSES {
        for lane in 0..32 {
            for r in 0..4 {
                let (m, n) = mma_d_coord(lane, r);
                let v = dump.get((p * 32 + lane) * 4 + r).copied().unwrap_or(f32::NAN);
                let (expected, found) = if p < 2 {
                    let c = code(v, 256);
                    (vec![m, n + 8 * p as i64], vec![c.clone().map(|c| c / 16), c.map(|c| c % 16)])
                } else {
                    let c = code(v, 128);
                    (vec![m, n], vec![c.clone().map(|c| c / 8), c.map(|c| c % 8)])
                };
                let it = Item { step: Some(p as u32), thread: lane as u32, reg: r as u32, half: None, expected, found };
                if p < 2 { a.items.push(it) } else { b.items.push(it) }
            }
        }
    }
    vec![a, b]
}

/// Row stride in bytes of the ldmatrix probe's 16 x 16 tile (`PROBE_LDSM_DPB`).
pub const LDSM_DPB: usize = 48;
/// The four ldmatrix variants of `probe_ldsm`, in dump order: (name, transposed, offsets b).
pub const LDSM_VARIANTS: [(&str, bool, bool); 4] = [
    ("ldmatrix x4 pipe_off_a", false, false),
    ("ldmatrix x4.trans pipe_off_a", true, false),
    ("ldmatrix x4 pipe_off_b", false, true),
    ("ldmatrix x4.trans pipe_off_b", true, true),
];

/// Tile element (row, col) in half `h` of register `i` of `lane` for an ldmatrix .x4 (trans or
/// not) whose matrix i starts at (8 (i & 1), 8 (i >> 1)) (pipe_off_a) or (8 (i >> 1), 8 (i & 1))
/// (pipe_off_b): row l/4, elements 2(l%4) + h of matrix i, or with .trans (row 2(l%4) + h, col l/4).
pub fn ldsm_coord(lane: usize, i: usize, h: usize, trans: bool, off_b: bool) -> (i64, i64) {
    let (r0, c0) = if off_b { (8 * (i >> 1), 8 * (i & 1)) } else { (8 * (i & 1), 8 * (i >> 1)) };
    let (x, y) = (lane / 4, 2 * (lane % 4) + h);
    let (r, c) = if trans { (r0 + y, c0 + x) } else { (r0 + x, c0 + y) };
    (r as i64, c as i64)
}

/// Check of variant `v` of an ldmatrix dump `[4][32 lanes][4]` u32 (tile codes (row << 8) | col).
pub fn ldsm_check(dump: &[u32], v: usize) -> Check {
    let (name, trans, off_b) = LDSM_VARIANTS[v];
    let mut c = Check { name: name.into(), axes: vec!["row", "col"], reg_name: "r", step_name: "", items: vec![] };
    for lane in 0..32 {
        for i in 0..4 {
            let w = dump.get((v * 32 + lane) * 4 + i).copied().unwrap_or(0xFFFF_FFFF);
            for h in 0..2 {
                let x = (w >> (16 * h)) & 0xFFFF;
                let (er, ec) = ldsm_coord(lane, i, h, trans, off_b);
                let found = if (x >> 8) < 16 && (x & 0xFF) < 16 {
                    vec![Ok((x >> 8) as i64), Ok((x & 0xFF) as i64)]
                } else {
                    vec![Err(format!("{x:#06x}")), Err(format!("{x:#06x}"))]
                };
                c.items.push(Item { step: None, thread: lane as u32, reg: i as u32, half: Some(h as u8), expected: vec![er, ec], found });
            }
        }
    }
    c
}

/// Source of `probe_cp_async`: 128 chunks of 4 words, word w of chunk c = 0xC0DE0000 | c << 4 | w.
pub fn cp_async_src() -> Vec<u32> {
    (0..512u32).map(|e| 0xC0DE_0000 | ((e / 4) << 4) | (e % 4)).collect()
}

/// Checks of `probe_cp_async`'s dump: `chunks` (128 chunks of 4 words: the source chunk each holds,
/// -1 for zero-filled) and `wait_group 1` (64 flags: group 0 complete after wait_group 1).
pub fn cp_async_checks(chunks: &[u32], early: &[u32]) -> Vec<Check> {
    let src = cp_async_src();
    let mut c = Check { name: "chunks".into(), axes: vec!["source chunk (-1 zero-filled)"], reg_name: "chunk", step_name: "", items: vec![] };
    for j in 0..128usize {
        let i = j % 64;
        let valid = if j < 64 { i % 4 != 3 } else { i % 5 != 0 };
        let w: Vec<u32> = (0..4).map(|x| chunks.get(j * 4 + x).copied().unwrap_or(0xFFFF_FFFF)).collect();
        let found = if w.iter().all(|&x| x == 0) {
            Ok(-1)
        } else if let Some(s) = (0..128).find(|&s| src[s * 4..s * 4 + 4] == w[..]) {
            Ok(s as i64)
        } else if w.iter().all(|&x| x == 0xFFFF_FFFF) {
            Err("poison (never written)".to_string())
        } else {
            Err(format!("{w:08x?}"))
        };
        c.items.push(Item { step: None, thread: i as u32, reg: j as u32, half: None, expected: vec![if valid { j as i64 } else { -1 }], found: vec![found] });
    }
    let mut e = Check { name: "wait_group 1".into(), axes: vec!["group 0 landed"], reg_name: "flag", step_name: "", items: vec![] };
    for i in 0..64 {
        let f = early.get(i).copied().unwrap_or(2);
        e.items.push(Item { step: None, thread: i as u32, reg: 0, half: None, expected: vec![1], found: vec![Ok(f as i64)] });
    }
    vec![c, e]
}

/// Global tensor of `probe_tma` (`[B, L, Hh, D]` = `[2, 120, 2, 128]`, 16-bit): element
/// (b, l, h, d) holds the code `b << 15 | h << 14 | l << 7 | d` (unique; never 0 in batch 1).
pub const TMA_DIMS: (usize, usize, usize, usize) = (2, 120, 2, 128);
/// Coordinates of `probe_tma`'s load, innermost first (d, h, l, b): the second 64-column block of
/// head 1, rows 20.. of batch 1; box rows 100..127 (tensor rows 120..147) are out of bounds.
pub const TMA_COORDS: [i32; 4] = [64, 1, 20, 1];
/// Box rows and 16-bit columns of `probe_tma`'s load (the flash kernels' box, 128 bytes a row).
pub const TMA_BOX: (usize, usize) = (128, 64);

/// Source of `probe_tma`: the codes of [`TMA_DIMS`] in `[B, L, Hh, D]` order.
pub fn tma_src() -> Vec<u16> {
    let (nb, nl, nh, nd) = TMA_DIMS;
    let mut v = Vec::with_capacity(nb * nl * nh * nd);
    for b in 0..nb {
        for l in 0..nl {
            for h in 0..nh {
                for d in 0..nd {
                    v.push(((b << 15) | (h << 14) | (l << 7) | d) as u16);
                }
            }
        }
    }
    v
}

/// The tensor element (l, d) that the 128-byte swizzle puts at 16-bit position `j` of box row `r`
/// of `probe_tma`'s buffer (16-byte chunk `j / 8` of row `r` holds logical chunk `(j / 8) ^ (r % 8)`),
/// or `None` where the row is past the tensor (zero-filled).
pub fn tma_expected(r: usize, j: usize) -> Option<(i64, i64)> {
    let c = (j / 8) ^ (r % 8);
    let (d, l) = (TMA_COORDS[0] as i64 + (8 * c + j % 8) as i64, TMA_COORDS[2] as i64 + r as i64);
    (l < TMA_DIMS.1 as i64).then_some((l, d))
}

/// Checks of `probe_tma`'s dump: `box` (4096 words: the buffer as it landed; per 16-bit element the
/// tensor row l and column d it holds, -1 / -1 for zero), `swizzle` (the span, 128 / 64 / 32 bytes
/// or 0 for none, whose pattern explains the rows that hold data: names the layout when `box`
/// fails) and `mbarrier phase` (128 flags: each thread passed the mbarrier wait).
pub fn tma_check(words: &[u32], done: &[u32]) -> Vec<Check> {
    let (rows, cols) = TMA_BOX;
    let mut c = Check { name: "box".into(), axes: vec!["l (-1 zero)", "d (-1 zero)"], reg_name: "elem", step_name: "", items: vec![] };
    for r in 0..rows {
        for j in 0..cols {
            let w = words.get((r * cols + j) / 2).copied().unwrap_or(0xFFFF_FFFF);
            let v = if j % 2 == 0 { w & 0xFFFF } else { w >> 16 };
            let found = if v == 0 {
                vec![Ok(-1), Ok(-1)]
            } else if v >> 14 == 3 && ((v >> 7) & 0x7F) < TMA_DIMS.1 as u32 {
                vec![Ok(((v >> 7) & 0x7F) as i64), Ok((v & 0x7F) as i64)]
            } else {
                vec![Err(format!("{v:#06x}")), Err(format!("{v:#06x}"))]
            };
            let expected = match tma_expected(r, j) {
                Some((l, d)) => vec![l, d],
                None => vec![-1, -1],
            };
            c.items.push(Item { step: None, thread: r as u32, reg: j as u32, half: None, expected, found });
        }
    }
    // which swizzle span explains the rows that hold data (S: 16-byte chunk j / 8 of row r holds
    // logical chunk (j / 8) ^ (r % (S / 16)); 0: none), -1 if none does
    let held = |r: usize, j: usize| c.items[r * cols + j].found.iter().map(|f| f.as_ref().ok().copied()).collect::<Option<Vec<i64>>>();
    let sw = swizzle_check(|sp| {
        (0..rows).filter(|&r| tma_expected(r, 0).is_some()).all(|r| {
            (0..cols).all(|j| {
                let lc = (j / 8) ^ if sp == 0 { 0 } else { r % (sp / 16) };
                let (l, d) = (TMA_COORDS[2] as i64 + r as i64, TMA_COORDS[0] as i64 + (8 * lc + j % 8) as i64);
                held(r, j) == Some(vec![l, d])
            })
        })
    });
    let mut e = Check { name: "mbarrier phase".into(), axes: vec!["passed the wait"], reg_name: "flag", step_name: "", items: vec![] };
    for i in 0..128 {
        let f = done.get(i).copied().unwrap_or(2);
        e.items.push(Item { step: None, thread: i as u32, reg: 0, half: None, expected: vec![1], found: vec![Ok(f as i64)] });
    }
    vec![c, sw, e]
}

/// The `swizzle` check of the TMA probes: the first span of 128 / 64 / 32 / 0 bytes (0: none) under
/// which `explains(span)` holds, expected 128 (the maps' swizzle); names the layout the hardware
/// used when the element checks fail.
fn swizzle_check(explains: impl Fn(usize) -> bool) -> Check {
    let span = [128usize, 64, 32, 0].into_iter().find(|&sp| explains(sp));
    let found = span.map_or(Err("none of 128 / 64 / 32 / 0".to_string()), |x| Ok(x as i64));
    Check {
        name: "swizzle".into(),
        axes: vec!["span bytes"],
        reg_name: "box",
        step_name: "",
        items: vec![Item { step: None, thread: 0, reg: 0, half: None, expected: vec![128], found: vec![found] }],
    }
}

/// dq tensor of `probe_tma_red` (`[B, L, Hh, D]` = `[1, 40, 2, 64]`, f32), before the reductions:
/// element (b, l, h, d) holds `10000 + 4096 h + 64 l + d` (the box's values, at most 4096, keep every
/// sum exact in f32).
pub const TMA_RED_DIMS: (usize, usize, usize, usize) = (1, 40, 2, 64);
/// Coordinates of `probe_tma_red`'s first reduction, innermost first (d, h, l, b); the second adds
/// its box at d + 32. Box rows 40..63 are past the tensor (skipped).
pub const TMA_RED_COORDS: [i32; 4] = [0, 1, 0, 0];

/// The dq tensor of `probe_tma_red` before the reductions, `[B, L, Hh, D]` order.
pub fn tma_red_init() -> Vec<f32> {
    let (_, nl, nh, nd) = TMA_RED_DIMS;
    let mut v = Vec::with_capacity(nl * nh * nd);
    for l in 0..nl {
        for h in 0..nh {
            for d in 0..nd {
                v.push((10000 + 4096 * h + 64 * l + d) as f32);
            }
        }
    }
    v
}

/// What `probe_tma_red` adds at (l, d) of head 1 when the reduction reads its shared box with a
/// swizzle span of `span` bytes (128: as the map says; 0: none) while the kernel stored it with the
/// 128-byte swizzle: the value `1 + d' + 64 l` of the element (l, d') stored where it reads.
fn tma_red_added(l: usize, d: usize, span: usize) -> i64 {
    let (x, c) = (d / 32, d % 32);
    let read_chunk = (c / 4) ^ if span == 0 { 0 } else { l % (span / 16) };
    let stored = read_chunk ^ (l % 8);  // the logical chunk the kernel put there
    (1 + 32 * x + 4 * stored + c % 4 + 64 * l) as i64
}

/// Checks of `probe_tma_red`'s result (`dq`, the tensor after the kernel): `dq head 1` (per element
/// the value added, decoded as the row l and column d it came from; expected its own (l, d)),
/// `dq head 0` (untouched: added 0) and `swizzle` (the span, 128 / 64 / 32 bytes or 0, whose reading
/// of the box explains what was added: names the layout when `dq head 1` fails).
pub fn tma_red_check(dq: &[f32]) -> Vec<Check> {
    let (_, nl, nh, nd) = TMA_RED_DIMS;
    let init = tma_red_init();
    let added = |l: usize, h: usize, d: usize| -> Option<i64> {
        let i = (l * nh + h) * nd + d;
        let delta = f64::from(*dq.get(i)?) - f64::from(init[i]);
        (delta.fract() == 0.0).then_some(delta as i64)
    };
    let decode = |v: Option<i64>| match v {
        Some(v) if (1..=64 * 64).contains(&v) => vec![Ok((v - 1) / 64), Ok((v - 1) % 64)],
        Some(0) => vec![Ok(-1), Ok(-1)],
        other => vec![Err(format!("{other:?}")), Err(format!("{other:?}"))],
    };
    let mut c1 = Check { name: "dq head 1".into(), axes: vec!["l (-1 none)", "d (-1 none)"], reg_name: "d", step_name: "", items: vec![] };
    let mut c0 = Check { name: "dq head 0".into(), axes: vec!["l (-1 none)", "d (-1 none)"], reg_name: "d", step_name: "", items: vec![] };
    for l in 0..nl {
        for d in 0..nd {
            c1.items.push(Item { step: None, thread: l as u32, reg: d as u32, half: None, expected: vec![l as i64, d as i64], found: decode(added(l, 1, d)) });
            c0.items.push(Item { step: None, thread: l as u32, reg: d as u32, half: None, expected: vec![-1, -1], found: decode(added(l, 0, d)) });
        }
    }
    let sw = swizzle_check(|sp| (0..nl).all(|l| (0..nd).all(|d| added(l, 1, d) == Some(tma_red_added(l, d, sp)))));
    vec![c1, c0, sw]
}

/// Bytes of `probe_stsm_ds`'s dumped tile: one `[64 queries x 64 keys]` 16-bit dS tile per
/// warpgroup (w = 0, 1), 128-byte rows, 128-byte swizzle (the layout the dQ wgmma reads).
pub const STSM_TILE_BYTES: usize = 2 * 64 * 128;

/// The 16-bit code `probe_stsm_ds` gives dS element (query, key): `0x8000 | query << 8 | key`.
pub fn stsm_code(query: usize, key: usize) -> u32 {
    0x8000 | ((query as u32) << 8) | key as u32
}

/// Register `r` of k-step `kk` of the dS^T fragments (`dsa[kk][r]`) of thread `tid` of
/// `probe_stsm_ds`, as the Hopper backwards hold them: low half (query c, key), high half (c + 1,
/// key), key = 64 wg + 16 wr + g + 8 (r & 1), c = 16 kk + 8 (r >> 1) + 2t.
pub fn stsm_frag(tid: usize, kk: usize, r: usize) -> u32 {
    let (wg, wr, lane) = (tid / 128, (tid / 32) % 4, tid % 32);
    let (g, t) = (lane / 4, lane % 4);
    let key = 64 * wg + 16 * wr + g + 8 * (r & 1);
    let c = 16 * kk + 8 * (r >> 1) + 2 * t;
    stsm_code(c, key) | stsm_code(c + 1, key) << 16
}

/// (query, key) that the kernels' dS layout puts at 16-bit element `e` of the tile: byte
/// `w * 8192 + q * 128 + 16 c + 2 j` holds query q and key `64 w + 8 ((c ^ q) % 8) + j`.
pub fn stsm_expected(e: usize) -> (i64, i64) {
    let (w, q, c, j) = (e / 4096, (e / 64) % 64, (e / 8) % 8, e % 8);
    (q as i64, (64 * w + 8 * ((c ^ q) % 8) + j) as i64)
}

/// The tile `probe_stsm_ds` leaves if stmatrix .x4 stores matrix i from row addresses given by lanes
/// 8i .. 8i + 7 and register i of lane l holds (row l / 4, cols 2 (l % 4), + 1) of matrix i
/// (`trans`: of its transpose; the PTX ISA's reading is `true`), with the row addresses of
/// `bwd_sm90_ds_store` (flash_sm90.cuh). Used to name the reading a failing dump matches.
pub fn stsm_simulate(trans: bool) -> Vec<u32> {
    let mut h = vec![0u16; STSM_TILE_BYTES / 2];
    for tid in 0..256 {
        let (wg, wr, lane) = (tid / 128, (tid / 32) % 4, tid % 32);
        let (rr, cc) = (lane / 4, 2 * (lane % 4));
        for kk in 0..4 {
            for i in 0..4 {
                // the row addresses: lanes 8i .. 8i + 7 of this warp
                let row = |j: usize| wg * 64 * 128 + (8 * (i >> 1) + j) * 128 + ((((2 * wr + (i & 1)) ^ j) & 7) << 4) + kk * 16 * 128;
                let v = stsm_frag(tid, kk, i);
                for (x, half) in [(cc, v & 0xFFFF), (cc + 1, v >> 16)] {
                    let byte = if trans { row(x) + 2 * rr } else { row(rr) + 2 * x };
                    h[byte / 2] = half as u16;
                }
            }
        }
    }
    h.chunks(2).map(|p| u32::from(p[0]) | u32::from(p[1]) << 16).collect()
}

/// Checks of `probe_stsm_ds`'s dump (`words`, the raw tile): `dS tile` (per 16-bit element the
/// (query, key) its code names, -1 for an element never written; expected [`stsm_expected`]) and
/// `stmatrix reading` (1 if the dump is what the PTX ISA's `.trans` reading predicts, 0 if it is
/// what a store without the transpose would leave, -1 neither).
pub fn stsm_check(words: &[u32]) -> Vec<Check> {
    let mut c = Check { name: "dS tile".into(), axes: vec!["query (-1 none)", "key (-1 none)"], reg_name: "elem", step_name: "", items: vec![] };
    for e in 0..STSM_TILE_BYTES / 2 {
        let w = words.get(e / 2).copied().unwrap_or(0xFFFF_FFFF);
        let v = if e % 2 == 0 { w & 0xFFFF } else { w >> 16 };
        let found = if v == 0 {
            vec![Ok(-1), Ok(-1)]
        } else if v >> 15 == 1 {
            vec![Ok(((v >> 8) & 0x7F) as i64), Ok((v & 0xFF) as i64)]
        } else {
            vec![Err(format!("{v:#06x}")), Err(format!("{v:#06x}"))]
        };
        let (q, k) = stsm_expected(e);
        c.items.push(Item { step: None, thread: (e / 64) as u32, reg: (e % 64) as u32, half: None, expected: vec![q, k], found });
    }
    let reading = if words == stsm_simulate(true).as_slice() {
        1
    } else if words == stsm_simulate(false).as_slice() {
        0
    } else {
        -1
    };
    let r = Check {
        name: "stmatrix reading".into(),
        axes: vec![".trans transposes (1 yes, 0 no, -1 neither)"],
        reg_name: "dump",
        step_name: "",
        items: vec![Item { step: None, thread: 0, reg: 0, half: None, expected: vec![1], found: vec![Ok(reading)] }],
    };
    vec![c, r]
}

/// Operand forms of the wgmma probes: `Ss` (A and B by descriptor, K-major: S = Q K^T), `Rs` (A
/// from registers via acc_to_a, B by descriptor MN-major with imm-trans-b: O += P V), `SsTb` (A by
/// descriptor K-major, B MN-major: dQ = dS K, N = 64 only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgForm {
    /// A desc K-major, B desc K-major.
    Ss,
    /// A registers, B desc MN-major.
    Rs,
    /// A desc K-major, B desc MN-major.
    SsTb,
}

impl WgForm {
    /// Kernel-name part: `ss`, `rs`, `sstb`.
    pub fn tag(self) -> &'static str {
        match self {
            WgForm::Ss => "ss",
            WgForm::Rs => "rs",
            WgForm::SsTb => "sstb",
        }
    }
}

/// `A[m][k]` of wgmma pass `p` (one nonzero per 16 k values: k % 16 == m % 16).
pub fn wg_a(p: usize, m: usize, k: usize) -> f32 {
    if k % 16 != m % 16 {
        return 0.0;
    }
    match p {
        0 => (m + 1) as f32,
        2 => (k / 16 + 1) as f32,
        _ => 1.0,
    }
}

/// `B[k][n]` of wgmma pass `p`.
pub fn wg_b(p: usize, k: usize, n: usize) -> f32 {
    match p {
        1 => (n + 1) as f32,
        3 => (k + 1) as f32,
        _ => 1.0,
    }
}

/// Inputs of a wgmma probe, all passes: A `[WG_PASSES][128][128]` row-major and B
/// `[WG_PASSES][N][128]` (K-major, `Ss`) or `[WG_PASSES][128][N]` (MN-major, `Rs`, `SsTb`).
pub fn wg_inputs(form: WgForm, n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut a = Vec::with_capacity(WG_PASSES * WG_M * WG_K);
    let mut b = Vec::with_capacity(WG_PASSES * WG_K * n);
    for p in 0..WG_PASSES {
        a.extend((0..WG_M * WG_K).map(|e| wg_a(p, e / WG_K, e % WG_K)));
        if form == WgForm::Ss {
            b.extend((0..n * WG_K).map(|e| wg_b(p, e % WG_K, e / WG_K)));
        } else {
            b.extend((0..WG_K * n).map(|e| wg_b(p, e / n, e % n)));
        }
    }
    (a, b)
}

/// wgmma accumulator element `reg` (= 4i + e) of block thread `tid`: row 64 wg + 16 wr + g +
/// 8 (e / 2), column 8i + 2t + e % 2 (wg = tid / 128, wr = tid / 32 % 4, g = lane / 4, t = lane % 4).
pub fn wg_acc_coord(tid: usize, reg: usize) -> (i64, i64) {
    let (wg, wr, lane) = (tid / 128, (tid / 32) % 4, tid % 32);
    let (g, t, i, e) = (lane / 4, lane % 4, reg / 4, reg % 4);
    ((64 * wg + 16 * wr + g + 8 * (e / 2)) as i64, (8 * i + 2 * t + e % 2) as i64)
}

/// Check of a wgmma dump `[WG_PASSES][8 k-steps][256 threads][n / 2]` f32: per k-step, thread and
/// accumulator register, the (row, col) the four passes decode to and which A k-step and B k it
/// multiplied, against (m, n, kk, 16 kk + m % 16).
pub fn wg_check(name: &str, n: usize, dump: &[f32]) -> Check {
    let ks = WG_K / 16;
    let mut c = Check { name: name.into(), axes: vec!["row", "col", "A k-step", "B k"], reg_name: "d", step_name: "kk", items: vec![] };
    c.items.reserve(ks * WG_THREADS * n / 2);
    let max = [WG_M as i64, n as i64, ks as i64, WG_K as i64];
    for kk in 0..ks {
        for tid in 0..WG_THREADS {
            for reg in 0..n / 2 {
                let (m, col) = wg_acc_coord(tid, reg);
                let found = (0..WG_PASSES)
                    .map(|p| code(dump.get(((p * ks + kk) * WG_THREADS + tid) * (n / 2) + reg).copied().unwrap_or(f32::NAN), max[p]))
                    .collect();
                let expected = vec![m, col, kk as i64, (16 * kk) as i64 + m % 16];
                c.items.push(Item { step: Some(kk as u32), thread: tid as u32, reg: reg as u32, half: None, expected, found });
            }
        }
    }
    c
}

#[cfg(test)]
#[path = "probe_map_tests.rs"]
mod tests;
