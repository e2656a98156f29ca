// marrow train-tokenizer: a byte-level BPE tokenizer.json (Qwen pre-tokenizer, NFC) trained on raw text.
#include <chrono>
#include <filesystem>
#include <thread>

#include "apps/commands.h"
#include "core/errors.h"
#include "data/bpe_trainer.h"

namespace marrow {

int train_tokenizer_command(int argc, char** argv) {
  CLI::App app{"Train a byte-level BPE tokenizer (Hugging Face tokenizer.json) on raw text.", "marrow train-tokenizer"};
  BpeTrainOptions options;
  options.threads = int(std::max(1u, std::thread::hardware_concurrency()));
  std::string out;
  bool overwrite = false, quiet = false;
  app.add_option("--input", options.inputs, "text files, directories or globs (.txt, .jsonl, .jsonl.zst, .jsonl.zstd)")
      ->required();
  app.add_option("--vocab-size", options.vocab_size, "tokens in the vocabulary, special tokens and the 256 bytes included")
      ->required();
  app.add_option("--out", out, "tokenizer.json to write")->required();
  app.add_option("--special-tokens", options.special_tokens, "special tokens, given ids 0, 1, ...")->capture_default_str();
  app.add_option("--min-frequency", options.min_frequency, "pairs seen fewer times are not merged")->capture_default_str();
  app.add_option("--field", options.field, "JSONL field holding the text")->capture_default_str();
  app.add_option("--threads", options.threads, "counting threads")->capture_default_str();
  app.add_flag("--strict", options.strict, "stop at the first bad line instead of skipping it");
  app.add_flag("--overwrite", overwrite, "replace an existing --out file");
  app.add_flag("--quiet", quiet, "no progress line");
  if (const int code = parse_command_line(app, argc, argv); code >= 0) return code;
  options.progress = !quiet;
  MARROW_CHECK(options.min_frequency >= 1, "--min-frequency must be at least 1, got {}", options.min_frequency);
  MARROW_CHECK(overwrite || !std::filesystem::exists(out), "output {} already exists; pass --overwrite to replace it", out);
  MARROW_CHECK(!std::filesystem::is_directory(out), "output {} is a directory; --out names the tokenizer.json file to write", out);
  auto start = std::chrono::steady_clock::now();
  PieceCounts counts = count_pieces(options);
  Tokenizer tokenizer = train_bpe(counts, options);
  std::string partial = out + ".incomplete";
  tokenizer.save(partial);
  std::error_code error;
  std::filesystem::rename(partial, out, error);
  MARROW_CHECK(!error, "cannot rename {} to {}: {}", partial, out, error.message());
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("train-tokenizer: %zu distinct pieces; vocabulary of %lld tokens -> %s (%.1f s)\n", counts.size(),
              static_cast<long long>(tokenizer.vocab_size()), out.c_str(), seconds);
  if (tokenizer.vocab_size() < options.vocab_size)
    std::printf("train-tokenizer: stopped short of %lld: no other pair occurs at least %lld times\n",
                static_cast<long long>(options.vocab_size), static_cast<long long>(options.min_frequency));
  return 0;
}

}  // namespace marrow
