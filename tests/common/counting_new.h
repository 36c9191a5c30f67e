// A counting global operator new for the hot-path allocation tests
// (tests/unit/hot_path_alloc_test.cc, tests/gpu/cuda_hot_path_alloc_test.cc): every global
// operator new / new[] is forwarded to malloc and counted per thread, and into the engine,
// kernel or client counter on the threads a test marks (MarkEngineThread, t_in_kernels,
// t_client). Malloc called directly (the CUDA runtime and driver) is not counted. Exactly
// one translation unit of a binary defines EPD_COUNTING_NEW_DEFINE_OPERATORS before
// including this header; unmarked threads only bump their t_allocs. Details:
// docs/CUDA_BACKEND.md "Hot path: no allocation per op".
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>

#include "absl/strings/str_cat.h"

namespace epd::testing::counting_new {

inline thread_local bool t_engine = false;        ///< This thread is an engine thread.
inline thread_local bool t_in_kernels = false;    ///< Inside kernels/host (engine thread).
inline thread_local bool t_client = false;        ///< This thread is the test's (client) thread.
inline thread_local uint64_t t_allocs = 0;        ///< Allocations by this thread (any thread).
inline std::atomic<uint64_t> g_engine_allocs{0};  ///< Engine threads, outside kernels/host.
inline std::atomic<uint64_t> g_kernel_allocs{0};  ///< Engine threads, inside kernels/host.
inline std::atomic<uint64_t> g_client_allocs{0};  ///< Client-marked threads (not engine).

/// Whose allocation sizes are recorded: index of RecordedSizes' `who`.
enum Who : int { kClientThread = 0, kEngineThread = 1 };
/// Allocation sizes recorded per thread kind and window.
inline constexpr int kMaxSizes = 8;
inline std::atomic<bool> g_record_sizes{false};
inline std::array<std::atomic<int>, 2> g_num_sizes{};
inline std::array<std::array<std::atomic<size_t>, kMaxSizes>, 2> g_sizes{};

/// Counts one allocation of `bytes` on the calling thread (see the file comment).
inline void CountAllocation(size_t bytes) noexcept {
  ++t_allocs;
  if (t_engine) {
    (t_in_kernels ? g_kernel_allocs : g_engine_allocs).fetch_add(1, std::memory_order_relaxed);
  } else if (t_client) {
    g_client_allocs.fetch_add(1, std::memory_order_relaxed);
  }
  const int who = t_client ? kClientThread : (t_engine && !t_in_kernels) ? kEngineThread : -1;
  if (who >= 0 && g_record_sizes.load(std::memory_order_relaxed)) {
    const int i = g_num_sizes[who].fetch_add(1);
    if (i < kMaxSizes) g_sizes[who][i].store(bytes);
  }
}

/// The replacement operators' body: counts, then malloc (posix_memalign above
/// alignof(max_align_t)); std::bad_alloc on failure unless `nothrow` (then nullptr).
inline void* Allocate(size_t bytes, size_t alignment, bool nothrow) {
  CountAllocation(bytes);
  if (bytes == 0) bytes = 1;
  void* p = nullptr;
  if (alignment <= alignof(std::max_align_t)) {
    p = std::malloc(bytes);
  } else if (posix_memalign(&p, std::max(alignment, sizeof(void*)), bytes) != 0) {
    p = nullptr;
  }
  if (p == nullptr && !nothrow) throw std::bad_alloc();
  return p;
}

/// Marks the calling thread as an engine thread (call it from on_engine_start) and makes one
/// probe allocation there, which proves that the engine threads' allocations are counted
/// (g_engine_allocs grows by 1).
inline void MarkEngineThread() {
  t_engine = true;
  ::operator delete(::operator new(16));
}

/// True when the counting operator new is in force in this binary (a probe allocation on
/// the calling thread is counted).
inline bool CountingNewInForce() {
  const uint64_t before = t_allocs;
  ::operator delete(::operator new(16));
  return t_allocs == before + 1;
}

/// Starts recording the sizes of the first kMaxSizes allocations of each Who (a new window:
/// the earlier records are dropped). Allocates nothing.
inline void StartRecordingSizes() {
  for (auto& n : g_num_sizes) n = 0;
  g_record_sizes = true;
}
inline void StopRecordingSizes() { g_record_sizes = false; }

/// The sizes (bytes) of the first allocations of one Who in a window: a copy, no allocation.
struct RecordedSizes {
  std::array<size_t, kMaxSizes> bytes{};
  int n = 0;  ///< Entries of `bytes` in use (<= kMaxSizes).
  /// "a, b, c" (allocates: call it outside counted windows).
  std::string ToString() const {
    std::string s;
    for (int i = 0; i < n; ++i) absl::StrAppend(&s, i ? ", " : "", bytes[i]);
    return s;
  }
};

/// The sizes recorded for `who` since the last StartRecordingSizes. Allocates nothing.
inline RecordedSizes TakeRecordedSizes(Who who) {
  RecordedSizes r;
  r.n = std::min(g_num_sizes[who].load(), kMaxSizes);
  for (int i = 0; i < r.n; ++i) r.bytes[i] = g_sizes[who][i].load();
  return r;
}

}  // namespace epd::testing::counting_new

#ifdef EPD_COUNTING_NEW_DEFINE_OPERATORS
// The replacement global operators (exactly one translation unit per binary).
void* operator new(size_t n) { return epd::testing::counting_new::Allocate(n, 0, false); }
void* operator new[](size_t n) { return epd::testing::counting_new::Allocate(n, 0, false); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  return epd::testing::counting_new::Allocate(n, 0, true);
}
void* operator new[](size_t n, const std::nothrow_t&) noexcept {
  return epd::testing::counting_new::Allocate(n, 0, true);
}
void* operator new(size_t n, std::align_val_t a) {
  return epd::testing::counting_new::Allocate(n, static_cast<size_t>(a), false);
}
void* operator new[](size_t n, std::align_val_t a) {
  return epd::testing::counting_new::Allocate(n, static_cast<size_t>(a), false);
}
void* operator new(size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return epd::testing::counting_new::Allocate(n, static_cast<size_t>(a), true);
}
void* operator new[](size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return epd::testing::counting_new::Allocate(n, static_cast<size_t>(a), true);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
#endif  // EPD_COUNTING_NEW_DEFINE_OPERATORS
