#!/bin/sh
# ThreadSanitizer builds of the library and the threaded tests under them (docs/RELIABILITY.md, "Threads"):
#
#  1. --disable-openmp: every thread in the process is a caller's, so TSan sees all of the library's own
#     synchronisation (and its absence). Runs tests/test_threads and the fuzz corpus replay.
#  2. with OpenMP, clang's libomp: libomp is not instrumented, so its Archer tool (loaded through
#     OMP_TOOL_LIBRARIES) tells TSan about the fork, join, barriers and locks of parallel regions; without it
#     every parallel region reports false races. No suppressions are used. Runs the same two programs and the
#     conformance tests named in TSAN_CONFORMANCE (default: all but test_grid, whose kernels the others run
#     on fewer shapes and which needs several minutes under TSan; TSAN_CONFORMANCE=all runs everything).
#
#   tests/tsan.sh            builds in $TSAN_OUT (default ./build-tsan), compiler $TSAN_CC (default clang)
# Needs clang, libclang-rt-14-dev (the TSan runtime) and libomp-14-dev (libomp and Archer). Exit status 1 if
# a build fails, a test fails or TSan reports anything.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
out=${TSAN_OUT:-$PWD/build-tsan}
cc=${TSAN_CC:-clang}
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
conformance=${TSAN_CONFORMANCE:-"test_*_vectors test_predict_* test_grad_* test_transpose_*"}
archer="$($cc -print-resource-dir)/../../libarcher.so"
if [ ! -e "$archer" ]; then
    echo "tsan.sh: no Archer library at $archer (apt-get install libomp-14-dev)" >&2
    exit 2
fi
[ -x "$root/configure" ] || (cd "$root" && autoreconf -fi >/dev/null)
programs="tests/test_threads tests/fuzz/fuzz_replay"
export TSAN_OPTIONS="halt_on_error=0 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"

# build DIR CONFIGURE-ARGS...: configure with TSan and build the library and the test programs.
build() {
    dir=$1
    shift
    mkdir -p "$dir"
    echo "== configure and build $dir ($*)"
    if ! (cd "$dir" && "$root/configure" --without-cuda --without-hip CC="$cc" CFLAGS="-fsanitize=thread -g -O1" \
              LDFLAGS=-fsanitize=thread "$@" >configure.log 2>&1); then
        tail -n 30 "$dir/configure.log"
        return 1
    fi
    sed -n 's/^  OpenMP *: /   OpenMP: /p' "$dir/configure.log"
    # shellcheck disable=SC2086
    (cd "$dir" && make -j"$jobs" libsparge.la $programs tests/conformance >make.log 2>&1) || {
        grep -E 'error|Error' "$dir/make.log" | head -n 20
        return 1
    }
}

failures=
# check NAME COMMAND...: run one program, keep going on failure.
check() {
    name=$1
    shift
    echo "== $name"
    if "$@"; then
        echo "   passed"
    else
        echo "   FAILED (exit $?)"
        failures="$failures
  $name"
    fi
}

if build "$out/no-openmp" --disable-openmp; then
    for p in $programs; do
        check "$p (no OpenMP)" "$out/no-openmp/$p"
    done
else
    failures="$failures
  build without OpenMP"
fi

if build "$out/openmp" --enable-openmp; then
    for p in $programs; do
        check "$p (OpenMP + Archer)" env OMP_TOOL_LIBRARIES="$archer" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" \
            TSAN_OPTIONS="$TSAN_OPTIONS ignore_noninstrumented_modules=1" "$out/openmp/$p"
    done
    if [ "$conformance" = all ]; then
        conformance=""
    fi
    for pattern in ${conformance:-"*"}; do
        check "tests/conformance '$pattern' (OpenMP + Archer)" env OMP_TOOL_LIBRARIES="$archer" \
            OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" TSAN_OPTIONS="$TSAN_OPTIONS ignore_noninstrumented_modules=1" \
            "$out/openmp/tests/conformance" "$pattern"
    done
else
    failures="$failures
  build with OpenMP"
fi

if [ -n "$failures" ]; then
    echo "tsan.sh: failed:$failures" >&2
    exit 1
fi
echo "tsan.sh: no race reported"
