#!/usr/bin/env python3
"""make_gguf_vocab.py - writes a vocabulary-only GGUF file (no tensors) from a Hugging Face
tokenizer folder (tokenizer.json, tokenizer_config.json), holding the tokenizer.ggml.* metadata
llama.cpp's converter writes for such a model, so that Kiln's reading of GGUF tokenizers
(models/loader/gguf_vocab.c) can be checked against Hugging Face's own goldens
(tests/data/tokenizer/<name>.jsonl) in test_tokenizer.

What the converter keeps, and so what is written here (standard library only):
  - byte-level BPE vocabularies (no byte_fallback): tokenizer.ggml.model "gpt2", the tokens by
    id, the merges as "left right" strings, tokenizer.ggml.pre naming the pre-tokenizer (given
    with --pre: llama.cpp recognises it by hashing a test text's encoding);
  - SentencePiece BPE vocabularies (byte_fallback): "llama", the pieces and their scores and
    no merges (a SentencePiece model has none: the reader rebuilds them from the scores). A
    tokenizer.json has no scores, so each piece gets minus the rank of the first merge that
    makes it (pieces no merge makes rank after every merge), which orders the rebuilt merges
    as the file's;
  - token types: CONTROL for special added tokens and for added tokens that look special
    ("<|...|>", "<｜...｜>"), USER_DEFINED for other added tokens, BYTE for <0xXX> pieces and
    UNKNOWN for the unk piece of a SentencePiece vocabulary, NORMAL for the rest; an id no
    token has becomes "[PAD<id>]", UNUSED;
  - bos/eos/unk/padding ids, add_bos_token/add_eos_token from what the post-processor adds,
    add_space_prefix from a Prepend normalizer, tokenizer.chat_template.
Usage: make_gguf_vocab.py TOKENIZER_DIR OUT.gguf [--pre NAME] [--into MODEL.gguf]
  --into: OUT is MODEL.gguf (its tensors and other metadata) with this tokenizer's metadata in
  place of its tokenizer.* entries; otherwise OUT holds the vocabulary alone.
       make_gguf_vocab.py --synthetic N|MODEL.gguf DIR: writes a byte-level tokenizer of exactly N ids
  into DIR (tokenizer.json, tokenizer_config.json), for a model fixture of that vocabulary.
"""
import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bytelevel import byte_level_alphabet  # noqa: E402

T_U32, T_I32, T_F32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def gstr(s):
    b = s.encode('utf-8')
    return struct.pack('<Q', len(b)) + b


def kv(key, typ, value):
    out = gstr(key) + struct.pack('<I', typ)
    if typ == T_STRING:
        return out + gstr(value)
    if typ == T_BOOL:
        return out + struct.pack('<B', 1 if value else 0)
    if typ == T_U32:
        return out + struct.pack('<I', value)
    etype, items = value
    out += struct.pack('<IQ', etype, len(items))
    if etype == T_STRING:
        return out + b''.join(gstr(x) for x in items)
    fmt = {T_I32: '<i', T_F32: '<f'}[etype]
    return out + b''.join(struct.pack(fmt, x) for x in items)


def looks_special(t):
    return (t.startswith('<|') and t.endswith('|>')) or (t.startswith('<\uff5c') and t.endswith('\uff5c>'))


def template_ends(post):
    """(adds a token before $A, its content; adds one after $A, its content)."""
    if not post or post.get('type') != 'TemplateProcessing':
        return None, None
    single = post['single']
    seq = next(i for i, e in enumerate(single) if 'Sequence' in e)
    before = [e['SpecialToken']['id'] for e in single[:seq] if 'SpecialToken' in e]
    after = [e['SpecialToken']['id'] for e in single[seq + 1:] if 'SpecialToken' in e]
    tok = lambda name: post['special_tokens'][name]['tokens'][0]
    return (tok(before[0]) if before else None), (tok(after[0]) if after else None)


def vocab_meta(src, pre):
    """The tokenizer.* metadata entries for the tokenizer folder src, as (key, bytes) pairs."""
    tj = json.load(open(f'{src}/tokenizer.json', encoding='utf-8'))
    try:
        cfg = json.load(open(f'{src}/tokenizer_config.json', encoding='utf-8'))
    except FileNotFoundError:
        cfg = {}
    model = tj['model']
    spm = bool(model.get('byte_fallback'))
    vocab = dict(model['vocab'])
    added = {a['id']: a for a in tj.get('added_tokens', [])}
    for i, a in added.items():
        vocab.setdefault(a['content'], i)
    n = max(vocab.values()) + 1
    tokens = [None] * n
    for t, i in vocab.items():
        if tokens[i] is None:
            tokens[i] = t
    types = []
    for i in range(n):
        t = tokens[i]
        if t is None:
            tokens[i] = f'[PAD{i}]'
            types.append(UNUSED)
        elif i in added:
            a = added[i]
            types.append(CONTROL if a['special'] or looks_special(t) else USER_DEFINED)
            if spm and t == model.get('unk_token'):
                types[-1] = UNKNOWN
        elif spm and len(t) == 6 and t.startswith('<0x') and t.endswith('>'):
            types.append(BYTE)
        elif spm and t == model.get('unk_token'):
            types.append(UNKNOWN)
        else:
            types.append(NORMAL)
    merges = [m if isinstance(m, str) else ' '.join(m) for m in model.get('merges', [])]
    meta = [kv('tokenizer.ggml.model', T_STRING, 'llama' if spm else 'gpt2'),
            kv('tokenizer.ggml.tokens', T_ARRAY, (T_STRING, tokens)),
            kv('tokenizer.ggml.token_type', T_ARRAY, (T_I32, types))]
    if spm:
        first = {}
        for rank, m in enumerate(model.get('merges', [])):
            left, right = (m.split(' ', 1) if isinstance(m, str) else m)
            first.setdefault(vocab[left + right], rank)
        def score(i):
            if i in first:
                return -1.0 - first[i]
            return 0.0 if len(tokens[i]) == 1 else -2.0 - len(merges) - i
        scores = [score(i) for i in range(n)]
        meta.append(kv('tokenizer.ggml.scores', T_ARRAY, (T_F32, scores)))
        norm = tj.get('normalizer') or {}
        parts = norm.get('normalizers', [norm])
        prefix = any(p.get('type') == 'Prepend' for p in parts)
        meta.append(kv('tokenizer.ggml.add_space_prefix', T_BOOL, prefix))
    else:
        meta.append(kv('tokenizer.ggml.merges', T_ARRAY, (T_STRING, merges)))
        if pre:
            meta.append(kv('tokenizer.ggml.pre', T_STRING, pre))

    def special(name):
        v = cfg.get(name)
        if isinstance(v, dict):
            v = v.get('content')
        return vocab.get(v) if isinstance(v, str) else None

    before, after = template_ends(tj.get('post_processor'))
    bos = vocab[before] if before else special('bos_token')
    eos = vocab[after] if after else special('eos_token')
    for key, v in (('bos', bos), ('eos', eos), ('padding', special('pad_token'))):
        if v is not None:
            meta.append(kv(f'tokenizer.ggml.{key}_token_id', T_U32, v))
    if spm and model.get('unk_token') in vocab:
        meta.append(kv('tokenizer.ggml.unknown_token_id', T_U32, vocab[model['unk_token']]))
    meta.append(kv('tokenizer.ggml.add_bos_token', T_BOOL, before is not None))
    meta.append(kv('tokenizer.ggml.add_eos_token', T_BOOL, after is not None))
    tpl = cfg.get('chat_template')
    if isinstance(tpl, str):
        meta.append(kv('tokenizer.chat_template', T_STRING, tpl))
    elif isinstance(tpl, list):
        for t in tpl:
            key = 'tokenizer.chat_template' + ('' if t['name'] == 'default' else '.' + t['name'])
            meta.append(kv(key, T_STRING, t['template']))
    return meta


def skip_value(b, pos, typ):
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    if typ in sizes:
        return pos + sizes[typ]
    if typ == T_STRING:
        return pos + 8 + struct.unpack_from('<Q', b, pos)[0]
    etype, count = struct.unpack_from('<IQ', b, pos)
    pos += 12
    for _ in range(count):
        pos = skip_value(b, pos, etype)
    return pos


def merge_into(model, meta, out):
    """model (a GGUF file) with its tokenizer.* entries replaced by meta, written to out."""
    b = open(model, 'rb').read()
    assert b[:4] == b'GGUF'
    version, n_t, n_kv = struct.unpack_from('<IQQ', b, 4)
    pos, kept, align = 24, [], 32
    for _ in range(n_kv):
        start = pos
        klen = struct.unpack_from('<Q', b, pos)[0]
        key = b[pos + 8:pos + 8 + klen].decode()
        typ = struct.unpack_from('<I', b, pos + 8 + klen)[0]
        pos = skip_value(b, pos + 12 + klen, typ)
        if key == 'general.alignment':
            align = struct.unpack_from('<I', b, pos - 4)[0]
        if not key.startswith('tokenizer.'):
            kept.append(b[start:pos])
    infos_start = pos
    for _ in range(n_t):
        nlen = struct.unpack_from('<Q', b, pos)[0]
        nd = struct.unpack_from('<I', b, pos + 8 + nlen)[0]
        pos += 8 + nlen + 4 + 8 * nd + 4 + 8
    infos = b[infos_start:pos]
    data = b[(pos + align - 1) // align * align:]
    head = b'GGUF' + struct.pack('<IQQ', version, n_t, len(kept) + len(meta)) + b''.join(kept + meta) + infos
    head += b'\0' * ((-len(head)) % align)
    with open(out, 'wb') as f:
        f.write(head + data)


SAMPLE = ('Once upon a time there was a little fox who lived in the forest. Every day the fox '
          'ran to the river, and every night the fox slept under the old tree. The end. ') * 4


def synthetic(n, out_dir):
    """A byte-level BPE tokenizer of exactly n ids (256 bytes, merges learned on SAMPLE, then
    <|bos|> and <|eos|>) in the Qwen2 pipeline, written as out_dir/tokenizer.json and
    tokenizer_config.json (with a chat template)."""
    import re
    bc = byte_level_alphabet()
    vocab = {bc[b]: b for b in range(256)}
    words = [tuple(bc[x] for x in w.encode()) for w in re.findall(r' ?[A-Za-z]+| ?[^A-Za-z ]', SAMPLE)]
    merges = []
    while len(vocab) < n - 2:
        counts = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        best = max(sorted(counts), key=lambda p: counts[p])
        merges.append(best)
        vocab[best[0] + best[1]] = len(vocab)
        new = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new.append(tuple(out))
        words = new
    while len(vocab) < n - 2:  # a tiny sample may run out of pairs
        vocab[f'<unused{len(vocab)}>'] = len(vocab)
    added = [{'id': n - 2 + k, 'content': t, 'single_word': False, 'lstrip': False, 'rstrip': False,
              'normalized': False, 'special': True} for k, t in enumerate(('<|bos|>', '<|eos|>'))]
    for a in added:
        vocab[a['content']] = a['id']
    regex = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
             "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
    tj = {'version': '1.0', 'truncation': None, 'padding': None, 'added_tokens': added,
          'normalizer': {'type': 'NFC'},
          'pre_tokenizer': {'type': 'Sequence', 'pretokenizers': [
              {'type': 'Split', 'pattern': {'Regex': regex}, 'behavior': 'Isolated', 'invert': False},
              {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': False, 'use_regex': False}]},
          'post_processor': None,
          'decoder': {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': False, 'use_regex': False},
          'model': {'type': 'BPE', 'dropout': None, 'unk_token': None, 'continuing_subword_prefix': None,
                    'end_of_word_suffix': None, 'fuse_unk': False, 'byte_fallback': False,
                    'ignore_merges': False, 'vocab': {t: i for t, i in vocab.items() if i < n - 2},
                    'merges': [[a, b] for a, b in merges]}}
    cfg = {'bos_token': '<|bos|>', 'eos_token': '<|eos|>', 'add_bos_token': False,
           'chat_template': "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}<|eos|>"
                            "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"}
    os.makedirs(out_dir, exist_ok=True)
    json.dump(tj, open(f'{out_dir}/tokenizer.json', 'w', encoding='utf-8'), ensure_ascii=False)
    json.dump(cfg, open(f'{out_dir}/tokenizer_config.json', 'w', encoding='utf-8'))


def embedding_rows(model):
    """The vocabulary size of a GGUF model: token_embd.weight's outer dimension."""
    b = open(model, 'rb').read()
    _, n_t, n_kv = struct.unpack_from('<IQQ', b, 4)
    pos = 24
    for _ in range(n_kv):
        klen = struct.unpack_from('<Q', b, pos)[0]
        typ = struct.unpack_from('<I', b, pos + 8 + klen)[0]
        pos = skip_value(b, pos + 12 + klen, typ)
    for _ in range(n_t):
        nlen = struct.unpack_from('<Q', b, pos)[0]
        name = b[pos + 8:pos + 8 + nlen]
        nd = struct.unpack_from('<I', b, pos + 8 + nlen)[0]
        ne = struct.unpack_from(f'<{nd}Q', b, pos + 12 + nlen)
        if name == b'token_embd.weight':
            return ne[1]
        pos += 8 + nlen + 4 + 8 * nd + 4 + 8
    raise SystemExit(f'{model}: no token_embd.weight')


def main():
    args = sys.argv[1:]
    if args and args[0] == '--synthetic':
        n = args[1]
        synthetic(int(n) if n.isdigit() else embedding_rows(n), args[2])
        return
    pre = into = None
    for flag in ('--pre', '--into'):
        if flag in args:
            i = args.index(flag)
            if flag == '--pre':
                pre = args[i + 1]
            else:
                into = args[i + 1]
            del args[i:i + 2]
    src, out = args
    meta = vocab_meta(src, pre)
    if into:
        merge_into(into, meta, out)
        return
    meta = [kv('general.architecture', T_STRING, 'llama'),
            kv('general.name', T_STRING, 'vocab of ' + src.rstrip('/').split('/')[-1])] + meta
    with open(out, 'wb') as f:
        f.write(b'GGUF' + struct.pack('<IQQ', 3, 0, len(meta)) + b''.join(meta))


if __name__ == '__main__':
    main()
