// Host side of cuda_ops.h shared by every CUDA op: context checks,
// grid sizing, the DeviceStatus read-back, low-latency sync reset, the run-time token-count
// slot and eager kernel loading.
#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cuda/cuda_check.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ll_internal.h"

namespace epd::kernels::cuda {
namespace {

__global__ void SetInt32Kernel(int32_t* dst, int32_t value) { *dst = value; }

constexpr int kStatusWords = static_cast<int>(sizeof(DeviceStatus) / sizeof(uint32_t));

/// host[i] = status[i]; status[i] = 0 for the 64 words of a DeviceStatus (EnqueueStatusReadback).
__global__ void StatusReadbackKernel(uint32_t* status, uint32_t* host) {
  for (int i = static_cast<int>(threadIdx.x); i < kStatusWords; i += blockDim.x) {
    host[i] = status[i];
    status[i] = 0;
  }
}

std::mutex& HookMutex() {
  static std::mutex mu;
  return mu;
}
std::vector<absl::Status (*)()>& Hooks() {
  static std::vector<absl::Status (*)()> hooks;
  return hooks;
}

}  // namespace

absl::Status ValidateContext(const CudaRankContext& ctx) {
  const GroupShape& s = ctx.shape;
  if (s.num_ranks < 1 || s.num_ranks > kMaxStatusRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaRankContext: shape.num_ranks = ", s.num_ranks, " is outside [1, ",
                     kMaxStatusRanks, "]"));
  }
  if (s.num_experts < s.num_ranks || s.num_experts % s.num_ranks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaRankContext: shape.num_experts = ", s.num_experts,
                     " must be a positive multiple of num_ranks = ", s.num_ranks));
  }
  if (s.hidden < 1 || s.num_topk < 1) {
    return absl::InvalidArgumentError(absl::StrCat("CudaRankContext: hidden = ", s.hidden,
                                                   ", num_topk = ", s.num_topk, " must be >= 1"));
  }
  if (ctx.rank < 0 || ctx.rank >= s.num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaRankContext: rank = ", ctx.rank, " is outside [0, ", s.num_ranks, ")"));
  }
  if (ctx.peer_bases == nullptr || ctx.own_base == nullptr) {
    return absl::InvalidArgumentError("CudaRankContext: peer_bases and own_base must be set");
  }
  if (ctx.timeout_ns <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CudaRankContext: timeout_ns = ", ctx.timeout_ns, " must be > 0"));
  }
  if (ctx.num_sms < 0 || ctx.ranks_on_device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CudaRankContext: num_sms = ", ctx.num_sms,
                                                   ", ranks_on_device = ", ctx.ranks_on_device,
                                                   " must be >= 0"));
  }
  if (ctx.layout.sync.bytes < kSyncRegionBytes) {
    return absl::InvalidArgumentError(absl::StrCat("CudaRankContext: layout.sync has ",
                                                   ctx.layout.sync.bytes, " bytes, needs ",
                                                   kSyncRegionBytes));
  }
  return absl::OkStatus();
}

absl::Status ResolveNumBlocks(const CudaRankContext& ctx, int32_t* num_blocks) {
  if (ctx.num_sms > 0 && ctx.sms_left_per_rank <= 0) {
    *num_blocks = ctx.num_sms;
    return absl::OkStatus();
  }
  int device = 0;
  int sms = 0;
  EPD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  EPD_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int32_t ranks = ctx.ranks_on_device > 0 ? ctx.ranks_on_device : ctx.shape.num_ranks;
  const int32_t usable = sms - ranks * std::max(ctx.sms_left_per_rank, 0);
  const int32_t fit = usable / ranks > 0 ? usable / ranks : 1;
  // An explicit grid is capped, so the SMs left per rank stay free.
  *num_blocks = ctx.num_sms > 0 ? std::min(ctx.num_sms, fit) : fit;
  return absl::OkStatus();
}

absl::Status StatusFromDevice(const DeviceStatus& status, const GroupShape& shape, int32_t rank,
                              const char* op, bool low_latency) {
  std::vector<std::string> findings;
  if (status.bad_expert_ids != 0) {
    findings.push_back(absl::StrCat(
        status.bad_expert_ids, " topk_idx value(s) outside [-1, num_experts = ", shape.num_experts,
        ") were ignored"));
  }
  if (status.bad_routing != 0) {
    findings.push_back(absl::StrCat(
        status.bad_routing,
        " routing value(s) in the endpoint's memory (send_pos rows, low-latency handle "
        "positions, exchanged counts) were outside their buffers and were ignored: the "
        "endpoint's memory was overwritten, or the handle is from a dispatch that failed"));
  }
  if (status.has_bad_num_tokens != 0) {
    findings.push_back(
        absl::StrCat("num_tokens = ", status.bad_num_tokens, " is outside [0, ",
                     low_latency ? "ll_max_tokens_per_rank = " : "max_tokens_per_rank = ",
                     low_latency ? shape.ll_max_tokens_per_rank : shape.max_tokens_per_rank,
                     "] (nothing was sent)"));
  }
  if (status.timed_out != 0) {
    std::vector<int32_t> missing;
    for (int32_t r = 0; r < kMaxStatusRanks; ++r) {
      if (status.missing_ranks[r / 32] & (1u << (r % 32))) missing.push_back(r);
    }
    std::string msg =
        absl::StrCat(op, ": rank ", rank, ": peer rank(s) [", absl::StrJoin(missing, ", "),
                     "] did not arrive before the op timeout");
    if (!findings.empty()) absl::StrAppend(&msg, "; also: ", absl::StrJoin(findings, "; "));
    return errors::WithReason(absl::DeadlineExceededError(msg), errors::Reason::kGpuTimeout);
  }
  if (!findings.empty()) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  op, ": rank ", rank, ": ", absl::StrJoin(findings, "; "))),
                              errors::Reason::kOpInputInvalid);
  }
  return absl::OkStatus();
}

absl::Status EnqueueStatusReadback(const CudaRankContext& ctx, cudaStream_t stream,
                                   DeviceStatus* host_dst) {
  if (host_dst == nullptr || ctx.own_base == nullptr) {
    return absl::InvalidArgumentError("EnqueueStatusReadback: null host or area pointer");
  }
  uint8_t* dev = ctx.own_base + ctx.layout.sync.offset + kSyncStatusOffset;
  StatusReadbackKernel<<<1, kStatusWords, 0, stream>>>(reinterpret_cast<uint32_t*>(dev),
                                                       reinterpret_cast<uint32_t*>(host_dst));
  return EPD_CUDA_STATUS(cudaGetLastError());
}

absl::Status CopyDeviceAsync(void* dst, const void* src, uint64_t bytes, cudaStream_t stream) {
  // One kernel of the batch copy (handoff.cu), without a signal.
  const DeviceCopy copy{dst, src, bytes};
  return CopyDeviceBatchAsync(&copy, 1, nullptr, 0, nullptr, stream);
}

absl::Status ReadAndClearStatus(const CudaRankContext& ctx, cudaStream_t stream, const char* op) {
  // Pageable destination: copies (this is the synchronous slow path).
  DeviceStatus status{};
  uint8_t* dev = ctx.own_base + ctx.layout.sync.offset + kSyncStatusOffset;
  EPD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&status, dev, sizeof(DeviceStatus), cudaMemcpyDeviceToHost, stream));
  EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dev, 0, sizeof(DeviceStatus), stream));
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  // This entry point gets only the op's name: a low-latency op is one named
  // "LowLatency..." (what every caller passes for those ops); the name picks the bound
  // named in a bad-T message.
  const bool low_latency = op != nullptr && std::strncmp(op, "LowLatency", 10) == 0;
  return StatusFromDevice(status, ctx.shape, ctx.rank, op, low_latency);
}

absl::Status ResetLowLatencySync(const CudaRankContext& ctx, cudaStream_t stream) {
  uint8_t* sync = ctx.own_base + ctx.layout.sync.offset;
  // Keep the token-count slot (an input the host may have written already) and each
  // buffer's dispatch T (dispatch_num_tokens, after it): a combine enqueued after a reset
  // (a rank joined between a dispatch and its combine) still reads its dispatch's T.
  static_assert(offsetof(device::LowLatencyState, dispatch_num_tokens) ==
                    offsetof(device::LowLatencyState, num_tokens) + sizeof(int32_t),
                "the kept words must be contiguous");
  const uint64_t begin = kSyncLowLatencyStateOffset;
  const uint64_t slot = offsetof(device::LowLatencyState, num_tokens);
  EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(sync + begin, 0, slot, stream));
  const uint64_t after_slot = begin + sizeof(device::LowLatencyState);
  EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      sync + after_slot, 0,
      kSyncLowLatencyExchangeOffset + kSyncLowLatencyExchangeBytes - after_slot, stream));
  return absl::OkStatus();
}

int32_t* LowLatencyNumTokensSlot(const CudaRankContext& ctx) {
  return reinterpret_cast<int32_t*>(ctx.own_base + ctx.layout.sync.offset +
                                    kSyncLowLatencyStateOffset +
                                    offsetof(device::LowLatencyState, num_tokens));
}

absl::Status SetLowLatencyNumTokensAsync(const CudaRankContext& ctx, int32_t num_tokens,
                                         cudaStream_t stream) {
  SetInt32Kernel<<<1, 1, 0, stream>>>(LowLatencyNumTokensSlot(ctx), num_tokens);
  return EPD_CUDA_STATUS(cudaGetLastError());
}

bool RegisterPreloadHook(absl::Status (*hook)()) {
  std::lock_guard<std::mutex> lock(HookMutex());
  Hooks().push_back(hook);
  return true;
}

absl::Status PreloadKernels() {
  cudaFuncAttributes attr;
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, SetInt32Kernel));
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, StatusReadbackKernel));
  EPD_RETURN_IF_ERROR(internal::PreloadLowLatencyKernels());
  std::vector<absl::Status (*)()> hooks;
  {
    std::lock_guard<std::mutex> lock(HookMutex());
    hooks = Hooks();
  }
  for (auto* hook : hooks) EPD_RETURN_IF_ERROR(hook());
  return absl::OkStatus();
}

}  // namespace epd::kernels::cuda
