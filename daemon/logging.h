// Logging: one spdlog logger per subsystem ("epd.control", "epd.registry", "epd.engine",
// "epd.gpu", "epd.daemon", ...), all writing to stderr through one shared sink, so the
// subsystem shows in every line: "[2026-11-29 15:20:25.123] [epd.control] [info] ...".
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "spdlog/spdlog.h"

namespace epd {

/// Logger names of the daemon's subsystems (a logger may use any "epd.*" name).
inline constexpr char kLogControl[] = "epd.control";
inline constexpr char kLogRegistry[] = "epd.registry";
inline constexpr char kLogEngine[] = "epd.engine";
inline constexpr char kLogGpu[] = "epd.gpu";
inline constexpr char kLogDaemon[] = "epd.daemon";
inline constexpr char kLogConfig[] = "epd.config";

/// Returns the logger of subsystem `name`, creating it on first use at the current level.
/// Thread-safe. Never returns null.
std::shared_ptr<spdlog::logger> GetLogger(absl::string_view name);

/// Parses an spdlog level name: trace, debug, info, warn (or warning), error, critical,
/// off. INVALID_ARGUMENT naming `log_level` and the value otherwise.
absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view level);

/// Sets the level of every existing and future epd logger. Errors as ParseLogLevel.
absl::Status SetLogLevel(absl::string_view level);

}  // namespace epd

/// Lets spdlog/fmt format absl::string_view (Debian's abseil is built with its own
/// string_view type, not std::string_view).
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<fmt::string_view> {
  template <typename FormatContext>
  auto format(absl::string_view s, FormatContext& ctx) const {
    return fmt::formatter<fmt::string_view>::format(fmt::string_view(s.data(), s.size()), ctx);
  }
};
