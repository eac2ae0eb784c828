#!/usr/bin/env python3
"""vl_fidelity_7b.py - Kiln against transformers at the real Qwen2-VL-7B and Qwen2.5-VL-7B shapes
on the GPU machine: one 1280 x 720 image plus a question (bench/vl_7b.py's prompt), the first
step's log-probabilities and a greedy continuation, transformers fp32 (SDPA) as the reference,
Kiln fp32 and bf16 (`kiln generate --ids ... --image ... --logprobs 20 --json`).

Usage: python3 bench/vl_fidelity_7b.py --kiln KILN [--work /tmp/vlf] [--shape S ...]
           [--new-tokens 8] [--out result.json]

The tiny CI fixtures check the logits to 1e-4; this checks the shapes they do not have (vision
head_dim 80 with 16 heads, 32 blocks, 4,784 patches, Qwen2.5-VL's 112-pixel windows, M-RoPE
sections 16/24/24 over 28 layers). The weights are random but scaled so that activations stay
O(1): Linear and embedding weights N(0, 0.02 / sqrt(fan_in / 1024)), biases 0, norm weights 1
(bench/vl_7b.py's timing models set biases to 1, which drives 32 vision blocks into a regime
where bf16 rounding decides the argmax). Reported per setting: the largest |logprob difference|
over transformers' top 20 first-step tokens (those Kiln also lists), whether the argmax agrees,
and how many of the greedy tokens agree before the first difference.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vl_7b  # noqa: E402

RESULT = {}

# --variants: the 7B shapes cut down (one vision block, one text layer) with one dimension
# changed each, to find which one a difference follows (fp32, the small image only).
VARIANTS = {
    "q2-hd80": ("qwen2-vl-7b", dict(num_hidden_layers=1), dict(depth=1)),
    "q2-embed320-hd80": ("qwen2-vl-7b", dict(num_hidden_layers=1), dict(depth=1, embed_dim=320, num_heads=4)),
    "q2-text-tied": ("qwen2-vl-7b", dict(num_hidden_layers=1, tie_word_embeddings=True), dict(depth=1)),
    "q2-theta1e4": ("qwen2-vl-7b", dict(num_hidden_layers=1), dict(depth=1), dict(rope_theta=10000.0)),
    "q25-hd80": ("qwen2.5-vl-7b", dict(num_hidden_layers=1), dict(depth=1, fullatt_block_indexes=[0])),
}


def variant_shape(name):
    base, t, v = VARIANTS[name][:3]
    s = dict(vl_7b.SHAPES[base], **(VARIANTS[name][3] if len(VARIANTS[name]) > 3 else {}))
    s["text"] = dict(s["text"], **t)
    s["vision"] = dict(s["vision"], **v)
    vl_7b.SHAPES[name] = s
    return name


def scaled_init(model):
    """Activations O(1): N(0, 0.02 / sqrt(fan_in / 1024)) weights, biases 0, norm weights 1."""
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            p.normal_(0.0, 0.02 / max(1.0, (p[0].numel() / 1024) ** 0.5))


def hf(shape, path, img, n):
    from PIL import Image
    # No TF32 anywhere in the reference: PyTorch lets cuDNN (the Conv3d patch embedding) use it by
    # default, and a TF32 patch embedding is ~1e-3 off before the first block.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    s = vl_7b.SHAPES[shape]
    model = getattr(transformers, s["arch"]).from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").cuda().eval()
    extra, proc = {}, vl_7b.image_processor()
    if img:
        out = proc(images=[Image.open(img)], return_tensors="pt")
        grid = out["image_grid_thw"].cuda()
        m = s["vision"]["spatial_merge_size"]
        ids = vl_7b.expand_ids(int(grid.prod().item()) // (m * m))
        extra = dict(pixel_values=out["pixel_values"].cuda(), image_grid_thw=grid)
    else:
        ids, grid = text_ids(), None
    x = torch.tensor([ids], device="cuda")
    if img:  # transformers 5.x computes M-RoPE from these (1 = image token); without them, 1-D
        extra["mm_token_type_ids"] = (x == vl_7b.IMAGE_PAD).long()
    with torch.no_grad():
        o = model.generate(input_ids=x, attention_mask=torch.ones_like(x), **extra,
                           max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           output_scores=True, return_dict_in_generate=True)
    lp = torch.log_softmax(o.scores[0][0].double(), -1)
    top = torch.topk(lp, 20)
    del model
    torch.cuda.empty_cache()
    return dict(tokens=o.sequences[0, x.shape[1]:].tolist(), prompt_tokens=len(ids),
                image_processor=type(proc).__name__,
                grid=grid[0].tolist() if grid is not None else None,
                top=[[int(i), float(v)] for v, i in zip(top.values.tolist(), top.indices.tolist())])


def text_ids():
    """The prompt with its vision tokens left out (a text-only request)."""
    return [t for t in vl_7b.prompt_ids() if t not in (vl_7b.IMAGE_PAD, vl_7b.VISION_START, vl_7b.VISION_END)]


def kiln(a, path, img, dtype, backend="cuda"):
    env = dict(os.environ)
    if a.kiln_ld_path:
        env["LD_LIBRARY_PATH"] = a.kiln_ld_path
    ids = vl_7b.prompt_ids() if img else text_ids()
    cmd = [a.kiln, "generate", "--model", path, "--ids", ",".join(map(str, ids))] + \
        (["--image", img] if img else []) + \
        ["--max-tokens", str(a.new_tokens), "--ignore-eos", "--temperature", "0",
         "--logprobs", "20", "--json", "--dtype", dtype, "--set", "backend.name=" + backend]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0:
        return dict(error=(p.stderr or p.stdout)[-1500:], cmd=" ".join(cmd))
    j = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    return dict(tokens=j["token_ids"], prompt_tokens=j["usage"]["prompt_tokens"],
                top=j["logprobs"][0]["top_logprobs"], cmd=" ".join(cmd))


def compare(ref, k):
    if "error" in k:
        return dict(error=k["error"])
    kl = {int(t): v for t, v in k["top"]}
    diffs = [abs(kl[t] - v) for t, v in ref["top"] if t in kl]
    agree = 0
    for x, y in zip(ref["tokens"], k["tokens"]):
        if x != y:
            break
        agree += 1
    return dict(top20_max_abs_logprob_diff=max(diffs) if diffs else None, top20_shared=len(diffs),
                argmax_agrees=ref["tokens"][:1] == k["tokens"][:1], greedy_prefix_agree=agree,
                greedy_len=len(ref["tokens"]), prompt_tokens_equal=ref["prompt_tokens"] == k["prompt_tokens"],
                ref_top1_gap=ref["top"][0][1] - ref["top"][1][1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--kiln-ld-path", default=os.environ.get("KILN_LD_LIBRARY_PATH"))
    ap.add_argument("--work", default="/tmp/vlf")
    ap.add_argument("--shape", action="append")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--variants", action="store_true", help="the cut-down variants instead")
    ap.add_argument("--out")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    img = os.path.join(a.work, "image_1280x720.png")
    vl_7b.make_image(img)
    from PIL import Image
    small = os.path.join(a.work, "image_336x252.png")
    Image.open(img).resize((336, 252), Image.BICUBIC).save(small)
    RESULT["versions"] = dict(transformers=transformers.__version__, torch=torch.__version__,
                              gpu=torch.cuda.get_device_name())
    shapes = [variant_shape(v) for v in VARIANTS] if a.variants else (a.shape or ["qwen2-vl-7b", "qwen2.5-vl-7b"])
    for shape in shapes:
        path = os.path.join(a.work, shape)
        vl_7b.build(shape, path, init=scaled_init)
        for im in (small, None) if a.variants else (img,):
            tag = shape + ("" if im == img else "@336x252" if im else "@text")
            ref = hf(shape, path, im, a.new_tokens)
            r = RESULT.setdefault(tag, dict(hf_fp32=ref))
            runs = [("float32", "cuda"), ("bfloat16", "cuda")] if im == img else [("float32", "cuda")]
            if a.variants:
                runs.append(("float32", "cpu"))
            for dt, be in runs:
                key = "kiln_" + dt + ("" if be == "cuda" else "_" + be)
                k = kiln(a, path, im, dt, be)
                r[key] = k
                r[key + "_vs_hf_fp32"] = c = compare(ref, k)
                print(tag, key, json.dumps(c), flush=True)
        if a.variants:
            shutil.rmtree(path)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(RESULT, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
