// Fork-join parallelism and scratch for the host ops (see internal.h, host_ops.h:
// HostWorkerPool, HostScratch).
#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>

#include "kernels/host/internal.h"

namespace epd::kernels::host {
namespace internal {

int ResolveThreads(const HostExecution& exec) {
  if (exec.num_threads > 0) return exec.num_threads;
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// ---- WorkerPoolState -------------------------------------------------------------------

WorkerPoolState::~WorkerPoolState() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

int WorkerPoolState::num_workers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(workers_.size());
}

void WorkerPoolState::Start(int count) {
  std::lock_guard<std::mutex> lock(mu_);
  StartLocked(count);
}

void WorkerPoolState::StartLocked(int count) {
  // A worker started while a job runs has a slot above that job's job_workers_: it skips
  // the job (see WorkerLoop).
  if (static_cast<int>(workers_.size()) >= count) return;
  workers_.reserve(static_cast<size_t>(std::max(count, 0)));
  while (static_cast<int>(workers_.size()) < count) {
    const int slot = static_cast<int>(workers_.size()) + 1;
    try {
      workers_.emplace_back([this, slot] { WorkerLoop(slot); });
    } catch (const std::system_error&) {
      return;  // Out of threads: the ones running (and the caller) do the work.
    }
  }
}

void WorkerPoolState::Work(int slot) {
  const int64_t n = n_;
  const LoopBody& fn = *body_;
  for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n;
       i = next_.fetch_add(1, std::memory_order_relaxed)) {
    fn(i, slot);
  }
}

void WorkerPoolState::WorkerLoop(int slot) {
  if (on_thread_start_) on_thread_start_();
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (slot > job_workers_) continue;  // Not needed for this job.
    lock.unlock();
    Work(slot);
    lock.lock();
    if (--running_ == 0) done_.notify_one();
  }
}

void WorkerPoolState::Run(int64_t n, int threads, LoopBody fn) {
  if (n <= 0) return;
  const int wanted = static_cast<int>(std::min<int64_t>(std::max(threads, 1), n) - 1);
  int helpers = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    StartLocked(wanted);
    helpers = std::min(wanted, static_cast<int>(workers_.size()));
  }
  if (helpers == 0) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    body_.emplace(fn);
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    job_workers_ = helpers;
    running_ = helpers;
    ++generation_;
  }
  wake_.notify_all();
  Work(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return running_ == 0; });
  body_.reset();
}

// ---- OpContext -------------------------------------------------------------------------

OpContext::OpContext(const HostExecution& exec)
    : threads_(ResolveThreads(exec)), pool_(exec.pool), scratch_(exec.scratch) {}

ScratchState& OpContext::scratch() {
  if (scratch_ == nullptr) scratch_ = &own_scratch_.emplace();
  return scratch_->state();
}

void OpContext::ParallelFor(int64_t n, LoopBody fn) {
  if (n <= 0) return;
  if (threads_ <= 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  if (pool_ == nullptr) pool_ = &own_pool_.emplace();
  pool_->state().Run(n, threads_, fn);
}

// ---- TokenChunks -----------------------------------------------------------------------

TokenChunks::TokenChunks(std::span<const int32_t> num_tokens, int32_t grain,
                         std::vector<int64_t>& first)
    : num_tokens_(num_tokens), grain_(std::max<int32_t>(grain, 1)), first_(first) {
  first.resize(num_tokens.size() + 1);
  first[0] = 0;
  for (size_t r = 0; r < num_tokens.size(); ++r) {
    const int64_t t = std::max<int32_t>(num_tokens[r], 0);
    first[r + 1] = first[r] + (t + grain_ - 1) / grain_;
  }
}

TokenChunk TokenChunks::operator[](int64_t c) const {
  // The rank whose chunks [first[r], first[r + 1]) hold c (ranks without tokens hold none).
  const auto it = std::upper_bound(first_.begin(), first_.end(), c);
  const int32_t r = static_cast<int32_t>(it - first_.begin()) - 1;
  const int32_t begin = static_cast<int32_t>((c - first_[r]) * grain_);
  return {r, begin, std::min(num_tokens_[r], begin + grain_)};
}

int32_t GrainForRowBytes(int64_t row_bytes) {
  constexpr int64_t kChunkBytes = 64 * 1024;
  return static_cast<int32_t>(
      std::clamp<int64_t>(kChunkBytes / std::max<int64_t>(row_bytes, 1), 1, 1024));
}

}  // namespace internal

// ---- HostWorkerPool, HostScratch -------------------------------------------------------

HostWorkerPool::HostWorkerPool(std::function<void()> on_thread_start)
    : state_(std::make_unique<internal::WorkerPoolState>(std::move(on_thread_start))) {}
HostWorkerPool::~HostWorkerPool() = default;

void HostWorkerPool::Start(int num_threads) {
  state_->Start(internal::ResolveThreads({num_threads}) - 1);
}

int HostWorkerPool::num_workers() const { return state_->num_workers(); }

HostScratch::HostScratch() : state_(std::make_unique<internal::ScratchState>()) {}
HostScratch::~HostScratch() = default;

namespace {

/// The element counts Reserve grows each buffer to, in ScratchState's order.
struct ScratchSizes {
  size_t num_tokens, first_chunk, source_offset, local_pos, count_to_rank, count_to_expert,
      expert_base, expert_total, marks, prefix, num_recv, layout_per_rank, layout_per_expert, acc,
      fp8_row, fp8_scales;
};

ScratchSizes SizesOf(const GroupShape& shape, int num_threads) {
  const size_t R = static_cast<size_t>(shape.num_ranks);
  const size_t E = static_cast<size_t>(shape.num_experts);
  const size_t M = static_cast<size_t>(shape.max_tokens_per_rank);
  const size_t H = static_cast<size_t>(shape.hidden);
  const size_t threads = static_cast<size_t>(internal::ResolveThreads({num_threads}));
  const size_t layout_chunks = (M + 1023) / 1024;
  return ScratchSizes{R,
                      R + 1,
                      R + 1,
                      R * M * R,
                      R * R,
                      R * E,
                      R * E,
                      E,
                      std::max(R * M, R),
                      R * R,
                      R,
                      layout_chunks * R,
                      layout_chunks * E,
                      threads * H,
                      threads * H,
                      threads * static_cast<size_t>(shape.num_scales())};
}

}  // namespace

void HostScratch::Reserve(const GroupShape& shape, int num_threads) {
  if (!internal::CheckGroupShape(shape).ok()) return;
  internal::ScratchState& s = *state_;
  const ScratchSizes n = SizesOf(shape, num_threads);
  s.num_tokens.reserve(n.num_tokens);
  s.first_chunk.reserve(n.first_chunk);
  s.source_offset.reserve(n.source_offset);
  s.local_pos.reserve(n.local_pos);
  s.count_to_rank.reserve(n.count_to_rank);
  s.count_to_expert.reserve(n.count_to_expert);
  s.expert_base.reserve(n.expert_base);
  s.expert_total.reserve(n.expert_total);
  s.marks.reserve(n.marks);
  s.prefix.reserve(n.prefix);
  s.num_recv.reserve(n.num_recv);
  s.layout_per_rank.reserve(n.layout_per_rank);
  s.layout_per_expert.reserve(n.layout_per_expert);
  s.acc.reserve(n.acc);
  s.fp8_row.reserve(n.fp8_row);
  s.fp8_scales.reserve(n.fp8_scales);
}

uint64_t HostScratch::ReservedBytes(const GroupShape& shape, int num_threads) {
  if (!internal::CheckGroupShape(shape).ok()) return 0;
  using S = internal::ScratchState;
  const ScratchSizes n = SizesOf(shape, num_threads);
  auto bytes = [](size_t count, size_t elem) { return static_cast<uint64_t>(count) * elem; };
  return bytes(n.num_tokens, sizeof(S::num_tokens[0])) +
         bytes(n.first_chunk, sizeof(S::first_chunk[0])) +
         bytes(n.source_offset, sizeof(S::source_offset[0])) +
         bytes(n.local_pos, sizeof(S::local_pos[0])) +
         bytes(n.count_to_rank, sizeof(S::count_to_rank[0])) +
         bytes(n.count_to_expert, sizeof(S::count_to_expert[0])) +
         bytes(n.expert_base, sizeof(S::expert_base[0])) +
         bytes(n.expert_total, sizeof(S::expert_total[0])) + bytes(n.marks, sizeof(S::marks[0])) +
         bytes(n.prefix, sizeof(S::prefix[0])) + bytes(n.num_recv, sizeof(S::num_recv[0])) +
         bytes(n.layout_per_rank, sizeof(S::layout_per_rank[0])) +
         bytes(n.layout_per_expert, sizeof(S::layout_per_expert[0])) +
         bytes(n.acc, sizeof(S::acc[0])) + bytes(n.fp8_row, sizeof(S::fp8_row[0])) +
         bytes(n.fp8_scales, sizeof(S::fp8_scales[0]));
}

}  // namespace epd::kernels::host
