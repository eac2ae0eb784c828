#!/usr/bin/env bash
# test_plugin_folders.sh - one `kiln` binary and one INI file (`[backend] name = auto`) over
# installation-like trees that differ only in the plugins they ship, as on an NVIDIA machine, an
# AMD machine or a CPU-only one:
#   1. cpu only                         auto -> cpu; generation works
#   2. cpu + fakegpu (score 150)        auto -> fakegpu, and the model runs through it (it wraps
#                                       cpu: tests/plugins/fake_backend.c FAKE_WRAP_CPU) with the
#                                       same greedy text; a second INI naming cpu still gets cpu
#   3. cpu + fakegpu built for ABI 2    rejected with "plugin ABI 2.0, host ABI 1.0" in `kiln
#      (score 200: it would win)        info`; auto -> cpu; asking for it by name is an error
#   4. no plugins                       a clear error from info and generate, exit status 1
#   5. cpu + each GPU plugin this build has (rocm, cuda): rejected with the runtime's reason
#      and auto -> cpu on a machine without that GPU, auto -> it on one with it; skipped (with
#      a "skip" line) when the build has none
# Usage: test_plugin_folders.sh BUILD_DIR SOURCE_DIR. Prints "N passed, N failed"; exits 77
# (skipped) when plugins installed in the default plugin directory would leak into every tree.
#
# How the trees are kept apart. bin/kiln finds libkiln.so.0 through its RUNPATH (the build's
# lib/), and libkiln searches plugins in $KILN_BACKEND_PATH, [backend] path, <the real folder of
# libkiln.so>/kiln (dladdr + realpath) and the configured install folder. So each tree gets a
# *copy* of libkiln.so.0 in TREE/lib (a symlink would resolve back to the build's lib/, whose
# lib/kiln may hold the CUDA plugin) and its plugins, as symlinks, in TREE/lib/kiln; the one
# kiln binary of the build runs with LD_LIBRARY_PATH=TREE/lib, which the dynamic linker
# searches before a RUNPATH; KILN_BACKEND_PATH is emptied and the INI sets no [backend] path.
# Every tree checks the "plugin search path" line of `kiln info` (TREE/lib/kiln first, no
# build folder) and that every plugin listed lives in TREE/lib/kiln.
set -u
build=$(cd "$1" && pwd -P); src=$2
# The host's ABI version, as the patterns below expect it ("1\\.1"), read from the header.
abi_major=$(sed -n 's/^#define KILN_HAL_ABI_MAJOR \([0-9]*\).*/\1/p' "$src/hal/include/kiln/hal.h")
abi_minor=$(sed -n 's/^#define KILN_HAL_ABI_MINOR \([0-9]*\).*/\1/p' "$src/hal/include/kiln/hal.h")
HOST_ABI="$abi_major\\.$abi_minor"
kiln=$build/bin/kiln
fakes=${KILN_FAKE_PLUGIN_DIR:-$build/tests/fakeplugins}
unset KILN_BACKEND_PATH KILN_CONFIG
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tmp=$(cd "$tmp" && pwd -P)
pass=0; fail=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() {
  fail=$((fail + 1)); echo "FAIL $1"
  [ -f "$tmp/out" ] && sed 's/^/     | /' "$tmp/out" | tail -30
}

for f in "$kiln" "$build/lib/libkiln.so.0" "$build/lib/kiln/libkiln-backend-cpu.so" \
         "$fakes/libfake-gpuwrap.so" "$fakes/libfake-gpuabi2.so"; do
  [ -e "$f" ] || { echo "FAIL missing $f (build the tests first)"; echo "0 passed, 1 failed"; exit 1; }
done

# The one INI file of every tree, and two that name a backend.
cat >"$tmp/kiln.ini" <<'EOF'
[backend]
name = auto
threads = 2
[log]
level = info
EOF
sed 's/^name = auto/name = cpu/' "$tmp/kiln.ini" >"$tmp/cpu.ini"
sed 's/^name = auto/name = fakegpu/' "$tmp/kiln.ini" >"$tmp/fakegpu.ini"

# tree NAME [FILE_NAME=PLUGIN ...]: TREE/lib/libkiln.so.0 (a copy) and TREE/lib/kiln holding
# libkiln-backend-FILE_NAME.so -> PLUGIN for each pair.
tree() {
  local t=$tmp/$1 spec; shift
  mkdir -p "$t/lib/kiln"
  cp "$build/lib/libkiln.so.0" "$t/lib/libkiln.so.0"
  for spec in "$@"; do ln -s "${spec#*=}" "$t/lib/kiln/libkiln-backend-${spec%%=*}.so"; done
}

# run TREE ARGS...: the build's kiln with TREE's libkiln, in TREE; stdout to $tmp/stdout, both
# streams to $tmp/out, exit status to $rc.
rc=0
run() {
  local t=$tmp/$1; shift
  (cd "$t" && LD_LIBRARY_PATH="$t/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$kiln" "$@") \
    >"$tmp/stdout" 2>"$tmp/stderr"
  rc=$?
  cat "$tmp/stdout" "$tmp/stderr" >"$tmp/out"
}

# has REGEX: $tmp/out matches the extended regex. lacks REGEX: it does not.
has() { grep -Eq -- "$1" "$tmp/out"; }
lacks() { ! grep -Eq -- "$1" "$tmp/out"; }
# An exit by signal (rc > 128) or a sanitizer report is a crash, whatever the test wanted.
crashed() { [ "$rc" -gt 128 ] || has 'AddressSanitizer|LeakSanitizer|runtime error:|Segmentation fault'; }

# check NAME WANT_RC CONDITION...: the last run exited WANT_RC ("nonzero": 1..127) without a
# crash, and every CONDITION (a shell command) holds.
check() {
  local name=$1 want=$2 c; shift 2
  local good=1
  if crashed; then good=0
  elif [ "$want" = nonzero ]; then [ "$rc" -ne 0 ] || good=0
  else [ "$rc" = "$want" ] || good=0
  fi
  for c in "$@"; do [ "$good" = 1 ] && ! eval "$c" && { good=0; echo "     condition failed: $c"; }; done
  if [ "$good" = 1 ]; then ok "$name"; else echo "     (exit status $rc, wanted $want)"; bad "$name"; fi
}

# isolated TREE: `kiln info` (already run for TREE) searched TREE/lib/kiln first, no build
# folder, and every plugin it lists is in TREE/lib/kiln.
isolated() {
  local t=$tmp/$1 sp others
  sp=$(sed -n 's/^plugin search path: //p' "$tmp/out")
  others=$(grep -E '^  [a-z0-9_-]+ +/' "$tmp/out" | awk '{print $2}' | grep -v "^$t/lib/kiln/")
  [[ "$sp" == "$t/lib/kiln:"* || "$sp" == "$t/lib/kiln" ]] && [[ "$sp" != *"$build"* ]] && [ -z "$others" ]
}

# Plugins installed in the configured install folder would appear in every tree.
tree probe
run probe info --config "$tmp/kiln.ini"
installdir=$(sed -n "s|^plugin search path: $tmp/probe/lib/kiln:||p" "$tmp/out")
if [ -n "$installdir" ] && compgen -G "$installdir/libkiln-backend-*.so" >/dev/null; then
  echo "skip: plugins are installed in $installdir, which every tree searches; uninstall them to run this test"
  exit 77
fi

# generate TREE INI: a short greedy run of the embedded default model.
generate() { run "$1" generate --config "$2" --prompt "Once upon a time" --max-tokens 12 --temperature 0; }

# ---- 1. cpu only ------------------------------------------------------------------------------
tree cpu cpu="$build/lib/kiln/libkiln-backend-cpu.so"
run cpu info --config "$tmp/kiln.ini"
check "1 cpu only: info searches only the tree's plugin folder" 0 "isolated cpu"
check "1 cpu only: auto -> cpu" 0 "has 'backend = auto -> cpu \\($tmp/cpu/lib/kiln/libkiln-backend-cpu\\.so\\)'"
generate cpu "$tmp/kiln.ini"
cp "$tmp/stdout" "$tmp/text.cpu"
check "1 cpu only: generate runs on cpu" 0 \
  "has 'backend auto: no GPU backend is usable; using cpu'" \
  "has 'backend cpu: $tmp/cpu/lib/kiln/libkiln-backend-cpu\\.so \\(ABI $HOST_ABI'" \
  "grep -q '^Once upon a time.' '$tmp/text.cpu'" \
  "[ \$(wc -c <'$tmp/text.cpu') -gt 20 ]"

# ---- 2. cpu + a fake GPU plugin that wraps cpu ----------------------------------------------
tree gpu cpu="$build/lib/kiln/libkiln-backend-cpu.so" fakegpu="$fakes/libfake-gpuwrap.so"
run gpu info --config "$tmp/kiln.ini"
check "2 cpu + fakegpu: info searches only the tree's plugin folder" 0 "isolated gpu"
check "2 cpu + fakegpu: both usable, fakegpu scores 150" 0 \
  "[ \$(grep -c '| usable' '$tmp/out') = 2 ]" "has 'usable \\| probe score 150'" \
  "has 'device 0: Fake fakegpu GPU'"
check "2 cpu + fakegpu: auto -> fakegpu" 0 \
  "has 'backend = auto -> fakegpu \\($tmp/gpu/lib/kiln/libkiln-backend-fakegpu\\.so\\)'"
generate gpu "$tmp/kiln.ini"
cp "$tmp/stdout" "$tmp/text.gpu"
check "2 cpu + fakegpu: generate runs through fakegpu" 0 \
  "has 'backend fakegpu: $tmp/gpu/lib/kiln/libkiln-backend-fakegpu\\.so \\(ABI $HOST_ABI, probe score 150\\)'" \
  "has 'backend fakegpu: fake GPU fakegpu: every op runs on the cpu backend it wraps'" \
  "lacks 'no GPU backend is usable'"
check "2 cpu + fakegpu: the same greedy text as on cpu" 0 "cmp -s '$tmp/text.cpu' '$tmp/text.gpu'"
run gpu info --config "$tmp/cpu.ini"
check "2 cpu + fakegpu: an INI naming cpu gets cpu" 0 \
  "has 'backend = cpu -> cpu \\($tmp/gpu/lib/kiln/libkiln-backend-cpu\\.so\\)'"
generate gpu "$tmp/cpu.ini"
check "2 cpu + fakegpu: generate with cpu named runs on cpu only" 0 \
  "has 'backend cpu: $tmp/gpu/lib/kiln/libkiln-backend-cpu\\.so \\(ABI $HOST_ABI'" \
  "lacks 'backend fakegpu: '" "cmp -s '$tmp/text.cpu' '$tmp/stdout'"

# ---- 3. cpu + a GPU plugin built for ABI major 2 ----------------------------------------------
tree abi2 cpu="$build/lib/kiln/libkiln-backend-cpu.so" fakegpu="$fakes/libfake-gpuabi2.so"
run abi2 info --config "$tmp/kiln.ini"
check "3 cpu + ABI-2 fakegpu: info searches only the tree's plugin folder" 0 "isolated abi2"
check "3 cpu + ABI-2 fakegpu: rejected, with the versions" 0 \
  "has 'ABI 2\\.0 \\| rejected'" "has 'reason: plugin ABI 2\\.0, host ABI $HOST_ABI'"
check "3 cpu + ABI-2 fakegpu: auto -> cpu" 0 \
  "has 'backend = auto -> cpu \\($tmp/abi2/lib/kiln/libkiln-backend-cpu\\.so\\)'"
generate abi2 "$tmp/kiln.ini"
check "3 cpu + ABI-2 fakegpu: generate falls back to cpu, saying why" 0 \
  "has 'using cpu\\. Rejected plugins:'" "has 'fakegpu .*plugin ABI 2\\.0, host ABI $HOST_ABI'" \
  "has 'backend cpu: $tmp/abi2/lib/kiln/libkiln-backend-cpu\\.so'" \
  "cmp -s '$tmp/text.cpu' '$tmp/stdout'"
run abi2 info --config "$tmp/fakegpu.ini"
check "3 cpu + ABI-2 fakegpu: info naming it fails with the reason" 1 \
  "has 'backend = fakegpu: cannot be used: .*plugin ABI 2\\.0, host ABI $HOST_ABI'"
generate abi2 "$tmp/fakegpu.ini"
check "3 cpu + ABI-2 fakegpu: generate naming it fails with the reason" nonzero \
  "has '^kiln: .*fakegpu.*plugin ABI 2\\.0, host ABI $HOST_ABI'" "[ ! -s '$tmp/stdout' ]"

# ---- 4. no plugins at all ---------------------------------------------------------------------
tree empty
run empty info --config "$tmp/kiln.ini"
check "4 no plugins: info searches only the tree's plugin folder" 1 "isolated empty"
check "4 no plugins: info says so and fails" 1 "has 'no backend plugins found'" \
  "has 'backend = auto: cannot be used: backend auto: no usable backend and no cpu plugin in $tmp/empty/lib/kiln'"
generate empty "$tmp/kiln.ini"
check "4 no plugins: generate fails with the same reason" nonzero \
  "has '^kiln: .*no usable backend and no cpu plugin in $tmp/empty/lib/kiln'" "[ ! -s '$tmp/stdout' ]"

# ---- 5. cpu + each GPU plugin of this build ---------------------------------------------------
# rocm: /dev/kfd is the AMD GPU driver's device; cuda: an NVIDIA driver library is installed.
for gpu in rocm cuda; do
  plugin=$build/lib/kiln/libkiln-backend-$gpu.so
  if [ ! -f "$plugin" ]; then
    echo "skip 5 cpu + $gpu: this build has no $plugin"
    continue
  fi
  have=0
  case $gpu in
    rocm) [ -e /dev/kfd ] && have=1 ;;
    cuda) ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1' && have=1 ;;
  esac
  tree "real-$gpu" cpu="$build/lib/kiln/libkiln-backend-cpu.so" "$gpu=$plugin"
  run "real-$gpu" info --config "$tmp/kiln.ini"
  check "5 cpu + $gpu: info searches only the tree's plugin folder" 0 "isolated real-$gpu"
  if [ "$have" = 0 ]; then
    check "5 cpu + $gpu: rejected by its probe, with the runtime's reason" 0 \
      "grep -A3 -E '^  $gpu +/' '$tmp/out' | grep -Eq '\\| rejected'" \
      "grep -A3 -E '^  $gpu +/' '$tmp/out' | grep -Eq '^ +reason: probe found no usable device: .+'"
    check "5 cpu + $gpu: auto -> cpu" 0 \
      "has 'backend = auto -> cpu \\($tmp/real-$gpu/lib/kiln/libkiln-backend-cpu\\.so\\)'"
  else
    check "5 cpu + $gpu: auto -> $gpu on this machine's GPU" 0 \
      "has 'backend = auto -> $gpu \\($tmp/real-$gpu/lib/kiln/libkiln-backend-$gpu\\.so\\)'"
  fi
done

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
