// Normal-mode (high-throughput) CUDA kernels on R = 8 virtual ranks of one GPU
// (epd_bench --backend=cuda --mode=normal): FP8 dispatch, BF16 dispatch and BF16 combine
// at T=4096 H=7168 K=8 E=256 over an SM sweep {8, 16, 24, 32} blocks per rank, each beside
// a device-to-device cudaMemcpy of the same total bytes measured in the same run. Two
// figures per op: DeepEP's logical bandwidth (the rows sent, one copy per destination) over
// the memcpy's, and the HBM bytes the op must read and write (every input byte read once,
// every output byte written once, counted from the routing) per second over the memcpy's
// HBM rate (2 bytes of traffic per byte copied), with the goal (>= 85%) and its verdict at
// the default SM budget. Beside each op, its measured floor: the fan-out copy bound
// (bench_fanout.cu), the op's byte pattern on the same routing without its logic, at the
// op's SM budget and on the whole GPU. Each dispatch is also timed cached (the same routing,
// the layout of the fresh dispatch before it reused: the op without its routing pass), and
// under its goal line the routing's share (fresh - cached) and what the fresh op would reach
// without it. --normal_kernels=static,block,balanced,bulk compares kernel variants
// (EPD_NORMAL_KERNELS) in one run, --normal_pdl=0,1 the ops' second kernels launched
// normally and programmatically (EPD_NORMAL_PDL), --normal_gpu_scope=0,1 the inter-rank flags
// at .sys and .gpu scope (EPD_NORMAL_GPU_SCOPE). docs/BENCHMARKS.md "Normal-mode kernels".
#include <cuda_runtime.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "kernels/cuda/normal_common.cuh"
#include "tests/bench/bench.h"
#include "tests/bench/bench_cuda.h"
#include "tests/bench/floors.h"
#include "tests/gpu/gpu_test_util.h"

ABSL_FLAG(std::string, normal_kernels, "",
          "normal bench: comma-separated EPD_NORMAL_KERNELS values (balanced, static, block, "
          "bulk) "
          "to compare in one run, interleaved per SM budget; empty = as the environment has it");
ABSL_FLAG(std::string, normal_pdl, "",
          "normal bench: comma-separated EPD_NORMAL_PDL values (0, 1: each op's second kernel "
          "launched programmatically) to compare in one run, interleaved per SM budget and kernel "
          "variant; empty = as the environment has it");
ABSL_FLAG(std::string, normal_gpu_scope, "",
          "normal bench: comma-separated EPD_NORMAL_GPU_SCOPE values (0, 1: the inter-rank "
          "flags at .gpu scope, every rank being on this GPU) to compare in one run, interleaved "
          "within each --normal_pdl setting; empty = as the environment has it");
ABSL_FLAG(std::string, normal_sms, "8,16,24,32",
          "normal bench: the SM budgets (blocks per rank, each in [1, 1024]) to sweep, "
          "comma-separated; the goal is judged at floor(SMs / 8)");
ABSL_FLAG(bool, normal_phases, true,
          "normal bench: after timing each dispatch, run it again with the kernels' phase "
          "stamps (NormalDispatchArgs::phase_ns) and print where its time goes");
ABSL_FLAG(bool, normal_bound, true,
          "normal bench: also time the fan-out copy bound (each op's HBM byte pattern on the "
          "same routing without its logic, the fastest of its kernel variants) at each SM "
          "budget and on the whole GPU, printed beside the ops");

namespace epd::bench {
namespace {

namespace kc = epd::kernels::cuda;
using epd::testing::CudaStream;
using epd::testing::DeviceBuffer;
using epd::testing::VirtualRankGroup;

constexpr int32_t kRanks = 8;
constexpr int32_t kTokens = kNormalBenchTokens;
constexpr int32_t kHidden = kNormalBenchHidden;
constexpr int32_t kTopk = kNormalBenchTopk;
constexpr int32_t kExperts = kNormalBenchExperts;
constexpr int kWarmup = 3;
constexpr int kBatch = 20;
/// GPU time the first op runs before anything is timed, so that no row is timed on a GPU
/// still ramping up from idle (with the bound off, nothing else runs first).
constexpr double kGpuWarmUpMs = 500;

/// Wall time of `batch` back-to-back rounds of `launch(r, stream)` on every rank (rounds
/// enqueued round-major), in microseconds per round: first start to last end.
absl::StatusOr<double> TimeRounds(
    VirtualRankGroup& g, int batch,
    const std::function<absl::Status(int32_t, cudaStream_t)>& launch) {
  const int32_t R = g.num_ranks();
  std::vector<cudaEvent_t> start(R), end(R);
  absl::Status st;
  // absl::Status::Update keeps the first error; later calls are skipped once it is set.
  for (int32_t r = 0; r < R; ++r) {
    st.Update(EPD_CUDA_STATUS(cudaEventCreate(&start[r])));
    st.Update(EPD_CUDA_STATUS(cudaEventCreate(&end[r])));
  }
  for (int32_t r = 0; r < R && st.ok(); ++r) {
    st.Update(EPD_CUDA_STATUS(cudaEventRecord(start[r], g.stream(r))));
  }
  for (int it = 0; it < batch && st.ok(); ++it) {
    for (int32_t r = 0; r < R && st.ok(); ++r) st.Update(launch(r, g.stream(r)));
  }
  for (int32_t r = 0; r < R && st.ok(); ++r) {
    st.Update(EPD_CUDA_STATUS(cudaEventRecord(end[r], g.stream(r))));
  }
  if (st.ok()) st.Update(g.SynchronizeAll());
  float first = 0, last = 0;
  for (int32_t r = 0; r < R && st.ok(); ++r) {
    float s = 0, e = 0;
    st.Update(EPD_CUDA_STATUS(cudaEventElapsedTime(&s, start[0], start[r])));
    if (st.ok()) st.Update(EPD_CUDA_STATUS(cudaEventElapsedTime(&e, start[0], end[r])));
    first = std::min(first, s);
    last = std::max(last, e);
  }
  for (int32_t r = 0; r < R; ++r) {
    if (start[r] != nullptr) cudaEventDestroy(start[r]);
    if (end[r] != nullptr) cudaEventDestroy(end[r]);
  }
  if (!st.ok()) return st;
  return 1000.0 * (last - first) / batch;
}

static_assert(kc::kNormalDispatchPhases == 7, "SplitPhases (floors.h) splits 7 stamps an op");

/// `batch` back-to-back rounds of `launch(r, stream, stamps)` as TimeRounds runs them, each
/// op of each rank with its own kNormalDispatchPhases stamps, split (SplitPhases).
absl::StatusOr<PhaseSplit> TracePhases(
    VirtualRankGroup& g, int batch,
    const std::function<absl::Status(int32_t, cudaStream_t, uint64_t*)>& launch) {
  const int32_t R = g.num_ranks();
  const size_t per_op = static_cast<size_t>(kc::kNormalDispatchPhases) * R;
  std::vector<uint64_t> stamps(per_op * batch);
  EPD_ASSIGN_OR_RETURN(DeviceBuffer buf, DeviceBuffer::Allocate(stamps.size() * 8));
  auto* dev = reinterpret_cast<uint64_t*>(buf.get());
  for (int it = 0; it < batch; ++it) {
    for (int32_t r = 0; r < R; ++r) {
      EPD_RETURN_IF_ERROR(launch(
          r, g.stream(r), dev + per_op * it + static_cast<size_t>(r) * kc::kNormalDispatchPhases));
    }
  }
  EPD_RETURN_IF_ERROR(g.SynchronizeAll());
  EPD_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(stamps.data(), dev, stamps.size() * 8, cudaMemcpyDeviceToHost));
  return SplitPhases(stamps, R);
}

/// Microseconds of one device-to-device cudaMemcpyAsync of `bytes` (median of `batch`).
absl::StatusOr<double> TimeMemcpy(size_t bytes, int batch) {
  EPD_ASSIGN_OR_RETURN(const Percentiles p, TimeDeviceCopy(bytes, kWarmup, batch));
  return p.p50;
}

struct Row {
  std::string op;
  std::string variant;  // EPD_NORMAL_KERNELS during the op ("" = as the process had it)
  // The switches in effect during the op (as --normal_pdl / --normal_gpu_scope set them or
  // the process had them): each op's second kernel launched programmatically
  // (NormalProgrammaticFromEnv), the inter-rank flags at .gpu scope (NormalGpuScopeFromEnv).
  bool pdl = false;
  bool gpu_scope = false;
  int32_t sms = 0;
  bool oversubscribed = false;
  double bytes_per_rank = 0;  // mean over ranks
  double op_us = 0;
  double memcpy_us = 0;
  double memcpy_bytes = 0;  // the bytes the bound's memcpy copied (all ranks)
  double hbm_bytes = 0;     // HBM bytes the op reads + writes (all ranks)
  // The fan-out copy bound of the op's pattern (us 0: not measured): the fastest variant
  // at the op's SM budget (sms x ranks blocks, at most the GPU's SMs) and on the whole GPU,
  // and the HBM bytes the bound moves per run.
  BoundTiming bound;
  BoundTiming gpu_bound;
  double bound_bytes = 0;
  // Where a dispatch's time went (--normal_phases; ops 0: not traced).
  PhaseSplit phases;
};

/// One bound variant's time (for the variant listing): pattern, blocks, us, bytes.
struct BoundRow {
  std::string pattern;
  BoundTiming timing;
  double hbm_bytes = 0;
};

/// The device copy's HBM rate of a row, in TB/s (2 bytes of traffic per byte copied).
double CopyTbps(const Row& r) { return 2.0 * r.memcpy_bytes / r.memcpy_us / 1e6; }

/// The row's op, bound and copy figures (the bound at the op's budget, or on the whole GPU).
FloorFigures Floor(const Row& r, bool whole_gpu) {
  const BoundTiming& b = whole_gpu ? r.gpu_bound : r.bound;
  return ComputeFloorFigures(r.hbm_bytes, r.op_us, r.bound_bytes, b.us, CopyTbps(r));
}

/// HBM rate of the op over the memcpy's (read + write of every byte), in [0, ...).
double HbmOverCopy(const Row& r) {
  return (r.hbm_bytes / r.op_us) / (2.0 * r.memcpy_bytes / r.memcpy_us);
}

/// The kernel variant of a row, for printing.
const char* VariantName(const Row& r) { return r.variant.empty() ? "default" : r.variant.c_str(); }

/// The switches of a row, for printing: "pdl", "gpu" (scope), "pdl+gpu" or "-".
const char* SwitchesName(const Row& r) {
  return r.pdl ? (r.gpu_scope ? "pdl+gpu" : "pdl") : (r.gpu_scope ? "gpu" : "-");
}

/// The values of a switch list flag (`flag`: "0,1,..."), each "0" or "1"; one empty value
/// (the environment as it is) when the flag is empty. INVALID_ARGUMENT naming the flag.
absl::StatusOr<std::vector<std::string>> SwitchValues(const std::string& value, const char* flag,
                                                      const char* env) {
  std::vector<std::string> values = absl::StrSplit(value, ',', absl::SkipEmpty());
  for (const std::string& v : values) {
    if (v != "0" && v != "1") {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": '", v, "' is not 0 or 1 (", env, ")"));
    }
  }
  if (values.empty()) values.push_back("");
  return values;
}

/// The name of a dispatch's cached row ("dispatch fp8" -> "dispatch fp8 cached").
std::string CachedName(const std::string& op) { return op + " cached"; }

/// The cached row measured right after fresh dispatch row rows[i] (the first later row of
/// its cached op at the same SM budget, variant and programmatic setting), or null.
const Row* CachedRowOf(const std::vector<Row>& rows, size_t i) {
  const Row& fresh = rows[i];
  const std::string name = CachedName(fresh.op);
  for (size_t j = i + 1; j < rows.size(); ++j) {
    const Row& r = rows[j];
    if (r.op == name && r.sms == fresh.sms && r.variant == fresh.variant && r.pdl == fresh.pdl &&
        r.gpu_scope == fresh.gpu_scope) {
      return &r;
    }
  }
  return nullptr;
}

/// The routing share of fresh dispatch row `fresh` against its cached row.
RoutingShare Routing(const Row& fresh, const Row& cached) {
  return SplitRouting(fresh.hbm_bytes, fresh.op_us, cached.hbm_bytes, cached.op_us,
                      CopyTbps(fresh));
}

/// The goal of the normal kernels: HBM bytes per second >= 85% of the device copy's.
constexpr double kHbmGoal = 0.85;

/// The fan-out bounds of one run, measured once per (pattern, blocks) and kept.
class Bounds {
 public:
  Bounds(FanoutBound* bound, std::vector<BoundRow>* listing) : bound_(bound), listing_(listing) {}
  /// The fastest variant of `kind` with rows of `row_bytes` on `blocks` blocks, timing every
  /// variant the first time (and listing it under `pattern`).
  absl::StatusOr<BoundTiming> Best(const std::string& pattern, FanoutKind kind, int64_t row_bytes,
                                   int32_t blocks) {
    const std::string key = absl::StrCat(pattern, "/", blocks);
    for (const auto& [k, t] : best_) {
      if (k == key) return t;
    }
    EPD_ASSIGN_OR_RETURN(std::vector<BoundTiming> all,
                         bound_->TimeVariants(kind, row_bytes, blocks, kWarmup, kBatch));
    const HbmBytes bytes = kind == FanoutKind::kDispatch
                               ? DispatchFanoutBytes(bound_->plan(), row_bytes)
                               : CombineFaninBytes(bound_->plan(), row_bytes);
    for (const BoundTiming& t : all) listing_->push_back({pattern, t, bytes.total()});
    EPD_ASSIGN_OR_RETURN(const BoundTiming best, FastestBound(all));
    best_.emplace_back(key, best);
    return best;
  }

 private:
  FanoutBound* bound_;
  std::vector<BoundRow>* listing_;
  std::vector<std::pair<std::string, BoundTiming>> best_;
};

absl::Status Run(std::vector<Row>* rows, std::vector<BoundRow>* bound_rows,
                 std::string* device_name, int* device_sms) {
  std::vector<int32_t> sweep;
  for (absl::string_view v : absl::StrSplit(absl::GetFlag(FLAGS_normal_sms), ',')) {
    int32_t sms = 0;
    if (!absl::SimpleAtoi(v, &sms) || sms < 1 || sms > 1024) {
      return absl::InvalidArgumentError(
          absl::StrCat("--normal_sms: '", v, "' is not a number of SMs in [1, 1024]"));
    }
    sweep.push_back(sms);
  }
  cudaDeviceProp prop{};
  int device = 0;
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  *device_name = prop.name;
  *device_sms = prop.multiProcessorCount;
  EPD_RETURN_IF_ERROR(kc::PreloadKernels());

  const kernels::GroupShape shape = NormalBenchShape(kRanks);
  EPD_ASSIGN_OR_RETURN(std::unique_ptr<VirtualRankGroup> g, VirtualRankGroup::Create(shape));
  // Every rank on this GPU, as the daemon's contexts say for virtual ranks (only
  // EPD_NORMAL_GPU_SCOPE=1 makes the normal kernels use it).
  g->set_all_ranks_on_device(true);
  const kernels::EndpointLayout& l = g->layout();

  // Inputs: uniform top-8 of 256 experts per token (DeepEP's benchmark routing), values
  // from a hash; T set in every rank's slot.
  std::mt19937_64 rng(2024);
  int64_t sent_rows_total = 0;
  // Each token's destination ranks (source rank-major), for the fan-out bound.
  std::vector<uint32_t> masks;
  masks.reserve(static_cast<size_t>(kRanks) * kTokens);
  for (int32_t r = 0; r < kRanks; ++r) {
    const std::vector<int64_t> topk = epd::testing::RandomTopk(kTokens, kTopk, kExperts, {}, rng);
    for (int32_t t = 0; t < kTokens; ++t) {
      uint32_t mask = 0;
      for (int32_t k = 0; k < kTopk; ++k) {
        mask |= 1u << (topk[static_cast<size_t>(t) * kTopk + k] / (kExperts / kRanks));
      }
      sent_rows_total += __builtin_popcount(mask);
      masks.push_back(mask);
    }
    EPD_RETURN_IF_ERROR(g->Upload(r, l.in_topk_idx, topk.data(), topk.size() * 8));
    const std::vector<float> w = epd::testing::RandomFloats(topk.size(), rng);
    EPD_RETURN_IF_ERROR(g->Upload(r, l.in_topk_weights, w.data(), w.size() * 4));
    for (const kernels::Region* region : {&l.in_x, &l.in_scales, &l.in_combine_x}) {
      EPD_RETURN_IF_ERROR(FillPatternAsync(g->At<uint32_t>(r, *region), region->bytes / 4 * 4,
                                           static_cast<uint32_t>(r * 977 + region->offset),
                                           g->stream(r)));
    }
    EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(g->Context(r), kTokens, g->stream(r)));
  }
  EPD_RETURN_IF_ERROR(g->SynchronizeAll());

  const double rows_per_rank = static_cast<double>(sent_rows_total) / kRanks;
  const double bf16_row = 2.0 * kHidden;
  const double fp8_row = kHidden + 4.0 * shape.num_scales();
  const double bf16_total = static_cast<double>(sent_rows_total) * bf16_row;
  const double fp8_total = static_cast<double>(sent_rows_total) * fp8_row;
  // HBM bytes each op must move at least, all ranks: the least any kernel can read and
  // write (each input byte read once, each output byte written once).
  //   dispatch: reads x [T, row], topk_idx [T, K] int64, topk_weights [T, K] f32; writes,
  //     per (token, destination rank) sent, recv_x row, recv_topk_idx [K] int64,
  //     recv_topk_weights [K] f32, recv_src_info int32; and send_pos [T, R] int32.
  //   combine (with weights): reads each sent row [2H] and its recv_topk_weights [K] f32,
  //     send_pos [T, R]; writes combined_x [T, 2H] and combined weights [T, K] f32.
  const double all_tokens = static_cast<double>(kTokens) * kRanks;
  const double sent = static_cast<double>(sent_rows_total);
  const double meta_in = kTopk * 12.0;
  const double send_pos_bytes = all_tokens * kRanks * 4.0;
  auto dispatch_hbm = [&](double row) {
    return all_tokens * (row + meta_in) + sent * (row + meta_in + 4.0) + send_pos_bytes;
  };
  //   cached dispatch: reads x and send_pos (the handle); writes per (token, destination) the
  //     recv_x row and recv_src_info (no top-k metadata either way).
  auto cached_dispatch_hbm = [&](double row) {
    return all_tokens * row + sent * (row + 4.0) + send_pos_bytes;
  };
  const double combine_hbm =
      sent * (bf16_row + kTopk * 4.0) + send_pos_bytes + all_tokens * (bf16_row + kTopk * 4.0);
  EPD_ASSIGN_OR_RETURN(const double memcpy_bf16_us,
                       TimeMemcpy(static_cast<size_t>(bf16_total), kBatch));
  EPD_ASSIGN_OR_RETURN(const double memcpy_fp8_us,
                       TimeMemcpy(static_cast<size_t>(fp8_total), kBatch));

  // The fan-out copy bound on the same routing (rows as wide as the widest op's). Its
  // failure is the run's, but the ops are still measured and printed without it.
  std::unique_ptr<FanoutBound> fanout;
  absl::Status bound_status;
  if (absl::GetFlag(FLAGS_normal_bound)) {
    absl::StatusOr<FanoutPlan> plan = BuildFanoutPlan(masks, kRanks, kTokens);
    absl::StatusOr<std::unique_ptr<FanoutBound>> created =
        plan.ok() ? FanoutBound::Create(*plan, static_cast<int64_t>(bf16_row))
                  : absl::StatusOr<std::unique_ptr<FanoutBound>>(plan.status());
    if (created.ok()) {
      fanout = std::move(*created);
    } else {
      bound_status = created.status();
    }
  }
  Bounds bounds(fanout.get(), bound_rows);

  // Kernel variants compared in this run (--normal_kernels), interleaved per SM budget so
  // each pair is measured minutes, not runs, apart; "" = EPD_NORMAL_KERNELS as it was.
  std::vector<std::string> variants =
      absl::StrSplit(absl::GetFlag(FLAGS_normal_kernels), ',', absl::SkipEmpty());
  if (variants.empty()) variants.push_back("");
  // Programmatic launch and flag scope settings (--normal_pdl, --normal_gpu_scope),
  // interleaved within each variant.
  EPD_ASSIGN_OR_RETURN(
      const std::vector<std::string> pdls,
      SwitchValues(absl::GetFlag(FLAGS_normal_pdl), "--normal_pdl", "EPD_NORMAL_PDL"));
  EPD_ASSIGN_OR_RETURN(const std::vector<std::string> scopes,
                       SwitchValues(absl::GetFlag(FLAGS_normal_gpu_scope), "--normal_gpu_scope",
                                    "EPD_NORMAL_GPU_SCOPE"));

  bool warmed = false;
  for (int32_t sms : sweep) {
    // A context per rank with this SM budget (the group's own contexts use the default).
    std::vector<kc::CudaRankContext> ctx(kRanks);
    for (int32_t r = 0; r < kRanks; ++r) {
      ctx[r] = g->Context(r);
      ctx[r].num_sms = sms;
    }
    // A cached dispatch reuses the send_pos handle the fresh dispatch before it left (the
    // same routing), so it is timed right after its fresh dispatch.
    auto traced_dispatch = [&](bool fp8, bool cached) {
      return [&, fp8, cached](int32_t r, cudaStream_t s, uint64_t* phase_ns) {
        kc::NormalDispatchArgs args;
        args.fp8 = fp8;
        args.cached = cached;
        args.phase_ns = phase_ns;
        return kc::NormalDispatch(ctx[r], args, s);
      };
    };
    auto dispatch = [&](bool fp8, bool cached) {
      return [launch = traced_dispatch(fp8, cached)](int32_t r, cudaStream_t s) {
        return launch(r, s, nullptr);
      };
    };
    auto combine = [&](int32_t r, cudaStream_t s) {
      kc::NormalCombineArgs args;
      args.with_weights = true;
      return kc::NormalCombine(ctx[r], args, s);
    };
    const bool over = sms * kRanks > *device_sms;
    struct Op {
      const char* name;
      std::function<absl::Status(int32_t, cudaStream_t)> launch;
      double row_bytes;
      double memcpy_us;
      double memcpy_bytes;
      double hbm_bytes;
      FanoutKind pattern;
      const char* bound_name;  // The op whose bound it shares (its own name, or the fresh op's).
      // The op with phase stamps (a dispatch), or empty.
      std::function<absl::Status(int32_t, cudaStream_t, uint64_t*)> traced;
    };
    const std::string fp8_name = "dispatch fp8";
    const std::string bf16_name = "dispatch bf16";
    const std::string fp8_cached = CachedName(fp8_name);
    const std::string bf16_cached = CachedName(bf16_name);
    const Op ops[] = {
        {fp8_name.c_str(), dispatch(true, false), fp8_row, memcpy_fp8_us, fp8_total,
         dispatch_hbm(fp8_row), FanoutKind::kDispatch, fp8_name.c_str(),
         traced_dispatch(true, false)},
        {fp8_cached.c_str(), dispatch(true, true), fp8_row, memcpy_fp8_us, fp8_total,
         cached_dispatch_hbm(fp8_row), FanoutKind::kDispatch, fp8_name.c_str(),
         traced_dispatch(true, true)},
        {bf16_name.c_str(), dispatch(false, false), bf16_row, memcpy_bf16_us, bf16_total,
         dispatch_hbm(bf16_row), FanoutKind::kDispatch, bf16_name.c_str(),
         traced_dispatch(false, false)},
        // The combine right after the fresh dispatch whose handle it takes (as in a model's
        // step); the cached dispatch after it still reuses that dispatch's send_pos.
        {"combine bf16", combine, bf16_row, memcpy_bf16_us, bf16_total, combine_hbm,
         FanoutKind::kCombine, "combine bf16", nullptr},
        {bf16_cached.c_str(), dispatch(false, true), bf16_row, memcpy_bf16_us, bf16_total,
         cached_dispatch_hbm(bf16_row), FanoutKind::kDispatch, bf16_name.c_str(),
         traced_dispatch(false, true)}};
    constexpr int kOps = static_cast<int>(std::size(ops));
    // The ops' bounds at this budget (sms x ranks blocks, at most one per SM of the GPU) and
    // on the whole GPU; a cached dispatch shares its fresh dispatch's (the same pattern).
    BoundTiming op_bound[kOps], gpu_bound[kOps];
    double bound_bytes[kOps] = {};
    for (int i = 0; i < kOps && fanout != nullptr; ++i) {
      const int64_t row = static_cast<int64_t>(ops[i].row_bytes);
      const std::string pattern = ops[i].bound_name;
      absl::StatusOr<BoundTiming> at =
          bounds.Best(pattern, ops[i].pattern, row, std::min(sms * kRanks, *device_sms));
      absl::StatusOr<BoundTiming> whole =
          at.ok() ? bounds.Best(pattern, ops[i].pattern, row, *device_sms) : at;
      if (!whole.ok()) {
        bound_status = whole.status();
        fanout.reset();
        op_bound[i] = gpu_bound[i] = BoundTiming{};
        break;
      }
      op_bound[i] = *at;
      gpu_bound[i] = *whole;
      const HbmBytes b = ops[i].pattern == FanoutKind::kDispatch
                             ? DispatchFanoutBytes(fanout->plan(), row)
                             : CombineFaninBytes(fanout->plan(), row);
      bound_bytes[i] = b.total();
    }
    for (const std::string& variant : variants) {
      if (!variant.empty()) setenv("EPD_NORMAL_KERNELS", variant.c_str(), 1);
      for (const std::string& pdl : pdls) {
        if (!pdl.empty()) setenv("EPD_NORMAL_PDL", pdl.c_str(), 1);
        for (const std::string& scope : scopes) {
          if (!scope.empty()) setenv("EPD_NORMAL_GPU_SCOPE", scope.c_str(), 1);
          EPD_ASSIGN_OR_RETURN(const bool programmatic, kc::normal::NormalProgrammaticFromEnv());
          EPD_ASSIGN_OR_RETURN(const bool gpu_scope, kc::normal::NormalGpuScopeFromEnv(ctx[0]));
          for (double ms = 0; !warmed && ms < kGpuWarmUpMs;) {
            EPD_ASSIGN_OR_RETURN(const double us, TimeRounds(*g, kBatch, ops[0].launch));
            ms += us * kBatch / 1000.0;
          }
          warmed = true;
          for (int i = 0; i < kOps; ++i) {
            const Op& op = ops[i];
            EPD_RETURN_IF_ERROR(TimeRounds(*g, kWarmup, op.launch).status());
            EPD_ASSIGN_OR_RETURN(const double us, TimeRounds(*g, kBatch, op.launch));
            for (int32_t r = 0; r < kRanks; ++r) {
              EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(ctx[r], g->stream(r), op.name));
            }
            PhaseSplit phases;
            if (op.traced && absl::GetFlag(FLAGS_normal_phases)) {
              // After the timed rounds: the stamps cannot slow them, and a cached dispatch
              // still follows the fresh one whose handle it reuses (the same routing).
              EPD_ASSIGN_OR_RETURN(phases, TracePhases(*g, kBatch, op.traced));
              for (int32_t r = 0; r < kRanks; ++r) {
                EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(ctx[r], g->stream(r), op.name));
              }
            }
            rows->push_back({op.name, variant, programmatic, gpu_scope, sms, over,
                             rows_per_rank * op.row_bytes, us, op.memcpy_us, op.memcpy_bytes,
                             op.hbm_bytes, op_bound[i], gpu_bound[i], bound_bytes[i], phases});
          }
        }
      }
    }
  }
  return bound_status;
}

/// "84%" or "-" when the figure was not measured (0).
std::string Percent(double ratio) {
  return ratio > 0 ? absl::StrFormat("%.0f%%", 100.0 * ratio) : std::string("-");
}

/// The fan-out bound's table (one line per op row) and its variants, as text.
void PrintBoundTable(const std::vector<Row>& rows, const std::vector<BoundRow>& bound_rows,
                     int device_sms) {
  if (bound_rows.empty()) return;
  std::printf(
      "\nFan-out copy bound: the op's HBM byte pattern on the same routing without its logic "
      "(dispatch: each token row read once, written at each destination row; combine: a "
      "token's rows read and summed, written once), the fastest kernel variant; 'bound' at the "
      "op's SMs: sms x %d ranks blocks (at most %d), 'GPU bound' on all %d SMs; one block an "
      "SM\n",
      kRanks, device_sms, device_sms);
  std::printf("%-20s %-9s %-8s %5s %9s %9s %-7s %6s %9s %-7s %9s %8s %9s %8s %10s %8s\n", "op",
              "kernels", "switches", "sms", "op TB/s", "bound", "variant", "blocks", "GPU bound",
              "variant", "copy TB/s", "op/copy", "op/bound", "op/GPU", "bound/copy", "GPU/copy");
  for (const Row& r : rows) {
    if (r.bound.us <= 0) continue;
    const FloorFigures at = Floor(r, false);
    const FloorFigures gpu = Floor(r, true);
    std::printf("%-20s %-9s %-8s %5d %9.2f %9.2f %-7s %6d %9.2f %-7s %9.2f %8s %9s %8s %10s %8s\n",
                r.op.c_str(), VariantName(r), SwitchesName(r), r.sms, at.op_tbps, at.bound_tbps,
                r.bound.variant.c_str(), r.bound.blocks, gpu.bound_tbps,
                r.gpu_bound.variant.c_str(), at.copy_tbps, Percent(at.op_over_copy).c_str(),
                Percent(at.op_over_bound).c_str(), Percent(gpu.op_over_bound).c_str(),
                Percent(at.bound_over_copy).c_str(), Percent(gpu.bound_over_copy).c_str());
  }
  std::printf("bound variants (HBM TB/s):");
  std::string last;
  for (const BoundRow& b : bound_rows) {
    const std::string key = absl::StrCat(b.pattern, " at ", b.timing.blocks, " blocks");
    if (key != last) std::printf("\n  %-28s", key.c_str());
    last = key;
    std::printf("  %s %.2f", b.timing.variant.c_str(), b.hbm_bytes / b.timing.us / 1e6);
  }
  std::printf("\n");
}

/// Where each traced dispatch's time went (--normal_phases).
void PrintPhaseTable(const std::vector<Row>& rows) {
  bool header = false;
  for (const Row& r : rows) {
    if (r.phases.ops == 0) continue;
    if (!header) {
      std::printf(
          "\nwhere a dispatch's time goes (kernel phase stamps, %d back-to-back ops; per "
          "segment the median op's mean over ranks, us; skew = a rank's notify start after the "
          "first rank's, layout = the layout pass (0 cached), arrival = totals, counts out and "
          "the wait for every peer's, counts = prefixes and tile bases, to copy = notify end to "
          "the copy's first block, done = the done barrier; op = first start to last end)\n",
          kBatch);
      std::printf("%-20s %-9s %-8s %5s %5s %7s %7s %8s %7s %8s %8s %7s %8s\n", "op", "kernels",
                  "switches", "sms", "ops", "skew", "layout", "arrival", "counts", "to copy",
                  "copy", "done", "op");
      header = true;
    }
    const PhaseSplit& ph = r.phases;
    std::printf("%-20s %-9s %-8s %5d %5d %7.1f %7.1f %8.1f %7.1f %8.1f %8.1f %7.1f %8.1f\n",
                r.op.c_str(), VariantName(r), SwitchesName(r), r.sms, ph.ops, ph.skew, ph.layout,
                ph.arrival, ph.counts, ph.to_copy, ph.copy, ph.done, ph.op);
  }
}

/// With more than one switch setting measured: per op and kernel variant at `sms` SMs per
/// rank, the mean us/op and HBM/copy of each setting over its repeats, and the us change
/// against the setting with neither switch ("-"), as text.
void PrintSwitchSummary(const std::vector<Row>& rows, int32_t sms) {
  struct Cell {
    std::string op, variant, switches;
    double us = 0, over_copy = 0;
    int n = 0;
  };
  std::vector<Cell> cells;
  bool several = false;
  for (const Row& r : rows) {
    if (r.sms != sms) continue;
    several |= r.pdl || r.gpu_scope;
    auto it = std::find_if(cells.begin(), cells.end(), [&](const Cell& c) {
      return c.op == r.op && c.variant == VariantName(r) && c.switches == SwitchesName(r);
    });
    if (it == cells.end()) it = cells.insert(cells.end(), {r.op, VariantName(r), SwitchesName(r)});
    it->us += r.op_us;
    it->over_copy += HbmOverCopy(r);
    ++it->n;
  }
  if (!several) return;
  std::printf("\nswitches at %d SMs/rank (mean of each setting's repeats; change against '-'):\n",
              sms);
  for (const Cell& c : cells) {
    auto base = std::find_if(cells.begin(), cells.end(), [&](const Cell& b) {
      return b.op == c.op && b.variant == c.variant && b.switches == "-";
    });
    const double us = c.us / c.n;
    std::string change;
    if (base != cells.end() && &*base != &c) {
      const double base_us = base->us / base->n;
      change = absl::StrFormat("  %+.1f us (%+.2f%%)", us - base_us, 100.0 * (us / base_us - 1));
    }
    std::printf("  %-20s %-9s %-8s %2dx %9.1f us  HBM/copy %5.1f%%%s\n", c.op.c_str(),
                c.variant.c_str(), c.switches.c_str(), c.n, us, 100.0 * c.over_copy / c.n,
                change.c_str());
  }
}

}  // namespace

int RunNormalBench() {
  std::vector<Row> rows;
  std::vector<BoundRow> bound_rows;
  std::string device;
  int sms = 0;
  const absl::Status st = Run(&rows, &bound_rows, &device, &sms);
  const bool json = absl::GetFlag(FLAGS_json);
  if (!json) {
    std::printf("Normal-mode kernels, %d virtual ranks on one GPU (%s, %d SMs)\n", kRanks,
                device.c_str(), sms);
    std::printf(
        "shape: T=%d H=%d K=%d E=%d R=%d; uniform top-%d routing; %d rounds after %d "
        "warm-up\n",
        kTokens, kHidden, kTopk, kExperts, kRanks, kTopk, kBatch, kWarmup);
    std::printf(
        "rows 'cached': the dispatch with the fresh dispatch's layout reused (an arrival barrier "
        "instead of the layout pass and count exchange, no top-k metadata; HBM bytes its own); "
        "switches in effect: pdl = each op's second kernel launched programmatically "
        "(EPD_NORMAL_PDL=1, kernels with griddepcontrol), gpu = the inter-rank flags at .gpu "
        "scope (EPD_NORMAL_GPU_SCOPE=1, every rank on this GPU), - = neither\n");
    std::printf("%-20s %-9s %-8s %5s %13s %10s %14s %14s %13s %10s %9s %9s\n", "op", "kernels",
                "switches", "sms", "MB/rank", "us/op", "rank GB/s", "aggregate GB/s", "memcpy GB/s",
                "agg/memcpy", "HBM TB/s", "HBM/copy");
  }
  for (const Row& r : rows) {
    const double rank_gbs = r.bytes_per_rank / r.op_us / 1e3;
    const double agg_gbs = rank_gbs * kRanks;
    const double memcpy_gbs = r.bytes_per_rank * kRanks / r.memcpy_us / 1e3;
    if (json) {
      const FloorFigures at = Floor(r, false);
      const FloorFigures gpu = Floor(r, true);
      std::printf(
          "{\"figure\":\"normal "
          "%s\",\"kernels\":\"%s\",\"pdl\":%s,\"gpu_scope\":%s,\"device\":\"%s\","
          "\"sms_per_rank\":%d,"
          "\"oversubscribed\":%s,\"bytes_per_rank\":%.0f,\"op_us\":%.2f,\"rank_gbps\":%.1f,"
          "\"aggregate_gbps\":%.1f,\"memcpy_us\":%.2f,\"memcpy_gbps\":%.1f,"
          "\"hbm_bytes\":%.0f,\"hbm_tbps\":%.3f,\"copy_hbm_tbps\":%.3f,"
          "\"hbm_over_copy\":%.3f,\"bound_hbm_bytes\":%.0f,\"bound_variant\":\"%s\","
          "\"bound_blocks\":%d,\"bound_us\":%.2f,\"bound_tbps\":%.3f,\"op_over_bound\":%.3f,"
          "\"bound_over_copy\":%.3f,\"gpu_bound_variant\":\"%s\",\"gpu_bound_blocks\":%d,"
          "\"gpu_bound_us\":%.2f,\"gpu_bound_tbps\":%.3f,\"op_over_gpu_bound\":%.3f,"
          "\"gpu_bound_over_copy\":%.3f}\n",
          r.op.c_str(), VariantName(r), r.pdl ? "true" : "false", r.gpu_scope ? "true" : "false",
          device.c_str(), r.sms, r.oversubscribed ? "true" : "false", r.bytes_per_rank, r.op_us,
          rank_gbs, agg_gbs, r.memcpy_us, memcpy_gbs, r.hbm_bytes, r.hbm_bytes / r.op_us / 1e6,
          CopyTbps(r), HbmOverCopy(r), r.bound_bytes, r.bound.variant.c_str(), r.bound.blocks,
          r.bound.us, at.bound_tbps, at.op_over_bound, at.bound_over_copy,
          r.gpu_bound.variant.c_str(), r.gpu_bound.blocks, r.gpu_bound.us, gpu.bound_tbps,
          gpu.op_over_bound, gpu.bound_over_copy);
    } else {
      std::printf(
          "%-20s %-9s %-8s %5d%s %12.1f %10.1f %14.1f %14.1f %13.1f %9.0f%% %9.2f %8.0f%%\n",
          r.op.c_str(), VariantName(r), SwitchesName(r), r.sms, r.oversubscribed ? "*" : " ",
          r.bytes_per_rank / 1e6, r.op_us, rank_gbs, agg_gbs, memcpy_gbs,
          100.0 * agg_gbs / memcpy_gbs, r.hbm_bytes / r.op_us / 1e6, 100.0 * HbmOverCopy(r));
    }
  }
  if (json) {
    for (const Row& r : rows) {
      if (r.phases.ops == 0) continue;
      const PhaseSplit& ph = r.phases;
      std::printf(
          "{\"figure\":\"normal %s phases\",\"kernels\":\"%s\",\"pdl\":%s,\"gpu_scope\":%s,"
          "\"device\":\"%s\",\"sms_per_rank\":%d,\"ops\":%d,\"skew_us\":%.2f,"
          "\"layout_us\":%.2f,\"arrival_us\":%.2f,\"counts_us\":%.2f,\"to_copy_us\":%.2f,"
          "\"copy_us\":%.2f,\"done_us\":%.2f,\"op_us\":%.2f}\n",
          r.op.c_str(), VariantName(r), r.pdl ? "true" : "false", r.gpu_scope ? "true" : "false",
          device.c_str(), r.sms, ph.ops, ph.skew, ph.layout, ph.arrival, ph.counts, ph.to_copy,
          ph.copy, ph.done, ph.op);
    }
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      const Row* cached = CachedRowOf(rows, i);
      if (cached == nullptr) continue;
      const RoutingShare share = Routing(r, *cached);
      std::printf(
          "{\"figure\":\"normal %s routing\",\"kernels\":\"%s\",\"pdl\":%s,\"gpu_scope\":%s,"
          "\"device\":\"%s\",\"sms_per_rank\":%d,\"fresh_us\":%.2f,\"cached_us\":%.2f,"
          "\"routing_us\":%.2f,\"routing_fraction\":%.4f,\"hbm_over_copy\":%.3f,"
          "\"without_routing_over_copy\":%.3f,\"cached_over_copy\":%.3f}\n",
          r.op.c_str(), VariantName(r), r.pdl ? "true" : "false", r.gpu_scope ? "true" : "false",
          device.c_str(), r.sms, share.fresh_us, share.cached_us, share.routing_us,
          share.routing_fraction, HbmOverCopy(r), share.without_routing_over_copy,
          share.cached_over_copy);
    }
    for (const BoundRow& b : bound_rows) {
      std::printf(
          "{\"figure\":\"normal fanout bound\",\"pattern\":\"%s\",\"variant\":\"%s\","
          "\"device\":\"%s\",\"blocks\":%d,\"us\":%.2f,\"hbm_bytes\":%.0f,\"hbm_tbps\":%.3f}\n",
          b.pattern.c_str(), b.timing.variant.c_str(), device.c_str(), b.timing.blocks, b.timing.us,
          b.hbm_bytes, b.hbm_bytes / b.timing.us / 1e6);
    }
  } else {
    std::printf(
        "* %d ranks x sms > %d SMs: blocks of different ranks time-share SMs "
        "(only one block per rank spins, so it runs, but the budget is not real)\n",
        kRanks, sms);
    PrintBoundTable(rows, bound_rows, sms);
    PrintPhaseTable(rows);
    // The goal at the default budget: floor(SMs / ranks) blocks per rank.
    const int32_t default_sms = sms / kRanks;
    PrintSwitchSummary(rows, default_sms);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      if (r.sms != default_sms) continue;
      std::printf(
          "goal: %s (%s kernels, switches %s) at %d SMs/rank, HBM bytes/s >= %.0f%% of the "
          "same-run "
          "copy's: %.0f%% (%s)\n",
          r.op.c_str(), VariantName(r), SwitchesName(r), r.sms, 100.0 * kHbmGoal,
          100.0 * HbmOverCopy(r), HbmOverCopy(r) >= kHbmGoal ? "met" : "NOT met");
      if (const Row* cached = CachedRowOf(rows, i); cached != nullptr) {
        const RoutingShare share = Routing(r, *cached);
        std::printf(
            "  floor: routing (fresh %.1f us - cached %.1f us) = %.1f us, %.1f%% of the op; "
            "without it the op's bytes would move at %.0f%% of copy (the cached op itself: "
            "%.0f%%)\n",
            share.fresh_us, share.cached_us, share.routing_us, 100.0 * share.routing_fraction,
            100.0 * share.without_routing_over_copy, 100.0 * share.cached_over_copy);
      }
      if (r.bound.us <= 0) continue;
      const FloorFigures at = Floor(r, false);
      const FloorFigures gpu = Floor(r, true);
      std::printf(
          "  floor: the fan-out copy bound reaches %.0f%% of copy at the op's %d SMs (%s), %.0f%% "
          "on all %d SMs (%s); the op is at %.0f%% / %.0f%% of it%s\n",
          100.0 * at.bound_over_copy, r.bound.blocks, r.bound.variant.c_str(),
          100.0 * gpu.bound_over_copy, r.gpu_bound.blocks, r.gpu_bound.variant.c_str(),
          100.0 * at.op_over_bound, 100.0 * gpu.op_over_bound,
          gpu.bound_over_copy < kHbmGoal
              ? absl::StrFormat(": the %.0f%% goal is beyond this byte pattern on this GPU",
                                100.0 * kHbmGoal)
                    .c_str()
              : "");
    }
  }
  if (!st.ok()) {
    std::fprintf(stderr, "normal bench failed: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace epd::bench
