// OpLaunchTrace (daemon/dataplane/op_launch_trace.h): the per-op segments summed over a
// window, summarised once per window, unset points left out.
#include "daemon/dataplane/op_launch_trace.h"

#include <chrono>
#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace epd {
namespace {

using ::testing::HasSubstr;
using Clock = OpLaunchTrace::Clock;
using std::chrono::microseconds;

/// An op whose points are `t0` plus the given microseconds.
OpLaunchTrace::Op MakeOp(Clock::time_point t0, int first, int last, int start, int launched,
                         int done, std::optional<uint64_t> gpu_ns, int calls, bool graph) {
  OpLaunchTrace::Op op;
  op.first_arrival = t0 + microseconds(first);
  op.last_arrival = t0 + microseconds(last);
  op.start = t0 + microseconds(start);
  op.launched = t0 + microseconds(launched);
  op.done_seen = t0 + microseconds(done);
  op.gpu_ns = gpu_ns;
  op.launch_calls = calls;
  op.graph = graph;
  return op;
}

TEST(OpLaunchTraceTest, SummarisesEachSegmentOncePerWindow) {
  OpLaunchTrace trace(std::chrono::milliseconds(1));
  const Clock::time_point t0 = Clock::now();
  // Two ops: per-rank (32 calls) and graph (1 call).
  trace.Record(MakeOp(t0, 0, 10, 12, 52, 152, 80'000, 32, false));
  EXPECT_FALSE(trace.MaybeSummary(t0 + microseconds(300)).has_value());  // Window open.
  trace.Record(MakeOp(t0 + microseconds(400), 0, 20, 24, 28, 128, 90'000, 1, true));
  const std::optional<std::string> line = trace.MaybeSummary(t0 + microseconds(1200));
  ASSERT_TRUE(line.has_value());
  EXPECT_THAT(*line, HasSubstr("2 ops (1 through op graphs, 16.5 launch calls/op)"));
  EXPECT_THAT(*line, HasSubstr("arrival spread mean 15.0 max 20.0 us"));
  EXPECT_THAT(*line, HasSubstr("last arrival→start mean 3.0 max 4.0 us"));
  EXPECT_THAT(*line, HasSubstr("start→launched mean 22.0 max 40.0 us"));
  EXPECT_THAT(*line, HasSubstr("launched→done seen mean 100.0 max 100.0 us"));
  EXPECT_THAT(*line, HasSubstr("GPU mean 85.0 max 90.0 us"));
  EXPECT_THAT(*line, HasSubstr("minus GPU (GPU start + poll slack) mean 15.0 max 20.0 us"));
  // A new window: nothing until an op comes and the window passes again.
  EXPECT_FALSE(trace.MaybeSummary(t0 + microseconds(5000)).has_value());
}

TEST(OpLaunchTraceTest, UnsetPointsAndUntimedOpsAreLeftOut) {
  OpLaunchTrace trace(std::chrono::milliseconds(1));
  const Clock::time_point t0 = Clock::now();
  OpLaunchTrace::Op op = MakeOp(t0, 0, 5, 6, 7, 50, std::nullopt, 4, false);
  op.first_arrival = Clock::time_point{};  // Not known.
  op.last_arrival = Clock::time_point{};
  trace.Record(op);
  const std::optional<std::string> line = trace.MaybeSummary(t0 + std::chrono::seconds(1));
  ASSERT_TRUE(line.has_value());
  EXPECT_THAT(*line, HasSubstr("arrival spread -"));
  EXPECT_THAT(*line, HasSubstr("last arrival→start -"));
  EXPECT_THAT(*line, HasSubstr("GPU -"));
  EXPECT_THAT(*line, HasSubstr("start→launched mean 1.0 max 1.0 us"));
}

}  // namespace
}  // namespace epd
