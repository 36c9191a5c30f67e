// Daemon start-up checks of the config, run in-process (daemon/daemon.h): what a user gets
// from epd for a config value that cannot work (an unknown socket_group), and what
// start-up says about the values it was given.
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "daemon/config.h"
#include "daemon/daemon.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_data_plane.h"

namespace epd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

class DaemonStartupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/epd_startup_test_XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  v1::DaemonConfig Config() {
    v1::DaemonConfig config;
    config.set_socket_path(dir_ + "/epd.sock");
    config.set_socket_mode("0600");
    config.set_log_level("warn");
    config.set_backend(v1::BACKEND_HOST);
    FillDaemonConfigDefaults(&config);
    return config;
  }
  /// No GPU; the real data plane when `fake` is false.
  DaemonOptions Options(bool fake = true) {
    DaemonOptions options;
    options.inventory = GpuInventory::FromList({}, "no CUDA device found (test)");
    options.drain_grace = absl::Milliseconds(10);
    if (fake) {
      auto state = std::make_shared<testing::FakeDataPlaneState>();
      options.data_plane_factory =
          [state](const v1::DaemonConfig&,
                  const BackendChoice&) -> absl::StatusOr<std::unique_ptr<DataPlane>> {
        return std::unique_ptr<DataPlane>(new testing::FakeDataPlane(state));
      };
    }
    return options;
  }

  std::string dir_;
};

// With the real (host) data plane, whose first shm region is owned by the group: the
// error names the field and the flag, not only the group, and nothing is left behind.
TEST_F(DaemonStartupTest, UnknownSocketGroupNamesTheFieldWithTheRealDataPlane) {
  v1::DaemonConfig config = Config();
  config.set_socket_group("no-such-group-epd");
  absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(config, Options(false));
  EXPECT_EQ(daemon.status().code(), absl::StatusCode::kNotFound) << daemon.status();
  EXPECT_THAT(std::string(daemon.status().message()),
              AllOf(HasSubstr("socket_group"), HasSubstr("--socket_group"),
                    HasSubstr("\"no-such-group-epd\""), HasSubstr("not a group")));
  EXPECT_FALSE(std::filesystem::exists(config.socket_path()));
}

}  // namespace
}  // namespace epd
