#!/usr/bin/env bash
# Offload on the simulated device (bench/RESULTS.md, "Devices: offload on the simulated
# device"): gpt, world 2, stage 3, with --offload none, optimizer and params, alternating in
# rounds. Per run: the median step of steps 3.. and the device's peak and end-of-step bytes
# (rank 0's log), and the final loss (the three must be equal: OFFL-1).
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
            --no-progress --log-json "$OUT/$o-$r.jsonl" > /dev/null
    done
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = {}
for o in ["none", "optimizer", "params"]:
    steps, peak, end, loss = [], set(), set(), set()
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{out}/{o}-{r}.jsonl")]
        steps.append(statistics.median(x["step_time_s"] for x in lines[2:]) * 1e3)
        peak.add(lines[-1]["device_peak_bytes"]); end.add(lines[-1]["device_bytes"])
        loss.add(lines[-1]["loss"])
    rows[o] = {"step_ms_median_of_rounds": statistics.median(steps), "step_ms_rounds": steps,
               "device_peak_bytes": max(peak), "device_end_bytes": max(end),
               "final_loss": sorted(loss)}
base = rows["none"]
print("offload | step ms (median of rounds) | vs none | device peak | saved | end of step | final loss")
print("---|---|---|---|---|---|---")
for o, v in rows.items():
    print(f"{o} | {v['step_ms_median_of_rounds']:.1f} | {v['step_ms_median_of_rounds'] / base['step_ms_median_of_rounds']:.3f}x"
          f" | {v['device_peak_bytes'] / 2**20:.2f} MiB | {1 - v['device_peak_bytes'] / base['device_peak_bytes']:.1%}"
          f" | {v['device_end_bytes'] / 2**20:.2f} MiB | {v['final_loss']}")
json.dump(rows, open(f"{out}/device_offload.json", "w"), indent=1)
PY
