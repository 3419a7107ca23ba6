#!/bin/bash
# Device check of branch ovl6 (wgmma backward: the dK/dV pass launched as a programmatic dependent of the dQ pass,
# D_t/LSE handed over through a release/acquire counter). Run in the build dir (/tmp/sparge-build):
#   bash /work/dev-tools/verify-ovl6.sh
# Every step runs under timeout, capped to what is left of 150 s (a step with < 3 s left is skipped).
log() { echo "## $* (t=${SECONDS}s)"; }
capped() { # capped SECONDS CMD...: timeout min(SECONDS, time left)
  local want=$1 left=$((150 - SECONDS)); shift
  [ $left -lt 3 ] && { echo "(skipped: out of time)"; return 0; }
  timeout $((want < left ? want : left)) "$@"
}
S13="src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16"
small="src/sparge bench --backend cuda --H 2 --N 1000 --Nk 777 --D 128 --sparsity dense,hybrid --reps 1 --warmup 0 --ops bwd"
log "build"
capped 60 make -j16 src/sparge tests/conformance_cuda >/dev/null 2>&1 || { echo "build failed"; exit 1; }
log "conformance_cuda (overlap on, the default)"
capped 45 ./tests/conformance_cuda 2>&1 | grep -E "cases ran|PASSED|FAILED|FAIL|rror|differ|reproducible" | head -12
echo "rc=${PIPESTATUS[0]}"
log "invalid SPARGE_CUDA_BWD_OVERLAP (expect an error naming it)"
capped 10 env SPARGE_CUDA_BWD_OVERLAP=maybe $small 2>&1 | grep -i "OVERLAP" | head -2
for round in 1 2 3; do
  for ov in on off; do
    log "round $round: bwd 1.3B 95 % SPARGE_CUDA_BWD_OVERLAP=$ov, 10 reps"
    capped 15 env SPARGE_CUDA_BWD_OVERLAP=$ov $S13 --sparsity 0.95 --ops bwd --reps 10 | tail -1
  done
done
for ov in on off; do
  log "bwd 1.3B dense,97 % SPARGE_CUDA_BWD_OVERLAP=$ov, 5 reps"
  capped 15 env SPARGE_CUDA_BWD_OVERLAP=$ov $S13 --sparsity dense,0.97 --ops bwd --reps 5 | tail -2
  log "bwd 1.3B 95 % deterministic SPARGE_CUDA_BWD_OVERLAP=$ov, 5 reps"
  capped 12 env SPARGE_CUDA_BWD_OVERLAP=$ov $S13 --deterministic --sparsity 0.95 --ops bwd --reps 5 | tail -1
done
for t in memcheck racecheck; do
  log "compute-sanitizer $t small (dense, hybrid)"
  capped 20 compute-sanitizer --tool $t $small 2>&1 | grep -E "SUMMARY|rror" | tail -2
done
log "compute-sanitizer memcheck small, deterministic (dense through the wgmma dQ pass too)"
capped 20 compute-sanitizer --tool memcheck $small --deterministic 2>&1 | grep -E "SUMMARY|rror" | tail -2
log "end"
# ---- then: COMMIT=aed5dfa bash final6.sh ----
#!/bin/bash
# Session 6 record (H200): conformance decides whether the dK/dV overlap stays on, then main's record with peers.
# Run in the build dir after the branch's own verification script.
log() { echo "## $* (t=${SECONDS}s)"; }
S13="src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16"
S14="src/sparge bench --backend cuda --H 40 --N 75600 --D 128 --dtype bf16"
make -j16 tests/conformance_cuda experiments/exp_speed >/dev/null 2>&1 || { echo "build failed"; exit 1; }
log "conformance_cuda (overlap on)"
timeout 60 ./tests/conformance_cuda > /tmp/conf.txt 2>&1; rc=$?
grep -E "vectors|cases|PASSED|FAILED" /tmp/conf.txt | head -6; echo "rc=$rc"
[ $rc = 0 ] || { export SPARGE_CUDA_BWD_OVERLAP=off; echo "conformance failed: the record runs with the overlap off"; }
log "ncu kernel times: one 1.3B Top-k 95 % mask prediction, forward and backward"
timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum $S13 --sparsity 0.95 --reps 1 --warmup 0 2>&1 |
  grep -E "^  [^ ].*Context|gpu__time_duration" | sed -E 's/ +/ /g' | cut -c1-90 | tail -18
log "bench 1.3B, levels in order"; timeout 60 $S13 --sparsity dense,0.5,0.8,0.9,0.95,0.97,hybrid --output $OUT/bench_13b.csv | tail -9
log "bench 1.3B, levels in order, --settle 1"; timeout 90 $S13 --sparsity dense,0.9,0.95,0.97 --settle 1 --output $OUT/bench_13b_settle.csv | tail -5
log "backward 95 % steady state: 200 queued runs"; timeout 20 $S13 --sparsity 0.95 --ops bwd --reps 200 | tail -1
log "forward 95 % steady state: 500 queued runs"; timeout 20 $S13 --sparsity 0.95 --ops fwd --reps 500 | tail -1
log "bench 1.3B deterministic backward, --settle 1"; timeout 40 $S13 --sparsity dense,0.95,0.97 --ops bwd --deterministic --reps 5 --settle 1 | tail -3
log "bench 14B"; timeout 60 $S14 --sparsity dense,0.95,0.97 --ops mask,fwd --reps 5 --settle 1 | tail -3
log "exp_speed video 1.3B (hybrid 0.03/0.2 and Top-k 95 %)"
timeout 100 experiments/exp_speed --backend cuda --family video --heads 12 --dim 128 --dtype bf16 --sparsities 0.95 \
  --hybrid 0.03:0.2 --backward --reps 10 --export-masks /tmp/m13 --csv /tmp/speed_video13.csv --md /tmp/speed_video13.md --quiet
cat /tmp/speed_video13.md
log "peers forward: SDPA dense, FlexAttention on the same masks"
timeout 120 python3 experiments/peers/peer_bench.py --mask /tmp/m13-k0.03-p0.2 --mask /tmp/m13-s95.12 --reps 20 \
  2>&1 | grep -v -i "deprecat\|create_block_mask("
log "peers backward: SDPA dense"
timeout 60 python3 experiments/peers/peer_bench.py --reps 10 --backward 2>&1 | grep -v -i deprecat
log "in-process peers (python binding): Top-k 95 %, Flex forward only"
SPARGE_BUILD_DIR=$PWD timeout 100 python3 python/examples/peer_bench.py --N 32760 --levels 0.05:0 --iters 20 \
  --no-flex-backward --commit "${COMMIT:-unknown}" 2>&1 | grep -v -i "deprecat\|return self.create\|create_block_mask("
log end
