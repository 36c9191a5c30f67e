// Where a daemon-launched op's microseconds go on the daemon's side (EPD_OP_TRACE): per
// op, the engine's timestamps from the first rank's request seen to the op's end seen,
// summed over a window and summarised once per window. A diagnostic: off by default.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace epd {

/// EPD_OP_TRACE=1 (a diagnostic, off by default): the CUDA backend's groups trace every
/// daemon-launched op (OpLaunchTrace) and log the summary once a second (epd.engine).
bool OpTraceEnabled();

/// The per-op trace of one group, on its engine thread. Record allocates nothing; the
/// summary (one string per window) does.
class OpLaunchTrace {
 public:
  using Clock = std::chrono::steady_clock;

  /// One op's timestamps (engine thread, steady clock). Unset points (epoch) leave their
  /// segments out of the window.
  struct Op {
    Clock::time_point first_arrival;  ///< The first rank's request seen by the engine.
    Clock::time_point last_arrival;   ///< The last rank's (the op can start from here).
    Clock::time_point start;          ///< The backend's start of the op (StartOpInto).
    Clock::time_point launched;       ///< Every launch call of the op returned.
    Clock::time_point done_seen;      ///< The engine saw the op complete on the GPU.
    /// The op's GPU time (first kernel's begin event to the last done event), if timed.
    std::optional<uint64_t> gpu_ns;
    int32_t launch_calls = 0;  ///< CUDA enqueue calls of the launch (graph: one per GPU).
    bool graph = false;        ///< Launched through the group's op graphs.
  };

  /// The segments summed per window, in order.
  enum Segment : int {
    kArrivalSpread = 0,  ///< first_arrival → last_arrival (the clients' submit spread).
    kPickupToStart,      ///< last_arrival → start (the engine's round, the GPU claim).
    kLaunch,             ///< start → launched (the daemon's CPU launch path).
    kLaunchToDone,       ///< launched → done_seen (GPU start + GPU time + poll slack).
    kGpu,                ///< gpu_ns.
    kNumSegments,
  };

  explicit OpLaunchTrace(Clock::duration window = std::chrono::seconds(1)) : window_(window) {}

  /// Adds `op` to the window.
  void Record(const Op& op);
  /// Once the window (from its first op) has passed at `now`: the summary of its ops
  /// ("N ops (G through graphs, L launch calls/op): arrival spread mean/max µs, ...,
  /// launched→done minus GPU mean µs") and a new window; otherwise nothing.
  std::optional<std::string> MaybeSummary(Clock::time_point now);

 private:
  struct Sum {
    uint64_t count = 0;
    double total_us = 0;
    double max_us = 0;
    void Add(double us);
  };
  Clock::duration window_;
  std::optional<Clock::time_point> window_start_;
  uint64_t ops_ = 0;
  uint64_t graph_ops_ = 0;
  uint64_t launch_calls_ = 0;
  std::array<Sum, kNumSegments> sums_{};
  Sum launch_to_done_minus_gpu_;
};

}  // namespace epd
