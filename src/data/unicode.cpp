#include "data/unicode.h"

#include <utf8proc.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/errors.h"

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

// Full NFC (decomposition, canonical ordering, composition) of valid UTF-8 through utf8proc.
void append_utf8proc_nfc(std::string_view text, std::string& out) {
  utf8proc_uint8_t* normalized = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), utf8proc_ssize_t(text.size()),
                                          &normalized, utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  MARROW_CHECK(n >= 0, "NFC of {} bytes of text failed: {}", text.size(), utf8proc_errmsg(n));
  out.append(reinterpret_cast<const char*>(normalized), size_t(n));
  std::free(normalized);
}

// utf8proc 2.8 composes an LV syllable with U+11A7, which is not a trailing consonant, and drops it.
// U+11A7 is a starter that composes with nothing, so NFC of the text is NFC of the pieces around it.
void append_full_nfc(std::string_view text, std::string& out) {
  constexpr std::string_view kNotATrail = "\xE1\x86\xA7";
  for (size_t at; (at = text.find(kNotATrail)) != std::string_view::npos; text.remove_prefix(at + kNotATrail.size())) {
    append_utf8proc_nfc(text.substr(0, at), out);
    out.append(kNotATrail);
  }
  append_utf8proc_nfc(text, out);
}

// One bit per code point: set when the character may change under NFC or combine with a neighbour
// (Unicode's NFC_Quick_Check "No" or "Maybe", or a non-zero combining class), read off utf8proc's
// data once. Over-marking only sends more text down the full path.
struct UnstableCharacters {
  std::vector<uint64_t> bits = std::vector<uint64_t>(0x110000 / 64);

  UnstableCharacters() {
    auto mark = [&](utf8proc_int32_t c) { bits[size_t(c) >> 6] |= uint64_t(1) << (c & 63); };
    utf8proc_int32_t parts[8];
    for (utf8proc_int32_t c = 0; c < 0x110000; ++c) {
      if (c >= 0xD800 && c < 0xE000) continue;
      if (utf8proc_get_property(c)->combining_class != 0) mark(c);
      int last_boundclass = 0;
      const utf8proc_ssize_t n = utf8proc_decompose_char(c, parts, 8, UTF8PROC_DECOMPOSE, &last_boundclass);
      if (n < 1 || (n == 1 && parts[0] == c)) continue;
      std::string utf8, nfc;
      append_utf8(char32_t(c), utf8);
      append_full_nfc(utf8, nfc);
      // A composite that NFC keeps: its later parts may combine with a preceding starter.
      if (nfc == utf8) for (utf8proc_ssize_t k = 1; k < n; ++k) mark(parts[k]);
      else mark(c);
    }
  }

  bool operator()(char32_t c) const { return bits[c >> 6] >> (c & 63) & 1; }
};

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
  static const UnstableCharacters unstable;
  // Normalisation never reaches across a stable character that is a starter, so only the spans
  // between such characters that hold an unstable one need the full algorithm.
  size_t copied = 0, span_start = 0, i = 0;
  bool span_unstable = false;
  while (i < text.size()) {
    size_t at = i;
    if (uint8_t(text[i]) < 0x80) {
      ++i;
      if (span_unstable) {
        append_full_nfc(text.substr(span_start, at - span_start), out);
        copied = at;
        span_unstable = false;
      }
      span_start = at;
      continue;
    }
    char32_t c = next_code_point(text, i);
    if (unstable(c)) {
      if (!span_unstable) {
        out.append(text.substr(copied, span_start - copied));
        span_unstable = true;
      }
      continue;
    }
    if (span_unstable) {
      append_full_nfc(text.substr(span_start, at - span_start), out);
      copied = at;
      span_unstable = false;
    }
    span_start = at;
  }
  if (span_unstable) append_full_nfc(text.substr(span_start), out);
  else out.append(text.substr(copied));
}

std::string to_nfc(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  append_nfc(text, out);
  return out;
}

}  // namespace marrow
