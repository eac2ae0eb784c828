#!/usr/bin/env bash
# qdeq_emu.sh - builds and runs tools/dev/qdeq_emu.cc: the CUDA backend's gemm_quant
# dequantization (backends/cuda/cuda_qdeq.cuh) on the host, bit for bit against kiln/hal_quant.h.
# No GPU needed (a few seconds). Usage: tools/dev/qdeq_emu.sh [c++ compiler]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cxx="${1:-${CXX:-c++}}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$cxx" -std=c++17 -O1 -g -Wall -Wextra -Werror -Wno-unknown-pragmas -fsanitize=address,undefined \
  -I "$root/hal/include" "$root/tools/dev/qdeq_emu.cc" -o "$out/qdeq_emu" -lm
"$out/qdeq_emu"
