#!/usr/bin/env bash
# Figures for multi-process and multi-node runs, each "node" a network namespace on one
# bridge (root needed): 64 MiB all-reduce busbw and training step time for 2 nodes x 2
# processes vs 1 node x 4 processes, and the detection time of a SIGKILLed worker (median
# over RUNS) against the configured collective timeout.
#
#   cargo build --release -p shardline-runtime --bin shardline
#   cargo build --release -p shardline-collectives --example hybrid_bw
#   sudo tests/multinode-figures.sh [RATE]     # RATE: optional tc tbf rate, e.g. 1gbit
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${SHARDLINE_BIN:-target/release/shardline}
BW=target/release/examples/hybrid_bw
RATE=${1:-}
RUNS=${RUNS:-10}
TIMEOUT_S=${TIMEOUT_S:-30}
ID=$$
BR=sfb$ID
NS=(sfn$ID-0 sfn$ID-1)
SUB=10.$((200 + ID % 50)).$((ID % 250))
cleanup() {
  for n in "${NS[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  ip link del "$BR" 2>/dev/null || true
}
trap cleanup EXIT
ip link add "$BR" type bridge && ip link set "$BR" up
for i in 0 1; do
  ip netns add "${NS[$i]}"
  # MTU 9000 as in tests/src/netns.rs (jumbo frames)
  ip link add "sfh$ID-$i" mtu 9000 type veth peer name "sfi$ID-$i" mtu 9000
  ip link set "sfi$ID-$i" netns "${NS[$i]}"
  ip link set "sfh$ID-$i" master "$BR" up
  ip -n "${NS[$i]}" addr add "$SUB.$((i + 1))/24" dev "sfi$ID-$i"
  ip -n "${NS[$i]}" link set "sfi$ID-$i" up
  ip -n "${NS[$i]}" link set lo up
  if [ -n "$RATE" ]; then
    ip netns exec "${NS[$i]}" tc qdisc add dev "sfi$ID-$i" root tbf rate "$RATE" burst 256kb latency 50ms
  fi
done
STORE=$SUB.1:29610
echo "# link: ${RATE:-unshaped veth}"

bw() { # placement: list of namespace indices, one per rank
  local pl=("$@") w=${#pl[@]} pids=()
  for r in $(seq 0 $((w - 1))); do
    local ns=${NS[${pl[$r]}]}
    RANK=$r WORLD_SIZE=$w NODE=${pl[$r]} STORE=$STORE TOKEN=fig MIB=64 ITERS=${ITERS:-5} \
      timeout 300 ip netns exec "$ns" "$BW" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
}
echo "## 64 MiB all-reduce (hybrid transport)"
bw 0 0 0 0
bw 0 0 1 1

TRAIN=(train --model mlp-bn --hidden 1024 --depth 4 --dataset synthetic --input-dim 784
  --classes 10 --samples 8192 --batch-size 256 --steps 30 --stage 0 --sync-bn off
  --no-progress --timeout "$TIMEOUT_S")
step() { # nnodes nproc
  local nn=$1 np=$2 pids=() out=/tmp/fig-step-$ID
  for k in $(seq 0 $((nn - 1))); do
    timeout 300 ip netns exec "${NS[$k]}" "$BIN" launch --nproc-per-node "$np" --nnodes "$nn" \
      --node-rank "$k" --rdzv "$STORE" --token fig -- "${TRAIN[@]}" \
      --summary-json "$out.json" > "$out.$k.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  python3 -c "import json,sys; s=json.load(open('$out.json')); print(f'train {sys.argv[1]} nodes x {sys.argv[2]} procs (stage 0, MLP 784-4x1024-10, batch 256): median step {s[\"median_step_s\"]*1e3:.1f} ms, exposed comm {s[\"comm_exposed_frac\"]*100:.0f}%')" "$nn" "$np"
}
echo "## training step time"
step 1 4
step 2 2

echo "## detection of a SIGKILLed worker (rank 3 of 2x2), collective timeout ${TIMEOUT_S}s"
times=()
for run in $(seq 1 "$RUNS"); do
  pids=()
  for k in 0 1; do
    timeout 120 ip netns exec "${NS[$k]}" "$BIN" launch --nproc-per-node 2 --nnodes 2 \
      --node-rank "$k" --rdzv "$STORE" --token fig -- train --steps 1000000 --batch-size 48 \
      --no-progress --timeout "$TIMEOUT_S" > /tmp/fig-kill-$ID.$k.log 2>&1 &
    pids+=($!)
  done
  victim=""
  for _ in $(seq 1 200); do
    for c in $(cat /proc/${pids[1]}/task/*/children 2>/dev/null; pgrep -P "${pids[1]}" || true); do
      for w in $(cat /proc/$c/task/$c/children 2>/dev/null) $c; do
        if tr '\0' '\n' < /proc/$w/environ 2>/dev/null | grep -qx SHARDLINE_RANK=3; then victim=$w; fi
      done
    done
    [ -n "$victim" ] && break
    sleep 0.05
  done
  [ -n "$victim" ] || { echo "rank 3 not found"; exit 1; }
  sleep 2
  t0=$(date +%s.%N)
  kill -KILL "$victim"
  for p in "${pids[@]}"; do wait "$p" || true; done
  t1=$(date +%s.%N)
  times+=("$(python3 -c "print(($t1 - $t0) * 1e3)")")
  grep -q "error: rank 0: .*rank 3" /tmp/fig-kill-$ID.0.log || { echo "rank 0 did not name rank 3"; cat /tmp/fig-kill-$ID.0.log; }
done
python3 -c "import statistics,sys; v=sorted(map(float,sys.argv[2:])); print(f'detection (kill -> every launch exited): median {statistics.median(v):.0f} ms, min {v[0]:.0f}, max {v[-1]:.0f} over {len(v)} runs; collective timeout {sys.argv[1]} s')" "$TIMEOUT_S" "${times[@]}"
