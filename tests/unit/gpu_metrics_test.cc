// The parts of the CUDA backend's metrics that run without a GPU: OpGpuTimer's logic over
// fake events (daemon/dataplane/op_gpu_timer.h), the per-expert tally of host-mapped
// counter blocks (daemon/metrics/expert_tally.h) and the families they and the transports'
// counters feed, as the registry exposes them (epd_op_gpu_seconds,
// epd_expert_received_tokens_total, epd_transport_retransmits_total,
// epd_transport_error_completions_total).
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "daemon/dataplane/op_gpu_timer.h"
#include "daemon/metrics/expert_tally.h"
#include "daemon/metrics/exposition.h"
#include "daemon/metrics/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/abi/shm_abi.h"

namespace epd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

/// Events as integers: Record stamps the stream's clock; the test completes them. Never
/// waits (there is no wait to call), and counts Query calls.
class FakeEvents : public TimingEvents {
 public:
  struct Event {
    bool recorded = false;
    State state = State::kPending;
    double at_ms = 0;
  };
  bool fail_records = false;
  bool fail_elapsed = false;
  int queries = 0;
  std::map<void*, double> stream_clock_ms;  ///< Per stream: the time a record stamps.

  bool Record(void* event, void* stream) override {
    if (fail_records) return false;
    Event& e = *static_cast<Event*>(event);
    e.recorded = true;
    e.state = State::kPending;
    e.at_ms = stream_clock_ms[stream];
    return true;
  }
  State Query(void* event) override {
    ++queries;
    return static_cast<Event*>(event)->state;
  }
  bool ElapsedMs(void* begin, void* end, float* ms) override {
    const Event& b = *static_cast<Event*>(begin);
    const Event& e = *static_cast<Event*>(end);
    if (fail_elapsed || !b.recorded || !e.recorded) return false;
    *ms = static_cast<float>(e.at_ms - b.at_ms);
    return true;
  }
};

/// Two ranks on two streams: begin at t0, end (the done event) at t1 per rank.
struct TwoRankOp {
  FakeEvents events;
  OpGpuTimer timer{&events, 2};
  FakeEvents::Event begin[2], end[2];
  int stream[2] = {0, 0};

  void Run(double start0, double stop0, double start1, double stop1) {
    timer.Start();
    const double starts[2] = {start0, start1}, stops[2] = {stop0, stop1};
    for (int r = 0; r < 2; ++r) {
      events.stream_clock_ms[&stream[r]] = starts[r];
      timer.Begin(r, &begin[r], &stream[r]);
      events.stream_clock_ms[&stream[r]] = stops[r];
      events.Record(&end[r], &stream[r]);
      timer.SetEnd(r, &end[r]);
    }
  }
  void CompleteAll() {
    for (auto& e : end) e.state = TimingEvents::State::kComplete;
    for (auto& e : begin) e.state = TimingEvents::State::kComplete;
  }
};

TEST(OpGpuTimerTest, AnOpTakesItsLongestRank) {
  TwoRankOp op;
  op.Run(1.0, 1.25, 1.0, 1.5);  // 0.25 ms and 0.5 ms.
  op.CompleteAll();
  std::optional<uint64_t> ns = op.timer.Finish();
  ASSERT_TRUE(ns.has_value());
  EXPECT_EQ(*ns, 500'000u);
  // The next op starts from nothing: a rank without events is not timed.
  op.timer.Start();
  EXPECT_FALSE(op.timer.Finish().has_value());
}

TEST(OpGpuTimerTest, NeverWaitsForAnEventThatIsNotComplete) {
  TwoRankOp op;
  op.Run(0, 1, 0, 2);
  op.end[0].state = TimingEvents::State::kComplete;  // Rank 1 still running.
  EXPECT_FALSE(op.timer.Finish().has_value());
  EXPECT_GE(op.events.queries, 1);
  op.end[1].state = TimingEvents::State::kFailed;
  EXPECT_FALSE(op.timer.Finish().has_value());
  op.end[1].state = TimingEvents::State::kComplete;
  ASSERT_TRUE(op.timer.Finish().has_value());
  EXPECT_EQ(*op.timer.Finish(), 2'000'000u);
}

TEST(OpGpuTimerTest, AFailedRecordOrUnavailableTimeLeavesTheOpUntimed) {
  TwoRankOp op;
  op.events.fail_records = true;
  op.timer.Start();
  EXPECT_FALSE(op.timer.Begin(0, &op.begin[0], &op.stream[0]));
  op.events.fail_records = false;
  EXPECT_TRUE(op.timer.Begin(1, &op.begin[1], &op.stream[1]));
  op.timer.SetEnd(0, &op.end[0]);
  op.timer.SetEnd(1, &op.end[1]);
  op.CompleteAll();
  EXPECT_FALSE(op.timer.Finish().has_value());  // Rank 0 has no begin.

  op.Run(0, 1, 0, 1);
  op.CompleteAll();
  op.events.fail_elapsed = true;
  EXPECT_FALSE(op.timer.Finish().has_value());
  op.events.fail_elapsed = false;
  EXPECT_TRUE(op.timer.Finish().has_value());
  // Out of range ranks are refused, not written.
  EXPECT_FALSE(op.timer.Begin(2, &op.begin[0], &op.stream[0]));
  EXPECT_FALSE(op.timer.Begin(-1, &op.begin[0], &op.stream[0]));
  op.timer.SetEnd(5, &op.end[0]);
}

// An op launched through a CUDA graph: its begin events are graph nodes, recorded by the
// graph, so the timer takes them without recording anything.
TEST(OpGpuTimerTest, BeginEventsRecordedByAGraphAreTakenAsGiven) {
  TwoRankOp op;
  op.timer.Start();
  for (int r = 0; r < 2; ++r) {
    op.events.stream_clock_ms[&op.stream[r]] = 1.0;
    op.events.Record(&op.begin[r], &op.stream[r]);  // As the graph's node.
    op.timer.SetBegin(r, &op.begin[r]);
    op.events.stream_clock_ms[&op.stream[r]] = r == 0 ? 1.5 : 1.75;
    op.events.Record(&op.end[r], &op.stream[r]);
    op.timer.SetEnd(r, &op.end[r]);
  }
  op.CompleteAll();
  ASSERT_TRUE(op.timer.Finish().has_value());
  EXPECT_EQ(*op.timer.Finish(), 750'000u);
  // Without SetBegin a rank has no begin: not timed. Out of range is ignored.
  op.timer.Start();
  op.timer.SetBegin(0, &op.begin[0]);
  op.timer.SetBegin(7, &op.begin[1]);
  op.timer.SetBegin(-1, &op.begin[1]);
  op.timer.SetEnd(0, &op.end[0]);
  op.timer.SetEnd(1, &op.end[1]);
  EXPECT_FALSE(op.timer.Finish().has_value());
}

TEST(ExpertTokenTallyTest, SumsLiveBlocksAndKeepsWhatRetiredBlocksCounted) {
  metrics::ExpertTokenTally tally(/*num_ranks=*/2, /*experts_per_rank=*/3);
  volatile uint64_t rank0[3] = {0, 0, 0};
  volatile uint64_t rank1_old[3] = {0, 0, 0};
  volatile uint64_t rank1_new[3] = {0, 0, 0};
  tally.Attach(0, rank0);
  tally.Attach(1, rank1_old);
  tally.Attach(7, rank0);  // Out of range: ignored.
  // The kernels store running totals.
  rank0[0] = 5;
  rank0[2] = 1;
  rank1_old[1] = 4;
  std::vector<uint64_t> out(6, 0);
  tally.AddTo(out);
  EXPECT_EQ(out, (std::vector<uint64_t>{5, 0, 1, 0, 4, 0}));
  // Rank 1 rejoins while its old block's op still runs: both count.
  tally.Attach(1, rank1_new);
  rank1_old[1] = 6;
  rank1_new[1] = 2;
  out.assign(6, 0);
  tally.AddTo(out);
  EXPECT_EQ(out, (std::vector<uint64_t>{5, 0, 1, 0, 8, 0}));
  // The old block is final and freed: its totals stay counted.
  tally.Retire(1, rank1_old);
  tally.Retire(1, rank1_old);  // Already gone: ignored.
  rank1_old[1] = 1000;         // Freed memory is never read again.
  rank1_new[2] = 3;
  out.assign(6, 0);
  tally.AddTo(out);
  EXPECT_EQ(out, (std::vector<uint64_t>{5, 0, 1, 0, 8, 3}));
  // A shorter span gets what fits.
  std::vector<uint64_t> short_out(2, 1);
  tally.AddTo(short_out);
  EXPECT_EQ(short_out, (std::vector<uint64_t>{6, 1}));
}

TEST(GpuMetricsExpositionTest, ExpertTotalsAddTheTallyToTheHostCounts) {
  metrics::Registry registry;
  std::shared_ptr<metrics::GroupMetrics> g = registry.AddGroup("gx", 2, 4);
  auto tally = std::make_shared<metrics::ExpertTokenTally>(2, 2);
  volatile uint64_t rank1[2] = {0, 9};
  tally->Attach(1, rank1);
  g->AddExpertTokens(3, 1);
  g->SetExpertTokenTally(tally);
  EXPECT_EQ(g->expert_tokens(3), 10u);  // Global expert 3 = rank 1's local expert 1.
  EXPECT_EQ(g->expert_tokens(2), 0u);
  EXPECT_EQ(g->expert_tokens(4), 0u);  // Out of range.
  const std::string text = metrics::RenderPrometheus(registry.Collect());
  EXPECT_THAT(text, HasSubstr("epd_expert_received_tokens_total{expert=\"3\",group=\"gx\"} 10\n"));
  EXPECT_THAT(text, Not(HasSubstr("expert=\"2\"")));  // Zero: no series.
  tally->Retire(1, rank1);
  tally.reset();  // The group's metrics keep it.
  EXPECT_EQ(g->expert_tokens(3), 10u);
  g->SetExpertTokenTally(nullptr);
  EXPECT_EQ(g->expert_tokens(3), 1u);
}

TEST(GpuMetricsExpositionTest, GpuSecondsHistogramPerOpKind) {
  metrics::Registry registry;
  std::shared_ptr<metrics::GroupMetrics> g = registry.AddGroup("gt", 2, 2);
  const uint32_t ll = static_cast<uint32_t>(abi::OpKind::kLowLatencyDispatch);
  const uint32_t combine = static_cast<uint32_t>(abi::OpKind::kCombine);
  g->RecordOp(ll, absl::StatusCode::kOk, 40'000, 0);
  g->RecordOp(ll, absl::StatusCode::kOk, 40'000, 0);
  g->RecordOp(combine, absl::StatusCode::kOk, 40'000, 0);
  g->RecordGpuTime(ll, 20'000);
  g->RecordGpuTime(ll, 30'000);
  EXPECT_EQ(g->gpu_timed_ops(ll), 2u);
  EXPECT_EQ(g->gpu_timed_ops(combine), 0u);
  const std::string text = metrics::RenderPrometheus(registry.Collect());
  EXPECT_THAT(text, HasSubstr("# TYPE epd_op_gpu_seconds histogram\n"));
  EXPECT_THAT(text,
              HasSubstr("epd_op_gpu_seconds_count{group=\"gt\",op=\"LowLatencyDispatch\"} 2\n"));
  EXPECT_THAT(text,
              HasSubstr("epd_op_gpu_seconds_sum{group=\"gt\",op=\"LowLatencyDispatch\"} 5e-05\n"));
  EXPECT_THAT(text, HasSubstr("epd_op_gpu_seconds_bucket{group=\"gt\",op=\"LowLatencyDispatch\","
                              "le=\"2.5e-05\"} 1\n"));
  // A kind the backend did not time has no GPU series.
  EXPECT_THAT(text, Not(HasSubstr("epd_op_gpu_seconds_count{group=\"gt\",op=\"Combine\"}")));
}

TEST(GpuMetricsExpositionTest, TransportCountsComeFromTheLinksProbeWhileItIsSet) {
  metrics::Registry registry;
  std::shared_ptr<metrics::LinkMetrics> tcp = registry.AddLink("gl", "tcp", "10.0.0.2:7100");
  std::shared_ptr<metrics::LinkMetrics> rdma = registry.AddLink("gl", "rdma", "10.0.0.3:7100");
  int64_t retransmits = 0;
  tcp->SetTransportProbe([&] { return metrics::TransportCounts{retransmits, -1}; });
  rdma->SetTransportProbe([] { return metrics::TransportCounts{-1, 2}; });
  retransmits = 17;
  std::string text = metrics::RenderPrometheus(registry.Collect());
  EXPECT_THAT(text, HasSubstr("epd_transport_retransmits_total{group=\"gl\",peer=\"10.0.0.2:7100\","
                              "transport=\"tcp\"} 17\n"));
  EXPECT_THAT(text, HasSubstr("epd_transport_error_completions_total{group=\"gl\",peer=\"10.0.0."
                              "3:7100\",transport=\"rdma\"} 2\n"));
  // What a transport does not know has no series.
  EXPECT_THAT(text, Not(HasSubstr("epd_transport_retransmits_total{group=\"gl\",peer=\"10.0.0.3")));
  EXPECT_THAT(text, Not(HasSubstr("epd_transport_error_completions_total{group=\"gl\",peer=\"10.0."
                                  "0.2")));
  // The link gone, its probe is cleared: the counts go, the link's own counters stay.
  tcp->SetTransportProbe({});
  text = metrics::RenderPrometheus(registry.Collect());
  EXPECT_THAT(text, Not(HasSubstr("peer=\"10.0.0.2:7100\",transport=\"tcp\"} 17")));
  EXPECT_THAT(text, HasSubstr("epd_transport_writes_total{group=\"gl\",peer=\"10.0.0.2:7100\","
                              "transport=\"tcp\"} 0\n"));
}

}  // namespace
}  // namespace epd
