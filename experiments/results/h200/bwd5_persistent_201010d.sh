#!/bin/bash
# Device check of branch bwd5 (backward: prep fused into the wgmma dQ pass, one order launch, persistent dK/dV CTAs).
# Run in the build dir (tests/, src/sparge):   bash /work/dev-tools/verify-bwd5.sh
# Prints sections "## name"; every step is capped, optional ones stop when the budget (s) runs low.
B=${BUDGET:-230}
log() { echo "## $* (t=${SECONDS}s)"; }
left() { [ $((B - SECONDS)) -gt "$1" ]; }
S13="src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16 --sparsity dense,0.95,0.97 --ops bwd --reps 5"
small1="src/sparge bench --backend cuda --H 2 --N 1000 --Nk 777 --D 128 --sparsity dense,hybrid --ops bwd --reps 1 --warmup 0 --deterministic"
small2="src/sparge bench --backend cuda --H 2 --N 700 --Nk 1000 --D 64 --dtype f16 --layout bnhd --block-k 128 --sparsity dense,hybrid --ops bwd --reps 1 --warmup 0 --deterministic"
timeout 60 make -j16 src/sparge tests/conformance_cuda >/dev/null 2>&1 || { echo "build failed"; exit 1; }
conf() { timeout "$1" ./tests/conformance_cuda 2>&1 | grep -E "PASSED|FAILED|FAIL|cases ran|error|rel L2|reproducible" | head -12
  rc=${PIPESTATUS[0]}; echo "rc=$rc $([ $rc = 0 ] && echo PASSED || echo FAILED)"; }

# Deterministic cases also rerun on SPARGE_CUDA_BWD_CTAS=3 (several items per CTA) and compare bitwise.
log "conformance_cuda (default hooks: persistent dK/dV CTAs)"
conf 50

log "SPARGE_CUDA_BWD_CTAS=bogus must be refused (SPARGE_ERR_INVALID, a clear message)"
SPARGE_CUDA_BWD_CTAS=bogus timeout 10 $small1 2>&1 | grep -iE "BWD_CTAS|error|invalid" | head -2

for v in "default" "SPARGE_CUDA_BWD_CTAS=items" "--deterministic"; do
  left 22 || { echo "(budget: skipped bwd 1.3B $v)"; continue; }
  log "bwd 1.3B $v"
  case $v in
    --*) timeout 20 $S13 $v | tail -4 ;;
    default) timeout 20 $S13 | tail -4 ;;
    *) env $v timeout 20 $S13 | tail -4 ;;
  esac
done

# Small shapes have fewer items than resident CTAs: SPARGE_CUDA_BWD_CTAS=3 makes every CTA walk several items.
for c in "$small1" "$small2"; do
  for t in memcheck racecheck synccheck; do
    left 22 || { echo "(budget: skipped $t)"; continue; }
    log "compute-sanitizer $t, SPARGE_CUDA_BWD_CTAS=3: ${c#src/sparge bench --backend cuda }"
    SPARGE_CUDA_BWD_CTAS=3 timeout 20 compute-sanitizer --tool $t $c 2>&1 | grep -E "SUMMARY|rror" | tail -3
  done
done

left 30 && { log "conformance_cuda, SPARGE_CUDA_BWD_CTAS=items SPARGE_CUDA_BWD_KEYS=64 (64-key dK/dV items: ragged halves of bk=128)"
  SPARGE_CUDA_BWD_CTAS=items SPARGE_CUDA_BWD_KEYS=64 conf $((B - SECONDS - 2)); }
log "end"
