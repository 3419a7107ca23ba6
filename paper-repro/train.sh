#!/usr/bin/env bash
# Reproduce SpargeAttention2's training claims (Tables 2, 3 and 6) with sparge-train, the tiny video
# DiT of experiments/trainer (see paper-repro/README.md, "Training tables"). `make repro-train` calls it.
#
#   paper-repro/train.sh [--bindir DIR] [--device NAME] [--device-ops 0|1] [--out DIR] [--only LIST] [--seeds N]
#                        [--jobs N] [--teacher FILE] [--hybrid-k K] [--quick] [-- KEY=VALUE...]
#
#   --bindir DIR   where sparge-train is (default: ./experiments/trainer if built here, else build it in
#                  build-repro/, configured ${CONFIGURE_FLAGS:---without-hip}: CUDA when configure finds it)
#   --device NAME  sparge device for every run (default: cuda-generic:0 when `sparge info` of that build shows
#                  a CUDA device, else cpu; --quick: cpu)
#   --device-ops B device_ops= for every run (default 1: on a CUDA device the whole model runs there; 0: the
#                  model on the host, only the attention on the device)
#   --out DIR      results directory (default paper-repro/results/train; checkpoints go to DIR/runs, not committed)
#   --only LIST    comma-separated subset of teacher,table3,table6,table2, run in that order; every entry reuses
#                  the checkpoints found in DIR/runs (delete them to train again; table2 needs table6's students)
#   --seeds N      fine-tuning seeds per arm (default 3)
#   --jobs N       runs at a time (default: the number of cores; each gets cores/N OpenMP threads)
#   --teacher FILE use this checkpoint as the teacher instead of training one (copied to DIR/runs)
#   --hybrid-k K   Top-k fraction of the Table 6 hybrid (default 0.035: 2 of repro.cfg's 64 key blocks)
#   --quick        tiny config and a few steps: a smoke test in about a minute, not the committed results
#   -- KEY=VALUE   sparge-train keys applied to every run after the config (e.g. block_k=8)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
bindir= device= device_ops=1 out= only=teacher,table3,table6,table2 seeds=3 jobs=$(nproc 2>/dev/null || echo 1) quick=0
teacher_file= hybrid_k=0.035
while [ $# -gt 0 ]; do
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
    --) shift; break ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "train.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
overrides=("$@")
for kv in "${overrides[@]}"; do
    case $kv in *=*) ;; *) echo "train.sh: '$kv' after -- is not KEY=VALUE" >&2; exit 2 ;; esac
done
[ -z "$teacher_file" ] || [ -f "$teacher_file" ] || { echo "train.sh: --teacher $teacher_file: no such file" >&2; exit 2; }
case $seeds$jobs in *[!0-9]*) echo "train.sh: --seeds and --jobs take positive integers" >&2; exit 2 ;; esac
case $device_ops in 0|1) ;; *) echo "train.sh: --device-ops takes 0 or 1" >&2; exit 2 ;; esac
[ "$seeds" -ge 1 ] && [ "$jobs" -ge 1 ] || { echo "train.sh: --seeds and --jobs must be >= 1" >&2; exit 2; }

if [ -z "$bindir" ]; then
    if [ -x ./experiments/trainer/sparge-train ]; then
        bindir=$(pwd)/experiments/trainer
    else
        build=$top/build-repro
        echo "== building sparge-train in $build"
        [ -x "$top/configure" ] || (cd "$top" && autoreconf -fi)
        mkdir -p "$build"
        (cd "$build" && { [ -f Makefile ] || "$top/configure" --quiet ${CONFIGURE_FLAGS:---without-hip}; } &&
            make -j"$jobs" --no-print-directory experiments/trainer/sparge-train src/sparge)
        bindir=$build/experiments/trainer
    fi
fi
train=$bindir/sparge-train
[ -x "$train" ] || { echo "train.sh: $train not found (configure found no CBLAS? see experiments/trainer/README.md)" >&2; exit 1; }
if [ -z "$device" ]; then # CUDA by default; the quick smoke test on the CPU
    device=cpu
    sparge_cli=$bindir/../../src/sparge
    if [ "$quick" = 0 ] && [ -x "$sparge_cli" ] && "$sparge_cli" info 2>/dev/null | grep -q '^  cuda-generic:0 '; then
        device=cuda-generic:0
    fi
fi

# The experiment. Every number below is a choice of this reproduction, documented in paper-repro/README.md.
if [ "$quick" = 1 ]; then
    cfg=$top/experiments/trainer/configs/tiny.cfg
    teacher_steps=30 teacher_batch=4 ft_steps=10 eval_keys="eval_batches=1 sample_steps=2" calib_iters=6 smooth=3
    out=${out:-/tmp/sparge-train-quick}
else
    cfg=$top/experiments/trainer/configs/repro.cfg
    teacher_steps=4000 teacher_batch=8 ft_steps=300 eval_keys="eval_batches=8 sample_steps=16" calib_iters=14 smooth=25
    out=${out:-$here/results/train}
fi
target_sparsity=0.95 # Table 6: every sparse arm at this block sparsity (paper: ≈95 %)
# Table 6 hybrid (--hybrid-k): Top-k keeps 2 of repro.cfg's 64 key blocks (floor(0.035·64) = 2; the paper's
# k = 0.03 keeps 15 of Wan2.1's 512): with 1 block it would add nothing to the block Top-p always keeps, and
# the hybrid would be Top-p only. p is calibrated so that the union reaches the target.
table2_p=0.6         # Table 2: the paper's fixed Top-p
ft_keys="data=B lr=3e-4 warmup=20 steps=$ft_steps log_every=50"
runs=$out/runs
mkdir -p "$runs" "$out/logs"
cores=$(nproc 2>/dev/null || echo 1)
threads=$((cores / jobs)); [ "$threads" -ge 1 ] || threads=1
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=1 # sparge's and OpenBLAS's threads do not coordinate

commit=$(git -C "$top" rev-parse --short HEAD 2>/dev/null || echo unknown)
cpu_model=$(sed -n 's/^model name[^:]*: //p' /proc/cpuinfo 2>/dev/null | head -n1)
machine="$(uname -m), $cores cores${cpu_model:+, $cpu_model}"

# ---------------------------------------------------------------- runs

# evaluate FILE TABLE ARM SEED KEY=VALUE...: one mode=eval row of the model, prefixed with its labels.
# Every model is evaluated with the same held-out inputs (seed=0), whatever seed it was trained with.
evaluate() {
    local file=$1 table=$2 arm=$3 seed=$4
    shift 4
    # shellcheck disable=SC2086
    "$train" "$cfg" "${overrides[@]}" mode=eval device="$device" device_ops="$device_ops" seed=0 teacher="$runs/teacher.safetensors" $eval_keys "$@" \
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
        "$train" "$cfg" "${overrides[@]}" device="$device" device_ops="$device_ops" init="$runs/teacher.safetensors" teacher="$runs/teacher.safetensors" \
            $ft_keys seed="$seed" data_seed=$((100 + seed)) "$@" out="$runs/$name.part.safetensors" \
            log="$runs/$name.csv" 2>"$runs/$name.log" || { echo "train.sh: $name failed:" >&2; tail -n 5 "$runs/$name.log" >&2; return 1; }
        mv "$runs/$name.part.safetensors" "$runs/$name.safetensors"
    fi
    cp "$runs/$name.csv" "$out/logs/"
    evaluate "$runs/$name.eval.csv" "$table" "$arm" "$seed" init="$runs/$name.safetensors" "$@"
    echo "   done: $name ($(tail -n 1 "$runs/$name.log" | sed 's/.*| \([0-9.]* ms\/step\).*/\1/'))"
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

# calibrate_p MODE K: the Top-p that gives the target sparsity with the teacher (bisection; sparsity falls as p grows).
calibrate_p() {
    local mode=$1 k=$2 lo=0 hi=1 p s i
    for ((i = 0; i < calib_iters; i++)); do
        p=$(awk -v a="$lo" -v b="$hi" 'BEGIN { printf "%.6f", (a + b) / 2 }')
        "$train" "$cfg" "${overrides[@]}" mode=eval device="$device" device_ops="$device_ops" seed=0 init="$runs/teacher.safetensors" eval_batches=2 \
            sample_steps=1 attn="$mode" topk="$k" topp="$p" >"$runs/calibrate.csv" 2>/dev/null
        s=$(column_of "$runs/calibrate.csv" sparsity | tail -n 1)
        if awk -v s="$s" -v t="$target_sparsity" 'BEGIN { exit !(s > t) }'; then lo=$p; else hi=$p; fi
    done
    rm -f "$runs/calibrate.csv"
    awk -v a="$lo" -v b="$hi" 'BEGIN { printf "%.6f", (a + b) / 2 }'
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

# summary CSV TABLE COLUMNS...: one markdown row per arm of TABLE (in first-seen order): mean ± std over seeds.
summary() {
    local csv=$1 table=$2
    shift 2
    echo "| arm | seeds | $(echo "$*" | sed 's/ / | /g') |"
    echo "|---|---|$(printf -- '---|%.0s' "$@")"
    column_of "$csv" table arm "$@" | awk -F, -v table="$table" '
        $1 == table { if (!($2 in n)) order[++arms] = $2
                      n[$2]++; for (i = 3; i <= NF; i++) { s[$2, i] += $i; q[$2, i] += $i * $i }; cols = NF }
        END { for (a = 1; a <= arms; a++) {
                  arm = order[a]; line = "| " arm " | " n[arm] " |"
                  for (i = 3; i <= cols; i++) {
                      m = s[arm, i] / n[arm]
                      v = n[arm] > 1 ? (q[arm, i] - n[arm] * m * m) / (n[arm] - 1) : 0
                      line = line sprintf(n[arm] > 1 ? " %.4g ± %.2g |" : " %.4g |", m, sqrt(v > 0 ? v : 0))
                  }
                  print line } }'
}

header() { # file title claim
    {
        echo "# $2"
        echo
        echo "$3"
        echo
        echo "Generated by \`paper-repro/train.sh\` on $(date -u +%Y-%m-%d) — device \`$device\` (device_ops=$device_ops), commit \`$commit\`, $machine;"
        echo "config \`${cfg#"$top"/}\`${overrides[*]:+ with \`${overrides[*]}\`}, teacher $teacher_steps steps of batch $teacher_batch on A, fine-tuning $ft_steps steps, $seeds seed(s) per"
        echo "fine-tuned arm, every model evaluated on the same held-out A inputs ($eval_keys). Columns: paper-repro/README.md."
        echo
    } >"$1"
}

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
plot() { # script output assignments
    [ -n "$GNUPLOT" ] || return 0
    "$GNUPLOT" -e "term='$term'; out='$2'; $3" "$here/plots/$1" || echo "train.sh: gnuplot failed on $1" >&2
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

# ---------------------------------------------------------------- entries

entries=$(echo "$only" | tr ',' ' ')
for entry in $entries; do
    case $entry in teacher|table3|table6|table2) ;; *) echo "train.sh: unknown entry $entry" >&2; exit 2 ;; esac
done
t_all=$(date +%s)
for entry in teacher table3 table6 table2; do
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
            OMP_NUM_THREADS=$cores "$train" "$cfg" "${overrides[@]}" device="$device" device_ops="$device_ops" steps="$teacher_steps" \
                batch="$teacher_batch" out="$runs/teacher.part.safetensors" log="$runs/teacher.csv" \
                2> >(tee "$runs/teacher.log" >&2)
            mv "$runs/teacher.part.safetensors" "$runs/teacher.safetensors"
        fi
        evaluate "$runs/teacher.eval.csv" teacher full 0 init="$runs/teacher.safetensors" attn=dense
        [ ! -f "$runs/teacher.csv" ] || cp "$runs/teacher.csv" "$out/logs/" # none when --teacher gave the checkpoint
        ;;
    table3)
        need_teacher
        echo "== Table 3: full attention fine-tuned with the diffusion loss on mismatched B (control: on A), $seeds seeds"
        for s in $(seq 1 "$seeds"); do
            queue finetune "t3_full_B_s$s" table3 "full attention + diffusion loss on B" "$s" attn=dense loss=diffusion
            queue finetune "t3_full_A_s$s" table3 "full attention + diffusion loss on A (control)" "$s" attn=dense loss=diffusion data=A
        done
        drain
        names=(teacher)
        for s in $(seq 1 "$seeds"); do names+=("t3_full_B_s$s"); done
        for s in $(seq 1 "$seeds"); do names+=("t3_full_A_s$s"); done
        collect "${names[@]}" | sed 's/^teacher,full,/table3,teacher (no fine-tuning),/' >"$out/table3.csv"
        f=$out/table3.md
        header "$f" "Table 3 — fine-tuning full attention on mismatched data with the diffusion loss" \
            "Paper (Table 3): fine-tuning *full* attention with the diffusion loss on data unlike the pretraining data lowers the quality of the pretrained model (Wan2.1, VBench). Here: the teacher trained on A, fine-tuned on B (blurred, noisy, colour-shifted, jerky), evaluated against A; the control arm fine-tunes on A itself."
        {
            echo "Quality of Euler samples against held-out A (lower Fréchet distance, higher class accuracy, imaging quality and"
            echo "temporal consistency are better) and the velocity error to the teacher:"
            echo
            summary "$out/table3.csv" table3 frechet class_accuracy imaging_quality temporal_consistency diffusion_loss velocity_rel_l2
            echo
            echo "Sample statistics (real held-out A videos: $(column_of "$out/table3.csv" ref_sharpness ref_temporal_jitter ref_mean_c0 | sed -n 2p | sed 's/,/ \/ /g') for sharpness / jitter / channel-0 mean):"
            echo
            summary "$out/table3.csv" table3 sample_sharpness sample_temporal_jitter sample_mean_c0
        } >>"$f"
        ;;
    table6)
        need_teacher
        echo "== Table 6: sparse fine-tuning at $target_sparsity sparsity; calibrating Top-p on the teacher"
        p_topp=$(calibrate_p topp 0)
        p_hybrid=$(calibrate_p hybrid "$hybrid_k")
        k_topk=$(awk -v t="$target_sparsity" 'BEGIN { printf "%.6f", 1 - t }')
        echo "   Top-p only p = $p_topp; hybrid k = $hybrid_k, p = $p_hybrid; Top-k only k = $k_topk"
        hyb="attn=hybrid topk=$hybrid_k topp=$p_hybrid"
        evaluate "$runs/t6_training_free.eval.csv" table6 "hybrid training-free" 0 init="$runs/teacher.safetensors" $hyb
        for s in $(seq 1 "$seeds"); do
            queue finetune "t6_hybrid_vd_s$s" table6 "hybrid + L_VD" "$s" $hyb loss=vd
            queue finetune "t6_topk_vd_s$s" table6 "Top-k only + L_VD" "$s" attn=topk topk="$k_topk" loss=vd
            queue finetune "t6_topp_vd_s$s" table6 "Top-p only + L_VD" "$s" attn=topp topp="$p_topp" loss=vd
            queue finetune "t6_hybrid_diff_s$s" table6 "hybrid + diffusion loss" "$s" $hyb loss=diffusion
        done
        drain
        names=(teacher t6_training_free)
        for arm in hybrid_vd topk_vd topp_vd hybrid_diff; do
            for s in $(seq 1 "$seeds"); do names+=("t6_${arm}_s$s"); done
        done
        collect "${names[@]}" | sed 's/^teacher,full,/table6,full attention (teacher),/' >"$out/table6.csv"
        echo "topp_only_p=$p_topp hybrid_k=$hybrid_k hybrid_p=$p_hybrid topk_only_k=$k_topk" >"$out/table6_calibration.txt"
        f=$out/table6.md
        header "$f" "Table 6 — sparse fine-tuning at matched sparsity: mask rule and loss" \
            "Paper (Table 6, Wan2.1 at ≈95 % sparsity): the hybrid mask beats Top-k only and Top-p only, training-free sparse attention collapses, and velocity distillation (L_VD against the frozen full-attention teacher) beats the diffusion loss. Here every arm fine-tunes the teacher on B (the mismatched data, as in the paper) and is evaluated on held-out A; Top-p values were calibrated on the teacher so each rule starts at $target_sparsity sparsity (top-p only p = $p_topp; hybrid k = $hybrid_k, p = $p_hybrid; Top-k only k = $k_topk); the sparsity column is what each model reaches after fine-tuning."
        {
            summary "$out/table6.csv" table6 sparsity velocity_rel_l2 attention_rel_l1 frechet class_accuracy imaging_quality temporal_consistency
        } >>"$f"
        column_of "$out/table6.csv" arm velocity_rel_l2 frechet | means >"$out/table6.dat"
        plot train_table6.gp "$out/table6.png" "dat='$out/table6.dat'"
        ;;
    table2)
        need_teacher
        echo "== Table 2: Top-p at p = $table2_p before and after fine-tuning"
        names=()
        evaluate "$runs/t2_teacher.eval.csv" table2 "before: teacher (dense training)" 0 \
            init="$runs/teacher.safetensors" attn=topp topp="$table2_p"
        names+=(t2_teacher)
        for s in $(seq 1 "$seeds"); do
            for pair in "t6_hybrid_vd:after: hybrid + L_VD fine-tuning on B" "t3_full_B:after: dense fine-tuning on B (control)"; do
                run=${pair%%:*}_s$s label=${pair#*:}
                if [ -f "$runs/$run.safetensors" ]; then
                    queue evaluate "$runs/t2_$run.eval.csv" table2 "$label" "$s" init="$runs/$run.safetensors" \
                        attn=topp topp="$table2_p"
                    names+=("t2_$run")
                else
                    echo "   (no $run: run table6 and table3 first for every row)"
                fi
            done
        done
        drain
        collect "${names[@]}" >"$out/table2.csv"
        f=$out/table2.md
        header "$f" "Table 2 — Top-p sparsity and attention error at fixed p, before and after sparse fine-tuning" \
            "Paper (Table 2, p = 0.6): fine-tuning with sparse attention concentrates attention — sparsity 51.3 % → 56.9 %, attention L1 0.4901 → 0.4119. Here: the same Top-p (p = $table2_p) applied to the teacher and to the models fine-tuned in Tables 6 and 3."
        summary "$out/table2.csv" table2 sparsity attention_rel_l1 velocity_rel_l2 >>"$f"
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
