#!/usr/bin/env bash
# Interleaved rounds at 64 MiB: Open MPI (shm, tcp) then Shardline (shm, tcp), W=2 and 4, N
# times (default 3), so that the ratios come from back-to-back runs and the noise of a shared
# machine shows as a spread. Then prints the table (bench/rounds.py).
#   ROUNDS=5 bash bench/rounds.sh
#   IN_PLACE=1 bash bench/rounds.sh    # reduce-scatter and all-gather in place on both sides
#                                      # (Open MPI with MPI_IN_PLACE: bench/mpi-in-place.py)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/rounds}
PEERS=${PEERS:-../shared/peers}
mkdir -p "$OUT"
MPI_RUN="$PEERS/mpi_collectives/run.py"
PLACE=()
if [ -n "${IN_PLACE:-}" ]; then
    MPI_RUN=$(PEERS="$PEERS" python3 bench/mpi-in-place.py "$OUT/mpi-in-place")
    PLACE=(--in-place)
fi
cargo build --release -p shardline-bench --bin shardline-bench
for r in $(seq 1 "${ROUNDS:-3}"); do
    python3 "$MPI_RUN" --worlds 2,4 --transports shm,tcp --sizes 67108864 --build-dir "$OUT/build" \
        --no-wait-quiet --out "$OUT/mpi-$r.json" > "$OUT/mpi-$r.txt" 2>&1
    target/release/shardline-bench collectives --transport shm,tcp --world 2,4 \
        --op all-reduce,reduce-scatter,all-gather --min-bytes 64M --max-bytes 64M --no-limits \
        "${PLACE[@]}" --json "$OUT/ours-$r.json" > "$OUT/ours-$r.txt" 2>&1
done
python3 bench/rounds.py "$OUT"
