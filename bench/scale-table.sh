#!/usr/bin/env bash
# The shaped-link table: full shard against HSDP (`--shard-group node`) over two
# network-namespace nodes of two ranks each (shm inside a node, TCP across, every node link
# shaped to $RATE by tc tbf), with f32, bf16 or int8 parameter gathers and, under HSDP, an
# f32 or int8 reduction across the nodes. Needs root (ip netns, veth, bridge, tc).
#
# Model: `shardline-bench overlap --nodes` launches mlp-bn on synthetic data only (its
# launched jobs are built for it), so the table is mlp-bn, width $HIDDEN (1024), depth
# $DEPTH (4), stage 3, prefetch 1, global batch $BATCH (256), lr 0.01.
#
# Per row, means over the seeds: bytes rank 0 sent per step inside its node and to the other
# node, counted by its hybrid transport where it routes them (HYB-4, `--log-json`'s
# intra_node_bytes and inter_node_bytes; medians after the warmup); bytes per rank and step
# across nodes at the nodes' interfaces (veth transmit counters over the whole job, headers
# and the store's heartbeats included, over its steps and ranks), a cross-check; the step
# time and exposed communication (medians after the warmup, from the workers' traces); the
# final loss (the last step's, rank 0's log) and its difference from full-shard f32's. A third sharding mode, hpz (`--reshard-after-forward node`), runs only
# when `shardline train --help` lists that flag. Writes $OUT/scale-table.json and
# $OUT/scale-table.md and prints the table's four checks.
#
#   RATE=1gbit SEEDS="1 2 3" STEPS=60 bash bench/scale-table.sh
#   TRAIN_ARGS="--momentum 0.9" STEPS=200 bash bench/scale-table.sh   # f32 lowers the loss by 30%
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=${BENCH:-target/release/shardline-bench}
export SHARDLINE_BIN=${SHARDLINE_BIN:-$(dirname "$BENCH")/shardline}
OUT=${OUT:-out/scale-table}
RATE=${RATE:-1gbit}
SEEDS=${SEEDS:-1 2 3}
STEPS=${STEPS:-60}
WARMUP=${WARMUP:-4}
HIDDEN=${HIDDEN:-1024}
DEPTH=${DEPTH:-4}
BATCH=${BATCH:-256}
# Extra `shardline train` flags for every run, e.g. TRAIN_ARGS="--momentum 0.9".
TRAIN_ARGS=${TRAIN_ARGS:-}
extra=""
for w in $TRAIN_ARGS; do extra+=" --train-arg=$w"; done
mkdir -p "$OUT/runs"

# name, then the flags of the mode
modes=(
    "full/f32|"
    "full/bf16|--param-dtype bf16 --reduce-dtype f32"
    "full/int8|--gather-dtype int8"
    "hsdp/f32/x-f32|--shard-group node"
    "hsdp/bf16/x-f32|--shard-group node --param-dtype bf16 --reduce-dtype f32"
    "hsdp/int8/x-f32|--shard-group node --gather-dtype int8"
    "hsdp/f32/x-int8|--shard-group node --cross-node-reduce-dtype int8"
    "hsdp/bf16/x-int8|--shard-group node --param-dtype bf16 --reduce-dtype f32 --cross-node-reduce-dtype int8"
    "hsdp/int8/x-int8|--shard-group node --gather-dtype int8 --cross-node-reduce-dtype int8"
)
hpz="--train-arg=--reshard-after-forward --train-arg=node"
if "$SHARDLINE_BIN" train --help | grep -q -- '--reshard-after-forward'; then
    # Secondary shards are f32 copies of the decoded unit: only the first gather is packed.
    modes+=("hpz/f32|$hpz" "hpz/bf16|$hpz --param-dtype bf16 --reduce-dtype f32"
        "hpz/int8|$hpz --gather-dtype int8")
else
    echo "hpz: skipped (shardline train --help lists no --reshard-after-forward)"
fi

# MODES="full/f32 hsdp/f32/x-f32": only these rows (the checks need full/f32, hsdp/f32/x-f32
# and hsdp/int8/x-int8; those missing are reported as not run).
if [ -n "${MODES:-}" ]; then
    picked=()
    for m in "${modes[@]}"; do
        for w in $MODES; do [ "${m%%|*}" = "$w" ] && picked+=("$m"); done
    done
    modes=("${picked[@]}")
fi

for m in "${modes[@]}"; do
    name=${m%%|*}
    flags=${m#*|}
    for seed in $SEEDS; do
        tag=$(echo "$name" | tr / -)-$seed
        # shellcheck disable=SC2086 # the mode's flags are words
        "$BENCH" overlap --nodes 2 --nproc-per-node 2 --link-rate "$RATE" --prefetch 1 \
            --steps "$STEPS" --warmup "$WARMUP" --busbw-sizes --hidden "$HIDDEN" \
            --depth "$DEPTH" --batch-size "$BATCH" --seed "$seed" --timeline-prefetch 1 \
            --keep-dir "$OUT/runs/$tag" --json "$OUT/runs/$tag.json" $flags $extra \
            > "$OUT/runs/$tag.txt"
        echo "$name seed $seed: $(grep 'prefetch 1:' "$OUT/runs/$tag.txt")"
    done
done

python3 - "$OUT" "$RATE" "$STEPS" "$WARMUP" "$SEEDS" "${modes[@]}" <<'PY'
import json, statistics, sys
out, rate, steps, warmup, seeds, modes = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                          sys.argv[5].split(), sys.argv[6:])
names = [m.split("|")[0] for m in modes]
def log(tag):
    with open(f"{out}/runs/{tag}/p1.jsonl") as f:
        return [json.loads(l) for l in f if l.strip()]
rows = []
for name in names:
    per = []
    for s in seeds:
        tag = name.replace("/", "-") + f"-{s}"
        r = json.load(open(f"{out}/runs/{tag}.json"))["rows"][0]
        l = log(tag)
        counted = l[warmup:] or l
        med = lambda k: statistics.median(x[k] for x in counted)
        gathers = [x.get("inter_node_gather_bytes") for x in counted]
        gather_across = None if None in gathers else statistics.median(gathers)
        per.append({"seed": int(s), "inside": med("intra_node_bytes"), "across": med("inter_node_bytes"),
                    "gather_across": gather_across,
                    "across_veth": r["inter_node_bytes"], "step_ms": r["step_ms"],
                    "exposed_ms": r["exposed_ms"], "first_loss": l[0]["loss"], "final_loss": l[-1]["loss"]})
    mean = lambda k: statistics.mean(p[k] for p in per)
    ga = [p["gather_across"] for p in per]
    rows.append({"mode": name, "seeds": per, "inside_bytes": mean("inside"), "across_bytes": mean("across"),
                 "gather_across_bytes": None if None in ga else statistics.mean(ga),
                 "across_veth_bytes": mean("across_veth"), "step_ms": mean("step_ms"),
                 "exposed_ms": mean("exposed_ms"), "first_loss": mean("first_loss"),
                 "final_loss": mean("final_loss")})
by = {r["mode"]: r for r in rows}
if "full/f32" not in by:
    sys.exit("full/f32 is the baseline of every column: include it in MODES")
base = by["full/f32"]
for r in rows:
    r["loss_vs_f32_pct"] = 100 * (r["final_loss"] - base["final_loss"]) / base["final_loss"]
    r["across_vs_f32"] = r["across_bytes"] / base["across_bytes"]
    r["speedup_vs_f32"] = base["step_ms"] / r["step_ms"]
mib = lambda b: f"{b / 2**20:.2f}"
md = [f"links {rate} (tc tbf), 2 nodes x 2 ranks, seeds {' '.join(seeds)}, {steps} steps",
      "",
      "| mode | inside node MiB/step (rank 0, transport) | across nodes MiB/step (rank 0, transport) | of which gathers | x full f32 | across MiB/rank/step (veth) | step ms | exposed ms | speedup | final loss | vs f32 |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
opt = lambda b: "n/a" if b is None else mib(b)
for r in rows:
    md.append(f"| {r['mode']} | {mib(r['inside_bytes'])} | {mib(r['across_bytes'])} | {opt(r['gather_across_bytes'])} | {r['across_vs_f32']:.3f} | "
              f"{mib(r['across_veth_bytes'])} | {r['step_ms']:.1f} | {r['exposed_ms']:.1f} | {r['speedup_vs_f32']:.2f}x | "
              f"{r['final_loss']:.4f} | {r['loss_vs_f32_pct']:+.2f}% |")
if not any(n.startswith("hpz/") for n in names):
    md.append("| hpz | not run: not in MODES, or `shardline train --help` lists no `--reshard-after-forward` | | | | | | | | | |")
g = 2  # ranks per shard group (a node)
h, q = by.get("hsdp/f32/x-f32"), by.get("hsdp/int8/x-int8")
drop = (base["first_loss"] - base["final_loss"]) / base["first_loss"]
checks = []
if h is None:
    checks.append(("HSDP f32 gathers across nodes <= 1/2 of full shard's", False, "not run"))
elif h["gather_across_bytes"] is None or base["gather_across_bytes"] is None:
    checks.append((f"HSDP f32 across-node bytes <= 1/{g} of full shard f32's (all collectives: this "
                   f"build's log has no inter_node_gather_bytes)",
                   h["across_bytes"] <= base["across_bytes"] / g, f"{h['across_vs_f32']:.3f}x"))
else:
    checks.append((f"HSDP f32 gather bytes across nodes <= 1/{g} of full shard f32's",
                   h["gather_across_bytes"] <= base["gather_across_bytes"] / g,
                   f"{opt(h['gather_across_bytes'])} against {opt(base['gather_across_bytes'])} MiB"))
if q is None:
    checks.append(("HSDP + int8 + int8 rows", False, "not run"))
else:
    checks += [
        ("HSDP + int8 gathers + int8 cross-node reduce across-node bytes <= 1/4 of full-shard f32's",
         q["across_bytes"] <= base["across_bytes"] / 4, f"{q['across_vs_f32']:.3f}x"),
        (f"HSDP + int8 + int8 at least 3x faster than full-shard f32 at {rate}",
         q["speedup_vs_f32"] >= 3, f"{q['speedup_vs_f32']:.2f}x"),
        (f"HSDP + int8 + int8 final loss within 1% of full-shard f32's (premise: f32 lowered the loss "
         f"by 30%; it lowered it by {100 * drop:.1f}%{'' if drop >= 0.3 else ': premise NOT met, run longer'})",
         abs(q["loss_vs_f32_pct"]) <= 1, f"{q['loss_vs_f32_pct']:+.2f}%"),
    ]
md += ["", "checks:"] + [f"- {'met' if ok else 'NOT met'}: {what}: {val}" for what, ok, val in checks]
text = "\n".join(md)
print(text)
open(f"{out}/scale-table.md", "w").write(text + "\n")
json.dump({"rate": rate, "steps": steps, "seeds": seeds, "rows": rows,
           "checks": [{"check": w, "met": ok, "value": v} for w, ok, v in checks]},
          open(f"{out}/scale-table.json", "w"), indent=1)
PY
