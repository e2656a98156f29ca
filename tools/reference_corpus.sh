#!/usr/bin/env bash
# The text of issue #52's long comparison (tools/reference_run.py against marrow train), as one
# compressed JSONL file small enough to carry to the GPU machine, where `marrow tokenize` turns it
# into a corpus of the Qwen3 tokenizer: ~11M tokens of real English prose and technical writing,
#   the State of the Union addresses (../shared/data/sotu.jsonl, 2.1M tokens),
#   the Python 3.11 documentation sources (python3.11-doc, as the demo corpus),
#   the Linux 6.1 documentation sources (linux-doc-6.1, downloaded into .cache/ when missing).
# usage: tools/reference_corpus.sh <out.jsonl.zst> [sotu.jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/reference_corpus.sh <out.jsonl.zst> [sotu.jsonl]}
sotu=${2:-../shared/data/sotu.jsonl}
python_docs=/usr/share/doc/python3.11/html/_sources
kernel=.cache/linux-doc
[ -d "$python_docs" ] || { echo "reference_corpus: $python_docs is missing: install python3.11-doc (tools/setup.sh does)" >&2; exit 1; }
[ -f "$sotu" ] || { echo "reference_corpus: $sotu is missing: name the State of the Union text as the second argument" >&2; exit 1; }
if [ ! -d "$kernel/usr/share/doc" ]; then
  mkdir -p "$kernel"
  (cd "$kernel" && apt-get download linux-doc-6.1 >/dev/null 2>&1) || { echo "reference_corpus: apt-get download linux-doc-6.1 failed" >&2; exit 1; }
  dpkg-deb -x "$kernel"/linux-doc-6.1_*.deb "$kernel"
fi
mkdir -p "$(dirname "$out")"
python3 - "$sotu" "$python_docs" "$kernel/usr/share/doc/linux-doc-6.1/html/_sources" <<'PY' | zstd -q -19 -T0 -o "$out" -f
import json, os, sys
sotu, *trees = sys.argv[1:]
documents = 0
for line in open(sotu):
    sys.stdout.write(line)
    documents += 1
for tree in trees:
    for root, _, files in sorted(os.walk(tree)):
        for name in sorted(files):
            if name.endswith(".txt"):
                text = open(os.path.join(root, name), errors="replace").read()
                if text.strip():
                    sys.stdout.write(json.dumps({"text": text}) + "\n")
                    documents += 1
print(f"reference_corpus: {documents} documents", file=sys.stderr)
PY
echo "reference_corpus: $out ($(du -h "$out" | cut -f1))"
