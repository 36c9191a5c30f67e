// Request text checks (request_text.h).
#include "client/request_text.h"

#include <cstdint>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace epd::internal {
namespace {

/// The length of the well-formed UTF-8 sequence at the start of `s` (non-empty), or 0.
size_t SequenceLength(absl::string_view s) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t b0 = byte(0);
  if (b0 < 0x80) return 1;
  size_t n;
  uint8_t lo = 0x80, hi = 0xBF;  // The second byte's range (Unicode Table 3-7).
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;  // Overlong.
    if (b0 == 0xED) hi = 0x9F;  // Surrogates.
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;  // Overlong.
    if (b0 == 0xF4) hi = 0x8F;  // Past U+10FFFF.
  } else {
    return 0;
  }
  if (s.size() < n || byte(1) < lo || byte(1) > hi) return 0;
  for (size_t i = 2; i < n; ++i) {
    if (byte(i) < 0x80 || byte(i) > 0xBF) return 0;
  }
  return n;
}

std::string Shown(absl::string_view text) {
  constexpr size_t kShown = 64;
  if (text.size() <= kShown) return absl::StrCat("\"", absl::CHexEscape(text), "\"");
  return absl::StrCat("\"", absl::CHexEscape(text.substr(0, kShown)), "\"...");
}

}  // namespace

size_t ValidUtf8Prefix(absl::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const size_t n = SequenceLength(text.substr(i));
    if (n == 0) break;
    i += n;
  }
  return i;
}

absl::Status CheckRequestText(absl::string_view field, absl::string_view text, size_t max_bytes) {
  if (text.size() > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, " ", Shown(text), " is ", text.size(),
                                                   " bytes long; at most ", max_bytes,
                                                   " are taken"));
  }
  if (const size_t valid = ValidUtf8Prefix(text); valid != text.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " ", Shown(text), " is not valid UTF-8 (at byte ", valid, ")"));
  }
  if (const size_t nul = text.find('\0'); nul != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " ", Shown(text), " has a NUL byte at byte ", nul));
  }
  return absl::OkStatus();
}

std::string SanitizeUtf8(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  while (!text.empty()) {
    const size_t n = SequenceLength(text);
    if (n == 0) {
      out.push_back('?');
      text.remove_prefix(1);
    } else {
      out.append(text.data(), n);
      text.remove_prefix(n);
    }
  }
  return out;
}

}  // namespace epd::internal
