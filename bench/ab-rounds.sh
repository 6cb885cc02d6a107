#!/usr/bin/env bash
# Alternating rounds of two builds of Shardline on the same machine, so that a change's effect
# on the training step and the overlap figures is read against each build's own spread:
#   OLD=/path/to/old/bin NEW=target/release ROUNDS=5 bash bench/ab-rounds.sh
# OLD and NEW are directories holding `shardline` and `shardline-bench`. Per round and build:
# - `shardline train` (the main job: mlp-bn on digits, 4 ranks in one process, stage 3),
#   median `step_time_s` of its --log-json;
# - `shardline launch --nproc-per-node 4 -- train` (the same job as processes), the same;
# - `shardline-bench overlap --link-rate 2gbit --prefetch 1` (ranks in one process);
# - with root, `shardline-bench overlap --nodes 2 --link-rate 4gbit --prefetch 1` (two
#   network-namespace nodes over shaped links).
# Then prints, per figure, each build's median and range over the rounds (bench/ab-rounds.py).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OLD:?OLD=directory of the baseline build}"
NEW=${NEW:-target/release}
OUT=${OUT:-out/ab-rounds}
mkdir -p "$OUT"
steps=(--steps 200 --no-progress)
for r in $(seq 1 "${ROUNDS:-5}"); do
    for side in old new; do
        bin=$OLD; [ "$side" = new ] && bin=$NEW
        rm -f "$OUT/$side-train-$r.jsonl" "$OUT/$side-launch-$r.jsonl"
        "$bin/shardline" train "${steps[@]}" --log-json "$OUT/$side-train-$r.jsonl" > /dev/null
        "$bin/shardline" launch --nproc-per-node 4 -- train "${steps[@]}" \
            --log-json "$OUT/$side-launch-$r.jsonl" > /dev/null 2>&1
        "$bin/shardline-bench" overlap --link-rate 2gbit --prefetch 1 --steps 40 --warmup 4 \
            --json "$OUT/$side-overlap-$r.json" > /dev/null
        if [ "$(id -u)" = 0 ]; then
            "$bin/shardline-bench" overlap --nodes 2 --link-rate 4gbit --prefetch 1 --steps 40 \
                --warmup 4 --busbw-sizes --json "$OUT/$side-nodes-$r.json" > /dev/null 2>&1
        fi
        echo "round $r $side done"
    done
done
python3 bench/ab-rounds.py "$OUT"
