#!/usr/bin/env python3
"""Golden outputs for Kiln's tokenizer and chat-template tests, from Hugging Face's own code.

Runs where `tokenizers` and `transformers` are installed (the GPU machine):

    python3 tools/dev/gen_tokenizer_goldens.py CACHE_DIR OUT_DIR [BENCH_TEXT]

CACHE_DIR holds <name>/tokenizer.json + tokenizer_config.json (tests/fetch_tokenizers.sh).
Reads tests/data/tokenizer/corpus.jsonl and tests/data/templates/cases.jsonl and writes
OUT_DIR/tokenizer/<name>.jsonl and OUT_DIR/templates/goldens.jsonl, one JSON object a line.
With BENCH_TEXT, also times HF `tokenizers` encoding that file on one thread (the reference for
Kiln's tokenizer benchmark) and writes OUT_DIR/hf_bench.json.
"""
import json
import os
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

from tokenizers import Tokenizer  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

NAMES = os.environ.get("KILN_TOKENIZERS", "qwen3 llama3 llama2 gemma3 mistral_nemo deepseek_v3 gpt4o").split()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def tokenizer_goldens(cache, out):
    corpus = [r["text"] for r in read_jsonl(os.path.join(ROOT, "tests/data/tokenizer/corpus.jsonl"))]
    for name in NAMES:
        tok = Tokenizer.from_file(os.path.join(cache, name, "tokenizer.json"))
        rows = []
        for text in corpus:
            plain = tok.encode(text, add_special_tokens=False).ids
            special = tok.encode(text, add_special_tokens=True).ids
            rows.append({
                "text": text,
                "ids": plain,
                "ids_special": special,
                "decoded": tok.decode(special, skip_special_tokens=False),
                "decoded_skip": tok.decode(special, skip_special_tokens=True),
            })
        write_jsonl(os.path.join(out, "tokenizer", name + ".jsonl"), rows)
        print(f"{name}: {len(rows)} tokenizer goldens")


def template_goldens(cache, out):
    cases = read_jsonl(os.path.join(ROOT, "tests/data/templates/cases.jsonl"))
    cases = [c for c in cases if c["template"] in NAMES]
    toks = {n: AutoTokenizer.from_pretrained(os.path.join(cache, n)) for n in NAMES}
    rows = []
    for c in cases:
        tok = toks[c["template"]]
        kwargs = dict(c.get("extra", {}))
        if "tools" in c:
            kwargs["tools"] = c["tools"]
        if "source" in c:
            kwargs["chat_template"] = c["source"]
        row = dict(c)
        try:
            row["rendered"] = tok.apply_chat_template(
                c["messages"], tokenize=False, add_generation_prompt=c["add_generation_prompt"],
                **kwargs)
        except Exception as e:  # the template raised: Kiln must refuse the same case
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    write_jsonl(os.path.join(out, "templates", "goldens.jsonl"), rows)
    print(f"templates: {len(rows)} goldens ({sum('error' in r for r in rows)} expected errors)")


def hf_bench(cache, text_path, out):
    # newline="" keeps CR/CRLF as they are; lines split on "\n" only, as the C benchmark does.
    with open(text_path, encoding="utf-8", newline="") as f:
        text = f.read()
    lines = [line for line in text.split("\n") if line]
    res = {"bytes": len(text.encode("utf-8")), "lines": len(lines),
           "tokenizers_version": __import__("tokenizers").__version__,
           "transformers_version": transformers.__version__, "results": {}}
    for name in NAMES:
        tok = Tokenizer.from_file(os.path.join(cache, name, "tokenizer.json"))
        r = {}
        for mode in ("whole", "lines"):
            best, ntok = None, 0
            for _ in range(3):
                t0 = time.perf_counter()
                if mode == "whole":
                    ntok = len(tok.encode(text, add_special_tokens=False).ids)
                else:
                    ntok = sum(len(tok.encode(line, add_special_tokens=False).ids) for line in lines)
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            r[mode] = {"seconds": best, "tokens": ntok, "mb_per_s": res["bytes"] / best / 1e6}
            print(f"HF tokenizers {name} {mode}: {res['bytes'] / best / 1e6:.2f} MB/s, {ntok} tokens, "
                  f"{best:.3f} s (best of 3, one thread)")
        res["results"][name] = r
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "hf_bench.json"), "w") as f:
        json.dump(res, f, indent=2)


def main():
    cache, out = sys.argv[1], sys.argv[2]
    print(f"transformers {transformers.__version__}, tokenizers {__import__('tokenizers').__version__}")
    if os.environ.get("BENCH_ONLY") != "1":
        tokenizer_goldens(cache, out)
        template_goldens(cache, out)
    if len(sys.argv) > 3:
        hf_bench(cache, sys.argv[3], out)


if __name__ == "__main__":
    main()
