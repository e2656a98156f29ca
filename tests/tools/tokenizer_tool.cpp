// Test helper for tests/python: encodes or round-trips the "text" field of each line of a JSONL
// file with a tokenizer.json, so Python can compare against Hugging Face `tokenizers`.
//   tokenizer_tool encode <tokenizer.json> <docs.jsonl>     one line of ids per document
//   tokenizer_tool roundtrip <tokenizer.json> <docs.jsonl>  checks decode(encode(x)) == x, or the
//                                                          line's "expected" field where it has one
//   tokenizer_tool bench <tokenizer.json> <docs.jsonl>      encodes on one thread, prints MB/s
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "core/json.h"
#include "data/tokenizer.h"

namespace {

std::vector<std::string> read_documents(const std::string& path, const char* field = "text") {
  std::ifstream in(path);
  MARROW_CHECK(in, "cannot open {}", path);
  std::vector<std::string> documents;
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    marrow::Json json = marrow::Json::parse(line);
    documents.push_back(json.value(field, json.at("text").get<std::string>()));
  }
  return documents;
}

int run(int argc, char** argv) {
  MARROW_CHECK(argc == 4, "usage: tokenizer_tool encode|roundtrip|bench <tokenizer.json> <docs.jsonl>");
  std::string mode = argv[1];
  marrow::Tokenizer tokenizer = marrow::Tokenizer::load(argv[2]);
  std::vector<std::string> documents = read_documents(argv[3]);
  marrow::EncodeState state;
  std::vector<int32_t> ids;
  if (mode == "encode") {
    for (const std::string& document : documents) {
      ids.clear();
      tokenizer.encode(document, ids, state);
      std::string line;
      for (size_t i = 0; i < ids.size(); ++i) line += (i ? " " : "") + std::to_string(ids[i]);
      std::puts(line.c_str());
    }
  } else if (mode == "roundtrip") {
    std::vector<std::string> expected = read_documents(argv[3], "expected");
    for (size_t d = 0; d < documents.size(); ++d) {
      ids.clear();
      tokenizer.encode(documents[d], ids, state);
      MARROW_CHECK(tokenizer.decode(ids) == expected[d], "document {} does not survive decode(encode(x))", d);
    }
    std::printf("roundtrip: %zu documents decode to themselves\n", documents.size());
  } else if (mode == "bench") {
    size_t bytes = 0, tokens = 0;
    auto start = std::chrono::steady_clock::now();
    for (const std::string& document : documents) {
      ids.clear();
      tokenizer.encode(document, ids, state);
      bytes += document.size();
      tokens += ids.size();
    }
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("%zu bytes, %zu tokens in %.3f s: %.2f MB/s\n", bytes, tokens, seconds, bytes / seconds / 1e6);
  } else {
    marrow::fail("unknown mode '{}'", mode);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenizer_tool: error: %s\n", e.what());
    return 1;
  }
}
