#!/usr/bin/env bash
# Side-by-side figures: Shardline and the peers (Open MPI, Gloo, torch FSDP/DDP) measured in one
# session, one after the other, on the same machine. The peers are installed by
# ../shared/peers/setup.sh (not a project dependency). Results go to $OUT (default out/compare).
#
#   bash bench/compare-peers.sh            # everything
#   PARTS="collectives" bash bench/compare-peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/compare}
PEERS=${PEERS:-../shared/peers}
PARTS=${PARTS:-"collectives train"}
mkdir -p "$OUT"
cargo build --release -p shardline-bench -p shardline-runtime --bin shardline-bench --bin shardline
B=target/release/shardline-bench
S=target/release/shardline

for part in $PARTS; do
case $part in
collectives)
    python3 "$PEERS/mpi_collectives/run.py" --worlds 2,4 --transports shm,tcp --sizes 4096,1048576,67108864 \
        --no-wait-quiet --out "$OUT/mpi.json" | tee "$OUT/mpi.txt"
    python3 "$PEERS/gloo_collectives.py" --worlds 2,4 --sizes 4096,67108864 --ops all_reduce,reduce_scatter,all_gather \
        --no-wait-quiet --out "$OUT/gloo.json" | tee "$OUT/gloo.txt"
    $B collectives --transport local,shm,tcp --world 2,4 --min-bytes 4K --max-bytes 64M \
        --json "$OUT/shardline-collectives.json" --plot "$OUT/shardline-collectives.svg" | tee "$OUT/shardline-collectives.txt"
    ;;
train)
    python3 "$PEERS/torch_fsdp_train.py" --worlds 2,4 --variants ddp,fsdp2 --threads 1 --no-wait-quiet \
        --out "$OUT/torch.json" | tee "$OUT/torch.txt"
    for w in 2 4; do
        for st in 0 3; do
            $S train --no-progress --model mlp-bn --hidden 1024 --depth 4 --dataset synthetic --input-dim 784 \
                --classes 10 --batch-size 256 --world "$w" --stage "$st" --steps 30 --sync-bn off --lr 0.01 \
                --summary-json "$OUT/shardline-train-w$w-s$st.json" | tee "$OUT/shardline-train-w$w-s$st.txt"
        done
    done
    ;;
esac
done
echo "results in $OUT"
