#!/usr/bin/env bash
# The loss-curve effect of a packed reduction across shard groups (`--cross-node-reduce-dtype`,
# QREDUCE-1..2) against f32, at several seeds: gpt on the bundled text, 2 groups of 2 ranks
# (threads), stage 3. Prints the final training loss (mean of the last 20 steps) and the
# held-out loss per dtype and seed, and their means; writes $OUT/cross-node-reduce.json.
#
#   SEEDS="1 2 3" STEPS=300 LR=1e-3 bash bench/cross-node-reduce.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/shardline}
OUT=${OUT:-out/cross-node-reduce}
SEEDS=${SEEDS:-1 2 3}
STEPS=${STEPS:-300}
LR=${LR:-1e-3}
mkdir -p "$OUT"
for seed in $SEEDS; do
    for dtype in f32 int8 fp8; do
        extra=()
        [ "$dtype" = f32 ] || extra=(--cross-node-reduce-dtype "$dtype")
        "$BIN" train --model gpt --dataset text --n-layer 2 --n-head 2 --n-embd 64 \
            --block-size 64 --batch-size 16 --optimizer adamw --lr "$LR" --world 4 --stage 3 \
            --shard-group 2 --steps "$STEPS" --no-progress --seed "$seed" "${extra[@]}" \
            --summary-json "$OUT/$dtype-$seed.json" > /dev/null
    done
done
python3 - "$OUT" $SEEDS <<'PY'
import json, statistics, sys
out, seeds = sys.argv[1], sys.argv[2:]
rows, table = [], {}
for d in ["f32", "int8", "fp8"]:
    for s in seeds:
        j = json.load(open(f"{out}/{d}-{s}.json"))
        tail = statistics.mean(j["losses"][-20:])
        rows.append({"dtype": d, "seed": int(s), "train_loss_last20": tail,
                     "first_loss": j["losses"][0], "test_loss": j["test_loss"]})
        table.setdefault(d, []).append((tail, j["test_loss"]))
print("| dtype | seeds | train loss, mean of the last 20 steps (per seed) | held-out loss (per seed) | mean held-out | vs f32 |")
print("|---|---|---|---|---|---|")
base = statistics.mean(t for _, t in table["f32"])
for d, v in table.items():
    m = statistics.mean(t for _, t in v)
    print(f"| {d} | {len(v)} | {', '.join(f'{a:.4f}' for a, _ in v)} | "
          f"{', '.join(f'{t:.4f}' for _, t in v)} | {m:.4f} | {100 * (m - base) / base:+.2f}% |")
json.dump(rows, open(f"{out}/cross-node-reduce.json", "w"), indent=1)
PY
