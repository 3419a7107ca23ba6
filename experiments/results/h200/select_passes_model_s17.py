# Session 17: a CPU model of fast_select_row's bisection passes (backends/cuda/mask.cu), main's against the
# moment-guided first two passes of select_guided_s17.patch, on rows like the bench's (normal tokens pooled by
# 128 x 64, 512 key blocks), the same with a shared structure (peaked rows) and a sink-plus-band row shape.
# Run: python3 select_passes_model_s17.py (numpy). It counts passes only; the kept sets are exact either way.
import numpy as np
from statistics import NormalDist

ND = NormalDist()
rows, D, nk = 256, 128, 512


def bench_logits(rng, peaked=0.0):
    q = rng.standard_normal((rows * 128, D)).astype(np.float32)
    k = rng.standard_normal((nk * 64, D)).astype(np.float32)
    qb, kb = q.reshape(rows, 128, D).mean(1), k.reshape(nk, 64, D).mean(1)
    if peaked:
        qb = qb + peaked * rng.standard_normal((rows, D)).astype(np.float32)
        kb = kb + peaked * rng.standard_normal((nk, D)).astype(np.float32)
    return (qb @ kb.T) / np.sqrt(D)


def sink_band_logits(rng):
    L = rng.standard_normal((rows, nk)) * 0.5
    L[:, 0] += 4
    for i in range(rows):
        c = i * nk // rows
        L[i, max(0, c - 8):c + 8] += 2.5
    return L.astype(np.float32)


def probs(L):
    P = np.exp(L - L.max(1, keepdims=True))
    return (P / P.sum(1, keepdims=True)).astype(np.float32)


def keys(p):
    return (np.asarray(p, np.float32).view(np.int32) & 0x7fffffff).astype(np.int64)


def passes(x, pv, least, topp, guided):
    key = keys(pv)
    n = len(key)
    lo, hi, ge_lo, above = key.min(), key.max() + 1, n, 0
    g = [lo, lo]
    if guided:
        y = (x - x.max()).astype(np.float32)
        inv = 1 / np.exp(y.astype(np.float64)).sum()
        mean = y.mean()
        var = max((y * y).mean() - mean * mean, 0)
        sd = np.sqrt(var)
        zk = ND.inv_cdf(min(max(1 - max(least, 1) / n, 1e-6), 1 - 1e-6))
        zp = ND.inv_cdf(min(max(1 - topp, 1e-6), 1 - 1e-6)) if topp > 0 else 0
        t = mean + zk * sd
        if topp > 0:
            t = min(t, mean + var + zp * sd)
        z = (t - mean) / sd
        d = 12 * sd / (n * 0.39894228 * np.exp(-0.5 * z * z))
        g = [int(keys([np.exp(t - d) * inv])[0]), int(keys([np.exp(t + d) * inv])[0])]
    count = 0
    while hi - lo > 1 and ge_lo - above > 32:
        guess = g[count] if count < 2 else lo
        mid = guess if lo < guess < hi else lo + (hi - lo) // 2
        sel = key >= mid
        c, m = sel.sum(), pv[sel].astype(np.float64).sum()
        count += 1
        if c >= least and (topp <= 0 or m >= topp):
            lo, ge_lo = key[sel].min(), c
        else:
            hi, above = key[~sel].max() + 1, c
    return count


for name, L in [("bench", bench_logits(np.random.default_rng(7))),
                ("bench, peaked", bench_logits(np.random.default_rng(7), 1.0)),
                ("sink and band", sink_band_logits(np.random.default_rng(3)))]:
    P = probs(L)
    for arm, least, topp in [("Top-k 95 %", 25, 0.0), ("hybrid 0.03/0.2", 15, 0.2), ("Top-p 0.4", 1, 0.4)]:
        b = [passes(L[i], P[i], least, topp, False) for i in range(rows)]
        g = [passes(L[i], P[i], least, topp, True) for i in range(rows)]
        print(f"{name:14s} {arm:16s} main {np.mean(b):.2f} passes per row (max {max(b)}), "
              f"guided {np.mean(g):.2f} (max {max(g)})")
