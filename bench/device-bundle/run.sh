#!/usr/bin/env bash
# The device check, run from a bundle built by bench/device-bundle.sh (no Rust toolchain or
# network needed where it runs). Every step is bounded; the whole check stays under
# BUDGET_S (default 290 s). On a host without a GPU the CUDA steps report "skipped" or
# fail with DeviceUnavailable, and the simulated-device step still runs: that is the dry run.
#
#   bash out/device-bundle/run.sh            # from the repository root; summary at the end
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
start=$(date +%s)
budget=${BUDGET_S:-290}
summary=()
figures=()
left() { echo $(( budget - ($(date +%s) - start) )); }
step() {
    # step NAME MAX_SECONDS CMD...: runs CMD with the smaller of MAX_SECONDS and the time left
    local name=$1 max=$2; shift 2
    local t; t=$(left)
    [ "$t" -gt "$max" ] && t=$max
    if [ "$t" -le 5 ]; then summary+=("$(printf '%-44s %s' "$name" 'not run (budget spent)')"); return 1; fi
    echo "== $name (limit ${t}s)"
    local s0; s0=$(date +%s)
    timeout "$t" "$@" 2>&1 | tee "/tmp/device-bundle-step.log"
    local rc=${PIPESTATUS[0]}
    local note=""
    grep -q "skipped" /tmp/device-bundle-step.log && note=" (reported skipped: no usable GPU)"
    # Lines "figure: ..." (GEMM TFLOP/s, step times against the host) go to the summary.
    while IFS= read -r f; do figures+=("${f#*figure: }"); done < <(grep -o "figure: .*" /tmp/device-bundle-step.log)
    summary+=("$(printf '%-44s rc=%-3s %4ss%s' "$name" "$rc" "$(( $(date +%s) - s0 ))" "$note")")
    return "$rc"
}

echo "== machine"
uname -m
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    nvidia-smi | grep -o "CUDA Version: [0-9.]*" || true
else
    echo "nvidia-smi: not found"
fi

# cudarc loads libcuda, cuBLAS, NVRTC and NCCL at run time: add the folders that hold them,
# from the system's linker cache, CUDA's usual prefix and a Python environment's nvidia-*
# wheels (torch installs cuBLAS, NVRTC and NCCL there).
dirs=()
for d in /usr/local/cuda/lib64 /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu; do
    [ -d "$d" ] && dirs+=("$d")
done
if command -v python3 >/dev/null; then
    while IFS= read -r d; do dirs+=("$d"); done < <(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        print(d)
PY
)
fi
LD_LIBRARY_PATH=$(IFS=:; echo "${dirs[*]}")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
echo "== libraries"
for lib in libcuda.so libcublas.so libcublasLt.so libnvrtc.so libnccl.so; do
    found=$( (ldconfig -p 2>/dev/null | grep -o "/[^ ]*${lib}[.0-9]*" ; \
              for d in "${dirs[@]}"; do ls "$d"/${lib}* 2>/dev/null; done) | head -3 | tr '\n' ' ')
    printf '  %-16s %s\n' "$lib" "${found:-not found}"
done

step "cuda backend, CUDA device ops and NCCL comm vs cpu" 120 "$here/tests/models" cuda --test-threads=1 --nocapture
step "nccl at world 1" 60 "$here/tests/collectives" nccl --test-threads=1 --nocapture
step "cuda training follows the cpu (runtime test)" 90 "$here/tests/runtime-device" --nocapture
step "gpt as model ops: cuda+nccl vs cpu device" 120 "$here/tests/runtime-model-ops" gpt_on_the_cuda --test-threads=1 --nocapture
gpt_args=(--model-ops --model gpt --n-layer 2 --n-head 2 --n-embd 64 --block-size 64 --dataset "text:$here/run.sh" --world 1 --stage 3 --steps 10 --seed 1 --no-progress)
step "gpt 10 steps as model ops, sim (no host code)" 60 "$here/bin/shardline" train --device sim "${gpt_args[@]}"
step "gpt 10 steps as model ops, cuda (train)" 60 "$here/bin/shardline" train --device cuda "${gpt_args[@]}"
step "mlp-bn 100 steps, world 1, cpu" 60 "$here/bin/shardline" train --device cpu --model mlp-bn --world 1 --steps 100 --no-progress
step "mlp-bn 100 steps, world 1, cuda" 60 "$here/bin/shardline" train --device cuda --model mlp-bn --world 1 --steps 100 --no-progress
step "mlp-bn 20 steps, world 2, simulated device" 60 "$here/bin/shardline" train --device sim --model mlp-bn --world 2 --stage 3 --steps 20 --no-progress

echo "== summary ($(( $(date +%s) - start ))s of ${budget}s)"
printf '  %s\n' "${summary[@]}"
if [ "${#figures[@]}" -gt 0 ]; then
    echo "== figures"
    printf '  %s\n' "${figures[@]}"
else
    echo "== figures: none (no step ran on a GPU)"
fi
