#!/usr/bin/env python3
"""make_seeds.py - writes the libFuzzer seed corpora, tests/fuzz/corpus/<target>/.

Usage: make_seeds.py [OUT_DIR]   (default: the corpus folder beside this script)

The corpus is this script's output and nothing else: to add a seed, add it here and run the
script again (it removes files it did not write). test_fuzz_corpus checks that the committed
files are what the script writes. Every input is made here from scratch: small hand-made BPE
vocabularies in the real tokenizer.json format, chat templates written in the style of the
real ones, and tiny safetensors and GGUF files packed by hand. Only etc/*.ini is copied (it
is Kiln's own). Standard library only; the output is the same on every run.
"""
import json
import math
import os
import re
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bytelevel import byte_level_alphabet  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# api: the first byte of fuzz_api's input picks the route (kiln_api_kind_t, taken % 4).
ROUTE = {"completions": 0, "chat": 1, "tokenize": 2, "detokenize": 3}


def dumps(v):
    return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))


# ---- api ------------------------------------------------------------------------------------


def api_seeds():
    c, ch, tk, dt = (bytes([ROUTE[k]]) for k in ("completions", "chat", "tokenize", "detokenize"))
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2+2?"}]
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    j = lambda v: dumps(v).encode()  # noqa: E731
    return {
        # completions: every prompt form, the sampling fields, logprobs, streams
        "completions_basic": c + j({"model": "kiln-tiny", "prompt": "Once upon a time",
                                    "max_tokens": 16, "temperature": 0.8}),
        "completions_prompt_list": c + j({"prompt": ["a", "b c"], "n": 2, "best_of": 2}),
        "completions_token_ids": c + j({"prompt": [1, 2, 3, 4999], "max_tokens": 4}),
        "completions_token_id_lists": c + j({"prompt": [[1, 2], [3], [4, 5, 6]]}),
        "completions_sampling": c + j({
            "prompt": "x", "max_tokens": 32, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
            "min_p": 0.05, "seed": 1234, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.1, "logit_bias": {"17": -100, "42": 5.5},
            "stop": ["\n\n", "END"], "stop_token_ids": [2, 7], "include_stop_str_in_output": True,
            "ignore_eos": False, "min_tokens": 2, "skip_special_tokens": False, "priority": 3,
            "user": "u-1"}),
        "completions_logprobs_echo": c + j({"prompt": "hello \u00e9\u4f60\U0001f600",
                                            "logprobs": 5, "echo": True, "prompt_logprobs": 2,
                                            "stop": "."}),
        "completions_stream": c + j({"prompt": "s", "stream": True,
                                     "stream_options": {"include_usage": True,
                                                        "continuous_usage_stats": True}}),
        "completions_bad_max_tokens": c + j({"prompt": "x", "max_tokens": -1}),
        "completions_bad_best_of": c + j({"prompt": "x", "n": 2, "best_of": 3}),
        "completions_bad_suffix": c + j({"prompt": "x", "suffix": "y",
                                         "response_format": {"type": "json_object"}}),
        "completions_bad_types": c + j({"prompt": {"a": 1}, "temperature": "hot", "n": 1.5}),
        "completions_bad_json": c + b'{"prompt": "unterminated, "max_tokens": 1',
        "completions_empty": c,
        # chat: content forms, tools, template kwargs, logprobs
        "chat_basic": ch + j({"model": "kiln-tiny", "messages": msgs}),
        "chat_multi_turn": ch + j({"messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                         {"type": "text", "text": "a joke."}]}],
            "max_completion_tokens": 20, "max_tokens": 5}),
        "chat_tools": ch + j({"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}],
            "tools": tools, "add_generation_prompt": True,
            "chat_template_kwargs": {"enable_thinking": False}}),
        "chat_tool_choice_named": ch + j({"messages": msgs, "tools": tools, "tool_choice": {
            "type": "function", "function": {"name": "get_weather"}}, "stream": True}),
        "chat_tool_choice_required": ch + j({"messages": [
            {"role": "user", "content": "<tool_call>{\"name\": \"get_weather\", \"arguments\": "
                                        "{\"city\": \"Paris\"}}</tool_call>"}],
            "tools": tools, "tool_choice": "required", "parallel_tool_calls": False}),
        "chat_tools_bad": ch + j({"messages": msgs, "tools": [{"type": "function"}, 3],
                                  "tool_choice": "sometimes"}),
        "chat_logprobs_stream": ch + j({"messages": msgs, "logprobs": True, "top_logprobs": 3,
                                        "stream": True, "n": 3, "stop": ["</s>"],
                                        "stream_options": {"include_usage": True}}),
        "chat_bad_part": ch + j({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
        "chat_images": ch + j({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Compare"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "image_url", "image_url": "data:image/jpeg;base64,/9j/4AAQ"},
            {"type": "image_url", "image_url": {"url": "https://127.0.0.1/a.webp"}}]}]}),
        "chat_image_bad_urls": ch + j({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iV*="}},
            {"type": "image_url", "image_url": {"url": "data:image/gif,xyz"}},
            {"type": "image_url", "image_url": {"href": 1}}]}]}),
        "chat_bad_role": ch + j({"messages": [{"content": "no role"}, {"role": 5}]}),
        "chat_no_messages": ch + j({"prompt": "completions field on the chat route"}),
        "chat_bad_top_logprobs": ch + j({"messages": msgs, "logprobs": True,
                                         "top_logprobs": 21}),
        # tokenize / detokenize
        "tokenize_prompt": tk + j({"model": "kiln-tiny", "prompt": "Hello world",
                                   "add_special_tokens": True}),
        "tokenize_messages": tk + j({"messages": msgs, "add_generation_prompt": True,
                                     "add_special_tokens": False}),
        "tokenize_bad": tk + j({"prompt": 12}),
        "detokenize_tokens": dt + j({"model": "kiln-tiny", "tokens": [1, 415, 3186, 2]}),
        "detokenize_bad_ids": dt + j({"tokens": [-1, 5000, 1e3, "7"]}),
        "detokenize_empty": dt + j({"tokens": []}),
    }


# ---- config ---------------------------------------------------------------------------------


def guide_seeds():
    """Constraint specs for fuzz_guide: a kind byte (0 schema, 1 regex, 2 choice, 3 grammar,
    4 json_object), the spec, NUL, a text to run."""
    def seed(kind, spec, text):
        return bytes([kind]) + spec.encode() + b"\0" + text.encode()
    return {
        "schema_object": seed(0, json.dumps({"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
            "required": ["name"]}), '{"name": "ab", "tags": ["a"]}'),
        "schema_ref": seed(0, json.dumps({"$defs": {"n": {"type": "object", "properties": {
            "v": {"type": "number", "minimum": -3, "maximum": 7},
            "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}},
            "$ref": "#/$defs/n"}), '{"v": 1.5, "next": null}'),
        "schema_formats": seed(0, json.dumps({"type": "array", "prefixItems": [
            {"type": "string", "format": "date"}, {"type": "string", "format": "email"},
            {"type": "string", "pattern": "^[A-Z]{2}\\d+$"}], "items": False}),
            '["2024-02-29", "a@b.co", "AB12"]'),
        "regex": seed(1, "(cat|dog)s?[0-9]{1,3}\\.\\w+", "cats12.x"),
        "choice": seed(2, json.dumps(["yes", "no", "caf\u00e9"]), "caf\u00e9"),
        "grammar": seed(3, 'root ::= "(" root ")" | [a-z]* ("," [0-9]{2})?', "((ab,12))"),
        "json_object": seed(4, "", '{"a": [1, {"b": null}]}'),
    }


def config_seeds():
    out = {}
    for rel in ("etc/kiln.ini", "etc/examples/cpu.ini", "etc/examples/nvidia-h100.ini",
                "etc/examples/amd-mi300.ini"):
        with open(os.path.join(ROOT, rel), "rb") as f:
            out[os.path.basename(rel)[:-4]] = f.read()
    near = {
        "minimal": "[model]\npath = /models/Qwen2-7B-Instruct\ndtype = bfloat16\n",
        "overrides": ("# comment\n[engine]\nmax_num_seqs = 64 ; inline comment\nseed = "
                      "9223372036854775807\n[cache]\nblock_size = 32\n"
                      "gpu_memory_utilization = 0.01\nenable_prefix_caching = false\n"
                      "[server]\nhost = ::\nport = 0\napi_key = sk-local\n"),
        "bad_unknown_key": "[engine]\nmax_num_seqs = 8\nno_such_key = 1\n",
        "bad_unknown_section": "[nonsense]\nx = 1\n",
        "bad_range": "[cache]\nblock_size = 24\ngpu_memory_utilization = 1.5\n",
        "bad_types": "[engine]\nmax_num_seqs = many\n[cache]\nenable_prefix_caching = maybe\n",
        "bad_syntax": "[engine\nmax_num_seqs\n= 3\n",
        "key_before_section": "seed = 1\n[engine]\n",
        "duplicate_keys": "[engine]\nseed = 1\nseed = 2\n[engine]\nseed = 3\n",
        "empty_values": "[model]\npath =\ndtype = \n[server]\napi_key=\n",
        "crlf_bom": "\ufeff[engine]\r\nmax_num_seqs = 2\r\n",
    }
    for k, v in near.items():
        out[k] = v.encode()
    return out


# ---- json -----------------------------------------------------------------------------------


def json_seeds():
    hf_config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
        "eos_token_id": [151645, 151643], "bos_token_id": 151643, "use_cache": True}
    deep = "[" * 60 + "{\"k\": 1}" + "]" * 60
    return {
        "hf_config": json.dumps(hf_config, indent=2).encode(),
        "generation_config": b'{"do_sample": true, "temperature": 0.6, "top_p": 0.95, '
                             b'"top_k": 20, "repetition_penalty": 1.05, "eos_token_id": 2}',
        "api_body": dumps({"messages": [{"role": "user", "content": "hi"}],
                           "logit_bias": {"1": -100}}).encode(),
        "scalars": b'[null, true, false, 0, -0, 1, -1, 0.5, -1.5e-10, 1E+308, 2.2250738585072014'
                   b'e-308, 9223372036854775807, -9223372036854775808, 18446744073709551616, '
                   b'123456789012345678901234567890, 1e-400]',
        "strings": b'["", "plain", "esc \\" \\\\ \\/ \\b \\f \\n \\r \\t", "\\u0000\\u001f\\u00e9'
                   b'\\u4f60", "\\ud83d\\ude00", "raw \xc3\xa9 \xe4\xbd\xa0 \xf0\x9f\x98\x80", '
                   b'"\\u2028\\u2029"]',
        "duplicate_keys": b'{"a": 1, "b": 2, "a": 3, "": 4, "": {"a": [], "a": {}}}',
        "nested": deep.encode(),
        "pretty": b'{\n  "list": [\n    1,\n    {"x": []},\n    [[], {}]\n  ],\n  "o": {}\n}\n',
        "whitespace": b' \t\r\n{ "k" :\t"v" , "n":[ 1 , 2 ] }\r\n ',
        "bad_trailing_comma": b'{"a": [1, 2,], }',
        "bad_lone_surrogate": b'["\\ud800", "\\udc00x", "\\ud800\\u0041"]',
        "bad_utf8": b'["\xff\xfe", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80"]',
        "bad_numbers": b'[1e400, 01, 1., .5, -, +1, 1e, 0x10, NaN, Infinity]',
        "bad_control": b'["tab\there", "nl\nhere"]',
        "bad_unterminated": b'{"a": "b',
        "bad_trailing": b'{} {}',
        "bom": b'\xef\xbb\xbf{"a": 1}',
    }


# ---- template -------------------------------------------------------------------------------

# Written for these seeds in the style of the chat templates models ship (ChatML, Llama 3,
# [INST], Gemma turns, DeepSeek's full-width markers), plus one that touches many filters.
TEMPLATES = {
    "chatml_tools_thinking": """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if message.role == "user" and message.content is string and not message.content.startswith('<tool_response>') %}
{%- set ns.last_query = index %}{%- break %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' + content }}
{%- for tc in message.tool_calls or [] %}
{%- set f = tc.function if tc.function else tc %}
{{- '\\n<tool_call>\\n{"name": "' + f.name + '", "arguments": ' }}
{{- f.arguments if f.arguments is string else f.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
""",
    "llama3_header": """\
{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content']|trim %}
{%- set messages = messages[1:] %}
{%- else %}
{%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
{%- if message.content is not none %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] if message['content'] is string else message['content'] | map(attribute='text') | join('\\n')) | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
""",
    "inst_alternating": """\
{%- if messages[0]['role'] == 'system' %}
{%- set loop_messages = messages[1:] %}{%- set system_message = messages[0]['content'] %}
{%- else %}
{%- set loop_messages = messages %}{%- set system_message = false %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- if loop.index0 == 0 and system_message != false %}
{%- set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}
{%- else %}{%- set content = message['content'] %}{%- endif %}
{%- if message['role'] == 'user' %}{{- '[INST] ' + content | trim + ' [/INST]' }}
{%- elif message['role'] == 'assistant' %}{{- ' ' + content | trim + ' ' + eos_token }}
{%- endif %}
{%- endfor %}
""",
    "gemma_turns": """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'assistant') -%}{%- set role = "model" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}
{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
{%- if message['content'] is string -%}{{ message['content'] | trim }}
{%- elif message['content'] is iterable -%}
{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}
{%- elif message['content'] is none -%}{{ '' }}
{%- else -%}{{ raise_exception("Invalid content type") }}{%- endif -%}
{{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{'<start_of_turn>model\\n'}}{%- endif -%}
""",
    "deepseek_markers": """\
{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}
{% set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true) %}
{%- for message in messages %}{%- if message['role'] == 'system' %}
{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}
{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}
{%- endif %}{%- endfor %}
{{ bos_token }}{{ ns.system_prompt }}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<\uff5cUser\uff5c>' + (message['content'] if message['content'] is string else '')}}
{%- elif message['role'] == 'assistant' and message['content'] is none %}
{%- for tool in message['tool_calls'] %}
{{- '<\uff5ctool\u2581call\u2581begin\uff5c>' + (tool['type'] | default('function')) + '<\uff5ctool\u2581sep\uff5c>' + tool['function']['name'] + '\\n```json\\n' + (tool['function']['arguments'] | tojson) + '\\n```<\uff5ctool\u2581call\u2581end\uff5c>' }}
{%- endfor %}
{%- elif message['role'] == 'assistant' %}{{'<\uff5cAssistant\uff5c>' + message['content'] + '<\uff5cend\u2581of\u2581sentence\uff5c>'}}
{%- endif %}
{%- endfor -%}
{% if add_generation_prompt and not ns.is_tool %}{{'<\uff5cAssistant\uff5c>'}}{% endif %}
""",
    "macros_filters": """\
{%- macro render(m, prefix='') -%}
{{ prefix }}{{ m.role | upper }}: {% if m.content is string %}{{ m.content | replace('\\n', ' ') | truncate(40) }}{% elif m.content is none %}(none){% else %}{{ m.content | map(attribute='text') | join(' / ') }}{% endif %}
{%- endmacro -%}
{%- set roles = messages | map(attribute='role') | unique | list -%}
roles={{ roles | join(',') }} n={{ messages | length }} users={{ messages | selectattr('role', 'equalto', 'user') | list | length }}
{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }} {{ render(m, '> ') }}{{ '\\n' if not loop.last }}{% endfor %}
{% set d = {'b': 2, 'a': 1, 'c': [3, 4.5, none, true]} %}{{ d | dictsort | tojson }} {{ d.items() | list | length }} {{ d.get('z', 'dflt') }}
{{ '{}|{}|{}'.format('ab', 7, 2.5) }} {{ [3, 1, 2] | sort | reverse | list }} {{ range(0, 10, 3) | list | sum }}
{{ 'Hello World' | lower | title }} {{ 'a,b,,c'.split(',') }} {{ '  x  '.strip() }}|{{ 'abc'[::-1] }}|{{ 'abc'[1:] }}
{{ tools | tojson(indent=2) }}
{%- if strftime_now is defined %} {{ strftime_now('%Y') | length }}{% endif %}
{%- filter upper %} filtered {{ eos_token }}{% endfilter %}
{% raw %}{{ not parsed }}{% endraw %}{# a comment #}
{%- set x = messages[1]['content'] ~ '|' ~ 1 ~ none %}{{ x }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} {{ -7 / 2 }}
""",
    "loops_recursion": """\
{%- for k, v in {'x': [1, [2, [3]]], 'y': {'z': 'w'}}.items() recursive -%}
{{ k }}={% if v is mapping %}{{ loop(v.items()) }}{% else %}{{ v }}{% endif %};
{%- endfor %}
{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ loop.previtem | default('-') }}{{ i }}{{ loop.cycle('a', 'b') }}{% else %}empty{% endfor %}
{% for m in messages if m.content is not string and m.content is not none %}{% for c in m.content %}{{ c.type }}{% endfor %}{% endfor %}
{%- macro render_list(items) %}{% for i in items %}{{ caller(i) }}{% endfor %}{% endmacro %}
{%- call(x) render_list([1, 2]) %}<{{ x }}>{% endcall %}
""",
    "generation_tag": """\
{%- for message in messages -%}
{%- if message.role == 'assistant' -%}{% generation %}{{ message.content or '' }}{% endgeneration %}
{%- else -%}[{{ message.role }}] {{ message.content if message.content is string else '' }}
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}[assistant] {% endif -%}
""",
    "bad_unclosed": "{% for m in messages %}{{ m.role }}{% if m.content %}x{% endfor %}",
    "bad_unknown_filter": "{{ messages | frobnicate }}{{ messages[0].content | trim(1, 2, 3) }}",
    "bad_raise": "{% if messages | length > 1 %}{{ raise_exception('too many: ' ~ messages | length) }}{% endif %}",
    "bad_mutation": "{% set l = [1] %}{{ l.append(2) }}{{ messages.pop() }}",
    "bad_runaway": "{% for i in range(1000) %}{% for j in range(1000) %}{{ i * j }}{% endfor %}{% endfor %}",
}


def template_seeds():
    return {k: v.encode() for k, v in TEMPLATES.items()}


# ---- tool_parse -----------------------------------------------------------------------------

# Model replies in the tool-call formats (first byte: the format % 4 - hermes, llama3_json,
# mistral, json - and the split pattern), well-formed and not.
def tool_parse_seeds():
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5]}}'
    h, l, m, j = 0, 1, 2, 3
    seeds = {
        "hermes_call": (h, "<tool_call>\n" + call + "\n</tool_call>"),
        "hermes_text_two_calls": (4, "Let me check.\n<tool_call>\n" + call + "\n</tool_call>\n"
                                     "<tool_call>{\"name\": \"now\"}</tool_call> done"),
        "hermes_string_args": (8, '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"}\\"}"}'
                                  '</tool_call>'),
        "hermes_unclosed": (h, "<tool_call>\n" + call + "\n"),
        "hermes_bad_json": (h, "<tool_call>{\"name\": \"f\", </tool_call> <tool_ca"),
        "hermes_plain": (h, "No tools needed: caf\u00e9 \U0001f600 <b>bold</b>"),
        "llama_call": (l, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
        "llama_python_tag_two": (5, '<|python_tag|>{"name": "a", "parameters": {}}; '
                                    '{"name": "b", "parameters": {"x": "\\u00e9"}}'),
        "llama_not_a_call": (l, '{"answer": 42} and text'),
        "mistral_array": (m, "[TOOL_CALLS] [" + call + ', {"name": "g", "arguments": {}}]'),
        "mistral_args_form": (6, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]b'
                                 '[ARGS]{}'),
        "mistral_bad": (m, "Hi [TOOL_CALLS] [{\"name\": 1}] [TOOL_CALLS]x[AR"),
        "json_required": (j, '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'),
        "json_bad": (7, '[{"name": "f", "parameters": {"a": '),
    }
    return {k: bytes([b]) + t.encode() for k, (b, t) in seeds.items()}


# ---- tokenizer ------------------------------------------------------------------------------

TRAIN_TEXT = ("The quick brown fox jumps over the lazy dog. Hello world! It's 2024 and "
              "there are 123 tokens in the tokenizer; they're the ones we'll test. "
              "hello hello HELLO Hello, worlds.\n\nnew lines\tand tabs  double  spaces "
              "caf\u00e9 na\u00efve \u4f60\u597d\u4e16\u754c \U0001f600 <s> end")

# The pre-tokenizer patterns of the tokenizer families (facts of those formats).
SPLIT_LLAMA3 = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?"
                "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
SPLIT_QWEN = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?"
              "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
SPLIT_O200K = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}"
               "\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}"
               "\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}"
               "{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def train_bpe(words, n_merges):
    """Greedy BPE over a list of symbol sequences: merge the most frequent adjacent pair (ties
    by first occurrence) n_merges times. Returns the merges in order."""
    seqs = [list(w) for w in words if w]
    merges = []
    for _ in range(n_merges):
        counts, first = {}, {}
        for s in seqs:
            for a, b in zip(s, s[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
                first.setdefault((a, b), len(first))
        if not counts:
            break
        best = max(counts, key=lambda p: (counts[p], -first[p]))
        if counts[best] < 2:
            break
        merges.append(best)
        for s in seqs:
            i = 0
            while i < len(s) - 1:
                if (s[i], s[i + 1]) == best:
                    s[i:i + 2] = [best[0] + best[1]]
                i += 1
    return merges


def simple_words(text):
    """A rough GPT-style split for training: optional space + letters, digits, punctuation."""
    return re.findall(r" ?[A-Za-z\u00c0-\uffff]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", text)


def bytelevel_model(n_merges=48, merges_as_lists=False, ignore_merges=None):
    table = byte_level_alphabet()
    words = ["".join(table[b] for b in w.encode("utf-8")) for w in simple_words(TRAIN_TEXT)]
    merges = train_bpe(words, n_merges)
    vocab = {}
    for b in range(256):
        vocab[table[b]] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False}
    if ignore_merges is not None:
        model["ignore_merges"] = ignore_merges
    model["vocab"] = vocab
    model["merges"] = [[a, b] for a, b in merges] if merges_as_lists else [a + " " + b for a, b in merges]
    return model


def sentencepiece_model(n_merges=40, merges_as_lists=False, specials=("<unk>", "<s>", "</s>")):
    words = ["\u2581" + w for w in TRAIN_TEXT.replace("\n", " ").split(" ") if w]
    merges = train_bpe(words, n_merges)
    vocab = {}
    for s in specials:
        vocab[s] = len(vocab)
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for ch in sorted(set("".join(words))):
        vocab.setdefault(ch, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    model = {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True}
    model["vocab"] = vocab
    model["merges"] = [[a, b] for a, b in merges] if merges_as_lists else [a + " " + b for a, b in merges]
    return model


def added(tid, content, special=True, lstrip=False, rstrip=False, single_word=False, normalized=False):
    return {"id": tid, "content": content, "single_word": single_word, "lstrip": lstrip,
            "rstrip": rstrip, "normalized": normalized, "special": special}


def tokenizer_file(model, normalizer, pre_tokenizer, post_processor, decoder, added_tokens):
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens,
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor, "decoder": decoder, "model": model}


def byte_level(add_prefix_space=False, trim_offsets=True, use_regex=False):
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": trim_offsets,
            "use_regex": use_regex}


def split(pattern, behavior="Isolated", invert=False, string=False):
    return {"type": "Split", "pattern": {"String" if string else "Regex": pattern},
            "behavior": behavior, "invert": invert}


def template_processing(bos, bos_id):
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def sp_decoder(strip=True):
    d = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
         {"type": "ByteFallback"}, {"type": "Fuse"}]
    if strip:
        d.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {"type": "Sequence", "decoders": d}


def tokenizer_jsons():
    out = {}
    # Llama 3 style: byte-level BPE, the 3-digit split, specials after the vocabulary.
    m = bytelevel_model(ignore_merges=True)
    n = len(m["vocab"])
    out["llama3_style"] = tokenizer_file(
        m, None, {"type": "Sequence", "pretokenizers": [split(SPLIT_LLAMA3), byte_level()]},
        {"type": "Sequence", "processors": [
            byte_level(True, False, True),
            template_processing("<|begin_of_text|>", n)]},
        byte_level(True, True, True),
        [added(n, "<|begin_of_text|>"), added(n + 1, "<|end_of_text|>"), added(n + 2, "<|eot_id|>")])
    # Qwen style: NFC, single-digit split, merges as pairs, no BOS.
    m = bytelevel_model(merges_as_lists=True, ignore_merges=False)
    m["continuing_subword_prefix"] = ""
    m["end_of_word_suffix"] = ""
    n = len(m["vocab"])
    out["qwen_style"] = tokenizer_file(
        m, {"type": "NFC"},
        {"type": "Sequence", "pretokenizers": [split(SPLIT_QWEN), byte_level(False, False, False)]},
        byte_level(False, False, False), byte_level(False, False, False),
        [added(n, "<|endoftext|>"), added(n + 1, "<|im_start|>"), added(n + 2, "<|im_end|>"),
         added(n + 3, "<think>", special=False), added(n + 4, "</think>", special=False)])
    # o200k style: the pattern's matches kept by an inverted Removed split.
    m = bytelevel_model(n_merges=32)
    n = len(m["vocab"])
    out["o200k_style"] = tokenizer_file(
        m, None,
        {"type": "Sequence", "pretokenizers": [split(SPLIT_O200K, "Removed", True), byte_level()]},
        None, byte_level(True, True, True), [added(n, "<|endoftext|>"), added(n + 1, "<|endofprompt|>")])
    # DeepSeek V3 style: empty normalizer sequence, three splits in a row.
    m = bytelevel_model(n_merges=40)
    n = len(m["vocab"])
    out["deepseek_style"] = tokenizer_file(
        m, {"type": "Sequence", "normalizers": []},
        {"type": "Sequence", "pretokenizers": [
            split("\\p{N}{1,3}"), split("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"),
            split("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
                  "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"),
            byte_level()]},
        byte_level(True, False, True), byte_level(True, True, True),
        [added(n, "<\uff5cbegin\u2581of\u2581sentence\uff5c>"),
         added(n + 1, "<\uff5cend\u2581of\u2581sentence\uff5c>")])
    # Llama 2 style (SentencePiece BPE): prepend + replace normalizer, byte fallback.
    m = sentencepiece_model()
    out["llama2_style"] = tokenizer_file(
        m, {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                {"type": "Replace", "pattern": {"String": " "},
                                                 "content": "\u2581"}]},
        None, template_processing("<s>", 1), sp_decoder(True),
        [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")])
    # Gemma style: replace normalizer, split on " " merged with the previous piece.
    m = sentencepiece_model(merges_as_lists=True, specials=("<pad>", "<eos>", "<bos>", "<unk>"))
    out["gemma_style"] = tokenizer_file(
        m, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        split(" ", "MergedWithPrevious", False, string=True), template_processing("<bos>", 2),
        sp_decoder(False),
        [added(0, "<pad>"), added(1, "<eos>"), added(2, "<bos>"), added(3, "<unk>"),
         added(len(m["vocab"]), "<start_of_turn>"), added(len(m["vocab"]) + 1, "<end_of_turn>")])
    # Metaspace pre-tokenizer and decoder (older SentencePiece exports), with added-token flags.
    m = sentencepiece_model(n_merges=24)
    n = len(m["vocab"])
    out["metaspace_style"] = tokenizer_file(
        m, {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"},
                                                {"type": "Replace", "pattern": {"Regex": "\\s{2,}"},
                                                 "content": " "}]},
        {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True}]},
        template_processing("<s>", 1),
        {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True},
        [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>"),
         added(n, "<mask>", lstrip=True, rstrip=True), added(n + 1, "hello", special=False, single_word=True),
         added(n + 2, "WORLD", special=False, normalized=True)])
    # BERT-like components on a BPE model: NFD + StripAccents, Whitespace/Punctuation splits.
    m = bytelevel_model(n_merges=16)
    n = len(m["vocab"])
    out["bert_components"] = tokenizer_file(
        m, {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "StripAccents"},
                                                {"type": "Lowercase"}]},
        {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"}, {"type": "Punctuation", "behavior": "Isolated"},
            {"type": "Whitespace"}, byte_level()]},
        {"type": "BertProcessing", "sep": ["[SEP]", n + 1], "cls": ["[CLS]", n]},
        byte_level(), [added(n, "[CLS]"), added(n + 1, "[SEP]")])
    # A roberta post-processor and merged-with-next / contiguous splits.
    m = bytelevel_model(n_merges=16)
    n = len(m["vocab"])
    out["roberta_components"] = tokenizer_file(
        m, None,
        {"type": "Sequence", "pretokenizers": [
            split("\\s", "MergedWithNext"), split("\\d", "Contiguous"), byte_level(True, True, True)]},
        {"type": "RobertaProcessing", "sep": ["</s>", n + 1], "cls": ["<s>", n], "trim_offsets": True,
         "add_prefix_space": True},
        byte_level(), [added(n, "<s>"), added(n + 1, "</s>")])
    return out


TOKENIZER_TEXTS = {
    "text_ascii": "Hello world 123! It's the quick brown fox.",
    "text_specials": "<s> ab CD <m>x</m> <m> abab ab, CD cd <s><s>",
    "text_unicode": "caf\u00e9 \u4f60\u597d \U0001f600 \u00c5\u212b e\u0301 \uff21\uff11",
    "text_whitespace": "  a\n\n\n b\t\t c    d\r\n",
    "text_digits": "1234567890 3.14159 -42 1e10",
}


def tokenizer_seeds():
    out = {}
    for k, v in tokenizer_jsons().items():
        out[k] = b"\x00" + json.dumps(v, ensure_ascii=False).encode()
    # near-valid: a merge naming an unknown token, an unknown component, ids that collide
    bad = bytelevel_model(n_merges=4)
    bad["merges"].append("zz qq")
    out["bad_merge"] = b"\x00" + json.dumps(tokenizer_file(bad, None, byte_level(), None, byte_level(), [])).encode()
    out["bad_component"] = b"\x00" + json.dumps(tokenizer_file(
        bytelevel_model(n_merges=4), {"type": "Frobnicate"}, None, None, None, [])).encode()
    dup = sentencepiece_model(n_merges=4)
    out["bad_added_id"] = b"\x00" + json.dumps(tokenizer_file(
        dup, None, None, None, None, [added(1, "<other>"), added(-5, "<neg>")])).encode()
    out["bad_model_type"] = b"\x00" + b'{"model": {"type": "WordPiece", "vocab": {"a": 0}}}'
    # odd first byte: text for the target's fixed tokenizer
    for k, v in TOKENIZER_TEXTS.items():
        out[k] = b"\x01" + v.encode()
    out["text_invalid_utf8"] = b"\x01" + b"ok \xff\xfe \xc3 \xe4\xbd \xf0\x9f\x98 end"
    out["text_ids"] = b"\x03" + bytes(range(0, 48)) + bytes(range(47, -1, -3))
    return out


# ---- weights --------------------------------------------------------------------------------


def f16_bytes(values):
    return b"".join(struct.pack("<e", v) for v in values)


def bf16_bytes(values):
    return b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:]
                    for v in values)


def f32_bytes(values):
    return struct.pack("<%df" % len(values), *values)


def q8_0_bytes(values):
    """ggml's q8_0: blocks of 32 values, an f16 scale then 32 int8 (value = scale * q)."""
    out = b""
    for i in range(0, len(values), 32):
        block = values[i:i + 32]
        amax = max(abs(v) for v in block)
        d = amax / 127 if amax else 0.0
        qs = [int(round(v / d)) if d else 0 for v in block]
        out += struct.pack("<e", d) + struct.pack("<32b", *qs)
    return out


def ramp(n, scale=0.02):
    return [math.sin(i * 0.7) * scale for i in range(n)]


def encode(values, dtype):
    return {"F32": f32_bytes, "F16": f16_bytes, "BF16": bf16_bytes}[dtype](values)


def safetensors(tensors, metadata=None, pad=True):
    """tensors: [(name, dtype, shape, raw bytes)] -> file bytes (header padded to 8 with
    spaces, as the reference writer does)."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def gguf_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


GG = {"u8": 0, "i8": 1, "u16": 2, "i16": 3, "u32": 4, "i32": 5, "f32": 6, "bool": 7, "string": 8,
      "array": 9, "u64": 10, "i64": 11, "f64": 12}
GG_FMT = {"u8": "<B", "i8": "<b", "u16": "<H", "i16": "<h", "u32": "<I", "i32": "<i", "f32": "<f",
          "bool": "<?", "u64": "<Q", "i64": "<q", "f64": "<d"}
GGML = {"F32": 0, "F16": 1, "Q8_0": 8, "BF16": 30}


def gguf_value(kind, v):
    if kind == "string":
        return gguf_str(v)
    if kind.startswith("array:"):
        et = kind[6:]
        return struct.pack("<IQ", GG[et.split(":")[0]], len(v)) + b"".join(gguf_value(et, x) for x in v)
    return struct.pack(GG_FMT[kind], v)


def gguf(kvs, tensors, version=3, align=32):
    """kvs: [(key, kind, value)]; tensors: [(name, ggml type (a GGML key or a number), ne
    innermost first, raw bytes)]."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, kind, v in kvs:
        et = "array" if kind.startswith("array:") else kind
        out += gguf_str(key) + struct.pack("<I", GG[et]) + gguf_value(kind, v)
    data, offsets = b"", []
    for _, _, _, raw in tensors:
        data += b"\0" * (-len(data) % align)
        offsets.append(len(data))
        data += raw
    for (name, t, ne, _), off in zip(tensors, offsets):
        out += gguf_str(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        out += struct.pack("<IQ", GGML.get(t, t), off)
    out += b"\0" * (-len(out) % align)
    return out + data


def tiny_llama(arch="llama", dtype="F16", hidden=32, ffn=32, vocab=16, heads=4, kv_heads=2,
               biases=False, qk_norm=False, q8_names=(), extra_kvs=(), tied=True, rope_freqs=False):
    head_dim = hidden // heads

    def t(name, ne, ty=None):
        ty = ty or ("Q8_0" if name in q8_names else dtype)
        n = 1
        for d in ne:
            n *= d
        vals = ramp(n)
        raw = q8_0_bytes(vals) if ty == "Q8_0" else encode(vals, ty)
        return (name, ty, ne, raw)

    ts = [t("token_embd.weight", [hidden, vocab]), t("output_norm.weight", [hidden], "F32")]
    if not tied:
        ts.append(t("output.weight", [hidden, vocab]))
    p = "blk.0."
    ts += [t(p + "attn_norm.weight", [hidden], "F32"), t(p + "ffn_norm.weight", [hidden], "F32"),
           t(p + "attn_q.weight", [hidden, hidden]), t(p + "attn_k.weight", [hidden, kv_heads * head_dim]),
           t(p + "attn_v.weight", [hidden, kv_heads * head_dim]), t(p + "attn_output.weight", [hidden, hidden]),
           t(p + "ffn_gate.weight", [hidden, ffn]), t(p + "ffn_up.weight", [hidden, ffn]),
           t(p + "ffn_down.weight", [ffn, hidden])]
    if biases:
        ts += [t(p + "attn_q.bias", [hidden], "F32"), t(p + "attn_k.bias", [kv_heads * head_dim], "F32"),
               t(p + "attn_v.bias", [kv_heads * head_dim], "F32")]
    if qk_norm:
        ts += [t(p + "attn_q_norm.weight", [head_dim], "F32"), t(p + "attn_k_norm.weight", [head_dim], "F32")]
    if rope_freqs:
        ts.append(("rope_freqs.weight", "F32", [head_dim // 2], f32_bytes([1.0] * (head_dim // 2))))
    kvs = [("general.architecture", "string", arch), ("general.name", "string", "fuzz-tiny"),
           (arch + ".context_length", "u32", 128), (arch + ".embedding_length", "u32", hidden),
           (arch + ".block_count", "u32", 1), (arch + ".feed_forward_length", "u32", ffn),
           (arch + ".attention.head_count", "u32", heads),
           (arch + ".attention.head_count_kv", "u32", kv_heads),
           (arch + ".attention.layer_norm_rms_epsilon", "f32", 1e-5),
           (arch + ".rope.freq_base", "f32", 10000.0),
           ("general.alignment", "u32", 32),
           ("tokenizer.ggml.model", "string", "gpt2"),
           ("tokenizer.ggml.tokens", "array:string", ["<s>", "</s>"] + ["t%d" % i for i in range(vocab - 2)]),
           ("tokenizer.ggml.token_type", "array:i32", [3, 3] + [1] * (vocab - 2)),
           ("tokenizer.ggml.bos_token_id", "u32", 0), ("tokenizer.ggml.eos_token_id", "u32", 1)]
    kvs += list(extra_kvs)
    return kvs, ts


def weights_seeds():
    out = {}
    out["st_f32"] = safetensors([("a", "F32", [2, 3], f32_bytes([1, -2, 3.5, 0, -0.0, 1e-40]))])
    out["st_mixed"] = safetensors(
        [("model.embed_tokens.weight", "BF16", [4, 8], bf16_bytes(ramp(32, 3.0))),
         ("model.norm.weight", "F16", [8], f16_bytes([1.0, -1.0, 65504.0, 6e-8, float("inf"),
                                                       float("-inf"), float("nan"), 0.0])),
         ("scalar", "F32", [], f32_bytes([7.0])),
         ("empty", "F16", [0, 4], b"")],
        metadata={"format": "pt"})
    out["st_unpadded"] = safetensors([("x", "F16", [3], f16_bytes([1, 2, 3]))], pad=False)
    out["st_bad_dtype"] = safetensors([("x", "I64", [1], b"\0" * 8)])
    overlap = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
                         separators=(",", ":")).encode()
    out["st_bad_overlap"] = struct.pack("<Q", len(overlap)) + overlap + b"\0" * 12
    out["st_bad_header_len"] = struct.pack("<Q", 1 << 40) + b'{"a":{}}'
    kvs, ts = tiny_llama()
    out["gguf_llama_f16"] = gguf(kvs, ts)
    kvs, ts = tiny_llama(dtype="F32", q8_names=("blk.0.ffn_up.weight", "blk.0.attn_q.weight"),
                         tied=False, rope_freqs=True,
                         extra_kvs=[("llama.rope.scaling.type", "string", "linear"),
                                    ("llama.rope.scaling.factor", "f32", 2.0)])
    out["gguf_llama_q8_0"] = gguf(kvs, ts)
    kvs, ts = tiny_llama(arch="qwen2", dtype="BF16", biases=True,
                         extra_kvs=[("qwen2.rope.scaling.type", "string", "yarn"),
                                    ("qwen2.rope.scaling.factor", "f32", 4.0),
                                    ("qwen2.rope.scaling.original_context_length", "u32", 64),
                                    ("qwen2.attention.sliding_window", "u32", 64)])
    out["gguf_qwen2_bf16_v2"] = gguf(kvs, ts, version=2)
    kvs, ts = tiny_llama(arch="qwen3", qk_norm=True,
                         extra_kvs=[("qwen3.attention.key_length", "u32", 8),
                                    ("qwen3.attention.value_length", "u32", 8),
                                    ("tokenizer.ggml.eot_token_id", "i32", 1),
                                    ("misc.nested", "array:array:u8", [[1, 2], []]),
                                    ("misc.f64", "f64", 0.5), ("misc.i64", "i64", -1),
                                    ("misc.bool", "bool", True), ("misc.i16", "i16", -2),
                                    ("misc.u16", "u16", 2), ("misc.i8", "i8", -3), ("misc.u8", "u8", 3)])
    out["gguf_qwen3_f16"] = gguf(kvs, ts)
    kvs, ts = tiny_llama()
    out["gguf_bad_arch"] = gguf([("general.architecture", "string", "mamba")] + kvs[1:], ts)
    out["gguf_bad_q4_0"] = gguf(kvs, [("token_embd.weight", 2, [32, 16], b"\0" * 288)] + ts[1:])
    out["gguf_bad_truncated"] = gguf(kvs, ts)[:-100]
    out["gguf_header_only"] = b"GGUF" + struct.pack("<IQQ", 3, 0, 0)
    # Vocabulary-only files: the tokenizer in the metadata (models/loader/gguf_vocab.c).
    bl = ["a", "b", "ab", "\u0120", "\u0120ab", "<|end|>"]
    out["gguf_vocab_gpt2"] = gguf(
        [("tokenizer.ggml.model", "string", "gpt2"), ("tokenizer.ggml.pre", "string", "qwen2"),
         ("tokenizer.ggml.tokens", "array:string", bl),
         ("tokenizer.ggml.token_type", "array:i32", [1, 1, 1, 1, 1, 3]),
         ("tokenizer.ggml.merges", "array:string", ["a b", "\u0120 ab"]),
         ("tokenizer.ggml.eos_token_id", "u32", 5), ("tokenizer.ggml.add_bos_token", "bool", False),
         ("tokenizer.chat_template", "string", "{% for m in messages %}{{ m.content }}{% endfor %}")], [])
    spm = ["<unk>", "<s>", "</s>", "<0x21>", "\u2581", "a", "b", "ab", "\u2581a", "\u2581ab"]
    out["gguf_vocab_spm"] = gguf(
        [("tokenizer.ggml.model", "string", "llama"), ("tokenizer.ggml.tokens", "array:string", spm),
         ("tokenizer.ggml.scores", "array:f32", [0.0, 0, 0, 0, -1, -2, -3, -4, -5, -6]),
         ("tokenizer.ggml.token_type", "array:i32", [2, 3, 3, 6, 1, 1, 1, 1, 1, 1]),
         ("tokenizer.ggml.bos_token_id", "u32", 1), ("tokenizer.ggml.eos_token_id", "u32", 2),
         ("tokenizer.ggml.unknown_token_id", "u32", 0),
         ("tokenizer.chat_template.tool_use", "string", "{{ bos_token }}")], [])
    return out


# ---- main -----------------------------------------------------------------------------------


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "corpus")
    corpora = {"api": api_seeds(), "config": config_seeds(), "guide": guide_seeds(), "json": json_seeds(),
               "template": template_seeds(), "tokenizer": tokenizer_seeds(),
               "tool_parse": tool_parse_seeds(),
               "weights": weights_seeds()}
    total = 0
    for target, seeds in corpora.items():
        d = os.path.join(out_dir, target)
        os.makedirs(d, exist_ok=True)
        for name in os.listdir(d):
            if name not in seeds:
                os.remove(os.path.join(d, name))
        for name, data in seeds.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
            total += len(data)
    print("make_seeds: %d files, %d bytes in %s" % (sum(map(len, corpora.values())), total, out_dir))


if __name__ == "__main__":
    main()
