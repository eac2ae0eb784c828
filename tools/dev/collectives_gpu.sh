#!/usr/bin/env bash
# collectives_gpu.sh - runs tests/test_collectives.c on a GPU backend with one process per GPU
# (NCCL needs fresh processes: a CUDA context does not survive fork). Each rank opens device
# (rank mod device count), rank 0 writes the NCCL unique id to a file the others read, and every
# rank runs all_reduce (F32/F16/BF16, in place, two-step sizes, graph replay), all_gather,
# broadcast and a send/recv ring against the fp64 reference (the cpu backend's mismatch and
# timeout cases are skipped: NCCL checks neither). About 10-20 s, most of it NCCL init.
# Usage (from a build tree with -DKILN_BACKEND_CUDA=ON, on a machine with >= 2 GPUs and
# libnccl.so.2 on the loader path):
#   bash tools/dev/collectives_gpu.sh BUILD_DIR [WORLD=2] [BACKEND=cuda]
# Exit status 0 when every rank passed; each rank's log is in ${OUT:-/tmp}/coll-rank<r>.log.
set -uo pipefail
BUILD=${1:?usage: collectives_gpu.sh BUILD_DIR [WORLD] [BACKEND]}
WORLD=${2:-2}
BACKEND=${3:-cuda}
OUT=${OUT:-/tmp}
mkdir -p "$OUT"
ID_FILE=$(mktemp -u "${TMPDIR:-/tmp}/kiln-coll-id.XXXXXX")
SEED=${KILN_TEST_SEED:-$(date +%s)}
echo "collectives_gpu: $WORLD ranks on $BACKEND, seed $SEED"
pids=()
for ((r = 0; r < WORLD; r++)); do
  KILN_BACKEND_PATH="$BUILD/lib/kiln" KILN_TEST_BACKENDS="$BACKEND" KILN_TEST_SEED="$SEED" \
    KILN_COLL_RANK=$r KILN_COLL_WORLD=$WORLD KILN_COLL_ID_FILE="$ID_FILE" \
    timeout 300 "$BUILD/tests/test_collectives" >"$OUT/coll-rank$r.log" 2>&1 &
  pids+=($!)
done
rc=0
for ((r = 0; r < WORLD; r++)); do
  if ! wait "${pids[$r]}"; then rc=1; fi
  tail -n 5 "$OUT/coll-rank$r.log"
done
rm -f "$ID_FILE" "$ID_FILE.tmp"
exit $rc
