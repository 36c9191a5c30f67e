// The deploy/ scripts and files against what they promise (no build, no install, no epd):
// - deploy/demo.sh refuses a bad EPD_* input (exit 2, naming the variable and the allowed
//   values) before it installs or builds anything;
// - the README section deploy/install-deps.sh points to exists;
// - every Documentation=file:// page of the systemd unit is installed by its install steps;
// - the systemd unit keeps restarting epd (Restart=always, no start limit).
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/subprocess.h"

namespace epd::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

/// The repository root (EPD_SOURCE_DIR, tests/CMakeLists.txt: __FILE__ is relative when
/// ccache rewrites paths against its base_dir).
std::filesystem::path RepoRoot() { return EPD_SOURCE_DIR; }

std::string ReadText(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Each bad input is refused at the top of demo.sh. The tools that install and build
// (cmake, ninja, apt-get, sudo, dpkg-query, nvcc) are stand-ins on PATH that leave a mark
// and fail, so even a demo.sh without the checks can neither install nor build here.
TEST(DeployScriptsTest, DemoRefusesBadInputsBeforeInstallingOrBuilding) {
  const std::filesystem::path demo = RepoRoot() / "deploy/demo.sh";
  ASSERT_TRUE(std::filesystem::exists(demo)) << demo;
  const std::string dir = MakeTempDir("epd_demo_test_");
  const std::string fakes = dir + "/bin";
  std::filesystem::create_directory(fakes);
  for (const char* tool : {"cmake", "ninja", "apt-get", "sudo", "dpkg-query", "nvcc"}) {
    const std::string path = absl::StrCat(fakes, "/", tool);
    std::ofstream(path) << "#!/bin/sh\ntouch \"" << dir << "/ran-" << tool << "\"\nexit 97\n";
    ASSERT_EQ(::chmod(path.c_str(), 0755), 0) << path;
  }
  const std::string build_dir = dir + "/build";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"EPD_DEMO_RANKS=3", {"EPD_DEMO_RANKS=3", "1, 2, 4, 8, 16 or 32"}},
      {"EPD_DEMO_RANKS=eight", {"EPD_DEMO_RANKS=eight", "1, 2, 4, 8, 16 or 32"}},
      {"EPD_BACKEND=gpu", {"EPD_BACKEND=gpu", "auto, cuda or host"}},
      {"EPD_WITH_CUDA=maybe", {"EPD_WITH_CUDA=maybe", "AUTO, ON or OFF"}},
      {"EPD_BUILD_TYPE=fast", {"EPD_BUILD_TYPE=fast", "Release"}},
      {"EPD_JOBS=0", {"EPD_JOBS=0", "positive"}},
  };
  for (const auto& [assignment, messages] : cases) {
    absl::StatusOr<CommandResult> result =
        RunCommand({"/usr/bin/env", assignment, "PATH=" + fakes + ":/usr/bin:/bin",
                    "EPD_BUILD_DIR=" + build_dir, "/bin/bash", demo.string()},
                   absl::Seconds(60));
    ASSERT_TRUE(result.ok()) << assignment << ": " << result.status();
    EXPECT_EQ(result->exit_code, 2) << assignment << ": " << result->stderr_text;
    for (const std::string& message : messages) {
      EXPECT_THAT(result->stderr_text, HasSubstr(message)) << assignment;
    }
    EXPECT_THAT(result->stdout_text, ::testing::Not(HasSubstr("==> "))) << assignment;
    for (const char* tool : {"cmake", "ninja", "apt-get", "sudo", "dpkg-query", "nvcc"}) {
      EXPECT_FALSE(std::filesystem::exists(absl::StrCat(dir, "/ran-", tool)))
          << assignment << ": demo.sh ran " << tool << " before refusing the input";
      std::filesystem::remove(absl::StrCat(dir, "/ran-", tool));
    }
    EXPECT_FALSE(std::filesystem::exists(build_dir)) << assignment;
  }
  std::filesystem::remove_all(dir);
}

// install-deps.sh sends the reader to a README section by name: that section exists.
TEST(DeployScriptsTest, InstallDepsPointsToAnExistingReadmeSection) {
  const std::string script = ReadText(RepoRoot() / "deploy/install-deps.sh");
  const std::string readme = ReadText(RepoRoot() / "README.md");
  ASSERT_FALSE(script.empty());
  ASSERT_FALSE(readme.empty());
  int references = 0;
  for (absl::string_view rest = script;;) {
    const size_t at = rest.find("README.md, \"");
    if (at == absl::string_view::npos) break;
    rest.remove_prefix(at + 12);
    const std::string section(rest.substr(0, rest.find('"')));
    ++references;
    bool found = false;
    for (absl::string_view line : absl::StrSplit(readme, '\n')) {
      if (!absl::ConsumePrefix(&line, "#")) continue;
      while (absl::ConsumePrefix(&line, "#")) {
      }
      if (absl::StripAsciiWhitespace(line) == section) found = true;
    }
    EXPECT_TRUE(found) << "deploy/install-deps.sh names README section \"" << section
                       << "\", which README.md has no heading for";
  }
  EXPECT_GT(references, 0);
}

// Documentation=file:///... pages of the unit exist once its install steps have run: each
// is installed by an `install ... -t <its directory> ... <its file name>` line of the
// unit's header.
TEST(DeployScriptsTest, SystemdDocumentationPagesAreInstalledByTheUnitsSteps) {
  const std::string unit = ReadText(RepoRoot() / "deploy/systemd/epd.service");
  ASSERT_FALSE(unit.empty());
  std::vector<std::string> install_lines;
  for (absl::string_view line : absl::StrSplit(unit, '\n')) {
    if (absl::StartsWith(line, "#") && absl::StrContains(line, " install ")) {
      install_lines.emplace_back(line);
    }
  }
  for (absl::string_view line : absl::StrSplit(unit, '\n')) {
    if (!absl::ConsumePrefix(&line, "Documentation=")) continue;
    for (absl::string_view uri : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      if (!absl::ConsumePrefix(&uri, "file://")) continue;
      const std::filesystem::path page{std::string(uri)};
      bool installed = false;
      for (const std::string& install : install_lines) {
        if (absl::StrContains(install, "-t " + page.parent_path().string()) &&
            absl::StrContains(install, page.filename().string())) {
          installed = true;
        }
      }
      EXPECT_TRUE(installed) << "Documentation=file://" << uri
                             << " is not installed by any install step of the unit";
      EXPECT_TRUE(std::filesystem::exists(RepoRoot() / "docs" / page.filename()) ||
                  std::filesystem::exists(RepoRoot() / page.filename()))
          << page.filename() << " is not in the repository";
    }
  }
}

/// The value of `key` in the unit file `unit` ("" when absent; the last one wins, as in
/// systemd).
std::string UnitValue(const std::string& unit, absl::string_view key) {
  std::string value;
  for (absl::string_view line : absl::StrSplit(unit, '\n')) {
    if (absl::ConsumePrefix(&line, key) && absl::ConsumePrefix(&line, "=")) {
      value = std::string(absl::StripAsciiWhitespace(line));
    }
  }
  return value;
}

/// A systemd time span in seconds ("2s", "2", "500ms", "1min"); -1 when not understood.
double UnitSeconds(absl::string_view span) {
  for (const auto& [suffix, scale] :
       {std::pair<absl::string_view, double>{"ms", 0.001}, {"min", 60}, {"s", 1}, {"", 1}}) {
    absl::string_view number = span;
    if (!absl::ConsumeSuffix(&number, suffix)) continue;
    double value = 0;
    if (absl::SimpleAtod(number, &value)) return value * scale;
  }
  return -1;
}

// The unit keeps epd running: restarted whatever ended it (a crash, a kill, a failed start),
// at a pace, and never given up on: a start limit would let a client that can crash epd
// keep it down for good by crashing it a few times in a row.
TEST(DeployScriptsTest, SystemdUnitKeepsRestartingEpd) {
  const std::string unit = ReadText(RepoRoot() / "deploy/systemd/epd.service");
  ASSERT_FALSE(unit.empty());
  EXPECT_EQ(UnitValue(unit, "Restart"), "always");
  const double restart_sec = UnitSeconds(UnitValue(unit, "RestartSec"));
  EXPECT_GE(restart_sec, 1) << "RestartSec=" << UnitValue(unit, "RestartSec");
  EXPECT_LE(restart_sec, 30) << "RestartSec=" << UnitValue(unit, "RestartSec");
  // StartLimitIntervalSec=0 disables the start limit; systemd's default (5 starts in 10 s)
  // applies when it is not set.
  const std::string interval = UnitValue(unit, "StartLimitIntervalSec");
  EXPECT_TRUE(interval == "0" || interval == "infinity")
      << "StartLimitIntervalSec=" << interval << ": restarts can reach the start limit";
  // Only a configuration epd refuses (exit 2) may stop the restarts; never a signal.
  for (absl::string_view status :
       absl::StrSplit(UnitValue(unit, "RestartPreventExitStatus"), ' ', absl::SkipEmpty())) {
    EXPECT_EQ(status, "2") << "RestartPreventExitStatus= holds " << status;
  }
}

}  // namespace
}  // namespace epd::testing
