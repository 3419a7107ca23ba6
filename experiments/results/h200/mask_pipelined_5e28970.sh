#!/bin/bash
# Quick device check of main 5e28970: pipelined mask prediction + queued bench timing.
log() { echo "## $* (t=${SECONDS}s)"; }
S13="src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16"
S14="src/sparge bench --backend cuda --H 40 --N 75600 --D 128 --dtype bf16"
make -j16 tests/conformance_cuda tests/conformance_cuda_generic tests/test_cli >/dev/null 2>&1 || { echo "test build failed"; exit 1; }
for t in conformance_cuda conformance_cuda_generic test_cli; do
  log "$t"; timeout 120 ./tests/$t 2>&1 | grep -E "vectors|PASSED|FAILED|FAIL|cases ran|rror" | head -8; echo "rc=${PIPESTATUS[0]}"
done
small="src/sparge bench --backend cuda --H 2 --N 32768 --Nk 32000 --D 64 --sparsity hybrid --ops mask --reps 1 --warmup 0"
for t in memcheck racecheck synccheck; do
  log "compute-sanitizer $t (pipelined mask, 2 groups)"; timeout 60 compute-sanitizer --tool $t $small 2>&1 | grep -E "SUMMARY|rror" | tail -2
done
log "1.3B mask/fwd, queued"; timeout 60 $S13 --sparsity 0.95,0.97,hybrid --ops mask,fwd --reps 20
log "1.3B mask/fwd, each"; timeout 60 $S13 --sparsity 0.95,hybrid --ops mask,fwd --reps 20 --timing each
log "14B mask/fwd, queued"; timeout 90 $S14 --sparsity 0.95 --ops mask,fwd --reps 5
log "14B mask/fwd, each"; timeout 90 $S14 --sparsity 0.95 --ops mask --reps 5 --timing each
log "1.3B bwd queued"; timeout 60 $S13 --sparsity dense,0.95 --ops bwd --reps 5
log end
