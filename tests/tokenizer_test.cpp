#include "data/tokenizer.h"

#include <gtest/gtest.h>
#include <utf8proc.h>

#include <cstdlib>

#include "core/sha256.h"
#include "data/bpe_trainer.h"
#include "data/unicode.h"
#include "data_test_util.h"

namespace marrow {
namespace {

using data_testing::ScratchDir;
using data_testing::write_file;

TEST(Sha256, MatchesFipsVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // A million 'a's fed in pieces of awkward sizes, so blocks straddle update calls.
  Sha256 million;
  std::string block(1000, 'a');
  size_t sizes[] = {1, 63, 64, 65, 999};
  for (size_t fed = 0, i = 0; fed < 1000000; ++i) {
    size_t take = std::min(sizes[i % 5], size_t(1000000) - fed);
    million.update(block.data(), take);
    fed += take;
  }
  EXPECT_EQ(million.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Utf8, FindsTheFirstInvalidByte) {
  EXPECT_EQ(find_invalid_utf8("plain ascii text, long enough for the 8-byte path"), std::string_view::npos);
  EXPECT_EQ(find_invalid_utf8("caf\xC3\xA9 \xE4\xB8\xAD \xF0\x9F\x98\x80"), std::string_view::npos);
  EXPECT_EQ(find_invalid_utf8("ab\xC3"), 2u);                // truncated sequence
  EXPECT_EQ(find_invalid_utf8("ab\xC0\xAF"), 2u);            // overlong
  EXPECT_EQ(find_invalid_utf8("\xED\xA0\x80"), 0u);          // surrogate
  EXPECT_EQ(find_invalid_utf8("x\xF4\x90\x80\x80"), 1u);     // above U+10FFFF
  EXPECT_EQ(find_invalid_utf8("12345678\xFF"), 8u);
}

TEST(Nfc, ComposesReordersAndMapsSingletons) {
  EXPECT_EQ(to_nfc("cafe\xCC\x81"), "caf\xC3\xA9");                              // e + acute -> é
  EXPECT_EQ(to_nfc("\xE2\x84\xAB"), "\xC3\x85");                                  // ANGSTROM SIGN -> Å
  EXPECT_EQ(to_nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");     // jamo -> 각
  EXPECT_EQ(to_nfc("\xEA\xB0\x80\xE1\x86\xA8"), "\xEA\xB0\x81");                 // 가 + jamo -> 각
  EXPECT_EQ(to_nfc("q\xCC\x81\xCC\xA3"), "q\xCC\xA3\xCC\x81");                    // dot below (220) before acute (230)
  EXPECT_EQ(to_nfc("e\xCC\x81\xCC\xA3"), "\xE1\xBA\xB9\xCC\x81");                  // ẹ then the acute
  EXPECT_EQ(to_nfc("\xEF\xA4\x80"), "\xE8\xB1\x88");                              // CJK compatibility ideograph
  std::string stable = "plain text, caf\xC3\xA9, \xE4\xB8\xAD\xE6\x96\x87, \xF0\x9F\x98\x80";
  EXPECT_EQ(to_nfc(stable), stable);
}

// The skip over text NFC leaves alone must not skip what the full algorithm changes: every code
// point of the BMP and the first supplementary planes, alone and between neighbours it could
// combine with, against utf8proc's NFC of the whole string (U+11A7, which utf8proc 2.8 gets wrong,
// separately).
TEST(Nfc, SkipAgreesWithTheFullAlgorithmOnEveryCodePoint) {
  const char32_t neighbours[] = {U'a', U'e', 0x1100, 0xAC00, 0x0B47, 0x0301, 0x0323, 0x1161, 0x11A8};
  int64_t compared = 0;
  for (char32_t c = 0x80; c < 0x30000; ++c) {
    if ((c >= 0xD800 && c < 0xE000) || c == 0x11A7) continue;
    for (char32_t before : neighbours) {
      for (char32_t after : {char32_t(U'x'), char32_t(0x0301), char32_t(0x1161), char32_t(0x11A8), char32_t(0x0B3E)}) {
        std::string text;
        for (char32_t part : {before, c, after}) append_utf8(part, text);
        auto* full = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(text.c_str()));
        ASSERT_EQ(to_nfc(text), reinterpret_cast<const char*>(full)) << "code point U+" << std::hex << uint32_t(c);
        std::free(full);
        ++compared;
      }
    }
  }
  EXPECT_GT(compared, 8000000);
  EXPECT_EQ(to_nfc("\xEA\xB0\x80\xE1\x86\xA7"), "\xEA\xB0\x80\xE1\x86\xA7");                  // 가 + U+11A7 stays
  EXPECT_EQ(to_nfc("\xEA\xB0\x80\xCC\x81\xE1\x86\xA7" "e\xCC\x81"), "\xEA\xB0\x80\xCC\x81\xE1\x86\xA7\xC3\xA9");
}

Tokenizer small_trained_tokenizer() {
  PieceCounts counts;
  Tokenizer splitter = untrained_tokenizer({"<|endoftext|>"});
  EncodeState state;
  std::string text = "the cat sat on the mat. the dog sat on the log. The theory of the thing is that the theme "
                     "is then there. 12345 caf\xC3\xA9 na\xC3\xAFve \xE4\xB8\xAD\xE6\x96\x87\xE4\xB8\xAD\xE6\x96\x87";
  for (int i = 0; i < 3; ++i) splitter.pre_tokenize(text, state, [&](std::string_view piece) { ++counts[std::string(piece)]; });
  BpeTrainOptions options;
  options.vocab_size = 300;
  return train_bpe(counts, options);
}

TEST(Tokenizer, TrainedTokenizerRoundTripsAndMatchesSpecialTokens) {
  Tokenizer tokenizer = small_trained_tokenizer();
  EXPECT_EQ(tokenizer.vocab_size(), 300);
  EXPECT_EQ(tokenizer.token_id("<|endoftext|>"), 0);
  std::string text = "the theme of the cat<|endoftext|>A new document: \xF0\x9F\x98\x80 e\xCC\x81 \t\n\n  x";
  std::vector<int32_t> ids = tokenizer.encode(text);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 0), ids.end());
  // NFC composes e + acute, so the round trip gives the normalised text.
  EXPECT_EQ(tokenizer.decode(ids), to_nfc(text));
  EXPECT_LT(tokenizer.encode("the theme").size(), std::string("the theme").size());
}

TEST(Tokenizer, TrainingIsDeterministicAndSurvivesSaveAndLoad) {
  Tokenizer first = small_trained_tokenizer(), second = small_trained_tokenizer();
  EXPECT_EQ(first.to_json().dump(), second.to_json().dump());
  ScratchDir dir;
  first.save(dir / "tokenizer.json");
  Tokenizer loaded = Tokenizer::load(dir / "tokenizer.json");
  std::string text = "Then the thing: 12345 na\xC3\xAFve \xE4\xB8\xAD\xE6\x96\x87 <|endoftext|>";
  EXPECT_EQ(loaded.encode(text), first.encode(text));
  EXPECT_EQ(loaded.to_json().dump(), first.to_json().dump());
}

TEST(Tokenizer, LongWordsRoundTrip) {
  Tokenizer tokenizer = small_trained_tokenizer();
  // Pieces longer than the short-word limit merge through the heap (their ids are compared with
  // `tokenizers` in tests/python/test_tokenizer_parity.py).
  std::string word;
  for (int i = 0; i < 50; ++i) word += "the";
  std::vector<int32_t> ids = tokenizer.encode(word);
  EXPECT_EQ(tokenizer.decode(ids), word);
  std::string cjk;
  for (int i = 0; i < 100; ++i) cjk += "\xE4\xB8\xAD\xE6\x96\x87";
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(cjk)), cjk);
  EXPECT_EQ(tokenizer.encode(cjk), tokenizer.encode(cjk));
}

TEST(Tokenizer, RejectsInvalidUtf8) {
  Tokenizer tokenizer = small_trained_tokenizer();
  try {
    tokenizer.encode("ok \xFF bad");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos) << e.what();
  }
}

std::string load_error(const std::string& json) {
  ScratchDir dir;
  write_file(dir / "tokenizer.json", json);
  try {
    Tokenizer::load(dir / "tokenizer.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Tokenizer, RefusesWhatItCannotEncodeExactly) {
  EXPECT_NE(load_error(R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})").find("model type 'WordPiece' is not supported"),
            std::string::npos);
  EXPECT_NE(load_error(R"({"version": "1.0"})").find("is not a Hugging Face tokenizer.json"), std::string::npos);
  EXPECT_NE(load_error("{not json").find("tokenizer.json"), std::string::npos);
  std::string lowercase = R"({"normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "ByteLevel"},
      "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})";
  EXPECT_NE(load_error(lowercase).find("normalizer 'Lowercase' is not supported"), std::string::npos);
  std::string no_byte_level = R"({"pre_tokenizer": {"type": "Whitespace"}, "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})";
  EXPECT_NE(load_error(no_byte_level).find("pre-tokenizer 'Whitespace' is not supported"), std::string::npos);
  std::string bad_merge = R"({"pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}})";
  EXPECT_NE(load_error(bad_merge).find("makes 'ab', which is not in the vocabulary"), std::string::npos);
}

TEST(Tokenizer, ReadsMergesAsStringsOrPairs) {
  std::string base = R"({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
      "decoder": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120ab": 4},
      "merges": MERGES}})";
  auto with = [&](const std::string& merges) {
    std::string json = base;
    json.replace(json.find("MERGES"), 6, merges);
    ScratchDir dir;
    write_file(dir / "t.json", json);
    return Tokenizer::load(dir / "t.json").encode("ab ab");
  };
  std::vector<int32_t> expected = {2, 4};
  EXPECT_EQ(with(R"(["a b", "\u0120 ab"])"), expected);
  EXPECT_EQ(with(R"([["a", "b"], ["\u0120", "ab"]])"), expected);
}

}  // namespace
}  // namespace marrow
