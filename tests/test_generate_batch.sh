#!/usr/bin/env bash
# test_generate_batch.sh - `kiln generate --input`: 1,000 mixed requests through the engine on a
# fixture model (all answered, in input order, with a summary), greedy and seeded results equal
# to the single-request mode's, text prompts and stop strings with a synthetic tokenizer, and bad
# lines that each get an error line naming their line number while the others still run (an
# unknown field among them: a field the command would drop is refused, never ignored).
# Usage: test_generate_batch.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD=${1:?build dir}
SRC=${2:?source dir}
KILN="$BUILD/bin/kiln"
MODEL="$SRC/tests/fixtures/models/llama2"
TMP=$(mktemp -d /tmp/kiln-genbatch-XXXXXX)
trap 'rm -rf "$TMP"' EXIT
COMMON=(--set backend.name=cpu --set engine.max_num_seqs=64 --set engine.max_num_batched_tokens=1024)

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# ---- 1. 1,000 mixed requests ------------------------------------------------------------------
python3 - "$TMP/mixed.jsonl" <<'EOF'
import json, random, sys
rng = random.Random(1234)
with open(sys.argv[1], "w") as f:
    for i in range(1000):
        r = {"prompt_ids": [rng.randrange(3, 320) for _ in range(rng.randint(1, 40))],
             "max_tokens": rng.randint(1, 16)}
        if i < 8:  # greedy, compared with the single-request mode below
            r.update(temperature=0, ignore_eos=True)
        elif i == 8:  # seeded sampling, compared with the single-request mode below
            r.update(temperature=0.8, top_p=0.9, seed=4242, ignore_eos=True, max_tokens=16)
        else:
            r["temperature"] = rng.choice([0, 0.5, 1.0])
            if rng.random() < 0.5: r["seed"] = rng.randrange(1 << 31)
            if rng.random() < 0.4: r["n"] = rng.randint(2, 3)
            if rng.random() < 0.3: r["stop_token_ids"] = [rng.randrange(3, 320) for _ in range(3)]
            if rng.random() < 0.5: r["ignore_eos"] = True
            if rng.random() < 0.1: r["top_k"] = rng.randint(1, 50)
            if rng.random() < 0.1: r["logprobs"] = rng.randint(0, 3)
            if rng.random() < 0.05: r["custom_id"] = "req-%d" % i  # metadata: allowed, ignored
        f.write(json.dumps(r) + "\n")
        if i % 97 == 0:
            f.write("\n")  # blank lines are skipped
EOF
start=$(date +%s.%N)
"$KILN" generate "${COMMON[@]}" --model "$MODEL" --input "$TMP/mixed.jsonl" \
  --output "$TMP/mixed.out" 2>"$TMP/mixed.err" || {
  rc=$?
  cat "$TMP/mixed.err" >&2
  fail "the mixed batch exited $rc"
}
end=$(date +%s.%N)
cat "$TMP/mixed.err" >&2
grep -q "1000 requests (1000 ok, 0 failed)" "$TMP/mixed.err" || fail "no summary on stderr"
grep -q "tokens/s" "$TMP/mixed.err" || fail "the summary has no tokens/s"
python3 - "$TMP/mixed.jsonl" "$TMP/mixed.out" <<'EOF'
import json, sys
reqs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
outs = [json.loads(l) for l in open(sys.argv[2])]
assert len(outs) == len(reqs) == 1000, (len(outs), len(reqs))
for i, (q, o) in enumerate(zip(reqs, outs)):
    assert o["index"] == i, (i, o)
    assert "error" not in o, (i, o)
    n = q.get("n", 1)
    ids, fin = o["token_ids"], o["finish_reason"]
    if n == 1:
        ids, fin = [ids], [fin]
    assert len(ids) == len(fin) == n, (i, o)
    assert "text" not in o, "the fixture has no tokenizer"
    for s, f in zip(ids, fin):
        assert 1 <= len(s) <= q["max_tokens"], (i, q, o)
        assert all(0 <= t < 320 for t in s), (i, o)
        stops = set(q.get("stop_token_ids", [])) | (set() if q.get("ignore_eos") else {2})
        if f == "length":
            assert len(s) == q["max_tokens"], (i, q, o)
        else:
            assert f == "stop" and s[-1] in stops, (i, q, o)
    u = o["usage"]
    assert u["prompt_tokens"] == len(q["prompt_ids"]), (i, u)
    assert u["completion_tokens"] == sum(len(s) for s in ids), (i, u)
    assert "cached_tokens" in u
    if "logprobs" in q:
        lps = o["logprobs"] if n > 1 else [o["logprobs"]]
        for s, lp in zip(ids, lps):
            assert [e["token_id"] for e in lp] == s, (i, o)
            assert all(e["logprob"] <= 0 for e in lp), (i, o)
            assert all(len(e.get("top_logprobs", [])) == q["logprobs"] for e in lp), (i, o)
    else:
        assert "logprobs" not in o
EOF
echo "mixed batch: 1000 requests in $(python3 -c "print(round($end - $start, 2))") s" >&2

# ---- 2. greedy and seeded results equal the single-request mode's -----------------------------
for i in 0 1 2 3 4 5 6 7 8; do
  read -r ids max extra < <(python3 - "$TMP/mixed.jsonl" "$i" <<'EOF'
import json, sys
q = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][int(sys.argv[2])]
extra = "--temperature 0"
if q["temperature"]:
    extra = "--temperature %g --top-p %g --seed %d" % (q["temperature"], q["top_p"], q["seed"])
print(",".join(map(str, q["prompt_ids"])), q["max_tokens"], extra)
EOF
)
  # shellcheck disable=SC2086
  "$KILN" generate --set backend.name=cpu --model "$MODEL" --ids "$ids" --max-tokens "$max" \
    --ignore-eos --json $extra >"$TMP/single.json"
  python3 - "$TMP/single.json" "$TMP/mixed.out" "$i" <<'EOF'
import json, sys
single = json.load(open(sys.argv[1]))
batch = [json.loads(l) for l in open(sys.argv[2])][int(sys.argv[3])]
assert single["token_ids"] == batch["token_ids"], (sys.argv[3], single, batch)
assert single["finish_reason"] == batch["finish_reason"] == "length"
EOF
done
# The seeded request alone in a batch of one gives the same tokens too.
grep -v '^$' "$TMP/mixed.jsonl" | sed -n 9p >"$TMP/one.jsonl"
"$KILN" generate "${COMMON[@]}" --model "$MODEL" --input "$TMP/one.jsonl" --output "$TMP/one.out" 2>/dev/null
python3 - "$TMP/one.out" "$TMP/mixed.out" <<'EOF'
import json, sys
one = json.loads(open(sys.argv[1]).read())
batch = [json.loads(l) for l in open(sys.argv[2])][8]
assert one["index"] == 0 and one["token_ids"] == batch["token_ids"], (one, batch)
EOF

# ---- 3. text prompts, stop strings: a copy of the fixture with a byte-level tokenizer ---------
mkdir "$TMP/tok"
cp -r "$MODEL/." "$TMP/tok/"
python3 - "$TMP/tok/tokenizer.json" <<'EOF'
import json, sys
# GPT-2's byte-to-character map; ids 0..255 are the bytes, then four merges (as
# tests/test_model_load.c writes it).
vocab, n = {}, 0
for b in range(256):
    if 33 <= b <= 126 or 161 <= b <= 172 or b >= 174:
        vocab[chr(b)] = b
    else:
        vocab[chr(256 + n)] = b
        n += 1
vocab.update({"he": 256, "ll": 257, "\u0120t": 258, "on": 259})
bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
# The model's ids 260..319 (beyond the byte-level vocabulary) decode as "<tN>".
added = [{"id": i, "content": "<t%d>" % i, "single_word": False, "lstrip": False,
          "rstrip": False, "normalized": False, "special": False} for i in range(260, 320)]
tok = {"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": bl,
       "post_processor": None, "decoder": dict(bl, add_prefix_space=True),
       "model": {"type": "BPE", "dropout": None, "unk_token": None,
                 "continuing_subword_prefix": None, "end_of_word_suffix": None,
                 "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                 "merges": ["h e", "l l", "\u0120 t", "o n"]}}
json.dump(tok, open(sys.argv[1], "w"))
EOF
cat >"$TMP/text.jsonl" <<'EOF'
{"prompt": "hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": true}
{"prompt": "once upon a time", "max_tokens": 8, "temperature": 0.7, "seed": 7, "n": 2, "ignore_eos": true}
{"prompt_ids": [104, 105], "max_tokens": 6, "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 2}
EOF
"$KILN" generate "${COMMON[@]}" --model "$TMP/tok" --input "$TMP/text.jsonl" --output "$TMP/text.out" 2>/dev/null
"$KILN" generate --set backend.name=cpu --model "$TMP/tok" --prompt "hello there" --max-tokens 12 \
  --ignore-eos --json >"$TMP/text1.json"
python3 - "$TMP/text.out" "$TMP/text1.json" "$TMP/stop.jsonl" <<'EOF'
import json, sys
outs = [json.loads(l) for l in open(sys.argv[1])]
single = json.load(open(sys.argv[2]))
assert len(outs) == 3
assert outs[0]["token_ids"] == single["token_ids"] and outs[0]["text"] == single["text"], (outs[0], single)
assert single["prompt_ids"] == [256, 257, 111, 258, 256, 114, 101], single
assert isinstance(outs[1]["text"], list) and len(outs[1]["text"]) == 2, outs[1]
assert len(outs[2]["logprobs"]) == 6 and all(len(e["top_logprobs"]) == 2 for e in outs[2]["logprobs"])
# A stop string: a piece from the middle of the greedy text; the output ends before it.
text = outs[0]["text"]
piece = text[4:6] if len(text) >= 6 else None
with open(sys.argv[3], "w") as f:
    f.write(json.dumps({"prompt": "hello there", "max_tokens": 12, "temperature": 0,
                        "ignore_eos": True, "stop": [piece] if piece else ["\u0000never"]}) + "\n")
print(json.dumps({"text": text, "piece": piece}))
EOF
"$KILN" generate "${COMMON[@]}" --model "$TMP/tok" --input "$TMP/stop.jsonl" --output "$TMP/stop.out" 2>/dev/null
python3 - "$TMP/stop.out" "$TMP/text.out" "$TMP/stop.jsonl" <<'EOF'
import json, sys
o = json.loads(open(sys.argv[1]).read())
full = json.loads(open(sys.argv[2]).readline())["text"]
stop = json.loads(open(sys.argv[3]).read())["stop"][0]
cut = full.find(stop)
assert o["finish_reason"] == "stop", o
assert o["text"] == full[:cut], (o["text"], full, stop)
EOF
# The plain single-request mode prints the prompt, then the continuation.
"$KILN" generate --set backend.name=cpu --model "$TMP/tok" --prompt "hello there" --max-tokens 12 \
  --ignore-eos >"$TMP/plain.txt" 2>/dev/null
python3 - "$TMP/plain.txt" "$TMP/text1.json" <<'EOF'
import json, sys
plain = open(sys.argv[1], encoding="utf-8", errors="surrogateescape").read()
want = "hello there" + json.load(open(sys.argv[2]))["text"] + "\n"
assert plain == want, (plain, want)
EOF

# ---- 4. bad lines ------------------------------------------------------------------------------
cat >"$TMP/bad.jsonl" <<'EOF'
{"prompt_ids": [5, 9, 200], "max_tokens": 4, "temperature": 0}
{"prompt_ids": [5, 9,
{"prompt_ids": "x", "max_tokens": 4}

{"max_tokens": 4}
{"prompt_ids": [5, 9, 200], "max_tokens": -3}
{"prompt_ids": [5, 9, 5000], "max_tokens": 4}
{"prompt_ids": [7, 8], "max_tokens": 3, "temperature": 0}
{"prompt_ids": [7, 8], "max_tokens": 3, "temperature": -1}
{"prompt": "no tokenizer", "max_tokens": 3}
[1, 2, 3]
{"prompt_ids": [1], "max_tokens": 2, "n": 2, "seed": 3, "temperature": 1}
{"prompt_ids": [1], "max_tokens": 2, "suffix": "!"}
EOF
rc=0
"$KILN" generate "${COMMON[@]}" --model "$MODEL" --input "$TMP/bad.jsonl" --output "$TMP/bad.out" \
  2>"$TMP/bad.err" || rc=$?
cat "$TMP/bad.err" >&2
[ "$rc" = 1 ] || fail "a batch with bad lines exits $rc, want 1"
python3 - "$TMP/bad.out" "$TMP/bad.err" <<'EOF'
import json, sys
outs = [json.loads(l) for l in open(sys.argv[1])]
err = open(sys.argv[2]).read()
# index -> (input line, a word the message must hold), or None for a good line
want = [None, (2, "invalid JSON"), (3, "prompt_ids"), (5, "no prompt"), (6, "max_tokens"),
        (7, "vocabulary"), None, (9, "temperature"), (10, "tokenizer"), (11, "object"), None,
        (13, 'unknown field "suffix"')]
assert len(outs) == len(want), outs
for i, (o, w) in enumerate(zip(outs, want)):
    assert o["index"] == i, o
    if w is None:
        assert "error" not in o and o["token_ids"], o
    else:
        line, word = w
        assert o["error"].startswith("line %d: " % line), (o, w)
        assert word in o["error"], (o, w)
        assert ("line %d: " % line) in err, (w, err)
assert "12 requests (3 ok, 9 failed)" in err, err
EOF
# Bad options are errors naming the option and the range.
if "$KILN" generate --set backend.name=cpu --model "$MODEL" --ids 1,2 --max-tokens 0 2>"$TMP/opt.err"; then
  fail "--max-tokens 0 accepted"
fi
grep -q -- "--max-tokens wants an integer in \[1, 16777216\]" "$TMP/opt.err" || fail "$(cat "$TMP/opt.err")"
if "$KILN" generate --set backend.name=cpu --model "$MODEL" --input "$TMP/nonexistent.jsonl" 2>"$TMP/opt.err"; then
  fail "a missing --input accepted"
fi
grep -q "nonexistent.jsonl" "$TMP/opt.err" || fail "$(cat "$TMP/opt.err")"
echo "test_generate_batch: all passed" >&2
