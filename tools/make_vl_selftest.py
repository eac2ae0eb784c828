#!/usr/bin/env python3
"""Two tiny random Qwen2-VL / Qwen2.5-VL checkpoints with an independent float64 reference,
in the Python standard library alone (no torch, no numpy):

    python3 tools/make_vl_selftest.py --out tests/fixtures/models

writes vl_tiny_qwen2_vl/ (the published layout: flat text keys, rope_scaling {type: mrope},
weights visual.* / model.*) and vl_tiny_qwen2_5_vl/ (transformers 5's layout: text_config,
rope_parameters, weights model.visual.* / model.language_model.*), each with config.json,
model.safetensors (float32) and reference.json + .npy files in the format of
tools/make_vl_fixtures.py (which has transformers compute the same things; these two exist so
that the C side can be checked on any machine, and the two reference implementations check
each other's reading of transformers' code).

The reference follows transformers' modeling_qwen2_vl.py / modeling_qwen2_5_vl.py step by step
(get_rope_index, rot_pos_emb, get_window_index with its -100 padding, cu_seqlens, the patch
merger, apply_multimodal_rotary_pos_emb's section split) in float64. Vocabulary 64 with the
vision token ids moved into it (58..61), so nothing here depends on a tokenizer.
"""
import argparse
import array
import json
import math
import os
import random
import struct
import sys

VOCAB = 64
VS, VE, VPAD, IMG, VID = 58, 59, 57, 60, 61
EPS_TEXT = 1e-6

FIXTURES = [
    dict(name="vl_tiny_qwen2_vl", v25=False, seed=31, layout="published",
         text=dict(hidden=16, inter=24, layers=2, heads=2, kv=1, theta=50.0, sec=[1, 1, 2]),
         vis=dict(depth=2, embed=16, heads=2, mlp=32, out=16)),
    dict(name="vl_tiny_qwen2_5_vl", v25=True, seed=32, layout="tf5",
         text=dict(hidden=16, inter=24, layers=2, heads=1, kv=1, theta=200.0, sec=[2, 3, 3]),
         vis=dict(depth=3, embed=16, heads=2, mlp=20, out=16, window=56, fullatt=[1])),
]
PATCH, TP, MERGE, C = 14, 2, 2, 3
K = C * TP * PATCH * PATCH
GREEDY = 4


# ---- tiny linear algebra on lists ---------------------------------------------------------------

def matvec(W, x):  # W: rows of len(x)
    return [sum(a * b for a, b in zip(row, x)) for row in W]


def linear(X, W, b=None):
    out = []
    for x in X:
        y = matvec(W, x)
        if b is not None:
            y = [u + v for u, v in zip(y, b)]
        out.append(y)
    return out


def rmsnorm(x, w, eps):
    r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
    return [v * r * g for v, g in zip(x, w)]


def layernorm(x, w, b, eps):
    m = sum(x) / len(x)
    var = sum((v - m) ** 2 for v in x) / len(x)
    r = 1.0 / math.sqrt(var + eps)
    return [(v - m) * r * g + c for v, g, c in zip(x, w, b)]


def silu(v):
    return v / (1.0 + math.exp(-v))


def quick_gelu(v):
    return v / (1.0 + math.exp(-1.702 * v))


def gelu(v):
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


def softmax(s):
    m = max(s)
    e = [math.exp(v - m) for v in s]
    z = sum(e)
    return [v / z for v in e]


def rotate_half(x):
    h = len(x) // 2
    return [-v for v in x[h:]] + x[:h]


def rope_apply(x, cos, sin):
    r = rotate_half(x)
    return [a * c + b * s for a, b, c, s in zip(x, r, cos, sin)]


# ---- weights --------------------------------------------------------------------------------------

class Weights:
    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.t = {}  # name -> (shape, flat list)

    def mat(self, name, rows, cols, std=0.15):
        vals = [self.rng.gauss(0.0, std) for _ in range(rows * cols)]
        self.t[name] = ([rows, cols], vals)
        return [vals[i * cols:(i + 1) * cols] for i in range(rows)]

    def vec(self, name, n, lo=None, hi=None, std=0.1):
        if lo is not None:
            vals = [self.rng.uniform(lo, hi) for _ in range(n)]
        else:
            vals = [self.rng.gauss(0.0, std) for _ in range(n)]
        self.t[name] = ([n], vals)
        return vals

    def reshape(self, name, shape):
        self.t[name] = (shape, self.t[name][1])

    def write(self, path):
        header, blobs, off = {}, [], 0
        for name in sorted(self.t):
            shape, vals = self.t[name]
            b = array.array("f", vals)
            if sys.byteorder != "little":
                b.byteswap()
            b = b.tobytes()
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(b)]}
            blobs.append(b)
            off += len(b)
        h = json.dumps(header).encode()
        h += b" " * ((8 - len(h) % 8) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for b in blobs:
                f.write(b)


def write_npy(path, rows):
    n, m = len(rows), len(rows[0]) if rows else 0
    hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, %d), }" % (n, m)
    hdr += " " * ((64 - (10 + len(hdr) + 1) % 64) % 64) + "\n"
    data = array.array("f", [v for r in rows for v in r])
    if sys.byteorder != "little":
        data.byteswap()
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr.encode("latin1"))
        f.write(data.tobytes())


def f32(v):
    return struct.unpack("<f", struct.pack("<f", v))[0]


# ---- the model ------------------------------------------------------------------------------------

class Model:
    def __init__(self, fx):
        self.fx = fx
        self.v25 = fx["v25"]
        W = Weights(fx["seed"])
        t, v = fx["text"], fx["vis"]
        vp = "model.visual" if fx["layout"] == "tf5" else "visual"
        tp = "model.language_model" if fx["layout"] == "tf5" else "model"
        H, E = t["hidden"], v["embed"]
        self.H, self.E = H, E
        self.hd = H // t["heads"]
        self.emb = W.mat(tp + ".embed_tokens.weight", VOCAB, H, 0.5)
        self.layers = []
        for l in range(t["layers"]):
            p = "%s.layers.%d." % (tp, l)
            L = dict(
                ln1=W.vec(p + "input_layernorm.weight", H, 0.5, 1.5),
                ln2=W.vec(p + "post_attention_layernorm.weight", H, 0.5, 1.5),
                q=W.mat(p + "self_attn.q_proj.weight", t["heads"] * self.hd, H),
                qb=W.vec(p + "self_attn.q_proj.bias", t["heads"] * self.hd),
                k=W.mat(p + "self_attn.k_proj.weight", t["kv"] * self.hd, H),
                kb=W.vec(p + "self_attn.k_proj.bias", t["kv"] * self.hd),
                v=W.mat(p + "self_attn.v_proj.weight", t["kv"] * self.hd, H),
                vb=W.vec(p + "self_attn.v_proj.bias", t["kv"] * self.hd),
                o=W.mat(p + "self_attn.o_proj.weight", H, t["heads"] * self.hd),
                g=W.mat(p + "mlp.gate_proj.weight", t["inter"], H),
                u=W.mat(p + "mlp.up_proj.weight", t["inter"], H),
                d=W.mat(p + "mlp.down_proj.weight", H, t["inter"]))
            self.layers.append(L)
        self.norm = W.vec(tp + ".norm.weight", H, 0.5, 1.5)
        # vision
        self.patch = W.mat(vp + ".patch_embed.proj.weight", E, K, 0.05)
        W.reshape(vp + ".patch_embed.proj.weight", [E, C, TP, PATCH, PATCH])
        self.blocks = []
        I = v["mlp"]
        for b in range(v["depth"]):
            p = "%s.blocks.%d." % (vp, b)
            B = dict(n1=W.vec(p + "norm1.weight", E, 0.5, 1.5), n2=W.vec(p + "norm2.weight", E, 0.5, 1.5),
                     qkv=W.mat(p + "attn.qkv.weight", 3 * E, E), qkvb=W.vec(p + "attn.qkv.bias", 3 * E),
                     proj=W.mat(p + "attn.proj.weight", E, E), projb=W.vec(p + "attn.proj.bias", E))
            if self.v25:
                B.update(g=W.mat(p + "mlp.gate_proj.weight", I, E), gb=W.vec(p + "mlp.gate_proj.bias", I),
                         u=W.mat(p + "mlp.up_proj.weight", I, E), ub=W.vec(p + "mlp.up_proj.bias", I),
                         d=W.mat(p + "mlp.down_proj.weight", E, I), db=W.vec(p + "mlp.down_proj.bias", E))
            else:
                B.update(n1b=W.vec(p + "norm1.bias", E), n2b=W.vec(p + "norm2.bias", E),
                         f1=W.mat(p + "mlp.fc1.weight", I, E), f1b=W.vec(p + "mlp.fc1.bias", I),
                         f2=W.mat(p + "mlp.fc2.weight", E, I), f2b=W.vec(p + "mlp.fc2.bias", E))
            self.blocks.append(B)
        U = MERGE * MERGE
        self.lnq = W.vec(vp + ".merger.ln_q.weight", E, 0.5, 1.5)
        self.lnqb = None if self.v25 else W.vec(vp + ".merger.ln_q.bias", E)
        self.m0 = W.mat(vp + ".merger.mlp.0.weight", U * E, U * E)
        self.m0b = W.vec(vp + ".merger.mlp.0.bias", U * E)
        self.m2 = W.mat(vp + ".merger.mlp.2.weight", v["out"], U * E)
        self.m2b = W.vec(vp + ".merger.mlp.2.bias", v["out"])
        self.W = W

    # -- vision, as Qwen2VisionTransformerPretrainedModel / Qwen2_5_... .forward --
    def rot_pos(self, grids):
        pos = []
        for (t, h, w) in grids:
            one = []
            for bh in range(h // MERGE):
                for bw in range(w // MERGE):
                    for dy in range(MERGE):
                        for dx in range(MERGE):
                            one.append((bh * MERGE + dy, bw * MERGE + dx))
            pos += one * t
        return pos

    def window_index(self, grids):
        ws = self.fx["vis"]["window"] // MERGE // PATCH
        window_index, cu = [], [0]
        wid = 0
        for (gt, gh, gw) in grids:
            lh, lw = gh // MERGE, gw // MERGE
            pad_h = ws - lh % ws
            pad_w = ws - lw % ws
            nh, nw = (lh + pad_h) // ws, (lw + pad_w) // ws
            idx = [[[t * lh * lw + y * lw + x if (y < lh and x < lw) else -100
                     for x in range(lw + pad_w)] for y in range(lh + pad_h)] for t in range(gt)]
            for t in range(gt):
                for wy in range(nh):
                    for wx in range(nw):
                        cnt = 0
                        for y in range(wy * ws, wy * ws + ws):
                            for x in range(wx * ws, wx * ws + ws):
                                vv = idx[t][y][x]
                                if vv != -100:
                                    window_index.append(vv + wid)
                                    cnt += 1
                        cu.append(cu[-1] + cnt * MERGE * MERGE)
            wid += gt * lh * lw
        uniq = [cu[0]]
        for c in cu[1:]:
            if c != uniq[-1]:
                uniq.append(c)
        return window_index, uniq

    def vision(self, pix, grids):
        E, nh = self.E, self.fx["vis"]["heads"]
        Dv = E // nh
        x = linear(pix, self.patch)
        pos = self.rot_pos(grids)
        inv = [1.0 / (10000.0 ** (2 * i / (Dv // 2))) for i in range(Dv // 4)]
        freqs = [[hp * f for f in inv] + [wp * f for f in inv] for (hp, wp) in pos]
        N = len(x)
        U = MERGE * MERGE
        cu = [0]
        for (t, h, w) in grids:
            for _ in range(t):
                cu.append(cu[-1] + h * w)
        if self.v25:
            widx, cuw = self.window_index(grids)
            x = [x[widx[r // U] * U + r % U] for r in range(N)]
            freqs = [freqs[widx[r // U] * U + r % U] for r in range(N)]
        cos = [[math.cos(a) for a in f + f] for f in freqs]
        sin = [[math.sin(a) for a in f + f] for f in freqs]
        for bi, B in enumerate(self.blocks):
            if self.v25:
                h = [rmsnorm(r, B["n1"], 1e-6) for r in x]
            else:
                h = [layernorm(r, B["n1"], B["n1b"], 1e-6) for r in x]
            qkv = linear(h, B["qkv"], B["qkvb"])
            seqs = cu if (not self.v25 or bi in self.fx["vis"]["fullatt"]) else cuw
            att = [[0.0] * E for _ in range(N)]
            for hh in range(nh):
                q = [rope_apply(r[hh * Dv:(hh + 1) * Dv], cos[i], sin[i]) for i, r in enumerate(qkv)]
                k = [rope_apply(r[E + hh * Dv:E + (hh + 1) * Dv], cos[i], sin[i]) for i, r in enumerate(qkv)]
                vv = [r[2 * E + hh * Dv:2 * E + (hh + 1) * Dv] for r in qkv]
                for s in range(len(seqs) - 1):
                    a, b = seqs[s], seqs[s + 1]
                    for i in range(a, b):
                        p = softmax([sum(u * w for u, w in zip(q[i], k[j])) / math.sqrt(Dv) for j in range(a, b)])
                        for d in range(Dv):
                            att[i][hh * Dv + d] = sum(p[j - a] * vv[j][d] for j in range(a, b))
            o = linear(att, B["proj"], B["projb"])
            x = [[u + w for u, w in zip(r, s)] for r, s in zip(x, o)]
            if self.v25:
                h = [rmsnorm(r, B["n2"], 1e-6) for r in x]
                g = linear(h, B["g"], B["gb"])
                u = linear(h, B["u"], B["ub"])
                m = linear([[silu(a) * b for a, b in zip(gr, ur)] for gr, ur in zip(g, u)], B["d"], B["db"])
            else:
                h = [layernorm(r, B["n2"], B["n2b"], 1e-6) for r in x]
                f = linear(h, B["f1"], B["f1b"])
                m = linear([[quick_gelu(a) for a in r] for r in f], B["f2"], B["f2b"])
            x = [[u + w for u, w in zip(r, s)] for r, s in zip(x, m)]
        if self.v25:
            h = [rmsnorm(r, self.lnq, 1e-6) for r in x]
        else:
            h = [layernorm(r, self.lnq, self.lnqb, 1e-6) for r in x]
        hm = [sum(h[i * U:(i + 1) * U], []) for i in range(N // U)]
        mo = linear([[gelu(a) for a in r] for r in linear(hm, self.m0, self.m0b)], self.m2, self.m2b)
        if self.v25:
            rev = sorted(range(len(widx)), key=lambda i: widx[i])
            mo = [mo[r] for r in rev]
        return mo

    # -- get_rope_index (one sequence, images only) --
    def rope_index(self, ids, grids):
        n = len(ids)
        pos = [[0] * n for _ in range(3)]
        st, nxt, k = 0, 0, 0
        n_img = sum(1 for i in range(n - 1) if ids[i] == VS and ids[i + 1] == IMG)
        out = []
        for _ in range(n_img):
            ed = ids.index(IMG, st)
            t, h, w = grids[k]
            k += 1
            lt, lh, lw = t, h // MERGE, w // MERGE
            text_len = ed - st
            st_idx = (max(max(r) for r in out[-1]) + 1) if out else 0
            out.append([[st_idx + i for i in range(text_len)] for _ in range(3)])
            tt = []
            for ti in range(lt):
                for hi in range(lh):
                    for wi in range(lw):
                        tv = 0 if self.v25 else ti
                        tt.append((tv + text_len + st_idx, hi + text_len + st_idx, wi + text_len + st_idx))
            out.append([[p[a] for p in tt] for a in range(3)])
            st = ed + lt * lh * lw
        if st < n:
            st_idx = (max(max(r) for r in out[-1] if r) + 1) if out else 0
            out.append([[st_idx + i for i in range(n - st)] for _ in range(3)])
        for a in range(3):
            pos[a] = sum((blk[a] for blk in out), [])
        return pos

    # -- Qwen2 decoder with M-RoPE --
    def text(self, ids, pos, img_rows):
        t = self.fx["text"]
        H, hd, nh, nkv = self.H, self.hd, t["heads"], t["kv"]
        x = [list(self.emb[i]) for i in ids]
        it = iter(img_rows)
        for i, v in enumerate(ids):
            if v == IMG:
                x[i] = list(next(it))
        inv = [1.0 / (t["theta"] ** (2 * i / hd)) for i in range(hd // 2)]
        sec = t["sec"] * 2
        axis = []
        for ci, s in enumerate(sec):
            axis += [ci % 3] * s
        T = len(ids)
        cos = [[math.cos(pos[axis[d]][i] * inv[d % (hd // 2)]) for d in range(hd)] for i in range(T)]
        sin = [[math.sin(pos[axis[d]][i] * inv[d % (hd // 2)]) for d in range(hd)] for i in range(T)]
        for L in self.layers:
            h = [rmsnorm(r, L["ln1"], EPS_TEXT) for r in x]
            q = linear(h, L["q"], L["qb"])
            k = linear(h, L["k"], L["kb"])
            v = linear(h, L["v"], L["vb"])
            att = [[0.0] * (nh * hd) for _ in range(T)]
            for hh in range(nh):
                g = hh // (nh // nkv)
                qh = [rope_apply(r[hh * hd:(hh + 1) * hd], cos[i], sin[i]) for i, r in enumerate(q)]
                kh = [rope_apply(r[g * hd:(g + 1) * hd], cos[i], sin[i]) for i, r in enumerate(k)]
                vh = [r[g * hd:(g + 1) * hd] for r in v]
                for i in range(T):
                    p = softmax([sum(a * b for a, b in zip(qh[i], kh[j])) / math.sqrt(hd) for j in range(i + 1)])
                    for d in range(hd):
                        att[i][hh * hd + d] = sum(p[j] * vh[j][d] for j in range(i + 1))
            o = linear(att, L["o"])
            x = [[a + b for a, b in zip(r, s)] for r, s in zip(x, o)]
            h = [rmsnorm(r, L["ln2"], EPS_TEXT) for r in x]
            gg, uu = linear(h, L["g"]), linear(h, L["u"])
            m = linear([[silu(a) * b for a, b in zip(gr, ur)] for gr, ur in zip(gg, uu)], L["d"])
            x = [[a + b for a, b in zip(r, s)] for r, s in zip(x, m)]
        h = [rmsnorm(r, self.norm, EPS_TEXT) for r in x]
        return linear(h, self.emb)

    def config(self):
        t, v, fx = self.fx["text"], self.fx["vis"], self.fx
        arch = "Qwen2_5_VLForConditionalGeneration" if self.v25 else "Qwen2VLForConditionalGeneration"
        mt = "qwen2_5_vl" if self.v25 else "qwen2_vl"
        if self.v25:
            vc = dict(depth=v["depth"], hidden_size=v["embed"], out_hidden_size=v["out"],
                      intermediate_size=v["mlp"], num_heads=v["heads"], hidden_act="silu",
                      in_channels=3, patch_size=PATCH, spatial_merge_size=MERGE,
                      temporal_patch_size=TP, window_size=v["window"],
                      fullatt_block_indexes=v["fullatt"], tokens_per_second=2)
        else:
            vc = dict(depth=v["depth"], embed_dim=v["embed"], hidden_size=v["out"],
                      mlp_ratio=v["mlp"] / v["embed"], num_heads=v["heads"], in_chans=3,
                      patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TP)
        text = dict(vocab_size=VOCAB, hidden_size=t["hidden"], intermediate_size=t["inter"],
                    num_hidden_layers=t["layers"], num_attention_heads=t["heads"],
                    num_key_value_heads=t["kv"], rms_norm_eps=EPS_TEXT, max_position_embeddings=512,
                    hidden_act="silu", tie_word_embeddings=True, use_sliding_window=False,
                    bos_token_id=1, eos_token_id=2)
        cfg = dict(architectures=[arch], model_type=mt, image_token_id=IMG, video_token_id=VID,
                   vision_start_token_id=VS, vision_end_token_id=VE, vision_config=vc)
        if fx["layout"] == "tf5":
            text["rope_parameters"] = dict(rope_type="default", rope_theta=t["theta"], mrope_section=t["sec"])
            text["model_type"] = mt + "_text"
            cfg["text_config"] = text
            cfg["dtype"] = "float32"
        else:
            cfg.update(text)
            cfg["rope_theta"] = t["theta"]
            cfg["rope_scaling"] = dict(type="mrope", mrope_section=t["sec"])
            cfg["torch_dtype"] = "float32"
        return cfg


PROMPTS = [
    dict(name="two_images", grids=[[1, 4, 6], [1, 6, 4]],
         ids=[1, 5, 6, VS, "I0", VE, 7, VS, "I1", VE, 8, 9, 10]),
    dict(name="image_mid", grids=[[1, 6, 6]], ids=[1, 11, 12, 13, VS, "I0", VE, 14, 15]),
    dict(name="text_only", grids=[], ids=[1, 20, 21, 22, 23, 24]),
]


def expand(ids, grids):
    out = []
    for v in ids:
        if isinstance(v, str):
            t, h, w = grids[int(v[1:])]
            out += [IMG] * (t * h * w // (MERGE * MERGE))
        else:
            out.append(v)
    return out


def make(fx, out_root):
    d = os.path.join(out_root, fx["name"])
    os.makedirs(d, exist_ok=True)
    m = Model(fx)
    m.W.write(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(m.config(), f, indent=1)
    rng = random.Random(fx["seed"] + 100)
    prompts = []
    for pr in PROMPTS:
        ids = expand(pr["ids"], pr["grids"])
        npatch = sum(t * h * w for t, h, w in pr["grids"])
        pix = [[f32(rng.gauss(0.0, 1.0)) for _ in range(K)] for _ in range(npatch)]
        img_rows = m.vision(pix, pr["grids"]) if npatch else []
        pos = m.rope_index(ids, pr["grids"])
        logits = m.text(ids, pos, img_rows)
        delta = max(max(r) for r in pos) + 1 - len(ids)
        seq, toks, steps = list(ids), [], []
        last = logits[-1]
        for s in range(GREEDY):
            steps.append(last)
            tok = max(range(VOCAB), key=lambda v: last[v])
            toks.append(tok)
            if s == GREEDY - 1:
                break
            seq.append(tok)
            last = m.text(seq, m.rope_index(seq, pr["grids"]), img_rows)[-1]
        name = pr["name"]
        write_npy(os.path.join(d, name + ".logits.npy"), logits)
        write_npy(os.path.join(d, name + ".greedy_logits.npy"), steps)
        pf = None
        if npatch:
            pf = name + ".pixel_values.npy"
            write_npy(os.path.join(d, pf), pix)
        lse = []
        for r in logits:
            mx = max(r)
            lse.append(mx + math.log(sum(math.exp(v - mx) for v in r)))
        prompts.append(dict(name=name, input_ids=ids, image_grid_thw=pr["grids"],
                            n_image_tokens=ids.count(IMG), position_ids=pos, rope_delta=delta,
                            pixel_values_file=pf, logits_file=name + ".logits.npy",
                            logit_cols=list(range(VOCAB)),
                            argmax=[max(range(VOCAB), key=lambda v: r[v]) for r in logits],
                            logsumexp=lse,
                            greedy=dict(token_ids=toks, step_logits_file=name + ".greedy_logits.npy")))
        print("  %s/%s: T=%d delta=%d greedy=%s" % (fx["name"], name, len(ids), delta, toks))
    ref = dict(name=fx["name"], architecture=m.config()["architectures"][0], image_token_id=IMG,
               reference="tools/make_vl_selftest.py (float64, standard library)", prompts=prompts)
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    for fx in FIXTURES:
        make(fx, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
