// GPU time of a lockstep op from events recorded on each rank's stream: a begin event
// before the op's kernels, an end event after them, read back once the engine has already
// seen the op complete, so the engine thread never waits on the GPU for it. The event
// calls sit behind TimingEvents (CUDA events on the CUDA backend, a fake in unit tests).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace epd {

/// The event calls OpGpuTimer makes. Events and streams are opaque handles (cudaEvent_t,
/// cudaStream_t on the CUDA backend). No call blocks.
class TimingEvents {
 public:
  enum class State { kComplete, kPending, kFailed };
  virtual ~TimingEvents() = default;
  /// Records `event` on `stream` (cudaEventRecord). False when that failed.
  virtual bool Record(void* event, void* stream) = 0;
  /// Whether the work before `event`'s latest record has completed (cudaEventQuery).
  virtual State Query(void* event) = 0;
  /// Milliseconds from `begin` to `end`, both complete (cudaEventElapsedTime). False when
  /// the time is unavailable (an event without timing, never recorded, on two devices).
  virtual bool ElapsedMs(void* begin, void* end, float* ms) = 0;
};

/// One op's GPU time: per rank, the time from its begin event to its end event; the op's,
/// the longest of its ranks' (ranks on several GPUs run side by side). Sized for R ranks
/// at construction: an op allocates nothing. One op at a time (the group's engine thread).
class OpGpuTimer {
 public:
  /// `events` outlives the timer.
  OpGpuTimer(TimingEvents* events, int32_t num_ranks);

  /// A new op: no rank has its events yet.
  void Start();
  /// Records rank r's begin `event` on its `stream`, before the op's kernels there. False
  /// (and the op is then not timed) when the record failed or r is out of range.
  bool Begin(int32_t r, void* event, void* stream);
  /// Rank r's begin `event`, already recorded before the op's kernels (a node of a CUDA
  /// graph the op was launched through). Ignored when r is out of range.
  void SetBegin(int32_t r, void* event);
  /// Rank r's end `event`, recorded by the caller on the rank's stream after the op's
  /// kernels (on the CUDA backend: the op's done event, which the engine polls anyway).
  void SetEnd(int32_t r, void* event);
  /// The op's GPU time in nanoseconds, once the engine has seen every end event complete:
  /// the longest begin → end of the ranks. Nothing when a rank lacks its begin or end, an
  /// event is not complete (Query, never a wait) or failed, or a time is unavailable.
  std::optional<uint64_t> Finish() const;

 private:
  struct RankEvents {
    void* begin = nullptr;
    void* end = nullptr;
  };
  TimingEvents* events_;
  std::vector<RankEvents> ranks_;  ///< [R]
};

}  // namespace epd
