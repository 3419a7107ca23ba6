#!/bin/bash
# Session 6, call 3: main (e2ff64e) against cand (main + mask5 + sel5 + dqv4), 3 interleaved rounds; then why the
# backward at 95 % reads slower inside a full `sparge bench` run than alone. Run in cand's build dir.
log() { echo "## $* (t=${SECONDS}s)"; }
clk() { nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader; }
A="--backend cuda --H 12 --N 32760 --D 128 --dtype bf16"
mkdir -p /tmp/b-main && tar -xzf $DEV/alt/main.tar.gz -C /tmp/b-main --strip-components=1 &&
  (cd /tmp/b-main && ./configure --with-cuda --with-cuda-arch=90 --without-hip >/dev/null && make -j16 src/sparge >/dev/null 2>&1) ||
  echo "main build failed"
log "main built"
for r in 1 2 3; do for b in main cand; do
  bin=src/sparge; [ $b = main ] && bin=/tmp/b-main/src/sparge
  log "round $r $b mask 0.95,hybrid reps 20"; timeout 20 $bin bench $A --sparsity 0.95,hybrid --ops mask --reps 20 | tail -2
  log "round $r $b fwd 0.95 reps 10"; timeout 20 $bin bench $A --sparsity 0.95 --ops fwd --reps 10 | tail -1
  log "round $r $b bwd 0.95 default reps 5"; timeout 20 $bin bench $A --sparsity 0.95 --ops bwd --reps 5 | tail -1
  log "round $r $b bwd dense,0.95 atomic reps 5"; SPARGE_CUDA_DQ=atomic timeout 25 $bin bench $A --sparsity dense,0.95 --ops bwd --reps 5 | tail -2
done; done
log "backward in context (cand)"; clk
for ops in bwd fwd,bwd mask,fwd,bwd; do
  log "cand --sparsity 0.95 --ops $ops"; timeout 20 src/sparge bench $A --sparsity 0.95 --ops $ops | tail -1; clk
done
log "cand --sparsity dense,0.5,0.8,0.9,0.95 --ops mask,fwd,bwd"
timeout 40 src/sparge bench $A --sparsity dense,0.5,0.8,0.9,0.95 --ops mask,fwd,bwd | tail -5; clk
log "cand --sparsity 0.5,0.95 --ops bwd"; timeout 30 src/sparge bench $A --sparsity 0.5,0.95 --ops bwd | tail -2; clk
log "cand --sparsity 0.95 --ops bwd again"; timeout 20 src/sparge bench $A --sparsity 0.95 --ops bwd | tail -1; clk
log "cand --sparsity 0.95 --ops bwd --timing each"; timeout 20 src/sparge bench $A --sparsity 0.95 --ops bwd --timing each | tail -1
log end
