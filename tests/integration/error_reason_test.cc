// The error catalog end to end against a real `epd --backend=host`: each error reaches the
// client with its reason (proto/epd/v1/errors.proto) through every path it takes:
// - gRPC (JoinGroup): a bad spec (SPEC_INVALID), a wrong join secret (JOIN_SECRET_MISMATCH),
//   a rank already held (RANK_TAKEN), a spec differing from the live group (SPEC_MISMATCH);
// - the shm completion record: ranks that disagree on an op's options fail it in the daemon
//   (OP_INPUT_INVALID) and the client reads the reason back from Completion.reason;
// - the C ABI: epd_last_error_reason() and epd_reason_name() for the same errors, a buffer
//   too small (BUFFER_TOO_SMALL), and 0 after a call that succeeded;
// - `epctl explain` by code, by name, --list and --json, and an unknown reason.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "common/errors/reason.h"
#include "epd/client.h"
#include "epd/epd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"
#include "tests/common/specs.h"
#include "tests/common/subprocess.h"

namespace epd::testing {
namespace {

using errors::Reason;
using errors::ReasonOf;
using ::testing::HasSubstr;

constexpr int kTokens = 4, kHidden = 256, kTopk = 2, kExperts = 8;

class ErrorReasonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonProcessOptions o;
    o.tcp = false;
    o.log_level = "info";
    o.extra_args = {"--op_timeout=10s"};
    auto epd = DaemonProcess::Start(o);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
    ClientOptions options;
    options.socket_path = epd_->socket_path();
    auto client = Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  void TearDown() override {
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
  }

  JoinOptions Join(const std::string& name, int rank, const std::string& secret = "s3cret") {
    JoinOptions j;
    j.spec = MakeSpec(name, {.num_ranks = 2,
                             .num_experts = kExperts,
                             .hidden = kHidden,
                             .num_topk = kTopk,
                             .max_tokens_per_rank = 16});
    j.rank = rank;
    j.join_secret = secret;
    return j;
  }

  std::unique_ptr<DaemonProcess> epd_;
  std::unique_ptr<Client> client_;
};

TEST_F(ErrorReasonTest, JoinErrorsCarryTheirReasonOverGrpc) {
  JoinOptions bad = Join("bad", 0);
  bad.spec.set_num_experts(7);  // Not a multiple of num_ranks.
  auto st = client_->Join(bad);
  ASSERT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument) << st.status();
  EXPECT_EQ(ReasonOf(st.status()), Reason::kSpecInvalid) << st.status();
  EXPECT_TRUE(errors::HasReason(st.status()));  // Sent by the daemon, not the generic.

  auto rank0 = client_->Join(Join("g", 0));
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  auto wrong_secret = client_->Join(Join("g", 1, "not-the-secret"));
  ASSERT_EQ(wrong_secret.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ReasonOf(wrong_secret.status()), Reason::kJoinSecretMismatch) << wrong_secret.status();

  auto taken = client_->Join(Join("g", 0));
  ASSERT_EQ(taken.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ReasonOf(taken.status()), Reason::kRankTaken) << taken.status();

  JoinOptions other = Join("g", 1);
  other.spec.set_max_tokens_per_rank(8);
  auto mismatch = client_->Join(other);
  ASSERT_EQ(mismatch.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReasonOf(mismatch.status()), Reason::kSpecMismatch) << mismatch.status();
}

/// x [T, H] bf16 and topk_idx [T, K] int64 (experts 0..K-1) of a dispatch.
struct DispatchInputs {
  std::vector<uint16_t> x = std::vector<uint16_t>(kTokens * kHidden, 0x3f80);
  std::vector<int64_t> topk = std::vector<int64_t>(kTokens * kTopk);
  std::vector<int64_t> x_shape{kTokens, kHidden}, topk_shape{kTokens, kTopk};
  DLTensor x_dl{}, topk_dl{};
  DispatchInputs() {
    for (int t = 0; t < kTokens; ++t) {
      for (int k = 0; k < kTopk; ++k) topk[t * kTopk + k] = (t + k) % kExperts;
    }
    x_dl = MakeDLTensor(x.data(), kBf16, x_shape);
    topk_dl = MakeDLTensor(topk.data(), kI64, topk_shape);
  }
};

TEST_F(ErrorReasonTest, DaemonFailedOpCarriesItsReasonThroughTheCompletionRecord) {
  auto rank0 = client_->Join(Join("ring", 0));
  auto rank1 = client_->Join(Join("ring", 1));
  ASSERT_TRUE(rank0.ok() && rank1.ok()) << rank0.status() << " " << rank1.status();
  absl::Status got[2];
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      DispatchInputs in;
      DispatchArgs args;
      args.x = &in.x_dl;
      args.topk_idx = &in.topk_dl;
      args.expert_alignment = r + 1;  // The ranks disagree: the daemon fails the op.
      Endpoint& ep = r == 0 ? **rank0 : **rank1;
      auto op = ep.Dispatch(args);
      if (!op.ok()) {
        got[r] = op.status();
        return;
      }
      got[r] = op->Wait(absl::Seconds(30)).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r].code(), absl::StatusCode::kInvalidArgument) << got[r];
    EXPECT_THAT(std::string(got[r].message()), HasSubstr("ranks disagree")) << got[r];
    EXPECT_EQ(ReasonOf(got[r]), Reason::kOpInputInvalid) << got[r];
    EXPECT_TRUE(errors::HasReason(got[r]));  // Read from Completion.reason.
  }
}

TEST_F(ErrorReasonTest, CAbiReportsTheLastErrorsReason) {
  epd_client_options_t o{};
  o.struct_size = sizeof(o);
  o.socket_path = epd_->socket_path().c_str();
  epd_client_t* client = nullptr;
  ASSERT_EQ(epd_client_connect(&o, &client), EPD_OK) << epd_last_error();
  EXPECT_EQ(epd_last_error_reason(), 0);

  auto join = [&](const char* name, int rank, const char* secret, int experts,
                  epd_endpoint_t** ep) {
    epd_join_options_t j{};
    j.struct_size = sizeof(j);
    j.name = name;
    j.num_ranks = 2;
    j.num_experts = experts;
    j.hidden = kHidden;
    j.num_topk = kTopk;
    j.max_tokens_per_rank = 16;
    j.rank = rank;
    j.join_secret = secret;
    j.join_secret_len = std::strlen(secret);
    return epd_client_join(client, &j, ep);
  };
  epd_endpoint_t* ep0 = nullptr;
  epd_endpoint_t* ep1 = nullptr;
  EXPECT_EQ(join("c", 0, "s", 7, &ep0), EPD_INVALID_ARGUMENT);
  EXPECT_EQ(epd_last_error_reason(), 1001) << epd_last_error();
  EXPECT_STREQ(epd_reason_name(epd_last_error_reason()), "SPEC_INVALID");

  ASSERT_EQ(join("c", 0, "s", kExperts, &ep0), EPD_OK) << epd_last_error();
  EXPECT_EQ(epd_last_error_reason(), 0);
  EXPECT_EQ(join("c", 1, "wrong", kExperts, &ep1), EPD_PERMISSION_DENIED);
  EXPECT_EQ(epd_last_error_reason(), 4001) << epd_last_error();
  EXPECT_STREQ(epd_reason_name(4001), "JOIN_SECRET_MISMATCH");
  ASSERT_EQ(join("c", 1, "s", kExperts, &ep1), EPD_OK) << epd_last_error();

  // An op the daemon fails: the reason comes back from the completion record.
  int32_t status[2] = {-1, -1}, reason[2] = {-1, -1};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      DispatchInputs in;
      epd_dispatch_args_t a{};
      a.struct_size = sizeof(a);
      a.x = &in.x_dl;
      a.topk_idx = &in.topk_dl;
      a.expert_alignment = r + 1;
      epd_op_t* op = nullptr;
      if (epd_op_create(&op) != EPD_OK) return;
      epd_status_t s = epd_dispatch(r == 0 ? ep0 : ep1, &a, op);
      if (s == EPD_OK) s = epd_op_wait(op, 30000);
      status[r] = s;
      reason[r] = epd_last_error_reason();  // Per thread.
      epd_op_destroy(op);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[r], EPD_INVALID_ARGUMENT) << r;
    EXPECT_EQ(reason[r], 1006) << r;
  }
  EXPECT_STREQ(epd_reason_name(1006), "OP_INPUT_INVALID");
  EXPECT_STREQ(epd_reason_name(0), "UNSPECIFIED");
  EXPECT_STREQ(epd_reason_name(1), "UNKNOWN_REASON");

  // A caller's buffer too small.
  char small[2];
  size_t needed = 0;
  EXPECT_EQ(epd_client_stats_json(client, small, sizeof small, &needed), EPD_OUT_OF_RANGE);
  EXPECT_EQ(epd_last_error_reason(), 1010) << epd_last_error();
  EXPECT_STREQ(epd_reason_name(1010), "BUFFER_TOO_SMALL");

  // An error of the library itself gets the generic reason of its code.
  EXPECT_EQ(epd_client_join(nullptr, nullptr, nullptr), EPD_INVALID_ARGUMENT);
  EXPECT_EQ(epd_last_error_reason(), 9003);
  EXPECT_STREQ(epd_reason_name(9003), "INVALID_ARGUMENT");

  epd_endpoint_destroy(ep1);
  epd_endpoint_destroy(ep0);
  epd_client_destroy(client);
}

/// Runs epctl with `args`; its stdout, and the exit code in *code.
std::string Epctl(const std::vector<std::string>& args, int* code) {
  std::vector<std::string> argv = {EpctlBinary()};
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = RunCommand(argv, absl::Seconds(20));
  if (!r.ok()) {
    *code = -1;
    return r.status().ToString();
  }
  *code = r->exit_code;
  return r->stdout_text;
}

TEST(EpctlExplainCommandTest, ExplainsByCodeAndNameListsAndRefusesUnknown) {
  int code = 0;
  std::string out = Epctl({"explain", "EPD-2003"}, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("EPD-2003 CUDA_DRIVER_TOO_OLD (FAILED_PRECONDITION)"));
  EXPECT_THAT(out, HasSubstr("cause:"));
  EXPECT_THAT(out, HasSubstr("next step:"));
  EXPECT_EQ(Epctl({"explain", "join_secret_mismatch"}, &code).find("EPD-4001 JOIN_SECRET_MISMATCH"),
            0u);
  out = Epctl({"--json", "explain", "1006"}, &code);
  EXPECT_EQ(code, 0);
  EXPECT_THAT(out, HasSubstr("\"code\": \"EPD-1006\""));
  EXPECT_THAT(out, HasSubstr("\"name\": \"OP_INPUT_INVALID\""));
  out = Epctl({"explain", "--list"}, &code);
  EXPECT_EQ(code, 0);
  for (const errors::ReasonInfo& r : errors::AllReasons()) {
    EXPECT_THAT(out, HasSubstr(std::string(r.name)));
  }
  out = Epctl({"--json", "explain", "--list"}, &code);
  EXPECT_THAT(out, HasSubstr("\"reasons\": ["));
  Epctl({"explain", "EPD-0042"}, &code);
  EXPECT_EQ(code, 1);
  Epctl({"explain"}, &code);
  EXPECT_EQ(code, 2);
}

}  // namespace
}  // namespace epd::testing
