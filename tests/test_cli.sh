#!/usr/bin/env bash
# test_cli.sh - the `kiln` command end to end: info, config errors, overrides, help.
# Usage: test_cli.sh BUILD_DIR SOURCE_DIR. Prints "N passed, N failed".
set -u
build=$1; src=$2
kiln="$build/bin/kiln"
pass=0; fail=0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# check NAME EXPECTED_RC REGEX -- CMD...: runs CMD, wants its exit code and output to match.
check() {
  local name=$1 want_rc=$2 regex=$3; shift 4
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [ "$rc" = "$want_rc" ] && grep -Eq -- "$regex" <<<"$out"; then
    pass=$((pass + 1)); echo "ok   $name"
  else
    fail=$((fail + 1)); echo "FAIL $name (rc $rc, want $want_rc; output did not match /$regex/):"
    sed 's/^/     | /' <<<"$out" | head -40
  fi
}

cd "$tmp"   # no ./etc/kiln.ini here: built-in defaults unless --config is given
check "info lists the cpu backend" 0 'cpu +.*libkiln-backend-cpu\.so' -- "$kiln" info
check "info shows the cpu device" 0 'device 0: .*CPU' -- "$kiln" info
check "auto picks a backend" 0 'backend = auto -> ' -- "$kiln" info
if [ -f "$build/lib/kiln/libkiln-backend-cuda.so" ]; then
  if ldconfig -p | grep -q 'libcuda\.so\.1'; then
    check "cuda plugin present" 0 'cuda +.*libkiln-backend-cuda\.so' -- "$kiln" info
  else
    check "cuda plugin rejected with the driver's reason" 0 \
      'reason: .*libcuda\.so\.1: cannot open shared object file' -- "$kiln" info
    check "explicit cuda without a driver is a hard error" 1 \
      'backend = cuda: cannot be used: .*libcuda\.so\.1' -- "$kiln" info --set backend.name=cuda
  fi
fi
check "explicit cpu" 0 'backend = cpu -> cpu' -- "$kiln" info --set backend.name=cpu
check "unknown backend name" 1 "backend 'nosuch': no file libkiln-backend-nosuch.so" \
  -- "$kiln" info --set backend.name=nosuch
check "missing backend path" 1 'No such file or directory' \
  -- "$kiln" info --set backend.name=/nonexistent/libkiln-backend-x.so

printf '[engine]\nmax_num_seqs = 0\n' >bad_range.ini
check "out-of-range value names file:line and range" 1 'bad_range\.ini:2: .*max_num_seqs.*\[1, ' \
  -- "$kiln" info --config bad_range.ini
printf '[engine]\nmax_num_seq = 4\n' >bad_key.ini
check "unknown key suggests the right one" 1 'bad_key\.ini:2: .*max_num_seq.*max_num_seqs' \
  -- "$kiln" info --config bad_key.ini
printf '[enigne]\n' >bad_section.ini
check "unknown section" 1 'bad_section\.ini:1: .*enigne' -- "$kiln" info --config bad_section.ini
printf '[engine\nmax_num_seqs = 4\n' >bad_syntax.ini
check "syntax error" 1 'bad_syntax\.ini:1: ' -- "$kiln" info --config bad_syntax.ini
check "missing config file" 1 'nonexistent\.ini' -- "$kiln" info --config nonexistent.ini
check "bad --set" 1 'log\.level' -- "$kiln" info --set log.level=loud
check "--set without =" 1 '--set' -- "$kiln" info --set engine.max_num_seqs
check "--set wins over the file" 0 'max_num_seqs = 7' \
  -- "$kiln" config --config "$src/etc/kiln.ini" --set engine.max_num_seqs=7
check "default config loads" 0 'backend = auto -> ' -- "$kiln" info --config "$src/etc/kiln.ini"
check "info: the model and its quantization" 0 'kiln-tiny \(LlamaForCausalLM; quantization none\)' \
  -- "$kiln" info --config "$src/etc/kiln.ini"
check "info: quantization = fp8 at load" 0 'quantization = fp8: FP8 e4m3 per-channel, made at load' \
  -- "$kiln" info --config "$src/etc/kiln.ini" --set model.quantization=fp8
for ex in "$src"/etc/examples/*.ini; do
  check "example config $(basename "$ex") loads" 0 '^\[backend\]' -- "$kiln" config --config "$ex"
done
check "--help-config lists keys" 0 'gpu_memory_utilization' -- "$kiln" --help-config
check "unknown command" 2 "unknown command 'frobnicate'" -- "$kiln" frobnicate
check "version" 0 'backend ABI [0-9]+\.[0-9]+\)' -- "$kiln" --version

# ---- every subcommand's option table: --help and -h list it, wrong options are refused ----------
# The options of each command's table, written out here as the reference: --help must list exactly
# these (none missing, none more), then -h/--help and the common options. A command that `kiln
# --help` (or `kiln bench --help`) lists and this table does not is a failure too.
declare -A want_opts=(
  [info]=""
  [config]=""
  [selftest]="--seed"
  [tokenize]="--tokenizer --special --json"
  [detokenize]="--tokenizer --skip-special"
  [template]="--tokenizer --messages --add-generation-prompt --template"
  [score]="--model --ids --out --dtype --quantization --chunk --image"
  [generate]="--model --dtype --quantization --ids --prompt --input --output --max-tokens --min-tokens
    --temperature --top-p --top-k --min-p --seed --n --stop --ignore-eos --logprobs --json --chunk
    --max-in-flight --beam-width --length-penalty --early-stopping --image --messages --json-schema --json-object --regex --grammar --choice"
  [chat]="--model --dtype --quantization --system --max-tokens --temperature --top-p --top-k --min-p
    --repetition-penalty --seed --ignore-eos"
  [perplexity]="--model --file --ctx --chunk --dtype --quantization --json"
  [serve]="--model --host --port --api-key --served-model-name --dtype --quantization"
  [download]="--model --cache-dir --endpoint"
  [bench latency]="--model --dtype --quantization --input-len --output-len --batch-size --num-iters --warmup
    --seed --json --ids --image --regex --json-schema"
  [bench throughput]="--model --dtype --quantization --num-prompts --input-len --output-len --dataset --warmup
    --seed --json --regex --json-schema"
  [bench serve]="--url --endpoint --model --api-key --num-prompts --request-rate --max-concurrency --image-dir
    --input-len --output-len --random-ids --dataset --seed --temperature --ignore-eos --timeout
    --warmup --json"
)
# the commands the binary has (serve and bench serve only with KILN_HTTP)
cmds=$("$kiln" --help | sed -n '/^commands:$/,/^$/p' | awk '/^  [a-z]/ {print $1}' | grep -vx bench)
cmds+=$'\n'$("$kiln" bench --help | awk '/^  [a-z]/ {print "bench " $1}')
sorted() { tr ' ' '\n' | grep -v '^$' | sort; }
while IFS= read -r cmd; do
  [ -n "$cmd" ] || continue
  if [ -z "${want_opts[$cmd]+set}" ]; then
    fail=$((fail + 1)); echo "FAIL kiln $cmd: not in this test's table of options"; continue
  fi
  # shellcheck disable=SC2086
  help=$("$kiln" $cmd --help 2>/dev/null); rc=$?
  listed=$(sed -n '/^options:$/,/^common options:$/p' <<<"$help" | grep -oE '^  --?[a-z-]+' | sort)
  common=$(sed -n '/^common options:$/,$p' <<<"$help" | grep -oE '^  --[a-z-]+' | sort)
  want=$( (echo "${want_opts[$cmd]}" -h) | sorted | sed 's/^/  /' | sort)
  if [ "$rc" = 0 ] && grep -q "^usage: kiln $cmd" <<<"$help" && [ "$listed" = "$want" ] &&
     [ "$common" = "$(printf '  --%s\n' config log-level set)" ]; then
    pass=$((pass + 1)); echo "ok   kiln $cmd --help lists its options"
  else
    fail=$((fail + 1)); echo "FAIL kiln $cmd --help (rc $rc):"
    diff <(echo "$want") <(echo "$listed") | sed 's/^/     | /'
    sed 's/^/     | /' <<<"$help" | head -40
  fi
  # shellcheck disable=SC2086
  if [ "$("$kiln" $cmd -h 2>/dev/null)" = "$help" ]; then
    pass=$((pass + 1)); echo "ok   kiln $cmd -h = --help"
  else
    fail=$((fail + 1)); echo "FAIL kiln $cmd -h differs from --help"
  fi
  # shellcheck disable=SC2086
  check "kiln $cmd refuses an unknown option" 1 \
    "^kiln: $cmd: unknown (or incomplete )?option '--frobnicate'" -- "$kiln" $cmd --frobnicate
  # every option with a value (a metavar in the help) refuses to come without one
  own=$(sed -n '/^options:$/,/^common options:$/p' <<<"$help")
  for opt in $(grep -oE '^  --[a-z-]+ [^ ]' <<<"$own" | awk '{print $1}'); do
    # shellcheck disable=SC2086
    check "kiln $cmd $opt without its value" 1 \
      "^kiln: $cmd: (unknown (or incomplete )?option '$opt'|$opt needs a value)" -- "$kiln" $cmd $opt
  done
done <<<"$cmds"

# values go through the table's checks, with the messages the commands always gave
check "an integer option's range" 1 "score: --chunk wants an integer in \[0, 16777216\], got '-1'" \
  -- "$kiln" score --chunk -1
check "a number option's range" 1 "generate: --top-p wants a number in \[1e-06, 1\], got '0'" \
  -- "$kiln" generate --top-p 0
check "selftest --seed is checked" 1 "selftest: --seed wants an integer in \[0, 18446744073709551615\], got 'abc'" \
  -- "$kiln" selftest --seed abc
check "--name=value where the command takes it" 1 "tokenize: unknown or incomplete option '--json=1'" \
  -- "$kiln" tokenize --tokenizer=. --json=1
check "--name=value where it does not" 1 "generate: unknown or incomplete option '--model=x'" \
  -- "$kiln" generate --model=x
# beam search on the default model: each hypothesis with its score; the option checks
check "generate --beam-width prints each hypothesis with its score" 0 \
  "--- hypothesis 1 \((stop|length), score -[0-9.]+, logprob -[0-9.]+\) ---" \
  -- "$kiln" generate --prompt "Once upon a time" --beam-width 3 --n 2 --max-tokens 6
check "generate --early-stopping is checked" 1 "generate: --early-stopping must be true, false or never" \
  -- "$kiln" generate --prompt x --beam-width 2 --early-stopping soon
check "generate --n beyond --beam-width is refused" 1 "generate: --n \(3\) must be <= --beam-width \(2\)" \
  -- "$kiln" generate --prompt x --beam-width 2 --n 3
for opt in --config --set --log-level; do
  check "common option $opt without its value" 1 "^kiln: $opt needs a value" -- "$kiln" generate $opt
done
check "info no longer ignores stray arguments" 1 "info: unknown or incomplete option 'stray'" \
  -- "$kiln" info stray

# ---- a .gguf file's own tokenizer (tokenizer.ggml.* metadata, models/loader/gguf_vocab.c) -------
# The llama3_gguf fixture with a synthetic byte-level tokenizer of its vocabulary size: once as
# tokenizer.json beside the file, once inside the file (tests/make_gguf_vocab.py --into) with
# nothing beside it. Both must encode, decode and generate the same.
g="$src/tests/fixtures/models/llama3_gguf/model.gguf"
mkdir -p gguf_json gguf_meta
if python3 "$src/tests/make_gguf_vocab.py" --synthetic "$g" gguf_json && cp "$g" gguf_json/ &&
  python3 "$src/tests/make_gguf_vocab.py" gguf_json gguf_meta/model.gguf --pre qwen2 --into "$g"; then
  text='Once upon a time, the fox ran to the river.'
  ids_json=$(printf '%s' "$text" | "$kiln" tokenize --tokenizer gguf_json 2>&1)
  check "tokenize: a .gguf file's own tokenizer" 0 "^${ids_json}\$" -- \
    bash -c "printf '%s' '$text' | '$kiln' tokenize --tokenizer gguf_meta/model.gguf"
  check "detokenize: a .gguf file's own tokenizer" 0 "^${text}\$" -- \
    bash -c "echo '$ids_json' | '$kiln' detokenize --tokenizer gguf_meta/model.gguf"
  gen_json=$("$kiln" generate --model gguf_json/model.gguf --prompt 'the fox' --max-tokens 8 \
    --set backend.name=cpu 2>/dev/null | od -An -tx1 | tr -d ' \n')
  check "generate: a .gguf file's own tokenizer, as with tokenizer.json beside it" 0 "^${gen_json}\$" -- \
    bash -c "'$kiln' generate --model gguf_meta/model.gguf --prompt 'the fox' --max-tokens 8 --set backend.name=cpu 2>/dev/null | od -An -tx1 | tr -d ' \n'"
  check "generate logs where the tokenizer came from" 0 'tokenizer: from the metadata of .*gguf_meta/model\.gguf' -- \
    "$kiln" generate --model gguf_meta/model.gguf --prompt 'the fox' --max-tokens 1 --set backend.name=cpu --log-level info
  python3 "$src/tests/make_gguf_vocab.py" gguf_json gguf_meta/bad.gguf --pre falcon --into "$g"
  check "an unknown GGUF pre-tokenizer is refused, named" 1 'tokenizer\.ggml\.pre "falcon" is not a pre-tokenizer Kiln knows' -- \
    "$kiln" generate --model gguf_meta/bad.gguf --prompt 'the fox' --max-tokens 1 --set backend.name=cpu
else
  fail=$((fail + 1)); echo "FAIL making the GGUF tokenizer files (tests/make_gguf_vocab.py)"
fi

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
