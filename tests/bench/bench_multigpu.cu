// Normal-mode kernels with one rank per GPU (epd_bench --backend=cuda --mode=multigpu
// [--gpus=N]): every GPU of this host a rank, all in this one process (peer access, one
// stream per rank), the launchers of cuda_normal.h with ranks_on_device = 1, at T=4096
// H=7168 K=8 E=256 (FP8 dispatch, BF16 dispatch, BF16 combine) over an SM sweep, beside
// an NCCL all-to-all (needs EPD_HAVE_NCCL) and a peer copy of the same bytes measured in
// the same run. With fewer than 2 GPUs it says the figures were not measured and exits 0.
// Bytes, op time and bounds: docs/BENCHMARKS.md "Normal-mode kernels, one rank per GPU".
#pragma nv_diag_suppress 2810

#include <cuda_runtime.h>

#if defined(EPD_HAVE_NCCL)
#include <nccl.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "tests/bench/bench.h"
#include "tests/bench/bench_cuda.h"
#include "tests/gpu/gpu_test_util.h"

ABSL_FLAG(int, gpus, 0, "multigpu: GPUs to use, one rank each (0 = every visible GPU)");

namespace epd::bench {
namespace {

namespace kc = ::epd::kernels::cuda;
using ::epd::testing::CudaStream;
using ::epd::testing::DeviceBuffer;

constexpr int32_t kTokens = kNormalBenchTokens;
constexpr int32_t kHidden = kNormalBenchHidden;
constexpr int32_t kTopk = kNormalBenchTopk;
constexpr int32_t kExperts = kNormalBenchExperts;
constexpr int kWarmup = 3;
constexpr int kBatch = 20;
/// Blocks per rank; 0 = the default (every SM of the rank's GPU, ranks_on_device = 1).
constexpr int32_t kSmSweep[] = {8, 16, 24, 32, 0};

#if defined(EPD_HAVE_NCCL)
absl::Status NcclStatus(ncclResult_t r, const char* call) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, " failed: ", ncclGetErrorString(r)));
}
#define EPD_NCCL_RETURN_IF_ERROR(call) EPD_RETURN_IF_ERROR(NcclStatus((call), #call))

/// One communicator per rank's GPU (ncclCommInitAll), destroyed on destruction.
class NcclComms {
 public:
  NcclComms() = default;
  NcclComms(const NcclComms&) = delete;
  NcclComms& operator=(const NcclComms&) = delete;
  ~NcclComms() {
    for (ncclComm_t c : comms_) {
      if (c != nullptr) ncclCommDestroy(c);
    }
  }
  absl::Status Init(const std::vector<int>& devices) {
    comms_.assign(devices.size(), nullptr);
    return NcclStatus(
        ncclCommInitAll(comms_.data(), static_cast<int>(devices.size()), devices.data()),
        "ncclCommInitAll");
  }
  ncclComm_t get(int32_t r) const { return comms_[r]; }

 private:
  std::vector<ncclComm_t> comms_;
};
#endif

/// One rank on its own GPU.
struct GpuRank {
  int device = 0;
  DeviceBuffer area;        // EndpointLayout::total_bytes on `device`
  DeviceBuffer peer_bases;  // [R] uint8_t* on `device`
  DeviceBuffer send;        // NCCL / peer-copy source, on `device`
  DeviceBuffer recv;        // NCCL / peer-copy destination, on `device`
  CudaStream stream;
  cudaEvent_t start = nullptr;
  cudaEvent_t end = nullptr;
  kc::CudaRankContext ctx;
};

/// All ranks, one per GPU; frees each rank's resources with its device current.
class MultiGpuGroup {
 public:
  MultiGpuGroup() = default;
  MultiGpuGroup(const MultiGpuGroup&) = delete;
  MultiGpuGroup& operator=(const MultiGpuGroup&) = delete;
  ~MultiGpuGroup() {
    for (GpuRank& r : ranks_) {
      cudaSetDevice(r.device);
      if (r.start != nullptr) cudaEventDestroy(r.start);
      if (r.end != nullptr) cudaEventDestroy(r.end);
      r = GpuRank();  // frees buffers and the stream on their device
    }
  }

  absl::Status Create(const kernels::GroupShape& shape, const std::vector<int>& devices,
                      size_t nccl_bytes) {
    const int32_t R = static_cast<int32_t>(devices.size());
    const kernels::EndpointLayout layout = kernels::EndpointLayout::Compute(shape);
    ranks_.resize(R);
    for (int32_t r = 0; r < R; ++r) {
      GpuRank& g = ranks_[r];
      g.device = devices[r];
      EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
      for (int32_t p = 0; p < R; ++p) {
        if (p == r) continue;
        int can = 0;
        EPD_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, g.device, devices[p]));
        if (!can) {
          return absl::FailedPreconditionError(
              absl::StrCat("GPU ", g.device, " cannot access GPU ", devices[p], " as a peer"));
        }
        const cudaError_t err = cudaDeviceEnablePeerAccess(devices[p], 0);
        if (err != cudaErrorPeerAccessAlreadyEnabled) {
          EPD_CUDA_RETURN_IF_ERROR(err);
        } else {
          cudaGetLastError();
        }
      }
      EPD_RETURN_IF_ERROR(kc::PreloadKernels());
      EPD_ASSIGN_OR_RETURN(g.area, DeviceBuffer::Allocate(layout.total_bytes));
      EPD_ASSIGN_OR_RETURN(g.peer_bases, DeviceBuffer::Allocate(R * sizeof(uint8_t*)));
      EPD_ASSIGN_OR_RETURN(g.send, DeviceBuffer::Allocate(nccl_bytes));
      EPD_ASSIGN_OR_RETURN(g.recv, DeviceBuffer::Allocate(nccl_bytes));
      EPD_ASSIGN_OR_RETURN(g.stream, CudaStream::Create());
      EPD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&g.start));
      EPD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&g.end));
    }
    std::vector<uint8_t*> bases(R);
    for (int32_t r = 0; r < R; ++r) bases[r] = ranks_[r].area.get();
    for (int32_t r = 0; r < R; ++r) {
      GpuRank& g = ranks_[r];
      EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
      EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(g.peer_bases.get(), bases.data(), R * sizeof(uint8_t*),
                                          cudaMemcpyHostToDevice));
      g.ctx.shape = shape;
      g.ctx.layout = layout;
      g.ctx.rank = r;
      g.ctx.peer_bases = reinterpret_cast<uint8_t* const*>(g.peer_bases.get());
      g.ctx.own_base = g.area.get();
      g.ctx.ranks_on_device = 1;
      g.ctx.timeout_ns = 10'000'000'000;
    }
    return absl::OkStatus();
  }

  GpuRank& rank(int32_t r) { return ranks_[r]; }

  absl::Status SynchronizeAll() {
    for (GpuRank& g : ranks_) {
      EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
      EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(g.stream.get()));
    }
    return absl::OkStatus();
  }

  /// Microseconds per round of `batch` back-to-back rounds of `round()` (which enqueues one
  /// op on every rank's stream): per rank end - start event, the largest, / batch.
  absl::StatusOr<double> TimeRounds(int batch, const std::function<absl::Status()>& round) {
    for (GpuRank& g : ranks_) {
      EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
      EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(g.start, g.stream.get()));
    }
    for (int it = 0; it < batch; ++it) EPD_RETURN_IF_ERROR(round());
    for (GpuRank& g : ranks_) {
      EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
      EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(g.end, g.stream.get()));
    }
    EPD_RETURN_IF_ERROR(SynchronizeAll());
    float longest = 0;
    for (GpuRank& g : ranks_) {
      float ms = 0;
      EPD_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, g.start, g.end));
      longest = std::max(longest, ms);
    }
    return 1000.0 * longest / batch;
  }

 private:
  std::vector<GpuRank> ranks_;
};

struct Row {
  std::string op;
  std::string sms;            // blocks per rank, or "all (N)"
  double bytes_per_rank = 0;  // mean logical bytes over ranks
  double nvlink_bytes_per_rank = 0;
  double op_us = 0;
  double nccl_us = 0;  // 0 = not measured
};

struct Result {
  std::string device;
  int num_sms = 0;
  int32_t ranks = 0;
  double rows_per_rank = 0;
  double peer_copy_us = 0;
  double peer_copy_bytes = 0;  // all ranks
  std::vector<Row> rows;
  std::string nccl_note;
};

absl::Status Run(int32_t R, Result* out) {
  std::vector<int> devices(R);
  for (int32_t r = 0; r < R; ++r) devices[r] = r;
  cudaDeviceProp prop{};
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0));
  out->device = prop.name;
  out->num_sms = prop.multiProcessorCount;
  out->ranks = R;

  const kernels::GroupShape shape = NormalBenchShape(R);
  const int32_t experts_per_rank = kExperts / R;

  // Routing: uniform top-8 of 256 distinct experts per token (DeepEP's benchmark routing).
  // rows[s][d] = tokens of rank s with at least one expert on rank d.
  std::mt19937_64 rng(2024);
  std::vector<std::vector<int64_t>> topk(R);
  std::vector<std::vector<int64_t>> rows(R, std::vector<int64_t>(R, 0));
  for (int32_t s = 0; s < R; ++s) {
    topk[s] = epd::testing::RandomTopk(kTokens, kTopk, kExperts, {}, rng);
    for (int32_t t = 0; t < kTokens; ++t) {
      uint64_t mask = 0;
      for (int32_t k = 0; k < kTopk; ++k) {
        mask |= uint64_t{1} << (topk[s][static_cast<size_t>(t) * kTopk + k] / experts_per_rank);
      }
      for (int32_t d = 0; d < R; ++d) rows[s][d] += (mask >> d) & 1;
    }
  }
  int64_t total_rows = 0, remote_rows = 0, max_out = 0, max_in = 0;
  for (int32_t s = 0; s < R; ++s) {
    int64_t out_rows = 0, in_rows = 0;
    for (int32_t d = 0; d < R; ++d) {
      total_rows += rows[s][d];
      if (d != s) remote_rows += rows[s][d];
      out_rows += rows[s][d];
      in_rows += rows[d][s];
    }
    max_out = std::max(max_out, out_rows);
    max_in = std::max(max_in, in_rows);
  }
  out->rows_per_rank = static_cast<double>(total_rows) / R;
  const double bf16_row = 2.0 * kHidden;
  const double fp8_row = kHidden + 4.0 * shape.num_scales();
  const size_t nccl_bytes = static_cast<size_t>(std::max(max_out, max_in) * bf16_row);

  MultiGpuGroup group;
  EPD_RETURN_IF_ERROR(group.Create(shape, devices, nccl_bytes));
  const kernels::EndpointLayout& l = group.rank(0).ctx.layout;
  for (int32_t r = 0; r < R; ++r) {
    GpuRank& g = group.rank(r);
    EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
    EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(g.area.get() + l.in_topk_idx.offset, topk[r].data(),
                                        topk[r].size() * 8, cudaMemcpyHostToDevice));
    const std::vector<float> w = epd::testing::RandomFloats(topk[r].size(), rng);
    EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(g.area.get() + l.in_topk_weights.offset, w.data(),
                                        w.size() * 4, cudaMemcpyHostToDevice));
    for (const kernels::Region* region : {&l.in_x, &l.in_scales, &l.in_combine_x}) {
      EPD_RETURN_IF_ERROR(FillPatternAsync(g.area.get() + region->offset, region->bytes / 4 * 4,
                                           static_cast<uint32_t>(r * 977 + region->offset),
                                           g.stream.get()));
    }
    EPD_RETURN_IF_ERROR(
        FillPatternAsync(g.send.get(), nccl_bytes / 4 * 4, 17u + r, g.stream.get()));
    EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(g.ctx, kTokens, g.stream.get()));
  }
  EPD_RETURN_IF_ERROR(group.SynchronizeAll());

  // Sanity check of the kernels on this topology: one BF16 dispatch, then every rank's
  // received row count N must equal the rows the routing sends it.
  EPD_RETURN_IF_ERROR(group
                          .TimeRounds(1,
                                      [&]() -> absl::Status {
                                        for (int32_t r = 0; r < R; ++r) {
                                          GpuRank& g = group.rank(r);
                                          EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
                                          EPD_RETURN_IF_ERROR(kc::NormalDispatch(
                                              g.ctx, kc::NormalDispatchArgs{}, g.stream.get()));
                                        }
                                        return absl::OkStatus();
                                      })
                          .status());
  for (int32_t r = 0; r < R; ++r) {
    GpuRank& g = group.rank(r);
    EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
    EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(g.ctx, g.stream.get(), "check dispatch"));
    EPD_ASSIGN_OR_RETURN(kc::NormalDispatchCounts counts,
                         kc::ReadNormalDispatchCounts(g.ctx, g.stream.get()));
    int64_t expected = 0;
    for (int32_t s = 0; s < R; ++s) expected += rows[s][r];
    if (counts.num_recv_tokens != expected) {
      return absl::InternalError(absl::StrCat("rank ", r, " received ", counts.num_recv_tokens,
                                              " rows, the routing sends it ", expected));
    }
  }

  // Peer-copy bound: every rank copies its NVLink bytes (BF16 rows) to the next rank.
  {
    auto round = [&]() -> absl::Status {
      for (int32_t r = 0; r < R; ++r) {
        GpuRank& g = group.rank(r);
        GpuRank& next = group.rank((r + 1) % R);
        int64_t remote = 0;
        for (int32_t d = 0; d < R; ++d) remote += d == r ? 0 : rows[r][d];
        EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
        EPD_CUDA_RETURN_IF_ERROR(
            cudaMemcpyPeerAsync(next.recv.get(), next.device, g.send.get(), g.device,
                                static_cast<size_t>(remote * bf16_row), g.stream.get()));
      }
      return absl::OkStatus();
    };
    EPD_RETURN_IF_ERROR(group.TimeRounds(kWarmup, round).status());
    EPD_ASSIGN_OR_RETURN(out->peer_copy_us, group.TimeRounds(kBatch, round));
    out->peer_copy_bytes = static_cast<double>(remote_rows) * bf16_row;
  }

  // NCCL all-to-all of the same bytes as each op (combine: the transposed matrix).
  std::vector<double> nccl_us(3, 0.0);
#if defined(EPD_HAVE_NCCL)
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // never NVLink multicast on a shared host
  NcclComms comms;
  EPD_RETURN_IF_ERROR(comms.Init(devices));
  for (int op = 0; op < 3; ++op) {
    const double row = op == 0 ? fp8_row : bf16_row;
    const bool transposed = op == 2;
    auto bytes = [&](int32_t s, int32_t d) {
      return static_cast<size_t>((transposed ? rows[d][s] : rows[s][d]) * row);
    };
    auto round = [&]() -> absl::Status {
      EPD_NCCL_RETURN_IF_ERROR(ncclGroupStart());
      for (int32_t r = 0; r < R; ++r) {
        GpuRank& g = group.rank(r);
        size_t send_off = 0, recv_off = 0;
        for (int32_t p = 0; p < R; ++p) {
          EPD_NCCL_RETURN_IF_ERROR(ncclSend(g.send.get() + send_off, bytes(r, p), ncclUint8, p,
                                            comms.get(r), g.stream.get()));
          EPD_NCCL_RETURN_IF_ERROR(ncclRecv(g.recv.get() + recv_off, bytes(p, r), ncclUint8, p,
                                            comms.get(r), g.stream.get()));
          send_off += bytes(r, p);
          recv_off += bytes(p, r);
        }
      }
      return NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
    };
    EPD_RETURN_IF_ERROR(group.TimeRounds(kWarmup, round).status());
    EPD_ASSIGN_OR_RETURN(nccl_us[op], group.TimeRounds(kBatch, round));
  }
  int nccl_version = 0;
  ncclGetVersion(&nccl_version);
  out->nccl_note = absl::StrCat("NCCL ", nccl_version, ", ncclCommInitAll over ", R, " GPUs");
#else
  out->nccl_note = "NCCL not measured: epd_bench was built without libnccl (EPD_HAVE_NCCL)";
#endif

  const double remote_per_rank = static_cast<double>(remote_rows) / R;
  for (int32_t sms : kSmSweep) {
    if (sms > out->num_sms) continue;
    for (int32_t r = 0; r < R; ++r) group.rank(r).ctx.num_sms = sms;
    struct Op {
      const char* name;
      double row_bytes;
      double nccl_us;
      std::function<absl::Status(const kc::CudaRankContext&, cudaStream_t)> launch;
    };
    const Op ops[] = {
        {"dispatch fp8", fp8_row, nccl_us[0],
         [](const kc::CudaRankContext& c, cudaStream_t s) {
           kc::NormalDispatchArgs a;
           a.fp8 = true;
           return kc::NormalDispatch(c, a, s);
         }},
        {"dispatch bf16", bf16_row, nccl_us[1],
         [](const kc::CudaRankContext& c, cudaStream_t s) {
           return kc::NormalDispatch(c, kc::NormalDispatchArgs{}, s);
         }},
        {"combine bf16", bf16_row, nccl_us[2],
         [](const kc::CudaRankContext& c, cudaStream_t s) {
           kc::NormalCombineArgs a;
           a.with_weights = true;
           return kc::NormalCombine(c, a, s);
         }},
    };
    for (const Op& op : ops) {
      auto round = [&]() -> absl::Status {
        for (int32_t r = 0; r < R; ++r) {
          GpuRank& g = group.rank(r);
          EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
          EPD_RETURN_IF_ERROR(op.launch(g.ctx, g.stream.get()));
        }
        return absl::OkStatus();
      };
      EPD_RETURN_IF_ERROR(group.TimeRounds(kWarmup, round).status());
      EPD_ASSIGN_OR_RETURN(const double us, group.TimeRounds(kBatch, round));
      for (int32_t r = 0; r < R; ++r) {
        GpuRank& g = group.rank(r);
        EPD_CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
        EPD_RETURN_IF_ERROR(kc::ReadAndClearStatus(g.ctx, g.stream.get(), op.name));
      }
      out->rows.push_back(
          {op.name, sms == 0 ? absl::StrCat("all(", out->num_sms, ")") : absl::StrCat(sms),
           out->rows_per_rank * op.row_bytes, remote_per_rank * op.row_bytes, us, op.nccl_us});
    }
  }
  return absl::OkStatus();
}

}  // namespace

int RunMultiGpuBench() {
  const bool json = absl::GetFlag(FLAGS_json);
  int visible = 0;
  if (cudaGetDeviceCount(&visible) != cudaSuccess) {
    cudaGetLastError();
    visible = 0;
  }
  const int asked = absl::GetFlag(FLAGS_gpus);
  if (asked < 0 || asked > visible) {
    std::fprintf(stderr, "epd_bench multigpu: --gpus=%d, but %d GPU(s) are visible\n", asked,
                 visible);
    return 2;
  }
  const int32_t R = asked == 0 ? visible : asked;
  if (R < 2) {
    if (json) {
      std::printf("{\"bench\":\"multigpu\",\"skipped\":true,\"gpus\":%d,\"visible\":%d}\n", R,
                  visible);
    }
    std::fprintf(json ? stderr : stdout,
                 "multi-GPU normal mode: SKIPPED, %d GPU to use (%d visible; one rank per GPU "
                 "needs >= 2): the multi-GPU figures were NOT measured\n",
                 R, visible);
    return 0;
  }
  Result res;
  const absl::Status st = Run(R, &res);
  if (!json) {
    std::printf("Normal-mode kernels, one rank per GPU: %d x %s (%d SMs each), one process\n",
                res.ranks, res.device.c_str(), res.num_sms);
    std::printf(
        "shape: T=%d H=%d K=%d E=%d R=%d; uniform top-%d routing (%.2f of the %d ranks per "
        "token); %d rounds after %d warm-up\n",
        kTokens, kHidden, kTopk, kExperts, res.ranks, kTopk, res.rows_per_rank / kTokens, res.ranks,
        kBatch, kWarmup);
    if (res.peer_copy_us > 0) {
      std::printf(
          "peer copy bound: every rank cudaMemcpyPeerAsync's its NVLink bytes (%.1f MB) to the "
          "next rank: %.1f us, %.1f GB/s per rank, %.1f GB/s aggregate\n",
          res.peer_copy_bytes / res.ranks / 1e6, res.peer_copy_us,
          res.peer_copy_bytes / res.ranks / res.peer_copy_us / 1e3,
          res.peer_copy_bytes / res.peer_copy_us / 1e3);
    }
    std::printf("%s\n", res.nccl_note.c_str());
    std::printf("%-14s %8s %9s %9s %10s %10s %11s %10s %10s %9s\n", "op", "sms", "MB/rank", "us/op",
                "rank GB/s", "agg GB/s", "NVLink GB/s", "NCCL us", "NCCL agg", "agg/NCCL");
  }
  for (const Row& r : res.rows) {
    const double rank_gbs = r.bytes_per_rank / r.op_us / 1e3;
    const double agg_gbs = rank_gbs * res.ranks;
    const double nvlink_gbs = r.nvlink_bytes_per_rank / r.op_us / 1e3;
    const double nccl_agg = r.nccl_us > 0 ? r.bytes_per_rank * res.ranks / r.nccl_us / 1e3 : 0;
    if (json) {
      std::printf(
          "{\"bench\":\"multigpu\",\"op\":\"%s\",\"device\":\"%s\",\"gpus\":%d,"
          "\"sms_per_rank\":\"%s\",\"bytes_per_rank\":%.0f,\"nvlink_bytes_per_rank\":%.0f,"
          "\"op_us\":%.2f,\"rank_gbps\":%.1f,\"aggregate_gbps\":%.1f,\"nvlink_rank_gbps\":%.1f,"
          "\"nccl_us\":%.2f,\"nccl_aggregate_gbps\":%.1f,\"peer_copy_us\":%.2f,"
          "\"peer_copy_bytes\":%.0f}\n",
          r.op.c_str(), res.device.c_str(), res.ranks, r.sms.c_str(), r.bytes_per_rank,
          r.nvlink_bytes_per_rank, r.op_us, rank_gbs, agg_gbs, nvlink_gbs, r.nccl_us, nccl_agg,
          res.peer_copy_us, res.peer_copy_bytes);
    } else if (r.nccl_us > 0) {
      std::printf("%-14s %8s %9.1f %9.1f %10.1f %10.1f %11.1f %10.1f %10.1f %8.0f%%\n",
                  r.op.c_str(), r.sms.c_str(), r.bytes_per_rank / 1e6, r.op_us, rank_gbs, agg_gbs,
                  nvlink_gbs, r.nccl_us, nccl_agg, 100.0 * agg_gbs / nccl_agg);
    } else {
      std::printf("%-14s %8s %9.1f %9.1f %10.1f %10.1f %11.1f %10s %10s %9s\n", r.op.c_str(),
                  r.sms.c_str(), r.bytes_per_rank / 1e6, r.op_us, rank_gbs, agg_gbs, nvlink_gbs,
                  "-", "-", "-");
    }
  }
  if (!json) {
    std::printf(
        "NVLink GB/s: rows to other ranks only, per rank. NCCL: ncclSend/ncclRecv of the same "
        "bytes to/from every rank (itself included) in one group call, same streams.\n");
  }
  if (!st.ok()) {
    std::fprintf(stderr, "epd_bench multigpu failed: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace epd::bench
