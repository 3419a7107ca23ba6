#!/usr/bin/env bash
# The GPU tables of experiments/BENCHMARKS.md on one CUDA GPU, from a configured and built build directory:
# sparge bench at the Wan2.1-1.3B attention shape (B=1 H=12 N=32760 D=128 bf16, blocks 128x64) over sparsity
# levels, its deterministic backward and mask prediction, the Wan2.1-14B shape (H=40 N=75600); the paper's
# hybrid mask on video-like inputs (exp_speed, which exports the masks); and the PyTorch peers (SDPA,
# FlexAttention) beside sparge in one process on those masks, forward and backward. CSV files, each
# command's output and summary.md go to OUT_DIR.
set -euo pipefail

usage() {
    cat <<EOF
usage: experiments/bench/gpu.sh [--build DIR] [--gpu N] [--quick] [--no-14b] [--no-peers] [--shapes | --shapes-only]
                                [--profile] OUT_DIR

  --build DIR  a build directory configured with the CUDA backend and built (default: the current directory)
  --gpu N      the CUDA device to use (default 0)
  --quick      2 timed runs per level, no idle between operations, no Wan2.1-14B rows, no FlexAttention
               backward: a check that everything runs, not a measurement
  --no-14b     skip the Wan2.1-14B rows (they need about 4 GiB of GPU memory)
  --no-peers   skip the PyTorch peers (they need python3 with torch and CUDA; PYTHON picks the interpreter)
  --shapes     also the model shapes at the 1.3B token count: grouped K/V heads (H=32, Hkv=8) beside equal
               heads, 4 packed sequences beside a batch of 4, block-causal, head dims 96 and 256, and with
               the peers causal 95 % against FlexAttention on the same causal block mask (prediction
               included) and dense D=64, 256 against cuDNN
  --shapes-only  the model shapes of --shapes alone, without the Wan2.1 tables and their peers
  --profile    also Nsight Compute profiles (bench/profile.sh) at the 1.3B shape: forward and backward at dense
               and 95 %, and the dense D=256 forward (needs ncu; about a minute)
Writes OUT_DIR/bench-*.csv (sparge bench), OUT_DIR/speed-video.{csv,md} and OUT_DIR/masks/ (exp_speed),
OUT_DIR/peers-{forward,backward}.{csv,md} (experiments/peers/peer_bench.py), OUT_DIR/profile-*/ (--profile),
OUT_DIR/log/*.txt (each command's output) and OUT_DIR/summary.md. Exits 1 if a command failed; the others still
run.
EOF
}

invocation="experiments/bench/gpu.sh${*:+ $*}"
build=. gpu=0 quick=0 big=1 peers=1 shapes=0 wan=1 profile=0 out=
while [ $# -gt 0 ]; do
    case $1 in
    --build) [ $# -ge 2 ] || { usage >&2; exit 2; }; build=$2; shift 2 ;;
    --gpu) [ $# -ge 2 ] || { usage >&2; exit 2; }; gpu=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --no-14b) big=0; shift ;;
    --no-peers) peers=0; shift ;;
    --shapes) shapes=1; shift ;;
    --shapes-only) shapes=1 wan=0 big=0; shift ;;
    --profile) profile=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) [ -z "$out" ] || { usage >&2; exit 2; }; out=$1; shift ;;
    esac
done
[ -n "$out" ] || { usage >&2; exit 2; }
case $gpu in ''|*[!0-9]*) echo "gpu.sh: --gpu wants a device number" >&2; exit 2 ;; esac

src=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=experiments/bench/common.sh
. "$src/experiments/bench/common.sh"
bench_build gpu.sh "$build" experiments/exp_speed
sparge=$build/src/sparge exp_speed=$build/experiments/exp_speed
if ! grep -q "^  cuda:$gpu " <<<"$info"; then
    echo "gpu.sh: sparge info lists no device cuda:$gpu (configure --with-cuda, and a GPU):" >&2
    echo "$info" >&2
    exit 1
fi
py=${PYTHON:-python3} peers_note=
if [ "$peers" = 1 ] && ! "$py" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
    peers=0 peers_note="skipped: $py has no torch with CUDA"
    echo "gpu.sh: peers $peers_note" >&2
fi
[ "$peers" = 1 ] || [ -n "$peers_note" ] || peers_note="--no-peers"

backend=cuda:$gpu settle=1 warmup=() flex_bwd=()
reps=5 reps_det=10 reps_mask=20 reps_speed=10 reps_peers=20 reps_peers_bwd=5
if [ "$quick" = 1 ]; then
    settle=0 warmup=(--warmup 1) flex_bwd=(--no-flex-backward) big=0
    reps=2 reps_det=2 reps_mask=2 reps_speed=2 reps_peers=2 reps_peers_bwd=2
fi
mkdir -p "$out/log" "$out/masks"
out=$(cd "$out" && pwd)
t_all=$(date +%s)
failed=()
declare -A shown  # NAME -> the command as run, paths relative to the build, source and output directories

# run NAME COMMAND...: print progress, run COMMAND with its output on the terminal (indented) and in
# log/NAME.txt, and remember a failure instead of stopping.
run() {
    local name=$1 rc
    shift
    echo "== $name ($(date -u +%H:%M:%S)): $*"
    shown[$name]=$(printf '%s ' "$@" | sed "s#$out/##g; s#$build/##g; s#$src/##g; s/ $//")
    set +e
    "$@" 2>&1 | tee "$out/log/$name.txt" | sed 's/^/   /'
    rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" != 0 ]; then
        echo "== $name FAILED (exit $rc), output in $out/log/$name.txt"
        failed+=("$name (exit $rc)")
    fi
}

# Each sparge bench command: NAME|OPTIONS (after the backend); --settle idles before each timed operation,
# because after dense work the GPU holds its power cap for a while and would run the next level slower.
wan13=(--B 1 --H 12 --N 32760 --D 128 --dtype bf16 --settle "$settle")
wan14=(--B 1 --H 40 --N 75600 --D 128 --dtype bf16 --settle "$settle")
w=${warmup[*]:+ ${warmup[*]}}
benches=()
if [ "$wan" = 1 ]; then
    benches+=(
        "bench-1.3b|${wan13[*]} --sparsity dense,0.5,0.8,0.9,0.95,0.97,hybrid --reps $reps$w"
        "bench-1.3b-deterministic|${wan13[*]} --ops bwd --deterministic --sparsity 0.95,hybrid --reps $reps_det$w"
        "bench-1.3b-mask|${wan13[*]} --ops mask --sparsity 0.95,hybrid --reps $reps_mask$w"
    )
fi
if [ "$big" = 1 ]; then
    benches+=(
        "bench-14b|${wan14[*]} --ops mask,fwd --sparsity dense,0.5,0.8,0.9,0.95,0.97,hybrid --reps 3"
        "bench-14b-mask|${wan14[*]} --ops mask --sparsity 0.95,hybrid --reps 5"
    )
fi
if [ "$shapes" = 1 ]; then
    # The same work in each pair: grouped heads read 8 K/V heads for 32 query heads; 4 packed sequences of 8190
    # tokens against a batch of 4 (the dense level keeps every block of every sequence).
    shape=(--dtype bf16 --settle "$settle" --sparsity dense,0.95 --reps "$reps"$w)
    benches+=(
        "bench-gqa|--B 1 --H 32 --kv-heads 8 --N 32760 --D 128 ${shape[*]}"
        "bench-gqa-equal|--B 1 --H 32 --N 32760 --D 128 ${shape[*]}"
        "bench-varlen|--B 1 --H 12 --N 32760 --varlen 8190,8190,8190,8190 --D 128 ${shape[*]}"
        "bench-varlen-batch|--B 4 --H 12 --N 8190 --D 128 ${shape[*]}"
        "bench-causal|--B 1 --H 12 --N 32760 --causal --D 128 ${shape[*]}"
        "bench-d96|--B 1 --H 12 --N 32760 --D 96 ${shape[*]}"
        "bench-d256|--B 1 --H 12 --N 32760 --D 256 --ops mask,fwd ${shape[*]}"
    )
fi
for b in "${benches[@]}"; do
    name=${b%%|*} opts=${b#*|}
    # shellcheck disable=SC2086  # opts is a list of options
    run "$name" "$sparge" bench --backend "$backend" $opts --output "$out/$name.csv"
done

if [ "$wan" = 1 ]; then
    speed_opts=(--backend "$backend" --family video --heads 12 --dim 128 --dtype bf16 --sparsities 0.95 --hybrid 0.03:0.2
                --backward --reps "$reps_speed" "${warmup[@]}")
    rm -f "$out"/masks/m13-*
    run speed-video "$exp_speed" "${speed_opts[@]}" --export-masks "$out/masks/m13" --csv "$out/speed-video.csv" \
        --md "$out/speed-video.md"

    masks=() mask_names=()
    for m in "$out"/masks/m13-*.json; do
        [ -f "$m" ] || continue
        masks+=(--mask "${m%.json}")
        mask_names+=("$(basename "${m%.json}")")
    done
    peer_cmd=("$py" "$src/experiments/peers/peer_bench.py" --device "$backend" --sparge "${masks[@]}")
    if [ "$peers" = 1 ] && [ ${#masks[@]} = 0 ]; then
        peers=0 peers_note="skipped: exp_speed exported no masks"
    fi
    if [ "$peers" = 1 ]; then
        export SPARGE_BUILD_DIR=$build
        run peers-forward "${peer_cmd[@]}" --pass forward --reps "$reps_peers" "${warmup[@]}" \
            --csv "$out/peers-forward.csv" --md "$out/peers-forward.md"
        run peers-backward "${peer_cmd[@]}" --pass backward --reps "$reps_peers_bwd" "${warmup[@]}" "${flex_bwd[@]}" \
            --csv "$out/peers-backward.csv" --md "$out/peers-backward.md"
    fi
fi
if [ "$peers" = 1 ] && [ "$shapes" = 1 ]; then
    export SPARGE_BUILD_DIR=$build
    # Top-k 0.04 under the causal rule keeps about 4.6 % of the attendable blocks at this shape.
    shape_peers=("$py" "$src/experiments/peers/peer_bench.py" --device "$backend" --B 1 --H 12 --N 32760 --dtype bf16)
    run peers-causal "${shape_peers[@]}" --D 128 --causal --levels 0.04:0 --pass forward --reps "$reps_peers" \
        "${warmup[@]}" --csv "$out/peers-causal.csv" --md "$out/peers-causal.md"
    for d in 64 256; do
        run "peers-dense-d$d" "${shape_peers[@]}" --D "$d" --sparge --pass forward --reps "$reps_peers" "${warmup[@]}" \
            --csv "$out/peers-dense-d$d.csv" --md "$out/peers-dense-d$d.md"
    done
fi

if [ "$profile" = 1 ]; then
    # profile.sh runs on device 0: CUDA_VISIBLE_DEVICES makes --gpu that one.
    run profile-1.3b env CUDA_VISIBLE_DEVICES="$gpu" "$src/experiments/bench/profile.sh" --build "$build" \
        --levels dense,0.95 --ops fwd,bwd "$out/profile-1.3b"
    run profile-d256 env CUDA_VISIBLE_DEVICES="$gpu" "$src/experiments/bench/profile.sh" --build "$build" \
        --levels dense --D 256 --ops fwd "$out/profile-d256"
    for p in profile-1.3b profile-d256; do
        [ ! -f "$out/$p/summary.md" ] || sed 1d "$out/$p/summary.md" >"$out/$p.md"
    done
fi

# section TITLE NAME [NOTE...]: a Markdown section with the command NAME ran, its table, or why it is missing
section() {
    local title=$1 name=$2
    shift 2
    echo
    echo "## $title"
    echo
    if [ -n "${shown[$name]+set}" ]; then
        echo "\`${shown[$name]}\`"
        [ "${name#peers}" = "$name" ] || echo "(with SPARGE_BUILD_DIR=$build)"
        echo
    fi
    [ $# = 0 ] || printf '%s\n' "$@" ""
    if grep -qx "$name (exit [0-9]*)" < <(printf '%s\n' "${failed[@]+"${failed[@]}"}"); then
        echo "Failed: see \`log/$name.txt\`."
    elif [ -f "$out/$name.csv" ] && [ "${name#bench}" != "$name" ]; then
        python3 "$src/experiments/bench/tables.py" bench "$out/$name.csv"
    elif [ -f "$out/$name.md" ]; then
        cat "$out/$name.md"
    else
        echo "Not run${peers_note:+ ($peers_note)}."
    fi
}

gpu_name=$(nvidia-smi -i "$gpu" --query-gpu=name,driver_version,power.limit,clocks.max.sm,memory.total \
           --format=csv,noheader 2>/dev/null || echo "nvidia-smi not available")
{
    echo "# sparge on $(sed -n "s/^  cuda:$gpu  *//p" <<<"$info")"
    echo
    echo "Produced by \`$invocation\` on $(date -u '+%Y-%m-%d %H:%M UTC') in $(($(date +%s) - t_all)) s;" \
         "source commit $(source_commit "$src"), build \`$build\`."
    echo "nvidia-smi (name, driver, power limit, max SM clock, memory): $gpu_name."
    [ "$peers" = 0 ] || echo "Peers: $("$py" -c 'import torch; print("torch", torch.__version__)' 2>&1)."
    echo "Dense-equivalent TFLOP/s = 4·B·H·Nq·Nk·D / t (×2.5 for the backward); effective: the kept token pairs" \
         "only. sparge bench reports the mean of queued runs, each operation after ${settle} s idle."
    echo
    echo '```'
    "$sparge" info
    echo '```'
    if [ "$wan" = 1 ]; then
        section "Wan2.1-1.3B, forward and backward against sparsity" bench-1.3b \
            "Levels: Top-k masks at 1 − sparsity, and the paper's hybrid (k 0.03, p 0.2), which keeps ≈ 20 % of the" \
            "blocks on these random inputs."
        section "Wan2.1-1.3B, deterministic backward" bench-1.3b-deterministic
        section "Wan2.1-1.3B, mask prediction" bench-1.3b-mask
        if [ "$big" = 1 ]; then
            section "Wan2.1-14B, forward" bench-14b
            section "Wan2.1-14B, mask prediction" bench-14b-mask
        fi
        section "The paper's hybrid mask on video-like inputs" speed-video \
            "Each sparse run alternates with a dense one; the median of runs timed one at a time."
        section "Peers in one process on the exported masks, forward" peers-forward
        section "Peers in one process on the exported masks, backward" peers-backward
    fi
    if [ "$shapes" = 1 ]; then
        section "Grouped K/V heads (H=32, Hkv=8)" bench-gqa
        section "Equal heads (H=32), the same work" bench-gqa-equal
        section "Four packed sequences of 8190 tokens" bench-varlen
        section "A batch of four 8190-token sequences, the same work" bench-varlen-batch
        section "Block-causal" bench-causal "Rates count the attendable (query, key) pairs only."
        section "Head dim 96" bench-d96
        section "Head dim 256, forward" bench-d256
        section "Causal 95 % against FlexAttention on the same causal block mask" peers-causal
        section "Dense forward at D=64 against cuDNN" peers-dense-d64
        section "Dense forward at D=256 against cuDNN" peers-dense-d256
    fi
    if [ "$profile" = 1 ]; then
        section "Nsight Compute profiles, 1.3B shape" profile-1.3b "Reports: \`profile-1.3b/*.ncu-rep\`."
        section "Nsight Compute profile, dense forward at D=256" profile-d256 "Report: \`profile-d256/dense.ncu-rep\`."
    fi
    if [ ${#failed[@]} -gt 0 ]; then
        echo
        echo "## Failed commands"
        echo
        printf -- '- %s\n' "${failed[@]}"
    fi
} >"$out/summary.md"
echo "== done in $(($(date +%s) - t_all)) s: $out/summary.md"
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu.sh: failed: ${failed[*]}" >&2
    exit 1
fi
