// Helpers shared by the CUDA benchmark sources of epd_bench (bench_ll.cu, bench_normal.cu,
// bench_multigpu.cu, bench_launch.cc): filling device memory with a finite pattern, the
// device-to-device copy bound, the fan-out copy bound of the normal ops, the gated per-op
// timer of the low-latency figures, and the in-process low-latency measurement the launch
// modes are compared with. Needs CUDA
// (declared only when EPD_HAVE_CUDA).
#pragma once

#if defined(EPD_HAVE_CUDA)
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epd/kernels/layout.h"
#include "tests/bench/bench.h"
#include "tests/bench/floors.h"

namespace epd::testing {
class VirtualRankGroup;
}  // namespace epd::testing

namespace epd::bench {

/// The normal-mode benchmark shape (DeepSeek-V3 prefill): T=4096 tokens per rank,
/// H=7168, K=8, E=256, FP8 enabled, with `ranks` ranks (8 virtual ranks in bench_normal.cu,
/// one per GPU in bench_multigpu.cu).
inline constexpr int32_t kNormalBenchTokens = 4096;
inline constexpr int32_t kNormalBenchHidden = 7168;
inline constexpr int32_t kNormalBenchTopk = 8;
inline constexpr int32_t kNormalBenchExperts = 256;
inline kernels::GroupShape NormalBenchShape(int32_t ranks) {
  kernels::GroupShape shape;
  shape.num_ranks = ranks;
  shape.num_experts = kNormalBenchExperts;
  shape.hidden = kNormalBenchHidden;
  shape.num_topk = kNormalBenchTopk;
  shape.max_tokens_per_rank = kNormalBenchTokens;
  shape.use_fp8 = true;
  return shape;
}

/// The low-latency benchmark shape (DeepSeek-V3 decode): T=128 tokens per rank (the LL
/// capacity), H=7168, K=8, E=256, FP8 enabled, with `ranks` ranks.
inline constexpr int32_t kLowLatencyBenchTokens = 128;
inline kernels::GroupShape LowLatencyBenchShape(int32_t ranks) {
  kernels::GroupShape s;
  s.num_ranks = ranks;
  s.num_experts = 256;
  s.hidden = 7168;
  s.num_topk = 8;
  s.max_tokens_per_rank = 1;
  s.ll_max_tokens_per_rank = kLowLatencyBenchTokens;
  s.use_fp8 = true;
  return s;
}

/// Enqueues on `stream` a fill of `bytes` (a multiple of 4) at device address `dst` with a
/// hash of each 32-bit word's index and `seed`, every bf16 half (and f32 word) finite
/// (bandwidth does not depend on the values; a kernel is faster than uploading GBs).
/// Errors: INTERNAL for a CUDA launch error, INVALID_ARGUMENT for bytes % 4 != 0.
absl::Status FillPatternAsync(void* dst, size_t bytes, uint32_t seed, cudaStream_t stream);

/// Latency of one device-to-device cudaMemcpyAsync of `bytes` on the current GPU, in µs:
/// `iterations` copies after `warmup`, each timed alone with events (p50/p99).
/// Errors: INTERNAL (CUDA).
absl::StatusOr<Percentiles> TimeDeviceCopy(size_t bytes, int warmup, int iterations);

/// Which op's byte pattern a FanoutBound moves.
enum class FanoutKind {
  kDispatch,  ///< Each token row read once, written at each of its destination rows.
  kCombine,   ///< Each token's destination rows read (bf16), summed, written once.
};

/// The fan-out copy bound of the normal ops (bench_fanout.cu): the dispatch's or the
/// combine's HBM byte pattern on a FanoutPlan (the bench's routing), with none of the ops'
/// logic, in kernel variants whose fastest is the bound. Owns its device buffers (the
/// tokens' rows and the destination rows, each `max_row_bytes` wide) and a stream.
class FanoutBound {
 public:
  /// Buffers for `plan`, filled with a finite bf16 pattern. INVALID_ARGUMENT when
  /// max_row_bytes is not a positive multiple of 16 or the plan's arrays do not match its
  /// sizes; INTERNAL (CUDA).
  static absl::StatusOr<std::unique_ptr<FanoutBound>> Create(const FanoutPlan& plan,
                                                             int64_t max_row_bytes);
  ~FanoutBound();
  FanoutBound(const FanoutBound&) = delete;
  FanoutBound& operator=(const FanoutBound&) = delete;

  /// The kernel variants of `kind` on this GPU (the bulk ones on sm_90 and later only).
  std::vector<std::string> Variants(FanoutKind kind) const;
  /// Microseconds per run of `variant` with rows of `row_bytes` (a multiple of 16, at most
  /// max_row_bytes; a combine's rows are bf16) on `blocks` blocks, one per SM: the mean of
  /// `iterations` back-to-back runs after `warmup`. The first time for a variant and row
  /// size, its output is checked first (every row it must write). INVALID_ARGUMENT for an
  /// unknown variant or bad sizes; INTERNAL (CUDA, a bulk load past its bound, wrong bytes).
  absl::StatusOr<double> Time(FanoutKind kind, const std::string& variant, int64_t row_bytes,
                              int32_t blocks, int warmup, int iterations);
  /// Time() of every variant of `kind`, in Variants() order.
  absl::StatusOr<std::vector<BoundTiming>> TimeVariants(FanoutKind kind, int64_t row_bytes,
                                                        int32_t blocks, int warmup, int iterations);
  const FanoutPlan& plan() const { return plan_; }

 private:
  struct Buffers;
  FanoutBound();
  absl::Status Launch(FanoutKind kind, const std::string& variant, int64_t row_bytes,
                      int32_t blocks);
  /// Runs the variant once on a cleared output and checks every byte it wrote (once per
  /// kind, variant and row size). INTERNAL naming the variant when any is wrong.
  absl::Status Check(FanoutKind kind, const std::string& variant, int64_t row_bytes,
                     int32_t blocks);
  FanoutPlan plan_;
  int64_t max_row_bytes_ = 0;
  cudaDeviceProp prop_{};
  std::unique_ptr<Buffers> buf_;
  std::vector<std::string> checked_;  // kind/variant/row_bytes checked so far
};

/// Latency of `bytes` copied device-to-host into pinned memory and back on one stream of the
/// current GPU, in µs (the copies a node's bytes take when they cross it staged through the
/// host): `iterations` round trips after `warmup`, each timed with events. Errors: INTERNAL.
absl::StatusOr<Percentiles> TimeHostDeviceRoundTrip(size_t bytes, int warmup, int iterations);

/// Prints one op's fixed-cost split (floors.h SplitFixedCost) of the figures `bench` / `mode`:
/// as a JSON line ("figure":"ll_fixed_cost"), else as the text " <op> op p50 .., T=0 p50 ..,
/// memcpy p50 ..: (op - T0) / memcpy ..x;" of a line the caller starts and ends.
void PrintFixedCostSplit(const char* bench, const char* mode, const char* op,
                         const std::string& device, const FixedCostSplit& f, bool json);

/// One op's latency over all ranks, in µs: `span` = last end event - first start event
/// over the ranks' streams (the figure), `after_last` = the shortest per-rank end - start,
/// i.e. from the last rank's start to its end (no launch skew), and `host` = host wall
/// time from the first launch call to the end of the iteration's `after` callback.
struct OpTimes {
  Percentiles span;
  Percentiles after_last;
  Percentiles host;
};

/// Accumulates per-iteration samples into OpTimes.
class OpTimesBuilder {
 public:
  void Add(double span_us, double after_last_us, double host_us) {
    span_.push_back(span_us);
    after_last_.push_back(after_last_us);
    host_.push_back(host_us);
  }
  OpTimes Build() const {
    return OpTimes{ComputePercentiles(span_), ComputePercentiles(after_last_),
                   ComputePercentiles(host_)};
  }

 private:
  std::vector<double> span_, after_last_, host_;
};

/// Times one op on R streams of the current GPU per iteration, behind a common gate:
/// every stream first waits on a device word (cuStreamWaitValue32), records a start event,
/// gets the op (`launch`), records an end event; the host then opens the gate
/// (cuStreamWriteValue32 on a stream of its own), so host launch skew is not timed; then
/// waits for every stream and calls `after`. The driver entry points are resolved through
/// the runtime (epd_bench must start on machines without the NVIDIA driver).
class GatedTimer {
 public:
  /// `launch(r, iteration, stream)` enqueues rank r's op of this iteration on `stream`.
  using Launch = std::function<absl::Status(int32_t, int, cudaStream_t)>;
  /// `after(iteration)`: once every stream has passed its end event (e.g. PendingOp::Wait).
  using After = std::function<absl::Status(int)>;

  /// Timer for `ranks` streams. Errors: INTERNAL (CUDA, driver entry points).
  static absl::StatusOr<std::unique_ptr<GatedTimer>> Create(int32_t ranks);
  ~GatedTimer();
  GatedTimer(const GatedTimer&) = delete;
  GatedTimer& operator=(const GatedTimer&) = delete;

  /// `warmup` + `iterations` iterations on `streams` (size == ranks); percentiles over the
  /// timed ones. Errors: the first of launch / after / CUDA.
  absl::StatusOr<OpTimes> Run(const std::vector<cudaStream_t>& streams, int warmup, int iterations,
                              const Launch& launch, const After& after = nullptr);

  /// One iteration's times in µs (the fields of OpTimes, before percentiles).
  struct Sample {
    double span = 0;
    double after_last = 0;
    double host = 0;
  };
  /// One gated iteration (number `iteration`, passed to launch and after).
  absl::StatusOr<Sample> RunOnce(const std::vector<cudaStream_t>& streams, int iteration,
                                 const Launch& launch, const After& after = nullptr);

  /// Host time between the last launch call and opening the gate (default 0: at once).
  /// A delay lets work that other threads or processes enqueue in response to the launches
  /// (e.g. a daemon's engine) be queued on the GPU before the timed part starts, so the
  /// figure is the GPU-side path alone; `host` still counts the delay.
  void set_gate_delay_us(int64_t us) { gate_delay_us_ = us; }

 private:
  GatedTimer() = default;
  int64_t gate_delay_us_ = 0;
  uint32_t* gate_ = nullptr;  // device word
  cudaStream_t trigger_ = nullptr;
  uint32_t gate_value_ = 0;
  std::vector<cudaEvent_t> start_, end_;
};

/// One in-process low-latency figure (bench_ll.cu): bytes moved between ranks per op (all
/// ranks), the op's times and the same-bytes cudaMemcpy (count == 0: no bound).
struct LowLatencyFigure {
  std::string name;
  double bytes = 0;
  OpTimes op_us;
  Percentiles memcpy_us;
};

/// The low-latency kernels launched in-process on R = `num_ranks` virtual ranks of the
/// current GPU (a divisor of E; 8 is DeepSeek-V3 decode's), DeepSeek-V3 decode shape
/// otherwise (T=128, H=7168, K=8, E=256, Mll=128), 1000 iterations after 50 of warm-up each:
/// figures ll_dispatch_fp8, ll_dispatch_bf16, ll_combine_bf16, ll_dispatch_fp8_then_combine,
/// ll_combine_bf16_after_dispatch, ll_dispatch_fp8_T0, ll_combine_bf16_T0, each with its
/// memcpy bound (bench_ll.cu). `device_name` gets the GPU's name and SM count. Errors:
/// INTERNAL (CUDA), kernel status.
absl::Status MeasureLowLatencyInProcess(std::vector<LowLatencyFigure>* figures,
                                        std::string* device_name, int32_t num_ranks = 8);

/// Fills every rank of `g` (a LowLatencyBenchShape group) with the low-latency bench's
/// inputs and waits for them: kLowLatencyBenchTokens random bf16 tokens, uniform top-k
/// routing and random weights (one seeded generator, ranks in order), the token-count slot
/// set to that T, and the expert outputs a constant bf16 pattern (0x3f3f, about 0.75; the
/// kernels' speed does not depend on the values). Returns the dispatch's rows of all ranks
/// (each token once per distinct expert). Errors: INTERNAL (CUDA).
absl::StatusOr<double> UploadLowLatencyBenchInputs(testing::VirtualRankGroup& g);

/// Captures `launch(r, g.stream(r))` for every rank of `g` into one CUDA graph: the ranks'
/// streams fork from rank 0's and join back, so the ranks' kernels are concurrent nodes.
/// The caller owns the returned executable graph. Errors: the first of launch / CUDA.
absl::StatusOr<cudaGraphExec_t> CaptureAllRanks(
    testing::VirtualRankGroup& g, const std::function<absl::Status(int32_t, cudaStream_t)>& launch);

}  // namespace epd::bench
#endif  // EPD_HAVE_CUDA
