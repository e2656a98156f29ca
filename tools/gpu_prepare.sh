#!/usr/bin/env bash
# Run on the CPU machine before a GPU run: fills .gpu-carry/ (git-ignored) with what the GPU machine
# lacks, for the device tool to carry there (carry: [".gpu-carry"]):
#   libs/      PCRE2's and utf8proc's headers and static libraries (the GPU image has neither -dev package)
#   tomlplusplus/  toml++'s headers (header-only; the GPU image has no libtomlplusplus-dev)
#   cudnn-frontend/  the cuDNN frontend's headers (header-only; tools/setup.sh fetches them)
#   demo/      the demo corpus (tools/make_demo_corpus.sh)
#   qwen3/     a corpus in the Qwen3 tokenizer's vocabulary for the bench config, made from the text
#              and tokenizer given as arguments (default: ../shared/data's State of the Union text)
#   wheels/    flash-linear-attention's (and fla-core's) and transformers 5.24's wheels for Qwen3.5-MoE's PyTorch
#              peer (tools/gpu_family.sh installs them there with no network)
#   commit     the commit of the tree being sent (rerun this script after each commit)
# usage: tools/gpu_prepare.sh <marrow-binary> [text.jsonl qwen3-tokenizer.json]
# A stale build-gpu/CMakeCache.txt there keeps an old PCRE2 path: delete it. CMake's find_path looks in
# .gpu-carry/tomlplusplus/include first; gpu_common.sh points PKG_CONFIG_PATH at .gpu-carry/libs.
set -euo pipefail
cd "$(dirname "$0")/.."
marrow=$1
text=${2:-../shared/data/sotu.jsonl}
tokenizer=${3:-../shared/data/qwen3-tokenizer.json}
carry=.gpu-carry
rm -rf $carry/pcre2
mkdir -p $carry/libs/include $carry/libs/lib/pkgconfig
# pc <name> <library>: a pkg-config file for a static library carried into $carry/libs.
pc() {
  cat > $carry/libs/lib/pkgconfig/$1.pc <<PC
prefix=\${pcfiledir}/../..
Name: $1
Description: $1, carried for the GPU machine
Version: $(pkg-config --modversion "$1")
Libs: -L\${prefix}/lib -l$2
Cflags: -I\${prefix}/include
PC
}
cp /usr/include/pcre2.h /usr/include/utf8proc.h $carry/libs/include/
cp /usr/lib/x86_64-linux-gnu/libpcre2-8.a /usr/lib/x86_64-linux-gnu/libutf8proc.a $carry/libs/lib/
pc libpcre2-8 pcre2-8
pc libutf8proc utf8proc
mkdir -p $carry/tomlplusplus/include
cp -r /usr/include/toml++ $carry/tomlplusplus/include/
[ -f .cache/cudnn-frontend/include/cudnn_frontend.h ] || tools/setup.sh
rm -rf $carry/cudnn-frontend && cp -r .cache/cudnn-frontend $carry/cudnn-frontend
tools/make_demo_corpus.sh "$marrow" $carry/demo
if [ ! -f $carry/qwen3/manifest.json ]; then
  "$marrow" tokenize --input "$text" --tokenizer "$tokenizer" --out $carry/qwen3
fi
if ! ls $carry/wheels/flash_linear_attention-*.whl > /dev/null 2>&1; then
  .venv/bin/pip download -q --no-deps --only-binary=:all: -d $carry/wheels flash-linear-attention==0.6.0 fla-core==0.6.0 transformers==5.24.0
fi
# The device copy's .git can lag behind the tree it receives, so the tree's commit travels as a file.
{ git rev-parse --short HEAD; git diff --quiet HEAD -- . ':!docs' || echo "(plus uncommitted changes)"; } | paste -sd' ' > $carry/commit
du -sh $carry
