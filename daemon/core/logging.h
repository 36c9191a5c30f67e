// Logging: one spdlog logger per subsystem ("epd.control", "epd.registry", "epd.engine",
// "epd.gpu", "epd.daemon", ...), all writing to stderr through one shared sink, so the
// subsystem shows in every line: "[2026-11-29 15:20:25.123] [epd.control] [info] ...".
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "spdlog/spdlog.h"

namespace epd {

/// Logger names of the daemon's subsystems (a logger may use any "epd.*" name).
inline constexpr char kLogControl[] = "epd.control";
inline constexpr char kLogRegistry[] = "epd.registry";
inline constexpr char kLogEngine[] = "epd.engine";
inline constexpr char kLogGpu[] = "epd.gpu";
inline constexpr char kLogDaemon[] = "epd.daemon";
inline constexpr char kLogConfig[] = "epd.config";
inline constexpr char kLogPeer[] = "epd.peer";
inline constexpr char kLogTransport[] = "epd.transport";

/// Returns the logger of subsystem `name`, creating it on first use at the current level.
/// Thread-safe. Never returns null.
std::shared_ptr<spdlog::logger> GetLogger(absl::string_view name);

/// Parses an spdlog level name: trace, debug, info, warn (or warning), error, critical,
/// off. INVALID_ARGUMENT naming `log_level` and the value otherwise.
absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view level);

/// The subsystem logger names (kLogControl ... kLogConfig), the names a log_level spec
/// may give a level of its own.
absl::Span<const char* const> SubsystemLoggerNames();

/// A parsed log_level spec: the level of every epd logger, and per-subsystem exceptions.
struct LogLevels {
  spdlog::level::level_enum level = spdlog::level::info;
  /// (logger name, level) for the loggers named in the spec, in its order.
  std::vector<std::pair<std::string, spdlog::level::level_enum>> loggers;

  /// The level of logger `name`: its own when the spec names it, else `level`.
  spdlog::level::level_enum For(absl::string_view name) const;
};

/// Parses a log_level spec: comma-separated items, each a level (ParseLogLevel; at most
/// one: every logger's level, info when absent) or LOGGER=LEVEL for one subsystem's
/// logger (SubsystemLoggerNames), e.g. "info,epd.engine=trace,epd.control=debug".
/// INVALID_ARGUMENT naming log_level and the offending item: a bad level, an unknown
/// logger name (the known ones listed), a logger or the default given twice, an empty item.
absl::StatusOr<LogLevels> ParseLogLevels(absl::string_view spec);

/// Sets the level of every existing and future epd logger from a log_level spec
/// (ParseLogLevels). Errors as ParseLogLevels (nothing changes then).
absl::Status SetLogLevel(absl::string_view spec);

/// `ranks` as a log or audit line names them: the first `max_named` joined by `separator`,
/// then " and N more" for the rest ("1, 2, 3, 4 and 60 more"), so a change naming thousands
/// of ranks stays one short line.
std::string BoundedRankList(absl::Span<const int32_t> ranks, size_t max_named,
                            absl::string_view separator = ", ");

/// A token bucket for the log lines one client can cause (docs/SECURITY.md, "Client-caused
/// log lines are rate-limited"): up to `burst` lines at once, then `per_second` lines a
/// second. Lines over that are counted instead of logged, with the source of the last of
/// them, and the count is reported in one line ("N similar messages from <client> (last:
/// <source>) suppressed in the last T s") before the next line that is logged, or by
/// LogSuppressed once the bucket has a token again.
///
/// One limiter is the budget of one client that cannot multiply it: the daemon keeps one
/// per uid (GroupRegistry), shared through shared_ptr by every endpoint and group of that
/// uid on every engine thread. Thread-safe; deciding takes a short lock and allocates
/// nothing.
class LogRateLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  /// Steady rate of lines a second, and the burst allowed at once.
  static constexpr double kDefaultPerSecond = 2;
  static constexpr double kDefaultBurst = 10;
  /// Bytes of a source's name kept for the report; longer names are cut.
  static constexpr size_t kMaxSourceBytes = 160;

  /// `per_second` > 0 and `burst` >= 1 (smaller values are raised to them). `client` names
  /// whose budget this is in the report ("uid 1000"); "" when the source of each line is
  /// its client (the report then names the last source alone).
  explicit LogRateLimiter(double per_second = kDefaultPerSecond, double burst = kDefaultBurst,
                          std::string client = "");
  LogRateLimiter(const LogRateLimiter&) = delete;
  LogRateLimiter& operator=(const LogRateLimiter&) = delete;

  /// What Allow / TakeReport / Flush decided.
  struct Decision {
    bool log = false;               ///< Log the line (Allow) / the report (TakeReport).
    uint64_t suppressed = 0;        ///< Lines suppressed before it (0 = none to report).
    double suppressed_seconds = 0;  ///< Seconds since the first of them was suppressed.
    /// The source of the last suppressed line (cut to kMaxSourceBytes), when suppressed > 0.
    char last_source[kMaxSourceBytes];
    size_t last_source_bytes = 0;
    absl::string_view last() const { return absl::string_view(last_source, last_source_bytes); }
  };

  /// Whether one more line of `source` (e.g. "group G rank R (endpoint E)") may be logged
  /// at `now` (takes a token); when not, the line is counted as suppressed and `source`
  /// kept as the last one. When it may and lines were suppressed before, their count is in
  /// the decision (and reset): log the report first.
  Decision Allow(absl::string_view source, Clock::time_point now = Clock::now());
  /// Lines suppressed and not yet reported (read without the lock).
  uint64_t suppressed() const { return suppressed_.load(std::memory_order_relaxed); }
  /// When lines were suppressed and a token is available at `now`: takes it and returns
  /// their count (reset); else a decision with log = false.
  Decision TakeReport(Clock::time_point now = Clock::now());
  /// The suppressed lines' report regardless of tokens (reset), e.g. when the last source
  /// goes away; log = false when there is nothing to report.
  Decision Flush(Clock::time_point now = Clock::now());
  /// Whose budget this is ("" = each source's own).
  const std::string& client() const { return client_; }

 private:
  void RefillLocked(Clock::time_point now);
  Decision ReportLocked(Clock::time_point now);

  const double per_second_;
  const double burst_;
  const std::string client_;
  std::mutex mu_;  // Guards everything below; suppressed_ is also read without it.
  double tokens_;
  Clock::time_point last_refill_;
  std::atomic<uint64_t> suppressed_{0};
  Clock::time_point first_suppressed_{};
  char last_source_[kMaxSourceBytes];
  size_t last_source_bytes_ = 0;
};

/// Logs "N similar messages from <client> (last: <source>) suppressed in the last T s" (or
/// "from <source>" when `limiter` has no client name) at `level` for a decision of
/// `limiter` that carries suppressed lines (nothing otherwise).
void LogSuppressedReport(spdlog::logger& log, spdlog::level::level_enum level,
                         const LogRateLimiter& limiter, const LogRateLimiter::Decision& decision);

/// Logs one client-caused line of `source` at `level` through `limiter`: nothing when the
/// limiter suppresses it (the arguments are not even formatted), else the report of earlier
/// suppressed lines first (LogSuppressedReport), then the line. A line the logger's level
/// hides is neither logged nor counted.
template <typename... Args>
void LogLimited(spdlog::logger& log, spdlog::level::level_enum level, LogRateLimiter& limiter,
                absl::string_view source, fmt::format_string<Args...> format, Args&&... args) {
  if (!log.should_log(level)) return;
  const LogRateLimiter::Decision d = limiter.Allow(source);
  if (!d.log) return;
  LogSuppressedReport(log, level, limiter, d);
  log.log(level, format, std::forward<Args>(args)...);
}

/// Reports the lines `limiter` suppressed, once it has a token again (call it now and
/// then, e.g. on every engine poll: it reads the clock and locks only while lines are
/// suppressed). True if it logged.
bool LogSuppressed(spdlog::logger& log, spdlog::level::level_enum level, LogRateLimiter& limiter);

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
