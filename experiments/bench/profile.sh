#!/usr/bin/env bash
# Nsight Compute profiles of sparge's GPU kernels at the Wan2.1-1.3B attention shape (B=1 H=12 N=32760 bf16, blocks
# 128x64): per level one run of mask prediction, forward and backward (`sparge bench --reps 1 --warmup 0`) under
# ncu with its SpeedOfLight, ComputeWorkloadAnalysis, WarpStateStats, Occupancy and LaunchStats sections, the
# tensor pipes' active cycles and the warps' stall reasons per issued instruction. The clocks are left alone
# (--clock-control none). Writes OUT_DIR/LEVEL.ncu-rep, OUT_DIR/LEVEL.csv (ncu's details page) and OUT_DIR/summary.md:
# per kernel its duration, SM and memory throughput (L2, DRAM and L1 each), tensor-pipe activity, issue slots,
# occupancy and the three largest stall reasons.
set -euo pipefail

usage() {
    cat <<EOF
usage: experiments/bench/profile.sh [--build DIR] [--levels LIST] [--D N] [--ops LIST] OUT_DIR [-- BENCH-OPTIONS]

  --build DIR    a build directory configured with the CUDA backend and built (default: the current directory)
  --levels LIST  sparge bench --sparsity levels (default dense,0.95)
  --D N          head dim (default 128)
  --ops LIST     sparge bench --ops (default mask,fwd,bwd)
  -- OPTIONS     passed to sparge bench, e.g. -- --option fwd_kernel=wgmma-ws --causal
NCU picks the profiler (default: ncu on PATH, else under /usr/local/cuda or /opt/nvidia/nsight-compute).
EOF
}

here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
dir=. levels=dense,0.95 D=128 ops=mask,fwd,bwd out=''
while [ $# -gt 0 ]; do
    case $1 in
    --build|--levels|--D|--ops) [ $# -ge 2 ] || { echo "profile.sh: $1 needs a value" >&2; exit 2; } ;;
    esac
    case $1 in
    --build) dir=$2; shift 2 ;;
    --levels) levels=$2; shift 2 ;;
    --D) D=$2; shift 2 ;;
    --ops) ops=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "profile.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "profile.sh: one OUT_DIR only" >&2; exit 2; }; out=$1; shift ;;
    esac
done
[ -n "$out" ] || { usage >&2; exit 2; }
bench_build profile.sh "$dir"
ncu=${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || true)}
[ -n "$ncu" ] && [ -x "$ncu" ] || { echo "profile.sh: no ncu (Nsight Compute): set NCU" >&2; exit 1; }
mkdir -p "$out"

# The tensor-pipe and stall metrics this chip has (names differ between GPU generations).
avail=$("$ncu" --query-metrics 2>/dev/null | awk '{print $1}')
metrics=$(echo "$avail" | grep -E '^sm__pipe_tensor_op_[a-z]+_cycles_active$' | sed 's/$/.avg.pct_of_peak_sustained_active/' ||
    true)
stalls=$(echo "$avail" | grep -E '^smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active$' | sed 's/$/.ratio/' || true)
# Where the bytes come from: L2, DRAM and L1/shared-memory throughput, each against its own peak (SpeedOfLight's
# "Memory Throughput" is only the largest of them).
memory=$(echo "$avail" | grep -E '^(lts|dram|l1tex)__throughput$' | sed 's/$/.avg.pct_of_peak_sustained_elapsed/' || true)
extra=$(echo $metrics $stalls $memory | tr ' ' ',')

IFS=, read -r -a level_list <<<"$levels"
for level in "${level_list[@]}"; do
    name=$(echo "$level" | tr -c 'A-Za-z0-9.\n' _)
    echo "== $level: $ncu ... sparge bench --sparsity $level --D $D --ops $ops $*"
    "$ncu" --clock-control none --force-overwrite -o "$out/$name" --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
        ${extra:+--metrics "$extra"} \
        "$build/src/sparge" bench --backend cuda:0 --B 1 --H 12 --N 32760 --D "$D" --dtype bf16 --sparsity "$level" \
        --ops "$ops" --reps 1 --warmup 0 --settle 0 "$@" >"$out/$name.log" 2>&1 ||
        { echo "profile.sh: ncu failed (see $out/$name.log)" >&2; tail -n 5 "$out/$name.log" >&2; exit 1; }
    "$ncu" --import "$out/$name.ncu-rep" --csv --page details >"$out/$name.csv"
done

python3 - "$out" "$(source_commit "$here/../..")" "${level_list[@]}" <<'EOF'
import csv, sys, collections
out, commit, levels = sys.argv[1], sys.argv[2], sys.argv[3:]
lines = [f"# ncu profiles (commit {commit})", ""]
want = [("duration", "Duration"), ("SM %", "Compute (SM) Throughput"), ("memory %", "Memory Throughput"),
        ("issue slots %", "Issue Slots Busy"), ("occupancy %", "Achieved Occupancy"),
        ("registers", "Registers Per Thread")]
for level in levels:
    name = "".join(c if c.isalnum() or c == "." else "_" for c in level)
    kernels = collections.OrderedDict()
    with open(f"{out}/{name}.csv", newline="") as f:
        for row in csv.DictReader(f):
            short = row["Kernel Name"].rsplit("(", 1)[0].replace("void ", "").replace("(anonymous namespace)::", "")
            k = kernels.setdefault(row["ID"], {"name": short, "m": {}})
            k["m"][row["Metric Name"]] = (row["Metric Value"], row.get("Metric Unit", ""))
    lines += [f"## {level}", "",
              "| kernel | " + " | ".join(w[0] for w in want) + " | L2 / DRAM / L1 % | tensor pipe % | "
              "largest stalls (per issue) |",
              "|---" * (len(want) + 4) + "|"]
    for k in kernels.values():
        m = k["m"]
        cells = [" ".join(m.get(w[1], ("—", ""))).strip() for w in want]
        tensor = [n.split("tensor_op_")[1].split("_")[0] + " " + v for n, (v, _) in m.items()
                  if n.startswith("sm__pipe_tensor_op_")]
        stalls = sorted(((float(v.replace(",", "")), n.split("stalled_")[1].split("_per_issue")[0])
                         for n, (v, _) in m.items() if "issue_stalled_" in n), reverse=True)[:3]
        mem = " / ".join(m.get(f"{unit}__throughput.avg.pct_of_peak_sustained_elapsed", ("—",))[0]
                         for unit in ("lts", "dram", "l1tex"))
        lines.append(f"| {k['name']} | " + " | ".join(cells) + f" | {mem} | {' / '.join(tensor) or '—'} | "
                     + ", ".join(f"{s} {v:.2f}" for v, s in stalls) + " |")
    lines.append("")
open(f"{out}/summary.md", "w").write("\n".join(lines))
print("\n".join(lines))
EOF
