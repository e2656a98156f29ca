#include "data/unicode.h"

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "data/unicode_tables.h"

namespace marrow {

char32_t next_code_point(std::string_view text, size_t& i) {
  auto byte = [&](size_t k) { return char32_t(uint8_t(text[k])); };
  char32_t c = byte(i);
  if (c < 0x80) {
    i += 1;
    return c;
  }
  if (c < 0xE0) {
    c = (c & 0x1F) << 6 | (byte(i + 1) & 0x3F);
    i += 2;
  } else if (c < 0xF0) {
    c = (c & 0x0F) << 12 | (byte(i + 1) & 0x3F) << 6 | (byte(i + 2) & 0x3F);
    i += 3;
  } else {
    c = (c & 0x07) << 18 | (byte(i + 1) & 0x3F) << 12 | (byte(i + 2) & 0x3F) << 6 | (byte(i + 3) & 0x3F);
    i += 4;
  }
  return c;
}

namespace {

constexpr char32_t kHangulFirst = 0xAC00, kLeadFirst = 0x1100, kVowelFirst = 0x1161, kTrailFirst = 0x11A7;
constexpr int kVowelCount = 21, kTrailCount = 28, kSyllableCount = 11172;

struct NfcData {
  // One bit per code point: set when the character may change under NFC or combine with its
  // neighbour (Unicode's NFC_Quick_Check "No" or "Maybe", or a non-zero combining class).
  std::vector<uint64_t> unstable_bits = std::vector<uint64_t>(0x110000 / 64);
  std::unordered_map<char32_t, std::pair<char32_t, char32_t>> decompositions;
  std::unordered_map<uint64_t, char32_t> compositions;

  NfcData() {
    auto mark = [&](char32_t c) { unstable_bits[c >> 6] |= uint64_t(1) << (c & 63); };
    for (const auto& d : unicode::kDecompositions) {
      decompositions[d.code] = {d.first, d.second};
      if (d.composes) {
        compositions[uint64_t(d.first) << 32 | d.second] = d.code;
        mark(d.second);
      } else {
        mark(d.code);
      }
    }
    for (const auto& range : unicode::kCombiningClasses)
      for (char32_t c = range.first; c <= range.last; ++c) mark(c);
    for (char32_t c = kVowelFirst; c < kVowelFirst + kVowelCount; ++c) mark(c);
    for (char32_t c = kTrailFirst + 1; c < kTrailFirst + kTrailCount; ++c) mark(c);
  }

  bool unstable(char32_t c) const { return unstable_bits[c >> 6] >> (c & 63) & 1; }
};

const NfcData& nfc_data() {
  static const NfcData data;
  return data;
}

uint8_t combining_class(char32_t c) {
  const auto* begin = std::begin(unicode::kCombiningClasses);
  const auto* end = std::end(unicode::kCombiningClasses);
  const auto* it = std::upper_bound(begin, end, c, [](char32_t v, const auto& r) { return v < r.first; });
  if (it == begin) return 0;
  --it;
  return c <= it->last ? it->combining_class : 0;
}

void decompose(char32_t c, const NfcData& data, std::vector<char32_t>& out) {
  if (c >= kHangulFirst && c < kHangulFirst + kSyllableCount) {
    int index = int(c - kHangulFirst);
    out.push_back(kLeadFirst + index / (kVowelCount * kTrailCount));
    out.push_back(kVowelFirst + index % (kVowelCount * kTrailCount) / kTrailCount);
    if (index % kTrailCount) out.push_back(kTrailFirst + index % kTrailCount);
    return;
  }
  auto it = data.decompositions.find(c);
  if (it == data.decompositions.end()) {
    out.push_back(c);
    return;
  }
  decompose(it->second.first, data, out);
  if (it->second.second) decompose(it->second.second, data, out);
}

char32_t compose_pair(char32_t first, char32_t second, const NfcData& data) {
  if (first >= kLeadFirst && first < kLeadFirst + 19 && second >= kVowelFirst && second < kVowelFirst + kVowelCount)
    return kHangulFirst + ((first - kLeadFirst) * kVowelCount + (second - kVowelFirst)) * kTrailCount;
  if (first >= kHangulFirst && first < kHangulFirst + kSyllableCount && (first - kHangulFirst) % kTrailCount == 0 &&
      second > kTrailFirst && second < kTrailFirst + kTrailCount)
    return first + (second - kTrailFirst);
  auto it = data.compositions.find(uint64_t(first) << 32 | second);
  return it == data.compositions.end() ? 0 : it->second;
}

// Full NFC of a span: canonical decomposition, canonical ordering, canonical composition.
void normalize_span(std::string_view text, const NfcData& data, std::string& out) {
  std::vector<char32_t> chars;
  for (size_t i = 0; i < text.size();) decompose(next_code_point(text, i), data, chars);
  std::vector<uint8_t> classes(chars.size());
  for (size_t i = 0; i < chars.size(); ++i) classes[i] = combining_class(chars[i]);
  for (size_t i = 0; i < chars.size();) {
    if (classes[i] == 0) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < chars.size() && classes[end] != 0) ++end;
    std::vector<std::pair<uint8_t, char32_t>> run;
    for (size_t k = i; k < end; ++k) run.emplace_back(classes[k], chars[k]);
    std::stable_sort(run.begin(), run.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t k = i; k < end; ++k) std::tie(classes[k], chars[k]) = run[k - i];
    i = end;
  }
  // Composition: each character joins the last starter unless a character between them has a
  // combining class of zero or at least its own (it is "blocked"). After reordering, the last
  // character kept since the starter has the largest class among those in between.
  size_t written = 0;
  size_t starter = SIZE_MAX;
  for (size_t i = 0; i < chars.size(); ++i) {
    uint8_t cls = classes[i];
    if (starter != SIZE_MAX) {
      bool adjacent = written == starter + 1;
      if (adjacent || classes[written - 1] < cls) {
        if (char32_t composite = compose_pair(chars[starter], chars[i], data)) {
          chars[starter] = composite;
          continue;
        }
      }
    }
    if (cls == 0) starter = written;
    chars[written] = chars[i];
    classes[written] = cls;
    ++written;
  }
  for (size_t i = 0; i < written; ++i) append_utf8(chars[i], out);
}

}  // namespace

size_t find_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    if (i + 8 <= n) {
      uint64_t word;
      std::memcpy(&word, s + i, 8);
      if (!(word & 0x8080808080808080ull)) {
        i += 8;
        continue;
      }
    }
    uint8_t c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t length;
    uint8_t low = 0x80, high = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      length = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      length = 3;
      if (c == 0xE0) low = 0xA0;
      if (c == 0xED) high = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      length = 4;
      if (c == 0xF0) low = 0x90;
      if (c == 0xF4) high = 0x8F;
    } else {
      return i;
    }
    if (i + length > n || s[i + 1] < low || s[i + 1] > high) return i;
    for (size_t k = 2; k < length; ++k)
      if ((s[i + k] & 0xC0) != 0x80) return i;
    i += length;
  }
  return std::string_view::npos;
}

void append_utf8(char32_t c, std::string& out) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xC0 | c >> 6);
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | c >> 12);
    out += char(0x80 | (c >> 6 & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | c >> 18);
    out += char(0x80 | (c >> 12 & 0x3F));
    out += char(0x80 | (c >> 6 & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

void append_nfc(std::string_view text, std::string& out) {
  const NfcData& data = nfc_data();
  // Normalisation never reaches across a stable character that is a starter, so only the spans
  // between such characters that hold an unstable one need the full algorithm.
  size_t copied = 0, span_start = 0, i = 0;
  bool span_unstable = false;
  while (i < text.size()) {
    size_t at = i;
    if (uint8_t(text[i]) < 0x80) {
      ++i;
      if (span_unstable) {
        normalize_span(text.substr(span_start, at - span_start), data, out);
        copied = at;
        span_unstable = false;
      }
      span_start = at;
      continue;
    }
    char32_t c = next_code_point(text, i);
    if (data.unstable(c)) {
      if (!span_unstable) {
        out.append(text.substr(copied, span_start - copied));
        span_unstable = true;
      }
      continue;
    }
    if (span_unstable) {
      normalize_span(text.substr(span_start, at - span_start), data, out);
      copied = at;
      span_unstable = false;
    }
    span_start = at;
  }
  if (span_unstable) normalize_span(text.substr(span_start), data, out);
  else out.append(text.substr(copied));
}

std::string to_nfc(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  append_nfc(text, out);
  return out;
}

}  // namespace marrow
