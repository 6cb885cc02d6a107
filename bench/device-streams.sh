#!/usr/bin/env bash
# One communicator against separate ones on the simulated device (bench/RESULTS.md, "Devices:
# one communicator or two"): gpt, world 2, stage 3, prefetch 1, with gathers and reductions
# on their own streams and communicators (the default) or on one (--sim-one-comm), at each
# delay bound in DELAYS, alternating in rounds. Per run: the median step of steps 3.. (rank
# 0's log) and rank 0's overlap line (communication time that ran while compute did).
#
# Simulated timing: every device operation first waits a seeded random delay up to the
# bound, standing in for a GPU's kernel and link times; kernels run on this CPU. The figures
# compare schedules on the simulator; they are not GPU measurements.
#
#   cargo build --release -p shardline-runtime --bin shardline
#   ROUNDS=3 STEPS=12 DELAYS="0 200" bench/device-streams.sh   # table on stdout, JSON in $OUT
set -euo pipefail
BIN=${BIN:-target/release/shardline}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-12}
DELAYS=${DELAYS:-0 200}
OUT=${OUT:-out/device-streams}
mkdir -p "$OUT"
for r in $(seq 1 "$ROUNDS"); do
    for d in $DELAYS; do
        for c in two one; do
            flag=()
            [ "$c" = one ] && flag=(--sim-one-comm)
            "$BIN" train --device sim --sim-delay-us "$d" --sim-seed "$r" "${flag[@]}" \
                --model gpt --dataset text --n-layer 4 --n-head 4 --n-embd 128 \
                --block-size 64 --batch-size 16 --optimizer adamw --lr 1e-3 --world 2 \
                --stage 3 --prefetch 1 --steps "$STEPS" --no-progress \
                --log-json "$OUT/$c-$d-$r.jsonl" > "$OUT/$c-$d-$r.txt"
        done
    done
done
python3 - "$OUT" "$ROUNDS" "$DELAYS" <<'PY'
import json, re, statistics, sys
out, rounds, delays = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
rows = []
for d in delays:
    for c in ["two", "one"]:
        steps, hidden, loss = [], [], set()
        for r in range(1, rounds + 1):
            lines = [json.loads(l) for l in open(f"{out}/{c}-{d}-{r}.jsonl")]
            steps.append(statistics.median(x["step_time_s"] for x in lines[2:]) * 1e3)
            loss.add(lines[-1]["loss"])
            m = re.search(r"(\d+)% of it while compute ran", open(f"{out}/{c}-{d}-{r}.txt").read())
            hidden.append(int(m.group(1)))
        rows.append({"delay_us": int(d), "communicators": c,
                     "step_ms_median_of_rounds": statistics.median(steps), "step_ms_rounds": steps,
                     "hidden_pct_rounds": hidden, "final_loss": sorted(loss)})
print("delay bound | communicators | step ms (median of rounds) | rounds | comm hidden behind compute | final loss")
print("---|---|---|---|---|---")
for v in rows:
    print(f"{v['delay_us']} us | {v['communicators']} | {v['step_ms_median_of_rounds']:.1f} | "
          + ", ".join(f"{s:.1f}" for s in v["step_ms_rounds"]) + " | "
          + ", ".join(f"{h}%" for h in v["hidden_pct_rounds"]) + f" | {v['final_loss']}")
json.dump(rows, open(f"{out}/device_streams.json", "w"), indent=1)
PY
