"""The demo corpus (tools/make_demo_corpus.sh, at $MARROW_DEMO_CORPUS): real English text, enough of
it, and every token id as Hugging Face `tokenizers` gives them with the corpus's own tokenizer.json,
which `tokenizers` must load. Decoding the corpus gives the source text back.
"""
import argparse
import glob
import hashlib
import json
import os
import sys
import unicodedata

from tokenizers import Tokenizer

TEXT_DIR = "/usr/share/doc/python3.11/html/_sources"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    parser.parse_args()
    corpus_root = os.environ.get("MARROW_DEMO_CORPUS")
    if not corpus_root:
        sys.exit("FAIL: MARROW_DEMO_CORPUS is not set (ctest sets it through the demo_corpus fixture)")
    corpus = os.path.join(corpus_root, "corpus")
    with open(os.path.join(corpus, "manifest.json")) as f:
        manifest = json.load(f)
    failures = []
    ids = []
    for shard in manifest["shards"]:
        with open(os.path.join(corpus, shard["file"]), "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != shard["sha256"]:
            failures.append(f"{shard['file']}: sha256 differs from the manifest")
        ids.extend(int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4))
    tokenizer_path = os.path.join(corpus_root, "tokenizer.json")
    with open(tokenizer_path, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != manifest["tokenizer_sha256"]:
            failures.append("tokenizer.json is not the one the manifest names")
    if manifest["tokens"] < 2_000_000:
        failures.append(f"only {manifest['tokens']} tokens; the demo needs at least 2M")
    tokenizer = Tokenizer.from_file(tokenizer_path)
    eos = tokenizer.token_to_id("<|endoftext|>")
    files = sorted(glob.glob(os.path.join(TEXT_DIR, "**", "*.txt"), recursive=True))
    documents = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            documents.append(f.read())
    expected = []
    for encoding in tokenizer.encode_batch(documents, add_special_tokens=False):
        expected.extend(encoding.ids + [eos])
    if ids != expected:
        at = next(i for i in range(min(len(ids), len(expected)) + 1) if i == min(len(ids), len(expected)) or ids[i] != expected[i])
        failures.append(f"corpus ids differ from tokenizers' at token {at} of {len(expected)}")
    decoded, start = [], 0
    for i, token in enumerate(ids):
        if token == eos:
            decoded.append(tokenizer.decode(ids[start:i]))
            start = i + 1
    if decoded != [unicodedata.normalize("NFC", d) for d in documents if d]:
        failures.append("decoding the corpus does not give the source text back")
    size = sum(len(d.encode()) for d in documents)
    print(f"demo corpus: {len(documents)} documents, {size / 1e6:.1f} MB of text, {manifest['tokens']} tokens, "
          f"vocabulary {manifest['vocab_size']}; ids compared with tokenizers: {'identical' if ids == expected else 'DIFFER'}")
    for failure in failures:
        print(f"  {failure}")
    print("PASS" if not failures else "FAIL")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
