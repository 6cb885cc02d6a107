#!/usr/bin/env bash
# Interleaved rounds at 64 MiB: Open MPI (shm, tcp) then Shardline (shm, tcp), W=2 and 4, N
# times (default 3), so that the ratios come from back-to-back runs and the noise of a shared
# machine shows as a spread. Then prints the table (bench/rounds.py).
#   ROUNDS=5 bash bench/rounds.sh
#   IN_PLACE=1 bash bench/rounds.sh    # reduce-scatter and all-gather in place on both sides
#                                      # (Open MPI with MPI_IN_PLACE: bench/mpi-in-place.py)
#   TRANSPORTS=tcp bash bench/rounds.sh
#   PEER_CC=cubic bash bench/rounds.sh # Open MPI's runs under this system-wide TCP congestion
#                                      # control (root; restored after). Shardline's links ask
#                                      # for cubic themselves (SHARDLINE_TCP_CONGESTION).
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
TRANSPORTS=${TRANSPORTS:-shm,tcp}
CC_KEY=net.ipv4.tcp_congestion_control
SYSTEM_CC=$(sysctl -n "$CC_KEY")
set_cc() { if [ -n "${PEER_CC:-}" ]; then sysctl -qw "$CC_KEY=$1"; fi; }
trap 'set_cc "$SYSTEM_CC"' EXIT
cargo build --release -p shardline-bench --bin shardline-bench
echo "system congestion control: $SYSTEM_CC; Open MPI runs under: ${PEER_CC:-$SYSTEM_CC}" > "$OUT/cc.txt"
for r in $(seq 1 "${ROUNDS:-3}"); do
    set_cc "${PEER_CC:-}"
    python3 "$MPI_RUN" --worlds 2,4 --transports "$TRANSPORTS" --sizes 67108864 --build-dir "$OUT/build" \
        --no-wait-quiet --out "$OUT/mpi-$r.json" > "$OUT/mpi-$r.txt" 2>&1
    set_cc "$SYSTEM_CC"
    target/release/shardline-bench collectives --transport "$TRANSPORTS" --world 2,4 \
        --op all-reduce,reduce-scatter,all-gather --min-bytes 64M --max-bytes 64M --no-limits \
        "${PLACE[@]}" --json "$OUT/ours-$r.json" > "$OUT/ours-$r.txt" 2>&1
done
python3 bench/rounds.py "$OUT"
