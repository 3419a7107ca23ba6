#!/bin/sh
# What CI cannot check, on a CUDA machine (docs/RELIABILITY.md, "GPU backends"): the whole conformance table on the
# cuda device against cpu-ref (`sparge check --backend cuda --full`), its gradients against finite differences
# (`--mode grad`), the shape tests on every device (tests/test_shapes), the trainer's tests where the build has it
# (its CUDA ops against the host's, and its eigen-solver: cuSOLVER's in a build without a host LAPACK), and the
# Python binding's GPU, torch.compile, CUDA-graph and FlexAttention tests (with a torch that has CUDA). tests/gpu_sanitize.sh runs the grid under
# compute-sanitizer.
#
#   tests/gpu_check.sh [BUILD_DIR] [OUT_DIR]
#     BUILD_DIR  a build configured --with-cuda and built with its tests (`make check` or `make tests/test_shapes`)
#                (default: the current directory)
#     OUT_DIR    one log per step (default: BUILD_DIR/gpu-check)
#   PY           the Python with torch and CUDA (default python3); the Python step is skipped without one
# One line per step: its verdict, time and summary. Exit status 1 if a step failed, 2 if the build cannot run it.
set -eu
src=$(cd "$(dirname "$0")/.." && pwd)
. "$src/tests/gpu_common.sh"
gpu_build gpu_check.sh "${1:-.}" src/sparge tests/test_shapes
out=${2:-$build/gpu-check}
py=${PY:-python3}
mkdir -p "$out"

status=0
# step NAME SUMMARY_PATTERN COMMAND...: runs COMMAND with its output in OUT/NAME.log; prints the verdict, the time and
# the log's last line matching SUMMARY_PATTERN.
step() {
    name=$1 pattern=$2
    shift 2
    start=$(date +%s)
    if "$@" >"$out/$name.log" 2>&1; then
        verdict=ok
    else
        verdict="FAILED (exit $?)"
        status=1
    fi
    echo "$name: $verdict in $(($(date +%s) - start)) s; $(grep -E "$pattern" "$out/$name.log" | tail -n 1)"
}

step check-full "passed, [0-9]+ failed" "$build/src/sparge" check --backend cuda --full
step check-grad "passed, [0-9]+ failed" "$build/src/sparge" check --backend cuda --mode grad
step test-shapes "PASSED|FAILED" "$build/tests/test_shapes"
if [ -x "$build/tests/test_trainer" ] && [ -x "$build/tests/test_trainer_device" ]; then
    step trainer "PASSED|FAILED" sh -c '"$1/tests/test_trainer" && exec "$1/tests/test_trainer_device"' sh "$build"
else
    echo "trainer: skipped (no tests/test_trainer: a build without sparge-train, or its tests not built)"
fi
if "$py" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
    step python "^(OK|FAILED)" sh -c 'cd "$1/python/tests" && SPARGE_BUILD_DIR=$2 PYTHONDONTWRITEBYTECODE=1 \
        exec "$3" -m unittest -v test_gpu test_compile test_interop' sh "$src" "$build" "$py"
else
    echo "python: skipped ('$py' has no torch with CUDA; PY picks the interpreter)"
fi
echo "logs in $out"
exit $status
