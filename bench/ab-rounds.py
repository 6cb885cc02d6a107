#!/usr/bin/env python3
"""Summarises bench/ab-rounds.sh: per figure, each build's median and range over the rounds,
and whether the new build's median falls within the old build's own range."""
import glob, json, os, statistics, sys

out = sys.argv[1] if len(sys.argv) > 1 else "out/ab-rounds"

def log_step_ms(path):
    steps = [json.loads(l)["step_time_s"] for l in open(path) if l.strip()]
    return statistics.median(steps[5:] or steps) * 1e3

def overlap(path, key):
    rows = json.load(open(path))["rows"]
    return next(r[key] for r in rows if r["prefetch"] == 1)

figures = [
    ("train step, 4 ranks in one process (ms)", "train-*.jsonl", log_step_ms),
    ("train step, 4 launched processes, rank 0 (ms)", "launch-*.jsonl", log_step_ms),
    ("overlap 2gbit prefetch 1: step (ms)", "overlap-*.json", lambda p: overlap(p, "step_ms")),
    ("overlap 2gbit prefetch 1: exposed (%)", "overlap-*.json", lambda p: overlap(p, "exposed_pct")),
    ("overlap --nodes 2 4gbit prefetch 1: step (ms)", "nodes-*.json", lambda p: overlap(p, "step_ms")),
    ("overlap --nodes 2 4gbit prefetch 1: exposed (%)", "nodes-*.json", lambda p: overlap(p, "exposed_pct")),
]
result = {}
print(f"{'figure':50} {'old median [range]':>26} {'new median [range]':>26}  new within old's range")
for name, pat, f in figures:
    vals = {}
    for side in ("old", "new"):
        files = sorted(glob.glob(os.path.join(out, f"{side}-{pat}")))
        vals[side] = [f(p) for p in files]
    if not vals["old"] or not vals["new"]:
        continue
    o, n = vals["old"], vals["new"]
    om, nm = statistics.median(o), statistics.median(n)
    within = min(o) <= nm <= max(o)
    result[name] = {"old": o, "new": n, "old_median": om, "new_median": nm, "within": within}
    fmt = lambda m, v: f"{m:8.3f} [{min(v):.3f}-{max(v):.3f}]"
    print(f"{name:50} {fmt(om, o):>26} {fmt(nm, n):>26}  {'yes' if within else 'NO'} (n={len(o)},{len(n)})")
json.dump(result, open(os.path.join(out, "summary.json"), "w"), indent=1)
