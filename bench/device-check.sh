#!/usr/bin/env bash
# Device check for a machine with one NVIDIA GPU (8 minutes at most, every step bounded):
#   1. builds the CUDA backend and the NCCL lanes (--features cuda),
#   2. runs the CUDA-vs-CPU kernel tests and the NCCL world-1 tests (they print
#      "skipped: <reason>" where no GPU is found, so the log says which ran),
#   3. reports cuBLAS sgemm TFLOP/s (the gemm_throughput_is_reported test),
#   4. trains mlp-bn for 100 steps at world 1 on the CPU backend and on the GPU
#      (`--device cuda`: cuBLAS and NVRTC kernels, host-resident shards), and checks that
#      a short GPU run follows the CPU run (runtime test `device`).
# Cargo needs the crates: on a host without network access, run it with the registry
# (~/.cargo) or a `cargo vendor` directory in place and SHARDLINE_OFFLINE=1.
# Usage: bash bench/device-check.sh   (output: a log on stdout, summary at the end)
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
budget=${DEVICE_CHECK_BUDGET_S:-470}
offline=()
[ "${SHARDLINE_OFFLINE:-0}" = 1 ] && offline=(--offline)
summary=()
left() { echo $(( budget - ($(date +%s) - start) )); }
step() {
    # step NAME MAX_SECONDS CMD...: runs CMD with the smaller of MAX_SECONDS and the time left
    local name=$1 max=$2; shift 2
    local t; t=$(left)
    [ "$t" -gt "$max" ] && t=$max
    if [ "$t" -le 5 ]; then summary+=("$name: not run (time budget spent)"); return 1; fi
    echo "== $name (limit ${t}s, $(( $(date +%s) - start ))s elapsed)"
    local s0; s0=$(date +%s)
    timeout "$t" "$@"
    local rc=$?
    summary+=("$name: rc=$rc in $(( $(date +%s) - s0 ))s")
    return $rc
}

echo "== device"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
    echo "nvidia-smi not found: the CUDA tests will report skipped"
fi
command -v cargo >/dev/null || { echo "cargo not found"; exit 2; }

step "build (features cuda)" 240 cargo build "${offline[@]}" --release -p shardline-runtime --features cuda \
    && step "build tests (features cuda)" 150 cargo test "${offline[@]}" --no-run -p shardline-models -p shardline-collectives -p shardline-runtime --features cuda

step "cuda kernel tests vs cpu" 90 cargo test "${offline[@]}" -p shardline-models --features cuda --lib cuda -- --nocapture --test-threads=1 2>&1 | tee /tmp/device-check-cuda.log
grep -E "TFLOP/s|skipped:|test result" /tmp/device-check-cuda.log | sed 's/^/   /'
step "nccl world-1 tests" 60 cargo test "${offline[@]}" -p shardline-collectives --features cuda --lib nccl -- --nocapture --test-threads=1
step "cuda training follows cpu (runtime test)" 90 cargo test "${offline[@]}" -p shardline-runtime --features cuda --test device -- --nocapture

bin=target/release/shardline
if [ -x "$bin" ]; then
    step "mlp-bn 100 steps, world 1, cpu" 90 "$bin" train --device cpu --model mlp-bn --world 1 --steps 100 --no-progress
    step "mlp-bn 100 steps, world 1, cuda" 90 "$bin" train --device cuda --model mlp-bn --world 1 --steps 100 --no-progress
fi

echo "== summary ($(( $(date +%s) - start ))s)"
printf '  %s\n' "${summary[@]}"
