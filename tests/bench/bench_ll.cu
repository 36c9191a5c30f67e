// Low-latency kernel benchmark (epd_bench --backend=cuda --mode=ll): the CUDA
// LowLatencyDispatch (FP8) and LowLatencyCombine (BF16) on the DeepSeek-V3 decode shape,
// R=8 virtual ranks on one GPU, launched in-process (the bound the daemon's launch modes
// are compared with), each beside a device-to-device cudaMemcpy of the same bytes measured
// in the same run. Timing (a device gate, events; p50/p99 of last end - first start) and
// figures: docs/BENCHMARKS.md "Low-latency kernels".

// nvcc (EDG) warns about assigning an absl::Status ([[nodiscard]] on operator=) by mistake.
#pragma nv_diag_suppress 2810

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/host_ops.h"
#include "tests/bench/bench.h"
#include "tests/bench/bench_cuda.h"
#include "tests/gpu/gpu_test_util.h"

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

}  // namespace

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
  const auto& l = g.layout();

  // Inputs: random bf16 tokens, uniform top-8 routing without masking, random weights.
  std::mt19937_64 rng(1);
  std::vector<std::vector<int64_t>> topk(s.num_ranks);
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    auto x = testing::RandomBf16(static_cast<size_t>(kTokens) * s.hidden, rng);
    topk[r] = testing::RandomTopk(kTokens, s.num_topk, s.num_experts, {}, rng);
    auto w = testing::RandomFloats(static_cast<size_t>(kTokens) * s.num_topk, rng);
    EPD_RETURN_IF_ERROR(g.Upload(r, l.in_x, x.data(), x.size() * 2));
    EPD_RETURN_IF_ERROR(g.Upload(r, l.in_topk_idx, topk[r].data(), topk[r].size() * 8));
    EPD_RETURN_IF_ERROR(g.Upload(r, l.in_topk_weights, w.data(), w.size() * 4));
    EPD_RETURN_IF_ERROR(kc::SetLowLatencyNumTokensAsync(g.Context(r), kTokens, g.stream(r)));
    // Expert outputs: a constant bf16 pattern (0x3f3f, about 0.75); the kernels' speed does
    // not depend on the values.
    EPD_CUDA_RETURN_IF_ERROR(
        cudaMemset(g.At<uint8_t>(r, l.in_ll_combine_x), 0x3f, l.in_ll_combine_x.bytes));
  }
  EPD_RETURN_IF_ERROR(g.SynchronizeAll());

  // Bytes moved between ranks per op (all ranks together).
  const double fp8_row = s.hidden + 4.0 * s.num_scales() + 4.0;  // e4m3 row + scales + src_info
  double dispatch_rows = 0;
  for (int32_t r = 0; r < s.num_ranks; ++r) {
    for (int32_t t = 0; t < kTokens; ++t) {
      for (int32_t k = 0; k < s.num_topk; ++k) {
        bool dup = false;
        for (int32_t j = 0; j < k; ++j)
          dup |= topk[r][t * s.num_topk + j] == topk[r][t * s.num_topk + k];
        dispatch_rows += dup ? 0 : 1;
      }
    }
  }
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
  figures->push_back({"ll_dispatch_fp8_T0", 0, dispatch_empty, {}});
  figures->push_back({"ll_combine_bf16_T0", 0, combine_empty, {}});
  return absl::OkStatus();
}

int RunLowLatencyBench() {
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
    std::printf("%-19s %10s %8s %8s %11s %11s %11s %11s\n", "op", "bytes/op", "p50 us", "p99 us",
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
    } else if (bound) {
      std::printf("%-19s %10.0f %8.2f %8.2f %11.2f %11.2f %11.2f %11.2f\n", f.name.c_str(), f.bytes,
                  f.op_us.span.p50, f.op_us.span.p99, f.memcpy_us.p50, f.memcpy_us.p99,
                  f.op_us.span.p50 / f.memcpy_us.p50, f.op_us.after_last.p50);
    } else {
      std::printf("%-19s %10.0f %8.2f %8.2f %11s %11s %11s %11.2f\n", f.name.c_str(), f.bytes,
                  f.op_us.span.p50, f.op_us.span.p99, "-", "-", "-", f.op_us.after_last.p50);
    }
  }
  if (!json) {
    std::printf("last-in: from the last rank's kernel start to its end (no launch skew)\n");
  }
  return 0;
}

}  // namespace epd::bench
