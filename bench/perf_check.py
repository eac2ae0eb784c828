#!/usr/bin/env python3
"""perf_check.py - the GPU performance check of issue 24: the figures of the 7B table measured
on one build, with the card's ceilings from the same run, written as a result file for
bench/results/ and compared with the newest earlier one there (bench/perf_compare.py).

Usage (on the GPU machine; tools/dev/gpu_run.sh PERF=1 runs it after building the tree):
  python3 bench/perf_check.py --kiln build/bin/kiln [--root .] [--work /tmp/m7] [--commit C]
                              [--results bench/results] --out-dir DIR [--requests 1000]
Writes DIR/<YYYY-MM-DD>-<commit>.json (copy it into bench/results/ and commit it) and
DIR/perf_compare.json (the comparison); exits with perf_compare's status: 0 no figure dropped
more than --threshold (5%), 1 one did, 2 bad input; 3 when a measurement failed outright.

The figures, Qwen2-7B (random bf16 weights, bench/cuda_7b.py's model), default etc/kiln.ini:
  decode_ms      kiln bench latency, batch 1, 128 + 256: ms per output token, p50 of 5
  prefill512_ms  kiln bench latency, batch 1, 512 + 1: ms to the first token, p50 of 10
  offline_tok_s  kiln bench throughput, 1,000 x (512 + 256): output tokens/s
and the ceilings (bench/cuda_7b.py): copy bandwidth (4 GiB device-to-device copy, read + write
bytes) and the bf16 matrix rate (8192^3 torch.matmul), medians of 10. Each figure also gets its
floor and the fraction of it reached: decode weights / copy bandwidth, prefill 2 * params *
512 / matrix rate; throughput has no single floor here (see perf_compare.py for why it is
judged against the matrix rate).
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import perf_compare  # noqa: E402
import perf_run  # noqa: E402


def git_commit(root):
    try:
        r = subprocess.run(["git", "-C", root, "rev-parse", "--short=7", "HEAD"],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--root", default=".", help="source root: etc/kiln.ini is read from here")
    ap.add_argument("--work", default="/tmp/m7")
    ap.add_argument("--shape", default="qwen2-7b")
    ap.add_argument("--commit", default="", help="default: $PERF_COMMIT, else git in --root")
    ap.add_argument("--results", default=None, help="default: bench/results beside this script")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--requests", type=int, default=1000, help="other than 1000: a trial run")
    ap.add_argument("--threshold", type=float, default=0.05)
    a = ap.parse_args()
    import torch
    import cuda_7b

    root = os.path.abspath(a.root)
    kiln = os.path.abspath(a.kiln)
    plugin = os.path.join(os.path.dirname(os.path.dirname(kiln)), "lib/kiln/libkiln-backend-cuda.so")
    commit = (a.commit or os.environ.get("PERF_COMMIT") or git_commit(root) or "unknown")[:12]
    now = time.gmtime()
    res = {"schema": 1, "source": "bench/perf_check.py", "commit": commit,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", now), "shape": a.shape}
    os.makedirs(a.out_dir, exist_ok=True)
    out = os.path.join(a.out_dir, "%s-%s.json" % (time.strftime("%Y-%m-%d", now), commit))

    def save():
        with open(out + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(out + ".tmp", out)

    path = os.path.join(a.work, a.shape)
    cuda_7b.build(a.shape, path)
    wb = cuda_7b.weight_bytes(path)
    res["weight_bytes"] = wb
    m = perf_run.machine(kiln_bin=kiln, plugin=plugin, cwd=root)
    m["torch"] = torch.__version__
    m["torch_cuda"] = torch.version.cuda
    res["machine"] = m
    cuda_7b.ceilings()
    torch.cuda.empty_cache()
    copy, rate = cuda_7b.RESULT["copy_GBps"], cuda_7b.RESULT["bf16_TFLOPs"]
    res["ceilings"] = {"copy_GBps": copy, "bf16_TFLOPs": rate}
    res["figures"], res["runs"] = {}, {}
    save()

    failed = False
    # Another request count is another figure: recorded under its own name, never compared
    # with the 1,000-request one (the comparison then reports that one missing).
    tput_name = "offline_tok_s" if a.requests == 1000 else "offline_tok_s_%d" % a.requests
    runs = (("decode_ms", "decode", lambda: perf_run.decode(kiln, path, cwd=root)),
            ("prefill512_ms", "prefill", lambda: perf_run.prefill(kiln, path, cwd=root)),
            (tput_name, "throughput",
             lambda: perf_run.throughput(kiln, path, a.requests, cwd=root, timeout=480)))
    for name, kind, fn in runs:
        r = fn()
        res["runs"][name] = r
        v = perf_run.figure(r, kind)
        fig = {"value": v}
        if v is None:
            fig["error"] = r.get("error", "no figure in the bench output")
            failed = True
        elif kind == "decode":
            floor = wb / (copy * 1e9) * 1e3
            fig.update(floor_ms=round(floor, 3), fraction=round(floor / v, 3))
        elif kind == "prefill":
            floor = 2 * (wb / 2) * 512 / (rate * 1e12) * 1e3
            fig.update(floor_ms=round(floor, 3), fraction=round(floor / v, 3))
        elif kind == "throughput":
            fig["requests"] = a.requests
        res["figures"][name] = fig
        perf_run.log("%-14s %s" % (name, fig))
        save()

    results = a.results or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    rc = perf_compare.main([out, "--results", results, "--threshold", str(a.threshold),
                            "--json", os.path.join(a.out_dir, "perf_compare.json")])
    perf_run.log("result: %s (copy it into bench/results/)" % out)
    return 3 if failed and rc == 0 else rc


if __name__ == "__main__":
    sys.exit(main())
