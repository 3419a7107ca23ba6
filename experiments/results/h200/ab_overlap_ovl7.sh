#!/bin/bash
# session 7 call 2: the intra-warpgroup overlap in the wgmma forward (2 CTAs/SM: "new"; 1 CTA/SM: "one") and in the
# wgmma dK/dV pass, against the previous head 23368ad ("base"), same machine, interleaved.
log() { echo "## $* (t=${SECONDS}s)"; }
M=$PWD
build() { # dir tarball [sed]
  mkdir -p $1 && tar -xzf $2 -C $1 --strip-components=1 && cd $1 && { [ -z "${3:-}" ] || sed -i "$3" backends/cuda/forward_sm90.cu; } &&
  ./configure --with-cuda --with-cuda-arch=90 --without-hip >/dev/null && make -j6 src/sparge >/dev/null 2>&1; echo "$1 rc=$?"; }
build /tmp/base $DEV/alt/base.tar.gz > /tmp/base.log 2>&1 &
build /tmp/one $DEV/sparge-*.tar.gz 's/__launch_bounds__(THREADS, 2) wgmma_fwd_kernel/__launch_bounds__(THREADS, 1) wgmma_fwd_kernel/' > /tmp/one.log 2>&1 &
timeout 200 make -j4 tests/conformance_cuda >/dev/null 2>&1 || { echo "build failed"; exit 1; }
log "conformance_cuda (new forward and dK/dV)"
timeout 80 ./tests/conformance_cuda > /tmp/conf.txt 2>&1; rc=$?
grep -E "vectors|cases|PASSED|FAILED|FAIL|rel" /tmp/conf.txt | head -12; echo "rc=$rc"
wait; cat /tmp/base.log /tmp/one.log | tail -4
grep -c "THREADS, 1) wgmma_fwd_kernel" /tmp/one/backends/cuda/forward_sm90.cu
S="bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16 --settle 1"
for r in 1 2; do
  for v in base new one; do
    d=$M; [ $v = base ] && d=/tmp/base; [ $v = one ] && d=/tmp/one
    log "fwd+mask 95 %, hybrid: $v round $r"; timeout 30 $d/src/sparge $S --sparsity 0.95,hybrid --ops mask,fwd --reps 20 | tail -2
  done
  for v in base new; do
    d=$M; [ $v = base ] && d=/tmp/base
    log "bwd 95 %, 97 %: $v round $r"; timeout 30 $d/src/sparge $S --sparsity 0.95,0.97 --ops bwd --reps 10 | tail -2
  done
done
for v in base new one; do
  d=$M; [ $v = base ] && d=/tmp/base; [ $v = one ] && d=/tmp/one
  log "dense fwd: $v"; timeout 30 $d/src/sparge $S --sparsity dense --ops fwd --reps 3 | tail -1
done
for v in base new; do
  d=$M; [ $v = base ] && d=/tmp/base
  log "dense bwd: $v"; timeout 30 $d/src/sparge $S --sparsity dense --ops bwd --reps 3 | tail -1
done
small1="--H 2 --N 1000 --Nk 777 --D 128 --sparsity dense,hybrid --reps 1 --warmup 0"
small2="--H 2 --N 700 --Nk 1000 --D 64 --dtype f16 --layout bnhd --block-k 128 --sparsity dense,hybrid --reps 1 --warmup 0"
for c in "$small1" "$small2"; do for t in memcheck racecheck synccheck; do
  log "compute-sanitizer $t new: $c"
  timeout 30 compute-sanitizer --tool $t src/sparge bench --backend cuda $c 2>&1 | grep -E "SUMMARY|rror" | tail -2
done; done
log "ncu 95 %: new"
timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16 --sparsity 0.95 --reps 1 --warmup 0 2>&1 | grep -E "^  [^ ].*Context|gpu__time|registers|warps_active" | sed -E 's/ +/ /g' | cut -c1-90 | tail -40
log end
