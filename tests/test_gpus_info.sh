#!/usr/bin/env bash
# test_gpus_info.sh - `kiln info`'s GPU section against fake vendor libraries (tests/vendor/):
# every vendor's GPUs are listed whatever plugins are installed, each with the plugin that
# drives it or the reason none does.
# Usage: test_gpus_info.sh BUILD_DIR SOURCE_DIR. Prints "N passed, N failed".
#
# kiln runs from a prefix assembled here whose plugin directory holds only the cpu plugin (and,
# in part 3, fake "cuda"/"rocm" plugins): the build's real GPU plugins would dlopen the fake
# libcuda.so.1 / libamdhip64.so.5 on LD_LIBRARY_PATH and call their runtimes into them.
set -u
build=$1; src=$2
vendor=${KILN_VENDOR_LIB_DIR:-$build/tests/vendorlibs}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
pass=0; fail=0

# check NAME REGEX [REGEX...]: wants every regex in $tmp/out (after the command ran).
check() {
  local name=$1; shift
  for re in "$@"; do
    if ! grep -Eq -- "$re" "$tmp/out"; then
      fail=$((fail + 1)); echo "FAIL $name (no line matches /$re/):"
      sed 's/^/     | /' "$tmp/out" | head -60
      return
    fi
  done
  pass=$((pass + 1)); echo "ok   $name"
}

prefix=$tmp/prefix
mkdir -p "$prefix/lib/kiln"
# The real file, not a symlink: libkiln finds its plugins next to where it really is.
cp "$(readlink -f "$build/lib/libkiln.so.0")" "$prefix/lib/libkiln.so.0"
cp "$build/lib/kiln/libkiln-backend-cpu.so" "$prefix/lib/kiln/"
# kiln's RUNPATH points into the build; LD_LIBRARY_PATH comes first for a RUNPATH.
kiln() { LD_LIBRARY_PATH="$prefix/lib:$vendor" "$build/bin/kiln" "$@"; }
cd "$tmp"

for gpu in cuda rocm; do
  if [ -e "/usr/local/lib/kiln/libkiln-backend-$gpu.so" ]; then
    echo "skip: an installed $gpu plugin in /usr/local/lib/kiln would load the fake libraries"
    echo "0 passed, 0 failed"
    exit 0
  fi
done
# Whether a real ROCm 6 HIP runtime answers before the fake libamdhip64.so.5.
rocm6=0
ldconfig -p 2>/dev/null | grep -q 'libamdhip64\.so\.6 ' && rocm6=1

# 1. Only the cpu plugin: every GPU is listed, none is driven.
kiln info >"$tmp/out" 2>&1; echo "rc $?" >>"$tmp/out"
check "kiln runs from the assembled prefix" '^rc 0$' "^plugin search path: $prefix/lib/kiln(:|$)"
check "only the cpu plugin" '^  cpu +' '^backend = auto -> cpu '
if grep -E '^  [a-z0-9_-]+ +/' "$tmp/out" | grep -qv "^  cpu "; then
  fail=$((fail + 1)); echo "FAIL a plugin other than cpu was found:"; sed 's/^/     | /' "$tmp/out" | head -30
fi
check "GPU section header" "^GPUs seen through the vendors' driver libraries \(independent of the plugins above\):$"
check "NVIDIA through libcuda.so.1" '^  NVIDIA +libcuda\.so\.1, driver 12\.8: 2 devices$' \
  '^ +device 0: NVIDIA H200 \| sm_90 \| 140\.4 GiB \| PCI 0000:19:00\.0$' \
  '^ +device 1: NVIDIA A100-SXM4-80GB \| sm_80 \| 80\.0 GiB \| PCI 0001:3b:02\.0$' \
  '^ +no plugin for NVIDIA GPUs is installed \(libkiln-backend-cuda\.so\)$'
if [ "$rocm6" = 0 ]; then
  check "AMD through libamdhip64.so.5" '^  AMD +libamdhip64\.so\.5, HIP 5\.2\.21153: 1 device$' \
    '^ +device 0: AMD Instinct MI300X \| 192\.0 GiB \| PCI 0000:c1:00\.0$' \
    '^ +no plugin for AMD GPUs is installed \(libkiln-backend-rocm\.so\)$'
else
  echo "skip AMD checks: a real libamdhip64.so.6 is installed"
fi
check "Intel through libze_loader.so.1" \
  '^  Intel +libze_loader\.so\.1, Level Zero API 1\.3: 1 device$' \
  '^ +device 0: Intel\(R\) Data Center GPU Max 1550 \| 128\.0 GiB \| PCI 0000:3a:00\.0$' \
  '^ +Kiln has no Level Zero backend yet; this machine runs on cpu$'

# 2. Present but no device: the library's own reason.
FAKE_HIP_FAIL=1 FAKE_CUDA_FAIL=1 FAKE_ZE_FAIL=1 kiln info >"$tmp/out" 2>&1; echo "rc $?" >>"$tmp/out"
check "libraries present, no devices" '^rc 0$' \
  '^  NVIDIA +libcuda\.so\.1, driver 12\.8: cuInit: CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected$' \
  '^  Intel +libze_loader\.so\.1: zeInit: ZE_RESULT_ERROR_UNINITIALIZED: no Level Zero GPU driver could be initialised$' \
  '^backend = auto -> cpu '
if [ "$rocm6" = 0 ]; then
  check "AMD present, no device" \
    '^  AMD +libamdhip64\.so\.5, HIP 5\.2\.21153: hipGetDeviceCount: hipErrorNoDevice: no ROCm-capable device is detected$'
fi

# 3. A "rocm" plugin that drives the AMD GPU (same PCI address) and a "cuda" plugin that was
#    rejected: each GPU names its plugin, or the rejection.
cp "$build/tests/vendorplugins/libkiln-backend-rocm.so" "$build/tests/vendorplugins/libkiln-backend-cuda.so" \
  "$prefix/lib/kiln/"
kiln info >"$tmp/out" 2>&1; echo "rc $?" >>"$tmp/out"
check "plugins cross-referenced" '^rc 0$' '^  rocm +.*/libkiln-backend-rocm\.so$' '^ +ABI [0-9]+\.[0-9]+ \| usable \| probe score 150$' \
  '^ +reason: probe found no usable device: fake cuda driver: no device$' \
  '^ +device 0: NVIDIA H200 .*PCI 0000:19:00\.0$' \
  '^ +no installed plugin drives it: the cuda plugin was rejected: probe found no usable device: fake cuda driver: no device$' \
  '^ +Kiln has no Level Zero backend yet; this machine runs on rocm$' \
  '^backend = auto -> rocm '
if [ "$rocm6" = 0 ]; then
  check "AMD GPU used by plugin rocm" \
    '^ +device 0: AMD Instinct MI300X \| 192\.0 GiB \| PCI 0000:c1:00\.0 \| used by plugin rocm$'
fi

# 4. A plugin chosen by path, from outside the search path, is matched too.
rm -f "$prefix/lib/kiln/libkiln-backend-rocm.so" "$prefix/lib/kiln/libkiln-backend-cuda.so"
kiln info --set "backend.name=$build/tests/vendorplugins/libkiln-backend-rocm.so" >"$tmp/out" 2>&1
echo "rc $?" >>"$tmp/out"
check "a plugin chosen by path" '^rc 0$' "^backend = .*libkiln-backend-rocm\.so -> rocm " \
  '^ +no plugin for NVIDIA GPUs is installed \(libkiln-backend-cuda\.so\)$'
if [ "$rocm6" = 0 ]; then
  check "AMD GPU used by the plugin chosen by path" \
    '^ +device 0: AMD Instinct MI300X \| 192\.0 GiB \| PCI 0000:c1:00\.0 \| used by plugin rocm$'
fi

# 5. This machine's own vendor libraries, if any (no fakes on the path; names that exist
#    nowhere are test_gpus's business): kiln info still works and lists all three vendors.
LD_LIBRARY_PATH="$prefix/lib" "$build/bin/kiln" info >"$tmp/out" 2>&1; echo "rc $?" >>"$tmp/out"
check "real vendor libraries (or none)" '^rc 0$' '^  NVIDIA +libcuda\.so\.1(, driver [0-9.]+)?: ' \
  '^  AMD +libamdhip64\.so' '^  Intel +libze_loader\.so\.1(, Level Zero API [0-9.]+)?: '

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
