#!/bin/bash
# Session 6: A/B of main (e2ff64e), cand (main + mask5 + sel5 + dqv4) and sel5 (cand's mask + fwd5 persistent
# forward), all built in this call; then cand's full record with peers (as final_bbfc625.sh). Run in cand's build dir.
log() { echo "## $* (t=${SECONDS}s)"; }
A="--backend cuda --H 12 --N 32760 --D 128 --dtype bf16"
for n in main sel5; do
  mkdir -p /tmp/b-$n && tar -xzf $DEV/alt/$n.tar.gz -C /tmp/b-$n --strip-components=1 &&
  (cd /tmp/b-$n && ./configure --with-cuda --with-cuda-arch=90 --without-hip >/dev/null && make -j16 src/sparge >/dev/null 2>&1) ||
  echo "alt build $n failed"
done
log "alt builds done"
for r in 1 2; do
  for b in main cand sel5 sel5-items; do
    case $b in cand) bin=src/sparge; e=;; sel5-items) bin=/tmp/b-sel5/src/sparge; e=SPARGE_CUDA_FWD_CTAS=items;;
                *) bin=/tmp/b-$b/src/sparge; e=;; esac
    log "round $r $b fwd"; env $e timeout 25 $bin bench $A --sparsity dense,0.95,0.97 --ops fwd --reps 10 | tail -3
    [ $b = sel5-items ] && continue
    log "round $r $b mask"; timeout 20 $bin bench $A --sparsity 0.95,hybrid --ops mask --reps 20 | tail -2
    [ $b = sel5 ] && continue
    log "round $r $b bwd default"; timeout 25 $bin bench $A --sparsity dense,0.95 --ops bwd --reps 5 | tail -2
    log "round $r $b bwd atomic"; SPARGE_CUDA_DQ=atomic timeout 25 $bin bench $A --sparsity dense,0.95 --ops bwd --reps 5 | tail -2
  done
done
log "A/B end"
bash /tmp/final.sh
# ---- /tmp/final.sh (final_bbfc625.sh with "log end" renamed) ----
#!/bin/bash
# Final verification and benchmark of main for issues #3/#4 (H200). Sections "## name".
log() { echo "## $* (t=${SECONDS}s)"; }
S13="src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16"
S14="src/sparge bench --backend cuda --H 40 --N 75600 --D 128 --dtype bf16"
small1="src/sparge bench --backend cuda --H 2 --N 1000 --Nk 777 --D 128 --sparsity dense,hybrid --reps 1 --warmup 0"
small2="src/sparge bench --backend cuda --H 2 --N 700 --Nk 1000 --D 64 --dtype f16 --layout bnhd --block-k 128 --sparsity dense,hybrid --reps 1 --warmup 0"
make -j16 tests/conformance_cuda tests/conformance_cuda_generic experiments/exp_speed >/dev/null 2>&1 || { echo "test build failed"; exit 1; }
make -j16 experiments/trainer/sparge-train tests/test_trainer_device >/dev/null 2>&1
for t in conformance_cuda conformance_cuda_generic test_trainer_device; do
  log "$t"; timeout 100 ./tests/$t 2>&1 | grep -E "vectors|cases|PASSED|FAILED|SKIP|relative" | head -8; echo "rc=${PIPESTATUS[0]}"
done
for t in memcheck racecheck; do for c in "$small1" "$small2"; do
  log "compute-sanitizer $t ${c#src/sparge bench --backend cuda }"
  timeout 40 compute-sanitizer --tool $t $c 2>&1 | grep -E "SUMMARY|rror" | tail -2
done; done
log "ncu kernel times: one 1.3B Top-k 95 % mask prediction, forward and backward"
timeout 90 ncu --clock-control none --metrics gpu__time_duration.sum $S13 --sparsity 0.95 --reps 1 --warmup 0 2>&1 |
  grep -E "^  [^ ].*Context|gpu__time_duration" | sed -E 's/ +/ /g' | cut -c1-90 | tail -26
log "bench 1.3B"; timeout 100 $S13 --sparsity dense,0.5,0.8,0.9,0.95,0.97,hybrid --output $OUT/bench_13b.csv
log "bench 1.3B deterministic backward"; timeout 40 $S13 --sparsity dense,0.95,0.97 --ops bwd --deterministic --reps 5 | tail -3
log "bench 14B"; timeout 120 $S14 --sparsity dense,0.5,0.8,0.9,0.95,0.97,hybrid --ops mask,fwd --reps 5 --output $OUT/bench_14b.csv
log "exp_speed video 1.3B (hybrid 0.03/0.2 and Top-k 95 %)"
timeout 150 experiments/exp_speed --backend cuda --family video --heads 12 --dim 128 --dtype bf16 --sparsities 0.95 \
  --hybrid 0.03:0.2 --backward --reps 10 --export-masks $OUT/m13 --csv $OUT/speed_video13.csv --md $OUT/speed_video13.md --quiet
cat $OUT/speed_video13.md
log "peers forward: SDPA dense, FlexAttention on the same masks"
timeout 180 python3 experiments/peers/peer_bench.py --mask $OUT/m13-k0.03-p0.2 --mask $OUT/m13-s95.12 --reps 20 \
  --csv $OUT/peers_fwd13.csv 2>&1 | grep -v -i "deprecat\|create_block_mask("
log "peers backward: SDPA dense"
timeout 90 python3 experiments/peers/peer_bench.py --reps 10 --backward --csv $OUT/peers_bwd13.csv 2>&1 | grep -v -i deprecat
log "in-process peers (python binding): Top-k 95 %, Flex forward only"
SPARGE_BUILD_DIR=$PWD timeout 150 python3 python/examples/peer_bench.py --N 32760 --levels 0.05:0 --iters 20 \
  --no-flex-backward --csv $OUT/peer_inproc13.csv 2>&1 | grep -v -i "deprecat\|return self.create\|create_block_mask("
log "final end"
