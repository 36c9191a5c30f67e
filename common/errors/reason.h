// The error catalog in C++: every error epd returns carries a stable reason
// (proto/epd/v1/errors.proto ErrorReason, e.g. EPD-2003 CUDA_DRIVER_TOO_OLD) as an
// absl::Status payload. No protobuf here (kernels and rules use it too): the table is
// generated from the .proto at build time (reasons.inc) and the payload is written in
// ErrorInfo's wire format by hand (a test checks it against the generated message).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace epd::errors {

/// ErrorReason of errors.proto, by number: Reason::kCudaDriverTooOld == 2003. A value
/// outside the enumerators is a reason of a newer epd (still carried and printed).
enum class Reason : int32_t {
  kUnspecified = 0,
#define EPD_REASON(number, NAME, Camel, code, cause, next_step) k##Camel = number,
#include "common/errors/reasons.inc"
#undef EPD_REASON
};

/// One catalog entry; static storage.
struct ReasonInfo {
  Reason reason;
  absl::string_view name;       ///< "CUDA_DRIVER_TOO_OLD".
  absl::StatusCode code;        ///< The status code the error comes with.
  absl::string_view cause;      ///< Why it happens.
  absl::string_view next_step;  ///< What the operator does about it.
};

/// The payload's type URL; its value is a serialized epd.v1.ErrorInfo.
inline constexpr absl::string_view kErrorInfoTypeUrl = "type.googleapis.com/epd.v1.ErrorInfo";

/// Every entry, in catalog order (without kUnspecified).
absl::Span<const ReasonInfo> AllReasons();

/// The entry of `number`, or nullptr for 0 and numbers this build does not know.
const ReasonInfo* FindReason(int32_t number);

/// The entry named by `text`: "EPD-2003", "2003", "CUDA_DRIVER_TOO_OLD" (any case);
/// nullptr when none.
const ReasonInfo* LookupReason(absl::string_view text);

/// "EPD-2003"; "" for kUnspecified.
std::string ReasonCode(Reason reason);

/// "CUDA_DRIVER_TOO_OLD"; "UNSPECIFIED" for 0, "UNKNOWN_REASON" for a number this build
/// does not know. Static storage.
absl::string_view ReasonName(Reason reason);

/// The unclassified reason of a status code: 9000 + code (kUnspecified for OK).
Reason GenericReason(absl::StatusCode code);

/// `status` with `reason` attached (replacing one it had). OK stays OK (no payload).
absl::Status WithReason(absl::Status status, Reason reason);

/// `status` with `reason` attached unless it carries one already: for classifying the
/// errors of a whole call at its boundary while keeping the more specific reasons of the
/// calls inside.
absl::Status WithDefaultReason(absl::Status status, Reason reason);

/// `to` with the reason `from` carries, if it carries one: for a status rebuilt from another
/// (its message prefixed) that must keep the original's reason.
absl::Status CopyReason(const absl::Status& from, absl::Status to);

/// True when `status` carries a reason payload.
bool HasReason(const absl::Status& status);

/// The reason `status` carries; GenericReason(code) when it carries none (or a malformed
/// one); kUnspecified for OK.
Reason ReasonOf(const absl::Status& status);

/// "CODE: message", followed by " [EPD-1006 OP_INPUT_INVALID]" when `status` carries a
/// specific (not unclassified) reason: absl's ToString without the payload's raw bytes, for
/// logs and messages people read. "OK" for OK.
std::string StatusText(const absl::Status& status);

/// The payload's bytes for `reason` (ErrorInfo{reason}) and their parse. Parse gives false
/// for bytes that are not an ErrorInfo; a missing reason field parses as kUnspecified.
std::string EncodeErrorInfo(Reason reason);
bool ParseErrorInfo(absl::string_view bytes, Reason* reason);

}  // namespace epd::errors
