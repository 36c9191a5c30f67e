// Per-expert totals kept by kernels in host memory (expert_tally.h).
#include "daemon/metrics/expert_tally.h"

#include <algorithm>

namespace epd::metrics {

ExpertTokenTally::ExpertTokenTally(int32_t num_ranks, int32_t experts_per_rank)
    : num_ranks_(std::max(num_ranks, 0)),
      experts_per_rank_(std::max(experts_per_rank, 0)),
      gone_(static_cast<size_t>(num_ranks_) * experts_per_rank_, 0),
      live_(num_ranks_) {}

void ExpertTokenTally::Attach(int32_t rank, const volatile uint64_t* counts) {
  if (rank < 0 || rank >= num_ranks_ || counts == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  live_[rank].push_back(counts);
}

void ExpertTokenTally::Retire(int32_t rank, const volatile uint64_t* counts) {
  if (rank < 0 || rank >= num_ranks_) return;
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const volatile uint64_t*>& blocks = live_[rank];
  auto it = std::find(blocks.begin(), blocks.end(), counts);
  if (it == blocks.end()) return;
  uint64_t* gone = gone_.data() + static_cast<size_t>(rank) * experts_per_rank_;
  for (int32_t j = 0; j < experts_per_rank_; ++j) gone[j] += counts[j];
  blocks.erase(it);  // No allocation: the capacity stays.
}

void ExpertTokenTally::AddTo(std::span<uint64_t> out) const {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t n = std::min(out.size(), gone_.size());
  for (size_t i = 0; i < n; ++i) out[i] += gone_[i];
  for (int32_t r = 0; r < num_ranks_; ++r) {
    const size_t first = static_cast<size_t>(r) * experts_per_rank_;
    for (const volatile uint64_t* block : live_[r]) {
      for (int32_t j = 0; j < experts_per_rank_ && first + j < n; ++j) out[first + j] += block[j];
    }
  }
}

}  // namespace epd::metrics
