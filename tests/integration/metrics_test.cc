// Metrics end to end: a real `epd --backend=host --metrics_listen=127.0.0.1:<port>`, this
// process as the client of a 2-rank group, ops run, /metrics scraped with a real HTTP client
// (cpp-httplib) and checked against the ops; `epctl metrics` (table and --json); the start
// counter across a restart.
#include <httplib.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "epd/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/daemon_process.h"
#include "tests/common/dtypes.h"
#include "tests/common/subprocess.h"

namespace epd::testing {
namespace {

using ::testing::HasSubstr;

/// The value of the sample line "name{labels} value" (labels as printed, "" for none), or
/// -1 when the scrape has no such line.
double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.size() > series.size() && line.substr(0, series.size()) == series &&
        line[series.size()] == ' ') {
      double v = 0;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return -1;
}

constexpr int kRanks = 2, kExperts = 4, kHidden = 128, kTopk = 2, kTokens = 6;
constexpr char kGroup[] = "metrics_g";

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    port_ = PickFreeTcpPort();
    ASSERT_GT(port_, 0);
    DaemonProcessOptions options;
    options.tcp = false;
    options.log_level = "info";
    options.extra_args = {"--op_timeout=10s", absl::StrCat("--metrics_listen=127.0.0.1:", port_)};
    absl::StatusOr<std::unique_ptr<DaemonProcess>> epd = DaemonProcess::Start(options);
    ASSERT_TRUE(epd.ok()) << epd.status();
    epd_ = *std::move(epd);
  }
  void TearDown() override {
    if (HasFailure() && epd_ != nullptr) std::cerr << "---- epd log ----\n" << epd_->Logs();
  }

  std::string Scrape(const std::string& path = "/metrics", int* status = nullptr) {
    httplib::Client http("127.0.0.1", port_);
    http.set_connection_timeout(5, 0);
    http.set_read_timeout(5, 0);
    httplib::Result r = http.Get(path);
    EXPECT_TRUE(r) << "GET " << path << ": " << httplib::to_string(r.error());
    if (!r) return "";
    if (status != nullptr) *status = r->status;
    if (path == "/metrics") {
      EXPECT_EQ(r->status, 200);
      EXPECT_THAT(r->get_header_value("Content-Type"), HasSubstr("version=0.0.4"));
    }
    return r->body;
  }

  int port_ = 0;
  std::unique_ptr<DaemonProcess> epd_;
};

TEST_F(MetricsTest, ScrapeCountsTheOpsRun) {
  ClientOptions client_options;
  client_options.socket_path = epd_->socket_path();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<std::unique_ptr<Endpoint>> ep;
  for (int r = 0; r < kRanks; ++r) {
    JoinOptions join;
    join.spec.set_name(kGroup);
    join.spec.set_num_ranks(kRanks);
    join.spec.set_num_experts(kExperts);
    join.spec.set_hidden(kHidden);
    join.spec.set_num_topk(kTopk);
    join.spec.set_max_tokens_per_rank(8);
    join.rank = r;
    absl::StatusOr<std::unique_ptr<Endpoint>> e = (*client)->Join(join);
    ASSERT_TRUE(e.ok()) << e.status();
    ep.push_back(*std::move(e));
  }
  // Rank r routes token t to experts (t + r) % E and (t + r + 1) % E, the last token of
  // rank 1 twice to one expert (counted once).
  std::vector<std::vector<int64_t>> idx(kRanks);
  std::map<int, int> expected_tokens;
  for (int r = 0; r < kRanks; ++r) {
    for (int t = 0; t < kTokens; ++t) {
      int64_t a = (t + r) % kExperts, b = (t + r + 1) % kExperts;
      if (r == 1 && t == kTokens - 1) b = a;
      idx[r].push_back(a);
      idx[r].push_back(b);
      expected_tokens[a] += 1;
      if (b != a) expected_tokens[b] += 1;
    }
  }
  std::vector<int64_t> idx_shape = {kTokens, kTopk}, x_shape = {kTokens, kHidden};
  std::vector<std::vector<uint16_t>> x(kRanks, std::vector<uint16_t>(kTokens * kHidden, 0x3f80));
  std::vector<DLTensor> idx_t, x_t;
  for (int r = 0; r < kRanks; ++r) {
    idx_t.push_back(MakeDLTensor(idx[r].data(), kI64, idx_shape));
    x_t.push_back(MakeDLTensor(x[r].data(), kBf16, x_shape));
  }
  constexpr int kLayouts = 3, kDispatches = 2;
  for (int i = 0; i < kLayouts; ++i) {
    std::vector<PendingOp<LayoutResult>> ops;
    for (int r = 0; r < kRanks; ++r) {
      absl::StatusOr<PendingOp<LayoutResult>> op = ep[r]->GetDispatchLayout(idx_t[r]);
      ASSERT_TRUE(op.ok()) << op.status();
      ops.push_back(*op);
    }
    for (auto& op : ops) ASSERT_TRUE(op.Wait(absl::Seconds(10)).ok());
  }
  int64_t received_rows = 0;
  for (int i = 0; i < kDispatches; ++i) {
    std::vector<PendingOp<DispatchResult>> ops;
    for (int r = 0; r < kRanks; ++r) {
      DispatchArgs args;
      args.x = &x_t[r];
      args.topk_idx = &idx_t[r];
      absl::StatusOr<PendingOp<DispatchResult>> op = ep[r]->Dispatch(args);
      ASSERT_TRUE(op.ok()) << op.status();
      ops.push_back(*op);
    }
    for (auto& op : ops) {
      absl::StatusOr<DispatchResult> res = op.Wait(absl::Seconds(10));
      ASSERT_TRUE(res.ok()) << res.status();
      received_rows += res->num_recv_tokens;
    }
  }

  const std::string text = Scrape();
  const std::string g = absl::StrCat("group=\"", kGroup, "\"");
  EXPECT_EQ(Sample(text, absl::StrCat("epd_ops_total{", g, ",op=\"GetDispatchLayout\"}")), kLayouts)
      << text;
  EXPECT_EQ(Sample(text, absl::StrCat("epd_ops_total{", g, ",op=\"Dispatch\"}")), kDispatches);
  EXPECT_EQ(Sample(text, absl::StrCat("epd_op_latency_seconds_count{", g, ",op=\"Dispatch\"}")),
            kDispatches);
  EXPECT_EQ(Sample(text, absl::StrCat("epd_op_latency_seconds_bucket{", g,
                                      ",op=\"GetDispatchLayout\",le=\"+Inf\"}")),
            kLayouts);
  EXPECT_GT(Sample(text, absl::StrCat("epd_op_latency_seconds_sum{", g, ",op=\"Dispatch\"}")), 0);
  EXPECT_EQ(Sample(text, absl::StrCat("epd_op_bytes_total{", g, ",op=\"Dispatch\"}")),
            received_rows * kHidden * 2);
  for (const auto& [e, n] : expected_tokens) {
    EXPECT_EQ(
        Sample(text, absl::StrCat("epd_expert_received_tokens_total{expert=\"", e, "\",", g, "}")),
        n * kDispatches)
        << "expert " << e;
  }
  // Every op had both ranks here: one of them arrived last at each.
  double last = 0;
  for (int r = 0; r < kRanks; ++r) {
    const double v =
        Sample(text, absl::StrCat("epd_straggler_last_total{", g, ",rank=\"", r, "\"}"));
    if (v > 0) last += v;
  }
  EXPECT_EQ(last, kLayouts + kDispatches);
  EXPECT_EQ(Sample(text, absl::StrCat("epd_straggler_lag_seconds_count{", g, "}")),
            kLayouts + kDispatches);
  EXPECT_EQ(Sample(text, "epd_sessions"), 1);
  EXPECT_EQ(Sample(text, "epd_groups"), 1);
  EXPECT_EQ(Sample(text, "epd_endpoints"), kRanks);
  EXPECT_EQ(Sample(text, "epd_serving"), 1);
  EXPECT_EQ(Sample(text, "epd_restarts_total"), 0);
  EXPECT_GT(Sample(text, "process_start_time_seconds"), 1.7e9);
  EXPECT_GE(Sample(text, "epd_engine_busy_seconds_total{engine=\"0\"}"), 0) << text;
  EXPECT_THAT(text, HasSubstr("# TYPE epd_op_latency_seconds histogram\n"));

  // Only /metrics is served.
  int status = 0;
  Scrape("/", &status);
  EXPECT_EQ(status, 404);

  // epctl metrics: the table, then JSON.
  SubprocessOptions so;
  so.stdout_path = epd_->dir() + "/epctl.out";
  so.stderr_path = epd_->dir() + "/epctl.err";
  absl::StatusOr<std::unique_ptr<Subprocess>> table =
      Subprocess::Spawn({EpctlBinary(), "--socket=" + epd_->socket_path(), "metrics"}, so);
  ASSERT_TRUE(table.ok()) << table.status();
  absl::StatusOr<int> rc = (*table)->Wait(absl::Seconds(20));
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ(*rc, 0) << (*table)->Stderr();
  const std::string out = (*table)->Stdout();
  EXPECT_THAT(out, HasSubstr("P50"));
  EXPECT_THAT(out, ::testing::ContainsRegex(absl::StrCat(kGroup, " +Dispatch +2 +0 ")));
  EXPECT_THAT(out, HasSubstr("epd_expert_received_tokens_total"));
  so.stdout_path = epd_->dir() + "/epctl-json.out";
  absl::StatusOr<std::unique_ptr<Subprocess>> json = Subprocess::Spawn(
      {EpctlBinary(), "--socket=" + epd_->socket_path(), "--json", "metrics"}, so);
  ASSERT_TRUE(json.ok()) << json.status();
  rc = (*json)->Wait(absl::Seconds(20));
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ(*rc, 0) << (*json)->Stderr();
  EXPECT_THAT((*json)->Stdout(), HasSubstr("\"name\": \"epd_ops_total\""));
  EXPECT_THAT((*json)->Stdout(), HasSubstr("\"p99\""));
  EXPECT_THAT((*json)->Stdout(), HasSubstr(kGroup));
}

TEST_F(MetricsTest, RestartsAreCountedAcrossStarts) {
  EXPECT_EQ(Sample(Scrape(), "epd_restarts_total"), 0);
  ASSERT_TRUE(epd_->Restart().ok());
  const std::string text = Scrape();
  EXPECT_EQ(Sample(text, "epd_restarts_total"), 1) << text;
  EXPECT_EQ(Sample(text, "epd_groups"), 0);
}

}  // namespace
}  // namespace epd::testing
