#!/usr/bin/env python3
"""perf_bisect.py - the measuring half of tools/dev/perf_bisect.sh (run that, not this): the
prefill-512 and a shortened offline throughput for each of several Kiln builds, on one random
Qwen2-7B made once (bench/cuda_7b.py's model), with the card's ceilings measured once.

  python3 bench/perf_bisect.py --make-model --work /tmp/m7
  python3 bench/perf_bisect.py --work /tmp/m7 --builds BUILDS.tsv --requests 300 \
      --deadline EPOCH_S --out OUT.json

BUILDS.tsv: one line per row of the table, tab-separated: label, source root (holding
build/bin/kiln and etc/kiln.ini), commit, archs, env ("-" or VAR=VALUE[,VAR=VALUE]). Rows are
measured in file order; each row is one `kiln bench latency` (512 + 1) and one `kiln bench
throughput` (N x (512 + 256)) process. With time left before the deadline a second round of
prefill runs follows, so each prefill figure has two samples and the run shows its own noise.

The shortened throughput (300 requests by default) is for comparing builds within one run
only: 300 prompts are one full batch of 256 sequences and a tail of 44, so ramp-up and drain
weigh more than in the 1,000-request figure (about 3.9 batches) and its tokens/s come out
lower than that figure for the same build; the ratio between builds is what it measures.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import perf_run  # noqa: E402

RESULT = {"rows": []}


def save(path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(RESULT, f, indent=1)
    os.replace(tmp, path)


def read_builds(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.split("\t")
            if len(parts) != 5:
                sys.exit("%s:%d: want 5 tab-separated fields (label, root, commit, archs, env), "
                         "got %d" % (path, n, len(parts)))
            label, root, commit, archs, env = parts
            envd = {}
            if env != "-":
                for kv in env.split(","):
                    if "=" not in kv:
                        sys.exit("%s:%d: env entry %r is not VAR=VALUE" % (path, n, kv))
                    k, v = kv.split("=", 1)
                    envd[k] = v
            rows.append(dict(label=label, root=root, commit=commit, archs=archs, env=envd))
    return rows


def table(rows, ref_label):
    ref = next((r for r in rows if r["label"] == ref_label), rows[0] if rows else None)
    out = ["%-18s %-15s %-10s %-20s %20s %6s %14s %6s" % (
        "build", "commit", "archs", "env", "prefill-512 ms", "x ref", "offline tok/s", "x ref")]

    def fmt(v, nd):
        return ("%.*f" % (nd, v)) if v is not None else "-"

    for r in rows:
        p, t = r.get("prefill_ms"), r.get("throughput_tok_s")
        p_all = r.get("prefill_ms_all", [])
        ps = fmt(p, 2) + ("" if len(p_all) < 2 else " (%s)" % "/".join("%.2f" % x for x in p_all))
        rp = (ref["prefill_ms"] / p) if ref and p and ref.get("prefill_ms") else None
        rt = (t / ref["throughput_tok_s"]) if ref and t and ref.get("throughput_tok_s") else None
        env = ",".join("%s=%s" % kv for kv in r["env"].items()) or "-"
        out.append("%-18s %-15s %-10s %-20s %20s %6s %14s %6s" % (
            r["label"], r["commit"][:15], r["archs"], env[:20], ps, fmt(rp, 3), fmt(t, 0),
            fmt(rt, 3)))
    out.append("x ref: speed relative to row '%s' (above 1 = faster); prefill is the median of "
               "the samples shown" % (ref["label"] if ref else "-"))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/m7")
    ap.add_argument("--shape", default="qwen2-7b")
    ap.add_argument("--make-model", action="store_true", help="only build the model, then exit")
    ap.add_argument("--builds")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--deadline", type=float, default=0, help="epoch seconds; 0 = none")
    ap.add_argument("--ref", default="0815eff", help="label of the row the ratios are against")
    ap.add_argument("--out")
    a = ap.parse_args()
    import cuda_7b  # torch and transformers: only on the GPU machine
    path = os.path.join(a.work, a.shape)
    if a.make_model:
        cuda_7b.build(a.shape, path)
        return 0
    if not a.builds or not a.out:
        ap.error("--builds and --out are needed to measure")
    rows = read_builds(a.builds)
    cuda_7b.build(a.shape, path)  # a no-op when --make-model made it
    RESULT.update(shape=a.shape, requests=a.requests, weight_bytes=cuda_7b.weight_bytes(path),
                  date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    first_root = rows[0]["root"] if rows else None
    RESULT["machine"] = perf_run.machine(
        kiln_bin=os.path.join(first_root, "build/bin/kiln") if first_root else None,
        plugin=os.path.join(first_root, "build/lib/kiln/libkiln-backend-cuda.so") if first_root else None,
        cwd=first_root)
    cuda_7b.ceilings()
    import torch
    torch.cuda.empty_cache()
    RESULT["ceilings"] = {"copy_GBps": cuda_7b.RESULT["copy_GBps"],
                          "bf16_TFLOPs": cuda_7b.RESULT["bf16_TFLOPs"]}
    save(a.out)

    def left():
        return a.deadline - time.time() if a.deadline else 1e9

    t_put_est = 20 + a.requests * 256 / 7000.0  # start-up + tokens at a pessimistic rate
    for r in rows:
        rec = dict(r)
        RESULT["rows"].append(rec)
        kb = os.path.join(r["root"], "build/bin/kiln")
        if not os.path.exists(kb):
            rec["error"] = "not built (see the build log)"
            save(a.out)
            continue
        rec["build_info"] = perf_run.machine(kiln_bin=kb, cwd=r["root"]).get("kiln_info")
        if left() < 25:
            rec["skipped"] = "deadline"
            continue
        res = perf_run.prefill(kb, path, tag="prefill_" + r["label"], cwd=r["root"], env=r["env"])
        rec["prefill"] = res
        v = perf_run.figure(res, "prefill")
        rec["prefill_ms_all"] = [v] if v is not None else []
        rec["prefill_ms"] = v
        perf_run.log("%-22s prefill-512 %s ms" % (r["label"], v))
        save(a.out)
        if left() < t_put_est:
            rec["throughput_skipped"] = "deadline"
            continue
        res = perf_run.throughput(kb, path, a.requests, tag="tput_" + r["label"], cwd=r["root"],
                                  env=r["env"])
        rec["throughput"] = res
        rec["throughput_tok_s"] = perf_run.figure(res, "throughput")
        perf_run.log("%-22s offline %d x (512 + 256): %s output tok/s" % (
            r["label"], a.requests, rec["throughput_tok_s"]))
        save(a.out)
    # A second prefill sample per build while time is left.
    for rec in RESULT["rows"]:
        if rec.get("prefill_ms") is None or left() < 25:
            continue
        res = perf_run.prefill(os.path.join(rec["root"], "build/bin/kiln"), path,
                               tag="prefill2_" + rec["label"], cwd=rec["root"], env=rec["env"])
        v = perf_run.figure(res, "prefill")
        if v is not None:
            rec["prefill_ms_all"].append(v)
            s = sorted(rec["prefill_ms_all"])
            rec["prefill_ms"] = (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2
        save(a.out)
    txt = table(RESULT["rows"], a.ref)
    c = RESULT["ceilings"]
    head = ("perf_bisect %s, %s; ceilings: copy %.0f GB/s, bf16 matmul %.0f TFLOP/s; offline = "
            "%d x (512 + 256)" % (RESULT["date"], RESULT["machine"].get("gpu", "?"),
                                  c["copy_GBps"], c["bf16_TFLOPs"], a.requests))
    RESULT["table"] = head + "\n" + txt
    save(a.out)
    print(RESULT["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
