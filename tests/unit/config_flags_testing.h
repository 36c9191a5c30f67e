// Test helper for epd's flags (daemon/core/config.cc): set one as the command line would.
#pragma once

#include <string>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "gtest/gtest.h"

namespace epd::testing {

/// Sets flag `name` as "--name=value" on the command line would: through the flag's parser,
/// so ConfigFlagsFromCommandLine sees it as given. Restore the flags with an
/// absl::FlagSaver in the calling test.
inline void GiveFlag(const std::string& name, const std::string& value) {
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  ASSERT_NE(flag, nullptr) << name;
  std::string error;
  ASSERT_TRUE(flag->ParseFrom(value, &error)) << "--" << name << "=" << value << ": " << error;
}

}  // namespace epd::testing
