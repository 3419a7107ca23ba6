#!/bin/bash
log() { echo "## $* (t=${SECONDS}s)"; }
make -j16 tests/conformance_cuda tests/conformance_cuda_generic >/dev/null 2>&1 || { echo "test build failed"; exit 1; }
log "conformance_cuda (default: wgmma forward, wgmma backward)"
timeout 120 ./tests/conformance_cuda 2>&1 | grep -E "vectors|cases|finite|PASSED|FAILED|rel L2|error" | head -12; echo "rc=${PIPESTATUS[0]}"
log "conformance_cuda, SPARGE_CUDA_FWD_KERNEL=mma SPARGE_CUDA_BWD_KERNEL=mma (the sm_80/sm_120 kernels)"
SPARGE_CUDA_FWD_KERNEL=mma SPARGE_CUDA_BWD_KERNEL=mma timeout 120 ./tests/conformance_cuda 2>&1 |
  grep -E "vectors|cases|finite|PASSED|FAILED|rel L2|error" | head -12; echo "rc=${PIPESTATUS[0]}"
log "conformance_cuda_generic"
timeout 120 ./tests/conformance_cuda_generic 2>&1 | grep -E "vectors|cases|finite|PASSED|FAILED|rel L2|error" | head -12; echo "rc=${PIPESTATUS[0]}"
log end
