#!/usr/bin/env bash
# test_hub.sh - Hugging Face Hub ids (models/hub, `kiln download`, --model ORG/NAME) against
# tests/fake_hub_server.py, a local server (127.0.0.1 only) that speaks the Hub's endpoints as
# huggingface_hub uses them, serving copies of the fixture models. Never the real internet.
#
# Cases: a download checked file by file against the server's manifest (Python's hashlib is the
# reference for the blob names: SHA-256 for LFS files, git blob SHA-1 for the others) and the
# huggingface_hub layout (refs, relative snapshot symlinks, .no_exist markers, no leftovers);
# generate/score/serve from the cache with no request reaching the server, with outputs equal to
# loading the fixture folder itself; the snapshot read back by path; [model] path = a Hub id in
# an INI file; a local folder named like an id wins; a sharded model (the index's shards); a tag
# and a commit id sharing the blobs; GGUF by file name; a relative redirect (renamed repository);
# a connection cut mid-file (resumed with a range request); a partial .incomplete left by an
# earlier run (resumed) and a bad one (checksum mismatch, removed); a wrong checksum from the
# server; a 404 (repository, revision); a gated repository (401 without a token, 403 with a wrong
# one, then HF_TOKEN and the token file, never sent to the CDN); offline with and without the
# cache; the network down (with what is cached); not enough disk; kiln serve downloading into
# an empty cache, then serving the model under its Hub id.
# Usage: test_hub.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD=${1:?build dir}
SRC=${2:?source dir}
KILN="$BUILD/bin/kiln"
FAKE="$SRC/tests/fake_hub_server.py"
TMP=$(mktemp -d /tmp/kiln-hub-XXXXXX)
SERVER_PID=
SERVE_PID=
cleanup() {
  if [ -n "$SERVE_PID" ]; then kill "$SERVE_PID" 2>/dev/null || true; fi
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi
  [ -n "${KEEP_TMP:-}" ] || rm -rf "$TMP"
}
trap cleanup EXIT
# Nothing of the caller's Hub set-up may leak in (a real cache or token, the real endpoint).
unset HF_HOME HF_HUB_CACHE HUGGINGFACE_HUB_CACHE HF_TOKEN HUGGING_FACE_HUB_TOKEN HF_TOKEN_PATH \
  HF_HUB_OFFLINE HF_ENDPOINT XDG_CACHE_HOME KILN_CONFIG
export HOME="$TMP/home"
mkdir -p "$HOME"
cd "$TMP"

pass=0
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
ok() {
  pass=$((pass + 1))
  echo "ok   $*"
}

TINY="$SRC/share/models/kiln-tiny"
SHARDED="$SRC/tests/fixtures/models/llama_sharded"
QWEN3="$SRC/tests/fixtures/models/qwen3"
mkdir -p "$TMP/repos/gguf"
cp "$SRC/tests/fixtures/models/qwen3_gguf/model.gguf" "$TMP/repos/gguf/model.gguf"
cp "$SRC/tests/fixtures/models/qwen3_gguf/model.gguf" "$TMP/repos/gguf/copy-Q8_0.gguf"

LOG="$TMP/server.log"
MANIFEST="$TMP/manifest.json"
TOKEN=hf_kilntest_secret
python3 "$FAKE" --port-file "$TMP/port" --log "$LOG" --manifest "$MANIFEST" --token "$TOKEN" \
  --repo kiln-test/tiny="$TINY" --tag kiln-test/tiny@v1.0 \
  --repo kiln-test/sharded="$SHARDED" \
  --repo kiln-test/gguf="$TMP/repos/gguf" \
  --repo kiln-test/gated="$QWEN3" --gated kiln-test/gated \
  --repo kiln-test/cut="$SHARDED" --fault cut:kiln-test/cut/model-00003-of-00006.safetensors \
  --repo kiln-test/corrupt="$QWEN3" --fault corrupt:kiln-test/corrupt/model.safetensors \
  --repo kiln-test/huge="$QWEN3" --fault huge:kiln-test/huge/model.safetensors \
  --rename kiln-test/old-tiny=kiln-test/tiny &
SERVER_PID=$!
for _ in $(seq 200); do
  [ -s "$TMP/port" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || fail "the fake Hub did not start"
  sleep 0.05
done
PORT=$(cat "$TMP/port") || fail "the fake Hub wrote no port"
export HF_ENDPOINT="http://127.0.0.1:$PORT"
export HF_HUB_CACHE="$TMP/cache"
# a closed port: bound, then released
DEAD_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

requests() { wc -l <"$LOG"; }
commit_of() { python3 -c "import json,sys; print(json.load(open('$MANIFEST'))[sys.argv[1]]['revisions'][sys.argv[2]])" "$1" "$2"; }

# run NAME WANT_RC CMD...: stdout, stderr in $TMP/NAME.{out,err}
run() {
  local name=$1 want=$2 rc=0
  shift 2
  "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" || rc=$?
  if [ "$rc" != "$want" ]; then
    cat "$TMP/$name.out" "$TMP/$name.err" >&2
    fail "$name: exit status $rc, want $want"
  fi
}
# want NAME REGEX: stdout + stderr of run NAME match REGEX
want() {
  grep -Eq -- "$2" "$TMP/$1.out" "$TMP/$1.err" || {
    cat "$TMP/$1.out" "$TMP/$1.err" >&2
    fail "$1: no match for /$2/"
  }
}

# check_layout REPO REV PATH FILES...: the cache holds exactly FILES of REPO at REV in
# huggingface_hub's layout, each the server's bytes under the right blob name.
check_layout() {
  python3 - "$MANIFEST" "$HF_HUB_CACHE" "$@" <<'EOF'
import hashlib, json, os, sys
manifest, cache, repo, rev, printed, *files = sys.argv[1:]
m = json.load(open(manifest))[repo]
commit = m["revisions"][rev]
top = os.path.join(cache, "models--" + repo.replace("/", "--"))
def bad(msg):
    sys.exit("layout of %s@%s: %s" % (repo, rev, msg))
if rev != commit:
    ref = open(os.path.join(top, "refs", rev)).read()
    if ref != commit:
        bad("refs/%s holds %r, want %s" % (rev, ref, commit))
snap = os.path.join(top, "snapshots", commit)
printed = os.path.normpath(os.path.abspath(printed))
if printed != os.path.normpath(snap) and os.path.dirname(printed) != os.path.normpath(snap):
    bad("printed %s, want %s" % (printed, snap))
have = sorted(os.path.relpath(os.path.join(r, f), snap) for r, _, fs in os.walk(snap) for f in fs)
if have != sorted(files):
    bad("snapshot has %s, want %s" % (have, sorted(files)))
for f in files:
    meta = m["files"][f]
    link = os.path.join(snap, f)
    if not os.path.islink(link):
        bad(f + " is not a symlink")
    target = os.readlink(link)
    etag = meta["sha256"] if meta["lfs"] else meta["git_sha1"]
    want = "../../" + "../" * f.count("/") + "blobs/" + etag
    if target != want:
        bad("%s -> %s, want %s" % (f, target, want))
    data = open(link, "rb").read()
    if hashlib.sha256(data).hexdigest() != meta["sha256"] or len(data) != meta["size"]:
        bad(f + ": the bytes differ from the server's")
left = [b for b in os.listdir(os.path.join(top, "blobs")) if not all(c in "0123456789abcdef" for c in b)]
if left:
    bad("leftovers in blobs/: %s" % left)
EOF
}

# ---- 1. download: the files Kiln needs, nothing more, in huggingface_hub's layout ---------------
run dl_tiny 0 "$KILN" download kiln-test/tiny
TINY_COMMIT=$(commit_of kiln-test/tiny main)
SNAP=$(cat "$TMP/dl_tiny.out")
[ "$SNAP" = "$HF_HUB_CACHE/models--kiln-test--tiny/snapshots/$TINY_COMMIT" ] || fail "download printed $SNAP"
check_layout kiln-test/tiny main "$SNAP" config.json generation_config.json model.safetensors \
  tokenizer.json tokenizer_config.json || fail "layout after download"
for f in chat_template.jinja preprocessor_config.json; do
  [ -f "$HF_HUB_CACHE/models--kiln-test--tiny/.no_exist/$TINY_COMMIT/$f" ] || fail "no .no_exist/$f"
done
! grep -q 'README.md\|train_log.json' "$LOG" || fail "files the model does not need were fetched"
want dl_tiny 'kiln-test/tiny@main \(commit [0-9a-f]{12}\): 5 files, 5 downloaded'
ok "download: 5 files, blobs named by SHA-256 / git SHA-1, relative links, refs/main, .no_exist"

# ---- 2. from the cache, no network; outputs equal the fixture's -------------------------------
n0=$(requests)
gen() { "$KILN" generate --prompt "Once upon a time" --max-tokens 12 --temperature 0 --ignore-eos "$@"; }
run gen_ref 0 gen --model "$TINY"
run gen_hub 0 gen --model kiln-test/tiny
cmp -s "$TMP/gen_ref.out" "$TMP/gen_hub.out" || fail "generate from the Hub id differs from the folder"
run gen_path 0 gen --model "$SNAP"
cmp -s "$TMP/gen_ref.out" "$TMP/gen_path.out" || fail "generate from the snapshot path differs"
run gen_rev 0 gen --model "kiln-test/tiny@$TINY_COMMIT"
cmp -s "$TMP/gen_ref.out" "$TMP/gen_rev.out" || fail "generate from ORG/NAME@COMMIT differs"
[ "$(requests)" = "$n0" ] || fail "a cached model touched the network ($(tail -n +$((n0 + 1)) "$LOG"))"
ok "generate --model ORG/NAME, ORG/NAME@COMMIT and the snapshot path: from the cache, no request, same text"

# [model] path in an INI file (and [hub] cache_dir relative to it), the endpoint unreachable
mkdir -p "$TMP/conf"
printf '[model]\npath = kiln-test/tiny\n[hub]\ncache_dir = ../cache\n' >"$TMP/conf/kiln.ini"
HF_HUB_CACHE="" HF_ENDPOINT="http://127.0.0.1:$DEAD_PORT" run gen_ini 0 gen --config "$TMP/conf/kiln.ini"
cmp -s "$TMP/gen_ref.out" "$TMP/gen_ini.out" || fail "[model] path = a Hub id differs"
ok "[model] path = ORG/NAME with [hub] cache_dir relative to the INI file, no endpoint reachable"

# a local folder named like the id always wins (no Hub lookup: the cache is elsewhere)
mkdir -p "$TMP/local/kiln-test"
cp -r "$TINY" "$TMP/local/kiln-test/tiny"
(cd "$TMP/local" && HF_HUB_CACHE="$TMP/empty-cache" HF_ENDPOINT="http://127.0.0.1:$DEAD_PORT" \
  run gen_local 0 gen --model kiln-test/tiny)
cmp -s "$TMP/gen_ref.out" "$TMP/gen_local.out" || fail "the local folder did not win"
[ ! -e "$TMP/empty-cache" ] || fail "a local folder went through the Hub cache"
ok "a local folder named ORG/NAME wins over the Hub id"

# ---- 3. a sharded model: the index's shards; score equals the folder's ------------------------
run dl_sharded 0 "$KILN" download kiln-test/sharded
SHARDS=$(cd "$SHARDED" && ls model-0000*.safetensors)
# shellcheck disable=SC2086
check_layout kiln-test/sharded main "$(cat "$TMP/dl_sharded.out")" config.json \
  generation_config.json model.safetensors.index.json $SHARDS || fail "sharded layout"
[ -f "$HF_HUB_CACHE/models--kiln-test--sharded/.no_exist/$(commit_of kiln-test/sharded main)/tokenizer.json" ] ||
  fail "no .no_exist marker for the missing tokenizer.json"
n0=$(requests)
run score_ref 0 "$KILN" score --model "$SHARDED" --ids 1,5,9,20 --out "$TMP/ref.npy"
run score_hub 0 "$KILN" score --model kiln-test/sharded --ids 1,5,9,20 --out "$TMP/hub.npy"
cmp -s "$TMP/ref.npy" "$TMP/hub.npy" || fail "score of the sharded Hub model differs"
[ "$(requests)" = "$n0" ] || fail "score of a cached sharded model touched the network"
ok "sharded: index + 6 shards downloaded, score from the cache equals the folder's, no request"

# ---- 4. a tag and a relative redirect reuse the blobs ------------------------------------------
n0=$(requests)
run dl_tag 0 "$KILN" download kiln-test/tiny@v1.0
check_layout kiln-test/tiny v1.0 "$(cat "$TMP/dl_tag.out")" config.json generation_config.json \
  model.safetensors tokenizer.json tokenizer_config.json || fail "tag layout"
! tail -n +$((n0 + 1)) "$LOG" | grep -q '"server": "cdn"\|"method": "GET", "path": "/kiln-test' ||
  fail "a tag with the same files downloaded blobs again"
want dl_tag '5 files, 0 downloaded'
run dl_renamed 0 "$KILN" download kiln-test/old-tiny
tail -n 20 "$LOG" | grep -q '/api/models/kiln-test/tiny/revision/main' || fail "the redirect was not followed"
ok "a tag: a new snapshot and refs/v1.0 over the same blobs; a renamed repository's relative redirect"

# ---- 5. GGUF by file name ------------------------------------------------------------------------
run gguf_none 1 "$KILN" download kiln-test/gguf
want gguf_none 'no safetensors weights; name one of its GGUF files: kiln-test/gguf/copy-Q8_0.gguf, kiln-test/gguf/model.gguf'
run gguf_dl 0 "$KILN" download kiln-test/gguf/model.gguf
check_layout kiln-test/gguf main "$(cat "$TMP/gguf_dl.out")" model.gguf || fail "gguf layout"
run gguf_ref 0 "$KILN" score --model "$TMP/repos/gguf/model.gguf" --ids 1,2,3 --out "$TMP/g_ref.npy"
run gguf_hub 0 "$KILN" score --model kiln-test/gguf/model.gguf --ids 1,2,3 --out "$TMP/g_hub.npy"
cmp -s "$TMP/g_ref.npy" "$TMP/g_hub.npy" || fail "score of the Hub GGUF differs"
run gguf_missing 1 "$KILN" download kiln-test/gguf/nope.gguf
want gguf_missing 'has no file nope.gguf; its .gguf files: copy-Q8_0.gguf, model.gguf'
ok "GGUF: ORG/NAME/FILE.gguf downloads that file alone; without a name, the choices are listed"

# ---- 6. a connection cut mid-file: resumed with a range request ----------------------------------
run dl_cut 0 "$KILN" download kiln-test/cut
check_layout kiln-test/cut main "$(cat "$TMP/dl_cut.out")" config.json generation_config.json \
  model.safetensors.index.json $SHARDS || fail "layout after a cut"
CUT_SHA=$(python3 -c "import json; print(json.load(open('$MANIFEST'))['kiln-test/cut']['files']['model-00003-of-00006.safetensors']['sha256'])")
CUT_SIZE=$(stat -c %s "$SHARDED/model-00003-of-00006.safetensors")
grep "/cdn/$CUT_SHA" "$LOG" | grep -q "\"range\": \"bytes=$((CUT_SIZE / 2))-\"" ||
  fail "no range request from byte $((CUT_SIZE / 2)) after the cut"
want dl_cut 'the transfer stopped at .* resuming'
ok "a connection cut at half of a shard: resumed with Range: bytes=$((CUT_SIZE / 2))-, checksum good"

# a partial download left by an earlier run resumes; a bad one fails its checksum and is removed
export HF_HUB_CACHE="$TMP/cache2"
QSHA=$(python3 -c "import json; print(json.load(open('$MANIFEST'))['kiln-test/gated']['files']['model.safetensors']['sha256'])")
mkdir -p "$HF_HUB_CACHE/models--kiln-test--tiny/blobs"
TSHA=$(python3 -c "import json; print(json.load(open('$MANIFEST'))['kiln-test/tiny']['files']['model.safetensors']['sha256'])")
head -c 1000000 "$TINY/model.safetensors" >"$HF_HUB_CACHE/models--kiln-test--tiny/blobs/$TSHA.incomplete"
run dl_resume 0 "$KILN" download kiln-test/tiny
want dl_resume 'resuming a partial download at'
grep "/cdn/$TSHA" "$LOG" | tail -1 | grep -q '"range": "bytes=1000000-"' || fail "no range request for the .incomplete"
check_layout kiln-test/tiny main "$(cat "$TMP/dl_resume.out")" config.json generation_config.json \
  model.safetensors tokenizer.json tokenizer_config.json || fail "layout after a resume"
mkdir -p "$HF_HUB_CACHE/models--kiln-test--sharded/blobs"
S1=$(python3 -c "import json; print(json.load(open('$MANIFEST'))['kiln-test/sharded']['files']['model-00001-of-00006.safetensors']['sha256'])")
head -c 5000 /dev/urandom >"$HF_HUB_CACHE/models--kiln-test--sharded/blobs/$S1.incomplete"
run dl_badpart 1 "$KILN" download kiln-test/sharded
want dl_badpart "model-00001-of-00006.safetensors: checksum mismatch: the SHA-256 of the downloaded bytes is [0-9a-f]{64}, the Hub's etag is $S1; the download was removed"
[ ! -e "$HF_HUB_CACHE/models--kiln-test--sharded/blobs/$S1.incomplete" ] || fail "the bad partial file was kept"
run dl_badpart2 0 "$KILN" download kiln-test/sharded
ok "a .incomplete of 1,000,000 bytes resumes from there; a corrupt one fails its checksum, is removed, the next run succeeds"

# ---- 7. a wrong checksum from the server ---------------------------------------------------------
run dl_corrupt 1 "$KILN" download kiln-test/corrupt
want dl_corrupt "kiln-test/corrupt@main: model.safetensors: checksum mismatch: .* the Hub's etag is $QSHA"
[ ! -e "$HF_HUB_CACHE/models--kiln-test--corrupt/blobs/$QSHA" ] || fail "a corrupt blob was kept"
compgen -G "$HF_HUB_CACHE/models--kiln-test--corrupt/blobs/*.incomplete" >/dev/null && fail "a corrupt .incomplete was kept"
[ ! -e "$HF_HUB_CACHE/models--kiln-test--corrupt/snapshots/$(commit_of kiln-test/corrupt main)/model.safetensors" ] ||
  fail "the snapshot links a corrupt blob"
ok "bytes that do not match the etag: an error naming both checksums; nothing kept"

# ---- 8. 404s -------------------------------------------------------------------------------------
run nf_repo 1 "$KILN" download kiln-test/nope
want nf_repo 'unknown repository kiln-test/nope on http://127.0.0.1:[0-9]+ \(HTTP 404\)'
run nf_rev 1 "$KILN" download kiln-test/tiny@no-such-branch
want nf_rev "kiln-test/tiny has no revision 'no-such-branch' \(HTTP 404\)"
run nf_gen 1 "$KILN" generate --model kiln-test/nope --prompt hi
want nf_gen '^kiln: model kiln-test/nope \(no such file or folder; as a Hugging Face Hub id\): unknown repository'
run bad_id 1 "$KILN" generate --model kiln-test/x/y --prompt hi
want bad_id 'kiln-test/x/y'
ok "unknown repository and revision (404): clear errors, also through generate"

# ---- 9. a gated repository: 401 without a token, 403 with a wrong one; the token never reaches the CDN
run gated_none 1 "$KILN" download kiln-test/gated
want gated_none 'kiln-test/gated is gated or private \(HTTP 401\) and no token was given: .* set HF_TOKEN'
HF_TOKEN=hf_wrong run gated_wrong 1 "$KILN" download kiln-test/gated
want gated_wrong 'kiln-test/gated: the token was refused \(HTTP 403\)'
n0=$(requests)
HF_TOKEN=$TOKEN run gated_env 0 "$KILN" download kiln-test/gated
tail -n +$((n0 + 1)) "$LOG" | grep '"server": "hub"' | grep -vq "Bearer $TOKEN" &&
  fail "a request to the Hub went without the token"
tail -n +$((n0 + 1)) "$LOG" | grep '"server": "cdn"' | grep -q 'Bearer' && fail "the token reached the CDN"
tail -n +$((n0 + 1)) "$LOG" | grep -q '"server": "cdn"' || fail "the gated model's LFS file did not come from the CDN"
rm -rf "$HF_HUB_CACHE/models--kiln-test--gated"
mkdir -p "$HOME/.cache/huggingface"
printf '%s\n' "$TOKEN" >"$HOME/.cache/huggingface/token"
run gated_file 0 "$KILN" download kiln-test/gated
rm "$HOME/.cache/huggingface/token"
ok "gated: 401 without a token, 403 with a wrong one; HF_TOKEN and ~/.cache/huggingface/token work; none sent to the CDN"

# ---- 10. offline, with and without the cache; the network down --------------------------------
n0=$(requests)
HF_HUB_OFFLINE=1 run off_cached 0 gen --model kiln-test/tiny
cmp -s "$TMP/gen_ref.out" "$TMP/off_cached.out" || fail "offline generate differs"
HF_HUB_OFFLINE=1 run off_dl 0 "$KILN" download kiln-test/tiny
want off_dl 'in the cache, offline: 5 files'
HF_HUB_OFFLINE=1 run off_none 1 gen --model kiln-test/sharded-nope
want off_none 'offline \(HF_HUB_OFFLINE is set\) and not in the cache: the cache \(.*\) holds nothing of kiln-test/sharded-nope'
rm "$HF_HUB_CACHE/models--kiln-test--sharded/snapshots/$(commit_of kiln-test/sharded main)/model-00002-of-00006.safetensors"
run off_part 1 "$KILN" score --set hub.offline=true --model kiln-test/sharded --ids 1 --out "$TMP/x.npy"
want off_part 'offline \(\[hub\] offline\) and not in the cache: the cache \(.*\) has kiln-test/sharded@main \(commit [0-9a-f]{12}\) with 8 of its files; missing: model-00002-of-00006.safetensors'
[ "$(requests)" = "$n0" ] || fail "offline mode touched the network"
HF_ENDPOINT="http://127.0.0.1:$DEAD_PORT" run down 1 "$KILN" download kiln-test/sharded
want down "cannot reach http://127.0.0.1:$DEAD_PORT/api/models/kiln-test/sharded/revision/main \(Couldn't connect to server.*\); the cache .* missing: model-00002-of-00006.safetensors"
run relink 0 "$KILN" score --model kiln-test/sharded --ids 1 --out "$TMP/x.npy"
want relink '9 files, 0 downloaded'
ok "offline: cached models load, missing ones are named; the network down says what is cached; a lost link is restored from its blob"

# ---- 11. not enough disk -------------------------------------------------------------------------
run huge 1 "$KILN" download kiln-test/huge
want huge 'not enough disk space \(disk full\): kiln-test/huge@main needs 1.00 PiB more in .*/blobs, .* is free'
ok "a file larger than the free space: refused before downloading"

# ---- 12. kiln serve: downloads into an empty cache, serves under the Hub id --------------------
export HF_HUB_CACHE="$TMP/cache3"
"$KILN" serve --model kiln-test/tiny --port 0 --set backend.name=cpu >"$TMP/serve.out" 2>"$TMP/serve.err" &
SERVE_PID=$!
for _ in $(seq 300); do
  grep -q '^kiln: serving' "$TMP/serve.out" 2>/dev/null && break
  kill -0 "$SERVE_PID" 2>/dev/null || { cat "$TMP/serve.out" "$TMP/serve.err" >&2; fail "kiln serve exited"; }
  sleep 0.1
done
URL=$(grep -oE 'http://[0-9.]+:[0-9]+' "$TMP/serve.out" | head -1)
grep -q '^kiln: serving kiln-test/tiny on' "$TMP/serve.out" || fail "serve's name: $(cat "$TMP/serve.out")"
python3 - "$URL" "$TMP/gen_ref.out" <<'EOF' || fail "the served model"
import json, sys, urllib.request
url, ref = sys.argv[1], open(sys.argv[2]).read()
models = json.load(urllib.request.urlopen(url + "/v1/models"))
assert [m["id"] for m in models["data"]] == ["kiln-test/tiny"], models
assert models["data"][0]["quantization"] == "none", models
assert models["data"][0]["kv_cache_dtype"] in ("bf16", "f16", "f32"), models
req = urllib.request.Request(url + "/v1/completions", data=json.dumps({
    "model": "kiln-test/tiny", "prompt": "Once upon a time", "max_tokens": 12,
    "temperature": 0, "ignore_eos": True}).encode(), headers={"Content-Type": "application/json"})
text = json.load(urllib.request.urlopen(req))["choices"][0]["text"]
assert "Once upon a time" + text == ref.rstrip("\n"), (text, ref)
EOF
kill "$SERVE_PID"
wait "$SERVE_PID" || fail "kiln serve did not exit 0 on SIGTERM"
SERVE_PID=
check_layout kiln-test/tiny main "$HF_HUB_CACHE/models--kiln-test--tiny/snapshots/$TINY_COMMIT" \
  config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json ||
  fail "serve's download"
ok "serve --model ORG/NAME: downloaded into an empty cache, served as kiln-test/tiny, same completion"

echo "test_hub: $pass passed"
