#!/usr/bin/env bash
# Run on the CPU machine before a GPU run: fills .gpu-carry/ (git-ignored) with what the GPU machine
# lacks, for the device tool to carry there (carry: [".gpu-carry"]):
#   pcre2/     PCRE2 header and static library (the GPU image has no libpcre2-dev)
#   tomlplusplus/  toml++'s headers (header-only; the GPU image has no libtomlplusplus-dev)
#   cudnn-frontend/  the cuDNN frontend's headers (header-only; tools/setup.sh fetches them)
#   demo/      the demo corpus (tools/make_demo_corpus.sh)
#   qwen3/     a corpus in the Qwen3 tokenizer's vocabulary for the bench config, made from the text
#              and tokenizer given as arguments (default: ../shared/data's State of the Union text)
#   commit     the commit of the tree being sent (rerun this script after each commit)
# usage: tools/gpu_prepare.sh <marrow-binary> [text.jsonl qwen3-tokenizer.json]
# A stale build-gpu/CMakeCache.txt there keeps an old PCRE2 path: delete it. CMake's find_path looks in
# .gpu-carry/tomlplusplus/include first; gpu_common.sh points PKG_CONFIG_PATH at .gpu-carry/pcre2.
set -euo pipefail
cd "$(dirname "$0")/.."
marrow=$1
text=${2:-../shared/data/sotu.jsonl}
tokenizer=${3:-../shared/data/qwen3-tokenizer.json}
carry=.gpu-carry
mkdir -p $carry/pcre2/include $carry/pcre2/lib/pkgconfig
cp /usr/include/pcre2.h $carry/pcre2/include/
cp /usr/lib/x86_64-linux-gnu/libpcre2-8.a $carry/pcre2/lib/
cat > $carry/pcre2/lib/pkgconfig/libpcre2-8.pc <<PC
prefix=\${pcfiledir}/../..
Name: libpcre2-8
Description: PCRE2 8-bit, carried for the GPU machine
Version: 10.42
Libs: -L\${prefix}/lib -lpcre2-8
Cflags: -I\${prefix}/include
PC
mkdir -p $carry/tomlplusplus/include
cp -r /usr/include/toml++ $carry/tomlplusplus/include/
[ -f .cache/cudnn-frontend/include/cudnn_frontend.h ] || tools/setup.sh
rm -rf $carry/cudnn-frontend && cp -r .cache/cudnn-frontend $carry/cudnn-frontend
tools/make_demo_corpus.sh "$marrow" $carry/demo
if [ ! -f $carry/qwen3/manifest.json ]; then
  "$marrow" tokenize --input "$text" --tokenizer "$tokenizer" --out $carry/qwen3
fi
# The device copy's .git can lag behind the tree it receives, so the tree's commit travels as a file.
{ git rev-parse --short HEAD; git diff --quiet HEAD -- . ':!docs' || echo "(plus uncommitted changes)"; } | paste -sd' ' > $carry/commit
du -sh $carry
