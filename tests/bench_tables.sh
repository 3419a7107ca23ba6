#!/bin/sh
# experiments/bench/tables.py counts a `sparge bench` row's work as the tool does: every (query, key) pair the
# attention may use, each packed sequence's own pairs (--varlen) and with --causal those up to each query's
# bottom-right diagonal. The tool writes the rows (its CSV columns causal and varlen), the expected pair counts
# are worked out here. Run by `make check` with SPARGE set; by hand: tests/bench_tables.sh [path/to/sparge].
sparge=${1:-${SPARGE:-./src/sparge}}
src=${srcdir:-.}
if [ ! -x "$sparge" ]; then
    echo "bench_tables.sh: no sparge tool at '$sparge' (pass its path or set SPARGE)" >&2
    exit 99
fi
command -v python3 >/dev/null 2>&1 || { echo "bench_tables.sh: no python3, skipped"; exit 77; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/sparge-tables-XXXXXX") || exit 99
trap 'rm -rf "$tmp"' EXIT

bench() {
    name=$1
    shift
    "$sparge" bench --backend cpu --D 32 --sparsity dense,0.5 --ops fwd,bwd --reps 1 --warmup 0 \
        --output "$tmp/$name.csv" "$@" >"$tmp/$name.log" 2>&1 || { cat "$tmp/$name.log"; exit 1; }
}
bench plain --B 2 --H 3 --N 100 --Nk 150
bench causal --B 2 --H 2 --N 100 --Nk 150 --causal
bench varlen --B 1 --H 2 --N 600 --varlen 200,70,330
bench varlen-causal --B 1 --H 2 --N 600 --varlen 200,70,330 --causal

python3 - "$src/experiments/bench" "$tmp" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import tables

tmp = sys.argv[2]
causal = lambda nq, nk: nq * (nk - nq) + nq * (nq + 1) // 2
expect = {  # forward FLOP: 4 · B · H · pairs · D
    "plain": 4 * 2 * 3 * 100 * 150 * 32,
    "causal": 4 * 2 * 2 * causal(100, 150) * 32,
    "varlen": 4 * 1 * 2 * (200 * 200 + 70 * 70 + 330 * 330) * 32,
    "varlen-causal": 4 * 1 * 2 * (causal(200, 200) + causal(70, 70) + causal(330, 330)) * 32,
}
bad = 0
for name, want in expect.items():
    path = f"{tmp}/{name}.csv"
    for row in tables.read(path):
        got = tables.flops(row)
        if got != want:
            print(f"{name} {row['level']}: tables.py counts {got:.0f} FLOP, the shape has {want}")
            bad = 1
    table = tables.bench_table(path, "GFLOP/s")
    if len(table) != 4 + len(tables.read(path)):
        print(f"{name}: table of {len(table)} lines:\n" + "\n".join(table))
        bad = 1
sys.exit(bad)
PY
