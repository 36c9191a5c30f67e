// epd's start-up flags as a user meets them: the real binary, its exit code and its log
// (daemon/core/config.h, daemon/main.cc). Values that cannot work are refused naming the flag
// and the value; values that work but deserve a word are logged.
#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"

namespace epd::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

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

// A failed start is reported even when the log level hides errors.
TEST(StartupFlagsTest, FailedStartIsReportedAtEveryLogLevel) {
  for (const char* level : {"off", "critical"}) {
    auto [code, logs] =
        RefusedStart({"--socket_group=no-such-group-epd", std::string("--log_level=") + level});
    EXPECT_EQ(code, 1) << level << ": " << logs;
    EXPECT_THAT(logs, AllOf(HasSubstr("failed to start"), HasSubstr("no-such-group-epd"))) << level;
  }
}

// A stray argument (e.g. a config file without --config=) is refused, not ignored.
TEST(StartupFlagsTest, PositionalArgumentIsRefusedNamingIt) {
  auto [code, logs] = RefusedStart({"/etc/epd.textproto"});
  EXPECT_EQ(code, 2) << logs;
  EXPECT_THAT(logs, AllOf(HasSubstr("unexpected argument \"/etc/epd.textproto\""),
                          HasSubstr("--config=PATH")));
  EXPECT_THAT(logs, Not(HasSubstr("starting")));
}

// A flag value that does not parse is refused by the flag parser (exit 1, absl's), saying
// what a value looks like: a duration without its unit was "Illegal value '10'" alone.
TEST(StartupFlagsTest, UnparsableFlagValueSaysWhatAValueLooksLike) {
  {
    auto [code, logs] = RefusedStart({"--op_timeout=10"});
    EXPECT_NE(code, 0) << logs;
    EXPECT_THAT(logs, AllOf(HasSubstr("'10'"), HasSubstr("op_timeout"),
                            HasSubstr("need a number with its unit, e.g. 10s")));
  }
  {
    auto [code, logs] = RefusedStart({"--engine_idle_us=-5"});
    EXPECT_NE(code, 0) << logs;
    EXPECT_THAT(logs, HasSubstr("need a whole number from 0 to 4294967295"));
  }
}

// "--socket=" is refused (exit 2, before anything starts), not read as the default socket.
TEST(StartupFlagsTest, EmptySocketFlagIsRefusedNamingIt) {
  auto [code, logs] = RefusedStart({"--socket="});
  EXPECT_EQ(code, 2) << logs;
  EXPECT_THAT(logs, AllOf(HasSubstr("--socket: \"\""), HasSubstr("empty")));
  EXPECT_THAT(logs, Not(HasSubstr("starting")));
}

// A socket in a directory that does not exist: epd creates it (example configs rely on
// it) and says so at info level, naming the field and every directory it made.
TEST(StartupFlagsTest, MissingSocketDirectoryIsCreatedAndLogged) {
  const std::string dir = MakeTempDir("epd_startup_dir");
  DaemonProcessOptions options;
  options.socket_path = dir + "/typo/sub/epd.sock";
  options.log_level = "info";
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/typo/sub"));
  EXPECT_EQ(*(*epd)->Stop(), 0);
  std::string line;
  for (absl::string_view l : absl::StrSplit((*epd)->Logs(), '\n')) {
    if (absl::StrContains(l, "created the missing directory")) line = std::string(l);
  }
  EXPECT_THAT(line, AllOf(HasSubstr("[info] socket_path: created the missing directory " + dir +
                                    "/typo/sub (from " + dir + "/typo down)"),
                          HasSubstr("--socket")));
  std::filesystem::remove_all(dir);
}

// A daemon configured for rdma that cannot run it (here: a device that does not exist)
// exits non-zero with the preflight's reason before it creates or binds anything: no
// socket directory, no socket, no Peer or data listener, no health listener.
TEST(StartupFlagsTest, RdmaThatCannotRunIsRefusedBeforeAnythingIsCreatedOrBound) {
  const std::string dir = MakeTempDir("epd_startup_rdma");
  DaemonProcessOptions options;
  options.socket_path = dir + "/sub/epd.sock";
  options.log_level = "info";
  options.peer = true;
  options.wait_serving = false;
  options.extra_args = {"--transport=rdma", "--rdma_devices=epd_no_such_nic0"};
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
  ASSERT_TRUE(epd.ok()) << epd.status();
  absl::StatusOr<int> code = (*epd)->WaitExit(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  const std::string logs = (*epd)->Logs();
  EXPECT_EQ(*code, 1) << logs;
  EXPECT_THAT(logs, AllOf(HasSubstr("transport: \"rdma\" is configured but this daemon cannot "
                                    "run it"),
                          HasSubstr("refuse: RDMA: rdma.devices names epd_no_such_nic0:1")));
  // Nothing was created or bound: no directory for the socket, no listener announced.
  EXPECT_FALSE(std::filesystem::exists(dir + "/sub")) << logs;
  EXPECT_THAT(logs,
              AllOf(Not(HasSubstr("Peer service on")), Not(HasSubstr("data listener")),
                    Not(HasSubstr("TCP listener")), Not(HasSubstr("TCP transport listening"))));
  std::filesystem::remove_all(dir);
}

// shm_mode is deprecated: --shm_mode=0777 (or any value, valid or not) still starts, and
// start-up warns that it is ignored, naming the field and the value.
TEST(StartupFlagsTest, DeprecatedShmModeStartsAndIsWarnedAboutAsIgnored) {
  for (const std::string& value : {"0777", "rw-rw----"}) {
    DaemonProcessOptions options;
    options.extra_args = {"--shm_mode=" + value};
    options.log_level = "info";
    absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
    ASSERT_TRUE(epd.ok()) << epd.status();
    EXPECT_EQ(*(*epd)->Stop(), 0);
    EXPECT_THAT((*epd)->Logs(), HasSubstr("[epd.config] [warning] shm_mode: \"" + value +
                                          "\" is deprecated and ignored"));
  }
}

// "backend: BACKEND_HOST" in the config file: the start-up line says so (with the file),
// not "--backend=host requested"; given as a flag, it says the command line.
TEST(StartupFlagsTest, BackendLineNamesTheConfigFileOrTheFlag) {
  DaemonProcessOptions options;
  options.backend = "";  // Not on the command line.
  options.config_text = "backend: BACKEND_HOST\n";
  options.log_level = "info";
  absl::StatusOr<std::unique_ptr<DaemonProcess>> from_file = DaemonProcess::Start(options);
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(*(*from_file)->Stop(), 0);
  EXPECT_THAT((*from_file)->Logs(),
              AllOf(HasSubstr("backend host (requested by `backend: BACKEND_HOST` in the config "
                              "file " +
                              (*from_file)->dir() + "/epd.textproto)"),
                    Not(HasSubstr("--backend=host"))));

  options.backend = "host";
  absl::StatusOr<std::unique_ptr<DaemonProcess>> from_flag = DaemonProcess::Start(options);
  ASSERT_TRUE(from_flag.ok()) << from_flag.status();
  EXPECT_EQ(*(*from_flag)->Stop(), 0);
  EXPECT_THAT((*from_flag)->Logs(),
              HasSubstr("backend host (requested by --backend=host on the command line)"));
}

// Every flag shows its real default (std::optional flags showed "default: ;"), each flag's
// help names its DaemonConfig field, and the usage line does not repeat the program name.
TEST(StartupFlagsTest, HelpShowsEveryFlagsDefault) {
  absl::StatusOr<CommandResult> help = RunCommand({EpdBinary(), "--help"});
  ASSERT_TRUE(help.ok()) << help.status();
  // --help wraps at 80 columns, between any two words: compare with single spaces.
  const std::string text = absl::StrJoin(absl::StrSplit(help->stdout_text + help->stderr_text,
                                                        absl::ByAnyChar(" \n"), absl::SkipEmpty()),
                                         " ");
  EXPECT_THAT(text, Not(HasSubstr("default: ;")));
  EXPECT_THAT(text, Not(HasSubstr("epd: epd:")));
  // The flags' file as in the source tree, not the build machine's path to it.
  EXPECT_THAT(text, HasSubstr("Flags from daemon/core/config.cc:"));
  for (const char* expected : {"--socket (socket_path:", "default: \"/run/epd/epd.sock\";",
                               "--op_timeout (op_timeout_ms:", "default: 10s;",
                               "--max_groups (max_groups:", "default: 64;", "default: \"auto\";",
                               "--gpu_uuids (gpu_uuids:", "--config ("}) {
    EXPECT_THAT(text, HasSubstr(expected));
  }
}

}  // namespace
}  // namespace epd::testing
