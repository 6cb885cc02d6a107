#!/usr/bin/env python3
"""Medians over interleaved rounds of Open MPI and Shardline at 64 MiB (see bench/rounds.sh).

Reads out/rounds/{mpi,ours}-N.json and prints, per (transport, world, op), every round's busbw
for both, the ratio of the medians and the per-round ratios (each round runs MPI, then
Shardline, back to back, so a round's ratio is a side-by-side figure)."""
import glob, json, os, statistics as st, sys

d = sys.argv[1] if len(sys.argv) > 1 else "out/rounds"
mpi, ours = {}, {}
for f in sorted(glob.glob(os.path.join(d, "mpi-*.json"))):
    n = f.rsplit("-", 1)[1].split(".")[0]
    for run in json.load(open(f))["runs"]:
        for x in run["results"]:
            k = (run["transport"], run["world_size"], x["op"].replace("_", "-"))
            mpi.setdefault(k, {})[n] = x["busbw_GBps"]
    o = json.load(open(os.path.join(d, f"ours-{n}.json")))
    for x in o["rows"] if isinstance(o, dict) else o:
        if x["bytes"] != 67108864:
            continue
        ours.setdefault((x["transport"], x["world"], x["op"]), {})[n] = x["busbw_GBps"]
print("| transport | W | op | Shardline busbw (rounds) | Open MPI busbw (rounds) | median ratio | per-round ratios |")
print("|---|---|---|---|---|---|---|")
for k in sorted(ours):
    o, m = ours[k], mpi.get(k, {})
    rounds = sorted(set(o) & set(m))
    if not rounds:
        continue
    ov, mv = [o[r] for r in rounds], [m[r] for r in rounds]
    ratio = st.median(ov) / st.median(mv)
    per = ", ".join(f"{o[r] / m[r]:.2f}" for r in rounds)
    print(f"| {k[0]} | {k[1]} | {k[2]} | {', '.join(f'{v:.2f}' for v in ov)} | "
          f"{', '.join(f'{v:.2f}' for v in mv)} | {ratio:.2f} | {per} |")
