// Data-plane integration tests (issue: shm data plane, client library, host backend):
// the real `epd --backend=host` with real client processes.
// - moe_layer over R = 2, 4, 8 processes matches the single-process layer;
// - two groups at once in one daemon;
// - the bad-input matrix (tests/integration/clients/dp_client.cc --scenario=bad_inputs)
//   while another group keeps running;
// - a rank killed mid-op: the others get DEADLINE_EXCEEDED within op_timeout + 1 s, and
//   the group works again once the rank rejoins.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"

namespace epd::testing {
namespace {

std::string MoeLayerBinary() { return std::string(EPD_EXAMPLES_DIR) + "/moe_layer"; }
std::string DpClientBinary() { return std::string(EPD_TEST_BIN_DIR) + "/epd_dp_client"; }

std::unique_ptr<DaemonProcess> StartEpd(const std::string& op_timeout = "2s") {
  DaemonProcessOptions o;
  o.tcp = false;
  o.log_level = "info";
  o.extra_args = {absl::StrCat("--op_timeout=", op_timeout)};
  auto epd = DaemonProcess::Start(o);
  EXPECT_TRUE(epd.ok()) << epd.status();
  return epd.ok() ? std::move(*epd) : nullptr;
}

std::unique_ptr<Subprocess> Spawn(const std::vector<std::string>& argv, const std::string& dir,
                                  const std::string& name) {
  SubprocessOptions o;
  o.stdout_path = dir + "/" + name + ".out";
  o.stderr_path = dir + "/" + name + ".err";
  auto p = Subprocess::Spawn(argv, o);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(*p) : nullptr;
}

/// Waits for `p` and expects exit code 0, printing its output otherwise.
void ExpectSuccess(Subprocess& p, const std::string& what, absl::Duration timeout,
                   const DaemonProcess& epd) {
  auto rc = p.Wait(timeout);
  ASSERT_TRUE(rc.ok()) << what << ": " << rc.status() << "\n" << p.Stdout() << p.Stderr();
  EXPECT_EQ(*rc, 0) << what << " stdout:\n"
                    << p.Stdout() << "stderr:\n"
                    << p.Stderr() << "epd log:\n"
                    << epd.Logs();
}

// Bad flags are refused before any process is forked or epd is contacted (exit 2),
// naming the flag: --hidden not a multiple of 128 with --fp8 (the default) among them.
TEST(MoeLayerFlagsTest, BadFlagsAreRefusedNamingThem) {
  const std::string dir = ::testing::TempDir();
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--hidden=200"}, "--hidden=200 is not a multiple of 128, which --fp8 needs"},
      {{"--num_ranks=3"}, "--num_experts=32 is not a positive multiple of --num_ranks=3"},
      {{"--launch_mode=gpu"}, "--launch_mode=gpu must be auto, daemon or client"},
      {{"--tolerance=-1"}, "--tolerance=-1 must be a finite number >= 0"},
      {{"--tolerance=nan"}, "--tolerance=nan must be a finite number >= 0"},
  };
  for (const auto& [flags, message] : cases) {
    std::vector<std::string> argv = {MoeLayerBinary(), "--socket=/nonexistent/epd.sock"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto p = Spawn(argv, dir, "moe_bad");
    ASSERT_NE(p, nullptr);
    auto rc = p->Wait(absl::Seconds(30));
    ASSERT_TRUE(rc.ok()) << rc.status();
    EXPECT_EQ(*rc, 2) << flags[0] << "\n" << p->Stderr();
    EXPECT_NE(p->Stderr().find(message), std::string::npos) << p->Stderr();
  }
}

class MoeLayerTest : public ::testing::TestWithParam<int> {};

/// op_timeout of the correctness tests: the rank processes start one by one, and the
/// group's first op waits op_timeout for the last to join, which on a loaded machine or
/// under a sanitizer build (tests/sanitize.sh) can be seconds after the first.
constexpr char kCorrectnessOpTimeout[] = "10s";

TEST_P(MoeLayerTest, MatchesSingleProcessLayer) {
  const int R = GetParam();
  auto epd = StartEpd(kCorrectnessOpTimeout);
  ASSERT_NE(epd, nullptr);
  auto p = Spawn({MoeLayerBinary(), "--socket=" + epd->socket_path(),
                  absl::StrCat("--num_ranks=", R), absl::StrCat("--num_experts=", 4 * R),
                  "--hidden=256", "--topk=3", "--tokens=24", "--iters=2"},
                 epd->dir(), "moe");
  ASSERT_NE(p, nullptr);
  ExpectSuccess(*p, "moe_layer", absl::Seconds(120), *epd);
  EXPECT_NE(p->Stdout().find("all ranks match"), std::string::npos) << p->Stdout();
  // One result row per rank, each "ok".
  int ok_rows = 0;
  for (absl::string_view line : absl::StrSplit(p->Stdout(), '\n')) {
    if (absl::EndsWith(line, "  ok")) ++ok_rows;
  }
  EXPECT_EQ(ok_rows, R) << p->Stdout();
  auto rc = epd->Stop();
  ASSERT_TRUE(rc.ok());
  EXPECT_EQ(*rc, 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, MoeLayerTest, ::testing::Values(2, 4, 8));

TEST(DataPlaneTest, TwoGroupsAtOnce) {
  auto epd = StartEpd(kCorrectnessOpTimeout);
  ASSERT_NE(epd, nullptr);
  auto a = Spawn({MoeLayerBinary(), "--socket=" + epd->socket_path(), "--group=alpha",
                  "--num_ranks=2", "--num_experts=8", "--hidden=128", "--tokens=16", "--iters=4"},
                 epd->dir(), "alpha");
  auto b =
      Spawn({MoeLayerBinary(), "--socket=" + epd->socket_path(), "--group=beta", "--num_ranks=4",
             "--num_experts=16", "--hidden=384", "--tokens=20", "--iters=3", "--fp8=false"},
            epd->dir(), "beta");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ExpectSuccess(*a, "group alpha", absl::Seconds(120), *epd);
  ExpectSuccess(*b, "group beta", absl::Seconds(120), *epd);
}

TEST(DataPlaneTest, BadInputMatrixWhileAnotherGroupRuns) {
  auto epd = StartEpd();
  ASSERT_NE(epd, nullptr);
  auto other =
      Spawn({MoeLayerBinary(), "--socket=" + epd->socket_path(), "--group=bystander",
             "--num_ranks=2", "--num_experts=8", "--hidden=128", "--tokens=16", "--iters=20"},
            epd->dir(), "bystander");
  auto bad = Spawn({DpClientBinary(), "--socket=" + epd->socket_path(), "--scenario=bad_inputs",
                    "--group=victim"},
                   epd->dir(), "bad");
  ASSERT_NE(other, nullptr);
  ASSERT_NE(bad, nullptr);
  ExpectSuccess(*bad, "bad_inputs", absl::Seconds(120), *epd);
  const std::string out = bad->Stdout();
  for (const char* c :
       {"shape_mismatch", "dtype_mismatch", "tokens_over_max", "topk_idx_4", "topk_idx_-5",
        "fp8_hidden_192_join", "fp8_hidden_192_ll_dispatch", "combine_foreign_handle",
        "combine_stale_handle", "combine_device_only_handle", "negative_ndim", "null_shape",
        "cached_device_only_handle", "garbage_ring_slot", "op_after_leave"}) {
    EXPECT_NE(out.find(absl::StrCat("case ", c)), std::string::npos) << c << "\n" << out;
  }
  EXPECT_EQ(out.find("=> FAIL"), std::string::npos) << out;
  EXPECT_NE(out.find("all cases passed"), std::string::npos) << out;
  ExpectSuccess(*other, "bystander group", absl::Seconds(120), *epd);
  // The daemon still serves.
  auto health = epd->CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST(DataPlaneTest, RankKilledMidOpThenRejoins) {
  const int kTimeoutMs = 1000;
  auto epd = StartEpd("1s");
  ASSERT_NE(epd, nullptr);
  auto loop = [&](int rank, const std::string& name, bool exit_after_recovery) {
    std::vector<std::string> argv = {DpClientBinary(),  "--socket=" + epd->socket_path(),
                                     "--scenario=loop", "--group=kill",
                                     "--num_ranks=2",   absl::StrCat("--rank=", rank)};
    if (exit_after_recovery) argv.push_back("--exit_after_recovery");
    return Spawn(argv, epd->dir(), name);
  };
  auto survivor = loop(0, "survivor", true);
  auto victim = loop(1, "victim", false);
  ASSERT_NE(survivor, nullptr);
  ASSERT_NE(victim, nullptr);
  ASSERT_TRUE(victim->WaitForOutput("op 20 OK", absl::Seconds(30)).ok()) << victim->Stdout();
  victim->Signal(SIGKILL);
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(victim->Wait(absl::Seconds(5)).ok());
  // The survivor is in (or about to start) an op that can never complete.
  absl::Status failed = survivor->WaitForOutput("DEADLINE_EXCEEDED", absl::Seconds(10));
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  ASSERT_TRUE(failed.ok()) << failed << "\n" << survivor->Stdout() << epd->Logs();
  EXPECT_LT(secs, kTimeoutMs / 1000.0 + 1.0) << survivor->Stdout();
  // A new process rejoins rank 1; the survivor recovers (3 good ops) and exits 0.
  auto again = loop(1, "victim2", false);
  ASSERT_NE(again, nullptr);
  ExpectSuccess(*survivor, "survivor", absl::Seconds(30), *epd);
  EXPECT_NE(survivor->Stdout().find("recovered"), std::string::npos);
}

TEST(DataPlaneTest, ClientsFailFastWhenEpdIsKilled) {
  // op_timeout 10 s: a client that noticed nothing would wait op_timeout + 5 s.
  auto epd = StartEpd("10s");
  ASSERT_NE(epd, nullptr);
  // Rank 0 of a 2-rank group whose rank 1 never comes: its first op waits in epd.
  auto lonely = Spawn({DpClientBinary(), "--socket=" + epd->socket_path(), "--scenario=loop",
                       "--group=orphan", "--num_ranks=2", "--rank=0", "--max_ops=1"},
                      epd->dir(), "lonely");
  ASSERT_NE(lonely, nullptr);
  ASSERT_TRUE(lonely->WaitForOutput("joined rank 0", absl::Seconds(10)).ok()) << lonely->Stdout();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  epd->Kill();
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(lonely->WaitForOutput("UNAVAILABLE", absl::Seconds(8)).ok()) << lonely->Stdout();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  EXPECT_LT(secs, 3.0) << lonely->Stdout();
  EXPECT_NE(lonely->Stdout().find("Session with epd ended"), std::string::npos) << lonely->Stdout();
  auto rc = lonely->Wait(absl::Seconds(10));
  ASSERT_TRUE(rc.ok());
}

}  // namespace
}  // namespace epd::testing
