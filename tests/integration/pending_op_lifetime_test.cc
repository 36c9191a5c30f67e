// A PendingOp that outlives its Endpoint (client/include/epd/client.h): Wait and Enqueued
// then return FAILED_PRECONDITION "endpoint destroyed" at once, for an op that had
// completed and for one still pending, instead of reading the destroyed endpoint (a
// use-after-free: the endpoint's state is freed and its shm region unmapped). A real epd
// (host backend) and this process as its client.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "epd/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"

namespace epd::testing {
namespace {

using ::testing::HasSubstr;

class PendingOpLifetimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonProcessOptions options;
    options.tcp = false;
    options.log_level = "info";
    options.extra_args = {"--op_timeout=10s"};
    absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
    ClientOptions client_options;
    client_options.socket_path = epd_->socket_path();
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  void TearDown() override {
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
  }

  /// Joins rank 0 of a group of `num_ranks` ranks (the others never come).
  std::unique_ptr<Endpoint> Join(const std::string& name, int num_ranks) {
    JoinOptions join;
    join.spec.set_name(name);
    join.spec.set_num_ranks(num_ranks);
    join.spec.set_num_experts(4);
    join.spec.set_hidden(128);
    join.spec.set_num_topk(2);
    join.spec.set_max_tokens_per_rank(8);
    absl::StatusOr<std::unique_ptr<Endpoint>> endpoint = client_->Join(join);
    EXPECT_TRUE(endpoint.ok()) << endpoint.status();
    return endpoint.ok() ? *std::move(endpoint) : nullptr;
  }

  std::unique_ptr<DaemonProcess> epd_;
  std::unique_ptr<Client> client_;
  std::vector<int64_t> idx_ = std::vector<int64_t>(4 * 2, 1);
  std::vector<int64_t> shape_ = {4, 2};
  DLTensor topk_idx_ = MakeDLTensor(idx_.data(), kI64, shape_);
};

void ExpectEndpointDestroyed(const absl::Status& status) {
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("endpoint destroyed")) << status;
}

TEST_F(PendingOpLifetimeTest, WaitOfACompletedOpAfterItsEndpointIsDestroyed) {
  std::unique_ptr<Endpoint> endpoint = Join("done", 1);
  ASSERT_NE(endpoint, nullptr);
  absl::StatusOr<PendingOp<LayoutResult>> op = endpoint->GetDispatchLayout(topk_idx_);
  ASSERT_TRUE(op.ok()) << op.status();
  ASSERT_TRUE(op->Wait(absl::Seconds(10)).ok());
  endpoint.reset();
  // Its outputs were views of the endpoint's buffers, now unmapped: no result to give.
  ExpectEndpointDestroyed(op->Wait(absl::Seconds(10)).status());
  ExpectEndpointDestroyed(op->Enqueued().status());
  // A copy made before is as safe.
  PendingOp<LayoutResult> copy = *op;
  ExpectEndpointDestroyed(copy.Wait().status());
}

TEST_F(PendingOpLifetimeTest, WaitOfAPendingOpAfterItsEndpointIsDestroyed) {
  std::unique_ptr<Endpoint> endpoint = Join("pending", 2);  // Rank 1 never comes.
  ASSERT_NE(endpoint, nullptr);
  absl::StatusOr<PendingOp<LayoutResult>> op = endpoint->GetDispatchLayout(topk_idx_);
  ASSERT_TRUE(op.ok()) << op.status();
  endpoint.reset();
  const absl::Time start = absl::Now();
  ExpectEndpointDestroyed(op->Wait().status());
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  // epd is unharmed: another endpoint joins and completes an op.
  std::unique_ptr<Endpoint> again = Join("pending2", 1);
  ASSERT_NE(again, nullptr);
  absl::StatusOr<PendingOp<LayoutResult>> next = again->GetDispatchLayout(topk_idx_);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(next->Wait(absl::Seconds(10)).ok());
}

}  // namespace
}  // namespace epd::testing
