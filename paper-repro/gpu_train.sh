#!/usr/bin/env bash
# The training tables at GPU scale (experiments/trainer/configs/gpu.cfg: 4096 tokens, width 256, 4 heads of dim 64,
# depth 8, a 64 × 256 block map per head), resumable in chunks of at most ~9 minutes on a lent GPU machine that keeps
# nothing between runs (paper-repro/README.md, "GPU-scale runs"). The plan, in order:
#   1. teachers 1..T (dense, diffusion loss on rich-scene A), each trained in chunks until its held-out loss stops
#      falling (less than --tol relative improvement over the last --window steps, after --min-steps; at most
#      --max-steps); bit-for-bit across chunks (AdamW moments and step in the checkpoint, batches a function of
#      the step); teacher 1's calibration and exp_discrim at the first sparsity (step 3's) before teacher 2;
#   2. an untrained model (the null model of the sanity checks);
#   3. per sparsity (the first of --sparsities first), per teacher: its evaluation, Table 2's "before" rows, Top-p and
#      hybrid p calibrated on it, the training-free hybrid; at the first sparsity its Q/K/V dump and exp_discrim;
#      then per seed the Table 6 arms (hybrid, Top-k only, Top-p only with L_VD; at the first sparsity also the
#      hybrid with the diffusion loss), each fine-tuned on B and evaluated (the hybrid's Table 2 rows too); after
#      the first sparsity the dense fine-tunings on B and on A (Tables 3 and 2's control).
#
#   gpu_train.sh status --state DIR                 what is done, what comes next, what the next chunk needs
#   gpu_train.sh stage  --state DIR [--to DIR]      (here) copy what the next chunk needs into the folder `run`
#                                                   carries (default paper-repro/.gpu-carry) and print the command
#   gpu_train.sh next   --state DIR [--out DIR] [--budget S]
#                                                   (on the GPU machine) build if needed, run jobs for at most S
#                                                   seconds (default 540) from the start, copy what changed to DIR
#   gpu_train.sh absorb --state DIR --from DIR      (here) take a chunk's files back into the state
#   gpu_train.sh keep   --state DIR                 (here) commit the state to the checkout holding it: its small
#                                                   files in the tree, its checkpoints in the history alone (one
#                                                   commit adds them, the next removes them; DIR/checkpoints.txt
#                                                   names their blobs), so that a fresh clone can resume the plan
#   gpu_train.sh restore --state DIR                (here) take the kept checkpoints back out of the history
#                                                   (stage does it by itself)
#   gpu_train.sh tables --state DIR [--out DIR]     (here) tables, statistics and plots of what is done
#                                                   (default paper-repro/results/gpu), with the drivers of
#                                                   GPU_TRAIN_BINDIR, the build directory it runs in, or build-repro/
# Plan options, fixed at the first command on a state (DIR/plan.env): --teachers N (3) --seeds N (3)
#   --sparsities LIST (0.95,0.9,0.8) --ft-steps N (1000) --min-steps N (8000) --max-steps N (30000)
#   --window N (4000) --tol X (0.01)
# A rehearsal on the CPU (paper-repro/README.md) replaces the machine's parts through the environment:
#   GPU_TRAIN_CONFIG (gpu.cfg), GPU_TRAIN_DEVICE (cuda:0), GPU_TRAIN_BINDIR (a build's experiments/ folder:
#   no build), GPU_TRAIN_CONFIGURE_FLAGS (the build's configure flags), GPU_TRAIN_EVAL_KEYS, GPU_TRAIN_HELDOUT_KEYS, GPU_TRAIN_FT_KEYS (the sparge-train keys of evaluations,
#   held-out losses and fine-tunings), GPU_TRAIN_GUESS (seconds: the first estimate of every kind of job, before
#   one has been timed).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/.." && pwd)
cfg=${GPU_TRAIN_CONFIG:-$top/experiments/trainer/configs/gpu.cfg}
gpu_device=${GPU_TRAIN_DEVICE:-cuda:0}
cmd=${1:-}
[ $# -gt 0 ] && shift
state='' to=$here/.gpu-carry out='' budget=540 from=''
declare -A plan_opt=()
while [ $# -gt 0 ]; do
    case $1 in
    --state|--to|--out|--budget|--from|--teachers|--seeds|--sparsities|--ft-steps|--min-steps|--max-steps|\
        --window|--tol)
        [ $# -ge 2 ] || { echo "gpu_train.sh: $1 needs a value (see --help)" >&2; exit 2; } ;;
    esac
    case $1 in
    --state) state=$2; shift 2 ;;
    --to) to=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --from) from=$2; shift 2 ;;
    --teachers|--seeds|--sparsities|--ft-steps|--min-steps|--max-steps|--window|--tol) plan_opt[${1#--}]=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
    *) echo "gpu_train.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case $cmd in status|stage|next|absorb|keep|restore|tables) ;; -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
*) echo "gpu_train.sh: the first argument is status, stage, next, absorb, keep, restore or tables (see --help)" >&2
   exit 2 ;;
esac
[ -n "$state" ] || { echo "gpu_train.sh: --state DIR is needed" >&2; exit 2; }
case $budget in '' | *[!0-9]*) echo "gpu_train.sh: --budget takes whole seconds, not '$budget'" >&2; exit 2 ;; esac
# plan_error NAME VALUE: what is wrong with a value of plan option NAME, or nothing
plan_error() {
    case $1 in
    teachers|seeds|ft-steps|min-steps|max-steps|window)
        case $2 in '' | *[!0-9]* | 0*) echo "a whole number >= 1" ;; esac ;;
    tol) awk -v x="$2" 'BEGIN { exit !(x ~ /^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$/ && x + 0 > 0) }' ||
        echo "a number > 0" ;;
    sparsities)
        awk -v l="$2" 'BEGIN { n = split(l, s, ","); if (!n) exit 1
                               for (i = 1; i <= n; i++)
                                   if (!(s[i] ~ /^(0?\.[0-9]+|0)$/ && s[i] + 0 > 0 && s[i] + 0 < 1)) exit 1 }' ||
            echo "comma-separated block sparsities in (0, 1), e.g. 0.95,0.9" ;;
    esac
}
for k in "${!plan_opt[@]}"; do
    why=$(plan_error "$k" "${plan_opt[$k]}")
    [ -z "$why" ] || { echo "gpu_train.sh: --$k takes $why, not '${plan_opt[$k]}'" >&2; exit 2; }
done
if [ "${plan_opt[min-steps]:-8000}" -gt "${plan_opt[max-steps]:-30000}" ]; then
    echo "gpu_train.sh: --min-steps ${plan_opt[min-steps]:-8000} is above --max-steps ${plan_opt[max-steps]:-30000}" >&2
    exit 2
fi
mkdir -p "$state"
state=$(cd "$state" && pwd)
# shellcheck source=paper-repro/claims.sh
. "$here/claims.sh"

# ---------------------------------------------------------------- the plan

if [ ! -f "$state/plan.env" ]; then
    {
        echo "teachers=${plan_opt[teachers]:-3}"
        echo "seeds=${plan_opt[seeds]:-3}"
        echo "sparsities=${plan_opt[sparsities]:-0.95,0.9,0.8}"
        echo "ft_steps=${plan_opt[ft-steps]:-1000}"
        echo "min_steps=${plan_opt[min-steps]:-8000}"
        echo "max_steps=${plan_opt[max-steps]:-30000}"
        echo "window=${plan_opt[window]:-4000}"
        echo "tol=${plan_opt[tol]:-0.01}"
    } >"$state/plan.env"
elif [ ${#plan_opt[@]} -gt 0 ]; then
    echo "gpu_train.sh: $state/plan.env fixes the plan; its options are not taken again" >&2
fi
# shellcheck disable=SC1091
. "$state/plan.env"
# shellcheck disable=SC2154 # plan.env sets them
for v in "$teachers" "$seeds" "$ft_steps" "$min_steps" "$max_steps" "$window"; do
    case $v in '' | *[!0-9]*) echo "gpu_train.sh: $state/plan.env: a count is not a whole number" >&2; exit 2 ;; esac
done
first_sparsity=${sparsities%%,*}
ft_keys="data=B lr=1e-4 warmup=50 steps=$ft_steps ${GPU_TRAIN_FT_KEYS:-batch=4 log_every=100}" # the arms' fine-tuning
eval_keys=${GPU_TRAIN_EVAL_KEYS:-eval_batches=8 sample_steps=16 batch=8}       # every model's evaluation
heldout_keys=${GPU_TRAIN_HELDOUT_KEYS:-eval_batches=8 sample_steps=1 batch=8} # a teacher's held-out loss per chunk
hybrid_k=0.03 # the paper's: 7 of gpu.cfg's 256 key blocks (floor(0.03·256) = 7)

# Jobs in plan order, one a line: teacher:I, null, prep:I:S, discrim:I, arm:I:S:SEED:KIND (KIND hybvd, topkvd, toppvd,
# hybdiff; denseB and denseA with S = -). Teacher 1's calibration and discriminability at the first sparsity come
# right after its training: if the hybrid cannot differ from Top-p at this scale, that shows before the other
# teachers take GPU time.
plan_jobs() {
    local i s seed k
    echo "teacher:1"
    echo "prep:1:$first_sparsity"
    echo "discrim:1"
    for i in $(seq 2 "$teachers"); do echo "teacher:$i"; done
    echo null
    for s in ${sparsities//,/ }; do
        for i in $(seq 1 "$teachers"); do
            if [ "$i:$s" != "1:$first_sparsity" ]; then
                echo "prep:$i:$s"
                [ "$s" != "$first_sparsity" ] || echo "discrim:$i"
            fi
            for seed in $(seq 1 "$seeds"); do
                for k in hybvd topkvd toppvd; do echo "arm:$i:$s:$seed:$k"; done
                [ "$s" != "$first_sparsity" ] || echo "arm:$i:$s:$seed:hybdiff"
            done
        done
        if [ "$s" = "$first_sparsity" ]; then
            for i in $(seq 1 "$teachers"); do
                for seed in $(seq 1 "$seeds"); do echo "arm:$i:-:$seed:denseB"; echo "arm:$i:-:$seed:denseA"; done
            done
        fi
    done
}

job_id() { echo "$1" | tr ':' '_' | sed 's/_-_/_/'; } # arm:1:-:2:denseB -> arm_1_2_denseB

done_job() {
    case $1 in
    teacher:*) [ -f "$state/t${1#teacher:}/final.safetensors" ] ;;
    *) [ -f "$state/results/$(job_id "$1").eval.csv" ] ;;
    esac
}

# The big files (checkpoints) a job needs, relative to the state; empty for none.
job_inputs() {
    local i
    case $1 in
    teacher:*)
        i=${1#teacher:}
        [ ! -f "$state/t$i/state.safetensors" ] || ckpt_files "t$i/state.safetensors" ;;
    null) ;;
    *) i=$(echo "$1" | cut -d: -f2); ckpt_files "t$i/final.safetensors" ;;
    esac
}

# ckpt_files FILE: a checkpoint (relative to the state) and, when it is an index, the shards its metadata names
# ("shards":"a,b" in the JSON header); shards of earlier saves beside it are not listed
ckpt_files() {
    local list
    echo "$1"
    [ -f "$state/$1" ] || return 0
    list=$(head -c 65536 "$state/$1" | LC_ALL=C grep -ao '"shards":"[^"]*"' | sed -n '1s/^"shards":"\(.*\)"$/\1/p') || true
    [ -z "$list" ] || echo "$list" | tr ',' '\n' | sed "s|^|$(dirname "$1")/|"
}

# prune_shards: removes the shards of earlier saves beside each checkpoint of the state, as the trainer does where it
# saves, and the training state of a teacher with final weights, as teacher_chunk does at the plateau
prune_shards() {
    local idx keep f
    for idx in "$state"/t*/final.safetensors; do
        [ ! -f "$idx" ] || rm -f "$(dirname "$idx")"/state*.safetensors
    done
    for idx in "$state"/t*/state.safetensors "$state"/t*/final.safetensors; do
        [ -f "$idx" ] || continue
        keep=$(ckpt_files "${idx#"$state"/}")
        for f in "${idx%.safetensors}"-*-of-*.safetensors; do
            [ -f "$f" ] || continue
            echo "$keep" | grep -qxF "${f#"$state"/}" || rm -f "$f"
        done
    done
}

# Whether a job can run with the files present: 0 yes; 1 no (its message on stdout).
runnable() {
    local i s
    case $1 in
    teacher:*)
        i=${1#teacher:}
        if [ -f "$state/t$i/heldout.csv" ] && [ ! -f "$state/t$i/state.safetensors" ]; then
            echo "teacher $i has started but its training state t$i/state*.safetensors is not here (restore?)"; return 1
        fi ;;
    null) ;;
    *)
        i=$(echo "$1" | cut -d: -f2) s=$(echo "$1" | cut -d: -f3)
        [ -f "$state/t$i/final.safetensors" ] ||
            { echo "needs teacher $i's final weights t$i/final*.safetensors (restore?)"; return 1; }
        case $1 in arm:*:-:*) ;; arm:*)
            grep -q "^$s," "$state/t$i/calibration.csv" 2>/dev/null || { echo "needs prep:$i:$s first"; return 1; } ;;
        esac ;;
    esac
    return 0
}

next_job() { # the first job not done, or nothing
    local j
    while read -r j; do done_job "$j" || { echo "$j"; return 0; }; done < <(plan_jobs)
}

# ---------------------------------------------------------------- status

status() {
    local total=0 finished=0 j i steps loss
    while read -r j; do total=$((total + 1)); ! done_job "$j" || finished=$((finished + 1)); done < <(plan_jobs)
    echo "plan ($state/plan.env): $teachers teachers, $seeds seeds, sparsities $sparsities, $ft_steps fine-tuning steps"
    for i in $(seq 1 "$teachers"); do
        steps=0 loss=—
        if [ -f "$state/t$i/heldout.csv" ]; then
            steps=$(tail -n 1 "$state/t$i/heldout.csv" | cut -d, -f1) loss=$(tail -n 1 "$state/t$i/heldout.csv" | cut -d, -f2)
        fi
        echo "teacher $i: $steps steps, held-out loss $loss$([ -f "$state/t$i/final.safetensors" ] && echo ", done (plateau or cap)")"
    done
    echo "jobs: $finished of $total done"
    j=$(next_job)
    if [ -z "$j" ]; then echo "next: nothing (the plan is complete); run: gpu_train.sh tables --state $state"; return; fi
    echo "next: $j (needs: $(job_inputs "$j" | tr '\n' ' '))"
}

# ---------------------------------------------------------------- stage (here)

# The state's files other than its large checkpoint files (relative paths): they travel in one archive; a checkpoint
# file of 1 MiB or more travels as a file of its own.
small_files() {
    (cd "$state" && find . -type f ! \( -name '*.safetensors' -size +1023k \) ! -name autotools.tar.gz |
        sed 's|^\./||' | sort)
}

stage() {
    local j need
    restore
    rm -rf "$to"
    mkdir -p "$to"
    # a teacher's training log travels as its header and last line, the run logs not at all: both only grow, and
    # absorb appends what comes back (they would otherwise crowd the 64 MiB a teacher's checkpoint needs)
    small_files | (cd "$state" && while read -r f; do
        mkdir -p "$to/$(dirname "$f")"
        case $f in
        t*/train.csv) { head -n 1 "$f"; tail -n +2 "$f" | tail -n 1; } >"$to/$f" ;;
        logs/*.log) ;;
        *) cp -p "$f" "$to/$f" ;;
        esac
    done)
    # the checkpoints of the next jobs: the first one's, then whichever teacher's weights come next, as room allows
    local budget_bytes=$((44 * 1024 * 1024)) used=0 size f first_job=
    while read -r j; do
        done_job "$j" && continue
        [ -n "$first_job" ] || first_job=$j
        need=$(job_inputs "$j")
        [ -n "$need" ] || continue
        size=0
        for f in $need; do [ -f "$to/$f" ] || [ ! -f "$state/$f" ] || size=$((size + $(stat -c %s "$state/$f"))); done
        if [ "$j" != "$first_job" ] && [ $((used + size)) -gt "$budget_bytes" ]; then break; fi
        for f in $need; do
            [ -f "$to/$f" ] || [ ! -f "$state/$f" ] || { mkdir -p "$to/$(dirname "$f")"; cp -p "$state/$f" "$to/$f"; }
        done
        used=$((used + size))
        case $j in teacher:*) break ;; esac # a training state fills the carry alone
    done < <(plan_jobs)
    # the commit of this checkout, and the generated build files (the GPU machine has autoconf and automake but
    # no libtool, so it cannot run autoreconf)
    local rev
    rev=$(git -C "$top" rev-parse --short HEAD 2>/dev/null || echo unknown)
    git -C "$top" diff --quiet HEAD -- 2>/dev/null || rev="$rev+uncommitted"
    echo "$rev" >"$to/commit.txt"
    [ -x "$top/configure" ] || (cd "$top" && autoreconf -fi >/dev/null)
    (cd "$top" && tar -czf "$to/autotools.tar.gz" configure Makefile.in config.h.in aclocal.m4 build-aux/ar-lib \
        build-aux/compile build-aux/config.guess build-aux/config.sub build-aux/depcomp build-aux/install-sh \
        build-aux/ltmain.sh build-aux/missing build-aux/test-driver)
    local staged tracked
    staged=$(du -sb "$to" | cut -f1)
    # outside a git checkout (an unpacked dist tarball) the whole tree stands in for the tracked files
    tracked=$(git -C "$top" ls-files -z 2>/dev/null | (cd "$top" && xargs -0 du -cb 2>/dev/null) | tail -n 1 | cut -f1) ||
        tracked=$(du -sb "$top" | cut -f1)
    echo "staged $((staged / 1048576)) MiB in $to (the checkout's tracked files: $((tracked / 1048576)) MiB; the limit is 64 MiB together)"
    echo "next job: ${first_job:-none (the plan is complete)}"
    if [ $((staged + tracked)) -gt $((62 * 1048576)) ]; then
        echo "gpu_train.sh: more than 62 MiB would travel: stage less (see --help)" >&2
        exit 1
    fi
    echo "on the GPU machine (device tool): run(command=\"bash paper-repro/gpu_train.sh next --state ${to#"$top"/} --out \$OUT\","
    echo "    carry=[\"${to#"$top"/}\"], timeout_s=600); then: paper-repro/gpu_train.sh absorb --state $state --from FILES_AT"
}

# ---------------------------------------------------------------- absorb (here)

absorb() {
    [ -d "$from" ] || { echo "gpu_train.sh: --from $from: no such folder" >&2; exit 2; }
    local f name
    if [ -f "$from/state-small.tar.gz" ]; then
        local tmp_small last
        tmp_small=$(mktemp -d)
        tar -xzf "$from/state-small.tar.gz" -C "$tmp_small"
        # stage sent a training log's last line only and no run logs: append what is new to the ones here
        (cd "$tmp_small" && find . -type f | sed 's|^\./||') | while read -r f; do
            mkdir -p "$state/$(dirname "$f")"
            case $f in
            t*/train.csv)
                if [ -f "$state/$f" ]; then
                    last=$(tail -n +2 "$state/$f" | tail -n 1 | cut -d, -f1)
                    tail -n +2 "$tmp_small/$f" | awk -F, -v last="${last:--1}" '$1 + 0 > last + 0' >>"$state/$f"
                else
                    cp "$tmp_small/$f" "$state/$f"
                fi
                ;;
            logs/*.log) cat "$tmp_small/$f" >>"$state/$f" ;;
            *) cp "$tmp_small/$f" "$state/$f" ;;
            esac
        done
        rm -rf "$tmp_small"
    fi
    for f in "$from"/*.safetensors; do
        [ -f "$f" ] || continue
        name=$(basename "$f" | sed 's|__|/|g')
        mkdir -p "$state/$(dirname "$name")"
        cp "$f" "$state/$name"
        echo "  $name"
    done
    prune_shards
    status
    echo "then: gpu_train.sh keep --state $state (what the checkout's history does not hold is lost with the checkout)"
}

# ---------------------------------------------------------------- keep and restore (here)

# The lent machine keeps nothing and neither does a checkout's ignored files between clones: what the plan has
# done lives in the repository. A checkpoint (19.5 MiB of weights, 56 MiB with the AdamW moments) cannot sit in
# the tree, which travels whole with every run within the same 64 MiB, so it lives in the history: a commit adds
# it and the next one removes it, and checkpoints.txt names its blob for restore.

# git ARGS...: git in the checkout that holds the state
git_state() { git -C "$state" "$@"; }

# checkpoint_lines: "PATH BYTES SHA256 BLOB" for each checkpoint file of the state, writing each blob into the
# object store (git hash-object -w: nothing is committed yet)
checkpoint_lines() {
    local f
    (cd "$state" && find . -type f -name '*.safetensors' | sed 's|^\./||' | LC_ALL=C sort) | while read -r f; do
        echo "$f $(stat -c %s "$state/$f") $(sha256sum "$state/$f" | cut -d' ' -f1) $(git_state hash-object -w -- "$state/$f")"
    done
}

keep() {
    local root rel head parent lines kept new f bytes sum blob idx c
    root=$(git_state rev-parse --show-toplevel 2>/dev/null) ||
        { echo "gpu_train.sh: keep commits the state to the git checkout that holds it; $state is in none" >&2; exit 2; }
    rel=${state#"$root"/}
    git_state symbolic-ref -q HEAD >/dev/null ||
        { echo "gpu_train.sh: keep commits to the checked-out branch; HEAD is detached: check out a branch" >&2; exit 2; }
    git_state diff --cached --quiet ||
        { echo "gpu_train.sh: keep commits; the index has staged changes: commit or unstage them first" >&2; exit 2; }
    head=$(git_state rev-parse HEAD)
    parent=$head
    # blobs named in the committed checkpoints.txt are in the history already
    lines=$(checkpoint_lines)
    kept=$(git_state show "$head:$rel/checkpoints.txt" 2>/dev/null) || kept=
    new=$(echo "$lines" | while read -r f bytes sum blob; do
        [ -n "$f" ] || continue
        echo "$kept" | grep -q " $blob\$" || echo "$f $blob"
    done)
    # both commits are built in an index of their own and HEAD moves once, at the end
    idx=$(mktemp -u "${TMPDIR:-/tmp}/gpu-keep-index.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -f '$idx'" EXIT
    export GIT_INDEX_FILE=$idx
    if [ -n "$new" ]; then
        git_state read-tree "$head"
        echo "$new" | while read -r f blob; do git_state update-index --add --cacheinfo "100644,$blob,$rel/$f"; done
        parent=$(git_state commit-tree "$(git_state write-tree)" -p "$head" \
            -m "paper-repro/gpu-state: keep $(echo "$new" | wc -l) checkpoint file(s) in the history" \
            -m "$(echo "$new" | cut -d' ' -f1 | sed 's/^/  /')" \
            -m "The next commit takes them out of the tree; checkpoints.txt names their blobs and 'paper-repro/gpu_train.sh restore --state $rel' takes them back.")
    fi
    { echo "# path bytes sha256 blob: the checkpoints of this state, kept in the history (gpu_train.sh restore)"
      [ -z "$lines" ] || echo "$lines"; } >"$state/checkpoints.txt"
    git_state read-tree "$head"
    # the state's own files; its checkpoints and run logs (chunk.log repeats runs.csv) stay out of the tree wherever
    # the state lies
    git_state add -A -- .
    git_state rm -r -q --cached --ignore-unmatch -- '*.safetensors' '*.restore' logs chunk.log commit.txt \
        autotools.tar.gz
    if [ -z "$new" ] && [ "$(git_state write-tree)" = "$(git_state rev-parse "$head^{tree}")" ]; then
        unset GIT_INDEX_FILE
        echo "kept: nothing new"
        return 0
    fi
    c=$(git_state commit-tree "$(git_state write-tree)" -p "$parent" \
        -m "paper-repro/gpu-state: $(next_job | sed 's/^/next job /;s/^$/the plan is complete/'), $(status | sed -n 's/^jobs: //p')" \
        -m "Written by 'paper-repro/gpu_train.sh keep --state $rel'.")
    unset GIT_INDEX_FILE
    git_state update-ref -m "gpu_train.sh keep" HEAD "$c" "$head"
    git_state reset -q # the index follows HEAD; the working tree is as it was
    echo "kept at $(git_state rev-parse --short HEAD)$([ -z "$new" ] || echo ", $(echo "$new" | wc -l) checkpoint file(s) in $(git_state rev-parse --short HEAD~1)")"
}

restore() {
    local list=$state/checkpoints.txt f bytes sum blob missing=0
    [ -f "$list" ] || return 0
    # every blob first: a restore that cannot finish writes nothing
    while read -r f bytes sum blob; do
        case $f in '#'* | '') continue ;; esac
        [ ! -f "$state/$f" ] || [ "$(sha256sum "$state/$f" | cut -d' ' -f1)" != "$sum" ] || continue
        git_state cat-file -e "$blob^{blob}" 2>/dev/null || {
            echo "gpu_train.sh: $f (blob $blob) is not in this checkout's history: clone with the full history" \
                "(not --depth), or fetch the commit that kept it" >&2; missing=1; }
    done <"$list"
    [ "$missing" = 0 ] || exit 1
    while read -r f bytes sum blob; do
        case $f in '#'* | '') continue ;; esac
        [ ! -f "$state/$f" ] || [ "$(sha256sum "$state/$f" | cut -d' ' -f1)" != "$sum" ] || continue
        mkdir -p "$state/$(dirname "$f")"
        git_state cat-file blob "$blob" >"$state/$f.restore"
        if [ "$(sha256sum "$state/$f.restore" | cut -d' ' -f1)" != "$sum" ]; then
            rm -f "$state/$f.restore"
            echo "gpu_train.sh: blob $blob does not hold $f as checkpoints.txt records it (sha256 differs)" >&2
            exit 1
        fi
        mv "$state/$f.restore" "$state/$f"
        echo "  restored $f ($bytes bytes)"
    done <"$list"
}

# ---------------------------------------------------------------- next (there)

# build: sparge-train and the drivers in paper-repro/.build-gpu, reused while the commit and flags are the same
build() {
    if [ -n "${GPU_TRAIN_BINDIR:-}" ]; then
        expdir=$GPU_TRAIN_BINDIR train=$GPU_TRAIN_BINDIR/trainer/sparge-train
        return 0
    fi
    local bdir=$here/.build-gpu flags=${GPU_TRAIN_CONFIGURE_FLAGS:-"--with-cuda --with-cuda-arch=90 --without-hip"}
    local t0 stamp
    t0=$(date +%s)
    export PATH=/usr/local/cuda/bin:$PATH
    stamp="$(cat "$state/commit.txt" 2>/dev/null) $flags"
    if [ ! -f "$bdir/.stamp" ] || [ "$(cat "$bdir/.stamp")" != "$stamp" ]; then
        # the generated files of the staging checkout (this machine has no libtool for autoreconf), newer than
        # their sources so that make does not try to regenerate them
        tar -xzf "$state/autotools.tar.gz" -C "$top"
        touch "$top/aclocal.m4"; sleep 1; touch "$top/configure" "$top/config.h.in"; sleep 1; touch "$top/Makefile.in"
        rm -rf "$bdir"
        mkdir -p "$bdir"
        # shellcheck disable=SC2086
        (cd "$bdir" && "$top/configure" $flags >configure.log 2>&1) ||
            { tail -n 30 "$bdir/configure.log"; echo "gpu_train.sh: configure failed" >&2; return 1; }
        sed -n '/^sparge .* configuration/,$p' "$bdir/configure.log"
        echo "$stamp" >"$bdir/.stamp"
    fi
    # the autotools variables: never regenerate (the copied files' times need not be in order there)
    (cd "$bdir" && make -j"$(nproc)" --no-print-directory ACLOCAL=true AUTOCONF=true AUTOMAKE=true AUTOHEADER=true \
        experiments/trainer/sparge-train experiments/exp_discrim experiments/exp_table1 experiments/exp_failure \
        experiments/exp_ablation >make.log 2>&1) || {
        tail -n 30 "$bdir/make.log" >&2
        [ -z "${out:-}" ] || cp "$bdir/configure.log" "$bdir/make.log" "$out/" 2>/dev/null || true
        echo "gpu_train.sh: the build failed (make.log and configure.log${out:+ in $out})" >&2
        return 1
    }
    train=$bdir/experiments/trainer/sparge-train
    expdir=$bdir/experiments
    echo "built in $(($(date +%s) - t0)) s"
}

# run_train LOG KEY=VALUE...: sparge-train on the GPU with gpu.cfg and the chunk's tag, stderr appended to LOG.
run_train() {
    local log=$1
    shift
    mkdir -p "$(dirname "$log")"
    "$train" "$cfg" device="$gpu_device" device_ops=1 tag="commit=$commit" "$@" 2>>"$log"
}

# evaluate FILE TABLE ARM SEED TEACHER SPARSITY KEY=VALUE...: one labelled eval row.
evaluate() {
    local file=$1 table=$2 arm=$3 seed=$4 teacher=$5 sparsity=$6
    shift 6
    mkdir -p "$(dirname "$file")"
    # shellcheck disable=SC2086
    run_train "$state/logs/eval.log" mode=eval seed=0 $eval_keys "$@" >"$file.tmp"
    { echo "table,arm,seed,teacher,target_sparsity,$(sed -n 1p "$file.tmp")"
      echo "$table,$arm,$seed,$teacher,$sparsity,$(sed -n 2p "$file.tmp")"; } >"$file"
    rm -f "$file.tmp"
}

# table2_rows PREFIX ARM SEED TEACHER MODEL TEACHER_CKPT: Table 2's rows of a model, Top-p at each p of T2_PS (one Euler
# step: Table 2 uses no sample metric), in PREFIX_pP.eval.csv
table2_rows() {
    local p
    for p in $T2_PS; do
        evaluate "${1}_p$p.eval.csv" table2 "$(t2_arm "$2" "$p")" "$3" "$4" - init="$5" teacher="$6" attn=topp topp="$p" \
            sample_steps=1
    done
}

record() { # JOB SECONDS RESULT: the run's line in runs.csv and its time for the estimates
    [ -f "$state/runs.csv" ] || echo "utc,job,commit,device,seconds,result" >"$state/runs.csv"
    echo "$(date -u +%FT%TZ),$1,$commit,$gpu,$2,$3" >>"$state/runs.csv"
    echo "${1%%:*},$2" >>"$state/timing.csv"
}

estimate() { # KIND: seconds a job of this kind took (the largest of the last three), or a first guess
    local kind=$1 guess
    case $kind in arm) guess=300 ;; prep) guess=180 ;; discrim) guess=240 ;; null) guess=90 ;; heldout) guess=60 ;; *) guess=120 ;; esac
    guess=${GPU_TRAIN_GUESS:-$guess}
    [ -f "$state/timing.csv" ] || { echo "$guess"; return; }
    awk -F, -v k="$kind" -v g="$guess" '$1 == k { t[++n] = $2 } END { if (!n) print g
        else { m = 0; for (i = (n > 3 ? n - 2 : 1); i <= n; i++) if (t[i] > m) m = t[i]; print m } }' "$state/timing.csv"
}

# teacher_chunk I SECONDS: train teacher I for at most SECONDS, evaluate its held-out loss, and at the plateau (or
# the cap) write its final weights.
teacher_chunk() {
    local i=$1 limit=$2 d=$state/t$1 resume=() steps loss plateau
    mkdir -p "$d"
    [ ! -f "$d/state.safetensors" ] || resume=(resume="$d/state.safetensors")
    run_train "$state/logs/teacher_$i.log" seed="$i" data_seed="$i" steps="$max_steps" time_limit="$limit" \
        "${resume[@]}" out="$d/state.safetensors" log="$d/train.csv"
    local t_eval
    t_eval=$(date +%s)
    # shellcheck disable=SC2086
    run_train "$state/logs/teacher_$i.log" mode=eval seed=0 $heldout_keys init="$d/state.safetensors" >"$d/heldout.tmp"
    steps=$(tail -n 1 "$d/train.csv" | cut -d, -f1)
    loss=$(column_of "$d/heldout.tmp" diffusion_loss | tail -n 1)
    rm -f "$d/heldout.tmp"
    echo "$steps,$loss" >>"$d/heldout.csv"
    # the plateau: at least min_steps, and the loss of `window` steps ago (the latest evaluation at or before it)
    # is less than tol above the latest
    plateau=$(awk -F, -v w="$window" -v tol="$tol" -v min="$min_steps" -v cap="$max_steps" '
        { s[NR] = $1; l[NR] = $2 } END {
            if (s[NR] >= cap) { print "cap"; exit }
            if (s[NR] < min) { print ""; exit }
            for (i = NR - 1; i >= 1; i--) if (s[i] <= s[NR] - w) { if ((l[i] - l[NR]) / l[NR] < tol) print "plateau"; exit } }' \
        "$d/heldout.csv")
    echo "   teacher $i: step $steps, held-out loss $loss${plateau:+ — $plateau reached}"
    if [ -n "$plateau" ]; then # the final weights come back instead of the training state (both would not fit)
        run_train "$state/logs/teacher_$i.log" resume="$d/state.safetensors" steps="$steps" save_optimizer=0 \
            ckpt_shard_mib=15 out="$d/final.safetensors"
        rm -f "$d"/state*.safetensors
    fi
    echo "heldout,$(($(date +%s) - t_eval))" >>"$state/timing.csv"
}

column_of() { # CSV NAME: one column of a CSV with a header
    awk -F, -v name="$2" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == name) c = i; next } c { print $c }' "$1"
}

# calibrated_p I S MODE K: from t_I/calibration.csv (sparsity,topp_p,hybrid_k,hybrid_p)
cal_field() { awk -F, -v s="$2" -v c="$3" '$1 == s { print $c }' "$state/t$1/calibration.csv"; }

prep_job() { # I S
    local i=$1 s=$2 d=$state/t$1 fin=$state/t$1/final.safetensors p_topp p_hyb log=$state/logs/prep_$1.log
    if [ "$s" = "$first_sparsity" ]; then
        evaluate "$state/results/teacher_$i.eval.csv" table6 "$ARM_TEACHER_T6" 0 "$i" 0 init="$fin" teacher="$fin" attn=dense
        table2_rows "$state/results/t2before_$i" "$ARM_T2_BEFORE" 0 "$i" "$fin" "$fin"
    fi
    p_topp=$(run_train "$log" mode=calibrate seed=0 init="$fin" eval_batches=2 calib_iters=20 batch=8 \
        target_sparsity="$s" attn=topp | sed -n 2p | cut -d, -f1)
    p_hyb=$(run_train "$log" mode=calibrate seed=0 init="$fin" eval_batches=2 calib_iters=20 batch=8 \
        target_sparsity="$s" attn=hybrid topk="$hybrid_k" | sed -n 2p | cut -d, -f1)
    { grep -v "^$s," "$d/calibration.csv" 2>/dev/null || true; echo "$s,$p_topp,$hybrid_k,$p_hyb"; } >"$d/calibration.new"
    mv "$d/calibration.new" "$d/calibration.csv" # a repeated prep (after a failure) replaces its line
    evaluate "$state/results/$(job_id "prep:$i:$s").eval.csv" table6 "$ARM_FREE" 0 "$i" "$s" init="$fin" teacher="$fin" \
        attn=hybrid topk="$hybrid_k" topp="$p_hyb"
}

discrim_job() { # I: the teacher's Q/K/V (2 videos, t = 0.1, 0.5, 0.9) and exp_discrim at the first sparsity's arms
    local i=$1 fin=$state/t$1/final.safetensors q=/tmp/gpu-qkv-$1 s=$first_sparsity d=$state/discrim f file
    rm -rf "$q"
    mkdir -p "$d"
    run_train "$state/logs/discrim_$i.log" mode=dump seed=0 batch=2 init="$fin" dump_dir="$q" dump_times=0.1,0.5,0.9
    local k p_topp p_hyb
    k=$(awk -v s="$s" 'BEGIN { printf "%.6f", 1 - s }')
    p_topp=$(cal_field "$i" "$s" 2) p_hyb=$(cal_field "$i" "$s" 4)
    f=$d/t$i.md
    {
        echo "Teacher $i, commit \`$commit\`, $gpu: \`exp_discrim --dump DIR --topk $k --topp $p_topp --hybrid $hybrid_k,$p_hyb\`"
        echo
    } >"$f"
    "$expdir/exp_discrim" --quiet --backend "$gpu_device" --dump "$q" --topk "$k" --topp "$p_topp" \
        --hybrid "$hybrid_k,$p_hyb" --csv "$d/t$i.csv" --masks "$d/t${i}_masks.dat" >>"$f"
    # the training-free analyses on the first, a middle and the last layer at t = 0.5
    local bq bk common
    bq=$(sed -n 2p "$q/manifest.csv" | cut -d, -f8) bk=$(sed -n 2p "$q/manifest.csv" | cut -d, -f9)
    common="--backend $gpu_device --quiet --block-q $bq --block-k $bk"
    f=$d/t${i}_maps.md
    echo "Teacher $i's own Q/K/V through the training-free drivers (\`--input\`; $common), commit \`$commit\`." >"$f"
    for file in $(awk -F, 'NR > 1 && $3 == 0.5 { print $1 }' "$q/manifest.csv" | sed -n '1p;4p;$p' | sort -u); do
        { echo; echo "## $file"; echo; } >>"$f"
        # shellcheck disable=SC2086
        "$expdir/exp_table1" --input "$q/$file" $common --topk "$k" --hybrid-k "$hybrid_k" >>"$f"
        echo >>"$f"
        # shellcheck disable=SC2086
        "$expdir/exp_failure" --input "$q/$file" $common --topk "$k" --hybrid-k "$hybrid_k" |
            awk '/^Toy rows/ { skip = 1 } /^Per-row statistics/ { skip = 0 } !skip' >>"$f"
        echo >>"$f"
        # shellcheck disable=SC2086
        "$expdir/exp_ablation" --input "$q/$file" $common >>"$f"
    done
    rm -rf "$q"
    echo "discrim" >"$state/results/$(job_id "discrim:$i").eval.csv" # the job's mark: its files are in discrim/
}

arm_job() { # I S SEED KIND
    local i=$1 s=$2 seed=$3 kind=$4 fin=$state/t$1/final.safetensors id ck keys=() table=table6 arm steps
    id=$(job_id "arm:$i:$s:$seed:$kind")
    local p_topp p_hyb k
    if [ "$s" != - ]; then
        p_topp=$(cal_field "$i" "$s" 2) p_hyb=$(cal_field "$i" "$s" 4)
        k=$(awk -v s="$s" 'BEGIN { printf "%.6f", 1 - s }')
    fi
    case $kind in
    hybvd) keys=(attn=hybrid topk="$hybrid_k" topp="$p_hyb" loss=vd) arm=$ARM_HYB_VD ;;
    topkvd) keys=(attn=topk topk="$k" loss=vd) arm=$ARM_TOPK_VD ;;
    toppvd) keys=(attn=topp topp="$p_topp" loss=vd) arm=$ARM_TOPP_VD ;;
    hybdiff) keys=(attn=hybrid topk="$hybrid_k" topp="$p_hyb" loss=diffusion) arm=$ARM_HYB_DIFF ;;
    denseB) keys=(attn=dense loss=diffusion) arm=$ARM_FULL_B table=table3 ;;
    denseA) keys=(attn=dense loss=diffusion data=A) arm=$ARM_FULL_A table=table3 ;;
    esac
    ck=/tmp/gpu-$id.safetensors
    # shellcheck disable=SC2086
    run_train "$state/logs/$id.log" init="$fin" teacher="$fin" $ft_keys seed="$seed" data_seed=$((100 + seed)) \
        "${keys[@]}" out="$ck" log="$state/logs/$id.csv"
    steps=$(tail -n 1 "$state/logs/$id.csv" | cut -d, -f1)
    [ "$steps" = "$ft_steps" ] || { echo "gpu_train.sh: $id stopped at step $steps" >&2; return 1; }
    evaluate "$state/results/$id.eval.csv" "$table" "$arm" "$seed" "$i" "$s" init="$ck" teacher="$fin" "${keys[@]}"
    case $kind in
    hybvd) [ "$s" != "$first_sparsity" ] || table2_rows "$state/results/t2_$id" "$ARM_T2_HYB" "$seed" "$i" "$ck" "$fin" ;;
    denseB) table2_rows "$state/results/t2_$id" "$ARM_T2_DENSE" "$seed" "$i" "$ck" "$fin" ;;
    esac
    rm -f /tmp/gpu-"$id"*.safetensors
}

null_job() {
    local n=/tmp/gpu-null.safetensors
    run_train "$state/logs/null.log" steps=0 out="$n"
    evaluate "$state/results/null.eval.csv" null "$ARM_NULL" 0 0 - init="$n" attn=dense
}

# run_job FUNCTION ARGS...: a job in a subshell of its own with `set -e` in force, its status in job_rc (a failing
# command ends the job, not the chunk: what is done still comes back). Called as a plain command: in the condition
# of an `if` or beside `||` bash ignores `set -e` inside the job, subshells included, and a job would run on past a
# failed training into an evaluation of what it did not write.
run_job() {
    set +e
    ( set -e; "$@" )
    job_rc=$?
    set -e
}

next_chunk() {
    local t_start j kind left est msg limit job_rc stamp=/tmp/gpu-chunk-start
    t_start=$(date +%s)
    touch "$stamp"
    commit=$(cat "$state/commit.txt" 2>/dev/null || echo unknown)
    build
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) || gpu=
    gpu="$gpu_device${gpu:+ ($gpu)}"
    mkdir -p "$state/results" "$state/logs"
    case $cfg in "$top"/*) echo "${cfg#"$top"/}" ;; *) echo "$cfg" ;; esac >"$state/config.txt"
    while :; do
        j=$(next_job)
        [ -n "$j" ] || { echo "== the plan is complete"; break; }
        msg=$(runnable "$j") || { echo "== next job $j: $msg; stage again"; break; }
        kind=${j%%:*}
        left=$((t_start + budget - $(date +%s)))
        local t0
        t0=$(date +%s)
        if [ "$kind" = teacher ]; then
            # after the training: the held-out evaluation (and at the plateau the final weights), and the copy out
            limit=$((left - $(estimate heldout) - 30))
            [ "$limit" -ge 30 ] || { echo "== $left s left: not enough for a teacher chunk"; break; }
            echo "== $j: training for at most $limit s"
            run_job teacher_chunk "${j#teacher:}" "$limit"
            if [ "$job_rc" = 0 ]; then
                record "$j" $(($(date +%s) - t0)) "$(tail -n 1 "$state/t${j#teacher:}/heldout.csv" | sed "s/^/step /; s/,/ held-out loss /")"
            else
                record "$j" $(($(date +%s) - t0)) failed
            fi
            break # a training state is as much as one chunk brings back
        fi
        est=$(estimate "$kind")
        [ "$left" -ge $((est + est / 4)) ] || { echo "== $left s left, $j needs about $est s: the next chunk"; break; }
        echo "== $j (about $est s)"
        # shellcheck disable=SC2046
        case $j in
        null) run_job null_job ;;
        prep:*) run_job prep_job "$(echo "$j" | cut -d: -f2)" "$(echo "$j" | cut -d: -f3)" ;;
        discrim:*) run_job discrim_job "${j#discrim:}" ;;
        arm:*) run_job arm_job $(echo "$j" | cut -d: -f2- | tr ':' ' ') ;;
        esac
        if [ "$job_rc" != 0 ]; then
            record "$j" $(($(date +%s) - t0)) failed
            rm -f "$state/results/$(job_id "$j").eval.csv" # not done: the next chunk tries again
            echo "== $j failed (its log: logs/); the chunk ends here"
            break
        fi
        record "$j" $(($(date +%s) - t0)) ok
    done
    echo "$(date -u +%FT%TZ) chunk at $commit on $gpu: $(($(date +%s) - t_start)) s, next $(next_job)" | tee -a "$state/chunk.log"
    [ -n "$out" ] || return 0
    # what comes back: every small file in one archive, each checkpoint file written in this chunk flat (a/b -> a__b)
    mkdir -p "$out"
    (cd "$state" && small_files | tar -czf "$out/state-small.tar.gz" -T -)
    (cd "$state" && find . -type f -size +1023k -newer "$stamp" -name '*.safetensors' | sed 's|^\./||') |
        while read -r f; do cp "$state/$f" "$out/$(echo "$f" | sed 's|/|__|g')"; done
    ls -la "$out"
}

# ---------------------------------------------------------------- tables (here)

tables() {
    local res=${out:-$here/results/gpu}
    # the drivers: GPU_TRAIN_BINDIR, else those of the build directory this runs in, else build-repro/'s
    expdir=${GPU_TRAIN_BINDIR:-}
    if [ -z "$expdir" ]; then
        expdir=$top/build-repro/experiments
        [ ! -x ./experiments/exp_stats ] || expdir=$(pwd)/experiments
    fi
    [ -x "$expdir/exp_stats" ] || {
        echo "gpu_train.sh: $expdir/exp_stats not found (run tables in a build directory or set GPU_TRAIN_BINDIR)" >&2
        exit 1
    }
    mkdir -p "$res"
    local t f s first
    for t in table3 table6 table2; do # every eval row of the table, one header
        first=1
        for f in "$state"/results/*.eval.csv; do
            [ -f "$f" ] && sed -n 2p "$f" | grep -q "^$t," || continue
            if [ "$first" = 1 ]; then sed -n 1p "$f" >"$res/$t.csv"; first=0; fi
            sed -n 2p "$f" >>"$res/$t.csv"
        done
        [ "$first" = 0 ] || rm -f "$res/$t.csv"
    done
    # the null model and the teachers belong to every table's sanity check
    for t in table3 table6; do
        [ -f "$res/$t.csv" ] || continue
        [ ! -f "$state/results/null.eval.csv" ] || sed -n 2p "$state/results/null.eval.csv" | sed "s/^null,/$t,/" >>"$res/$t.csv"
    done
    if [ -f "$res/table3.csv" ]; then
        grep "^table6,$ARM_TEACHER_T6," "$res/table6.csv" | sed "s/^table6,$ARM_TEACHER_T6,/table3,$ARM_TEACHER_T3,/" >>"$res/table3.csv"
    fi
    local prov
    prov="From the runs in \`$(basename "$state")\` (runs.csv: commit, GPU and seconds of every run; logs/: each run's full
configuration) of \`paper-repro/gpu_train.sh\` ($(tr '\n' ' ' <"$state/plan.env")), config
\`$(cat "$state/config.txt" 2>/dev/null || echo experiments/trainer/configs/gpu.cfg)\`; tables written on $(date -u +%Y-%m-%d). Teachers: $(for i in $(seq 1 "$teachers"); do
        if [ -f "$state/t$i/heldout.csv" ]; then printf '%s ' "t$i $(tail -n 1 "$state/t$i/heldout.csv" | cut -d, -f1) steps$([ -f "$state/t$i/final.safetensors" ] || echo ' (training)');"; fi; done)"
    if [ -f "$res/table3.csv" ]; then
        { echo "# Table 3 at GPU scale"; echo; echo "$PAPER_T3"; echo; echo "$prov"; } >"$res/table3.md"
        stats_table3 "$res/table3.csv" "$res/table3.md"
    fi
    if [ -f "$res/table6.csv" ]; then
        for s in ${sparsities//,/ }; do # one table per sparsity: the arms of that sparsity and the teachers
            awk -F, -v s="$s" 'NR == 1 || $5 == s || $5 == 0 || $5 == "-"' "$res/table6.csv" >"$res/table6_$s.csv"
            [ "$(wc -l <"$res/table6_$s.csv")" -gt 1 ] || continue
            { echo "# Table 6 at GPU scale, sparsity $s"; echo; echo "$PAPER_T6"; echo; echo "$prov"; } >"$res/table6_$s.md"
            stats_table6 "$res/table6_$s.csv" "$res/table6_$s.md"
        done
    fi
    if [ -f "$res/table2.csv" ]; then
        { echo "# Table 2 at GPU scale"; echo; echo "$PAPER_T2"; echo; echo "$prov"; } >"$res/table2.md"
        stats_table2 "$res/table2.csv" "$res/table2.md"
    fi
    for f in "$state"/discrim/t*.md; do [ -f "$f" ] && cp "$f" "$res/discrim_$(basename "$f")"; done
    for f in "$state"/discrim/t*.csv; do [ -f "$f" ] && cp "$f" "$res/discrim_$(basename "$f")"; done
    local g=${GNUPLOT:-gnuplot} term=pngcairo
    if command -v "$g" >/dev/null 2>&1; then
        for f in "$state"/discrim/t[0-9].csv "$state"/discrim/t[0-9][0-9].csv; do
            [ -f "$f" ] || continue
            t=$(basename "$f" .csv)
            "$g" -e "term='$term'; out='$res/discrim_${t}_profile.png'; csv='$f'" "$here/plots/discrim_profile.gp"
            "$g" -e "term='$term'; out='$res/discrim_${t}_heads.png'; csv='$f'" "$here/plots/discrim_heads.gp"
            [ ! -f "$state/discrim/${t}_masks.dat" ] ||
                "$g" -e "term='$term'; out='$res/discrim_${t}_masks.png'; dat='$state/discrim/${t}_masks.dat'" "$here/plots/discrim_masks.gp"
        done
    fi
    cp "$state/runs.csv" "$res/runs.csv" 2>/dev/null || true
    echo "tables in $res"
}

case $cmd in
status) status ;;
stage) stage ;;
next) next_chunk ;;
absorb) absorb ;;
keep) keep ;;
restore) restore ;;
tables) tables ;;
esac
