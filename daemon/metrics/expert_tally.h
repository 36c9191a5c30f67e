// Per-expert received-token totals that GPU kernels keep in host-mapped memory
// (kernels::cuda::ExpertTokenStats), gathered for the metrics scrape: one block of El
// counters per attached rank, read on demand, and what blocks of ranks that left had
// counted. Plain C++ (no CUDA): the CUDA backend hands it the blocks' host addresses.
#pragma once

#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

namespace epd::metrics {

/// The group's per-expert totals across attached ranks and ranks gone. Thread-safe: blocks
/// come and go on the control path or the engine thread, AddTo runs at scrape time; one
/// mutex, held for El loads at most per block. No allocation in Retire or AddTo.
class ExpertTokenTally {
 public:
  /// `num_ranks` R >= 0, `experts_per_rank` El >= 0 (negative: 0).
  ExpertTokenTally(int32_t num_ranks, int32_t experts_per_rank);

  /// Rank `rank`'s block `counts` ([El] uint64, host memory that its kernels store running
  /// totals into, starting at 0) counts from now on, until Retire. A rank may have more
  /// than one block at a time (a rank that rejoined while its old block's op still ran).
  /// Allocates (control path). A rank out of range is ignored.
  void Attach(int32_t rank, const volatile uint64_t* counts);
  /// The block is final (no kernel writes it any more) and is about to be freed: its totals
  /// move into what ranks gone counted. Unknown blocks are ignored. Allocates nothing.
  void Retire(int32_t rank, const volatile uint64_t* counts);
  /// Adds each global expert's total (rank * El + j) to out[rank * El + j]; `out` has
  /// R * El entries (a shorter span gets the entries that fit).
  void AddTo(std::span<uint64_t> out) const;

  int32_t num_ranks() const { return num_ranks_; }
  int32_t experts_per_rank() const { return experts_per_rank_; }

 private:
  const int32_t num_ranks_;
  const int32_t experts_per_rank_;
  mutable std::mutex mu_;
  std::vector<uint64_t> gone_;                               ///< [R * El]
  std::vector<std::vector<const volatile uint64_t*>> live_;  ///< [R] attached blocks.
};

}  // namespace epd::metrics
