#!/usr/bin/env bash
# make_bench_text.sh OUT - about 4 MB of mixed text for tokenizer throughput benchmarks: the
# licence texts Debian ships (English prose), Kiln's own C sources (code), and the tokenizer
# test corpus (many scripts, emoji, whitespace runs), repeated in a fixed order.
set -euo pipefail
out=${1:?usage: make_bench_text.sh OUT}
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp)
cat /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 >"$tmp"
find "$root/core" "$root/hal" -name '*.[ch]' | sort | xargs cat >>"$tmp"
python3 -c 'import json,sys; [print(json.loads(l)["text"]) for l in open(sys.argv[1], encoding="utf-8")]' \
  "$root/tests/data/tokenizer/corpus.jsonl" >>"$tmp"
: >"$out"
while [ "$(stat -c %s "$out")" -lt 4000000 ]; do cat "$tmp" >>"$out"; done
rm -f "$tmp"
echo "$out: $(stat -c %s "$out") bytes"
