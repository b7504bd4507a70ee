"""Tile configs of the Hopper wgmma backward for check_launch_args.py (kept apart so that file
stays short): kernels/flash_bwd_sm90.cu (WGMMA_BWD_*, WGMMA_DQ_*, the kernels' constexprs) vs
src/flash/bwd_sm90.rs (consts and the shared-memory functions, evaluated on both sides)."""
import re


def wgmma_bwd_configs(rd, num, err, out):
    """Asserts both sides agree (err(...) otherwise) and adds the launch shapes (threads, rows per
    block, shared memory) of flash_bwd_wgmma_{dkdv,atomic,dq} per head dim to `out`."""
    # wgmma dK/dV (flash_bwd_sm90.cu, bwd_sm90.rs): constants on both sides, and both shared-memory
    # formulas (the C macro WGMMA_BWD_SMEM and the Rust wgmma_bwd_smem) evaluated at each head dim.
    wb_cu, wb_rs = rd("kernels", "flash_bwd_sm90.cu"), rd("src", "flash", "bwd_sm90.rs")
    c_bn, c_bq = num(r"#define WGMMA_BWD_BN (\d+)", wb_cu, "WGMMA_BWD_BN"), num(r"#define WGMMA_BWD_BQ (\d+)", wb_cu, "WGMMA_BWD_BQ")
    k_nwg, k_bq = num(r"constexpr int NWG = (\d+), NTH = 128 \* NWG, BN = 64 \* NWG, BQ = (\d+)", wb_cu, "bwd_wgmma_dkdv NWG, BQ") or (0, 0)
    r_bn, r_bq = num(r"const WGMMA_BWD_BN: usize = (\d+);", wb_rs, "bwd_sm90.rs WGMMA_BWD_BN"), num(r"const WGMMA_BWD_BQ: usize = (\d+);", wb_rs, "bwd_sm90.rs WGMMA_BWD_BQ")
    r_thr = num(r"const WGMMA_BWD_THREADS: u32 = (\d+);", wb_rs, "bwd_sm90.rs WGMMA_BWD_THREADS")
    if (c_bn, c_bq) != (64 * k_nwg, k_bq) or (c_bn, c_bq) != (r_bn, r_bq) or r_thr != 128 * k_nwg:
        err(f"wgmma bwd: kernel NWG={k_nwg} BQ={k_bq}, WGMMA_BWD_BN={c_bn} BQ={c_bq}; bwd_sm90.rs BN={r_bn} BQ={r_bq} threads={r_thr}")
    q_bm, q_bk = num(r"#define WGMMA_DQ_BM (\d+)", wb_cu, "WGMMA_DQ_BM"), num(r"#define WGMMA_DQ_BK (\d+)", wb_cu, "WGMMA_DQ_BK")
    k_qbm, k_qbk = num(r"constexpr int NWG = (\d+), NTH = 128 \* NWG, BM = 64 \* NWG, BK = (\d+)", wb_cu, "bwd_wgmma_dq NWG, BK") or (0, 0)
    r_qbm, r_qbk = num(r"const WGMMA_DQ_BM: usize = (\d+);", wb_rs, "bwd_sm90.rs WGMMA_DQ_BM"), num(r"const WGMMA_DQ_BK: usize = (\d+);", wb_rs, "bwd_sm90.rs WGMMA_DQ_BK")
    if (q_bm, q_bk) != (64 * k_qbm, k_qbk) or (q_bm, q_bk) != (r_qbm, r_qbk) or r_thr != 128 * k_qbm:
        err(f"wgmma dq: kernel NWG={k_qbm} BK={k_qbk}, WGMMA_DQ_BM={q_bm} BK={q_bk}; bwd_sm90.rs BM={r_qbm} BK={r_qbk} threads={r_thr}")
    c_sm = re.search(r"#define WGMMA_BWD_SMEM\(D\) (.*)", wb_cu)
    r_sm = re.search(r"fn wgmma_bwd_smem\(d: usize\) -> u32 \{\s*(.*?) as u32\s*\}", wb_rs, re.S)
    for d in (64, 128):
        sub = lambda e: e.replace("WGMMA_BWD_BN", str(c_bn)).replace("WGMMA_BWD_BQ", str(c_bq)).replace("(D)", f"({d})").replace(" d ", f" {d} ")
        try:
            cs, rsm = eval(sub(c_sm.group(1))), eval(sub(r_sm.group(1)))
        except Exception as e:  # missing or unparsable formula
            err(f"wgmma bwd: cannot evaluate the shared-memory formulas ({e})")
            break
        if cs != rsm:
            err(f"wgmma bwd d{d}: kernel WGMMA_BWD_SMEM {cs} != bwd_sm90.rs wgmma_bwd_smem {rsm}")
        out.setdefault("flash_bwd_wgmma_dkdv", {})[d] = (r_thr, c_bn, cs)
        # atomic-dQ variant: WGMMA_BWD_SMEM_ATOMIC(D) vs wgmma_bwd_smem_atomic(d), in terms of the above
        c_at = re.search(r"#define WGMMA_BWD_SMEM_ATOMIC\(D\) (.*)", wb_cu)
        r_at = re.search(r"fn wgmma_bwd_smem_atomic\(d: usize\) -> u32 \{\s*(.*?)\s*\}", wb_rs, re.S)
        try:
            ca = eval(sub(c_at.group(1).replace("WGMMA_BWD_SMEM(D)", str(cs))))
            ra = eval(sub(r_at.group(1).replace("wgmma_bwd_smem(d)", str(rsm)).replace(" as u32", "")))
        except Exception as e:
            err(f"wgmma bwd atomic: cannot evaluate the shared-memory formulas ({e})")
            break
        if ca != ra:
            err(f"wgmma bwd atomic d{d}: kernel WGMMA_BWD_SMEM_ATOMIC {ca} != bwd_sm90.rs wgmma_bwd_smem_atomic {ra}")
        out.setdefault("flash_bwd_wgmma_atomic", {})[d] = (r_thr, c_bn, ca)
        # dQ kernel: WGMMA_DQ_SMEM(D) vs wgmma_dq_smem(d), 128 rows per block, the same 256 threads
        c_dq = re.search(r"#define WGMMA_DQ_SMEM\(D\) (.*)", wb_cu)
        r_dq = re.search(r"fn wgmma_dq_smem\(d: usize\) -> u32 \{\s*(.*?) as u32\s*\}", wb_rs, re.S)
        dsub = lambda e: sub(e).replace("WGMMA_DQ_BM", str(q_bm)).replace("WGMMA_DQ_BK", str(q_bk))
        try:
            cq, rq = eval(dsub(c_dq.group(1))), eval(dsub(r_dq.group(1)))
        except Exception as e:
            err(f"wgmma dq: cannot evaluate the shared-memory formulas ({e})")
            break
        if cq != rq:
            err(f"wgmma dq d{d}: kernel WGMMA_DQ_SMEM {cq} != bwd_sm90.rs wgmma_dq_smem {rq}")
        out.setdefault("flash_bwd_wgmma_dq", {})[d] = (r_thr, q_bm, cq)

