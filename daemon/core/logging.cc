#include "daemon/core/logging.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/errors/reason.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace epd {
namespace {

struct LoggingState {
  std::mutex mu;
  spdlog::sink_ptr sink;
  LogLevels levels;
};

LoggingState& State() {
  static LoggingState* state = [] {
    auto* s = new LoggingState();  // Leaked on purpose: loggers outlive static teardown.
    s->sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    return s;
  }();
  return *state;
}

}  // namespace

std::shared_ptr<spdlog::logger> GetLogger(absl::string_view name) {
  LoggingState& state = State();
  std::lock_guard<std::mutex> lock(state.mu);
  std::string key(name);
  if (auto existing = spdlog::get(key)) return existing;
  auto logger = std::make_shared<spdlog::logger>(key, state.sink);
  logger->set_level(state.levels.For(key));
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%l] %v");
  logger->flush_on(spdlog::level::info);
  spdlog::register_logger(logger);
  return logger;
}

absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view level) {
  static constexpr std::pair<absl::string_view, spdlog::level::level_enum> kLevels[] = {
      {"trace", spdlog::level::trace},       {"debug", spdlog::level::debug},
      {"info", spdlog::level::info},         {"warn", spdlog::level::warn},
      {"warning", spdlog::level::warn},      {"error", spdlog::level::err},
      {"critical", spdlog::level::critical}, {"off", spdlog::level::off}};
  for (const auto& [name, value] : kLevels) {
    if (name == level) return value;
  }
  return errors::WithReason(
      absl::InvalidArgumentError(
          absl::StrCat("log_level: \"", level,
                       "\" is not a level (trace, debug, info, warn, error, critical, off)")),
      errors::Reason::kConfigInvalid);
}

std::string BoundedRankList(absl::Span<const int32_t> ranks, size_t max_named,
                            absl::string_view separator) {
  if (ranks.size() <= max_named) return absl::StrJoin(ranks, separator);
  return absl::StrCat(absl::StrJoin(ranks.subspan(0, max_named), separator), " and ",
                      ranks.size() - max_named, " more");
}

absl::Span<const char* const> SubsystemLoggerNames() {
  static constexpr const char* kNames[] = {kLogControl, kLogRegistry, kLogEngine, kLogGpu,
                                           kLogDaemon,  kLogConfig,   kLogPeer,   kLogTransport};
  return kNames;
}

spdlog::level::level_enum LogLevels::For(absl::string_view name) const {
  for (const auto& [logger, logger_level] : loggers) {
    if (logger == name) return logger_level;
  }
  return level;
}

absl::StatusOr<LogLevels> ParseLogLevels(absl::string_view spec) {
  LogLevels levels;
  bool default_given = false;
  for (absl::string_view item : absl::StrSplit(spec, ',')) {
    const size_t eq = item.find('=');
    if (eq == absl::string_view::npos) {
      if (item.empty() && spec.find(',') != absl::string_view::npos) {
        return errors::WithReason(
            absl::InvalidArgumentError(absl::StrCat("log_level: \"", spec, "\" has an empty item")),
            errors::Reason::kConfigInvalid);
      }
      if (default_given) {
        return errors::WithReason(
            absl::InvalidArgumentError(
                absl::StrCat("log_level: \"", spec, "\" gives the level of every logger twice (\"",
                             item, "\"); give one level, then LOGGER=LEVEL items")),
            errors::Reason::kConfigInvalid);
      }
      absl::StatusOr<spdlog::level::level_enum> parsed = ParseLogLevel(item);
      if (!parsed.ok()) return parsed.status();
      levels.level = *parsed;
      default_given = true;
      continue;
    }
    const absl::string_view name = item.substr(0, eq);
    const absl::StatusOr<spdlog::level::level_enum> parsed = ParseLogLevel(item.substr(eq + 1));
    if (!parsed.ok()) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat("log_level: \"", item, "\" in \"", spec,
                                                  "\": ", parsed.status().message())),
          errors::Reason::kConfigInvalid);
    }
    const absl::Span<const char* const> known = SubsystemLoggerNames();
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                    "log_level: \"", name, "\" (in \"", spec,
                                    "\") is not a logger name (", absl::StrJoin(known, ", "), ")")),
                                errors::Reason::kConfigInvalid);
    }
    for (const auto& [logger, unused] : levels.loggers) {
      if (logger == name) {
        return errors::WithReason(
            absl::InvalidArgumentError(
                absl::StrCat("log_level: \"", spec, "\" gives the level of ", name, " twice")),
            errors::Reason::kConfigInvalid);
      }
    }
    levels.loggers.emplace_back(std::string(name), *parsed);
  }
  return levels;
}

absl::Status SetLogLevel(absl::string_view spec) {
  absl::StatusOr<LogLevels> parsed = ParseLogLevels(spec);
  if (!parsed.ok()) return parsed.status();
  LoggingState& state = State();
  std::lock_guard<std::mutex> lock(state.mu);
  state.levels = *std::move(parsed);
  spdlog::apply_all([&](const std::shared_ptr<spdlog::logger>& l) {
    if (l->name().rfind("epd", 0) == 0) l->set_level(state.levels.For(l->name()));
  });
  return absl::OkStatus();
}

LogRateLimiter::LogRateLimiter(double per_second, double burst, std::string client)
    : per_second_(std::max(per_second, 1e-3)),
      burst_(std::max(burst, 1.0)),
      client_(std::move(client)),
      tokens_(burst_),
      last_refill_(Clock::now()) {}

void LogRateLimiter::RefillLocked(Clock::time_point now) {
  if (now <= last_refill_) return;
  const double seconds = std::chrono::duration<double>(now - last_refill_).count();
  tokens_ = std::min(burst_, tokens_ + seconds * per_second_);
  last_refill_ = now;
}

LogRateLimiter::Decision LogRateLimiter::ReportLocked(Clock::time_point now) {
  Decision d;
  d.log = true;
  d.suppressed = suppressed_.load(std::memory_order_relaxed);
  if (d.suppressed > 0) {
    // Threads read the clock before taking the lock: `now` may precede the first one.
    d.suppressed_seconds =
        std::max(0.0, std::chrono::duration<double>(now - first_suppressed_).count());
    std::memcpy(d.last_source, last_source_, last_source_bytes_);
    d.last_source_bytes = last_source_bytes_;
  }
  suppressed_.store(0, std::memory_order_relaxed);
  return d;
}

LogRateLimiter::Decision LogRateLimiter::Allow(absl::string_view source, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  RefillLocked(now);
  if (tokens_ >= 1.0) {
    tokens_ -= 1.0;
    return ReportLocked(now);
  }
  if (suppressed_.fetch_add(1, std::memory_order_relaxed) == 0) first_suppressed_ = now;
  last_source_bytes_ = std::min(source.size(), sizeof(last_source_));
  std::memcpy(last_source_, source.data(), last_source_bytes_);
  return Decision{};
}

LogRateLimiter::Decision LogRateLimiter::TakeReport(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (suppressed() == 0) return Decision{};
  RefillLocked(now);
  if (tokens_ < 1.0) return Decision{};
  tokens_ -= 1.0;
  return ReportLocked(now);
}

LogRateLimiter::Decision LogRateLimiter::Flush(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (suppressed() == 0) return Decision{};
  return ReportLocked(now);
}

void LogSuppressedReport(spdlog::logger& log, spdlog::level::level_enum level,
                         const LogRateLimiter& limiter, const LogRateLimiter::Decision& decision) {
  if (decision.suppressed == 0) return;
  if (limiter.client().empty()) {
    log.log(level, "{} similar messages from {} suppressed in the last {:.1f} s",
            decision.suppressed, decision.last(), decision.suppressed_seconds);
  } else {
    log.log(level, "{} similar messages from {} (last: {}) suppressed in the last {:.1f} s",
            decision.suppressed, limiter.client(), decision.last(), decision.suppressed_seconds);
  }
}

bool LogSuppressed(spdlog::logger& log, spdlog::level::level_enum level, LogRateLimiter& limiter) {
  if (limiter.suppressed() == 0) return false;
  const LogRateLimiter::Decision d = limiter.TakeReport();
  if (!d.log) return false;
  LogSuppressedReport(log, level, limiter, d);
  return true;
}

}  // namespace epd
