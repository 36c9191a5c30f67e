// Per-subsystem log levels (daemon/core/logging.h): the log_level spec
// "LEVEL,LOGGER=LEVEL,..." sets every epd logger's level and the named subsystems' own,
// for existing and later loggers; a bad level, an unknown logger name or a repeated item
// is INVALID_ARGUMENT naming log_level and the value, and changes nothing; DaemonConfig
// validation takes the same spec.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon/core/config.h"
#include "daemon/core/logging.h"

namespace epd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class LogLevelsTest : public ::testing::Test {
 protected:
  void TearDown() override { ASSERT_TRUE(SetLogLevel("info").ok()); }
};

TEST_F(LogLevelsTest, ParsesDefaultAndPerLoggerLevels) {
  absl::StatusOr<LogLevels> levels = ParseLogLevels("warn,epd.engine=trace,epd.control=debug");
  ASSERT_TRUE(levels.ok()) << levels.status();
  EXPECT_EQ(levels->level, spdlog::level::warn);
  EXPECT_EQ(levels->For(kLogEngine), spdlog::level::trace);
  EXPECT_EQ(levels->For(kLogControl), spdlog::level::debug);
  EXPECT_EQ(levels->For(kLogGpu), spdlog::level::warn);

  absl::StatusOr<LogLevels> only_one = ParseLogLevels("epd.gpu=error");
  ASSERT_TRUE(only_one.ok()) << only_one.status();
  EXPECT_EQ(only_one->level, spdlog::level::info);
  EXPECT_EQ(only_one->For(kLogGpu), spdlog::level::err);
}

TEST_F(LogLevelsTest, AppliesToExistingAndNewLoggers) {
  auto engine = GetLogger(kLogEngine);
  auto daemon = GetLogger(kLogDaemon);
  ASSERT_TRUE(SetLogLevel("error,epd.engine=trace").ok());
  EXPECT_EQ(engine->level(), spdlog::level::trace);
  EXPECT_EQ(daemon->level(), spdlog::level::err);
  // A logger created later (any epd.* name) gets the default level.
  EXPECT_EQ(GetLogger("epd.later_subsystem_test")->level(), spdlog::level::err);
  ASSERT_TRUE(SetLogLevel("debug").ok());
  EXPECT_EQ(engine->level(), spdlog::level::debug);
  EXPECT_EQ(daemon->level(), spdlog::level::debug);
}

TEST_F(LogLevelsTest, UnknownLoggerIsAnErrorNamingIt) {
  absl::StatusOr<LogLevels> levels = ParseLogLevels("info,epd.engin=trace");
  ASSERT_EQ(levels.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(levels.status().message()),
              AllOf(HasSubstr("log_level"), HasSubstr("\"epd.engin\""),
                    HasSubstr("is not a logger name"), HasSubstr("epd.engine")));
}

TEST_F(LogLevelsTest, BadItemsAreErrorsAndChangeNothing) {
  auto engine = GetLogger(kLogEngine);
  ASSERT_TRUE(SetLogLevel("warn").ok());
  for (const char* spec : {"verbose", "info,epd.engine=loud", "info,warn", "info,,epd.gpu=debug",
                           "epd.gpu=debug,epd.gpu=trace", "info,=debug"}) {
    SCOPED_TRACE(spec);
    absl::Status status = SetLogLevel(spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr("log_level"));
    EXPECT_EQ(engine->level(), spdlog::level::warn);
  }
  EXPECT_THAT(std::string(SetLogLevel("info,epd.engine=loud").message()), HasSubstr("loud"));
  // An empty item is named as such, wherever it stands.
  for (const char* spec : {"info,", "info,,epd.engine=trace", ",info"}) {
    SCOPED_TRACE(spec);
    EXPECT_THAT(std::string(SetLogLevel(spec).message()), HasSubstr("has an empty item"));
  }
}

TEST_F(LogLevelsTest, ConfigValidationAcceptsPerLoggerSpec) {
  v1::DaemonConfig config;
  FillDaemonConfigDefaults(&config);
  config.set_log_level("info,epd.engine=trace");
  EXPECT_TRUE(ValidateDaemonConfig(config).ok());
  config.set_log_level("info,epd.nope=trace");
  absl::Status status = ValidateDaemonConfig(config);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("epd.nope"));
}

}  // namespace
}  // namespace epd
