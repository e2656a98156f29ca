// marrow tokenize: the corpus it writes, its determinism, and its messages for bad inputs.
#include <zstd.h>

#include <cstring>
#include <functional>

#include "core/json.h"
#include "data/bpe_trainer.h"
#include "data/tokenize_corpus.h"
#include "data_test_util.h"

namespace marrow {
namespace {

using data_testing::CommandResult;
using data_testing::read_file;
using data_testing::run_marrow;
using data_testing::ScratchDir;
using data_testing::write_file;

const char* const kSampleText =
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity. Caf\xC3\xA9 na\xC3\xAFve "
    "\xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80 1234 5678.\n";

std::string save_tokenizer(const ScratchDir& dir) {
  PieceCounts counts;
  Tokenizer splitter = untrained_tokenizer({"<|endoftext|>"});
  EncodeState state;
  splitter.pre_tokenize(kSampleText, state, [&](std::string_view piece) { counts[std::string(piece)] += 3; });
  BpeTrainOptions options;
  options.vocab_size = 320;
  std::string path = dir / "tokenizer.json";
  train_bpe(counts, options).save(path);
  return path;
}

std::string jsonl_line(const std::string& text) { return Json{{"text", text}, {"id", 7}}.dump() + "\n"; }

std::vector<uint32_t> corpus_tokens(const std::string& dir) {
  CorpusManifest manifest = read_manifest(dir);
  std::vector<uint32_t> tokens;
  for (const ShardInfo& shard : manifest.shards) {
    std::string bytes = read_file(dir + "/" + shard.file);
    EXPECT_EQ(sha256_hex(bytes), shard.sha256);
    size_t at = tokens.size();
    tokens.resize(at + bytes.size() / 4);
    std::memcpy(tokens.data() + at, bytes.data(), bytes.size());
  }
  return tokens;
}

std::string zstd_compress(const std::string& bytes) {
  std::string out(ZSTD_compressBound(bytes.size()), '\0');
  size_t size = ZSTD_compress(out.data(), out.size(), bytes.data(), bytes.size(), 3);
  EXPECT_FALSE(ZSTD_isError(size));
  out.resize(size);
  return out;
}

TEST(Tokenize, WritesManifestShardsAndEosAfterEachDocument) {
  ScratchDir dir;
  TokenizeOptions options;
  options.tokenizer_path = save_tokenizer(dir);
  std::string docs;
  for (int i = 0; i < 50; ++i) docs += jsonl_line(std::to_string(i) + " " + kSampleText);
  write_file(dir / "a.jsonl", docs);
  write_file(dir / "b.txt", std::string(kSampleText) + kSampleText);
  options.inputs = {dir / "a.jsonl", dir / "b.txt"};
  options.out_dir = dir / "corpus";
  options.shard_tokens = 1000;
  TokenizeReport report = tokenize_corpus(options);
  CorpusManifest manifest = read_manifest(options.out_dir);
  EXPECT_EQ(manifest.documents, 51);
  EXPECT_GT(manifest.shards.size(), 1u);
  EXPECT_EQ(manifest.tokenizer_sha256, sha256_hex(read_file(options.tokenizer_path)));
  EXPECT_EQ(manifest.eos_id, 0);
  EXPECT_EQ(manifest.vocab_size, 320);
  std::vector<uint32_t> tokens = corpus_tokens(options.out_dir);
  ASSERT_EQ(int64_t(tokens.size()), manifest.tokens);
  EXPECT_EQ(std::count(tokens.begin(), tokens.end(), 0u), 51);
  EXPECT_EQ(tokens.back(), 0u);
  int64_t documents = 0;
  for (const ShardInfo& shard : manifest.shards) documents += shard.documents;
  EXPECT_EQ(documents, 51);

  Tokenizer tokenizer = Tokenizer::load(options.tokenizer_path);
  std::vector<int32_t> expected = tokenizer.encode(std::string("0 ") + kSampleText);
  expected.push_back(0);
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(), tokens.begin()));
  EXPECT_EQ(report.manifest.tokens, manifest.tokens);
}

TEST(Tokenize, SameOutputForAnyThreadCountAndChunkSize) {
  ScratchDir dir;
  std::string tokenizer = save_tokenizer(dir);
  std::string docs, text;
  for (int i = 0; i < 300; ++i) docs += jsonl_line(std::string(size_t(i % 13), ' ') + kSampleText + std::to_string(i));
  for (int i = 0; i < 200; ++i) text += std::to_string(i) + " Line of text\n" + kSampleText + "\n  indented\n\n";
  write_file(dir / "docs.jsonl.zst", zstd_compress(docs));
  write_file(dir / "book.txt", text);
  std::vector<std::vector<uint32_t>> results;
  for (auto [threads, chunk] : {std::pair{1, size_t(4) << 20}, std::pair{3, size_t(300)}, std::pair{2, size_t(4096)}}) {
    TokenizeOptions options;
    options.tokenizer_path = tokenizer;
    options.inputs = {dir.path()};
    options.out_dir = dir / ("corpus-" + std::to_string(threads));
    options.threads = threads;
    options.chunk_bytes = chunk;
    tokenize_corpus(options);
    results.push_back(corpus_tokens(options.out_dir));
  }
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
  // The text file is one document: cutting it into chunks must not change its tokens.
  Tokenizer loaded = Tokenizer::load(tokenizer);
  std::vector<int32_t> whole = loaded.encode(text);
  EXPECT_TRUE(std::equal(whole.begin(), whole.end(), results[1].begin()));
}

TEST(Tokenize, SkipsAndReportsBadLinesWithFileAndLine) {
  ScratchDir dir;
  std::string tokenizer = save_tokenizer(dir);
  write_file(dir / "mixed.jsonl", jsonl_line("good one") + "{\"text\": \"bad \xFF utf8\"}\n" + "{\"text\": broken\n" +
                                      "{\"title\": \"no text\"}\n" + "{\"text\": 42}\n" + jsonl_line("good two"));
  CommandResult lenient = run_marrow("tokenize --quiet --input " + dir / "mixed.jsonl" + " --tokenizer " + tokenizer +
                                     " --out " + dir / "out");
  EXPECT_EQ(lenient.exit_code, 0) << lenient.output;
  for (const char* expected : {"mixed.jsonl:2: invalid UTF-8", "mixed.jsonl:3: invalid JSON", "mixed.jsonl:4: missing field 'text'",
                               "mixed.jsonl:5: field 'text' is not a string", "2 documents"})
    EXPECT_NE(lenient.output.find(expected), std::string::npos) << expected << "\n" << lenient.output;
  EXPECT_EQ(read_manifest(dir / "out").bad_lines, 4);

  CommandResult strict = run_marrow("tokenize --quiet --strict --input " + dir / "mixed.jsonl" + " --tokenizer " + tokenizer +
                                    " --out " + dir / "strict");
  EXPECT_EQ(strict.exit_code, 1);
  EXPECT_NE(strict.output.find("marrow tokenize: error: " + dir / "mixed.jsonl" + ":2: invalid UTF-8"), std::string::npos)
      << strict.output;
  EXPECT_FALSE(std::filesystem::exists(dir / "strict"));
  EXPECT_FALSE(std::filesystem::exists(dir / "strict.incomplete"));
}

TEST(Tokenize, InvalidUtf8InTextFilesDropsTheLine) {
  ScratchDir dir;
  std::string tokenizer = save_tokenizer(dir);
  write_file(dir / "t.txt", "first line\nsecond \xC3 broken\nthird line\n");
  CommandResult result = run_marrow("tokenize --quiet --input " + dir / "t.txt" + " --tokenizer " + tokenizer + " --out " + dir / "out");
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("t.txt:2: invalid UTF-8"), std::string::npos) << result.output;
  Tokenizer loaded = Tokenizer::load(tokenizer);
  std::vector<int32_t> expected = loaded.encode("first line\nthird line\n");
  expected.push_back(0);
  std::vector<uint32_t> tokens = corpus_tokens(dir / "out");
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(), tokens.begin(), tokens.end()));
}

struct BadInputCase {
  const char* name;
  std::function<std::string(const ScratchDir&, const std::string& tokenizer)> arguments;
  const char* expected_message;
};

TEST(Tokenize, BadInputsFailWithOneClearSentence) {
  std::string docs;
  for (int i = 0; i < 2000; ++i) docs += jsonl_line(kSampleText + std::to_string(i));
  std::vector<BadInputCase> cases = {
      {"truncated zstd",
       [&](const ScratchDir& dir, const std::string& tokenizer) {
         std::string compressed = zstd_compress(docs);
         write_file(dir / "cut.jsonl.zst", compressed.substr(0, compressed.size() / 2));
         return "--input " + dir / "cut.jsonl.zst" + " --tokenizer " + tokenizer + " --out " + dir / "out";
       },
       "cut.jsonl.zst: the zstd stream is truncated"},
      {"corrupt zstd",
       [&](const ScratchDir& dir, const std::string& tokenizer) {
         write_file(dir / "junk.jsonl.zstd", "this is not zstd at all");
         return "--input " + dir / "junk.jsonl.zstd" + " --tokenizer " + tokenizer + " --out " + dir / "out";
       },
       "junk.jsonl.zstd: corrupt zstd data"},
      {"empty input",
       [&](const ScratchDir& dir, const std::string& tokenizer) {
         write_file(dir / "empty.jsonl", "");
         return "--input " + dir / "empty.jsonl" + " --tokenizer " + tokenizer + " --out " + dir / "out";
       },
       "hold no documents"},
      {"WordPiece tokenizer",
       [&](const ScratchDir& dir, const std::string&) {
         write_file(dir / "d.jsonl", jsonl_line("hello"));
         write_file(dir / "wordpiece.json", R"({"model": {"type": "WordPiece", "vocab": {"[UNK]": 0}}})");
         return "--input " + dir / "d.jsonl" + " --tokenizer " + dir / "wordpiece.json" + " --out " + dir / "out";
       },
       "model type 'WordPiece' is not supported"},
      {"output present",
       [&](const ScratchDir& dir, const std::string& tokenizer) {
         write_file(dir / "d.jsonl", jsonl_line("hello"));
         std::filesystem::create_directory(dir / "out");
         return "--input " + dir / "d.jsonl" + " --tokenizer " + tokenizer + " --out " + dir / "out";
       },
       "already exists; pass --overwrite to replace it"},
      {"unknown file kind",
       [&](const ScratchDir& dir, const std::string& tokenizer) {
         write_file(dir / "data.parquet", "PAR1");
         return "--input " + dir / "data.parquet" + " --tokenizer " + tokenizer + " --out " + dir / "out";
       },
       "is not a .txt, .jsonl, .jsonl.zst or .jsonl.zstd file"},
      {"missing input",
       [&](const ScratchDir& dir, const std::string& tokenizer) {
         return "--input " + dir / "nothing-*.jsonl" + " --tokenizer " + tokenizer + " --out " + dir / "out";
       },
       "does not exist and matches no files"},
  };
  for (const BadInputCase& c : cases) {
    ScratchDir dir;
    std::string tokenizer = save_tokenizer(dir);
    CommandResult result = run_marrow("tokenize --quiet " + c.arguments(dir, tokenizer));
    EXPECT_EQ(result.exit_code, 1) << c.name << ": " << result.output;
    EXPECT_NE(result.output.find("marrow tokenize: error: "), std::string::npos) << c.name << ": " << result.output;
    EXPECT_NE(result.output.find(c.expected_message), std::string::npos) << c.name << ": " << result.output;
  }
}

TEST(Tokenize, OverwriteReplacesOnlyACorpus) {
  ScratchDir dir;
  std::string tokenizer = save_tokenizer(dir);
  write_file(dir / "d.jsonl", jsonl_line("hello there"));
  std::string arguments = "tokenize --quiet --input " + dir / "d.jsonl" + " --tokenizer " + tokenizer + " --out " + dir / "out";
  EXPECT_EQ(run_marrow(arguments).exit_code, 0);
  EXPECT_EQ(run_marrow(arguments + " --overwrite").exit_code, 0);
  write_file(dir / "out/notes.md", "mine");
  CommandResult refused = run_marrow(arguments + " --overwrite");
  EXPECT_EQ(refused.exit_code, 1);
  EXPECT_NE(refused.output.find("holds notes.md, which 'marrow tokenize' did not write"), std::string::npos) << refused.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "out/notes.md"));
}

TEST(TrainTokenizer, CommandWritesALoadableDeterministicFile) {
  ScratchDir dir;
  std::string docs;
  for (int i = 0; i < 200; ++i) docs += jsonl_line(kSampleText + std::to_string(i * 7919));
  write_file(dir / "d.jsonl", docs);
  for (int threads : {1, 2}) {
    CommandResult result = run_marrow("train-tokenizer --quiet --input " + dir / "d.jsonl" + " --vocab-size 330 --threads " +
                                      std::to_string(threads) + " --out " + dir / ("t" + std::to_string(threads) + ".json"));
    EXPECT_EQ(result.exit_code, 0) << result.output;
  }
  EXPECT_EQ(read_file(dir / "t1.json"), read_file(dir / "t2.json"));
  Tokenizer tokenizer = Tokenizer::load(dir / "t1.json");
  EXPECT_EQ(tokenizer.vocab_size(), 330);
  CommandResult again = run_marrow("train-tokenizer --quiet --input " + dir / "d.jsonl" + " --vocab-size 400 --out " + dir / "t1.json");
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.output.find("already exists; pass --overwrite"), std::string::npos) << again.output;
  CommandResult too_small = run_marrow("train-tokenizer --quiet --input " + dir / "d.jsonl" + " --vocab-size 100 --out " + dir / "x.json");
  EXPECT_NE(too_small.output.find("--vocab-size 100 is too small"), std::string::npos) << too_small.output;
}

}  // namespace
}  // namespace marrow
