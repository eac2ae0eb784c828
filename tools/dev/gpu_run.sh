#!/usr/bin/env bash
# gpu_run.sh - one call on the GPU machine (device tool): build a source snapshot with the
# Debian libraries carried as .deb files, then run kiln info, the op conformance suite and
# kiln selftest on the cuda backend, the op benchmarks (BENCH=1), the attention kernels under
# compute-sanitizer (SANITIZE_ATTN=seconds per tool), ctest, and (when the tokenizer cache is
# carried) the Hugging Face goldens and tokenizer reference timing; GEMM_KERNEL=1 runs the op
# suite and the gemm benchmark with Kiln's own GEMM kernel (KILN_GPU_GEMM=kernel, the ROCm
# plugin's fallback); PORTABILITY=1 runs `kiln info` with the ROCm plugin and Debian's HIP and
# Level Zero runtimes from DEPS_DIR/hip/ beside the NVIDIA GPU; PERF=1 runs the performance check
# (bench/perf_check.py: batch-1 decode, prefill 512, offline 1,000 x (512 + 256) and the card's
# ceilings on a random Qwen2-7B, compared with the newest bench/results/ file; PERF_COMMIT names
# the commit, which the copied tree cannot tell) and exits 1 when a figure dropped over 5%.
# QGEMM=1 runs tools/dev/cuda_qgemm_gpu.sh (gemm_quant's cases, memcheck, quantized models and
# benchmark on cuda). KILN_EXTRA_CMAKE adds configure arguments (e.g. -DCMAKE_CUDA_FLAGS=-DKILN_CUDA_ATT_EXPERIMENT for
# the attention tuning variants). VL=1 runs test_vl_engine (image requests through the engine) on the cuda backend.
# Usage (from the repo root there): bash tools/dev/gpu_run.sh DEPS_DIR
#   DEPS_DIR/*.deb      Debian 12 -dev packages (inih, cmocka, openblas, pcre2, utf8proc; for
#                       image input libpng-dev libpng16-16 libjpeg62-turbo-dev libjpeg62-turbo
#                       libwebp-dev libwebp7, runtime packages too: the GPU image may lack them)
#   DEPS_DIR/src.tar    the source snapshot to build (git archive HEAD); without it, the
#                       working tree the device tool copied is built in place
#   DEPS_DIR/tok/       optional tokenizer cache (tests/fetch_tokenizers.sh layout)
#   DEPS_DIR/bench.txt  optional tokenizer benchmark text
# Logs and results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-gpu-out}
mkdir -p "$OUT"
# The .debs into /tmp/sys, the search paths exported, KILN_DEPS_CMAKE_ARGS for the configure.
# shellcheck source=tools/dev/gpu_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh" "$1"
mkdir -p /tmp/src
if [ -f "$deps/src.tar" ]; then tar xf "$deps/src.tar" -C /tmp/src; else src=$(pwd); rm -rf /tmp/src; ln -s "$src" /tmp/src; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1; cat "$OUT/gpu.txt"
cd /tmp/src
echo "== configure + build"
if ! { cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${KILN_DEPS_CMAKE_ARGS[@]}" \
        -DKILN_TOKENIZER_CACHE="$deps/tok" -DKILN_HTTP=OFF \
        ${KILN_CUDA_ARCHS:+-DKILN_CUDA_ARCHS="$KILN_CUDA_ARCHS"} ${KILN_EXTRA_CMAKE:-} &&
       cmake --build build -j"$(nproc)"; } >"$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -20; tail -20 "$OUT/build.log"; exit 1
fi
echo "== kiln info"; ./build/bin/kiln info 2>&1 | tee "$OUT/info.txt"
echo "== test_ops on cuda"
for seed in ${SEEDS-1 2}; do
  (cd build/tests && KILN_TEST_SEED=$seed KILN_BACKEND_PATH=/tmp/src/build/lib/kiln KILN_TEST_BACKENDS=cuda \
     timeout 300 ./test_ops) >"$OUT/test_ops_$seed.log" 2>&1
  echo "seed $seed rc=$?"; grep -E "^FAIL|failure\(s\)|PASSED|FAILED" "$OUT/test_ops_$seed.log" | grep -v " 0 failure" | head -30
done
[ -n "${SELFTEST-1}" ] && echo "== selftest on cuda" && ./build/bin/kiln selftest --set backend.name=cuda 2>&1 | tee "$OUT/selftest.txt"
if [ -n "${BENCH:-}" ]; then
  echo "== bench_ops cuda"; timeout 240 ./build/bin/kiln-bench-ops build/lib/kiln/libkiln-backend-cuda.so ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_cuda.txt"
fi
if [ -n "${QGEMM:-}" ]; then
  echo "== gemm_quant on cuda (tools/dev/cuda_qgemm_gpu.sh)"
  OUT="$OUT/qgemm" bash tools/dev/cuda_qgemm_gpu.sh build
fi
if [ -n "${SANITIZE_ATTN:-}" ]; then
  # The attention kernels under compute-sanitizer, $SANITIZE_ATTN seconds per tool, both logs in
  # one file: memcheck over the op suite with only the attention kernels instrumented, racecheck
  # over the attention benchmark (--quick, no ceilings: racecheck fails on cuBLASLt's kernels,
  # which the suite's gemm cases and the ceilings run).
  echo "== compute-sanitizer memcheck on test_ops (cuda, attention kernels)" | tee -a "$OUT/sanitize_attn.log"
  (cd build/tests && KILN_TEST_SEED=3 KILN_BACKEND_PATH=/tmp/src/build/lib/kiln KILN_TEST_BACKENDS=cuda \
     timeout "$SANITIZE_ATTN" compute-sanitizer --tool memcheck --kernel-name kns=att --print-limit 20 ./test_ops) \
     >>"$OUT/sanitize_attn.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|Invalid|PASSED|FAILED" "$OUT/sanitize_attn.log" | tail -4
  echo "== compute-sanitizer racecheck on kiln-bench-ops --only attn --quick (attention kernels)" | tee -a "$OUT/sanitize_attn.log"
  timeout "$SANITIZE_ATTN" compute-sanitizer --tool racecheck --kernel-name kns=att --print-limit 20 \
    ./build/bin/kiln-bench-ops build/lib/kiln/libkiln-backend-cuda.so --only attn --quick --reps 1 --no-ceilings \
    >>"$OUT/sanitize_attn.log" 2>&1
  echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|Race reported|hazard|attn " "$OUT/sanitize_attn.log" | tail -12
fi
if [ -n "${GEMM_KERNEL:-}" ]; then
  echo "== test_ops on cuda with every gemm on Kiln's own kernel (KILN_GPU_GEMM=kernel)"
  for seed in ${SEEDS-1 2}; do
    (cd build/tests && KILN_GPU_GEMM=kernel KILN_TEST_SEED=$seed KILN_BACKEND_PATH=/tmp/src/build/lib/kiln \
       KILN_TEST_BACKENDS=cuda timeout 300 ./test_ops) >"$OUT/test_ops_gemmkernel_$seed.log" 2>&1
    echo "seed $seed rc=$?"; grep -E "^FAIL|failure\(s\)|PASSED|FAILED" "$OUT/test_ops_gemmkernel_$seed.log" | grep -v " 0 failure" | head -30
  done
  echo "== gemm benchmark: cuBLASLt, then Kiln's own kernel"
  timeout 200 ./build/bin/kiln-bench-ops build/lib/kiln/libkiln-backend-cuda.so --only gemm 2>&1 | tee "$OUT/bench_gemm_lt.txt"
  KILN_GPU_GEMM=kernel timeout 200 ./build/bin/kiln-bench-ops build/lib/kiln/libkiln-backend-cuda.so --only gemm --no-ceilings 2>&1 | tee "$OUT/bench_gemm_kernel.txt"
fi
if [ -n "${PORTABILITY:-}" ] && [ -d "$deps/hip" ]; then
  echo "== kiln info with the ROCm plugin (built on the CPU machine) and Debian's HIP/Level Zero runtimes"
  mkdir -p /tmp/hipsys /tmp/plugins-all
  for f in "$deps"/hip/*.deb; do dpkg -x "$f" /tmp/hipsys 2>/dev/null; done
  cp "$deps"/hip/libkiln-backend-rocm.so /tmp/plugins-all/
  hl=/tmp/hipsys/usr/lib/x86_64-linux-gnu
  echo "-- without the HIP runtime on the library path"
  KILN_BACKEND_PATH=/tmp/plugins-all ./build/bin/kiln info 2>&1 | tee "$OUT/info_portability_nohip.txt"
  echo "-- with Debian's HIP 5.2 and Level Zero loader on the library path"
  LD_LIBRARY_PATH=$hl:$LD_LIBRARY_PATH KILN_BACKEND_PATH=/tmp/plugins-all ./build/bin/kiln info 2>&1 | tee "$OUT/info_portability.txt"
  LD_LIBRARY_PATH=$hl:$LD_LIBRARY_PATH KILN_BACKEND_PATH=/tmp/plugins-all ./build/bin/kiln generate --prompt "Once upon a time" --max-tokens 8 2>&1 | tail -3
fi
if [ -n "${CTEST-1}" ]; then
  echo "== ctest (all, default backends)"
  (cd build && timeout 300 ctest 2>&1 | tail -15) | tee "$OUT/ctest.txt"
fi
if [ -n "${GRAPHS:-}" ]; then
  echo "== decode graphs on cuda: test_graphs, and test_engine with graphs on (the default)"
  (cd build/tests && KILN_SOURCE_DIR=/tmp/src KILN_BUILD_DIR=/tmp/src/build KILN_BACKEND_PATH=/tmp/src/build/lib/kiln \
     KILN_TEST_BACKEND=cuda timeout 300 ./test_graphs) >"$OUT/graphs_cuda.log" 2>&1
  echo "test_graphs rc=$?"; grep -E "OK|FAIL|PASSED|differ|error" "$OUT/graphs_cuda.log" | head -20
fi
if [ -n "${MODELS:-}" ]; then
  echo "== model parity fixtures on cuda (fp32 + bf16)"
  (cd build/tests && KILN_SOURCE_DIR=/tmp/src KILN_BUILD_DIR=/tmp/src/build KILN_BACKEND_PATH=/tmp/src/build/lib/kiln \
     KILN_TEST_BACKEND=cuda KILN_TEST_VERBOSE=1 timeout 300 ./test_parity) >"$OUT/parity_cuda.log" 2>&1
  echo "rc=$?"; grep -E "rel err|greedy|FAIL|PASSED|FAILED" "$OUT/parity_cuda.log" | grep -v "chunk" | head -60
  echo "== kiln vs transformers on real-size models (${MODEL_SHAPES:-none})"
  for shape in ${MODEL_SHAPES:-}; do
    timeout 500 python3 bench/model_vs_hf.py --kiln ./build/bin/kiln --work /tmp/mb --shape "$shape" \
      --out "$OUT/model_vs_hf_$shape.json" 2>&1 | grep -v Warning | tail -8
  done
fi
if [ -n "${VL:-}" ]; then
  echo "== image requests through the engine on cuda: test_vl_engine (the tiny Qwen2-VL and Qwen2.5-VL fixtures)"
  (cd build/tests && KILN_SOURCE_DIR=/tmp/src KILN_BUILD_DIR=/tmp/src/build KILN_BACKEND_PATH=/tmp/src/build/lib/kiln \
     KILN_TEST_BACKEND=cuda timeout 300 ./test_vl_engine) >"$OUT/vl_engine_cuda.log" 2>&1
  echo "test_vl_engine rc=$?"; grep -E "OK|FAIL|PASSED|FAILED|preempt|cache|logprob|error" "$OUT/vl_engine_cuda.log" | head -40
fi
if [ -n "${ENGINE:-}" ]; then
  echo "== the engine on cuda: test_engine (fp32 fixture), default model perplexity, offline throughput"
  (cd build/tests && KILN_SOURCE_DIR=/tmp/src KILN_BUILD_DIR=/tmp/src/build KILN_BACKEND_PATH=/tmp/src/build/lib/kiln \
     KILN_TEST_BACKEND=cuda timeout 300 ./test_engine) >"$OUT/engine_cuda.log" 2>&1
  echo "test_engine rc=$?"; grep -E "OK|FAIL|PASSED|preempt|differs|error" "$OUT/engine_cuda.log" | head -20
  for dt in float32 bfloat16; do
    ./build/bin/kiln perplexity --set backend.name=cuda --dtype $dt --file tests/fixtures/default_model/heldout.txt --json 2>&1 | tail -1
  done
  ./build/bin/kiln generate --set backend.name=cuda --prompt "Once upon a time" --max-tokens 48 --temperature 0.8 --seed 1 2>&1 | tail -3
  for shape in ${ENGINE_SHAPES-qwen2-0.5b}; do
    timeout 400 python3 bench/engine_offline.py --kiln ./build/bin/kiln --work /tmp/mb --shape "$shape" \
      ${ENGINE_ARGS:-} --out "$OUT/engine_offline_$shape.json" 2>&1 | grep -v Warning | tail -6
  done
fi
for shape in ${BENCH7B:-}; do
  echo "== $shape: Kiln (kiln bench latency/throughput) vs transformers, with the card's ceilings"
  timeout "${BENCH7B_TIMEOUT:-500}" python3 bench/cuda_7b.py --kiln ./build/bin/kiln --work /tmp/m7 --shape "$shape" \
    --steps "${BENCH7B_STEPS:-ceilings,hf,latency,prefill,throughput}" --out "$OUT/bench7b_$shape.json" 2>&1 |
    grep -v -i warn | tail -40
done
perf_rc=0
if [ -n "${PERF:-}" ]; then
  echo "== performance check (issue 24): the 7B figures against the newest bench/results/ file"
  timeout "${PERF_TIMEOUT:-500}" python3 bench/perf_check.py --kiln ./build/bin/kiln --root /tmp/src \
    --work /tmp/m7 --commit "${PERF_COMMIT:-}" --results /tmp/src/bench/results --out-dir "$OUT" 2>&1 |
    grep -v -i warn | tail -30
  perf_rc=${PIPESTATUS[0]}
  echo "perf_check rc=$perf_rc (0 ok, 1 a figure dropped, 2 bad input, 3 a run failed, 124 timed out)"
fi
if [ -d "$deps/tok" ] && [ -f "$deps/bench.txt" ]; then
  echo "== Kiln tokenizer encode speed (one thread)"
  for n in qwen3 llama3 llama2; do
    echo "-- $n"; ./build/bin/kiln-bench-tokenizer "$deps/tok/$n" "$deps/bench.txt" 3 2>&1 | tee -a "$OUT/bench_tokenizer.txt"
  done
fi
if [ -d "$deps/tok" ] && [ -n "${GOLDENS:-}" ]; then
  echo "== Hugging Face goldens"
  python3 tools/dev/gen_tokenizer_goldens.py "$deps/tok" "$OUT/goldens" "$deps/bench.txt" 2>&1 | tee "$OUT/goldens.log"
  (cd "$OUT/goldens" && tar cf "$OUT/goldens.tar" .)
  rm -rf "$OUT/goldens"
fi
if [ -n "${SANITIZE:-}" ]; then
  if [ -n "${SANITIZE_OPS-1}" ]; then
    echo "== compute-sanitizer memcheck on test_ops (cuda)"
    (cd build/tests && KILN_TEST_SEED=3 KILN_BACKEND_PATH=/tmp/src/build/lib/kiln KILN_TEST_BACKENDS=cuda \
       timeout "$SANITIZE" compute-sanitizer --tool memcheck --leak-check no ./test_ops) >"$OUT/memcheck.log" 2>&1
    echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck.log" | head
  fi
  if [ -n "${ENGINE:-}" ]; then
    echo "== compute-sanitizer memcheck on test_engine (cuda: the device sampler included)"
    (cd build/tests && KILN_SOURCE_DIR=/tmp/src KILN_BUILD_DIR=/tmp/src/build KILN_BACKEND_PATH=/tmp/src/build/lib/kiln \
       KILN_TEST_BACKEND=cuda timeout "$SANITIZE" compute-sanitizer --tool memcheck --leak-check no ./test_engine) \
       >"$OUT/memcheck_engine.log" 2>&1
    echo "memcheck engine rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck_engine.log" | head
  fi
  if [ -n "${MODELS:-}" ]; then
    echo "== compute-sanitizer memcheck on the model parity fixtures (cuda)"
    (cd build/tests && KILN_SOURCE_DIR=/tmp/src KILN_BUILD_DIR=/tmp/src/build KILN_BACKEND_PATH=/tmp/src/build/lib/kiln \
       KILN_TEST_BACKEND=cuda timeout "$SANITIZE" compute-sanitizer --tool memcheck --leak-check no ./test_parity) \
       >"$OUT/memcheck_parity.log" 2>&1
    echo "memcheck parity rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/memcheck_parity.log" | head
  fi
fi
exit "$perf_rc"
