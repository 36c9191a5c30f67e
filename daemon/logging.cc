#include "daemon/logging.h"

#include <mutex>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace epd {
namespace {

struct LoggingState {
  std::mutex mu;
  spdlog::sink_ptr sink;
  spdlog::level::level_enum level = spdlog::level::info;
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
  logger->set_level(state.level);
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
  return absl::InvalidArgumentError(
      absl::StrCat("log_level: \"", level,
                   "\" is not a level (trace, debug, info, warn, error, critical, off)"));
}

absl::Status SetLogLevel(absl::string_view level) {
  absl::StatusOr<spdlog::level::level_enum> parsed = ParseLogLevel(level);
  if (!parsed.ok()) return parsed.status();
  LoggingState& state = State();
  std::lock_guard<std::mutex> lock(state.mu);
  state.level = *parsed;
  spdlog::apply_all([&](const std::shared_ptr<spdlog::logger>& l) {
    if (l->name().rfind("epd", 0) == 0) l->set_level(*parsed);
  });
  return absl::OkStatus();
}

}  // namespace epd
