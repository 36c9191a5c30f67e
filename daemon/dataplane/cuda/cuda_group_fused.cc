// Fused launches on the CUDA backend (see cuda_group.h "fused launches"): a daemon-launched
// low-latency op is, per GPU of the group, one wait kernel for every rank's ready flag and
// one kernel holding every rank's blocks, instead of each rank's launches
// (docs/CUDA_BACKEND.md "Fused launches").
#include <array>
#include <atomic>
#include <span>
#include <vector>

#include "common/cuda/cuda_check.h"
#include "daemon/dataplane/cuda/cuda_data_plane.h"
#include "daemon/dataplane/cuda/cuda_group.h"

namespace epd {

namespace kc = kernels::cuda;

namespace {
std::atomic<uint64_t> fused_launches{0};
}  // namespace

uint64_t CudaFusedLaunchesForTesting() { return fused_launches.load(std::memory_order_relaxed); }

bool CudaGroup::FusedLaunchCovers(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots) {
  if (!plane_->options().fused_launch || fused_refused_generation_ == ranks_generation_ ||
      !EveryRankHandsOffInAKernel(plan, slots)) {
    return false;
  }
  if (fused_devices_.empty() || fused_generation_ != ranks_generation_) {
    // The group's ranks changed (or the first op): regrouped by GPU, once.
    fused_devices_.clear();
    fused_fits_ = true;
    for (size_t i = 0; i < slots.size(); ++i) {
      const int32_t r = static_cast<int32_t>(i);
      const int device = OpRank(r)->device;
      FusedDevice* at = nullptr;
      for (FusedDevice& fd : fused_devices_) {
        if (fd.device == device) at = &fd;
      }
      if (at == nullptr) {
        fused_devices_.push_back(FusedDevice{device, {}});
        at = &fused_devices_.back();
      }
      at->ranks.push_back(r);
      if (at->ranks.size() > static_cast<size_t>(kc::kMaxFusedRanks)) fused_fits_ = false;
    }
    fused_generation_ = ranks_generation_;
  }
  return fused_fits_;
}

void CudaGroup::LaunchFused(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
                            GpuOp& op) {
  // Per GPU, on the stack: no allocation per op.
  std::array<kc::FlagWait, kc::kMaxFusedRanks> waits;
  std::array<kc::CudaRankContext, kc::kMaxFusedRanks> ctxs;
  std::array<kc::LowLatencyDispatchArgs, kc::kMaxFusedRanks> dispatch_args;
  std::array<kc::LowLatencyCombineArgs, kc::kMaxFusedRanks> combine_args;
  const bool dispatch = plan.op == abi::OpKind::kLowLatencyDispatch;
  for (const FusedDevice& fd : fused_devices_) {
    for (int32_t r : fd.ranks) op.lead[r] = fd.ranks.front();
  }
  for (const FusedDevice& fd : fused_devices_) {
    const size_t n = fd.ranks.size();
    const CudaRank& lead = *OpRank(fd.ranks.front());
    cudaStream_t s = lead.stream.get();
    for (size_t i = 0; i < n; ++i) {
      const int32_t r = fd.ranks[i];
      const CudaRank& cr = *OpRank(r);
      // The wait passes once the rank's staging kernel has started (staging_seq) or, from
      // a client that does not write staging_seq, once it is done (ready_seq); the fused
      // kernel's blocks of that rank then wait for ready_seq themselves (LaunchRank).
      waits[i] = kc::FlagWait{reinterpret_cast<const uint64_t*>(cr.staging_flag()),
                              reinterpret_cast<const uint64_t*>(cr.ready_flag()), slots[r].seq,
                              &cr.readback->ready_seen};
      ctxs[i] = Context(r, plane_->options().num_sms);
      ctxs[i].sms_left_per_rank = 1;  // For the clients' staging kernels (LaunchRank).
      kc::KernelHandoff handoff = HandoffFor(slots[r], r, nullptr);
      handoff.programmatic = true;
      if (dispatch) {
        dispatch_args[i] = DispatchArgsFor(plan, slots[r], r, handoff, /*captured=*/false);
      } else {
        combine_args[i] = CombineArgsFor(plan, r, handoff);
      }
    }
    absl::Status st = EPD_CUDA_STATUS(cudaSetDevice(fd.device));
    if (st.ok()) {
      // The op's GPU time starts before the wait, as on the per-rank path; every rank of
      // this GPU shares the begin and done events of the launch stream.
      gpu_timer_.Begin(fd.ranks.front(), lead.op_begin.get(), s);
      st = kc::WaitFlagsAsync(std::span<const kc::FlagWait>(waits.data(), n), ReadyWaitBoundNs(), s,
                              plane_->shutdown_word());
    }
    bool refused = false;  // By the launcher's checks: nothing of the kernel enqueued.
    if (st.ok()) {
      st = dispatch ? kc::LowLatencyDispatchRanks(
                          std::span<const kc::CudaRankContext>(ctxs.data(), n),
                          std::span<const kc::LowLatencyDispatchArgs>(dispatch_args.data(), n), s)
                    : kc::LowLatencyCombineRanks(
                          std::span<const kc::CudaRankContext>(ctxs.data(), n),
                          std::span<const kc::LowLatencyCombineArgs>(combine_args.data(), n), s);
      refused = absl::IsInvalidArgument(st);
    }
    if (st.ok()) st = EPD_CUDA_STATUS(cudaEventRecord(lead.done.get(), s));
    // Completion waits for the launch stream (the other ranks' done events are not
    // recorded), also after a failure: a wait kernel enqueued before it still runs.
    op.graph_streams.push_back(s);  // Within its capacity R (SizeOp).
    if (st.ok()) {
      fused_launches.fetch_add(1, std::memory_order_relaxed);
      for (int32_t r : fd.ranks) {
        if (r != fd.ranks.front()) gpu_timer_.SetBegin(r, lead.op_begin.get());
        gpu_timer_.SetEnd(r, lead.done.get());
      }
      continue;
    }
    EngineLog()->error("group {}: the fused launch of op {} on GPU {} failed: {}{}", spec().name(),
                       plan.seq, fd.device, st.ToString(),
                       refused ? "; the group's ops take the per-rank launches until its ranks "
                                 "change"
                               : "");
    if (refused) fused_refused_generation_ = ranks_generation_;
    ReleaseRanksAfterFailedLaunch(fd.device, plan, op, st);
  }
}

void CudaGroup::OrderAfterFusedOp(int32_t r) const {
  const CudaRank* cr = ranks_[r].get();
  if (cr == nullptr) return;
  for (const std::optional<GpuOp>* held : {&gpu_op_, &abandoned_}) {
    if (!*held || static_cast<size_t>(r) >= (*held)->lead.size()) continue;
    const GpuOp& op = **held;
    const int32_t lead = op.lead[r];
    if (lead < 0 || lead == r || !op.ranks[lead]) continue;
    cudaSetDevice(cr->device);
    const cudaError_t err = cudaStreamWaitEvent(cr->stream.get(), op.ranks[lead]->done.get(), 0);
    if (err != cudaSuccess) {
      cudaGetLastError();
      EngineLog()->error("group {} rank {}: ordering its stream after the fused op {}: {}",
                         spec().name(), r, op.seq, cudaGetErrorString(err));
    }
  }
}

}  // namespace epd
