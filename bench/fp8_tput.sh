#!/usr/bin/env bash
# fp8_tput.sh - issue 17's throughput table: offline 1,000 x (128 + 128) and 1,000 x (1,000 +
# 1,000) output tok/s of one random model in bf16 and in FP8 made at load (W8A8: per-channel
# e4m3 weights kept, dynamic per-token activations on cuBLASLt's FP8 GEMM), with the FP8 KV
# cache off and on, all in one run, for comparison with TensorRT-LLM's published H200
# Llama-3.1-8B FP8 figures (27.9k and 17.7k output tok/s). The prompts are random ids
# (kiln bench throughput), every request runs to its output length (ignore_eos).
# Usage (GPU machine): bash bench/fp8_tput.sh KILN MODEL_DIR OUT_DIR [N] [SEQS]
#   MODEL_DIR: bench/cuda_7b.py's random model (e.g. --shape llama3-8b);
#   N requests per run (1000), SEQS the FP8 runs' [engine] max_num_seqs (1024; bf16 keeps the
#   default 256 (128 + 128 only) and also runs with SEQS, so the batch size is not what differs).
# Writes OUT_DIR/tput_<variant>_<in>.json and prints one line per run.
set -u
kiln=$1 model=$2 out=$3 n=${4:-1000} seqs=${5:-1024}
mkdir -p "$out"
w8a8="--set model.quantization=fp8 --set model.fp8_activations=dynamic"
variants=("bf16|"
          "bf16_s${seqs}|--set engine.max_num_seqs=$seqs"
          "fp8_w8a8_s${seqs}|$w8a8 --set engine.max_num_seqs=$seqs"
          "fp8_w8a8_kvfp8_s${seqs}|$w8a8 --set cache.dtype=fp8_e4m3 --set engine.max_num_seqs=$seqs")
for len in 128 1000; do
  for v in "${variants[@]}"; do
    name=${v%%|*} extra=${v#*|}
    # the long runs take minutes each: bf16 at the default batch only for the short ones
    if [ "$len" = 1000 ] && [ "$name" = bf16 ]; then continue; fi
    # shellcheck disable=SC2086
    "$kiln" bench throughput --model "$model" --set backend.name=cuda $extra \
      --num-prompts "$n" --input-len "$len" --output-len "$len" \
      --json "$out/tput_${name}_${len}.json" >"$out/tput_${name}_${len}.log" 2>&1
    rc=$?
    python3 - "$out/tput_${name}_${len}.json" "$name" "$len" "$rc" <<'PY'
import json, sys
f, name, n, rc = sys.argv[1:]
try:
    d = json.load(open(f))
    print("%-24s %4s+%-4s output %9.1f tok/s  total %9.1f tok/s  %6.1f s  start-up %5.1f s" % (
        name, n, n, d["output_tokens_per_s"], d["total_tokens_per_s"], d["duration_s"],
        d.get("startup_s", 0)))
except Exception as e:
    print("%-24s %4s+%-4s failed (rc %s): %s" % (name, n, n, rc, e))
PY
    grep -i -E "error|preempt" "$out/tput_${name}_${len}.log" | head -3
  done
done
