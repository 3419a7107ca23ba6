#!/bin/bash
log() { echo "## $* (t=${SECONDS}s)"; }
S13="src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16"
make -j16 tests/conformance_cuda >/dev/null 2>&1 || { echo "test build failed"; exit 1; }
log "mask 1.3B"; timeout 30 $S13 --sparsity hybrid,0.95 --ops mask --reps 20 | tail -2
log "mask 14B"; timeout 40 src/sparge bench --backend cuda --H 40 --N 75600 --D 128 --dtype bf16 --sparsity hybrid,0.95 --ops mask --reps 10 | tail -2
log "ncu select"; timeout 60 ncu --clock-control none --kernel-name regex:"fast_select" --metrics gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__waves_per_multiprocessor,launch__registers_per_thread $S13 --sparsity hybrid,0.95 --ops mask --reps 1 --warmup 0 2>&1 | grep -E "fast_select|duration|waves|registers|warps_active" | cut -c1-100
log "conformance_cuda"; timeout 100 ./tests/conformance_cuda 2>&1 | grep -E "vectors|cases|finite|PASSED|FAILED|rel L2|error" | head -10; echo "rc=${PIPESTATUS[0]}"
log end
