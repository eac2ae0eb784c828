#!/usr/bin/env python3
"""make_quant_fixtures.py - GPTQ and AWQ checkpoints of a tiny float model, for test_qlinear.

Reads a float safetensors fixture (tests/fixtures/models/<name>: config.json, model.safetensors),
quantizes every decoder Linear (q/k/v/o_proj, gate/up/down_proj) with numpy and writes, for
each variant below, two checkpoints:

  OUT/<variant>/      config.json with a quantization_config, model.safetensors with
                      <module>.qweight / .qzeros / .scales (/ .g_idx) packed byte for byte as
                      AutoGPTQ / GPTQModel (GPTQ) and AutoAWQ (AWQ, GEMM version) write them
  OUT/<variant>_ref/  the same model with each Linear's dequantized weights as a plain F32
                      <module>.weight (the exact f32 values (q - z) * s), no quantization_config

The packing is written here from the format descriptions (docs/models.md, kiln/hal_quant.h),
independently of Kiln's C code:
  GPTQ qweight int32 [K / P, N] (P = 32 / bits codes per word, packed along K, lowest bits
       first); qzeros int32 [G, N / P] packed along N, holding z - 1 ("gptq", v1) or z
       ("gptq_v2"); scales f16 [G, N]; g_idx int32 [K].
  AWQ  qweight int32 [K, N / 8] packed along N, column 8j + c in nibble [0,4,1,5,2,6,3,7][c];
       qzeros int32 [G, N / 8] the same way; scales f16 [G, N].
Deterministic (a fixed seed per variant). Usage:
  make_quant_fixtures.py SRC_DIR OUT_DIR [VARIANT ...]
"""
import json
import os
import struct
import sys

import numpy as np

VARIANTS = {
    # name: method, bits, group_size, sym, desc_act, checkpoint_format
    "gptq_sym_g32": ("gptq", 4, 32, True, False, "gptq"),
    # act-order: one column order per Linear input, as GPTQ gives the Linears that read the
    # same activations (q/k/v, gate/up: the same Hessian); "_mixed" draws one per Linear, so
    # fused parts differ and Kiln dequantizes those at load (its widening path).
    "gptq_asym_act": ("gptq", 4, 32, False, True, "gptq"),
    "gptq_asym_act_mixed": ("gptq", 4, 32, False, True, "gptq"),
    "gptq_int8_g64": ("gptq", 8, 64, False, False, "gptq_v2"),
    "gptq_all_k": ("gptq", 4, -1, False, False, "gptq"),
    "awq_g32": ("awq", 4, 32, False, False, None),
}

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of 8 lives in nibble AWQ_NIBBLE[c]

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "I32": np.int32}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in ("F32", "F16"):
            raise SystemExit(f"{path}: {name}: dtype {info['dtype']} not handled here")
        b, e = info["data_offsets"]
        arr = np.frombuffer(data[base + b : base + e], dtype=DTYPES[info["dtype"]])
        out[name] = arr.reshape(info["shape"]).astype(np.float32)
    return out


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dt = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int32): "I32"}[a.dtype]
        raw = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def quantize(w, bits, gs, sym, g_idx):
    """w [N, K] f32 -> codes [N, K], zeros [G, N] (real zero points), scales f16 [G, N]."""
    n_out, k_in = w.shape
    maxq = 2**bits - 1
    groups = int(g_idx.max()) + 1
    codes = np.zeros((n_out, k_in), np.int64)
    zeros = np.zeros((groups, n_out), np.int64)
    scales = np.zeros((groups, n_out), np.float16)
    for g in range(groups):
        cols = np.nonzero(g_idx == g)[0]
        wg = w[:, cols].astype(np.float64)
        if sym:
            s = np.maximum(np.abs(wg).max(axis=1) * 2 / maxq, 1e-4)
            z = np.full(n_out, (maxq + 1) // 2)
        else:
            lo, hi = wg.min(axis=1), wg.max(axis=1)
            s = np.maximum((hi - lo) / maxq, 1e-4)
            z = np.clip(np.round(-lo / s), 0, maxq).astype(np.int64)
        s16 = s.astype(np.float16)
        sf = s16.astype(np.float64)
        q = np.clip(np.round(wg / sf[:, None]) + z[:, None], 0, maxq).astype(np.int64)
        codes[:, cols] = q
        zeros[g] = z
        scales[g] = s16
    return codes, zeros, scales


def pack_along(vals, bits, order=None):
    """vals [R, C] (C a multiple of P = 32 / bits) -> int32 [R, C / P], value c of a word in bits
    bits * pos(c), pos = order or identity."""
    p = 32 // bits
    r, c = vals.shape
    assert c % p == 0
    out = np.zeros((r, c // p), np.uint64)
    for i in range(p):
        pos = order[i] if order else i
        out |= (vals[:, i::p].astype(np.uint64) & (2**bits - 1)) << np.uint64(bits * pos)
    return out.astype(np.uint32).view(np.int32)


def dequant(codes, zeros, scales, g_idx):
    """The exact f32 weights (q - z) * s, [N, K]."""
    z = zeros[g_idx, :].T  # [N, K]
    s = scales[g_idx, :].T.astype(np.float32)
    return (codes - z).astype(np.float32) * s


def make_variant(src_dir, out_dir, name):
    method, bits, gs, sym, desc_act, fmt = VARIANTS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    tensors = read_safetensors(os.path.join(src_dir, "model.safetensors"))
    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    quant, ref, perms = {}, {}, {}
    for tname, w in tensors.items():
        mod = tname[: -len(".weight")] if tname.endswith(".weight") else None
        if not mod or mod.rsplit(".", 1)[-1] not in LINEARS:
            quant[tname] = w
            ref[tname] = w
            continue
        n_out, k_in = w.shape
        g = gs if gs > 0 else k_in
        if desc_act:  # act-order: columns visited in a random order, groups of g along it
            shared = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp",
                      "up_proj": "mlp"}.get(mod.rsplit(".", 1)[-1])
            key = mod if name.endswith("_mixed") or not shared else mod.rsplit(".", 1)[0] + shared
            if key not in perms:
                perms[key] = rng.permutation(k_in)
            perm = perms[key]
            g_idx = np.zeros(k_in, np.int64)
            g_idx[perm] = np.arange(k_in) // g
        else:
            g_idx = np.arange(k_in) // g
        codes, zeros, scales = quantize(w, bits, g, sym, g_idx)
        if method == "gptq":
            stored = zeros - 1 if fmt == "gptq" else zeros
            stored &= 2**bits - 1
            eff = stored + 1 if fmt == "gptq" else stored  # what a GPTQ kernel decodes
            quant[mod + ".qweight"] = np.ascontiguousarray(pack_along(codes, bits).T)
            quant[mod + ".qzeros"] = pack_along(stored, bits)
            quant[mod + ".scales"] = scales
            quant[mod + ".g_idx"] = g_idx.astype(np.int32)
        else:
            eff = zeros
            quant[mod + ".qweight"] = pack_along(np.ascontiguousarray(codes.T), 4, AWQ_NIBBLE)
            quant[mod + ".qzeros"] = pack_along(zeros, 4, AWQ_NIBBLE)
            quant[mod + ".scales"] = scales
        ref[tname] = dequant(codes, eff, scales, g_idx)
    qc = {"quant_method": method, "bits": bits, "group_size": gs}
    if method == "gptq":
        qc.update({"desc_act": desc_act, "sym": sym, "damp_percent": 0.01, "true_sequential": True,
                   "static_groups": False, "checkpoint_format": fmt})
    else:
        qc.update({"version": "gemm", "zero_point": True, "modules_to_not_convert": None})
    for sub, t, cfg in ((name, quant, dict(config, quantization_config=qc)), (name + "_ref", ref, config)):
        d = os.path.join(out_dir, sub)
        os.makedirs(d, exist_ok=True)
        write_safetensors(os.path.join(d, "model.safetensors"), t)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    names = sys.argv[3:] or list(VARIANTS)
    for n in names:
        make_variant(sys.argv[1], sys.argv[2], n)


if __name__ == "__main__":
    main()
