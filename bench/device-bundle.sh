#!/usr/bin/env bash
# Builds the device check's bundle here, for a GPU machine with no Rust toolchain and no
# network (issue: devices, part 2): the `shardline` binary and the CUDA/NCCL test
# executables built with `--features cuda` (cudarc loads the CUDA libraries at run time, so
# they build without CUDA), stripped, with bench/device-bundle/run.sh, under
# out/device-bundle (64 MiB at most travels to a lent machine). Then it dry-runs the bundle
# here, where no GPU is: the CUDA steps report skipped or DeviceUnavailable, and the
# simulated-device step trains.
#
#   bash bench/device-bundle.sh            # DRY_RUN=0 to build only
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=out/device-bundle
rm -rf "$OUT" && mkdir -p "$OUT/bin" "$OUT/tests"
feats=(--features shardline-runtime/cuda,shardline-models/cuda,shardline-collectives/cuda)
cargo build --release -p shardline-runtime "${feats[@]}" --bin shardline
cp target/release/shardline "$OUT/bin/"
cargo test --release --no-run -p shardline-models -p shardline-collectives -p shardline-runtime \
    "${feats[@]}" --message-format=json 2>/dev/null > "$OUT/build.json"
python3 - "$OUT" <<'PY'
import json, shutil, sys
out = sys.argv[1]
want = {("shardline_models", "lib"): "models", ("shardline_collectives", "lib"): "collectives",
        ("device", "test"): "runtime-device", ("model_ops", "test"): "runtime-model-ops"}
got = {}
for line in open(f"{out}/build.json"):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    key = (t["name"], t["kind"][0])
    if key in want:
        got[want[key]] = m["executable"]
missing = sorted(set(want.values()) - set(got))
if missing:
    sys.exit(f"test executables not built: {missing}")
for name, path in got.items():
    shutil.copy(path, f"{out}/tests/{name}")
PY
rm -f "$OUT/build.json"
strip "$OUT"/bin/* "$OUT"/tests/*
cp bench/device-bundle/run.sh "$OUT/run.sh"
du -sh "$OUT"
size=$(du -sb "$OUT" | cut -f1)
[ "$size" -le $((60 * 1024 * 1024)) ] || { echo "bundle is $size bytes: over the 60 MiB budget" >&2; exit 1; }
if [ "${DRY_RUN:-1}" = 1 ]; then
    bash "$OUT/run.sh"
fi
