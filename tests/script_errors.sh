#!/bin/sh
# The paper-repro scripts (and cpu_peak, exp_speed's --export-masks and sparge-train) refuse bad invocations before
# they run anything: each `bad` line must exit with status 2, name the offending flag or value on stderr and leave
# the output directory it was given without files; `--help` prints the whole header comment and nothing of the code.
# A failed run.sh entry keeps the files of the entry's earlier run.
# Run by `make check` with SPARGE_SRCDIR and SPARGE_BUILDDIR set; by hand: tests/script_errors.sh SRCDIR BUILDDIR.
src=${1:-${SPARGE_SRCDIR:-.}}
build=${2:-${SPARGE_BUILDDIR:-.}}
if [ ! -f "$src/paper-repro/run.sh" ]; then
    echo "script_errors.sh: no paper-repro/run.sh under '$src' (pass the source directory or set SPARGE_SRCDIR)" >&2
    exit 99
fi
command -v bash >/dev/null 2>&1 || { echo "script_errors.sh: train.sh and gpu_train.sh need bash" >&2; exit 77; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/sparge-scripts-XXXXXX") || exit 99
trap 'rm -rf "$tmp"' EXIT
failed=0
count=0

fail() {
    failed=$((failed + 1))
    printf 'FAIL: %s\n' "$1"
    sed 's/^/    | /' "$tmp/err" | head -n 5
}

# bad WORD SHELL SCRIPT ARGS...: status 2, WORD in the message, nothing in $tmp/out.
bad() {
    word=$1 sh=$2 script=$3
    shift 3
    count=$((count + 1))
    rm -rf "$tmp/out"
    mkdir "$tmp/out"
    $sh "$src/paper-repro/$script" "$@" >"$tmp/stdout" 2>"$tmp/err" </dev/null
    status=$?
    what="$script $*"
    if [ "$status" -ne 2 ]; then
        fail "$what exited $status, not 2"
    elif ! grep -qF -- "$word" "$tmp/err"; then
        fail "$what exited 2 but its message does not name '$word'"
    elif [ -n "$(ls -A "$tmp/out")" ]; then
        fail "$what exited 2 but wrote $(ls -A "$tmp/out" | head -n 3 | tr '\n' ' ')"
    else
        echo "ok: $what -> 2: $(head -n 1 "$tmp/err")"
    fi
}

# help SHELL SCRIPT LAST-WORDS: --help exits 0 with the header up to its last line and no line of code.
help() {
    count=$((count + 1))
    $1 "$src/paper-repro/$2" --help >"$tmp/stdout" 2>"$tmp/err"
    status=$?
    if [ "$status" -ne 0 ]; then
        fail "$2 --help exited $status"
    elif grep -q '^set ' "$tmp/stdout"; then
        fail "$2 --help prints the script's code"
    elif ! tail -n 1 "$tmp/stdout" | grep -qF -- "$3"; then
        fail "$2 --help does not end with '$3' (cut short?)"
    else
        echo "ok: $2 --help"
    fi
}

o=$tmp/out
help sh run.sh "as they were."
bad --out sh run.sh --out
bad --bogus sh run.sh --bogus --out "$o"
bad "'bogus'" sh run.sh --only fig1,bogus --out "$o"
bad --only sh run.sh --only , --out "$o"
bad --bindir sh run.sh --bindir "$tmp/none" --out "$o"

help bash train.sh "(e.g. block_k=8)"
bad --seeds bash train.sh --out "$o" --seeds
bad --seeds bash train.sh --out "$o" --seeds 0
bad --jobs bash train.sh --out "$o" --jobs x
bad --hybrid-k bash train.sh --out "$o" --hybrid-k 2
bad --hybrid-k bash train.sh --out "$o" --hybrid-k abc
bad "'x'" bash train.sh --out "$o" --only teacher,x
bad --device-ops bash train.sh --out "$o" --device-ops 3
bad --only bash train.sh --out "$o" --only ,

help bash gpu_train.sh "one has been timed)."
bad --state bash gpu_train.sh status --state
bad --budget bash gpu_train.sh status --state "$o" --budget abc
bad --teachers bash gpu_train.sh status --state "$o" --teachers x
bad --sparsities bash gpu_train.sh status --state "$o" --sparsities 95
bad --tol bash gpu_train.sh status --state "$o" --tol foo
bad --min-steps bash gpu_train.sh status --state "$o" --min-steps 500 --max-steps 400
# a refused plan is not fixed in the state: the corrected call takes its options
count=$((count + 1))
rm -rf "$o"
bash "$src/paper-repro/gpu_train.sh" status --state "$o" --teachers x >/dev/null 2>"$tmp/err"
if bash "$src/paper-repro/gpu_train.sh" status --state "$o" --teachers 2 >"$tmp/stdout" 2>"$tmp/err" &&
    grep -q '^teachers=2$' "$o/plan.env"; then
    echo "ok: gpu_train.sh status after a refused plan takes the corrected one"
else
    fail "gpu_train.sh status after a refused --teachers x does not take --teachers 2"
fi

# the plan's order: teacher 1's calibration and discriminability come before teacher 2's training
count=$((count + 1))
rm -rf "$o"
mkdir -p "$o/t1"
: >"$o/t1/final.safetensors"
if bash "$src/paper-repro/gpu_train.sh" status --state "$o" >"$tmp/stdout" 2>"$tmp/err" &&
    grep -q '^next: prep:1:0.95 ' "$tmp/stdout"; then
    echo "ok: gpu_train.sh runs teacher 1's calibration before teacher 2"
else
    grep '^next:' "$tmp/stdout" >"$tmp/err"
    fail "gpu_train.sh status after teacher 1 does not name prep:1:0.95 next"
fi

# stage and absorb around a chunk: a teacher's training log travels as its header and last line and the run logs
# not at all; what the chunk appended comes back and is added to the full files here
count=$((count + 1))
rm -rf "$o"
mkdir -p "$o/t1" "$o/logs"
{ echo "step,loss"; for i in 1 2 3; do echo "$i,0.$i"; done; } >"$o/t1/train.csv"
echo "run 1" >"$o/logs/teacher_1.log"
echo "3,0.3" >"$o/t1/heldout.csv"
if bash "$src/paper-repro/gpu_train.sh" status --state "$o" >/dev/null 2>&1 &&
    bash "$src/paper-repro/gpu_train.sh" stage --state "$o" --to "$tmp/carry" >/dev/null 2>"$tmp/err" &&
    [ "$(cat "$tmp/carry/t1/train.csv")" = "$(printf 'step,loss\n3,0.3')" ] && [ ! -e "$tmp/carry/logs/teacher_1.log" ] &&
    cmp -s "$o/t1/heldout.csv" "$tmp/carry/t1/heldout.csv"; then
    # the chunk, as `next` leaves it: rows 4 and 5 appended, a log of its own, a new held-out line
    printf '4,0.4\n5,0.5\n' >>"$tmp/carry/t1/train.csv"
    mkdir -p "$tmp/carry/logs" "$tmp/back"
    echo "run 2" >"$tmp/carry/logs/teacher_1.log"
    echo "5,0.25" >>"$tmp/carry/t1/heldout.csv"
    (cd "$tmp/carry" && tar -czf "$tmp/back/state-small.tar.gz" t1/train.csv t1/heldout.csv logs/teacher_1.log)
    if bash "$src/paper-repro/gpu_train.sh" absorb --state "$o" --from "$tmp/back" >/dev/null 2>"$tmp/err" &&
        [ "$(cat "$o/t1/train.csv")" = "$(printf 'step,loss\n1,0.1\n2,0.2\n3,0.3\n4,0.4\n5,0.5')" ] &&
        [ "$(cat "$o/logs/teacher_1.log")" = "$(printf 'run 1\nrun 2')" ] && [ "$(tail -n 1 "$o/t1/heldout.csv")" = "5,0.25" ]; then
        echo "ok: gpu_train.sh stage sends a training log's last line, absorb appends the chunk's rows and logs"
    else
        fail "gpu_train.sh absorb did not append the chunk's training rows and log to the full ones"
    fi
else
    fail "gpu_train.sh stage did not send the training log's header and last line alone (or sent the run logs)"
fi
rm -rf "$tmp/carry" "$tmp/back"

# keep and restore: the state's files in the tree, its checkpoints in the history alone, back in a fresh clone;
# keep refuses with staged changes and moves nothing; restore of a blob the history lacks writes nothing
if command -v git >/dev/null 2>&1; then
    count=$((count + 1))
    r=$tmp/repo
    rm -rf "$r" "$tmp/clone"
    mkdir -p "$r/paper-repro"
    cp "$src/paper-repro/gpu_train.sh" "$src/paper-repro/claims.sh" "$r/paper-repro/" # keep needs no .gitignore
    g() { git -C "$r" -c user.name=test -c user.email=test@localhost "$@"; }
    g init -q && g add -A && g commit -q -m base
    st=$r/paper-repro/gpu-state
    mkdir -p "$st/t1" "$st/logs"
    head -c 70000 /dev/urandom >"$st/t1/state.safetensors"
    echo "100,0.5" >"$st/t1/heldout.csv"
    echo "run 1" >"$st/logs/teacher_1.log"
    cp "$st/t1/state.safetensors" "$tmp/ckpt"
    # the committer's identity for keep's commits
    export GIT_AUTHOR_NAME=test GIT_AUTHOR_EMAIL=test@localhost GIT_COMMITTER_NAME=test GIT_COMMITTER_EMAIL=test@localhost
    if bash "$r/paper-repro/gpu_train.sh" keep --state "$st" >"$tmp/stdout" 2>"$tmp/err" &&
        [ "$(g rev-list --count HEAD)" = 3 ] &&
        [ "$(g ls-tree -r --name-only HEAD~1 -- paper-repro/gpu-state)" = paper-repro/gpu-state/t1/state.safetensors ] &&
        g ls-tree -r --name-only HEAD -- paper-repro/gpu-state | grep -qx paper-repro/gpu-state/t1/heldout.csv &&
        ! g ls-tree -r --name-only HEAD | grep -q 'safetensors\|logs/' &&
        [ -z "$(g status --porcelain --untracked-files=no)" ] &&
        git clone -q "$r" "$tmp/clone" && [ ! -e "$tmp/clone/paper-repro/gpu-state/t1/state.safetensors" ] &&
        bash "$tmp/clone/paper-repro/gpu_train.sh" restore --state "$tmp/clone/paper-repro/gpu-state" >/dev/null 2>>"$tmp/err" &&
        cmp -s "$tmp/ckpt" "$tmp/clone/paper-repro/gpu-state/t1/state.safetensors"; then
        echo "ok: gpu_train.sh keep commits the state and its checkpoints; restore takes them back in a fresh clone"
    else
        fail "gpu_train.sh keep then restore in a fresh clone did not give back the state and its checkpoint"
    fi
    # nothing new: no commit; a teacher's final weights replace its training state in checkpoints.txt
    count=$((count + 1))
    rm -f "$st/t1/state.safetensors"
    head -c 50000 /dev/urandom >"$st/t1/final.safetensors"
    if bash "$r/paper-repro/gpu_train.sh" keep --state "$st" >/dev/null 2>"$tmp/err" &&
        bash "$r/paper-repro/gpu_train.sh" keep --state "$st" >"$tmp/stdout" 2>>"$tmp/err" &&
        grep -q "nothing new" "$tmp/stdout" && [ "$(g rev-list --count HEAD)" = 5 ] &&
        [ "$(grep -vc '^#' "$st/checkpoints.txt")" = 1 ] && grep -q '^t1/final.safetensors ' "$st/checkpoints.txt"; then
        echo "ok: gpu_train.sh keep follows the state's checkpoints and commits nothing when nothing changed"
    else
        fail "gpu_train.sh keep did not replace the training state by the final weights (or committed nothing new)"
    fi
    head=$(g rev-parse HEAD)
    echo "x" >"$r/other" && g add other
    echo "200,0.4" >>"$st/t1/heldout.csv"
    count=$((count + 1))
    bash "$r/paper-repro/gpu_train.sh" keep --state "$st" >/dev/null 2>"$tmp/err"
    status=$?
    if [ "$status" = 2 ] && grep -q "staged" "$tmp/err" && [ "$(g rev-parse HEAD)" = "$head" ]; then
        echo "ok: gpu_train.sh keep with staged changes -> 2: $(head -n 1 "$tmp/err")"
    else
        fail "gpu_train.sh keep with staged changes exited $status or moved HEAD"
    fi
    g reset -q
    count=$((count + 1))
    cl=$tmp/clone/paper-repro/gpu-state
    rm -f "$cl/t1/state.safetensors"
    sed -i 's/ [0-9a-f]*$/ 0000000000000000000000000000000000000001/' "$cl/checkpoints.txt"
    bash "$tmp/clone/paper-repro/gpu_train.sh" restore --state "$cl" >/dev/null 2>"$tmp/err"
    status=$?
    if [ "$status" = 1 ] && grep -q "not in this checkout's history" "$tmp/err" && [ -z "$(ls "$cl/t1" | grep safetensors)" ]; then
        echo "ok: gpu_train.sh restore of a blob the history lacks -> 1 and writes nothing"
    else
        fail "gpu_train.sh restore of a missing blob exited $status or wrote a file"
    fi
    rm -rf "$r" "$tmp/clone" "$tmp/ckpt"
fi

# gpu_train.sh tables works at any time: here with one teacher's first held-out loss and nothing else done
if [ -x "$build/experiments/exp_stats" ]; then
    count=$((count + 1))
    rm -rf "$o"
    mkdir -p "$o/state/t1"
    echo "1000,0.5" >"$o/state/t1/heldout.csv"
    if GPU_TRAIN_BINDIR=$build/experiments bash "$src/paper-repro/gpu_train.sh" tables --state "$o/state" \
        --out "$o/res" >"$tmp/stdout" 2>"$tmp/err"; then
        echo "ok: gpu_train.sh tables before the teachers are done"
    else
        fail "gpu_train.sh tables before the teachers are done exited $?"
    fi
fi

# train.sh --tables-only: a table whose statistics fail (here a CSV without a column its claims use) leaves the
# table's Markdown as it was
if [ -x "$build/experiments/exp_stats" ] && [ -f "$src/paper-repro/results/train/table6.csv" ]; then
    count=$((count + 1))
    rm -rf "$o"
    mkdir -p "$o"
    cp "$src/paper-repro/results/train/table6.csv" "$src/paper-repro/results/train/table6.md" \
        "$src/paper-repro/results/train/table6_calibration.txt" "$o/"
    chmod u+w "$o"/*
    cp "$o/table6.md" "$tmp/before.md"
    sed '1s/,frechet,/,frechet_renamed,/' "$src/paper-repro/results/train/table6.csv" >"$o/table6.csv"
    if ! (cd "$build" && bash "$src/paper-repro/train.sh" --tables-only --only table6 --out "$o") >/dev/null 2>&1 &&
        cmp -s "$o/table6.md" "$tmp/before.md" && [ -z "$(ls "$o" | grep '\.part')" ]; then
        echo "ok: train.sh --tables-only keeps table6.md when its statistics fail"
    else
        fail "train.sh --tables-only: a failed table6 changed table6.md or left a partial file"
    fi
fi

# run.sh: an entry whose driver fails leaves the entry's earlier Markdown as it was, and no partial file
if [ -x "$build/experiments/exp_table1" ]; then
    count=$((count + 1))
    rm -rf "$o"
    if sh "$src/paper-repro/run.sh" --quick --only table1 --bindir "$build/experiments" --out "$o" >/dev/null 2>&1 &&
        cp "$o/table1.md" "$tmp/before.md" &&
        ! sh "$src/paper-repro/run.sh" --quick --only table1 --bindir "$build/experiments" --out "$o" -- --dtype f64 \
            >/dev/null 2>"$tmp/err" &&
        cmp -s "$o/table1.md" "$tmp/before.md" && [ -z "$(ls "$o" | grep '\.part')" ]; then
        echo "ok: run.sh keeps table1.md when the entry fails"
    else
        fail "run.sh: a failed table1 entry changed table1.md or left a partial file"
    fi
fi

# experiments/cpu_peak: its one argument is a number of seconds in (0, 60] (inf used to run for ever)
peak=$build/experiments/cpu_peak
if [ -x "$peak" ]; then
    if command -v timeout >/dev/null 2>&1; then to="timeout 30"; else to=; fi
    for a in 1e400 abc 5x 0; do
        count=$((count + 1))
        $to "$peak" "$a" >/dev/null 2>"$tmp/err"
        status=$?
        if [ "$status" -eq 2 ] && grep -qF "'$a'" "$tmp/err"; then
            echo "ok: cpu_peak $a -> 2: $(head -n 1 "$tmp/err")"
        else
            fail "cpu_peak $a exited $status, not 2 with '$a' named"
        fi
    done
    count=$((count + 1))
    if "$peak" --help >"$tmp/stdout" 2>"$tmp/err" && grep -q '^usage' "$tmp/stdout"; then
        echo "ok: cpu_peak --help"
    else
        fail "cpu_peak --help does not exit 0 with its usage"
    fi
fi

# exp_speed: an --export-masks prefix that cannot be written is refused before the timings
speed=$build/experiments/exp_speed
if [ -x "$speed" ]; then
    count=$((count + 1))
    "$speed" --quiet --tokens 1024 --heads 1 --reps 1 --warmup 0 --export-masks "$tmp/none/m" >"$tmp/stdout" 2>"$tmp/err"
    status=$?
    if [ "$status" -eq 2 ] && grep -qF -- --export-masks "$tmp/err" && [ ! -s "$tmp/stdout" ]; then
        echo "ok: exp_speed --export-masks $tmp/none/m -> 2: $(head -n 1 "$tmp/err")"
    else
        fail "exp_speed --export-masks into a missing directory exited $status (not 2) or timed first"
    fi
fi

# sparge-train (built with a CBLAS): --help lists every key; a bad key or value is refused with status 2, an out= that
# cannot be written with status 1 before the first step
train=$build/experiments/trainer/sparge-train
if [ -x "$train" ]; then
    count=$((count + 1))
    if "$train" --help >"$tmp/stdout" 2>"$tmp/err" && grep -q 'dump_times=0.1,0.5,0.9' "$tmp/stdout" &&
        grep -q ' time_limit=0 ' "$tmp/stdout"; then
        echo "ok: sparge-train --help"
    else
        fail "sparge-train --help does not list the keys with their defaults"
    fi
    # train_case STATUS WORD ARGS...: sparge-train ARGS exits STATUS naming WORD, before any step
    train_case() {
        want=$1 word=$2
        shift 2
        count=$((count + 1))
        "$train" "$@" >/dev/null 2>"$tmp/err"
        status=$?
        if [ "$status" -eq "$want" ] && grep -qF -- "$word" "$tmp/err" && ! grep -q '^step ' "$tmp/err"; then
            echo "ok: sparge-train $* -> $status: $(tail -n 1 "$tmp/err")"
        else
            fail "sparge-train $* exited $status (not $want), or ran steps, or did not name '$word'"
        fi
    }
    train_case 2 seed=-1 seed=-1
    train_case 2 bogus bogus=1
    train_case 2 "No such file" "$tmp/none.cfg"
    train_case 2 device_ops device_ops=2
    train_case 2 init= mode=eval
    train_case 1 "out=$tmp/none/x.safetensors" steps=50 "out=$tmp/none/x.safetensors"
fi

# experiments/bench/compare.sh: bad variants and options are refused with status 2; two variants of the CPU
# backend over two rounds give one table line per level with both rounds' times and the ratio of the medians
cmp=$src/experiments/bench/compare.sh
sparge=$build/src/sparge
if [ -x "$sparge" ] && command -v python3 >/dev/null 2>&1; then
    cmp_bad() { # WORD ARGS...
        word=$1
        shift
        count=$((count + 1))
        bash "$cmp" "$@" >/dev/null 2>"$tmp/err"
        status=$?
        if [ "$status" -eq 2 ] && grep -qF -- "$word" "$tmp/err"; then
            echo "ok: compare.sh $* -> 2: $(head -n 1 "$tmp/err")"
        else
            fail "compare.sh $* exited $status (not 2) or did not name '$word'"
        fi
    }
    cmp_bad --rounds --rounds 0 -- -- "a=$sparge"
    cmp_bad --ops --ops both -- -- "a=$sparge"
    cmp_bad "'nolabel'" -- -- nolabel
    cmp_bad "'$tmp/none'" -- -- "a=$tmp/none"
    cmp_bad "'simd'" -- -- "a=$sparge,simd"
    cmp_bad "given twice" -- -- "a=$sparge" "a=$sparge"
    cmp_bad --option -- --option simd=avx2 -- "a=$sparge"
    count=$((count + 1))
    if bash "$cmp" --rounds 2 --csv "$tmp/cmp.csv" -- --backend cpu --B 1 --H 1 --N 300 --D 32 --dtype f32 \
        --sparsity dense,0.9 --reps 1 --warmup 0 -- "auto=$sparge" "generic=$sparge,simd=generic" >"$tmp/stdout" 2>"$tmp/err" &&
        grep -q '^| level | sparsity | auto, ms | generic, ms | generic / auto |$' "$tmp/stdout" &&
        [ "$(grep -cE '^\| (dense|0\.9) \| [0-9.]+ % \| [0-9.]+, [0-9.]+ \| [0-9.]+, [0-9.]+ \| [0-9.]+ \|$' "$tmp/stdout")" -eq 2 ] &&
        [ "$(wc -l <"$tmp/cmp.csv")" -eq 9 ]; then
        echo "ok: compare.sh, two variants over two rounds"
    else
        fail "compare.sh on the CPU backend: no table of both levels and rounds (or the CSV lacks rows)"
        sed 's/^/    | /' "$tmp/stdout" | head -n 6
    fi
fi

echo "$((count - failed)) of $count checks passed"
[ "$failed" -eq 0 ]
