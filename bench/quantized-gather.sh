#!/usr/bin/env bash
# Quantized parameter gathers against f32 (bench/RESULTS.md, "Quantized parameter gathers"):
# gpt on the bundled text (4 layers, 4 heads, embd 128, block 64, batch 16, AdamW 1e-3),
# world 2, stage 3, with --gather-dtype none/int8/fp8 (block 256), SEEDS seeds each, STEPS
# steps. Per run: the gather bytes rank 0 sent per step (the lanes' counters), the final
# training loss (mean of the last 10 steps) and the held-out (test) loss at the end.
#
#   cargo build --release -p shardline-runtime --bin shardline
#   SEEDS="1 2 3" STEPS=300 bench/quantized-gather.sh      # table on stdout, JSON in $OUT
set -euo pipefail
BIN=${BIN:-target/release/shardline}
SEEDS=${SEEDS:-1 2 3}
STEPS=${STEPS:-300}
OUT=${OUT:-out/quantized-gather}
mkdir -p "$OUT"
for s in $SEEDS; do
    for g in f32 int8 fp8; do
        flag=()
        [ "$g" != f32 ] && flag=(--gather-dtype "$g")
        "$BIN" train --model gpt --dataset text --n-layer 4 --n-head 4 --n-embd 128 \
            --block-size 64 --batch-size 16 --optimizer adamw --lr 1e-3 --world 2 --stage 3 \
            --steps "$STEPS" --seed "$s" "${flag[@]}" --no-progress \
            --log-json "$OUT/$g-$s.jsonl" > "$OUT/$g-$s.txt"
    done
done
python3 - "$OUT" "$SEEDS" <<'PY'
import json, re, statistics, sys
out, seeds = sys.argv[1], sys.argv[2].split()
rows = {}
for g in ["f32", "int8", "fp8"]:
    first, final, val, gb = [], [], [], set()
    for s in seeds:
        lines = [json.loads(l) for l in open(f"{out}/{g}-{s}.jsonl") if '"loss"' in l]
        steps = [l for l in lines if "step" in l and "loss" in l]
        first.append(steps[0]["loss"])
        final.append(statistics.mean(l["loss"] for l in steps[-10:]))
        gb.add(steps[-1]["gather_bytes"])
        m = re.findall(r"test loss\s+([0-9.]+)", open(f"{out}/{g}-{s}.txt").read())
        val.append(float(m[-1]) if m else float("nan"))
    rows[g] = {"gather_bytes_per_step": sorted(gb), "first_loss": first, "final_loss": final,
               "final_loss_mean": statistics.mean(final), "val_loss": val}
base = rows["f32"]
print("gathers | gather bytes per step (rank 0) | vs f32 | final train loss per seed | mean | vs f32 | test loss per seed")
print("---|---|---|---|---|---|---")
for g, v in rows.items():
    print(f"{g} | {v['gather_bytes_per_step']} | {v['gather_bytes_per_step'][0] / base['gather_bytes_per_step'][0]:.3f}"
          f" | {', '.join(f'{x:.4f}' for x in v['final_loss'])} | {v['final_loss_mean']:.4f}"
          f" | {v['final_loss_mean'] / base['final_loss_mean'] - 1:+.2%} | {', '.join(f'{x:.4f}' for x in v['val_loss'])}")
json.dump(rows, open(f"{out}/quantized_gather.json", "w"), indent=1)
PY
