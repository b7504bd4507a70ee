# Pure-Python simulation of fwd_mma's fragment bookkeeping (kernels/flash_fwd.cu), one (b, h).
# Mirrors the kernel's index expressions lane by lane, with mma.sync m16n8k16 defined by the PTX
# fragment layouts (common.cuh), in float64 without 16-bit rounding; compares with a direct
# reference. It checks the kernel's indexing against that layout, not the hardware.
# Run: python3 candle-cp-kernels/sim/fwd_mma_sim.py  (exit 1 on a mismatch; used by scripts/ci-cuda.sh)
import math, random, sys

def mma(d, a, b0, b1):
    # d[lane][4], a[lane][4] pairs, b0/b1[lane] pairs; PTX m16n8k16 layouts.
    A = [[0.0]*16 for _ in range(16)]; B = [[0.0]*8 for _ in range(16)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g][2*t], A[g][2*t+1] = a[lane][0]
        A[g+8][2*t], A[g+8][2*t+1] = a[lane][1]
        A[g][2*t+8], A[g][2*t+9] = a[lane][2]
        A[g+8][2*t+8], A[g+8][2*t+9] = a[lane][3]
        B[2*t][g], B[2*t+1][g] = b0[lane]
        B[2*t+8][g], B[2*t+9][g] = b1[lane]
    D = [[sum(A[i][k]*B[k][j] for k in range(16)) for j in range(8)] for i in range(16)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        d[lane][0] += D[g][2*t]; d[lane][1] += D[g][2*t+1]
        d[lane][2] += D[g+8][2*t]; d[lane][3] += D[g+8][2*t+1]

def run(T, S, D, q, k, v, scale, causal, qo, qs, ko, ks):
    BQ, BK = 64, 64
    DC, DT, NT = D // 16, D // 8, BK // 8
    qpos = lambda i: qo + i * qs
    kpos = lambda j: ko + j * ks
    def key_end(qp):
        if not causal: return S
        if qp < ko: return 0
        return min(S, (qp - ko) // ks + 1)
    out = [[0.0]*D for _ in range(T)]; lse = [0.0]*T
    L2E = 1.4426950408889634
    for bx in range((T + BQ - 1) // BQ):
        last_row = min(bx*BQ + BQ, T) - 1
        s_end = key_end(qpos(last_row))
        first_qpos = qpos(bx*BQ)
        for warp in range(4):
            ra = [bx*BQ + warp*16 + (l >> 2) for l in range(32)]
            rb = [x + 8 for x in ra]
            def qv(r, c): return q[r][c] if r < T else 0.0
            qa = [[None]*4 for _ in range(32)]
            qa = [[[None]*4 for _ in range(32)] for _ in range(DC)]
            for kc in range(DC):
                for l in range(32):
                    t = l & 3; c = kc*16 + 2*t
                    qa[kc][l] = [(qv(ra[l], c), qv(ra[l], c+1)), (qv(rb[l], c), qv(rb[l], c+1)),
                                 (qv(ra[l], c+8), qv(ra[l], c+9)), (qv(rb[l], c+8), qv(rb[l], c+9))]
            o = [[[0.0]*4 for _ in range(32)] for _ in range(DT)]
            m_a = [-math.inf]*32; m_b = [-math.inf]*32; l_a = [0.0]*32; l_b = [0.0]*32
            for k0 in range(0, s_end, BK):
                ks_ = [[(k[k0+r][c] if k0+r < S else 0.0) for c in range(D)] for r in range(BK)]
                vt = [[(v[k0+r][c] if k0+r < S else 0.0) for r in range(BK)] for c in range(D)]
                s = [[[0.0]*4 for _ in range(32)] for _ in range(NT)]
                for nt in range(NT):
                    for kc in range(DC):
                        b0 = []; b1 = []
                        for l in range(32):
                            g, t = l >> 2, l & 3
                            row = ks_[nt*8 + g]; c = kc*16 + 2*t
                            b0.append((row[c], row[c+1])); b1.append((row[c+8], row[c+9]))
                        mma(s[nt], qa[kc], b0, b1)
                full_tile = k0 + BK <= S and (not causal or kpos(k0 + BK - 1) <= first_qpos)
                mx_a = [-math.inf]*32; mx_b = [-math.inf]*32
                for nt in range(NT):
                    for l in range(32):
                        t = l & 3
                        for e in range(4):
                            j = k0 + nt*8 + 2*t + (e & 1)
                            pq = qpos(ra[l]) if e < 2 else qpos(rb[l])
                            vis = full_tile or (j < S and (not causal or kpos(j) <= pq))
                            s[nt][l][e] = s[nt][l][e]*scale*L2E if vis else -math.inf
                        mx_a[l] = max(mx_a[l], s[nt][l][0], s[nt][l][1])
                        mx_b[l] = max(mx_b[l], s[nt][l][2], s[nt][l][3])
                qmax = lambda arr: [max(arr[(l & ~3) + i] for i in range(4)) for l in range(32)]
                qa_ = qmax(mx_a); qb_ = qmax(mx_b)
                for l in range(32):
                    mn_a = max(m_a[l], qa_[l]); mn_b = max(m_b[l], qb_[l])
                    al_a = 1.0 if mn_a == -math.inf else 2**(m_a[l] - mn_a) if m_a[l] != -math.inf else 0.0
                    al_b = 1.0 if mn_b == -math.inf else 2**(m_b[l] - mn_b) if m_b[l] != -math.inf else 0.0
                    sa = sb = 0.0
                    for nt in range(NT):
                        x = s[nt][l]
                        x[0] = 0.0 if mn_a == -math.inf else (2**(x[0]-mn_a) if x[0] != -math.inf else 0.0)
                        x[1] = 0.0 if mn_a == -math.inf else (2**(x[1]-mn_a) if x[1] != -math.inf else 0.0)
                        x[2] = 0.0 if mn_b == -math.inf else (2**(x[2]-mn_b) if x[2] != -math.inf else 0.0)
                        x[3] = 0.0 if mn_b == -math.inf else (2**(x[3]-mn_b) if x[3] != -math.inf else 0.0)
                        sa += x[0] + x[1]; sb += x[2] + x[3]
                    l_a[l] = l_a[l]*al_a + sa; l_b[l] = l_b[l]*al_b + sb
                    m_a[l] = mn_a; m_b[l] = mn_b
                    for dt in range(DT):
                        o[dt][l][0] *= al_a; o[dt][l][1] *= al_a; o[dt][l][2] *= al_b; o[dt][l][3] *= al_b
                for kk in range(BK // 16):
                    pf = [[(s[2*kk][l][0], s[2*kk][l][1]), (s[2*kk][l][2], s[2*kk][l][3]),
                           (s[2*kk+1][l][0], s[2*kk+1][l][1]), (s[2*kk+1][l][2], s[2*kk+1][l][3])] for l in range(32)]
                    for dt in range(DT):
                        b0 = []; b1 = []
                        for l in range(32):
                            g, t = l >> 2, l & 3
                            row = vt[dt*8 + g]; c = kk*16 + 2*t
                            b0.append((row[c], row[c+1])); b1.append((row[c+8], row[c+9]))
                        mma(o[dt], pf, b0, b1)
            qs_ = lambda arr: [sum(arr[(l & ~3) + i] for i in range(4)) for l in range(32)]
            la = qs_(l_a); lb = qs_(l_b)
            for l in range(32):
                t = l & 3
                ia = 1/la[l] if la[l] > 0 else 0.0; ib = 1/lb[l] if lb[l] > 0 else 0.0
                for dt in range(DT):
                    c = dt*8 + 2*t
                    if ra[l] < T: out[ra[l]][c] = o[dt][l][0]*ia; out[ra[l]][c+1] = o[dt][l][1]*ia
                    if rb[l] < T: out[rb[l]][c] = o[dt][l][2]*ib; out[rb[l]][c+1] = o[dt][l][3]*ib
                if t == 0:
                    if ra[l] < T: lse[ra[l]] = (m_a[l] + math.log2(la[l]))*math.log(2) if la[l] > 0 else -math.inf
                    if rb[l] < T: lse[rb[l]] = (m_b[l] + math.log2(lb[l]))*math.log(2) if lb[l] > 0 else -math.inf
    return out, lse

def ref(T, S, D, q, k, v, scale, causal, qo, qs, ko, ks):
    out = []; lse = []
    for i in range(T):
        sc = [sum(q[i][d]*k[j][d] for d in range(D))*scale for j in range(S)]
        vis = [(not causal) or ko + j*ks <= qo + i*qs for j in range(S)]
        xs = [s for s, vv in zip(sc, vis) if vv]
        if not xs:
            out.append([0.0]*D); lse.append(-math.inf); continue
        m = max(xs); z = sum(math.exp(x-m) for x in xs)
        lse.append(m + math.log(z))
        out.append([sum(math.exp(sc[j]-lse[-1])*v[j][d] for j in range(S) if vis[j]) for d in range(D)])
    return out, lse

if __name__ == "__main__":
  bad = False
  random.seed(1)
  for (T, S, D, causal, qo, qs, ko, ks) in [(70, 70, 16, False, 0, 1, 0, 1), (70, 70, 32, True, 0, 1, 0, 1),
                                            (65, 130, 16, True, 64, 1, 0, 1), (40, 40, 16, True, 0, 1, 20, 1),
                                            (30, 30, 16, True, 0, 1, 100, 1), (50, 50, 32, True, 1, 4, 3, 4)]:
      q = [[random.gauss(0, 1) for _ in range(D)] for _ in range(T)]
      k = [[random.gauss(0, 1) for _ in range(D)] for _ in range(S)]
      v = [[random.gauss(0, 1) for _ in range(D)] for _ in range(S)]
      sc = 1/math.sqrt(D)
      o1, l1 = run(T, S, D, q, k, v, sc, causal, qo, qs, ko, ks)
      o2, l2 = ref(T, S, D, q, k, v, sc, causal, qo, qs, ko, ks)
      eo = max(abs(a-b) for ra, rb in zip(o1, o2) for a, b in zip(ra, rb))
      el = max(0.0 if a == b else abs(a-b) for a, b in zip(l1, l2))
      print(f"T{T} S{S} D{D} causal={causal} off=({qo},{qs},{ko},{ks}): out err {eo:.2e} lse err {el:.2e}")
      bad |= max(eo, el) > 1e-9
  sys.exit(1 if bad else 0)
