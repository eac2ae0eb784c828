#!/usr/bin/env bash
# test_cli.sh - the `kiln` command end to end: info, config errors, overrides, help.
# Usage: test_cli.sh BUILD_DIR SOURCE_DIR. Prints "N passed, N failed".
set -u
build=$1; src=$2
kiln="$build/bin/kiln"
pass=0; fail=0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# check NAME EXPECTED_RC REGEX -- CMD...: runs CMD, wants its exit code and output to match.
check() {
  local name=$1 want_rc=$2 regex=$3; shift 4
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [ "$rc" = "$want_rc" ] && grep -Eq -- "$regex" <<<"$out"; then
    pass=$((pass + 1)); echo "ok   $name"
  else
    fail=$((fail + 1)); echo "FAIL $name (rc $rc, want $want_rc; output did not match /$regex/):"
    sed 's/^/     | /' <<<"$out" | head -40
  fi
}

cd "$tmp"   # no ./etc/kiln.ini here: built-in defaults unless --config is given
check "info lists the cpu backend" 0 'cpu +.*libkiln-backend-cpu\.so' -- "$kiln" info
check "info shows the cpu device" 0 'device 0: .*CPU' -- "$kiln" info
check "auto picks a backend" 0 'backend = auto -> ' -- "$kiln" info
if [ -f "$build/lib/kiln/libkiln-backend-cuda.so" ]; then
  if ldconfig -p | grep -q 'libcuda\.so\.1'; then
    check "cuda plugin present" 0 'cuda +.*libkiln-backend-cuda\.so' -- "$kiln" info
  else
    check "cuda plugin rejected with the driver's reason" 0 \
      'reason: .*libcuda\.so\.1: cannot open shared object file' -- "$kiln" info
    check "explicit cuda without a driver is a hard error" 1 \
      'backend = cuda: cannot be used: .*libcuda\.so\.1' -- "$kiln" info --set backend.name=cuda
  fi
fi
check "explicit cpu" 0 'backend = cpu -> cpu' -- "$kiln" info --set backend.name=cpu
check "unknown backend name" 1 "backend 'nosuch': no file libkiln-backend-nosuch.so" \
  -- "$kiln" info --set backend.name=nosuch
check "missing backend path" 1 'No such file or directory' \
  -- "$kiln" info --set backend.name=/nonexistent/libkiln-backend-x.so

printf '[engine]\nmax_num_seqs = 0\n' >bad_range.ini
check "out-of-range value names file:line and range" 1 'bad_range\.ini:2: .*max_num_seqs.*\[1, ' \
  -- "$kiln" info --config bad_range.ini
printf '[engine]\nmax_num_seq = 4\n' >bad_key.ini
check "unknown key suggests the right one" 1 'bad_key\.ini:2: .*max_num_seq.*max_num_seqs' \
  -- "$kiln" info --config bad_key.ini
printf '[enigne]\n' >bad_section.ini
check "unknown section" 1 'bad_section\.ini:1: .*enigne' -- "$kiln" info --config bad_section.ini
printf '[engine\nmax_num_seqs = 4\n' >bad_syntax.ini
check "syntax error" 1 'bad_syntax\.ini:1: ' -- "$kiln" info --config bad_syntax.ini
check "missing config file" 1 'nonexistent\.ini' -- "$kiln" info --config nonexistent.ini
check "bad --set" 1 'log\.level' -- "$kiln" info --set log.level=loud
check "--set without =" 1 '--set' -- "$kiln" info --set engine.max_num_seqs
check "--set wins over the file" 0 'max_num_seqs = 7' \
  -- "$kiln" config --config "$src/etc/kiln.ini" --set engine.max_num_seqs=7
check "default config loads" 0 'backend = auto -> ' -- "$kiln" info --config "$src/etc/kiln.ini"
for ex in "$src"/etc/examples/*.ini; do
  check "example config $(basename "$ex") loads" 0 '^\[backend\]' -- "$kiln" config --config "$ex"
done
check "--help-config lists keys" 0 'gpu_memory_utilization' -- "$kiln" --help-config
check "unknown command" 2 "unknown command 'frobnicate'" -- "$kiln" frobnicate
check "version" 0 'backend ABI [0-9]+\.[0-9]+\)' -- "$kiln" --version

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
