#!/bin/bash
# Device check of branch sel5 (fast selection: candidates compacted into a per-warp shared list, splits only
# at differing bits; programmatic dependent launch of logits -> selection -> transpose on sm_90+).
# Run in the build dir (/tmp/sparge-build): bash /work/dev-tools/verify-sel5.sh
# Every step runs under timeout, capped to what is left of 145 s (a step with < 3 s left is skipped).
log() { echo "## $* (t=${SECONDS}s)"; }
capped() { # capped SECONDS CMD...: timeout min(SECONDS, time left)
  local want=$1 left=$((145 - SECONDS)); shift
  [ $left -lt 3 ] && { echo "(skipped: out of time)"; return 0; }
  timeout $((want < left ? want : left)) "$@"
}
B13="src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16 --sparsity 0.95,hybrid --ops mask"
B14="src/sparge bench --backend cuda --H 40 --N 75600 --D 128 --dtype bf16 --sparsity 0.95,hybrid --ops mask"
# ragged: 8 x 13 blocks (fast selection CAP 256)
small="src/sparge bench --backend cuda --H 2 --N 1000 --Nk 777 --D 128 --sparsity hybrid --ops mask --reps 1 --warmup 0"
# 32 x 1094 blocks: rows wider than 1024 (fast selection CAP 1280)
wide="src/sparge bench --backend cuda --H 2 --N 4096 --Nk 70000 --D 64 --block-k 64 --sparsity hybrid --ops mask --reps 1 --warmup 0"
# 16 x 2188 blocks: past the fast selection, the block-sort selection kernel (softmax fused), a dependent launch
sorted="src/sparge bench --backend cuda --H 1 --N 2048 --Nk 140000 --D 64 --block-k 64 --sparsity hybrid --ops mask --reps 1 --warmup 0"
capped 60 make -j16 src/sparge tests/conformance_cuda tests/conformance_cuda_generic >/dev/null 2>&1 ||
  { echo "build failed"; exit 1; }
for t in conformance_cuda conformance_cuda_generic; do
  log "$t"
  capped 40 ./tests/$t 2>&1 | grep -E "PASSED|FAILED|FAIL|error|mask vectors|differ" | head -12
  echo "rc=${PIPESTATUS[0]}"
done
log "mask 1.3B (B=1 H=12 N=32760 D=128 bf16, 95 % and hybrid), 20 reps"; capped 14 $B13 --reps 20 | tail -3
log "mask 14B (B=1 H=40 N=75600 D=128 bf16, 95 % and hybrid), 5 reps"; capped 20 $B14 --reps 5 | tail -3
for t in memcheck racecheck synccheck; do
  log "compute-sanitizer $t small"; capped 8 compute-sanitizer --tool $t $small 2>&1 | grep -E "SUMMARY|rror" | tail -2
  log "compute-sanitizer $t wide (1094 blocks/row)"
  capped 10 compute-sanitizer --tool $t $wide 2>&1 | grep -E "SUMMARY|rror" | tail -2
done
log "compute-sanitizer memcheck sorted (2188 blocks/row)"
capped 10 compute-sanitizer --tool memcheck $sorted 2>&1 | grep -E "SUMMARY|rror" | tail -2
if command -v ncu >/dev/null && [ $((145 - SECONDS)) -ge 15 ]; then
  log "ncu gpu__time_duration, 1.3B mask kernels (hybrid)"
  capped 40 ncu --clock-control none --kernel-name regex:"pool|logits|select|transpose" --launch-count 4 \
    --metrics gpu__time_duration.sum ${B13/0.95,hybrid/hybrid} --reps 1 --warmup 0 2>&1 |
    grep -E "pool_kernel|logits|select|transpose|gpu__time_duration" | cut -c1-110
fi
log "end"
