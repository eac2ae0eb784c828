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
    a = ap.parse_args()

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


if __name__ == "__main__":
    main()
