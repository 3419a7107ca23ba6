#!/usr/bin/env bash
# Kernel variants against each other in one process tree: `sparge bench` with the same arguments for each variant,
# the variants in turn within a round and the rounds one after the other, so that a drift of the machine (clocks,
# power cap, other load) falls on every variant alike. A variant is LABEL=SPARGE[,OPTION=VALUE...]: a sparge binary
# (two builds compare two commits) and device options for its --option (one build compares its kernels).
#
#   experiments/bench/compare.sh [--rounds N] [--ops fwd|bwd] [--csv FILE] -- BENCH_ARGS... -- VARIANT...
#
# Prints a markdown table: one line per level, each variant's time (ms) in every round, and the ratio of each
# variant's median to the first variant's (< 1: faster). The times are sparge bench's fwd_ms or bwd_ms (its --output).
# --csv writes round,variant,level,sparsity,ms. Example (the forward kernels of one build, two rounds):
#
#   experiments/bench/compare.sh --rounds 2 -- --backend cuda:0 --B 1 --H 12 --N 32760 --D 128 --dtype bf16 \
#       --settle 1 --reps 10 --sparsity dense,0.8,0.9,0.95,0.97,hybrid -- \
#       wgmma=src/sparge,fwd_kernel=wgmma ws=src/sparge,fwd_kernel=wgmma-ws
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "compare.sh: $*" >&2; exit 2; }

rounds=2 ops=fwd csv=
while [ $# -gt 0 ] && [ "$1" != -- ]; do
    case $1 in
    -h | --help) usage; exit 0 ;;
    --rounds) [ $# -ge 2 ] || die "--rounds needs a count"; rounds=$2; shift 2 ;;
    --ops) [ $# -ge 2 ] || die "--ops needs fwd or bwd"; ops=$2; shift 2 ;;
    --csv) [ $# -ge 2 ] || die "--csv needs a file"; csv=$2; shift 2 ;;
    *) die "unknown option '$1' (--help lists them)" ;;
    esac
done
case $rounds in '' | *[!0-9]* | 0) die "--rounds '$rounds': a count of at least 1" ;; esac
case $ops in fwd | bwd) ;; *) die "--ops '$ops': fwd or bwd" ;; esac
[ $# -gt 0 ] || die "no '--' before the bench arguments (--help shows the form)"
shift
args=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
    case $1 in --ops | --option | --output) die "bench argument '$1': compare.sh sets it (--ops here; options per variant)" ;; esac
    args+=("$1")
    shift
done
[ $# -gt 0 ] || die "no '--' before the variants (--help shows the form)"
shift
[ $# -ge 1 ] || die "no variants (LABEL=SPARGE[,OPTION=VALUE...])"
labels=() bins=() opts=()
for v in "$@"; do
    case $v in *=*) ;; *) die "variant '$v': LABEL=SPARGE[,OPTION=VALUE...]" ;; esac
    label=${v%%=*} rest=${v#*=}
    case $label in '' | *[!A-Za-z0-9_.+-]*) die "variant '$v': a label of letters, digits, '.', '_', '+', '-'" ;; esac
    for l in "${labels[@]+"${labels[@]}"}"; do [ "$l" != "$label" ] || die "variant label '$label' given twice"; done
    bin=${rest%%,*}
    [ -x "$bin" ] || die "variant '$label': '$bin' is not an executable sparge"
    o=()
    if [ "$bin" != "$rest" ]; then
        IFS=, read -r -a kv <<<"${rest#*,}"
        for x in "${kv[@]}"; do
            case $x in *=*) o+=(--option "$x") ;; *) die "variant '$label': option '$x' is not OPTION=VALUE" ;; esac
        done
    fi
    labels+=("$label") bins+=("$bin") opts+=("${o[*]+"${o[*]}"}")
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/sparge-compare-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
command -v python3 >/dev/null || die "python3 is needed for the table"
for ((r = 1; r <= rounds; r++)); do
    for i in "${!labels[@]}"; do
        echo "round $r/$rounds: ${labels[$i]}" >&2
        # shellcheck disable=SC2086 # the options were split on commas above and hold no spaces
        if ! "${bins[$i]}" bench "${args[@]}" --ops "$ops" ${opts[$i]} --output "$tmp/$r-$i.csv" >"$tmp/out" 2>&1; then
            cat "$tmp/out" >&2
            echo "compare.sh: sparge bench failed for '${labels[$i]}' in round $r" >&2
            exit 1
        fi
    done
done

python3 - "$tmp" "$rounds" "$ops" "$csv" "${labels[@]}" <<'PY'
import csv, statistics, sys
tmp, rounds, ops, out, labels = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
rows, levels, sparsity = [], [], {}
for r in range(1, rounds + 1):
    for i, lab in enumerate(labels):
        with open(f"{tmp}/{r}-{i}.csv", newline="") as f:
            for row in csv.DictReader(f):
                lv = row["level"]
                if lv not in sparsity:
                    levels.append(lv)
                    sparsity[lv] = float(row["sparsity"])
                rows.append((r, lab, lv, row["sparsity"], float(row[ops + "_ms"])))
if out:
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["round", "variant", "level", "sparsity", "ms"])
        w.writerows(rows)
t = {}
for r, lab, lv, _, ms in rows:
    t.setdefault((lv, lab), []).append(ms)
head = ["level", "sparsity"] + [f"{lab}, ms" for lab in labels] + [f"{lab} / {labels[0]}" for lab in labels[1:]]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for lv in levels:
    cells = [lv, f"{100 * sparsity[lv]:.2f} %"]
    cells += [", ".join(f"{x:.3f}" for x in t.get((lv, lab), [])) or "—" for lab in labels]
    base = t.get((lv, labels[0]))
    for lab in labels[1:]:
        x = t.get((lv, lab))
        cells.append(f"{statistics.median(x) / statistics.median(base):.3f}" if x and base else "—")
    print("| " + " | ".join(cells) + " |")
PY
