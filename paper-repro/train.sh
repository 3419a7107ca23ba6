#!/usr/bin/env bash
# Reproduce SpargeAttention2's training claims (Tables 2, 3 and 6) with sparge-train, the tiny video
# DiT of experiments/trainer (see paper-repro/README.md, "Training tables"), and look at the teacher's
# own attention (the discrim entry). `make repro-train` calls it.
#
#   paper-repro/train.sh [--bindir DIR] [--device NAME] [--device-ops 0|1] [--out DIR] [--only LIST] [--seeds N]
#                        [--jobs N] [--teacher FILE] [--hybrid-k K] [--quick] [--tables-only] [-- KEY=VALUE...]
#
#   --bindir DIR   where sparge-train is (default: ./experiments/trainer if built here, else build it in
#                  build-repro/, configured ${CONFIGURE_FLAGS:---without-hip}: CUDA when configure finds it); the
#                  exp_* drivers are taken from DIR/..
#   --device NAME  sparge device for every run (default: cuda-generic:0 when `sparge info` of that build shows
#                  a CUDA device, else cpu; --quick: cpu)
#   --device-ops B device_ops= for every run (default 1: on a CUDA device the whole model runs there; 0: the
#                  model on the host, only the attention on the device)
#   --out DIR      results directory (default paper-repro/results/train; checkpoints go to DIR/runs, not committed)
#   --only LIST    comma-separated subset of teacher,table3,table6,table2,discrim, run in that order; every entry
#                  reuses the checkpoints found in DIR/runs (delete them to train again; table2 needs table6's
#                  students, discrim the teacher and table6's calibration)
#   --seeds N      fine-tuning seeds per arm (default 3)
#   --jobs N       runs at a time (default: the number of cores; each gets cores/N OpenMP threads)
#   --teacher FILE use this checkpoint as the teacher instead of training one (copied to DIR/runs)
#   --hybrid-k K   Top-k fraction of the Table 6 hybrid (default 0.035: 2 of repro.cfg's 64 key blocks)
#   --quick        tiny config and a few steps: a smoke test in 1–2 minutes on 2 cores, not the committed results
#   --tables-only  train and evaluate nothing but the null model: rewrite each table's Markdown (statistics and
#                  verdicts) from the CSVs in DIR, keeping the provenance lines of the runs
#   -- KEY=VALUE   sparge-train keys applied to every run after the config (e.g. block_k=8)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
bindir= device= device_ops=1 out= only=teacher,table3,table6,table2,discrim seeds=3 jobs=$(nproc 2>/dev/null || echo 1)
quick=0 tables_only=0 teacher_file= hybrid_k=0.035
value() { # FLAG NUMBER-OF-ARGUMENTS-LEFT: FLAG needs a value after it
    [ "$2" -ge 2 ] || { echo "train.sh: $1 needs a value (see --help)" >&2; exit 2; }
}
while [ $# -gt 0 ]; do
    case $1 in
    --bindir|--device|--device-ops|--out|--only|--seeds|--jobs|--teacher|--hybrid-k) value "$1" $# ;;
    esac
    case $1 in
    --bindir) bindir=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --device-ops) device_ops=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --teacher) teacher_file=$2; shift 2 ;;
    --hybrid-k) hybrid_k=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --tables-only) tables_only=1; shift ;;
    --) shift; break ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
    *) echo "train.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
overrides=("$@")
for kv in "${overrides[@]}"; do
    case $kv in *=*) ;; *) echo "train.sh: '$kv' after -- is not KEY=VALUE" >&2; exit 2 ;; esac
done
[ -z "$teacher_file" ] || [ -f "$teacher_file" ] || { echo "train.sh: --teacher $teacher_file: no such file" >&2; exit 2; }
case $seeds in '' | *[!0-9]*) echo "train.sh: --seeds takes a positive integer, not '$seeds'" >&2; exit 2 ;; esac
case $jobs in '' | *[!0-9]*) echo "train.sh: --jobs takes a positive integer, not '$jobs'" >&2; exit 2 ;; esac
[ "$seeds" -ge 1 ] || { echo "train.sh: --seeds must be >= 1" >&2; exit 2; }
[ "$jobs" -ge 1 ] || { echo "train.sh: --jobs must be >= 1" >&2; exit 2; }
case $device_ops in 0|1) ;; *) echo "train.sh: --device-ops takes 0 or 1" >&2; exit 2 ;; esac
# the hybrid's topk= (sparge-train would refuse anything else, but only after the teacher has trained)
awk -v k="$hybrid_k" 'BEGIN { exit !(k ~ /^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$/ && k + 0 > 0 && k + 0 <= 1) }' ||
    { echo "train.sh: --hybrid-k takes a number in (0, 1], not '$hybrid_k'" >&2; exit 2; }
entries=$(echo "$only" | tr ',' ' ')
[ -n "$(echo "$only" | tr -d ', ')" ] || { echo "train.sh: --only needs at least one of teacher,table3,table6,table2,discrim" >&2; exit 2; }
for entry in $entries; do
    case $entry in teacher|table3|table6|table2|discrim) ;; *) echo "train.sh: --only: unknown entry '$entry'" >&2; exit 2 ;; esac
done

if [ -z "$bindir" ]; then
    if [ -x ./experiments/trainer/sparge-train ]; then
        bindir=$(pwd)/experiments/trainer
    else
        build=$top/build-repro
        echo "== building sparge-train and the drivers in $build"
        [ -x "$top/configure" ] || (cd "$top" && autoreconf -fi)
        mkdir -p "$build"
        (cd "$build" && { [ -f Makefile ] || "$top/configure" --quiet ${CONFIGURE_FLAGS:---without-hip}; } &&
            make -j"$jobs" --no-print-directory experiments/trainer/sparge-train src/sparge experiments/exp_stats \
                experiments/exp_discrim experiments/exp_table1 experiments/exp_failure experiments/exp_ablation)
        bindir=$build/experiments/trainer
    fi
fi
train=$bindir/sparge-train
expdir=$(cd "$bindir/.." && pwd)
[ -x "$train" ] || { echo "train.sh: $train not found (configure found no CBLAS? see experiments/trainer/README.md)" >&2; exit 1; }
[ -x "$expdir/exp_stats" ] || { echo "train.sh: $expdir/exp_stats not found (make experiments/exp_stats)" >&2; exit 1; }
if [ -z "$device" ]; then # CUDA by default; the quick smoke test on the CPU
    device=cpu
    sparge_cli=$bindir/../../src/sparge
    if [ "$quick" = 0 ] && [ -x "$sparge_cli" ] && "$sparge_cli" info 2>/dev/null | grep -q '^  cuda-generic:0 '; then
        device=cuda-generic:0
    fi
fi
# shellcheck source=paper-repro/claims.sh
. "$here/claims.sh"

# The experiment. Every number below is a choice of this reproduction, documented in paper-repro/README.md.
if [ "$quick" = 1 ]; then
    cfg=$top/experiments/trainer/configs/tiny.cfg
    teacher_steps=30 teacher_batch=4 ft_steps=10 eval_keys="eval_batches=1 sample_steps=2" calib_iters=6 smooth=3
    dump_times=0.5
    out=${out:-/tmp/sparge-train-quick}
else
    cfg=$top/experiments/trainer/configs/repro.cfg
    teacher_steps=4000 teacher_batch=8 ft_steps=300 eval_keys="eval_batches=8 sample_steps=16" calib_iters=14 smooth=25
    dump_times=0.1,0.5,0.9
    out=${out:-$here/results/train}
fi
target_sparsity=0.95 # Table 6: every sparse arm at this block sparsity (paper: ≈95 %)
# Table 6 hybrid (--hybrid-k): Top-k keeps 2 of repro.cfg's 64 key blocks (floor(0.035·64) = 2; the paper's
# k = 0.03 keeps 15 of Wan2.1's 512): with 1 block it would add nothing to the block Top-p always keeps, and
# the hybrid would be Top-p only. p is calibrated so that the union reaches the target.
ft_keys="data=B lr=3e-4 warmup=20 steps=$ft_steps log_every=50"
runs=$out/runs
mkdir -p "$runs" "$out/logs"
cores=$(nproc 2>/dev/null || echo 1)
threads=$((cores / jobs)); [ "$threads" -ge 1 ] || threads=1
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=1 # sparge's and OpenBLAS's threads do not coordinate

commit=$(git -C "$top" rev-parse --short HEAD 2>/dev/null || cat "$top/COMMIT" 2>/dev/null || echo unknown) # COMMIT: a dist tarball's
cpu_model=$(sed -n 's/^model name[^:]*: //p' /proc/cpuinfo 2>/dev/null | head -n1)
machine="$(uname -m), $cores cores${cpu_model:+, $cpu_model}"
tag="commit=$commit" # every run's log records it with its whole configuration

# ---------------------------------------------------------------- runs

# evaluate FILE TABLE ARM SEED KEY=VALUE...: one mode=eval row of the model, prefixed with its labels.
# Every model is evaluated with the same held-out inputs (seed=0), whatever seed it was trained with; the velocity
# error is to the teacher where there is one (with --tables-only, for the null model, there may be none).
evaluate() {
    local file=$1 table=$2 arm=$3 seed=$4 teacher=()
    shift 4
    [ ! -f "$runs/teacher.safetensors" ] || teacher=(teacher="$runs/teacher.safetensors")
    # shellcheck disable=SC2086
    "$train" "$cfg" "${overrides[@]}" mode=eval device="$device" device_ops="$device_ops" seed=0 tag="$tag" \
        "${teacher[@]}" $eval_keys "$@" \
        >"$file.tmp" 2>"$file.err" || { echo "train.sh: evaluation failed ($file.err):" >&2; cat "$file.err" >&2; return 1; }
    { echo "table,arm,seed,$(sed -n 1p "$file.tmp")"; echo "$table,$arm,$seed,$(sed -n 2p "$file.tmp")"; } >"$file"
    rm -f "$file.tmp" "$file.err"
}

# finetune NAME TABLE ARM SEED KEY=VALUE...: fine-tune the teacher (unless the checkpoint exists), then evaluate it
# under the same attention keys.
finetune() {
    local name=$1 table=$2 arm=$3 seed=$4
    shift 4
    if [ ! -f "$runs/$name.safetensors" ]; then
        # shellcheck disable=SC2086
        "$train" "$cfg" "${overrides[@]}" device="$device" device_ops="$device_ops" init="$runs/teacher.safetensors" \
            teacher="$runs/teacher.safetensors" tag="$tag" $ft_keys seed="$seed" data_seed=$((100 + seed)) "$@" \
            out="$runs/$name.part.safetensors" log="$runs/$name.csv" 2>"$runs/$name.log" ||
            { echo "train.sh: $name failed:" >&2; tail -n 5 "$runs/$name.log" >&2; return 1; }
        mv "$runs/$name.part.safetensors" "$runs/$name.safetensors"
    fi
    cp "$runs/$name.csv" "$out/logs/"
    evaluate "$runs/$name.eval.csv" "$table" "$arm" "$seed" init="$runs/$name.safetensors" "$@"
    echo "   done: $name ($(tail -n 1 "$runs/$name.log" | sed 's/.*| \([0-9.]* ms\/step\).*/\1/'))"
}

# The null model of the sanity checks: the config's model untrained (adaLN-Zero: zero velocity, so its Euler samples
# are the sampler's noise), evaluated like every other model. Its row is appended to CSV unless there.
null_row() { # CSV TABLE
    grep -q ",$ARM_NULL," "$1" && return 0
    if [ ! -f "$runs/null.eval.csv" ]; then
        "$train" "$cfg" "${overrides[@]}" steps=0 device="$device" device_ops="$device_ops" tag="$tag" \
            out="$runs/null.safetensors" 2>/dev/null
        evaluate "$runs/null.eval.csv" null "$ARM_NULL" 0 init="$runs/null.safetensors" attn=dense
    fi
    sed -n 2p "$runs/null.eval.csv" | sed "s/^null,/$2,/" >>"$1"
}

# Runs queued with `queue` go $jobs at a time; `drain` waits for all and fails if one failed.
pids=()
queue() {
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    "$@" &
    pids+=($!)
}
drain() {
    local rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    pids=()
    [ "$rc" = 0 ] || { echo "train.sh: a run failed (see above)" >&2; exit 1; }
}

need_teacher() {
    [ -f "$runs/teacher.safetensors" ] || { echo "train.sh: no teacher in $runs: run the teacher entry first" >&2; exit 1; }
}

# calibrate_p MODE K: the Top-p that gives the target sparsity with the teacher on 2 held-out batches (sparge-train
# mode=calibrate: bisection, p on a 1e-6 grid).
calibrate_p() {
    "$train" "$cfg" "${overrides[@]}" mode=calibrate device="$device" device_ops="$device_ops" seed=0 tag="$tag" \
        init="$runs/teacher.safetensors" eval_batches=2 calib_iters="$calib_iters" target_sparsity="$target_sparsity" \
        attn="$1" topk="$2" 2>"$runs/calibrate.log" | sed -n 2p | cut -d, -f1
}

# ---------------------------------------------------------------- tables

# column_of CSV NAME...: the named columns of a CSV with a header, comma-separated.
column_of() {
    local csv=$1
    shift
    awk -F, -v names="$*" 'NR == 1 { n = split(names, want, " "); for (i = 1; i <= NF; i++) idx[$i] = i
                                      for (j = 1; j <= n; j++) if (!(want[j] in idx)) { print "no column " want[j] > "/dev/stderr"; exit 1 }
                                      next }
                           { line = ""; for (j = 1; j <= n; j++) line = line (j > 1 ? "," : "") $(idx[want[j]]); print line }' "$csv"
}

# header FILE TITLE CLAIM: the table's Markdown head, into FILE.part (the table is written there and renamed to FILE
# by finish when complete: a table that fails half-way leaves FILE as it was). The provenance paragraph is this
# run's, or with --tables-only the one FILE had (the runs behind the CSV), followed by a line saying when the tables
# were rewritten.
header() {
    local provenance
    if [ "$tables_only" = 1 ] && [ -f "$1" ] && grep -q '^Generated by' "$1"; then
        provenance=$(awk '/^Generated by/ { on = 1 } on && /^$/ { exit } on && !/^Statistics and verdicts rewritten/' "$1")
        provenance="$provenance
Statistics and verdicts rewritten from the CSV by \`paper-repro/train.sh --tables-only\` on $(date -u +%Y-%m-%d), commit \`$commit\`."
    else
        provenance="Generated by \`paper-repro/train.sh\` on $(date -u +%Y-%m-%d) — device \`$device\` (device_ops=$device_ops), commit \`$commit\`, $machine;
config \`${cfg#"$top"/}\`${overrides[*]:+ with \`${overrides[*]}\`}, teacher $teacher_steps steps of batch $teacher_batch on A, fine-tuning $ft_steps steps, $seeds seed(s) per
fine-tuned arm, every model evaluated on the same held-out A inputs ($eval_keys). Columns: paper-repro/README.md."
    fi
    { echo "# $2"; echo; echo "$3"; echo; echo "$provenance"; } >"$1.part"
}
finish() { mv "$1.part" "$1"; } # FILE: the table written into FILE.part is complete
trap 'rm -f "$out"/table[0-9].md.part "$out/discrim.md.part" "$out/trained_maps.md.part"' EXIT

collect() { # the eval rows of the given run names, one header
    local first=1 f
    for f in "$@"; do
        if [ "$first" = 1 ]; then cat "$runs/$f.eval.csv"; first=0; else sed -n 2p "$runs/$f.eval.csv"; fi
    done
}

GNUPLOT=${GNUPLOT:-gnuplot}
if command -v "$GNUPLOT" >/dev/null 2>&1; then
    if "$GNUPLOT" -e 'set terminal pngcairo' >/dev/null 2>&1; then term=pngcairo; else term=png; fi
else
    GNUPLOT=
    echo "train.sh: gnuplot not found: tables and CSVs only, no PNGs (apt-get install gnuplot-nox)" >&2
fi
plot() { # script output assignments (gnuplot's notes on degenerate ranges, as the smoke test's data give, dropped)
    [ -n "$GNUPLOT" ] || return 0
    "$GNUPLOT" -e "term='$term'; out='$2'; $3" "$here/plots/$1" 2> >(grep -v '^Warning: empty .* range' >&2) ||
        echo "train.sh: gnuplot failed on $1" >&2
}

# means: "arm" mean std ... per arm of headerless CSV rows arm,value... (stdin), for the plots.
means() {
    awk -F, '{ if (!($1 in n)) order[++arms] = $1
               n[$1]++; for (i = 2; i <= NF; i++) { s[$1, i] += $i; q[$1, i] += $i * $i }; cols = NF }
             END { for (a = 1; a <= arms; a++) {
                       arm = order[a]; line = "\"" arm "\""
                       for (i = 2; i <= cols; i++) {
                           m = s[arm, i] / n[arm]; v = n[arm] > 1 ? (q[arm, i] - n[arm] * m * m) / (n[arm] - 1) : 0
                           line = line sprintf(" %.6g %.6g", m, sqrt(v > 0 ? v : 0))
                       }
                       print line } }'
}

write_table3() {
    local f=$out/table3.md
    null_row "$out/table3.csv" table3
    header "$f" "Table 3 — fine-tuning full attention on mismatched data with the diffusion loss" "$PAPER_T3"
    stats_table3 "$out/table3.csv" "$f.part"
    {
        echo
        echo "Sample statistics (real held-out A videos: $(column_of "$out/table3.csv" ref_sharpness ref_temporal_jitter ref_mean_c0 | sed -n 2p | sed 's/,/ \/ /g') for sharpness / jitter / channel-0 mean):"
    } >>"$f.part"
    "$expdir/exp_stats" --quiet --in "$out/table3.csv" --table table3 \
        --metrics sample_sharpness,sample_temporal_jitter,sample_mean_c0 >>"$f.part"
    finish "$f"
}

write_table6() {
    local f=$out/table6.md cal
    cal=$(cat "$out/table6_calibration.txt")
    null_row "$out/table6.csv" table6
    header "$f" "Table 6 — sparse fine-tuning at matched sparsity: mask rule and loss" "$PAPER_T6

Here every arm fine-tunes the teacher on B (the mismatched data, as in the paper) and is evaluated on held-out A;
Top-p values were calibrated on the teacher so each rule starts at $target_sparsity sparsity ($cal); the sparsity
column is what each model reaches after fine-tuning. Whether this teacher's attention lets the arms differ at all:
discrim.md."
    stats_table6 "$out/table6.csv" "$f.part"
    finish "$f"
    column_of "$out/table6.csv" arm velocity_rel_l2 frechet | grep -v "^$ARM_NULL," | means >"$out/table6.dat"
    plot train_table6.gp "$out/table6.png" "dat='$out/table6.dat'"
}

write_table2() {
    local f=$out/table2.md
    header "$f" "Table 2 — Top-p sparsity and attention error at fixed p, before and after sparse fine-tuning" "$PAPER_T2

Here: the same Top-p at p = ${T2_PS// /, } (the paper's $T2_P) applied to the teacher and to the models fine-tuned in
Tables 6 and 3 (evaluated with one Euler step: Table 2 uses no sample metric)."
    stats_table2 "$out/table2.csv" "$f.part"
    finish "$f"
}

# ---------------------------------------------------------------- entries

if [ "$tables_only" = 1 ]; then
    for t in table3 table6 table2; do
        case " $entries " in *" $t "*) ;; *) continue ;; esac
        [ -f "$out/$t.csv" ] || { echo "train.sh: --tables-only: no $out/$t.csv" >&2; exit 1; }
        echo "== $t: statistics and verdicts from $out/$t.csv"
        "write_$t"
    done
    exit 0
fi
t_all=$(date +%s)
for entry in teacher table3 table6 table2 discrim; do
    case " $entries " in *" $entry "*) ;; *) continue ;; esac
    t0=$(date +%s)
    case $entry in
    teacher)
        [ -z "$teacher_file" ] || [ -f "$runs/teacher.safetensors" ] || cp "$teacher_file" "$runs/teacher.safetensors"
        if [ -f "$runs/teacher.safetensors" ]; then
            echo "== teacher: reusing $runs/teacher.safetensors (delete it to train again)"
        else
            echo "== teacher: dense attention, diffusion loss on A, $teacher_steps steps of batch $teacher_batch (progress in $runs/teacher.log)"
            # the teacher trains alone: every core goes to it
            OMP_NUM_THREADS=$cores "$train" "$cfg" "${overrides[@]}" device="$device" device_ops="$device_ops" \
                steps="$teacher_steps" batch="$teacher_batch" tag="$tag" out="$runs/teacher.part.safetensors" \
                log="$runs/teacher.csv" 2> >(tee "$runs/teacher.log" >&2)
            mv "$runs/teacher.part.safetensors" "$runs/teacher.safetensors"
        fi
        evaluate "$runs/teacher.eval.csv" teacher full 0 init="$runs/teacher.safetensors" attn=dense
        [ ! -f "$runs/teacher.csv" ] || cp "$runs/teacher.csv" "$out/logs/" # none when --teacher gave the checkpoint
        ;;
    table3)
        need_teacher
        echo "== Table 3: full attention fine-tuned with the diffusion loss on mismatched B (control: on A), $seeds seeds"
        for s in $(seq 1 "$seeds"); do
            queue finetune "t3_full_B_s$s" table3 "$ARM_FULL_B" "$s" attn=dense loss=diffusion
            queue finetune "t3_full_A_s$s" table3 "$ARM_FULL_A" "$s" attn=dense loss=diffusion data=A
        done
        drain
        names=(teacher)
        for s in $(seq 1 "$seeds"); do names+=("t3_full_B_s$s"); done
        for s in $(seq 1 "$seeds"); do names+=("t3_full_A_s$s"); done
        collect "${names[@]}" | sed "s/^teacher,full,/table3,$ARM_TEACHER_T3,/" >"$out/table3.csv"
        write_table3
        ;;
    table6)
        need_teacher
        echo "== Table 6: sparse fine-tuning at $target_sparsity sparsity; calibrating Top-p on the teacher"
        p_topp=$(calibrate_p topp 0)
        p_hybrid=$(calibrate_p hybrid "$hybrid_k")
        k_topk=$(awk -v t="$target_sparsity" 'BEGIN { printf "%.6f", 1 - t }')
        echo "   Top-p only p = $p_topp; hybrid k = $hybrid_k, p = $p_hybrid; Top-k only k = $k_topk"
        hyb="attn=hybrid topk=$hybrid_k topp=$p_hybrid"
        evaluate "$runs/t6_training_free.eval.csv" table6 "$ARM_FREE" 0 init="$runs/teacher.safetensors" $hyb
        for s in $(seq 1 "$seeds"); do
            queue finetune "t6_hybrid_vd_s$s" table6 "$ARM_HYB_VD" "$s" $hyb loss=vd
            queue finetune "t6_topk_vd_s$s" table6 "$ARM_TOPK_VD" "$s" attn=topk topk="$k_topk" loss=vd
            queue finetune "t6_topp_vd_s$s" table6 "$ARM_TOPP_VD" "$s" attn=topp topp="$p_topp" loss=vd
            queue finetune "t6_hybrid_diff_s$s" table6 "$ARM_HYB_DIFF" "$s" $hyb loss=diffusion
        done
        drain
        names=(teacher t6_training_free)
        for arm in hybrid_vd topk_vd topp_vd hybrid_diff; do
            for s in $(seq 1 "$seeds"); do names+=("t6_${arm}_s$s"); done
        done
        collect "${names[@]}" | sed "s/^teacher,full,/table6,$ARM_TEACHER_T6,/" >"$out/table6.csv"
        echo "topp_only_p=$p_topp hybrid_k=$hybrid_k hybrid_p=$p_hybrid topk_only_k=$k_topk" >"$out/table6_calibration.txt"
        write_table6
        ;;
    table2)
        need_teacher
        echo "== Table 2: Top-p at p = ${T2_PS// /, } before and after fine-tuning"
        names=()
        for p in $T2_PS; do
            queue evaluate "$runs/t2_teacher_p$p.eval.csv" table2 "$(t2_arm "$ARM_T2_BEFORE" "$p")" 0 \
                init="$runs/teacher.safetensors" attn=topp topp="$p" sample_steps=1
            names+=("t2_teacher_p$p")
            for s in $(seq 1 "$seeds"); do
                for pair in "t6_hybrid_vd:$ARM_T2_HYB" "t3_full_B:$ARM_T2_DENSE"; do
                    run=${pair%%:*}_s$s label=${pair#*:}
                    if [ -f "$runs/$run.safetensors" ]; then
                        queue evaluate "$runs/t2_${run}_p$p.eval.csv" table2 "$(t2_arm "$label" "$p")" "$s" \
                            init="$runs/$run.safetensors" attn=topp topp="$p" sample_steps=1
                        names+=("t2_${run}_p$p")
                    else
                        echo "   (no $run: run table6 and table3 first for every row)"
                    fi
                done
            done
        done
        drain
        collect "${names[@]}" >"$out/table2.csv"
        write_table2
        ;;
    discrim)
        need_teacher
        [ -f "$out/table6_calibration.txt" ] || { echo "train.sh: discrim needs table6's calibration: run table6 first" >&2; exit 1; }
        # shellcheck disable=SC1090
        eval "$(tr ' ' '\n' <"$out/table6_calibration.txt")"
        echo "== discrim: the teacher's Q/K/V per layer at t = $dump_times; the Table 6 arms on them (${topk_only_k}; ${topp_only_p}; ${hybrid_k}, ${hybrid_p})"
        rm -rf "$runs/qkv"
        "$train" "$cfg" "${overrides[@]}" mode=dump device="$device" device_ops="$device_ops" seed=0 tag="$tag" \
            init="$runs/teacher.safetensors" dump_dir="$runs/qkv" dump_times="$dump_times" 2>"$runs/dump.log"
        bq=$(sed -n 2p "$runs/qkv/manifest.csv" | cut -d, -f8) bk=$(sed -n 2p "$runs/qkv/manifest.csv" | cut -d, -f9)
        f=$out/discrim.md
        {
            echo "# Discriminability — can the Table 6 arms differ on this teacher's attention?"
            echo
            echo "The paper's Table 6 compares mask rules on Wan2.1, whose rows mix near-uniform and sink-dominated ones"
            echo "(its Fig. 1); the comparison can only show a difference where the rules keep different blocks. Here: the"
            echo "teacher's own Q/K/V (\`sparge-train mode=dump\`, the first held-out batch at t = $dump_times) under the"
            echo "Table 6 arms' parameters (table6_calibration.txt)."
            echo
            echo "Generated by \`paper-repro/train.sh --only discrim\` on $(date -u +%Y-%m-%d), commit \`$commit\`, $machine;"
            echo "\`exp_discrim --dump runs/qkv --topk $topk_only_k --topp $topp_only_p --hybrid $hybrid_k,$hybrid_p --csv discrim.csv --masks discrim_masks.dat\`."
            echo
        } >"$f.part"
        # in DIR with paths relative to it, as the command above says: the Markdown names no path of this machine
        (cd "$out" && "$expdir/exp_discrim" --quiet --dump runs/qkv --backend "$device" --topk "$topk_only_k" \
            --topp "$topp_only_p" --hybrid "$hybrid_k,$hybrid_p" --csv discrim.csv --masks discrim_masks.dat) >>"$f.part"
        finish "$f"
        plot discrim_profile.gp "$out/discrim_profile.png" "csv='$out/discrim.csv'"
        plot discrim_heads.gp "$out/discrim_heads.png" "csv='$out/discrim.csv'"
        plot discrim_masks.gp "$out/discrim_masks.png" "dat='$out/discrim_masks.dat'"
        # the training-free analyses of the synthetic families, on the teacher's own maps
        f=$out/trained_maps.md
        common="--block-q $bq --block-k $bk --quiet --backend $device"
        rules="--topk $topk_only_k --hybrid-k $hybrid_k" # exp_ablation sweeps its own
        {
            echo "# Table 1, Fig. 1 and the ablation on the teacher's own attention"
            echo
            echo "The training-free analyses of paper-repro/results/ (there on synthetic inputs) run with \`--input\` on the"
            echo "teacher's Q/K/V of each layer (discrim.md), at the Table 6 arms' Top-k count and hybrid k, each rule's p"
            echo "calibrated per file to equal sparsity. Generated by \`paper-repro/train.sh --only discrim\` on"
            echo "$(date -u +%Y-%m-%d), commit \`$commit\`; command per file: \`exp_table1|exp_failure --input FILE $common $rules\`,"
            echo "\`exp_ablation --input FILE $common\`."
            echo
            echo "## Table 1 at equal sparsity, every layer and time"
            echo
            echo "| input | variation | sparsity | Top-k | Top-p | hybrid | ordering (rel. L1, lower first) |"
            echo "|---|---|---|---|---|---|---|"
        } >"$f.part"
        tail -n +2 "$runs/qkv/manifest.csv" | while IFS=, read -r file layer t _; do
            # shellcheck disable=SC2086
            "$expdir/exp_table1" --input "$runs/qkv/$file" --row "layer $layer, t $t" $common $rules >>"$f.part"
        done
        mid=$(echo "$dump_times" | tr ',' '\n' | awk '{ t[NR] = $1 } END { print t[int((NR + 1) / 2)] }')
        for driver in failure ablation; do
            { echo; echo "## exp_$driver, every layer at t = $mid"; echo; } >>"$f.part"
            tail -n +2 "$runs/qkv/manifest.csv" | awk -F, -v t="$mid" '$3 == t { print $1 }' | while read -r file; do
                # shellcheck disable=SC2086
                "$expdir/exp_$driver" --input "$runs/qkv/$file" $common $([ $driver = ablation ] || echo "$rules") |
                    awk '/^Toy rows/ { skip = 1 } /^Per-row statistics/ { skip = 0 } !skip' >>"$f.part" # toy rows: fig1_failure.md
                echo >>"$f.part"
            done
        done
        finish "$f"
        ;;
    esac
    echo "   ($entry: $(($(date +%s) - t0)) s)"
done
curves= # loss curves of the runs present: the teacher and seed 1 of each fine-tuned arm
for r in t6_hybrid_vd_s1 t6_topk_vd_s1 t6_topp_vd_s1 t6_hybrid_diff_s1 t3_full_B_s1 t3_full_A_s1; do
    [ ! -f "$out/logs/$r.csv" ] || curves="$curves $r"
done
[ ! -f "$out/logs/teacher.csv" ] || plot train_curves.gp "$out/training_curves.png" "logs='$out/logs'; runs='$curves'; window=$smooth"
echo "== done in $(($(date +%s) - t_all)) s; tables in $out"
