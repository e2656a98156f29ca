"""Parity of Marrow's tokenizer with Hugging Face `tokenizers`.

Real English text (the Python documentation that Debian's python3.11-doc ships) plus generated
multilingual text (accents, decomposed accents, CJK, Hangul jamo, emoji, code, digits, whitespace
runs, special tokens) is encoded by `marrow tokenize` and by `tokenizers`, and the ids must be
identical, for tokenizers trained by `tokenizers` (Qwen pre-tokenizer; GPT-2 ByteLevel) and by
`marrow train-tokenizer`. decode(encode(x)) must give x back (x in NFC). Set MARROW_QWEN3_TOKENIZER
to a Qwen3 tokenizer.json to check it too. Trained with the same settings, marrow's trainer and
`tokenizers`' BpeTrainer must produce the same vocabulary and merges.
"""
import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import unicodedata

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

TEXT_DIR = "/usr/share/doc/python3.11/html/_sources"
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SNIPPETS = [
    "café", "cafe\u0301", "naïve façade", "A\u0308\u0304", "e\u0323\u0301", "\u1100\u1161\u11a8", "\uac00\u11a8",
    "한국어 텍스트", "日本語のテキスト、漢字かな交じり。", "中文文本，包括标点符号！", "\uf900\uf901", "\u2126 \u212b Å",
    "😀😃🎉 👍🏽 👨‍👩‍👧‍👦 🇫🇷", "def f(x):\n    return x**2  # comment\n", "for (int i = 0; i < 10; ++i) {\n\tsum += a[i];\n}\n",
    "1234567890 3.14159 1,000,000 2024-01-01", "   multiple   spaces\t\ttabs\n\n\n", "\r\n\r\nwindows lines\r\n",
    "nbsp\u00a0here\u3000ideographic\u2028line\u2029para\u0085nel", "I'm you're they've we'll he'd it's DON'T",
    "'ſ 'S 'Ll", "<|endoftext|>", "a<|endoftext|>b", "Ελληνικά ά ά", "العربية نص", "हिन्दी पाठ", "Русский текст",
    "\u200b\u200d\u200e\u2060", "x\u0301\u0302\u0303\u0304", "\u0344\u0340\u0958", "ﬁ ＡＢＣ", " leading", "trailing   ",
    "!!!???...---", "https://example.com/path?q=1&r=2#frag", "\U00020000\U0002A6D6", "ไทย", "ö" * 40, "a" * 300,
    "中" * 500, " " * 50, "\n" * 20, "1" * 100, "ab" * 200,
]
RANGES = [(32, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x3FF), (0x1100, 0x11FF), (0x3000, 0x30FF),
          (0x4E00, 0x4FFF), (0xAC00, 0xAC40), (0x1F300, 0x1F64F)]


def generated_documents(count, seed):
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            if r < 0.6:
                parts.append(rng.choice(SNIPPETS))
            elif r < 0.8:
                chars = []
                for _ in range(rng.randint(1, 30)):
                    low, high = rng.choice(RANGES)
                    chars.append(chr(rng.randint(low, high)) if rng.random() < 0.9 else rng.choice("\t\n\r\x85\xa0\u2028\u3000\u200b"))
                parts.append("".join(chars))
            else:
                parts.append(rng.choice([" ", "\n", "  ", "\t", "\r\n"]))
        documents.append("".join(parts))
    return documents


def real_documents(min_bytes):
    files = sorted(glob.glob(os.path.join(TEXT_DIR, "**", "*.txt"), recursive=True))
    if not files:
        sys.exit(f"FAIL: no text under {TEXT_DIR}; install the Debian package python3.11-doc (tools/setup.sh does)")
    documents, size = [], 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            documents.append(f.read())
        size += len(documents[-1].encode())
        if size >= min_bytes:
            break
    return documents


def write_jsonl(path, documents, expected=None):
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(documents):
            line = {"text": d} if expected is None else {"text": d, "expected": expected[i]}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def hf_trained(path, documents, gpt2_style):
    tokenizer = Tokenizer(models.BPE())
    if gpt2_style:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    else:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=6000, special_tokens=["<|endoftext|>"], show_progress=False, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.save(path)


def read_corpus(directory):
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    ids = []
    for shard in manifest["shards"]:
        with open(os.path.join(directory, shard["file"]), "rb") as f:
            data = f.read()
        ids.extend(int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4))
    return manifest, ids


def check(name, tokenizer_path, documents, args, work, prefix_space=False):
    docs_path = os.path.join(work, "docs.jsonl")
    out = os.path.join(work, f"corpus-{name}")
    subprocess.run([args.marrow, "tokenize", "--quiet", "--input", docs_path, "--tokenizer", tokenizer_path,
                    "--out", out, "--threads", "2"], check=True)
    manifest, ids = read_corpus(out)
    hf = Tokenizer.from_file(tokenizer_path)
    eos = hf.token_to_id("<|endoftext|>")
    expected = []
    per_document = [e.ids for e in hf.encode_batch(documents, add_special_tokens=False)]
    for document_ids in per_document:
        expected.extend(document_ids + [eos])
    failures = 0
    if ids != expected:
        failures += 1
        at = next(i for i in range(min(len(ids), len(expected)) + 1)
                  if i == min(len(ids), len(expected)) or ids[i] != expected[i])
        print(f"  {name}: ids differ from tokenizers at token {at} of {len(expected)}")
        print(f"    tokenizers: {[hf.id_to_token(t) for t in expected[max(0, at - 5):at + 5]]}")
        print(f"    marrow:     {[hf.id_to_token(t) for t in ids[max(0, at - 5):at + 5]]}")
    # ByteLevel's add_prefix_space puts a space before text that does not start with one.
    normalized = [unicodedata.normalize("NFC", d) for d in documents if "<|endoftext|>" not in d]
    decoded = [" " + d if prefix_space and not d.startswith(" ") else d for d in normalized]
    roundtrip_path = os.path.join(work, "normalized.jsonl")
    write_jsonl(roundtrip_path, normalized, decoded)
    tool = os.path.join(args.build_dir, "tests", "tokenizer_tool")
    result = subprocess.run([tool, "roundtrip", tokenizer_path, roundtrip_path], capture_output=True, text=True)
    if result.returncode != 0:
        failures += 1
        print(f"  {name}: decode(encode(x)) != x: {result.stderr.strip()}")
    hf_decoded = hf.decode_batch([e.ids for e in hf.encode_batch(normalized, add_special_tokens=False)])
    if hf_decoded != decoded:
        failures += 1
        print(f"  {name}: tokenizers' own decode does not round-trip this tokenizer")
    size = sum(len(d.encode()) for d in documents)
    print(f"{'ok  ' if not failures else 'FAIL'} {name}: {len(documents)} documents, {size / 1e6:.2f} MB, "
          f"{len(expected)} tokens, vocabulary {manifest['vocab_size']}: ids {'identical' if ids == expected else 'DIFFER'}; "
          f"{len(normalized)} documents round-trip")
    return failures


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marrow", required=True)
    parser.add_argument("--build-dir", required=True)
    args = parser.parse_args()
    real = real_documents(1_500_000)
    generated = generated_documents(600, seed=7)
    documents = real + generated
    failures = 0
    with tempfile.TemporaryDirectory(prefix="marrow-parity-") as work:
        write_jsonl(os.path.join(work, "docs.jsonl"), documents)
        train_path = os.path.join(work, "train.jsonl")
        write_jsonl(train_path, real)
        cases = []
        for name, gpt2 in (("hf-qwen-style", False), ("hf-gpt2-style", True)):
            path = os.path.join(work, f"{name}.json")
            hf_trained(path, real, gpt2)
            cases.append((name, path, gpt2))
        marrow_path = os.path.join(work, "marrow-trained.json")
        subprocess.run([args.marrow, "train-tokenizer", "--quiet", "--input", train_path, "--vocab-size", "6000",
                        "--out", marrow_path], check=True)
        cases.append(("marrow-trained", marrow_path, False))
        # With the same settings, marrow's trainer and tokenizers' BpeTrainer learn the same merges.
        with open(cases[0][1]) as f, open(marrow_path) as g:
            hf_model, marrow_model = json.load(f)["model"], json.load(g)["model"]
        same = hf_model["vocab"] == marrow_model["vocab"] and hf_model["merges"] == marrow_model["merges"]
        print(f"{'ok  ' if same else 'FAIL'} marrow train-tokenizer and tokenizers' BpeTrainer: "
              f"{'identical' if same else 'different'} vocabularies and merges ({len(marrow_model['merges'])} merges)")
        failures += 0 if same else 1
        if os.environ.get("MARROW_QWEN3_TOKENIZER"):
            cases.append(("qwen3", os.environ["MARROW_QWEN3_TOKENIZER"], False))
        for name, path, prefix_space in cases:
            failures += check(name, path, documents, args, work, prefix_space)
    print("PASS" if failures == 0 else f"FAIL: {failures} problems")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
