// Request text checks (request_text.h).
#include "client/request_text.h"

#include <cstdint>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/client_text.h"

namespace epd::internal {
namespace {

std::string Shown(absl::string_view text) {
  constexpr size_t kShown = 64;
  if (text.size() <= kShown) return absl::StrCat("\"", absl::CHexEscape(text), "\"");
  return absl::StrCat("\"", absl::CHexEscape(text.substr(0, kShown)), "\"...");
}

}  // namespace

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
    const size_t n = Utf8SequenceLength(text);
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
