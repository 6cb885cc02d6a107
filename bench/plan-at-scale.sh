#!/usr/bin/env bash
# `shardline plan --search` for gpt from GPT-2 small to GPT-3 13B on H100 nodes, with the
# shipped profile h100-8x-ib (from published figures, not measured here), under an 80 GB
# cap per rank (bench/RESULTS.md, "`shardline plan` at scale"). Nothing is trained: every
# figure is a prediction. Per case: the best configuration's memory, step split, tokens/s
# and MFU (6N + 12 L C T flops per token, nanoGPT's estimate_mfu, over 989.5 TFLOP/s dense
# BF16 per GPU).
#
#   cargo build --release -p shardline-runtime --bins
#   bench/plan-at-scale.sh            # table on stdout, JSON in $OUT
set -euo pipefail
BIN=${BIN:-target/release/shardline}
OUT=${OUT:-out/plan-at-scale}
mkdir -p "$OUT"
# name | layers heads width context | global batch (sequences) | worlds searched
CASES=(
    "gpt2-124M|12 12 768 1024|512|1x8,8x8"
    "gpt2-350M|24 16 1024 1024|512|1x8,8x8"
    "gpt3-1.3B|24 16 2048 2048|512|1x8,8x8,32x8"
    "gpt3-2.7B|32 32 2560 2048|512|8x8,32x8,64x8"
    "gpt3-13B|40 40 5120 2048|1024|32x8,128x8"
)
for c in "${CASES[@]}"; do
    IFS='|' read -r name shape batch worlds <<< "$c"
    read -r l h e t <<< "$shape"
    args=(plan --model gpt --n-layer "$l" --n-head "$h" --n-embd "$e" --block-size "$t"
        --vocab-size 50304 --batch-size "$batch" --optimizer adamw --world "$worlds"
        --profile h100-8x-ib --search --memory-cap 80GB --top 5)
    echo "$name: shardline ${args[*]}" >> "$OUT/commands.txt"
    "$BIN" "${args[@]}" > "$OUT/$name.txt"
    "$BIN" "${args[@]}" --json > "$OUT/$name.json"
done
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
print("| model | params | GPUs | best configuration (stage, prefetch, recompute, microbatches x samples) | peak per rank (GiB) | step (s) | compute (s) | exposed comm (s) | tokens/s | MFU | within 80 GB at this world / predicted over the worlds searched |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for name in ["gpt2-124M", "gpt2-350M", "gpt3-1.3B", "gpt3-2.7B", "gpt3-13B"]:
    v = json.load(open(os.path.join(out, name + ".json")))
    s = v["search"]
    r = s["ranked"]
    cmd = v["best_command"] or ""
    f = cmd.split()
    get = lambda k: int(f[f.index(k) + 1])
    l, e, t, batch = get("--n-layer"), get("--n-embd"), get("--block-size"), get("--batch-size")
    # nanoGPT's count: embeddings and blocks, tied head (biases and norms included).
    n = 50304 * e + t * e + l * (12 * e * e + 13 * e) + 2 * e
    flops_tok = 6 * n + 12 * l * e * t
    worlds = sorted({x["choice"]["nodes"] * x["choice"]["ranks_per_node"] for x in r})
    for w in worlds:
        best = next(x for x in r if x["choice"]["nodes"] * x["choice"]["ranks_per_node"] == w)
        c = best["choice"]
        micro = batch // w // c["grad_accum"]
        tps = best["tokens_per_s"]
        mfu = tps * flops_tok / (w * 989.5e12)
        within = sum(1 for x in r if x["choice"]["nodes"] * x["choice"]["ranks_per_node"] == w)
        print(f"| {name} | {n/1e6:.0f}M | {w} ({c['nodes']}x{c['ranks_per_node']}) | stage {c['stage']}, prefetch {c['prefetch']}, recompute {c['recompute']}, {c['grad_accum']} x {micro} | {best['peak_bytes']/2**30:.1f} | {best['step_s']:.3f} | {best['compute_s']:.3f} | {best['exposed_s']:.3f} | {tps:,.0f} | {mfu*100:.0f}% | {within} / {s['evaluated']} |")
PY
