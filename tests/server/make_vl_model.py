#!/usr/bin/env python3
"""make_vl_model.py SRC DST - a servable copy of a tiny Qwen2-VL fixture (tests/fixtures/models/
qwen2_vl has weights and configs but no tokenizer): links its files into DST and writes a
tokenizer.json (byte-level BPE over the 256 byte symbols, no merges, with Qwen's special tokens
at their real ids, so <|image_pad|> is the config's image_token_id) and a chat template that
writes <|vision_start|><|image_pad|><|vision_end|> for each image part, as Qwen2-VL's does."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bytelevel import byte_level_alphabet  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
for f in os.listdir(src):
    if f.endswith((".json", ".safetensors")) and f != "reference.json":
        os.symlink(os.path.abspath(os.path.join(src, f)), os.path.join(dst, f))

# The byte-level alphabet: printable bytes stand for themselves, the others are shifted past 255.
sym = byte_level_alphabet()
vocab = {sym[b]: b for b in range(256)}
special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
           "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
           "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
added = [{"id": 151643 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
          "normalized": False, "special": True} for i, t in enumerate(special)]
tok = {
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": True},
    "post_processor": None,
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
              "vocab": vocab, "merges": []},
}
with open(os.path.join(dst, "tokenizer.json"), "w") as f:
    json.dump(tok, f)
template = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor -%}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}")
with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None}, f)
