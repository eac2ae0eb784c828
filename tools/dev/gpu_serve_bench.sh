#!/usr/bin/env bash
# gpu_serve_bench.sh - issue 24's serving figures on the GPU machine: `kiln serve` on MODEL (a
# folder with a tokenizer.json, which the server needs to detokenize),
# then `kiln bench serve` with random 512-token-id / 256-token completions (as vLLM's random dataset), rate inf over 256
# prompts, then 4 requests/s over 120 prompts (streamed, ignore_eos, greedy), JSON into OUT_DIR.
# Usage: KILN=path/to/kiln bash tools/dev/gpu_serve_bench.sh MODEL OUT_DIR [--set k=v ...]
set -uo pipefail
model=${1:?usage: gpu_serve_bench.sh MODEL OUT_DIR} out=${2:?out dir}; shift 2
kiln=${KILN:-build/bin/kiln}
mkdir -p "$out"
"$kiln" serve --model "$model" --set server.port=0 --set backend.name=cuda "$@" >"$out/serve.log" 2>&1 &
pid=$!
url=
for _ in $(seq 360); do
  url=$(sed -n 's|^kiln: serving .* on \(http://127\.0\.0\.1:[0-9]*\).*|\1|p' "$out/serve.log")
  [ -n "$url" ] && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.5
done
[ -n "$url" ] || { echo "gpu_serve_bench: the server did not start:"; tail -20 "$out/serve.log"; kill $pid 2>/dev/null; exit 1; }
rc=0
for run in "inf 256" "4 120"; do
  set -- $run
  echo "== kiln bench serve: random 512/256, rate $1, $2 prompts"
  "$kiln" bench serve --url "$url" --random-ids 150000 --input-len 512 --output-len 256 --ignore-eos --temperature 0 \
    --request-rate "$1" --num-prompts "$2" --warmup 4 --seed 1 --timeout 600 \
    --json "$out/serve_rate_$1.json" 2>&1 | tail -18 || rc=1
done
kill -TERM $pid; wait $pid
exit $rc
