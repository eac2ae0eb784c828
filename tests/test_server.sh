#!/usr/bin/env bash
# test_server.sh - `kiln serve` end to end on the embedded model (kiln-tiny, CPU backend).
#   api (default): the official openai npm package (tests/server/package.json, installed once
#       into a cache outside the repository) drives live servers: tests/server/api.mjs (the API
#       surface), disconnect.mjs (64 streams, a third of them going away), errors.mjs (bad
#       requests; API key, body limit, queue-full and request-timeout servers) and shutdown.mjs
#       (SIGTERM draining, and shutdown_timeout aborting).
#   load: 60 s of Poisson-arrival requests from `kiln bench serve`; every one must succeed and be
#       logged by the server, and the numbers are printed (docs/perf.md has a reference run).
# Every server must exit 0 on SIGTERM, with no sanitizer report on its stderr (an ASan build runs
# the same script). Servers are always killed on the way out.
#   images: image input (tests/server/images.mjs) on the tiny Qwen2-VL fixture, data URLs and
#       remote URLs from a local HTTP server.
#   structured: structured outputs (tests/server/structured.mjs): the schema corpus of
#       tests/data/schemas validated by ajv, regex/choice/grammar constraints, the 400s.
#   tools: tool calling (tests/server/tools.mjs) on fixture models with fixed replies
#       (tests/server/make_tool_model.py) and the real Qwen3 / Mistral Nemo chat templates.
#   web: the chat page at / in Debian's chromium, headless, through puppeteer-core
#       (tests/server/web.mjs): a conversation with streamed replies, stop, loading, busy, an API
#       key, image upload; screenshots in BUILD_DIR/test-artifacts. Exit 77 (skipped) when no
#       chromium is installed (make deps installs it).
# Usage: test_server.sh BUILD_DIR SOURCE_DIR [api|load|images|tools|web|structured]
# Env: KILN_NPM_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/kiln/npm-server),
#      KILN_LOAD_RATE (requests/s, default 30), KILN_LOAD_PROMPTS (default 60 s worth),
#      KILN_TEST_SEED (disconnect.mjs's random schedule), KILN_TOKENIZER_CACHE (tools: where
#      tests/fetch_tokenizers.sh put the real tokenizer files).
set -euo pipefail
BUILD=${1:?usage: test_server.sh BUILD_DIR SOURCE_DIR [api|load]}
SRC=${2:?source dir}
MODE=${3:-api}
KILN="$BUILD/bin/kiln"
TESTS="$SRC/tests/server"
TMP=$(mktemp -d /tmp/kiln-server-XXXXXX)
SERVERS=()
unset KILN_API_KEY OPENAI_API_KEY OPENAI_BASE_URL OPENAI_ORG_ID OPENAI_PROJECT_ID
# The servers fetch remote images with libcurl, which honours http_proxy: the test's own image
# server on 127.0.0.1 must never be reached through a proxy of the machine running the tests.
export no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}" NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# Kills every server still running (SIGTERM, then SIGKILL), prints the stderr of each on a
# failure, and removes the temporary directory.
cleanup() {
  local rc=$? name pid
  for name in "${SERVERS[@]}"; do
    pid=$(cat "$TMP/$name.pid" 2>/dev/null) || continue
    [ -e "$TMP/$name.rc" ] && continue
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 20); do
      [ -e "$TMP/$name.rc" ] && break
      sleep 0.1
    done
    [ -e "$TMP/$name.rc" ] || kill -KILL "$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
  if [ "$rc" != 0 ]; then
    for name in "${SERVERS[@]}"; do
      echo "---- server '$name': last lines of stderr ----" >&2
      tail -n 40 "$TMP/$name.err" >&2 2>/dev/null || true
    done
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT

[ -x "$KILN" ] || fail "$KILN is not built"

# ---- servers -----------------------------------------------------------------------------------

# start_server NAME ARGS...: starts `kiln serve` on a free port with the embedded model and the
# extra --set ARGS, in the background; its stdout/stderr go to $TMP/NAME.{out,err}, its pid to
# $TMP/NAME.pid and, once it exits, its exit status to $TMP/NAME.rc. Does not wait: see
# wait_ready. One backend thread: the clients (node, kiln bench serve) run on the same cores,
# and the CPU backend's pool of two loses most of its speed when a third thread wants a core
# (docs/perf.md, "HTTP server").
start_server() {
  local name=$1
  shift
  SERVERS+=("$name")
  (
    "$KILN" serve --config "$SRC/etc/kiln.ini" --set server.port=0 --set backend.name=cpu \
      --set backend.threads=1 --set cache.num_blocks=2048 "$@" >"$TMP/$name.out" \
      2>"$TMP/$name.err" &
    pid=$!
    echo "$pid" >"$TMP/$name.pid"
    rc=0
    wait "$pid" || rc=$?
    echo "$rc" >"$TMP/$name.rc.tmp"
    mv "$TMP/$name.rc.tmp" "$TMP/$name.rc"
  ) &
}

# wait_ready NAME: waits for the server's "serving ... on http://HOST:PORT" line; prints the URL.
wait_ready() {
  local name=$1 port
  for _ in $(seq 1200); do
    if [ -s "$TMP/$name.out" ] && grep -q '^kiln: serving ' "$TMP/$name.out"; then
      port=$(sed -n 's|^kiln: serving .* on http://127\.0\.0\.1:\([0-9]*\) .*|\1|p' "$TMP/$name.out")
      [ -n "$port" ] || fail "server '$name': no port in: $(cat "$TMP/$name.out")"
      echo "http://127.0.0.1:$port"
      return
    fi
    if [ -e "$TMP/$name.rc" ]; then
      cat "$TMP/$name.err" >&2
      fail "server '$name' exited with status $(cat "$TMP/$name.rc") before it was ready"
    fi
    sleep 0.1
  done
  fail "server '$name' was not ready after 120 s"
}

# check_clean NAME: no sanitizer report on the server's stderr.
check_clean() {
  if grep -qE 'ERROR: (Address|Leak|Memory|Thread)Sanitizer|runtime error:|SUMMARY: [A-Za-z]+Sanitizer' \
    "$TMP/$1.err"; then
    cat "$TMP/$1.err" >&2
    fail "server '$1': a sanitizer report on stderr (above)"
  fi
}

# wait_exit NAME SECONDS: waits for the server to exit; it must exit 0 with a clean stderr.
wait_exit() {
  local name=$1 secs=$2 rc
  for _ in $(seq $((secs * 10))); do
    [ -e "$TMP/$name.rc" ] && break
    sleep 0.1
  done
  [ -e "$TMP/$name.rc" ] || fail "server '$name' did not exit within $secs s"
  rc=$(cat "$TMP/$name.rc")
  check_clean "$name"
  [ "$rc" = 0 ] || {
    tail -n 40 "$TMP/$name.err" >&2
    fail "server '$name' exited with status $rc"
  }
}

# stop_server NAME: SIGTERM; the server must drain, exit 0 and leave no sanitizer report.
stop_server() {
  kill -TERM "$(cat "$TMP/$1.pid")"
  wait_exit "$1" 60
  echo "server '$1': stopped, exit 0"
}

# ---- the openai npm package, installed once per package.json into a cache ----------------------

npm_setup() {
  command -v node >/dev/null 2>&1 || fail "node (20 or later) is needed for the server tests"
  node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)' ||
    fail "node $(node --version) is too old: the server tests need Node 20 or later"
  local pkg="$TESTS/package.json" hash base tmp want got
  hash=$(sha256sum "$pkg" | cut -c1-16)
  base=${KILN_NPM_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/kiln/npm-server}
  NPM_DIR="$base/$hash"
  if [ ! -s "$NPM_DIR/node_modules/openai/package.json" ]; then
    command -v npm >/dev/null 2>&1 ||
      fail "npm is needed to install the openai package for the server tests (apt-get install npm)"
    mkdir -p "$base"
    tmp=$(mktemp -d "$base/.install-XXXXXX")
    cp "$pkg" "$tmp/package.json"
    echo "installing the npm packages of tests/server/package.json into $NPM_DIR"
    if ! npm install --prefix "$tmp" --no-audit --no-fund --no-package-lock --loglevel=error \
      >"$tmp/npm.log" 2>&1; then
      cat "$tmp/npm.log" >&2
      rm -rf "$tmp"
      fail "npm install failed (is the npm registry reachable?): the server tests need the openai package"
    fi
    # another run may have installed it meanwhile: keep the first
    [ -s "$NPM_DIR/node_modules/openai/package.json" ] || rm -rf "$NPM_DIR"
    mv -T "$tmp" "$NPM_DIR" 2>/dev/null || rm -rf "$tmp"
  fi
  want=$(node -p 'require(process.argv[1]).dependencies.openai' "$pkg")
  got=$(node -p 'require(process.argv[1]).version' "$NPM_DIR/node_modules/openai/package.json")
  [ "$want" = "$got" ] || fail "openai $got is installed in $NPM_DIR, package.json pins $want"
  echo "openai $got (npm) from $NPM_DIR; node $(node --version)"
}

# run_node SCRIPT VAR=VALUE...: runs tests/server/SCRIPT with the environment given.
run_node() {
  local script=$1 rc=0
  shift
  echo "---- $script"
  env KILN_NPM_DIR="$NPM_DIR" "$@" node "$TESTS/$script" || rc=$?
  if [ "$rc" != 0 ]; then
    local name
    for name in "${SERVERS[@]}"; do check_clean "$name"; done # a crash explains the failure
    fail "$script failed (exit status $rc)"
  fi
}

# ---- api ---------------------------------------------------------------------------------------

run_api() {
  npm_setup
  start_server main
  start_server auth --set server.api_key=test-key-123 --set server.max_body_bytes=1024 \
    --set cache.num_blocks=256
  start_server queue --set server.max_queued_requests=1 --set engine.max_num_seqs=1 \
    --set cache.num_blocks=256
  start_server timeout --set server.request_timeout=0.5 --set cache.num_blocks=512
  local main auth queue timeout
  main=$(wait_ready main)
  auth=$(wait_ready auth)
  queue=$(wait_ready queue)
  timeout=$(wait_ready timeout)
  echo "servers: main $main, auth $auth, queue $queue, timeout $timeout"
  run_node api.mjs KILN_URL="$main" KILN_WEB_DIR="$SRC/server/web"
  run_node disconnect.mjs KILN_URL="$main"
  run_node errors.mjs KILN_URL="$main" KILN_URL_AUTH="$auth" KILN_AUTH_KEY=test-key-123 \
    KILN_URL_QUEUE="$queue" KILN_URL_TIMEOUT="$timeout"
  for name in auth queue timeout main; do stop_server "$name"; done
  # every answered request was logged, the disconnected ones as client_gone
  grep -q 'outcome=client_gone' "$TMP/main.err" || fail "no client_gone request in the main server's log"
  grep -q 'outcome=timeout' "$TMP/timeout.err" || fail "no timeout request in the timeout server's log"

  # SIGTERM while requests stream: they finish, then exit 0
  local url
  start_server drain --set server.shutdown_timeout=60
  url=$(wait_ready drain)
  run_node shutdown.mjs KILN_URL="$url" KILN_SERVER_PID="$(cat "$TMP/drain.pid")" \
    KILN_SERVER_RC="$TMP/drain.rc" KILN_SHUTDOWN_MODE=drain
  wait_exit drain 70
  # shutdown_timeout = 1: long requests are aborted, then exit 0
  start_server abort --set server.shutdown_timeout=1
  url=$(wait_ready abort)
  run_node shutdown.mjs KILN_URL="$url" KILN_SERVER_PID="$(cat "$TMP/abort.pid")" \
    KILN_SERVER_RC="$TMP/abort.rc" KILN_SHUTDOWN_MODE=abort
  wait_exit abort 15
  grep -q 'cancelling them' "$TMP/abort.err" || fail "the abort server did not log the cancellation"
  echo "test_server: all passed"
}

# ---- load --------------------------------------------------------------------------------------

run_load() {
  command -v node >/dev/null 2>&1 || fail "node is needed for the load test's report"
  local rate=${KILN_LOAD_RATE:-30} n url rc=0
  n=${KILN_LOAD_PROMPTS:-$((rate * 60))}
  start_server load
  url=$(wait_ready load)
  local cmd=("$KILN" bench serve --url "$url" --request-rate "$rate" --num-prompts "$n"
    --input-len 32 --output-len 16 --ignore-eos --seed 1 --timeout 300 --json "$TMP/load.json")
  echo "load: ${cmd[*]}"
  "${cmd[@]}" >"$TMP/load.out" 2>"$TMP/load.stderr" || rc=$?
  cat "$TMP/load.out"
  if [ "$rc" != 0 ]; then
    cat "$TMP/load.stderr" >&2
    fail "kiln bench serve exited $rc: some requests failed"
  fi
  # nothing left behind in the engine once the load stopped (allowing a second for the last)
  local used=
  for _ in $(seq 10); do
    used=$(node -e 'fetch(process.argv[1] + "/metrics").then((r) => r.text()).then((t) =>
      console.log(/^kiln:kv_cache_used_blocks\{[^}]*\} (\S+)$/m.exec(t)[1]))' "$url")
    [ "$used" = 0 ] && break
    sleep 0.2
  done
  [ "$used" = 0 ] || fail "$used KV blocks still used after the load"
  stop_server load
  node - "$TMP/load.json" "$TMP/load.err" "$n" <<'EOF' || fail "the load test's results are wrong (above)"
const fs = require('fs');
const [file, log, nStr] = process.argv.slice(2);
const n = Number(nStr);
const j = JSON.parse(fs.readFileSync(file, 'utf8'));
const bad = [];
if (j.completed !== n) bad.push(`completed ${j.completed}, want ${n}`);
if (j.failed !== 0) bad.push(`failed ${j.failed}: ${JSON.stringify(j.errors)}`);
if (j.requests.length !== n || j.requests.some((r) => !r.ok || r.http_status !== 200))
  bad.push('a request is not ok');
if (j.output_tokens !== 16 * n) bad.push(`output_tokens ${j.output_tokens}, want ${16 * n}`);
if (j.requests.some((r) => r.output_tokens !== 16)) bad.push('a request got other than 16 tokens');
// the server's side: one log line per request, every one ok
const lines = fs.readFileSync(log, 'utf8').split('\n').filter((l) => / request id=cmpl-/.test(l));
const ok = lines.filter((l) => / status=200 .*outcome=ok/.test(l)).length;
if (lines.length !== n || ok !== n) bad.push(`the server logged ${lines.length} requests (${ok} ok), want ${n}`);
const f = (x) => (x === null || x === undefined ? 'n/a' : x.toFixed(1));
const st = (k) => `mean ${f(j[k].mean)}  p50 ${f(j[k].p50)}  p90 ${f(j[k].p90)}  p99 ${f(j[k].p99)}`;
console.log(`load: ${j.completed}/${n} requests ok in ${j.duration_s.toFixed(1)} s at ${j.request_rate} req/s offered`);
console.log(`load: ${j.request_throughput.toFixed(2)} requests/s, ${j.output_throughput.toFixed(1)} output tokens/s, ${j.total_token_throughput.toFixed(1)} total tokens/s`);
console.log(`load: e2e ms   ${st('e2e_ms')}`);
console.log(`load: TTFT ms  ${st('ttft_ms')}`);
console.log(`load: TPOT ms  ${st('tpot_ms')}`);
console.log(`load: ITL ms   ${st('itl_ms')}`);
console.log(`load: the server logged ${lines.length} requests, ${ok} of them ok`);
if (bad.length) {
  for (const b of bad) console.error(`FAIL: ${b}`);
  process.exit(1);
}
EOF
  echo "test_server_load: passed"
}

# ---- web ---------------------------------------------------------------------------------------

run_web() {
  local chromium
  chromium=${KILN_CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
  if [ -z "$chromium" ] || [ ! -x "$chromium" ]; then
    echo "SKIP: no chromium to run the chat page in (Debian: apt-get install chromium; make deps does)"
    exit 77
  fi
  npm_setup
  [ -s "$NPM_DIR/node_modules/puppeteer-core/package.json" ] ||
    fail "puppeteer-core is not installed in $NPM_DIR"
  echo "chromium: $chromium ($("$chromium" --version 2>/dev/null || true))"
  # a copy of kiln-tiny whose config.json is a FIFO: its server stays "loading" until web.mjs
  # writes the real file into it
  local slow="$TMP/slow-model" f
  mkdir -p "$slow"
  for f in "$SRC"/share/models/kiln-tiny/*; do
    [ "$(basename "$f")" = config.json ] || ln -s "$f" "$slow/"
  done
  mkfifo "$slow/config.json"
  local model="$TMP/vl-tiny"
  python3 "$TESTS/make_vl_model.py" "$SRC/tests/fixtures/models/qwen2_vl" "$model" ||
    fail "make_vl_model.py failed"
  # no prefix cache: the page's turn and the API request that checks it would otherwise start
  # from different cached prefixes, so their prompts are prefilled in different chunks, whose
  # GEMMs round differently (OpenBLAS picks kernels by shape) and can flip a near-tie in bf16
  start_server main --set cache.enable_prefix_caching=false
  start_server loading --set "model.path=$slow" --set server.served_model_name=kiln-tiny
  start_server busy --set server.max_queued_requests=1 --set engine.max_num_seqs=1 \
    --set cache.num_blocks=256
  start_server auth --set server.api_key=web-key-456 --set cache.num_blocks=256
  start_server vl --set "model.path=$model" --set model.dtype=float32 --set cache.num_blocks=512
  local main busy auth vl loading port
  main=$(wait_ready main)
  busy=$(wait_ready busy)
  auth=$(wait_ready auth)
  vl=$(wait_ready vl)
  for _ in $(seq 600); do
    port=$(sed -n 's|.* listening on http://127\.0\.0\.1:\([0-9]*\);.*|\1|p' "$TMP/loading.err")
    [ -n "$port" ] && break
    [ -e "$TMP/loading.rc" ] && fail "the loading server exited: $(cat "$TMP/loading.err")"
    sleep 0.1
  done
  [ -n "$port" ] || fail "the loading server did not start listening"
  loading="http://127.0.0.1:$port"
  run_node web.mjs KILN_URL="$main" KILN_URL_LOADING="$loading" KILN_URL_BUSY="$busy" \
    KILN_URL_AUTH="$auth" KILN_AUTH_KEY=web-key-456 KILN_URL_VL="$vl" \
    KILN_IMAGES="$SRC/tests/fixtures/models/qwen2_vl/images" KILN_CHROMIUM="$chromium" \
    KILN_ARTIFACTS="$BUILD/test-artifacts" KILN_LOADING_FIFO="$slow/config.json" \
    KILN_LOADING_CONFIG="$SRC/share/models/kiln-tiny/config.json"
  wait_ready loading >/dev/null
  for name in main loading busy auth vl; do stop_server "$name"; done
  echo "test_server_web: all passed (screenshots in $BUILD/test-artifacts)"
}

# ---- images ------------------------------------------------------------------------------------

# Image input on the tiny Qwen2-VL fixture, made servable (a tokenizer and chat template) by
# tests/server/make_vl_model.py; a text-only server for the refusal.
run_images() {
  npm_setup
  local model="$TMP/vl-tiny"
  python3 "$TESTS/make_vl_model.py" "$SRC/tests/fixtures/models/qwen2_vl" "$model" ||
    fail "make_vl_model.py failed"
  local vlset=(--set "model.path=$model" --set model.dtype=float32 --set cache.num_blocks=512)
  start_server vl "${vlset[@]}" --set model.max_images_per_prompt=2
  start_server remote "${vlset[@]}" --set server.allow_remote_images=true \
    --set server.max_image_bytes=60000 --set server.image_fetch_timeout=5
  start_server text
  local vl remote text
  vl=$(wait_ready vl)
  remote=$(wait_ready remote)
  text=$(wait_ready text)
  run_node images.mjs KILN_URL_VL="$vl" KILN_URL_REMOTE="$remote" KILN_URL_TEXT="$text" \
    KILN_IMAGES="$SRC/tests/fixtures/models/qwen2_vl/images" KILN_DATA_IMAGES="$SRC/tests/data/images"
  for name in vl remote text; do stop_server "$name"; done
  echo "test_server_images: all passed"
}

# Structured outputs (tests/server/structured.mjs): the schema corpus of tests/data/schemas,
# every finished output validated by ajv; regex, choice and grammar constraints; the 400s.
run_structured() {
  npm_setup
  start_server main --set engine.max_num_seqs=16
  local main
  main=$(wait_ready main)
  run_node structured.mjs KILN_URL="$main" KILN_SCHEMAS="$SRC/tests/data/schemas"
  stop_server main
  echo "test_server_structured: all passed"
}

# ---- tools -------------------------------------------------------------------------------------

# Tool calling (tests/server/tools.mjs) on the fixture models of tests/server/make_tool_model.py,
# whose replies are fixed calls and texts, with the real Qwen3 and Mistral Nemo chat templates
# from $KILN_TOKENIZER_CACHE (tests/fetch_tokenizers.sh); kiln-tiny for a template without tools.
run_tools() {
  npm_setup
  local cache=${KILN_TOKENIZER_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/kiln/tokenizers}
  [ -s "$cache/qwen3/tokenizer_config.json" ] && [ -s "$cache/mistral_nemo/tokenizer_config.json" ] ||
    fail "no Qwen3 / Mistral Nemo tokenizer files in $cache (run tests/fetch_tokenizers.sh $cache)"
  python3 "$TESTS/make_tool_model.py" "$cache" "$TMP/toolm" || fail "make_tool_model.py failed"
  local set=(--set model.dtype=float32 --set cache.num_blocks=512)
  start_server hermes "${set[@]}" --set "model.path=$TMP/toolm/hermes"
  start_server mistral "${set[@]}" --set "model.path=$TMP/toolm/mistral"
  start_server llama "${set[@]}" --set "model.path=$TMP/toolm/llama3"
  start_server noparse "${set[@]}" --set "model.path=$TMP/toolm/hermes" --set server.tool_parser=none
  start_server plain --set cache.num_blocks=256
  local hermes mistral llama noparse plain
  hermes=$(wait_ready hermes)
  mistral=$(wait_ready mistral)
  llama=$(wait_ready llama)
  noparse=$(wait_ready noparse)
  plain=$(wait_ready plain)
  run_node tools.mjs KILN_URL_HERMES="$hermes" KILN_URL_MISTRAL="$mistral" KILN_URL_LLAMA="$llama" \
    KILN_URL_NOPARSE="$noparse" KILN_URL_PLAIN="$plain"
  for name in hermes mistral llama noparse plain; do stop_server "$name"; done
  echo "test_server_tools: all passed"
}

case "$MODE" in
api) run_api ;;
load) run_load ;;
images) run_images ;;
structured) run_structured ;;
tools) run_tools ;;
web) run_web ;;
*) fail "unknown mode '$MODE' (api, load, images, tools, web or structured)" ;;
esac
