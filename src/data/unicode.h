// UTF-8 helpers and Unicode NFC normalisation, as Hugging Face's "NFC" normaliser applies it (the
// Unicode data and the full algorithm from utf8proc; the skip over text NFC leaves alone is ours).
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace marrow {

// Byte offset of the first byte that does not belong to well-formed UTF-8 (overlongs, surrogates
// and code points above U+10FFFF are ill-formed), or npos when all of it is valid.
size_t find_invalid_utf8(std::string_view text);

// Appends the NFC form of valid UTF-8 `text` to `out`. Text whose characters can neither decompose
// nor combine (all ASCII, most Latin, CJK, ...) is copied as is after one scan.
void append_nfc(std::string_view text, std::string& out);
std::string to_nfc(std::string_view text);

void append_utf8(char32_t code, std::string& out);
// Decodes one code point of valid UTF-8 at text[i] and advances i.
char32_t next_code_point(std::string_view text, size_t& i);

}  // namespace marrow
