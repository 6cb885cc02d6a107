#!/usr/bin/env bash
# What `--live-recovery` costs a step when nothing fails: alternating launches of the same job
# with and without the flag on this host, the median `step_time_s` of each run's --log-json
# (the first 5 steps left out), then per job the median over the rounds and their ratio, and
# the median and range of each round's own ratio (the two runs of a round back to back).
# Under live recovery a step's updates begin after a one-value commit all-reduce that follows
# its last reduction, instead of as each unit's reduction lands (LIVE-1; at stages 1 and 2 the
# loss all-reduce is the commit), and a watch thread reads the rank's collectives 20 times a
# second (LIVE-11); nothing else in a step changes. Odd rounds run the flag first.
#   ROUNDS=5 STEPS=60 bash bench/live-overhead.sh
# BIN is the directory holding `shardline` (default target/release, built here).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release}
OUT=${OUT:-out/live-overhead}
STEPS=${STEPS:-60}
mkdir -p "$OUT"
if [ "$BIN" = target/release ]; then
    cargo build --release -p shardline-runtime --bin shardline
fi
# name|processes|train arguments
JOBS=(
    "gpt-stage0-w2|2|--model gpt --dataset text --n-layer 4 --n-embd 128 --stage 0"
    "mlp-1024x4-stage0-w2|2|--model mlp-bn --hidden 1024 --depth 4 --dataset synthetic --input-dim 784 --classes 10 --batch-size 256 --stage 0"
    "mlp-1024x4-hsdp2x2-stage3|4|--model mlp-bn --hidden 1024 --depth 4 --dataset synthetic --input-dim 784 --classes 10 --batch-size 256 --stage 3 --shard-group 2"
)
for r in $(seq 1 "${ROUNDS:-5}"); do
    for job in "${JOBS[@]}"; do
        IFS='|' read -r name nproc args <<< "$job"
        order="plain live"
        [ $((r % 2)) -eq 1 ] && order="live plain"
        for side in $order; do
            flag=()
            [ "$side" = live ] && flag=(--live-recovery)
            log="$OUT/$name-$side-$r.jsonl"
            rm -f "$log"
            # shellcheck disable=SC2086
            "$BIN/shardline" launch --nproc-per-node "$nproc" "${flag[@]}" -- train $args \
                --steps "$STEPS" --no-progress --log-json "$log" > /dev/null 2>&1
        done
    done
    echo "round $r done"
done
python3 - "$OUT" <<'EOF'
import glob, json, os, statistics, sys
out = sys.argv[1]
rows = {}
for p in sorted(glob.glob(os.path.join(out, "*.jsonl"))):
    name, side, _ = os.path.basename(p)[:-6].rsplit("-", 2)
    t = [json.loads(l)["step_time_s"] for l in open(p)][5:]
    rows.setdefault(name, {}).setdefault(side, []).append(statistics.median(t))
table = []
print(f"{'job':28} {'plain ms':>10} {'live ms':>10} {'live/plain':>10}   (median of round medians; range)")
for name, s in rows.items():
    a, b = statistics.median(s["plain"]), statistics.median(s["live"])
    rng = lambda v: f"{min(v)*1e3:.2f}-{max(v)*1e3:.2f}"
    # Each round ran the two back to back: its own ratio cancels the host's drift.
    paired = sorted(l / p for p, l in zip(s["plain"], s["live"]))
    print(f"{name:28} {a*1e3:10.2f} {b*1e3:10.2f} {b/a:10.3f}   plain {rng(s['plain'])}, live {rng(s['live'])}")
    print(f"{'':28} per-round live/plain: median {statistics.median(paired):.3f}, range {paired[0]:.3f}-{paired[-1]:.3f}")
    table.append({"job": name, "plain_s": a, "live_s": b, "ratio": b / a,
                  "paired_ratios": paired, "paired_median": statistics.median(paired),
                  "plain_rounds": s["plain"], "live_rounds": s["live"]})
json.dump(table, open(os.path.join(out, "summary.json"), "w"), indent=1)
EOF
