#!/usr/bin/env python3
"""Markdown tables from the CSV files of `sparge bench --output` (used by gpu.sh and cpu.sh; standard library only).

    tables.py bench FILE.csv [GFLOP/s]           one table: a row per level, the columns the run measured
                                                 (rates in TFLOP/s, or GFLOP/s)
    tables.py runs --peak GFLOPS OUT.csv NAME=FILE.csv ...
                                                 several runs of the same commands (NAME: the command's label,
                                                 the same label once per run): median and range over the runs
                                                 of every time, written to OUT.csv, and a Markdown table with
                                                 the rates against --peak (GFLOP/s, the machine's FMA peak)
                                                 and the speedups over dense, taken run by run: a command's own
                                                 dense level where it has one, else the first command's
Dense-equivalent rates: 4·B·H·pairs·D / t for the forward, 2.5× that for the backward, where pairs counts the
(query, key) pairs attention may use, as `sparge bench` does: Nq·Nk, with packed sequences (the `varlen` column)
each sequence's own, with `causal` those up to each query's bottom-right diagonal; effective rates count only the
kept token pairs (× token_density).
"""
import csv
import math
import statistics
import sys
from collections import OrderedDict

TIMES = ("mask_ms", "fwd_ms", "fwd_mask_ms", "bwd_ms", "step_ms")


def number(text):
    try:
        x = float(text)
    except ValueError:
        return math.nan
    return x if math.isfinite(x) and x >= 0 else math.nan  # sparge bench writes -1 / nan for "not timed"


def read(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"tables.py: {path} has no rows")
    return rows


def flops(row):
    """The forward's dense-equivalent FLOP of a row (files written before the causal and varlen columns: neither)."""
    lengths = [int(n) for n in row.get("varlen", "").split(",") if n]
    seqs = [(n, n) for n in lengths] if lengths else [(int(row["Nq"]), int(row["Nk"]))]
    causal = row.get("causal", "0") not in ("0", "")
    pairs = sum(nq * (nk - nq) + nq * (nq + 1) / 2 if causal else nq * nk for nq, nk in seqs)
    return 4.0 * float(row["B"]) * float(row["H"]) * pairs * float(row["D"])


def fmt(x, spec):
    return format(x, spec) if math.isfinite(x) else "—"


def rate(f, ms, unit):
    """f FLOP in ms milliseconds, in TFLOP/s or GFLOP/s."""
    return f / (ms * 1e-3) / (1e12 if unit == "TFLOP/s" else 1e9) if math.isfinite(ms) and ms > 0 else math.nan


def bench_table(path, unit="TFLOP/s"):
    rows = read(path)
    r0 = rows[0]
    out = [f"{r0['device']}; B={r0['B']} H={r0['H']} Nq={r0['Nq']} Nk={r0['Nk']} D={r0['D']} {r0['dtype']} "
           f"{r0['layout']}, blocks {r0['block_q']}×{r0['block_k']}.", ""]
    cols = [("level", lambda r: r["level"]),
            ("sparsity", lambda r: f"{100 * float(r['sparsity']):.2f} %")]
    have = {t: any(math.isfinite(number(r[t])) for r in rows) for t in TIMES}
    if have["mask_ms"]:
        cols.append(("mask prediction ms", lambda r: fmt(number(r["mask_ms"]), ".3f")))
    if have["fwd_ms"]:
        cols += [("forward ms", lambda r: fmt(number(r["fwd_ms"]), ".3f")),
                 (f"forward {unit} (dense-eq.)", lambda r: fmt(rate(flops(r), number(r["fwd_ms"]), unit), ".1f")),
                 (f"effective {unit}", lambda r: fmt(rate(flops(r) * float(r["token_density"]), number(r["fwd_ms"]),
                                                           unit), ".1f"))]
    if have["fwd_mask_ms"] and have["mask_ms"]:
        cols.append(("prediction + forward ms", lambda r: fmt(number(r["fwd_mask_ms"]), ".3f")))
    if have["bwd_ms"]:
        cols += [("backward ms", lambda r: fmt(number(r["bwd_ms"]), ".3f")),
                 (f"backward {unit} (dense-eq.)",
                  lambda r: fmt(rate(2.5 * flops(r), number(r["bwd_ms"]), unit), ".1f"))]
    if have["step_ms"]:
        cols.append(("step ms (prediction, forward, backward)", lambda r: fmt(number(r["step_ms"]), ".3f")))
    out.append("| " + " | ".join(c[0] for c in cols) + " |")
    out.append("|" + "---|" * len(cols))
    for r in rows:
        out.append("| " + " | ".join(c[1](r) for c in cols) + " |")
    return out


def spread(values):
    """(median, min, max) of the finite values; NaNs when there are none."""
    v = [x for x in values if math.isfinite(x)]
    return (statistics.median(v), min(v), max(v)) if v else (math.nan, math.nan, math.nan)


def cell(values, spec, unit=""):
    """The median of values with its unit, and the range when there are several."""
    m, lo, hi = spread(values)
    if not math.isfinite(m):
        return "—"
    return fmt(m, spec) + unit if len([x for x in values if math.isfinite(x)]) < 2 else \
        f"{fmt(m, spec)}{unit} ({fmt(lo, spec)}–{fmt(hi, spec)})"


def runs_table(peak, out_csv, named):
    """named: [(label, path)], each label once per run, runs in order. Returns Markdown lines."""
    groups = OrderedDict()  # (label, level) -> [row of each run]
    for label, path in named:
        for r in read(path):
            groups.setdefault((label, r["level"]), []).append(r)
    with open(out_csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["command", "level", "runs", "sparsity", "token_density"] +
                   [f"{t}_{s}" for t in TIMES for s in ("median", "min", "max")])
        for (label, level), rs in groups.items():
            w.writerow([label, level, len(rs), rs[0]["sparsity"], rs[0]["token_density"]] +
                       [f"{x:.6g}" for t in TIMES for x in spread([number(r[t]) for r in rs])])
    out = [f"Median over the runs (range in brackets); GFLOP/s dense-equivalent, % of the FMA peak of "
           f"{peak:.1f} GFLOP/s measured in the same invocation (effective: the kept token pairs only); speedups "
           f"over dense taken run by run.", "",
           "| command | level | sparsity | mask prediction ms | forward ms | forward GFLOP/s: dense-eq., effective "
           "(% of peak) | forward speedup, prediction included | prediction / forward | backward ms "
           "| backward GFLOP/s: dense-eq., effective (% of peak) | backward speedup |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    dense_of = {}  # label -> the rows of the dense level the label's speedups are taken against
    for (label, level), rs in groups.items():
        if level == "dense":
            dense_of.setdefault(label, rs)
            dense_of.setdefault(None, rs)
    for (label, level), rs in groups.items():
        ms = {t: [number(r[t]) for r in rs] for t in TIMES}
        density = float(rs[0]["token_density"])
        f0 = flops(rs[0])
        fr = spread([rate(f0, t, "GFLOP/s") for t in ms["fwd_ms"]])[0]
        br = spread([rate(2.5 * f0, t, "GFLOP/s") for t in ms["bwd_ms"]])[0]
        f_rates, b_rates = (f"{x:.0f}, {x * density:.0f} ({100 * x * density / peak:.1f} %)" if math.isfinite(x)
                            else "—" for x in (fr, br))
        dense = dense_of.get(label) or dense_of.get(None)
        up_f = up_b = share = "—"
        if level != "dense" and dense:
            dfwd = [number(r["fwd_ms"]) for r in dense]
            dbwd = [number(r["bwd_ms"]) for r in dense]
            up_f = cell([d / (m + f) for d, m, f in zip(dfwd, ms["mask_ms"], ms["fwd_ms"])], ".1f", "×")
            up_b = cell([d / b for d, b in zip(dbwd, ms["bwd_ms"])], ".1f", "×")
            share = cell([100 * m / f for m, f in zip(ms["mask_ms"], ms["fwd_ms"])], ".1f", " %")
        out.append(f"| {label} | {level} | {100 * float(rs[0]['sparsity']):.2f} % | {cell(ms['mask_ms'], '.3f')} "
                   f"| {cell(ms['fwd_ms'], '.3f')} | {f_rates} | {up_f} | {share} | {cell(ms['bwd_ms'], '.2f')} "
                   f"| {b_rates} | {up_b} |")
    return out


def main(argv):
    if len(argv) in (2, 3) and argv[0] == "bench":
        print("\n".join(bench_table(*argv[1:])))
    elif len(argv) >= 4 and argv[0] == "runs" and argv[1] == "--peak":
        named = []
        for item in argv[4:]:
            label, sep, path = item.partition("=")
            if not sep:
                sys.exit(f"tables.py: runs wants NAME=FILE.csv, not '{item}'")
            named.append((label, path))
        print("\n".join(runs_table(float(argv[2]), argv[3], named)))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
