#!/bin/bash
# sparge-train on the H200, second call (trainer helper): the batch overlap and one mask read-back per forward,
# and attn_dtype=bf16 on the tuned cuda kernels. Runs in the dist build directory; logs under $OUT.
set -u
O=$OUT
E=./experiments/trainer/sparge-train
R=experiments/trainer/configs/repro.cfg
G=cuda-generic:0
echo "== test_trainer_device"
make -j16 tests/test_trainer_device >/dev/null 2>&1
timeout 90 ./tests/test_trainer_device > $O/trainer_device.log 2>&1; echo "exit $?" >> $O/trainer_device.log
grep -E "^#|exit|PASSED|FAILED|SKIPPED" $O/trainer_device.log
run_steps() { # name device keys...
    local n=$1 dev=$2; shift 2
    timeout 60 $E $R device=$dev steps=30 log_every=10 "$@" log=$O/step_$n.csv > $O/step_$n.log 2>&1
    echo "exit $?" >> $O/step_$n.log
    echo "-- $n: $dev $*"; cat $O/step_$n.log
}
echo "== step times (repro.cfg, batch 4, 30 steps)"
H="attn=hybrid topk=0.035 topp=0.05"
run_steps dense_ops1 $G
run_steps hybrid_ops1 $G $H
echo "== head dim 64 (dim 128, 2 heads), blocks 128x64: f32 on cuda-generic vs bf16 on the tuned cuda kernels"
W="dim=128 heads=2 block_q=128 block_k=64"
HW="attn=hybrid topk=0.0625 topp=0.05"
run_steps w_dense_f32 $G $W
run_steps w_hybrid_f32 $G $W $HW
run_steps w_dense_bf16 cuda:0 $W attn_dtype=bf16
run_steps w_hybrid_bf16 cuda:0 $W $HW attn_dtype=bf16
echo "== memcheck: 2 steps of bf16 on the tuned kernels"
timeout 60 compute-sanitizer --tool memcheck $E $R device=cuda:0 $W $HW attn_dtype=bf16 steps=2 log_every=1 > $O/memcheck_bf16.log 2>&1
echo "exit $?" >> $O/memcheck_bf16.log
grep -E "ERROR SUMMARY|^exit|step " $O/memcheck_bf16.log
