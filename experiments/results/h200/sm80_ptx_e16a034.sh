#!/bin/bash
# sm_80 build (compute_80 PTX JIT-compiled for the H200): the mma.sync kernels and the mask chain without PDL.
log() { echo "## $* (t=${SECONDS}s)"; }
export CUDA_CACHE_MAXSIZE=4294967296
timeout 40 make -j16 tests/conformance_cuda >/dev/null 2>&1 || { echo "build failed"; exit 1; }
log "sparge bench small (first launch: JIT)"; timeout 60 src/sparge bench --backend cuda --H 2 --N 1000 --Nk 777 --D 128 --sparsity dense,hybrid --reps 1 --warmup 0 | tail -3
log "conformance_cuda (sm_80 PTX on sm_90)"; timeout 70 ./tests/conformance_cuda 2>&1 | grep -E "vectors|cases|PASSED|FAILED|FAIL|rror" | head -8; echo "rc=${PIPESTATUS[0]}"
log "bench 1.3B Top-k 95 %, mma.sync kernels"; timeout 25 src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16 --sparsity 0.95 --reps 5 --settle 1 | tail -1
log "memcheck small"; timeout 30 compute-sanitizer --tool memcheck src/sparge bench --backend cuda --H 2 --N 700 --Nk 1000 --D 64 --dtype f16 --layout bnhd --block-k 128 --sparsity dense,hybrid --reps 1 --warmup 0 2>&1 | grep -E "SUMMARY|rror" | tail -2
log end
