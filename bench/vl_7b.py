#!/usr/bin/env python3
"""vl_7b.py - the reference experiment of issue 16 on the GPU machine: Qwen2-VL-7B-Instruct's
shape (random bf16 weights), one 1280 x 720 image plus a short question, 128 output tokens, one
request at a time, Kiln against transformers on the same card in the same run.

Usage: python3 bench/vl_7b.py --kiln build/bin/kiln --work /tmp/vl7 [--shape qwen2-vl-7b]
           [--runs 3] [--hf-runs 3] [--out result.json] [--budget-s 420]

Settings (the seed experiment's five, with Kiln in vLLM's place):
  hf-fp16          transformers generate, fp16, SDPA (the baseline)
  kiln-fp32-nochunk  Kiln fp32, chunked prefill off (scheduler.enable_chunked_prefill=false)
  kiln-fp32-nograph  Kiln fp32, CUDA graphs off (graph.enabled=false)
  kiln-fp32        Kiln fp32, defaults
  kiln-bf16        Kiln bf16, defaults
Each Kiln run is a fresh `kiln generate --ids ... --image IMG --max-tokens 128 --ignore-eos
--json` process; its JSON gives time_to_first_token_s and total_time_s measured in-process
from submission (model load excluded). So every Kiln run is a cold process: its first prefill
pays cuBLASLt's first-use heuristics for each new shape (issue 24's "cold-shape penalty"),
which a server pays only on its first request. transformers gets a full-length warm-up generate first.
Prompt: Qwen's chat layout as token ids (no tokenizer is needed): system, user turn with
<|vision_start|><|image_pad|><|vision_end|> and a 12-token question, assistant header. For
transformers the one <|image_pad|> is expanded to the image's token count, as its processor
does; Kiln expands it itself.
Floors: decode = weight bytes / copy bandwidth; time to first token = (2 x text params x prompt
tokens + 2 x vision params x patches + vision attention FLOPs) / bf16 matrix rate (fp32 runs use
the same floor; their ratio is stated against it only for reference).
The model is built with transformers (from_config, normal(0, 0.02)) and saved once under --work.
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

IMAGE_PAD, VISION_START, VISION_END = 151655, 151652, 151653
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643

SHAPES = {
    # Qwen2-VL-7B-Instruct: text as Qwen2-7B, vision tower of 32 blocks of 1280 (16 heads), merger to 3584.
    "qwen2-vl-7b": dict(
        arch="Qwen2VLForConditionalGeneration", config="Qwen2VLConfig",
        text=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu",
                  tie_word_embeddings=False),
        rope_theta=1000000.0, mrope_section=[16, 24, 24],
        vision=dict(depth=32, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4,
                    hidden_act="quick_gelu", in_channels=3, patch_size=14, spatial_merge_size=2,
                    temporal_patch_size=2)),
    # Qwen2.5-VL-7B-Instruct: windowed vision tower with RMSNorm + SwiGLU.
    "qwen2.5-vl-7b": dict(
        arch="Qwen2_5_VLForConditionalGeneration", config="Qwen2_5_VLConfig",
        text=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                  max_position_embeddings=128000, rms_norm_eps=1e-6, hidden_act="silu",
                  tie_word_embeddings=False),
        rope_theta=1000000.0, mrope_section=[16, 24, 24],
        vision=dict(depth=32, hidden_size=1280, out_hidden_size=3584, intermediate_size=3420,
                    num_heads=16, hidden_act="silu", in_channels=3, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)),
}

T0 = time.time()
RESULT = {}


def log(*a):
    print("[%6.1f s]" % (time.time() - T0), *a, flush=True)


def save(path):
    if path:
        with open(path, "w") as f:
            json.dump(RESULT, f, indent=1)


def timing_init(model):
    """normal(0, 0.02) weights, every 1-D parameter (norms, biases) 1: a timing model."""
    for p in model.parameters():
        if p.dim() == 1:
            p.fill_(1.0)  # norms (biases too: harmless for a timing run)
        else:
            p.normal_(0.0, 0.02)


def expand_ids(n_img):
    """prompt_ids() with its one <|image_pad|> expanded to the image's n_img tokens."""
    ids = []
    for t in prompt_ids():
        ids.extend([IMAGE_PAD] * n_img if t == IMAGE_PAD else [t])
    return ids


def build(shape, path, init=timing_init):
    if os.path.exists(os.path.join(path, "config.json")):
        return
    s = SHAPES[shape]
    text = dict(s["text"], bos_token_id=ENDOFTEXT, eos_token_id=IM_END)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": s["rope_theta"],
                               "mrope_section": list(s["mrope_section"])}
    cfg = getattr(transformers, s["config"])(
        text_config=text, vision_config=dict(s["vision"]), image_token_id=IMAGE_PAD,
        video_token_id=151656, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        tie_word_embeddings=s["text"].get("tie_word_embeddings", False))
    cls = getattr(transformers, s["arch"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls._from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        init(model)
    model.save_pretrained(path)
    proc = image_processor()
    proc.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def image_processor():
    """The slow, PIL-based Qwen2-VL image processor (the one Kiln matches)."""
    import importlib
    if hasattr(transformers, "Qwen2VLImageProcessorPil"):
        return transformers.Qwen2VLImageProcessorPil()
    try:
        mod = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
        return mod.Qwen2VLImageProcessorPil()
    except ImportError:
        mod = importlib.import_module("transformers.models.qwen2_vl.image_processing_qwen2_vl")
        return mod.Qwen2VLImageProcessor()


def make_image(path):
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(1)
    y, x = np.mgrid[0:720, 0:1280]
    img = np.stack([(x * 255 / 1279), (y * 255 / 719), ((x + y) % 256)], -1)
    img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
    Image.fromarray(img, "RGB").save(path)


def prompt_ids():
    # system / user / assistant as Qwen writes them, with made-up word ids for the text.
    sys_ids = [IM_START, 8948, 198, 2610, 525, 264, 10950, 17847, 13, IM_END, 198]
    user = [IM_START, 872, 198, VISION_START, IMAGE_PAD, VISION_END]
    question = [3838, 374, 304, 419, 2168, 30, 60785, 432, 304, 7716, 13, 220]
    tail = [IM_END, 198, IM_START, 77091, 198]
    return sys_ids + user + question + tail


def ceilings():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    copy = 2 * 4 * n / statistics.median(ts[1:]) / 1e9
    del a, b
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ts = []
    for _ in range(6):
        torch.cuda.synchronize()
        t = time.perf_counter()
        m @ m
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    mm = 2 * 8192 ** 3 / statistics.median(ts[1:]) / 1e12
    del m
    torch.cuda.empty_cache()
    return copy, mm


def hf(path, shape, img_path, runs, new_tokens):
    from PIL import Image
    s = SHAPES[shape]
    cls = getattr(transformers, s["arch"])
    model = cls.from_pretrained(path, dtype=torch.float16, attn_implementation="sdpa").cuda().eval()
    proc = image_processor()
    out = proc(images=[Image.open(img_path)], return_tensors="pt")
    pv = out["pixel_values"].to("cuda", torch.float16)
    grid = out["image_grid_thw"].to("cuda")
    merge = s["vision"]["spatial_merge_size"]
    n_img = int(grid.prod().item()) // (merge * merge)
    ids = expand_ids(n_img)
    input_ids = torch.tensor([ids], device="cuda")

    def gen(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            # mm_token_type_ids: transformers 5.x computes M-RoPE from them; without them
            # generate silently gives the image tokens 1-D positions (found 2026-12-03).
            o = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                               mm_token_type_ids=(input_ids == IMAGE_PAD).long(),
                               pixel_values=pv, image_grid_thw=grid, max_new_tokens=n,
                               min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t, o[0, input_ids.shape[1]:].tolist()

    # Warm-up at full length: on 2026-12-02 a 4-token warm-up left the first timed 128-token run
    # three times slower than the second (docs/perf.md), so the warm-up now runs the whole request.
    gen(1)
    gen(new_tokens)
    e2e, first = [], []
    for _ in range(runs):
        first.append(gen(1)[0])
        t, toks = gen(new_tokens)
        e2e.append(t)
    # The vision tower alone (warm), for the first token's breakdown.
    vis_ms = None
    try:
        vis = getattr(model, "visual", None) or model.model.visual
        ts = []
        for _ in range(4):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                vis(pv, grid_thw=grid)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        vis_ms = 1e3 * statistics.median(ts[1:])
    except Exception as ex:  # a transformers layout this script does not know
        log("hf vision tower timing skipped: %s" % ex)
    del model
    torch.cuda.empty_cache()
    return dict(e2e_s=statistics.mean(e2e), e2e_all=e2e, ttft_s=statistics.mean(first),
                tpot_ms=1e3 * (statistics.mean(e2e) - statistics.mean(first)) / (new_tokens - 1),
                prompt_tokens=len(ids), image_tokens=n_img, patches=int(grid.prod().item()),
                grid=grid[0].tolist(), tokens=toks, vision_tower_ms=vis_ms)


def hf_prompt(path, shape, img_path):
    """The prompt's token, image-token and patch counts, from the image processor alone."""
    from PIL import Image
    out = image_processor()(images=[Image.open(img_path)], return_tensors="pt")
    grid = out["image_grid_thw"]
    merge = SHAPES[shape]["vision"]["spatial_merge_size"]
    n_img = int(grid.prod().item()) // (merge * merge)
    return dict(prompt_tokens=len(prompt_ids()) - 1 + n_img, image_tokens=n_img,
                patches=int(grid.prod().item()), grid=grid[0].tolist())


def kiln(kiln_bin, path, img_path, runs, new_tokens, extra):
    ids = ",".join(str(t) for t in prompt_ids())
    cmd = [kiln_bin, "generate", "--model", path, "--ids", ids, "--image", img_path,
           "--max-tokens", str(new_tokens), "--ignore-eos", "--temperature", "0", "--json",
           "--set", "backend.name=cuda"] + list(extra)
    res = []
    for _ in range(runs):
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        wall = time.perf_counter() - t
        if p.returncode != 0:
            return dict(error=(p.stderr or p.stdout)[-2000:], cmd=" ".join(cmd))
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1]
        j = json.loads(line)
        res.append(dict(ttft=j["time_to_first_token_s"], e2e=j["total_time_s"], wall=wall,
                        n=len(j.get("token_ids", [])), prompt=j.get("usage", {}).get("prompt_tokens"),
                        tokens=j.get("token_ids", [])))
    e2e = statistics.mean(r["e2e"] for r in res)
    ttft = statistics.mean(r["ttft"] for r in res)
    return dict(e2e_s=e2e, e2e_all=[r["e2e"] for r in res], ttft_s=ttft,
                ttft_all=[r["ttft"] for r in res],
                tpot_ms=1e3 * (e2e - ttft) / max(1, res[-1]["n"] - 1), tokens_out=res[-1]["n"],
                prompt_tokens=res[-1]["prompt"], process_wall_s=[r["wall"] for r in res],
                tokens=res[-1]["tokens"], cmd=" ".join(cmd))


def kiln_warm(kiln_bin, path, img_path, new_tokens, prompt_tokens, work):
    """In-process, warm: `kiln bench latency` submits the same image request again and again in
    one engine (prefix caching off), so the cold-process costs (module loading, cuBLASLt's
    first-use heuristics) are paid by its warm-up runs only. Then the same token count as a text
    prompt (the image's share of the first token is the difference), and one traced run with a
    device sync after every op (per-op device times; the sync adds launch gaps)."""
    ids = ",".join(str(t) for t in prompt_ids())
    base = [kiln_bin, "bench", "latency", "--model", path, "--set", "backend.name=cuda"]
    out = {}

    def run(name, args, timeout=300):
        j = os.path.join(work, name + ".json")
        cmd = base + args + ["--json", j]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            out[name] = dict(error=(p.stderr or p.stdout)[-1500:], cmd=" ".join(cmd))
            return None
        with open(j) as f:
            out[name] = json.load(f)
        out[name]["cmd"] = " ".join(cmd)
        return out[name]

    img = ["--ids", ids, "--image", img_path]
    r = run("warm_ttft", img + ["--output-len", "1", "--num-iters", "5", "--warmup", "2"])
    if r:
        log("kiln-bf16 warm: ttft p50 %.1f ms (submission %.1f ms)"
            % (r["ttft_ms"]["p50"], r["submit_ms"]["p50"]))
    r = run("warm_e2e", img + ["--output-len", str(new_tokens), "--num-iters", "3", "--warmup", "1"])
    if r:
        log("kiln-bf16 warm: e2e p50 %.1f ms, tpot p50 %.2f ms" % (r["e2e_ms"]["p50"], r["tpot_ms"]["p50"]))
    r = run("warm_text_ttft", ["--input-len", str(prompt_tokens), "--output-len", "1",
                               "--num-iters", "5", "--warmup", "2"])
    if r:
        log("kiln-bf16 warm: a %d-token text prompt's ttft p50 %.1f ms" % (prompt_tokens, r["ttft_ms"]["p50"]))
    trace = os.path.join(work, "trace_report.json")  # the plugin's; run() writes trace.json
    r = run("trace", img + ["--output-len", "1", "--num-iters", "1", "--warmup", "1",
                            "--set", "backend.name=trace", "--set", "plugin.trace.backend=cuda",
                            "--set", "plugin.trace.sync=true", "--set", "plugin.trace.format=json",
                            "--set", "plugin.trace.output=" + trace,
                            "--set", "plugin.trace.gemm_shapes=16"])
    if r and os.path.exists(trace):
        with open(trace) as f:
            out["trace_ops"] = json.load(f)
        ops = sorted(out["trace_ops"].get("ops", []), key=lambda o: -o.get("total_ns", 0))[:8]
        log("trace (2 runs, synced): " + ", ".join(
            "%s %.1f ms" % (o.get("op"), 1e-6 * o.get("total_ns", 0)) for o in ops))
    return out


def params(path):
    from safetensors import safe_open
    text = vision = 0
    byts = 0
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as h:
                for k in h.keys():
                    sl = h.get_slice(k)
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    byts += 2 * n
                    if "visual" in k:
                        vision += n
                    elif "embed_tokens" not in k:
                        text += n
    return text, vision, byts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--work", default="/tmp/vl7")
    ap.add_argument("--shape", action="append")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hf-runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out")
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--steps", default="hf,kiln,warm",
                    help="comma list: hf (transformers), kiln (the cold-process settings), warm "
                         "(in-process, text-only and traced Kiln runs)")
    a = ap.parse_args()
    shapes = a.shape or ["qwen2-vl-7b"]
    steps = set(a.steps.split(","))
    os.makedirs(a.work, exist_ok=True)
    img = os.path.join(a.work, "image_1280x720.png")
    make_image(img)
    RESULT["versions"] = dict(transformers=transformers.__version__, torch=torch.__version__,
                              gpu=torch.cuda.get_device_name())
    copy, mm = ceilings()
    RESULT["ceilings"] = dict(copy_GBps=copy, bf16_TFLOPs=mm)
    log("ceilings: copy %.0f GB/s, bf16 %.0f TFLOP/s" % (copy, mm))
    for shape in shapes:
        if time.time() - T0 > a.budget_s:
            log("budget spent: %s skipped" % shape)
            break
        path = os.path.join(a.work, shape)
        build(shape, path)
        log("%s built" % shape)
        text_p, vis_p, wbytes = params(path)
        r = RESULT.setdefault(shape, {})
        r["params"] = dict(text=text_p, vision=vis_p, weight_bytes_bf16=wbytes)
        if "hf" in steps:
            h = hf(path, shape, img, a.hf_runs, a.new_tokens)
        else:  # the prompt's size without running transformers
            h = dict(e2e_s=float("nan"), ttft_s=float("nan"), tpot_ms=float("nan"), tokens=[],
                     **hf_prompt(path, shape, img))
        r["hf-fp16"] = h
        log("hf-fp16: e2e %.3f s, ttft %.3f s, tpot %.2f ms (prompt %d tokens, %d image tokens)"
            % (h["e2e_s"], h["ttft_s"], h["tpot_ms"], h["prompt_tokens"], h["image_tokens"]))
        save(a.out)
        vs = SHAPES[shape]["vision"]
        ed = vs.get("embed_dim", vs.get("hidden_size"))
        attn = 4 * h["patches"] * h["patches"] * ed * vs["depth"]  # QK^T and PV, full attention
        r["floors"] = dict(
            decode_ms=1e3 * wbytes / (copy * 1e9),
            ttft_ms=1e3 * (2 * text_p * h["prompt_tokens"] + 2 * vis_p * h["patches"] + attn) / (mm * 1e12))
        log("floors: decode %.2f ms/token, ttft %.2f ms" % (r["floors"]["decode_ms"], r["floors"]["ttft_ms"]))
        settings = [("kiln-bf16", []),
                    ("kiln-fp32", ["--dtype", "float32"]),
                    ("kiln-fp32-nograph", ["--dtype", "float32", "--set", "graph.enabled=false"]),
                    ("kiln-fp32-nochunk", ["--dtype", "float32", "--set",
                                           "scheduler.enable_chunked_prefill=false"])]
        if shape != shapes[0]:
            settings = settings[:1]
        if "kiln" not in steps:
            settings = []
        for name, extra in settings:
            if time.time() - T0 > a.budget_s:
                log("budget spent: %s skipped" % name)
                continue
            k = kiln(a.kiln, path, img, a.runs, a.new_tokens, extra)
            r[name] = k
            if "error" in k:
                log("%s: FAILED: %s" % (name, k["error"][-500:]))
            else:
                k["speedup_vs_hf_fp16"] = h["e2e_s"] / k["e2e_s"]
                log("%s: e2e %.3f s (%.1fx hf-fp16), ttft %.1f ms, tpot %.2f ms, prompt %s tokens"
                    % (name, k["e2e_s"], k["speedup_vs_hf_fp16"], 1e3 * k["ttft_s"], k["tpot_ms"],
                       k["prompt_tokens"]))
            save(a.out)
        if "warm" in steps and time.time() - T0 < a.budget_s + 120:
            r["kiln-bf16-warm"] = kiln_warm(a.kiln, path, img, a.new_tokens, h["prompt_tokens"], a.work)
            save(a.out)
        kb = r.get("kiln-bf16", {})
        if "tokens" in kb and kb["tokens"][:1] and h["tokens"][:1]:
            r["first_token_agree_bf16_vs_hf_fp16"] = kb["tokens"][0] == h["tokens"][0]
    save(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
