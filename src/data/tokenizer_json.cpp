// Reading and writing Hugging Face tokenizer.json for byte-level BPE models.
#include <array>
#include <fstream>

#include "core/errors.h"
#include "data/tokenizer.h"
#include "data/unicode.h"

namespace marrow {
namespace {

// GPT-2's ByteLevel alphabet: printable bytes stand for themselves, the other 68 bytes for the
// code points 256, 257, ... in byte order, so that every token is printable text.
struct ByteAlphabet {
  std::array<char32_t, 256> code_of_byte{};
  std::array<int16_t, 324> byte_of_code{};
  ByteAlphabet() {
    byte_of_code.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      code_of_byte[size_t(b)] = printable ? char32_t(b) : next++;
      byte_of_code[code_of_byte[size_t(b)]] = int16_t(b);
    }
  }
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}

// GPT-2's own split, which ByteLevel applies when use_regex is true.
const char* const kGpt2SplitPattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string byte_level_text(std::string_view bytes) {
  std::string text;
  for (char b : bytes) append_utf8(byte_alphabet().code_of_byte[uint8_t(b)], text);
  return text;
}

// The bytes a ByteLevel token (valid UTF-8, as JSON holds it) stands for, or nullopt when it holds
// a character outside the alphabet.
std::optional<std::string> byte_level_bytes(std::string_view text) {
  std::string bytes;
  for (size_t i = 0; i < text.size();) {
    const char32_t code = next_code_point(text, i);
    if (code >= 324 || byte_alphabet().byte_of_code[code] < 0) return std::nullopt;
    bytes += char(byte_alphabet().byte_of_code[code]);
  }
  return bytes;
}

std::string type_of(const Json& node) {
  return node.is_object() && node.contains("type") && node["type"].is_string() ? node["type"].get<std::string>() : "";
}

// The steps of a Sequence node (its `list`), else the node alone; none for null.
std::vector<Json> steps_of(const Json& node, const char* list) {
  if (node.is_null()) return {};
  return type_of(node) == "Sequence" && node.contains(list) ? node[list].get<std::vector<Json>>() : std::vector<Json>{node};
}

bool flag(const Json& node, const char* key, bool fallback) {
  return node.contains(key) && node[key].is_boolean() ? node[key].get<bool>() : fallback;
}

// Regex syntax for a literal string pattern.
std::string quote_regex(const std::string& literal) {
  std::string quoted;
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) quoted += '\\';
    quoted += c;
  }
  return quoted;
}

// Only byte-level BPE: one sentence for each other kind of model.
void check_byte_level_bpe(const Json& json, const std::string& source) {
  MARROW_CHECK(json.is_object() && json.contains("model") && json["model"].is_object(),
               "{} is not a Hugging Face tokenizer.json (it has no \"model\" object)", source);
  const Json& model = json["model"];
  std::string model_type = type_of(model);
  MARROW_CHECK(model_type == "BPE",
               "{}: model type '{}' is not supported; Marrow reads byte-level BPE tokenizers (Qwen2/Qwen3, GPT-2 families)",
               source, model_type.empty() ? "(none)" : model_type);
  auto empty_or_null = [&](const char* key) { return !model.contains(key) || model[key].is_null() || model[key] == ""; };
  MARROW_CHECK(empty_or_null("continuing_subword_prefix") && empty_or_null("end_of_word_suffix"),
               "{}: BPE with a continuing_subword_prefix or end_of_word_suffix is not supported (only byte-level BPE is)", source);
  MARROW_CHECK(!flag(model, "byte_fallback", false),
               "{}: BPE with byte_fallback (SentencePiece style) is not supported; Marrow reads byte-level BPE tokenizers", source);
  MARROW_CHECK(!model.contains("dropout") || model["dropout"].is_null() || model["dropout"] == 0,
               "{}: BPE dropout is not supported when encoding a corpus; set \"dropout\" to null", source);
}

}  // namespace

char32_t byte_level_code(uint8_t b) { return byte_alphabet().code_of_byte[b]; }

Tokenizer Tokenizer::load(const std::string& path) { return from_json(read_json_file(path), path); }

void Tokenizer::read_vocab(const Json& model, const std::string& source) {
  MARROW_CHECK(model.contains("vocab") && model["vocab"].is_object(), "{}: model.vocab must be an object of token: id", source);
  id_by_text_.reserve(model["vocab"].size());
  id_by_bytes_.reserve(model["vocab"].size());
  for (const auto& [text, id_node] : model["vocab"].items()) {
    MARROW_CHECK(id_node.is_number_integer() && id_node.get<int64_t>() >= 0 && id_node.get<int64_t>() < (int64_t(1) << 31),
                 "{}: model.vocab['{}'] must be a non-negative integer id", source, text);
    auto id = size_t(id_node.get<int64_t>());
    if (id >= token_text_.size()) {
      token_text_.resize(id + 1);
      token_bytes_.resize(id + 1);
    }
    MARROW_CHECK(token_text_[id].empty(), "{}: model.vocab gives id {} to both '{}' and '{}'", source, id, token_text_[id], text);
    token_text_[id] = text;
    // A token outside the ByteLevel alphabet cannot come out of BPE; it keeps its text for decoding.
    token_bytes_[id] = byte_level_bytes(text).value_or(text);
    id_by_text_.emplace(text, int32_t(id));
  }
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    auto unknown = id_by_text_.find(model["unk_token"].get<std::string>());
    MARROW_CHECK(unknown != id_by_text_.end(), "{}: model.unk_token is not in the vocabulary", source);
    unknown_id_ = unknown->second;
  }
}

std::vector<std::pair<int32_t, int32_t>> Tokenizer::read_merges(const Json& model, const std::string& source) const {
  std::vector<std::pair<int32_t, int32_t>> merges;
  MARROW_CHECK(model.contains("merges") && model["merges"].is_array(), "{}: model.merges must be an array", source);
  for (const Json& merge : model["merges"]) {
    std::string left, right;
    if (merge.is_string()) {
      auto text = merge.get<std::string>();
      size_t space = text.find(' ');
      MARROW_CHECK(space != std::string::npos && text.find(' ', space + 1) == std::string::npos,
                   "{}: merge \"{}\" must be two tokens separated by one space", source, text);
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else {
      MARROW_CHECK(merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string(),
                   "{}: merge {} must be \"a b\" or [\"a\", \"b\"]", source, merge.dump());
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    }
    auto a = id_by_text_.find(left), b = id_by_text_.find(right);
    MARROW_CHECK(a != id_by_text_.end() && b != id_by_text_.end(), "{}: merge '{} {}' uses a token missing from the vocabulary",
                 source, left, right);
    merges.emplace_back(a->second, b->second);
  }
  return merges;
}

void Tokenizer::read_added_tokens(const Json& json, const std::string& source) {
  if (!json.contains("added_tokens") || json["added_tokens"].is_null()) return;
  MARROW_CHECK(json["added_tokens"].is_array(), "{}: added_tokens must be an array", source);
  for (const Json& node : json["added_tokens"]) {
    MARROW_CHECK(node.is_object() && node.contains("id") && node["id"].is_number_integer() && node["id"].get<int64_t>() >= 0 &&
                     node.contains("content") && node["content"].is_string(),
                 "{}: each added token needs an integer id and a string content, got {}", source, node.dump());
    AddedToken token;
    token.id = int32_t(node["id"].get<int64_t>());
    token.content = node["content"].get<std::string>();
    token.special = flag(node, "special", false);
    token.normalized = flag(node, "normalized", !token.special);
    token.lstrip = flag(node, "lstrip", false);
    token.rstrip = flag(node, "rstrip", false);
    MARROW_CHECK(!flag(node, "single_word", false), "{}: added token '{}' has single_word set, which Marrow does not support",
                 source, token.content);
    MARROW_CHECK(!token.content.empty(), "{}: added token {} is empty", source, token.id);
    // `tokenizers` matches a normalized added token in normalised text, so in its normalised form.
    if (token.normalized && json.contains("normalizer") && !json["normalizer"].is_null()) token.content = to_nfc(token.content);
    added_.push_back(std::move(token));
  }
}

void Tokenizer::read_normalizer(const Json& json, const std::string& source) {
  const std::vector<Json> steps = steps_of(json.value("normalizer", Json()), "normalizers");
  for (const Json& step : steps)
    MARROW_CHECK(type_of(step) == "NFC", "{}: normalizer '{}' is not supported (Marrow applies NFC or nothing)", source,
                 type_of(step).empty() ? step.dump() : type_of(step));
  nfc_ = !steps.empty();
}

// Split steps, then ByteLevel (with use_regex, GPT-2's split rule after them); the ByteLevel decoder.
void Tokenizer::read_pre_tokenizer(const Json& json, const std::string& source) {
  bool byte_level = false;
  for (const Json& step : steps_of(json.value("pre_tokenizer", Json()), "pretokenizers")) {
    std::string type = type_of(step);
    MARROW_CHECK(!byte_level, "{}: pre-tokenizer '{}' after ByteLevel is not supported", source, type);
    if (type == "ByteLevel") {
      byte_level = true;
      byte_level_rule_ = splits_.size();
      prefix_space_ = flag(step, "add_prefix_space", false);
      if (flag(step, "use_regex", true)) splits_.push_back({kGpt2SplitPattern, false});
      continue;
    }
    MARROW_CHECK(type == "Split", "{}: pre-tokenizer '{}' is not supported (Marrow reads Split and ByteLevel)", source,
                 type.empty() ? step.dump() : type);
    const Json& pattern = step.contains("pattern") ? step["pattern"] : Json();
    std::string regex;
    if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
      regex = pattern["Regex"].get<std::string>();
    } else {
      MARROW_CHECK(pattern.contains("String") && pattern["String"].is_string(), "{}: Split needs a pattern {{\"Regex\": ...}} or {{\"String\": ...}}", source);
      regex = quote_regex(pattern["String"].get<std::string>());
    }
    std::string behavior = step.value("behavior", std::string("Isolated"));
    MARROW_CHECK(behavior == "Isolated" || behavior == "Removed",
                 "{}: Split behavior '{}' is not supported (Marrow reads Isolated and Removed)", source, behavior);
    bool invert = flag(step, "invert", false);
    MARROW_CHECK(!(invert && behavior == "Removed"), "{}: an inverted Split with behavior Removed is not supported", source);
    splits_.push_back({regex, behavior == "Removed"});
  }
  MARROW_CHECK(byte_level, "{}: the pre-tokenizer has no ByteLevel step, so this is not a byte-level BPE tokenizer", source);
  const Json decoder = json.value("decoder", Json());
  MARROW_CHECK(decoder.is_null() || type_of(decoder) == "ByteLevel",
               "{}: decoder '{}' is not supported; a byte-level BPE tokenizer decodes with ByteLevel", source, type_of(decoder));
}

Tokenizer Tokenizer::from_json(const Json& json, const std::string& source) {
  check_byte_level_bpe(json, source);
  const Json& model = json["model"];
  Tokenizer t;
  t.ignore_merges_ = flag(model, "ignore_merges", false);
  t.fuse_unknown_ = flag(model, "fuse_unk", false);
  t.read_vocab(model, source);
  const std::vector<std::pair<int32_t, int32_t>> merges = t.read_merges(model, source);
  t.read_added_tokens(json, source);
  t.read_normalizer(json, source);
  t.read_pre_tokenizer(json, source);
  t.build_tables(merges, source);
  return t;
}

Tokenizer::Tokenizer(std::vector<std::string> tokens, const std::vector<std::pair<int32_t, int32_t>>& merges,
                     std::vector<AddedToken> added, std::vector<SplitRule> splits, bool nfc)
    : token_bytes_(std::move(tokens)), added_(std::move(added)), splits_(std::move(splits)), nfc_(nfc) {
  byte_level_rule_ = splits_.size();
  std::vector<bool> is_added(token_bytes_.size());
  for (const AddedToken& token : added_)
    if (size_t(token.id) < token_bytes_.size()) is_added[size_t(token.id)] = true;
  token_text_.resize(token_bytes_.size());
  for (size_t id = 0; id < token_bytes_.size(); ++id) {
    token_text_[id] = is_added[id] ? token_bytes_[id] : byte_level_text(token_bytes_[id]);
    id_by_text_.emplace(token_text_[id], int32_t(id));
  }
  build_tables(merges, "the trained tokenizer");
}

nlohmann::ordered_json Tokenizer::to_json() const {
  using Ordered = nlohmann::ordered_json;
  Ordered added = Ordered::array();
  for (const AddedToken& token : added_)
    added.push_back({{"id", token.id}, {"content", token.content}, {"single_word", false}, {"lstrip", token.lstrip},
                     {"rstrip", token.rstrip}, {"normalized", token.normalized}, {"special", token.special}});
  Ordered steps = Ordered::array();
  for (size_t i = 0; i < byte_level_rule_; ++i)
    steps.push_back({{"type", "Split"}, {"pattern", {{"Regex", splits_[i].pattern}}},
                     {"behavior", splits_[i].remove_matches ? "Removed" : "Isolated"}, {"invert", false}});
  Ordered byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", prefix_space_}, {"trim_offsets", false},
                        {"use_regex", splits_.size() > byte_level_rule_}};
  steps.push_back(byte_level);
  Ordered vocab = Ordered::object();
  for (size_t id = 0; id < token_text_.size(); ++id)
    if (!token_text_[id].empty()) vocab[token_text_[id]] = id;
  Ordered merges = Ordered::array();
  for (auto [left, right] : merges_) merges.push_back({token_text_[size_t(left)], token_text_[size_t(right)]});
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nfc_ ? Ordered{{"type", "NFC"}} : Ordered()},
          {"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", steps}}},
          {"post_processor", byte_level},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", ignore_merges_},
            {"vocab", vocab},
            {"merges", merges}}}};
}

void Tokenizer::save(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  MARROW_CHECK(out, "cannot write {}: {}", path, std::strerror(errno));
  out << to_json().dump(2) << '\n';
  out.close();
  MARROW_CHECK(out, "cannot write {}: {}", path, std::strerror(errno));
}

}  // namespace marrow
