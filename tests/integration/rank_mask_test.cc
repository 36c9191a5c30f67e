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
#include "tests/common/mask_process_scenario.h"
#include "tests/common/subprocess.h"
#include "tests/integration/raw_session.h"

namespace epd::testing {
namespace {

constexpr int kRanks = kMaskScenarioRanks;
constexpr int kOpTimeoutMs = 2000;

std::string DpMaskBinary() { return std::string(EPD_TEST_BIN_DIR) + "/epd_dp_mask"; }

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
  KilledRankIsMaskedThenARejoinIsIncluded(
      *epd_, kOpTimeoutMs, [&](int rank, const std::string& name, std::vector<std::string> flags) {
        return Rank(rank, name, std::move(flags));
      });
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
  // ListGroups (epctl groups) shows the MASK group's mask: none masked yet, epoch 0.
  {
    v1::ListGroupsRequest list;
    v1::ListGroupsResponse groups;
    grpc::ClientContext list_context;
    ASSERT_TRUE(stub->ListGroups(&list_context, list, &groups).ok());
    ASSERT_EQ(groups.groups_size(), 1);
    EXPECT_TRUE(groups.groups(0).has_rank_mask());
    EXPECT_EQ(groups.groups(0).rank_mask().epoch(), 0u);
    EXPECT_EQ(groups.groups(0).rank_mask().masked_ranks_size(), 0);
  }
  holder->Signal(SIGKILL);
  (void)holder->Wait(absl::Seconds(5));
}

}  // namespace
}  // namespace epd::testing
