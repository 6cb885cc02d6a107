#!/usr/bin/env bash
# Interleaved rounds at 64 MiB: Open MPI (shm, tcp) then Shardline (shm, tcp), W=2 and 4, N
# times (default 3), so that the ratios come from back-to-back runs and the noise of a shared
# machine shows as a spread. Then prints the table (bench/rounds.py).
#   ROUNDS=5 bash bench/rounds.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/rounds}
PEERS=${PEERS:-../shared/peers}
mkdir -p "$OUT"
cargo build --release -p shardline-bench --bin shardline-bench
for r in $(seq 1 "${ROUNDS:-3}"); do
    python3 "$PEERS/mpi_collectives/run.py" --worlds 2,4 --transports shm,tcp --sizes 67108864 \
        --no-wait-quiet --out "$OUT/mpi-$r.json" > "$OUT/mpi-$r.txt" 2>&1
    target/release/shardline-bench collectives --transport shm,tcp --world 2,4 \
        --op all-reduce,reduce-scatter,all-gather --min-bytes 64M --max-bytes 64M --no-limits \
        --json "$OUT/ours-$r.json" > "$OUT/ours-$r.txt" 2>&1
done
python3 bench/rounds.py "$OUT"
