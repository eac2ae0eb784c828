#!/usr/bin/env python3
"""warmup_ttft.py - the cold-shape penalty: time to first token of the first request a fresh
engine serves, against the same request once the engine is warm, with [engine] warmup off and
on (docs/perf.md "The cold-shape penalty", issue 24 item 6: within 1.2x, start-up under 10 s).

Each (mode, repeat) runs in a fresh Python process (a fresh CUDA context, fresh cuBLASLt
heuristics cache, nothing loaded yet), through the kiln package (python/, ctypes over
libkiln): LLM(model, warmup=mode), then the same prompts one at a time, each a fresh random
prompt of --prompt-len token ids (no prefix-cache hit), max_tokens --gen, ignore_eos. Per
process: the start-up seconds (LLM() returning, warm-up included), the first request's TTFT
and the median TTFT of the requests after it (the warm figure), and the median per-output-token
time of those. Writes JSON (--out) and prints one line per process.

    python3 bench/warmup_ttft.py --model /tmp/m7/qwen2-7b --out warmup.json
(about 20 s a process for a 7B model on an H200). Options: --lens 512,128 (each length is one
request sequence: the first request of the process has the first length), --repeats 2,
--modes off,on, --backend cuda, --library build/lib/libkiln.so.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(a):
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import random
    from kiln import LLM, SamplingParams
    lens = [int(x) for x in a.lens.split(",")]
    t0 = time.perf_counter()
    llm = LLM(a.model, backend=a.backend, warmup=a.mode)
    startup = time.perf_counter() - t0
    vocab = llm.info["vocab_size"]
    rng = random.Random(1234)
    sp = SamplingParams(max_tokens=a.gen, ignore_eos=True, temperature=0)
    rows = []
    for L in lens:
        for i in range(a.per_len):
            ids = [rng.randrange(1000, min(vocab, 30000)) for _ in range(L)]
            t = time.perf_counter()
            out = llm.generate({"prompt_token_ids": ids}, sp)[0]
            wall = time.perf_counter() - t
            m = out.metrics or {}
            rows.append({"len": L, "ttft_s": m.get("first_token_time"), "wall_s": wall,
                         "tokens": len(out.outputs[0].token_ids)})
    llm.close()
    print(json.dumps({"mode": a.mode, "startup_s": startup, "requests": rows}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out")
    ap.add_argument("--lens", default="512,128")
    ap.add_argument("--per-len", type=int, default=4, help="requests per length (default 4)")
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="off,on")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--library", default=os.path.join(ROOT, "build", "lib", "libkiln.so"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="on", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    env = dict(os.environ, KILN_LIBRARY=a.library)
    runs = []
    for mode in a.modes.split(","):
        for r in range(a.repeats):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode,
                   "--model", a.model, "--lens", a.lens, "--per-len", str(a.per_len),
                   "--gen", str(a.gen), "--backend", a.backend]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode:
                print(f"{mode} #{r}: failed (rc {p.returncode}): {p.stderr.strip()[-800:]}")
                continue
            doc = json.loads(p.stdout.strip().splitlines()[-1])
            reqs = doc["requests"]
            first = reqs[0]
            warm = [x["ttft_s"] for x in reqs[1:] if x["len"] == first["len"]]
            wm = statistics.median(warm) if warm else None
            doc["first_ttft_s"] = first["ttft_s"]
            doc["warm_ttft_s"] = wm
            doc["first_over_warm"] = first["ttft_s"] / wm if wm else None
            runs.append(doc)
            print(f"warmup={mode} #{r}: start-up {doc['startup_s']:.2f} s, first "
                  f"{first['len']}-token TTFT {first['ttft_s'] * 1e3:.1f} ms, warm "
                  f"{wm * 1e3:.1f} ms -> {doc['first_over_warm']:.2f}x"
                  + "".join(f"; {x['len']}: {x['ttft_s'] * 1e3:.1f}" for x in reqs[1:]))
    res = {"model": a.model, "lens": a.lens, "per_len": a.per_len, "gen": a.gen,
           "backend": a.backend, "runs": runs}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
