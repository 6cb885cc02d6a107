#!/usr/bin/env bash
# Offload on the simulated device (bench/RESULTS.md, "Devices: offload on the simulated
# device"): gpt, world 2, stage 3, with --offload none, optimizer and params, alternating in
# rounds. Per run: the median step of steps 3.. (rank 0's --log-json), the device's peak,
# in all and by category (rank 0's, from --summary-json), and the final loss (the three must
# be equal: OFFL-1).
#
# The delays are off (--sim-delay-us 0), so a step's time is this CPU's work: the kernels,
# the host functions and the copies. It is not what a GPU would take.
#
#   cargo build --release -p shardline-runtime --bin shardline
#   ROUNDS=3 STEPS=20 bench/device-offload.sh        # table on stdout, JSON in $OUT
set -euo pipefail
BIN=${BIN:-target/release/shardline}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-20}
OUT=${OUT:-out/device-offload}
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
    for o in none optimizer params; do
        "$BIN" train --device sim --sim-delay-us 0 --model gpt --dataset text --n-layer 4 \
            --n-head 4 --n-embd "${EMBD:-128}" --block-size 64 --batch-size 16 \
            --optimizer adamw --lr 1e-3 --world 2 --stage 3 --steps "$STEPS" --offload "$o" \
            --no-progress --log-json "$OUT/$o-$r.jsonl" --summary-json "$OUT/$o-$r.json" > /dev/null
    done
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = {}
for o in ["none", "optimizer", "params"]:
    steps, peak, cats, loss = [], set(), None, set()
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{out}/{o}-{r}.jsonl")]
        steps.append(statistics.median(x["step_time_s"] for x in lines[2:]) * 1e3)
        s = json.load(open(f"{out}/{o}-{r}.json"))
        peak.add(s["peak_bytes"][0]); cats = dict(s["peak_by_category"][0])
        loss.add(s["final_loss"])
    rows[o] = {"step_ms_median_of_rounds": statistics.median(steps), "step_ms_rounds": steps,
               "device_peak_bytes": max(peak), "device_peak_by_category": cats,
               "final_loss": sorted(loss)}
base = rows["none"]
print("offload | step ms (median of rounds) | vs none | device peak | saved | final loss")
print("---|---|---|---|---|---")
for o, v in rows.items():
    print(f"{o} | {v['step_ms_median_of_rounds']:.1f} | {v['step_ms_median_of_rounds'] / base['step_ms_median_of_rounds']:.3f}x"
          f" | {v['device_peak_bytes'] / 2**20:.2f} MiB | {1 - v['device_peak_bytes'] / base['device_peak_bytes']:.1%}"
          f" | {v['final_loss']}")
print()
keys = [k for k in base["device_peak_by_category"] if any(rows[o]["device_peak_by_category"].get(k) for o in rows)]
print("offload | " + " | ".join(keys))
print("---|" + "---|" * len(keys))
for o, v in rows.items():
    print(o + " | " + " | ".join(f"{v['device_peak_by_category'].get(k, 0) / 2**20:.2f} MiB" for k in keys))
json.dump(rows, open(f"{out}/device_offload.json", "w"), indent=1)
PY
