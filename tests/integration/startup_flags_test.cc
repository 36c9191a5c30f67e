// epd's start-up flags as a user meets them: the real binary, its exit code and its log
// (daemon/config.h, daemon/main.cc). Values that cannot work are refused naming the flag
// and the value; values that work but deserve a word are logged.
#include <filesystem>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/subprocess.h"

namespace epd::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

/// Starts epd with `extra_args` expecting it to refuse; returns its exit code and log.
std::pair<int, std::string> RefusedStart(const std::vector<std::string>& extra_args,
                                         const std::string& config_text = "") {
  DaemonProcessOptions options;
  options.extra_args = extra_args;
  options.config_text = config_text;
  options.wait_serving = false;
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
  EXPECT_TRUE(epd.ok()) << epd.status();
  if (!epd.ok()) return {-1000, ""};
  absl::StatusOr<int> code = (*epd)->WaitExit(absl::Seconds(20));
  EXPECT_TRUE(code.ok()) << code.status();
  return {code.ok() ? *code : -1000, (*epd)->Logs()};
}

TEST(StartupFlagsTest, UnknownSocketGroupNamesTheFlagAndTheValue) {
  auto [code, logs] = RefusedStart({"--socket_group=no-such-group-epd"});
  EXPECT_EQ(code, 1) << logs;
  EXPECT_THAT(logs, AllOf(HasSubstr("socket_group"), HasSubstr("--socket_group"),
                          HasSubstr("\"no-such-group-epd\" is not a group")));
}

}  // namespace
}  // namespace epd::testing
