#!/usr/bin/env bash
# Gradient accumulation and activation recomputation, measured side by side in one run
# (bench/RESULTS.md, "Gradient accumulation and activation recomputation").
#
# For each configuration: the summary's median step and peaks by category (rank 0), and the
# process's maximum resident set size from GNU time (the whole process: every rank, the data
# and the model, so only differences between rows mean something). Rounds alternate the
# configurations so that load from other jobs on the host falls on all of them.
#
#   cargo build --release -p shardline-runtime --bin shardline
#   ROUNDS=2 STEPS=30 bench/accum-recompute.sh            # both parts
#   PARTS=accum ROUNDS=3 STEPS=20 bench/accum-recompute.sh  # accumulation only
set -euo pipefail
BIN=${BIN:-target/release/shardline}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-30}
PARTS=${PARTS:-recompute accum}
GPT=(--model gpt --dataset text --n-layer 4 --n-head 4 --n-embd "${EMBD:-128}" --block-size 64
     --optimizer adamw --lr 1e-3 --steps "$STEPS" --no-progress)

run() {
    local name=$1
    shift
    local out
    out=$(/usr/bin/time -f 'maxrss_kib %M' "$BIN" train "${GPT[@]}" "$@" 2>&1)
    local step peak cats rss
    step=$(grep -o 'median step *[0-9.]* ms' <<<"$out" | grep -o '[0-9.]* ms')
    peak=$(grep 'rank 0 peak' <<<"$out" | sed 's/ *rank 0 peak *//')
    rss=$(grep -o 'maxrss_kib [0-9]*' <<<"$out" | grep -o '[0-9]*$')
    printf '%s | %s | %s MiB | %s\n' "$name" "$step" "$((rss / 1024))" "$peak"
}

for r in $(seq 1 "$ROUNDS"); do
    echo "# round $r"
    if [[ " $PARTS " == *" recompute "* ]]; then
        # Recomputation: one rank, and stage 3 over two ranks.
        run "w1 b32 recompute none" --world 1 --stage 0 --batch-size 32 --recompute none
        run "w1 b32 recompute units" --world 1 --stage 0 --batch-size 32 --recompute units
        run "w2 s3 b32 recompute none" --world 2 --stage 3 --batch-size 32 --recompute none
        run "w2 s3 b32 recompute units" --world 2 --stage 3 --batch-size 32 --recompute units
    fi
    if [[ " $PARTS " == *" accum "* ]]; then
        # Accumulation over two ranks: the global batch of 32 in 4 microbatches per rank.
        for stage in 2 3; do
            run "w2 s$stage b32 accum 1" --world 2 --stage $stage --batch-size 32
            for how in each last; do
                run "w2 s$stage b32 accum 4 $how" --world 2 --stage $stage --batch-size 32 \
                    --grad-accum 4 --accum-reduce $how
            done
        done
        # Stage 2 over a 200 Mbit/s link, where the bytes each policy sends cost time (stage
        # 3's per-microbatch gathers would cost both policies the same).
        for how in each last; do
            run "w2 s2 b32 accum 4 $how 200mbit" --world 2 --stage 2 --batch-size 32 \
                --grad-accum 4 --accum-reduce $how --link-rate 200mbit
        done
    fi
done
