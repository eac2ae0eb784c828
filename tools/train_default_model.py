#!/usr/bin/env python3
"""train_default_model.py - trains Kiln's default model (share/models/kiln-tiny) from scratch:
a byte-level BPE tokenizer and a small LlamaForCausalLM on the English text of a few Debian
packages, then records the reference figures Kiln's tests compare against.

    python3 tools/dev/extract_default_corpus.py             # CPU machine: .corpus/
    python3 tools/train_default_model.py --corpus .corpus --out /tmp/out    # GPU machine

A larger model on the same tokenizer, which kiln-tiny can draft for (issue 20's speculative
decoding measurements; bench/spec_bench.py then measures it, docs/perf.md has the figures):

    python3 tools/train_default_model.py --corpus .corpus --out /tmp/out --name kiln-small \
        --tokenizer share/models/kiln-tiny/tokenizer.json --hidden 512 --intermediate 1536 \
        --layers 12 --heads 8 --kv-heads 4 --steps 1800 --lr 1e-3 --max-train-seconds 200

Needs torch 2.x, transformers (4.4x or 5.x), tokenizers and numpy (the GPU machine); no
network. Everything is seeded (Python, NumPy, torch, CUDA) and the data order is a function of
the seed alone; with --steps fixed, a rerun on the same GPU and library versions trains the
same model up to the nondeterminism of cuDNN/flash-attention backward kernels.

Writes:
  OUT/kiln-tiny/     config.json, model.safetensors (bf16), generation_config.json,
                     tokenizer.json, tokenizer_config.json (ChatML chat_template),
                     train_log.json (loss curve, held-out loss, timings, corpus statistics)
  OUT/test/          heldout.txt (held-out documents, ~4k tokens) and reference.json (its
                     perplexity computed by transformers from the saved checkpoint, fp32 and
                     bf16, and greedy continuations in fp32) for tests/test_default_model.c

Perplexity, as Kiln's `kiln perplexity` computes it: ids = tokenizer.encode(text) with no
special tokens added; consecutive non-overlapping windows of ctx tokens (ctx =
max_position_embeddings; the last may be shorter; a window of fewer than 2 tokens is
dropped); in each window positions 1..len-1 are scored given the window's preceding tokens;
ppl = exp(total NLL / scored tokens). The "full held-out" figure applies the same windows to
all held-out documents joined as in training (each followed by <|endoftext|>).
"""
import argparse
import hashlib
import json
import lzma
import math
import os
import platform
import random
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tokenizers  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

TF_MAJOR = int(transformers.__version__.split(".")[0])

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL = [EOT, IM_START, IM_END]  # ids 0, 1, 2

# ChatML, as Qwen and others use it. No default system message: the model is not an assistant.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QUESTIONS = ['What does "{}" mean?', 'What is the meaning of "{}"?', 'Define "{}".']

GREEDY_PROMPTS = [
    {"name": "story", "text": "Once upon a time"},
    {"name": "python", "text": "The Python interpreter"},
    {"name": "chat", "messages": [{"role": "user", "content": 'What does "serendipity" mean?'}]},
]
GREEDY_STEPS = 32


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def h64(s):
    """A stable 64-bit hash of a string (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(s.encode("utf-8")).digest()[:8], "little")


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


# ---- data ---------------------------------------------------------------------------------------

def load_corpus(corpus_dir, heldout_per_mille):
    """Reads every <source>.jsonl.xz; returns (docs, sources meta). A document is held out when
    the hash of "source/id" falls in the first heldout_per_mille of 1000 buckets."""
    with open(os.path.join(corpus_dir, "SOURCES.json")) as fh:
        meta = json.load(fh)["sources"]
    docs = []
    for name in sorted(meta):
        with lzma.open(os.path.join(corpus_dir, meta[name]["file"]), "rt", encoding="utf-8") as fh:
            for ln in fh:
                d = json.loads(ln)
                d["source"] = name
                d["key"] = f"{name}/{d['id']}"
                d["heldout"] = h64(d["key"]) % 1000 < heldout_per_mille
                docs.append(d)
    return docs, meta


def train_text(d, chat_per_mille):
    """The text a training document contributes: plain, or, for a dictionary entry chosen by
    hash, the user/assistant exchange the chat template renders for it."""
    if "term" in d and "definition" in d and h64("chat:" + d["key"]) % 1000 < chat_per_mille:
        q = QUESTIONS[h64("q:" + d["key"]) % len(QUESTIONS)].format(d["term"])
        return (f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{d['definition']}{IM_END}\n")
    return d["text"]


def train_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def encode_all(tok, texts):
    out = []
    for i in range(0, len(texts), 4096):
        out += [np.asarray(e.ids, dtype=np.int32)
                for e in tok.encode_batch(texts[i:i + 4096], add_special_tokens=False)]
    return out


class Stream:
    """Training rows of ctx + 1 tokens cut from the concatenation of the training documents
    (each followed by <|endoftext|>), reshuffled every epoch with a generator seeded by
    (seed, epoch): the data order depends on the seed alone."""

    def __init__(self, doc_ids, ctx, seed, eot_id):
        self.doc_ids, self.ctx, self.seed, self.eot = doc_ids, ctx, seed, eot_id
        self.epoch, self.rows, self.pos = -1, None, 0

    def _next_epoch(self):
        self.epoch += 1
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(len(self.doc_ids))
        eot = np.asarray([self.eot], dtype=np.int32)
        parts = []
        for i in order:
            parts.append(self.doc_ids[i])
            parts.append(eot)
        s = np.concatenate(parts)
        n = (len(s) - 1) // self.ctx
        idx = np.arange(n)[:, None] * self.ctx + np.arange(self.ctx + 1)[None, :]
        self.rows = torch.from_numpy(s[idx].astype(np.int64))
        self.pos = 0

    def batch(self, b):
        out = []
        while b > 0:
            if self.rows is None or self.pos >= len(self.rows):
                self._next_epoch()
            take = min(b, len(self.rows) - self.pos)
            out.append(self.rows[self.pos:self.pos + take])
            self.pos += take
            b -= take
        return torch.cat(out)


# ---- model --------------------------------------------------------------------------------------

def make_config(a, vocab_size):
    kw = dict(vocab_size=vocab_size, hidden_size=a.hidden, intermediate_size=a.intermediate,
              num_hidden_layers=a.layers, num_attention_heads=a.heads,
              num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
              max_position_embeddings=a.ctx, rms_norm_eps=1e-5, hidden_act="silu",
              tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
              initializer_range=0.02, bos_token_id=None, eos_token_id=0, pad_token_id=0,
              use_cache=True)
    if TF_MAJOR >= 5:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(a.rope_theta)}
    else:
        kw["rope_theta"] = float(a.rope_theta)
    return transformers.LlamaConfig(**kw)


def make_model(cfg, attn):
    cls = transformers.LlamaForCausalLM
    try:
        m = cls._from_config(cfg, attn_implementation=attn)
    except Exception as e:  # noqa: BLE001
        log(f"note: _from_config failed ({type(e).__name__}: {e}); constructing directly")
        cfg._attn_implementation = attn
        m = cls(cfg)
    m = m.float()
    assert m.get_input_embeddings().weight is m.get_output_embeddings().weight, "lm_head not tied"
    return m


def load_saved(path, dtype, device, attn="sdpa"):
    kw = {("dtype" if TF_MAJOR >= 5 else "torch_dtype"): dtype, "attn_implementation": attn}
    m = transformers.LlamaForCausalLM.from_pretrained(path, **kw)
    if dtype == torch.float32:
        m = m.float()
    return m.to(device).eval()


def lr_at(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * min(1.0, t)))


@torch.no_grad()
def score_windows(model, ids, ctx, device, batch=16, autocast=False):
    """Total NLL (float64) and number of scored tokens over consecutive windows of ctx tokens,
    as `kiln perplexity` defines it; log-softmax in float64."""
    ids = list(ids)
    wins = [ids[s:s + ctx] for s in range(0, len(ids), ctx)]
    wins = [w for w in wins if len(w) >= 2]
    nll, scored = 0.0, 0
    groups = {}
    for w in wins:
        groups.setdefault(len(w), []).append(w)
    for n, ws in sorted(groups.items()):
        for i in range(0, len(ws), batch):
            x = torch.tensor(ws[i:i + batch], dtype=torch.long, device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=x, use_cache=False).logits
            lp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
            nll -= lp.gather(-1, x[:, 1:, None]).sum().item()
            scored += x.shape[0] * (n - 1)
    return nll, scored, len(wins)


def joined_ids(doc_ids, eot):
    out = []
    for d in doc_ids:
        out += d.tolist() + [eot]
    return out


# ---- main ---------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=".corpus")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="kiln-tiny")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--tokenizer", default=None,
                    help="a tokenizer.json to use instead of training one (e.g. "
                         "share/models/kiln-tiny/tokenizer.json, so that kiln-tiny can draft "
                         "for the model trained here); --vocab is then its size")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--steps", type=int, default=3600)
    ap.add_argument("--batch", type=int, default=32, help="sequences of ctx tokens per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--heldout-per-mille", type=int, default=10)
    ap.add_argument("--chat-per-mille", type=int, default=400,
                    help="share of training dictionary entries rendered as chat exchanges")
    ap.add_argument("--heldout-txt-tokens", type=int, default=3500)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=300)
    ap.add_argument("--compile", action="store_true", help="torch.compile the training model")
    ap.add_argument("--max-train-seconds", type=float, default=420,
                    help="safety stop for the device's time limit (recorded when it triggers)")
    a = ap.parse_args()

    t_start = time.time()
    timings = {}
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    dev = torch.device("cuda")
    seed_everything(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, tokenizers "
        f"{tokenizers.__version__}, {torch.cuda.get_device_name(0)}")

    # -- corpus and tokenizer
    docs, sources = load_corpus(a.corpus, a.heldout_per_mille)
    train = [d for d in docs if not d["heldout"]]
    held = [d for d in docs if d["heldout"]]
    log(f"{len(docs)} documents: {len(train)} train, {len(held)} held out")
    if a.tokenizer:
        tok = Tokenizer.from_file(a.tokenizer)
        for i, s in enumerate(SPECIAL):
            assert tok.token_to_id(s) == i, (a.tokenizer, s, tok.token_to_id(s))
    else:
        tok = train_tokenizer([d["text"] for d in train], a.vocab)
    vocab_size = tok.get_vocab_size()
    eot = tok.token_to_id(EOT)
    timings["tokenizer_s"] = time.time() - t_start
    log(f"tokenizer: vocab {vocab_size} in {timings['tokenizer_s']:.1f}s")

    t0 = time.time()
    train_ids = encode_all(tok, [train_text(d, a.chat_per_mille) for d in train])
    held_ids = encode_all(tok, [d["text"] for d in held])
    stats = {}
    for d, ids in zip(train + held, train_ids + held_ids):
        s = stats.setdefault(d["source"], {"train_docs": 0, "train_tokens": 0, "heldout_docs": 0,
                                           "heldout_tokens": 0, "bytes": 0})
        k = "heldout" if d["heldout"] else "train"
        s[k + "_docs"] += 1
        s[k + "_tokens"] += int(len(ids)) + 1
        s["bytes"] += len(d["text"].encode("utf-8"))
    n_train_tok = sum(s["train_tokens"] for s in stats.values())
    n_bytes = sum(s["bytes"] for s in stats.values())
    n_all_tok = n_train_tok + sum(s["heldout_tokens"] for s in stats.values())
    timings["encode_s"] = time.time() - t0
    log(f"encoded in {timings['encode_s']:.1f}s: {n_train_tok} training tokens "
        f"({n_bytes / n_all_tok:.2f} bytes/token overall)")
    for k, s in sorted(stats.items()):
        log(f"  {k:9s} {s}")
    held_stream = joined_ids(held_ids, eot)

    # -- model
    cfg = make_config(a, vocab_size)
    model = make_model(cfg, "sdpa").to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params} parameters ({n_params * 2 / 1e6:.2f} MB in bf16)")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    fwd = torch.compile(model) if a.compile else model
    stream = Stream(train_ids, a.ctx, a.seed, eot)

    def heldout_loss():
        model.eval()
        nll, n, _ = score_windows(model, held_stream, a.ctx, dev, batch=32, autocast=True)
        model.train()
        return nll / n

    # -- train
    curve, evals = [], []
    model.train()
    t0 = time.time()
    acc, acc_n, tokens, stopped_early = 0.0, 0, 0, False
    step = 0
    for step in range(a.steps):
        lr = lr_at(step, a)
        for g in opt.param_groups:
            g["lr"] = lr
        rows = stream.batch(a.batch).to(dev, non_blocking=True)
        x, y = rows[:, :-1], rows[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        tokens += x.numel()
        acc += loss.detach()
        acc_n += 1
        last = step + 1 == a.steps
        if (step + 1) % a.log_every == 0 or last:
            el = time.time() - t0
            rec = {"step": step + 1, "loss": round(float(acc) / acc_n, 5), "lr": lr,
                   "grad_norm": round(float(gnorm), 4), "tokens": tokens,
                   "epoch": round(tokens / n_train_tok, 3), "seconds": round(el, 2)}
            curve.append(rec)
            acc, acc_n = 0.0, 0
            if (step + 1) % (a.log_every * 8) == 0 or last:
                log(f"step {step + 1:5d} loss {rec['loss']:.4f} lr {lr:.2e} gnorm "
                    f"{rec['grad_norm']:.3f} epoch {rec['epoch']:.2f} {tokens / el:,.0f} tok/s")
        if (step + 1) % a.eval_every == 0 or last:
            hl = heldout_loss()
            evals.append({"step": step + 1, "heldout_loss": round(hl, 5),
                          "heldout_ppl": round(math.exp(hl), 4), "tokens": tokens})
            log(f"step {step + 1:5d} held-out loss {hl:.4f} ppl {math.exp(hl):.3f}")
        if time.time() - t0 > a.max_train_seconds and not last:
            log(f"stopping early at step {step + 1}: over {a.max_train_seconds}s")
            stopped_early = True
            hl = heldout_loss()
            evals.append({"step": step + 1, "heldout_loss": round(hl, 5),
                          "heldout_ppl": round(math.exp(hl), 4), "tokens": tokens})
            break
    torch.cuda.synchronize()
    timings["train_s"] = time.time() - t0
    steps_done = step + 1
    log(f"trained {steps_done} steps, {tokens} tokens in {timings['train_s']:.1f}s")

    # -- save (bf16)
    out_dir = os.path.join(a.out, a.name)
    os.makedirs(out_dir, exist_ok=True)
    model.eval()
    model = model.to(torch.bfloat16)
    try:
        model.config.dtype = torch.bfloat16
    except Exception:  # noqa: BLE001
        model.config.torch_dtype = torch.bfloat16
    gen = transformers.GenerationConfig(bos_token_id=None, eos_token_id=[eot, tok.token_to_id(IM_END)],
                                        pad_token_id=eot)
    model.generation_config = gen
    model.save_pretrained(out_dir, safe_serialization=True)
    gpath = os.path.join(out_dir, "generation_config.json")
    g = json.load(open(gpath)) if os.path.exists(gpath) else {}
    if g.get("eos_token_id") != [eot, tok.token_to_id(IM_END)]:
        g.update(eos_token_id=[eot, tok.token_to_id(IM_END)], pad_token_id=eot)
        json.dump(g, open(gpath, "w"), indent=2)
    cpath = os.path.join(out_dir, "config.json")
    c = json.load(open(cpath))
    want_dtype_key = "dtype" if TF_MAJOR >= 5 else "torch_dtype"
    if c.get(want_dtype_key) != "bfloat16":
        c[want_dtype_key] = "bfloat16"
        json.dump(c, open(cpath, "w"), indent=2, sort_keys=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tcfg = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for i, s in enumerate(SPECIAL)},
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "errors": "replace",
        "model_max_length": a.ctx,
        "pad_token": EOT,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(tcfg, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    model = fwd = opt = None
    torch.cuda.empty_cache()

    # -- reference figures, from the saved checkpoint; fp32 without TF32
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tok2 = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    m32 = load_saved(out_dir, torch.float32, dev)
    m16 = load_saved(out_dir, torch.bfloat16, dev)
    full = {}
    for label, m in (("float32", m32), ("bfloat16", m16)):
        nll, n, w = score_windows(m, held_stream, a.ctx, dev)
        full[label] = {"nll": nll, "scored": n, "windows": w, "perplexity": math.exp(nll / n)}
    full["tokens"] = len(held_stream)
    full["documents"] = len(held)
    log(f"full held-out ({len(held_stream)} tokens): ppl fp32 {full['float32']['perplexity']:.4f}"
        f" bf16 {full['bfloat16']['perplexity']:.4f}")

    # heldout.txt: whole held-out documents, round-robin over the sources
    by_src = {}
    for d in sorted(held, key=lambda d: h64("pick:" + d["key"])):
        if 150 <= len(d["text"]) <= 2500:
            by_src.setdefault(d["source"], []).append(d)
    order = ["bible", "python", "fortunes", "jargon", "wordnet", "devil"]
    order = [s for s in order if s in by_src] + sorted(s for s in by_src if s not in order)
    picked, ntok, k = [], 0, 0
    while ntok < a.heldout_txt_tokens and any(by_src.values()):
        src = order[k % len(order)]
        k += 1
        if by_src[src]:
            d = by_src[src].pop(0)
            picked.append(d)
            ntok += len(tok2.encode(d["text"], add_special_tokens=False).ids)
    text = "\n\n".join(d["text"] for d in picked) + "\n"
    test_dir = os.path.join(a.out, "test")
    os.makedirs(test_dir, exist_ok=True)
    with open(os.path.join(test_dir, "heldout.txt"), "w", encoding="utf-8") as fh:
        fh.write(text)
    ids = tok2.encode(text, add_special_tokens=False).ids
    ref_ppl = {}
    for label, m in (("float32", m32), ("bfloat16", m16)):
        nll, n, w = score_windows(m, ids, a.ctx, dev)
        ref_ppl[label] = {"nll": nll, "scored": n, "windows": w, "perplexity": math.exp(nll / n)}
    log(f"heldout.txt ({len(ids)} tokens, {len(picked)} documents): ppl fp32 "
        f"{ref_ppl['float32']['perplexity']:.4f} bf16 {ref_ppl['bfloat16']['perplexity']:.4f}")

    # chat template through transformers, as a server would render it
    rendered, render_how = {}, None
    try:
        hf_tok = transformers.AutoTokenizer.from_pretrained(out_dir)
        for p in GREEDY_PROMPTS:
            if "messages" in p:
                rendered[p["name"]] = hf_tok.apply_chat_template(p["messages"], tokenize=False,
                                                                 add_generation_prompt=True)
        render_how = f"transformers {transformers.__version__} AutoTokenizer.apply_chat_template"
        hf_ids = hf_tok("Once upon a time", add_special_tokens=False)["input_ids"]
        assert hf_ids == tok2.encode("Once upon a time", add_special_tokens=False).ids
    except Exception as e:  # noqa: BLE001
        log(f"note: transformers could not render the chat template ({type(e).__name__}: {e}); "
            "using jinja2 as transformers configures it")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        tpl = env.from_string(CHAT_TEMPLATE)
        for p in GREEDY_PROMPTS:
            if "messages" in p:
                rendered[p["name"]] = tpl.render(messages=p["messages"],
                                                 add_generation_prompt=True, eos_token=EOT)
        render_how = f"jinja2 {jinja2.__version__} (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks)"

    greedy = []
    with torch.no_grad():
        for p in GREEDY_PROMPTS:
            ptext = rendered[p["name"]] if "messages" in p else p["text"]
            pids = tok2.encode(ptext, add_special_tokens=False).ids
            seq, outs, gaps = list(pids), [], []
            for _ in range(GREEDY_STEPS):
                x = torch.tensor([seq], dtype=torch.long, device=dev)
                lg = m32(input_ids=x, use_cache=False).logits[0, -1].double()
                top = torch.topk(lg, 2)
                nid = int(top.indices[0])
                gaps.append(float(top.values[0] - top.values[1]))
                outs.append(nid)
                seq.append(nid)
            rec = {"name": p["name"], "prompt": ptext, "prompt_ids": pids, "token_ids": outs,
                   "text": tok2.decode(outs, skip_special_tokens=False), "top1_top2_gaps": gaps,
                   "min_gap": min(gaps)}
            if "messages" in p:
                rec["messages"] = p["messages"]
            greedy.append(rec)
            log(f"greedy {p['name']}: {ptext!r} -> {rec['text']!r} (min gap {min(gaps):.4f})")
    timings["reference_s"] = time.time() - t0

    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__, "numpy": np.__version__,
                "python": platform.python_version(), "cuda": torch.version.cuda,
                "gpu": torch.cuda.get_device_name(0)}
    reference = {
        "model": a.name,
        "description": "Reference figures for tests/test_default_model.c, computed by "
                       "transformers on the GPU from the saved bf16 checkpoint (TF32 off).",
        "versions": versions,
        "ctx": a.ctx,
        "heldout_file": "heldout.txt",
        "heldout": {"tokens": len(ids), "documents": [d["key"] for d in picked],
                    "float32": ref_ppl["float32"], "bfloat16": ref_ppl["bfloat16"]},
        "perplexity_definition": "ids = tokenizer.encode(text) with no special tokens added; "
                                 "consecutive non-overlapping windows of ctx tokens (the last "
                                 "may be shorter, fewer than 2 tokens dropped); positions "
                                 "1..len-1 of each window scored given the window's preceding "
                                 "tokens; log-softmax in float64; ppl = exp(sum NLL / scored). "
                                 "float32: checkpoint loaded then .float(); bfloat16: computed "
                                 "in bf16 (logits rounded to bf16 by transformers).",
        "full_heldout": full,
        "chat_template_render": {"how": render_how, "rendered": rendered},
        "greedy": {"steps": GREEDY_STEPS, "compute": "float32, full forward per step, no EOS "
                   "stop; top1_top2_gaps[i] = top-1 minus top-2 logit at step i",
                   "prompts": greedy},
    }
    with open(os.path.join(test_dir, "reference.json"), "w") as fh:
        json.dump(reference, fh, indent=1, ensure_ascii=False)
        fh.write("\n")

    timings["total_s"] = time.time() - t_start
    train_log = {
        "model": a.name,
        "args": vars(a),
        "versions": versions,
        "parameters": n_params,
        "vocab_size": vocab_size,
        "steps": steps_done,
        "stopped_early": stopped_early,
        "tokens_per_step": a.batch * a.ctx,
        "tokens_seen": tokens,
        "train_tokens": n_train_tok,
        "epochs": round(tokens / n_train_tok, 3),
        "bytes_per_token": round(n_bytes / n_all_tok, 4),
        "corpus": {k: dict(v, **{kk: sources[k][kk] for kk in ("package", "version", "license")})
                   for k, v in stats.items()},
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "final_train_loss": curve[-1]["loss"] if curve else None,
        "full_heldout": {"tokens": full["tokens"], "documents": full["documents"],
                         "ppl_float32": full["float32"]["perplexity"],
                         "ppl_bfloat16": full["bfloat16"]["perplexity"]},
        "heldout_txt": {"tokens": len(ids), "ppl_float32": ref_ppl["float32"]["perplexity"],
                        "ppl_bfloat16": ref_ppl["bfloat16"]["perplexity"]},
        "eval": evals,
        "loss_curve": curve,
    }
    with open(os.path.join(out_dir, "train_log.json"), "w") as fh:
        json.dump(train_log, fh, indent=1)
        fh.write("\n")
    log(f"done in {timings['total_s']:.1f}s: {out_dir}, {test_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
