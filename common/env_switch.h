// On/off switches of the environment (the EPD_* variables the client library and the
// kernels' launchers read): one parser and one error text for all of them.
#pragma once

#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace epd {

/// The on/off switch `name` of the process environment: unset or empty = `unset`, "0" =
/// off, "1" = on. Reads the environment on every call (getenv: safe where no thread of the
/// process calls setenv, as in epd and its client library; a per-op caller pays a scan of
/// the environment). Errors: INVALID_ARGUMENT naming the variable and its value, for any
/// other value.
inline absl::StatusOr<bool> SwitchFromEnv(const char* name, bool unset) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return unset;
  if (std::strcmp(v, "0") == 0) return false;
  if (std::strcmp(v, "1") == 0) return true;
  return absl::InvalidArgumentError(absl::StrCat(name, " = \"", v, "\" is not \"0\" or \"1\""));
}

}  // namespace epd
