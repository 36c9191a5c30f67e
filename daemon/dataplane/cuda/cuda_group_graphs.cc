// Per-GPU op graphs on the CUDA backend (see cuda_group.h "per-GPU op graphs"): a
// daemon-launched op that a graph covers is one cudaGraphLaunch per GPU of the group
// instead of every rank's launches (docs/CUDA_BACKEND.md "Op graphs"). Each variant of an
// op is captured once, at its first op, from the per-rank path itself (LaunchRank with
// `captured`), its per-op words read by the kernels from the ranks' Readback words.
#include <atomic>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/device_alloc.h"
#include "common/status_macros.h"
#include "daemon/dataplane/cuda/cuda_data_plane.h"
#include "daemon/dataplane/cuda/cuda_group.h"
#include "epd/kernels/op_rules.h"

namespace epd {

namespace kc = kernels::cuda;

namespace {
std::atomic<uint64_t> op_graph_launches{0};
}  // namespace

uint64_t CudaOpGraphLaunchesForTesting() {
  return op_graph_launches.load(std::memory_order_relaxed);
}

bool CudaGroup::EveryRankHandsOffInAKernel(const OpPlan& plan,
                                           const std::vector<abi::RequestSlot>& slots) const {
  // The kernel hand-off (a wait kernel + the kernel that writes done_seq itself): low-latency
  // ops under kernel_ready_wait. A masked rank's part differs (no hand-off, T = 0) and the
  // mask array is in its kernels' context: not covered. Work a failed op left on a rank's
  // stream (streams_touched_) is ordered only by that stream.
  if (spanning() || !plane_->kernel_ready_wait() || program_ || streams_touched_ || any_masked_) {
    return false;
  }
  if (plan.op != abi::OpKind::kLowLatencyDispatch && plan.op != abi::OpKind::kLowLatencyCombine) {
    return false;
  }
  for (size_t r = 0; r < slots.size(); ++r) {
    const std::shared_ptr<CudaRank>& cr = OpRank(static_cast<int32_t>(r));
    if (rank_masked()[r] != 0 || !cr || cr->client_launched ||
        !rules::DecodeFlags(slots[r].flags).stream_ordered) {
      return false;
    }
  }
  return true;
}

std::optional<CudaGroup::OpGraphKey> CudaGroup::OpGraphVariant(
    const OpPlan& plan, const std::vector<abi::RequestSlot>& slots) const {
  if (!plane_->options().op_graphs || !EveryRankHandsOffInAKernel(plan, slots)) {
    return std::nullopt;
  }
  const rules::RequestOptions flags = rules::DecodeFlags(plan.flags);
  OpGraphKey key;
  key.op = plan.op;
  if (plan.op == abi::OpKind::kLowLatencyDispatch) {
    key.buffer = plan.ll_buffer;
    key.use_fp8 = flags.use_fp8;
    key.round_scale = flags.round_scale;
    key.use_ue8m0 = flags.use_ue8m0;
  } else {
    key.handle_buffer = plan.ll_handle_buffer;
    key.out_buffer = plan.ll_out_buffer;
  }
  return key;
}

const CudaGroup::OpGraphSet* CudaGroup::OpGraphsFor(const OpGraphKey& key, const OpPlan& plan,
                                                    const std::vector<abi::RequestSlot>& slots) {
  if (op_graphs_generation_ != ranks_generation_) {
    DropOpGraphs();  // Captured with other ranks' areas, streams and events.
    op_graphs_generation_ = ranks_generation_;
  }
  for (const OpGraphSet& set : op_graphs_) {
    if (set.key == key) return set.failed ? nullptr : &set;
  }
  if (op_graphs_.size() >= kMaxOpGraphVariants) return nullptr;
  // The first op of this variant: captured now, once (allocates; later ops do not).
  OpGraphSet set;
  set.key = key;
  absl::Status st;
  for (int d : devices_) {
    OpGraphDevice g;
    st = CaptureOpGraph(d, plan, slots, &g);
    if (!st.ok()) break;
    set.devices.push_back(std::move(g));
  }
  if (!st.ok()) {
    EngineLog()->warn(
        "group {}: capturing the op graph of {} (buffer {}, fp8 {}) failed: {}; ops of this "
        "variant take the per-rank launch path until the group's ranks change",
        spec().name(), OpName(static_cast<uint32_t>(key.op)),
        key.op == abi::OpKind::kLowLatencyDispatch ? key.buffer : key.handle_buffer, key.use_fp8,
        st.ToString());
    set.failed = true;
    // The GPUs captured before the failure: destroyed between engine rounds, as every graph.
    if (!set.devices.empty()) {
      plane_->deferred_release().Add(
          std::make_shared<std::vector<OpGraphDevice>>(std::move(set.devices)));
      set.devices.clear();
    }
  }
  op_graphs_.push_back(std::move(set));
  return op_graphs_.back().failed ? nullptr : &op_graphs_.back();
}

absl::Status CudaGroup::CaptureOpGraph(int device, const OpPlan& plan,
                                       const std::vector<abi::RequestSlot>& slots,
                                       OpGraphDevice* out) {
  std::vector<int32_t> on_device;
  for (size_t r = 0; r < slots.size(); ++r) {
    if (OpRank(static_cast<int32_t>(r))->device == device) {
      on_device.push_back(static_cast<int32_t>(r));
    }
  }
  if (on_device.empty()) {
    return absl::InternalError(
        absl::StrCat("no rank of group ", spec().name(), " on GPU ", device));
  }
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(device)));
  // Fork and join events of the capture (edges of the graph, not nodes).
  std::vector<EventHandle> events;
  for (size_t i = 0; i < on_device.size(); ++i) {
    EPD_ASSIGN_OR_RETURN(EventHandle e, CreateEvent());
    events.push_back(std::move(e));
  }
  cudaStream_t origin = OpRank(on_device[0])->stream.get();
  // Thread-local: other threads' calls (other groups' engines, the control path) are not
  // restricted meanwhile. The ranks' streams are this group's, idle (its GPUs are claimed
  // and no op of it runs), and used only under mu_, which the engine holds.
  EPD_RETURN_IF_ERROR(
      EPD_CUDA_STATUS(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal)));
  std::vector<cudaStream_t> forked;
  absl::Status st = [&]() -> absl::Status {
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventRecord(events[0].get(), origin)));
    for (size_t i = 1; i < on_device.size(); ++i) {
      cudaStream_t s = OpRank(on_device[i])->stream.get();
      EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamWaitEvent(s, events[0].get(), 0)));
      forked.push_back(s);
    }
    // Each rank's branch: as the per-rank path (LaunchRank, then the done event), its seq
    // and T from its Readback words. The branches run side by side, as the ranks' streams.
    for (int32_t r : on_device) {
      const CudaRank& cr = *OpRank(r);
      bool ready_wait = false;
      EPD_RETURN_IF_ERROR(LaunchRank(plan, slots[r], r, &ready_wait, /*captured=*/true));
      EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(
          cudaEventRecordWithFlags(cr.done.get(), cr.stream.get(), cudaEventRecordExternal)));
    }
    return absl::OkStatus();
  }();
  // Every forked stream joins the origin again, also after an error: the capture then ends
  // on every stream (an unjoined one would stay in it).
  for (size_t i = 0; i < forked.size(); ++i) {
    absl::Status j = EPD_CUDA_STATUS(cudaEventRecord(events[i + 1].get(), forked[i]));
    if (j.ok()) j = EPD_CUDA_STATUS(cudaStreamWaitEvent(origin, events[i + 1].get(), 0));
    if (st.ok()) st = j;
  }
  cudaGraph_t raw = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(origin, &raw);
  GraphHandle graph(raw);
  if (st.ok() && ended != cudaSuccess) {
    st = CudaErrorToStatus(ended, "cudaStreamEndCapture", __FILE__, __LINE__);
  }
  if (st.ok() && graph == nullptr) st = absl::InternalError("the op graph's capture was empty");
  if (!st.ok()) {
    cudaGetLastError();  // The capture's error is reported, not left pending.
    return st;
  }
  cudaGraphExec_t exec = nullptr;
  EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaGraphInstantiate(&exec, graph.get(), 0)));
  out->exec.reset(exec);
  out->device = device;
  out->stream = origin;
  // Its first launch then does not upload it (the capture is not on a client's timing path
  // again: this op's).
  return EPD_CUDA_STATUS(cudaGraphUpload(exec, origin));
}

void CudaGroup::LaunchOpGraphs(const OpGraphSet& set, const OpPlan& plan,
                               const std::vector<abi::RequestSlot>& slots, GpuOp& op) {
  const int R = static_cast<int>(slots.size());
  // The per-op words the graphs' kernels read (host-mapped, daemon-private), written
  // before the launches: the previous op's kernels have left the GPU (one op of the group
  // at a time), so none reads them now.
  for (int r = 0; r < R; ++r) {
    Readback* rb = OpRank(r)->readback.get();
    *reinterpret_cast<volatile uint64_t*>(&rb->op_seq) = slots[r].seq;
    *reinterpret_cast<volatile int32_t*>(&rb->op_num_tokens) = slots[r].num_tokens;
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (int r = 0; r < R; ++r) {
    const CudaRank& cr = *OpRank(r);
    gpu_timer_.SetBegin(r, cr.op_begin.get());  // Nodes of the graph.
    gpu_timer_.SetEnd(r, cr.done.get());
  }
  op_graph_launches.fetch_add(1, std::memory_order_relaxed);
  for (const OpGraphDevice& g : set.devices) {
    absl::Status st;
    if (set.devices.size() > 1) st = EPD_CUDA_STATUS(cudaSetDevice(g.device));
    if (st.ok()) st = EPD_CUDA_STATUS(cudaGraphLaunch(g.exec.get(), g.stream));
    if (st.ok()) {
      op.graph_streams.push_back(g.stream);  // Within its capacity R (SizeOp).
      continue;
    }
    EngineLog()->error("group {}: launching the op graph of op {} on GPU {} failed: {}",
                       spec().name(), plan.seq, g.device, st.ToString());
    ReleaseRanksAfterFailedLaunch(g.device, plan, op, st);
  }
}

void CudaGroup::ReleaseRanksAfterFailedLaunch(int device, const OpPlan& plan, GpuOp& op,
                                              const absl::Status& st) {
  // Nothing of this GPU's ranks runs: as the per-rank path after a failed launch, their
  // status is read back, their clients' streams are released and their done events
  // recorded (the other GPUs' ranks wait for them until the kernels' timeout).
  for (size_t i = 0; i < op.ranks.size(); ++i) {
    const int32_t r = static_cast<int32_t>(i);
    const CudaRank& cr = *OpRank(r);
    if (cr.device != device) continue;
    op.launch[r] = st;
    op.done_written[r] = true;
    cudaSetDevice(cr.device);
    absl::Status tail =
        kc::EnqueueStatusReadback(Context(r, 0), cr.stream.get(), &cr.readback->status);
    if (tail.ok()) tail = WriteDone(cr, plan.seq);
    if (tail.ok()) tail = EPD_CUDA_STATUS(cudaEventRecord(cr.done.get(), cr.stream.get()));
    if (!tail.ok()) {
      EngineLog()->error("group {} rank {}: releasing the client's stream for op {} failed: {}",
                         spec().name(), r, plan.seq, tail.ToString());
    }
  }
}

bool CudaGroup::GraphStreamsBusy(const GpuOp& op) {
  for (cudaStream_t s : op.graph_streams) {
    const cudaError_t err = cudaStreamQuery(s);
    if (err == cudaErrorNotReady) return true;
    if (err != cudaSuccess) cudaGetLastError();  // The done events report the failure.
  }
  return false;
}

void CudaGroup::DropOpGraphs() {
  if (op_graphs_.empty()) return;
  plane_->deferred_release().Add(std::make_shared<std::vector<OpGraphSet>>(std::move(op_graphs_)));
  op_graphs_.clear();
  op_graphs_.reserve(kMaxOpGraphVariants);
}

}  // namespace epd
