// Rank masking on the CUDA backend (see cuda_group.h): a masked rank's part of each op is
// played on its own area with T = 0, or, once it detached, on the area it left (its
// stand-in); the rank mask the kernels read; the peer arrays re-pointed when a process
// rejoins a masked slot, and the stand-ins it replaced freed off the engine thread.
#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/device_alloc.h"
#include "common/status_macros.h"
#include "daemon/dataplane/cuda/cuda_group.h"

namespace epd {

void CudaGroup::KeepAsStandIn(int32_t rank) {
  // Part of the op on the GPU, its client gone before its stream staged the inputs: its
  // kernels would wait for ready_seq, and the others' for them, until the engine gives up
  // (op_timeout + 5 s). Released now; the op then fails for every rank (PollOpInto), as
  // it ran on inputs the client never finished staging.
  if (gpu_op_ && gpu_op_->ranks[rank] && gpu_op_->ranks[rank] == ranks_[rank] &&
      ReleaseReadyWait(*gpu_op_, static_cast<size_t>(rank))) {
    gpu_op_->left_unstaged[rank] = true;
  }
  cudaGetLastError();
  // The rank is masked (now, or when the running op ends): its area stays in every peer
  // array as its stand-in, in step with the others' sync state, until a process rejoins.
  // A stand-in it replaces (a rejoin that left before any op re-pointed the peer arrays)
  // goes to DeferredRelease with its last reference, not freed here under the lock.
  standins_[rank].reset();
  spare_masked_areas_[rank].reset();
  if (masked_areas_[rank]) {
    // Masked while attached: its part already runs on its scratch area, which every peer
    // array names; that stays its stand-in, and the area it left goes.
    standins_[rank] = std::move(masked_areas_[rank]);
    ranks_[rank].reset();
  } else {
    standins_[rank] = std::move(ranks_[rank]);
  }
  ++ranks_generation_;  // OpRank(rank) is now the stand-in: the op graphs are stale.
}

void CudaGroup::RankMaskChanged(int32_t rank, bool masked) {
  mask_dirty_ = true;
  if (masked && program_) {
    DisarmProgram(absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " of group ", spec().name(),
        " was masked: its graph-mode program was disarmed; register it again once every rank "
        "takes part")));
  }
  if (masked && ranks_[rank] && !masked_areas_[rank] && RankIsAttached(rank)) {
    UseMaskedArea(rank);
  } else if (!masked && masked_areas_[rank] && ranks_[rank]) {
    // Back on its own area, whose sync state is behind the others' (zeroed before the next
    // op). The scratch area is kept for the rank's next mask; the peer arrays name the
    // rank's own area again before any kernel runs (UploadPeerBases).
    spare_masked_areas_[rank] = std::move(masked_areas_[rank]);
    host_bases_[rank] = ranks_[rank]->area.get();
    bases_dirty_ = true;
    needs_sync_reset_ = true;
    ++ranks_generation_;
    UpdateDevices();
  }
}

void CudaGroup::UseMaskedArea(int32_t rank) {
  const CudaRank& own = *ranks_[rank];
  absl::StatusOr<std::shared_ptr<CudaRank>> scratch =
      spare_masked_areas_[rank]
          ? std::move(spare_masked_areas_[rank])
          : CreateCudaRank(own.device, rank, layout(), /*client_launched=*/false,
                           &plane_->deferred_release());
  if (!scratch.ok()) {
    EngineLog()->warn(
        "group {}: rank {} is masked, but no area for its masked part could be allocated ({}); "
        "the ops that run without it use its own area, so its client must read its last op's "
        "results before the group's next op",
        spec().name(), rank, scratch.status().ToString());
    return;
  }
  masked_areas_[rank] = *std::move(scratch);
  host_bases_[rank] = masked_areas_[rank]->area.get();
  bases_dirty_ = true;
  needs_sync_reset_ = true;  // The scratch area's sync state is not the others'.
  ++ranks_generation_;
  UpdateDevices();
}

absl::Status CudaGroup::UploadPeerBases() {
  if (!bases_dirty_) return absl::OkStatus();
  EPD_RETURN_IF_ERROR(CopyPeerBases(host_bases_, nullptr));
  // Every peer array now names the rejoined ranks' areas: their stand-ins go, unfreed here
  // (DeferredRelease): the clients' streams may already wait for this op's done_seq.
  for (size_t r = 0; r < ranks_.size(); ++r) {
    if (ranks_[r] && standins_[r]) standins_[r].reset();
  }
  ++ranks_generation_;
  bases_dirty_ = false;
  return absl::OkStatus();
}

absl::Status CudaGroup::UploadMask() {
  if (!mask_dirty_) return absl::OkStatus();
  const std::vector<uint8_t>& mask = rank_masked();
  any_masked_ = std::any_of(mask.begin(), mask.end(), [](uint8_t m) { return m != 0; });
  for (int d : devices_) {
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(d)));
    auto it = mask_arrays_.find(d);
    if (it == mask_arrays_.end()) {
      if (!any_masked_) continue;  // Nothing to tell this GPU's kernels (they get null).
      EPD_ASSIGN_OR_RETURN(DeviceMemory m, AllocateDevice(mask.size(), DeviceZero::kNo));
      it = mask_arrays_.emplace(d, std::move(m)).first;
    }
    // Waited for: every kernel of the group is off the GPU (claimed, idle), and the next
    // op's kernels, on any of the ranks' streams, must see the new mask. On the engine's
    // aux stream, which no rank's waits hold.
    cudaStream_t aux = plane_->EngineOf(d)->aux.get();
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(
        cudaMemcpyAsync(it->second.get(), mask.data(), mask.size(), cudaMemcpyHostToDevice, aux)));
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamSynchronize(aux)));
  }
  mask_dirty_ = false;
  return absl::OkStatus();
}

}  // namespace epd
