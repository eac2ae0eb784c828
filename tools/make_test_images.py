#!/usr/bin/env python3
"""Tiny test images for Kiln's image decoder and Qwen2-VL preprocessing (tests/test_image.c).

    python3 tools/make_test_images.py --out tests/data/images

Needs Pillow and numpy (Debian: python3-pil python3-numpy). Writes every image listed in
IMAGES below plus images.json, the list tools/make_image_goldens.py and the C test read:
name, file, format, what it exercises, and the processor configurations ("default",
"small_max", "tiny") its golden pixel values are recorded under.

The committed files are the reference, not this script's output on another machine: a newer
Pillow or libjpeg may encode the same pixels to different bytes, which is harmless because the
goldens are computed from the committed files. PNG variants Pillow cannot write (16-bit colour,
Adam7 interlacing, 1/2-bit grey, tRNS on truecolour) come from the small PNG writer below,
written from the PNG specification (signature, IHDR/PLTE/tRNS/IDAT/IEND chunks with CRC-32,
filter type 0 on every scanline, zlib stream).
"""
import argparse
import io
import json
import os
import struct
import zlib

import numpy as np
from PIL import Image


def pattern(w, h, seed, channels=3):
    """Gradients, hard edges and noise: content that makes bicubic overshoot and clip."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    out = np.empty((h, w, channels), np.float64)
    for c in range(channels):
        grad = 255.0 * (0.5 + 0.5 * np.sin((x * (c + 1) * 0.21) + (y * (3 - c) * 0.13) + seed))
        checker = ((x.astype(int) // (3 + c) + y.astype(int) // (4 + c)) % 2) * 255.0
        noise = rng.normal(0.0, 25.0, (h, w))
        mix = 0.55 * grad + 0.35 * checker + noise
        out[:, :, c] = mix
    out[0:2, :, :] = 255.0  # saturated borders: the filter's edge handling
    out[:, -1, :] = 0.0
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------- PNG writer --
def _chunk(kind, data):
    return (struct.pack(">I", len(data)) + kind + data +
            struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def _pack_rows(samples, bit_depth):
    """samples: uint array [h, w*channels] of values < 2**bit_depth -> list of row bytes."""
    rows = []
    for row in samples:
        if bit_depth == 16:
            rows.append(row.astype(">u2").tobytes())
        elif bit_depth == 8:
            rows.append(row.astype(np.uint8).tobytes())
        else:
            per = 8 // bit_depth
            padded = np.zeros(((len(row) + per - 1) // per) * per, np.uint32)
            padded[:len(row)] = row
            packed = np.zeros(len(padded) // per, np.uint32)
            for i in range(per):
                packed |= padded[i::per] << (8 - bit_depth * (i + 1))
            rows.append(packed.astype(np.uint8).tobytes())
    return rows


ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
         (0, 1, 1, 2)]  # (x0, y0, dx, dy)


def write_png(path, pixels, color_type, bit_depth, interlace=False, palette=None, trns=None):
    """pixels: [h, w, channels] (or [h, w] for grey/palette) unsigned values."""
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    h, w, ch = pixels.shape
    raw = b""
    if not interlace:
        for r in _pack_rows(pixels.reshape(h, w * ch), bit_depth):
            raw += b"\x00" + r
    else:
        for x0, y0, dx, dy in ADAM7:
            sub = pixels[y0::dy, x0::dx, :]
            if sub.shape[0] == 0 or sub.shape[1] == 0:
                continue
            for r in _pack_rows(sub.reshape(sub.shape[0], sub.shape[1] * ch), bit_depth):
                raw += b"\x00" + r
    out = b"\x89PNG\r\n\x1a\n"
    out += _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0,
                                       1 if interlace else 0))
    if palette is not None:
        out += _chunk(b"PLTE", bytes(np.asarray(palette, np.uint8).reshape(-1)))
    if trns is not None:
        out += _chunk(b"tRNS", trns)
    out += _chunk(b"IDAT", zlib.compress(raw, 9))
    out += _chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(out)


# ------------------------------------------------------------------------------ images --
def make_all(out):
    os.makedirs(out, exist_ok=True)
    entries = []

    def add(name, fmt, what, procs):
        entries.append({"name": name, "file": name, "format": fmt, "what": what,
                        "processors": procs})

    def pil_save(name, im, fmt, what, procs, **kw):
        im.save(os.path.join(out, name), fmt, **kw)
        add(name, fmt.lower(), what, procs)

    d = ["default"]
    s = ["small_max"]
    t = ["tiny"]

    # Through the default Qwen2-VL settings (min 56*56 pixels): odd sizes, both orientations.
    pil_save("rgb_odd.png", Image.fromarray(pattern(61, 47, 1)), "PNG",
             "8-bit RGB PNG, odd size, landscape", d)
    pil_save("portrait.jpg", Image.fromarray(pattern(45, 97, 2)), "JPEG",
             "baseline JPEG 4:2:0, portrait", d, quality=90)
    pil_save("landscape_prog.jpg", Image.fromarray(pattern(75, 40, 3)), "JPEG",
             "progressive JPEG, landscape, below min_pixels", d, quality=85, progressive=True)
    pil_save("lossy.webp", Image.fromarray(pattern(70, 50, 7)), "WEBP",
             "lossy WebP (VP8); 70/28 = 2.5 rounds half to even", d, quality=80)

    # Through a small max_pixels: larger images downscaled (filter support widened).
    pil_save("big_landscape.png", Image.fromarray(pattern(200, 130, 10)), "PNG",
             "RGB PNG that hits max_pixels", s)
    pil_save("big_portrait.jpg", Image.fromarray(pattern(120, 210, 11)), "JPEG",
             "JPEG that hits max_pixels, portrait", s, quality=92)

    # Through a tiny configuration (min 28*28 pixels): the colour types, cheaply. Those with no
    # processor listed get only a decode golden (decoded/NAME.ppm).
    n = []
    pil_save("grey.png", Image.fromarray(pattern(50, 40, 4, 1)[:, :, 0], "L"), "PNG",
             "8-bit greyscale PNG", t)
    pal = Image.fromarray(pattern(40, 60, 5)).quantize(colors=48, method=Image.Quantize.MEDIANCUT)
    trns = bytes([0 if i % 7 == 0 else (128 if i % 7 == 1 else 255) for i in range(48)])
    pil_save("palette_trns.png", pal, "PNG", "8-bit palette PNG with a tRNS alpha table", t,
             transparency=trns)
    rgba = np.dstack([pattern(44, 36, 6), np.tile(np.linspace(0, 255, 44).astype(np.uint8),
                                                  (36, 1))])
    rgba[10:20, 10:30, 3] = 0
    pil_save("rgba.png", Image.fromarray(rgba, "RGBA"), "PNG",
             "8-bit RGBA PNG, alpha from 0 to 255", t)
    a = np.dstack([pattern(40, 34, 8), pattern(40, 34, 9, 1)])
    pil_save("alpha_lossless.webp", Image.fromarray(a, "RGBA"), "WEBP",
             "lossless WebP (VP8L) with alpha", t, lossless=True, exact=True)
    la = np.dstack([pattern(33, 29, 12, 1), pattern(33, 29, 13, 1)])
    pil_save("la.png", Image.fromarray(la, "LA"), "PNG", "8-bit grey+alpha PNG", t)
    v16 = pattern(30, 34, 14).astype(np.uint32) * 257 + np.arange(30, dtype=np.uint32)[None, :, None]
    write_png(os.path.join(out, "rgb16.png"), np.minimum(v16, 65535), 2, 16)
    add("rgb16.png", "png", "16-bit RGB PNG", n)
    g16 = pattern(31, 28, 15, 1)[:, :, 0].astype(np.uint32)
    g16 = g16 * (np.arange(31, dtype=np.uint32)[None, :] % 3 + 1)  # values 0..765: some > 255
    write_png(os.path.join(out, "grey16.png"), g16, 0, 16)
    add("grey16.png", "png", "16-bit greyscale PNG, values 0..765", t)
    a16 = np.dstack([pattern(28, 30, 16), pattern(28, 30, 17, 1)]).astype(np.uint32) * 257
    write_png(os.path.join(out, "rgba16.png"), a16, 6, 16)
    add("rgba16.png", "png", "16-bit RGBA PNG", n)
    la16 = np.dstack([pattern(29, 29, 18, 1), pattern(29, 29, 19, 1)]).astype(np.uint32) * 256
    write_png(os.path.join(out, "la16.png"), la16, 4, 16)
    add("la16.png", "png", "16-bit grey+alpha PNG", n)
    write_png(os.path.join(out, "interlaced.png"), pattern(37, 41, 20), 2, 8, interlace=True)
    add("interlaced.png", "png", "Adam7-interlaced RGB PNG", t)
    pal4 = (pattern(30, 33, 21, 1)[:, :, 0] // 16).astype(np.uint32)
    palette = [(i * 16, 255 - i * 16, (i * 53) % 256) for i in range(16)]
    write_png(os.path.join(out, "interlaced_pal4.png"), pal4, 3, 4, interlace=True,
              palette=palette)
    add("interlaced_pal4.png", "png", "Adam7-interlaced 4-bit palette PNG", n)
    write_png(os.path.join(out, "grey2.png"), pattern(29, 30, 22, 1)[:, :, 0] // 64, 0, 2)
    add("grey2.png", "png", "2-bit greyscale PNG", n)
    write_png(os.path.join(out, "grey1.png"), pattern(30, 29, 23, 1)[:, :, 0] // 128, 0, 1)
    add("grey1.png", "png", "1-bit greyscale PNG", n)
    rgbt = pattern(32, 30, 24)
    rgbt[5:9, 5:9] = (255, 255, 255)
    write_png(os.path.join(out, "rgb_trns.png"), rgbt, 2, 8, trns=struct.pack(">HHH", 255, 255, 255))
    add("rgb_trns.png", "png", "RGB PNG with a tRNS colour key", n)
    write_png(os.path.join(out, "grey_trns.png"), pattern(30, 32, 25, 1)[:, :, 0], 0, 8,
              trns=struct.pack(">H", 255))
    add("grey_trns.png", "png", "greyscale PNG with a tRNS grey key", n)
    pil_save("grey.jpg", Image.fromarray(pattern(40, 36, 26, 1)[:, :, 0], "L"), "JPEG",
             "greyscale JPEG", t, quality=90)
    cmyk = Image.fromarray(np.dstack([pattern(32, 32, 27), pattern(32, 32, 28, 1)]), "CMYK")
    pil_save("cmyk.jpg", cmyk, "JPEG", "CMYK JPEG (Adobe APP14)", t, quality=90)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display; decoders must NOT apply it
    pil_save("exif_rot.jpg", Image.fromarray(pattern(60, 30, 29)), "JPEG",
             "JPEG with EXIF orientation 6 (not applied)", t, quality=90, exif=exif.tobytes())
    pil_save("jpeg444.jpg", Image.fromarray(pattern(35, 31, 30)), "JPEG",
             "baseline JPEG 4:4:4", n, quality=95, subsampling=0)
    pil_save("jpeg422.jpg", Image.fromarray(pattern(35, 31, 31)), "JPEG",
             "baseline JPEG 4:2:2", n, quality=95, subsampling=1)
    la_w = np.dstack([pattern(36, 30, 32), np.full((30, 36), 255, np.uint8)])
    la_w[:, :12, 3] = 0
    la_w[:, 12:24, 3] = 100
    pil_save("lossy_alpha.webp", Image.fromarray(la_w, "RGBA"), "WEBP", "lossy WebP with alpha",
             t, quality=75)
    pil_save("lossless.webp", Image.fromarray(pattern(30, 30, 33)), "WEBP",
             "lossless WebP without alpha", n, lossless=True)

    # Refused inputs the C test reads as they are (others it makes by truncating these).
    hdr = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))
    with open(os.path.join(out, "huge_dims.png"), "wb") as f:
        f.write(hdr + _chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + _chunk(b"IEND", b""))
    buf = io.BytesIO()
    Image.fromarray(pattern(12, 10, 34)).save(buf, "GIF")
    with open(os.path.join(out, "tiny.gif"), "wb") as f:
        f.write(buf.getvalue())
    buf = io.BytesIO()
    Image.fromarray(pattern(12, 10, 35)).save(buf, "BMP")
    with open(os.path.join(out, "tiny.bmp"), "wb") as f:
        f.write(buf.getvalue())

    with open(os.path.join(out, "images.json"), "w") as f:
        json.dump({"images": entries,
                   "processors": {
                       "default": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280},
                       "small_max": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 8},
                       "tiny": {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 4}},
                   "refused": ["huge_dims.png", "tiny.gif", "tiny.bmp"]}, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/data/images")
    args = ap.parse_args()
    make_all(args.out)


if __name__ == "__main__":
    main()
