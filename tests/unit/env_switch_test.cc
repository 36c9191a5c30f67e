// The environment's on/off switches (common/env_switch.h): unset and empty take the default,
// "0" and "1" their meaning, anything else an INVALID_ARGUMENT naming the variable and value.
#include "common/env_switch.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>

namespace epd {
namespace {

constexpr char kName[] = "EPD_ENV_SWITCH_TEST";

TEST(EnvSwitchTest, UnsetAndEmptyTakeTheDefault) {
  unsetenv(kName);
  EXPECT_EQ(*SwitchFromEnv(kName, false), false);
  EXPECT_EQ(*SwitchFromEnv(kName, true), true);
  setenv(kName, "", 1);
  EXPECT_EQ(*SwitchFromEnv(kName, false), false);
  EXPECT_EQ(*SwitchFromEnv(kName, true), true);
  unsetenv(kName);
}

TEST(EnvSwitchTest, ZeroAndOneOverrideTheDefault) {
  setenv(kName, "0", 1);
  EXPECT_EQ(*SwitchFromEnv(kName, true), false);
  setenv(kName, "1", 1);
  EXPECT_EQ(*SwitchFromEnv(kName, false), true);
  unsetenv(kName);
}

TEST(EnvSwitchTest, AnyOtherValueIsRefusedNamingTheVariableAndValue) {
  for (const char* bad : {"yes", "true", "2", " 1", "10", "on"}) {
    setenv(kName, bad, 1);
    const absl::StatusOr<bool> on = SwitchFromEnv(kName, false);
    ASSERT_FALSE(on.ok()) << bad;
    EXPECT_EQ(on.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(on.status().message()),
              std::string(kName) + " = \"" + bad + "\" is not \"0\" or \"1\"");
  }
  unsetenv(kName);
}

}  // namespace
}  // namespace epd
