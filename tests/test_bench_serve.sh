#!/usr/bin/env bash
# test_bench_serve.sh - `kiln bench serve` against tests/fake_openai_server.py (a streaming
# OpenAI-compatible server with known delays): request and token counts, TTFT/ITL/TPOT close to
# the injected delays, the JSON output, the request bodies and API key sent, --max-concurrency,
# Poisson arrivals at --request-rate, a chat dataset with warmup, --image-dir (data: URL image
# parts, cyclically, checked byte for byte at the server), token-id prompts, unusual but
# legal SSE framing, and every kind of server failure (4xx/5xx, junk in the stream, dropped
# connections, timeouts, no server), each of which must fail only its own requests with a message
# and exit status 1. The fake server binds a free port itself and writes it to a file.
# Usage: test_bench_serve.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
BUILD=${1:?build dir}
SRC=${2:?source dir}
KILN="$BUILD/bin/kiln"
FAKE="$SRC/tests/fake_openai_server.py"
TMP=$(mktemp -d /tmp/kiln-benchserve-XXXXXX)
SERVER_PID=
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT
unset KILN_API_KEY OPENAI_API_KEY

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# start_server ARGS...: starts the fake server on a free port; sets PORT and URL.
start_server() {
  stop_server
  rm -f "$TMP/port"
  python3 "$FAKE" --port-file "$TMP/port" "$@" &
  SERVER_PID=$!
  for _ in $(seq 200); do
    [ -s "$TMP/port" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || fail "the fake server did not start ($*)"
    sleep 0.05
  done
  PORT=$(cat "$TMP/port") || fail "the fake server wrote no port"
  URL="http://127.0.0.1:$PORT"
}

stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
  fi
}

# bench NAME WANT_RC ARGS...: runs kiln bench serve; stdout, stderr in $TMP/NAME.{out,err}.
bench() {
  local name=$1 want=$2 rc=0
  shift 2
  "$KILN" bench serve "$@" >"$TMP/$name.out" 2>"$TMP/$name.err" || rc=$?
  if [ "$rc" != "$want" ]; then
    cat "$TMP/$name.out" "$TMP/$name.err" >&2
    fail "$name: exit status $rc, want $want"
  fi
}

# want NAME REGEX: the run's stdout + stderr match REGEX.
want() {
  grep -Eq -- "$2" "$TMP/$1.out" "$TMP/$1.err" || {
    cat "$TMP/$1.out" "$TMP/$1.err" >&2
    fail "$1: no match for /$2/"
  }
}

stats() { python3 -c "import json, urllib.request as u; print(json.load(u.urlopen('$URL/stats'))['$1'])"; }

# ---- 1. completions: counts, timing, JSON, request bodies, API key, max concurrency -----------
start_server --ttft 0.1 --itl 0.02 --require-key secret --log "$TMP/basic.log"
KILN_API_KEY=secret bench basic 0 --url "$URL/" --num-prompts 20 --max-concurrency 4 \
  --input-len 16 --output-len 8 --ignore-eos --json "$TMP/basic.json"
want basic 'Successful requests: +20'
want basic 'Failed requests: +0'
want basic 'TTFT +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +20'
want basic 'ITL +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +140'
[ "$(stats requests)" = 20 ] || fail "the server saw $(stats requests) requests, want 20"
[ "$(stats max_in_flight)" = 4 ] || fail "max in flight $(stats max_in_flight), want 4"
python3 - "$TMP/basic.json" "$TMP/basic.log" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 20 and r["failed"] == 0, r
assert r["model"] == "fake-model" and r["endpoint"] == "completions", r
assert r["request_rate"] is None and r["max_concurrency"] == 4, r
assert r["input_tokens"] == 20 * 16 and r["output_tokens"] == 20 * 8, r
# The server waits 100 ms for the first token and 20 ms between tokens.
assert 90 <= r["ttft_ms"]["mean"] <= 300 and r["ttft_ms"]["count"] == 20, r["ttft_ms"]
assert 90 <= r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"] <= r["ttft_ms"]["p99"], r["ttft_ms"]
assert 15 <= r["itl_ms"]["mean"] <= 80 and r["itl_ms"]["count"] == 20 * 7, r["itl_ms"]
assert 15 <= r["tpot_ms"]["mean"] <= 80 and r["tpot_ms"]["count"] == 20, r["tpot_ms"]
assert 230 <= r["e2e_ms"]["mean"] <= 800, r["e2e_ms"]
# 20 requests, 4 at a time, about 0.24 s each: 5 rounds.
assert 1.1 <= r["duration_s"] <= 4, r["duration_s"]
assert abs(r["request_throughput"] - 20 / r["duration_s"]) < 1e-3 * r["request_throughput"], r
assert len(r["requests"]) == 20 and all(q["ok"] and q["error"] is None for q in r["requests"])
assert all(q["output_tokens"] == 8 and q["http_status"] == 200 for q in r["requests"])
assert r["errors"] == [], r["errors"]
log = [json.loads(l) for l in open(sys.argv[2])]
assert len(log) == 20, len(log)
prompts = set()
for e in log:
    b = e["body"]
    assert e["path"] == "/v1/completions" and e["authorization"] == "Bearer secret", e
    assert b["model"] == "fake-model" and b["stream"] is True, b
    assert b["stream_options"] == {"include_usage": True}, b
    assert b["ignore_eos"] is True and b["max_tokens"] == 8 and b["temperature"] == 0, b
    assert isinstance(b["prompt"], str) and len(b["prompt"].split()) == 16, b
    prompts.add(b["prompt"])
assert len(prompts) == 20, "random prompts repeat"
EOF

# A wrong key: every request fails with the server's 401 message; exit status 1.
bench badkey 1 --url "$URL" --api-key wrong --num-prompts 3 --output-len 2
want badkey '3 of 3 requests failed'
want badkey 'request 0: HTTP 401: invalid API key'

# ---- 2. Poisson arrivals: 40 requests at 20/s take about 2 s -----------------------------------
start_server --ttft 0.2 --itl 0.005
bench rate 0 --url "$URL" --model fake-model --num-prompts 40 --request-rate 20 --output-len 2 \
  --seed 7 --json "$TMP/rate.json"
want rate 'Request rate \(req/s\): +20'
bench burst 0 --url "$URL" --model fake-model --num-prompts 30 --output-len 2 --json "$TMP/burst.json"
python3 - "$TMP/rate.json" "$TMP/burst.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 40 and r["request_rate"] == 20, r
starts = [q["start_s"] for q in r["requests"]]
assert starts == sorted(starts) and starts[0] < 0.05, starts
gap = starts[-1] / 39  # mean exponential gap: 1/20 s
assert 0.03 <= gap <= 0.08, gap
assert 1.2 <= r["duration_s"] <= 4, r["duration_s"]
b = json.load(open(sys.argv[2]))  # rate inf, no limit: all start at once
assert b["completed"] == 30 and max(q["start_s"] for q in b["requests"]) < 0.2, b["requests"]
EOF
[ "$(stats max_in_flight)" -ge 20 ] || fail "rate inf had only $(stats max_in_flight) in flight"

# ---- 3. chat with a dataset (prompt and messages lines, per-line max_tokens) and warmup -------
start_server --ttft 0.05 --itl 0.005 --log "$TMP/chat.log"
cat >"$TMP/data.jsonl" <<'EOF'
{"prompt": "hello there world", "max_tokens": 3}

{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hi"}], "max_tokens": 5}
{"prompt": "one two"}
EOF
bench chat 0 --url "$URL" --endpoint chat --dataset "$TMP/data.jsonl" --output-len 4 --warmup 2 \
  --json "$TMP/chat.json"
bench chat7 0 --url "$URL" --endpoint chat --dataset "$TMP/data.jsonl" --output-len 4 \
  --num-prompts 7 --json "$TMP/chat7.json"
python3 - "$TMP/chat.json" "$TMP/chat7.json" "$TMP/chat.log" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 3 and r["failed"] == 0 and r["endpoint"] == "chat", r
assert r["output_tokens"] == 3 + 5 + 4 and r["input_tokens"] == 3 + 4 + 2, r
# The role-only first chunk comes at once; TTFT waits for content (50 ms).
assert r["ttft_ms"]["mean"] >= 45, r["ttft_ms"]
assert r["tpot_ms"]["count"] == 3, r["tpot_ms"]
r7 = json.load(open(sys.argv[2]))
assert r7["completed"] == 7 and r7["output_tokens"] == 2 * 12 + 3, r7
log = [json.loads(l) for l in open(sys.argv[3])]
assert len(log) == 2 + 3 + 7, len(log)  # the warmup requests reach the server too
assert all(e["path"] == "/v1/chat/completions" for e in log)
# The three measured requests run at once, so they reach the server in any order.
got = sorted((b["max_tokens"], b["messages"]) for b in (e["body"] for e in log[2:5]))
assert got == [(3, [{"role": "user", "content": "hello there world"}]),
               (4, [{"role": "user", "content": "one two"}]),
               (5, [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "say hi"}])], got
assert all("ignore_eos" not in e["body"] and e["body"]["stream"] is True for e in log), log
EOF

# ---- 3b. --image-dir: each chat request carries one image (name order, cyclically) as a data:
# URL before its text; other files are skipped; refusals for completions and messages lines ----
mkdir -p "$TMP/imgs"
cp "$SRC/tests/data/images/grey.png" "$TMP/imgs/b.png"
cp "$SRC/tests/data/images/grey.jpg" "$TMP/imgs/a.jpg"
cp "$SRC/tests/data/images/alpha_lossless.webp" "$TMP/imgs/c.webp"
echo "not an image" >"$TMP/imgs/notes.txt"
n_before=$(wc -l <"$TMP/chat.log")
bench img 0 --url "$URL" --endpoint chat --image-dir "$TMP/imgs" --input-len 5 --output-len 2 \
  --num-prompts 4 --max-concurrency 1 --json "$TMP/img.json"
python3 - "$TMP/img.json" "$TMP/chat.log" "$n_before" "$TMP/imgs" <<'EOF'
import base64, json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 4 and r["failed"] == 0 and r["image_dir"] == sys.argv[4], r
log = [json.loads(l) for l in open(sys.argv[2])][int(sys.argv[3]):]
assert len(log) == 4, len(log)
want = ["a.jpg", "b.png", "c.webp", "a.jpg"]  # one at a time: in order
types = {"jpg": "image/jpeg", "png": "image/png", "webp": "image/webp"}
for e, name in zip(log, want):
    (m,) = e["body"]["messages"]
    img, txt = m["content"]
    assert m["role"] == "user" and img["type"] == "image_url" and txt["type"] == "text", m
    url = img["image_url"]["url"]
    head, data = url.split(",", 1)
    assert head == "data:%s;base64" % types[name.split(".")[1]], head
    assert base64.b64decode(data) == open(sys.argv[4] + "/" + name, "rb").read(), name
    assert len(txt["text"].split()) == 5, txt
EOF
bench img_comp 1 --url "$URL" --image-dir "$TMP/imgs" --num-prompts 1
grep -q -- "--image-dir sends image_url parts, which only --endpoint chat takes" "$TMP/img_comp.err" ||
  fail "img_comp: $(cat "$TMP/img_comp.err")"
bench img_msgs 1 --url "$URL" --endpoint chat --image-dir "$TMP/imgs" --dataset "$TMP/data.jsonl"
grep -q "carries its own images: no --image-dir" "$TMP/img_msgs.err" || fail "img_msgs: $(cat "$TMP/img_msgs.err")"
mkdir -p "$TMP/noimgs" && echo x >"$TMP/noimgs/x.png"
bench img_none 1 --url "$URL" --endpoint chat --image-dir "$TMP/noimgs" --num-prompts 1
grep -q "holds no PNG, JPEG or WebP file" "$TMP/img_none.err" || fail "img_none: $(cat "$TMP/img_none.err")"

# ---- 4. token-id prompts -------------------------------------------------------------------
bench ids 0 --url "$URL" --random-ids 1000 --input-len 32 --output-len 3 --num-prompts 5 \
  --seed 3 --json "$TMP/ids.json"
python3 - "$TMP/ids.json" "$TMP/chat.log" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 5 and r["input_tokens"] == 5 * 32 and r["output_tokens"] == 15, r
log = [json.loads(l) for l in open(sys.argv[2])][-5:]
for e in log:
    p = e["body"]["prompt"]
    assert e["path"] == "/v1/completions" and isinstance(p, list) and len(p) == 32, e
    assert all(isinstance(x, int) and 0 <= x < 1000 for x in p), p
EOF

# ---- 5. unusual but legal SSE: CRLF, comments, event fields, events split across writes -----
start_server --ttft 0.02 --itl 0.01 --odd-sse
bench oddsse 0 --url "$URL" --endpoint chat --num-prompts 4 --output-len 5 --json "$TMP/odd.json"
python3 - "$TMP/odd.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 4 and r["output_tokens"] == 20 and r["itl_ms"]["count"] == 16, r
assert r["ttft_ms"]["mean"] >= 18 and r["itl_ms"]["mean"] >= 9, r
EOF

# ---- 6. failures: each kind fails 2 of 8 requests, the rest succeed --------------------------
check_fault() {
  local kind=$1 regex=$2
  start_server --ttft 0.01 --itl 0.005 --fault "$kind" --fault-every 4
  bench "fault_$kind" 1 --url "$URL" --num-prompts 8 --max-concurrency 2 --output-len 4 \
    --timeout 10 --json "$TMP/fault_$kind.json"
  want "fault_$kind" '2 of 8 requests failed'
  want "fault_$kind" "$regex"
  python3 - "$TMP/fault_$kind.json" <<'EOF' || fail "fault $kind: JSON"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 6 and r["failed"] == 2 and r["output_tokens"] == 6 * 4, r
assert len(r["errors"]) == 2 and all(r["errors"]), r["errors"]
bad = [q for q in r["requests"] if not q["ok"]]
assert len(bad) == 2 and all(q["error"] for q in bad), bad
EOF
}
check_fault 500 'HTTP 500: injected failure'
check_fault 400text 'HTTP 400: bad request: injected'
check_fault garbage "event that is not JSON .*\{this is not json"
check_fault error 'error in the stream: injected stream error'
check_fault close 'transfer closed|outstanding read data|Recv failure|reset'
check_fault nodone 'the stream ended without data: \[DONE\]'
check_fault raw 'HTTP/0\.9|Weird server reply|Unsupported|nsupported protocol'

start_server --ttft 0.01 --itl 0.005 --fault hang --fault-every 2
bench hang 1 --url "$URL" --num-prompts 4 --output-len 2 --timeout 0.5
want hang '2 of 4 requests failed'
want hang 'timed out after 0.5 s'
stop_server

# ---- 7. no server, bad options --------------------------------------------------------------
bench refused 1 --url "http://127.0.0.1:$PORT" --model m --num-prompts 3 --json "$TMP/refused.json"
want refused '3 of 3 requests failed'
want refused 'onnect'
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['failed'] == 3 and r['ttft_ms']['mean'] is None, r" "$TMP/refused.json"
bench nomodel 1 --url "http://127.0.0.1:$PORT" --num-prompts 3
want nomodel "no --model, and GET http://127.0.0.1:$PORT/v1/models failed"
bench badendpoint 1 --endpoint embeddings
want badendpoint '--endpoint wants completions or chat'
bench idschat 1 --endpoint chat --random-ids 100
want idschat 'only --endpoint completions'
bench badrate 1 --request-rate 0
want badrate '--request-rate wants a number'
bench badopt 1 --frobnicate
want badopt "unknown or incomplete option '--frobnicate'"
bench help 0 --help
want help 'usage: kiln bench serve'
rc=0
"$KILN" bench nosuch >"$TMP/mode.out" 2>&1 || rc=$?
if [ "$rc" != 2 ] || ! grep -q "unknown bench mode 'nosuch'" "$TMP/mode.out"; then
  fail "kiln bench nosuch: exit status $rc: $(cat "$TMP/mode.out")"
fi

echo "test_bench_serve: all checks passed"
