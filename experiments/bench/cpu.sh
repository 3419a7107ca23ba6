#!/usr/bin/env bash
# The CPU table of experiments/BENCHMARKS.md: the FMA peak of this machine, then sparge bench on the `cpu`
# backend (B=1 H=2 N=8192 D=128) dense, at 95 % sparsity (Top-k 0.05 and the hybrid mask at the same
# sparsity) and with the paper's hybrid, forward and backward, deterministic backward, and the f16, bf16 and
# BNHD variants, each command --runs times; CSV files and summary.md in OUT_DIR.
set -euo pipefail

usage() {
    cat <<EOF
usage: experiments/bench/cpu.sh [--build DIR] [--runs N] [--quick] OUT_DIR

  --build DIR  a configured and built build directory (default: the current directory)
  --runs N     runs of each command; the tables give the median and the range (default 5; 1 with --quick)
  --quick      N=2048, 3 timed runs per level, a short peak measurement: a check that everything
               works, not a measurement
Writes OUT_DIR/peak.txt, OUT_DIR/runs/*.csv (one per command and run), OUT_DIR/cpu.csv (median, min and
max of every time) and OUT_DIR/summary.md. Other load on the machine moves the times: the summary records
the load average before and after.
EOF
}

build=. runs='' quick=0 out=''
while [ $# -gt 0 ]; do
    case $1 in
    --build) [ $# -ge 2 ] || { usage >&2; exit 2; }; build=$2; shift 2 ;;
    --runs) [ $# -ge 2 ] || { usage >&2; exit 2; }; runs=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "cpu.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) [ -z "$out" ] || { usage >&2; exit 2; }; out=$1; shift ;;
    esac
done
[ -n "$out" ] || { usage >&2; exit 2; }
[ -n "$runs" ] || runs=$([ "$quick" = 1 ] && echo 1 || echo 5)
case $runs in ''|*[!0-9]*|0) echo "cpu.sh: --runs wants a positive integer" >&2; exit 2 ;; esac

src=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=experiments/bench/common.sh
. "$src/experiments/bench/common.sh"
bench_build cpu.sh "$build" experiments/cpu_peak
sparge=$build/src/sparge peak_bin=$build/experiments/cpu_peak
grep -q '^  cpu ' <<<"$info" || { echo "cpu.sh: this build has no cpu backend" >&2; exit 1; }

N=8192 reps=10 warmup=2 reps_bwd=5 warmup_bwd=1 peak_s=0.5
if [ "$quick" = 1 ]; then N=2048 reps=3 warmup=1 reps_bwd=3 warmup_bwd=1 peak_s=0.1; fi
mkdir -p "$out/runs"
out=$(cd "$out" && pwd)
load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)
t_all=$(date +%s)

shape=(--backend cpu --B 1 --H 2 --N "$N" --D 128 --timing each)
short="--reps $reps_bwd --warmup $warmup_bwd"
# label|options; --timing each: the median of runs synchronized one at a time
commands=(
    "f32|--dtype f32 --sparsity dense,0.95,hybrid --reps $reps --warmup $warmup"
    "f32 hybrid p 0.045|--dtype f32 --sparsity hybrid --topk 0.03 --topp 0.045 --reps $reps --warmup $warmup"
    "f32 deterministic|--dtype f32 --sparsity dense,0.95 --ops bwd --deterministic $short"
    "f16|--dtype f16 --sparsity dense,0.95 $short"
    "bf16|--dtype bf16 --sparsity dense,0.95 $short"
    "f32 BNHD|--dtype f32 --layout bnhd --sparsity dense,0.95 $short"
)

echo "== FMA peak: experiments/cpu_peak $peak_s"
"$peak_bin" "$peak_s" | tee "$out/peak.txt"
# the last line is the widest SIMD tier on every thread: "  avx512f (16 lanes)    2 thread(s):    523.2 GFLOP/s ..."
peak=$(tail -n 1 "$out/peak.txt" | sed -n 's/.*: *\([0-9.][0-9.]*\) GFLOP\/s.*/\1/p')
[ -n "$peak" ] || { echo "cpu.sh: could not read the peak from $out/peak.txt" >&2; exit 1; }

named=()
for run in $(seq 1 "$runs"); do
    for i in "${!commands[@]}"; do
        label=${commands[$i]%%|*} opts=${commands[$i]#*|}
        csv=$out/runs/cmd$((i + 1))-run$run.csv
        echo "== run $run/$runs, command $((i + 1))/${#commands[@]} ($label): sparge bench ${shape[*]} $opts"
        # shellcheck disable=SC2086  # opts is a list of options
        "$sparge" bench "${shape[@]}" $opts --output "$csv" | sed 's/^/   /'
        named+=("$label=$csv")
    done
done

{
    echo "# sparge on the CPU: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)"
    echo
    echo "Produced by \`experiments/bench/cpu.sh$([ "$quick" = 1 ] && echo ' --quick') --runs $runs\` on" \
         "$(date -u '+%Y-%m-%d %H:%M UTC'), source commit $(source_commit "$src"), build \`$build\`."
    echo "CPU: $(sed -n 's/^cpu family[[:space:]]*: /family /p' /proc/cpuinfo | head -n 1)," \
         "$(sed -n 's/^model[[:space:]]*: /model /p' /proc/cpuinfo | head -n 1), $(nproc) logical CPUs;" \
         "load average $load_before before, $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown) after" \
         "($(($(date +%s) - t_all)) s)."
    echo
    echo '```'
    "$sparge" info
    echo '```'
    echo
    echo "FMA peak (\`experiments/cpu_peak $peak_s\`):"
    echo
    echo '```'
    cat "$out/peak.txt"
    echo '```'
    echo
    echo "Commands ($runs run(s) of each): \`sparge bench ${shape[*]} OPTIONS\` with"
    echo
    for i in "${!commands[@]}"; do echo "- ${commands[$i]%%|*}: \`${commands[$i]#*|}\`"; done
    echo
    python3 "$src/experiments/bench/tables.py" runs --peak "$peak" "$out/cpu.csv" "${named[@]}"
    echo
    echo "The last run of the first command:"
    echo
    python3 "$src/experiments/bench/tables.py" bench "$out/runs/cmd1-run$runs.csv" GFLOP/s
} >"$out/summary.md"
echo "== done in $(($(date +%s) - t_all)) s: $out/summary.md, $out/cpu.csv"
