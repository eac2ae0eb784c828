#!/usr/bin/env bash
# test_sdk.sh - `cmake --install` produces an SDK a third party can build a backend with, by
# CMake (find_package(Kiln)) and by pkg-config, and the installed kiln loads those plugins.
# Usage: test_sdk.sh BUILD_DIR SOURCE_DIR. Prints "N passed, N failed".
set -u
build=$1; src=$2
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
pass=0; fail=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; [ -f "$tmp/log" ] && sed 's/^/     | /' "$tmp/log" | tail -30; }

if cmake --install "$build" --prefix "$prefix" >"$tmp/log" 2>&1; then ok "cmake --install"; else bad "cmake --install"; fi
for f in include/kiln/hal.h include/kiln/hal_util.h lib/libkiln.so bin/kiln lib/kiln/libkiln-backend-cpu.so \
         lib/pkgconfig/kiln.pc lib/cmake/Kiln/KilnConfig.cmake share/kiln/plugin.map etc/kiln/kiln.ini; do
  if [ -e "$prefix/$f" ]; then ok "installed $f"; else bad "installed $f"; fi
done

# 1. CMake: find_package(Kiln) + kiln_add_plugin, from outside the source tree.
if cmake -S "$src/tests/sdk" -B "$tmp/p1" -DCMAKE_PREFIX_PATH="$prefix" \
     -DFAKE_BACKEND_SOURCE="$src/tests/plugins/fake_backend.c" >"$tmp/log" 2>&1 &&
   cmake --build "$tmp/p1" >>"$tmp/log" 2>&1; then ok "plugin built with find_package(Kiln)"; else bad "plugin built with find_package(Kiln)"; fi
exported=$(nm -D --defined-only "$tmp/p1/libkiln-backend-sdkdemo.so" 2>/dev/null | awk '$2 == "T" {print $3}')
if [ "$exported" = "kiln_backend_query" ]; then ok "exports only kiln_backend_query"; else echo "exports: $exported" >"$tmp/log"; bad "exports only kiln_backend_query"; fi

# 2. pkg-config: plain cc with the flags and version script kiln.pc gives.
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
if cc -std=c11 -shared -fPIC -fvisibility=hidden -DFAKE_NAME='"pcdemo"' -DFAKE_SCORE=30 \
     $(pkg-config --cflags kiln) "$src/tests/plugins/fake_backend.c" \
     -Wl,--version-script="$(pkg-config --variable=pluginmap kiln)" \
     -o "$tmp/p1/libkiln-backend-pcdemo.so" >"$tmp/log" 2>&1; then ok "plugin built with pkg-config kiln"; else bad "plugin built with pkg-config kiln"; fi

# 3. The installed kiln finds its own cpu plugin and loads both third-party plugins.
cd "$tmp"
if KILN_BACKEND_PATH="$tmp/p1" "$prefix/bin/kiln" info >"$tmp/log" 2>&1 &&
   grep -q 'sdkdemo .*libkiln-backend-sdkdemo.so' "$tmp/log" &&
   grep -q 'pcdemo .*libkiln-backend-pcdemo.so' "$tmp/log" &&
   grep -q "cpu .*$prefix/lib/kiln/libkiln-backend-cpu.so" "$tmp/log" &&
   [ "$(grep -c '| usable' "$tmp/log")" -ge 3 ]; then ok "installed kiln loads SDK-built plugins"; else bad "installed kiln loads SDK-built plugins"; fi
if KILN_BACKEND_PATH="$tmp/p1" "$prefix/bin/kiln" info --set backend.name=sdkdemo >"$tmp/log" 2>&1 &&
   grep -q 'backend = sdkdemo -> sdkdemo' "$tmp/log"; then ok "a third-party backend chosen by name"; else bad "a third-party backend chosen by name"; fi

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
