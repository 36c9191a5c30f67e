// One rank's device resources on the CUDA backend (see cuda_rank.h), and this process's
// registry of exported areas (FindInProcessCudaArea, cuda_data_plane.h).
#include "daemon/dataplane/cuda/cuda_rank.h"

#include <map>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/dataplane/cuda/cuda_data_plane.h"

namespace epd {
namespace {

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, void*>& Registry() {
  static auto* m = new std::map<std::string, void*>();
  return *m;
}

}  // namespace

CudaRank::~CudaRank() {
  if (!ipc_handle.empty()) {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    Registry().erase(ipc_handle);
  }
  if (stream != nullptr) {
    cudaSetDevice(device);
    cudaStreamSynchronize(stream.get());  // Bounded: every kernel wait is bounded.
  }
  // No kernel writes the totals any more: the tally keeps them before the copy is freed.
  if (expert_tally && expert_mirror) expert_tally->Retire(rank, expert_mirror.get());
  area.reset();
  cudaGetLastError();
}

absl::StatusOr<std::shared_ptr<CudaRank>> CreateCudaRank(int device, int32_t rank,
                                                         const kernels::EndpointLayout& layout,
                                                         bool client_launched,
                                                         DeferredRelease* release) {
  std::shared_ptr<CudaRank> r;
  if (release == nullptr) {
    r = std::make_shared<CudaRank>();
  } else {
    // The last reference's drop hands the rank to `release` (whose own reference then
    // destroys it, between engine rounds) instead of destroying it there.
    auto owned = std::make_unique<CudaRank>();
    r = std::shared_ptr<CudaRank>(owned.release(), [release](CudaRank* p) {
      release->Add(std::shared_ptr<CudaRank>(std::unique_ptr<CudaRank>(p)));
    });
  }
  r->device = device;
  r->rank = rank;
  r->bytes = layout.total_bytes;
  r->launch_flags_offset = layout.launch_flags.offset;
  r->client_launched = client_launched;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(device)));
  EPD_ASSIGN_OR_RETURN(r->stream, CreateStream());
  const cudaStream_t stream = r->stream.get();
  // done and op_begin keep timestamps: the op's GPU time is op_begin → done (OpGpuTimer).
  EPD_ASSIGN_OR_RETURN(r->done, CreateEvent(cudaEventDefault));
  EPD_ASSIGN_OR_RETURN(r->waited, CreateEvent());
  EPD_ASSIGN_OR_RETURN(r->op_begin, CreateEvent(cudaEventDefault));
  // Mapped: kernels write the status, N and ready_seen straight into it.
  EPD_ASSIGN_OR_RETURN(
      r->readback, AllocatePinnedArray<Readback>(1, cudaHostAllocPortable | cudaHostAllocMapped));
  EPD_ASSIGN_OR_RETURN(r->area, AllocateDevice(r->bytes, DeviceZero::kNo));
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaMemsetAsync(r->area.get(), 0, r->bytes, stream)));
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamSynchronize(stream)));
  cudaIpcMemHandle_t handle;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaIpcGetMemHandle(&handle, r->area.get())));
  r->ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    Registry()[r->ipc_handle] = r->area.get();
  }
  return r;
}

absl::Status AddCudaRankExpertStats(CudaRank& rank, int32_t experts_per_rank,
                                    std::shared_ptr<metrics::ExpertTokenTally> tally) {
  if (experts_per_rank <= 0 || !tally) return absl::OkStatus();
  const size_t bytes = 2 * sizeof(uint64_t) * static_cast<size_t>(experts_per_rank);
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(rank.device)));
  EPD_ASSIGN_OR_RETURN(rank.expert_totals, AllocateDevice(bytes, DeviceZero::kYes));
  rank.experts_per_rank = experts_per_rank;
  EPD_ASSIGN_OR_RETURN(
      rank.expert_mirror,
      AllocatePinnedArray<uint64_t>(experts_per_rank, cudaHostAllocPortable | cudaHostAllocMapped));
  tally->Attach(rank.rank, rank.expert_mirror.get());
  rank.expert_tally = std::move(tally);
  return absl::OkStatus();
}

absl::Status AddCudaRankMirror(CudaRank& rank, const kernels::GroupShape& shape,
                               const kernels::EndpointLayout& layout) {
  namespace kc = kernels::cuda;
  constexpr unsigned kMapped = cudaHostAllocPortable | cudaHostAllocMapped;
  std::unique_ptr<CudaRankMirror> m;
  try {
    m = std::make_unique<CudaRankMirror>(shape);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("rank ", rank.rank, ": out of host memory for its routing state"));
  }
  if (rank.client_launched) {  // The client's kernels copy, into its endpoint region.
    rank.mirror = std::move(m);
    return absl::OkStatus();
  }
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(rank.device)));
  auto pinned = [&](auto& array, size_t count, const char* what) -> absl::Status {
    using T = typename std::remove_reference_t<decltype(array)>::element_type;
    absl::StatusOr<PinnedArray<T>> a = AllocatePinnedArray<T>(count, kMapped);
    if (!a.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat("rank ", rank.rank, ": allocating ",
                                                       count * sizeof(T), " bytes of pinned ", what,
                                                       ": ", a.status().message()));
    }
    array = *std::move(a);
    return absl::OkStatus();
  };
  EPD_RETURN_IF_ERROR(
      pinned(m->data, CudaRankMirror::MirrorBytes(layout), "host mirror of its data area"));
  EPD_RETURN_IF_ERROR(pinned(m->in_spans, kernels::kMaxAreaSpans, "copy spans"));
  EPD_RETURN_IF_ERROR(pinned(m->out_spans, kernels::kMaxAreaSpans, "copy spans"));
  EPD_RETURN_IF_ERROR(pinned(m->staged, 1, "staging flag"));
  EPD_RETURN_IF_ERROR(pinned(m->row_sources, static_cast<size_t>(kernels::RowSourceRows(shape)),
                             "row source table"));
  EPD_RETURN_IF_ERROR(pinned(m->windows, kc::kMaxGatherWindows, "gather windows"));
  EPD_ASSIGN_OR_RETURN(m->packed, CreateEvent());
  EPD_ASSIGN_OR_RETURN(m->gathered, CreateEvent());
  EPD_RETURN_IF_ERROR(
      pinned(m->reduce_terms, CudaRankMirror::ReduceTermsCount(shape), "reduce term table"));
  EPD_ASSIGN_OR_RETURN(m->counter, AllocateDevice(256, DeviceZero::kYes));
  if (const uint64_t q = CudaRankMirror::QuantRowsBytes(shape); q > 0) {
    EPD_ASSIGN_OR_RETURN(m->quant_rows, AllocateDevice(q, DeviceZero::kNo));
  }
  m->base = m->data.get();
  rank.mirror = std::move(m);
  return absl::OkStatus();
}

absl::StatusOr<void*> FindInProcessCudaArea(const std::string& cuda_ipc_handle) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(cuda_ipc_handle);
  if (it == Registry().end()) {
    return errors::WithReason(
        absl::NotFoundError("no endpoint of this process exported that CUDA IPC handle"),
        errors::Reason::kCudaIpcFailed);
  }
  return it->second;
}

}  // namespace epd
