#!/bin/sh
# The GPU backends under NVIDIA's compute-sanitizer (docs/RELIABILITY.md, "GPU backends"): the conformance
# table's quick grid (`sparge check`, every case and device of the cuda backend)
# and the conformance program's particular checks, each under memcheck (out-of-bounds and misaligned accesses,
# leaks), racecheck (shared-memory hazards), initcheck (reads of uninitialised global memory) and synccheck
# (barrier misuse). A tool finding anything, or a check failing, fails the run.
#
#   tests/gpu_sanitize.sh [BUILD_DIR] [OUT_DIR]
#     BUILD_DIR  a build configured --with-cuda and built with its tests (`make check` or `make tests/conformance`)
#                (default: the current directory)
#     OUT_DIR    one log per tool and program (default: BUILD_DIR/sanitize)
#   SANITIZE_TOOLS   the tools (default "memcheck racecheck initcheck synccheck")
#   SANITIZE_CASE    `sparge check --case` filter for the grid (default: the whole quick grid)
#   SANITIZE_FULL    1: the full grid instead of the quick one (with SANITIZE_CASE, e.g. a kernel's full-grid rows)
# Needs compute-sanitizer (CUDA toolkit) on PATH or in /usr/local/cuda/bin. Exit status 1 on any finding.
set -eu
. "$(dirname "$0")/gpu_common.sh"
case ${SANITIZE_FULL:-0} in 0) grid= ;; 1) grid=--full ;; *) echo "gpu_sanitize.sh: SANITIZE_FULL is 0 or 1" >&2; exit 2 ;; esac
gpu_build gpu_sanitize.sh "${1:-.}" src/sparge tests/conformance
out=${2:-$build/sanitize}
tools=${SANITIZE_TOOLS:-"memcheck racecheck initcheck synccheck"}
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$cs" ] || { echo "gpu_sanitize.sh: compute-sanitizer not found (CUDA toolkit)" >&2; exit 2; }
mkdir -p "$out"

status=0
# run TOOL NAME COMMAND...: one program under one tool; its log is OUT/TOOL-NAME.log.
run() {
    tool=$1 name=$2
    shift 2
    log=$out/$tool-$name.log
    extra=
    [ "$tool" != memcheck ] || extra="--leak-check full"
    [ "$tool" != racecheck ] || extra="--racecheck-report hazard"
    start=$(date +%s)
    # --error-exitcode: a finding fails the run even when the program itself passes.
    if "$cs" --tool "$tool" $extra --error-exitcode 99 --print-limit 50 "$@" >"$log" 2>&1; then
        verdict=clean
    else
        verdict="FAILED (exit $?)"
        status=1
    fi
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY" "$log" | tr '\n' ' ')
    echo "$tool $name: $verdict in $(($(date +%s) - start)) s; ${summary:-no summary line}"
}

for tool in $tools; do
    if [ -n "${SANITIZE_CASE:-}" ]; then
        run "$tool" grid "$build/src/sparge" check --backend cuda $grid --case "$SANITIZE_CASE"
    else
        run "$tool" grid "$build/src/sparge" check --backend cuda $grid
    fi
    # The conformance program's particular checks (mask vectors, selection arms and exact boundaries, wide rows,
    # map tiles, the transpose); its test_grid is the full table, which the grid above samples.
    for pattern in "test_*_vectors" "test_predict_*" "test_map_tiles" "test_transpose_*"; do
        run "$tool" "conformance-$(echo "$pattern" | tr -d '*' | sed 's/^test_//; s/_$//')" \
            "$build/tests/conformance" "$pattern"
    done
done
echo "logs in $out"
exit $status
