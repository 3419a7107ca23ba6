#!/bin/bash
# sparge-train on the H200 (trainer helper): runs in the dist build directory; logs under $OUT, most important first.
set -u
O=$OUT
E=./experiments/trainer/sparge-train
R=experiments/trainer/configs/repro.cfg
T=experiments/trainer/configs/tiny.cfg
G=cuda-generic:0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $O/gpu.txt
nproc | tee -a $O/gpu.txt
echo "== test_trainer_device"
make -j16 tests/test_trainer_device >/dev/null 2>&1
timeout 90 ./tests/test_trainer_device > $O/trainer_device.log 2>&1; echo "exit $?" >> $O/trainer_device.log
cat $O/trainer_device.log
echo "== step times (repro.cfg, batch 4, 30 steps)"
run_steps() { # name keys...
    local n=$1; shift
    timeout 60 $E $R device=$G steps=30 log_every=10 "$@" log=$O/step_$n.csv > $O/step_$n.log 2>&1
    echo "exit $?" >> $O/step_$n.log
    echo "-- $n: $*"; cat $O/step_$n.log
}
H="attn=hybrid topk=0.035 topp=0.05"
run_steps dense_ops1 device_ops=1
run_steps hybrid_ops1 device_ops=1 $H
run_steps dense_ops1_tf32 device_ops=1 tf32=1
run_steps hybrid_ops1_tf32 device_ops=1 tf32=1 $H
run_steps dense_ops0 device_ops=0
run_steps hybrid_ops0 device_ops=0 $H
echo "== memcheck (tiny.cfg, 3 steps hybrid; then 2 VD steps and an eval)"
timeout 120 compute-sanitizer --tool memcheck $E $T device=$G steps=3 log_every=1 attn=hybrid out=/tmp/m.safetensors > $O/memcheck.log 2>&1; echo "exit $?" >> $O/memcheck.log
timeout 60 compute-sanitizer --tool memcheck $E $T device=$G steps=2 log_every=1 attn=hybrid loss=vd init=/tmp/m.safetensors >> $O/memcheck.log 2>&1; echo "exit $?" >> $O/memcheck.log
timeout 60 compute-sanitizer --tool memcheck $E $T device=$G mode=eval attn=hybrid init=/tmp/m.safetensors teacher=/tmp/m.safetensors eval_batches=1 sample_steps=2 >> $O/memcheck.log 2>&1; echo "exit $?" >> $O/memcheck.log
grep -E "ERROR SUMMARY|^exit|step " $O/memcheck.log
echo "== teacher (repro.cfg, 500 steps of batch 8) and a VD hybrid step time"
timeout 90 $E $R device=$G steps=500 batch=8 log_every=100 out=/tmp/teacher.safetensors log=$O/teacher.csv > $O/teacher.log 2>&1; echo "exit $?" >> $O/teacher.log
cat $O/teacher.log
run_steps hybrid_vd_ops1 device_ops=1 attn=hybrid topk=0.035 topp=0.071 loss=vd data=B init=/tmp/teacher.safetensors
echo "== train.sh table6, one seed"
s=$(date +%s)
timeout 200 bash paper-repro/train.sh --bindir $PWD/experiments/trainer --only teacher,table6 --seeds 1 \
    --teacher /tmp/teacher.safetensors --out /tmp/t6 > $O/table6_run.log 2>&1; echo "exit $? after $(($(date +%s) - s)) s" >> $O/table6_run.log
cat $O/table6_run.log
mkdir -p $O/t6 && cp /tmp/t6/*.md /tmp/t6/*.csv /tmp/t6/*.txt $O/t6/ 2>/dev/null; cp -r /tmp/t6/logs $O/t6/ 2>/dev/null
ls /tmp/t6/runs/*.log 2>/dev/null | head -20; tail -n 2 /tmp/t6/runs/*.log 2>/dev/null | head -40
