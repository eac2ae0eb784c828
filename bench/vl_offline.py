#!/usr/bin/env python3
"""vl_offline.py - issue 16's offline image throughput on the GPU machine: N image requests of
varied sizes (one image and a question each, greedy, exactly --output tokens) through
`kiln generate --input`, through `kiln serve` driven by `kiln bench serve --dataset`, and through
transformers' batched `generate` on the same requests, Qwen2-VL-7B-Instruct's shape with random
bf16 weights (bench/vl_7b.py builds it), everything in one run on one card.

Usage: python3 bench/vl_offline.py --kiln KILN --tokenizer DIR --work /tmp/vl7 [--requests 500]
           [--output 128] [--hf-requests 128] [--hf-batch 16] [--steps generate,serve,hf]
           [--out result.json]

The requests: image i is a W x H JPEG (q90, a gradient plus gaussian noise, seeded by i), W and H
drawn uniformly from 224..1280 and 224..1024, so its image tokens (smart_resize, 28 x 28 pixels
each) range from 64 to ~1,600; the text is one user message "Describe this image in detail.",
rendered by the chat template this script writes into the model folder (Qwen2-VL's layout: a
default system message, <|vision_start|><|image_pad|><|vision_end|> per image).
--tokenizer DIR holds a Qwen tokenizer.json (tests/fetch_tokenizers.sh's qwen3: the vision
tokens are at Qwen2-VL's ids) that is copied into the model folder, so the server can render chats.
- kiln generate --input: one JSONL line per request ("messages" with the image's path, max_tokens,
  ignore_eos, temperature 0); output tokens/s from its own summary (model load excluded).
- kiln serve + kiln bench serve --dataset (the same messages with data: URLs, rate inf, streamed
  chat completions): output tokens/s, TTFT and TPOT percentiles, after the server is up.
- transformers: bf16, SDPA, batches of --hf-batch requests (left-padded: the processor's image
  tensors concatenated, the prompt ids built with each image's token count as its processor does),
  timed around generate after a warm-up batch; on the first --hf-requests requests only (its
  time for all of them would exceed a device call), so its figure is tok/s over that subset.
Every figure is output tokens / wall seconds, and prompt tokens (image tokens included) are
summed the same way for each.
"""
import argparse
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vl_7b  # noqa: E402

QUESTION = "Describe this image in detail."
TEMPLATE = (
    "{%- if messages[0].role != 'system' -%}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif -%}"
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' or p.type == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor -%}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}")

# One clock, one result and its writer for the run: vl_7b's (its ceilings and builder are used too).
T0, RESULT, log, save = vl_7b.T0, vl_7b.RESULT, vl_7b.log, vl_7b.save


def make_images(d, n):
    import numpy as np
    from PIL import Image
    os.makedirs(d, exist_ok=True)
    paths = []
    for i in range(n):
        p = os.path.join(d, "img_%04d.jpg" % i)
        paths.append(p)
        if os.path.exists(p):
            continue
        rng = np.random.default_rng(1000 + i)
        w, h = int(rng.integers(224, 1281)), int(rng.integers(224, 1025))
        y, x = np.mgrid[0:h, 0:w]
        img = np.stack([x * 255 / max(1, w - 1), y * 255 / max(1, h - 1), (x + y + i) % 256], -1)
        img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img, "RGB").save(p, quality=90)
    return paths


def add_tokenizer(model_dir, tokdir):
    shutil.copy(os.path.join(tokdir, "tokenizer.json"), os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>"}, f)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)


def messages(url):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def data_url(path):
    with open(path, "rb") as f:
        return "data:image/jpeg;base64," + base64.b64encode(f.read()).decode()


def kiln_env(a):
    env = dict(os.environ)
    if a.kiln_ld_path:
        env["LD_LIBRARY_PATH"] = a.kiln_ld_path
    return env


def run_generate(a, model, paths, work):
    jl = os.path.join(work, "vl_requests.jsonl")
    with open(jl, "w") as f:
        for p in paths:
            f.write(json.dumps({"messages": messages(p), "max_tokens": a.output, "ignore_eos": True,
                                "temperature": 0}) + "\n")
    outp = os.path.join(work, "vl_results.jsonl")
    cmd = [a.kiln, "generate", "--model", model, "--input", jl, "--output", outp,
           "--set", "backend.name=cuda"] + a.kiln_set
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=kiln_env(a), timeout=a.step_timeout)
    r = dict(cmd=" ".join(cmd), rc=p.returncode, wall_incl_load_s=time.time() - t,
             summary=p.stderr[-1200:])
    m = re.search(r"in ([0-9.]+) s: ([0-9.]+) requests/s, ([0-9.]+) output tokens/s", p.stderr)
    if m:
        r.update(wall_s=float(m.group(1)), requests_s=float(m.group(2)), output_tok_s=float(m.group(3)))
    lines = [json.loads(x) for x in open(outp)] if os.path.exists(outp) else []
    r["ok"] = sum(1 for x in lines if "error" not in x and len(x.get("token_ids", [])) == a.output)
    r["prompt_tokens"] = sum(x.get("usage", {}).get("prompt_tokens", 0) for x in lines)
    r["first_tokens"] = [x.get("token_ids", [None])[0] for x in lines[:a.hf_requests]]
    return r


def run_serve(a, model, paths, work):
    ds = os.path.join(work, "vl_dataset.jsonl")
    with open(ds, "w") as f:
        for p in paths:
            f.write(json.dumps({"messages": messages(data_url(p)), "max_tokens": a.output}) + "\n")
    log_path = os.path.join(work, "serve.log")
    cmd = [a.kiln, "serve", "--model", model, "--set", "server.port=0", "--set", "backend.name=cuda"] + a.kiln_set
    srv = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=kiln_env(a))
    url = None
    t = time.time()
    while time.time() - t < 180 and srv.poll() is None:
        m = re.search(r"serving .* on (http://127\.0\.0\.1:[0-9]+)", open(log_path).read())
        if m:
            url = m.group(1)
            break
        time.sleep(0.5)
    r = dict(serve_cmd=" ".join(cmd), startup_s=time.time() - t)
    if not url:
        r["error"] = open(log_path).read()[-2000:]
        srv.kill()
        return r
    js = os.path.join(work, "bench_serve.json")
    bcmd = [a.kiln, "bench", "serve", "--url", url, "--endpoint", "chat", "--dataset", ds,
            "--num-prompts", str(len(paths)), "--request-rate", "inf", "--ignore-eos",
            "--temperature", "0", "--warmup", "2", "--timeout", str(a.step_timeout), "--json", js]
    p = subprocess.run(bcmd, capture_output=True, text=True, env=kiln_env(a), timeout=a.step_timeout)
    r.update(bench_cmd=" ".join(bcmd), rc=p.returncode, stdout=p.stdout[-2500:], stderr=p.stderr[-1500:])
    if os.path.exists(js):
        with open(js) as f:
            j = json.load(f)
        j.pop("requests", None)
        r["bench"] = j
    srv.send_signal(signal.SIGTERM)
    try:
        srv.wait(30)
    except subprocess.TimeoutExpired:
        srv.kill()
    r["server_log_tail"] = open(log_path).read()[-1500:]
    return r


def run_hf(a, model_dir, paths):
    from PIL import Image
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"))
    proc = vl_7b.image_processor()
    s = vl_7b.SHAPES[a.shape]
    merge = s["vision"]["spatial_merge_size"]
    model = getattr(transformers, s["arch"]).from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    head = tok.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    tail = tok.encode(QUESTION + "<|im_end|>\n<|im_start|>assistant\n")
    pad_id = vl_7b.ENDOFTEXT

    def batch(ps):
        out = proc(images=[Image.open(p).convert("RGB") for p in ps], return_tensors="pt")
        grids = out["image_grid_thw"]
        seqs = []
        for g in grids:
            n = int(g.prod().item()) // (merge * merge)
            seqs.append(head + [vl_7b.VISION_START] + [vl_7b.IMAGE_PAD] * n + [vl_7b.VISION_END] + tail)
        L = max(len(x) for x in seqs)
        ids = torch.tensor([[pad_id] * (L - len(x)) + x for x in seqs], device="cuda")
        mask = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in seqs], device="cuda")
        # mm_token_type_ids: transformers 5.x's M-RoPE needs them (1 = image token); generate
        # without them silently gives image tokens 1-D positions (found 2026-12-03).
        return dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == vl_7b.IMAGE_PAD).long(),
                    pixel_values=out["pixel_values"].to("cuda", torch.bfloat16),
                    image_grid_thw=grids.to("cuda")), sum(len(x) for x in seqs)

    def gen(ps, n):
        kw, ptok = batch(ps)
        with torch.no_grad():
            o = model.generate(**kw, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=pad_id)
        return o[:, kw["input_ids"].shape[1]:], ptok

    B = a.hf_batch
    sub = paths[:a.hf_requests]
    gen(sub[:B], 4)  # warm-up
    torch.cuda.synchronize()
    t = time.time()
    outs, ptoks, first = 0, 0, []
    for i in range(0, len(sub), B):
        o, pt = gen(sub[i:i + B], a.output)
        outs += o.numel()
        ptoks += pt
        first.extend(o[:, 0].tolist())
        if time.time() - T0 > a.budget_s:
            log("hf: budget spent after %d requests" % (i + B))
            sub = sub[:i + B]
            break
    torch.cuda.synchronize()
    wall = time.time() - t
    del model
    torch.cuda.empty_cache()
    return dict(requests=len(sub), batch=B, wall_s=wall, output_tokens=outs, prompt_tokens=ptoks,
                output_tok_s=outs / wall, requests_s=len(sub) / wall, first_tokens=first)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--kiln-ld-path", default=os.environ.get("KILN_LD_LIBRARY_PATH"),
                    help="LD_LIBRARY_PATH for the kiln processes only")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--work", default="/tmp/vl7")
    ap.add_argument("--shape", default="qwen2-vl-7b")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--hf-requests", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--steps", default="generate,serve,hf")
    ap.add_argument("--kiln-set", action="append", default=[],
                    help="extra --set section.key=value for every kiln process (repeatable)")
    ap.add_argument("--step-timeout", type=int, default=300)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--out")
    a = ap.parse_args()
    a.kiln_set = [x for kv in a.kiln_set for x in ("--set", kv)]
    steps = a.steps.split(",")
    os.makedirs(a.work, exist_ok=True)
    RESULT["versions"] = dict(transformers=transformers.__version__, torch=torch.__version__,
                              gpu=torch.cuda.get_device_name())
    RESULT["setup"] = dict(requests=a.requests, output=a.output, hf_requests=a.hf_requests,
                           hf_batch=a.hf_batch, shape=a.shape, question=QUESTION)
    copy, mm = vl_7b.ceilings()
    RESULT["ceilings"] = dict(copy_GBps=copy, bf16_TFLOPs=mm)
    log("ceilings: copy %.0f GB/s, bf16 %.0f TFLOP/s" % (copy, mm))
    model = os.path.join(a.work, a.shape)
    vl_7b.build(a.shape, model)
    add_tokenizer(model, a.tokenizer)
    log("model built")
    paths = make_images(os.path.join(a.work, "images"), a.requests)
    log("%d images made" % len(paths))
    for st in steps:
        if time.time() - T0 > a.budget_s:
            log("budget spent: %s skipped" % st)
            continue
        if st == "generate":
            r = run_generate(a, model, paths, a.work)
            log("kiln generate --input: %s output tok/s, %s requests/s, %d ok, %d prompt tokens"
                % (r.get("output_tok_s"), r.get("requests_s"), r["ok"], r["prompt_tokens"]))
        elif st == "serve":
            r = run_serve(a, model, paths, a.work)
            b = r.get("bench", {})
            log("kiln serve: rc %s, %s" % (r.get("rc"), r.get("stdout", r.get("error", ""))[-900:]))
            del b
        elif st == "hf":
            r = run_hf(a, model, paths)
            log("transformers: %.1f output tok/s over %d requests (batch %d), %d prompt tokens"
                % (r["output_tok_s"], r["requests"], r["batch"], r["prompt_tokens"]))
        else:
            raise SystemExit("unknown step " + st)
        RESULT[st] = r
        save(a.out)
    g, h = RESULT.get("generate", {}), RESULT.get("hf", {})
    if g.get("first_tokens") and h.get("first_tokens"):
        n = min(len(g["first_tokens"]), len(h["first_tokens"]))
        RESULT["first_token_agree"] = sum(1 for i in range(n) if g["first_tokens"][i] == h["first_tokens"][i])
        RESULT["first_token_compared"] = n
    if g.get("output_tok_s") and h.get("output_tok_s"):
        RESULT["generate_vs_hf"] = g["output_tok_s"] / h["output_tok_s"]
    save(a.out)
    log(json.dumps({k: RESULT.get(k) for k in ("generate_vs_hf", "first_token_agree",
                                                 "first_token_compared")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
