#!/usr/bin/env bash
# Does `shardline plan --search` pick the fastest configuration here? (bench/RESULTS.md,
# "`shardline plan --search` against measured runs"). The machine profile comes from
# microbenchmarks only (as bench/plan-validate.sh makes it); per case (model x per-rank
# memory cap) the search ranks every configuration at the case's worlds, and the TOP
# highest-ranked ones, and the lowest-ranked within the cap, then train for real (ROUNDS rounds, the configurations alternating
# within a round). Measured step: per round the median of rank 0's steps from step 3 on;
# the table gives the median over rounds. The search's choice passes when its measured step
# is the fastest, or within 5% of the fastest, of those run.
#
#   cargo build --release -p shardline-runtime -p shardline-bench --bins
#   ROUNDS=3 TOP=4 bench/plan-search-validate.sh        # table on stdout, JSON in $OUT
#   PROFILE=profile.json bench/plan-search-validate.sh  # an existing profile instead
set -euo pipefail
BIN=${BIN:-target/release/shardline}
BENCH=${BENCH:-target/release/shardline-bench}
STEPS=${STEPS:-10}
ROUNDS=${ROUNDS:-3}
TOP=${TOP:-4}
OUT=${OUT:-out/plan-search-validate}
mkdir -p "$OUT"
if [ -z "${PROFILE:-}" ]; then
    PROFILE=$OUT/profile.json
    "$BENCH" collectives --transport local --world 2,3,4 --op all-reduce,reduce-scatter \
        --min-bytes 4K --max-bytes 8M --iters 40 --no-limits --json "$OUT/coll.json" > /dev/null
    "$BENCH" collectives --transport local --world 2,3,4 --op all-gather --in-place \
        --min-bytes 4K --max-bytes 8M --iters 40 --no-limits --json "$OUT/ag.json" > /dev/null
    "$BENCH" machine-profile --collectives "$OUT/coll.json,$OUT/ag.json" --out "$PROFILE"
fi
GPT="--model gpt --dataset text --n-layer 4 --n-head 4 --n-embd 128 --block-size 64 --batch-size 16 --optimizer adamw"
MLP="--model mlp-bn --dataset synthetic --hidden 1024 --depth 4 --input-dim 784 --batch-size 256 --sync-bn off"
# name | model flags | worlds | cap
CASES=(
    "gpt-64MiB|$GPT|2,4|64MiB"
    "gpt-20MiB|$GPT|2,4|20MiB"
    "mlp-64MiB|$MLP|2,4|64MiB"
    "mlp-40MiB|$MLP|2,4|40MiB"
)
rm -f "$OUT/commands.txt"
for c in "${CASES[@]}"; do
    IFS='|' read -r name model worlds cap <<< "$c"
    echo "$name: $BIN plan $model --world $worlds --profile $PROFILE --search --memory-cap $cap" \
        >> "$OUT/commands.txt"
    # A rerun into the same $OUT keeps the searches already made.
    if [ -s "$OUT/$name.search.json" ]; then continue; fi
    # shellcheck disable=SC2086
    "$BIN" plan $model --world "$worlds" --profile "$PROFILE" --search --memory-cap "$cap" \
        --top "$TOP" > "$OUT/$name.search.txt"
    # shellcheck disable=SC2086
    "$BIN" plan $model --world "$worlds" --profile "$PROFILE" --search --memory-cap "$cap" \
        --json > "$OUT/$name.search.json"
done
# The TOP configurations of each case, as train flags.
python3 - "$OUT" "$TOP" "${CASES[@]}" > "$OUT/runs.txt" <<'PY'
import json, sys
out, top, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for c in cases:
    name = c.split("|")[0]
    v = json.load(open(f"{out}/{name}.search.json"))
    ranked = v["search"]["ranked"]
    # The top ones, and the last within the cap: does the ranking tell them apart?
    picks = list(range(min(top, len(ranked))))
    if len(ranked) > top:
        picks.append(len(ranked) - 1)
    for i in picks:
        ch = ranked[i]["choice"]
        flags = (f"--world {ch['nodes'] * ch['ranks_per_node']} --stage {ch['stage']} "
                 f"--prefetch {ch['prefetch']} --recompute {ch['recompute']} "
                 f"--grad-accum {ch['grad_accum']}")
        print(f"{name}|{i + 1}|{flags}")
PY
for r in $(seq 1 "$ROUNDS"); do
    while IFS='|' read -r name rank flags; do
        model=""
        for c in "${CASES[@]}"; do
            IFS='|' read -r n m _ _ <<< "$c"
            if [ "$n" = "$name" ]; then model=$m; fi
        done
        # shellcheck disable=SC2086
        "$BIN" train $model $flags --steps "$STEPS" --lr 1e-3 --no-progress \
            --log-json "$OUT/$name.$rank.$r.jsonl" > /dev/null 2>&1 < /dev/null
        if [ "$r" = 1 ]; then
            echo "$name #$rank: $BIN train $model $flags --steps $STEPS --lr 1e-3" >> "$OUT/commands.txt"
        fi
    done < "$OUT/runs.txt"
done
python3 - "$OUT" "$ROUNDS" "$TOP" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs = [l.strip().split("|") for l in open(f"{out}/runs.txt") if l.strip()]
cases = []
for name, rank, flags in runs:
    if name not in cases:
        cases.append(name)
rows = []
print("| case | rank by --search | configuration | predicted step (ms) | predicted peak (MiB) | measured step, median of rounds (ms) | round medians (ms) | vs the fastest of the top ones |")
print("|---|---|---|---|---|---|---|---|")
verdicts = []
for name in cases:
    v = json.load(open(f"{out}/{name}.search.json"))
    ranked = v["search"]["ranked"]
    mine = [(int(k), f) for n, k, f in runs if n == name]
    meas = {}
    for k, f in mine:
        meds = []
        for r in range(1, rounds + 1):
            steps = [json.loads(l) for l in open(f"{out}/{name}.{k}.{r}.jsonl")][2:]
            meds.append(statistics.median(x["step_time_s"] for x in steps))
        meas[k] = (statistics.median(meds), meds)
    fastest = min(m for k, (m, _) in meas.items() if k <= int(sys.argv[3]))
    for k, f in mine:
        r = ranked[k - 1]
        m, meds = meas[k]
        print(f"| {name} (of {len(ranked)} within the cap, {v['search']['evaluated']} predicted) | {k} | {f} | {r['step_s']*1e3:.1f} | {r['peak_bytes']/2**20:.2f} | {m*1e3:.1f} | {', '.join(f'{x*1e3:.1f}' for x in meds)} | {(m/fastest-1)*100:+.1f}% |")
        rows.append(dict(case=name, rank=k, flags=f, pred_step_s=r["step_s"], pred_peak=r["peak_bytes"], meas_step_s=m, round_medians_s=meds))
    top = meas[1][0]
    # The comparison is among the top ones; the last-ranked shows the spread.
    fastest = min(m for k, (m, _) in meas.items() if k <= int(sys.argv[3]))
    ok = top <= fastest * 1.05
    verdicts.append((name, ok, (top / fastest - 1) * 100))
print()
for name, ok, pct in verdicts:
    print(f"- {name}: the search's choice measured {pct:+.1f}% against the fastest run: {'confirmed' if ok else 'NOT confirmed'}")
json.dump(rows, open(f"{out}/rows.json", "w"), indent=1)
PY
