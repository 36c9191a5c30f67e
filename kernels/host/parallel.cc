// Fork-join parallelism and scratch for the host ops (see internal.h, host_ops.h:
// HostWorkerPool, HostScratch).
#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>
#include <type_traits>

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

/// Calls f(buffer, element count) for every buffer of `s` with the count Reserve grows it
/// to for `shape` and `num_threads` (one list for Reserve and ReservedBytes).
template <typename F>
void ForEachScratchBuffer(internal::ScratchState& s, const GroupShape& shape, int num_threads,
                          F f) {
  const size_t R = static_cast<size_t>(shape.num_ranks);
  const size_t E = static_cast<size_t>(shape.num_experts);
  const size_t M = static_cast<size_t>(shape.max_tokens_per_rank);
  const size_t H = static_cast<size_t>(shape.hidden);
  const size_t threads = static_cast<size_t>(internal::ResolveThreads({num_threads}));
  const size_t layout_chunks = (M + 1023) / 1024;
  f(s.num_tokens, R);
  f(s.first_chunk, R + 1);
  f(s.source_offset, R + 1);
  f(s.local_pos, R * M * R);
  f(s.count_to_rank, R * R);
  f(s.count_to_expert, R * E);
  f(s.expert_base, R * E);
  f(s.expert_total, E);
  f(s.marks, std::max(R * M, R));
  f(s.prefix, R * R);
  f(s.num_recv, R);
  f(s.layout_per_rank, layout_chunks * R);
  f(s.layout_per_expert, layout_chunks * E);
  f(s.acc, threads * H);
  f(s.fp8_row, threads * H);
  f(s.fp8_scales, threads * static_cast<size_t>(shape.num_scales()));
}

}  // namespace

void HostScratch::Reserve(const GroupShape& shape, int num_threads) {
  if (!internal::CheckGroupShape(shape).ok()) return;
  ForEachScratchBuffer(*state_, shape, num_threads,
                       [](auto& buffer, size_t count) { buffer.reserve(count); });
}

uint64_t HostScratch::ReservedBytes(const GroupShape& shape, int num_threads) {
  if (!internal::CheckGroupShape(shape).ok()) return 0;
  internal::ScratchState empty;  // Only its buffers' element types are used.
  uint64_t bytes = 0;
  ForEachScratchBuffer(empty, shape, num_threads, [&bytes](auto& buffer, size_t count) {
    using T = typename std::decay_t<decltype(buffer)>::value_type;
    bytes += static_cast<uint64_t>(count) * sizeof(T);
  });
  return bytes;
}

}  // namespace epd::kernels::host
