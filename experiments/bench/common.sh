# Sourced by cpu.sh and gpu.sh (bash), not run.
#
# source_commit DIR: the commit of the source tree DIR, " (with local changes)" appended where the checkout differs
# from it; in an unpacked dist tarball, the one `make dist` wrote into its COMMIT file; else "unknown".
source_commit() {
    if git -C "$1" rev-parse --short HEAD 2>/dev/null; then
        git -C "$1" diff --quiet HEAD 2>/dev/null || echo ' (with local changes)'
    else
        cat "$1/COMMIT" 2>/dev/null || echo unknown
    fi | tr -d '\n'
}

# bench_build NAME DIR BIN...: the build directory DIR made absolute in $build; src/sparge and each BIN (a path
# inside it) must be built; python3 must be there for the tables; `sparge info` of that build goes to $info.
bench_build() {
    local name=$1 dir=$2 bin
    shift 2
    [ -d "$dir" ] || { echo "$name: no build directory $dir" >&2; exit 1; }
    build=$(cd "$dir" && pwd)
    for bin in src/sparge "$@"; do
        [ -x "$build/$bin" ] || { echo "$name: $build/$bin is missing: run make in $build first (or give --build)" >&2; exit 1; }
    done
    command -v python3 >/dev/null || { echo "$name: python3 is needed for the tables" >&2; exit 1; }
    info=$("$build/src/sparge" info) # captured: with pipefail, grep -q closing the pipe early could fail the check
}
