#!/usr/bin/env bash
# prepare-corpus: raw text -> checked Marrow training corpus. Ends with a PASS or FAIL line.
# usage: prepare_corpus.sh --marrow BIN --out DIR --input SPEC [--input SPEC ...]
#                          [--tokenizer tokenizer.json | --vocab-size N] [--field NAME] [--overwrite] [--strict]
set -uo pipefail
marrow="" out="" tokenizer="" vocab_size=32000 field=text
inputs=() extra=()
fail() { echo "FAIL: $*"; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --marrow) marrow=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --input) inputs+=("$2"); shift 2 ;;
    --tokenizer) tokenizer=$2; shift 2 ;;
    --vocab-size) vocab_size=$2; shift 2 ;;
    --field) field=$2; shift 2 ;;
    --overwrite|--strict) extra+=("$1"); shift ;;
    *) fail "unknown argument $1" ;;
  esac
done
[ -x "$marrow" ] || fail "--marrow must name the marrow binary (got '$marrow')"
[ -n "$out" ] || fail "--out is required"
[ ${#inputs[@]} -gt 0 ] || fail "at least one --input is required"
mkdir -p "$out" || fail "cannot create $out"

if [ -z "$tokenizer" ]; then
  tokenizer="$out/tokenizer.json"
  overwrite=()
  for e in "${extra[@]}"; do [ "$e" = --overwrite ] && overwrite=(--overwrite); done
  "$marrow" train-tokenizer --input "${inputs[@]}" --field "$field" --vocab-size "$vocab_size" --out "$tokenizer" \
    "${overwrite[@]}" || fail "marrow train-tokenizer failed (message above)"
fi
"$marrow" tokenize --input "${inputs[@]}" --field "$field" --tokenizer "$tokenizer" --out "$out/corpus" "${extra[@]}" \
  || fail "marrow tokenize failed (message above)"

here=$(cd "$(dirname "$0")" && pwd)
python=python3
[ -x "$here/../../../.venv/bin/python" ] && python="$here/../../../.venv/bin/python"
"$python" - "$out/corpus" "$field" "${inputs[@]}" <<'PY'
import glob, hashlib, json, os, sys
corpus, field, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(os.path.join(corpus, "manifest.json")) as f:
    m = json.load(f)
problems, first_ids = [], []
for shard in m["shards"]:
    path = os.path.join(corpus, shard["file"])
    data = open(path, "rb").read()
    if len(data) != 4 * shard["tokens"]:
        problems.append(f"{shard['file']}: {len(data)} bytes, manifest says {shard['tokens']} tokens")
    if hashlib.sha256(data).hexdigest() != shard["sha256"]:
        problems.append(f"{shard['file']}: sha256 differs from the manifest")
    ids = memoryview(data).cast("I")
    if len(ids) and max(ids) >= m["vocab_size"]:
        problems.append(f"{shard['file']}: an id is outside the vocabulary of {m['vocab_size']}")
    if len(first_ids) < 2_000_000:
        first_ids.extend(ids[:2_000_000])
last = open(os.path.join(corpus, m["shards"][-1]["file"]), "rb").read()[-4:]
if int.from_bytes(last, "little") != m["eos_id"]:
    problems.append("the corpus does not end with the EOS id")
checked = "not checked against tokenizers (no Python with tokenizers found)"
try:
    from tokenizers import Tokenizer
    files = []
    for spec in specs:
        files += sorted(glob.glob(os.path.join(spec, "**", "*"), recursive=True)) if os.path.isdir(spec) else sorted(glob.glob(spec))
    first = next((p for p in files if p.endswith((".jsonl", ".txt"))), None)
    if first and m["bad_lines"] == 0 and first == m["inputs"][0]:
        tk = Tokenizer.from_file(os.path.join(corpus, "tokenizer.json"))
        with open(first, encoding="utf-8") as f:
            docs = [f.read()] if first.endswith(".txt") else [json.loads(l)[field] for l, _ in zip(f, range(200)) if l.strip()]
        docs = [d for d in docs if d]
        expected = []
        for e in tk.encode_batch(docs, add_special_tokens=False):
            expected += e.ids + [m["eos_id"]]
        same = list(first_ids[:len(expected)]) == expected
        checked = f"first {len(docs)} documents of {first} {'match' if same else 'DO NOT match'} tokenizers"
        if not same:
            problems.append(checked)
except ImportError:
    pass
print(f"corpus {corpus}: {m['documents']} documents, {m['tokens']} tokens in {len(m['shards'])} shards, "
      f"vocabulary {m['vocab_size']}, eos id {m['eos_id']}, {m['bad_lines']} bad lines skipped; {checked}")
for p in problems:
    print("  " + p)
print("PASS" if not problems else "FAIL: " + "; ".join(problems))
sys.exit(1 if problems else 0)
PY
