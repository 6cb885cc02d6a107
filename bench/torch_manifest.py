"""The torch state_dicts Shardline's exports must match: names, dtypes and shapes of
`resnet-bn` (bench/resnet_bn.py) and `gpt` (nanoGPT's decoder as
../shared/peers/torch_gpt_train.py builds it: nanoGPT's names, tied lm_head, no `attn.bias`
buffer, as nanoGPT's model.py has with torch >= 2.0's flash attention), at the
configurations runtime/tests/torch_names.rs trains. Writes the manifest that test reads
(no torch needed there):

    python3 bench/torch_manifest.py --out runtime/tests/fixtures/torch_state_dicts.json

loads an export strictly (what tests/tests/torch_load.rs runs where torch is installed):

    python3 bench/torch_manifest.py --load-strict resnet-bn FILE

(a `checkpoint export --dtype bf16` file into the module after `.bfloat16()`, checking every
tensor bitwise),

and writes what torch computes with a narrow resnet-bn (width 2), for
runtime/tests/torch_names.rs to check Shardline's forward against (no torch needed there):

    python3 bench/torch_manifest.py --reference runtime/tests/fixtures/resnet_bn_reference.safetensors
"""
import argparse, importlib.util, json, os, struct, sys, types

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


def save_safetensors(path, tensors, meta):
    """safetensors.torch.save_file without numpy: a JSON header, then the raw bytes."""
    header, blobs, at = {"__metadata__": meta}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        fmt, dt = {torch.float32: ("f", "F32"), torch.int64: ("q", "I64")}[t.dtype]
        b = struct.pack(f"<{t.numel()}{fmt}", *t.flatten().tolist())
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def reference(path):
    """resnet-bn at width 2 on 1x8x8 images: its state_dict (running statistics and
    counters made non-trivial), an input batch of 4, the eval-mode logits, and the
    training-mode logits with the running statistics that forward leaves."""
    torch.manual_seed(0)
    m = ResNetBN(in_channels=1, classes=10, width=2)
    with torch.no_grad():
        for name, b in m.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(0.1 * torch.randn_like(b))
            elif name.endswith("running_var"):
                b.copy_(1.0 + 0.5 * torch.rand_like(b))
            elif name.endswith("num_batches_tracked"):
                b.fill_(7)
        for name, p in m.named_parameters():
            if ".bn" in name or name.startswith("bn") or "downsample.1" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
    out = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(4, 1, 8, 8)
    m.eval()
    with torch.no_grad():
        out["ref.input"] = x
        out["ref.logits_eval"] = m(x)
        m.train()
        out["ref.logits_train"] = m(x)
    for k, v in m.state_dict().items():
        if "running" in k or "num_batches" in k:
            out[f"ref.after_train.{k}"] = v.clone()
    save_safetensors(path, out, {"made_by": f"bench/torch_manifest.py --reference, torch {torch.__version__}",
                                 "config": json.dumps({"in_channels": 1, "classes": 10, "width": 2})})
    print(f"wrote {len(out)} tensors to {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the manifest here")
    ap.add_argument("--load-strict", nargs=2, metavar=("MODEL", "FILE"))
    ap.add_argument("--reference", metavar="FILE", help="write resnet-bn's reference outputs")
    ap.add_argument("--peers", default=os.path.join(HERE, "..", "..", "shared", "peers"),
                    help="the folder of torch_gpt_train.py")
    a = ap.parse_args()
    if a.reference:
        reference(a.reference)
        return
    if a.load_strict:
        from safetensors.torch import load_file
        name, f = a.load_strict
        m = build(name, a.peers)
        sd = load_file(f)
        kinds = sorted({str(v.dtype).replace("torch.", "") for v in sd.values()})
        if torch.bfloat16 in {v.dtype for v in sd.values()}:
            # A bf16 export is the state_dict of the module after .bfloat16(): it loads
            # strictly there and every tensor comes back bitwise.
            m = m.bfloat16()
            print(f"{name} (bfloat16): {m.load_state_dict(sd, strict=True)}")
            own = m.state_dict()
            for k, v in sd.items():
                if own[k].dtype != v.dtype or not torch.equal(own[k], v):
                    sys.exit(f"{k}: {own[k].dtype} in the module, {v.dtype} in the file, or values differ")
            print(f"bitwise equal after loading: {len(sd)} tensors")
        else:
            print(f"{name}: {m.load_state_dict(sd, strict=True)}")
        print(f"strict load ok: {len(sd)} tensors of {f} ({', '.join(kinds)})")
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
