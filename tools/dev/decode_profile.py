#!/usr/bin/env python3
"""decode_profile.py - the per-kernel time of one batch-1 decode step on the GPU machine (issue
24 item 2), from Nsight Compute's gpu__time_duration of every kernel, set against the step time
the same build takes with decode graphs on (the difference is launch gaps, kernel ramp-up and
tails: what fusing kernels or programmatic dependent launch can win back).

Usage (on the GPU machine, after a build; MODEL is a Hugging Face directory, e.g. the random
Qwen2-7B that `bench/cuda_7b.py --steps ceilings` saves under /tmp/m7/qwen2-7b):
    python3 tools/dev/decode_profile.py --kiln build/bin/kiln --model MODEL --out prof.json
        [--steps 8] [--copy-GBps 4200]
Method:
  1. `kiln bench latency --batch-size 1 --input-len 128 --output-len 64` with graphs on (the
     default): its TPOT p50 is the real step time.
  2. the same with graphs off under `ncu --clock-control none --metrics gpu__time_duration.sum`
     (one iteration, no warm-up, output-len = steps + 4); of all the recorded launches only the
     last --steps whole decode steps are kept, each step delimited by the embedding kernel that
     it runs once.
  Kernels are grouped by name (template arguments cut); per group: launches per step, time per
  step, share. The sum over groups is the kernels' busy time per step; step time minus that is
  the idle time between kernels.
Writes the table to stdout and the figures as JSON to --out.
"""
import argparse
import csv
import io
import json
import os
import re
import subprocess
import sys


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        raise SystemExit("failed: " + " ".join(cmd))
    return r


def short(name):
    name = re.sub(r"<.*", "", name)  # template arguments
    name = re.sub(r"\(.*", "", name)  # parameter lists
    return name.strip()[:60]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--extra", default="", help="more kiln arguments, space separated")
    a = ap.parse_args()
    extra = a.extra.split() if a.extra else []
    base = [a.kiln, "bench", "latency", "--model", a.model, "--set", "backend.name=cuda",
            "--batch-size", "1", "--input-len", "128"] + extra
    jpath = "/tmp/decode_profile_lat.json"
    run(base + ["--output-len", "64", "--num-iters", "3", "--warmup", "1", "--json", jpath])
    lat = json.load(open(jpath))
    step_ms = lat["tpot_ms"]["p50"]
    # graphs off, one iteration, no warm-up: load, prefill, then output-len decode steps.
    n_dec = a.steps + 4
    r = run([a.ncu, "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv",
             "--print-units", "base"] + base +
            ["--output-len", str(n_dec), "--num-iters", "1", "--warmup", "0", "--json", jpath,
             "--set", "graph.enabled=false"])
    text = r.stdout
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    launches = []
    for row in rows:
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        launches.append((short(row["Kernel Name"]), float(row["Metric Value"].replace(",", "")) / 1e6))  # ns -> ms
    # One decode step = the launches between two embedding lookups; keep the last `steps` whole
    # steps (the first ones after prefill may still load modules).
    emb = [i for i, (n, _) in enumerate(launches) if "embed" in n.lower()]
    if len(emb) < a.steps + 2:
        raise SystemExit("found %d embedding launches in %d kernels; names: %s" %
                         (len(emb), len(launches), sorted({n for n, _ in launches})))
    lo, hi = emb[-a.steps - 1], emb[-1]
    per = {}
    for n, t in launches[lo:hi]:
        c, s = per.get(n, (0, 0.0))
        per[n] = (c + 1, s + t)
    busy = sum(s for _, s in per.values()) / a.steps
    kernels = sum(c for c, _ in per.values()) / a.steps
    table = sorted(per.items(), key=lambda kv: -kv[1][1])
    print("step time with graphs (TPOT p50): %.3f ms; kernels per step %.0f, busy %.3f ms, idle %.3f ms"
          % (step_ms, kernels, busy, step_ms - busy))
    print("%-60s %8s %10s %6s" % ("kernel", "n/step", "ms/step", "share"))
    for n, (c, s) in table:
        print("%-60s %8.1f %10.4f %5.1f%%" % (n, c / a.steps, s / a.steps, 100 * s / a.steps / step_ms))
    res = {"step_ms_graphs": step_ms, "busy_ms": round(busy, 4), "idle_ms": round(step_ms - busy, 4),
           "kernels_per_step": kernels, "steps": a.steps, "model": os.path.basename(a.model.rstrip("/")),
           "kernels": [{"name": n, "per_step": c / a.steps, "ms_per_step": round(s / a.steps, 5)}
                       for n, (c, s) in table]}
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
