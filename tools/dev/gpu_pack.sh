#!/usr/bin/env bash
# gpu_pack.sh - packs prebuilt binaries for the GPU machine (device tool), so that a call there
# runs at once instead of spending its first minutes (of a 30-minute session budget) building:
# the CUDA plugin, libkiln, the op suite and the op benchmark from BUILD_DIR (configured here,
# on the CPU machine, which has nvcc: cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release
# -DKILN_HTTP=OFF -DKILN_CUDA_ARCHS=90a -DKILN_BACKEND_ROCM=OFF && cmake --build build-gpu
# --target kiln-backend-cuda test_ops kiln-bench-ops), with the Debian runtime libraries they
# link (not the -dev packages, not OpenBLAS: only the cpu plugin needs it) from DEPS_DIR.
# When BUILD_DIR has the cpu plugin, it and its OpenBLAS come too. When BUILD_DIR has bin/kiln (the CLI, built with KILN_HTTP=ON: --target kiln_cli), it goes in
# too, with every library it links that is not glibc's, copied from this machine (libmicrohttpd,
# libcurl and what libcurl pulls in: the GPU machine has no apt).
# Everything is one OUT_DIR/pack.tar.xz (about 3 MB; the unpacked 30 MB would not fit beside the
# 50 MB working tree under the device tool's 64 MiB).
# Usage: bash tools/dev/gpu_pack.sh BUILD_DIR DEPS_DIR OUT_DIR   (OUT_DIR git-ignored, e.g. .gpu
# with "/.gpu/" in .git/info/exclude); then, on the GPU machine (carry [".gpu"]):
#   D=/tmp/gpu; mkdir -p $D && tar xJf .gpu/pack.tar.xz -C $D; . tools/dev/gpu_env.sh $D
#   export LD_LIBRARY_PATH=$D/lib:$LD_LIBRARY_PATH KILN_BACKEND_PATH=$D/lib/kiln
#   (cd $D && KILN_TEST_BACKENDS=cuda KILN_TEST_ONLY=test_ops_gemm_quant ./test_ops)
#   $D/kiln-bench-ops $D/lib/kiln/libkiln-backend-cuda.so --only fp8 --no-ceilings
set -euo pipefail
build=${1:?usage: gpu_pack.sh BUILD_DIR DEPS_DIR OUT_DIR} deps=${2:?deps dir} out=${3:?out dir}
rm -rf "$out"
mkdir -p "$out/lib/kiln"
for p in libinih1 libcmocka0 libpcre2-8-0 libutf8proc2 libxxhash0 libpng16-16 libjpeg62-turbo_ libwebp7; do
  ls "$deps"/${p}*.deb >/dev/null 2>&1 || { echo "gpu_pack: no $p*.deb in $deps" >&2; exit 1; }
  cp "$deps"/${p}*.deb "$out/"
done
cp "$build/lib/kiln/libkiln-backend-cuda.so" "$out/lib/kiln/"
cp -a "$build"/lib/libkiln.so* "$out/lib/"
cp "$build/tests/test_ops" "$build/bin/kiln-bench-ops" "$out/"
# The mask benchmark and the collectives test too, when built (issue 19's host figures; issue
# 22's NCCL path at world size 1: KILN_COLL_RANK=0 KILN_COLL_WORLD=1 ./test_collectives).
for b in bin/kiln-bench-guide tests/test_collectives tests/test_graphs; do
  if [ -x "$build/$b" ]; then cp "$build/$b" "$out/"; fi
done
libs_of() { # copies the non-glibc libraries $1 links into the pack
  ldd "$1" | awk '/=>/ {print $3}' | while read -r lib; do
    case $(basename "$lib") in libc.so*|libm.so*|libresolv.so*|libpthread.so*|libdl.so*|librt.so*|libkiln.so*) continue ;; esac
    cp -L "$lib" "$out/lib/"
  done
}
if [ -x "$build/bin/kiln" ]; then cp "$build/bin/kiln" "$out/"; libs_of "$build/bin/kiln"; fi
# The cpu plugin too when built (a second backend on the same machine, for diagnosis).
if [ -f "$build/lib/kiln/libkiln-backend-cpu.so" ]; then
  cp "$build/lib/kiln/libkiln-backend-cpu.so" "$out/lib/kiln/"; libs_of "$build/lib/kiln/libkiln-backend-cpu.so"
fi
strip "$out/lib/kiln/"*.so
tmp=$(mktemp -d)
mv "$out"/* "$tmp/"
tar cJf "$out/pack.tar.xz" -C "$tmp" .
rm -rf "$tmp"
du -sh "$out"
