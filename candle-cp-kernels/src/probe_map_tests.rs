//! Tests of `probe_map` + `probe_diag`: dumps simulated on the host from a "hardware" layout
//! (the documented one, or a deliberately wrong one) must be diagnosed as OK or as the error.

use super::*;
use crate::probe_diag::{diagnose, diagnose_all};

/// mma16816 dump of a device whose D register r of `lane` holds element `dmap(lane, r)`.
fn sim_mma(dmap: impl Fn(usize, usize) -> (i64, i64)) -> Vec<f32> {
    let mut out = vec![0f32; MMA_PASSES * 128];
    for p in 0..MMA_PASSES {
        let (a, b) = mma_inputs(p);
        for lane in 0..32 {
            for r in 0..4 {
                let (m, n) = dmap(lane, r);
                out[(p * 32 + lane) * 4 + r] = (0..16).map(|k| a[16 * m as usize + k] * b[8 * k + n as usize]).sum();
            }
        }
    }
    out
}

#[test]
fn mma_correct_and_row_halves_swapped() {
    let r = diagnose_all("mma", &mma_checks(&sim_mma(mma_d_coord)));
    assert!(r.ok, "{}", r.diagnosis);
    let r = diagnose_all("mma", &mma_checks(&sim_mma(|l, r| {
        let (m, n) = mma_d_coord(l, r);
        (m ^ 8, n)
    })));
    assert!(!r.ok);
    assert!(r.diagnosis.contains("[A operand] 256 of 256 values wrong; pattern: A row -> A row ^ 8 (A rows 8..15 swapped with 0..7 in every group of 16)"), "{}", r.diagnosis);
    assert!(r.diagnosis.contains("[B operand] 128 of 128 values wrong; pattern: B k -> B k ^ 8"), "{}", r.diagnosis);
    // a register that holds a sum / zero (e.g. A fragment halves in the wrong register)
    let mut d = sim_mma(mma_d_coord);
    d[5] = 0.0;
    let r = diagnose_all("mma", &mma_checks(&d));
    assert!(r.diagnosis.contains("pass 0 thread 1 d[1]: expected (A row=0, A col=3) found (A row=?0, A col=?0)"), "{}", r.diagnosis);
}

/// ldmatrix dump (all four variants) of a device that loads element `map(lane, i, h, trans, off_b)`.
fn sim_ldsm(map: impl Fn(usize, usize, usize, bool, bool) -> (i64, i64)) -> Vec<u32> {
    let mut out = vec![0u32; 4 * 128];
    for (v, &(_, trans, off_b)) in LDSM_VARIANTS.iter().enumerate() {
        for lane in 0..32 {
            for i in 0..4 {
                let mut w = 0u32;
                for h in 0..2 {
                    let (r, c) = map(lane, i, h, trans, off_b);
                    w |= (((r << 8) | c) as u32) << (16 * h);
                }
                out[(v * 32 + lane) * 4 + i] = w;
            }
        }
    }
    out
}

#[test]
fn ldsm_correct_and_transposed() {
    let d = sim_ldsm(ldsm_coord);
    for v in 0..4 {
        let r = diagnose(&ldsm_check(&d, v));
        assert!(r.ok, "{}", r.diagnosis);
    }
    // hardware .trans semantics opposite to ours: transposed inside each 8x8 matrix
    let d = sim_ldsm(|l, i, h, t, b| ldsm_coord(l, i, h, !t, b));
    let r = diagnose(&ldsm_check(&d, 1));
    assert!(!r.ok);
    assert!(r.diagnosis.contains("pattern: row and col transposed within 8x8 blocks"), "{}", r.diagnosis);
    // matrices 1 and 2 swapped (pipe_off_a vs pipe_off_b order)
    let d = sim_ldsm(|l, i, h, t, b| ldsm_coord(l, i, h, t, !b));
    let r = diagnose(&ldsm_check(&d, 0));
    assert!(!r.ok && r.diagnosis.contains("row -> row ^ 8 (rows 8..15 swapped with 0..7 in every group of 16) (128 registers); col -> col ^ 8"), "{}", r.diagnosis);
}

#[test]
fn cp_async_zero_fill() {
    let src = cp_async_src();
    let mut chunks = vec![0u32; 512];
    for j in 0..128 {
        let i = j % 64;
        if (j < 64 && i % 4 != 3) || (j >= 64 && i % 5 != 0) {
            chunks[j * 4..j * 4 + 4].copy_from_slice(&src[j * 4..j * 4 + 4]);
        }
    }
    let early = vec![1u32; 64];
    let r = diagnose_all("cp.async", &cp_async_checks(&chunks, &early));
    assert!(r.ok, "{}", r.diagnosis);
    // zero-fill ignored: the poison stays
    let mut bad = chunks.clone();
    bad[3 * 4..3 * 4 + 4].fill(0xFFFF_FFFF);
    let mut late = early.clone();
    late[7] = 0;
    let r = diagnose_all("cp.async", &cp_async_checks(&bad, &late));
    assert!(!r.ok);
    assert!(r.diagnosis.contains("[chunks] 1 of 128 values wrong (1 hold no single source element)"), "{}", r.diagnosis);
    assert!(r.diagnosis.contains("thread 3 chunk[3]: expected (source chunk (-1 zero-filled)=-1) found (source chunk (-1 zero-filled)=?poison (never written))"), "{}", r.diagnosis);
    assert!(r.diagnosis.contains("[wait_group 1] 1 of 64 values wrong"), "{}", r.diagnosis);
}

/// wgmma dump of a device whose accumulator `reg` of `tid` at k-step kk holds D(`acc(tid, reg)`)
/// of A k-step `a_step(kk)` against B k-step kk.
fn sim_wg(n: usize, acc: impl Fn(usize, usize) -> (i64, i64), a_step: impl Fn(usize) -> usize) -> Vec<f32> {
    let ks = WG_K / 16;
    let mut out = vec![0f32; WG_PASSES * ks * WG_THREADS * n / 2];
    for p in 0..WG_PASSES {
        for kk in 0..ks {
            for tid in 0..WG_THREADS {
                for reg in 0..n / 2 {
                    let (m, c) = acc(tid, reg);
                    let (m, c) = (m as usize, c as usize);
                    let v: f32 = (0..16).map(|k| wg_a(p, m, 16 * a_step(kk) + k) * wg_b(p, 16 * kk + k, c)).sum();
                    out[((p * ks + kk) * WG_THREADS + tid) * (n / 2) + reg] = v;
                }
            }
        }
    }
    out
}

#[test]
fn wgmma_correct_swapped_rows_and_k_step() {
    let r = diagnose(&wg_check("wg", 64, &sim_wg(64, wg_acc_coord, |kk| kk)));
    assert!(r.ok, "{}", r.diagnosis);
    assert_eq!(r.diagnosis, "OK (65536 values checked)");
    let r = diagnose(&wg_check("wg", 64, &sim_wg(64, |t, g| {
        let (m, c) = wg_acc_coord(t, g);
        (m ^ 8, c)
    }, |kk| kk)));
    assert!(!r.ok);
    assert!(r.diagnosis.contains("pattern: row -> row ^ 8 (rows 8..15 swapped with 0..7 in every group of 16) (65536 registers); B k -> B k ^ 8"), "{}", r.diagnosis);
    // descriptor k-step crossing the 64-element column block wrongly: A reads step kk ^ 4
    let r = diagnose(&wg_check("wg", 64, &sim_wg(64, wg_acc_coord, |kk| kk ^ 4)));
    assert!(!r.ok);
    assert!(r.diagnosis.contains("pattern: A k-step -> A k-step ^ 4 (A k-steps 4..7 swapped with 0..3 in every group of 8) (65536 registers);"), "{}", r.diagnosis);
    // columns transposed inside 8x8 blocks would need n = row: check a column shift instead
    let r = diagnose(&wg_check("wg", 128, &sim_wg(128, |t, g| {
        let (m, c) = wg_acc_coord(t, g);
        (m, (c + 8) % 128)
    }, |kk| kk)));
    assert!(r.diagnosis.contains("col permuted: 0->8"), "{}", r.diagnosis);
}

#[test]
fn inputs_are_exact_and_unique() {
    // every code fits the bf16 exact-integer range (<= 256)
    for p in 0..MMA_PASSES {
        let (a, b) = mma_inputs(p);
        assert!(a.iter().chain(&b).all(|&x| x <= 256.0 && x.fract() == 0.0));
    }
    let (a, b) = wg_inputs(WgForm::Ss, 128);
    assert!(a.iter().chain(&b).all(|&x| x <= 256.0 && x.fract() == 0.0));
    assert_eq!((a.len(), b.len()), (4 * 128 * 128, 4 * 128 * 128));
    // accumulator layout: every (row, col) of the 128 x N tile exactly once
    let mut seen = std::collections::HashSet::new();
    for tid in 0..WG_THREADS {
        for reg in 0..64 {
            assert!(seen.insert(wg_acc_coord(tid, reg)));
        }
    }
    assert_eq!(seen.len(), 128 * 128);
}

/// `probe_tma`'s dump as a load with swizzle pattern `sw` (chunk j / 8 of row r from logical chunk
/// sw(r, j / 8)) and rows past the tensor `oob` (zero, or left as poison).
fn sim_tma(sw: impl Fn(usize, usize) -> usize, zero_oob: bool) -> Vec<u32> {
    let src = tma_src();
    let (_, nl, nh, nd) = TMA_DIMS;
    let [c0, c1, c2, c3] = TMA_COORDS.map(|x| x as usize);
    let mut h16 = vec![0u16; 128 * 64];
    for r in 0..128 {
        for j in 0..64 {
            let (l, d) = (c2 + r, c0 + 8 * sw(r, j / 8) + j % 8);
            h16[r * 64 + j] = if l < nl { src[((c3 * nl + l) * nh + c1) * nd + d] } else if zero_oob { 0 } else { 0xFFFF };
        }
    }
    (0..h16.len() / 2).map(|i| h16[2 * i] as u32 | (h16[2 * i + 1] as u32) << 16).collect()
}

#[test]
fn tma_swizzle_and_zero_fill() {
    let done = vec![1u32; 128];
    let r = diagnose_all("tma", &tma_check(&sim_tma(|r, c| c ^ (r % 8), true), &done));
    assert!(r.ok, "{}", r.diagnosis);
    // no swizzle: the chunks of rows 1..7 (mod 8) land unpermuted
    let r = diagnose_all("tma", &tma_check(&sim_tma(|_, c| c, true), &done));
    assert!(!r.ok && r.diagnosis.contains("[box] 5568 of 8192 values wrong"), "{}", r.diagnosis);
    assert!(r.diagnosis.contains("[swizzle] 1 of 1 values wrong; pattern: span bytes permuted: 128->0 (1 registers); first: thread 0 box[0]: expected (span bytes=128) found (span bytes=0)"), "{}", r.diagnosis);
    // a 64-byte swizzle
    let r = diagnose_all("tma", &tma_check(&sim_tma(|r, c| c ^ (r % 4), true), &done));
    assert!(!r.ok && r.diagnosis.contains("found (span bytes=64)"), "{}", r.diagnosis);
    // rows past the tensor not zero-filled
    let r = diagnose_all("tma", &tma_check(&sim_tma(|r, c| c ^ (r % 8), false), &done));
    assert!(!r.ok && r.diagnosis.contains("1792 of 8192 values wrong (1792 hold no single source element)"), "{}", r.diagnosis);
    // a thread that never passed the phase
    let mut late = done.clone();
    late[5] = 0;
    let r = diagnose_all("tma", &tma_check(&sim_tma(|r, c| c ^ (r % 8), true), &late));
    assert!(!r.ok && r.diagnosis.contains("[mbarrier phase] 1 of 128 values wrong"), "{}", r.diagnosis);
}

/// `probe_tma_red`'s dq after reductions that read the shared box with a `span`-byte swizzle, into
/// head `h` (1: the map's coordinates).
fn sim_tma_red(span: usize, h: usize) -> Vec<f32> {
    let (_, nl, nh, nd) = TMA_RED_DIMS;
    let mut dq = tma_red_init();
    for l in 0..nl {
        for d in 0..nd {
            dq[(l * nh + h) * nd + d] += tma_red_added(l, d, span) as f32;
        }
    }
    dq
}

#[test]
fn tma_reduction_swizzle() {
    let r = diagnose_all("tma reduce", &tma_red_check(&sim_tma_red(128, 1)));
    assert!(r.ok, "{}", r.diagnosis);
    // the reduction reads the box unswizzled: rows 1..7 (mod 8) get other columns' values
    let r = diagnose_all("tma reduce", &tma_red_check(&sim_tma_red(0, 1)));
    assert!(!r.ok && r.diagnosis.contains("[dq head 1]") && r.diagnosis.contains("found (span bytes=0)"), "{}", r.diagnosis);
    // a 64-byte swizzle
    let r = diagnose_all("tma reduce", &tma_red_check(&sim_tma_red(64, 1)));
    assert!(!r.ok && r.diagnosis.contains("found (span bytes=64)"), "{}", r.diagnosis);
    // added into the wrong head
    let r = diagnose_all("tma reduce", &tma_red_check(&sim_tma_red(128, 0)));
    assert!(!r.ok && r.diagnosis.contains("[dq head 0] 2560 of 2560 values wrong"), "{}", r.diagnosis);
    // nothing added (the reductions never ran)
    let r = diagnose_all("tma reduce", &tma_red_check(&tma_red_init()));
    assert!(!r.ok && r.diagnosis.contains("[dq head 1] 2560 of 2560 values wrong"), "{}", r.diagnosis);
}

#[test]
fn stmatrix_ds_store() {
    // the PTX ISA's reading, through bwd_sm90_ds_store's row addresses, gives the layout the dQ
    // wgmma reads: every element once, at the swizzled place
    let d = stsm_simulate(true);
    let r = diagnose_all("stmatrix dS", &stsm_check(&d));
    assert!(r.ok, "{}", r.diagnosis);
    // a store without the transpose: queries and keys exchanged inside each 8x8 block
    let r = diagnose_all("stmatrix dS", &stsm_check(&stsm_simulate(false)));
    assert!(!r.ok && r.diagnosis.contains("[dS tile]") && r.diagnosis.contains("found (.trans transposes (1 yes, 0 no, -1 neither)=0)"), "{}", r.diagnosis);
    // one warpgroup's tile missing (nothing stored)
    let mut half = d.clone();
    half[STSM_TILE_BYTES / 8..].iter_mut().for_each(|w| *w = 0);
    let r = diagnose_all("stmatrix dS", &stsm_check(&half));
    assert!(!r.ok && r.diagnosis.contains("[dS tile] 4096 of 8192 values wrong"), "{}", r.diagnosis);
    assert!(r.diagnosis.contains("=-1)"), "{}", r.diagnosis);
}
