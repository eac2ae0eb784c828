#!/usr/bin/env python3
"""Reference pixel values from transformers' Qwen2-VL image processor, for tests/test_image.c.

    python3 tools/make_image_goldens.py --images tests/data/images \
        --out tests/data/images/goldens [--tar $OUT/image_goldens.tar]

Needs transformers (5.x; 4.4x works too), Pillow and numpy; no network, no GPU. Reads
images.json (written by tools/make_test_images.py) and, for every image and each processor
configuration it lists, runs the slow PIL-based Qwen2-VL image processor (transformers 5.x:
Qwen2VLImageProcessorPil, or Qwen2VLImageProcessor where that is the PIL one) with the default
Qwen2-VL settings and the configuration's min_pixels/max_pixels, on the image exactly as
transformers gets it from PIL.Image.open (no EXIF transpose), and writes under --out:

  <proc>/<image>.npy            pixel_values, float32 [grid_t*grid_h*grid_w, 1176]
  decoded/<image>.ppm           PIL's image.convert("RGB") of the file (binary P6): what the
                                decoder must produce before resizing
  resize/<image>.<w>x<h>.ppm    Pillow's Image.resize((w, h), BICUBIC) of two of the images at
                                sizes smart_resize never produces (1 pixel, extreme ratios)
  smart_resize.json             transformers' smart_resize on a table of sizes and limits
                                (results or the error it raised)
  proc_<proc>/preprocessor_config.json   the image processor's own save_pretrained
  proc_processor/processor_config.json   a Qwen2VLProcessor's save_pretrained (the 5.x layout,
                                with the image processor nested under "image_processor"), when
                                one can be built offline with a made-up tokenizer
  manifest.json                 versions (transformers, Pillow, numpy, libjpeg, libwebp), the
                                processor classes used, and per golden: file, processor,
                                image_grid_thw, shape; plus, where AutoImageProcessor's default
                                is another (torchvision) class, how far its output is from the
                                PIL one's (max abs difference)

--source pil replaces transformers with a restatement of its steps in Pillow and numpy (below),
for CI, where transformers is absent: it checks Kiln's resampler against Pillow bit for bit.

With --tar, the whole --out folder is also packed into that tar (what the lead fetches from the
GPU machine: run it there with --tar "$OUT/image_goldens.tar").
"""
import argparse
import importlib
import json
import os
import sys
import tarfile
import tempfile

import math

import numpy as np
import PIL
from PIL import Image, features

transformers = None  # imported by main() unless --source pil


# ---------------------------------------------------------------- --source pil ------------
# The same steps written out with Pillow and numpy alone, from transformers' code as read (PIL
# backend: convert("RGB"), smart_resize, Image.resize(BICUBIC) on uint8 RGB, rescale in float64
# then cast to float32, normalize in float32, the merge-window patch order). Used by CI
# (tests/test_image_pil.sh), where transformers is not installed, to check Kiln's C resampler
# against Pillow bit for bit; the committed goldens come from transformers itself.
def ref_smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280):
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class RefProcessor:
    backend = "pil"
    mean = [0.48145466, 0.4578275, 0.40821073]
    std = [0.26862954, 0.26130258, 0.27577711]

    def __init__(self, min_pixels, max_pixels):
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.patch_size, self.temporal_patch_size, self.merge_size = 14, 2, 2

    def save_pretrained(self, d):
        with open(os.path.join(d, "preprocessor_config.json"), "w") as f:
            json.dump({"image_processor_type": "Qwen2VLImageProcessor",
                       "min_pixels": self.min_pixels, "max_pixels": self.max_pixels,
                       "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
                       "image_mean": self.mean, "image_std": self.std,
                       "rescale_factor": 1 / 255, "resample": 3}, f, indent=2)

    def __call__(self, images, return_tensors="np"):
        im = images[0].convert("RGB")
        ps, tps, m = self.patch_size, self.temporal_patch_size, self.merge_size
        rh, rw = ref_smart_resize(im.height, im.width, ps * m, self.min_pixels, self.max_pixels)
        im = im.resize((rw, rh), Image.BICUBIC)
        x = np.asarray(im).transpose(2, 0, 1)                        # C, H, W uint8
        x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)
        mean = np.array(self.mean, np.float32)[:, None, None]
        std = np.array(self.std, np.float32)[:, None, None]
        x = (x - mean) / std
        x = np.repeat(x[None], tps, axis=0)                          # T, C, H, W
        gh, gw = rh // ps, rw // ps
        x = x.reshape(1, tps, 3, gh // m, m, ps, gw // m, m, ps)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        pv = x.reshape(gh * gw, 3 * tps * ps * ps)
        return {"pixel_values": pv, "image_grid_thw": np.array([[1, gh, gw]])}


def pil_processor_class():
    """The slow, PIL-based Qwen2-VL image processor of this transformers version."""
    try:
        return getattr(transformers, "Qwen2VLImageProcessorPil")
    except (AttributeError, ImportError):
        pass
    try:
        mod = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
        return mod.Qwen2VLImageProcessorPil
    except (ImportError, AttributeError):
        pass
    mod = importlib.import_module("transformers.models.qwen2_vl.image_processing_qwen2_vl")
    return mod.Qwen2VLImageProcessor  # 4.x: the slow class is the PIL one (checked by main)


def backend_of(proc):
    b = getattr(type(proc), "backend", None)
    if isinstance(b, property):
        try:
            return proc.backend
        except Exception:  # noqa: BLE001
            return "unknown"
    if b is not None:
        return str(b)
    return "torchvision" if "Fast" in type(proc).__name__ else "pil"


def make_proc(cls, min_pixels, max_pixels):
    """A fresh dict for size: transformers 5.x's __init__ writes min/max_pixels into the size
    dict it is given, which is the class attribute when none is passed."""
    if cls is RefProcessor:
        return cls(min_pixels=min_pixels, max_pixels=max_pixels)
    return cls(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
               min_pixels=min_pixels, max_pixels=max_pixels)


def run_proc(proc, im):
    out = proc(images=[im], return_tensors="np")
    pv = np.asarray(out["pixel_values"])
    if pv.ndim == 3:  # some versions keep a batch axis
        pv = pv.reshape(-1, pv.shape[-1])
    grid = np.asarray(out["image_grid_thw"]).reshape(-1, 3)[0].tolist()
    return pv.astype(np.float32), [int(g) for g in grid]


def write_ppm(path, rgb):
    h, w, _ = rgb.shape
    with open(path, "wb") as f:
        f.write(b"P6\n%d %d\n255\n" % (w, h))
        f.write(np.ascontiguousarray(rgb, np.uint8).tobytes())


def smart_resize_table(source):
    if source == "pil":
        sr = ref_smart_resize
    else:
        mod = importlib.import_module("transformers.models.qwen2_vl.image_processing_qwen2_vl")
        sr = mod.smart_resize
    cases = []
    sizes = [(1, 1), (10, 10), (27, 27), (28, 28), (42, 42), (70, 70), (98, 126), (14, 2800),
             (2800, 14), (10, 2000), (10, 2001), (5, 1000), (5, 1001), (56, 11200), (56, 11201),
             (47, 61), (97, 45), (60, 101), (200, 300), (260, 150), (720, 1280), (1080, 1920),
             (4000, 3000), (3024, 4032), (8192, 8192), (16384, 100), (100, 16384), (333, 777),
             (1, 200), (1, 201), (2, 401), (29, 29), (30, 31), (150, 150), (77, 1234)]
    rng = np.random.default_rng(0)
    for _ in range(60):
        sizes.append((int(rng.integers(1, 3000)), int(rng.integers(1, 3000))))
    limits = [(56 * 56, 28 * 28 * 1280), (56 * 56, 28 * 28 * 8), (28 * 28, 28 * 28 * 4),
              (3136, 12845056), (256 * 28 * 28, 1280 * 28 * 28)]
    for (h, w) in sizes:
        for (mn, mx) in limits:
            c = {"height": h, "width": w, "factor": 28, "min_pixels": mn, "max_pixels": mx}
            try:
                rh, rw = sr(h, w, factor=28, min_pixels=mn, max_pixels=mx)
                c["resized"] = [int(rh), int(rw)]
            except ValueError as e:
                c["error"] = str(e)
            cases.append(c)
    return cases


def try_processor_config(cls, outdir):
    """A Qwen2VLProcessor saved with save_pretrained: the layout 5.x writes. Best effort."""
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

    def qwen2_tokenizer(td):
        """A made-up byte-level BPE vocabulary in Qwen2's file format (no network)."""
        import transformers as t
        vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz \u0120")}
        with open(os.path.join(td, "vocab.json"), "w") as f:
            json.dump(vocab, f)
        with open(os.path.join(td, "merges.txt"), "w") as f:
            f.write("#version: 0.2\n")
        cls_ = getattr(t, "Qwen2TokenizerFast", None) or getattr(t, "Qwen2Tokenizer")
        tok = cls_(vocab_file=os.path.join(td, "vocab.json"),
                   merges_file=os.path.join(td, "merges.txt"), unk_token="a")
        tok.add_special_tokens({"additional_special_tokens": specials})
        return tok

    def wordlevel_tokenizer(td):
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        tk = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
        tok.add_special_tokens({"additional_special_tokens": specials})
        return tok

    errors = []
    for make_tok in (qwen2_tokenizer, wordlevel_tokenizer):
        try:
            with tempfile.TemporaryDirectory() as td:
                res = _save_processor(cls, make_tok(td), outdir)
                res["tokenizer"] = make_tok.__name__
                res["earlier_errors"] = errors
                return res
        except Exception as e:  # noqa: BLE001
            errors.append(f"{make_tok.__name__}: {type(e).__name__}: {e}")
    return {"error": errors}


def _save_processor(cls, tok, outdir):
    from transformers import Qwen2VLProcessor
    kwargs = {"image_processor": make_proc(cls, 56 * 56, 28 * 28 * 8), "tokenizer": tok}
    try:
        from transformers import Qwen2VLVideoProcessor
        kwargs["video_processor"] = Qwen2VLVideoProcessor()
    except Exception:  # noqa: BLE001
        pass
    proc = Qwen2VLProcessor(**kwargs)
    with tempfile.TemporaryDirectory() as td:
        proc.save_pretrained(td)
        os.makedirs(outdir, exist_ok=True)
        kept = []
        for fn in sorted(os.listdir(td)):
            if fn in ("processor_config.json", "preprocessor_config.json"):
                with open(os.path.join(td, fn)) as src, open(os.path.join(outdir, fn), "w") as dst:
                    dst.write(src.read())
                kept.append(fn)
        return {"files": kept, "all_files": sorted(os.listdir(td))}


def auto_default_class(min_pixels, max_pixels):
    """What AutoImageProcessor gives for a published-style preprocessor_config.json."""
    from transformers import AutoImageProcessor
    res = {}
    with tempfile.TemporaryDirectory() as td:
        with open(os.path.join(td, "preprocessor_config.json"), "w") as f:
            json.dump({"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": min_pixels,
                       "max_pixels": max_pixels, "patch_size": 14, "temporal_patch_size": 2,
                       "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                       "image_std": [0.26862954, 0.26130258, 0.27577711]}, f)
        for label, kw in (("default", {}), ("use_fast_false", {"use_fast": False})):
            try:
                p = AutoImageProcessor.from_pretrained(td, **kw)
                res[label] = {"class": type(p).__name__, "backend": backend_of(p), "obj": p}
            except Exception as e:  # noqa: BLE001
                res[label] = {"error": f"{type(e).__name__}: {e}"}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", default="tests/data/images")
    ap.add_argument("--out", default="tests/data/images/goldens")
    ap.add_argument("--tar", default=None)
    ap.add_argument("--source", choices=("transformers", "pil"), default="transformers",
                    help="pil: the Pillow+numpy restatement above instead of transformers (CI)")
    ap.add_argument("--all-processors", action="store_true",
                    help="every image through every configuration, not only those images.json "
                         "lists (CI's run, whose output is not committed)")
    args = ap.parse_args()
    global transformers
    if args.source == "transformers":
        import transformers as _t
        transformers = _t

    with open(os.path.join(args.images, "images.json")) as f:
        spec = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    cls = pil_processor_class() if args.source == "transformers" else RefProcessor
    procs = {name: make_proc(cls, p["min_pixels"], p["max_pixels"])
             for name, p in spec["processors"].items()}
    for name, p in procs.items():
        if backend_of(p) != "pil":
            sys.exit(f"{type(p).__name__} is not the PIL backend ({backend_of(p)})")
        d = os.path.join(args.out, f"proc_{name}")
        os.makedirs(d, exist_ok=True)
        p.save_pretrained(d)

    auto = auto_default_class(56 * 56, 28 * 28 * 1280) if args.source == "transformers" else {}
    manifest = {
        "source": args.source,
        "transformers_version": transformers.__version__ if transformers else None,
        "pillow_version": PIL.__version__,
        "numpy_version": np.__version__,
        "libjpeg_turbo_version": features.version("libjpeg_turbo") if hasattr(features, "version") else None,
        "jpeg_version": features.version("jpg") if hasattr(features, "version") else None,
        "webp_version": features.version("webp") if hasattr(features, "version") else None,
        "zlib_version": features.version("zlib") if hasattr(features, "version") else None,
        "processor_class": f"{cls.__module__}.{cls.__name__}",
        "processor_backend": backend_of(procs["default"]),
        "auto_image_processor": {k: {kk: vv for kk, vv in v.items() if kk != "obj"}
                                 for k, v in auto.items()},
        "processors": spec["processors"],
        "goldens": [],
        "decoded": [],
    }

    os.makedirs(os.path.join(args.out, "decoded"), exist_ok=True)
    for entry in spec["images"]:
        path = os.path.join(args.images, entry["file"])
        im = Image.open(path)
        im.load()
        rgb = np.asarray(im.convert("RGB"))
        write_ppm(os.path.join(args.out, "decoded", entry["name"] + ".ppm"), rgb)
        manifest["decoded"].append({"image": entry["name"], "pil_mode": im.mode,
                                    "size": [im.width, im.height]})
        for pname in (spec["processors"] if args.all_processors else entry["processors"]):
            lim = spec["processors"][pname]
            proc = make_proc(cls, lim["min_pixels"], lim["max_pixels"])
            pv, grid = run_proc(proc, Image.open(path))
            want = ref_smart_resize(im.height, im.width, 28, lim["min_pixels"], lim["max_pixels"])
            if grid != [1, want[0] // 14, want[1] // 14]:
                sys.exit(f"{entry['name']} under {pname}: grid {grid}, but smart_resize as read "
                         f"gives {want}: the processor did not take min/max_pixels")
            d = os.path.join(args.out, pname)
            os.makedirs(d, exist_ok=True)
            npy = os.path.join(d, entry["name"] + ".npy")
            np.save(npy, pv)
            g = {"image": entry["name"], "processor": pname, "file": f"{pname}/{entry['name']}.npy",
                 "image_grid_thw": grid, "shape": list(pv.shape)}
            other = auto.get("default", {}).get("obj")
            if other is not None and backend_of(other) != "pil":
                try:
                    lim = spec["processors"][pname]
                    other_p = type(other)(min_pixels=lim["min_pixels"], max_pixels=lim["max_pixels"])
                    opv, ogrid = run_proc(other_p, Image.open(path))
                    if opv.shape == pv.shape:
                        g["auto_default_max_abs_diff"] = float(np.max(np.abs(opv - pv)))
                    g["auto_default_grid"] = ogrid
                except Exception as e:  # noqa: BLE001
                    g["auto_default_error"] = f"{type(e).__name__}: {e}"
            manifest["goldens"].append(g)
            print(f"{pname:10s} {entry['name']:24s} grid {grid} {pv.shape}")

    # Pillow's BICUBIC alone, at sizes smart_resize never asks for: 1-pixel and 1-row outputs,
    # strong down- and upscaling, one side kept (a single pass).
    os.makedirs(os.path.join(args.out, "resize"), exist_ok=True)
    manifest["resizes"] = []
    resize_sizes = [(1, 1), (1, 40), (40, 1), (300, 5), (5, 90), (13, 9), (61, 20), (17, 47),
                    (97, 41), (28, 28)]
    if args.all_processors:
        rng = np.random.default_rng(1)
        resize_sizes += [(int(rng.integers(1, 400)), int(rng.integers(1, 60))) for _ in range(30)]
    for src in ("rgb_odd.png", "big_landscape.png"):
        im = Image.open(os.path.join(args.images, src)).convert("RGB")
        for (w, h) in resize_sizes:
            out = np.asarray(im.resize((w, h), Image.BICUBIC))
            fn = f"resize/{src}.{w}x{h}.ppm"
            write_ppm(os.path.join(args.out, fn), out)
            manifest["resizes"].append({"image": src, "width": w, "height": h, "file": fn})

    with open(os.path.join(args.out, "smart_resize.json"), "w") as f:
        f.write('{"cases": [\n')
        f.write(",\n".join(json.dumps(c) for c in smart_resize_table(args.source)))
        f.write("\n]}\n")
    if args.source == "transformers":
        manifest["processor_config"] = try_processor_config(cls, os.path.join(args.out,
                                                                               "proc_processor"))
    else:
        manifest["processor_config"] = None
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(json.dumps({k: manifest[k] for k in ("transformers_version", "pillow_version",
                                                "processor_class", "auto_image_processor",
                                                "processor_config")}, indent=1))
    if args.tar:
        with tarfile.open(args.tar, "w") as tf:
            tf.add(args.out, arcname="goldens")
        print("wrote", args.tar)


if __name__ == "__main__":
    main()
