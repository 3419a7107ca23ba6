#!/bin/sh
# Builds the libFuzzer target tests/fuzz/fuzz_mask.c with clang against the library's sources (no OpenMP, the
# generic SIMD tier, no hwloc, AddressSanitizer + UndefinedBehaviorSanitizer) and fuzzes for SECONDS
# (default 60) from the committed corpus. Exit status 0: no violation; otherwise the crashing input is left
# in the output directory and the command that replays it is printed.
#
#   tests/fuzz/run.sh [SECONDS]
#   FUZZ_CC (default clang), FUZZ_OUT (default $TMPDIR/sparge-fuzz): compiler and output directory.
#   Extra libFuzzer flags go in FUZZ_FLAGS (e.g. FUZZ_FLAGS=-jobs=2).
set -eu
seconds=${1:-60}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${FUZZ_OUT:-${TMPDIR:-/tmp}/sparge-fuzz}
cc=${FUZZ_CC:-clang}
mkdir -p "$out/obj" "$out/include" "$out/corpus"

# The library's C sources and the generic SIMD tier's defines, as Makefile.am lists them (continuation
# lines joined): the core and the CPU backend, never a GPU source.
am() { sed -e ':a' -e '/\\$/N; s/\\\n//; ta' "$root/Makefile.am"; }
sources=$(am | awk '$1 == "libsparge_la_SOURCES" { for (i = 3; i <= NF; i++) if ($i ~ /\.c$/) print $i }')
simd=$(am | awk '$1 == "backends_cpu_libsimd_generic_la_SOURCES" { for (i = 3; i <= NF; i++) print $i }')
simd_defs=$(am | awk '$1 == "backends_cpu_libsimd_generic_la_CPPFLAGS" { for (i = 3; i <= NF; i++) if ($i ~ /^-D/) print $i }')
case "$sources" in *src/core.c*) ;; *) echo "run.sh: no library sources found in Makefile.am" >&2; exit 2 ;; esac
[ -n "$simd" ] || { echo "run.sh: no generic SIMD source found in Makefile.am" >&2; exit 2; }

# config.h as configure writes it for a build with no optional part (no OpenMP, hwloc, AVX tiers, GPUs).
version=$(sed -n 's/^AC_INIT(\[sparge\], \[\([^]]*\)\].*/\1/p' "$root/configure.ac")
printf '#define PACKAGE_VERSION "%s"\n' "${version:-unknown}" > "$out/include/config.h"

# -D_POSIX_C_SOURCE: the sources are C11 and POSIX (clock_gettime).
cflags="-std=c11 -D_POSIX_C_SOURCE=200809L -g -O1 -fno-omit-frame-pointer -Wall -Wextra -Wno-unknown-pragmas
        -fsanitize=address,undefined -fno-sanitize-recover=undefined -I$root/src -I$out/include"
objs=
for src in $sources $simd; do
    obj="$out/obj/$(echo "$src" | tr / _ | sed 's/\.c$/.o/')"
    defs=
    [ "$src" = "$simd" ] && defs=$simd_defs
    # shellcheck disable=SC2086
    $cc $cflags -fsanitize=fuzzer-no-link $defs -c "$root/$src" -o "$obj"
    objs="$objs $obj"
done
# shellcheck disable=SC2086
$cc $cflags -fsanitize=fuzzer "$here/fuzz_mask.c" $objs -lm -o "$out/fuzz_mask"
echo "run.sh: built $out/fuzz_mask from$(echo " $sources $simd" | tr '\n' ' ')"

# New inputs go to $out/corpus (the first directory), never into the committed corpus.
status=0
# shellcheck disable=SC2086
"$out/fuzz_mask" -max_total_time="$seconds" -max_len=4096 -timeout=20 -rss_limit_mb=2048 \
    -artifact_prefix="$out/" -print_final_stats=1 ${FUZZ_FLAGS:-} "$out/corpus" "$here/corpus" || status=$?
if [ "$status" -ne 0 ]; then
    echo "run.sh: the fuzzer found a violation (exit $status); replay it with" >&2
    for f in "$out"/crash-* "$out"/leak-* "$out"/timeout-* "$out"/oom-*; do
        [ -e "$f" ] && echo "  $out/fuzz_mask $f" >&2
    done
fi
exit "$status"
