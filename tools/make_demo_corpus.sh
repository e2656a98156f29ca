#!/usr/bin/env bash
# Builds the demo corpus from real English text that a Debian package ships: the Python 3.11
# documentation sources (package python3.11-doc, ~11 MB of reStructuredText prose and code, ~3M
# tokens). Trains a 4096-token byte-level BPE tokenizer on it and tokenizes it:
#   <out-dir>/tokenizer.json, <out-dir>/corpus/ (manifest.json + shards)
# Skips the work when <out-dir> already holds a complete corpus made with that tokenizer.
#
# usage: tools/make_demo_corpus.sh <marrow-binary> <out-dir>
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 <marrow-binary> <out-dir>" >&2
  exit 2
fi
marrow=$1
out=$2
text=/usr/share/doc/python3.11/html/_sources
if [ ! -d "$text" ]; then
  echo "make_demo_corpus: $text is missing: install the Debian package python3.11-doc (tools/setup.sh does)" >&2
  exit 1
fi
mkdir -p "$out"
manifest="$out/corpus/manifest.json"
if [ -f "$out/tokenizer.json" ] && [ -f "$manifest" ]; then
  want=$(sha256sum "$out/tokenizer.json" | cut -d' ' -f1)
  if grep -q "\"tokenizer_sha256\": \"$want\"" "$manifest"; then
    echo "make_demo_corpus: $out is complete"
    exit 0
  fi
fi
"$marrow" train-tokenizer --quiet --input "$text" --vocab-size 4096 --out "$out/tokenizer.json" --overwrite
"$marrow" tokenize --quiet --input "$text" --tokenizer "$out/tokenizer.json" --out "$out/corpus" --overwrite
