#!/usr/bin/env python3
"""cuda_7b.py - Kiln against transformers on a real-size model (random bf16 weights) on the GPU
machine, in one run, with the card's own ceilings measured in the same run.

Usage: python3 bench/cuda_7b.py --kiln build/bin/kiln --work /tmp/m7 --shape qwen2-7b \
           [--steps ceilings,hf,latency,prefill,throughput,long,ablation] --out result.json

Steps (each appends its numbers to the JSON file as it goes, so a time-out keeps what ran):
  ceilings    copy bandwidth (a 4 GiB device-to-device copy, read + write bytes / time) and the
              bf16 matrix rate (8192^3 torch.matmul), the medians of 10.
  hf          transformers' generate (bf16, SDPA, dynamic cache), batch 1: 128-token prompt,
              256 new tokens (ms per output token after the first), and a 512-token prefill.
  latency     kiln bench latency, batch 1, 128 + 256 (time per output token) against the
              weight-streaming floor = weight bytes / copy bandwidth.
  prefill     kiln bench latency --output-len 1 on a 512-token prompt against the compute
              floor = 2 * params * 512 / matrix rate.
  throughput  kiln bench throughput: 1000 x (512 + 256).
  long        kiln bench throughput: 1000 x (1000 + 1000) (fewer with --long-requests).
  ablation    batch-1 128 + 256 with graphs off, chunked prefill off, fp32; transformers fp16.
The model is built on the GPU with transformers (from_config, random normal(0, 0.02) weights)
and saved once with save_pretrained under --work.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

SHAPES = {
    # Qwen2-7B: hidden 3584, 28 layers, 28 heads / 4 KV heads, intermediate 18944, vocab 152064.
    "qwen2-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                     vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False,
                     rope_theta=1000000.0, rms_norm_eps=1e-6),
    # Llama-3-8B: hidden 4096, 32 layers, 32 heads / 8 KV heads, intermediate 14336, vocab 128256.
    "llama3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                      vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
                      rope_theta=500000.0, rms_norm_eps=1e-5),
}

RESULT = {}
OUT = None


def save():
    if OUT:
        json.dump(RESULT, open(OUT, "w"), indent=1)


def log(*a):
    print(*a, flush=True)


def build(shape, path):
    if os.path.exists(os.path.join(path, "config.json")):
        return
    t0 = time.time()
    kw = dict(SHAPES[shape])
    model_type = kw.pop("model_type")
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norms
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    RESULT["build_s"] = round(time.time() - t0, 1)
    log("built", shape, "in", RESULT["build_s"], "s")


def ceilings():
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for _ in range(12):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    bw = 2 * n / statistics.median(ts[2:])
    del a, b
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ts = []
    for _ in range(12):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x @ y
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    rate = 2 * 8192 ** 3 / statistics.median(ts[2:])
    RESULT["copy_GBps"] = round(bw / 1e9, 1)
    RESULT["bf16_TFLOPs"] = round(rate / 1e12, 1)
    log("ceilings: copy %.0f GB/s, bf16 matmul %.0f TFLOP/s" % (bw / 1e9, rate / 1e12))
    save()


def weight_bytes(path):
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(idx):
        return json.load(open(idx))["metadata"]["total_size"]
    return os.path.getsize(os.path.join(path, "model.safetensors"))


def hf(path, dtype, tag):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").cuda().eval()
    g = torch.Generator().manual_seed(1)
    p = torch.randint(1000, 100000, (1, 128), generator=g).cuda()
    with torch.no_grad():
        model.generate(p, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        # time per output token: (256 new) - (1 new), over 255 tokens
        def gen(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(p, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        t1 = statistics.median([gen(1) for _ in range(3)])
        t256 = gen(256)
        tpot = (t256 - t1) / 255
        p512 = torch.randint(1000, 100000, (1, 512), generator=g).cuda()
        ts = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(p512)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
    RESULT[tag] = {"tpot_ms": round(tpot * 1e3, 3), "prefill512_ms": round(statistics.median(ts[1:]) * 1e3, 2)}
    log(tag, RESULT[tag])
    del model
    torch.cuda.empty_cache()
    save()


def kiln(args, kiln_bin, path, name, extra=()):
    out = "/tmp/kiln_bench_%s.json" % name
    cmd = [kiln_bin, "bench"] + args + ["--model", path, "--json", out, "--set", "backend.name=cuda"] + list(extra)
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        RESULT[name] = {"error": r.stderr[-1500:], "cmd": " ".join(cmd)}
        log(name, "FAILED:", r.stderr[-1500:])
        save()
        return None
    res = json.load(open(out))
    res["wall_s"] = round(time.time() - t0, 1)
    res["cmd"] = " ".join(cmd[1:])
    RESULT[name] = res
    log(name, r.stdout.strip())
    save()
    return res


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--work", default="/tmp/m7")
    ap.add_argument("--shape", default="qwen2-7b", choices=sorted(SHAPES))
    ap.add_argument("--steps", default="ceilings,hf,latency,prefill,throughput,long,ablation")
    ap.add_argument("--long-requests", type=int, default=1000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    OUT = a.out
    steps = a.steps.split(",")
    path = os.path.join(a.work, a.shape)
    RESULT["shape"] = a.shape
    RESULT["gpu"] = torch.cuda.get_device_name(0)
    build(a.shape, path)
    wb = weight_bytes(path)
    n_params = wb / 2
    RESULT["weight_bytes"] = wb
    if "ceilings" in steps or "latency" in steps or "prefill" in steps:
        ceilings()
    if "hf" in steps:
        hf(path, torch.bfloat16, "hf_bf16")
    if "latency" in steps:
        r = kiln(["latency", "--batch-size", "1", "--input-len", "128", "--output-len", "256",
                  "--num-iters", "5", "--warmup", "1"], a.kiln, path, "kiln_latency")
        if r:
            floor_ms = wb / (RESULT["copy_GBps"] * 1e9) * 1e3
            RESULT["decode_floor_ms"] = round(floor_ms, 3)
            RESULT["decode_fraction_of_floor"] = round(floor_ms / r["tpot_ms"]["p50"], 3)
            log("decode: %.3f ms/token, floor %.3f ms (%.0f%%)" % (r["tpot_ms"]["p50"], floor_ms,
                                                               100 * floor_ms / r["tpot_ms"]["p50"]))
    if "prefill" in steps:
        r = kiln(["latency", "--batch-size", "1", "--input-len", "512", "--output-len", "1",
                  "--num-iters", "10", "--warmup", "2"], a.kiln, path, "kiln_prefill")
        if r:
            floor_ms = 2 * n_params * 512 / (RESULT["bf16_TFLOPs"] * 1e12) * 1e3
            RESULT["prefill_floor_ms"] = round(floor_ms, 3)
            RESULT["prefill_fraction_of_rate"] = round(floor_ms / r["ttft_ms"]["p50"], 3)
            log("prefill 512: %.2f ms, compute floor %.2f ms (%.0f%%)" % (r["ttft_ms"]["p50"], floor_ms,
                                                                       100 * floor_ms / r["ttft_ms"]["p50"]))
    if "throughput" in steps:
        kiln(["throughput", "--num-prompts", "1000", "--input-len", "512", "--output-len", "256"],
             a.kiln, path, "kiln_throughput")
    if "long" in steps:
        kiln(["throughput", "--num-prompts", str(a.long_requests), "--input-len", "1000",
              "--output-len", "1000"], a.kiln, path, "kiln_throughput_long")
    if "ablation" in steps:
        base = ["latency", "--batch-size", "1", "--input-len", "128", "--output-len", "256",
                "--num-iters", "10", "--warmup", "1"]
        kiln(base, a.kiln, path, "abl_bf16")
        kiln(base, a.kiln, path, "abl_no_graphs", ["--set", "graph.enabled=false"])
        kiln(base, a.kiln, path, "abl_no_chunked", ["--set", "scheduler.enable_chunked_prefill=false"])
        kiln(base + ["--dtype", "float32"], a.kiln, path, "abl_fp32")
        hf(path, torch.float16, "hf_fp16")
    save()


if __name__ == "__main__":
    main()
