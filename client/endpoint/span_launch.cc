// ClientLaunch for a group that spans nodes (client_launch.h; DESIGN.md §5.5
// "Client-launched"): each op is staged into the rank's GPU area, posted by a kernel into
// the rank's host mirror as a command (proto/abi/span_abi.h), run across nodes by the
// daemon's exchange, and its outputs copied back by a kernel that waits for the daemon's
// answer; all on the op's stream, so a CUDA graph captures it. Empty without CUDA.
#include "client/endpoint/client_launch.h"

#if EPD_HAVE_CUDA

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/endpoint/endpoint_state.h"
#include "client/endpoint/tensor_checks.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"

namespace epd::internal {
namespace {

namespace kc = kernels::cuda;

/// Extra time the await kernel waits past op_timeout, so that the daemon's own verdict on
/// an op (sent by op_timeout plus its grace of at most 1 s) arrives before the kernel
/// gives up on the daemon.
constexpr uint64_t kAwaitGraceNs = 2'000'000'000ull;

/// Adds a range of `rows` rows (or rows read on the device at `rows_ptr`) of `row_bytes` at
/// the start of region `r`.
void AddSpan(kc::SpanPostArgs& a, const kernels::Region& r, uint64_t row_bytes, int64_t rows,
             const int32_t* rows_ptr = nullptr) {
  if (a.num_spans >= kc::kMaxPostSpans || r.bytes == 0) return;
  a.spans[a.num_spans++] = {r.offset, r.bytes, row_bytes, rows, rows_ptr};
  a.max_total_bytes += r.bytes;
}

}  // namespace

absl::Status ClientLaunch::SetUpSpanning() {
  const kernels::EndpointLayout& L = m_.layout;
  const uint64_t mirror_bytes = L.ll_routing.offset;  // CudaRankMirror::MirrorBytes.
  const uint64_t data_offset = m_.info.data_offset();
  const uint64_t need = abi::SpanDataBytes(mirror_bytes);
  if (data_offset == 0 || m_.info.shm_bytes() < data_offset + need) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", m_.spec.name(), " spans nodes but rank ", m_.info.rank(), "'s endpoint region (",
        m_.info.shm_bytes(), " bytes, data at ", data_offset, ") holds no mirror of ", need,
        " bytes: the daemon does not run client-launched "
        "endpoints across nodes (update epd)"));
  }
  uint8_t* mirror = m_.ring.region_data() + data_offset;
  control_host_ =
      reinterpret_cast<abi::SpanControl*>(mirror + abi::SpanControlOffset(mirror_bytes));
  if (control_host_->magic != abi::kSpanControlMagic ||
      control_host_->version != abi::kSpanControlVersion ||
      control_host_->first_seq != m_.next_seq) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", m_.spec.name(), " rank ", m_.info.rank(),
        ": the command block of the endpoint's mirror has magic 0x",
        absl::Hex(control_host_->magic), ", version ", control_host_->version, ", first op ",
        control_host_->first_seq, " (expected 0x", absl::Hex(abi::kSpanControlMagic), ", ",
        abi::kSpanControlVersion, ", ", m_.next_seq, ")"));
  }
  const int device = m_.mapping->device();
  DeviceGuard guard(device);
  EPD_RETURN_IF_ERROR(PreloadKernelsOnce(device));
  EPD_ASSIGN_OR_RETURN(mirror_registration_, RegisterHostMapped(mirror, need, &mirror_device_));
  control_device_ =
      reinterpret_cast<abi::SpanControl*>(mirror_device_ + abi::SpanControlOffset(mirror_bytes));
  EPD_ASSIGN_OR_RETURN(span_state_, AllocateDevice(sizeof(kc::SpanDeviceState)));
  kc::SpanDeviceState state{};
  state.next_seq = m_.next_seq;
  state.current_seq = m_.next_seq - 1;
  EPD_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(span_state_.get(), &state, sizeof(state), cudaMemcpyHostToDevice));
  EPD_ASSIGN_OR_RETURN(span_readback_,
                       AllocatePinnedArray<kc::SpanReadback>(
                           kSlots + 1, cudaHostAllocPortable | cudaHostAllocMapped));
  EPD_ASSIGN_OR_RETURN(
      readback_memory_,
      AllocatePinnedArray<Readback>(kSlots + 1, cudaHostAllocPortable | cudaHostAllocMapped));
  events_.clear();
  for (uint32_t i = 0; i < kSlots; ++i) {
    EPD_ASSIGN_OR_RETURN(EventHandle e, CreateEvent());
    events_.push_back(std::move(e));
  }
  return absl::OkStatus();
}

kc::SpanPostArgs ClientLaunch::PostArgs(const OpPlan& p, int buffer, bool rejected) const {
  const kernels::EndpointLayout& L = m_.layout;
  const kernels::GroupShape& s = m_.shape;
  const uint64_t H = s.hidden, K = s.num_topk;
  const rules::RequestOptions o = rules::DecodeFlags(p.flags);
  kc::SpanPostArgs a;
  a.area = m_.data;
  a.mirror = mirror_device_;
  a.control = control_device_;
  a.state = reinterpret_cast<kc::SpanDeviceState*>(span_state_.get());
  a.op = static_cast<uint32_t>(p.op);
  a.flags = p.flags & ~abi::kFlagStreamOrdered;
  a.expert_alignment = std::max(1, p.expert_alignment);
  a.num_tokens = p.num_tokens;
  if (rejected) {  // Nothing copied: the daemon fails the op for every rank.
    a.flags |= abi::kFlagClientError;
    a.num_tokens = 0;
    a.client_buffer = p.op == abi::OpKind::kLowLatencyCombine ? p.out_buffer : buffer;
    return a;
  }
  const int64_t T = p.num_tokens;
  const auto area_i32 = [&](const kernels::Region& r, uint64_t i) {
    return reinterpret_cast<const int32_t*>(m_.data + r.offset) + i;
  };
  switch (p.op) {
    case abi::OpKind::kGetDispatchLayout:
      AddSpan(a, L.in_topk_idx, K * 8, T);
      break;
    case abi::OpKind::kDispatch:
      AddSpan(a, L.in_x, o.use_fp8 ? H : 2 * H, T);
      if (o.use_fp8) AddSpan(a, L.in_scales, uint64_t(s.num_scales()) * 4, T);
      if (!o.cached_handle) AddSpan(a, L.in_topk_idx, K * 8, T);
      if (o.dispatch_weights) AddSpan(a, L.in_topk_weights, K * 4, T);
      a.handle = o.cached_handle ? kc::SpanHandle::kRouting : kc::SpanHandle::kNone;
      a.records_routing = !o.cached_handle;
      break;
    case abi::OpKind::kCombine: {
      const int32_t* N = area_i32(L.recv_count, 0);  // The routing dispatch's N.
      AddSpan(a, L.in_combine_x, 2 * H, 0, N);
      if (o.combine_weights) AddSpan(a, L.in_combine_weights, K * 4, 0, N);
      a.handle = kc::SpanHandle::kRouting;
      break;
    }
    case abi::OpKind::kLowLatencyDispatch: {
      const int32_t* t = p.device_num_tokens != nullptr
                             ? reinterpret_cast<const int32_t*>(TensorBytes(p.device_num_tokens))
                             : nullptr;
      a.num_tokens_ptr = t;
      AddSpan(a, L.in_x, 2 * H, T, t);
      AddSpan(a, L.in_topk_idx, K * 8, T, t);
      a.client_buffer = buffer;
      a.records_ll = true;
      break;
    }
    case abi::OpKind::kLowLatencyCombine: {
      // T is the handle's dispatch's, on the device (it may have been read there).
      const auto* state = reinterpret_cast<const uint8_t*>(span_state_.get());
      const int32_t* t = reinterpret_cast<const int32_t*>(
          state + offsetof(kc::SpanDeviceState, ll_tokens) + sizeof(int32_t) * buffer);
      AddSpan(a, L.in_topk_idx, K * 8, 0, t);
      AddSpan(a, L.in_topk_weights, K * 4, 0, t);
      const int64_t El = s.num_local_experts(), rpe = s.ll_rows_per_expert();
      if (El + 2 > kc::kMaxPostSpans) {  // Too many experts for a range each: every row.
        AddSpan(a, L.in_ll_combine_x, 1, static_cast<int64_t>(L.in_ll_combine_x.bytes));
      } else {
        // Per local expert, the rows its dispatch received (copied back into this area).
        for (int64_t j = 0; j < El; ++j) {
          const kernels::Region r{L.in_ll_combine_x.offset + uint64_t(j * rpe) * 2 * H,
                                  uint64_t(rpe) * 2 * H};
          AddSpan(a, r, 2 * H, 0, area_i32(L.ll_recv_count[buffer], j));
        }
      }
      a.handle = kc::SpanHandle::kLowLatency;
      a.handle_buffer = buffer;
      a.client_buffer = p.out_buffer;
      break;
    }
    default:
      break;
  }
  return a;
}

absl::StatusOr<uint64_t> ClientLaunch::RunSpanning(const OpPlan& p) {
  absl::Status st = p.status;
  int buffer = p.buffer;
  // A rejected layout still takes part here: the op is the daemon's lockstep op, which
  // its peers wait for (one-node client-launched layouts exchange nothing).
  if (!CheckHandle(p, &st, &buffer) && p.op != abi::OpKind::kGetDispatchLayout) return st;
  EPD_RETURN_IF_ERROR(EnsureSetUp());
  DeviceGuard guard(m_.mapping->device());
  const cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  bool capturing = false;
  EPD_ASSIGN_OR_RETURN(const uint64_t seq, Begin(s, &capturing));
  for (int i = 0; i < p.num_inputs && st.ok(); ++i) {
    const OpInput& in = p.inputs[i];
    st = m_.Stage(p.name, in.name, in.tensor, in.region, p.stream);
  }
  const bool rejected = !st.ok();
  const kc::SpanPostArgs post = PostArgs(p, buffer, rejected);
  EPD_RETURN_IF_ERROR(kc::SpanPostAsync(post, s));
  kc::SpanAwaitArgs wait;
  wait.area = m_.data;
  wait.area_bytes = m_.layout.total_bytes;
  wait.mirror = mirror_device_;
  wait.mirror_bytes = m_.layout.ll_routing.offset;
  wait.control = control_device_;
  wait.state = post.state;
  wait.readback = &span_readback(capturing ? kSlots : static_cast<uint32_t>(seq % kSlots));
  wait.timeout_ns = uint64_t(m_.info.op_timeout_ms()) * 1'000'000ull + kAwaitGraceNs;
  wait.max_total_bytes = wait.mirror_bytes;
  EPD_RETURN_IF_ERROR(kc::SpanAwaitAsync(wait, s));
  // An engine asleep would see the command at its next 20 ms wake-up; a captured op's
  // replays get no ring: the engine keeps polling for a while after each command.
  if (!capturing) {
    abi::Atomic(control_host_->client_wakes).fetch_add(1, std::memory_order_seq_cst);
    m_.ring.Wake();
  }
  EPD_RETURN_IF_ERROR(
      Record(p, seq, buffer, rejected, p.device_num_tokens != nullptr, st, s, capturing));
  return seq;
}

absl::StatusOr<OpOutcome> ClientLaunch::SpanOutcome(uint64_t seq, abi::OpKind op,
                                                    const kc::SpanReadback& rb_ref) const {
  kc::SpanReadback rb;
  std::memcpy(&rb, const_cast<const kc::SpanReadback*>(&rb_ref), sizeof(rb));
  const char* name = abi::OpKindName(static_cast<uint32_t>(op));
  if (rb.timed_out != 0) {
    return absl::DeadlineExceededError(
        absl::StrCat(name, " op ", seq, " of group ", m_.spec.name(), " rank ", m_.info.rank(),
                     ": epd did not answer the op (device op ", rb.seq, ") within op_timeout ",
                     m_.info.op_timeout_ms(), " ms + 2 s (is the daemon alive?)"));
  }
  if (rb.status_code != 0) {
    // The daemon's message, when its record still holds this op.
    const abi::SpanResult& r = control_host_->results[rb.seq % abi::kCompletionCapacity];
    char message[abi::kCompletionMessageBytes];
    std::memcpy(message, r.message, sizeof(message));
    message[sizeof(message) - 1] = '\0';
    const bool ours = abi::Atomic(const_cast<uint64_t&>(r.seq)).load() == rb.seq;
    const int code = std::clamp(rb.status_code, 1, 16);
    return absl::Status(static_cast<absl::StatusCode>(code),
                        ours ? std::string(message)
                             : absl::StrCat(name, " op ", seq, " failed at epd (code ", code, ")"));
  }
  if (rb.bad_copies != 0) {
    return absl::InternalError(absl::StrCat(name, " op ", seq, ": ", rb.bad_copies,
                                            " ranges of epd's answer lay outside the area"));
  }
  OpOutcome outcome;
  if (op == abi::OpKind::kDispatch) outcome.num_recv_tokens = rb.num_recv_tokens;
  return outcome;
}

}  // namespace epd::internal

#endif  // EPD_HAVE_CUDA
