// Measured floors of epd_bench (CPU logic, shared by the CUDA benches and their unit test):
// the fan-out copy bound of the normal ops (each token row read once and written once per
// destination rank for a dispatch, the rows of a token read and summed into one for a
// combine: the ops' byte pattern without their logic), its HBM byte count, the fastest of
// the bound's kernel variants, the ratios printed beside the ops, and the low-latency ops'
// fixed cost split (T = 0) against a copy of the same bytes, and a normal dispatch's routing
// share (fresh against cached) and where its time goes (the kernels' phase stamps).
// docs/BENCHMARKS.md "Measured floors".
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace epd::bench {

/// Where each token's rows go in the fan-out bound, built from the bench's routing: the
/// tokens of every source rank in order (source rank-major, `num_tokens` in all), and for
/// each the destination rows it is written to (dispatch) or read from (combine), one per
/// destination rank. The destination rows of rank d are contiguous, ordered by source rank,
/// then token: a dispatch's receive buffers laid end to end.
struct FanoutPlan {
  int32_t num_ranks = 0;
  int64_t num_tokens = 0;        ///< All source ranks' tokens.
  int64_t num_rows = 0;          ///< Destination rows: (token, destination rank) pairs.
  int64_t tokens_with_rows = 0;  ///< Tokens with at least one destination.
  /// [num_tokens + 1]: token t's rows are rows[row_begin[t], row_begin[t + 1]).
  std::vector<int32_t> row_begin;
  /// [num_rows]: the destination row index of each (token, destination) pair, destination
  /// ranks ascending within a token.
  std::vector<int32_t> rows;
  /// [num_ranks]: the rows destination rank d receives.
  std::vector<int64_t> rank_rows;
};

/// Builds the plan from one destination-rank mask per token (bit d set: the token goes to
/// rank d; `masks` source rank-major, `tokens_per_rank` per rank). INVALID_ARGUMENT when
/// num_ranks is not in [1, 32], tokens_per_rank < 0, masks.size() != num_ranks *
/// tokens_per_rank, a mask names a rank >= num_ranks, or the rows do not fit int32 indices.
inline absl::StatusOr<FanoutPlan> BuildFanoutPlan(std::span<const uint32_t> masks,
                                                  int32_t num_ranks, int64_t tokens_per_rank) {
  if (num_ranks < 1 || num_ranks > 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("BuildFanoutPlan: num_ranks=", num_ranks, " is not in [1, 32]"));
  }
  if (tokens_per_rank < 0 ||
      static_cast<int64_t>(masks.size()) != int64_t{num_ranks} * tokens_per_rank) {
    return absl::InvalidArgumentError(absl::StrCat("BuildFanoutPlan: masks.size()=", masks.size(),
                                                   " != num_ranks ", num_ranks,
                                                   " x tokens_per_rank ", tokens_per_rank));
  }
  const uint32_t allowed = num_ranks == 32 ? ~0u : (1u << num_ranks) - 1;
  FanoutPlan plan;
  plan.num_ranks = num_ranks;
  plan.num_tokens = static_cast<int64_t>(masks.size());
  plan.rank_rows.assign(num_ranks, 0);
  for (size_t t = 0; t < masks.size(); ++t) {
    if ((masks[t] & ~allowed) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("BuildFanoutPlan: token ", t, " has mask 0x",
                                                     absl::Hex(masks[t]), ", a rank >= num_ranks ",
                                                     num_ranks));
    }
    for (uint32_t m = masks[t]; m != 0; m &= m - 1) ++plan.rank_rows[std::countr_zero(m)];
    plan.num_rows += std::popcount(masks[t]);
    plan.tokens_with_rows += masks[t] != 0 ? 1 : 0;
  }
  if (plan.num_rows > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("BuildFanoutPlan: ", plan.num_rows, " rows do not fit int32 row indices"));
  }
  // Each destination rank's first row, then its next free row as tokens arrive in order.
  std::vector<int64_t> next(num_ranks, 0);
  for (int32_t d = 1; d < num_ranks; ++d) next[d] = next[d - 1] + plan.rank_rows[d - 1];
  plan.row_begin.reserve(masks.size() + 1);
  plan.rows.reserve(static_cast<size_t>(plan.num_rows));
  plan.row_begin.push_back(0);
  for (uint32_t mask : masks) {
    for (uint32_t m = mask; m != 0; m &= m - 1) {
      plan.rows.push_back(static_cast<int32_t>(next[std::countr_zero(m)]++));
    }
    plan.row_begin.push_back(static_cast<int32_t>(plan.rows.size()));
  }
  return plan;
}

/// HBM bytes a pattern reads and writes.
struct HbmBytes {
  double read = 0;
  double write = 0;
  double total() const { return read + write; }
};

/// The dispatch fan-out: each token with a destination read once (`row_bytes`), written at
/// each of its destination rows.
inline HbmBytes DispatchFanoutBytes(const FanoutPlan& plan, int64_t row_bytes) {
  return {static_cast<double>(plan.tokens_with_rows) * static_cast<double>(row_bytes),
          static_cast<double>(plan.num_rows) * static_cast<double>(row_bytes)};
}

/// The combine fan-in: each destination row read once, one output row written per token
/// (a token without rows gets zeros).
inline HbmBytes CombineFaninBytes(const FanoutPlan& plan, int64_t row_bytes) {
  return {static_cast<double>(plan.num_rows) * static_cast<double>(row_bytes),
          static_cast<double>(plan.num_tokens) * static_cast<double>(row_bytes)};
}

/// One timed run of a bound kernel variant.
struct BoundTiming {
  std::string variant;
  int32_t blocks = 0;  ///< Blocks of the launch (one per SM).
  double us = 0;       ///< Microseconds per run.
};

/// The fastest of `timings` (least us). INVALID_ARGUMENT when empty or a time is not > 0.
inline absl::StatusOr<BoundTiming> FastestBound(std::span<const BoundTiming> timings) {
  if (timings.empty()) return absl::InvalidArgumentError("FastestBound: no timings");
  const BoundTiming* best = nullptr;
  for (const BoundTiming& t : timings) {
    if (!(t.us > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("FastestBound: variant ", t.variant, " has us=", t.us, " (need > 0)"));
    }
    if (best == nullptr || t.us < best->us) best = &t;
  }
  return *best;
}

/// An op's HBM rate beside its bound's and the device copy's, in TB/s, and the ratios.
struct FloorFigures {
  double op_tbps = 0;
  double bound_tbps = 0;
  double copy_tbps = 0;
  double op_over_copy = 0;     ///< The goal's figure.
  double op_over_bound = 0;    ///< Of the attainable for this pattern.
  double bound_over_copy = 0;  ///< How far the pattern itself falls short of a copy.
};

/// Figures of an op moving `op_bytes` HBM bytes in `op_us`, its bound moving `bound_bytes`
/// in `bound_us`, and the device copy's HBM rate `copy_tbps` (TB/s, read + write). Rates are
/// compared, so the bound need not move exactly the op's bytes. Times and the copy rate
/// must be > 0 (else the figures are 0).
inline FloorFigures ComputeFloorFigures(double op_bytes, double op_us, double bound_bytes,
                                        double bound_us, double copy_tbps) {
  FloorFigures f;
  if (!(op_us > 0) || !(bound_us > 0) || !(copy_tbps > 0)) return f;
  f.op_tbps = op_bytes / op_us / 1e6;
  f.bound_tbps = bound_bytes / bound_us / 1e6;
  f.copy_tbps = copy_tbps;
  f.op_over_copy = f.op_tbps / copy_tbps;
  f.op_over_bound = f.bound_tbps > 0 ? f.op_tbps / f.bound_tbps : 0;
  f.bound_over_copy = f.bound_tbps / copy_tbps;
  return f;
}

/// A low-latency op's p50 split into its fixed cost (the same op with T = 0 on every rank:
/// count exchange and barriers, no rows) and the data part, against a copy of its bytes.
struct FixedCostSplit {
  double op_us = 0;
  double fixed_us = 0;   ///< The T = 0 op.
  double memcpy_us = 0;  ///< A device copy of the op's bytes.
  double data_us = 0;    ///< op_us - fixed_us.
  /// data_us / memcpy_us: the rows' part of the op against the copy (0 without a copy).
  double data_over_memcpy = 0;
};

/// The split of `op_us` with `fixed_us` at T = 0 and `memcpy_us` for the same bytes.
inline FixedCostSplit SplitFixedCost(double op_us, double fixed_us, double memcpy_us) {
  FixedCostSplit s{op_us, fixed_us, memcpy_us, op_us - fixed_us, 0};
  if (memcpy_us > 0) s.data_over_memcpy = s.data_us / memcpy_us;
  return s;
}

/// A fresh dispatch against the cached one of the same routing (its layout reused: an
/// arrival barrier instead of the layout pass and count exchange, and no top-k metadata
/// moved), both in the same run.
struct RoutingShare {
  double fresh_us = 0;
  double cached_us = 0;
  /// fresh_us - cached_us: what the routing (layout pass, count exchange, handle written
  /// back, top-k metadata) adds to the op's critical path.
  double routing_us = 0;
  double routing_fraction = 0;  ///< routing_us / fresh_us.
  /// The fresh op's HBM bytes in the cached op's time over the copy's rate: the goal's figure
  /// the fresh op would reach without its routing.
  double without_routing_over_copy = 0;
  /// The cached op's own HBM bytes in its time over the copy's rate (its own goal figure).
  double cached_over_copy = 0;
};

/// The split of a fresh dispatch moving `fresh_bytes` HBM bytes in `fresh_us` against the
/// cached one moving `cached_bytes` in `cached_us`, with the device copy's HBM rate
/// `copy_tbps` (TB/s). Times and the copy rate must be > 0 (else every figure is 0 but the
/// times).
inline RoutingShare SplitRouting(double fresh_bytes, double fresh_us, double cached_bytes,
                                 double cached_us, double copy_tbps) {
  RoutingShare s;
  s.fresh_us = fresh_us;
  s.cached_us = cached_us;
  if (!(fresh_us > 0) || !(cached_us > 0) || !(copy_tbps > 0)) return s;
  s.routing_us = fresh_us - cached_us;
  s.routing_fraction = s.routing_us / fresh_us;
  s.without_routing_over_copy = fresh_bytes / cached_us / 1e6 / copy_tbps;
  s.cached_over_copy = cached_bytes / cached_us / 1e6 / copy_tbps;
  return s;
}

/// Where a normal dispatch's time goes, from the phase stamps its kernels wrote
/// (NormalDispatchArgs::phase_ns): per segment, the median over ops of the mean over ranks,
/// in microseconds. `skew` is a rank's notify start after the op's first rank's; `op` the
/// last rank's end after the first rank's start.
struct PhaseSplit {
  int32_t ops = 0;  ///< Ops whose stamps were all set and in order.
  double skew = 0, layout = 0, arrival = 0, counts = 0, to_copy = 0, copy = 0, done = 0, op = 0;
};

/// Splits `stamps`: [ops][ranks][phases] global-timer nanoseconds (phases = 7, in the order
/// of kernels::cuda::NormalDispatchPhase), laid out op-major. An op with a stamp of 0 (never
/// written) or stamps out of order on any rank is left out (`ops` counts the rest).
/// INVALID_ARGUMENT when the size is not ops x ranks x 7 or `ranks` < 1.
inline absl::StatusOr<PhaseSplit> SplitPhases(std::span<const uint64_t> stamps, int32_t ranks) {
  constexpr size_t kPhases = 7;
  if (ranks < 1 || stamps.size() % (kPhases * static_cast<size_t>(ranks)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SplitPhases: ", stamps.size(), " stamps are not ops x ranks = ", ranks, " x ", kPhases));
  }
  const size_t per_op = kPhases * static_cast<size_t>(ranks);
  constexpr int kSegments = 8;
  std::vector<double> segments[kSegments];
  for (size_t base = 0; base < stamps.size(); base += per_op) {
    const uint64_t* op = stamps.data() + base;
    bool ok = true;
    uint64_t first = std::numeric_limits<uint64_t>::max(), last = 0;
    for (int32_t r = 0; r < ranks && ok; ++r) {
      const uint64_t* t = op + r * kPhases;
      for (size_t i = 0; i < kPhases && ok; ++i) ok = t[i] != 0 && (i == 0 || t[i] >= t[i - 1]);
      first = std::min(first, t[0]);
      last = std::max(last, t[kPhases - 1]);
    }
    if (!ok) continue;
    double sum[kSegments] = {};
    for (int32_t r = 0; r < ranks; ++r) {
      const uint64_t* t = op + r * kPhases;
      sum[0] += static_cast<double>(t[0] - first);
      for (size_t i = 1; i < kPhases; ++i) sum[i] += static_cast<double>(t[i] - t[i - 1]);
    }
    for (int i = 0; i < kSegments - 1; ++i) segments[i].push_back(sum[i] / ranks / 1e3);
    segments[kSegments - 1].push_back(static_cast<double>(last - first) / 1e3);
  }
  PhaseSplit split;
  split.ops = static_cast<int32_t>(segments[0].size());
  if (split.ops == 0) return split;
  double medians[kSegments];
  for (int i = 0; i < kSegments; ++i) {
    std::vector<double>& v = segments[i];
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    medians[i] = n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  }
  split.skew = medians[0];
  split.layout = medians[1];
  split.arrival = medians[2];
  split.counts = medians[3];
  split.to_copy = medians[4];
  split.copy = medians[5];
  split.done = medians[6];
  split.op = medians[7];
  return split;
}

}  // namespace epd::bench
