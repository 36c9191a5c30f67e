// ClientLaunch (client_launch.h). Empty without CUDA.
#include "client/endpoint/client_launch.h"

#if EPD_HAVE_CUDA

#include <algorithm>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/cuda/area_cache.h"
#include "client/endpoint/deadline.h"
#include "client/endpoint/endpoint_state.h"
#include "client/endpoint/tensor_checks.h"
#include "common/cuda/cuda_check.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/rank_context.h"

namespace epd::internal {
namespace {

namespace kc = kernels::cuda;

/// How long Wait spins on the op's event before it sleeps between polls (µs).
constexpr int64_t kSpinBeforeSleepUs = 200;
/// Extra time past op_timeout that Wait gives the op's stream (its kernels bound their own
/// waits by op_timeout) before it reports the stream stuck.
constexpr auto kGpuGrace = std::chrono::seconds(5);

}  // namespace

absl::Status PreloadKernelsOnce(int device) {
  static std::mutex mu;
  static std::set<int>* loaded = new std::set<int>();
  std::lock_guard<std::mutex> lock(mu);
  if (loaded->count(device) > 0) return absl::OkStatus();
  EPD_RETURN_IF_ERROR(kc::PreloadKernels());
  loaded->insert(device);
  return absl::OkStatus();
}

ClientLaunch::ClientLaunch(Endpoint::Impl& endpoint, GroupEndpointsFn group_endpoints)
    : m_(endpoint),
      group_endpoints_(std::move(group_endpoints)),
      spanning_(endpoint.spec.nodes_size() >= 2) {}

bool ClientLaunch::CheckHandle(const OpPlan& p, absl::Status* st, int* buffer) const {
  const int32_t Mll = m_.shape.ll_max_tokens_per_rank;
  switch (p.op) {
    case abi::OpKind::kGetDispatchLayout:
      return st->ok();  // No exchange between ranks: a rejected input takes part in nothing.
    case abi::OpKind::kDispatch:
    case abi::OpKind::kCombine:
      if (st->ok()) *st = handles_.Check(p.op, p.flags, p.handle_seq, p.num_tokens);
      return true;
    case abi::OpKind::kLowLatencyDispatch:
      return Mll != 0;  // No low-latency buffers: nothing to take part in.
    case abi::OpKind::kLowLatencyCombine:
      if (Mll == 0) {
        *st = absl::FailedPreconditionError(
            absl::StrCat(p.name, ": group ", m_.spec.name(),
                         " has ll_max_tokens_per_rank = 0 (low-latency disabled)"));
        return false;
      }
      // The handle's dispatch must still own its buffer.
      if (st->ok()) *st = handles_.Check(p.op, p.flags, p.handle_seq, p.num_tokens);
      *buffer = handles_.LowLatencyBufferOf(p.handle_seq);
      // A rejected rank takes part with the latest dispatch's buffer (what its peers use).
      if (*buffer < 0) *buffer = m_.parity.LatestDispatchBuffer();
      return *buffer >= 0;
    default:
      *st = absl::InternalError(absl::StrCat(p.name, ": not an op of the client-launched runner"));
      return false;
  }
}

absl::StatusOr<uint64_t> ClientLaunch::Run(const OpPlan& p) {
  if (spanning_) return RunSpanning(p);
  absl::Status st = p.status;
  int buffer = p.buffer;
  if (!CheckHandle(p, &st, &buffer)) return st;
  EPD_RETURN_IF_ERROR(EnsureSetUp());
  const int device = m_.mapping->device();
  DeviceGuard guard(device);
  const cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  bool capturing = false;
  EPD_ASSIGN_OR_RETURN(const uint64_t seq, Begin(s, &capturing));
  // Inputs a kernel takes by pointer are read in place unless the kernel could read past
  // them: with T on the device (the op's, or its handle's dispatch's), only when they have
  // ll_max_tokens_per_rank rows (else they are staged into those regions).
  const bool runtime_tokens = p.op == abi::OpKind::kLowLatencyCombine
                                  ? ll_runtime_tokens_[buffer]
                                  : p.device_num_tokens != nullptr;
  const bool in_place_ok = !runtime_tokens || p.num_tokens == m_.shape.ll_max_tokens_per_rank;
  std::array<const void*, 4> in_place{};
  for (int i = 0; i < p.num_inputs && st.ok(); ++i) {
    const OpInput& in = p.inputs[i];
    if (in.by_pointer && in_place_ok && ReadableInPlace(in.tensor, device, in.alignment)) {
      in_place[i] = TensorBytes(in.tensor);
    } else {
      st = m_.Stage(p.name, in.name, in.tensor, in.region, p.stream);
    }
  }
  // A rejected rank still takes part, with T = 0, so its peers' op completes (as if this
  // rank had no tokens); the routing or buffer it leaves is not usable. A combine's inputs
  // are zeroed: this rank's experts give zeros, and (low-latency) its own tokens pull
  // nothing (every topk_idx entry -1: bytes 0xff).
  const bool rejected = !st.ok();
  if (rejected) {
    in_place = {};
    const kernels::EndpointLayout& l = m_.layout;
    if (p.op == abi::OpKind::kCombine) {
      EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(m_.At(l.in_combine_x), 0, l.in_combine_x.bytes, s));
      EPD_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(m_.At(l.in_combine_weights), 0, l.in_combine_weights.bytes, s));
    } else if (p.op == abi::OpKind::kLowLatencyCombine) {
      EPD_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(m_.At(l.in_ll_combine_x), 0, l.in_ll_combine_x.bytes, s));
      EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(m_.At(l.in_topk_idx), 0xff, l.in_topk_idx.bytes, s));
    }
  }
  // A dispatch's kernel writes N into the op's read-back (a captured op's: the one Wait
  // reads for captured ops); a rejected op's N is not reported, so it writes nowhere (its
  // slot may still hold an earlier op's N).
  int32_t* recv_count_out = nullptr;
  if (p.op == abi::OpKind::kDispatch && !rejected) {
    recv_count_out = &readback(capturing ? kSlots : static_cast<uint32_t>(seq % kSlots)).recv_count;
  }
  EPD_RETURN_IF_ERROR(Launch(p, rejected, buffer, in_place, recv_count_out, s));
  EPD_RETURN_IF_ERROR(Record(p, seq, buffer, rejected, runtime_tokens, st, s, capturing));
  return seq;
}

absl::Status ClientLaunch::Record(const OpPlan& p, uint64_t seq, int buffer, bool rejected,
                                  bool runtime_tokens, const absl::Status& st, cudaStream_t s,
                                  bool capturing) {
  m_.parity.Advance(p.op);
  // The routing a rejected dispatch leaves is not usable; a low-latency dispatch owns its
  // buffer only once its op is recorded.
  if (p.op == abi::OpKind::kDispatch && rejected) handles_.Forget(handles_.routing_seq());
  if (p.op == abi::OpKind::kLowLatencyDispatch) {
    handles_.LowLatencyDispatchEnded(seq, buffer, p.num_tokens, /*ok=*/false);
  }
  EPD_RETURN_IF_ERROR(st);
  EPD_RETURN_IF_ERROR(End(seq, p.op, s, capturing));
  if (p.op == abi::OpKind::kDispatch) {
    // (N is known on the device only.)
    handles_.DispatchDone(seq, (p.flags & abi::kFlagCachedHandle) != 0, p.num_tokens,
                          /*num_recv_tokens=*/-1, (p.flags & abi::kFlagFp8) != 0);
  }
  if (p.op == abi::OpKind::kLowLatencyDispatch) {
    handles_.LowLatencyDispatchEnded(seq, buffer, p.num_tokens, /*ok=*/true);
    ll_runtime_tokens_[buffer] = runtime_tokens;
  }
  return absl::OkStatus();
}

absl::Status ClientLaunch::Launch(const OpPlan& p, bool rejected, int buffer,
                                  const std::array<const void*, 4>& in_place,
                                  int32_t* recv_count_out, cudaStream_t s) {
  const int32_t T = rejected ? 0 : p.num_tokens;
  kc::CudaRankContext ctx = ctx_;
  ctx.num_sms = p.num_sms;
  const rules::RequestOptions o = rules::DecodeFlags(p.flags);
  switch (p.op) {
    case abi::OpKind::kGetDispatchLayout: {
      kc::GetDispatchLayoutArgs a;
      a.topk_idx = static_cast<const int64_t*>(in_place[0]);
      EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, T, s));
      return kc::GetDispatchLayout(ctx, a, s);
    }
    case abi::OpKind::kDispatch: {
      kc::NormalDispatchArgs a;
      a.fp8 = o.use_fp8;
      a.expert_alignment = std::max(1, p.expert_alignment);
      a.with_weights = o.dispatch_weights;
      a.cached = o.cached_handle;
      a.recv_count_out = recv_count_out;
      EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, T, s));
      return kc::NormalDispatch(ctx, a, s);
    }
    case abi::OpKind::kCombine: {
      kc::NormalCombineArgs a;
      a.with_weights = o.combine_weights;
      EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, T, s));
      return kc::NormalCombine(ctx, a, s);
    }
    case abi::OpKind::kLowLatencyDispatch: {
      kc::LowLatencyDispatchArgs a;
      a.buffer = buffer;
      a.use_fp8 = o.use_fp8 && rules::Fp8Allowed(p.op, m_.shape);
      a.round_scale = o.round_scale;
      // A rejected op still runs (lockstep) with a scale format the kernel accepts.
      a.use_ue8m0 = o.use_ue8m0 && rules::CheckScaleFormat("LowLatencyDispatch", a.use_fp8,
                                                           a.round_scale, true, m_.shape)
                                       .ok();
      a.x = static_cast<const kernels::bf16_bits*>(in_place[0]);
      a.topk_idx = static_cast<const int64_t*>(in_place[1]);
      if (!rejected && p.device_num_tokens != nullptr) {
        a.num_tokens = reinterpret_cast<const int32_t*>(TensorBytes(p.device_num_tokens));
      } else {
        a.num_tokens_value = T;  // By value: no slot write to enqueue.
      }
      return kc::LowLatencyDispatch(ctx, a, s);
    }
    case abi::OpKind::kLowLatencyCombine: {
      kc::LowLatencyCombineArgs a;
      a.buffer = buffer;
      a.combined_x =
          reinterpret_cast<kernels::bf16_bits*>(m_.At(m_.layout.ll_combined_x[p.out_buffer]));
      a.topk_idx = static_cast<const int64_t*>(in_place[1]);
      a.topk_weights = static_cast<const float*>(in_place[2]);
      return kc::LowLatencyCombine(ctx, a, s);
    }
    default:
      return absl::InternalError(absl::StrCat(p.name, ": not an op of the client-launched runner"));
  }
}

absl::Status ClientLaunch::EnsureSetUp() {
  if (set_up_) return absl::OkStatus();
  if (spanning_) {
    EPD_RETURN_IF_ERROR(SetUpSpanning());
    set_up_ = true;
    return absl::OkStatus();
  }
  if (!group_endpoints_) {
    return absl::FailedPreconditionError(
        "client-launched endpoint opened without a control channel (GetGroupEndpoints)");
  }
  const int32_t R = m_.shape.num_ranks, rank = m_.info.rank();
  areas_.clear();  // (Of an earlier attempt that failed.)
  events_.clear();
  EPD_ASSIGN_OR_RETURN(v1::GetGroupEndpointsResponse group,
                       group_endpoints_(m_.info.op_timeout_ms()));
  if (group.endpoints_size() != R) {
    return absl::FailedPreconditionError(absl::StrCat("GetGroupEndpoints of group ", m_.spec.name(),
                                                      " returned ", group.endpoints_size(),
                                                      " endpoints, expected ", R));
  }
  const int own_device = m_.mapping->device();
  DeviceGuard guard(own_device);
  std::vector<uint8_t*> bases(R, nullptr);
  int32_t on_device = 0;
  for (int32_t r = 0; r < R; ++r) {
    const v1::GroupEndpoint& e = group.endpoints(r);
    if (e.rank() != r) {
      return absl::FailedPreconditionError(absl::StrCat("GetGroupEndpoints: entry ", r, " is rank ",
                                                        e.rank(), " (expected ordered by rank)"));
    }
    if (e.launch_mode() != v1::LAUNCH_MODE_CLIENT) {
      return absl::FailedPreconditionError(
          absl::StrCat("group ", m_.spec.name(), " rank ", r, " is ",
                       v1::LaunchMode_Name(e.launch_mode()), ", this endpoint is client-launched"));
    }
    if (r == rank) {
      if (e.endpoint_id() != m_.info.endpoint_id()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "GetGroupEndpoints: rank ", r, " is endpoint ", e.endpoint_id(), ", not this endpoint ",
            m_.info.endpoint_id(), " (it left and rejoined?)"));
      }
      areas_.push_back(m_.mapping);
    } else {
      EPD_ASSIGN_OR_RETURN(std::shared_ptr<const CudaAreaMapping> area,
                           MapSharedArea(e.cuda_ipc_handle(), e.gpu_uuid()));
      if (area->device() != own_device) {
        int can = 0;
        EPD_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, own_device, area->device()));
        if (!can) {
          return errors::WithReason(
              absl::FailedPreconditionError(
                  absl::StrCat("rank ", r, "'s GPU ", e.gpu_uuid(), " cannot be reached from GPU ",
                               m_.info.gpu_uuid(), " of rank ", rank, " (no peer access)")),
              errors::Reason::kCudaIpcFailed);
        }
        cudaError_t err = cudaDeviceEnablePeerAccess(area->device(), 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
        } else {
          EPD_CUDA_RETURN_IF_ERROR(err);
        }
      }
      areas_.push_back(std::move(area));
    }
    bases[r] = areas_.back()->data();
    if (e.gpu_uuid() == m_.info.gpu_uuid()) ++on_device;
  }
  EPD_RETURN_IF_ERROR(PreloadKernelsOnce(own_device));
  EPD_ASSIGN_OR_RETURN(peer_bases_, AllocateDevice(sizeof(uint8_t*) * R));
  EPD_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(peer_bases_.get(), bases.data(), sizeof(uint8_t*) * R, cudaMemcpyHostToDevice));
  kc::RankPlacement at;
  at.rank = rank;
  at.peer_bases = reinterpret_cast<uint8_t* const*>(peer_bases_.get());
  at.own_base = m_.data;
  at.ranks_on_device = on_device;
  at.op_timeout_ms = m_.info.op_timeout_ms();
  ctx_ = kc::MakeRankContext(m_.shape, m_.layout, at);
  EPD_RETURN_IF_ERROR(kc::ValidateContext(ctx_));
  // Mapped: kernels write the status and N straight into it (no copy engine on the op path).
  EPD_ASSIGN_OR_RETURN(
      readback_memory_,
      AllocatePinnedArray<Readback>(kSlots + 1, cudaHostAllocPortable | cudaHostAllocMapped));
  for (uint32_t i = 0; i < kSlots; ++i) {
    EPD_ASSIGN_OR_RETURN(EventHandle e, CreateEvent());
    events_.push_back(std::move(e));
  }
  set_up_ = true;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ClientLaunch::Begin(cudaStream_t stream, bool* capturing) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  if (capture == cudaStreamCaptureStatusInvalidated) {
    return absl::FailedPreconditionError(
        "the stream's CUDA graph capture was invalidated by an earlier error");
  }
  if (capture == cudaStreamCaptureStatusNone) {  // (Not a call allowed while capturing.)
    int stream_device = -1;
    EPD_CUDA_RETURN_IF_ERROR(cudaStreamGetDevice(stream, &stream_device));
    if (stream_device != m_.mapping->device()) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(
              "the op's stream belongs to CUDA device ", stream_device, ", the endpoint's GPU ",
              m_.info.gpu_uuid(), " is device ", m_.mapping->device(), " in this process")),
          errors::Reason::kOpInputInvalid);
    }
  }
  *capturing = capture == cudaStreamCaptureStatusActive;
  return m_.next_seq++;
}

absl::Status ClientLaunch::End(uint64_t seq, abi::OpKind op, cudaStream_t stream, bool capturing) {
  const uint32_t i = static_cast<uint32_t>(seq % kSlots);
  Slot& slot = slots_[i];
  slot.seq = 0;
  const bool low_latency = rules::IsLowLatency(op);
  // A spanning op's await kernel wrote its read-back itself.
  slot.deferred = low_latency && !capturing && !spanning_;
  slot.stream = stream;
  if (!capturing) {
    Readback& rb = readback(i);
    if (!low_latency && !spanning_) {
      EPD_RETURN_IF_ERROR(kc::EnqueueStatusReadback(ctx_, stream, &rb.status));
    }
    EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[i].get(), stream));
  }
  slot.seq = seq;
  slot.captured = capturing;
  return absl::OkStatus();
}

absl::StatusOr<OpOutcome> ClientLaunch::Wait(uint64_t seq, abi::OpKind op, absl::Duration timeout) {
  const uint32_t i = static_cast<uint32_t>(seq % kSlots);
  const Slot& slot = slots_[i];
  if (slot.seq != seq) {
    return absl::FailedPreconditionError(absl::StrCat(
        abi::OpKindName(op), " op ", seq, ": its completion record was reused: more than ", kSlots,
        " ops of this endpoint were enqueued after it without Wait"));
  }
  DeviceGuard guard(m_.mapping->device());
  Readback* rb = &readback(i);
  if (spanning_ && slot.captured) return SpanWaited(seq, op, span_readback(kSlots));
  if (slot.captured) {
    rb = &readback(kSlots);
    cudaStream_t s = m_.aux_stream.get();
    EPD_RETURN_IF_ERROR(kc::EnqueueStatusReadback(ctx_, s, &rb->status));
    EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  } else {
    const auto start = std::chrono::steady_clock::now();
    const auto limit = DeadlineAfter(start, timeout);
    const auto stuck = start + std::chrono::milliseconds(m_.info.op_timeout_ms()) + kGpuGrace;
    const auto spin_until = start + std::chrono::microseconds(kSpinBeforeSleepUs);
    for (;;) {
      cudaError_t err = cudaEventQuery(events_[i].get());
      if (err == cudaSuccess) break;
      if (err != cudaErrorNotReady) EPD_CUDA_RETURN_IF_ERROR(err);
      const auto now = std::chrono::steady_clock::now();
      if (now >= limit) {
        return errors::WithReason(absl::DeadlineExceededError(absl::StrCat(
                                      abi::OpKindName(op), " op ", seq, " not complete after ",
                                      absl::FormatDuration(timeout))),
                                  errors::Reason::kOpTimeout);
      }
      if (now >= stuck) {
        return errors::WithReason(
            absl::DeadlineExceededError(absl::StrCat(
                abi::OpKindName(op), " op ", seq,
                ": its stream did not pass the op within op_timeout + 5 s (is earlier work on "
                "the stream stuck?); the op is still pending")),
            errors::Reason::kOpTimeout);
      }
      if (now >= spin_until) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    if (slot.deferred) {
      // The read-back, ordered after everything enqueued on the op's stream so far: it
      // reports the device-side errors of this op and of the later ops of that stream
      // (nothing is lost and nothing is read while a kernel may still add to it).
      EPD_RETURN_IF_ERROR(kc::EnqueueStatusReadback(ctx_, slot.stream, &rb->status));
      EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(slot.stream));
      slots_[i].deferred = false;  // A second Wait reports the same status.
    }
  }
  if (spanning_) return SpanWaited(seq, op, span_readback(i));
  absl::Status st = kc::StatusFromDevice(rb->status, m_.shape, m_.info.rank(), abi::OpKindName(op),
                                         rules::IsLowLatency(op));
  if (!st.ok()) {
    handles_.Forget(seq);  // A handle it produced is not usable.
    return st;
  }
  OpOutcome outcome;
  if (op == abi::OpKind::kDispatch) outcome.num_recv_tokens = rb->recv_count;
  return outcome;
}

void ClientLaunch::ForgetLowLatencyHandles() { handles_.ClearLowLatency(); }

}  // namespace epd::internal

#endif  // EPD_HAVE_CUDA
