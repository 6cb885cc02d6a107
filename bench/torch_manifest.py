"""The torch state_dicts Shardline's exports must match: names, dtypes and shapes of
`resnet-bn` (bench/resnet_bn.py) and `gpt` (nanoGPT's decoder as
../shared/peers/torch_gpt_train.py builds it: nanoGPT's names, tied lm_head, no `attn.bias`
buffer, as nanoGPT's model.py has with torch >= 2.0's flash attention), at the
configurations runtime/tests/torch_names.rs trains. Writes the manifest that test reads
(no torch needed there):

    python3 bench/torch_manifest.py --out runtime/tests/fixtures/torch_state_dicts.json

and loads an export strictly (what tests/tests/torch_load.rs runs where torch is installed):

    python3 bench/torch_manifest.py --load-strict resnet-bn FILE
"""
import argparse, importlib.util, json, os, sys, types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from resnet_bn import ResNetBN  # noqa: E402

# The configurations runtime/tests/torch_names.rs trains (digits images 1x8x8, 10 classes;
# the bundled text, 256 byte values).
CONFIGS = {
    "resnet-bn": {"in_channels": 1, "classes": 10, "width": 4},
    "gpt": {"vocab": 256, "block": 16, "layers": 2, "heads": 2, "embd": 16},
}
DTYPES = {torch.float32: "F32", torch.int64: "I64"}


def gpt_module(peers, c):
    path = os.path.join(peers, "torch_gpt_train.py")
    spec = importlib.util.spec_from_file_location("torch_gpt_train", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, _block = mod.make_model(types.SimpleNamespace(**c))
    return model


def build(name, peers):
    c = CONFIGS[name]
    if name == "resnet-bn":
        return ResNetBN(c["in_channels"], c["classes"], c["width"])
    return gpt_module(peers, c)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the manifest here")
    ap.add_argument("--load-strict", nargs=2, metavar=("MODEL", "FILE"))
    ap.add_argument("--peers", default=os.path.join(HERE, "..", "..", "shared", "peers"),
                    help="the folder of torch_gpt_train.py")
    a = ap.parse_args()
    if a.load_strict:
        from safetensors.torch import load_file
        name, f = a.load_strict
        m = build(name, a.peers)
        sd = load_file(f)
        print(f"{name}: {m.load_state_dict(sd, strict=True)}")
        print(f"strict load ok: {len(sd)} tensors of {f}")
        return
    out = {}
    for name in CONFIGS:
        sd = build(name, a.peers).state_dict()
        out[name] = {
            "config": CONFIGS[name],
            "state_dict": [[k, DTYPES[v.dtype], list(v.shape)] for k, v in sd.items()],
        }
    out["made_by"] = f"bench/torch_manifest.py, torch {torch.__version__}"
    # One tensor a line, so that a change reads as a diff of names.
    parts = []
    for name, v in out.items():
        if name == "made_by":
            parts.append(f' "made_by": {json.dumps(v)}')
            continue
        rows = ",\n".join(f"   {json.dumps(t)}" for t in v["state_dict"])
        parts.append(f' {json.dumps(name)}: {{\n  "config": {json.dumps(v["config"])},\n'
                     f'  "state_dict": [\n{rows}\n  ]\n }}')
    text = "{\n" + ",\n".join(parts) + "\n}\n"
    json.loads(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
