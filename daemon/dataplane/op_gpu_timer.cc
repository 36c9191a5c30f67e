// GPU time of a lockstep op from per-rank events (op_gpu_timer.h).
#include "daemon/dataplane/op_gpu_timer.h"

#include <algorithm>
#include <cmath>

namespace epd {

OpGpuTimer::OpGpuTimer(TimingEvents* events, int32_t num_ranks)
    : events_(events), ranks_(static_cast<size_t>(std::max(num_ranks, 0))) {}

void OpGpuTimer::Start() { std::fill(ranks_.begin(), ranks_.end(), RankEvents{}); }

bool OpGpuTimer::Begin(int32_t r, void* event, void* stream) {
  if (r < 0 || static_cast<size_t>(r) >= ranks_.size() || event == nullptr) return false;
  if (!events_->Record(event, stream)) return false;
  ranks_[r].begin = event;
  return true;
}

void OpGpuTimer::SetBegin(int32_t r, void* event) {
  if (r >= 0 && static_cast<size_t>(r) < ranks_.size()) ranks_[r].begin = event;
}

void OpGpuTimer::SetEnd(int32_t r, void* event) {
  if (r >= 0 && static_cast<size_t>(r) < ranks_.size()) ranks_[r].end = event;
}

std::optional<uint64_t> OpGpuTimer::Finish() const {
  if (ranks_.empty()) return std::nullopt;
  float longest_ms = 0;
  for (const RankEvents& r : ranks_) {
    if (r.begin == nullptr || r.end == nullptr) return std::nullopt;
    // The end comes after the begin on the same stream: complete end, complete begin.
    if (events_->Query(r.end) != TimingEvents::State::kComplete) return std::nullopt;
    float ms = 0;
    if (!events_->ElapsedMs(r.begin, r.end, &ms) || !std::isfinite(ms) || ms < 0) {
      return std::nullopt;
    }
    longest_ms = std::max(longest_ms, ms);
  }
  return static_cast<uint64_t>(std::llround(static_cast<double>(longest_ms) * 1e6));
}

}  // namespace epd
