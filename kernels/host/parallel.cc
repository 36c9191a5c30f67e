// Fork-join parallelism and scratch for the host ops (see internal.h, host_ops.h:
// HostWorkerPool, HostScratch).
#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>

#include "internal.h"

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

void HostScratch::Reserve(const GroupShape& shape, int num_threads) {
  if (!internal::CheckGroupShape(shape).ok()) return;
  internal::ScratchState& s = *state_;
  const size_t R = static_cast<size_t>(shape.num_ranks);
  const size_t E = static_cast<size_t>(shape.num_experts);
  const size_t M = static_cast<size_t>(shape.max_tokens_per_rank);
  const size_t H = static_cast<size_t>(shape.hidden);
  const size_t threads = static_cast<size_t>(internal::ResolveThreads({num_threads}));
  s.num_tokens.reserve(R);
  s.first_chunk.reserve(R + 1);
  s.source_offset.reserve(R + 1);
  s.local_pos.reserve(R * M * R);
  s.count_to_rank.reserve(R * R);
  s.count_to_expert.reserve(R * E);
  s.expert_base.reserve(R * E);
  s.expert_total.reserve(E);
  s.marks.reserve(std::max(R * M, R));
  s.prefix.reserve(R * R);
  s.num_recv.reserve(R);
  const size_t layout_chunks = (M + 1023) / 1024;
  s.layout_per_rank.reserve(layout_chunks * R);
  s.layout_per_expert.reserve(layout_chunks * E);
  s.acc.reserve(threads * H);
  s.fp8_row.reserve(threads * H);
  s.fp8_scales.reserve(threads * static_cast<size_t>(shape.num_scales()));
}

}  // namespace epd::kernels::host
