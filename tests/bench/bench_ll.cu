// Low-latency kernel benchmark (epd_bench --backend=cuda --mode=ll): the CUDA
// LowLatencyDispatch (FP8) and LowLatencyCombine (BF16) on the DeepSeek-V3 decode shape,
// R=8 virtual ranks on one GPU, launched in-process (the bound the daemon's launch modes
// are compared with), each beside a device-to-device cudaMemcpy of the same bytes measured
// in the same run. With --ll_specialised=off,on,...: instead, the generic and the
// shape-specialised kernels (cuda_specialise.h) A/B, rounds interleaved, each op of the 8
// ranks in one CUDA graph. Timing (a device gate, events; p50/p99 of last end - first start) and
// figures: docs/BENCHMARKS.md "Low-latency kernels".

// nvcc (EDG) warns about assigning an absl::Status ([[nodiscard]] on operator=) by mistake.
#pragma nv_diag_suppress 2810

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/cuda_handles.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_specialise.h"
#include "epd/kernels/host_ops.h"
#include "tests/bench/bench.h"
#include "tests/bench/bench_cuda.h"
#include "tests/bench/floors.h"
#include "tests/gpu/gpu_test_util.h"

ABSL_FLAG(std::string, ll_specialised, "",
          "ll bench: instead of the usual figures, A/B the generic and the shape-specialised "
          "low-latency kernels (cuda_ops.h LowLatencySpecialisedFor), one round per entry in "
          "this order, e.g. off,on,off,on: each round captures the 8 ranks' FP8 dispatch, BF16 "
          "dispatch and BF16 combine into one CUDA graph each and replays them");
ABSL_FLAG(int, ll_ab_iters, 1000, "ll bench, --ll_specialised: timed replays per op per round");

namespace epd::bench {
namespace {

namespace kc = ::epd::kernels::cuda;
using ::epd::testing::CudaStream;
using ::epd::testing::DeviceBuffer;
using ::epd::testing::VirtualRankGroup;

constexpr int kWarmup = 50;
constexpr int kIterations = 1000;

// cudaMemcpyAsync device-to-device of `bytes` on one stream, timed with events.
absl::StatusOr<Percentiles> TimeMemcpy(size_t bytes) {
  return TimeDeviceCopy(bytes, kWarmup, kIterations);
}

std::vector<cudaStream_t> Streams(const VirtualRankGroup& g) {
  std::vector<cudaStream_t> streams(g.num_ranks());
  for (int32_t r = 0; r < g.num_ranks(); ++r) streams[r] = g.stream(r);
  return streams;
}

/// Replays each of `graphs` in turn on `origin`, `warmup + iterations` rounds, each replay
/// timed with events around cudaGraphLaunch on `origin` (the time of one op of every rank
/// as a CUDA graph, launch included); the percentiles of the timed rounds, per graph, in µs.
/// Errors: INTERNAL (CUDA).
absl::StatusOr<std::vector<Percentiles>> TimeGraphsInTurn(
    const std::vector<cudaGraphExec_t>& graphs, cudaStream_t origin, int warmup, int iterations) {
  cudaEvent_t start_raw = nullptr, end_raw = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start_raw));
  EventHandle start(start_raw);
  EPD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&end_raw));
  EventHandle end(end_raw);
  std::vector<std::vector<double>> samples(graphs.size());
  for (int it = 0; it < warmup + iterations; ++it) {
    for (size_t i = 0; i < graphs.size(); ++i) {
      EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), origin));
      EPD_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(graphs[i], origin));
      EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(end.get(), origin));
      EPD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(end.get()));
      float ms = 0;
      EPD_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.get(), end.get()));
      if (it >= warmup) samples[i].push_back(ms * 1000.0);
    }
  }
  std::vector<Percentiles> out;
  for (std::vector<double>& v : samples) out.push_back(ComputePercentiles(std::move(v)));
  return out;
}

/// Captures `launch(stream)` on rank 0's stream alone (one fused launch of every rank) into
/// one CUDA graph. Errors: the first of launch / CUDA.
absl::StatusOr<GraphExecHandle> CaptureOnOrigin(
    VirtualRankGroup& g, const std::function<absl::Status(cudaStream_t)>& launch) {
  const cudaStream_t origin = g.stream(0);
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal));
  absl::Status st = launch(origin);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(origin, &graph);  // on every path
  GraphHandle graph_handle(graph);
  EPD_RETURN_IF_ERROR(st);
  EPD_CUDA_RETURN_IF_ERROR(end);
  cudaGraphExec_t exec = nullptr;
  EPD_CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph, 0));
  return GraphExecHandle(exec);
}

/// One A/B round's p50 / p99 in µs per op (one CUDA graph of the 8 ranks, event-timed).
struct SpecialisedRound {
  bool specialised = false;
  Percentiles dispatch_fp8, dispatch_bf16, combine;
};

/// The 8 ranks' FP8 dispatch, BF16 dispatch and BF16 combine (after the BF16 dispatch,
/// same buffer) each captured into one CUDA graph with the current specialisation setting,
/// then replayed in turn `iterations` times after `warmup`; each replay timed with events on
/// rank 0's stream around cudaGraphLaunch (as the launch bench's "ranks in one CUDA graph").
absl::StatusOr<SpecialisedRound> MeasureSpecialisedRound(VirtualRankGroup& g, int warmup,
                                                         int iterations) {
  auto capture = [&](const std::function<absl::Status(int32_t, cudaStream_t)>& launch)
      -> absl::StatusOr<GraphExecHandle> {
    EPD_ASSIGN_OR_RETURN(cudaGraphExec_t exec, CaptureAllRanks(g, launch));
    return GraphExecHandle(exec);
  };
  const cudaStream_t origin = g.stream(0);
  kc::LowLatencyDispatchArgs fp8;
  fp8.use_fp8 = true;
  kc::LowLatencyDispatchArgs bf16;
  kc::LowLatencyCombineArgs combine;
  EPD_ASSIGN_OR_RETURN(GraphExecHandle fp8_graph, capture([&](int32_t r, cudaStream_t stream) {
                         return kc::LowLatencyDispatch(g.Context(r), fp8, stream);
                       }));
  EPD_ASSIGN_OR_RETURN(GraphExecHandle bf16_graph, capture([&](int32_t r, cudaStream_t stream) {
                         return kc::LowLatencyDispatch(g.Context(r), bf16, stream);
                       }));
  EPD_ASSIGN_OR_RETURN(GraphExecHandle combine_graph, capture([&](int32_t r, cudaStream_t stream) {
                         return kc::LowLatencyCombine(g.Context(r), combine, stream);
                       }));
  EPD_ASSIGN_OR_RETURN(std::vector<Percentiles> times,
                       TimeGraphsInTurn({fp8_graph.get(), bf16_graph.get(), combine_graph.get()},
                                        origin, warmup, iterations));
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "A/B round"));
  }
  SpecialisedRound round;
  round.specialised = kc::LowLatencySpecialisedFor(g.shape());
  round.dispatch_fp8 = times[0];
  round.dispatch_bf16 = times[1];
  round.combine = times[2];
  return round;
}

/// --ll_specialised: the A/B of the generic and the specialised kernels, one round per
/// entry, printed with the same-bytes memcpy and the mean p50 of each side.
int RunSpecialisedAb(const std::string& order) {
  std::vector<bool> rounds;
  for (absl::string_view v : absl::StrSplit(order, ',')) {
    if (v != "on" && v != "off") {
      std::cerr << "epd_bench: --ll_specialised entry '" << v << "' is not on or off\n";
      return 2;
    }
    rounds.push_back(v == "on");
  }
  const int iterations = absl::GetFlag(FLAGS_ll_ab_iters);
  if (iterations < 1) {
    std::cerr << "epd_bench: --ll_ab_iters=" << iterations << " must be >= 1\n";
    return 2;
  }
  absl::Status st = [&]() -> absl::Status {
    const kernels::GroupShape s = LowLatencyBenchShape(8);
    const int32_t tokens = kLowLatencyBenchTokens;
    EPD_RETURN_IF_ERROR(kc::PreloadKernels());
    EPD_ASSIGN_OR_RETURN(auto group, VirtualRankGroup::Create(s, 10'000'000'000));
    VirtualRankGroup& g = *group;
    g.set_all_ranks_on_device(true);
    EPD_ASSIGN_OR_RETURN(const double dispatch_rows, UploadLowLatencyBenchInputs(g));
    const double fp8_bytes = dispatch_rows * (s.hidden + 4.0 * s.num_scales() + 4.0);
    const double bf16_bytes = dispatch_rows * (2.0 * s.hidden + 4.0);
    const double combine_bytes =
        static_cast<double>(s.num_ranks) * tokens * s.num_topk * s.hidden * 2;
    EPD_ASSIGN_OR_RETURN(Percentiles fp8_copy, TimeMemcpy(static_cast<size_t>(fp8_bytes)));
    EPD_ASSIGN_OR_RETURN(Percentiles bf16_copy, TimeMemcpy(static_cast<size_t>(bf16_bytes)));
    EPD_ASSIGN_OR_RETURN(Percentiles combine_copy, TimeMemcpy(static_cast<size_t>(combine_bytes)));
    const bool json = absl::GetFlag(FLAGS_json);
    if (!json) {
      std::printf(
          "Generic vs shape-specialised low-latency kernels: 8 ranks' op in one CUDA "
          "graph, T=128 H=7168 K=8 E=256; %d replays per op per round\n",
          iterations);
      std::printf(
          "memcpy p50 us: fp8 dispatch bytes %.2f, bf16 dispatch bytes %.2f, combine "
          "bytes %.2f\n",
          fp8_copy.p50, bf16_copy.p50, combine_copy.p50);
      std::printf("%-6s %-12s %16s %16s %16s\n", "round", "kernels", "dispatch fp8",
                  "dispatch bf16", "combine bf16");
    }
    double sum[2][3] = {};
    int n[2] = {};
    for (size_t i = 0; i < rounds.size(); ++i) {
      kc::SetLowLatencySpecialisation(rounds[i] ? kc::LowLatencySpecialisation::kOn
                                                : kc::LowLatencySpecialisation::kOff);
      absl::StatusOr<SpecialisedRound> round = MeasureSpecialisedRound(g, kWarmup, iterations);
      kc::SetLowLatencySpecialisation(kc::LowLatencySpecialisation::kEnvironment);
      if (!round.ok()) return round.status();
      if (round->specialised != rounds[i]) {
        return absl::InternalError(
            "the specialised kernels were not selectable for the bench shape");
      }
      const int side = rounds[i] ? 1 : 0;
      sum[side][0] += round->dispatch_fp8.p50;
      sum[side][1] += round->dispatch_bf16.p50;
      sum[side][2] += round->combine.p50;
      ++n[side];
      const char* name = rounds[i] ? "specialised" : "generic";
      if (json) {
        std::printf(
            "{\"bench\":\"ll_specialised\",\"round\":%zu,\"kernels\":\"%s\","
            "\"dispatch_fp8_p50_us\":%.2f,\"dispatch_fp8_p99_us\":%.2f,"
            "\"dispatch_bf16_p50_us\":%.2f,\"dispatch_bf16_p99_us\":%.2f,"
            "\"combine_bf16_p50_us\":%.2f,\"combine_bf16_p99_us\":%.2f,"
            "\"memcpy_fp8_p50_us\":%.2f,\"memcpy_bf16_p50_us\":%.2f,"
            "\"memcpy_combine_p50_us\":%.2f}\n",
            i, name, round->dispatch_fp8.p50, round->dispatch_fp8.p99, round->dispatch_bf16.p50,
            round->dispatch_bf16.p99, round->combine.p50, round->combine.p99, fp8_copy.p50,
            bf16_copy.p50, combine_copy.p50);
      } else {
        std::printf("%-6zu %-12s %7.2f / %6.2f %7.2f / %6.2f %7.2f / %6.2f   (p50 / p99 us)\n", i,
                    name, round->dispatch_fp8.p50, round->dispatch_fp8.p99,
                    round->dispatch_bf16.p50, round->dispatch_bf16.p99, round->combine.p50,
                    round->combine.p99);
      }
    }
    if (!json) {
      const double copy[3] = {fp8_copy.p50, bf16_copy.p50, combine_copy.p50};
      for (int side = 0; side < 2; ++side) {
        if (n[side] == 0) continue;
        std::printf("%-19s", side == 1 ? "mean p50 specialised" : "mean p50 generic");
        for (int op = 0; op < 3; ++op) {
          const double m = sum[side][op] / n[side];
          std::printf("  %7.2f (%.2fx memcpy)", m, m / copy[op]);
        }
        std::printf("\n");
      }
      if (n[0] > 0 && n[1] > 0) {
        std::printf("specialised - generic, mean p50 us:");
        for (int op = 0; op < 3; ++op) {
          const double d = sum[1][op] / n[1] - sum[0][op] / n[0];
          std::printf("  %+.2f (%+.1f%%)", d, 100.0 * d / (sum[0][op] / n[0]));
        }
        std::printf("  (dispatch fp8, dispatch bf16, combine)\n");
      }
    }
    return absl::OkStatus();
  }();
  if (!st.ok()) {
    std::cerr << "epd_bench ll --ll_specialised: " << st << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

absl::StatusOr<double> UploadLowLatencyBenchInputs(VirtualRankGroup& g) {
  const kernels::GroupShape& s = g.shape();
  const int32_t tokens = kLowLatencyBenchTokens;
  const auto& l = g.layout();
  std::mt19937_64 rng(1);
  double dispatch_rows = 0;
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    auto x = testing::RandomBf16(static_cast<size_t>(tokens) * s.hidden, rng);
    auto topk = testing::RandomTopk(tokens, s.num_topk, s.num_experts, {}, rng);
    auto w = testing::RandomFloats(static_cast<size_t>(tokens) * s.num_topk, rng);
    EPD_RETURN_IF_ERROR(g.Upload(r, l.in_x, x.data(), x.size() * 2));
    EPD_RETURN_IF_ERROR(g.Upload(r, l.in_topk_idx, topk.data(), topk.size() * 8));
    EPD_RETURN_IF_ERROR(g.Upload(r, l.in_topk_weights, w.data(), w.size() * 4));
    EPD_RETURN_IF_ERROR(kc::SetLowLatencyNumTokensAsync(g.Context(r), tokens, g.stream(r)));
    EPD_CUDA_RETURN_IF_ERROR(
        cudaMemset(g.At<uint8_t>(r, l.in_ll_combine_x), 0x3f, l.in_ll_combine_x.bytes));
    for (int32_t t = 0; t < tokens; ++t) {
      for (int32_t k = 0; k < s.num_topk; ++k) {
        bool dup = false;
        for (int32_t j = 0; j < k; ++j) {
          dup |= topk[t * s.num_topk + j] == topk[t * s.num_topk + k];
        }
        dispatch_rows += dup ? 0 : 1;
      }
    }
  }
  EPD_RETURN_IF_ERROR(g.SynchronizeAll());
  return dispatch_rows;
}

absl::Status MeasureLowLatencyInProcess(std::vector<LowLatencyFigure>* figures,
                                        std::string* device_name, int32_t num_ranks) {
  const kernels::GroupShape s = LowLatencyBenchShape(num_ranks);
  const int32_t kTokens = kLowLatencyBenchTokens;

  cudaDeviceProp prop;
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0));
  *device_name = absl::StrFormat("%s, %d SMs", prop.name, prop.multiProcessorCount);
  EPD_RETURN_IF_ERROR(kc::PreloadKernels());
  EPD_ASSIGN_OR_RETURN(auto group, VirtualRankGroup::Create(s, 10'000'000'000));
  VirtualRankGroup& g = *group;
  // Every rank is on this GPU: the flags at .gpu scope, as the daemon and the client
  // library configure a group whose ranks share one GPU.
  g.set_all_ranks_on_device(true);
  EPD_ASSIGN_OR_RETURN(const double dispatch_rows, UploadLowLatencyBenchInputs(g));

  // Bytes moved between ranks per op (all ranks together).
  const double fp8_row = s.hidden + 4.0 * s.num_scales() + 4.0;  // e4m3 row + scales + src_info
  const double dispatch_bytes = dispatch_rows * fp8_row;
  const double combine_bytes =
      static_cast<double>(s.num_ranks) * kTokens * s.num_topk * s.hidden * 2;

  EPD_ASSIGN_OR_RETURN(auto timer, GatedTimer::Create(s.num_ranks));
  kc::LowLatencyDispatchArgs da;
  da.use_fp8 = true;
  EPD_ASSIGN_OR_RETURN(
      OpTimes dispatch,
      timer->Run(Streams(g), kWarmup, kIterations, [&](int32_t r, int it, cudaStream_t stream) {
        kc::LowLatencyDispatchArgs a = da;
        a.buffer = it % 2;
        return kc::LowLatencyDispatch(g.Context(r), a, stream);
      }));
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyDispatch"));
  }
  // For reference: the same dispatch without FP8 (bf16 rows, no quantisation).
  EPD_ASSIGN_OR_RETURN(
      OpTimes dispatch_bf16,
      timer->Run(Streams(g), kWarmup, kIterations, [&](int32_t r, int it, cudaStream_t stream) {
        kc::LowLatencyDispatchArgs a;
        a.buffer = it % 2;
        return kc::LowLatencyDispatch(g.Context(r), a, stream);
      }));
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyDispatch"));
  }
  // The FP8 dispatch through the large path (cuda_limits.h LowLatencyRoutingPlan), which
  // capacities whose routing does not fit shared memory and K > 32 take: its cost here.
  EPD_ASSIGN_OR_RETURN(
      OpTimes dispatch_large,
      timer->Run(Streams(g), kWarmup, kIterations, [&](int32_t r, int it, cudaStream_t stream) {
        kc::LowLatencyDispatchArgs a = da;
        a.buffer = it % 2;
        a.large_path = true;
        return kc::LowLatencyDispatch(g.Context(r), a, stream);
      }));
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyDispatch"));
  }
  // Combine against the handle of the last dispatch (buffer 1 after an even count).
  const int32_t last_buffer = (kWarmup + kIterations - 1) % 2;
  EPD_ASSIGN_OR_RETURN(
      OpTimes combine,
      timer->Run(Streams(g), kWarmup, kIterations, [&](int32_t r, int, cudaStream_t stream) {
        kc::LowLatencyCombineArgs a;
        a.buffer = last_buffer;
        return kc::LowLatencyCombine(g.Context(r), a, stream);
      }));
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "LowLatencyCombine"));
  }
  // The op sequence of the launch bench (bench_launch.cc): per iteration an FP8 dispatch,
  // then the combine with its handle, each timed on its own. The repeated combine above
  // reuses one buffer's handle and rows; after a dispatch the combine's rows and flags are
  // the other buffer's each time, as in decode.
  OpTimesBuilder paired_dispatch, paired_combine;
  for (int it = 0; it < kWarmup + kIterations; ++it) {
    EPD_ASSIGN_OR_RETURN(const GatedTimer::Sample ds,
                         timer->RunOnce(Streams(g), it, [&](int32_t r, int, cudaStream_t stream) {
                           kc::LowLatencyDispatchArgs a = da;
                           a.buffer = it % 2;
                           return kc::LowLatencyDispatch(g.Context(r), a, stream);
                         }));
    EPD_ASSIGN_OR_RETURN(const GatedTimer::Sample cs,
                         timer->RunOnce(Streams(g), it, [&](int32_t r, int, cudaStream_t stream) {
                           kc::LowLatencyCombineArgs a;
                           a.buffer = it % 2;
                           return kc::LowLatencyCombine(g.Context(r), a, stream);
                         }));
    if (it >= kWarmup) {
      paired_dispatch.Add(ds.span, ds.after_last, ds.host);
      paired_combine.Add(cs.span, cs.after_last, cs.host);
    }
  }
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "dispatch + combine"));
  }
  // The FP8 dispatch and BF16 combine (buffer 0) in CUDA graphs, replayed in turn, each
  // replay timed with events around cudaGraphLaunch (as the launch bench's graph figures):
  // the R ranks' kernels captured into one graph (fork/join from rank 0's stream), and ONE
  // fused launch per op (LowLatencyDispatchRanks / LowLatencyCombineRanks) captured alone.
  std::vector<kc::CudaRankContext> ctxs;
  for (int32_t r = 0; r < s.num_ranks; ++r) ctxs.push_back(g.Context(r));
  const std::vector<kc::LowLatencyDispatchArgs> fused_da(s.num_ranks, da);
  const std::vector<kc::LowLatencyCombineArgs> fused_ca(s.num_ranks);
  EPD_ASSIGN_OR_RETURN(cudaGraphExec_t rank_dispatch_raw,
                       CaptureAllRanks(g, [&](int32_t r, cudaStream_t stream) {
                         return kc::LowLatencyDispatch(g.Context(r), da, stream);
                       }));
  GraphExecHandle rank_dispatch_graph(rank_dispatch_raw);
  EPD_ASSIGN_OR_RETURN(cudaGraphExec_t rank_combine_raw,
                       CaptureAllRanks(g, [&](int32_t r, cudaStream_t stream) {
                         return kc::LowLatencyCombine(g.Context(r), fused_ca[r], stream);
                       }));
  GraphExecHandle rank_combine_graph(rank_combine_raw);
  EPD_ASSIGN_OR_RETURN(GraphExecHandle fused_dispatch_graph,
                       CaptureOnOrigin(g, [&](cudaStream_t stream) {
                         return kc::LowLatencyDispatchRanks(ctxs, fused_da, stream);
                       }));
  EPD_ASSIGN_OR_RETURN(GraphExecHandle fused_combine_graph,
                       CaptureOnOrigin(g, [&](cudaStream_t stream) {
                         return kc::LowLatencyCombineRanks(ctxs, fused_ca, stream);
                       }));
  EPD_ASSIGN_OR_RETURN(const std::vector<Percentiles> graph_times,
                       TimeGraphsInTurn({rank_dispatch_graph.get(), rank_combine_graph.get(),
                                         fused_dispatch_graph.get(), fused_combine_graph.get()},
                                        g.stream(0), kWarmup, kIterations));
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "graphs"));
  }
  // The fixed part: the same ops with T = 0 on every rank (count exchange, flags, launch
  // skew; no rows move).
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    EPD_RETURN_IF_ERROR(kc::SetLowLatencyNumTokensAsync(g.Context(r), 0, g.stream(r)));
  }
  EPD_ASSIGN_OR_RETURN(
      OpTimes dispatch_empty,
      timer->Run(Streams(g), kWarmup, kIterations, [&](int32_t r, int it, cudaStream_t stream) {
        kc::LowLatencyDispatchArgs a = da;
        a.buffer = it % 2;
        return kc::LowLatencyDispatch(g.Context(r), a, stream);
      }));
  EPD_ASSIGN_OR_RETURN(
      OpTimes combine_empty,
      timer->Run(Streams(g), kWarmup, kIterations, [&](int32_t r, int, cudaStream_t stream) {
        kc::LowLatencyCombineArgs a;
        a.buffer = last_buffer;
        return kc::LowLatencyCombine(g.Context(r), a, stream);
      }));
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(g.Context(r), g.stream(r), "T=0 ops"));
  }
  EPD_ASSIGN_OR_RETURN(Percentiles dispatch_copy, TimeMemcpy(static_cast<size_t>(dispatch_bytes)));
  EPD_ASSIGN_OR_RETURN(Percentiles combine_copy, TimeMemcpy(static_cast<size_t>(combine_bytes)));
  const double dispatch_bf16_bytes = dispatch_rows * (2.0 * s.hidden + 4.0);
  EPD_ASSIGN_OR_RETURN(Percentiles dispatch_bf16_copy,
                       TimeMemcpy(static_cast<size_t>(dispatch_bf16_bytes)));
  figures->push_back({"ll_dispatch_fp8", dispatch_bytes, dispatch, dispatch_copy});
  figures->push_back({"ll_dispatch_bf16", dispatch_bf16_bytes, dispatch_bf16, dispatch_bf16_copy});
  figures->push_back({"ll_dispatch_fp8_large", dispatch_bytes, dispatch_large, dispatch_copy});
  figures->push_back({"ll_combine_bf16", combine_bytes, combine, combine_copy});
  figures->push_back(
      {"ll_dispatch_fp8_then_combine", dispatch_bytes, paired_dispatch.Build(), dispatch_copy});
  figures->push_back(
      {"ll_combine_bf16_after_dispatch", combine_bytes, paired_combine.Build(), combine_copy});
  figures->push_back(
      {"ll_graph_dispatch_fp8", dispatch_bytes, OpTimes{graph_times[0], {}, {}}, dispatch_copy});
  figures->push_back(
      {"ll_graph_combine_bf16", combine_bytes, OpTimes{graph_times[1], {}, {}}, combine_copy});
  figures->push_back({"ll_fused_graph_dispatch_fp8", dispatch_bytes,
                      OpTimes{graph_times[2], {}, {}}, dispatch_copy});
  figures->push_back({"ll_fused_graph_combine_bf16", combine_bytes, OpTimes{graph_times[3], {}, {}},
                      combine_copy});
  figures->push_back({"ll_dispatch_fp8_T0", 0, dispatch_empty, {}});
  figures->push_back({"ll_combine_bf16_T0", 0, combine_empty, {}});
  return absl::OkStatus();
}

int RunLowLatencyBench() {
  if (const std::string order = absl::GetFlag(FLAGS_ll_specialised); !order.empty()) {
    return RunSpecialisedAb(order);
  }
  std::vector<LowLatencyFigure> figures;
  std::string device;
  absl::Status st = MeasureLowLatencyInProcess(&figures, &device);
  if (!st.ok()) {
    std::cerr << "epd_bench ll: " << st << "\n";
    return 1;
  }
  const bool json = absl::GetFlag(FLAGS_json);
  if (!json) {
    std::printf("Low-latency kernels, in-process, 8 virtual ranks on one GPU (%s)\n",
                device.c_str());
    std::printf("shape: T=128 H=7168 K=8 E=256 R=8; %d iterations after %d warm-up\n", kIterations,
                kWarmup);
    std::printf("%-28s %10s %8s %8s %11s %11s %11s %11s\n", "op", "bytes/op", "p50 us", "p99 us",
                "memcpy p50", "memcpy p99", "p50/memcpy", "last-in p50");
  }
  for (const LowLatencyFigure& f : figures) {
    const bool bound = f.memcpy_us.count > 0;
    if (json) {
      std::printf(
          "{\"bench\":\"ll\",\"op\":\"%s\",\"device\":\"%s\",\"bytes\":%.0f,\"p50_us\":%.2f,"
          "\"p99_us\":%.2f,\"after_last_p50_us\":%.2f,\"memcpy_p50_us\":%.2f,"
          "\"memcpy_p99_us\":%.2f,\"iterations\":%zu}\n",
          f.name.c_str(), device.c_str(), f.bytes, f.op_us.span.p50, f.op_us.span.p99,
          f.op_us.after_last.p50, f.memcpy_us.p50, f.memcpy_us.p99, f.op_us.span.count);
    } else {
      const std::string last_in = f.op_us.after_last.count > 0
                                      ? absl::StrFormat("%.2f", f.op_us.after_last.p50)
                                      : std::string("-");
      const auto column = [&](double v) {
        return bound ? absl::StrFormat("%.2f", v) : std::string("-");
      };
      std::printf("%-28s %10.0f %8.2f %8.2f %11s %11s %11s %11s\n", f.name.c_str(), f.bytes,
                  f.op_us.span.p50, f.op_us.span.p99, column(f.memcpy_us.p50).c_str(),
                  column(f.memcpy_us.p99).c_str(),
                  column(f.op_us.span.p50 / f.memcpy_us.p50).c_str(), last_in.c_str());
    }
  }
  // The fixed cost: each op against the same op with T = 0 on every rank, the data part
  // (op - T0) against the memcpy of the op's bytes.
  auto find = [&](const char* name) -> const LowLatencyFigure* {
    for (const LowLatencyFigure& f : figures) {
      if (f.name == name) return &f;
    }
    return nullptr;
  };
  const std::pair<const char*, const char*> splits[] = {{"ll_dispatch_fp8", "ll_dispatch_fp8_T0"},
                                                        {"ll_combine_bf16", "ll_combine_bf16_T0"}};
  if (!json) {
    std::printf(
        "last-in: from the last rank's kernel start to its end (no launch skew); ll_graph_*: the "
        "ranks' kernels in one CUDA graph, ll_fused_graph_*: one fused launch per op "
        "(LowLatencyDispatchRanks / LowLatencyCombineRanks) in one CUDA graph, both timed with "
        "events around cudaGraphLaunch\n");
    for (const char* op : {"dispatch_fp8", "combine_bf16"}) {
      const LowLatencyFigure* ranks = find(absl::StrCat("ll_graph_", op).c_str());
      const LowLatencyFigure* fused = find(absl::StrCat("ll_fused_graph_", op).c_str());
      if (ranks != nullptr && fused != nullptr) {
        std::printf("fused - ranks' kernels in one graph, %s p50: %+.2f us (%.2fx)\n", op,
                    fused->op_us.span.p50 - ranks->op_us.span.p50,
                    fused->op_us.span.p50 / ranks->op_us.span.p50);
      }
    }
    std::printf("fixed cost (the same op with T=0 on every rank: count exchange and barriers):");
  }
  for (const auto& [op_name, t0_name] : splits) {
    const LowLatencyFigure* op = find(op_name);
    const LowLatencyFigure* t0 = find(t0_name);
    if (op == nullptr || t0 == nullptr) continue;
    PrintFixedCostSplit("ll", "inprocess", op_name, device,
                        SplitFixedCost(op->op_us.span.p50, t0->op_us.span.p50, op->memcpy_us.p50),
                        json);
  }
  if (!json) std::printf("\n");
  return 0;
}

}  // namespace epd::bench
