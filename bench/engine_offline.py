#!/usr/bin/env python3
"""engine_offline.py - offline throughput of Kiln's engine (`kiln generate --input`) against
transformers' batched `generate` on the same real-size model with random weights, on the GPU
machine, in the same run.

Usage: python3 bench/engine_offline.py --kiln build/bin/kiln --work /tmp/mb --shape qwen2-0.5b
         [--requests 256] [--prompt 128] [--output 128] [--hf-batch 64] [--hf-requests N]
         --out result.json

Every request has the same prompt length (random ids) and generates exactly --output tokens
(ignore_eos), greedy. Kiln gets all requests at once and batches them continuously; transformers
gets them in batches of --hf-batch (same-length prompts need no padding), SDPA attention, its
default dynamic cache. Both run bf16 on the same GPU. Output tokens/s = requests x output /
wall time (Kiln: from its own summary, which starts after the model is loaded; transformers:
around generate, after a warm-up batch).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_vs_hf import build  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--work", default="/tmp/mb")
    ap.add_argument("--shape", default="qwen2-0.5b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--hf-requests", type=int, default=0,
                    help="time transformers on only the first N requests (0 = all)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    path = os.path.join(a.work, a.shape)
    build(a.shape, path)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 30000, (a.requests, a.prompt), generator=g)
    jl = os.path.join(a.work, "requests.jsonl")
    with open(jl, "w") as f:
        for p in prompts.tolist():
            f.write(json.dumps({"prompt_ids": p, "max_tokens": a.output, "ignore_eos": True,
                                "temperature": 0}) + "\n")
    res = {"shape": a.shape, "requests": a.requests, "prompt": a.prompt, "output": a.output}
    outp = os.path.join(a.work, "results.jsonl")
    t0 = time.time()
    r = subprocess.run([a.kiln, "generate", "--model", path, "--input", jl, "--output", outp,
                        "--set", "backend.name=cuda", "--set", "engine.max_num_seqs=%d" % a.max_num_seqs,
                        "--set", "engine.max_num_batched_tokens=8192"],
                       capture_output=True, text=True)
    res["kiln_wall_s_incl_load"] = time.time() - t0
    res["kiln_rc"] = r.returncode
    res["kiln_summary"] = r.stderr[-1500:]
    m = re.search(r"([0-9.]+) output tokens/s", r.stderr)
    res["kiln_output_tok_s"] = float(m.group(1)) if m else None
    lines = [json.loads(x) for x in open(outp)] if os.path.exists(outp) else []
    res["kiln_ok"] = sum(1 for x in lines if "error" not in x and len(x.get("token_ids", [])) == a.output)
    print("kiln:", res["kiln_output_tok_s"], "output tok/s;", res["kiln_ok"], "of", a.requests, "ok",
          flush=True)
    # transformers, batched generate
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").cuda().eval()
    B = a.hf_batch
    hf_n = a.hf_requests if 0 < a.hf_requests < a.requests else a.requests
    with torch.no_grad():
        model.generate(prompts[:B].cuda(), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.time()
        agree = 0
        for i in range(0, hf_n, B):
            out = model.generate(prompts[i:i + B].cuda(), max_new_tokens=a.output,
                                 min_new_tokens=a.output, do_sample=False)
            gen = out[:, a.prompt:].tolist()
            for k, row in enumerate(gen):
                if i + k < len(lines) and lines[i + k].get("token_ids", [])[:8] == row[:8]:
                    agree += 1
        torch.cuda.synchronize()
        dt = time.time() - t0
    res["hf_requests"] = hf_n
    res["hf_output_tok_s"] = hf_n * a.output / dt
    res["first8_greedy_agree"] = agree
    print("transformers:", round(res["hf_output_tok_s"], 1), "output tok/s (batch %d, %d requests);"
          % (B, hf_n), "first 8 greedy tokens agree on", agree, "of", hf_n, flush=True)
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
