#!/usr/bin/env python3
"""model_vs_hf.py - Kiln's single-sequence forward against Hugging Face transformers on a
real-size model with random weights, on the GPU machine: logits agreement (bf16 and fp32)
and prefill / decode speed, both measured in the same run.

Usage: python3 bench/model_vs_hf.py --kiln build/bin/kiln --work /tmp/mb --out results.json
         [--shape qwen2-0.5b] [--prompt 512] [--decode 128] [--cpu-decode 16]

The model is built from a real architecture's config with transformers' own initialisation
(normal(0, 0.02), norms 1) and saved with save_pretrained in bf16; nothing is downloaded.
Kiln runs through its command line (`kiln score`, `kiln generate --json`), whose timers start
after the model is loaded; transformers runs with SDPA attention and its default cache.
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

SHAPES = {
    # Qwen2-0.5B: hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate 4864, tied.
    "qwen2-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                       vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                       rope_theta=1000000.0, rms_norm_eps=1e-6),
    # Two layers of Qwen2-7B (hidden 3584, 28 heads / 4 KV heads, head 128, intermediate 18944,
    # vocab 152064): the real layer shapes at a fraction of the weights.
    "qwen2-7b-2l": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=2,
                        num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                        vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False,
                        rope_theta=1000000.0, rms_norm_eps=1e-6),
    # Llama-3.2-1B: hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192, tied,
    # llama3 rope scaling.
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
                        vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True,
                        rope_theta=500000.0, rms_norm_eps=1e-5,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
}


def build(shape, path):
    if os.path.exists(os.path.join(path, "config.json")):
        return
    kw = dict(SHAPES[shape])
    model_type = kw.pop("model_type")
    if int(transformers.__version__.split(".")[0]) >= 5:  # v5 keeps rope settings together
        rp = dict(kw.pop("rope_scaling", None) or {"rope_type": "default"})
        rp["rope_theta"] = kw.pop("rope_theta")
        kw["rope_parameters"] = rp
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)


def run_kiln(kiln, args):
    r = subprocess.run([kiln] + args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"kiln {' '.join(args[:3])}... failed: {r.stderr[-2000:]}")
    return r.stdout


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def cuda_time(fn, reps=5):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--cpu-decode", type=int, default=16)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    path = os.path.join(a.work, a.shape)
    build(a.shape, path)
    res = {"shape": a.shape, "transformers": transformers.__version__, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0), "prompt_tokens": a.prompt, "decode_tokens": a.decode}
    cfg = AutoConfig.from_pretrained(path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (a.prompt,), generator=g).tolist()
    ids_arg = ",".join(map(str, ids))
    n_check = 128  # positions whose logits are compared (all of them, kept small for memory)
    check_ids = ids[:n_check]

    # ---- agreement: transformers fp32 is the reference; transformers' own bf16 error against
    # it is the yardstick for Kiln's bf16 error ----
    refs, kiln = {}, {}
    for dtype_name, tdtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=tdtype, attn_implementation="sdpa").cuda().eval()
        with torch.no_grad():
            refs[dtype_name] = hf(torch.tensor([check_ids], device="cuda")).logits[0].float().cpu().numpy()
        del hf
        torch.cuda.empty_cache()
        npy = os.path.join(a.work, f"kiln_{dtype_name}.npy")
        run_kiln(a.kiln, ["score", "--set", "backend.name=cuda", "--model", path, "--dtype", dtype_name,
                          "--ids", ",".join(map(str, check_ids)), "--out", npy])
        kiln[dtype_name] = np.load(npy)
    r32 = refs["float32"]
    # the same logits through Kiln's decode path (one token per forward) and chunked prefill
    # (37-token chunks over the cached prefix), in bf16
    for mode, chunk in (("decode", 1), ("chunked", 37)):
        npy = os.path.join(a.work, f"kiln_bf16_{mode}.npy")
        run_kiln(a.kiln, ["score", "--set", "backend.name=cuda", "--model", path, "--dtype", "bfloat16",
                          "--chunk", str(chunk), "--ids", ",".join(map(str, check_ids)), "--out", npy])
        k = np.load(npy)
        res[f"rel_err_bfloat16_{mode}_vs_hf_fp32"] = rel_err(k, r32)
        res[f"argmax_agree_bfloat16_{mode}_vs_fp32"] = float(np.mean(k.argmax(-1) == r32.argmax(-1)))
        print(f"bf16 {mode} (chunk {chunk}): kiln vs transformers fp32 {res[f'rel_err_bfloat16_{mode}_vs_hf_fp32']:.3g} "
              f"(argmax {res[f'argmax_agree_bfloat16_{mode}_vs_fp32']:.3f})", flush=True)
    res["rel_err_float32"] = rel_err(kiln["float32"], r32)
    res["rel_err_bfloat16_vs_hf_bf16"] = rel_err(kiln["bfloat16"], refs["bfloat16"])
    res["rel_err_bfloat16_vs_hf_fp32"] = rel_err(kiln["bfloat16"], r32)
    res["hf_bf16_rel_err_vs_hf_fp32"] = rel_err(refs["bfloat16"], r32)
    res["argmax_agree_float32"] = float(np.mean(kiln["float32"].argmax(-1) == r32.argmax(-1)))
    res["argmax_agree_bfloat16_vs_fp32"] = float(np.mean(kiln["bfloat16"].argmax(-1) == r32.argmax(-1)))
    res["hf_bf16_argmax_agree_vs_fp32"] = float(np.mean(refs["bfloat16"].argmax(-1) == r32.argmax(-1)))
    print(f"fp32: kiln vs transformers {res['rel_err_float32']:.3g} (argmax {res['argmax_agree_float32']:.3f}); "
          f"bf16 vs transformers fp32: kiln {res['rel_err_bfloat16_vs_hf_fp32']:.3g} "
          f"(argmax {res['argmax_agree_bfloat16_vs_fp32']:.3f}), transformers bf16 "
          f"{res['hf_bf16_rel_err_vs_hf_fp32']:.3g} (argmax {res['hf_bf16_argmax_agree_vs_fp32']:.3f}); "
          f"kiln bf16 vs transformers bf16 {res['rel_err_bfloat16_vs_hf_bf16']:.3g}", flush=True)

    # ---- speed on the GPU, bf16 ----
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    x = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        hf(x)  # warm-up
        t_prefill = cuda_time(lambda: hf(x))
        gen = lambda n: hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        gen(4)
        t_gen = cuda_time(lambda: gen(a.decode), reps=3)
    res["hf_prefill_s"] = t_prefill
    res["hf_decode_tok_s"] = (a.decode - 1) / max(t_gen - t_prefill, 1e-9)
    del hf
    torch.cuda.empty_cache()
    kr = []
    for _ in range(3):
        out = run_kiln(a.kiln, ["generate", "--set", "backend.name=cuda", "--model", path, "--dtype", "bfloat16",
                                "--ids", ids_arg, "--max-tokens", str(a.decode), "--ignore-eos", "--json"])
        kr.append(json.loads(out))
    ttft = statistics.median(r["time_to_first_token_s"] for r in kr)
    dec = statistics.median((r["usage"]["completion_tokens"] - 1) / (r["total_time_s"] - r["time_to_first_token_s"]) for r in kr)
    res["kiln_prefill_s"] = ttft
    res["kiln_decode_tok_s"] = dec
    wbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    res["weight_bytes"] = wbytes
    # H200: 4.8 TB/s HBM3e (spec); decode reads every weight once per token at least.
    res["decode_floor_tok_s"] = 4.8e12 / wbytes
    print(f"GPU bf16, prompt {a.prompt}: prefill kiln {ttft*1e3:.1f} ms vs transformers {t_prefill*1e3:.1f} ms; "
          f"decode kiln {dec:.0f} tok/s vs transformers {res['hf_decode_tok_s']:.0f} tok/s "
          f"(weights {wbytes/1e9:.2f} GB -> floor {res['decode_floor_tok_s']:.0f} tok/s)", flush=True)

    # ---- CPU, fp32, short decode: kiln's cpu backend vs PyTorch on the same cores ----
    if a.cpu_decode > 0:
        short = ids[:64]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        xc = torch.tensor([short])
        with torch.no_grad():
            hf.generate(xc, max_new_tokens=2, min_new_tokens=2, do_sample=False)
            t0 = time.perf_counter(); hf(xc); tp = time.perf_counter() - t0
            t0 = time.perf_counter()
            hf.generate(xc, max_new_tokens=a.cpu_decode, min_new_tokens=a.cpu_decode, do_sample=False)
            tg = time.perf_counter() - t0
        res["cpu_threads"] = torch.get_num_threads()
        res["hf_cpu_decode_tok_s"] = (a.cpu_decode - 1) / max(tg - tp, 1e-9)
        out = json.loads(run_kiln(a.kiln, ["generate", "--set", "backend.name=cpu", "--model", path, "--dtype", "float32",
                                           "--ids", ",".join(map(str, short)), "--max-tokens", str(a.cpu_decode),
                                           "--ignore-eos", "--json"]))
        res["kiln_cpu_decode_tok_s"] = (out["usage"]["completion_tokens"] - 1) / (out["total_time_s"] - out["time_to_first_token_s"])
        print(f"CPU fp32 ({res['cpu_threads']} threads): decode kiln {res['kiln_cpu_decode_tok_s']:.1f} tok/s vs "
              f"transformers {res['hf_cpu_decode_tok_s']:.1f} tok/s", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
