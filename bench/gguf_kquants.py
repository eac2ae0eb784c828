#!/usr/bin/env python3
"""gguf_kquants.py - writes a random-weight Llama-shaped GGUF model in BF16 and in the layout of
llama.cpp's Q4_K_M, for measuring quantized decode against bf16 on the same machine
(docs/perf.md, "GGUF k-quants on the CPU").

Q4_K_M's recipe, as llama.cpp applies it (facts, not its code): every linear weight Q4_K,
except attn_v and ffn_down in the layers that get more bits (the first and last eighth of the
layers and every third layer between them) and the output matrix (here the tied token
embedding), which are Q6_K; norms stay F32. Block contents are random bytes with finite f16
scales: decode speed does not depend on the values, and every byte pattern is a valid Q4_K or
Q6_K block (kiln/hal_quant.h). The BF16 file holds N(0, 0.02) weights.

Usage: gguf_kquants.py OUT_DIR [--shape llama-1b|tiny] [--seed S]
Writes OUT_DIR/model-bf16.gguf and OUT_DIR/model-q4_k_m.gguf (about 2.5 GB and 0.8 GB for the
Llama 3.2 1B shape: hidden 2048, 16 layers, 32 heads / 8 KV heads, FFN 8192, vocab 128256,
tied embeddings).
"""
import os
import struct
import sys

import numpy as np

SHAPES = {
    "llama-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
    "tiny": dict(hidden=256, layers=4, heads=4, kv_heads=2, ffn=512, vocab=512),
}
GGML_F32, GGML_Q4_K, GGML_Q6_K, GGML_BF16 = 0, 12, 14, 30
BLOCK = {GGML_Q4_K: (256, 144), GGML_Q6_K: (256, 210)}
T_U32, T_F32, T_STRING = 4, 6, 8


def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, typ, v):
    out = gstr(key) + struct.pack("<I", typ)
    if typ == T_STRING:
        return out + gstr(v)
    return out + struct.pack("<I" if typ == T_U32 else "<f", v)


def more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_bytes(rng, typ, rows, cols):
    if typ == GGML_F32:
        return np.ones(rows * cols, dtype=np.float32).tobytes()
    if typ == GGML_BF16:
        w = (rng.standard_normal(rows * cols, dtype=np.float32) * 0.02).view(np.uint32)
        return (w >> 16).astype(np.uint16).tobytes()
    elems, nbytes = BLOCK[typ]
    nb = rows * cols // elems
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    # finite, small f16 scales: Q4_K d, dmin at bytes 0..3; Q6_K d at bytes 208..209
    d = np.full(nb, 2e-3, dtype=np.float16).view(np.uint8).reshape(nb, 2)
    if typ == GGML_Q4_K:
        raw[:, 0:2] = d
        raw[:, 2:4] = d
    else:
        raw[:, 208:210] = d
    return raw.tobytes()


def write(path, shape, quant, seed):
    rng = np.random.default_rng(seed)
    H, L, NH, KV, I, V = (shape[k] for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab"))
    D = H // NH
    tensors = []  # (name, type, rows, cols)

    def lin(name, rows, cols, q):
        tensors.append((name, (q if quant else GGML_BF16), rows, cols))

    lin("token_embd.weight", V, H, GGML_Q6_K)
    tensors.append(("output_norm.weight", GGML_F32, 1, H))
    for i in range(L):
        p = f"blk.{i}."
        tensors.append((p + "attn_norm.weight", GGML_F32, 1, H))
        tensors.append((p + "ffn_norm.weight", GGML_F32, 1, H))
        lin(p + "attn_q.weight", NH * D, H, GGML_Q4_K)
        lin(p + "attn_k.weight", KV * D, H, GGML_Q4_K)
        lin(p + "attn_v.weight", KV * D, H, GGML_Q6_K if more_bits(i, L) else GGML_Q4_K)
        lin(p + "attn_output.weight", H, NH * D, GGML_Q4_K)
        lin(p + "ffn_gate.weight", I, H, GGML_Q4_K)
        lin(p + "ffn_up.weight", I, H, GGML_Q4_K)
        lin(p + "ffn_down.weight", H, I, GGML_Q6_K if more_bits(i, L) else GGML_Q4_K)
    meta = [kv("general.architecture", T_STRING, "llama"),
            kv("general.name", T_STRING, "random %s" % ("q4_k_m" if quant else "bf16")),
            kv("llama.context_length", T_U32, 8192), kv("llama.embedding_length", T_U32, H),
            kv("llama.block_count", T_U32, L), kv("llama.feed_forward_length", T_U32, I),
            kv("llama.attention.head_count", T_U32, NH),
            kv("llama.attention.head_count_kv", T_U32, KV),
            kv("llama.attention.layer_norm_rms_epsilon", T_F32, 1e-5),
            kv("llama.rope.freq_base", T_F32, 500000.0), kv("general.alignment", T_U32, 32),
            kv("tokenizer.ggml.bos_token_id", T_U32, 1), kv("tokenizer.ggml.eos_token_id", T_U32, 2)]
    sizes, off, offs = [], 0, []
    for name, typ, rows, cols in tensors:
        n = rows * cols
        size = n * 4 if typ == GGML_F32 else n * 2 if typ == GGML_BF16 else n // BLOCK[typ][0] * BLOCK[typ][1]
        off += -off % 32
        offs.append(off)
        sizes.append(size)
        off += size
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta)
    for (name, typ, rows, cols), o in zip(tensors, offs):
        dims = [cols] if rows == 1 else [cols, rows]
        head += gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        head += struct.pack("<IQ", typ, o)
    head += b"\0" * (-len(head) % 32)
    with open(path, "wb") as f:
        f.write(head)
        pos = 0
        for (name, typ, rows, cols), o in zip(tensors, offs):
            f.write(b"\0" * (o - pos))
            data = tensor_bytes(rng, typ, rows, cols)
            f.write(data)
            pos = o + len(data)
    return len(head) + off


def main():
    args = sys.argv[1:]
    shape, seed = "llama-1b", 0
    if "--shape" in args:
        i = args.index("--shape")
        shape = args[i + 1]
        del args[i:i + 2]
    if "--seed" in args:
        i = args.index("--seed")
        seed = int(args[i + 1])
        del args[i:i + 2]
    out = args[0]
    os.makedirs(out, exist_ok=True)
    for quant, name in ((False, "model-bf16.gguf"), (True, "model-q4_k_m.gguf")):
        n = write(os.path.join(out, name), SHAPES[shape], quant, seed)
        print("gguf_kquants: %s, %.2f GB" % (os.path.join(out, name), n / 1e9))


if __name__ == "__main__":
    main()
