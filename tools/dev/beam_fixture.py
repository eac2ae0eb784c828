#!/usr/bin/env python3
"""beam_fixture.py - transformers' own beam search on kiln-tiny, as a JSON fixture that a Kiln
test can compare with (core/sample/beam.c, docs/engine.md "Beam search").

For each prompt and each (length_penalty, early_stopping) combination it runs
    model.generate(input_ids, num_beams=W, num_return_sequences=W, do_sample=False,
                   max_new_tokens=M, length_penalty=lp, early_stopping=es,
                   output_scores=True, return_dict_in_generate=True)
and writes the prompt ids, the generated ids of each returned sequence (cut after its first
end-of-sequence id, which transformers pads with pad_token_id = 0), and sequences_scores (the
length-penalised score, best first), plus the versions used.

Run it where torch and transformers 5.17 are installed (CPU is enough, a GPU is used when
there is one; about a minute):
    python3 tools/dev/beam_fixture.py --model share/models/kiln-tiny \
        --out tests/fixtures/beam/kiln_tiny_beam.json
Options: --dtype float32|bfloat16 (default float32: Kiln's CPU path computes in fp32),
--width 4, --max-new-tokens 24.

Then, anywhere with a Kiln build (no torch needed), compare Kiln's beam search with it:
    python3 tools/dev/beam_fixture.py --compare build-cpu/bin/kiln \
        --out tests/fixtures/beam/kiln_tiny_beam.json [--model share/models/kiln-tiny]
runs `kiln generate --ids ... --beam-width W --n W --length-penalty lp --early-stopping es
--max-tokens M --dtype float32 --json` per case and reports, per case, whether the hypotheses'
tokens are the same and the largest score difference (exit 1 on a token mismatch or a score
off by more than --tol, default 1e-3; near-ties between hypotheses can legitimately swap under
different float summation orders, so look at the report rather than only the exit code).
"""
import argparse
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="share/models/kiln-tiny")
    ap.add_argument("--out", default="tests/fixtures/beam/kiln_tiny_beam.json")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--compare", metavar="KILN", help="compare the kiln binary with --out")
    ap.add_argument("--tol", type=float, default=1e-3)
    a = ap.parse_args()
    if a.compare:
        sys.exit(compare(a))

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).to(dev)
    model.eval()
    gc = model.generation_config
    eos = gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]
    prompts = ["Once upon a time", "The weather today is", "What does \"river\" mean?",
               "In the beginning", "A list of fruits:"]
    combos = [(1.0, False), (1.0, True), (1.0, "never"), (0.0, False), (2.0, "never"),
              (-0.5, False)]
    cases = []
    torch.manual_seed(0)
    for p in prompts:
        ids = tok(p, add_special_tokens=True)["input_ids"]
        x = torch.tensor([ids], device=dev)
        for lp, es in combos:
            with torch.no_grad():
                out = model.generate(x, attention_mask=torch.ones_like(x), num_beams=a.width,
                                     num_return_sequences=a.width, do_sample=False,
                                     max_new_tokens=a.max_new_tokens, length_penalty=lp,
                                     early_stopping=es, output_scores=True,
                                     return_dict_in_generate=True)
            seqs = []
            for row in out.sequences.tolist():
                gen = row[len(ids):]
                for i, t in enumerate(gen):
                    if t in eos:
                        gen = gen[:i + 1]
                        break
                seqs.append(gen)
            cases.append({"prompt": p, "prompt_ids": ids, "length_penalty": lp,
                          "early_stopping": es, "sequences": seqs,
                          "sequences_scores": [float(s) for s in out.sequences_scores.tolist()]})
    doc = {"model": os.path.basename(os.path.normpath(a.model)), "dtype": a.dtype,
           "device": dev, "num_beams": a.width, "num_return_sequences": a.width,
           "max_new_tokens": a.max_new_tokens, "eos_token_id": eos,
           "torch": torch.__version__, "transformers": transformers.__version__, "cases": cases}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {len(cases)} cases to {a.out}", file=sys.stderr)


def compare(a):
    import subprocess
    with open(a.out) as f:
        doc = json.load(f)
    bad = 0
    for i, c in enumerate(doc["cases"]):
        es = c["early_stopping"]
        es = "never" if es == "never" else ("true" if es else "false")
        w = doc["num_beams"]
        cmd = [a.compare, "generate", "--model", a.model, "--ids",
               ",".join(str(t) for t in c["prompt_ids"]), "--beam-width", str(w), "--n", str(w),
               "--length-penalty", repr(c["length_penalty"]), "--early-stopping", es,
               "--max-tokens", str(doc["max_new_tokens"]), "--dtype", "float32", "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"case {i}: kiln failed: {out.stderr.strip()}")
            bad += 1
            continue
        got = json.loads(out.stdout.strip().splitlines()[-1])
        toks, scores = got["token_ids"], got["beam_score"]
        if w == 1:
            toks, scores = [toks], [scores]
        same = toks == c["sequences"]
        diff = max(abs(x - y) for x, y in zip(scores, c["sequences_scores"]))
        ok = same and diff <= a.tol
        bad += not ok
        print(f"case {i} ({c['prompt']!r}, lp {c['length_penalty']}, early_stopping {es}): "
              f"tokens {'same' if same else 'DIFFER'}, max score diff {diff:.2e}"
              f"{'' if ok else '  <-- FAIL'}")
        if not same:
            print(f"   transformers: {c['sequences']}\n   kiln:         {toks}")
    print(f"{len(doc['cases']) - bad} of {len(doc['cases'])} cases agree")
    return 1 if bad else 0


if __name__ == "__main__":
    main()
