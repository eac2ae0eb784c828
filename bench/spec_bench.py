#!/usr/bin/env python3
"""spec_bench.py - issue 20's speculative-decoding speedups: a trained target model with and
without speculation (a draft model, n-gram lookup) at batch 1, 4 and 16, on natural-text
prompts and on a copy-heavy editing task, all in one run so every ratio is within the run.

    python3 bench/spec_bench.py --kiln build/bin/kiln --target DIR [--draft share/models/kiln-tiny]
        [--out results.json] [--set backend.name=cpu --set backend.threads=2] [--quick]

The target is a model trained on the same corpus and tokenizer as kiln-tiny (random weights
accept nothing): `python3 tools/train_default_model.py --name kiln-small --tokenizer
share/models/kiln-tiny/tokenizer.json ...` on the GPU machine (see that script's docstring).

Workloads (greedy, ignore_eos, `kiln bench throughput --dataset`, max_num_seqs = the batch):
  natural  the held-out documents of tests/fixtures/default_model/heldout.txt, cut to their
           first 400 characters (text neither model was trained on), 128 tokens each
  copy     an editing task: a held-out document, then "Repeat the text above exactly:" and
           its first 120 characters, so the continuation is a copy, 128 tokens each
Each (workload, batch) runs with speculation off, method = draft (k = 4) and method = ngram
(k = 4, n-grams 2-4); at batch 16 also with disable_by_batch_size = 64 (the default, 8, turns
speculation off above 8 running sequences, so batch 16 shows the rule and the lifted rule
shows what speculation would cost there). Output tok/s is generated tokens over the wall time
from the first submission to the last completion; the speedup is against off in the same run.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def documents(path):
    text = open(path, encoding="utf-8").read()
    docs = [d.strip() for d in re.split(r"\n\s*\n", text)]
    return [d for d in docs if len(d) >= 150]


def write_dataset(path, prompts, max_tokens):
    with open(path, "w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p, "max_tokens": max_tokens}) + "\n")


def run(kiln, target, dataset, batch, spec, extra, env):
    fd, jpath = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [kiln, "bench", "throughput", "--model", target, "--dataset", dataset,
           "--json", jpath, "--set", f"engine.max_num_seqs={batch}"]
    for s in spec + extra:
        cmd += ["--set", s]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        raise SystemExit(f"spec_bench: {' '.join(cmd)} failed ({p.returncode})")
    res = json.load(open(jpath))
    os.unlink(jpath)
    res["command"] = " ".join(cmd)
    res["process_s"] = round(wall, 2)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=os.path.join(ROOT, "share/models/kiln-tiny"))
    ap.add_argument("--heldout", default=os.path.join(ROOT, "tests/fixtures/default_model/heldout.txt"))
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--set", action="append", default=[], help="passed to every kiln run")
    ap.add_argument("--quick", action="store_true", help="fewer requests per run")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    docs = documents(a.heldout)
    if len(docs) < 8:
        raise SystemExit(f"spec_bench: {a.heldout}: only {len(docs)} documents")
    work = tempfile.mkdtemp(prefix="kiln-spec-")
    natural = [d[:400] for d in docs]
    copy = [f"{d[:600]}\n\nRepeat the text above exactly:\n{d[:120]}" for d in docs]
    env = dict(os.environ)
    methods = {
        "off": ["speculative.method=off"],
        "draft": ["speculative.method=draft", f"speculative.draft_model={a.draft}",
                  f"speculative.num_speculative_tokens={a.k}"],
        "ngram": ["speculative.method=ngram", f"speculative.num_speculative_tokens={a.k}"],
    }
    rows = []
    for wl, prompts in (("natural", natural), ("copy", copy)):
        for b in [int(x) for x in a.batches.split(",")]:
            n = max(2 * b, 8) if a.quick else max(4 * b, 16)
            ds = os.path.join(work, f"{wl}-{b}.jsonl")
            write_dataset(ds, [prompts[i % len(prompts)] for i in range(n)], a.max_tokens)
            variants = [(m, methods[m], "") for m in methods]
            if b > 8:
                variants += [(m, methods[m] + ["speculative.disable_by_batch_size=64"], "lifted")
                             for m in ("draft", "ngram")]
            base = None
            for name, spec, note in variants:
                r = run(a.kiln, a.target, ds, b, spec, a.set, env)
                tps = r.get("output_tokens_per_s") or r.get("output_tok_s")
                if name == "off":
                    base = tps
                row = {"workload": wl, "batch": b, "requests": n, "method": name,
                       "rule": note or "default", "output_tok_s": tps,
                       "speedup": round(tps / base, 3) if base else None,
                       "acceptance_rate": r.get("spec_acceptance_rate"),
                       "mean_accepted_length": r.get("spec_mean_accepted_length"),
                       "spec_draft_tokens": r.get("spec_draft_tokens"),
                       "spec_accepted_tokens": r.get("spec_accepted_tokens"), "raw": r}
                rows.append(row)
                acc = row["acceptance_rate"]
                print(f"{wl:8s} batch {b:3d} {name:6s} {note or '':7s} {tps:10.1f} tok/s  "
                      f"x{row['speedup']:.2f}" + (f"  accepted {100 * acc:.1f}% mean len "
                                                   f"{row['mean_accepted_length']:.2f}"
                                                   if acc is not None else ""), flush=True)
    out = {"target": a.target, "draft": a.draft, "k": a.k, "max_tokens": a.max_tokens,
           "set": a.set, "rows": rows}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
