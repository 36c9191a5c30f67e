// Daemon start-up checks of the config, run in-process (daemon/core/daemon.h): what a user gets
// from epd for a config value that cannot work (an unknown socket_group), and what
// start-up says about the values it was given.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/flags/reflection.h"
#include "daemon/core/config.h"
#include "daemon/core/daemon.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/config_flags_testing.h"
#include "tests/unit/fake_data_plane.h"

namespace epd {
namespace {

using ::epd::testing::GiveFlag;
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

// The backend line names where the backend came from: the config file (with its path), the
// command line, or an in-process DaemonConfig; never "--backend=host" for a file's value.
TEST_F(DaemonStartupTest, BackendReasonNamesWhereTheValueCameFrom) {
  const std::string path = dir_ + "/epd.textproto";
  std::ofstream(path) << "backend: BACKEND_HOST\nsocket_path: \"" << dir_
                      << "/epd.sock\"\nlog_level: \"warn\"\n";
  {
    absl::FlagSaver saver;
    GiveFlag("config", path);
    const ConfigFlags flags = ConfigFlagsFromCommandLine();
    absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(flags);
    ASSERT_TRUE(config.ok()) << config.status();
    DaemonOptions options = Options();
    options.backend_source = BackendSource(*config, flags);  // as main.cc does
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(*config, options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    EXPECT_EQ((*daemon)->backend().backend, "host");
    EXPECT_EQ((*daemon)->backend().reason,
              "requested by `backend: BACKEND_HOST` in the config file " + path);
    EXPECT_EQ((*daemon)->Stats().backend_reason(), (*daemon)->backend().reason);
  }
  {
    absl::FlagSaver saver;
    GiveFlag("config", path);
    GiveFlag("backend", "host");
    const ConfigFlags flags = ConfigFlagsFromCommandLine();
    absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(flags);
    ASSERT_TRUE(config.ok()) << config.status();
    DaemonOptions options = Options();
    options.backend_source = BackendSource(*config, flags);  // as main.cc does
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(*config, options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    EXPECT_EQ((*daemon)->backend().reason, "requested by --backend=host on the command line");
  }
  absl::StatusOr<std::unique_ptr<Daemon>> in_process = Daemon::Start(Config(), Options());
  ASSERT_TRUE(in_process.ok()) << in_process.status();
  EXPECT_EQ((*in_process)->backend().reason,
            "requested by `backend: BACKEND_HOST` in the DaemonConfig");
  in_process->reset();

  // --backend=cuda without a GPU: the refusal names the source too.
  {
    absl::FlagSaver saver;
    GiveFlag("config", path);
    GiveFlag("backend", "cuda");
    const ConfigFlags flags = ConfigFlagsFromCommandLine();
    absl::StatusOr<v1::DaemonConfig> config = ResolveDaemonConfig(flags);
    ASSERT_TRUE(config.ok()) << config.status();
    DaemonOptions options = Options();
    options.backend_source = BackendSource(*config, flags);  // as main.cc does
    absl::StatusOr<std::unique_ptr<Daemon>> daemon = Daemon::Start(*config, options);
    EXPECT_EQ(daemon.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(daemon.status().message()),
                HasSubstr("cuda requested by --backend=cuda on the command line but no GPU"));
  }
}

}  // namespace
}  // namespace epd
