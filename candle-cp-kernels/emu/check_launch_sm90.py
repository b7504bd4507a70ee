"""Tile configs of the Hopper wgmma kernels for check_launch_args.py (kept apart so that file
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



def wgmma_ws_configs(rd, num, err, out):
    """Warp-specialized forward: kernels/flash_fwd_sm90_ws.cu (WS_BQ, WS_BK, WS_NST(D), WS_SMEM(D),
    __launch_bounds__) vs src/flash/sm90_ws.rs (WS_BQ, WS_BK, WS_NST, WS_THREADS, ws_smem), both
    shared-memory formulas evaluated at each head dim; adds (threads, rows, smem) of
    flash_fwd_wgmma_ws per head dim to `out`."""
    cu, rs = rd("kernels", "flash_fwd_sm90_ws.cu"), rd("src", "flash", "sm90_ws.rs")
    c_bq, c_bk = num(r"#define WS_BQ (\d+)", cu, "WS_BQ"), num(r"#define WS_BK (\d+)", cu, "WS_BK")
    c_lb = num(r"__launch_bounds__\((\d+), 1\) flash_fwd_wgmma_ws_", cu, "flash_fwd_wgmma_ws __launch_bounds__")
    k_bq = num(r"constexpr int BQ = (\d+), PTH = 128", cu, "fwd_wgmma_ws BQ")
    r_bq, r_bk = num(r"const WS_BQ: usize = (\d+);", rs, "sm90_ws.rs WS_BQ"), num(r"const WS_BK: usize = (\d+);", rs, "sm90_ws.rs WS_BK")
    r_thr = num(r"const WS_THREADS: u32 = (\d+);", rs, "sm90_ws.rs WS_THREADS")
    r_nst128, r_nst = num(r"fn ws_nst\(d: usize\) -> usize \{\s*if d == 128 \{ (\d+) \} else \{ (\d+) \}", rs, "sm90_ws.rs ws_nst") or (0, 0)
    # BQ = two consumer warpgroups of 64 rows; block = producer + two consumers
    if (c_bq, c_bk) != (r_bq, r_bk) or c_bq != k_bq or c_bq != 128 or c_lb != r_thr or r_thr != 384:
        err(f"wgmma ws: kernel WS_BQ={c_bq} BK={c_bk} BQ={k_bq} bounds={c_lb}; sm90_ws.rs BQ={r_bq} BK={r_bk} threads={r_thr}")
    c_nst = re.search(r"#define WS_NST\(D\) (.*)", cu)
    c_sm = re.search(r"#define WS_SMEM\(D\) (.*)", cu)
    r_sm = re.search(r"fn ws_smem\(d: usize\) -> u32 \{\s*(.*?) as u32\s*\}", rs, re.S)
    for d in (64, 128):
        try:
            nst = eval(_ternary(c_nst.group(1).replace("(D)", f"({d})")))
            cs = eval(_ternary(c_sm.group(1).replace("WS_NST(D)", str(nst)).replace("WS_BQ", str(c_bq))
                               .replace("WS_BK", str(c_bk)).replace("(D)", f"({d})")))
            rn = r_nst128 if d == 128 else r_nst
            rsm = eval(r_sm.group(1).replace("ws_nst(d)", str(rn)).replace("WS_BQ", str(r_bq)).replace("WS_BK", str(r_bk))
                       .replace(" d ", f" {d} "))
        except Exception as e:  # missing or unparsable formula
            err(f"wgmma ws: cannot evaluate the shared-memory formulas ({e})")
            break
        if nst != rn or cs != rsm:
            err(f"wgmma ws d{d}: kernel WS_NST {nst} WS_SMEM {cs} != sm90_ws.rs ws_nst {rn} ws_smem {rsm}")
        out.setdefault("flash_fwd_wgmma_ws", {})[d] = (r_thr, c_bq, cs)
    # the wide-tile TMA entries (d = 128 only): WS_WIDE_BK, WS_WIDE_NST, WS_WIDE_SMEM on both sides
    w_bk, w_nst = num(r"#define WS_WIDE_BK (\d+)", cu, "WS_WIDE_BK"), num(r"#define WS_WIDE_NST (\d+)", cu, "WS_WIDE_NST")
    rw_bk, rw_nst = num(r"const WS_WIDE_BK: usize = (\d+);", rs, "sm90_ws.rs WS_WIDE_BK"), num(r"const WS_WIDE_NST: usize = (\d+);", rs, "sm90_ws.rs WS_WIDE_NST")
    c_wsm = re.search(r"#define WS_WIDE_SMEM (.*)", cu)
    r_wsm = re.search(r"const WS_WIDE_SMEM: u32 = (.*?) as u32;", rs, re.S)
    try:
        cw = eval(c_wsm.group(1).replace("WS_WIDE_NST", str(w_nst)).replace("WS_WIDE_BK", str(w_bk)).replace("WS_BQ", str(c_bq)))
        rw = eval(r_wsm.group(1).replace("WS_WIDE_NST", str(rw_nst)).replace("WS_WIDE_BK", str(rw_bk)).replace("WS_BQ", str(r_bq)))
    except Exception as e:  # missing or unparsable formula
        err(f"wgmma tma wide: cannot evaluate the shared-memory formulas ({e})")
        return
    if (w_bk, w_nst, cw) != (rw_bk, rw_nst, rw) or cw > 232448:
        err(f"wgmma tma wide: kernel BK {w_bk} NST {w_nst} smem {cw} != sm90_ws.rs BK {rw_bk} NST {rw_nst} smem {rw} (or above 232,448)")
    out.setdefault("flash_fwd_wgmma_tma_wide", {})[128] = (r_thr, c_bq, cw)


def wgmma_ws_bwd_configs(rd, num, err, out):
    """Warp-specialized backward: kernels/flash_bwd_sm90_ws.cu (WSB_BN, WSB_BQ, WSB_NST(D),
    WSB_SMEM(D), the kernel's BN / BQ constexprs, __launch_bounds__) vs src/flash/bwd_sm90_ws.rs
    (WSB_BN, WSB_BQ, WSB_THREADS, wsb_nst, wsb_smem), both shared-memory formulas evaluated at each
    head dim; adds (threads, keys per block, smem) of flash_bwd_wgmma_ws per head dim to `out`."""
    cu, rs = rd("kernels", "flash_bwd_sm90_ws.cu"), rd("src", "flash", "bwd_sm90_ws.rs")
    c_bn, c_bq = num(r"#define WSB_BN (\d+)", cu, "WSB_BN"), num(r"#define WSB_BQ (\d+)", cu, "WSB_BQ")
    c_lb = num(r"__launch_bounds__\((\d+), 1\) flash_bwd_wgmma_ws_", cu, "flash_bwd_wgmma_ws __launch_bounds__")
    k_bn, k_bq = num(r"constexpr int BN = (\d+), BQ = (\d+), PTH = 128", cu, "bwd_wgmma_ws BN, BQ") or (0, 0)
    r_bn, r_bq = num(r"const WSB_BN: usize = (\d+);", rs, "bwd_sm90_ws.rs WSB_BN"), num(r"const WSB_BQ: usize = (\d+);", rs, "bwd_sm90_ws.rs WSB_BQ")
    r_thr = num(r"const WSB_THREADS: u32 = (\d+);", rs, "bwd_sm90_ws.rs WSB_THREADS")
    r_nst128, r_nst = num(r"fn wsb_nst\(d: usize\) -> usize \{\s*if d == 128 \{ (\d+) \} else \{ (\d+) \}", rs, "bwd_sm90_ws.rs wsb_nst") or (0, 0)
    # BN = two consumer warpgroups of 64 keys; block = producer + two consumers
    if (c_bn, c_bq) != (r_bn, r_bq) or (c_bn, c_bq) != (k_bn, k_bq) or c_bn != 128 or c_lb != r_thr or r_thr != 384:
        err(f"wgmma ws bwd: kernel WSB_BN={c_bn} BQ={c_bq} BN/BQ={k_bn}/{k_bq} bounds={c_lb}; bwd_sm90_ws.rs BN={r_bn} BQ={r_bq} threads={r_thr}")
    c_nst = re.search(r"#define WSB_NST\(D\) (.*)", cu)
    c_sm = re.search(r"#define WSB_SMEM\(D\)\s*\\\n(.*?)\n#define", cu, re.S)
    r_sm = re.search(r"fn wsb_smem\(d: usize\) -> u32 \{\s*let nst = wsb_nst\(d\);\s*(.*?) as u32\s*\}", rs, re.S)
    for d in (64, 128):
        try:
            nst = eval(_ternary(c_nst.group(1).replace("(D)", f"({d})")))
            ce = " ".join(c_sm.group(1).replace("\\\n", " ").split())
            cs = eval(ce.replace("WSB_NST(D)", str(nst)).replace("WSB_BN", str(c_bn)).replace("WSB_BQ", str(c_bq))
                      .replace("(D)", f"({d})"))
            rn = r_nst128 if d == 128 else r_nst
            rsm = eval(r_sm.group(1).replace("nst", str(rn)).replace("WSB_BN", str(r_bn)).replace("WSB_BQ", str(r_bq))
                       .replace(" d ", f" {d} "))
        except Exception as e:  # missing or unparsable formula
            err(f"wgmma ws bwd: cannot evaluate the shared-memory formulas ({e})")
            break
        if nst != rn or cs != rsm:
            err(f"wgmma ws bwd d{d}: kernel WSB_NST {nst} WSB_SMEM {cs} != bwd_sm90_ws.rs wsb_nst {rn} wsb_smem {rsm}")
        if cs > 232448:
            err(f"wgmma ws bwd d{d}: WSB_SMEM {cs} above sm_90's 232,448-byte opt-in")
        out.setdefault("flash_bwd_wgmma_ws", {})[d] = (r_thr, c_bn, cs)
        # the TMA entries: WSB_SMEM_TMA(D) = WSB_SMEM(D) + X vs wsb_smem_tma = wsb_smem(d) + Y
        c_x = re.search(r"#define WSB_SMEM_TMA\(D\) \(WSB_SMEM\(D\) \+ (.*)\)\n", cu)
        r_x = re.search(r"fn wsb_smem_tma\(d: usize\) -> u32 \{\s*wsb_smem\(d\) \+ \((.*?)\) as u32\s*\}", rs, re.S)
        if not c_x or not r_x:
            err("wgmma ws bwd: WSB_SMEM_TMA / wsb_smem_tma not found")
            continue
        ct = cs + eval(c_x.group(1).replace("WSB_BQ", str(c_bq)))
        rt = rsm + eval(r_x.group(1).replace("WSB_BQ", str(r_bq)))
        if ct != rt or ct > 232448:
            err(f"wgmma ws bwd d{d}: kernel WSB_SMEM_TMA {ct} != bwd_sm90_ws.rs wsb_smem_tma {rt} (or above 232,448)")
        out.setdefault("flash_bwd_wgmma_tma", {})[d] = (r_thr, c_bn, ct)


def _ternary(expr):
    """`((D) == 128 ? 3 : 2)` style C (one conditional, D already substituted) as Python; other
    expressions unchanged."""
    t = re.match(r"^\(\s*(.*?)\s*\?\s*(\w+)\s*:\s*(\w+)\s*\)$", expr.strip())
    return f"({t.group(2)} if {t.group(1)} else {t.group(3)})" if t else expr
