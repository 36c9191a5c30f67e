// moe_layer's rank processes and signals (the real epd --backend=host, the real moe_layer):
// - a rank process killed by SIGKILL is named in the summary, with the signal;
// - moe_layer itself killed by SIGKILL takes its rank processes with it (they hold the
//   group otherwise).
// The rank processes are found in /proc (children of moe_layer whose command line ends in
// --rank=N), not through a test-only flag.
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"

namespace epd::testing {
namespace {

using ::testing::HasSubstr;

std::string MoeLayerBinary() { return std::string(EPD_EXAMPLES_DIR) + "/moe_layer"; }

std::string ReadProcFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

/// The parent pid and state of `pid` from /proc/<pid>/stat; false when it is gone.
bool ProcStat(pid_t pid, pid_t* ppid, char* state) {
  const std::string stat = ReadProcFile(absl::StrCat("/proc/", pid, "/stat"));
  // "pid (comm) S ppid ...": comm may hold spaces and parentheses; the last ')' ends it.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return false;
  std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 1), ' ', absl::SkipEmpty());
  int parent = 0;
  if (fields.size() < 2 || fields[0].empty() || !absl::SimpleAtoi(fields[1], &parent)) {
    return false;
  }
  *state = fields[0][0];
  *ppid = parent;
  return true;
}

/// Alive: exists in /proc and is not a zombie (a zombie has ended; only its reaping waits).
bool Alive(pid_t pid) {
  pid_t ppid = 0;
  char state = 0;
  return ProcStat(pid, &ppid, &state) && state != 'Z' && state != 'X';
}

/// The rank processes of moe_layer `parent`: rank → pid, for children that exec'd already
/// (their command line carries --rank=N).
std::map<int, pid_t> RankChildren(pid_t parent) {
  std::map<int, pid_t> ranks;
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) return ranks;
  while (const dirent* entry = ::readdir(dir)) {
    int pid = 0;
    if (!absl::SimpleAtoi(entry->d_name, &pid)) continue;
    pid_t ppid = 0;
    char state = 0;
    if (!ProcStat(pid, &ppid, &state) || ppid != parent || state == 'Z') continue;
    const std::string cmdline = ReadProcFile(absl::StrCat("/proc/", pid, "/cmdline"));
    for (absl::string_view arg : absl::StrSplit(cmdline, '\0')) {
      int rank = -1;
      if (absl::ConsumePrefix(&arg, "--rank=") && absl::SimpleAtoi(arg, &rank) && rank >= 0) {
        ranks[rank] = pid;
      }
    }
  }
  ::closedir(dir);
  return ranks;
}

/// Polls until moe_layer `p` has `num_ranks` rank processes; empty on timeout or exit.
std::map<int, pid_t> WaitForRankChildren(Subprocess& p, int num_ranks, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline && p.Running()) {
    std::map<int, pid_t> ranks = RankChildren(p.pid());
    if (static_cast<int>(ranks.size()) == num_ranks) return ranks;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return {};
}

class MoeLayerProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonProcessOptions o;
    o.tcp = false;
    o.log_level = "info";
    o.extra_args = {"--op_timeout=2s"};
    auto epd = DaemonProcess::Start(o);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
  }
  void TearDown() override {
    // Whatever happened, no rank process outlives the test.
    for (const auto& [rank, pid] : ranks_) {
      if (Alive(pid)) ::kill(pid, SIGKILL);
    }
  }

  /// Starts moe_layer (moe_) with kNumRanks ranks and more iterations than the test lasts,
  /// and waits until its rank processes run (ranks_).
  void StartMoeLayerAndFindRanks() {
    SubprocessOptions o;
    o.stdout_path = epd_->dir() + "/moe.out";
    o.stderr_path = epd_->dir() + "/moe.err";
    auto p = Subprocess::Spawn(
        {MoeLayerBinary(), "--socket=" + epd_->socket_path(),
         absl::StrCat("--num_ranks=", kNumRanks), absl::StrCat("--num_experts=", 2 * kNumRanks),
         "--hidden=128", "--topk=2", "--tokens=8", "--iters=1000000"},
        o);
    ASSERT_TRUE(p.ok()) << p.status();
    moe_ = *std::move(p);
    ranks_ = WaitForRankChildren(*moe_, kNumRanks, absl::Seconds(60));
    ASSERT_EQ(static_cast<int>(ranks_.size()), kNumRanks) << moe_->Stdout() << moe_->Stderr();
  }

  static constexpr int kNumRanks = 4;
  std::unique_ptr<DaemonProcess> epd_;
  std::unique_ptr<Subprocess> moe_;
  std::map<int, pid_t> ranks_;  ///< rank → pid of its process.
};

TEST_F(MoeLayerProcessTest, ARankKilledBySignalIsNamedInTheSummary) {
  ASSERT_NO_FATAL_FAILURE(StartMoeLayerAndFindRanks());
  const int victim = 2;
  ASSERT_EQ(::kill(ranks_[victim], SIGKILL), 0) << std::strerror(errno);

  // The other ranks fail within op_timeout (2 s) of their next op; generous for a loaded
  // machine.
  absl::StatusOr<int> rc = moe_->Wait(absl::Seconds(120));
  ASSERT_TRUE(rc.ok()) << rc.status() << "\n" << moe_->Stdout() << moe_->Stderr();
  EXPECT_EQ(*rc, 1) << moe_->Stdout() << moe_->Stderr();
  const std::string out = moe_->Stdout();
  EXPECT_THAT(out, HasSubstr(absl::StrCat("rank ", victim, " (pid ", ranks_[victim],
                                          ") was killed by signal 9 (SIGKILL)")))
      << out << moe_->Stderr();
  EXPECT_THAT(out, HasSubstr(absl::StrCat("of ", kNumRanks, " ranks failed"))) << out;
  // Only the victim died by a signal.
  int killed_lines = 0;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StrContains(line, "killed by signal")) ++killed_lines;
  }
  EXPECT_EQ(killed_lines, 1) << out;
}

// A rank's error is printed as StatusText ("CODE: message [EPD-4004 QUOTA_EXCEEDED]"), not
// absl's ToString, which appended the reason payload's raw bytes
// ("[type.googleapis.com/epd.v1.ErrorInfo='...']"). Here the daemon lets a uid hold one
// endpoint, so one rank's join is refused.
TEST(MoeLayerErrorTextTest, ARanksErrorNamesItsReasonNotThePayloadBytes) {
  DaemonProcessOptions o;
  o.tcp = false;
  o.log_level = "info";
  o.extra_args = {"--op_timeout=2s", "--max_endpoints_per_uid=1"};
  absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(o);
  ASSERT_TRUE(epd.ok()) << epd.status();
  SubprocessOptions so;
  so.stdout_path = (*epd)->dir() + "/moe.out";
  so.stderr_path = (*epd)->dir() + "/moe.err";
  auto p =
      Subprocess::Spawn({MoeLayerBinary(), "--socket=" + (*epd)->socket_path(), "--num_ranks=2",
                         "--num_experts=4", "--hidden=128", "--topk=2", "--tokens=8", "--iters=1"},
                        so);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<int> rc = (*p)->Wait(absl::Seconds(120));
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ(*rc, 1) << (*p)->Stdout() << (*p)->Stderr();
  const std::string err = (*p)->Stderr();
  EXPECT_THAT(err, HasSubstr(": join: RESOURCE_EXHAUSTED: ")) << err;
  EXPECT_THAT(err, HasSubstr("[EPD-4004 QUOTA_EXCEEDED]")) << err;
  EXPECT_THAT(err, ::testing::Not(HasSubstr("type.googleapis.com"))) << err;
}

TEST_F(MoeLayerProcessTest, RankProcessesDieWithAKilledParent) {
  ASSERT_NO_FATAL_FAILURE(StartMoeLayerAndFindRanks());
  moe_->Signal(SIGKILL);
  absl::StatusOr<int> rc = moe_->Wait(absl::Seconds(30));
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ(*rc, -SIGKILL);

  // PR_SET_PDEATHSIG delivers SIGKILL to every rank process as the parent dies; allow a
  // loaded machine some seconds to get there.
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  std::vector<std::string> alive;
  do {
    alive.clear();
    for (const auto& [rank, pid] : ranks_) {
      if (Alive(pid)) alive.push_back(absl::StrCat("rank ", rank, " (pid ", pid, ")"));
    }
    if (alive.empty()) break;
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < deadline);
  EXPECT_TRUE(alive.empty()) << "still running 15 s after moe_layer was killed: "
                             << absl::StrJoin(alive, ", ");
}

}  // namespace
}  // namespace epd::testing
