// epd_bench's measured floors, their CPU logic (tests/bench/floors.h): the fan-out bound's
// destination rows from the routing, its HBM byte count, the fastest variant, the ratios
// printed beside the ops, and the low-latency fixed-cost split.
#include <cstdint>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/bench/floors.h"

namespace epd::bench {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(BenchFloorsTest, PlanGroupsRowsByDestinationThenSourceRankThenToken) {
  // 3 ranks, 2 tokens each (source rank-major): rank 0 gets tokens 0, 3, 5 (rows 0-2),
  // rank 1 tokens 0, 4 (rows 3-4), rank 2 tokens 1, 3, 4 (rows 5-7); token 2 goes nowhere.
  const std::vector<uint32_t> masks = {0b011, 0b100, 0b000, 0b101, 0b110, 0b001};
  absl::StatusOr<FanoutPlan> plan = BuildFanoutPlan(masks, 3, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_tokens, 6);
  EXPECT_EQ(plan->num_rows, 8);
  EXPECT_EQ(plan->tokens_with_rows, 5);
  EXPECT_THAT(plan->rank_rows, ElementsAre(3, 2, 3));
  EXPECT_THAT(plan->row_begin, ElementsAre(0, 2, 3, 3, 5, 7, 8));
  EXPECT_THAT(plan->rows, ElementsAre(0, 3, 5, 1, 6, 4, 7, 2));
}

TEST(BenchFloorsTest, PlanWritesEveryRowOnceInItsRanksRange) {
  constexpr int32_t kRanks = 8;
  constexpr int64_t kTokens = 500;
  std::mt19937 rng(7);
  std::vector<uint32_t> masks(kRanks * kTokens);
  for (uint32_t& m : masks) m = rng() & 0xffu;
  absl::StatusOr<FanoutPlan> plan = BuildFanoutPlan(masks, kRanks, kTokens);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<int> seen(plan->num_rows, 0);
  std::vector<int64_t> first(kRanks, 0), last_row(kRanks, -1);
  for (int32_t d = 1; d < kRanks; ++d) first[d] = first[d - 1] + plan->rank_rows[d - 1];
  for (int64_t t = 0; t < plan->num_tokens; ++t) {
    int k = plan->row_begin[t];
    for (int32_t d = 0; d < kRanks; ++d) {
      if ((masks[t] >> d & 1) == 0) continue;
      ASSERT_LT(k, plan->row_begin[t + 1]) << "token " << t;
      const int32_t row = plan->rows[k++];
      ++seen[row];
      EXPECT_GE(row, first[d]);
      EXPECT_LT(row, first[d] + plan->rank_rows[d]);
      EXPECT_GT(row, last_row[d]) << "rank " << d << " rows out of token order";
      last_row[d] = row;
    }
    EXPECT_EQ(k, plan->row_begin[t + 1]) << "token " << t;
  }
  for (int64_t r = 0; r < plan->num_rows; ++r) EXPECT_EQ(seen[r], 1) << "row " << r;
}

TEST(BenchFloorsTest, PlanRefusesBadInput) {
  const std::vector<uint32_t> masks = {0b01, 0b10, 0b100, 0b00};
  EXPECT_THAT(BuildFanoutPlan(masks, 2, 2).status().message(), HasSubstr("token 2 has mask 0x4"));
  EXPECT_THAT(BuildFanoutPlan(masks, 2, 3).status().message(), HasSubstr("masks.size()=4"));
  EXPECT_THAT(BuildFanoutPlan(masks, 0, 2).status().message(), HasSubstr("num_ranks=0"));
  EXPECT_THAT(BuildFanoutPlan(masks, 33, 2).status().message(), HasSubstr("num_ranks=33"));
  const std::vector<uint32_t> all(32, ~0u);
  EXPECT_TRUE(BuildFanoutPlan(all, 32, 1).ok());
}

TEST(BenchFloorsTest, BytesCountReadsAndWritesOfEachPattern) {
  const std::vector<uint32_t> masks = {0b011, 0b100, 0b000, 0b101, 0b110, 0b001};
  absl::StatusOr<FanoutPlan> plan = BuildFanoutPlan(masks, 3, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Dispatch: the 5 tokens with a destination read, 8 rows written.
  const HbmBytes d = DispatchFanoutBytes(*plan, 100);
  EXPECT_DOUBLE_EQ(d.read, 500);
  EXPECT_DOUBLE_EQ(d.write, 800);
  EXPECT_DOUBLE_EQ(d.total(), 1300);
  // Combine: 8 rows read, every token's output written (zeros for token 2).
  const HbmBytes c = CombineFaninBytes(*plan, 100);
  EXPECT_DOUBLE_EQ(c.read, 800);
  EXPECT_DOUBLE_EQ(c.write, 600);
}

TEST(BenchFloorsTest, FastestBoundPicksTheLeastTimeAndRefusesEmptyOrZero) {
  const std::vector<BoundTiming> t = {{"vec", 128, 500}, {"bulk", 128, 450}, {"vec_cs", 128, 470}};
  absl::StatusOr<BoundTiming> best = FastestBound(t);
  ASSERT_TRUE(best.ok()) << best.status();
  EXPECT_EQ(best->variant, "bulk");
  EXPECT_DOUBLE_EQ(best->us, 450);
  EXPECT_FALSE(FastestBound({}).ok());
  const std::vector<BoundTiming> zero = {{"vec", 128, 500}, {"bulk", 128, 0}};
  EXPECT_THAT(FastestBound(zero).status().message(), HasSubstr("variant bulk has us=0"));
}

TEST(BenchFloorsTest, FiguresCompareRates) {
  // 3e6 bytes in 1 us = 3 TB/s; the bound 8e6 bytes in 2 us = 4 TB/s; the copy 5 TB/s.
  const FloorFigures f = ComputeFloorFigures(3e6, 1, 8e6, 2, 5);
  EXPECT_DOUBLE_EQ(f.op_tbps, 3);
  EXPECT_DOUBLE_EQ(f.bound_tbps, 4);
  EXPECT_DOUBLE_EQ(f.copy_tbps, 5);
  EXPECT_DOUBLE_EQ(f.op_over_copy, 0.6);
  EXPECT_DOUBLE_EQ(f.op_over_bound, 0.75);
  EXPECT_DOUBLE_EQ(f.bound_over_copy, 0.8);
  const FloorFigures none = ComputeFloorFigures(3e6, 1, 8e6, 0, 5);
  EXPECT_EQ(none.op_over_bound, 0);
}

TEST(BenchFloorsTest, FixedCostSplitTakesTheT0OpOff) {
  const FixedCostSplit s = SplitFixedCost(43, 38, 36);
  EXPECT_DOUBLE_EQ(s.data_us, 5);
  EXPECT_DOUBLE_EQ(s.data_over_memcpy, 5.0 / 36);
  EXPECT_EQ(SplitFixedCost(43, 38, 0).data_over_memcpy, 0);
}

TEST(BenchFloorsTest, RoutingShareIsTheFreshOpLessTheCachedOne) {
  // Fresh: 4.2e8 bytes in 500 us; cached: 4e8 bytes in 400 us; the copy 4 TB/s (4e6 bytes/us).
  const RoutingShare s = SplitRouting(4.2e8, 500, 4e8, 400, 4);
  EXPECT_DOUBLE_EQ(s.fresh_us, 500);
  EXPECT_DOUBLE_EQ(s.cached_us, 400);
  EXPECT_DOUBLE_EQ(s.routing_us, 100);
  EXPECT_DOUBLE_EQ(s.routing_fraction, 0.2);
  EXPECT_DOUBLE_EQ(s.without_routing_over_copy, 4.2e8 / 400 / 4e6);  // 0.2625
  EXPECT_DOUBLE_EQ(s.cached_over_copy, 0.25);
  const RoutingShare none = SplitRouting(4.2e8, 500, 4e8, 0, 4);
  EXPECT_EQ(none.routing_us, 0);
  EXPECT_EQ(none.without_routing_over_copy, 0);
  EXPECT_EQ(SplitRouting(4.2e8, 500, 4e8, 400, 0).cached_over_copy, 0);
}

TEST(BenchFloorsTest, PhaseSplitIsTheMedianOverOpsOfTheMeanOverRanks) {
  // Two ranks, three ops. Rank 1 starts 2 us after rank 0; segments in us per rank.
  auto op = [](uint64_t at, uint64_t scale) {
    const uint64_t r0[7] = {0, 3, 10, 12, 15, 415, 420};
    const uint64_t r1[7] = {2, 4, 10, 13, 16, 410, 420};
    std::vector<uint64_t> v;
    for (uint64_t x : r0) v.push_back(at + scale * x * 1000);
    for (uint64_t x : r1) v.push_back(at + scale * x * 1000);
    return v;
  };
  std::vector<uint64_t> stamps;
  for (const auto& o : {op(1'000'000, 1), op(9'000'000, 2), op(5'000'000, 1)}) {
    stamps.insert(stamps.end(), o.begin(), o.end());
  }
  absl::StatusOr<PhaseSplit> s = SplitPhases(stamps, 2);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->ops, 3);
  // The median op is the unscaled one: skew (0 + 2) / 2, layout (3 + 2) / 2, ...
  EXPECT_DOUBLE_EQ(s->skew, 1.0);
  EXPECT_DOUBLE_EQ(s->layout, 2.5);
  EXPECT_DOUBLE_EQ(s->arrival, 6.5);
  EXPECT_DOUBLE_EQ(s->counts, 2.5);
  EXPECT_DOUBLE_EQ(s->to_copy, 3.0);
  EXPECT_DOUBLE_EQ(s->copy, 397.0);
  EXPECT_DOUBLE_EQ(s->done, 7.5);
  EXPECT_DOUBLE_EQ(s->op, 420.0);

  // An op with a stamp never written, or out of order, is left out.
  std::vector<uint64_t> bad = stamps;
  bad[7 + 3] = 0;                 // op 0, rank 1, kNotifyDone
  bad[14 + 5] = bad[14 + 4] - 1;  // op 1, rank 0: copy done before copy start
  absl::StatusOr<PhaseSplit> left = SplitPhases(bad, 2);
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(left->ops, 1);
  EXPECT_DOUBLE_EQ(left->op, 420.0);

  EXPECT_EQ(SplitPhases(std::vector<uint64_t>(13), 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SplitPhases(stamps, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace epd::bench
