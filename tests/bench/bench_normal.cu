// Normal-mode (high-throughput) CUDA kernels on R = 8 virtual ranks of one GPU
// (epd_bench --backend=cuda --mode=normal): FP8 dispatch, BF16 dispatch and BF16 combine
// at T=4096 H=7168 K=8 E=256 over an SM sweep {8, 16, 24, 32} blocks per rank, each beside
// a device-to-device cudaMemcpy of the same total bytes measured in the same run. Two
// figures per op: DeepEP's logical bandwidth (the rows sent, one copy per destination) over
// the memcpy's, and the HBM bytes the op must read and write (every input byte read once,
// every output byte written once, counted from the routing) per second over the memcpy's
// HBM rate (2 bytes of traffic per byte copied), with the goal (>= 85%) and its verdict at
// the default SM budget. --normal_kernels=static,block,balanced,bulk compares kernel variants
// (EPD_NORMAL_KERNELS) in one run. docs/BENCHMARKS.md "Normal-mode kernels".
#include <cuda_runtime.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "tests/bench/bench.h"
#include "tests/bench/bench_cuda.h"
#include "tests/gpu/gpu_test_util.h"

ABSL_FLAG(std::string, normal_kernels, "",
          "normal bench: comma-separated EPD_NORMAL_KERNELS values (balanced, static, block, "
          "bulk) "
          "to compare in one run, interleaved per SM budget; empty = as the environment has it");

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
constexpr int kSmSweep[] = {8, 16, 24, 32};

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

/// Microseconds of one device-to-device cudaMemcpyAsync of `bytes` (median of `batch`).
absl::StatusOr<double> TimeMemcpy(size_t bytes, int batch) {
  EPD_ASSIGN_OR_RETURN(const Percentiles p, TimeDeviceCopy(bytes, kWarmup, batch));
  return p.p50;
}

struct Row {
  std::string op;
  std::string variant;  // EPD_NORMAL_KERNELS during the op ("" = as the process had it)
  int32_t sms = 0;
  bool oversubscribed = false;
  double bytes_per_rank = 0;  // mean over ranks
  double op_us = 0;
  double memcpy_us = 0;
  double memcpy_bytes = 0;  // the bytes the bound's memcpy copied (all ranks)
  double hbm_bytes = 0;     // HBM bytes the op reads + writes (all ranks)
};

/// HBM rate of the op over the memcpy's (read + write of every byte), in [0, ...).
double HbmOverCopy(const Row& r) {
  return (r.hbm_bytes / r.op_us) / (2.0 * r.memcpy_bytes / r.memcpy_us);
}

/// The kernel variant of a row, for printing.
const char* VariantName(const Row& r) { return r.variant.empty() ? "default" : r.variant.c_str(); }

/// The goal of the normal kernels: HBM bytes per second >= 85% of the device copy's.
constexpr double kHbmGoal = 0.85;

absl::Status Run(std::vector<Row>* rows, std::string* device_name, int* device_sms) {
  cudaDeviceProp prop{};
  int device = 0;
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  *device_name = prop.name;
  *device_sms = prop.multiProcessorCount;
  EPD_RETURN_IF_ERROR(kc::PreloadKernels());

  const kernels::GroupShape shape = NormalBenchShape(kRanks);
  EPD_ASSIGN_OR_RETURN(std::unique_ptr<VirtualRankGroup> g, VirtualRankGroup::Create(shape));
  const kernels::EndpointLayout& l = g->layout();

  // Inputs: uniform top-8 of 256 experts per token (DeepEP's benchmark routing), values
  // from a hash; T set in every rank's slot.
  std::mt19937_64 rng(2024);
  int64_t sent_rows_total = 0;
  for (int32_t r = 0; r < kRanks; ++r) {
    const std::vector<int64_t> topk = epd::testing::RandomTopk(kTokens, kTopk, kExperts, {}, rng);
    for (int32_t t = 0; t < kTokens; ++t) {
      uint32_t mask = 0;
      for (int32_t k = 0; k < kTopk; ++k) {
        mask |= 1u << (topk[static_cast<size_t>(t) * kTopk + k] / (kExperts / kRanks));
      }
      sent_rows_total += __builtin_popcount(mask);
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
  const double combine_hbm =
      sent * (bf16_row + kTopk * 4.0) + send_pos_bytes + all_tokens * (bf16_row + kTopk * 4.0);
  EPD_ASSIGN_OR_RETURN(const double memcpy_bf16_us,
                       TimeMemcpy(static_cast<size_t>(bf16_total), kBatch));
  EPD_ASSIGN_OR_RETURN(const double memcpy_fp8_us,
                       TimeMemcpy(static_cast<size_t>(fp8_total), kBatch));

  // Kernel variants compared in this run (--normal_kernels), interleaved per SM budget so
  // each pair is measured minutes, not runs, apart; "" = EPD_NORMAL_KERNELS as it was.
  std::vector<std::string> variants =
      absl::StrSplit(absl::GetFlag(FLAGS_normal_kernels), ',', absl::SkipEmpty());
  if (variants.empty()) variants.push_back("");

  for (int32_t sms : kSmSweep) {
    // A context per rank with this SM budget (the group's own contexts use the default).
    std::vector<kc::CudaRankContext> ctx(kRanks);
    for (int32_t r = 0; r < kRanks; ++r) {
      ctx[r] = g->Context(r);
      ctx[r].num_sms = sms;
    }
    auto dispatch = [&](bool fp8) {
      return [&, fp8](int32_t r, cudaStream_t s) {
        kc::NormalDispatchArgs args;
        args.fp8 = fp8;
        return kc::NormalDispatch(ctx[r], args, s);
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
    };
    const Op ops[] = {
        {"dispatch fp8", dispatch(true), fp8_row, memcpy_fp8_us, fp8_total, dispatch_hbm(fp8_row)},
        {"dispatch bf16", dispatch(false), bf16_row, memcpy_bf16_us, bf16_total,
         dispatch_hbm(bf16_row)},
        {"combine bf16", combine, bf16_row, memcpy_bf16_us, bf16_total, combine_hbm}};
    for (const std::string& variant : variants) {
      if (!variant.empty()) setenv("EPD_NORMAL_KERNELS", variant.c_str(), 1);
      for (const Op& op : ops) {
        EPD_RETURN_IF_ERROR(TimeRounds(*g, kWarmup, op.launch).status());
        EPD_ASSIGN_OR_RETURN(const double us, TimeRounds(*g, kBatch, op.launch));
        for (int32_t r = 0; r < kRanks; ++r) {
          EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(ctx[r], g->stream(r), op.name));
        }
        rows->push_back({op.name, variant, sms, over, rows_per_rank * op.row_bytes, us,
                         op.memcpy_us, op.memcpy_bytes, op.hbm_bytes});
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

int RunNormalBench() {
  std::vector<Row> rows;
  std::string device;
  int sms = 0;
  const absl::Status st = Run(&rows, &device, &sms);
  const bool json = absl::GetFlag(FLAGS_json);
  if (!json) {
    std::printf("Normal-mode kernels, %d virtual ranks on one GPU (%s, %d SMs)\n", kRanks,
                device.c_str(), sms);
    std::printf(
        "shape: T=%d H=%d K=%d E=%d R=%d; uniform top-%d routing; %d rounds after %d "
        "warm-up\n",
        kTokens, kHidden, kTopk, kExperts, kRanks, kTopk, kBatch, kWarmup);
    std::printf("%-14s %-9s %5s %13s %10s %14s %14s %13s %10s %9s %9s\n", "op", "kernels", "sms",
                "MB/rank", "us/op", "rank GB/s", "aggregate GB/s", "memcpy GB/s", "agg/memcpy",
                "HBM TB/s", "HBM/copy");
  }
  for (const Row& r : rows) {
    const double rank_gbs = r.bytes_per_rank / r.op_us / 1e3;
    const double agg_gbs = rank_gbs * kRanks;
    const double memcpy_gbs = r.bytes_per_rank * kRanks / r.memcpy_us / 1e3;
    if (json) {
      std::printf(
          "{\"figure\":\"normal %s\",\"kernels\":\"%s\",\"device\":\"%s\",\"sms_per_rank\":%d,"
          "\"oversubscribed\":%s,\"bytes_per_rank\":%.0f,\"op_us\":%.2f,\"rank_gbps\":%.1f,"
          "\"aggregate_gbps\":%.1f,\"memcpy_us\":%.2f,\"memcpy_gbps\":%.1f,"
          "\"hbm_bytes\":%.0f,\"hbm_tbps\":%.3f,\"copy_hbm_tbps\":%.3f,"
          "\"hbm_over_copy\":%.3f}\n",
          r.op.c_str(), VariantName(r), device.c_str(), r.sms, r.oversubscribed ? "true" : "false",
          r.bytes_per_rank, r.op_us, rank_gbs, agg_gbs, r.memcpy_us, memcpy_gbs, r.hbm_bytes,
          r.hbm_bytes / r.op_us / 1e6, 2.0 * r.memcpy_bytes / r.memcpy_us / 1e6, HbmOverCopy(r));
    } else {
      std::printf("%-14s %-9s %5d%s %12.1f %10.1f %14.1f %14.1f %13.1f %9.0f%% %9.2f %8.0f%%\n",
                  r.op.c_str(), VariantName(r), r.sms, r.oversubscribed ? "*" : " ",
                  r.bytes_per_rank / 1e6, r.op_us, rank_gbs, agg_gbs, memcpy_gbs,
                  100.0 * agg_gbs / memcpy_gbs, r.hbm_bytes / r.op_us / 1e6,
                  100.0 * HbmOverCopy(r));
    }
  }
  if (!json) {
    std::printf(
        "* %d ranks x sms > %d SMs: blocks of different ranks time-share SMs "
        "(only one block per rank spins, so it runs, but the budget is not real)\n",
        kRanks, sms);
    // The goal at the default budget: floor(SMs / ranks) blocks per rank.
    const int32_t default_sms = sms / kRanks;
    for (const Row& r : rows) {
      if (r.sms != default_sms) continue;
      std::printf(
          "goal: %s (%s kernels) at %d SMs/rank, HBM bytes/s >= %.0f%% of the same-run "
          "copy's: %.0f%% (%s)\n",
          r.op.c_str(), VariantName(r), r.sms, 100.0 * kHbmGoal, 100.0 * HbmOverCopy(r),
          HbmOverCopy(r) >= kHbmGoal ? "met" : "NOT met");
    }
  }
  if (!st.ok()) {
    std::fprintf(stderr, "normal bench failed: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace epd::bench
