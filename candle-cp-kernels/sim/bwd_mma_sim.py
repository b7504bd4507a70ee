# Pure-Python simulation of the fragment bookkeeping of kernels/flash_bwd_mma.cu (one b, h),
# same method as fwd_mma_sim.py (whose mma() and reference forward it reuses). Exit 1 on a mismatch.
import math, random, sys
sys.path.insert(0, __import__('os').path.dirname(__import__('os').path.abspath(__file__)))
from fwd_mma_sim import mma, ref

L2E = 1.4426950408889634

def vis_fn(causal, qo, qs, ko, ks):
    return lambda i, j: (not causal) or ko + j * ks <= qo + i * qs

def dkdv(T, S, D, q, k, v, do, lse, delta, scale, causal, qo, qs_, ko, ks):
    BK, BQ, DC, DT = 32, 32, D // 16, D // 8
    visible = vis_fn(causal, qo, qs_, ko, ks)
    dk = [[0.0]*D for _ in range(S)]; dv = [[0.0]*D for _ in range(S)]
    def query_begin(kp):
        if not causal or kp <= qo: return 0
        return min(T, (kp - qo + qs_ - 1) // qs_)
    for bx in range((S + BK - 1) // BK):
        k0 = bx * BK
        k_s = [[k[k0+r][c] if k0+r < S else 0.0 for c in range(D)] for r in range(BK)]
        v_s = [[v[k0+r][c] if k0+r < S else 0.0 for c in range(D)] for r in range(BK)]
        for warp in range(2):
            acc_k = [[[0.0]*4 for _ in range(32)] for _ in range(DT)]
            acc_v = [[[0.0]*4 for _ in range(32)] for _ in range(DT)]
            for i0 in range(query_begin(ko + k0 * ks), T, BQ):
                q_s = [[q[i0+r][c] if i0+r < T else 0.0 for c in range(D)] for r in range(BQ)]
                do_s = [[do[i0+r][c] if i0+r < T else 0.0 for c in range(D)] for r in range(BQ)]
                lse_s = [lse[i0+r]*L2E if i0+r < T else -math.inf for r in range(BQ)]
                dl_s = [delta[i0+r] if i0+r < T else 0.0 for r in range(BQ)]
                st = [[[0.0]*4 for _ in range(32)] for _ in range(BQ//8)]
                dpt = [[[0.0]*4 for _ in range(32)] for _ in range(BQ//8)]
                for kc in range(DC):
                    ka = []; va = []
                    for l in range(32):
                        g, t = l >> 2, l & 3; kr = warp*16 + g; c = kc*16 + 2*t
                        p2 = lambda m, r, c: (m[r][c], m[r][c+1])
                        ka.append([p2(k_s, kr, c), p2(k_s, kr+8, c), p2(k_s, kr, c+8), p2(k_s, kr+8, c+8)])
                        va.append([p2(v_s, kr, c), p2(v_s, kr+8, c), p2(v_s, kr, c+8), p2(v_s, kr+8, c+8)])
                    for nt in range(BQ//8):
                        b0 = []; b1 = []; c0 = []; c1 = []
                        for l in range(32):
                            g, t = l >> 2, l & 3; c = kc*16 + 2*t
                            b0.append((q_s[nt*8+g][c], q_s[nt*8+g][c+1])); b1.append((q_s[nt*8+g][c+8], q_s[nt*8+g][c+9]))
                            c0.append((do_s[nt*8+g][c], do_s[nt*8+g][c+1])); c1.append((do_s[nt*8+g][c+8], do_s[nt*8+g][c+9]))
                        mma(st[nt], ka, b0, b1); mma(dpt[nt], va, c0, c1)
                for nt in range(BQ//8):
                    for l in range(32):
                        g, t = l >> 2, l & 3
                        for e in range(4):
                            r = nt*8 + 2*t + (e & 1); i = i0 + r; j = k0 + warp*16 + g + (0 if e < 2 else 8)
                            vis = i < T and j < S and visible(i, j) and lse_s[r] != -math.inf
                            p = 2**(st[nt][l][e]*scale*L2E - lse_s[r]) if vis else 0.0
                            st[nt][l][e] = p; dpt[nt][l][e] = p*(dpt[nt][l][e] - dl_s[r])*scale
                for kk in range(BQ//16):
                    pa = [[(st[2*kk][l][0], st[2*kk][l][1]), (st[2*kk][l][2], st[2*kk][l][3]),
                           (st[2*kk+1][l][0], st[2*kk+1][l][1]), (st[2*kk+1][l][2], st[2*kk+1][l][3])] for l in range(32)]
                    da = [[(dpt[2*kk][l][0], dpt[2*kk][l][1]), (dpt[2*kk][l][2], dpt[2*kk][l][3]),
                           (dpt[2*kk+1][l][0], dpt[2*kk+1][l][1]), (dpt[2*kk+1][l][2], dpt[2*kk+1][l][3])] for l in range(32)]
                    for dt in range(DT):
                        b0 = []; b1 = []; c0 = []; c1 = []
                        for l in range(32):
                            g, t = l >> 2, l & 3; r0 = kk*16 + 2*t; col = dt*8 + g
                            b0.append((do_s[r0][col], do_s[r0+1][col])); b1.append((do_s[r0+8][col], do_s[r0+9][col]))
                            c0.append((q_s[r0][col], q_s[r0+1][col])); c1.append((q_s[r0+8][col], q_s[r0+9][col]))
                        mma(acc_v[dt], pa, b0, b1); mma(acc_k[dt], da, c0, c1)
            for l in range(32):
                g, t = l >> 2, l & 3
                for dt in range(DT):
                    c = dt*8 + 2*t
                    for half in range(2):
                        j = k0 + warp*16 + g + 8*half
                        if j >= S: continue
                        for u in range(2):
                            dk[j][c+u] = acc_k[dt][l][2*half+u]; dv[j][c+u] = acc_v[dt][l][2*half+u]
    return dk, dv

def dq_fn(T, S, D, q, k, v, do, lse, delta, scale, causal, qo, qs_, ko, ks):
    BQ, BK, DC, DT = 64, 32, D // 16, D // 8
    visible = vis_fn(causal, qo, qs_, ko, ks)
    dq = [[0.0]*D for _ in range(T)]
    def key_end(qp):
        if not causal: return S
        if qp < ko: return 0
        return min(S, (qp - ko) // ks + 1)
    for bx in range((T + BQ - 1) // BQ):
        last = min(bx*BQ + BQ, T) - 1
        s_end = key_end(qo + last*qs_)
        for warp in range(4):
            ra = [bx*BQ + warp*16 + (l >> 2) for l in range(32)]; rb = [x + 8 for x in ra]
            qe = lambda r, c: q[r][c] if r < T else 0.0
            oe = lambda r, c: do[r][c] if r < T else 0.0
            qa = [[None]*32 for _ in range(DC)]; oa = [[None]*32 for _ in range(DC)]
            for kc in range(DC):
                for l in range(32):
                    t = l & 3; c = kc*16 + 2*t
                    qa[kc][l] = [(qe(ra[l], c), qe(ra[l], c+1)), (qe(rb[l], c), qe(rb[l], c+1)), (qe(ra[l], c+8), qe(ra[l], c+9)), (qe(rb[l], c+8), qe(rb[l], c+9))]
                    oa[kc][l] = [(oe(ra[l], c), oe(ra[l], c+1)), (oe(rb[l], c), oe(rb[l], c+1)), (oe(ra[l], c+8), oe(ra[l], c+9)), (oe(rb[l], c+8), oe(rb[l], c+9))]
            acc = [[[0.0]*4 for _ in range(32)] for _ in range(DT)]
            for k0 in range(0, s_end, BK):
                k_s = [[k[k0+r][c] if k0+r < S else 0.0 for c in range(D)] for r in range(BK)]
                v_s = [[v[k0+r][c] if k0+r < S else 0.0 for c in range(D)] for r in range(BK)]
                s = [[[0.0]*4 for _ in range(32)] for _ in range(BK//8)]
                dp = [[[0.0]*4 for _ in range(32)] for _ in range(BK//8)]
                for nt in range(BK//8):
                    for kc in range(DC):
                        b0 = []; b1 = []; c0 = []; c1 = []
                        for l in range(32):
                            g, t = l >> 2, l & 3; c = kc*16 + 2*t
                            b0.append((k_s[nt*8+g][c], k_s[nt*8+g][c+1])); b1.append((k_s[nt*8+g][c+8], k_s[nt*8+g][c+9]))
                            c0.append((v_s[nt*8+g][c], v_s[nt*8+g][c+1])); c1.append((v_s[nt*8+g][c+8], v_s[nt*8+g][c+9]))
                        mma(s[nt], qa[kc], b0, b1); mma(dp[nt], oa[kc], c0, c1)
                for nt in range(BK//8):
                    for l in range(32):
                        t = l & 3
                        for e in range(4):
                            i = ra[l] if e < 2 else rb[l]; j = k0 + nt*8 + 2*t + (e & 1)
                            li = lse[i]*L2E if i < T else -math.inf; di = delta[i] if i < T else 0.0
                            vis = i < T and j < S and visible(i, j) and li != -math.inf
                            p = 2**(s[nt][l][e]*scale*L2E - li) if vis else 0.0
                            s[nt][l][e] = p*(dp[nt][l][e] - di)*scale
                for kk in range(BK//16):
                    da = [[(s[2*kk][l][0], s[2*kk][l][1]), (s[2*kk][l][2], s[2*kk][l][3]),
                           (s[2*kk+1][l][0], s[2*kk+1][l][1]), (s[2*kk+1][l][2], s[2*kk+1][l][3])] for l in range(32)]
                    for dt in range(DT):
                        b0 = []; b1 = []
                        for l in range(32):
                            g, t = l >> 2, l & 3; r0 = kk*16 + 2*t; col = dt*8 + g
                            b0.append((k_s[r0][col], k_s[r0+1][col])); b1.append((k_s[r0+8][col], k_s[r0+9][col]))
                        mma(acc[dt], da, b0, b1)
            for l in range(32):
                t = l & 3
                for dt in range(DT):
                    c = dt*8 + 2*t
                    for half, i in ((0, ra[l]), (1, rb[l])):
                        if i < T:
                            dq[i][c] = acc[dt][l][2*half]; dq[i][c+1] = acc[dt][l][2*half+1]
    return dq

def ref_bwd(T, S, D, q, k, v, do, scale, causal, qo, qs_, ko, ks):
    out, lse = ref(T, S, D, q, k, v, scale, causal, qo, qs_, ko, ks)
    visible = vis_fn(causal, qo, qs_, ko, ks)
    delta = [sum(do[i][d]*out[i][d] for d in range(D)) for i in range(T)]
    dq = [[0.0]*D for _ in range(T)]; dk = [[0.0]*D for _ in range(S)]; dv = [[0.0]*D for _ in range(S)]
    for i in range(T):
        if lse[i] == -math.inf: continue
        for j in range(S):
            if not visible(i, j): continue
            s = sum(q[i][d]*k[j][d] for d in range(D))*scale
            p = math.exp(s - lse[i]); dp = sum(do[i][d]*v[j][d] for d in range(D)); ds = p*(dp - delta[i])
            for d in range(D):
                dv[j][d] += p*do[i][d]; dk[j][d] += ds*q[i][d]*scale; dq[i][d] += ds*k[j][d]*scale
    return lse, delta, dq, dk, dv

random.seed(2)
bad = False
for (T, S, D, causal, qo, qs_, ko, ks) in [(70, 70, 16, False, 0, 1, 0, 1), (70, 70, 32, True, 0, 1, 0, 1),
                                            (40, 75, 16, True, 64, 1, 0, 1), (40, 40, 16, True, 0, 1, 20, 1),
                                            (30, 30, 16, True, 0, 1, 100, 1), (50, 50, 16, True, 1, 4, 3, 4)]:
    R = lambda n: [[random.gauss(0, 1) for _ in range(D)] for _ in range(n)]
    q, k, v, do = R(T), R(S), R(S), R(T)
    sc = 1/math.sqrt(D)
    lse, delta, dq_r, dk_r, dv_r = ref_bwd(T, S, D, q, k, v, do, sc, causal, qo, qs_, ko, ks)
    dk, dv = dkdv(T, S, D, q, k, v, do, lse, delta, sc, causal, qo, qs_, ko, ks)
    dq = dq_fn(T, S, D, q, k, v, do, lse, delta, sc, causal, qo, qs_, ko, ks)
    err = lambda a, b: max(abs(x-y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    e = (err(dq, dq_r), err(dk, dk_r), err(dv, dv_r))
    bad |= max(e) > 1e-9
    print(f"T{T} S{S} D{D} causal={causal} off=({qo},{qs_},{ko},{ks}): dq {e[0]:.1e} dk {e[1]:.1e} dv {e[2]:.1e}")
sys.exit(1 if bad else 0)
