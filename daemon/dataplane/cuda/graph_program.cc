// Graph mode on the CUDA backend (see graph_program.h).
#include "daemon/dataplane/cuda/graph_program.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/device_alloc.h"
#include "common/cuda/stream_memops.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/dataplane/cuda/cuda_plane.h"
#include "daemon/dataplane/gpu_drain.h"
#include "epd/kernels/cuda_program.h"
#include "epd/kernels/layout.h"
#include "proto/abi/launch_flags.h"

namespace epd {
namespace {

namespace kc = kernels::cuda;

/// "done", "pending" or the error of cudaEventQuery(e) (clearing a non-sticky error).
const char* EventState(cudaEvent_t e) {
  const cudaError_t err = cudaEventQuery(e);
  if (err == cudaSuccess) return "done";
  if (err == cudaErrorNotReady) return "pending";
  cudaGetLastError();
  return cudaGetErrorString(err);
}

}  // namespace

bool ProgramTrace() {
  static const bool on = [] {
    const char* v = std::getenv("EPD_PROGRAM_TRACE");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return on;
}

absl::StatusOr<std::unique_ptr<GraphProgram>> GraphProgram::Arm(
    Host* host, const kernels::GroupShape& shape, std::vector<ProgramStepPlan> steps,
    const std::vector<std::shared_ptr<CudaRank>>& ranks, int32_t num_sms) {
  std::unique_ptr<GraphProgram> p(new GraphProgram(host, shape, std::move(steps), num_sms));
  const int R = static_cast<int>(ranks.size());
  p->ranks_.resize(R);
  p->event_errors_.assign(R, cudaSuccess);
  p->timeout_ns_ = host->ProgramRankContext(0, num_sms).timeout_ns;
  for (Instance& in : p->instances_) in.launch.assign(R, absl::OkStatus());
  for (int r = 0; r < R; ++r) {
    ProgramRank& pr = p->ranks_[r];
    pr.rank = ranks[r];
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(pr.rank->device)));
    for (int i = 0; i < kProgramDepth; ++i) {
      EPD_ASSIGN_OR_RETURN(pr.waited[i], CreateEvent());
      EPD_ASSIGN_OR_RETURN(pr.done[i], CreateEvent());
    }
    EPD_ASSIGN_OR_RETURN(pr.readback,
                         AllocatePinnedArray<kc::DeviceStatus>(
                             kProgramDepth, cudaHostAllocPortable | cudaHostAllocMapped));
    // go, done and instance start at 0 (the client runs no step while it registers).
    cudaStream_t s = pr.rank->stream.get();
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaMemsetAsync(
        pr.rank->flag(abi::kProgramGoOffset), 0,
        abi::kProgramInstanceOffset + sizeof(uint64_t) - abi::kProgramGoOffset, s)));
    EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaStreamSynchronize(s)));
    if (ProgramTrace()) {
      EngineLog()->warn("program trace: group {} rank {}: GPU {} stream {} go at {}",
                        host->ProgramGroupName(), r, pr.rank->device, static_cast<void*>(s),
                        static_cast<void*>(pr.rank->flag(abi::kProgramGoOffset)));
    }
  }
  for (int r = 0; r < R; ++r) {
    abi::EndpointShmHeader* h = host->ProgramHeader(r);
    abi::Atomic(h->program_errors).store(0, std::memory_order_relaxed);
    abi::Atomic(h->program_checked).store(0, std::memory_order_relaxed);
    abi::Atomic(h->program_armed).store(1, std::memory_order_release);
  }
  while (p->inflight_ < kProgramDepth) p->EnqueueInstance();
  return p;
}

absl::Status GraphProgram::LaunchStep(const ProgramStepPlan& st, int32_t r, uint64_t k,
                                      kc::DeviceStatus* status_out) {
  const CudaRank& cr = *ranks_[r].rank;
  const kc::CudaRankContext ctx = host_->ProgramRankContext(r, num_sms_);
  cudaStream_t s = cr.stream.get();
  // The step's kernel writes the instance number and then done = 1 itself (a stream memory
  // write behind the kernels and the read-back lands later, cuda_ops.h).
  kc::KernelHandoff handoff;
  handoff.done_flag = reinterpret_cast<uint64_t*>(cr.flag(abi::kProgramDoneOffset));
  handoff.done_value = 1;
  handoff.instance_flag = reinterpret_cast<uint64_t*>(cr.flag(abi::kProgramInstanceOffset));
  handoff.instance_value = k;
  handoff.status_out = status_out;
  if (st.op == abi::OpKind::kLowLatencyDispatch) {
    kc::LowLatencyDispatchArgs a;
    a.buffer = st.buffer;
    a.use_fp8 = st.use_fp8;
    a.round_scale = st.round_scale;
    a.use_ue8m0 = st.use_ue8m0;
    a.num_tokens_value = -1;  // T from the rank's token-count slot, staged by the client.
    a.handoff = handoff;
    a.expert_stats = cr.expert_stats();
    return kc::LowLatencyDispatch(ctx, a, s);
  }
  kc::LowLatencyCombineArgs a;
  a.buffer = st.buffer;
  a.handoff = handoff;
  a.combined_x = reinterpret_cast<kernels::bf16_bits*>(
      cr.area.get() + ctx.layout.ll_combined_x[st.out_buffer].offset);
  return kc::LowLatencyCombine(ctx, a, s);
}

void GraphProgram::EnqueueInstance() {
  // Instance k takes the ring entry of instance k - kProgramDepth, which has completed
  // (inflight_ < kProgramDepth); its launch vector already has R entries (Arm).
  const uint64_t k = next_++;
  Instance& in = instance(k);
  in.k = k;
  in.step = static_cast<int>((in.k - 1) % steps_.size());
  const int slot = static_cast<int>(in.k % kProgramDepth);
  const int R = static_cast<int>(ranks_.size());
  // Every rank's wait and kernel before any rank's event (as a lockstep op).
  for (int r = 0; r < R; ++r) {
    ProgramRank& pr = ranks_[r];
    const CudaRank& cr = *pr.rank;
    in.launch[r] = [&]() -> absl::Status {
      EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaSetDevice(cr.device)));
      cudaStream_t s = cr.stream.get();
      EPD_RETURN_IF_ERROR(StreamWaitValue64Geq(s, cr.flag(abi::kProgramGoOffset), 1));
      EPD_RETURN_IF_ERROR(StreamWriteValue64(s, cr.flag(abi::kProgramGoOffset), 0));
      EPD_RETURN_IF_ERROR(EPD_CUDA_STATUS(cudaEventRecord(pr.waited[slot].get(), s)));
      return LaunchStep(steps_[in.step], r, in.k, &pr.readback.get()[slot]);
    }();
  }
  for (int r = 0; r < R; ++r) {
    ProgramRank& pr = ranks_[r];
    const CudaRank& cr = *pr.rank;
    cudaSetDevice(cr.device);
    cudaStream_t s = cr.stream.get();
    // The kernel wrote instance, done and its status; when its launch failed, the stream
    // writes them (the read-back is a kernel, not a copy: this is enqueued long before the
    // go wait passes, and a device-to-host copy waiting there would hold a copy-engine
    // queue that other streams' copies share, epd/kernels/cuda_program.h), so the client's
    // stream is released on every path.
    absl::Status st;
    absl::Status w;
    if (!in.launch[r].ok()) {
      st = kc::EnqueueStatusReadback(host_->ProgramRankContext(r, 0), s, &pr.readback.get()[slot]);
      w = StreamWriteValue64(s, cr.flag(abi::kProgramInstanceOffset), in.k);
      if (st.ok()) st = w;
      w = StreamWriteValue64(s, cr.flag(abi::kProgramDoneOffset), 1);
      if (st.ok()) st = w;
    }
    w = EPD_CUDA_STATUS(cudaEventRecord(pr.done[slot].get(), s));
    if (st.ok()) st = w;
    if (in.launch[r].ok()) in.launch[r] = st;
    if (ProgramTrace()) {
      EngineLog()->warn("program trace: group {}: enqueued instance {} (step {}) on rank {}: {}",
                        host_->ProgramGroupName(), in.k, in.step, r, in.launch[r].ToString());
    }
  }
  ++inflight_;
}

void GraphProgram::PublishError(const absl::Status& st, uint64_t k, int step) {
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    abi::EndpointShmHeader* h = host_->ProgramHeader(r);
    if (h == nullptr) continue;
    h->program_error_instance = k;
    h->program_error_code = static_cast<int32_t>(st.code());
    h->program_error_step = step;
    const std::string msg(st.message());
    const size_t n = std::min(msg.size(), static_cast<size_t>(abi::kMessageBytes - 1));
    std::memcpy(h->program_error_message, msg.data(), n);
    h->program_error_message[n] = '\0';
    abi::Atomic(h->program_errors).fetch_add(1, std::memory_order_release);
  }
}

void GraphProgram::PublishChecked(uint64_t k) {
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    if (abi::EndpointShmHeader* h = host_->ProgramHeader(r)) {
      abi::Atomic(h->program_checked).store(k, std::memory_order_release);
    }
  }
}

void GraphProgram::Disarm(const absl::Status& why, bool stopping) {
  const std::string& name = host_->ProgramGroupName();
  if (ProgramTrace()) {
    EngineLog()->warn("program trace: group {}: disarming ({}) with {} instance(s) in flight", name,
                      why.ToString(), inflight_);
  }
  // Release the instances still waiting for their client's go, in instance order. go = 1
  // for instance j is written only once instance j-1 has passed its wait and written
  // go = 0 (its `waited` event), so no write is lost; a redundant go = 1 only releases the
  // next instance early, which is released anyway.
  for (uint64_t k = front(); k < next_; ++k) {
    const Instance& in = instance(k);
    const int slot = static_cast<int>(in.k % kProgramDepth);
    // A stream memory write, not a copy (epd/kernels/cuda_program.h: a copy could queue
    // behind another stream's copy that waits on the GPU).
    auto release = [&](ProgramRank& pr) {
      cudaSetDevice(pr.rank->device);
      if (cudaEventQuery(pr.waited[slot].get()) != cudaErrorNotReady) return;
      cudaStream_t aux = host_->ProgramAuxStream(pr.rank->device);
      absl::Status st = StreamWriteValue64(aux, pr.rank->flag(abi::kProgramGoOffset), 1);
      if (st.ok()) st = EPD_CUDA_STATUS(cudaStreamSynchronize(aux));
      if (!st.ok()) {
        EngineLog()->error("group {} rank {}: releasing program instance {} failed: {}", name,
                           pr.rank->rank, in.k, st.ToString());
      }
    };
    for (ProgramRank& pr : ranks_) release(pr);
    // The go word is in the client's area: a client that writes it back to 0 before the
    // instance's wait saw 1 would hold that wait. So the wait for `waited` is bounded (the
    // instance before it may run its kernels for up to op_timeout first), and go = 1 is
    // written again every millisecond meanwhile. An instance still waiting then is left: its
    // stream stays blocked on the client's word, which holds only its group's memory.
    const absl::Duration bound =
        stopping ? absl::FromChrono(kStopGrace)
                 : absl::FromChrono(kDisarmGrace) + absl::Nanoseconds(timeout_ns_);
    const absl::Time deadline = absl::Now() + bound;
    for (ProgramRank& pr : ranks_) {
      cudaSetDevice(pr.rank->device);
      const bool passed = PollUntil(
          [&] {
            if (cudaEventQuery(pr.waited[slot].get()) != cudaErrorNotReady) return true;
            release(pr);
            return false;
          },
          deadline);
      if (!passed) {
        EngineLog()->error(
            "group {} rank {}: program instance {} still waits for its go word {} ms after it "
            "was released (the client's area holds it back); left waiting",
            name, pr.rank->rank, in.k, absl::ToInt64Milliseconds(bound));
      }
    }
  }
  for (ProgramRank& pr : ranks_) {
    CudaRank& cr = *pr.rank;
    cudaSetDevice(cr.device);
    absl::Status st = StreamWriteValue64(cr.stream.get(), cr.flag(abi::kProgramDoneOffset),
                                         abi::kProgramReleased);
    if (!st.ok()) {
      EngineLog()->error("group {} rank {}: releasing the program's client stream failed: {}", name,
                         cr.rank, st.ToString());
    }
    cudaEventRecord(cr.done.get(), cr.stream.get());
  }
  cudaGetLastError();
  if (!why.ok()) {
    host_->ProgramWarning(
        absl::StrCat("group ", name, ": graph-mode program disarmed: ", why.message()));
    PublishError(why, next_ - 1, -1);
  } else {
    EngineLog()->info("group {}: graph-mode program unregistered", name);
  }
  // The released instances' results are not checked: nothing waits for them.
  PublishChecked(~uint64_t{0});
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    if (abi::EndpointShmHeader* h = host_->ProgramHeader(r)) {
      abi::Atomic(h->program_armed).store(0, std::memory_order_release);
    }
  }
}

void GraphProgram::TracePending() {
  if (Clock::now() < trace_next_) return;
  trace_next_ = Clock::now() + std::chrono::seconds(1);
  const int R = static_cast<int>(ranks_.size());
  for (uint64_t k = front(); k < next_; ++k) {
    const int ps = static_cast<int>(k % kProgramDepth);
    std::string ranks;
    for (int r = 0; r < R; ++r) {
      cudaSetDevice(ranks_[r].rank->device);
      absl::StrAppend(&ranks, " rank ", r, ": go wait ", EventState(ranks_[r].waited[ps].get()),
                      ", instance ", EventState(ranks_[r].done[ps].get()), ";");
    }
    EngineLog()->warn("program trace: group {}: instance {} pending:{}", host_->ProgramGroupName(),
                      k, ranks);
  }
}

absl::Status GraphProgram::Poll() {
  const int R = static_cast<int>(ranks_.size());
  while (inflight_ > 0) {
    Instance& in = instance(front());
    const int slot = static_cast<int>(in.k % kProgramDepth);
    bool done = true;
    for (int r = 0; r < R && done; ++r) {
      cudaSetDevice(ranks_[r].rank->device);
      const cudaError_t err = cudaEventQuery(ranks_[r].done[slot].get());
      event_errors_[r] = err;
      if (err == cudaErrorNotReady) {
        done = false;
      } else if (err != cudaSuccess) {
        cudaGetLastError();  // Clear a non-sticky error: it is reported below.
      }
    }
    if (!done) {
      if (ProgramTrace()) TracePending();
      break;
    }
    if (ProgramTrace()) {
      EngineLog()->warn("program trace: group {}: instance {} (step {}) done on every rank",
                        host_->ProgramGroupName(), in.k, in.step);
    }
    const ProgramStepPlan& step = steps_[in.step];
    const char* name = OpName(static_cast<uint32_t>(step.op));
    absl::Status bad;  // OK (no allocation) unless a rank failed.
    bool disarm = false;
    for (int r = 0; r < R && bad.ok(); ++r) {
      const bool event_failed = event_errors_[r] != cudaSuccess;
      absl::Status st =
          !in.launch[r].ok() ? in.launch[r]
          : event_failed
              ? CudaErrorToStatus(event_errors_[r], "cudaEventQuery(the instance's done event)",
                                  __FILE__, __LINE__)
              : kc::StatusFromDevice(ranks_[r].readback.get()[slot], shape_, r, name, true);
      if (!st.ok()) {
        disarm =
            !in.launch[r].ok() || event_failed || st.code() == absl::StatusCode::kDeadlineExceeded;
        bad = errors::CopyReason(
            st, absl::Status(st.code(), absl::StrCat("program instance ", in.k, " step ", in.step,
                                                     " (", ProgramStepName(step), "): rank ", r,
                                                     ": ", st.message())));
      }
    }
    const uint64_t k = in.k;
    const int step_index = in.step;
    --inflight_;  // Its ring entry is free for instance k + kProgramDepth.
    host_->ProgramInstanceChecked(bad.ok());
    if (!bad.ok()) {
      host_->ProgramWarning(absl::StrCat("group ", host_->ProgramGroupName(), ": ", bad.message()));
      PublishError(bad, k, step_index);
    }
    PublishChecked(k);
    if (disarm) {
      // The ranks' kernel counters may be out of step: later instances could not pair up.
      return errors::CopyReason(bad,
                                absl::Status(bad.code(), absl::StrCat(bad.message(),
                                                                      "; the program was disarmed: "
                                                                      "register it again")));
    }
  }
  while (inflight_ < kProgramDepth) EnqueueInstance();
  return absl::OkStatus();
}

}  // namespace epd
