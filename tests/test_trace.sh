#!/usr/bin/env bash
# test_trace.sh - plugins/trace, built from the installed SDK alone (CMake's find_package(Kiln),
# then pkg-config + cc), wraps the cpu backend, the model fixtures still pass through it
# (kiln selftest, the default model's greedy text, test_engine, test_graphs), its report counts
# the ops, and bad [plugin.trace] settings are clear errors, never a crash.
# Usage: test_trace.sh BUILD_DIR SOURCE_DIR. Prints "N passed, N failed".
set -u
build=$(cd "$1" && pwd); src=$(cd "$2" && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
pass=0; fail=0; skip=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; [ -f "$tmp/log" ] && sed 's/^/     | /' "$tmp/log" | tail -40; }
skipped() { skip=$((skip + 1)); echo "SKIP $1"; }
unset KILN_BACKEND_PATH KILN_CONFIG KILN_TEST_BACKEND KILN_TEST_SET
# A sanitizer build runs the long fixtures cut down (test_graphs' KILN_TEST_QUICK).
quick=0; grep -q '^KILN_SANITIZE:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null && quick=1

# has_ops REPORT OP...: every OP has a row with calls > 0 in the (last) text report.
has_ops() {
  local f=$1; shift
  for op in "$@"; do
    awk -v op="$op" '$1 == op && $2 > 0 {found = 1} END {exit !found}' "$f" || { echo "no calls of $op in $f" >>"$tmp/log"; return 1; }
  done
}

if cmake --install "$build" --prefix "$prefix" >"$tmp/log" 2>&1; then ok "cmake --install"; else bad "cmake --install"; fi

# 1. CMake, out of tree: find_package(Kiln) + kiln_add_plugin.
if cmake -S "$src/plugins/trace" -B "$tmp/trace" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/log" 2>&1 &&
   cmake --build "$tmp/trace" >>"$tmp/log" 2>&1 && [ -f "$tmp/trace/libkiln-backend-trace.so" ]; then
  ok "trace built with find_package(Kiln)"; else bad "trace built with find_package(Kiln)"; fi
so=$tmp/trace/libkiln-backend-trace.so
exported=$(nm -D --defined-only "$so" 2>/dev/null | awk '$2 == "T" {print $3}')
if [ "$exported" = "kiln_backend_query" ]; then ok "exports only kiln_backend_query"; else echo "exports: $exported" >"$tmp/log"; bad "exports only kiln_backend_query"; fi
if ! readelf -d "$so" 2>/dev/null | grep NEEDED | grep -q libkiln &&
   ! grep -Eq '^#include +"' "$src/plugins/trace/trace.c" &&
   [ -z "$(grep -E '^#include +<kiln/' "$src/plugins/trace/trace.c" | grep -Ev '<kiln/hal(_util)?\.h>')" ]; then
  ok "includes only the SDK headers, links no libkiln"
else readelf -d "$so" | grep NEEDED >"$tmp/log"; grep '#include' "$src/plugins/trace/trace.c" >>"$tmp/log"; bad "includes only the SDK headers, links no libkiln"; fi

# 2. pkg-config + cc, the README's one line (plus the warning flags).
mkdir -p "$tmp/pc"
if PKG_CONFIG_PATH="$prefix/lib/pkgconfig" sh -c 'cc -std=c11 -O2 -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Werror \
     -shared -fPIC -fvisibility=hidden $(pkg-config --cflags kiln) "$1" -o "$2" \
     -Wl,--version-script=$(pkg-config --variable=pluginmap kiln) -Wl,--no-undefined' _ \
     "$src/plugins/trace/trace.c" "$tmp/pc/libkiln-backend-trace.so" >"$tmp/log" 2>&1; then
  ok "trace built with pkg-config kiln"; else bad "trace built with pkg-config kiln"; fi

# 3. The installed kiln: `kiln info` lists trace (and writes no report: no device was opened).
cd "$tmp"
kiln=$prefix/bin/kiln
if KILN_BACKEND_PATH="$tmp/trace" "$kiln" info --set plugin.trace.backend=cpu >"$tmp/log" 2>&1 &&
   grep -q "trace .*$tmp/trace/libkiln-backend-trace.so" "$tmp/log" && grep -q 'build: trace over cpu' "$tmp/log" &&
   ! grep -q '== kiln trace' "$tmp/log"; then ok "kiln info lists trace over cpu"; else bad "kiln info lists trace over cpu"; fi

# 4. kiln selftest (a decoder layer through every op vs fp64) through each build of trace.
for d in trace pc; do
  rm -f "$tmp/selftest-$d.txt"
  if KILN_BACKEND_PATH="$tmp/$d" "$kiln" selftest --seed 7 --set backend.name=trace --set plugin.trace.backend=cpu \
       --set plugin.trace.output="$tmp/selftest-$d.txt" >"$tmp/log" 2>&1 &&
     grep -q 'kiln selftest: backend trace' "$tmp/log" && grep -q '^selftest passed' "$tmp/log" &&
     grep -q '^== kiln trace (pid [0-9]*): backend cpu' "$tmp/selftest-$d.txt" &&
     has_ops "$tmp/selftest-$d.txt" gemm attention rmsnorm rope silu_mul embedding kv_write copy argmax copy_h2d copy_d2h buffer_alloc; then
    ok "kiln selftest through trace ($d build), report counts the ops"
  else cat "$tmp/selftest-$d.txt" >>"$tmp/log" 2>/dev/null; bad "kiln selftest through trace ($d build), report counts the ops"; fi
done
cp "$tmp/selftest-trace.txt" "$tmp/selftest.txt" 2>/dev/null

# 5. The embedded default model: the same greedy text through trace as on cpu; a JSON report.
gen=(generate --prompt "Once upon a time" --max-tokens 24 --temperature 0 --ignore-eos --set backend.threads=2)
"$kiln" "${gen[@]}" --set backend.name=cpu >"$tmp/gen-cpu.txt" 2>"$tmp/log"
if KILN_BACKEND_PATH="$tmp/trace" "$kiln" "${gen[@]}" --set backend.name=trace --set plugin.trace.backend=cpu \
     --set plugin.trace.format=json --set plugin.trace.output="$tmp/gen.json" >"$tmp/gen-trace.txt" 2>"$tmp/log" &&
   [ -s "$tmp/gen-cpu.txt" ] && cmp -s "$tmp/gen-cpu.txt" "$tmp/gen-trace.txt"; then
  ok "default model: same greedy text through trace"
else diff "$tmp/gen-cpu.txt" "$tmp/gen-trace.txt" >>"$tmp/log" 2>&1; bad "default model: same greedy text through trace"; fi
if [ "$(wc -l <"$tmp/gen.json" 2>/dev/null)" = 1 ] &&
   grep -q '"report":"kiln-trace"' "$tmp/gen.json" && grep -q '"backend":"cpu"' "$tmp/gen.json" &&
   grep -Eq '\{"op":"gemm","calls":[1-9]' "$tmp/gen.json" && grep -Eq '\{"op":"attention","calls":[1-9]' "$tmp/gen.json" &&
   { ! command -v python3 >/dev/null || python3 -c 'import json,sys; json.loads(open(sys.argv[1]).read())' "$tmp/gen.json"; } >"$tmp/log" 2>&1; then
  ok "format = json: one valid JSON line with the ops"
else cat "$tmp/gen.json" >>"$tmp/log" 2>/dev/null; bad "format = json: one valid JSON line with the ops"; fi

# 6. test_engine (the llama2 fixture vs transformers' logits, batching, preemption, threads)
#    through trace; each engine opens the backend once, so one report (appended) per engine.
if [ -x "$build/tests/test_engine" ]; then
  rm -f "$tmp/engine.txt"
  if (cd "$build/tests" && KILN_SOURCE_DIR="$src" KILN_BACKEND_PATH="$tmp/trace" KILN_TEST_BACKEND=trace \
        KILN_TEST_SET="plugin.trace.backend=cpu;plugin.trace.output=$tmp/engine.txt;plugin.trace.sync=true" \
        ./test_engine) >"$tmp/log" 2>&1 &&
     [ "$(grep -c '^== kiln trace' "$tmp/engine.txt")" -ge 5 ] && grep -q 'sync = true' "$tmp/engine.txt" &&
     has_ops "$tmp/engine.txt" gemm attention rmsnorm rope silu_mul kv_write embedding sample copy_h2d copy_d2h stream_sync; then
    ok "test_engine passes through trace ($(grep -c '^== kiln trace' "$tmp/engine.txt") reports)"
  else tail -40 "$tmp/engine.txt" >>"$tmp/log" 2>/dev/null; bad "test_engine passes through trace"; fi
else skipped "test_engine through trace: $build/tests/test_engine not built"; fi

# 7. test_graphs (decode graphs vs eager, the engine with graphs on and off) through trace:
#    graphs pass through, and the report counts captured and replayed ops. Its registry gives
#    plugins no config, so trace runs on its defaults (backend = auto: cpu here; stderr).
if [ -x "$build/tests/test_graphs" ]; then
  if (cd "$build/tests" && KILN_SOURCE_DIR="$src" KILN_BACKEND_PATH="$tmp/trace" KILN_TEST_BACKEND=trace \
        KILN_TEST_QUICK=$quick ./test_graphs) >"$tmp/graphs.out" 2>"$tmp/graphs.err" &&
     grep -q '^== kiln trace.*backend cpu' "$tmp/graphs.err" &&
     has_ops "$tmp/graphs.err" gemm attention graph_begin graph_end graph_replay &&
     awk '$1 == "gemm" && $4 > 0 && $5 > 0 {f = 1} END {exit !f}' "$tmp/graphs.err"; then
    ok "test_graphs passes through trace (graphs captured and replayed)"
  else cat "$tmp/graphs.out" "$tmp/graphs.err" >"$tmp/log"; bad "test_graphs passes through trace"; fi
else skipped "test_graphs through trace: $build/tests/test_graphs not built"; fi

# 8. Bad settings: a clear error naming the problem, exit status 1, no crash, no report.
# expect_error NAME PATTERN --set ...: kiln selftest must fail with PATTERN in its message.
expect_error() {
  local name=$1 pat=$2; shift 2
  KILN_BACKEND_PATH="$tmp/trace" "$kiln" selftest --seed 1 --set backend.name=trace "$@" >"$tmp/log" 2>&1
  local rc=$?
  if [ $rc = 1 ] && grep -q "$pat" "$tmp/log" && ! grep -q '== kiln trace' "$tmp/log"; then ok "$name"; else echo "exit status $rc" >>"$tmp/log"; bad "$name"; fi
}
expect_error "a wrapped backend that does not exist" "init: \[plugin.trace\] backend = nosuch: backend 'nosuch': no file libkiln-backend-nosuch.so" \
  --set plugin.trace.backend=nosuch
expect_error "a wrapped backend file that does not exist" "\[plugin.trace\] backend = $tmp/none.so: backend file $tmp/none.so" \
  --set plugin.trace.backend="$tmp/none.so"
expect_error "trace wrapping itself" "backend 'trace' cannot wrap itself" --set plugin.trace.backend=trace
expect_error "trace wrapping itself by path" "plugins wrap each other in a cycle" --set plugin.trace.backend="$so"
expect_error "sync = maybe" "\[plugin.trace\] sync = 'maybe' is not a boolean" --set plugin.trace.backend=cpu --set plugin.trace.sync=maybe
expect_error "format = xml" "\[plugin.trace\] format = 'xml': use text or json" --set plugin.trace.format=xml
expect_error "output in a missing directory" "\[plugin.trace\] output = '$tmp/no/such/dir/t.txt': cannot open" \
  --set plugin.trace.output="$tmp/no/such/dir/t.txt"
expect_error "gemm_shapes = lots" "\[plugin.trace\] gemm_shapes = 'lots': want an integer" --set plugin.trace.gemm_shapes=lots
# An unknown key (a typo): the host lists the section's keys (ABI 1.1 config_key), so trace
# names it and the valid ones; from the command line and from an INI file alike.
expect_error "unknown key plugin.trace.bogus" \
  "init: \[plugin.trace\] unknown key 'bogus': valid keys are backend, sync, output, format, gemm_shapes" \
  --set plugin.trace.backend=cpu --set plugin.trace.bogus=1
printf '[backend]\nname = trace\n\n[plugin.trace]\nbackend = cpu\nsynk = true\n' >"$tmp/typo.ini"
KILN_BACKEND_PATH="$tmp/trace" "$kiln" selftest --seed 1 --config "$tmp/typo.ini" >"$tmp/log" 2>&1
rc=$?
if [ $rc = 1 ] && grep -q "\[plugin.trace\] unknown key 'synk'" "$tmp/log" && ! grep -q '== kiln trace' "$tmp/log"; then
  ok "unknown key synk in an INI file"; else echo "exit status $rc" >>"$tmp/log"; bad "unknown key synk in an INI file"; fi

echo "$pass passed, $fail failed$([ $skip = 0 ] || echo ", $skip skipped")"
[ "$fail" = 0 ]
