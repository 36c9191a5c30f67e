// Rank masking with real processes (the real `epd --backend=host`, each rank an
// epd_dp_mask process, tests/integration/clients/dp_mask.cc): kill -9 of one rank of a MASK
// group mid-stream, the survivors' next rounds complete within op_timeout + 1 s equal to
// kernels/host's reference with its experts dropped, reporting the mask; a new process
// rejoins the masked slot and the next rounds include it; the mask RPCs check the caller
// and the ranks.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "epd/v1/control.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "tests/common/daemon_process.h"
#include "tests/common/subprocess.h"
#include "tests/integration/raw_session.h"

namespace epd::testing {
namespace {

constexpr int kRanks = 4;
constexpr int kOpTimeoutMs = 2000;

std::string DpMaskBinary() { return std::string(EPD_TEST_BIN_DIR) + "/epd_dp_mask"; }

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// A parsed "round I OK epoch E masked M dropped D at NS verified|unverified" line.
struct RoundLine {
  int round = -1;
  bool ok = false;
  uint32_t epoch = 0;
  int masked = 0;
  int64_t at_ns = 0;
  bool verified = false;
};

std::vector<RoundLine> Rounds(const std::string& out) {
  std::vector<RoundLine> rounds;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    if (f.size() < 4 || f[0] != "round") continue;
    RoundLine r;
    if (!absl::SimpleAtoi(f[1], &r.round)) continue;
    r.ok = f[2] == "OK";
    if (r.ok && f.size() >= 12) {
      (void)absl::SimpleAtoi(f[4], &r.epoch);
      (void)absl::SimpleAtoi(f[6], &r.masked);
      (void)absl::SimpleAtoi(f[10], &r.at_ns);
      r.verified = f[11] == "verified";
    }
    rounds.push_back(r);
  }
  return rounds;
}

/// The first round line of `p` for which `pred` holds, waiting up to `timeout`.
std::optional<RoundLine> WaitForRound(Subprocess& p,
                                      const std::function<bool(const RoundLine&)>& pred,
                                      absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  do {
    for (const RoundLine& l : Rounds(p.Stdout())) {
      if (pred(l)) return l;
    }
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < end);
  return std::nullopt;
}

class RankMaskProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonProcessOptions o;
    o.tcp = false;
    o.log_level = "info";
    o.extra_args = {absl::StrCat("--op_timeout=", kOpTimeoutMs, "ms")};
    auto epd = DaemonProcess::Start(o);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = std::move(*epd);
  }

  std::unique_ptr<Subprocess> Rank(int rank, const std::string& name,
                                   std::vector<std::string> flags = {}) {
    std::vector<std::string> argv = {DpMaskBinary(), "--socket=" + epd_->socket_path(),
                                     "--group=masked", absl::StrCat("--num_ranks=", kRanks),
                                     absl::StrCat("--rank=", rank)};
    argv.insert(argv.end(), flags.begin(), flags.end());
    SubprocessOptions o;
    o.stdout_path = epd_->dir() + "/" + name + ".out";
    o.stderr_path = epd_->dir() + "/" + name + ".err";
    auto p = Subprocess::Spawn(argv, o);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }

  std::unique_ptr<v1::Control::Stub> Stub() {
    return v1::Control::NewStub(
        grpc::CreateChannel(epd_->unix_target(), grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<DaemonProcess> epd_;
};

TEST_F(RankMaskProcessTest, KilledRankIsMaskedThenARejoinIsIncluded) {
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < kRanks; ++r) {
    ranks.push_back(
        Rank(r, absl::StrCat("rank", r),
             r == 0 ? std::vector<std::string>{"--api_checks"} : std::vector<std::string>{}));
    ASSERT_NE(ranks.back(), nullptr);
  }
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(ranks[r]->WaitForOutput("round 20 OK", absl::Seconds(30)).ok())
        << ranks[r]->Stdout() << epd_->Logs();
  }
  EXPECT_NE(ranks[0]->Stdout().find("api_checks OK"), std::string::npos) << ranks[0]->Stdout();
  // The mask epoch before the kill (the group may have masked a rank that joined late).
  const std::vector<RoundLine> before = Rounds(ranks[0]->Stdout());
  ASSERT_FALSE(before.empty());
  const uint32_t epoch0 = before.back().epoch;
  ASSERT_EQ(before.back().masked, 0) << ranks[0]->Stdout();
  ranks[3]->Signal(SIGKILL);
  const int64_t killed_at = NowNs();
  ASSERT_TRUE(ranks[3]->Wait(absl::Seconds(5)).ok());
  // Each survivor: a round without rank 3 (a later epoch, 1 masked) soon after the kill.
  uint32_t epoch1 = 0;
  for (int r = 0; r < 3; ++r) {
    auto l = WaitForRound(
        *ranks[r], [&](const RoundLine& l) { return l.ok && l.epoch > epoch0 && l.masked == 1; },
        absl::Seconds(10));
    ASSERT_TRUE(l.has_value()) << ranks[r]->Stdout() << epd_->Logs();
    epoch1 = l->epoch;
  }
  // A new process joins rank 3's slot; the survivors' rounds include it again.
  auto again = Rank(3, "rank3_again");
  ASSERT_NE(again, nullptr);
  auto back = [&](const RoundLine& l) {
    return l.ok && l.epoch > epoch1 && l.masked == 0 && l.verified;
  };
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(WaitForRound(*ranks[r], back, absl::Seconds(10)).has_value())
        << ranks[r]->Stdout() << epd_->Logs();
  }
  ASSERT_TRUE(WaitForRound(*again, back, absl::Seconds(10)).has_value())
      << again->Stdout() << epd_->Logs();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // A few rounds with it.
  for (auto& p : ranks) p->Signal(SIGKILL);
  again->Signal(SIGKILL);
  for (int r = 0; r < 3; ++r) {
    (void)ranks[r]->Wait(absl::Seconds(5));
    const std::string out = ranks[r]->Stdout();
    EXPECT_EQ(out.find("MISMATCH"), std::string::npos) << out;
    std::vector<RoundLine> rounds = Rounds(out);
    int64_t first_without = 0;
    int verified_without = 0, verified_with_again = 0;
    for (const RoundLine& l : rounds) {
      EXPECT_TRUE(l.ok) << "survivor " << r << " had a failed round:\n" << out;
      if (l.ok && l.epoch > epoch0 && l.masked == 1) {
        if (first_without == 0) first_without = l.at_ns;
        verified_without += l.verified;
      }
      if (l.ok && l.epoch > epoch1 && l.masked == 0) verified_with_again += l.verified;
    }
    ASSERT_GT(first_without, 0) << out;
    EXPECT_LT(first_without - killed_at, (kOpTimeoutMs + 1000) * int64_t{1000000})
        << "survivor " << r << ": first round without rank 3 came late";
    EXPECT_GT(verified_without, 0) << "no round without rank 3 was checked:\n" << out;
    EXPECT_GT(verified_with_again, 0) << "no round with the rejoined rank was checked:\n" << out;
  }
  (void)again->Wait(absl::Seconds(5));
  EXPECT_EQ(again->Stdout().find("MISMATCH"), std::string::npos) << again->Stdout();
  auto health = epd_->CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(absl::StrContains(epd_->Logs(), "rank 3 masked")) << epd_->Logs();
}

TEST_F(RankMaskProcessTest, MaskRpcsCheckTheCallerAndTheRanks) {
  auto holder = Rank(0, "holder", {"--max_rounds=0"});
  ASSERT_NE(holder, nullptr);
  ASSERT_TRUE(holder->WaitForOutput("joined rank 0", absl::Seconds(20)).ok()) << holder->Stdout();
  auto stub = Stub();
  RawSession other(stub.get());
  auto call = [&](int32_t rank, const std::string& session, std::vector<int32_t> mask) {
    v1::UpdateRankMaskRequest request;
    request.set_group("masked");
    request.set_rank(rank);
    request.set_session_id(session);
    for (int32_t m : mask) request.add_mask(m);
    v1::UpdateRankMaskResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return stub->UpdateRankMask(&context, request, &response);
  };
  // Another session does not hold rank 0: refused, and nothing changes.
  grpc::Status st = call(0, other.id(), {1});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  // A rank nobody holds.
  st = call(2, other.id(), {1});
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  // A session id that is not open.
  st = call(0, "0123456789abcdef0123456789abcdef", {1});
  EXPECT_NE(st.error_code(), grpc::StatusCode::OK);
  v1::GetRankMaskRequest get;
  get.set_group("masked");
  get.set_rank(0);
  get.set_session_id(other.id());
  v1::GetRankMaskResponse mask;
  grpc::ClientContext context;
  st = stub->GetRankMask(&context, get, &mask);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  holder->Signal(SIGKILL);
  (void)holder->Wait(absl::Seconds(5));
}

}  // namespace
}  // namespace epd::testing
