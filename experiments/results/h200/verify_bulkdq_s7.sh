#!/bin/bash
# session 7 call 1: conformance with defaults (checks 23368ad's gpu_launch_dependent), then the bulkdq checks
timeout 90 make -j16 src/sparge tests/conformance_cuda >/dev/null 2>&1 || { echo "build failed"; exit 1; }
echo "## conformance_cuda, defaults (t=${SECONDS}s)"
timeout 80 ./tests/conformance_cuda 2>&1 | grep -E "PASSED|FAILED|FAIL|error" | head -8; echo "rc=${PIPESTATUS[0]}"
BUDGET=230 bash $DEV/verify.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv

# ---- verify.sh (the bulkdq checks, run by the lines above)
#!/bin/bash
# Device check of branch bulkdq (SPARGE_CUDA_DQ_REDUCE=bulk: the wgmma dK/dV kernel's atomic dQ staged in shared
# memory and added with cp.reduce.async.bulk). Run in the GPU build dir of the branch (tests/, src/sparge):
#   bash /work/dev-tools/verify-bulkdq.sh
# Prints sections "## step (t=...s)"; every step is under `timeout`; optional steps stop when the budget runs low.
B=${BUDGET:-200}
log() { echo "## $* (t=${SECONDS}s)"; }
left() { [ $((B - SECONDS)) -gt "$1" ]; }
BULK="SPARGE_CUDA_DQ=atomic SPARGE_CUDA_DQ_REDUCE=bulk"
RED="SPARGE_CUDA_DQ=atomic SPARGE_CUDA_DQ_REDUCE=red"
S13="src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16 --ops bwd --settle 1"
small1="src/sparge bench --backend cuda --H 2 --N 1000 --Nk 777 --D 128 --sparsity dense,hybrid --reps 1 --warmup 0 --ops bwd"
small2="src/sparge bench --backend cuda --H 2 --N 700 --Nk 1000 --D 64 --dtype f16 --layout bnhd --block-k 128 --sparsity dense,hybrid --reps 1 --warmup 0 --ops bwd"

log "build"
timeout 90 make -j16 src/sparge tests/conformance_cuda >/dev/null 2>&1 || { echo "build failed"; exit 1; }

log "SPARGE_CUDA_DQ_REDUCE=bogus must be refused (SPARGE_ERR_INVALID, a clear message)"
SPARGE_CUDA_DQ_REDUCE=bogus timeout 10 $small1 2>&1 | grep -iE "DQ_REDUCE|error|invalid" | head -2

# test_grid_bulk_dq inside sets SPARGE_CUDA_DQ=atomic SPARGE_CUDA_DQ_REDUCE=bulk itself (keys 128 and 64); the
# variables are also set here so that every backward case of the binary takes the bulk path.
log "conformance_cuda with $BULK"
env $BULK timeout 75 ./tests/conformance_cuda 2>&1 | grep -E "PASSED|FAILED|FAIL|cases ran|bulk dQ|error|rel L2|reproducible" | head -14
rc=${PIPESTATUS[0]}; echo "rc=$rc $([ $rc = 0 ] && echo PASSED || echo FAILED)"

for round in 1 2 3; do
  for v in default red bulk; do
    left 12 || { echo "(budget: skipped 95 % round $round $v)"; continue; }
    log "bwd 1.3B 95 % round $round: $v"
    case $v in
      default) timeout 12 $S13 --sparsity 0.95 --reps 10 | tail -1 ;;
      red) env $RED timeout 12 $S13 --sparsity 0.95 --reps 10 | tail -1 ;;
      bulk) env $BULK timeout 12 $S13 --sparsity 0.95 --reps 10 | tail -1 ;;
    esac
  done
done

for v in red bulk; do
  left 12 || { echo "(budget: skipped dense $v)"; continue; }
  log "bwd 1.3B dense: $v"
  if [ $v = red ]; then env $RED timeout 12 $S13 --sparsity dense --reps 3 | tail -1
  else env $BULK timeout 12 $S13 --sparsity dense --reps 3 | tail -1; fi
done

for c in "$small1" "$small2"; do
  for t in memcheck racecheck synccheck; do
    left 20 || { echo "(budget: skipped $t)"; continue; }
    log "compute-sanitizer $t, $BULK: ${c#src/sparge bench --backend cuda }"
    env $BULK timeout 20 compute-sanitizer --tool $t $c 2>&1 | grep -E "SUMMARY|rror" | tail -3
  done
done
log "end"
