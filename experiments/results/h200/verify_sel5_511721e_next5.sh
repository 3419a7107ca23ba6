#!/bin/bash
# Device check of branch next5 = main + fwd5 (persistent wgmma forward, L2 hints) + mask5 (logits/transpose
# kernels) + dqv4 (16-byte dQ reductions). Run in the build dir: bash verify-next5.sh. Budget ~420 s.
B=${BUDGET:-420}
log() { echo "## $* (t=${SECONDS}s)"; }
left() { [ $((B - SECONDS)) -gt "$1" ]; }
S13="src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16"
S14="src/sparge bench --backend cuda --H 40 --N 75600 --D 128 --dtype bf16"
small1="src/sparge bench --backend cuda --H 2 --N 1000 --Nk 777 --D 128 --sparsity dense,hybrid --reps 1 --warmup 0"
small2="src/sparge bench --backend cuda --H 2 --N 700 --Nk 1000 --D 64 --dtype f16 --layout bnhd --block-k 128 --sparsity dense,hybrid --reps 1 --warmup 0"
wide="src/sparge bench --backend cuda --H 16 --Nq 6235 --Nk 15990 --D 64 --block-q 16 --block-k 16 --sparsity hybrid --ops mask --reps 1 --warmup 0"
timeout 120 make -j16 src/sparge tests/conformance_cuda tests/conformance_cuda_generic >/dev/null 2>&1 || { echo "build failed"; exit 1; }
conf() { log "conformance_cuda $*"; env "$@" timeout 60 ./tests/conformance_cuda 2>&1 |
  grep -E "vectors|PASSED|FAILED|FAIL|cases ran|rror" | head -8; echo "rc=${PIPESTATUS[0]}"; }
conf SPARGE_CUDA_FWD_CTAS=persistent
conf SPARGE_CUDA_FWD_CTAS=3
conf SPARGE_CUDA_DQ=atomic
log "mask 1.3B"; timeout 20 $S13 --sparsity 0.95,hybrid --ops mask --reps 20 | tail -2
log "mask 14B"; timeout 30 $S14 --sparsity 0.95 --ops mask --reps 5 | tail -1
for l2 in hint plain; do for ctas in persistent items; do
  log "fwd 1.3B L2=$l2 CTAS=$ctas"; SPARGE_CUDA_FWD_L2=$l2 SPARGE_CUDA_FWD_CTAS=$ctas timeout 25 $S13 --sparsity dense,0.95,0.97 --ops fwd --reps 10 | tail -3
done; done
for v in pass atomic; do log "bwd 1.3B SPARGE_CUDA_DQ=$v"; SPARGE_CUDA_DQ=$v timeout 30 $S13 --sparsity dense,0.95 --ops bwd --reps 5 | tail -2; done
log "mask+fwd 1.3B defaults"; timeout 30 $S13 --sparsity 0.95,0.97 --ops mask,fwd --reps 20 | tail -2
for t in memcheck racecheck synccheck; do for c in "$small1" "$small2"; do
  left 30 || continue
  log "compute-sanitizer $t SPARGE_CUDA_FWD_CTAS=3 ${c#src/sparge bench --backend cuda }"
  SPARGE_CUDA_FWD_CTAS=3 timeout 30 compute-sanitizer --tool $t $c 2>&1 | grep -E "SUMMARY|rror" | tail -2
done; done
left 30 && { log "memcheck wide mask"; timeout 25 compute-sanitizer --tool memcheck $wide 2>&1 | grep -E "SUMMARY|rror" | tail -2; }
left 30 && { log "memcheck atomic dQ"; SPARGE_CUDA_DQ=atomic timeout 25 compute-sanitizer --tool memcheck $small1 --ops bwd 2>&1 | grep -E "SUMMARY|rror" | tail -2; }
left 40 && { log "conformance_cuda_generic"; timeout 60 ./tests/conformance_cuda_generic 2>&1 | grep -E "PASSED|FAILED" ; }
left 40 && { log "ncu mask kernels"; timeout 40 ncu --clock-control none --metrics gpu__time_duration.sum $S13 --sparsity 0.95 --ops mask --reps 1 --warmup 0 2>&1 | grep -E "^  [^ ].*Context|gpu__time_duration" | sed -E 's/ +/ /g' | cut -c1-90 | tail -10; }
log end
