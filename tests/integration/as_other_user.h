// The base of integration tests that run clients as other users than epd's (root) through
// setpriv: skipped with the reason when the test is not root or setpriv is missing; epd's
// log is printed when a test fails.
#pragma once

#include <unistd.h>

#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"

namespace epd::testing {

class AsOtherUserTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to run clients as other users";
    if (::access("/usr/bin/setpriv", X_OK) != 0) GTEST_SKIP() << "needs setpriv (util-linux)";
  }
  void TearDown() override {
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
  }
  /// Starts epd (no TCP listener) with `extra_args`; its socket is in a fresh 0700
  /// directory of root's.
  void StartEpd(std::vector<std::string> extra_args = {}) {
    DaemonProcessOptions options;
    options.tcp = false;
    options.extra_args = std::move(extra_args);
    auto epd = DaemonProcess::Start(options);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
  }

  std::unique_ptr<DaemonProcess> epd_;
};

}  // namespace epd::testing
