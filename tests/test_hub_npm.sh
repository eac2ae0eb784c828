#!/usr/bin/env bash
# test_hub_npm.sh - Kiln's use of the huggingface_hub cache against Hugging Face's own
# JavaScript Hub client (@huggingface/hub, tests/hub/package.json, installed once into a cache
# outside the tree), both talking to tests/fake_hub_server.py on 127.0.0.1:
#   - a cache written by that client is read by Kiln offline (same text as the fixture folder),
#     and `kiln download` over it finds every blob there (nothing fetched again);
#   - a cache written by Kiln (a sharded model, a tag) is read by the client's scanCacheDir:
#     the repository, both revisions with their commit and refs, every file with its blob and
#     size, no warnings; and the client's downloadFileToCacheDir finds Kiln's files without a
#     request.
# Env: KILN_NPM_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/kiln/npm-hub).
# Usage: test_hub_npm.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD=${1:?build dir}
SRC=${2:?source dir}
KILN="$BUILD/bin/kiln"
TMP=$(mktemp -d /tmp/kiln-hubnpm-XXXXXX)
SERVER_PID=
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# ---- @huggingface/hub, installed once per package.json ----------------------------------------
command -v node >/dev/null 2>&1 || fail "node (20 or later) is needed (apt-get install nodejs npm)"
PKG="$SRC/tests/hub/package.json"
base=${KILN_NPM_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/kiln/npm-hub}
NPM_DIR="$base/$(sha256sum "$PKG" | cut -c1-16)"
if [ ! -s "$NPM_DIR/node_modules/@huggingface/hub/package.json" ]; then
  command -v npm >/dev/null 2>&1 || fail "npm is needed to install @huggingface/hub (apt-get install npm)"
  mkdir -p "$base"
  tmp=$(mktemp -d "$base/.install-XXXXXX")
  cp "$PKG" "$tmp/package.json"
  echo "installing tests/hub/package.json into $NPM_DIR"
  if ! npm install --prefix "$tmp" --no-audit --no-fund --no-package-lock --loglevel=error \
    >"$tmp/npm.log" 2>&1; then
    cat "$tmp/npm.log" >&2
    rm -rf "$tmp"
    fail "npm install failed (is the npm registry reachable?)"
  fi
  [ -s "$NPM_DIR/node_modules/@huggingface/hub/package.json" ] || rm -rf "$NPM_DIR"
  mv -T "$tmp" "$NPM_DIR" 2>/dev/null || rm -rf "$tmp"
fi
want=$(node -p 'require(process.argv[1]).dependencies["@huggingface/hub"]' "$PKG")
got=$(node -p 'require(process.argv[1]).version' "$NPM_DIR/node_modules/@huggingface/hub/package.json")
[ "$want" = "$got" ] || fail "@huggingface/hub $got is installed in $NPM_DIR, package.json pins $want"
echo "@huggingface/hub $got from $NPM_DIR; node $(node --version)"
export KILN_NPM_DIR="$NPM_DIR"
HF="$SRC/tests/hub/hf_cache.mjs"

unset HF_HOME HF_HUB_CACHE HUGGINGFACE_HUB_CACHE HF_TOKEN HUGGING_FACE_HUB_TOKEN HF_TOKEN_PATH \
  HF_HUB_OFFLINE HF_ENDPOINT XDG_CACHE_HOME KILN_CONFIG
export HOME="$TMP/home"
mkdir -p "$HOME"
cd "$TMP"

TINY="$SRC/share/models/kiln-tiny"
SHARDED="$SRC/tests/fixtures/models/llama_sharded"
python3 "$SRC/tests/fake_hub_server.py" --port-file "$TMP/port" --log "$TMP/log" \
  --manifest "$TMP/manifest.json" --repo kiln-test/tiny="$TINY" \
  --repo kiln-test/sharded="$SHARDED" --tag kiln-test/sharded@v1 &
SERVER_PID=$!
for _ in $(seq 300); do
  [ -s "$TMP/port" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || fail "the fake Hub did not start"
  sleep 0.05
done
URL="http://127.0.0.1:$(cat "$TMP/port")"
commit_of() { python3 -c "import json,sys; print(json.load(open('$TMP/manifest.json'))[sys.argv[1]]['revisions'][sys.argv[2]])" "$1" "$2"; }
gen() { "$KILN" generate --prompt "Once upon a time" --max-tokens 12 --temperature 0 --ignore-eos "$@" 2>/dev/null; }

# ---- 1. written by @huggingface/hub, read by Kiln --------------------------------------------
C=$(commit_of kiln-test/tiny main)
node "$HF" download "$URL" "$TMP/js" kiln-test/tiny "$C" config.json model.safetensors \
  tokenizer.json tokenizer_config.json generation_config.json >"$TMP/js.out" 2>"$TMP/js.err" ||
  { cat "$TMP/js.err" >&2; fail "@huggingface/hub could not download from the fake Hub"; }
gen --model "$TINY" >"$TMP/ref.txt" || fail "generate from the folder"
HF_HUB_OFFLINE=1 HF_HUB_CACHE="$TMP/js" gen --model "kiln-test/tiny@$C" >"$TMP/js.txt" ||
  fail "Kiln could not load the cache @huggingface/hub wrote"
cmp -s "$TMP/ref.txt" "$TMP/js.txt" || fail "the model from @huggingface/hub's cache generates other text"
n0=$(wc -l <"$TMP/log")
HF_ENDPOINT=$URL HF_HUB_CACHE="$TMP/js" "$KILN" download "kiln-test/tiny@$C" >"$TMP/kd.out" 2>"$TMP/kd.err" ||
  { cat "$TMP/kd.err" >&2; fail "kiln download over @huggingface/hub's cache"; }
! tail -n +$((n0 + 1)) "$TMP/log" | grep -q '"method": "GET", "path": "/kiln-test\|"server": "cdn"' ||
  fail "kiln download fetched again what @huggingface/hub had cached"
echo "ok   a cache written by @huggingface/hub loads in Kiln offline; kiln download finds all of it"

# ---- 2. written by Kiln, read by @huggingface/hub --------------------------------------------
export HF_ENDPOINT=$URL HF_HUB_CACHE="$TMP/kiln"
"$KILN" download kiln-test/sharded >/dev/null 2>"$TMP/k1.err" || { cat "$TMP/k1.err" >&2; fail "kiln download"; }
"$KILN" download kiln-test/sharded@v1 >/dev/null 2>"$TMP/k2.err" || { cat "$TMP/k2.err" >&2; fail "kiln download @v1"; }
node "$HF" scan "$TMP/kiln" >"$TMP/scan.json" || fail "scanCacheDir on Kiln's cache"
python3 - "$TMP/scan.json" "$TMP/manifest.json" <<'EOF' || fail "scanCacheDir of Kiln's cache"
import json, sys
scan, man = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))["kiln-test/sharded"]
assert scan["warnings"] == [], scan["warnings"]
assert [(r["id"], r["type"]) for r in scan["repos"]] == [("kiln-test/sharded", "model")], scan
revs = {r["commit"]: r for r in scan["repos"][0]["revisions"]}
want_refs = {man["revisions"]["main"]: ["main"], man["revisions"]["v1"]: ["v1"]}
assert {c: r["refs"] for c, r in revs.items()} == want_refs, revs
names = sorted(["config.json", "generation_config.json", "model.safetensors.index.json"] +
               [n for n in man["files"] if n.startswith("model-")])
for c, r in revs.items():
    got = [(f["name"], f["blob"], f["size"]) for f in r["files"]]
    want = [(n, man["files"][n]["sha256"] if man["files"][n]["lfs"] else man["files"][n]["git_sha1"],
             man["files"][n]["size"]) for n in names]
    assert got == want, (c, got, want)
EOF
n0=$(wc -l <"$TMP/log")
node "$HF" download "$URL" "$TMP/kiln" kiln-test/sharded "$(commit_of kiln-test/sharded main)" \
  config.json model-00001-of-00006.safetensors >"$TMP/js2.out" || fail "@huggingface/hub on Kiln's cache"
[ "$(wc -l <"$TMP/log")" = "$n0" ] || fail "@huggingface/hub did not find Kiln's files in the cache"
echo "ok   a cache written by Kiln (main and a tag) reads in @huggingface/hub's scanCacheDir: commits, refs, blobs, sizes"
echo "test_hub_npm: 2 passed"
