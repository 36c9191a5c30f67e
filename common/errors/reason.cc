// The error catalog's table and the absl::Status payload (reason.h).
#include "common/errors/reason.h"

#include <iterator>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace epd::errors {
namespace {

constexpr ReasonInfo kCatalog[] = {
#define EPD_REASON(number, NAME, Camel, code, cause, next_step) \
  {Reason::k##Camel, #NAME, absl::StatusCode::code, cause, next_step},
#include "common/errors/reasons.inc"
#undef EPD_REASON
};

constexpr uint32_t kTagReason = (1 << 3) | 0;  // ErrorInfo.reason: field 1, varint.

bool ReadVarint(absl::string_view* in, uint64_t* value) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (in->empty()) return false;
    const uint8_t b = static_cast<uint8_t>(in->front());
    in->remove_prefix(1);
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) {
      *value = v;
      return true;
    }
  }
  return false;
}

}  // namespace

absl::Span<const ReasonInfo> AllReasons() { return kCatalog; }

const ReasonInfo* FindReason(int32_t number) {
  for (const ReasonInfo& r : kCatalog) {
    if (static_cast<int32_t>(r.reason) == number) return &r;
  }
  return nullptr;
}

const ReasonInfo* LookupReason(absl::string_view text) {
  std::string t = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  absl::string_view digits = t;
  if (absl::ConsumePrefix(&digits, "EPD-") || (!digits.empty() && absl::ascii_isdigit(digits[0]))) {
    int32_t n = 0;
    return absl::SimpleAtoi(digits, &n) ? FindReason(n) : nullptr;
  }
  absl::string_view name = t;
  absl::ConsumePrefix(&name, "ERROR_REASON_");
  for (const ReasonInfo& r : kCatalog) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

std::string ReasonCode(Reason reason) {
  return reason == Reason::kUnspecified ? std::string()
                                        : absl::StrCat("EPD-", static_cast<int32_t>(reason));
}

absl::string_view ReasonName(Reason reason) {
  if (reason == Reason::kUnspecified) return "UNSPECIFIED";
  const ReasonInfo* r = FindReason(static_cast<int32_t>(reason));
  return r != nullptr ? r->name : "UNKNOWN_REASON";
}

Reason GenericReason(absl::StatusCode code) {
  return code == absl::StatusCode::kOk ? Reason::kUnspecified
                                       : static_cast<Reason>(9000 + static_cast<int>(code));
}

std::string EncodeErrorInfo(Reason reason) {
  std::string out;
  if (reason == Reason::kUnspecified) return out;  // proto3: a default field is not written.
  out.push_back(static_cast<char>(kTagReason));
  // An enum is written as int64: a negative number takes ten bytes.
  uint64_t v = static_cast<uint64_t>(static_cast<int64_t>(static_cast<int32_t>(reason)));
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
  return out;
}

bool ParseErrorInfo(absl::string_view bytes, Reason* reason) {
  Reason found = Reason::kUnspecified;
  while (!bytes.empty()) {
    uint64_t tag = 0;
    if (!ReadVarint(&bytes, &tag) || (tag >> 3) == 0) return false;
    uint64_t value = 0;
    switch (tag & 7) {
      case 0:  // varint
        if (!ReadVarint(&bytes, &value)) return false;
        if (tag == kTagReason) found = static_cast<Reason>(static_cast<int32_t>(value));
        break;
      case 1:  // 64-bit
        if (bytes.size() < 8) return false;
        bytes.remove_prefix(8);
        break;
      case 2:  // length-delimited
        if (!ReadVarint(&bytes, &value) || value > bytes.size()) return false;
        bytes.remove_prefix(static_cast<size_t>(value));
        break;
      case 5:  // 32-bit
        if (bytes.size() < 4) return false;
        bytes.remove_prefix(4);
        break;
      default:
        return false;
    }
  }
  *reason = found;
  return true;
}

absl::Status WithReason(absl::Status status, Reason reason) {
  if (status.ok() || reason == Reason::kUnspecified) return status;
  status.SetPayload(kErrorInfoTypeUrl, absl::Cord(EncodeErrorInfo(reason)));
  return status;
}

absl::Status WithDefaultReason(absl::Status status, Reason reason) {
  if (HasReason(status)) return status;
  return WithReason(std::move(status), reason);
}

std::string StatusText(const absl::Status& status) {
  if (status.ok()) return "OK";
  std::string text = absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
  const Reason reason = ReasonOf(status);
  if (HasReason(status) && static_cast<int32_t>(reason) < 9000) {
    absl::StrAppend(&text, " [", ReasonCode(reason), " ", ReasonName(reason), "]");
  }
  return text;
}

absl::Status CopyReason(const absl::Status& from, absl::Status to) {
  return HasReason(from) ? WithReason(std::move(to), ReasonOf(from)) : to;
}

bool HasReason(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kErrorInfoTypeUrl).has_value();
}

Reason ReasonOf(const absl::Status& status) {
  if (status.ok()) return Reason::kUnspecified;
  if (auto p = status.GetPayload(kErrorInfoTypeUrl); p.has_value()) {
    Reason r = Reason::kUnspecified;
    if (ParseErrorInfo(std::string(*p), &r) && r != Reason::kUnspecified) return r;
  }
  return GenericReason(status.code());
}

}  // namespace epd::errors
