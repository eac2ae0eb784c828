#!/bin/bash
# run_device.sh - builds the CUDA plugin + checker on the GPU machine, runs the checker, the op
# conformance suite when the full tree builds there, and the checker under compute-sanitizer.
# Run from the repository root; logs go to $OUT (default /tmp/kiln-cuda-out).
set -o pipefail
OUT=${OUT:-/tmp/kiln-cuda-out}
mkdir -p "$OUT"
J=$(nproc)
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
echo "== build (standalone)"
if ! { cmake -S backends/cuda/dev -B /tmp/cbc && cmake --build /tmp/cbc -j"$J"; } > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"; exit 1
fi
echo "== checker"
/tmp/cbc/bin/kiln-check-cuda /tmp/cbc/lib/kiln/libkiln-backend-cuda.so > "$OUT/check.log" 2>&1
echo "checker rc=$?"
grep -E "^(FAIL|FATAL)|row |passed|device 0|probe" "$OUT/check.log"
if [ -n "$BENCH" ]; then
  echo "== bench"
  /tmp/cbc/bin/kiln-check-cuda /tmp/cbc/lib/kiln/libkiln-backend-cuda.so --bench > "$OUT/bench.log" 2>&1
  grep BENCH "$OUT/bench.log"
fi
# A test_ops built elsewhere (this machine may lack cmocka/inih) can travel in dev/carry_tmp with
# its libraries; it is run against the plugin built here.
C=backends/cuda/dev/carry_tmp
if [ -x "$C/test_ops" ]; then
  echo "== test_ops (carried binary)"
  for r in $(seq 1 "${TEST_OPS_RUNS:-1}"); do
    LD_LIBRARY_PATH="$PWD/$C" KILN_BACKEND_PATH=/tmp/cbc/lib/kiln KILN_TEST_BACKENDS=cuda \
      KILN_SOURCE_DIR="$PWD" timeout 300 "$C/test_ops" > "$OUT/test_ops_carried_$r.log" 2>&1
    echo "test_ops run $r rc=$?"
    grep -E "FAIL|failure|PASSED|not usable|skip|error|seed" "$OUT/test_ops_carried_$r.log" | head -40
  done
fi
echo "== full tree + test_ops"
if { cmake -S . -B /tmp/full && cmake --build /tmp/full -j"$J"; } > "$OUT/full_build.log" 2>&1; then
  T=$(find /tmp/full -name test_ops -type f -perm -u+x | head -1)
  if [ -n "$T" ]; then
    (cd "$(dirname "$T")" && KILN_BACKEND_PATH=/tmp/full/lib/kiln KILN_TEST_BACKENDS=cuda timeout 240 "$T") > "$OUT/test_ops.log" 2>&1
    echo "test_ops rc=$?"; grep -E "FAIL|ERROR|PASSED|not usable|skip" "$OUT/test_ops.log" | head -40
  else
    echo "no test_ops target in the tree"
  fi
else
  echo "full tree did not build:"; grep -E "Error|error" "$OUT/full_build.log" | head -8
fi
if [ -n "$SANITIZE" ]; then
  echo "== compute-sanitizer memcheck (quick cases)"
  KILN_CHECK_QUICK=1 timeout "${SANITIZE}" compute-sanitizer --tool memcheck --leak-check no \
    /tmp/cbc/bin/kiln-check-cuda /tmp/cbc/lib/kiln/libkiln-backend-cuda.so > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|Invalid|passed" "$OUT/memcheck.log" | head -20
fi
