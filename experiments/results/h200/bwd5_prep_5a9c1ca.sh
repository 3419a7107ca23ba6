#!/bin/bash
log() { echo "## $* (t=${SECONDS}s)"; }
S13="src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16 --sparsity dense,0.95,0.97 --ops bwd --reps 5"
timeout 60 make -j16 src/sparge tests/conformance_cuda >/dev/null 2>&1 || { echo "build failed"; exit 1; }
log "bwd default"; timeout 30 $S13 | tail -3
log "bwd deterministic"; timeout 30 $S13 --deterministic | tail -3
log "bwd default again"; timeout 30 $S13 | tail -3
log "conformance"; timeout 60 ./tests/conformance_cuda 2>&1 | grep -E "PASSED|FAILED|FAIL|cases ran" | head -5
log "ncu bwd kernels 95%"; timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --sparsity 0.95 --ops bwd --reps 1 --warmup 0 2>&1 | grep -E "^  [^ ].*Context|gpu__time_duration" | sed -E 's/ +/ /g' | cut -c1-90 | tail -14
log end
