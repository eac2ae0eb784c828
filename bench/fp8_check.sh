#!/usr/bin/env bash
# fp8_check.sh - FP8 on the GPU (issue 17): the same random model served in bf16, in FP8 made at
# load with weight-only activations (fp8_weights = keep, W8A16) and with dynamic per-token FP8
# activations (fp8_activations = dynamic, W8A8: cuBLASLt's FP8 GEMM for prefill), all in one run:
# batch-1 decode (128 + 256, ms/token), a 512-token prefill (ms to the first token) and a
# throughput run of N x (512 + 256) (output tok/s).
# Usage (GPU machine, after a build): bash bench/fp8_check.sh KILN MODEL_DIR OUT_DIR [N]
# (MODEL_DIR: bench/cuda_7b.py's random Qwen2-7B, e.g. /tmp/m7/qwen2-7b). Writes OUT_DIR/fp8_*.json.
# ONLY="bf16 fp8_w8a8" runs those variants only; TAG=x suffixes the files (fp8_<variant>x_*: a
# second run under another environment, e.g. KILN_CUDA_FP8_LT_MIN_M=2); B8=1 adds a batch-8
# decode (8 x (128 + 256), ms per step), where the FP8 GEMV / cuBLASLt threshold shows.
set -u
kiln=$1 model=$2 out=$3 n=${4:-300}
only=${ONLY:-} tag=${TAG:-}
mkdir -p "$out"
variants=("bf16|"
          "fp8_w8a16|--set model.quantization=fp8 --set model.fp8_weights=keep"
          "fp8_w8a8|--set model.quantization=fp8 --set model.fp8_activations=dynamic")
for v in "${variants[@]}"; do
  name=${v%%|*} extra=${v#*|}
  if [ -n "$only" ] && [[ " $only " != *" $name "* ]]; then continue; fi
  name=$name$tag
  # shellcheck disable=SC2086
  common=(--model "$model" --set backend.name=cuda $extra)
  "$kiln" bench latency "${common[@]}" --batch-size 1 --input-len 128 --output-len 256 \
    --num-iters 5 --warmup 1 --json "$out/fp8_${name}_decode.json" >"$out/fp8_${name}.log" 2>&1
  echo "$name decode rc=$?"
  "$kiln" bench latency "${common[@]}" --batch-size 1 --input-len 512 --output-len 1 \
    --num-iters 10 --warmup 2 --json "$out/fp8_${name}_prefill.json" >>"$out/fp8_${name}.log" 2>&1
  echo "$name prefill rc=$?"
  if [ "${B8:-0}" = 1 ]; then
    "$kiln" bench latency "${common[@]}" --batch-size 8 --input-len 128 --output-len 256 \
      --num-iters 3 --warmup 1 --json "$out/fp8_${name}_decode8.json" >>"$out/fp8_${name}.log" 2>&1
    echo "$name decode8 rc=$?"
  fi
  "$kiln" bench throughput "${common[@]}" --num-prompts "$n" --input-len 512 --output-len 256 \
    --json "$out/fp8_${name}_throughput.json" >>"$out/fp8_${name}.log" 2>&1
  echo "$name throughput rc=$?"
  python3 - "$out" "$name" <<'PY'
import json, sys
o, n = sys.argv[1], sys.argv[2]
def get(k):
    try: return json.load(open("%s/fp8_%s_%s.json" % (o, n, k)))
    except Exception as e: return {"error": str(e)}
d, p, t, d8 = get("decode"), get("prefill"), get("throughput"), get("decode8")
print(n, "decode ms/token", d.get("tpot_ms", d.get("error")), "| prefill ttft ms", p.get("ttft_ms", p.get("error")),
      "| batch-8 ms/step", d8.get("tpot_ms", "-"),
      "| throughput", {k: v for k, v in t.items() if "tok" in k} or t.get("error"))
PY
  grep -i -E "error|quantiz|kept|widen" "$out/fp8_${name}.log" | head -5
done
