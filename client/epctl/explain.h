// `epctl explain`: the error catalog (proto/epd/v1/errors.proto) for operators, offline.
#pragma once

#include <string>

#include "absl/strings/string_view.h"
#include "common/errors/reason.h"

namespace epd::epctl {

/// One entry: "EPD-2003 CUDA_DRIVER_TOO_OLD (FAILED_PRECONDITION)", then its cause and
/// next step on lines of their own.
std::string FormatReason(const errors::ReasonInfo& reason);
/// Every entry as a table: code, name, status code.
std::string FormatReasonList();
/// One entry as a JSON object {"code", "number", "name", "status", "cause", "next_step"}
/// ending in a newline; the list as {"reasons": [...]}.
std::string ReasonJson(const errors::ReasonInfo& reason);
std::string ReasonListJson();

/// `epctl explain ARG` (ARG "EPD-2003", "2003" or a name; `list` for --list): prints to
/// stdout and returns 0, or prints why to stderr and returns 1 for a reason the catalog
/// does not have.
int RunExplain(absl::string_view arg, bool list, bool json);

}  // namespace epd::epctl
