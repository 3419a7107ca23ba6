# Sourced by gpu_check.sh and gpu_sanitize.sh (sh), not run.
#
# gpu_build NAME DIR BIN...: the build directory DIR made absolute in $build; each BIN (a path inside it) must be
# built and `sparge info` must list a cuda device, else NAME says which and the script exits 2.
gpu_build() {
    name=$1
    build=$(cd "$2" && pwd)
    shift 2
    for bin in "$@"; do
        [ -x "$build/$bin" ] || { echo "$name: $build/$bin is missing: build it first (make check)" >&2; exit 2; }
    done
    "$build/src/sparge" info | grep -q "^  cuda:" || { echo "$name: sparge info lists no cuda device" >&2; exit 2; }
}
