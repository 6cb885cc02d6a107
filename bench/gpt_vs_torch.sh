#!/usr/bin/env bash
# nanoGPT training step, one thread per rank, side by side in one run: torch single process and
# torch FSDP2 at world 2 (../shared/peers/torch_gpt_train.py), `shardline train --model gpt` at
# world 1 stage 0 and world 2 stage 3, and the GEMM-bound limit of the step measured in the
# same run (`gpt_step --limit`: the step's matmul FLOPs at `gemm_gflops`' rate, measured before
# and after the runs, the faster of the two), and the same FLOPs at the core's measured FMA peak
# (a loop of independent vector FMAs; nothing runs faster). Same model (4 layers, 4 heads, embd 256, block
# 128, vocab 256), global batch 16, AdamW.
#
# Waits (polling every 30 s, at most WAIT_S seconds) until the 1-minute load is below
# MAX_LOAD, and records the load at start and end. Not part of `.ci/run`.
#
#   bash bench/gpt_vs_torch.sh                 # table on stdout, JSON in $OUT/gpt_vs_torch.json
#   WARMUP=2 STEPS=5 OUT=out/gpt bash bench/gpt_vs_torch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpt-vs-torch}
PEERS=${PEERS:-../shared/peers}
WARMUP=${WARMUP:-2}
STEPS=${STEPS:-5}
MAX_LOAD=${MAX_LOAD:-1.5}
WAIT_S=${WAIT_S:-1200}
mkdir -p "$OUT"
cargo build --release -p shardline-runtime --bin shardline
cargo build --release -p shardline-models --example gpt_step
S=target/release/shardline
G=target/release/examples/gpt_step

load1() { cut -d' ' -f1 /proc/loadavg; }
waited=0
while awk -v l="$(load1)" -v m="$MAX_LOAD" 'BEGIN { exit !(l >= m) }' && [ "$waited" -lt "$WAIT_S" ]; do
    echo "load $(load1) >= $MAX_LOAD, waiting (${waited} s)" >&2
    sleep 30
    waited=$((waited + 30))
done
load_start=$(cat /proc/loadavg)
date -u +%Y-%m-%dT%H:%M:%SZ > "$OUT/date"
# The limit is measured before and after the runs; the faster rate of the two counts.
$G --limit 16 > "$OUT/limit-b16-before.json"
$G --limit 8 > "$OUT/limit-b8-before.json"

python3 "$PEERS/torch_gpt_train.py" --variants single,fsdp2 --worlds 2 --threads 1 --layers 4 \
    --heads 4 --embd 256 --block 128 --vocab 256 --batch 16 --warmup "$WARMUP" --steps "$STEPS" \
    --out "$OUT/torch.json" | tee "$OUT/torch.txt"
for ws in "1 0" "2 3"; do
    set -- $ws
    rm -f "$OUT/ours-w$1-s$2.jsonl"
    $S train --no-progress --model gpt --dataset text --n-layer 4 --n-head 4 --n-embd 256 \
        --block-size 128 --batch-size 16 --optimizer adamw --lr 3e-4 --threads 1 --world "$1" \
        --stage "$2" --steps $((WARMUP + STEPS)) --log-json "$OUT/ours-w$1-s$2.jsonl" \
        > "$OUT/ours-w$1-s$2.txt"
done
# The limit per rank: its share of the global batch (16 sequences at world 1, 8 at world 2).
$G --limit 16 > "$OUT/limit-b16.json"
$G --limit 8 > "$OUT/limit-b8.json"
load_end=$(cat /proc/loadavg)

python3 - "$OUT" "$WARMUP" "$load_start" "$load_end" <<'EOF'
import json, statistics, sys
out, warmup, load_start, load_end = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
tokens = 16 * 128
torch = {(r['variant'], r['world']): r for r in json.load(open(f'{out}/torch.json'))['rows']}
def ours(w, s):
    t = [json.loads(l)['step_time_s'] * 1e3 for l in open(f'{out}/ours-w{w}-s{s}.jsonl')][warmup:]
    return statistics.median(t), min(t), max(t)
rows = []
for name, (w, s), peer, batch in [('world 1, stage 0', (1, 0), ('single', 1), 16),
                                  ('world 2, stage 3', (2, 3), ('fsdp2', 2), 8)]:
    med, lo, hi = ours(w, s)
    tm = torch[peer]['step_ms_median']
    lims = [json.load(open(f'{out}/limit-b{batch}{when}.json')) for when in ('-before', '')]
    lim = min(lims, key=lambda l: l['bound_ms'])
    rows.append({'ours': name, 'torch': f'{peer[0]} world {peer[1]}', 'ours_step_ms_median': med,
                 'ours_step_ms_min': lo, 'ours_step_ms_max': hi, 'torch_step_ms_median': tm,
                 'ratio_ours_over_torch': med / tm, 'ours_tokens_per_s': tokens / med * 1e3,
                 'torch_tokens_per_s': torch[peer]['tokens_per_s'],
                 'gemm_bound_ms': lim['bound_ms'], 'gemm_gflops': lim['gemm_gflops'],
                 'matmul_gflop_per_rank': lim['matmul_gflop'],
                 'ours_fraction_of_gemm_bound': lim['bound_ms'] / med,
                 'fma_peak_gflops': max(l['fma_peak_gflops'] for l in lims),
                 'fma_peak_bound_ms': min(l['peak_bound_ms'] for l in lims),
                 'ours_fraction_of_fma_peak': min(l['peak_bound_ms'] for l in lims) / med,
                 'goal_step_ms': 0.5 * tm if w == 2 else tm,
                 'torch_fraction_of_gemm_bound': lim['bound_ms'] / tm})
res = {'date': open(f'{out}/date').read().strip(), 'load_start': load_start,
       'load_end': load_end, 'warmup_steps_skipped': warmup, 'rows': rows}
json.dump(res, open(f'{out}/gpt_vs_torch.json', 'w'), indent=1)
print(f"load at start: {load_start}; at end: {load_end}")
print('| ours | torch | ours ms (min-max) | torch ms | ours/torch | ours tokens/s | torch tokens/s | GEMM bound ms | ours / torch at % of bound | FMA-peak bound ms | goal ms |')
print('|---|---|---|---|---|---|---|---|---|---|---|')
for r in rows:
    print(f"| {r['ours']} | {r['torch']} | {r['ours_step_ms_median']:.0f} ({r['ours_step_ms_min']:.0f}-{r['ours_step_ms_max']:.0f}) "
          f"| {r['torch_step_ms_median']:.0f} | {r['ratio_ours_over_torch']:.2f} | {r['ours_tokens_per_s']:.0f} "
          f"| {r['torch_tokens_per_s']:.0f} | {r['gemm_bound_ms']:.0f} ({r['gemm_gflops']:.0f} GFLOP/s) "
          f"| {100 * r['ours_fraction_of_gemm_bound']:.1f}% / {100 * r['torch_fraction_of_gemm_bound']:.1f}% "
          f"| {r['fma_peak_bound_ms']:.0f} ({r['fma_peak_gflops']:.0f} GFLOP/s) | {r['goal_step_ms']:.0f} |")
print(f"JSON: {out}/gpt_vs_torch.json")
EOF
