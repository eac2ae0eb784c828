#!/usr/bin/env python3
"""Tiny random-weight reference models for Kiln's numerical parity tests.

    python3 tools/make_parity_fixtures.py --out tests/fixtures/models [--only NAME]
    python3 tools/make_parity_fixtures.py --selftest      # stdlib only: GGUF + .npy writers

Needs torch 2.x, transformers (4.4x or 5.x), numpy and safetensors (the GPU machine); --selftest
needs only the Python standard library. Everything runs on the CPU in float32 with eager
attention, one thread, seeded per fixture, so a rerun writes the same files.

Each fixture <out>/<name>/ holds a Hugging Face checkpoint (config.json, generation_config.json,
model.safetensors or shards + index) or a GGUF v3 file (model.gguf, no config.json), and:
  logits.npy       float32 [n_tokens, vocab]: one forward pass over the whole prompt
  logits_bf16.npy  (qwen2_bf16 only) the same in bfloat16 compute, saved as float32
  reference.json   name, architecture, model_type, transformers_version, torch_version,
                   checkpoint_dtype, prompt_ids, logits_file, logits_bf16_file, greedy
                   {prompt_ids, token_ids, margins} or null, notes, weights
Greedy: a separate 8-token prompt continued 24 tokens by argmax, one full forward (no cache)
per step, no EOS stop; margins[i] = top-1 logit - top-2 logit at step i.

Model shape shared by all: vocab 320, hidden 64, intermediate 160, 2 layers, 4 heads,
rms_norm_eps 1e-5, bos 1, eos 2. Weights: normal(0, 0.08), norm weights uniform(0.5, 1.5).

The GGUF writer and reader below are written from the format description (little endian:
header, metadata key/values, tensor directory, data aligned to general.alignment = 32).
"""
import argparse
import array
import ast
import json
import math
import os
import random
import shutil
import struct
import sys

# Imported lazily by _import_ml() so that --selftest runs with the standard library alone.
torch = None
transformers = None
TF_MAJOR = 0

# ---------------------------------------------------------------------------------------------
# Fixture table
# ---------------------------------------------------------------------------------------------

VOCAB = 320
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
WEIGHT_STD = 0.08
GREEDY_PROMPT_LEN = 8
GREEDY_STEPS = 24
MAX_FIXTURE_BYTES = 2 * 1024 * 1024

DYNAMIC_NOTE = (
    "dynamic NTK rope, factor 2, max_position_embeddings 32. transformers recomputes the "
    "dynamic base from the running sequence length (base * (factor*L/max_pos - (factor-1))"
    "^(d/(d-2)) with L = current length when L > max_pos); Kiln fixes it at "
    "L = max_position_embeddings*factor = 64, so the two agree exactly only at length 64: the "
    "prompt is exactly 64 tokens and there is no greedy continuation."
)

# rope: (rope_type, rope_theta, extra parameters). save: "safetensors", "sharded", "bf16", "gguf".
FIXTURES = [
    dict(name="llama2", arch="LlamaForCausalLM", seed=1001, kv_heads=4, tie=False, max_pos=128,
         rope=("default", 10000.0, {}), prompt_len=40, save="safetensors",
         notes="Llama 2 style: 4 kv heads (MHA), default rope theta 10000, untied lm_head."),
    dict(name="llama3_scaled", arch="LlamaForCausalLM", seed=1002, kv_heads=2, tie=True, max_pos=512,
         rope=("llama3", 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
         prompt_len=100, save="safetensors",
         notes="Llama 3.1 rope scaling (rope_type llama3, factor 8, low 1, high 4, original 64: "
               "with head_dim 16 the frequencies fall in all three bands, wavelength 32.4 in the "
               "smoothed one), GQA 2 kv heads, tied embeddings (no lm_head.weight in the file); "
               "the 100-token prompt runs past the original 64 positions."),
    dict(name="llama_linear", arch="LlamaForCausalLM", seed=1003, kv_heads=2, tie=False, max_pos=128,
         rope=("linear", 10000.0, {"factor": 2.0}), prompt_len=90, save="safetensors",
         notes="linear rope scaling factor 2 (inv_freq / 2), GQA 2 kv heads."),
    dict(name="llama_dynamic", arch="LlamaForCausalLM", seed=1004, kv_heads=2, tie=False, max_pos=32,
         rope=("dynamic", 10000.0, {"factor": 2.0}), prompt_len=64, greedy=False, save="safetensors",
         notes=DYNAMIC_NOTE),
    dict(name="llama_yarn", arch="LlamaForCausalLM", seed=1005, kv_heads=2, tie=False, max_pos=128,
         rope=("yarn", 10000.0, {"factor": 4.0, "original_max_position_embeddings": 32}),
         prompt_len=100, save="safetensors",
         notes="YaRN factor 4, original_max_position_embeddings 32, max_position_embeddings 128 "
               "(so max/original = factor); default beta_fast 32 / beta_slow 1; attention factor "
               "0.1*ln(4)+1."),
    dict(name="llama_bias_mqa", arch="LlamaForCausalLM", seed=1006, kv_heads=1, tie=False, max_pos=128,
         rope=("default", 10000.0, {}), prompt_len=40, save="safetensors",
         extra={"attention_bias": True, "mlp_bias": True, "head_dim": 32},
         notes="attention_bias (q, k, v and o biases) and mlp_bias (gate, up, down biases); MQA "
               "(1 kv head); head_dim 32 given explicitly (q_proj is [128, 64], not hidden/heads)."),
    dict(name="mistral_swa", arch="MistralForCausalLM", seed=1007, kv_heads=2, tie=False, max_pos=128,
         rope=("default", 10000.0, {}), prompt_len=48, save="safetensors",
         extra={"sliding_window": 16, "head_dim": 16},
         notes="Mistral with sliding_window 16 on every layer; the 48-token prompt and the "
               "32-token greedy sequence both exceed the window."),
    dict(name="qwen2_bf16", arch="Qwen2ForCausalLM", seed=1008, kv_heads=2, tie=True, max_pos=128,
         rope=("default", 1000000.0, {}), prompt_len=40, save="bf16",
         notes="Qwen2 (q/k/v biases, no o bias), tied embeddings, rope theta 1e6, checkpoint "
               "saved in bfloat16. logits.npy: float32 compute on the bf16 weights (upcast); "
               "logits_bf16.npy: bf16 weights and activations as transformers' eager path runs "
               "them (rope inv_freq kept float32, cos/sin cast to bf16), saved as float32; "
               "greedy: float32 compute."),
    dict(name="qwen3", arch="Qwen3ForCausalLM", seed=1009, kv_heads=2, tie=False, max_pos=128,
         rope=("default", 1000000.0, {}), prompt_len=40, save="safetensors",
         extra={"head_dim": 128},
         notes="Qwen3: per-head q_norm/k_norm RMSNorm, head_dim 128 given explicitly (q_proj is "
               "[512, 64]), GQA 2 kv heads, untied, rope theta 1e6."),
    dict(name="llama_sharded", arch="LlamaForCausalLM", seed=1010, kv_heads=4, tie=False, max_pos=128,
         rope=("default", 10000.0, {}), prompt_len=40, save="sharded", max_shard_size="100KB",
         notes="same config as llama2 with other weights, saved with max_shard_size 100KB: "
               "model.safetensors.index.json plus several model-0000N-of-0000M.safetensors."),
    dict(name="llama3_gguf", base="llama3_scaled", save="gguf", gguf_arch="llama",
         gguf_types={"token_embd.weight": "F16", ".attn_q.weight": "Q8_0",
                     ".attn_k.weight": "BF16", ".ffn_up.weight": "Q8_0"},
         notes="the llama3_scaled model (same seed, same prompts) as GGUF v3, architecture llama: "
               "token_embd F16, attn_q Q8_0, attn_k BF16, ffn_up Q8_0, everything else F32; tied "
               "so no output.weight; attn_q/attn_k rows permuted as llama.cpp's converter does; "
               "rope_freqs.weight holds the llama3 factors (inv_freq is divided by them). "
               "Reference: the HF model with exactly the values the file stores (dequantized), "
               "float32."),
    dict(name="qwen3_gguf", base="qwen3", save="gguf", gguf_arch="qwen3", gguf_types={},
         notes="the qwen3 model (same seed, same prompts) as GGUF v3, architecture qwen3, all "
               "tensors F32, no q/k permutation; logits equal qwen3's."),
]
FIXTURE_BY_NAME = {f["name"]: f for f in FIXTURES}


def resolve_fixture(fx):
    """A GGUF fixture takes the model, seed and prompts of its base fixture."""
    if "base" not in fx:
        return dict(fx)
    out = dict(FIXTURE_BY_NAME[fx["base"]])
    for k, v in fx.items():
        if k != "base":
            out[k] = v
    out["base"] = fx["base"]
    return out


# ---------------------------------------------------------------------------------------------
# Number formats (stdlib only)
# ---------------------------------------------------------------------------------------------

def f32_round(x):
    """x rounded to the nearest float32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def floats_to_f32_bytes(vals):
    a = array.array("f", vals)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def f32_bytes_to_floats(b):
    a = array.array("f")
    a.frombytes(bytes(b))
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def encode_f16(vals):
    return struct.pack("<%de" % len(vals), *vals)  # round to nearest even


def decode_f16(b):
    return list(struct.unpack("<%de" % (len(b) // 2), bytes(b)))


def encode_bf16(vals):
    n = len(vals)
    bits = struct.unpack("<%dI" % n, floats_to_f32_bytes(vals))
    out = []
    for b in bits:
        if (b & 0x7F800000) == 0x7F800000 and (b & 0x007FFFFF):
            out.append((b >> 16) | 0x0040)  # NaN stays a (quiet) NaN
        else:
            out.append(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF)  # nearest even
    return struct.pack("<%dH" % n, *out)


def decode_bf16(b):
    n = len(b) // 2
    hs = struct.unpack("<%dH" % n, bytes(b))
    return list(struct.unpack("<%df" % n, struct.pack("<%dI" % n, *[h << 16 for h in hs])))


QK8_0 = 32
Q8_0_BLOCK_BYTES = 2 + QK8_0


def _round_half_away(r):
    """C roundf: halves go away from zero."""
    return math.floor(r + 0.5) if r >= 0 else -math.floor(-r + 0.5)


def encode_q8_0(vals):
    """Blocks of 32 consecutive values: d = max|x|/127 (float32) stored as f16, then 32 int8
    q = roundf(x/d) clamped to [-127, 127]; d == 0 gives q = 0."""
    n = len(vals)
    if n % QK8_0:
        raise ValueError("Q8_0 needs a multiple of 32 values, got %d" % n)
    vals = array.array("f", vals).tolist()  # the float32 values being quantized
    out = bytearray()
    for i in range(0, n, QK8_0):
        blk = vals[i:i + QK8_0]
        amax = max(abs(v) for v in blk)
        d = f32_round(amax / 127.0)
        if d == 0.0 or not math.isfinite(d):
            qs = [0] * QK8_0
            d = 0.0 if d == 0.0 else d
        else:
            qs = []
            for v in blk:
                q = _round_half_away(f32_round(v / d))
                qs.append(max(-127, min(127, q)))
        out += struct.pack("<e", d)
        out += struct.pack("<32b", *qs)
    return bytes(out)


def decode_q8_0(b, n):
    """Dequantized values float(f16(d)) * q (exact in float32)."""
    b = bytes(b)
    out = []
    for k in range(n // QK8_0):
        off = k * Q8_0_BLOCK_BYTES
        d = struct.unpack_from("<e", b, off)[0]
        qs = struct.unpack_from("<32b", b, off + 2)
        out.extend(d * q for q in qs)
    return out


# ggml tensor types used here
GGML_F32, GGML_F16, GGML_Q8_0, GGML_BF16 = 0, 1, 8, 30
GGML_TYPE_NAMES = {GGML_F32: "F32", GGML_F16: "F16", GGML_Q8_0: "Q8_0", GGML_BF16: "BF16"}
GGML_TYPE_BY_NAME = {v: k for k, v in GGML_TYPE_NAMES.items()}


def ggml_nbytes(gtype, n):
    if gtype == GGML_F32:
        return 4 * n
    if gtype in (GGML_F16, GGML_BF16):
        return 2 * n
    if gtype == GGML_Q8_0:
        if n % QK8_0:
            raise ValueError("Q8_0 tensor of %d values" % n)
        return n // QK8_0 * Q8_0_BLOCK_BYTES
    raise ValueError("unsupported ggml type %r" % gtype)


def ggml_encode(gtype, vals):
    if gtype == GGML_F32:
        return floats_to_f32_bytes(vals)
    if gtype == GGML_F16:
        return encode_f16(vals)
    if gtype == GGML_BF16:
        return encode_bf16(vals)
    if gtype == GGML_Q8_0:
        return encode_q8_0(vals)
    raise ValueError("unsupported ggml type %r" % gtype)


def ggml_decode(gtype, data, n):
    if gtype == GGML_F32:
        return f32_bytes_to_floats(data)
    if gtype == GGML_F16:
        return decode_f16(data)
    if gtype == GGML_BF16:
        return decode_bf16(data)
    if gtype == GGML_Q8_0:
        return decode_q8_0(data, n)
    raise ValueError("unsupported ggml type %r" % gtype)


# ---------------------------------------------------------------------------------------------
# GGUF v3 writer and reader (stdlib only)
# ---------------------------------------------------------------------------------------------

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
GGUF_ALIGNMENT = 32
# metadata value types
GV_U8, GV_I8, GV_U16, GV_I16, GV_U32, GV_I32, GV_F32, GV_BOOL, GV_STRING, GV_ARRAY, GV_U64, GV_I64, \
    GV_F64 = range(13)
_GV_FMT = {GV_U8: "<B", GV_I8: "<b", GV_U16: "<H", GV_I16: "<h", GV_U32: "<I", GV_I32: "<i",
           GV_F32: "<f", GV_BOOL: "<?", GV_U64: "<Q", GV_I64: "<q", GV_F64: "<d"}


def _gguf_str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _gguf_value(vtype, value, elem_type=None):
    if vtype == GV_STRING:
        return _gguf_str(value)
    if vtype == GV_ARRAY:
        if elem_type is None or elem_type == GV_ARRAY:
            raise ValueError("array needs a scalar or string element type")
        out = struct.pack("<IQ", elem_type, len(value))
        return out + b"".join(_gguf_value(elem_type, v) for v in value)
    if vtype not in _GV_FMT:
        raise ValueError("unknown metadata type %r" % vtype)
    return struct.pack(_GV_FMT[vtype], value)


def _align(n, a):
    return (n + a - 1) // a * a


class GGUFWriter:
    """Collects metadata and tensors; to_bytes() lays out a GGUF v3 file.

    Tensors are given in PyTorch order: shape [out, in] with row-major values; the file's ne
    lists dimensions innermost first, so ne = reversed(shape)."""

    def __init__(self, alignment=GGUF_ALIGNMENT):
        self.alignment = alignment
        self.kv = []  # (key, type, value, elem_type)
        self.tensors = []  # (name, shape, ggml_type, data)

    def add(self, key, vtype, value, elem_type=None):
        if any(k == key for k, _, _, _ in self.kv):
            raise ValueError("duplicate metadata key %s" % key)
        self.kv.append((key, vtype, value, elem_type))

    def add_u32(self, key, v):
        self.add(key, GV_U32, int(v))

    def add_i32(self, key, v):
        self.add(key, GV_I32, int(v))

    def add_u64(self, key, v):
        self.add(key, GV_U64, int(v))

    def add_f32(self, key, v):
        self.add(key, GV_F32, float(v))

    def add_bool(self, key, v):
        self.add(key, GV_BOOL, bool(v))

    def add_string(self, key, v):
        self.add(key, GV_STRING, str(v))

    def add_array(self, key, elem_type, values):
        self.add(key, GV_ARRAY, list(values), elem_type)

    def add_tensor(self, name, shape, values, gtype):
        shape = [int(s) for s in shape]
        n = 1
        for s in shape:
            n *= s
        if len(values) != n:
            raise ValueError("%s: %d values for shape %s" % (name, len(values), shape))
        if gtype == GGML_Q8_0 and shape[-1] % QK8_0:
            raise ValueError("%s: Q8_0 needs the innermost dimension to be a multiple of 32" % name)
        if any(t[0] == name for t in self.tensors):
            raise ValueError("duplicate tensor %s" % name)
        data = ggml_encode(gtype, values)
        assert len(data) == ggml_nbytes(gtype, n)
        self.tensors.append((name, shape, gtype, data))

    def to_bytes(self):
        for k, vtype, v, _ in self.kv:
            if k == "general.alignment" and (vtype != GV_U32 or v != self.alignment):
                raise ValueError("general.alignment must be u32 %d" % self.alignment)
        out = bytearray()
        out += GGUF_MAGIC
        out += struct.pack("<IQQ", GGUF_VERSION, len(self.tensors), len(self.kv))
        for key, vtype, value, elem_type in self.kv:
            out += _gguf_str(key)
            out += struct.pack("<I", vtype)
            out += _gguf_value(vtype, value, elem_type)
        offset = 0
        for name, shape, gtype, data in self.tensors:
            ne = list(reversed(shape))
            out += _gguf_str(name)
            out += struct.pack("<I", len(ne))
            out += struct.pack("<%dQ" % len(ne), *ne)
            out += struct.pack("<I", gtype)
            out += struct.pack("<Q", offset)
            offset += _align(len(data), self.alignment)
        out += b"\0" * (_align(len(out), self.alignment) - len(out))
        for _, _, _, data in self.tensors:
            out += data
            out += b"\0" * (_align(len(data), self.alignment) - len(data))
        return bytes(out)


class _Cursor:
    def __init__(self, buf):
        self.buf = buf
        self.pos = 0

    def take(self, fmt):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError("GGUF truncated at byte %d" % self.pos)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v[0] if len(v) == 1 else v

    def string(self):
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("GGUF string runs past the end")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype):
        if vtype == GV_STRING:
            return self.string()
        if vtype == GV_ARRAY:
            et = self.take("<I")
            n = self.take("<Q")
            return (et, [self.value(et) for _ in range(n)])
        if vtype not in _GV_FMT:
            raise ValueError("unknown metadata type %r" % vtype)
        return self.take(_GV_FMT[vtype])


def read_gguf(buf):
    """Parses a GGUF v3 file: {'version', 'kv': {key: (type, value)}, 'tensors': [ {name, ne,
    type, offset, data} ], 'by_name', 'alignment', 'data_start'}. Arrays are (elem_type, list)."""
    c = _Cursor(buf)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ValueError("not a GGUF file")
    c.pos = 4
    version = c.take("<I")
    if version != 3:
        raise ValueError("GGUF version %d" % version)
    n_tensors = c.take("<Q")
    n_kv = c.take("<Q")
    kv = {}
    for _ in range(n_kv):
        key = c.string()
        vtype = c.take("<I")
        if key in kv:
            raise ValueError("duplicate key %s" % key)
        kv[key] = (vtype, c.value(vtype))
    tensors = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.take("<I")
        ne = [c.take("<Q") for _ in range(n_dims)]
        gtype = c.take("<I")
        offset = c.take("<Q")
        tensors.append(dict(name=name, ne=ne, type=gtype, offset=offset))
    alignment = GGUF_ALIGNMENT
    if "general.alignment" in kv:
        if kv["general.alignment"][0] != GV_U32:
            raise ValueError("general.alignment is not u32")
        alignment = kv["general.alignment"][1]
    data_start = _align(c.pos, alignment)
    if any(b != 0 for b in bytes(buf[c.pos:data_start])):
        raise ValueError("non-zero padding before the data section")
    spans = []
    by_name = {}
    for t in tensors:
        if t["offset"] % alignment:
            raise ValueError("%s: offset %d not aligned" % (t["name"], t["offset"]))
        n = 1
        for e in t["ne"]:
            n *= e
        t["n"] = n
        nbytes = ggml_nbytes(t["type"], n)
        start = data_start + t["offset"]
        if start + nbytes > len(buf):
            raise ValueError("%s: data runs past the end of the file" % t["name"])
        t["data"] = bytes(buf[start:start + nbytes])
        spans.append((start, start + nbytes, t["name"]))
        if t["name"] in by_name:
            raise ValueError("duplicate tensor %s" % t["name"])
        by_name[t["name"]] = t
    spans.sort()
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError("tensors %s and %s overlap" % (n0, n1))
    return dict(version=version, kv=kv, tensors=tensors, by_name=by_name, alignment=alignment,
                data_start=data_start)


def gguf_tensor_values(t):
    return ggml_decode(t["type"], t["data"], t["n"])


# ---------------------------------------------------------------------------------------------
# llama.cpp conventions
# ---------------------------------------------------------------------------------------------

def llama_qk_permutation(n_heads, n_rows):
    """Row order of llama.cpp's converter permute for attn_q / attn_k on architecture llama:
    w.reshape(n_heads, 2, r/2, in).swapaxes(1, 2).reshape(w.shape), r = n_rows / n_heads.
    Returns perm with permuted_row[i] = original_row[perm[i]]."""
    if n_rows % n_heads:
        raise ValueError("%d rows do not split into %d heads" % (n_rows, n_heads))
    r = n_rows // n_heads
    if r % 2:
        raise ValueError("odd rows per head")
    half = r // 2
    perm = [0] * n_rows
    for h in range(n_heads):
        for b in range(half):
            for a in range(2):
                perm[h * r + 2 * b + a] = h * r + a * half + b
    return perm


def invert_permutation(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def permute_rows(flat, row_len, perm):
    out = []
    for p in perm:
        out.extend(flat[p * row_len:(p + 1) * row_len])
    return out


def llama3_rope_factors(theta, head_dim, factor, low_freq_factor, high_freq_factor, orig_ctx):
    """rope_freqs.weight as llama.cpp's converter computes it for llama3 rope scaling."""
    low_wavelen = orig_ctx / low_freq_factor
    high_wavelen = orig_ctx / high_freq_factor
    out = []
    for i in range(0, head_dim, 2):
        freq = f32_round(1.0 / f32_round(theta ** (i / head_dim)))
        wavelen = 2.0 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = (orig_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return out


# Hugging Face parameter name -> GGUF tensor name
_GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.down_proj.bias": "ffn_down.bias",
}


def gguf_name(hf_name):
    if hf_name in _GGUF_TOP:
        return _GGUF_TOP[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        rest = _GGUF_LAYER.get(parts[3])
        if rest is not None:
            return "blk.%d.%s" % (int(parts[2]), rest)
    raise ValueError("no GGUF name for parameter %s" % hf_name)


def gguf_type_for(gname, type_map):
    """type_map: exact tensor name or '.suffix' -> type name; anything else F32."""
    if gname in type_map:
        return GGML_TYPE_BY_NAME[type_map[gname]]
    for key, tname in type_map.items():
        if key.startswith(".") and gname.endswith(key):
            return GGML_TYPE_BY_NAME[tname]
    return GGML_F32


def is_permuted_qk(arch, gname):
    return arch == "llama" and gname.split(".", 2)[-1] in (
        "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")


# ---------------------------------------------------------------------------------------------
# .npy v1.0 writer
# ---------------------------------------------------------------------------------------------

def npy_bytes(shape, f32_data):
    """A .npy v1.0 file: magic, version 1.0, u16 header length, header dict padded with spaces
    and a final newline so that magic + version + length + header is a multiple of 64."""
    shape = tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    if len(f32_data) != 4 * n:
        raise ValueError("npy: %d bytes for shape %s" % (len(f32_data), shape))
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }" % (repr(shape),)
    prefix = 6 + 2 + 2
    total = _align(prefix + len(header) + 1, 64)
    header = header + " " * (total - prefix - len(header) - 1) + "\n"
    hb = header.encode("latin1")
    if len(hb) > 0xFFFF:
        raise ValueError("npy header too long")
    return b"\x93NUMPY" + bytes([1, 0]) + struct.pack("<H", len(hb)) + hb + bytes(f32_data)


def write_npy(path, shape, f32_data):
    with open(path, "wb") as f:
        f.write(npy_bytes(shape, f32_data))


def parse_npy(b):
    if b[:6] != b"\x93NUMPY" or b[6:8] != bytes([1, 0]):
        raise ValueError("not a .npy v1.0")
    hlen = struct.unpack_from("<H", b, 8)[0]
    header = b[10:10 + hlen].decode("latin1")
    if (10 + hlen) % 64 or not header.endswith("\n"):
        raise ValueError("npy header not padded to 64")
    d = ast.literal_eval(header.strip())
    return d, b[10 + hlen:]


# ---------------------------------------------------------------------------------------------
# Self-test (stdlib only)
# ---------------------------------------------------------------------------------------------

def _check(cond, what):
    if not cond:
        raise AssertionError("selftest: " + what)


def selftest():
    rng = random.Random(1234)
    n_checks = [0]

    def check(cond, what):
        _check(cond, what)
        n_checks[0] += 1

    # --- formats ---
    vals = [rng.gauss(0, 0.08) for _ in range(256)] + [0.0, -0.0, 1.0, -2.5, 65504.0, 1e-8]
    f32 = array.array("f", vals).tolist()
    check(f32_bytes_to_floats(floats_to_f32_bytes(vals)) == f32, "f32 round trip")
    f16 = decode_f16(encode_f16(f32))
    check(all(abs(a - b) <= abs(a) * 2 ** -11 + 2 ** -25 for a, b in zip(f32, f16)), "f16 error")
    check(decode_f16(encode_f16(f16)) == f16, "f16 idempotent")
    check(decode_f16(encode_f16([1.0 + 2 ** -11]))[0] == 1.0, "f16 ties to even")
    bf = decode_bf16(encode_bf16(f32))
    check(all(abs(a - b) <= abs(a) * 2 ** -8 for a, b in zip(f32, bf)), "bf16 error")
    check(decode_bf16(encode_bf16(bf)) == bf, "bf16 idempotent")
    check(decode_bf16(encode_bf16([1.0 + 2 ** -8]))[0] == 1.0, "bf16 ties to even (down)")
    check(decode_bf16(encode_bf16([1.0 + 3 * 2 ** -8]))[0] == 1.0 + 2 ** -6, "bf16 ties to even (up)")
    check(math.isnan(decode_bf16(encode_bf16([float("nan")]))[0]), "bf16 nan")

    # --- Q8_0 ---
    q_in = [rng.gauss(0, 0.08) for _ in range(32 * 6)]
    q_in[32:64] = [0.0] * 32  # an all-zero block
    q_in[64:96] = [rng.uniform(-1e-3, 1e-3) for _ in range(32)]
    q_in[96:128] = [(i - 16) * 0.5 for i in range(32)]  # exact multiples
    q_in = array.array("f", q_in).tolist()
    enc = encode_q8_0(q_in)
    check(len(enc) == 6 * 34, "Q8_0 size")
    deq = decode_q8_0(enc, len(q_in))
    for k in range(6):
        blk = q_in[k * 32:(k + 1) * 32]
        d = f32_round(max(abs(v) for v in blk) / 127.0)
        d16 = struct.unpack_from("<e", enc, k * 34)[0]
        check(d16 == struct.unpack("<e", struct.pack("<e", d))[0], "Q8_0 scale is f16(d)")
        qs = struct.unpack_from("<32b", enc, k * 34 + 2)
        check(all(-127 <= q <= 127 for q in qs), "Q8_0 range")
        if d == 0.0:
            check(all(q == 0 for q in qs) and all(x == 0.0 for x in deq[k * 32:(k + 1) * 32]),
                  "Q8_0 zero block")
            continue
        check(max(abs(q) for q in qs) == 127, "Q8_0 max maps to 127")
        # q is within 1/2 of x/d; dequantizing with f16(d) adds |d - f16(d)| * |q|
        for x, y, q in zip(blk, deq[k * 32:(k + 1) * 32], qs):
            bound = d / 2 + abs(d - d16) * abs(q) + 1e-9
            check(abs(x - y) <= bound, "Q8_0 error %g > %g" % (abs(x - y), bound))
            check(y == f32_round(y), "Q8_0 dequant exact in float32")
    check(encode_q8_0(deq) == enc, "Q8_0 requantizing the dequantized values is stable")
    check(_round_half_away(2.5) == 3 and _round_half_away(-2.5) == -3 and _round_half_away(2.49) == 2,
          "roundf")
    try:
        encode_q8_0([0.0] * 31)
        check(False, "Q8_0 accepts 31 values")
    except ValueError:
        n_checks[0] += 1

    # --- llama.cpp q/k permutation vs the reshape/swapaxes definition ---
    for n_heads, r, width in ((1, 4, 1), (4, 16, 3), (2, 8, 5)):
        n_rows = n_heads * r
        half = r // 2
        src = list(range(n_rows * width))
        ref = [None] * len(src)
        for h in range(n_heads):
            for a in range(2):
                for b in range(half):
                    for c in range(width):
                        # source index [h][a][b][c] of shape (H, 2, r/2, in) lands at [h][b][a][c]
                        ref[((h * half + b) * 2 + a) * width + c] = src[((h * 2 + a) * half + b) * width + c]
        perm = llama_qk_permutation(n_heads, n_rows)
        got = permute_rows(src, width, perm)
        check(got == ref, "permutation heads=%d rows/head=%d" % (n_heads, r))
        check(permute_rows(got, width, invert_permutation(perm)) == src, "inverse permutation")
    check(llama_qk_permutation(1, 4) == [0, 2, 1, 3], "permutation 1x4")

    # --- llama3 rope factors ---
    rf = llama3_rope_factors(500000.0, 16, 8.0, 1.0, 4.0, 32)
    check(len(rf) == 8 and rf[0] == 1.0 and rf[-1] == 8.0, "llama3 factors ends")
    check(all(1.0 <= x <= 8.0 for x in rf) and rf == sorted(rf), "llama3 factors monotone")
    rf2 = llama3_rope_factors(10000.0, 16, 8.0, 1.0, 4.0, 32)
    check(any(1.0 < x < 8.0 for x in rf2), "llama3 smooth band present for theta 1e4")

    # --- GGUF writer -> reader ---
    w = GGUFWriter()
    w.add_string("general.architecture", "llama")
    w.add_u32("general.alignment", 32)
    w.add_string("general.name", "selftest ü")
    w.add_u32("llama.context_length", 256)
    w.add_i32("test.i32", -7)
    w.add_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_u64("test.u64", 2 ** 40 + 3)
    w.add_bool("test.bool", True)
    w.add_array("test.arr_u32", GV_U32, [1, 2, 3])
    w.add_array("test.arr_str", GV_STRING, ["a", "", "héllo"])
    try:
        w.add_u32("test.i32", 1)
        check(False, "duplicate key accepted")
    except ValueError:
        n_checks[0] += 1
    tensors = {
        "t_f32_2d": ([3, 5], GGML_F32),
        "t_f32_1d": ([7], GGML_F32),
        "t_f16": ([2, 32], GGML_F16),
        "t_bf16": ([4, 3], GGML_BF16),
        "t_q8": ([3, 64], GGML_Q8_0),
    }
    src_vals = {}
    for name, (shape, gtype) in tensors.items():
        n = 1
        for s in shape:
            n *= s
        v = array.array("f", [rng.gauss(0, 0.08) for _ in range(n)]).tolist()
        src_vals[name] = v
        w.add_tensor(name, shape, v, gtype)
    try:
        w.add_tensor("bad_q8", [2, 16], [0.0] * 32, GGML_Q8_0)
        check(False, "Q8_0 with ne[0]=16 accepted")
    except ValueError:
        n_checks[0] += 1
    blob = w.to_bytes()
    check(blob[:4] == b"GGUF" and struct.unpack_from("<I", blob, 4)[0] == 3, "GGUF header")
    check(struct.unpack_from("<QQ", blob, 8) == (len(tensors), 10), "GGUF counts")
    path = "/tmp/kiln_selftest_%d.gguf" % os.getpid()
    with open(path, "wb") as f:
        f.write(blob)
    with open(path, "rb") as f:
        g = read_gguf(f.read())
    os.remove(path)
    kv = g["kv"]
    check(kv["general.architecture"] == (GV_STRING, "llama"), "kv string")
    check(kv["general.name"] == (GV_STRING, "selftest ü"), "kv utf-8 string")
    check(kv["general.alignment"] == (GV_U32, 32), "kv alignment")
    check(kv["llama.context_length"] == (GV_U32, 256), "kv u32")
    check(kv["test.i32"] == (GV_I32, -7), "kv i32")
    check(kv["llama.attention.layer_norm_rms_epsilon"] == (GV_F32, f32_round(1e-5)), "kv f32")
    check(kv["test.u64"] == (GV_U64, 2 ** 40 + 3), "kv u64")
    check(kv["test.bool"] == (GV_BOOL, True), "kv bool")
    check(kv["test.arr_u32"] == (GV_ARRAY, (GV_U32, [1, 2, 3])), "kv array u32")
    check(kv["test.arr_str"] == (GV_ARRAY, (GV_STRING, ["a", "", "héllo"])), "kv array str")
    check(list(kv.keys())[:3] == ["general.architecture", "general.alignment", "general.name"],
          "kv order")
    check(g["data_start"] % 32 == 0, "data start aligned")
    check([t["name"] for t in g["tensors"]] == list(tensors.keys()), "tensor order")
    for t in g["tensors"]:
        shape, gtype = tensors[t["name"]]
        check(t["ne"] == list(reversed(shape)), "%s ne order" % t["name"])
        check(t["type"] == gtype, "%s type" % t["name"])
        check(t["offset"] % 32 == 0, "%s offset aligned" % t["name"])
        got = gguf_tensor_values(t)
        v = src_vals[t["name"]]
        if gtype == GGML_F32:
            check(got == v, "%s F32 exact" % t["name"])
        elif gtype == GGML_F16:
            check(got == decode_f16(encode_f16(v)), "%s F16" % t["name"])
        elif gtype == GGML_BF16:
            check(got == decode_bf16(encode_bf16(v)), "%s BF16" % t["name"])
        elif gtype == GGML_Q8_0:
            check(got == decode_q8_0(encode_q8_0(v), len(v)), "%s Q8_0" % t["name"])
            for k in range(len(v) // 32):
                d = f32_round(max(abs(x) for x in v[k * 32:(k + 1) * 32]) / 127.0)
                d16 = struct.unpack("<e", struct.pack("<e", d))[0]
                for x, y in zip(v[k * 32:(k + 1) * 32], got[k * 32:(k + 1) * 32]):
                    check(abs(x - y) <= d / 2 + abs(d - d16) * 127 + 1e-9, "%s Q8_0 bound" % t["name"])
    # offsets: consecutive, each tensor padded to 32
    off = 0
    for t in g["tensors"]:
        check(t["offset"] == off, "%s offset %d != %d" % (t["name"], t["offset"], off))
        off += _align(ggml_nbytes(t["type"], t["n"]), 32)
    check(len(blob) == g["data_start"] + off, "file ends after the last padded tensor")
    # corruption is caught
    for bad, what in ((b"GGUX" + blob[4:], "magic"), (blob[:-40], "truncation")):
        try:
            read_gguf(bad)
            check(False, "reader accepted bad %s" % what)
        except ValueError:
            n_checks[0] += 1

    # --- a miniature model through the fixture path (names, permutation, rope_freqs) ---
    w = GGUFWriter()
    w.add_string("general.architecture", "llama")
    w.add_u32("general.alignment", 32)
    n_heads, n_kv, hd, hidden = 4, 2, 16, 64
    q_rows = [rng.gauss(0, 0.08) for _ in range(n_heads * hd * hidden)]
    perm_q = llama_qk_permutation(n_heads, n_heads * hd)
    stored_q = permute_rows(q_rows, hidden, perm_q)
    gq = gguf_name("model.layers.1.self_attn.q_proj.weight")
    check(gq == "blk.1.attn_q.weight" and is_permuted_qk("llama", gq) and not is_permuted_qk("qwen3", gq),
          "q naming")
    check(gguf_name("model.layers.0.self_attn.k_norm.weight") == "blk.0.attn_k_norm.weight", "k_norm name")
    check(gguf_name("lm_head.weight") == "output.weight", "output name")
    types = FIXTURE_BY_NAME["llama3_gguf"]["gguf_types"]
    check(gguf_type_for("token_embd.weight", types) == GGML_F16, "type map embd")
    check(gguf_type_for("blk.0.attn_q.weight", types) == GGML_Q8_0, "type map q")
    check(gguf_type_for("blk.1.attn_k.weight", types) == GGML_BF16, "type map k")
    check(gguf_type_for("blk.1.ffn_up.weight", types) == GGML_Q8_0, "type map up")
    check(gguf_type_for("blk.1.ffn_down.weight", types) == GGML_F32, "type map down")
    check(gguf_type_for("blk.1.attn_norm.weight", types) == GGML_F32, "type map norm")
    w.add_tensor("rope_freqs.weight", [hd // 2], rf, GGML_F32)
    w.add_tensor(gq, [n_heads * hd, hidden], stored_q, GGML_Q8_0)
    g = read_gguf(w.to_bytes())
    back = gguf_tensor_values(g["by_name"][gq])
    back = permute_rows(back, hidden, invert_permutation(perm_q))
    check(len(back) == len(q_rows), "q size")
    check(max(abs(a - b) for a, b in zip(back, q_rows)) < 0.02, "q round trip through Q8_0 + permutation")
    check(gguf_tensor_values(g["by_name"]["rope_freqs.weight"]) == array.array("f", rf).tolist(),
          "rope_freqs")

    # --- .npy ---
    for shape in ((40, 320), (5,), (3, 7), (1, 1)):
        n = 1
        for s in shape:
            n *= s
        data = floats_to_f32_bytes([rng.random() for _ in range(n)])
        b = npy_bytes(shape, data)
        check(b[:6] == b"\x93NUMPY" and b[6] == 1 and b[7] == 0, "npy magic/version")
        hlen = struct.unpack_from("<H", b, 8)[0]
        check((10 + hlen) % 64 == 0, "npy header multiple of 64")
        check(b[10 + hlen - 1:10 + hlen] == b"\n", "npy header ends with newline")
        d, payload = parse_npy(b)
        check(d == {"descr": "<f4", "fortran_order": False, "shape": shape}, "npy header dict")
        check(payload == data, "npy payload")
    check(npy_bytes((40, 320), b"\0" * 4 * 40 * 320)[10:].startswith(
        b"{'descr': '<f4', 'fortran_order': False, 'shape': (40, 320), }  "), "npy header text")

    # --- fixture table sanity ---
    for fx in FIXTURES:
        r = resolve_fixture(fx)
        check(r["save"] in ("safetensors", "sharded", "bf16", "gguf"), "%s save" % fx["name"])
        check(all(k in r for k in ("arch", "seed", "kv_heads", "tie", "max_pos", "rope", "prompt_len")),
              "%s fields" % fx["name"])
    check(resolve_fixture(FIXTURE_BY_NAME["llama3_gguf"])["seed"] == FIXTURE_BY_NAME["llama3_scaled"]["seed"],
          "gguf fixture reuses its base seed")
    print("selftest: %d checks passed" % n_checks[0])
    print("%d passed, 0 failed" % n_checks[0])


# ---------------------------------------------------------------------------------------------
# Hugging Face side (torch + transformers)
# ---------------------------------------------------------------------------------------------

def _import_ml():
    global torch, transformers, TF_MAJOR
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch as _torch
    import transformers as _transformers
    torch = _torch
    transformers = _transformers
    TF_MAJOR = int(transformers.__version__.split(".")[0])
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    try:
        transformers.logging.set_verbosity_error()
    except Exception:
        pass


def _warn(notes_extra, msg):
    print("  WARNING: " + msg)
    notes_extra.append("WARNING: " + msg)


def make_config(fx, overrides=None):
    cfg_name = fx["arch"].replace("ForCausalLM", "Config")
    Cfg = getattr(transformers, cfg_name)
    kw = dict(COMMON)
    kw.update(num_key_value_heads=fx["kv_heads"], tie_word_embeddings=fx["tie"],
              max_position_embeddings=fx["max_pos"])
    kw.update(fx.get("extra", {}))
    if overrides:
        kw.update(overrides)
    rope_type, theta, params = fx["rope"]
    if TF_MAJOR >= 5:
        rp = {"rope_type": rope_type, "rope_theta": float(theta)}
        rp.update(params)
        kw["rope_parameters"] = rp
    else:
        kw["rope_theta"] = float(theta)
        kw["rope_scaling"] = dict(rope_type=rope_type, **params) if rope_type != "default" else None
    cfg = Cfg(**kw)
    # what the constructor kept
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "tie_word_embeddings",
                "max_position_embeddings", "head_dim", "attention_bias", "mlp_bias", "sliding_window"):
        if key in kw and getattr(cfg, key, kw[key]) != kw[key]:
            raise RuntimeError("%s: config.%s = %r, asked for %r" % (fx["name"], key, getattr(cfg, key), kw[key]))
    return cfg


def head_dim_of(cfg):
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def _instantiate(cls, cfg):
    model = None
    try:
        model = cls._from_config(cfg, attn_implementation="eager")
    except Exception as e:  # noqa: BLE001
        print("  note: %s._from_config failed (%s: %s); constructing directly" % (cls.__name__, type(e).__name__, e))
    if model is not None and any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        print("  note: _from_config left meta tensors; constructing directly")
        model = None
    if model is None:
        try:
            cfg._attn_implementation = "eager"
        except Exception:  # noqa: BLE001
            pass
        model = cls(cfg)
    return model


def _ensure_eager(model):
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager" and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation("eager")
        except Exception as e:  # noqa: BLE001
            print("  note: set_attn_implementation failed: %s" % e)
        impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager":
        try:
            model.config._attn_implementation = "eager"
        except Exception:  # noqa: BLE001
            pass
        impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager":
        raise RuntimeError("could not select eager attention (got %r)" % impl)


def _ensure_tie(model, tie):
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    if tie and emb is not out:
        print("  note: lm_head not tied after construction; tying it")
        model.get_output_embeddings().weight = emb
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise RuntimeError("could not tie lm_head to embed_tokens")
    if not tie and emb is out:
        raise RuntimeError("lm_head is tied but the fixture asks for untied")


def init_weights(model, seed):
    """normal(0, 0.08) everywhere, uniform(0.5, 1.5) for norm weights; tied parameters once."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=g)
            else:
                p.normal_(0.0, WEIGHT_STD, generator=g)


def build_model(fx, overrides=None):
    """The fixture's model, deterministically: same fx (seed) -> same weights."""
    cfg = make_config(fx, overrides)
    cls = getattr(transformers, fx["arch"])
    torch.manual_seed(fx["seed"])
    model = _instantiate(cls, cfg)
    model = model.to(torch.float32)
    model.eval()
    _ensure_eager(model)
    _ensure_tie(model, fx["tie"])
    init_weights(model, fx["seed"])
    for name, p in model.named_parameters():
        if p.dtype != torch.float32 or p.is_meta:
            raise RuntimeError("%s: %s is %s on %s" % (fx["name"], name, p.dtype, p.device))
    try:
        model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2)
    except Exception as e:  # noqa: BLE001
        print("  note: could not set generation_config (%s); writing it by hand after saving" % e)
    return model


def prompts(fx):
    g = torch.Generator().manual_seed(fx["seed"] + 50000)
    prompt = torch.randint(3, VOCAB, (fx["prompt_len"],), generator=g).tolist()
    greedy_prompt = torch.randint(3, VOCAB, (GREEDY_PROMPT_LEN,), generator=g).tolist()
    return prompt, greedy_prompt


def forward_logits(model, ids):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].detach().to(torch.float32).contiguous()


def run_greedy(model, prompt_ids):
    seq = list(prompt_ids)
    tokens, margins = [], []
    for _ in range(GREEDY_STEPS):
        last = forward_logits(model, seq)[-1]
        top2 = torch.topk(last, 2).values
        tok = int(torch.argmax(last))
        tokens.append(tok)
        margins.append(float(top2[0] - top2[1]))
        seq.append(tok)
    return {"prompt_ids": list(prompt_ids), "token_ids": tokens, "margins": margins}


def tensor_f32_bytes(t):
    t = t.detach().to("cpu", torch.float32).contiguous()
    try:
        return t.numpy().astype("<f4", copy=False).tobytes()
    except Exception:  # noqa: BLE001  (numpy missing or broken: go through a list)
        return floats_to_f32_bytes(t.reshape(-1).tolist())


def save_logits(path, logits):
    write_npy(path, tuple(logits.shape), tensor_f32_bytes(logits))


def safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n).decode("utf-8"))


def _dtype_kw(dtype):
    return {("dtype" if TF_MAJOR >= 5 else "torch_dtype"): dtype}


def save_hf(model, d, fx):
    kw = {}
    if TF_MAJOR < 5:
        kw["safe_serialization"] = True
    if fx.get("max_shard_size"):
        kw["max_shard_size"] = fx["max_shard_size"]
    model.save_pretrained(d, **kw)
    gpath = os.path.join(d, "generation_config.json")
    gc = {}
    if os.path.exists(gpath):
        with open(gpath, encoding="utf-8") as f:
            gc = json.load(f)
    if gc.get("bos_token_id") != 1 or gc.get("eos_token_id") != 2:
        print("  note: generation_config.json missing or without bos/eos; writing it")
        gc.update(bos_token_id=1, eos_token_id=2)
        gc.setdefault("transformers_version", transformers.__version__)
        with open(gpath, "w", encoding="utf-8") as f:
            json.dump(gc, f, indent=2, sort_keys=True)
            f.write("\n")
    if not os.path.exists(os.path.join(d, "config.json")):
        raise RuntimeError("%s: save_pretrained wrote no config.json" % fx["name"])
    index = os.path.join(d, "model.safetensors.index.json")
    single = os.path.join(d, "model.safetensors")
    if fx["save"] == "sharded":
        if not os.path.exists(index):
            raise RuntimeError("%s: no model.safetensors.index.json" % fx["name"])
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        if len(shards) < 2:
            raise RuntimeError("%s: only %d shard(s)" % (fx["name"], len(shards)))
        files = [os.path.join(d, s) for s in shards]
    else:
        if not os.path.exists(single) or os.path.exists(index):
            raise RuntimeError("%s: expected a single model.safetensors" % fx["name"])
        files = [single]
    names, dtypes = set(), set()
    for p in files:
        for k, v in safetensors_header(p).items():
            if k != "__metadata__":
                names.add(k)
                dtypes.add(v["dtype"])
    if fx["tie"] and "lm_head.weight" in names:
        raise RuntimeError("%s: tied model saved lm_head.weight" % fx["name"])
    if not fx["tie"] and "lm_head.weight" not in names:
        raise RuntimeError("%s: untied model saved no lm_head.weight" % fx["name"])
    want = {"BF16"} if fx["save"] == "bf16" else {"F32"}
    if dtypes != want:
        raise RuntimeError("%s: safetensors dtypes %s, expected %s" % (fx["name"], sorted(dtypes), sorted(want)))
    return len(files)


def reload_check(fx, d, prompt, ref_logits, dtype, label, notes_extra, tol):
    """Loads the saved checkpoint back with from_pretrained and compares logits."""
    try:
        cls = getattr(transformers, fx["arch"])
        kw = _dtype_kw(dtype)
        kw["attn_implementation"] = "eager"
        m = cls.from_pretrained(d, **kw)
        m.eval()
        got = forward_logits(m, prompt)
        diff = float((got - ref_logits).abs().max())
        print("  reload (%s): max |diff| = %.3g" % (label, diff))
        if diff > tol:
            _warn(notes_extra, "from_pretrained(%s) logits differ from the reference by %.3g" % (label, diff))
        return diff
    except Exception as e:  # noqa: BLE001
        _warn(notes_extra, "reload with from_pretrained(%s) failed: %s: %s" % (label, type(e).__name__, e))
        return None


def _rotary(model):
    inner = getattr(model, "model", None)
    return getattr(inner, "rotary_emb", None) if inner is not None else None


def _default_inv_freq(theta, dim):
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def _yarn_inv_freq(theta, dim, factor, orig, truncate, beta_fast=32.0, beta_slow=1.0):
    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))
    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extra = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra


def rope_check(fx, model, cfg, notes_extra, after_len=None):
    """Compares the model's rotary inv_freq with the intended scaling (a guard against a config
    keyword transformers silently ignored)."""
    rot = _rotary(model)
    inv = getattr(rot, "inv_freq", None) if rot is not None else None
    if inv is None:
        print("  rope check skipped: no model.model.rotary_emb.inv_freq")
        return
    rope_type, theta, params = fx["rope"]
    got_type = getattr(rot, "rope_type", None)
    if isinstance(got_type, str) and got_type != rope_type:
        _warn(notes_extra, "rotary_emb.rope_type is %r, expected %r" % (got_type, rope_type))
    dim = head_dim_of(cfg)
    inv = inv.detach().to(torch.float32)
    base = _default_inv_freq(theta, dim)
    msg = None
    if rope_type == "default":
        want = {"default": base}
    elif rope_type == "linear":
        want = {"linear": base / params["factor"]}
    elif rope_type == "llama3":
        rf = torch.tensor(llama3_rope_factors(theta, dim, params["factor"], params["low_freq_factor"],
                                              params["high_freq_factor"],
                                              params["original_max_position_embeddings"]),
                          dtype=torch.float32)
        want = {"llama3": base / rf}
    elif rope_type == "yarn":
        want = {t: _yarn_inv_freq(theta, dim, params["factor"], params["original_max_position_embeddings"],
                                  truncate=(t == "yarn truncate=True"))
                for t in ("yarn truncate=True", "yarn truncate=False")}
        att = getattr(rot, "attention_scaling", None)
        want_att = 0.1 * math.log(params["factor"]) + 1.0
        if att is not None and abs(float(att) - want_att) > 1e-6:
            _warn(notes_extra, "yarn attention_scaling %r, expected %r" % (float(att), want_att))
    elif rope_type == "dynamic":
        L = after_len or fx["max_pos"]
        f = params["factor"]
        theta2 = theta * ((f * L / fx["max_pos"]) - (f - 1)) ** (dim / (dim - 2))
        want = {"dynamic at length %d" % L: _default_inv_freq(theta2, dim)}
    else:
        return
    matched = [k for k, v in want.items()
               if v.shape == inv.shape and float(((v - inv).abs() / v.abs()).max()) < 1e-5]
    if matched:
        msg = "rope check: model inv_freq matches %s" % matched[0]
        print("  " + msg)
        if rope_type == "yarn":
            notes_extra.append(msg + ".")
    else:
        _warn(notes_extra, "rotary inv_freq %s matches none of %s" % (
            [round(float(x), 8) for x in inv], list(want.keys())))


def fixture_dir(out, name):
    d = os.path.join(out, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    return d


def dir_size(d):
    total = 0
    for root, _, files in os.walk(d):
        for fn in files:
            total += os.path.getsize(os.path.join(root, fn))
    return total


def write_reference(d, fx, cfg, checkpoint_dtype, prompt, greedy, notes, weights, has_bf16):
    ref = {
        "name": fx["name"],
        "architecture": fx["arch"],
        "model_type": getattr(cfg, "model_type", None),
        "transformers_version": str(transformers.__version__),
        "torch_version": str(torch.__version__),
        "checkpoint_dtype": checkpoint_dtype,
        "prompt_ids": list(prompt),
        "logits_file": "logits.npy",
        "logits_bf16_file": "logits_bf16.npy" if has_bf16 else None,
        "greedy": greedy,
        "notes": notes,
        "weights": weights,
    }
    with open(os.path.join(d, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, indent=2)
        f.write("\n")


def _note_text(fx, extra):
    return " ".join([fx["notes"]] + extra)


def make_hf_fixture(fx, out):
    d = fixture_dir(out, fx["name"])
    notes_extra = []
    model = build_model(fx)
    cfg = model.config
    prompt, gprompt = prompts(fx)
    rope_check(fx, model, cfg, notes_extra)
    want_greedy = fx.get("greedy", True)
    has_bf16 = fx["save"] == "bf16"

    if has_bf16:
        # make every weight exactly bf16-representable; the fp32 model then computes in fp32 on
        # the very values the bf16 checkpoint holds
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    logits = forward_logits(model, prompt)
    if fx["rope"][0] == "dynamic":
        rope_check(fx, model, cfg, notes_extra, after_len=len(prompt))
    greedy = run_greedy(model, gprompt) if want_greedy else None

    if fx["name"] == "mistral_swa":
        full = build_model(fx, overrides={"sliding_window": None})
        full_logits = forward_logits(full, prompt)
        same = 0
        while same < len(prompt) and float((full_logits[same] - logits[same]).abs().max()) <= 1e-6:
            same += 1
        later = float((full_logits[same:] - logits[same:]).abs().max()) if same < len(prompt) else 0.0
        msg = ("Check: logits rows 0..%d equal a full-attention model's and later rows differ "
               "(max |diff| %.3g), i.e. each query attends to itself and the %d keys before it." %
               (same - 1, later, fx["extra"]["sliding_window"] - 1))
        print("  " + msg)
        if same != fx["extra"]["sliding_window"] or later < 1e-4:
            _warn(notes_extra, "sliding window: %d leading rows equal full attention (expected %d), "
                               "later max |diff| %.3g" % (same, fx["extra"]["sliding_window"], later))
        else:
            notes_extra.append(msg)
        del full

    if has_bf16:
        mb = build_model(fx)
        with torch.no_grad():
            for p in mb.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
        fp32_buffers = {n: b.detach().clone() for n, b in mb.named_buffers()}
        mb = mb.to(torch.bfloat16)
        # keep float buffers (rope inv_freq) in float32, as from_pretrained(dtype=bf16) has them
        for mod_name, mod in mb.named_modules():
            for bname, buf in list(mod._buffers.items()):
                full_name = (mod_name + "." + bname) if mod_name else bname
                if buf is not None and buf.is_floating_point() and full_name in fp32_buffers:
                    mod._buffers[bname] = fp32_buffers[full_name]
        logits_bf16 = forward_logits(mb, prompt)
        n_files = save_hf(mb, d, fx)
        save_logits(os.path.join(d, "logits_bf16.npy"), logits_bf16)
        diff = float((logits_bf16 - logits).abs().max())
        print("  bf16 compute vs fp32 compute: max |diff| = %.3g" % diff)
        notes_extra.append("max |logits_bf16 - logits| = %.3g." % diff)
        reload_check(fx, d, prompt, logits, torch.float32, "dtype=float32", notes_extra, 1e-5)
        rd = reload_check(fx, d, prompt, logits_bf16, torch.bfloat16, "dtype=bfloat16", notes_extra, 0.25)
        if rd is not None:
            notes_extra.append("from_pretrained(dtype=bfloat16) logits differ from logits_bf16 by at most %.3g." % rd)
        ckpt_dtype = "bfloat16"
    else:
        n_files = save_hf(model, d, fx)
        reload_check(fx, d, prompt, logits, torch.float32, "dtype=float32", notes_extra, 1e-5)
        ckpt_dtype = "float32"

    save_logits(os.path.join(d, "logits.npy"), logits)
    weights = "index" if fx["save"] == "sharded" else "model.safetensors"
    if fx["save"] == "sharded":
        notes_extra.append("%d shards." % n_files)
    write_reference(d, fx, cfg, ckpt_dtype, prompt, greedy, _note_text(fx, notes_extra), weights, has_bf16)
    return d


def gguf_metadata(w, fx, cfg):
    arch = fx["gguf_arch"]
    hd = head_dim_of(cfg)
    w.add_string("general.architecture", arch)
    w.add_u32("general.alignment", GGUF_ALIGNMENT)
    w.add_string("general.name", fx["name"])
    w.add_u32(arch + ".context_length", cfg.max_position_embeddings)
    w.add_u32(arch + ".embedding_length", cfg.hidden_size)
    w.add_u32(arch + ".block_count", cfg.num_hidden_layers)
    w.add_u32(arch + ".feed_forward_length", cfg.intermediate_size)
    w.add_u32(arch + ".attention.head_count", cfg.num_attention_heads)
    w.add_u32(arch + ".attention.head_count_kv", cfg.num_key_value_heads)
    w.add_f32(arch + ".attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_f32(arch + ".rope.freq_base", fx["rope"][1])
    w.add_u32(arch + ".attention.key_length", hd)
    w.add_u32(arch + ".attention.value_length", hd)
    w.add_u32(arch + ".rope.dimension_count", hd)
    w.add_u32(arch + ".vocab_size", cfg.vocab_size)
    w.add_u32("tokenizer.ggml.bos_token_id", 1)
    w.add_u32("tokenizer.ggml.eos_token_id", 2)


def make_gguf_fixture(fx, out):
    d = fixture_dir(out, fx["name"])
    notes_extra = []
    arch = fx["gguf_arch"]
    model = build_model(fx)
    cfg = model.config
    prompt, gprompt = prompts(fx)
    rope_check(fx, model, cfg, notes_extra)
    src_logits = forward_logits(model, prompt)
    hd = head_dim_of(cfg)
    q_perm = llama_qk_permutation(cfg.num_attention_heads, cfg.num_attention_heads * hd)
    k_perm = llama_qk_permutation(cfg.num_key_value_heads, cfg.num_key_value_heads * hd)

    w = GGUFWriter()
    gguf_metadata(w, fx, cfg)
    rope_type, theta, rp = fx["rope"]
    rope_factors = None
    if rope_type == "llama3":
        rope_factors = llama3_rope_factors(theta, hd, rp["factor"], rp["low_freq_factor"],
                                           rp["high_freq_factor"], rp["original_max_position_embeddings"])
        w.add_tensor("rope_freqs.weight", [hd // 2], rope_factors, GGML_F32)
        notes_extra.append("rope_freqs = %s." % [round(x, 6) for x in rope_factors])
    elif rope_type != "default":
        raise RuntimeError("%s: GGUF writer handles default and llama3 rope only" % fx["name"])

    sd = model.state_dict()
    mapping = []  # (hf name, gguf name, permutation or None)
    for hf_name, t in sd.items():
        if fx["tie"] and hf_name == "lm_head.weight":
            continue
        gname = gguf_name(hf_name)
        perm = None
        if is_permuted_qk(arch, gname):
            perm = q_perm if ".attn_q." in gname else k_perm
        vals = t.detach().to(torch.float32).contiguous()
        if perm is not None:
            vals = vals[torch.tensor(perm, dtype=torch.long)]
        gtype = gguf_type_for(gname, fx["gguf_types"])
        w.add_tensor(gname, list(vals.shape), vals.reshape(-1).tolist(), gtype)
        mapping.append((hf_name, gname, perm))
    blob = w.to_bytes()
    path = os.path.join(d, "model.gguf")
    with open(path, "wb") as f:
        f.write(blob)

    # the reference: the HF model holding exactly what the file stores
    with open(path, "rb") as f:
        g = read_gguf(f.read())
    if len(g["tensors"]) != len(mapping) + (1 if rope_factors is not None else 0):
        raise RuntimeError("%s: GGUF has %d tensors" % (fx["name"], len(g["tensors"])))
    if rope_factors is not None:
        got = gguf_tensor_values(g["by_name"]["rope_freqs.weight"])
        if got != array.array("f", rope_factors).tolist():
            raise RuntimeError("rope_freqs round trip")
    params = dict(model.named_parameters())
    stats = {}
    with torch.no_grad():
        for hf_name, gname, perm in mapping:
            p = params.get(hf_name)
            if p is None:
                raise RuntimeError("%s: no parameter %s" % (fx["name"], hf_name))
            t = g["by_name"][gname]
            if t["ne"] != list(reversed(list(p.shape))):
                raise RuntimeError("%s: ne %s for shape %s" % (gname, t["ne"], list(p.shape)))
            vals = torch.tensor(gguf_tensor_values(t), dtype=torch.float32).reshape(p.shape)
            if perm is not None:
                vals = vals[torch.tensor(invert_permutation(perm), dtype=torch.long)]
            diff = float((vals - p.detach()).abs().max())
            tname = GGML_TYPE_NAMES[t["type"]]
            if tname == "F32" and diff != 0.0:
                raise RuntimeError("%s: F32 round trip differs by %g" % (gname, diff))
            stats[tname] = max(stats.get(tname, 0.0), diff)
            p.copy_(vals)
    _ensure_tie(model, fx["tie"])
    print("  stored-vs-original max |diff| by type: %s" % {k: float("%.3g" % v) for k, v in stats.items()})
    logits = forward_logits(model, prompt)
    ldiff = float((logits - src_logits).abs().max())
    print("  logits vs the unquantized model (%s): max |diff| = %.3g" % (fx["base"], ldiff))
    if all(k == "F32" for k in stats) and ldiff != 0.0:
        _warn(notes_extra, "all-F32 GGUF but logits differ from %s by %.3g" % (fx["base"], ldiff))
    notes_extra.append("Weights stored-vs-original max |diff| by type: %s; logits differ from %s's by "
                       "at most %.3g." % (", ".join("%s %.3g" % kv for kv in sorted(stats.items())),
                                          fx["base"], ldiff))
    greedy = run_greedy(model, gprompt) if fx.get("greedy", True) else None
    save_logits(os.path.join(d, "logits.npy"), logits)
    ckpt_dtype = "float32" if all(k == "F32" for k in stats) else "mixed"
    write_reference(d, fx, cfg, ckpt_dtype, prompt, greedy, _note_text(fx, notes_extra), "model.gguf", False)
    return d


def generate(out, only):
    _import_ml()
    print("torch %s, transformers %s" % (torch.__version__, transformers.__version__))
    names = [only] if only else [f["name"] for f in FIXTURES]
    os.makedirs(out, exist_ok=True)
    made = []
    for name in names:
        fx = resolve_fixture(FIXTURE_BY_NAME[name])
        print("[%s]" % name)
        if fx["save"] == "gguf":
            d = make_gguf_fixture(fx, out)
        else:
            d = make_hf_fixture(fx, out)
        size = dir_size(d)
        print("  %s: %d bytes" % (d, size))
        made.append((name, d, size))
    print("sizes:")
    for name, d, size in made:
        print("  %-16s %9d bytes" % (name, size))
    for name, d, size in made:
        assert size < MAX_FIXTURE_BYTES, "%s is %d bytes (limit %d)" % (name, size, MAX_FIXTURE_BYTES)
    print("wrote %d fixture(s) under %s" % (len(made), out))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="output folder, e.g. tests/fixtures/models")
    ap.add_argument("--only", choices=[f["name"] for f in FIXTURES], help="make one fixture")
    ap.add_argument("--selftest", action="store_true", help="check the GGUF/.npy writers (stdlib only)")
    args = ap.parse_args(argv)
    if args.selftest:
        selftest()
        return 0
    if not args.out:
        ap.error("--out is required (or --selftest)")
    generate(args.out, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
