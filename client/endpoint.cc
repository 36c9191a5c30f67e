// Endpoint: the client side of the shm data plane (DESIGN.md §3.2–§3.3). Each op:
// validate the DLPack inputs, copy them into the endpoint's staging regions (skipped when
// a tensor already lives there), publish a RequestSlot, ring the engine's doorbell;
// PendingOp::Wait reads the Completion and builds the output views.
//
// Host backend: the data area is in the shm region; tensors are kDLCPU. CUDA backend
// (built with CUDA): the data area is GPU memory mapped by CUDA IPC (cuda_ipc.h); inputs
// may be kDLCUDA (copied device to device) or kDLCPU (copied host to device), staged with
// a synchronous cudaMemcpy before the request is published, and output views are kDLCUDA
// on this process's ordinal of the endpoint's GPU. (The stream-ordered hand-off of
// DESIGN §3.2 replaces the synchronous staging in a later step.)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda_ipc.h"
#include "endpoint_internal.h"
#include "epd/client.h"
#include "epd/common/status_macros.h"
#include "epd/kernels/layout.h"
#include "shm_abi.h"
#include "shm_region.h"

#if EPD_HAVE_CUDA
#include <cuda_runtime.h>

#include "epd/kernels/cuda_ops.h"
#endif

namespace epd {
namespace {

using kernels::EndpointLayout;
using kernels::GroupShape;
using kernels::Region;

/// DLPack >= 1.1 type code of float8_e4m3fn (kDLFloat8_e4m3fn); Debian's dlpack.h (0.6)
/// predates it, so the value is spelled here.
constexpr uint8_t kDLFloat8E4m3fnCode = 10;

constexpr DLDataType kBf16{kDLBfloat, 16, 1};
constexpr DLDataType kE4m3{kDLFloat8E4m3fnCode, 8, 1};
constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr DLDataType kI64{kDLInt, 64, 1};
/// bool as one byte (0/1); DLPack 0.6 has no kDLBool, so uint8 is used.
constexpr DLDataType kBool{kDLUInt, 8, 1};

bool SameType(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

std::string TypeName(DLDataType t) {
  if (SameType(t, kBf16)) return "bfloat16";
  if (SameType(t, kE4m3)) return "float8_e4m3fn";
  if (SameType(t, kF32)) return "float32";
  if (SameType(t, kI32)) return "int32";
  if (SameType(t, kI64)) return "int64";
  return absl::StrCat("dtype(code=", t.code, ",bits=", t.bits, ",lanes=", t.lanes, ")");
}

std::string ShapeString(const int64_t* shape, int ndim) {
  std::vector<int64_t> v(shape, shape + ndim);
  return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
}

/// Checks a DLTensor against an expected dtype and shape (-1 = any size; the size found
/// is written back into `shape`). Names the argument and the offending value.
/// `cuda`: the endpoint is on the CUDA backend, which also takes kDLCUDA tensors.
absl::Status CheckTensor(bool cuda, const char* op, const char* name, const DLTensor* t,
                         std::initializer_list<DLDataType> dtypes, std::vector<int64_t>& shape) {
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is required"));
  const bool device_ok = t->device.device_type == kDLCPU || t->device.device_type == kDLCUDAHost ||
                         (cuda && t->device.device_type == kDLCUDA);
  if (!device_ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " is on device type ", t->device.device_type,
                     cuda ? "; the CUDA backend takes kDLCUDA, kDLCPU or kDLCUDAHost tensors"
                          : "; the host backend takes kDLCPU tensors"));
  }
  bool dtype_ok = false;
  for (DLDataType d : dtypes) dtype_ok |= SameType(t->dtype, d);
  if (!dtype_ok) {
    std::vector<std::string> want;
    for (DLDataType d : dtypes) want.push_back(TypeName(d));
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has dtype ",
                                                   TypeName(t->dtype), ", expected ",
                                                   absl::StrJoin(want, " or ")));
  }
  if (t->ndim != static_cast<int>(shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has ", t->ndim, " dimensions ",
                                                   ShapeString(t->shape, t->ndim), ", expected ",
                                                   shape.size()));
  }
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] < 0 || (shape[i] >= 0 && t->shape[i] != shape[i])) {
      std::vector<std::string> want;
      for (int64_t d : shape) want.push_back(d < 0 ? "*" : absl::StrCat(d));
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": ", name, " has shape ", ShapeString(t->shape, t->ndim), ", expected [",
          absl::StrJoin(want, ", "), "] (dimension ", i, " is ", t->shape[i], ")"));
    }
    shape[i] = t->shape[i];
  }
  if (t->strides != nullptr) {
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
      if (t->shape[i] != 1 && t->strides[i] != expect) {
        return absl::InvalidArgumentError(
            absl::StrCat(op, ": ", name, " is not contiguous (row-major)"));
      }
      expect *= t->shape[i];
    }
  }
  if (t->data == nullptr) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (n > 0) return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has no data"));
  }
  return absl::OkStatus();
}

const uint8_t* TensorBytes(const DLTensor* t) {
  return static_cast<const uint8_t*>(t->data) + t->byte_offset;
}

int64_t TensorNbytes(const DLTensor* t) {
  int64_t n = (t->dtype.bits * t->dtype.lanes + 7) / 8;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

#if EPD_HAVE_CUDA
/// Makes `device` current for its scope and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      if (cudaSetDevice(device) == cudaSuccess) restore_ = true;
    }
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};
#endif

}  // namespace

// ---------------------------------------------------------------------------------------

/// How long Wait spins on a completion before it sleeps on the completion futex (µs).
constexpr int64_t kSpinBeforeSleepUs = 200;

struct Endpoint::Impl {
  v1::EndpointInfo info;
  v1::GroupSpec spec;
  GroupShape shape;
  EndpointLayout layout;
  ShmRegion region;
  ShmRegion doorbell_region;
  abi::EndpointShmHeader* header = nullptr;
  abi::DoorbellPage* doorbell = nullptr;
  uint8_t* data = nullptr;
  uint64_t next_seq = 1;
  bool woke_engine = false;  ///< The last Submit had to wake the engine.
  std::shared_ptr<const std::atomic<bool>> session_lost;  ///< See OpenEndpoint.
  std::function<absl::Status()> leave;
  bool left = false;
  DLDevice device{kDLCPU, 0};
  bool cuda = false;  ///< CUDA backend: `data` is device memory.
#if EPD_HAVE_CUDA
  internal::CudaAreaMapping mapping;  ///< The data area (CUDA backend).
  bool staged = false;                ///< Copies were issued since the last Submit.
#endif

  uint8_t* At(const Region& r) const { return data + r.offset; }

  /// Copies `t` into region `r` (no copy when it already lives there).
  absl::Status Stage(const char* op, const char* name, const DLTensor* t, const Region& r) {
    int64_t n = TensorNbytes(t);
    if (static_cast<uint64_t>(n) > r.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": ", name, " has ", n, " bytes, more than its staging area (", r.bytes, " bytes)"));
    }
    const uint8_t* src = TensorBytes(t);
    if (src == At(r) || n <= 0) return absl::OkStatus();
#if EPD_HAVE_CUDA
    if (cuda) {
      DeviceGuard guard(mapping.device());
      EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(At(r), src, static_cast<size_t>(n), cudaMemcpyDefault));
      staged = true;
      return absl::OkStatus();
    }
#endif
    std::memcpy(At(r), src, static_cast<size_t>(n));
    return absl::OkStatus();
  }

  /// CUDA backend: waits until every staging copy has landed (cudaMemcpy returns early for
  /// device-to-device and pageable copies), so the daemon's kernels read complete inputs.
  absl::Status FinishStaging() {
#if EPD_HAVE_CUDA
    if (cuda && staged) {
      DeviceGuard guard(mapping.device());
      EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cudaStreamLegacy));
      staged = false;
    }
#endif
    return absl::OkStatus();
  }

  absl::Status CheckUsable() const {
    if (abi::Atomic(header->daemon_closed).load(std::memory_order_acquire) != 0) {
      return absl::UnavailableError("epd is shutting down: it closed this endpoint");
    }
    if (left) {
      return absl::FailedPreconditionError(absl::StrCat("endpoint of group ", spec.name(), " rank ",
                                                        info.rank(), " has left its group"));
    }
    return absl::OkStatus();
  }

  /// Publishes one request; returns its seq.
  absl::StatusOr<uint64_t> Submit(abi::OpKind op, uint32_t flags, int32_t num_tokens,
                                  int32_t expert_alignment, uint64_t handle_seq, int32_t num_sms) {
    EPD_RETURN_IF_ERROR(FinishStaging());
    uint64_t head = abi::Atomic(header->ring_head).load(std::memory_order_relaxed);
    // Bounded wait for ring space (only when many ops are in flight).
    auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(info.op_timeout_ms() + 1000);
    while (head - abi::Atomic(header->ring_tail).load(std::memory_order_acquire) >=
           abi::kRingCapacity) {
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::UnavailableError("epd did not drain the request ring; is the daemon alive?");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    uint64_t seq = next_seq++;
    abi::RequestSlot slot{};
    slot.magic = abi::kRequestMagic;
    slot.op = static_cast<uint32_t>(op);
    slot.seq = seq;
    slot.flags = flags;
    slot.num_tokens = num_tokens;
    slot.expert_alignment = expert_alignment;
    slot.num_sms = num_sms;
    slot.handle_seq = handle_seq;
    auto* ring = reinterpret_cast<abi::RequestSlot*>(region.data() + header->ring_offset);
    std::memcpy(&ring[(head + 1) % abi::kRingCapacity], &slot, sizeof(slot));
    abi::Atomic(header->ring_head).store(head + 1, std::memory_order_seq_cst);
    // When the engine was asleep, do not spin on this CPU afterwards: the scheduler may
    // place the woken engine here, behind our spin (measured: +70–100 µs in a VM).
    woke_engine = RingDoorbell(doorbell);
    return seq;
  }

  /// Reports a client-side validation error to the group (so the other ranks' op fails
  /// promptly instead of timing out, and sequence numbers stay aligned), waits for the
  /// daemon's completion, and returns `error`.
  absl::Status SubmitClientError(abi::OpKind op, absl::Status error) {
    absl::StatusOr<uint64_t> seq = Submit(op, abi::kFlagClientError, 0, 1, 0, 0);
    if (seq.ok()) {
      abi::Completion c;
      (void)WaitCompletion(*seq, absl::Milliseconds(info.op_timeout_ms() + 5000), &c);
    }
    return error;
  }

  /// Waits for the completion of `seq`.
  absl::Status WaitCompletion(uint64_t seq, absl::Duration timeout, abi::Completion* out) {
    abi::Completion& c = reinterpret_cast<abi::Completion*>(
        region.data() + header->completion_offset)[seq % abi::kCompletionCapacity];
    const auto start = std::chrono::steady_clock::now();
    const auto limit = timeout == absl::InfiniteDuration()
                           ? std::chrono::steady_clock::time_point::max()
                           : start + absl::ToChronoNanoseconds(timeout);
    // The daemon bounds every op by op_timeout; far past it, the daemon is gone.
    const auto daemon_gone =
        start + std::chrono::milliseconds(info.op_timeout_ms()) + std::chrono::seconds(5);
    // Spin this long before sleeping on the futex: an op's own completion usually comes
    // within it, and a futex wake-up costs a scheduler round trip (~100 µs in a VM).
    const auto spin_until = start + std::chrono::microseconds(
                                        std::exchange(woke_engine, false) ? 0 : kSpinBeforeSleepUs);
    while (abi::Atomic(c.seq).load(std::memory_order_acquire) != seq) {
      auto now = std::chrono::steady_clock::now();
      if (now >= limit) {
        return absl::DeadlineExceededError(
            absl::StrCat("op ", seq, " not complete after ", absl::FormatDuration(timeout)));
      }
      if (session_lost && session_lost->load() &&
          abi::Atomic(c.seq).load(std::memory_order_acquire) != seq) {
        return absl::UnavailableError(absl::StrCat(
            "op ", seq, ": the Session with epd ended (the daemon died or restarted)"));
      }
      if (abi::Atomic(header->daemon_closed).load(std::memory_order_acquire) != 0 &&
          abi::Atomic(c.seq).load(std::memory_order_acquire) != seq) {
        return absl::UnavailableError(
            absl::StrCat("op ", seq, ": epd is shutting down: it closed this endpoint"));
      }
      if (now >= daemon_gone) {
        return absl::UnavailableError(
            absl::StrCat("op ", seq,
                         ": no completion from epd within op_timeout + 5 s; the daemon is gone "
                         "or stuck"));
      }
      if (now < spin_until) continue;
      uint32_t word = abi::Atomic(header->completion_futex).load(std::memory_order_seq_cst);
      abi::Atomic(header->client_waiting).store(1, std::memory_order_seq_cst);
      if (abi::Atomic(c.seq).load(std::memory_order_seq_cst) != seq) {
        FutexWait(&header->completion_futex, word, 2000);
      }
      abi::Atomic(header->client_waiting).store(0, std::memory_order_relaxed);
    }
    std::memcpy(out, &c, sizeof(c));
    if (out->status_code != 0) {
      out->message[abi::kMessageBytes - 1] = '\0';
      return absl::Status(static_cast<absl::StatusCode>(out->status_code), out->message);
    }
    return absl::OkStatus();
  }

  TensorView View(const Region& r, DLDataType dtype, std::vector<int64_t> shape) const {
    return TensorView(At(r), dtype, device, std::move(shape));
  }
};

Endpoint::Endpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Endpoint::~Endpoint() { (void)Leave(); }
const v1::EndpointInfo& Endpoint::info() const { return impl_->info; }
const v1::GroupSpec& Endpoint::spec() const { return impl_->spec; }
int32_t Endpoint::rank() const { return impl_->info.rank(); }

absl::Status Endpoint::Leave() {
  if (impl_->left) return absl::OkStatus();
  impl_->left = true;
  return impl_->leave ? impl_->leave() : absl::OkStatus();
}

// ---- op submission ---------------------------------------------------------------------

absl::StatusOr<PendingOp<LayoutResult>> Endpoint::GetDispatchLayout(const DLTensor& topk_idx) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  constexpr const char* kOp = "GetDispatchLayout";
  const auto op = abi::OpKind::kGetDispatchLayout;
  std::vector<int64_t> shape{-1, m.shape.num_topk};
  absl::Status st = CheckTensor(m.cuda, kOp, "topk_idx", &topk_idx, {kI64}, shape);
  if (st.ok() && shape[0] > m.shape.max_tokens_per_rank) {
    st = absl::InvalidArgumentError(absl::StrCat(
        kOp, ": num_tokens ", shape[0], " > max_tokens_per_rank ", m.shape.max_tokens_per_rank));
  }
  if (st.ok()) st = m.Stage(kOp, "topk_idx", &topk_idx, m.layout.in_topk_idx);
  if (!st.ok()) return m.SubmitClientError(op, st);
  const int32_t T = static_cast<int32_t>(shape[0]);
  EPD_ASSIGN_OR_RETURN(uint64_t seq, m.Submit(op, 0, T, 1, 0, 0));
  LayoutResult r;
  r.num_tokens_per_rank = m.View(m.layout.layout_tokens_per_rank, kI32, {m.shape.num_ranks});
  r.num_tokens_per_expert = m.View(m.layout.layout_tokens_per_expert, kI32, {m.shape.num_experts});
  r.is_token_in_rank = m.View(m.layout.layout_is_token_in_rank, kBool, {T, m.shape.num_ranks});
  return PendingOp<LayoutResult>(this, seq, std::move(r));
}

absl::StatusOr<PendingOp<DispatchResult>> Endpoint::Dispatch(const DispatchArgs& args) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  constexpr const char* kOp = "Dispatch";
  const auto op = abi::OpKind::kDispatch;
  const int H = m.shape.hidden, K = m.shape.num_topk;
  absl::Status st;
  std::vector<int64_t> xs{-1, H};
  st = CheckTensor(m.cuda, kOp, "x", args.x, {kBf16, kE4m3}, xs);
  const bool fp8 = st.ok() && SameType(args.x->dtype, kE4m3);
  const int64_t T = st.ok() ? xs[0] : 0;
  if (st.ok() && T > m.shape.max_tokens_per_rank) {
    st = absl::InvalidArgumentError(absl::StrCat(
        kOp, ": x has ", T, " tokens > max_tokens_per_rank ", m.shape.max_tokens_per_rank));
  }
  if (st.ok() && fp8 && !m.shape.use_fp8) {
    st = absl::InvalidArgumentError(absl::StrCat(kOp, ": x is float8_e4m3fn but group ",
                                                 m.spec.name(), " has use_fp8 = false"));
  }
  if (st.ok() && fp8) {
    std::vector<int64_t> ss{T, m.shape.num_scales()};
    st = CheckTensor(m.cuda, kOp, "x_scales", args.x_scales, {kF32}, ss);
  }
  if (st.ok() && args.expert_alignment < 1) {
    st = absl::InvalidArgumentError(
        absl::StrCat(kOp, ": expert_alignment ", args.expert_alignment, " must be >= 1"));
  }
  const Handle* cached = args.cached ? &*args.cached : nullptr;
  if (st.ok() && cached) {
    if (cached->endpoint_id != m.info.endpoint_id() || cached->low_latency) {
      st = absl::FailedPreconditionError(absl::StrCat(
          kOp, ": cached handle comes from another endpoint or from a low-latency dispatch"));
    } else if (cached->num_tokens != T) {
      st = absl::InvalidArgumentError(absl::StrCat(
          kOp, ": x has ", T, " tokens but the cached handle's dispatch had ", cached->num_tokens));
    }
  }
  if (st.ok() && !cached) {
    std::vector<int64_t> ts{T, K};
    st = CheckTensor(m.cuda, kOp, "topk_idx", args.topk_idx, {kI64}, ts);
  }
  const bool weights = !cached && args.topk_weights != nullptr;
  if (st.ok() && weights) {
    std::vector<int64_t> ws{T, K};
    st = CheckTensor(m.cuda, kOp, "topk_weights", args.topk_weights, {kF32}, ws);
  }
  if (st.ok()) st = m.Stage(kOp, "x", args.x, m.layout.in_x);
  if (st.ok() && fp8) st = m.Stage(kOp, "x_scales", args.x_scales, m.layout.in_scales);
  if (st.ok() && !cached) st = m.Stage(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx);
  if (st.ok() && weights) {
    st = m.Stage(kOp, "topk_weights", args.topk_weights, m.layout.in_topk_weights);
  }
  if (!st.ok()) return m.SubmitClientError(op, st);
  uint32_t flags = (fp8 ? abi::kFlagFp8 : 0) | (cached ? abi::kFlagCachedHandle : 0) |
                   (weights ? abi::kFlagDispatchWeights : 0);
  EPD_ASSIGN_OR_RETURN(uint64_t seq,
                       m.Submit(op, flags, static_cast<int32_t>(T), args.expert_alignment,
                                cached ? cached->seq : 0, args.num_sms));
  DispatchResult r;
  r.handle.endpoint_id = m.info.endpoint_id();
  r.handle.seq = seq;
  r.handle.num_tokens = static_cast<int32_t>(T);
  r.handle.use_fp8 = fp8;
  r.handle.low_latency = false;
  // Shapes need N: filled in by Wait.
  return PendingOp<DispatchResult>(this, seq, std::move(r));
}

absl::StatusOr<PendingOp<CombineResult>> Endpoint::Combine(const CombineArgs& args) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  constexpr const char* kOp = "Combine";
  const auto op = abi::OpKind::kCombine;
  absl::Status st;
  if (args.handle == nullptr) {
    st = absl::InvalidArgumentError(absl::StrCat(kOp, ": handle is required"));
  } else if (args.handle->endpoint_id != m.info.endpoint_id() || args.handle->low_latency) {
    st = absl::FailedPreconditionError(absl::StrCat(
        kOp,
        ": the handle comes from another endpoint (group or rank) or from a low-latency "
        "dispatch"));
  }
  const int64_t N = args.handle ? args.handle->num_recv_tokens : 0;
  if (st.ok()) {
    std::vector<int64_t> xs{N, m.shape.hidden};
    st = CheckTensor(m.cuda, kOp, "x", args.x, {kBf16}, xs);
  }
  const bool weights = args.topk_weights != nullptr;
  if (st.ok() && weights) {
    std::vector<int64_t> ws{N, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_weights", args.topk_weights, {kF32}, ws);
  }
  if (st.ok()) st = m.Stage(kOp, "x", args.x, m.layout.in_combine_x);
  if (st.ok() && weights) {
    st = m.Stage(kOp, "topk_weights", args.topk_weights, m.layout.in_combine_weights);
  }
  if (!st.ok()) return m.SubmitClientError(op, st);
  const int32_t T = args.handle->num_tokens;
  EPD_ASSIGN_OR_RETURN(uint64_t seq, m.Submit(op, weights ? abi::kFlagCombineWeights : 0, T, 1,
                                              args.handle->seq, args.num_sms));
  CombineResult r;
  r.combined_x = m.View(m.layout.combined_x, kBf16, {T, m.shape.hidden});
  if (weights) {
    r.combined_topk_weights = m.View(m.layout.combined_topk_weights, kF32, {T, m.shape.num_topk});
  }
  return PendingOp<CombineResult>(this, seq, std::move(r));
}

absl::StatusOr<PendingOp<LowLatencyDispatchResult>> Endpoint::LowLatencyDispatch(
    const LowLatencyDispatchArgs& args) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  constexpr const char* kOp = "LowLatencyDispatch";
  const auto op = abi::OpKind::kLowLatencyDispatch;
  const int32_t Mll = m.shape.ll_max_tokens_per_rank;
  absl::Status st;
  if (Mll == 0) {
    st = absl::FailedPreconditionError(absl::StrCat(
        kOp, ": group ", m.spec.name(), " has ll_max_tokens_per_rank = 0 (low-latency disabled)"));
  } else if (args.max_dispatch_tokens_per_rank != 0 && args.max_dispatch_tokens_per_rank != Mll) {
    st = absl::InvalidArgumentError(absl::StrCat(kOp, ": max_dispatch_tokens_per_rank ",
                                                 args.max_dispatch_tokens_per_rank,
                                                 " != the group's ll_max_tokens_per_rank ", Mll));
  }
  std::vector<int64_t> xs{-1, m.shape.hidden};
  if (st.ok()) st = CheckTensor(m.cuda, kOp, "x", args.x, {kBf16}, xs);
  const int64_t T = st.ok() ? xs[0] : 0;
  if (st.ok() && T > Mll) {
    st = absl::InvalidArgumentError(
        absl::StrCat(kOp, ": x has ", T, " tokens > max_dispatch_tokens_per_rank ", Mll));
  }
  if (st.ok() && args.use_fp8 && m.shape.hidden % kernels::kFp8BlockChannels != 0) {
    st = absl::InvalidArgumentError(
        absl::StrCat(kOp, ": use_fp8 needs hidden % 128 == 0, hidden = ", m.shape.hidden));
  }
  if (st.ok() && args.use_fp8 && !m.shape.use_fp8) {
    st = absl::InvalidArgumentError(
        absl::StrCat(kOp, ": use_fp8 but group ", m.spec.name(), " has use_fp8 = false"));
  }
  if (st.ok()) {
    std::vector<int64_t> ts{T, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_idx", args.topk_idx, {kI64}, ts);
  }
  if (st.ok()) st = m.Stage(kOp, "x", args.x, m.layout.in_x);
  if (st.ok()) st = m.Stage(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx);
  if (!st.ok()) return m.SubmitClientError(op, st);
  uint32_t flags =
      (args.use_fp8 ? abi::kFlagFp8 : 0) | (args.round_scale ? abi::kFlagRoundScale : 0);
  EPD_ASSIGN_OR_RETURN(uint64_t seq, m.Submit(op, flags, static_cast<int32_t>(T), 1, 0, 0));
  LowLatencyDispatchResult r;
  r.handle.endpoint_id = m.info.endpoint_id();
  r.handle.seq = seq;
  r.handle.low_latency = true;
  r.handle.num_tokens = static_cast<int32_t>(T);
  r.handle.use_fp8 = args.use_fp8;
  return PendingOp<LowLatencyDispatchResult>(this, seq, std::move(r));
}

absl::StatusOr<PendingOp<LowLatencyCombineResult>> Endpoint::LowLatencyCombine(
    const LowLatencyCombineArgs& args) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  constexpr const char* kOp = "LowLatencyCombine";
  const auto op = abi::OpKind::kLowLatencyCombine;
  const int64_t El = m.shape.num_local_experts();
  const int64_t rows = m.shape.ll_rows_per_expert();
  absl::Status st;
  if (args.handle == nullptr) {
    st = absl::InvalidArgumentError(absl::StrCat(kOp, ": handle is required"));
  } else if (args.handle->endpoint_id != m.info.endpoint_id() || !args.handle->low_latency) {
    st = absl::FailedPreconditionError(
        absl::StrCat(kOp,
                     ": the handle comes from another endpoint (group or rank) or from a normal "
                     "dispatch"));
  }
  const int64_t T = args.handle ? args.handle->num_tokens : 0;
  if (st.ok()) {
    std::vector<int64_t> xs{El, rows, m.shape.hidden};
    st = CheckTensor(m.cuda, kOp, "x", args.x, {kBf16}, xs);
  }
  if (st.ok()) {
    std::vector<int64_t> ts{T, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_idx", args.topk_idx, {kI64}, ts);
  }
  if (st.ok()) {
    std::vector<int64_t> ws{T, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_weights", args.topk_weights, {kF32}, ws);
  }
  if (st.ok()) st = m.Stage(kOp, "x", args.x, m.layout.in_ll_combine_x);
  if (st.ok()) st = m.Stage(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx);
  if (st.ok()) st = m.Stage(kOp, "topk_weights", args.topk_weights, m.layout.in_topk_weights);
  if (!st.ok()) return m.SubmitClientError(op, st);
  EPD_ASSIGN_OR_RETURN(uint64_t seq,
                       m.Submit(op, 0, static_cast<int32_t>(T), 1, args.handle->seq, 0));
  return PendingOp<LowLatencyCombineResult>(this, seq, LowLatencyCombineResult{});
}

// ---- completion ------------------------------------------------------------------------

template <typename Result>
absl::StatusOr<Result> PendingOp<Result>::Wait(absl::Duration timeout) {
  Endpoint::Impl& m = endpoint_->impl();
  abi::Completion c;
  EPD_RETURN_IF_ERROR(m.WaitCompletion(seq_, timeout, &c));
  Result r = partial_;
  if constexpr (std::is_same_v<Result, DispatchResult>) {
    const int64_t N = c.num_recv_tokens;
    const int64_t H = m.shape.hidden, K = m.shape.num_topk;
    const bool fp8 = r.handle.use_fp8;
    r.num_recv_tokens = c.num_recv_tokens;
    r.handle.num_recv_tokens = c.num_recv_tokens;
    r.recv_x = m.View(m.layout.recv_x, fp8 ? kE4m3 : kBf16, {N, H});
    if (fp8) r.recv_scales = m.View(m.layout.recv_scales, kF32, {N, m.shape.num_scales()});
    r.recv_topk_idx = m.View(m.layout.recv_topk_idx, kI64, {N, K});
    r.recv_topk_weights = m.View(m.layout.recv_topk_weights, kF32, {N, K});
    r.num_recv_tokens_per_expert =
        m.View(m.layout.recv_tokens_per_expert, kI32, {m.shape.num_local_experts()});
    r.recv_src_info = m.View(m.layout.recv_src_info, kI32, {N});
  } else if constexpr (std::is_same_v<Result, LowLatencyDispatchResult>) {
    const int b = c.buffer & 1;
    const int64_t El = m.shape.num_local_experts(), rows = m.shape.ll_rows_per_expert();
    const bool fp8 = r.handle.use_fp8;
    r.handle.buffer = b;
    r.recv_x = m.View(m.layout.ll_recv_x[b], fp8 ? kE4m3 : kBf16, {El, rows, m.shape.hidden});
    if (fp8)
      r.recv_scales = m.View(m.layout.ll_recv_scales[b], kF32, {El, rows, m.shape.num_scales()});
    r.recv_count = m.View(m.layout.ll_recv_count[b], kI32, {El});
    r.recv_src_info = m.View(m.layout.ll_recv_src_info[b], kI32, {El, rows});
  } else if constexpr (std::is_same_v<Result, LowLatencyCombineResult>) {
    const int b = c.buffer & 1;
    // The daemon reports this rank's T in num_recv_tokens for low-latency combine.
    r.combined_x = m.View(m.layout.ll_combined_x[b], kBf16,
                          {static_cast<int64_t>(c.num_recv_tokens), m.shape.hidden});
  }
  return r;
}

template class PendingOp<LayoutResult>;
template class PendingOp<DispatchResult>;
template class PendingOp<CombineResult>;
template class PendingOp<LowLatencyDispatchResult>;
template class PendingOp<LowLatencyCombineResult>;

// ---- opening ---------------------------------------------------------------------------

namespace internal {

absl::StatusOr<std::unique_ptr<Endpoint>> OpenEndpoint(
    const v1::EndpointInfo& info, const v1::GroupSpec& spec, std::function<absl::Status()> leave,
    std::shared_ptr<const std::atomic<bool>> session_lost) {
  auto m = std::make_unique<Endpoint::Impl>();
  m->info = info;
  m->spec = spec;
  m->leave = std::move(leave);
  m->session_lost = std::move(session_lost);
  m->shape.num_ranks = spec.num_ranks();
  m->shape.num_experts = spec.num_experts();
  m->shape.hidden = spec.hidden();
  m->shape.num_topk = spec.num_topk();
  m->shape.max_tokens_per_rank = spec.max_tokens_per_rank();
  m->shape.ll_max_tokens_per_rank = spec.ll_max_tokens_per_rank();
  m->shape.use_fp8 = spec.use_fp8();
  m->layout = EndpointLayout::Compute(m->shape);
  if (info.abi_version() != abi::kShmAbiVersion) {
    return absl::FailedPreconditionError(absl::StrCat("epd speaks shm ABI ", info.abi_version(),
                                                      ", this client ", abi::kShmAbiVersion));
  }
  if (info.backend() == "cuda") {
#if EPD_HAVE_CUDA
    m->cuda = true;
#else
    return absl::UnimplementedError(
        "the daemon offers a CUDA-backend endpoint but this libepdclient was built without "
        "CUDA");
#endif
  } else if (info.backend() != "host") {
    return absl::UnimplementedError(
        absl::StrCat("this libepdclient maps 'host' and 'cuda' endpoints; the daemon offers '",
                     info.backend(), "'"));
  }
  // The daemon's regions must be the ones this client computes (same layout version).
  std::map<std::string, kernels::Region> mine;
  m->layout.ForEachRegion([&](const char* n, const Region& r) { mine[n] = r; });
  for (const v1::BufferRegion& br : info.regions()) {
    auto it = mine.find(br.name());
    if (it == mine.end() || it->second.offset != br.offset() || it->second.bytes != br.bytes()) {
      return absl::FailedPreconditionError(
          absl::StrCat("buffer region '", br.name(), "' differs between epd and this client"));
    }
  }
  EPD_ASSIGN_OR_RETURN(m->region, ShmRegion::Open(info.shm_name(), info.shm_bytes()));
  EPD_ASSIGN_OR_RETURN(m->doorbell_region,
                       ShmRegion::Open(info.doorbell_shm_name(), sizeof(abi::DoorbellPage)));
  m->header = reinterpret_cast<abi::EndpointShmHeader*>(m->region.data());
  m->doorbell = reinterpret_cast<abi::DoorbellPage*>(m->doorbell_region.data());
  const abi::EndpointShmHeader& h = *m->header;
  if (h.magic != abi::kEndpointMagic || h.version != abi::kShmAbiVersion ||
      h.size != sizeof(abi::EndpointShmHeader) || h.total_bytes != info.shm_bytes() ||
      h.data_offset != info.data_offset() || h.data_bytes < m->layout.total_bytes ||
      m->doorbell->magic != abi::kDoorbellMagic) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm region ", info.shm_name(), " has a bad header (magic/version/size)"));
  }
  m->data = m->region.data() + h.data_offset;
#if EPD_HAVE_CUDA
  if (m->cuda) {
    EPD_ASSIGN_OR_RETURN(m->mapping,
                         internal::CudaAreaMapping::Open(info.cuda_ipc_handle(), info.gpu_uuid()));
    m->data = m->mapping.data();
    m->device = DLDevice{kDLCUDA, m->mapping.device()};
  }
#endif
  m->next_seq = info.first_seq();
  abi::Atomic(m->header->client_pid).store(static_cast<uint32_t>(::getpid()));
  abi::Atomic(m->header->client_mapped).store(1, std::memory_order_release);
  return std::make_unique<Endpoint>(std::move(m));
}

}  // namespace internal
}  // namespace epd
