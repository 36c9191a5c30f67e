// Status helpers shared by every epd library. Abseil 20220623 has no
// ABSL_RETURN_IF_ERROR, so epd defines its own once, here.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define EPD_STATUS_CONCAT_INNER_(a, b) a##b
#define EPD_STATUS_CONCAT_(a, b) EPD_STATUS_CONCAT_INNER_(a, b)

/// Evaluates `expr` (an absl::Status) and returns it from the enclosing function when it
/// is not OK.
#define EPD_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status epd_status_ = (expr);       \
    if (!epd_status_.ok()) return epd_status_; \
  } while (0)

/// `EPD_ASSIGN_OR_RETURN(auto x, MakeX());`: evaluates an absl::StatusOr<T>, returns its
/// status when not OK, else move-assigns the value to `lhs`.
#define EPD_ASSIGN_OR_RETURN(lhs, expr) \
  EPD_ASSIGN_OR_RETURN_IMPL_(EPD_STATUS_CONCAT_(epd_statusor_, __LINE__), lhs, expr)
#define EPD_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = std::move(tmp).value()
