// Where a daemon-launched op's microseconds go (see op_launch_trace.h).
#include "daemon/dataplane/op_launch_trace.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace epd {
namespace {

/// Microseconds from `a` to `b`, or nothing when either is unset or b is before a.
std::optional<double> SpanUs(OpLaunchTrace::Clock::time_point a,
                             OpLaunchTrace::Clock::time_point b) {
  if (a == OpLaunchTrace::Clock::time_point{} || b == OpLaunchTrace::Clock::time_point{} || b < a) {
    return std::nullopt;
  }
  return std::chrono::duration<double, std::micro>(b - a).count();
}

}  // namespace

bool OpTraceEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("EPD_OP_TRACE");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return on;
}

void OpLaunchTrace::Sum::Add(double us) {
  ++count;
  total_us += us;
  max_us = std::max(max_us, us);
}

void OpLaunchTrace::Record(const Op& op) {
  if (!window_start_) window_start_ = op.done_seen != Clock::time_point{} ? op.done_seen : op.start;
  ++ops_;
  graph_ops_ += op.graph ? 1 : 0;
  launch_calls_ += static_cast<uint64_t>(std::max(op.launch_calls, 0));
  const std::optional<double> spans[kNumSegments] = {
      SpanUs(op.first_arrival, op.last_arrival),
      SpanUs(op.last_arrival, op.start),
      SpanUs(op.start, op.launched),
      SpanUs(op.launched, op.done_seen),
      op.gpu_ns ? std::optional<double>(static_cast<double>(*op.gpu_ns) / 1000.0) : std::nullopt,
  };
  for (int s = 0; s < kNumSegments; ++s) {
    if (spans[s]) sums_[s].Add(*spans[s]);
  }
  if (spans[kLaunchToDone] && spans[kGpu]) {
    launch_to_done_minus_gpu_.Add(*spans[kLaunchToDone] - *spans[kGpu]);
  }
}

std::optional<std::string> OpLaunchTrace::MaybeSummary(Clock::time_point now) {
  if (!window_start_ || ops_ == 0 || now - *window_start_ < window_) return std::nullopt;
  static constexpr const char* kNames[kNumSegments] = {
      "arrival spread", "last arrival→start", "start→launched", "launched→done seen", "GPU"};
  std::string out = absl::StrFormat("%u ops (%u through op graphs, %.1f launch calls/op)", ops_,
                                    graph_ops_, static_cast<double>(launch_calls_) / ops_);
  auto append = [&out](const char* name, const Sum& s) {
    if (s.count == 0) {
      absl::StrAppend(&out, "; ", name, " -");
      return;
    }
    absl::StrAppend(&out, absl::StrFormat("; %s mean %.1f max %.1f us", name,
                                          s.total_us / static_cast<double>(s.count), s.max_us));
  };
  for (int s = 0; s < kNumSegments; ++s) append(kNames[s], sums_[s]);
  append("launched→done seen minus GPU (GPU start + poll slack)", launch_to_done_minus_gpu_);
  window_start_.reset();
  ops_ = graph_ops_ = launch_calls_ = 0;
  sums_ = {};
  launch_to_done_minus_gpu_ = Sum{};
  return out;
}

}  // namespace epd
