// Internal helpers shared by the host ops: the worker pool and scratch behind
// HostWorkerPool / HostScratch, a fork-join ParallelFor, token chunking, and the argument
// checks every op performs before it writes anything.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"

namespace epd::kernels::host::internal {

/// Threads to use for `exec`: num_threads, or hardware_concurrency() when it is 0
/// (at least 1).
int ResolveThreads(const HostExecution& exec);

/// The body of one parallel loop: fn(i, slot) for one index i; `slot` in [0, threads) names
/// the thread running it (0 = the caller), for per-thread scratch.
using LoopBody = absl::FunctionRef<void(int64_t, int)>;

/// The state behind HostWorkerPool: worker threads that sleep on a condition variable
/// between jobs. A job is (n, body): the caller and up to `threads - 1` workers take
/// indices from a shared counter until it reaches n.
class WorkerPoolState {
 public:
  explicit WorkerPoolState(std::function<void()> on_thread_start)
      : on_thread_start_(std::move(on_thread_start)) {}
  ~WorkerPoolState();

  /// Starts workers until there are `count` (stops early if a thread cannot be started).
  /// Safe while another thread runs a job.
  void Start(int count);
  int num_workers() const;
  /// Runs fn(i, slot) for every i in [0, n) on the caller (slot 0) and up to `threads - 1`
  /// workers (slots 1...). Returns when every call has returned. Allocates only when it
  /// must start workers (the first time this many are wanted).
  void Run(int64_t n, int threads, LoopBody fn);

 private:
  void StartLocked(int count);  // mu_ held.
  void WorkerLoop(int slot);
  void Work(int slot);

  std::function<void()> on_thread_start_;
  mutable std::mutex mu_;
  std::condition_variable wake_;  // Workers wait for a new job (or stop_).
  std::condition_variable done_;  // The caller waits for running_ == 0.
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;  // Bumped per job (guarded by mu_).
  int job_workers_ = 0;      // Workers with slot <= job_workers_ take part in the job.
  int running_ = 0;          // Workers of the current job not done yet.
  bool stop_ = false;
  // The current job (set under mu_ before generation_ is bumped, read by its workers).
  std::optional<LoopBody> body_;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
};

/// The state behind HostScratch: every op's temporaries (see each op for shapes). Buffers
/// are only resized/assigned, so they keep their capacity from op to op.
struct ScratchState {
  std::vector<int32_t> num_tokens;         ///< [R] tokens of each rank (chunking).
  std::vector<int64_t> first_chunk;        ///< [R + 1] first token chunk of each rank.
  std::vector<int64_t> source_offset;      ///< [R + 1] Dispatch: start of a source in local_pos.
  std::vector<int32_t> local_pos;          ///< Dispatch: [sum T, R] row at each destination.
  std::vector<int32_t> count_to_rank;      ///< Dispatch: [R (source), R] tokens sent.
  std::vector<int32_t> count_to_expert;    ///< Dispatch, LL dispatch: [R (source), E].
  std::vector<int32_t> expert_base;        ///< LL dispatch: [R (source), E] next row.
  std::vector<int32_t> expert_total;       ///< LL dispatch: [E] rows of each expert.
  std::vector<uint8_t> marks;              ///< Cached Dispatch: [N] rows seen; LL combine: [R].
  std::vector<int64_t> prefix;             ///< Dispatch: [R (dest), R (source)] first row.
  std::vector<int64_t> num_recv;           ///< Dispatch: [R] rows received.
  std::vector<int32_t> layout_per_rank;    ///< GetDispatchLayout: [chunks, R] partial counts.
  std::vector<int32_t> layout_per_expert;  ///< GetDispatchLayout: [chunks, E].
  std::vector<float> acc;                  ///< Combines: [threads, H] f32 accumulators.
  std::vector<e4m3_bits> fp8_row;          ///< LL dispatch FP8: [threads, H] e4m3.
  std::vector<float> fp8_scales;           ///< LL dispatch FP8: [threads, S] f32.
};

/// One op's execution: its thread count, and the pool and scratch it uses (the caller's
/// persistent ones, or its own, made when first needed and dropped with it).
class OpContext {
 public:
  explicit OpContext(const HostExecution& exec);
  int threads() const { return threads_; }
  ScratchState& scratch();
  /// Calls fn(i, slot) once for every i in [0, n), on up to threads() threads (the caller
  /// is slot 0). Indices are handed out dynamically; callers make every index write a
  /// disjoint part of the output, so the result does not depend on the thread count or on
  /// scheduling. Returns when every call has returned.
  void ParallelFor(int64_t n, LoopBody fn);

 private:
  int threads_;
  HostWorkerPool* pool_;
  HostScratch* scratch_;
  std::optional<HostWorkerPool> own_pool_;
  std::optional<HostScratch> own_scratch_;
};

/// A run of tokens [begin, end) of one rank: the unit of work of the per-token loops.
struct TokenChunk {
  int32_t rank = 0;
  int32_t begin = 0;
  int32_t end = 0;
};

/// Every rank's tokens [0, num_tokens[r]) split into chunks of at most `grain` tokens
/// (grain >= 1), rank by rank, begin ascending; chunk c is computed on demand from a
/// per-rank table (no list of chunks is kept).
class TokenChunks {
 public:
  /// `num_tokens` [R] must outlive this; `first` is filled ([R + 1], reused).
  TokenChunks(std::span<const int32_t> num_tokens, int32_t grain, std::vector<int64_t>& first);
  int64_t size() const { return first_.back(); }
  TokenChunk operator[](int64_t c) const;

 private:
  std::span<const int32_t> num_tokens_;
  int32_t grain_;
  const std::vector<int64_t>& first_;
};

/// Fills scratch.num_tokens [R] with every rank's T (args[r].num_tokens) and returns it,
/// for TokenChunks.
template <typename RankArgs>
std::span<const int32_t> TokenCounts(std::span<RankArgs> args, ScratchState& scratch) {
  scratch.num_tokens.resize(args.size());
  for (size_t r = 0; r < args.size(); ++r) scratch.num_tokens[r] = args[r].num_tokens;
  return scratch.num_tokens;
}

/// Tokens per chunk for rows of `row_bytes` bytes: about 64 KiB of row data per chunk.
int32_t GrainForRowBytes(int64_t row_bytes);

/// Checks the group shape itself: R >= 1, E >= R, E % R == 0, H >= 1, K >= 1, M >= 0,
/// Mll >= 0. INVALID_ARGUMENT naming the field and value otherwise.
absl::Status CheckGroupShape(const GroupShape& shape);

/// INVALID_ARGUMENT when `fp8` and H % 128 != 0 (FP8 needs whole 128-channel blocks).
absl::Status CheckFp8Hidden(const GroupShape& shape, bool fp8, const char* op);

/// INVALID_ARGUMENT unless `num_args` == R.
absl::Status CheckNumRankArgs(const GroupShape& shape, size_t num_args, const char* op);

/// INVALID_ARGUMENT unless 0 <= num_tokens <= capacity (`capacity_name` names the limit).
absl::Status CheckNumTokens(int32_t rank, int32_t num_tokens, int32_t capacity,
                            const char* capacity_name);

/// INVALID_ARGUMENT "<op>: rank <r>: <field> is null" when `needed` and ptr is null.
absl::Status CheckPointer(const void* ptr, bool needed, const char* op, int32_t rank,
                          const char* field);

/// A normal dispatch's checks of receiving rank `rank` once it is known to get `total` rows:
/// within its recv_capacity, and every output it is written is there (scales with fp8,
/// topk rows unless the dispatch is cached, weights when weights are moved).
absl::Status CheckDispatchReceiver(const DispatchRankArgs& a, int32_t rank, int64_t total, bool fp8,
                                   bool cached, bool with_weights);

/// Same as CheckTopkIdx, with `rank` < 0 meaning "rank unknown" (left out of the message).
absl::Status CheckTopkIdxImpl(const GroupShape& shape, int32_t rank, int32_t num_tokens,
                              const int64_t* topk_idx);

/// True when topk_idx[k] also appears at an earlier position of the same row [0, k).
inline bool IsDuplicateInRow(const int64_t* row, int k) {
  for (int j = 0; j < k; ++j) {
    if (row[j] == row[k]) return true;
  }
  return false;
}

/// Stores the S scales of row `row` of local expert `local_expert` into a low-latency
/// dispatch's recv_scales `out` (LowLatencyScaleOffset: f32, or a UE8M0 byte each).
inline void StoreLowLatencyScales(const GroupShape& shape, bool ue8m0, void* out,
                                  int64_t local_expert, int64_t row, const float* scales) {
  auto* bytes = static_cast<uint8_t*>(out);
  for (int32_t g = 0; g < shape.num_scales(); ++g) {
    const uint64_t at = LowLatencyScaleOffset(shape, ue8m0, local_expert, row, g);
    if (ue8m0) {
      bytes[at] = Ue8m0Code(scales[g]);
    } else {
      std::memcpy(bytes + at, &scales[g], sizeof(float));
    }
  }
}

}  // namespace epd::kernels::host::internal
