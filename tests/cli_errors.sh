#!/bin/sh
# The sparge tool refuses bad invocations (docs/RELIABILITY.md, "Command line"): each `bad` line must exit
# with an error status (1..125: not 0, not a signal, not a time-out), name the offending flag or value on
# stderr and print no row of NaN; each `good` line must exit 0. Run by `make check` with SPARGE set to the
# built tool; by hand: tests/cli_errors.sh [path/to/sparge].
sparge=${1:-${SPARGE:-./src/sparge}}
if [ ! -x "$sparge" ]; then
    echo "cli_errors.sh: no sparge tool at '$sparge' (pass its path or set SPARGE)" >&2
    exit 99
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/sparge-cli-XXXXXX") || exit 99
trap 'rm -rf "$tmp"' EXIT
limit=120
if command -v timeout >/dev/null 2>&1; then to="timeout $limit"; else to=; fi
failed=0
count=0

# Run the tool on "$@" with the time limit; sets $status, output in $tmp/out and $tmp/err.
run() {
    # shellcheck disable=SC2086
    $to "$sparge" "$@" >"$tmp/out" 2>"$tmp/err" </dev/null
    status=$?
}

report() {
    printf '%s\n' "$1"
    sed 's/^/    | /' "$tmp/err" | head -n 5
}

# bad WORD ARGS...: refused, and WORD (the flag or value at fault) appears in the error message.
bad() {
    word=$1
    shift
    count=$((count + 1))
    run "$@"
    what="sparge $*"
    if [ "$status" -eq 0 ]; then
        failed=$((failed + 1))
        report "FAIL: $what exited 0"
    elif [ "$status" -gt 125 ]; then
        failed=$((failed + 1))
        report "FAIL: $what ended with status $status (a signal or the ${limit}s time limit), not an error exit"
    elif ! grep -qF -- "$word" "$tmp/err"; then
        failed=$((failed + 1))
        report "FAIL: $what exited $status but its message does not name '$word'"
    elif grep -qiw 'nan' "$tmp/out"; then
        failed=$((failed + 1))
        report "FAIL: $what exited $status but printed NaN results first"
    else
        echo "ok: $what -> $status: $(head -n 1 "$tmp/err")"
    fi
}

# good ARGS...: accepted.
good() {
    count=$((count + 1))
    run "$@"
    if [ "$status" -ne 0 ]; then
        failed=$((failed + 1))
        report "FAIL: sparge $* exited $status"
    else
        echo "ok: sparge $* -> 0"
    fi
}

small="--backend cpu --B 1 --H 1 --N 64 --D 16 --reps 1 --warmup 0"

# ---- sparge bench: sizes
bad --N bench $small --N 99999999999999999999
bad --N bench $small --N 0
bad --N bench $small --N -5
bad --N bench $small --N 12abc
bad --N bench $small --N
bad --Nq bench $small --Nq 2147483648
bad --Nk bench $small --Nk -2
bad --B bench $small --B 0
bad --B bench $small --B 1e3
bad --H bench $small --H -1
bad --D bench $small --D 0
bad 300 bench $small --D 300
bad --block-q bench $small --block-q 4294967424
bad --block-k bench $small --block-k 0
# ---- sparge bench: grouped heads, causal, packed sequences (--N 64)
bad --kv-heads bench $small --kv-heads 0
bad --kv-heads bench $small --H 2 --kv-heads 3
bad --causal bench $small --Nk 32 --causal
bad --varlen bench $small --varlen 32,30
bad --varlen bench $small --varlen 32,x
bad --varlen bench $small --varlen -1,65
bad --varlen bench $small --varlen 32,32,
bad --varlen bench $small --varlen ''
bad --varlen bench $small --varlen 0000000000000000000000000000064xyz
bad --varlen bench $small --B 2 --varlen 32,32
bad --varlen bench $small --Nk 80 --varlen 32,32
# ---- sparge bench: mask parameters and levels
bad --topk bench $small --topk 2
bad --topp bench $small --topp nan
bad --sparsity bench $small --sparsity ''
bad 1.5 bench $small --sparsity 1.5
bad zzz bench $small --sparsity 0.5,zzz
bad zzz bench $small --sparsity dense,zzz
bad "''" bench $small --sparsity ,
bad "''" bench $small --sparsity dense,,0.5
bad "32 levels" bench $small --sparsity 0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5,0.5
bad --topk bench $small --sparsity hybrid --topk 0 --topp 0
# ---- sparge bench: words
bad foo bench $small --ops foo
bad --ops bench $small --ops ''
bad f64 bench $small --dtype f64
bad xyz bench $small --layout xyz
bad sometimes bench $small --timing sometimes
bad tpu bench $small --backend tpu
bad cpu:7 bench $small --backend cpu:7
# ---- sparge bench: counts, times, options
bad --reps bench $small --reps 0
bad --warmup bench $small --warmup -1
bad --seed bench $small --seed x
bad --settle bench $small --settle -1
bad --option bench $small --option noequals
bad nosuch bench $small --option nosuch=1
bad sse9 bench $small --option simd=sse9
bad --bogus bench $small --bogus
bad /nonexistent-dir bench $small --sparsity 0.5 --output /nonexistent-dir/out.csv
bad --export-mask bench $small --sparsity dense --export-mask "$tmp/mask"
# ---- sparge check and info
bad foo check --backend foo
bad --bogus check --bogus
bad --backend check --backend
bad --bogus info --bogus
# ---- the command
bad frobnicate frobnicate
bad usage

# ---- accepted
good --help
good info
good info --help
good bench --help
good check --help
good bench $small --sparsity dense,0.5
good bench --backend cpu-ref --B 1 --H 2 --N 40 --Nk 72 --D 8 --dtype bf16 --layout bnhd --ops mask,fwd \
    --sparsity hybrid,0.5 --reps 1 --warmup 0 --option strict=on
good bench $small --H 2 --kv-heads 1 --causal --varlen 1,20,43 --sparsity dense,0.5 --deterministic \
    --output "$tmp/run.json" --export-mask "$tmp/mask"
good bench $small --causal --varlen 0,30,0,34,0 --sparsity dense,0.5
good bench --backend=cpu --N=50 --D=8 --block-q=16 --block-k=8 --timing=each --reps=1 --warmup=0 --fallback \
    --option simd=generic --deterministic --sparsity 0.25 --output "$tmp/run.csv"

echo "cli_errors.sh: $count invocations, $failed failed"
[ "$failed" -eq 0 ]
