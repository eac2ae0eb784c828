#!/usr/bin/env bash
# test_generate_images.sh - `kiln generate --image` on the tiny Qwen2-VL fixture: with the
# fixture's own prompt ids (one placeholder per image) and its image files, the greedy tokens and
# the first logprob are transformers' (reference.json); --image + --prompt renders the chat
# template (a servable copy of the fixture, tests/server/make_vl_model.py) and gives the same
# result as a --messages file naming the file, and as one holding it as a data URL; usage counts
# the image tokens; bad input exits 1 naming the image: a missing file, an unsupported format, a
# truncated file, an image for a text-only model, --image with --input. The same requests as
# --input lines ("images" with "prompt" or "prompt_ids", "messages" with a data URL) give the
# one-request results, and bad lines fail alone, naming the field. `kiln score --image`
# gives transformers' logits at every position within 1e-4 (Kiln's own preprocessing).
# Usage: test_generate_images.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD=${1:?build dir}
SRC=${2:?source dir}
KILN="$BUILD/bin/kiln"
FIX="$SRC/tests/fixtures/models/qwen2_vl"
TMP=$(mktemp -d /tmp/kiln-genimg-XXXXXX)
trap 'rm -rf "$TMP"' EXIT
S=(--set backend.name=cpu --set backend.threads=2 --set model.dtype=float32)

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# ---- 1. transformers' greedy tokens from the image files --------------------------------------
for name in one_image two_images image_mid max_pixels; do
  read -r ids images want lp < <(python3 - "$FIX/reference.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
p = next(p for p in r["prompts"] if p["name"] == sys.argv[2])
ids, img = [], r["image_token_id"]
for t in p["input_ids"]:
    if not (t == img and ids and ids[-1] == img):
        ids.append(t)
n = len(p["input_ids"])
print(",".join(map(str, ids)), ",".join(p["images"]), ",".join(map(str, p["greedy"]["token_ids"])),
      p["max_logit"][n - 1] - p["logsumexp"][n - 1])
PY
  )
  args=()
  IFS=, read -r -a files <<<"$images"
  for f in "${files[@]}"; do args+=(--image "$FIX/images/$f"); done
  "$KILN" generate --model "$FIX" "${S[@]}" --ids "$ids" "${args[@]}" --max-tokens 8 \
    --temperature 0 --ignore-eos --logprobs 0 --json >"$TMP/$name.json"
  python3 - "$TMP/$name.json" "$want" "$lp" "$name" <<'PY' || fail "$name: not transformers' result (above)"
import json, sys
j = json.load(open(sys.argv[1]))
want = [int(x) for x in sys.argv[2].split(",")]
got = j["token_ids"]
if got != want:
    sys.exit(f"{sys.argv[4]}: tokens {got}, transformers {want}")
lp = j["logprobs"][0]["logprob"]
if abs(lp - float(sys.argv[3])) > 1e-4:
    sys.exit(f"{sys.argv[4]}: first logprob {lp}, transformers {sys.argv[3]}")
print(f"{sys.argv[4]}: transformers' 8 tokens, first logprob {lp:.6f} (want {float(sys.argv[3]):.6f}), "
      f"{j['usage']['prompt_tokens']} prompt tokens")
PY
done

# ---- 2. the chat template: --image + --prompt, --messages with a path, with a data URL ---------
python3 "$SRC/tests/server/make_vl_model.py" "$FIX" "$TMP/vl"
IMG="$FIX/images/landscape.png"
G=(generate --model "$TMP/vl" "${S[@]}" --max-tokens 4 --temperature 0 --ignore-eos --logprobs 0 --json)
"$KILN" "${G[@]}" --image "$IMG" --prompt "Describe this image." >"$TMP/p.json"
"$KILN" "${G[@]}" --prompt "Describe this image." >"$TMP/t.json" # no image, no template
python3 - "$IMG" "$TMP/m1.json" "$TMP/m2.json" <<'PY'
import base64, json, sys
img = sys.argv[1]
url = "data:image/png;base64," + base64.b64encode(open(img, "rb").read()).decode()
for path, u in ((sys.argv[2], img), (sys.argv[3], url)):
    json.dump({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}},
                                                         {"type": "text", "text": "Describe this image."}]}]},
              open(path, "w"))
PY
"$KILN" "${G[@]}" --messages "$TMP/m1.json" >"$TMP/m1.out"
"$KILN" "${G[@]}" --messages "$TMP/m2.json" >"$TMP/m2.out"
python3 - "$TMP/p.json" "$TMP/m1.out" "$TMP/m2.out" <<'PY' || fail "the chat forms disagree (above)"
import json, sys
a, b, c = (json.load(open(p)) for p in sys.argv[1:4])
for x in (b, c):
    for k in ("prompt_ids", "token_ids", "usage"):
        if x[k] != a[k]:
            sys.exit(f"{k}: {x[k]} != {a[k]}")
    if [t["logprob"] for t in x["logprobs"]] != [t["logprob"] for t in a["logprobs"]]:
        sys.exit("logprobs differ")
ids = a["prompt_ids"]
if ids.count(151655) != 1 or ids[ids.index(151655) - 1] != 151652:
    sys.exit(f"the rendered prompt has no <|vision_start|><|image_pad|>: {ids}")
# 15 image tokens for the one placeholder
if a["usage"]["prompt_tokens"] != len(ids) + 14:
    sys.exit(f"usage {a['usage']} for {len(ids)} prompt ids")
print(f"chat: --image/--prompt, --messages (path), --messages (data URL) agree: {a['usage']}")
PY

# ---- 2b. the same requests as --input lines: "images" with "prompt", "messages", and "images"
# with "prompt_ids", in one batch with a text line; each must equal its one-request run ----------
python3 - "$IMG" "$TMP/p.json" "$TMP/batch.jsonl" <<'PY'
import base64, json, sys
img, single, out = sys.argv[1:4]
url = "data:image/png;base64," + base64.b64encode(open(img, "rb").read()).decode()
ids = json.load(open(single))["prompt_ids"]
common = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0}
lines = [dict(common, prompt="Describe this image.", images=[img]),
         dict(common, messages=[{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": url}},
             {"type": "text", "text": "Describe this image."}]}]),
         dict(common, prompt="Describe this image."),
         dict(common, prompt_ids=ids, images=["file://" + img]),
         dict(common, prompt="x", suffix="!"),
         dict(common, prompt="x", images=[img + ".none"]),
         dict(common, messages=[{"role": "user", "content": "hi"}], prompt="x")]
with open(out, "w") as f:
    for l in lines:
        f.write(json.dumps(l) + "\n")
PY
rc=0
"$KILN" generate --model "$TMP/vl" "${S[@]}" --input "$TMP/batch.jsonl" >"$TMP/batch.out" 2>"$TMP/batch.err" || rc=$?
[ "$rc" = 1 ] || fail "--input with images: exit $rc, want 1 (three bad lines): $(cat "$TMP/batch.err")"
python3 - "$TMP/p.json" "$TMP/t.json" "$TMP/batch.out" <<'PY' || fail "--input with images (above)"
import json, sys
img, txt = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
rows = [json.loads(l) for l in open(sys.argv[3])]
assert [r["index"] for r in rows] == list(range(7)), rows
for i in (0, 1, 3):
    r = rows[i]
    assert "error" not in r, (i, r)
    got = (r["token_ids"], r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"])
    want = (img["token_ids"], img["usage"]["prompt_tokens"], img["usage"]["completion_tokens"])
    if got != want:
        sys.exit(f"line {i + 1}: {got} != the one-request run's {want}")
    if [t["logprob"] for t in r["logprobs"]] != [t["logprob"] for t in img["logprobs"]]:
        sys.exit(f"line {i + 1}: logprobs differ from the one-request run")
if rows[2]["token_ids"] != txt["token_ids"]:
    sys.exit("the text line differs from its one-request run")
want = ['unknown field "suffix"', "images[0]", '"messages" holds the whole chat']
for i, w in zip((4, 5, 6), want):
    if w not in rows[i].get("error", ""):
        sys.exit(f"line {i + 1}: error {rows[i].get('error')!r} lacks {w!r}")
print("--input: images with prompt, messages, images with prompt_ids agree with single runs; "
      "bad lines refused")
PY

# ---- 3. kiln score --image: every position's logits, in chunks of 7 that split the images -------
for name in two_images image_mid; do
  read -r ids images < <(python3 - "$FIX/reference.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
p = next(p for p in r["prompts"] if p["name"] == sys.argv[2])
ids, img = [], r["image_token_id"]
for t in p["input_ids"]:
    if not (t == img and ids and ids[-1] == img):
        ids.append(t)
print(",".join(map(str, ids)), ",".join(p["images"]))
PY
  )
  args=()
  IFS=, read -r -a files <<<"$images"
  for f in "${files[@]}"; do args+=(--image "$FIX/images/$f"); done
  "$KILN" score --model "$FIX" "${S[@]}" --ids "$ids" "${args[@]}" --chunk 7 --out "$TMP/$name.npy"
  python3 - "$FIX" "$name" "$TMP/$name.npy" <<'PY' || fail "score $name: not transformers' logits (above)"
import array, ast, json, sys
def npy(path):
    b = open(path, "rb").read()
    hl = int.from_bytes(b[8:10], "little")
    h = ast.literal_eval(b[10:10 + hl].decode())
    assert h["descr"] == "<f4" and not h["fortran_order"], h
    a = array.array("f")
    a.frombytes(b[10 + hl:])
    return a, h["shape"]
fix, name, got = sys.argv[1:4]
r = json.load(open(fix + "/reference.json"))
p = next(p for p in r["prompts"] if p["name"] == name)
a, (T, V) = npy(got)
ref, (RT, C) = npy(fix + "/" + p["logits_file"])
if not T == RT == len(p["input_ids"]):
    sys.exit(f"{T} rows, transformers {RT}")
cols = p["logit_cols"]
err = max(abs(a[t * V + cols[k]] - ref[t * C + k]) for t in range(T) for k in range(C))
rel = err / max(abs(x) for x in ref)
print(f"score {name}: {T} rows, max |kiln - transformers| / max |ref| over {C} columns = {rel:.2e}")
sys.exit(0 if rel <= 1e-4 else 1)
PY
done

# ---- 4. refusals ---------------------------------------------------------------------------
expect_fail() { # MESSAGE ARGS...: exits 1 with MESSAGE on stderr
  local want=$1 rc=0
  shift
  "$KILN" "$@" >"$TMP/out" 2>"$TMP/err" || rc=$?
  [ "$rc" = 1 ] || fail "kiln $*: exit $rc, want 1 ($(cat "$TMP/err"))"
  grep -qF -- "$want" "$TMP/err" || fail "kiln $*: '$(cat "$TMP/err")' lacks '$want'"
  echo "refused: $want"
}
head -c 300 "$IMG" >"$TMP/cut.png"
expect_fail "--image: $TMP/none.png: No such file or directory" "${G[@]}" --image "$TMP/none.png" --prompt x
expect_fail "$SRC/tests/data/images/tiny.gif: GIF images are not supported" "${G[@]}" \
  --image "$SRC/tests/data/images/tiny.gif" --prompt x
expect_fail "$TMP/cut.png: truncated PNG" "${G[@]}" --image "$TMP/cut.png" --prompt x
expect_fail "takes text only (it has no vision tower)" generate "${S[@]}" --image "$IMG" --prompt x
expect_fail "--image and --messages are for one request" generate "${S[@]}" --image "$IMG" \
  --input "$TMP/m1.json"
expect_fail "no --ids, --prompt or --image with it" "${G[@]}" --messages "$TMP/m1.json" --prompt x
expect_fail "score: --image: model LlamaForCausalLM takes text only" score "${S[@]}" \
  --model "$SRC/tests/fixtures/models/llama2" --ids 1,2 --image "$IMG" --out "$TMP/x.npy"
expect_fail "score: --ids hold 0 image placeholders (id 151655) for 1 --image" score "${S[@]}" \
  --model "$FIX" --ids 1,2 --image "$IMG" --out "$TMP/x.npy"
echo "test_generate_images: all passed"
