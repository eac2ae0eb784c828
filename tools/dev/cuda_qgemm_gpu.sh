#!/usr/bin/env bash
# cuda_qgemm_gpu.sh - the CUDA backend's gemm_quant (backends/cuda/cuda_qgemv.cu) on a GPU:
#   1. the op conformance cases (test_ops_gemm_quant: every format, M 1..64, f32/f16/bf16 x,
#      aligned and unaligned rows) on cuda with seeds 1, 2, 3, then seed 1 again with every call
#      on the tiled kernel (KILN_CUDA_QGEMM=tiled, which M <= 8 otherwise skips);
#   2. the same cases (seed 1) under compute-sanitizer memcheck, only the gemm_quant kernels
#      instrumented (kernel names containing "qgem");
#   3. test_gguf (its Q4_0/Q8_0 llama model, quantized against its widened twin), test_qlinear
#      (GPTQ/AWQ models) and test_fp8 (FP8 checkpoints kept FP8; both need python3 with numpy
#      for their fixtures) on cuda;
#   4. kiln-bench-ops --only qgemm: GB/s of the quantized bytes against the measured copy
#      bandwidth, M = 1, 8 and 128, shapes N x K = 8192x2048, 2048x8192, 4096x4096, 14336x4096,
#      4096x14336, 151936x3584, then for FP8 alone (per-channel and 128-blocks) Qwen2.5-7B's
#      4608x3584, 37888x3584, 18944x3584 and 3584x18944.
# About 2 minutes on an H200 (most of it the benchmark's weight fills and memcheck).
# Usage, with a build tree configured with -DKILN_BACKEND_CUDA=ON:
#   bash tools/dev/cuda_qgemm_gpu.sh BUILD_DIR
# or, building first, through gpu_run.sh (its build tree is /tmp/src/build; QGEMM=1 runs this):
#   QGEMM=1 SEEDS= SELFTEST= CTEST= KILN_CUDA_ARCHS=90a bash tools/dev/gpu_run.sh DEPS_DIR
# Logs go to ${OUT:-/tmp/kiln-qgemm}; the exit status is 0 when every test step passed.
set -uo pipefail
BUILD=$(cd "${1:?usage: cuda_qgemm_gpu.sh BUILD_DIR}" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-/tmp/kiln-qgemm}
mkdir -p "$OUT"
export KILN_BACKEND_PATH="$BUILD/lib/kiln"
rc=0
step() { # name, then the command; prints the verdict lines
  local name=$1
  shift
  (cd "$BUILD/tests" && "$@") >"$OUT/$name.log" 2>&1
  local r=$?
  echo "$name rc=$r"
  grep -E "^FAIL|failure\(s\)|PASSED|FAILED|ERROR SUMMARY|Invalid|\[  ERROR" "$OUT/$name.log" | head -20
  [ $r -eq 0 ] || { rc=1; tail -n 5 "$OUT/$name.log"; }
}
echo "== test_ops_gemm_quant on cuda"
for seed in 1 2 3; do
  step "test_ops_qgemm_$seed" env KILN_TEST_SEED=$seed KILN_TEST_BACKENDS=cuda \
    KILN_TEST_ONLY=test_ops_gemm_quant timeout 120 ./test_ops
done
step test_ops_qgemm_tiled env KILN_CUDA_QGEMM=tiled KILN_TEST_SEED=1 KILN_TEST_BACKENDS=cuda \
  KILN_TEST_ONLY=test_ops_gemm_quant timeout 120 ./test_ops
if command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer memcheck (gemm_quant kernels)"
  step test_ops_qgemm_memcheck env KILN_TEST_SEED=1 KILN_TEST_BACKENDS=cuda \
    KILN_TEST_ONLY=test_ops_gemm_quant timeout 150 compute-sanitizer --tool memcheck \
    --kernel-name kns=qgem --print-limit 20 ./test_ops
else
  echo "compute-sanitizer not found: memcheck skipped"
fi
echo "== test_gguf, test_qlinear, test_fp8 on cuda"
step test_gguf env KILN_TEST_BACKENDS=cuda KILN_SOURCE_DIR="$ROOT" KILN_BUILD_DIR="$BUILD" timeout 120 ./test_gguf
step test_qlinear env KILN_TEST_BACKENDS=cuda KILN_SOURCE_DIR="$ROOT" KILN_BUILD_DIR="$BUILD" timeout 120 ./test_qlinear
step test_fp8 env KILN_TEST_BACKENDS=cuda KILN_SOURCE_DIR="$ROOT" KILN_BUILD_DIR="$BUILD" timeout 120 ./test_fp8
echo "== kiln-bench-ops --only qgemm (cuda)"
timeout 360 "$BUILD/bin/kiln-bench-ops" "$BUILD/lib/kiln/libkiln-backend-cuda.so" --only qgemm \
  2>&1 | tee "$OUT/bench_qgemm.txt"
exit $rc
