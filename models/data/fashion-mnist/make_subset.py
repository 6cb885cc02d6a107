#!/usr/bin/env python3
"""Makes the bundled Fashion-MNIST subset (see README.md) from Debian's dataset-fashion-mnist.

    apt-get install -y dataset-fashion-mnist
    python3 models/data/fashion-mnist/make_subset.py [SOURCE_DIR] [OUT_DIR]

Selection: for each split, one random.Random(SEED) draws, class by class (0 to 9), a sample
of PER_CLASS[split] indices from that class's indices in file order; the chosen indices are
written in their original file order (so the classes stay interleaved as upstream has them).
Outputs are gzipped IDX files with a zero mtime and no file name, so the same inputs give
byte-identical files. Standard library only.
"""

import gzip
import hashlib
import os
import random
import struct
import sys

SEED = 20261202
PER_CLASS = {"train": 400, "t10k": 100}
CLASSES = 10


def read_idx(path, magic):
    with gzip.open(path, "rb") as f:
        data = f.read()
    got = struct.unpack(">I", data[:4])[0]
    if got != magic:
        sys.exit(f"{path}: magic {got:#010x}, expected {magic:#010x}")
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return dims, data[4 + 4 * ndim :]


def write_gz(path, payload):
    with open(path, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f:
            f.write(payload)


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "/usr/share/datasets/fashion-mnist"
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(os.path.abspath(__file__))
    for split, k in PER_CLASS.items():
        img_dims, pixels = read_idx(f"{src}/{split}-images-idx3-ubyte.gz", 0x00000803)
        lab_dims, labels = read_idx(f"{src}/{split}-labels-idx1-ubyte.gz", 0x00000801)
        n, h, w = img_dims
        if lab_dims[0] != n:
            sys.exit(f"{split}: {n} images but {lab_dims[0]} labels")
        rng = random.Random(SEED)
        chosen = []
        for c in range(CLASSES):
            of_class = [i for i in range(n) if labels[i] == c]
            chosen.extend(rng.sample(of_class, k))
        chosen.sort()
        m = len(chosen)
        img = struct.pack(">IIII", 0x00000803, m, h, w) + b"".join(
            pixels[i * h * w : (i + 1) * h * w] for i in chosen
        )
        lab = struct.pack(">II", 0x00000801, m) + bytes(labels[i] for i in chosen)
        for name, payload in ((f"{split}-images-idx3-ubyte.gz", img), (f"{split}-labels-idx1-ubyte.gz", lab)):
            path = os.path.join(out, name)
            write_gz(path, payload)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            print(f"{name}  {m} samples  {os.path.getsize(path)} bytes  sha256 {digest}")


if __name__ == "__main__":
    main()
