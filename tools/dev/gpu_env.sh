# shellcheck shell=bash
# gpu_env.sh - sourced (not run) by the GPU machine's scripts (gpu_run.sh, perf_bisect.sh): unpacks
# the Debian -dev packages carried as .deb files into /tmp/sys and exports what a CMake configure
# and the built binaries need to find them there.
# Usage: . tools/dev/gpu_env.sh DEPS_DIR
#   sets: deps (DEPS_DIR, absolute), sys ($KILN_SYS_DIR or /tmp/sys), ml (its multiarch lib folder),
#         KILN_DEPS_CMAKE_ARGS (an array of -D options for cmake);
#   exports: PKG_CONFIG_PATH, PKG_CONFIG_SYSROOT_DIR, LD_LIBRARY_PATH, CPATH.
deps=$(cd "$1" && pwd)
sys=${KILN_SYS_DIR:-/tmp/sys}
mkdir -p "$sys"
for f in "$deps"/*.deb; do
  dpkg -x "$f" "$sys" 2>/dev/null || (cd /tmp && ar x "$f" data.tar.xz && tar xJf data.tar.xz -C "$sys")
done
ml=$sys/usr/lib/x86_64-linux-gnu
export PKG_CONFIG_PATH=$ml/pkgconfig:$ml/openblas-pthread/pkgconfig PKG_CONFIG_SYSROOT_DIR=$sys
export LD_LIBRARY_PATH=$ml:$ml/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The carried multiarch headers (jconfig.h, ...) before the machine's own: pkg-config's -I names
# only $sys/usr/include, so <jconfig.h> came from the machine's libjpeg 8 while libjpeg.so.62
# was linked ("Wrong JPEG library version: library is 62, caller expects 80").
export CPATH=$sys/usr/include/x86_64-linux-gnu${CPATH:+:$CPATH}
# shellcheck disable=SC2034  # used by the scripts that source this file
KILN_DEPS_CMAKE_ARGS=(-DCMAKE_PREFIX_PATH="$sys/usr" -DCMAKE_LIBRARY_PATH="$ml;$ml/openblas-pthread"
  -DCMAKE_INCLUDE_PATH="$sys/usr/include;$sys/usr/include/x86_64-linux-gnu")
