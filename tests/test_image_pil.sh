#!/usr/bin/env bash
# test_image_pil.sh BUILD SRC [VARIANT] - Kiln's image preprocessing against Pillow + numpy, bit for bit.
# tools/make_image_goldens.py --source pil restates transformers' Qwen2-VL steps with Pillow's
# Image.resize(BICUBIC) and numpy; test_image then compares every decoded image and every
# pixel value with them (tolerance 0). Needs Debian's python3-pil and python3-numpy (make deps):
# the first python3 that imports both is used, /usr/bin/python3 first (Debian's packages are
# not visible to a pyenv or venv python).
set -euo pipefail
BUILD=$1
SRC=$2
PY=
for p in /usr/bin/python3 python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import PIL, numpy' 2>/dev/null; then PY=$p; break; fi
done
if [ -z "$PY" ]; then
  echo "test_image_pil: no python3 with Pillow and numpy (apt-get install python3-pil python3-numpy)" >&2
  exit 1
fi
# A third argument names the variant (its goldens go to their own folder: CTest may run both
# at once).
OUT="$BUILD/tests/image_goldens_pil${3:+_$3}"
rm -rf "$OUT"
"$PY" "$SRC/tools/make_image_goldens.py" --source pil --all-processors \
  --images "$SRC/tests/data/images" --out "$OUT" >/dev/null
KILN_IMAGE_GOLDENS="$OUT" KILN_IMAGE_REQUIRE_GOLDENS=1 KILN_IMAGE_TOLERANCE=0 \
  "$BUILD/tests/test_image"
