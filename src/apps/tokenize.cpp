// marrow tokenize: raw text (txt, jsonl, jsonl.zst[d]) to a tokenized corpus directory.
#include <thread>

#include "apps/commands.h"
#include "core/errors.h"
#include "data/tokenize_corpus.h"

namespace marrow {

int tokenize_command(int argc, char** argv) {
  CLI::App app{"Tokenize raw text into a training corpus (manifest.json + uint32 shards, EOS after each document).",
               "marrow tokenize"};
  TokenizeOptions options;
  options.threads = int(std::max(1u, std::thread::hardware_concurrency()));
  bool quiet = false;
  app.add_option("--input", options.inputs, "text files, directories or globs (.txt, .jsonl, .jsonl.zst, .jsonl.zstd)")
      ->required();
  app.add_option("--tokenizer", options.tokenizer_path, "Hugging Face tokenizer.json (byte-level BPE)")->required();
  app.add_option("--out", options.out_dir, "output corpus directory")->required();
  app.add_option("--field", options.field, "JSONL field holding the text")->capture_default_str();
  app.add_option("--loss-mask", options.loss_mask, "JSONL field whose text precedes the document's and is not trained on (a prompt)");
  app.add_option("--threads", options.threads, "encoding threads")->capture_default_str();
  app.add_option("--eos-token", options.eos_token, "token put after each document")->capture_default_str();
  app.add_option("--shard-tokens", options.shard_tokens, "tokens per shard file")->capture_default_str();
  app.add_flag("--strict", options.strict, "stop at the first bad line instead of skipping it");
  app.add_flag("--overwrite", options.overwrite, "replace an existing corpus at --out");
  app.add_flag("--quiet", quiet, "no progress line");
  if (const int code = parse_command_line(app, argc, argv); code >= 0) return code;
  options.progress = !quiet;
  TokenizeReport report = tokenize_corpus(options);
  const CorpusManifest& m = report.manifest;
  std::string skipped = m.bad_lines ? fmt::format(", {} bad lines skipped", m.bad_lines) : "";
  std::printf("tokenize: %lld documents, %lld tokens in %zu shard%s -> %s (%.1f MB of input in %.1f s, %.1f MB/s%s)\n",
              static_cast<long long>(m.documents), static_cast<long long>(m.tokens), m.shards.size(),
              m.shards.size() == 1 ? "" : "s", options.out_dir.c_str(), report.text_bytes / 1e6, report.seconds,
              report.text_bytes / 1e6 / std::max(report.seconds, 1e-9),
              skipped.c_str());
  return 0;
}

}  // namespace marrow
