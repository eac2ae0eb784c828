#!/usr/bin/env bash
# gpu_tune.sh - one call on the GPU machine for the CUDA tuning of 2026-12-02 (docs/perf.md):
# a build with the attention tuning variants (-DKILN_CUDA_ATT_EXPERIMENT), then
#   - test_ops' gemm cases with every decode-sized call on the skinny kernel (KILN_CUDA_GEMV=all) and its attention cases with each prefill variant;
#   - kiln-bench-ops' prefill attention (--only attn, --only vision) for variants 0-3;
#   - the decode-sized GEMMs on the skinny kernel and on cuBLASLt (KILN_CUDA_NO_GEMV=1);
#   - with PERF=1, the performance check (bench/perf_check.py, PERF_COMMIT names the commit;
#     tools/dev/gpu_run.sh runs it right after the build, as it sees PERF too).
# (The run of 2026-12-02 also timed a growable GEMM staging buffer and an f32 skinny kernel, both
# reverted after it: see docs/perf.md.)
# Usage (repo root there): bash tools/dev/gpu_tune.sh DEPS_DIR; results in $OUT.
set -u
OUT=${OUT:-/tmp/kiln-gpu-out}
export KILN_CUDA_ARCHS=${KILN_CUDA_ARCHS:-90a} SEEDS= SELFTEST= CTEST=
export KILN_EXTRA_CMAKE=-DCMAKE_CUDA_FLAGS=-DKILN_CUDA_ATT_EXPERIMENT
bash tools/dev/gpu_run.sh "$1" >"$OUT/gpu_run.log" 2>&1 || { tail -20 "$OUT/gpu_run.log"; exit 1; }
cd /tmp/src || exit 1
B=build/lib/kiln/libkiln-backend-cuda.so
ops() { (cd build/tests && env KILN_BACKEND_PATH=/tmp/src/build/lib/kiln KILN_TEST_BACKENDS=cuda \
  KILN_TEST_SEED=1 "$@" timeout 150 ./test_ops 2>&1 | grep -E 'FAIL|PASSED|FAILED' | head -8); }
bench() { timeout 90 ./build/bin/kiln-bench-ops "$B" --no-ceilings "$@" 2>&1; }
{
  echo "== gemm cases, every decode-sized call on the skinny kernel"
  ops KILN_CUDA_GEMV=all KILN_TEST_ONLY='test_ops_gemm*'
  for v in 1 2 3; do
    echo "== attention cases, prefill variant $v"
    ops KILN_CUDA_ATT_PREFILL=$v KILN_TEST_ONLY='test_ops_attention*'
  done
} >"$OUT/tests.txt"
cat "$OUT/tests.txt"
for v in 0 1 2 3; do
  echo "== prefill variant $v"
  KILN_CUDA_ATT_PREFILL=$v bench --only attn | grep prefill | grep -v unal
  KILN_CUDA_ATT_PREFILL=$v bench --only vision | grep 'attn bf16' | grep -v unal
done >"$OUT/attn_variants.txt"
cat "$OUT/attn_variants.txt"
{
  echo "== decode-sized gemm: skinny kernel (default)"; bench --only gemm | grep -E 'M=(1|8) '
  echo "== decode-sized gemm: cuBLASLt (KILN_CUDA_NO_GEMV=1)"; KILN_CUDA_NO_GEMV=1 bench --only gemm | grep -E 'M=(1|8) '
} >"$OUT/gemv.txt"
cat "$OUT/gemv.txt"
if [ -n "${PERF:-}" ]; then
  timeout "${PERF_TIMEOUT:-250}" python3 bench/perf_check.py --kiln ./build/bin/kiln --root /tmp/src \
    --work /tmp/m7 --commit "${PERF_COMMIT:-}" --results /tmp/src/bench/results --out-dir "$OUT" 2>&1 |
    grep -v -i warn | tail -25
fi
