#!/usr/bin/env python3
"""Tiny random-weight Qwen2-VL and Qwen2.5-VL reference models for Kiln's vision parity tests.

    python3 tools/make_vl_fixtures.py --out tests/fixtures/models [--only qwen2_vl]
        [--tokenizer DIR]     # a Qwen tokenizer (tokenizer.json + tokenizer_config.json);
                              # default $KILN_TOKENIZER_DIR or ~/.cache/kiln/tokenizers/qwen3

Needs torch, transformers 5.x (written against 5.17), numpy and Pillow (the GPU machine). Runs on
the CPU in float32 with eager attention, one thread, seeded per fixture: a rerun writes the same
files. The model weights are rounded to bfloat16 and saved in bfloat16; the reference runs on
the same values upcast to float32.

Each fixture <out>/<name>/ holds the checkpoint as save_pretrained writes it (config.json with
nested text_config / vision_config, generation_config.json, model.safetensors in bf16; 5.17
writes the published tensor names, model.layers.* and visual.*), the
image processor's preprocessor_config.json, the test images (images/*.png|jpg) and:

  reference.json   name, architecture, versions, the special token ids, weight name prefixes,
                   image_processor (class + settings), and "prompts": a list, each with
                     name, text (before image expansion), images [file names], input_ids (after
                     expansion), image_grid_thw [[t,h,w],...], n_image_tokens,
                     position_ids [3][T] (the ids transformers' language model received, captured
                     with a forward pre-hook) and rope_delta (max position + 1 - T),
                     position_ids_check ("ok" when an independent re-implementation of
                     get_rope_index in this script agrees),
                     pixel_values_file (float32 [n_patches, 3*2*14*14], transformers' order, or
                     null for a text-only prompt),
                     logits_file (float32 [T, K]: the logits of every position at the columns
                     logit_cols, K ~ 1100: the full [T, 151936] matrix would be 600 KB per token),
                     logit_cols [K] (sorted vocabulary ids: a fixed random set, every prompt id,
                     every position's top-2, every greedy token),
                     argmax [T], max_logit [T], logsumexp [T] over the full vocabulary,
                     greedy {token_ids [8], margins [8], step_logits_file (float32 [8, K]: the
                     last row's logits at each step, step i predicting token i),
                     position_ids [3][T+7] (the full sequence's ids at the last step),
                     generate_token_ids (model.generate with the KV cache, do_sample=False),
                     agree (generate == the no-cache loop)}
Greedy: 8 tokens by argmax, one full forward (no cache, pixel values every step) per step, no
EOS stop; margins[i] = top-1 logit - top-2 logit at step i.

Shapes: vocab 151936 (the real Qwen ids fit), tied embeddings, text hidden 16, 2 layers; vision
towers of 2-3 blocks, embed 32, 2 heads (head_dim 16). The image processor is the real slow
(PIL) Qwen2VLImageProcessor with min_pixels 56*56, max_pixels 28*28*20 so images stay small.
"""
import argparse
import copy
import inspect
import json
import math
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_parity_fixtures as mpf  # noqa: E402  (npy writer, model helpers)

torch = None
transformers = None
np = None
Image = None
TF_MAJOR = 0

VOCAB = 151936
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 151655, 151656, 151652, 151653
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643
WEIGHT_STD = 0.08
GREEDY_STEPS = 8
N_RANDOM_COLS = 1024
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 20
MAX_FIXTURE_BYTES = int(8 * 1024 * 1024)  # 5.17: 7.7 MB (4.9 MB of it the bf16 embedding)

FIXTURES = [
    dict(name="qwen2_vl", arch="Qwen2VLForConditionalGeneration", config="Qwen2VLConfig", seed=2001,
         text=dict(hidden_size=16, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, rms_norm_eps=1e-6, max_position_embeddings=4096),
         rope_theta=100.0, mrope_section=[1, 1, 2],
         vision=dict(depth=2, embed_dim=32, hidden_size=16, num_heads=2, mlp_ratio=2,
                     hidden_act="quick_gelu", in_channels=3, patch_size=14, spatial_merge_size=2,
                     temporal_patch_size=2),
         notes="Qwen2-VL: text head_dim 8 (2 heads, 1 kv head), mrope_section [1,1,2], rope theta "
               "100 (so every section's angles are large enough to matter); vision LayerNorm + "
               "quick_gelu MLP (mlp_ratio 2), 2 blocks, embed 32, 2 heads."),
    dict(name="qwen2_5_vl", arch="Qwen2_5_VLForConditionalGeneration", config="Qwen2_5_VLConfig",
         seed=2002,
         text=dict(hidden_size=16, intermediate_size=48, num_hidden_layers=2, num_attention_heads=1,
                   num_key_value_heads=1, rms_norm_eps=1e-6, max_position_embeddings=4096),
         rope_theta=1000.0, mrope_section=[2, 3, 3],
         vision=dict(depth=3, hidden_size=32, out_hidden_size=16, intermediate_size=64, num_heads=2,
                     hidden_act="silu", in_channels=3, patch_size=14, spatial_merge_size=2,
                     temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                     tokens_per_second=2),
         notes="Qwen2.5-VL: text head_dim 16 (1 head), mrope_section [2,3,3], rope theta 1000; "
               "vision RMSNorm + SwiGLU MLP with biases (intermediate 64), 3 blocks of which block "
               "1 is full attention and blocks 0 and 2 windowed: window_size 56 = 2x2 merged "
               "tokens (4x4 patches), so the 3x5 and 4x2 merged grids of the test images need "
               "padded windows."),
]

# (file, width, height, format). After smart_resize (factor 28, min 3136, max 15680), merged grids
# (h x w): landscape 150x90 -> 84x140, 3x5; portrait 70x130 -> 140x56, 5x2; large 420x200 hits
# max_pixels -> 84x168, 3x6; odd 43x57 -> 56x56, 2x2. With 2.5's 2x2-token windows every grid but
# the last needs padded windows.
IMAGES = [
    ("landscape.png", 150, 90, "PNG"),
    ("portrait.jpg", 70, 130, "JPEG"),
    ("large.png", 420, 200, "PNG"),
    ("odd.jpg", 43, 57, "JPEG"),
]

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def _user(text):
    return SYSTEM + "<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = [
    dict(name="one_image", images=["landscape.png"], text=_user(IMG + "Describe this image.")),
    dict(name="two_images", images=["portrait.jpg", "large.png"],
         text=_user(IMG + IMG + "What is different between these two pictures?")),
    dict(name="image_mid", images=["odd.jpg"], text=_user("Look at this: " + IMG + " What colour is it?")),
    dict(name="max_pixels", images=["large.png"], text=_user(IMG + "Describe it.")),
    dict(name="text_only", images=[], text=_user("Tell me a short story about a kiln.")),
]


def _import_ml():
    global torch, transformers, np, Image, TF_MAJOR
    mpf._import_ml()
    torch = mpf.torch
    transformers = mpf.transformers
    TF_MAJOR = mpf.TF_MAJOR
    import numpy as _np
    from PIL import Image as _Image
    np = _np
    Image = _Image


def make_config(fx):
    Cfg = getattr(transformers, fx["config"])
    text = dict(fx["text"], vocab_size=VOCAB, tie_word_embeddings=True, bos_token_id=ENDOFTEXT,
                eos_token_id=IM_END, hidden_act="silu")
    if TF_MAJOR >= 5:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": fx["rope_theta"],
                                   "mrope_section": list(fx["mrope_section"])}
    else:
        text["rope_scaling"] = {"type": "mrope", "mrope_section": list(fx["mrope_section"])}
        text["rope_theta"] = fx["rope_theta"]
    cfg = Cfg(text_config=text, vision_config=dict(fx["vision"]), image_token_id=IMAGE_PAD,
              video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
              vision_end_token_id=VISION_END, tie_word_embeddings=True)
    tc = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for k, v in fx["text"].items():
        if getattr(tc, k) != v:
            raise RuntimeError("%s: text_config.%s = %r, asked for %r" % (fx["name"], k, getattr(tc, k), v))
    rp = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    if list(rp.get("mrope_section", [])) != list(fx["mrope_section"]):
        raise RuntimeError("%s: mrope_section is %r" % (fx["name"], rp))
    theta = rp.get("rope_theta", getattr(tc, "rope_theta", None))
    if theta != fx["rope_theta"]:
        raise RuntimeError("%s: rope_theta is %r" % (fx["name"], theta))
    for k, v in fx["vision"].items():
        if getattr(cfg.vision_config, k) != v:
            raise RuntimeError("%s: vision_config.%s = %r, asked for %r"
                               % (fx["name"], k, getattr(cfg.vision_config, k), v))
    return cfg


def init_weights(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        seen = set()
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            leaf = name.rsplit(".", 2)
            is_norm_w = name.endswith(".weight") and (
                "norm" in leaf[-2] or leaf[-2] in ("ln_q",))
            if is_norm_w:
                p.uniform_(0.5, 1.5, generator=g)
            else:
                p.normal_(0.0, WEIGHT_STD, generator=g)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))  # bf16-exact values


def language_model(model):
    inner = model.model
    return getattr(inner, "language_model", inner)


def build_model(fx):
    cfg = make_config(fx)
    cls = getattr(transformers, fx["arch"])
    torch.manual_seed(fx["seed"])
    model = mpf._instantiate(cls, cfg).to(torch.float32)
    model.eval()
    mpf._ensure_eager(model)
    for sub in (getattr(model.model, "visual", None), language_model(model)):
        if sub is not None and getattr(sub.config, "_attn_implementation", "eager") != "eager":
            try:
                sub.config._attn_implementation = "eager"
            except Exception:  # noqa: BLE001
                pass
    mpf._ensure_tie(model, True)
    init_weights(model, fx["seed"])
    return model


def make_images(d, seed):
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(d, "images"), exist_ok=True)
    paths = {}
    for fname, w, h, fmt in IMAGES:
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
        base = np.stack([255 * xx / max(w - 1, 1), 255 * yy / max(h - 1, 1),
                         127.5 + 127.5 * np.sin((xx + 2 * yy) / 7.0)], axis=-1)
        noise = rng.normal(0.0, 40.0, size=(h, w, 3))
        arr = np.clip(base + noise, 0, 255).astype(np.uint8)
        p = os.path.join(d, "images", fname)
        img = Image.fromarray(arr, "RGB")
        if fmt == "JPEG":
            img.save(p, format="JPEG", quality=90)
        else:
            img.save(p, format="PNG")
        paths[fname] = p
    return paths


CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def make_image_processor(d):
    """The processor AutoProcessor gives for a published checkpoint's preprocessor_config.json
    (written here in the published layout, with small min/max_pixels), the slow PIL one."""
    pc = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS, "patch_size": 14,
          "temporal_patch_size": 2, "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
          "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}
    with open(os.path.join(d, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(pc, f, indent=2)
        f.write("\n")
    try:
        ip = transformers.AutoImageProcessor.from_pretrained(d, use_fast=False)
    except Exception as e:  # noqa: BLE001
        print("  note: AutoImageProcessor(use_fast=False) failed (%s); building the class directly" % e)
        cls = getattr(transformers, "Qwen2VLImageProcessorPil", None)
        if cls is None:
            try:
                from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
            except Exception:  # noqa: BLE001
                cls = transformers.Qwen2VLImageProcessor  # 4.x: the slow one is the plain class
        ip = cls(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    name = type(ip).__name__
    if "Fast" in name:
        raise RuntimeError("got the fast image processor %s, want the slow PIL one" % name)
    print("  image processor: %s" % name)
    return ip


def load_tokenizer(tokdir):
    if not tokdir or not os.path.exists(os.path.join(tokdir, "tokenizer.json")):
        raise RuntimeError("no tokenizer.json in %r: pass --tokenizer DIR (a Qwen tokenizer, e.g. "
                           "tests/fetch_tokenizers.sh's qwen3)" % tokdir)
    tok = transformers.AutoTokenizer.from_pretrained(tokdir)
    want = {"<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END,
            "<|image_pad|>": IMAGE_PAD, "<|video_pad|>": VIDEO_PAD, "<|im_start|>": IM_START,
            "<|im_end|>": IM_END}
    for s, i in want.items():
        got = tok.convert_tokens_to_ids(s)
        if got != i:
            raise RuntimeError("tokenizer maps %s to %r, expected %d" % (s, got, i))
    return tok


def expand_ids(ids, grids, merge):
    """Each <|image_pad|> (one per image, in order) becomes t*h*w/merge^2 copies of itself."""
    out, k = [], 0
    for t in ids:
        if t == IMAGE_PAD:
            if k >= len(grids):
                raise RuntimeError("more image pads than images")
            t_, h_, w_ = grids[k]
            out.extend([IMAGE_PAD] * (t_ * h_ * w_ // (merge * merge)))
            k += 1
        else:
            out.append(t)
    if k != len(grids):
        raise RuntimeError("%d image pads for %d images" % (k, len(grids)))
    return out


def own_rope_index(ids, grids, merge, tokens_per_second):
    """get_rope_index re-implemented from its description, for images only (t index =
    frame * second_per_grid_t * tokens_per_second with second_per_grid_t = 0 for images in 2.5,
    plain frame index in 2-VL; both 0 for one-frame images)."""
    T = len(ids)
    pos = [[0] * T for _ in range(3)]
    i, nxt, k = 0, 0, 0
    while i < T:
        if ids[i] == IMAGE_PAD and i > 0 and ids[i - 1] == VISION_START:
            t_, h_, w_ = grids[k]
            gh, gw = h_ // merge, w_ // merge
            n = t_ * gh * gw
            base = nxt
            mx = base
            for j in range(n):
                ti, rem = divmod(j, gh * gw)
                hi, wi = divmod(rem, gw)
                tv = ti if tokens_per_second is None else int(ti * 0 * tokens_per_second)
                vals = (base + tv, base + hi, base + wi)
                for a in range(3):
                    pos[a][i + j] = vals[a]
                mx = max(mx, *vals)
            nxt = mx + 1
            i += n
            k += 1
        else:
            for a in range(3):
                pos[a][i] = nxt
            nxt += 1
            i += 1
    delta = max(max(p) for p in pos) + 1 - T if T else 0
    return pos, delta


class PosCapture:
    def __init__(self, lm):
        self.pos = None
        self.h = lm.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        p = kwargs.get("position_ids")
        self.pos = None if p is None else p.detach().clone()

    def take(self):
        p = self.pos
        self.pos = None
        if p is None:
            return None
        if p.dim() == 3 and p.shape[0] == 4:  # text positions prepended (newer transformers)
            p = p[1:]
        if p.dim() == 3:
            p = p[:, 0, :]
        if p.dim() == 2 and p.shape[0] == 1:
            p = p.expand(3, -1)
        return [[int(v) for v in row] for row in p.tolist()]

    def close(self):
        self.h.remove()


def _mm_kw(model, ids):
    """mm_token_type_ids (0 text, 1 image, 2 video) for versions whose forward takes them: the
    processor returns them there, and get_rope_index may read them instead of the ids."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    if "mm_token_type_ids" not in params:
        return {}
    t = torch.tensor([ids], dtype=torch.long)
    return {"mm_token_type_ids": (t == IMAGE_PAD).long() + 2 * (t == VIDEO_PAD).long()}


def forward(model, ids, pv, grid):
    kw = dict(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    kw.update(_mm_kw(model, ids))
    if pv is not None:
        kw["pixel_values"] = pv
        kw["image_grid_thw"] = grid
    with torch.no_grad():
        out = model(**kw)
    return out.logits[0].detach().to(torch.float32)


def greedy(model, ids, pv, grid, cap):
    seq = list(ids)
    toks, margins, rows = [], [], []
    for _ in range(GREEDY_STEPS):
        last = forward(model, seq, pv, grid)[-1]
        cap.take()
        top2 = torch.topk(last, 2).values
        t = int(torch.argmax(last))
        toks.append(t)
        margins.append(float(top2[0] - top2[1]))
        rows.append(last)
        seq.append(t)
    forward(model, seq[:-1], pv, grid)
    final_pos = cap.take()
    return toks, margins, torch.stack(rows), final_pos


def hf_generate(model, ids, pv, grid, notes):
    try:
        gc = transformers.GenerationConfig(do_sample=False, max_new_tokens=GREEDY_STEPS,
                                           min_new_tokens=GREEDY_STEPS, eos_token_id=None,
                                           pad_token_id=ENDOFTEXT, bos_token_id=ENDOFTEXT)
        kw = dict(input_ids=torch.tensor([ids], dtype=torch.long),
                  attention_mask=torch.ones(1, len(ids), dtype=torch.long), generation_config=gc)
        kw.update(_mm_kw(model, ids))
        if pv is not None:
            kw["pixel_values"] = pv
            kw["image_grid_thw"] = grid
        with torch.no_grad():
            out = model.generate(**kw)
        return [int(t) for t in out[0, len(ids):].tolist()]
    except Exception as e:  # noqa: BLE001
        _warn(notes, "generate failed: %s: %s" % (type(e).__name__, e))
        return None


def call_get_rope_index(model, ids, grid, notes):
    """transformers' own get_rope_index, called with whatever arguments this version takes."""
    fn = getattr(model.model, "get_rope_index", None) or getattr(model, "get_rope_index", None)
    if fn is None:
        return None
    t = torch.tensor([ids], dtype=torch.long)
    avail = dict(input_ids=t, image_grid_thw=grid, video_grid_thw=None,
                 attention_mask=torch.ones_like(t), second_per_grid_ts=None,
                 mm_token_type_ids=(t == IMAGE_PAD).long())
    try:
        params = inspect.signature(fn).parameters
        kw = {k: v for k, v in avail.items() if k in params}
        pos, _ = fn(**kw)
        if pos.dim() == 3 and pos.shape[0] == 4:
            pos = pos[1:]
        return [[int(v) for v in row] for row in pos[:, 0, :].tolist()]
    except Exception as e:  # noqa: BLE001
        _warn(notes, "get_rope_index call failed: %s: %s" % (type(e).__name__, e))
        return None


def _warn(notes, msg):
    print("  WARNING: " + msg)
    notes.append("WARNING: " + msg)


def write_f32(path, t):
    t = t.detach().to("cpu", torch.float32).contiguous()
    if t.dim() != 2:
        raise RuntimeError("%s: npy arrays here are 2-D" % path)
    mpf.write_npy(path, tuple(t.shape), t.numpy().astype("<f4", copy=False).tobytes())


def weight_names(d):
    names, dtypes = set(), set()
    for fn in os.listdir(d):
        if fn.endswith(".safetensors"):
            for k, v in mpf.safetensors_header(os.path.join(d, fn)).items():
                if k != "__metadata__":
                    names.add(k)
                    dtypes.add(v["dtype"])
    return names, dtypes


def dir_bytes(d):
    n = 0
    for root, _, files in os.walk(d):
        for f in files:
            n += os.path.getsize(os.path.join(root, f))
    return n


def make_fixture(fx, out_root, tok):
    name = fx["name"]
    print("== %s (%s)" % (name, fx["arch"]))
    d = os.path.join(out_root, name)
    if os.path.isdir(d):
        import shutil
        shutil.rmtree(d)
    os.makedirs(d)
    notes = []
    model = build_model(fx)
    cfg = model.config
    merge = cfg.vision_config.spatial_merge_size
    tps = getattr(cfg.vision_config, "tokens_per_second", None) if "2_5" in fx["arch"] else None

    # The checkpoint in bf16 (a copy: the fp32 model keeps its fp32 rotary buffers).
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    m16.save_pretrained(d)
    del m16
    names, dtypes = weight_names(d)
    if dtypes != {"BF16"}:
        raise RuntimeError("%s: safetensors dtypes %s" % (name, sorted(dtypes)))
    if "lm_head.weight" in names:
        _warn(notes, "tied model saved lm_head.weight")
    prefixes = sorted({n.split(".layers.")[0] for n in names if ".layers." in n} |
                      {n.split(".blocks.")[0] for n in names if ".blocks." in n})
    print("  weights: %d tensors, prefixes %s" % (len(names), prefixes))

    ip = make_image_processor(d)
    paths = make_images(d, fx["seed"])

    # The processor itself, when it can be built, must expand the ids the way we do.
    proc = None
    try:
        proc = transformers.Qwen2VLProcessor(image_processor=ip, tokenizer=tok)
    except Exception as e:  # noqa: BLE001
        print("  note: Qwen2VLProcessor(image_processor, tokenizer) failed (%s); expanding ids here" % e)

    cap = PosCapture(language_model(model))
    rng = torch.Generator().manual_seed(fx["seed"] + 7)
    rand_cols = torch.randperm(VOCAB, generator=rng)[:N_RANDOM_COLS].tolist()
    prompts_out = []
    first = None
    for pr in PROMPTS:
        print("  prompt %s" % pr["name"])
        imgs = []
        for fn in pr["images"]:
            im = Image.open(paths[fn])
            im.load()
            imgs.append(im)
        pv, grid, grids = None, None, []
        if imgs:
            feat = ip(images=imgs, return_tensors="pt")
            pv = feat["pixel_values"].to(torch.float32)
            grid = feat["image_grid_thw"].to(torch.long)
            grids = [[int(v) for v in row] for row in grid.tolist()]
        raw = tok(pr["text"], add_special_tokens=False)["input_ids"]
        if raw.count(IMAGE_PAD) != len(imgs):
            raise RuntimeError("%s: %d image pads for %d images" % (pr["name"], raw.count(IMAGE_PAD), len(imgs)))
        ids = expand_ids(raw, grids, merge)
        if proc is not None and imgs:
            try:
                pi = proc(text=[pr["text"]], images=imgs, return_tensors="pt")
                if pi["input_ids"][0].tolist() != ids:
                    _warn(notes, "%s: the processor's input_ids differ from the expansion here" % pr["name"])
                if not torch.equal(pi["pixel_values"].to(torch.float32), pv):
                    _warn(notes, "%s: the processor's pixel_values differ from the image processor's" % pr["name"])
            except Exception as e:  # noqa: BLE001
                print("  note: processor call failed: %s" % e)
        logits = forward(model, ids, pv, grid)
        pos = cap.take()
        own, delta = own_rope_index(ids, grids, merge, tps)
        tf_pos = call_get_rope_index(model, ids, grid, notes) if imgs else None
        if pos is None:
            _warn(notes, "%s: no position_ids reached the language model; using get_rope_index's" % pr["name"])
            pos = tf_pos if tf_pos is not None else own
        check = "ok" if own == pos else "MISMATCH"
        if check != "ok":
            _warn(notes, "%s: this script's get_rope_index disagrees with transformers'" % pr["name"])
        if tf_pos is not None and tf_pos != pos:
            _warn(notes, "%s: get_rope_index() differs from the ids the model used" % pr["name"])
        delta = max(max(p) for p in pos) + 1 - len(ids)

        toks, margins, step_logits, final_pos = greedy(model, ids, pv, grid, cap)
        gen = hf_generate(model, ids, pv, grid, notes)
        if gen is not None and gen != toks:
            _warn(notes, "%s: generate %s != no-cache greedy %s" % (pr["name"], gen, toks))

        top2 = torch.topk(logits, 2, dim=-1).indices
        cols = set(rand_cols) | set(ids) | set(toks) | set(int(v) for v in top2.reshape(-1).tolist())
        cols = sorted(cols)
        ci = torch.tensor(cols, dtype=torch.long)
        lf = "%s.logits.npy" % pr["name"]
        sf = "%s.greedy_logits.npy" % pr["name"]
        write_f32(os.path.join(d, lf), logits[:, ci])
        write_f32(os.path.join(d, sf), step_logits[:, ci])
        pf = None
        if pv is not None:
            pf = "%s.pixel_values.npy" % pr["name"]
            write_f32(os.path.join(d, pf), pv)
        if first is None and imgs:
            first = (ids, pv, grid, logits)
        prompts_out.append(dict(
            name=pr["name"], text=pr["text"], images=list(pr["images"]), input_ids=ids,
            image_grid_thw=grids, n_image_tokens=ids.count(IMAGE_PAD), position_ids=pos,
            rope_delta=delta, position_ids_check=check, pixel_values_file=pf, logits_file=lf,
            logit_cols=cols, argmax=[int(v) for v in logits.argmax(-1).tolist()],
            max_logit=[float(v) for v in logits.max(-1).values.tolist()],
            logsumexp=[float(v) for v in torch.logsumexp(logits.double(), -1).tolist()],
            greedy=dict(token_ids=toks, margins=margins, step_logits_file=sf, position_ids=final_pos,
                        generate_token_ids=gen, agree=(gen == toks) if gen is not None else None)))
        print("    T=%d image tokens=%d delta=%d rope=%s greedy=%s min margin %.3g"
              % (len(ids), ids.count(IMAGE_PAD), delta, check, toks, min(margins)))
    cap.close()

    if first is not None:  # the saved checkpoint, reloaded, gives the same logits
        try:
            m2 = getattr(transformers, fx["arch"]).from_pretrained(
                d, attn_implementation="eager", **mpf._dtype_kw(torch.float32))
            m2.eval()
            got = forward(m2, first[0], first[1], first[2])
            diff = float((got - first[3]).abs().max())
            print("  reload: max |diff| = %.3g" % diff)
            if diff > 1e-5:
                _warn(notes, "from_pretrained logits differ by %.3g" % diff)
        except Exception as e:  # noqa: BLE001
            _warn(notes, "reload failed: %s: %s" % (type(e).__name__, e))

    ipcfg = {}
    for fn in ("preprocessor_config.json", "processor_config.json"):
        p = os.path.join(d, fn)
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                ipcfg = json.load(f)
    ref = dict(name=name, architecture=fx["arch"], model_type=cfg.model_type,
               transformers_version=transformers.__version__, torch_version=torch.__version__,
               checkpoint_dtype="bfloat16", reference_dtype="float32", seed=fx["seed"],
               image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
               vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
               weight_prefixes=prefixes, n_weights=len(names),
               image_processor=dict(cls=type(ip).__name__, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                    config=ipcfg),
               images=[dict(file="images/" + f, width=w, height=h, format=fmt) for f, w, h, fmt in IMAGES],
               greedy_steps=GREEDY_STEPS, notes=fx["notes"], warnings=notes, prompts=prompts_out)
    with open(os.path.join(d, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    size = dir_bytes(d)
    print("  %s: %.2f MB, %d warnings" % (d, size / 1e6, len(notes)))
    if size > MAX_FIXTURE_BYTES:
        print("  WARNING: fixture is larger than %.1f MB" % (MAX_FIXTURE_BYTES / 1e6))
    return len(notes)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", action="append")
    ap.add_argument("--tokenizer", default=os.environ.get(
        "KILN_TOKENIZER_DIR", os.path.expanduser("~/.cache/kiln/tokenizers/qwen3")))
    a = ap.parse_args()
    _import_ml()
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    tok = load_tokenizer(a.tokenizer)
    os.makedirs(a.out, exist_ok=True)
    warns = 0
    for fx in FIXTURES:
        if a.only and fx["name"] not in a.only:
            continue
        warns += make_fixture(fx, a.out, tok)
    print("done, %d warnings in all" % warns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
