#!/usr/bin/env bash
# `shardline plan` against `shardline train` on this machine (bench/RESULTS.md, "shardline
# plan: predicted against measured"). First the machine profile, from microbenchmarks only
# (collectives on the local transport at worlds 2-4, then machine-profile's GEMM probes, the
# jobs' own matrix products from `plan --json`'s `products` and fresh allocations, memory
# bandwidth); then per job: the prediction (plan --json), then the run with the same
# flags (train --log-json), ROUNDS times, the jobs alternating within a round. Step time: the
# prediction's steady step against the median over rounds of each round's median step from
# step 3 on (rank 0's log: the slowest rank of the process), and the fastest such step. Memory: rank 0's peak and its state categories against the
# prediction. Errors are signed: (predicted - measured) / measured.
#
#   cargo build --release -p shardline-runtime -p shardline-bench --bins
#   ROUNDS=2 STEPS=12 bench/plan-validate.sh          # table on stdout, JSON in $OUT
#   PROFILE=profile.json bench/plan-validate.sh   # an existing profile instead
#   ONLY=gpt-w1-s0,mlp-w2-s3 bench/plan-validate.sh  # a subset of the jobs below
set -euo pipefail
BIN=${BIN:-target/release/shardline}
BENCH=${BENCH:-target/release/shardline-bench}
STEPS=${STEPS:-12}
ROUNDS=${ROUNDS:-2}
OUT=${OUT:-out/plan-validate}
mkdir -p "$OUT"
GPT="--model gpt --n-layer 4 --n-head 4 --n-embd 128 --block-size 64 --batch-size 16 --optimizer adamw"
MLP="--model mlp-bn --dataset synthetic --hidden 1024 --depth 4 --input-dim 784 --batch-size 256 --sync-bn off"
# name | model flags | job flags (the same for plan and train)
JOBS=(
    "gpt-w1-s0|$GPT|--world 1 --stage 0"
    "gpt-w2-s0|$GPT|--world 2 --stage 0"
    "gpt-w2-s2|$GPT|--world 2 --stage 2"
    "gpt-w2-s3-p1|$GPT|--world 2 --stage 3 --prefetch 1"
    "gpt-w2-s3-accum2|$GPT|--world 2 --stage 3 --grad-accum 2"
    "gpt-w2-s3-recompute|$GPT|--world 2 --stage 3 --recompute units"
    "gpt-w4-s3-p0|$GPT|--world 4 --stage 3 --prefetch 0"
    "gpt-w4-s3-p2|$GPT|--world 4 --stage 3 --prefetch 2"
    "mlp-w1-s0|$MLP|--world 1 --stage 0"
    "mlp-w2-s0|$MLP|--world 2 --stage 0"
    "mlp-w2-s3|$MLP|--world 2 --stage 3"
    "mlp-w4-s3|$MLP|--world 4 --stage 3"
)
if [ -n "${ONLY:-}" ]; then
    picked=()
    for job in "${JOBS[@]}"; do
        case ",$ONLY," in *",${job%%|*},"*) picked+=("$job") ;; esac
    done
    [ ${#picked[@]} -gt 0 ] || { echo "ONLY=$ONLY names no job" >&2; exit 2; }
    JOBS=("${picked[@]}")
fi
if [ -z "${PROFILE:-}" ]; then
    PROFILE=$OUT/profile.json
    "$BENCH" collectives --transport local --world 2,3,4 --op all-reduce,reduce-scatter \
        --min-bytes 4K --max-bytes 8M --iters 40 --no-limits --json "$OUT/coll.json" > /dev/null
    "$BENCH" collectives --transport local --world 2,3,4 --op all-gather --in-place \
        --min-bytes 4K --max-bytes 8M --iters 40 --no-limits --json "$OUT/ag.json" > /dev/null
    # The jobs' products, from a plan without a profile (shapes only).
    shapes=()
    for job in "${JOBS[@]}"; do
        IFS='|' read -r name model flags <<< "$job"
        # shellcheck disable=SC2086
        "$BIN" plan $model $flags --json > "$OUT/$name.shapes.json"
        shapes+=("$OUT/$name.shapes.json")
    done
    "$BENCH" machine-profile --collectives "$OUT/coll.json,$OUT/ag.json" \
        --products "$(IFS=,; echo "${shapes[*]}")" --out "$PROFILE"
fi
uptime > "$OUT/load.txt"
rm -f "$OUT/commands.txt"
for job in "${JOBS[@]}"; do
    IFS='|' read -r name model flags <<< "$job"
    # shellcheck disable=SC2086
    "$BIN" plan $model $flags --profile "$PROFILE" --json > "$OUT/$name.plan.json"
    echo "$name: $BIN plan $model $flags --profile $PROFILE" >> "$OUT/commands.txt"
done
for r in $(seq 1 "$ROUNDS"); do
    for job in "${JOBS[@]}"; do
        IFS='|' read -r name model flags <<< "$job"
        data=$([ "${model#*gpt}" != "$model" ] && echo "--dataset text" || echo "")
        # shellcheck disable=SC2086
        "$BIN" train $model $data $flags --steps "$STEPS" --lr 1e-3 --no-progress \
            --log-json "$OUT/$name.$r.jsonl" --summary-json "$OUT/$name.$r.summary.json" > /dev/null
    done
done
uptime >> "$OUT/load.txt"
echo "load (after the profile, then after the runs):"; cat "$OUT/load.txt"
python3 - "$OUT" "$ROUNDS" "${JOBS[@]}" <<'PY'
import json, statistics, sys
out, rounds, jobs = sys.argv[1], int(sys.argv[2]), [j.split("|")[0] for j in sys.argv[3:]]
err = lambda p, m: (p - m) / m * 100 if m else float("nan")
rows = []
print(f"{'job':<22}{'pred ms':>9}{'meas ms':>9}{'err':>8}{'min ms':>8}{'err min':>9}"
      f"{'exposed p/m ms':>16}{'pred MiB':>10}{'meas MiB':>10}{'err':>8}  state")
for name in jobs:
    p = json.load(open(f"{out}/{name}.plan.json"))
    s = json.load(open(f"{out}/{name}.1.summary.json"))
    logs = [[json.loads(l) for l in open(f"{out}/{name}.{r}.jsonl")][2:]
            for r in range(1, rounds + 1)]
    meds = [statistics.median(x["step_time_s"] for x in steps) for steps in logs]
    med = statistics.median(meds)
    low = min(x["step_time_s"] for steps in logs for x in steps)
    exp = statistics.median(statistics.median(x["comm_exposed_s"] for x in steps)
                            for steps in logs)
    peaks = dict(s["peak_by_category"][0])
    state = ["full_params", "shard_params", "grads", "optimizer_state", "gathered_units"]
    exact = [k for k in state if any(r["category"] == k and r["bytes"] == peaks.get(k, 0)
                                     for r in p["memory"]) or not peaks.get(k)]
    st = p["step"]
    row = dict(job=name, pred_step_s=st["step_s"], meas_step_s=med, round_medians_s=meds,
               min_step_s=low, pred_compute_s=st["compute_s"],
               step_err_pct=err(st["step_s"], med), min_err_pct=err(st["step_s"], low),
               pred_exposed_s=st["exposed_s"], meas_exposed_s=exp,
               pred_peak=p["peak_bytes"], meas_peak=s["peak_bytes"][0],
               peak_err_pct=err(p["peak_bytes"], s["peak_bytes"][0]),
               pred=dict((r["category"], r["bytes"]) for r in p["memory"]), meas=peaks)
    rows.append(row)
    miss = [k for k in state if k not in exact]
    print(f"{name:<22}{st['step_s']*1e3:>9.1f}{med*1e3:>9.1f}{row['step_err_pct']:>+7.0f}%"
          f"{low*1e3:>8.1f}{row['min_err_pct']:>+8.0f}%{st['exposed_s']*1e3:>8.1f}/{exp*1e3:<7.1f}"
          f"{p['peak_bytes']/2**20:>10.2f}{s['peak_bytes'][0]/2**20:>10.2f}{row['peak_err_pct']:>+7.1f}%"
          f"  {'exact' if not miss else 'off: ' + ','.join(miss)}")
json.dump(rows, open(f"{out}/rows.json", "w"), indent=1)
PY
