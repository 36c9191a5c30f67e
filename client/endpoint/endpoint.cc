// Endpoint: the client side of the data plane (DESIGN.md §3.2–§3.3).
//
// Host backend: the data area is in the shm region; tensors are kDLCPU. Each op validates
// the DLPack inputs, copies them into the endpoint's staging regions (skipped when a tensor
// already lives there), publishes a RequestSlot and rings the engine's doorbell;
// PendingOp::Wait reads the Completion and builds the output views.
//
// CUDA backend (built with CUDA): the data area is GPU memory mapped by CUDA IPC
// (cuda_ipc.h); inputs may be kDLCUDA, kDLCUDAHost or kDLCPU; output views are kDLCUDA on
// this process's ordinal of the endpoint's GPU. Every op is ordered on the caller's stream
// (the args' `stream`; null = the legacy default stream), in one of two launch modes:
//  - daemon-launched (DESIGN §3.2, stream-ordered hand-off): on the stream, one kernel
//    stages the inputs on the endpoint's GPU and then sets launch_flags.ready_seq to the
//    op's seq (kc::CopyDeviceBatchAsync; other inputs are copied with cudaMemcpyAsync
//    before it); the slot is published with kFlagStreamOrdered; then
//    cuStreamWaitValue64(done_seq >= seq) holds the stream's later work until the daemon's
//    kernels are done (a low-latency op under MPS, EndpointInfo kernel_done_wait: the
//    staging kernel itself waits for done_seq, kc::DoneWait, and no stream wait follows).
//    An op on another stream than the endpoint's previous one first waits
//    for that op's done_seq (OrderAfterPreviousOp). Nothing synchronises the CPU per op;
//    Wait reads the CPU completion.
//    When the daemon dies or closes the endpoint, the stream is released by writing
//    done_seq = kReleasedSeq from the host.
//  - client-launched: the client launches the kernels of kernels/include/epd/kernels/
//    {cuda_ops.h,cuda_normal.h} itself on the caller's stream, on every rank's data area
//    (mapped once, from GetGroupEndpoints, before the first op); the daemon's ring is not
//    used. Wait waits for an event recorded after the op and reads the op's DeviceStatus.
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cuda/area_cache.h"
#include "client/cuda/cuda_ipc.h"
#include "client/endpoint/endpoint_internal.h"
#include "common/os/futex.h"
#include "common/os/shm_region.h"
#include "common/status_macros.h"
#include "epd/client.h"
#include "epd/kernels/layout.h"
#include "proto/abi/shm_abi.h"

#if EPD_HAVE_CUDA
#include <cuda_runtime.h>

#include "epd/kernels/cuda_normal.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_program.h"
#endif

namespace epd {
namespace {

using kernels::EndpointLayout;
using kernels::GroupShape;
using kernels::Region;

constexpr DLDataType kBf16{kDLBfloat, 16, 1};
constexpr DLDataType kE4m3 = kDLFloat8E4m3fn;  // client.h
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

/// Checks that `t`'s first element, data + byte_offset, is aligned to its dtype's element
/// size (bf16: 2 bytes, f32 and int32: 4, int64: 8): the host kernels and the CUDA kernels
/// that read a tensor in place load whole elements, and a misaligned one is undefined
/// behaviour. A tensor with no data pointer (empty) passes. INVALID_ARGUMENT naming `op`,
/// `name`, the address, data + byte_offset and the alignment required.
absl::Status CheckTensorAlignment(const char* op, const char* name, const DLTensor* t) {
  const uint64_t alignment = (t->dtype.bits + 7u) / 8u;
  if (t->data == nullptr || alignment <= 1) return absl::OkStatus();
  const uintptr_t address = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
  if (address % alignment == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", name, " starts at address 0x", absl::Hex(address), " (data 0x",
                   absl::Hex(reinterpret_cast<uintptr_t>(t->data)), " + byte_offset ",
                   t->byte_offset, "), which is not aligned to ", alignment, " bytes as its dtype ",
                   TypeName(t->dtype), " requires"));
}

/// Checks a DLTensor against an expected dtype and shape (-1 = any size; the size found
/// is written back into `shape`). Names the argument and the offending value.
/// `cuda`: the endpoint is on the CUDA backend, which also takes kDLCUDA tensors.
/// Also checks the first element's alignment (CheckTensorAlignment).
/// Allocates nothing when the tensor passes (the ops pass a std::array: README "Hot path").
absl::Status CheckTensor(bool cuda, const char* op, const char* name, const DLTensor* t,
                         std::initializer_list<DLDataType> dtypes, std::span<int64_t> shape) {
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is required"));
  if (t->ndim < 0 || t->ndim > 8 || (t->ndim > 0 && t->shape == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", name, " is a malformed DLTensor: ndim = ", t->ndim,
        t->ndim > 0 && t->shape == nullptr ? " with a null shape array" : " (expected 0 to 8)"));
  }
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
  return CheckTensorAlignment(op, name, t);
}

const uint8_t* TensorBytes(const DLTensor* t) {
  return static_cast<const uint8_t*>(t->data) + t->byte_offset;
}

int64_t TensorNbytes(const DLTensor* t) {
  int64_t n = (t->dtype.bits * t->dtype.lanes + 7) / 8;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

using abi::OpKindName;

/// The op kind whose result type is `Result`.
template <typename Result>
constexpr abi::OpKind OpKindOf() {
  if constexpr (std::is_same_v<Result, LayoutResult>) return abi::OpKind::kGetDispatchLayout;
  if constexpr (std::is_same_v<Result, DispatchResult>) return abi::OpKind::kDispatch;
  if constexpr (std::is_same_v<Result, CombineResult>) return abi::OpKind::kCombine;
  if constexpr (std::is_same_v<Result, LowLatencyDispatchResult>) {
    return abi::OpKind::kLowLatencyDispatch;
  }
  return abi::OpKind::kLowLatencyCombine;
}

#if EPD_HAVE_CUDA
namespace kc = kernels::cuda;

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

/// Whether a kernel on `device` can read `t` in place: device memory of that GPU, with
/// its first element `alignment`-aligned (the kernels load 16-byte vectors of x).
bool ReadableInPlace(const DLTensor* t, int device, uintptr_t alignment) {
  return t != nullptr && t->device.device_type == kDLCUDA && t->device.device_id == device &&
         reinterpret_cast<uintptr_t>(TensorBytes(t)) % alignment == 0;
}

/// The op's error from the DeviceStatus its kernels left (kernels/cuda StatusFromDevice).
absl::Status DeviceStatusOf(const kc::DeviceStatus& status, const GroupShape& shape, int32_t rank,
                            abi::OpKind op) {
  const bool low_latency =
      op == abi::OpKind::kLowLatencyDispatch || op == abi::OpKind::kLowLatencyCombine;
  return kc::StatusFromDevice(status, shape, rank, OpKindName(op), low_latency);
}

/// Loads every kernel on the current device once per process (DESIGN.md §3.2: a lazily
/// loaded kernel's first launch waits for running kernels, which deadlocks kernels that
/// spin on each other).
absl::Status PreloadKernelsOnce(int device) {
  static std::mutex mu;
  static std::set<int>* loaded = new std::set<int>();
  std::lock_guard<std::mutex> lock(mu);
  if (loaded->count(device) > 0) return absl::OkStatus();
  EPD_RETURN_IF_ERROR(kc::PreloadKernels());
  loaded->insert(device);
  return absl::OkStatus();
}
#endif

}  // namespace

// ---- SessionWatch ----------------------------------------------------------------------

namespace internal {

void SessionWatch::MarkLost() {
  std::lock_guard<std::mutex> lock(mu_);
  if (lost_.exchange(true, std::memory_order_acq_rel)) return;
  for (auto& [id, hook] : hooks_) hook();
  hooks_.clear();
}

uint64_t SessionWatch::AddHook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  if (lost_.load(std::memory_order_acquire)) {
    hook();
  } else {
    hooks_.emplace(id, std::move(hook));
  }
  return id;
}

void SessionWatch::RemoveHook(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  hooks_.erase(id);
}

}  // namespace internal

// ---------------------------------------------------------------------------------------

/// How long Wait spins on a completion before it sleeps on the completion futex (µs).
constexpr int64_t kSpinBeforeSleepUs = 200;
/// Extra time past op_timeout that a client-launched Wait gives the op's stream (its
/// kernels bound their own waits by op_timeout) before it reports the stream stuck.
constexpr auto kGpuGrace = std::chrono::seconds(5);
/// Bound of a staging kernel's wait for done_seq (kc::DoneWait), in ms of op_timeout:
/// 3 * op_timeout + kDoneWaitSlackMs counted from the staging. A successful op stores done
/// within about 2 * op_timeout of it (the daemon waits up to op_timeout for the other ranks'
/// requests, then the kernel's peer waits up to op_timeout) and a failed dispatch within
/// one more (its block 0 waits for the others' tickets); the engine's give-up is
/// op_timeout + 5 s after its launch. So the bound passes only when the daemon is gone or
/// stuck, whose op's Wait fails anyway.
constexpr int64_t kDoneWaitTimeouts = 3;
constexpr int64_t kDoneWaitSlackMs = 15'000;

#if EPD_HAVE_CUDA
/// Client-launched mode: what an endpoint keeps to launch its own kernels, set up once
/// before its first op (Endpoint::Impl::EnsureClientLaunch). No op allocates.
struct ClientLaunch {
  /// Ops whose completion records are kept: Wait works for the latest kSlots ops.
  static constexpr uint32_t kSlots = abi::kCompletionCapacity;
  /// What an op's stream copies back after its kernels (pinned host memory).
  struct Readback {
    kc::DeviceStatus status;
    int32_t recv_count;  ///< Dispatch: N.
    int32_t reserved[15];
  };
  /// The op last recorded in a completion slot.
  struct Slot {
    uint64_t seq = 0;
    bool captured = false;  ///< Enqueued while the stream was capturing a CUDA graph.
    /// A low-latency op: no read-back was enqueued after it (it would cost two stream ops
    /// per op on the decode hot path, where ops are rarely waited for); Wait enqueues it on
    /// `stream` when it is called.
    bool deferred = false;
    cudaStream_t stream = nullptr;
  };

  std::vector<std::shared_ptr<const internal::CudaAreaMapping>> areas;  ///< [R], own included.
  internal::DeviceMemory peer_bases;  ///< Device array [R] of the areas' bases.
  kc::CudaRankContext ctx;
  internal::PinnedMemory readback_memory;     ///< Readback [kSlots + 1]; the last for Wait
                                              ///< of a captured op (synchronous read).
  std::vector<internal::EventHandle> events;  ///< [kSlots]: recorded after each op.
  std::array<Slot, kSlots> slots;

  Readback& readback(uint32_t i) { return reinterpret_cast<Readback*>(readback_memory.get())[i]; }
};
#endif

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
  bool woke_engine = false;                         ///< The last Submit had to wake the engine.
  std::shared_ptr<internal::SessionWatch> session;  ///< See OpenEndpoint.
  uint64_t session_hook = 0;                        ///< Our hook in `session` (0 = none).
  std::function<absl::Status()> leave;
  bool left = false;
  DLDevice device{kDLCPU, 0};
  bool cuda = false;  ///< CUDA backend: `data` is device memory.

  // Handle state kept by the client. Client-launched: authoritative (it validates handles
  // and picks the low-latency buffers, by the daemon's rule: buffers alternate per
  // low-latency dispatch, and per low-latency combine for the output). Daemon-launched:
  // only predicts the daemon's buffer choice for Enqueued() (Wait uses the completion's).
  uint64_t ll_dispatches = 0;  ///< Low-latency dispatches counted for the buffer parity.
  uint64_t ll_combines = 0;
  uint64_t ll_seq[kernels::kLowLatencyBuffers] = {0, 0};  ///< Dispatch that wrote buffer b.
  int32_t ll_tokens[kernels::kLowLatencyBuffers] = {0, 0};
  bool ll_runtime_tokens[kernels::kLowLatencyBuffers] = {false, false};  ///< T on device.
  uint64_t routing_seq = 0;  ///< Normal dispatch whose routing (send_pos) is current.
  uint64_t last_dispatch_seq = 0;
  int32_t routing_tokens = 0;
  /// Seqs whose failure was already accounted (Wait may be called again).
  std::array<uint64_t, abi::kCompletionCapacity> failure_noted{};

  /// EndpointInfo kernel_done_wait, and this process sees MPS on the endpoint's GPU too
  /// (cudaDevAttrMpsEnabled): without MPS here, a spinning staging kernel would hold the
  /// GPU's time slice that the daemon's kernels need, whatever the daemon sees. Always
  /// false without CUDA.
  bool kernel_done_wait = false;
#if EPD_HAVE_CUDA
  std::shared_ptr<const internal::CudaAreaMapping> mapping;  ///< The data area.
  bool client_launched = false;
  internal::GroupEndpointsFn group_endpoints;
  internal::StreamHandle aux_stream;  ///< The library's own stream (releases, reads).
  std::atomic<bool> stream_released{false};
  /// Stream-ordered ops published, by seq % size (ReleaseStreams checks which are done).
  std::array<std::atomic<uint64_t>, abi::kCompletionCapacity> ordered_ops{};
  /// Daemon-launched: copies of the op being built that Submit enqueues in one kernel with
  /// the ready signal (StageForSubmit; kc::CopyDeviceBatchAsync).
  std::array<kc::DeviceCopy, kc::kMaxBatchCopies> pending_copies{};
  int num_pending_copies = 0;
  /// Daemon-launched: the stream and seq of the last stream-ordered op (OrderAfterPreviousOp).
  cudaStream_t last_ordered_stream = nullptr;
  uint64_t last_ordered_seq = 0;
  std::unique_ptr<ClientLaunch> cl;    ///< Client-launched state, after the first op.
  internal::StreamHandle own_stream;   ///< Runs the ops given no stream (OpStream).
  internal::EventHandle legacy_event;  ///< Orders own_stream after the legacy stream.
#endif
  // Graph mode: the registered program (empty = none), the next step's index, and the
  // daemon's error count already returned by ProgramStatus.
  std::vector<ProgramStep> program;
  std::vector<int> program_buffer;      ///< Per step: dispatch/handle buffer (see client.h).
  std::vector<int> program_out_buffer;  ///< Per step: combine output buffer.
  size_t program_next = 0;
  uint64_t program_errors_seen = 0;
#if EPD_HAVE_CUDA
  /// Pinned uint64 ProgramStatus reads launch_flags' program instance into (with a kernel:
  /// a device-to-host copy could queue behind the daemon's waiting instances, see
  /// epd/kernels/cuda_program.h). Allocated by the first RegisterProgram.
  internal::PinnedMemory program_word;
#endif
  /// Ops given no stream, by seq % size: Enqueued() refuses them.
  std::array<uint64_t, abi::kCompletionCapacity> unordered_ops{};

  ~Impl() {
    if (session != nullptr && session_hook != 0) session->RemoveHook(session_hook);
    // A stream still waiting for an op of this endpoint would wait on memory about to be
    // unmapped: release it first (best effort; callers should Wait before destroying).
    ReleaseStreams();
  }

  uint8_t* At(const Region& r) const { return data + r.offset; }

  /// The stream an op runs on (CUDA backend): the caller's `stream`; or, for a null
  /// stream, the endpoint's own stream, made to wait (on the GPU) for the caller's earlier
  /// work on the legacy default stream. An op given no stream is not ordered before any
  /// caller work: its results are valid once Wait returns. (Ordering it on the legacy
  /// stream itself would put every endpoint of a process that passes no stream on one
  /// stream, where one rank's op waits for another's, which waits for the first.)
  /// Host backend: null.
  absl::StatusOr<void*> OpStream(void* stream) {
#if EPD_HAVE_CUDA
    if (!cuda || stream != nullptr) return stream;
    internal::DeviceGuard guard(mapping->device());
    // Created at the first op given no stream: every stream takes one of the GPU's
    // CUDA_DEVICE_MAX_CONNECTIONS hardware queues, which streams beyond it share.
    if (own_stream == nullptr) {
      EPD_ASSIGN_OR_RETURN(own_stream, internal::CreateStream());
      EPD_ASSIGN_OR_RETURN(legacy_event, internal::CreateEvent());
    }
    EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(legacy_event.get(), cudaStreamLegacy));
    EPD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(own_stream.get(), legacy_event.get(), 0));
    return static_cast<void*>(own_stream.get());
#else
    return stream;
#endif
  }

  /// Records whether op `seq` was given no stream (see OpStream).
  void NoteStream(uint64_t seq, const void* caller_stream) {
    unordered_ops[seq % unordered_ops.size()] = caller_stream == nullptr ? seq : 0;
  }

  /// Copies `t` into region `r` (no copy when it already lives there). CUDA backend: on
  /// `stream` (ordered before the op's ready flag or kernels), a copy kernel for a tensor
  /// on the area's GPU, else cudaMemcpyAsync. With `for_submit` (a daemon-launched op
  /// about to Submit) a copy on the area's GPU is only recorded: Submit does it in the
  /// kernel that signals ready (one kernel per op instead of one per input plus a stream
  /// memory write, kc::CopyDeviceBatchAsync).
  absl::Status Stage(const char* op, const char* name, const DLTensor* t, const Region& r,
                     void* stream, bool for_submit = false) {
    int64_t n = TensorNbytes(t);
    if (static_cast<uint64_t>(n) > r.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": ", name, " has ", n, " bytes, more than its staging area (", r.bytes, " bytes)"));
    }
    const uint8_t* src = TensorBytes(t);
    if (src == At(r) || n <= 0) return absl::OkStatus();
#if EPD_HAVE_CUDA
    if (cuda) {
      internal::DeviceGuard guard(mapping->device());
      // A tensor on the area's GPU is copied by a kernel (kc::CopyDeviceAsync: no
      // copy-engine queue shared with the process's other streams); anything else (host
      // memory, another GPU) by cudaMemcpyAsync.
      if (t->device.device_type == kDLCUDA && t->device.device_id == mapping->device()) {
        if (for_submit && num_pending_copies < kc::kMaxBatchCopies) {
          pending_copies[num_pending_copies++] = {At(r), src, static_cast<uint64_t>(n)};
          return absl::OkStatus();
        }
        return kc::CopyDeviceAsync(At(r), src, static_cast<uint64_t>(n), AsStream(stream));
      }
      EPD_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(At(r), src, static_cast<size_t>(n), cudaMemcpyDefault, AsStream(stream)));
      return absl::OkStatus();
    }
#else
    (void)stream;
    (void)for_submit;
#endif
    std::memcpy(At(r), src, static_cast<size_t>(n));
    return absl::OkStatus();
  }

  /// Stage(..., for_submit = true): daemon-launched inputs, copied by Submit's kernel.
  absl::Status StageForSubmit(const char* op, const char* name, const DLTensor* t, const Region& r,
                              void* stream) {
    return Stage(op, name, t, r, stream, /*for_submit=*/true);
  }

  /// Starts a daemon-launched op on `stream` (call before its staging). The ops of an
  /// endpoint share its staging regions, its ready_seq word (the daemon waits for
  /// ready_seq >= seq: a later op's value must not land first) and the staging kernel's
  /// ticket word, so they must reach the GPU in seq order: when the previous stream-ordered
  /// op ran on another stream, `stream` first waits (on the GPU) for its done_seq. Same
  /// stream (the usual case): nothing. Errors: the driver's, as INTERNAL.
  absl::Status OrderAfterPreviousOp(void* stream) {
#if EPD_HAVE_CUDA
    num_pending_copies = 0;
    if (!cuda || client_launched || last_ordered_seq == 0 ||
        AsStream(stream) == last_ordered_stream) {
      return absl::OkStatus();
    }
    internal::DeviceGuard guard(mapping->device());
    return kc::StreamWaitValue64Geq(
        AsStream(stream), At(layout.launch_flags) + kernels::kDoneFlagOffset, last_ordered_seq);
#else
    (void)stream;
    return absl::OkStatus();
#endif
  }

  /// Whether the staging kernel of daemon-launched `op` waits for its done_seq itself
  /// (EndpointInfo kernel_done_wait: low-latency ops under MPS, whose grids the daemon sizes
  /// to leave that kernel an SM) instead of a cuStreamWaitValue64 on the stream after it.
  bool KernelWaitsForDone(abi::OpKind op) const {
    return kernel_done_wait &&
           (op == abi::OpKind::kLowLatencyDispatch || op == abi::OpKind::kLowLatencyCombine);
  }

  /// Ring ops of an endpoint with a registered graph-mode program are refused here, before
  /// any stream work or ring slot (the daemon refuses them too, for every rank).
  absl::Status CheckNoProgram() const {
    if (program.empty()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("endpoint of group ", spec.name(), " rank ", info.rank(),
                     " has a graph-mode program armed, which alone runs on its buffers; use "
                     "RunProgramDispatch/RunProgramCombine, or UnregisterProgram first"));
  }

  /// The error for a closed endpoint (EndpointShmHeader::daemon_closed), OK when open.
  absl::Status ClosedStatus(absl::string_view prefix) const {
    const uint32_t closed = abi::Atomic(header->daemon_closed).load(std::memory_order_acquire);
    if (closed == 0) return absl::OkStatus();
    if (closed == abi::kClosedRankRemoved) {
      return absl::FailedPreconditionError(absl::StrCat(
          prefix, "rank ", info.rank(), " of group ", spec.name(),
          " was removed from its group by epd (a LeaveGroup in this session's name, or the "
          "session ended); Join again"));
    }
    return absl::UnavailableError(
        absl::StrCat(prefix, "epd is shutting down: it closed this endpoint"));
  }

  absl::Status CheckUsable() const {
    if (left) {
      return absl::FailedPreconditionError(absl::StrCat("endpoint of group ", spec.name(), " rank ",
                                                        info.rank(), " has left its group"));
    }
    EPD_RETURN_IF_ERROR(ClosedStatus(""));
    if (session != nullptr && session->lost()) {
      return absl::UnavailableError(
          "the Session with epd ended (the daemon died or restarted): this endpoint is gone");
    }
    return absl::OkStatus();
  }

  /// Publishes one request; returns its seq. Daemon-launched on the CUDA backend (and not
  /// a client error): stream-ordered on `stream` (the file comment).
  absl::StatusOr<uint64_t> Submit(abi::OpKind op, uint32_t flags, int32_t num_tokens,
                                  int32_t expert_alignment, uint64_t handle_seq, int32_t num_sms,
                                  void* stream, const std::array<uint64_t, 3>& reserved = {}) {
#if EPD_HAVE_CUDA
    // The copies StageForSubmit recorded belong to this op only, whichever way it ends.
    const int num_copies = std::exchange(num_pending_copies, 0);
#endif
    uint64_t head = abi::Atomic(header->ring_head).load(std::memory_order_relaxed);
    // Bounded wait for ring space (only when many ops are in flight).
    auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(info.op_timeout_ms()) +
        std::chrono::seconds(1);  // (In int64: op_timeout_ms + 1000 overflows a uint32.)
    while (head - abi::Atomic(header->ring_tail).load(std::memory_order_acquire) >=
           abi::kRingCapacity) {
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::UnavailableError("epd did not drain the request ring; is the daemon alive?");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    uint64_t seq = next_seq++;
    absl::Status ordered_error;
#if EPD_HAVE_CUDA
    // Program registration is not ordered on a stream (it blocks the CPU instead).
    const bool ordered = cuda && !client_launched && (flags & abi::kFlagClientError) == 0 &&
                         op != abi::OpKind::kRegisterProgram &&
                         op != abi::OpKind::kUnregisterProgram;
    if (ordered) {
      internal::DeviceGuard guard(mapping->device());
      // ready_seq = seq by a kernel (with the inputs StageForSubmit recorded): a kernel's
      // store is seen by the daemon's WaitFlagAsync at once, where a stream memory write
      // queued behind the caller's kernels lands ~14 µs after them (cuda_ops.h). The same
      // kernel writes staging_seq = seq once all its blocks are resident, so the daemon's
      // kernel is launched while the copies run (layout.h). Under MPS a low-latency op's
      // kernel then also waits for done_seq (kernel_done_wait), in place of the stream wait
      // below.
      kc::DoneWait done_wait;
      if (KernelWaitsForDone(op)) {
        done_wait.flag =
            reinterpret_cast<const uint64_t*>(At(layout.launch_flags) + kernels::kDoneFlagOffset);
        done_wait.value = seq;
        done_wait.timeout_ns =
            (kDoneWaitTimeouts * info.op_timeout_ms() + kDoneWaitSlackMs) * 1'000'000;
      }
      ordered_error = kc::CopyDeviceBatchAsync(
          pending_copies.data(), num_copies,
          reinterpret_cast<uint64_t*>(At(layout.launch_flags) + kernels::kReadyFlagOffset), seq,
          reinterpret_cast<uint32_t*>(At(layout.launch_flags) + kernels::kReadySignalCounterOffset),
          AsStream(stream),
          reinterpret_cast<uint64_t*>(At(layout.launch_flags) + kernels::kStagingFlagOffset),
          done_wait);
      // Without the ready flag the daemon could not order its kernels: fail the op for
      // every rank instead (as a client error), and return the driver's error.
      flags |= ordered_error.ok() ? abi::kFlagStreamOrdered : abi::kFlagClientError;
    }
#else
    (void)stream;
#endif
    abi::RequestSlot slot{};
    slot.magic = abi::kRequestMagic;
    slot.op = static_cast<uint32_t>(op);
    slot.seq = seq;
    slot.flags = flags;
    slot.num_tokens = num_tokens;
    slot.expert_alignment = expert_alignment;
    slot.num_sms = num_sms;
    slot.handle_seq = handle_seq;
    slot.program_num_steps = reserved[0];
    slot.program_steps[0] = reserved[1];
    slot.program_steps[1] = reserved[2];
    auto* ring = reinterpret_cast<abi::RequestSlot*>(region.data() + header->ring_offset);
    std::memcpy(&ring[(head + 1) % abi::kRingCapacity], &slot, sizeof(slot));
    abi::Atomic(header->ring_head).store(head + 1, std::memory_order_seq_cst);
    // When the engine was asleep, do not spin on this CPU afterwards: the scheduler may
    // place the woken engine here, behind our spin (measured: +70–100 µs in a VM).
    woke_engine = RingDoorbell(doorbell);
#if EPD_HAVE_CUDA
    if (ordered && ordered_error.ok()) {
      ordered_ops[seq % ordered_ops.size()].store(seq, std::memory_order_release);
      internal::DeviceGuard guard(mapping->device());
      if (!KernelWaitsForDone(op)) {
        ordered_error = kc::StreamWaitValue64Geq(
            AsStream(stream), At(layout.launch_flags) + kernels::kDoneFlagOffset, seq);
      }
      if (ordered_error.ok()) {
        last_ordered_stream = AsStream(stream);
        last_ordered_seq = seq;
      }
    }
#endif
    if (!ordered_error.ok()) return ordered_error;
    return seq;
  }

  /// Reports a client-side validation error to the group (so the other ranks' op fails
  /// promptly instead of timing out, and sequence numbers stay aligned) and returns
  /// `error` at once: the op's completion is not waited for (a thread that drives several
  /// endpoints must not block on peers it has not submitted yet). Daemon-launched only.
  absl::Status SubmitClientError(abi::OpKind op, absl::Status error) {
    (void)Submit(op, abi::kFlagClientError, 0, 1, 0, 0, nullptr);
    return error;
  }

  /// Daemon-launched CUDA endpoint whose daemon is gone (or that is being destroyed):
  /// releases every stream still waiting for its done flag, by writing done_seq =
  /// kReleasedSeq from the host (on the library's own stream). Only when some stream-
  /// ordered op has no completion yet (an op with a completion had its done_seq written
  /// before it). Best effort: the area may be gone with the daemon. Once.
  void ReleaseStreams() {
#if EPD_HAVE_CUDA
    if (!cuda || client_launched || aux_stream == nullptr || stream_released.load()) return;
    if (!program.empty()) {
      // A stream at a program step's done wait: done = kProgramReleased, which no ack
      // clears (layout.h); a stream memory write, as for done_seq below.
      internal::DeviceGuard guard(mapping->device());
      (void)kc::StreamWriteValue64(aux_stream.get(),
                                   At(layout.launch_flags) + kernels::kProgramDoneOffset,
                                   kernels::kProgramReleased);
      cudaStreamSynchronize(aux_stream.get());
      cudaGetLastError();
    }
    abi::Completion* completions =
        reinterpret_cast<abi::Completion*>(region.data() + header->completion_offset);
    bool waiting = false;
    for (const std::atomic<uint64_t>& ordered : ordered_ops) {
      const uint64_t seq = ordered.load(std::memory_order_acquire);
      if (seq != 0 && abi::Atomic(completions[seq % abi::kCompletionCapacity].seq)
                              .load(std::memory_order_acquire) != seq) {
        waiting = true;
      }
    }
    if (!waiting || stream_released.exchange(true)) return;
    internal::DeviceGuard guard(mapping->device());
    // A stream memory write, not a copy: a copy would queue on the copy engine that the
    // process's other streams share, where one held behind a stream-ordered op could keep
    // the release from landing. (Stream memory operations are there: the daemon accepts no
    // stream-ordered op without them, CudaGroup::CheckRequest.)
    (void)kc::StreamWriteValue64(aux_stream.get(),
                                 At(layout.launch_flags) + kernels::kDoneFlagOffset,
                                 internal::kReleasedSeq);
    cudaStreamSynchronize(aux_stream.get());
    cudaGetLastError();
#endif
  }

  /// Daemon-launched: the op `seq` of kind `op` failed, so the daemon did not advance its
  /// low-latency buffer parity; neither does the prediction. Once per op.
  void NoteDaemonFailure(uint64_t seq, abi::OpKind op) {
    uint64_t& noted = failure_noted[seq % failure_noted.size()];
    if (noted == seq) return;
    noted = seq;
    if (op == abi::OpKind::kLowLatencyDispatch && ll_dispatches > 0) --ll_dispatches;
    if (op == abi::OpKind::kLowLatencyCombine && ll_combines > 0) --ll_combines;
  }

  /// Client-launched: the op `seq` failed; a handle it produced is not usable.
  void NoteClientFailure(uint64_t seq) {
    for (int b = 0; b < kernels::kLowLatencyBuffers; ++b) {
      if (ll_seq[b] == seq) ll_seq[b] = 0;
    }
    if (routing_seq == seq) routing_seq = 0;
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
    for (uint64_t got; (got = abi::Atomic(c.seq).load(std::memory_order_acquire)) != seq;) {
      if (got > seq) {
        // The record was reused by a later op (record seq % kCompletionCapacity).
        return absl::FailedPreconditionError(absl::StrCat(
            "op ", seq, ": its completion record already holds op ", got, "'s; only the latest ",
            abi::kCompletionCapacity, " ops of an endpoint can be waited for (Wait sooner)"));
      }
      auto now = std::chrono::steady_clock::now();
      if (now >= limit) {
        return absl::DeadlineExceededError(
            absl::StrCat("op ", seq, " not complete after ", absl::FormatDuration(timeout)));
      }
      if (session != nullptr && session->lost() &&
          abi::Atomic(c.seq).load(std::memory_order_acquire) != seq) {
        return absl::UnavailableError(absl::StrCat(
            "op ", seq, ": the Session with epd ended (the daemon died or restarted)"));
      }
      if (abi::Atomic(header->daemon_closed).load(std::memory_order_acquire) != 0 &&
          abi::Atomic(c.seq).load(std::memory_order_acquire) != seq) {
        return ClosedStatus(absl::StrCat("op ", seq, ": "));
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

  /// A view of region `r` (no allocation: TensorShape keeps up to 4 dimensions inline).
  TensorView View(const Region& r, DLDataType dtype, TensorShape shape) const {
    return TensorView(At(r), dtype, device, std::move(shape));
  }

  // ---- result views ----

  void LayoutViews(LayoutResult& r, int64_t T) const {
    r.num_tokens_per_rank = View(layout.layout_tokens_per_rank, kI32, {shape.num_ranks});
    r.num_tokens_per_expert = View(layout.layout_tokens_per_expert, kI32, {shape.num_experts});
    r.is_token_in_rank = View(layout.layout_is_token_in_rank, kBool, {T, shape.num_ranks});
  }

  void DispatchViews(DispatchResult& r, int32_t N) const {
    const int64_t H = shape.hidden, K = shape.num_topk;
    const bool fp8 = r.handle.use_fp8;
    r.num_recv_tokens = N;
    r.handle.num_recv_tokens = N;
    r.recv_x = View(layout.recv_x, fp8 ? kE4m3 : kBf16, {N, H});
    if (fp8) r.recv_scales = View(layout.recv_scales, kF32, {N, shape.num_scales()});
    r.recv_topk_idx = View(layout.recv_topk_idx, kI64, {N, K});
    r.recv_topk_weights = View(layout.recv_topk_weights, kF32, {N, K});
    r.num_recv_tokens_per_expert =
        View(layout.recv_tokens_per_expert, kI32, {shape.num_local_experts()});
    r.recv_src_info = View(layout.recv_src_info, kI32, {N});
    r.recv_count = View(layout.recv_count, kI32, {1});
  }

  void LowLatencyDispatchViews(LowLatencyDispatchResult& r, int b) const {
    const int64_t El = shape.num_local_experts(), rows = shape.ll_rows_per_expert();
    const bool fp8 = r.handle.use_fp8;
    r.handle.buffer = b;
    r.recv_x = View(layout.ll_recv_x[b], fp8 ? kE4m3 : kBf16, {El, rows, shape.hidden});
    r.recv_scales =
        fp8 ? View(layout.ll_recv_scales[b], kF32, {El, rows, shape.num_scales()}) : TensorView();
    r.recv_count = View(layout.ll_recv_count[b], kI32, {El});
    r.recv_src_info = View(layout.ll_recv_src_info[b], kI32, {El, rows});
  }

#if EPD_HAVE_CUDA
  // ---- client-launched mode ----

  /// Sets up client-launched mode once: every rank's area (GetGroupEndpoints, waiting up
  /// to op_timeout for every rank to join), the device array of bases, the kernels, the
  /// completion records. Errors: FAILED_PRECONDITION (no control channel, a rank not
  /// client-launched, a stale endpoint), the RPC's errors, CUDA errors (INTERNAL).
  absl::Status EnsureClientLaunch() {
    if (cl != nullptr) return absl::OkStatus();
    if (!group_endpoints) {
      return absl::FailedPreconditionError(
          "client-launched endpoint opened without a control channel (GetGroupEndpoints)");
    }
    const int32_t R = shape.num_ranks, rank = info.rank();
    EPD_ASSIGN_OR_RETURN(v1::GetGroupEndpointsResponse group,
                         group_endpoints(info.op_timeout_ms()));
    if (group.endpoints_size() != R) {
      return absl::FailedPreconditionError(absl::StrCat("GetGroupEndpoints of group ", spec.name(),
                                                        " returned ", group.endpoints_size(),
                                                        " endpoints, expected ", R));
    }
    auto launch = std::make_unique<ClientLaunch>();
    const int own_device = mapping->device();
    internal::DeviceGuard guard(own_device);
    std::vector<uint8_t*> bases(R, nullptr);
    int32_t on_device = 0;
    for (int32_t r = 0; r < R; ++r) {
      const v1::GroupEndpoint& e = group.endpoints(r);
      if (e.rank() != r) {
        return absl::FailedPreconditionError(absl::StrCat(
            "GetGroupEndpoints: entry ", r, " is rank ", e.rank(), " (expected ordered by rank)"));
      }
      if (e.launch_mode() != v1::LAUNCH_MODE_CLIENT) {
        return absl::FailedPreconditionError(absl::StrCat(
            "group ", spec.name(), " rank ", r, " is ", v1::LaunchMode_Name(e.launch_mode()),
            ", this endpoint is client-launched"));
      }
      if (r == rank) {
        if (e.endpoint_id() != info.endpoint_id()) {
          return absl::FailedPreconditionError(
              absl::StrCat("GetGroupEndpoints: rank ", r, " is endpoint ", e.endpoint_id(),
                           ", not this endpoint ", info.endpoint_id(), " (it left and rejoined?)"));
        }
        launch->areas.push_back(mapping);
      } else {
        EPD_ASSIGN_OR_RETURN(std::shared_ptr<const internal::CudaAreaMapping> area,
                             internal::MapSharedArea(e.cuda_ipc_handle(), e.gpu_uuid()));
        if (area->device() != own_device) {
          int can = 0;
          EPD_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, own_device, area->device()));
          if (!can) {
            return absl::FailedPreconditionError(
                absl::StrCat("rank ", r, "'s GPU ", e.gpu_uuid(), " cannot be reached from GPU ",
                             info.gpu_uuid(), " of rank ", rank, " (no peer access)"));
          }
          cudaError_t err = cudaDeviceEnablePeerAccess(area->device(), 0);
          if (err == cudaErrorPeerAccessAlreadyEnabled) {
            cudaGetLastError();
          } else {
            EPD_CUDA_RETURN_IF_ERROR(err);
          }
        }
        launch->areas.push_back(std::move(area));
      }
      bases[r] = launch->areas.back()->data();
      if (e.gpu_uuid() == info.gpu_uuid()) ++on_device;
    }
    EPD_RETURN_IF_ERROR(PreloadKernelsOnce(own_device));
    EPD_ASSIGN_OR_RETURN(launch->peer_bases, internal::AllocateDevice(sizeof(uint8_t*) * R));
    EPD_CUDA_RETURN_IF_ERROR(cudaMemcpy(launch->peer_bases.get(), bases.data(),
                                        sizeof(uint8_t*) * R, cudaMemcpyHostToDevice));
    kc::CudaRankContext& ctx = launch->ctx;
    ctx.shape = shape;
    ctx.layout = layout;
    ctx.rank = rank;
    ctx.peer_bases = reinterpret_cast<uint8_t* const*>(launch->peer_bases.get());
    ctx.own_base = data;
    ctx.ranks_on_device = on_device;
    // Flags at .gpu scope when every rank's area is on this GPU (cuda_ops.h).
    ctx.all_ranks_on_device = on_device == R;
    ctx.timeout_ns = static_cast<int64_t>(info.op_timeout_ms()) * 1'000'000;
    EPD_RETURN_IF_ERROR(kc::ValidateContext(ctx));
    EPD_ASSIGN_OR_RETURN(
        launch->readback_memory,
        internal::AllocatePinned(sizeof(ClientLaunch::Readback) * (ClientLaunch::kSlots + 1)));
    for (uint32_t i = 0; i < ClientLaunch::kSlots; ++i) {
      EPD_ASSIGN_OR_RETURN(internal::EventHandle e, internal::CreateEvent());
      launch->events.push_back(std::move(e));
    }
    cl = std::move(launch);
    return absl::OkStatus();
  }

  /// The rank's context with an SM budget (0 = default) for one op.
  kc::CudaRankContext Context(int32_t num_sms) const {
    kc::CudaRankContext ctx = cl->ctx;
    ctx.num_sms = num_sms;
    return ctx;
  }

  /// Client-launched: points `*in_place` at `t` when the kernel may read it in place
  /// (`in_place_ok`, device memory of this GPU, `alignment`-aligned); otherwise copies `t`
  /// into region `r` on `stream` and leaves `*in_place` null (the kernel then reads `r`).
  template <typename T>
  absl::Status ReadInPlaceOrStage(const char* op, const char* name, const DLTensor* t,
                                  const Region& r, bool in_place_ok, uintptr_t alignment,
                                  void* stream, const T** in_place) {
    if (in_place_ok && ReadableInPlace(t, mapping->device(), alignment)) {
      *in_place = reinterpret_cast<const T*>(TensorBytes(t));
      return absl::OkStatus();
    }
    return Stage(op, name, t, r, stream);
  }

  /// Starts a client-launched op on `stream`: says whether the stream is capturing a CUDA
  /// graph and assigns the op's seq. Call with the endpoint's device current.
  absl::StatusOr<uint64_t> BeginClientOp(cudaStream_t stream, bool* capturing) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    EPD_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusInvalidated) {
      return absl::FailedPreconditionError(
          "the stream's CUDA graph capture was invalidated by an earlier error");
    }
    if (capture == cudaStreamCaptureStatusNone) {  // (Not a call allowed while capturing.)
      int stream_device = -1;
      EPD_CUDA_RETURN_IF_ERROR(cudaStreamGetDevice(stream, &stream_device));
      if (stream_device != mapping->device()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the op's stream belongs to CUDA device ", stream_device, ", the endpoint's GPU ",
            info.gpu_uuid(), " is device ", mapping->device(), " in this process"));
      }
    }
    *capturing = capture == cudaStreamCaptureStatusActive;
    return next_seq++;
  }

  /// Ends a client-launched op on `stream`: unless capturing, records the slot's event,
  /// which Wait polls, after the read-back of the op's DeviceStatus (and, for Dispatch, N)
  /// into its completion slot. A low-latency op gets no read-back here: Wait enqueues it
  /// on the op's stream (see Endpoint's docs: its errors are reported by the first Wait
  /// at or after it). A captured op gets no read-back: Wait reads the device status
  /// itself once the graph's replay is done.
  absl::Status EndClientOp(uint64_t seq, abi::OpKind op, cudaStream_t stream, bool capturing) {
    const uint32_t i = static_cast<uint32_t>(seq % ClientLaunch::kSlots);
    ClientLaunch::Slot& slot = cl->slots[i];
    slot.seq = 0;
    const bool low_latency =
        op == abi::OpKind::kLowLatencyDispatch || op == abi::OpKind::kLowLatencyCombine;
    slot.deferred = low_latency && !capturing;
    slot.stream = stream;
    if (!capturing) {
      ClientLaunch::Readback& rb = cl->readback(i);
      if (!low_latency) EPD_RETURN_IF_ERROR(kc::EnqueueStatusReadback(cl->ctx, stream, &rb.status));
      if (op == abi::OpKind::kDispatch) {
        EPD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&rb.recv_count, At(layout.recv_count),
                                                 sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
      }
      EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(cl->events[i].get(), stream));
    }
    slot.seq = seq;
    slot.captured = capturing;
    return absl::OkStatus();
  }

  /// Client-launched Wait: the op's status (and N for Dispatch) once its stream has passed
  /// it. Bounded by `timeout` and by op_timeout + 5 s (DEADLINE_EXCEEDED; the op stays
  /// pending). A captured op is not waited for (see Endpoint docs).
  absl::Status WaitClientOp(uint64_t seq, abi::OpKind op, absl::Duration timeout,
                            int32_t* recv_count) {
    const uint32_t i = static_cast<uint32_t>(seq % ClientLaunch::kSlots);
    const ClientLaunch::Slot& slot = cl->slots[i];
    if (slot.seq != seq) {
      return absl::FailedPreconditionError(absl::StrCat(
          OpKindName(op), " op ", seq, ": its completion record was reused: more than ",
          ClientLaunch::kSlots, " ops of this endpoint were enqueued after it without Wait"));
    }
    internal::DeviceGuard guard(mapping->device());
    ClientLaunch::Readback* rb = &cl->readback(i);
    if (slot.captured) {
      rb = &cl->readback(ClientLaunch::kSlots);
      cudaStream_t s = aux_stream.get();
      EPD_RETURN_IF_ERROR(kc::EnqueueStatusReadback(cl->ctx, s, &rb->status));
      if (op == abi::OpKind::kDispatch) {
        EPD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&rb->recv_count, At(layout.recv_count),
                                                 sizeof(int32_t), cudaMemcpyDeviceToHost, s));
      }
      EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    } else {
      const auto start = std::chrono::steady_clock::now();
      const auto limit = timeout == absl::InfiniteDuration()
                             ? std::chrono::steady_clock::time_point::max()
                             : start + absl::ToChronoNanoseconds(timeout);
      const auto stuck = start + std::chrono::milliseconds(info.op_timeout_ms()) + kGpuGrace;
      const auto spin_until = start + std::chrono::microseconds(kSpinBeforeSleepUs);
      for (;;) {
        cudaError_t err = cudaEventQuery(cl->events[i].get());
        if (err == cudaSuccess) break;
        if (err != cudaErrorNotReady) EPD_CUDA_RETURN_IF_ERROR(err);
        const auto now = std::chrono::steady_clock::now();
        if (now >= limit) {
          return absl::DeadlineExceededError(absl::StrCat(
              OpKindName(op), " op ", seq, " not complete after ", absl::FormatDuration(timeout)));
        }
        if (now >= stuck) {
          return absl::DeadlineExceededError(absl::StrCat(
              OpKindName(op), " op ", seq,
              ": its stream did not pass the op within op_timeout + 5 s (is earlier work on "
              "the stream stuck?); the op is still pending"));
        }
        if (now >= spin_until) std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      if (slot.deferred) {
        // The read-back, ordered after everything enqueued on the op's stream so far: it
        // reports the device-side errors of this op and of the later ops of that stream
        // (nothing is lost and nothing is read while a kernel may still add to it).
        EPD_RETURN_IF_ERROR(kc::EnqueueStatusReadback(cl->ctx, slot.stream, &rb->status));
        EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(slot.stream));
        cl->slots[i].deferred = false;  // A second Wait reports the same status.
      }
    }
    if (recv_count != nullptr) *recv_count = rb->recv_count;
    absl::Status st = DeviceStatusOf(rb->status, shape, info.rank(), op);
    if (!st.ok()) NoteClientFailure(seq);
    return st;
  }
#endif
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

TensorView Endpoint::LowLatencyCombineInput() const {
  const Impl& m = *impl_;
  if (m.shape.ll_max_tokens_per_rank == 0) return TensorView();
  return m.View(m.layout.in_ll_combine_x, kBf16,
                {m.shape.num_local_experts(), m.shape.ll_rows_per_expert(), m.shape.hidden});
}

TensorView Endpoint::LowLatencyDispatchInput() const {
  const Impl& m = *impl_;
  if (m.shape.ll_max_tokens_per_rank == 0) return TensorView();
  return m.View(m.layout.in_x, kBf16, {m.shape.ll_max_tokens_per_rank, m.shape.hidden});
}

// ---- graph mode ----------------------------------------------------------------------------

absl::Status Endpoint::RegisterProgram(const std::vector<ProgramStep>& steps,
                                       absl::Duration timeout) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  if (steps.empty() || steps.size() > abi::kMaxProgramSteps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RegisterProgram: ", steps.size(), " steps, outside [1, ", abi::kMaxProgramSteps, "]"));
  }
  if (!m.program.empty()) {
    return absl::FailedPreconditionError(
        "RegisterProgram: this endpoint already has a program; UnregisterProgram first");
  }
  std::array<uint64_t, 3> reserved{};
  reserved[0] = steps.size();
  std::vector<int> buffer(steps.size(), -1), out_buffer(steps.size(), 0);
  int dispatches = 0, combines = 0, last = -1;
  for (size_t i = 0; i < steps.size(); ++i) {
    const bool dispatch = steps[i].op == ProgramStep::Op::kLowLatencyDispatch;
    const uint8_t b = abi::EncodeProgramStep(
        dispatch ? abi::OpKind::kLowLatencyDispatch : abi::OpKind::kLowLatencyCombine,
        steps[i].use_fp8, steps[i].round_scale);
    reserved[1 + i / 8] |= static_cast<uint64_t>(b) << (8 * (i % 8));
    // The daemon's rule (daemon/group_ops.h ProgramStepPlan), which it validates.
    if (dispatch) {
      last = buffer[i] = dispatches++ % kernels::kLowLatencyBuffers;
    } else {
      out_buffer[i] = combines++ % kernels::kLowLatencyBuffers;
      buffer[i] = last;
    }
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    if (buffer[i] < 0) buffer[i] = last;
  }
#if EPD_HAVE_CUDA
  // The step's acknowledging kernel is loaded now, not lazily inside a capture or while
  // the group's kernels spin (DESIGN.md §3.2).
  if (m.cuda) {
    internal::DeviceGuard guard(m.mapping->device());
    EPD_RETURN_IF_ERROR(PreloadKernelsOnce(m.mapping->device()));
    if (!m.client_launched && m.program_word == nullptr) {
      EPD_ASSIGN_OR_RETURN(m.program_word, internal::AllocatePinned(sizeof(uint64_t)));
    }
  }
#endif
  EPD_ASSIGN_OR_RETURN(uint64_t seq,
                       m.Submit(abi::OpKind::kRegisterProgram, 0, 0, 1, 0, 0, nullptr, reserved));
  abi::Completion c;
  EPD_RETURN_IF_ERROR(m.WaitCompletion(seq, timeout, &c));
  m.program = steps;
  m.program_buffer = std::move(buffer);
  m.program_out_buffer = std::move(out_buffer);
  m.program_next = 0;
  m.program_errors_seen = 0;
  for (int b = 0; b < kernels::kLowLatencyBuffers; ++b) m.ll_seq[b] = 0;
  return absl::OkStatus();
}

absl::Status Endpoint::UnregisterProgram(absl::Duration timeout) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  EPD_ASSIGN_OR_RETURN(uint64_t seq,
                       m.Submit(abi::OpKind::kUnregisterProgram, 0, 0, 1, 0, 0, nullptr));
  abi::Completion c;
  EPD_RETURN_IF_ERROR(m.WaitCompletion(seq, timeout, &c));
  m.program.clear();
  m.program_next = 0;
  return absl::OkStatus();
}

#if EPD_HAVE_CUDA
namespace {

/// Checks that `t` is kDLCUDA memory of `device` (program steps read it at run time).
/// CheckTensor, then: `t` is kDLCUDA memory of the endpoint's GPU `device` (a program
/// step is captured, so it reads its inputs at run time, in place).
absl::Status CheckStepTensor(const char* op, const char* name, const DLTensor* t,
                             std::initializer_list<DLDataType> dtypes, std::vector<int64_t>& shape,
                             int device) {
  EPD_RETURN_IF_ERROR(CheckTensor(true, op, name, t, dtypes, shape));
  if (t->device.device_type == kDLCUDA && t->device.device_id == device) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", name, " must be kDLCUDA memory of the endpoint's GPU (device ", device,
                   ") so a captured step reads it at run time"));
}

}  // namespace
#endif

/// The checks every program step shares: a registered program on a daemon-launched CUDA
/// endpoint, and `want` as the next step.
static absl::Status CheckProgramStep(Endpoint::Impl& m, ProgramStep::Op want, const char* op) {
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  if (m.program.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(op, ": no graph-mode program is registered on this endpoint"));
  }
  const ProgramStep& next = m.program[m.program_next];
  if (next.op != want) {
    return absl::FailedPreconditionError(
        absl::StrCat(op, ": the program's next step (", m.program_next, ") is ",
                     next.op == ProgramStep::Op::kLowLatencyDispatch ? "LowLatencyDispatch"
                                                                     : "LowLatencyCombine",
                     "; steps run in program order"));
  }
  return absl::OkStatus();
}

#if EPD_HAVE_CUDA
/// The go / done / ack sequence of one program step on `stream` (layout.h): the step's
/// inputs recorded by StageForSubmit are copied by one kernel whose last block stores go = 1
/// (kc::CopyDeviceBatchAsync: a kernel's store reaches the daemon's stream sooner than a
/// stream memory write queued behind the caller's kernels, cuda_ops.h), then the stream
/// waits for done and a one-thread kernel acknowledges it.
static absl::Status HandOffProgramStep(Endpoint::Impl& m, cudaStream_t stream) {
  uint8_t* flags = m.At(m.layout.launch_flags);
  const int num_copies = std::exchange(m.num_pending_copies, 0);
  EPD_RETURN_IF_ERROR(kc::CopyDeviceBatchAsync(
      m.pending_copies.data(), num_copies,
      reinterpret_cast<uint64_t*>(flags + kernels::kProgramGoOffset), 1,
      reinterpret_cast<uint32_t*>(flags + kernels::kReadySignalCounterOffset), stream));
  EPD_RETURN_IF_ERROR(kc::StreamWaitValue64Geq(stream, flags + kernels::kProgramDoneOffset, 1));
  return kc::ProgramAckAsync(reinterpret_cast<uint64_t*>(flags + kernels::kProgramDoneOffset),
                             stream);
}
#endif

absl::StatusOr<LowLatencyDispatchResult> Endpoint::RunProgramDispatch(
    const ProgramDispatchArgs& args) {
  Impl& m = *impl_;
  constexpr const char* kOp = "RunProgramDispatch";
  EPD_RETURN_IF_ERROR(CheckProgramStep(m, ProgramStep::Op::kLowLatencyDispatch, kOp));
#if EPD_HAVE_CUDA
  const int device = m.mapping->device();
  const int32_t Mll = m.shape.ll_max_tokens_per_rank;
  std::vector<int64_t> xs{-1, m.shape.hidden};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "x", args.x, {kBf16}, xs, device));
  const int64_t C = xs[0];
  if (C > Mll) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": x has ", C, " rows > ll_max_tokens_per_rank ", Mll));
  }
  std::vector<int64_t> ts{C, m.shape.num_topk};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "topk_idx", args.topk_idx, {kI64}, ts, device));
  std::vector<int64_t> ns{1};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "num_tokens", args.num_tokens, {kI32}, ns, device));
  EPD_ASSIGN_OR_RETURN(void* const stream, m.OpStream(args.stream));
  internal::DeviceGuard guard(device);
  m.num_pending_copies = 0;
  EPD_RETURN_IF_ERROR(m.StageForSubmit(kOp, "x", args.x, m.layout.in_x, stream));
  EPD_RETURN_IF_ERROR(
      m.StageForSubmit(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx, stream));
  kc::CudaRankContext ctx;
  ctx.shape = m.shape;
  ctx.layout = m.layout;
  ctx.rank = m.info.rank();
  ctx.own_base = m.data;
  // T into the rank's token-count slot, by the same kernel (x and topk_idx take two of its
  // kc::kMaxBatchCopies copies at most).
  m.pending_copies[m.num_pending_copies++] = {kc::LowLatencyNumTokensSlot(ctx),
                                              TensorBytes(args.num_tokens), sizeof(int32_t)};
  EPD_RETURN_IF_ERROR(HandOffProgramStep(m, AsStream(stream)));
  const size_t i = m.program_next;
  m.program_next = (i + 1) % m.program.size();
  LowLatencyDispatchResult r;
  r.handle.endpoint_id = m.info.endpoint_id();
  r.handle.low_latency = true;
  r.handle.num_tokens = static_cast<int32_t>(C);
  r.handle.use_fp8 = m.program[i].use_fp8;
  m.LowLatencyDispatchViews(r, m.program_buffer[i]);
  return r;
#else
  (void)args;
  return absl::FailedPreconditionError("RunProgramDispatch: built without CUDA");
#endif
}

absl::StatusOr<LowLatencyCombineResult> Endpoint::RunProgramCombine(
    const ProgramCombineArgs& args) {
  Impl& m = *impl_;
  constexpr const char* kOp = "RunProgramCombine";
  EPD_RETURN_IF_ERROR(CheckProgramStep(m, ProgramStep::Op::kLowLatencyCombine, kOp));
#if EPD_HAVE_CUDA
  const int device = m.mapping->device();
  std::vector<int64_t> xs{m.shape.num_local_experts(), m.shape.ll_rows_per_expert(),
                          m.shape.hidden};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "x", args.x, {kBf16}, xs, device));
  std::vector<int64_t> ts{-1, m.shape.num_topk};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "topk_idx", args.topk_idx, {kI64}, ts, device));
  const int64_t C = ts[0];
  if (C > m.shape.ll_max_tokens_per_rank) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": topk_idx has ", C,
                                                   " rows > ll_max_tokens_per_rank ",
                                                   m.shape.ll_max_tokens_per_rank));
  }
  std::vector<int64_t> ws{C, m.shape.num_topk};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "topk_weights", args.topk_weights, {kF32}, ws, device));
  EPD_ASSIGN_OR_RETURN(void* const stream, m.OpStream(args.stream));
  internal::DeviceGuard guard(device);
  m.num_pending_copies = 0;
  EPD_RETURN_IF_ERROR(m.StageForSubmit(kOp, "x", args.x, m.layout.in_ll_combine_x, stream));
  EPD_RETURN_IF_ERROR(
      m.StageForSubmit(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx, stream));
  EPD_RETURN_IF_ERROR(
      m.StageForSubmit(kOp, "topk_weights", args.topk_weights, m.layout.in_topk_weights, stream));
  EPD_RETURN_IF_ERROR(HandOffProgramStep(m, AsStream(stream)));
  const size_t i = m.program_next;
  m.program_next = (i + 1) % m.program.size();
  LowLatencyCombineResult r;
  r.combined_x =
      m.View(m.layout.ll_combined_x[m.program_out_buffer[i]], kBf16, {C, m.shape.hidden});
  return r;
#else
  (void)args;
  return absl::FailedPreconditionError("RunProgramCombine: built without CUDA");
#endif
}

absl::Status Endpoint::ProgramStatus() {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  abi::EndpointShmHeader* h = m.header;
  uint64_t instance = 0;
#if EPD_HAVE_CUDA
  if (m.cuda && !m.client_launched && m.program_word != nullptr) {
    // The latest instance whose results this endpoint's streams have seen (written by the
    // daemon's stream before done), read by a kernel (see program_word).
    internal::DeviceGuard guard(m.mapping->device());
    const auto* word = reinterpret_cast<const uint64_t*>(m.At(m.layout.launch_flags) +
                                                         kernels::kProgramInstanceOffset);
    auto* host = reinterpret_cast<uint64_t*>(m.program_word.get());
    EPD_RETURN_IF_ERROR(kc::ReadWordAsync(word, host, m.aux_stream.get()));
    EPD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.aux_stream.get()));
    instance = *reinterpret_cast<volatile uint64_t*>(host);
  }
#endif
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(m.info.op_timeout_ms()) + std::chrono::seconds(5);
  while (abi::Atomic(h->program_checked).load(std::memory_order_acquire) < instance) {
    EPD_RETURN_IF_ERROR(m.CheckUsable());
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::UnavailableError(
          absl::StrCat("ProgramStatus: epd did not check program instance ", instance,
                       " within op_timeout + 5 s; the daemon is gone or stuck"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  for (;;) {
    const uint64_t errors = abi::Atomic(h->program_errors).load(std::memory_order_acquire);
    if (errors == m.program_errors_seen) break;
    const int32_t code = h->program_error_code;
    std::string msg(h->program_error_message,
                    strnlen(h->program_error_message, abi::kMessageBytes));
    if (abi::Atomic(h->program_errors).load(std::memory_order_acquire) != errors) continue;
    const uint64_t missed = errors - m.program_errors_seen - 1;
    m.program_errors_seen = errors;
    if (missed > 0) absl::StrAppend(&msg, " (", missed, " earlier program error(s) not shown)");
    return absl::Status(static_cast<absl::StatusCode>(code), msg);
  }
  if (!m.program.empty() && abi::Atomic(h->program_armed).load(std::memory_order_acquire) == 0) {
    return absl::FailedPreconditionError(
        "ProgramStatus: the daemon disarmed this endpoint's program (see the error it "
        "reported); UnregisterProgram, then register it again");
  }
  return absl::OkStatus();
}

// ---- op submission ---------------------------------------------------------------------

absl::StatusOr<PendingOp<LayoutResult>> Endpoint::GetDispatchLayout(const DLTensor& topk_idx,
                                                                    void* caller_stream) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  EPD_RETURN_IF_ERROR(m.CheckNoProgram());
  EPD_ASSIGN_OR_RETURN(void* const stream, m.OpStream(caller_stream));
  constexpr const char* kOp = "GetDispatchLayout";
  const auto op = abi::OpKind::kGetDispatchLayout;
  std::array<int64_t, 2> shape{-1, m.shape.num_topk};
  absl::Status st = CheckTensor(m.cuda, kOp, "topk_idx", &topk_idx, {kI64}, shape);
  if (st.ok() && shape[0] > m.shape.max_tokens_per_rank) {
    st = absl::InvalidArgumentError(absl::StrCat(
        kOp, ": num_tokens ", shape[0], " > max_tokens_per_rank ", m.shape.max_tokens_per_rank));
  }
  const int32_t T = st.ok() ? static_cast<int32_t>(shape[0]) : 0;
  uint64_t seq = 0;
#if EPD_HAVE_CUDA
  if (m.client_launched) {
    // No exchange between ranks: a rejected input takes part in nothing.
    EPD_RETURN_IF_ERROR(st);
    EPD_RETURN_IF_ERROR(m.EnsureClientLaunch());
    internal::DeviceGuard guard(m.mapping->device());
    const cudaStream_t s = AsStream(stream);
    bool capturing = false;
    EPD_ASSIGN_OR_RETURN(seq, m.BeginClientOp(s, &capturing));
    kc::GetDispatchLayoutArgs a;
    EPD_RETURN_IF_ERROR(m.ReadInPlaceOrStage(kOp, "topk_idx", &topk_idx, m.layout.in_topk_idx, true,
                                             alignof(int64_t), stream, &a.topk_idx));
    const kc::CudaRankContext ctx = m.Context(0);
    EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, T, s));
    EPD_RETURN_IF_ERROR(kc::GetDispatchLayout(ctx, a, s));
    EPD_RETURN_IF_ERROR(m.EndClientOp(seq, op, s, capturing));
  }
#endif
  if (seq == 0) {
    if (st.ok()) st = m.OrderAfterPreviousOp(stream);
    if (st.ok()) st = m.StageForSubmit(kOp, "topk_idx", &topk_idx, m.layout.in_topk_idx, stream);
    if (!st.ok()) return m.SubmitClientError(op, st);
    EPD_ASSIGN_OR_RETURN(seq, m.Submit(op, 0, T, 1, 0, 0, stream));
  }
  m.NoteStream(seq, caller_stream);
  LayoutResult r;
  m.LayoutViews(r, T);
  return PendingOp<LayoutResult>(impl_, seq, std::move(r));
}

absl::StatusOr<PendingOp<DispatchResult>> Endpoint::Dispatch(const DispatchArgs& args) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  EPD_RETURN_IF_ERROR(m.CheckNoProgram());
  EPD_ASSIGN_OR_RETURN(void* const stream, m.OpStream(args.stream));
  constexpr const char* kOp = "Dispatch";
  const auto op = abi::OpKind::kDispatch;
  const int H = m.shape.hidden, K = m.shape.num_topk;
  absl::Status st;
  std::array<int64_t, 2> xs{-1, H};
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
    std::array<int64_t, 2> ss{T, m.shape.num_scales()};
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
    } else if (cached->num_recv_tokens < 0) {
      st = absl::FailedPreconditionError(absl::StrCat(
          kOp,
          ": the cached handle comes from Enqueued() of a Dispatch, whose N is known only on "
          "the device; Wait for that Dispatch and use the handle Wait returns"));
    }
  }
  if (st.ok() && !cached) {
    std::array<int64_t, 2> ts{T, K};
    st = CheckTensor(m.cuda, kOp, "topk_idx", args.topk_idx, {kI64}, ts);
  }
  const bool weights = !cached && args.topk_weights != nullptr;
  if (st.ok() && weights) {
    std::array<int64_t, 2> ws{T, K};
    st = CheckTensor(m.cuda, kOp, "topk_weights", args.topk_weights, {kF32}, ws);
  }
  uint64_t seq = 0;
#if EPD_HAVE_CUDA
  if (m.client_launched) {
    // The daemon's handle check (group_ops.cc ValidateHandle), done here.
    if (st.ok() && cached &&
        (m.routing_seq == 0 || cached->seq < m.routing_seq || cached->seq > m.last_dispatch_seq)) {
      st = absl::FailedPreconditionError(absl::StrCat(
          kOp, ": cached handle of op ", cached->seq,
          " is not the current dispatch routing of this endpoint (valid: ops ", m.routing_seq, "..",
          m.last_dispatch_seq, "); a handle is invalidated by the next Dispatch"));
    }
    EPD_RETURN_IF_ERROR(m.EnsureClientLaunch());
    internal::DeviceGuard guard(m.mapping->device());
    const cudaStream_t s = AsStream(stream);
    bool capturing = false;
    EPD_ASSIGN_OR_RETURN(seq, m.BeginClientOp(s, &capturing));
    if (st.ok()) st = m.Stage(kOp, "x", args.x, m.layout.in_x, stream);
    if (st.ok() && fp8) st = m.Stage(kOp, "x_scales", args.x_scales, m.layout.in_scales, stream);
    if (st.ok() && !cached) {
      st = m.Stage(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx, stream);
    }
    if (st.ok() && weights) {
      st = m.Stage(kOp, "topk_weights", args.topk_weights, m.layout.in_topk_weights, stream);
    }
    kc::NormalDispatchArgs a;
    a.fp8 = fp8;
    a.expert_alignment = std::max(1, args.expert_alignment);
    a.with_weights = weights;
    a.cached = cached != nullptr;
    const kc::CudaRankContext ctx = m.Context(args.num_sms);
    // A rejected rank still takes part with T = 0, so its peers' dispatch completes (as if
    // this rank had no tokens); the routing it leaves is not usable.
    EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, st.ok() ? static_cast<int32_t>(T) : 0, s));
    EPD_RETURN_IF_ERROR(kc::NormalDispatch(ctx, a, s));
    if (!st.ok()) {
      m.routing_seq = 0;
      return st;
    }
    EPD_RETURN_IF_ERROR(m.EndClientOp(seq, op, s, capturing));
    if (!cached) {
      m.routing_seq = seq;
      m.routing_tokens = static_cast<int32_t>(T);
    }
    m.last_dispatch_seq = seq;
  }
#endif
  if (seq == 0) {
    if (st.ok()) st = m.OrderAfterPreviousOp(stream);
    if (st.ok()) st = m.StageForSubmit(kOp, "x", args.x, m.layout.in_x, stream);
    if (st.ok() && fp8)
      st = m.StageForSubmit(kOp, "x_scales", args.x_scales, m.layout.in_scales, stream);
    if (st.ok() && !cached) {
      st = m.StageForSubmit(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx, stream);
    }
    if (st.ok() && weights) {
      st = m.StageForSubmit(kOp, "topk_weights", args.topk_weights, m.layout.in_topk_weights,
                            stream);
    }
    if (!st.ok()) return m.SubmitClientError(op, st);
    uint32_t flags = (fp8 ? abi::kFlagFp8 : 0) | (cached ? abi::kFlagCachedHandle : 0) |
                     (weights ? abi::kFlagDispatchWeights : 0);
    EPD_ASSIGN_OR_RETURN(seq, m.Submit(op, flags, static_cast<int32_t>(T), args.expert_alignment,
                                       cached ? cached->seq : 0, args.num_sms, stream));
  }
  m.NoteStream(seq, args.stream);
  DispatchResult r;
  r.handle.endpoint_id = m.info.endpoint_id();
  r.handle.seq = seq;
  r.handle.num_tokens = static_cast<int32_t>(T);
  r.handle.use_fp8 = fp8;
  r.handle.low_latency = false;
  // N is known now only for a cached re-dispatch; otherwise Wait fills the views in.
  if (cached) m.DispatchViews(r, cached->num_recv_tokens);
  return PendingOp<DispatchResult>(impl_, seq, std::move(r));
}

absl::StatusOr<PendingOp<CombineResult>> Endpoint::Combine(const CombineArgs& args) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  EPD_RETURN_IF_ERROR(m.CheckNoProgram());
  EPD_ASSIGN_OR_RETURN(void* const stream, m.OpStream(args.stream));
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
  } else if (args.handle->num_recv_tokens < 0) {
    st = absl::FailedPreconditionError(absl::StrCat(
        kOp,
        ": the handle comes from Enqueued() of a Dispatch, whose N is known only on the "
        "device; Wait for that Dispatch and use the handle Wait returns"));
  }
  const int64_t N = args.handle ? args.handle->num_recv_tokens : 0;
  if (st.ok()) {
    std::array<int64_t, 2> xs{N, m.shape.hidden};
    st = CheckTensor(m.cuda, kOp, "x", args.x, {kBf16}, xs);
  }
  const bool weights = args.topk_weights != nullptr;
  if (st.ok() && weights) {
    std::array<int64_t, 2> ws{N, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_weights", args.topk_weights, {kF32}, ws);
  }
  const int32_t T = args.handle ? args.handle->num_tokens : 0;
  uint64_t seq = 0;
#if EPD_HAVE_CUDA
  if (m.client_launched) {
    if (st.ok() && (m.routing_seq == 0 || args.handle->seq < m.routing_seq ||
                    args.handle->seq > m.last_dispatch_seq)) {
      st = absl::FailedPreconditionError(absl::StrCat(
          kOp, ": handle of op ", args.handle->seq,
          " is not the current dispatch routing of this endpoint (valid: ops ", m.routing_seq, "..",
          m.last_dispatch_seq, "); a handle is invalidated by the next Dispatch"));
    }
    if (st.ok() && T != m.routing_tokens) {
      st = absl::InvalidArgumentError(
          absl::StrCat(kOp, ": num_tokens ", T, " != the handle's ", m.routing_tokens));
    }
    EPD_RETURN_IF_ERROR(m.EnsureClientLaunch());
    internal::DeviceGuard guard(m.mapping->device());
    const cudaStream_t s = AsStream(stream);
    bool capturing = false;
    EPD_ASSIGN_OR_RETURN(seq, m.BeginClientOp(s, &capturing));
    if (st.ok()) st = m.Stage(kOp, "x", args.x, m.layout.in_combine_x, stream);
    if (st.ok() && weights) {
      st = m.Stage(kOp, "topk_weights", args.topk_weights, m.layout.in_combine_weights, stream);
    }
    if (!st.ok()) {
      // Take part with T = 0 and zero expert outputs, so the peers' combine completes (this
      // rank's experts then contribute zeros to their tokens).
      EPD_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(m.At(m.layout.in_combine_x), 0, m.layout.in_combine_x.bytes, s));
      EPD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(m.At(m.layout.in_combine_weights), 0,
                                               m.layout.in_combine_weights.bytes, s));
    }
    kc::NormalCombineArgs a;
    a.with_weights = weights;
    const kc::CudaRankContext ctx = m.Context(args.num_sms);
    EPD_RETURN_IF_ERROR(kc::SetNormalNumTokensAsync(ctx, st.ok() ? T : 0, s));
    EPD_RETURN_IF_ERROR(kc::NormalCombine(ctx, a, s));
    EPD_RETURN_IF_ERROR(st);
    EPD_RETURN_IF_ERROR(m.EndClientOp(seq, op, s, capturing));
  }
#endif
  if (seq == 0) {
    if (st.ok()) st = m.OrderAfterPreviousOp(stream);
    if (st.ok()) st = m.StageForSubmit(kOp, "x", args.x, m.layout.in_combine_x, stream);
    if (st.ok() && weights) {
      st = m.StageForSubmit(kOp, "topk_weights", args.topk_weights, m.layout.in_combine_weights,
                            stream);
    }
    if (!st.ok()) return m.SubmitClientError(op, st);
    EPD_ASSIGN_OR_RETURN(seq, m.Submit(op, weights ? abi::kFlagCombineWeights : 0, T, 1,
                                       args.handle->seq, args.num_sms, stream));
  }
  m.NoteStream(seq, args.stream);
  CombineResult r;
  r.combined_x = m.View(m.layout.combined_x, kBf16, {T, m.shape.hidden});
  if (weights) {
    r.combined_topk_weights = m.View(m.layout.combined_topk_weights, kF32, {T, m.shape.num_topk});
  }
  return PendingOp<CombineResult>(impl_, seq, std::move(r));
}

absl::StatusOr<PendingOp<LowLatencyDispatchResult>> Endpoint::LowLatencyDispatch(
    const LowLatencyDispatchArgs& args) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  EPD_RETURN_IF_ERROR(m.CheckNoProgram());
  EPD_ASSIGN_OR_RETURN(void* const stream, m.OpStream(args.stream));
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
  std::array<int64_t, 2> xs{-1, m.shape.hidden};
  if (st.ok()) st = CheckTensor(m.cuda, kOp, "x", args.x, {kBf16}, xs);
  // T, or with a device num_tokens the capacity of x and topk_idx (the kernel reads T).
  const int64_t T = st.ok() ? xs[0] : 0;
  if (st.ok() && T > Mll) {
    st = absl::InvalidArgumentError(
        absl::StrCat(kOp, ": x has ", T, " tokens > max_dispatch_tokens_per_rank ", Mll));
  }
  const bool use_fp8 = args.use_fp8;
  if (st.ok() && use_fp8 && m.shape.hidden % kernels::kFp8BlockChannels != 0) {
    st = absl::InvalidArgumentError(
        absl::StrCat(kOp, ": use_fp8 needs hidden % 128 == 0, hidden = ", m.shape.hidden));
  }
  if (st.ok() && use_fp8 && !m.shape.use_fp8) {
    st = absl::InvalidArgumentError(
        absl::StrCat(kOp, ": use_fp8 but group ", m.spec.name(), " has use_fp8 = false"));
  }
  if (st.ok()) {
    std::array<int64_t, 2> ts{T, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_idx", args.topk_idx, {kI64}, ts);
  }
  const bool runtime_tokens = args.num_tokens != nullptr;
  if (st.ok() && runtime_tokens) {
    bool client_launched = false;
#if EPD_HAVE_CUDA
    client_launched = m.client_launched;
#endif
    std::array<int64_t, 1> ns{1};
    if (!client_launched) {
      st = absl::InvalidArgumentError(absl::StrCat(
          kOp,
          ": num_tokens (T on the device) needs a client-launched endpoint; pass x with T "
          "rows instead"));
    } else {
      st = CheckTensor(m.cuda, kOp, "num_tokens", args.num_tokens, {kI32}, ns);
    }
#if EPD_HAVE_CUDA
    if (st.ok() && !ReadableInPlace(args.num_tokens, m.mapping->device(), alignof(int32_t))) {
      st = absl::InvalidArgumentError(absl::StrCat(
          kOp,
          ": num_tokens must be a 4-byte aligned int32 in the memory of the endpoint's GPU "
          "(kDLCUDA device ",
          m.mapping->device(), ")"));
    }
#endif
  }
  uint64_t seq = 0;
  int buffer = static_cast<int>(m.ll_dispatches % kernels::kLowLatencyBuffers);
#if EPD_HAVE_CUDA
  if (m.client_launched) {
    if (Mll == 0) return st;  // No low-latency buffers: nothing to take part in.
    EPD_RETURN_IF_ERROR(m.EnsureClientLaunch());
    const int device = m.mapping->device();
    internal::DeviceGuard guard(device);
    const cudaStream_t s = AsStream(stream);
    bool capturing = false;
    EPD_ASSIGN_OR_RETURN(seq, m.BeginClientOp(s, &capturing));
    kc::LowLatencyDispatchArgs a;
    a.buffer = buffer;
    a.use_fp8 = use_fp8 && m.shape.use_fp8 && m.shape.hidden % kernels::kFp8BlockChannels == 0;
    a.round_scale = args.round_scale;
    // Caller memory is read in place unless the kernel could read past it: with T on the
    // device, only when it has Mll rows (else it is staged into the Mll-row regions).
    const bool in_place_ok = !runtime_tokens || T == Mll;
    if (st.ok()) {
      st = m.ReadInPlaceOrStage(kOp, "x", args.x, m.layout.in_x, in_place_ok, 16, stream, &a.x);
    }
    if (st.ok()) {
      st = m.ReadInPlaceOrStage(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx, in_place_ok,
                                alignof(int64_t), stream, &a.topk_idx);
    }
    const kc::CudaRankContext ctx = m.Context(0);
    if (!st.ok()) {
      // A rejected rank takes part with T = 0 (its peers' dispatch completes, as if this
      // rank had no tokens); its buffer is then not usable by a combine.
      a.x = nullptr;
      a.topk_idx = nullptr;
      a.num_tokens_value = 0;
    } else if (runtime_tokens) {
      a.num_tokens = reinterpret_cast<const int32_t*>(TensorBytes(args.num_tokens));
    } else {
      a.num_tokens_value = static_cast<int32_t>(T);  // By value: no slot write to enqueue.
    }
    EPD_RETURN_IF_ERROR(kc::LowLatencyDispatch(ctx, a, s));
    ++m.ll_dispatches;
    m.ll_seq[buffer] = 0;
    EPD_RETURN_IF_ERROR(st);
    EPD_RETURN_IF_ERROR(m.EndClientOp(seq, op, s, capturing));
    m.ll_seq[buffer] = seq;
    m.ll_tokens[buffer] = static_cast<int32_t>(T);
    m.ll_runtime_tokens[buffer] = runtime_tokens;
  }
#endif
  if (seq == 0) {
    if (st.ok()) st = m.OrderAfterPreviousOp(stream);
    if (st.ok()) st = m.StageForSubmit(kOp, "x", args.x, m.layout.in_x, stream);
    if (st.ok())
      st = m.StageForSubmit(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx, stream);
    if (!st.ok()) return m.SubmitClientError(op, st);
    uint32_t flags = (use_fp8 ? abi::kFlagFp8 : 0) | (args.round_scale ? abi::kFlagRoundScale : 0);
    EPD_ASSIGN_OR_RETURN(seq, m.Submit(op, flags, static_cast<int32_t>(T), 1, 0, 0, stream));
    // The daemon's buffer, predicted for Enqueued(); Wait takes the completion's.
    ++m.ll_dispatches;
  }
  m.NoteStream(seq, args.stream);
  LowLatencyDispatchResult r;
  r.handle.endpoint_id = m.info.endpoint_id();
  r.handle.seq = seq;
  r.handle.low_latency = true;
  r.handle.num_tokens = static_cast<int32_t>(T);
  r.handle.use_fp8 = use_fp8;
  m.LowLatencyDispatchViews(r, buffer);
  return PendingOp<LowLatencyDispatchResult>(impl_, seq, std::move(r));
}

absl::StatusOr<PendingOp<LowLatencyCombineResult>> Endpoint::LowLatencyCombine(
    const LowLatencyCombineArgs& args) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  EPD_RETURN_IF_ERROR(m.CheckNoProgram());
  EPD_ASSIGN_OR_RETURN(void* const stream, m.OpStream(args.stream));
  constexpr const char* kOp = "LowLatencyCombine";
  const auto op = abi::OpKind::kLowLatencyCombine;
  [[maybe_unused]] const int32_t Mll = m.shape.ll_max_tokens_per_rank;
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
    std::array<int64_t, 3> xs{El, rows, m.shape.hidden};
    st = CheckTensor(m.cuda, kOp, "x", args.x, {kBf16}, xs);
  }
  if (st.ok()) {
    std::array<int64_t, 2> ts{T, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_idx", args.topk_idx, {kI64}, ts);
  }
  if (st.ok()) {
    std::array<int64_t, 2> ws{T, m.shape.num_topk};
    st = CheckTensor(m.cuda, kOp, "topk_weights", args.topk_weights, {kF32}, ws);
  }
  uint64_t seq = 0;
  const int out_buffer = static_cast<int>(m.ll_combines % kernels::kLowLatencyBuffers);
#if EPD_HAVE_CUDA
  if (m.client_launched) {
    if (Mll == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(kOp, ": group ", m.spec.name(),
                       " has ll_max_tokens_per_rank = 0 (low-latency disabled)"));
    }
    // The daemon's handle check, done here: the handle's dispatch must still own its buffer.
    int buffer = -1;
    for (int b = 0; b < kernels::kLowLatencyBuffers; ++b) {
      if (args.handle != nullptr && m.ll_seq[b] != 0 && m.ll_seq[b] == args.handle->seq) buffer = b;
    }
    if (st.ok() && buffer < 0) {
      st = absl::FailedPreconditionError(absl::StrCat(
          kOp, ": handle of op ", args.handle->seq,
          " is not one of this endpoint's last two low-latency dispatches (its buffers were "
          "reused, or the dispatch failed)"));
    }
    if (buffer < 0) {
      // A rejected rank takes part with the latest dispatch's buffer (what its peers use).
      if (m.ll_dispatches == 0) return st;
      buffer = static_cast<int>((m.ll_dispatches + 1) % kernels::kLowLatencyBuffers);
    }
    EPD_RETURN_IF_ERROR(m.EnsureClientLaunch());
    const int device = m.mapping->device();
    internal::DeviceGuard guard(device);
    const cudaStream_t s = AsStream(stream);
    bool capturing = false;
    EPD_ASSIGN_OR_RETURN(seq, m.BeginClientOp(s, &capturing));
    kc::LowLatencyCombineArgs a;
    a.buffer = buffer;
    a.combined_x = reinterpret_cast<kernels::bf16_bits*>(m.At(m.layout.ll_combined_x[out_buffer]));
    // x is read by every rank at the same offset of each area: in_ll_combine_x (staged
    // unless the caller wrote it there: LowLatencyCombineInput()).
    if (st.ok()) st = m.Stage(kOp, "x", args.x, m.layout.in_ll_combine_x, stream);
    const bool in_place_ok = !m.ll_runtime_tokens[buffer] || T == Mll;
    if (st.ok()) {
      st = m.ReadInPlaceOrStage(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx, in_place_ok,
                                alignof(int64_t), stream, &a.topk_idx);
    }
    if (st.ok()) {
      st = m.ReadInPlaceOrStage(kOp, "topk_weights", args.topk_weights, m.layout.in_topk_weights,
                                in_place_ok, alignof(float), stream, &a.topk_weights);
    }
    if (!st.ok()) {
      // Take part so the peers' combine completes: this rank's experts give zeros, and its
      // own tokens pull nothing (every topk_idx entry -1: bytes 0xff).
      a.topk_idx = nullptr;
      a.topk_weights = nullptr;
      EPD_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(m.At(m.layout.in_ll_combine_x), 0, m.layout.in_ll_combine_x.bytes, s));
      EPD_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(m.At(m.layout.in_topk_idx), 0xff, m.layout.in_topk_idx.bytes, s));
    }
    EPD_RETURN_IF_ERROR(kc::LowLatencyCombine(m.Context(0), a, s));
    ++m.ll_combines;
    EPD_RETURN_IF_ERROR(st);
    EPD_RETURN_IF_ERROR(m.EndClientOp(seq, op, s, capturing));
  }
#endif
  if (seq == 0) {
    if (st.ok()) st = m.OrderAfterPreviousOp(stream);
    if (st.ok()) st = m.StageForSubmit(kOp, "x", args.x, m.layout.in_ll_combine_x, stream);
    if (st.ok())
      st = m.StageForSubmit(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx, stream);
    if (st.ok()) {
      st = m.StageForSubmit(kOp, "topk_weights", args.topk_weights, m.layout.in_topk_weights,
                            stream);
    }
    if (!st.ok()) return m.SubmitClientError(op, st);
    EPD_ASSIGN_OR_RETURN(seq,
                         m.Submit(op, 0, static_cast<int32_t>(T), 1, args.handle->seq, 0, stream));
    ++m.ll_combines;  // The daemon's output buffer, predicted for Enqueued().
  }
  m.NoteStream(seq, args.stream);
  LowLatencyCombineResult r;
  r.combined_x = m.View(m.layout.ll_combined_x[out_buffer], kBf16, {T, m.shape.hidden});
  return PendingOp<LowLatencyCombineResult>(impl_, seq, std::move(r));
}

// ---- completion ------------------------------------------------------------------------

namespace {

/// FAILED_PRECONDITION for an op whose Endpoint was destroyed (`what`: "Wait", "Enqueued").
absl::Status EndpointDestroyed(const char* what, uint64_t seq) {
  return absl::FailedPreconditionError(absl::StrCat(
      what, ": op ", seq,
      ": endpoint destroyed (its buffers, which held the op's outputs, are unmapped); Wait for "
      "an op before destroying its Endpoint"));
}

}  // namespace

template <typename Result>
absl::StatusOr<Result> PendingOp<Result>::Wait(absl::Duration timeout) {
  const std::shared_ptr<Endpoint::Impl> endpoint = endpoint_.lock();
  if (endpoint == nullptr) return EndpointDestroyed("Wait", seq_);
  Endpoint::Impl& m = *endpoint;
  constexpr abi::OpKind kOp = OpKindOf<Result>();
  Result r = partial_;
#if EPD_HAVE_CUDA
  if (m.client_launched) {
    int32_t recv_count = 0;
    EPD_RETURN_IF_ERROR(m.WaitClientOp(seq_, kOp, timeout, &recv_count));
    if constexpr (std::is_same_v<Result, DispatchResult>) {
      if (!r.handle.low_latency && r.recv_x.data() == nullptr) m.DispatchViews(r, recv_count);
    }
    return r;
  }
#endif
  abi::Completion c{};
  absl::Status st = m.WaitCompletion(seq_, timeout, &c);
  if (st.code() == absl::StatusCode::kUnavailable) m.ReleaseStreams();
  if (!st.ok()) {
    if (c.seq == seq_) m.NoteDaemonFailure(seq_, kOp);  // The op's own failure.
    return st;
  }
  if constexpr (std::is_same_v<Result, DispatchResult>) {
    m.DispatchViews(r, c.num_recv_tokens);
  } else if constexpr (std::is_same_v<Result, LowLatencyDispatchResult>) {
    m.LowLatencyDispatchViews(r, c.buffer & 1);
  } else if constexpr (std::is_same_v<Result, LowLatencyCombineResult>) {
    // The daemon reports this rank's T in num_recv_tokens for low-latency combine.
    r.combined_x = m.View(m.layout.ll_combined_x[c.buffer & 1], kBf16,
                          {static_cast<int64_t>(c.num_recv_tokens), m.shape.hidden});
  }
  return r;
}

template <typename Result>
absl::StatusOr<Result> PendingOp<Result>::Enqueued() const {
  const std::shared_ptr<const Endpoint::Impl> endpoint = endpoint_.lock();
  if (endpoint == nullptr) return EndpointDestroyed("Enqueued", seq_);
  const Endpoint::Impl& m = *endpoint;
  if (!m.cuda) {
    return absl::FailedPreconditionError(
        "Enqueued: ops of the host backend are not stream-ordered; use Wait");
  }
  if (m.unordered_ops[seq_ % m.unordered_ops.size()] == seq_) {
    return absl::FailedPreconditionError(
        "Enqueued: the op was given no stream (its args' stream is null), so it is ordered "
        "before no work of the caller; its results are valid once Wait returns");
  }
  if constexpr (std::is_same_v<Result, DispatchResult>) {
    if (partial_.recv_x.data() == nullptr) {
      // N is on the device only: views of the capacity R*M rows, N in recv_count.
      DispatchResult r = partial_;
      m.DispatchViews(r, static_cast<int32_t>(m.shape.max_recv_tokens()));
      r.num_recv_tokens = -1;
      r.handle.num_recv_tokens = -1;
      return r;
    }
  }
  return partial_;
}

template class PendingOp<LayoutResult>;
template class PendingOp<DispatchResult>;
template class PendingOp<CombineResult>;
template class PendingOp<LowLatencyDispatchResult>;
template class PendingOp<LowLatencyCombineResult>;

// ---- opening ---------------------------------------------------------------------------

namespace internal {

absl::StatusOr<std::unique_ptr<Endpoint>> OpenEndpoint(const v1::EndpointInfo& info,
                                                       const v1::GroupSpec& spec, EndpointFds fds,
                                                       std::function<absl::Status()> leave,
                                                       std::shared_ptr<SessionWatch> session,
                                                       GroupEndpointsFn group_endpoints) {
  auto m = std::make_unique<Endpoint::Impl>();
  m->info = info;
  m->spec = spec;
  m->leave = std::move(leave);
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
  if (info.launch_mode() == v1::LAUNCH_MODE_CLIENT && !m->cuda) {
    return absl::FailedPreconditionError(
        "the daemon granted a client-launched endpoint on the host backend; client-launched "
        "mode needs the CUDA backend");
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
  if (fds.endpoint_id != info.endpoint_id()) {
    return absl::FailedPreconditionError(absl::StrCat("epd handed the memory of endpoint ",
                                                      fds.endpoint_id, " for endpoint ",
                                                      info.endpoint_id()));
  }
  // Sealed memfds of the expected sizes only: nothing can shrink them under the mapping.
  const std::string what = absl::StrCat("group ", info.group(), " rank ", info.rank());
  EPD_ASSIGN_OR_RETURN(m->region, ShmRegion::Map(std::move(fds.region), info.shm_bytes(),
                                                 absl::StrCat(what, ": endpoint region")));
  EPD_ASSIGN_OR_RETURN(m->doorbell_region,
                       ShmRegion::Map(std::move(fds.doorbell), sizeof(abi::DoorbellPage),
                                      absl::StrCat(what, ": doorbell")));
  m->header = reinterpret_cast<abi::EndpointShmHeader*>(m->region.data());
  m->doorbell = reinterpret_cast<abi::DoorbellPage*>(m->doorbell_region.data());
  // The doorbell page is shared with other clients of the engine, who can write its
  // header: only its two words are used, so its magic is not checked.
  const abi::EndpointShmHeader& h = *m->header;
  if (h.magic != abi::kEndpointMagic || h.version != abi::kShmAbiVersion ||
      h.size != sizeof(abi::EndpointShmHeader) || h.total_bytes != info.shm_bytes() ||
      h.data_offset != info.data_offset() || h.data_bytes < m->layout.total_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the endpoint region has a bad header (magic/version/size)"));
  }
  m->data = m->region.data() + h.data_offset;
#if EPD_HAVE_CUDA
  if (m->cuda) {
    EPD_ASSIGN_OR_RETURN(m->mapping,
                         internal::MapSharedArea(info.cuda_ipc_handle(), info.gpu_uuid()));
    m->data = m->mapping->data();
    m->device = DLDevice{kDLCUDA, m->mapping->device()};
    m->client_launched = info.launch_mode() == v1::LAUNCH_MODE_CLIENT;
    m->group_endpoints = std::move(group_endpoints);
    internal::DeviceGuard guard(m->mapping->device());
    EPD_ASSIGN_OR_RETURN(m->aux_stream, internal::CreateStream());
    if (!m->client_launched) {
      int mps = 0;
      if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, m->mapping->device()) !=
          cudaSuccess) {
        cudaGetLastError();  // Ours: no MPS assumed (the stream wait).
        mps = 0;
      }
      m->kernel_done_wait = info.kernel_done_wait() && mps != 0;
    }
  }
#else
  (void)group_endpoints;
#endif
  m->next_seq = info.first_seq();
  abi::Atomic(m->header->client_pid).store(static_cast<uint32_t>(::getpid()));
  abi::Atomic(m->header->client_mapped).store(1, std::memory_order_release);
  m->session = std::move(session);
  if (m->session != nullptr && m->cuda) {
    // A daemon that dies leaves the streams of daemon-launched ops waiting: release them.
    Endpoint::Impl* raw = m.get();
    m->session_hook = m->session->AddHook([raw] { raw->ReleaseStreams(); });
  }
  return std::make_unique<Endpoint>(std::move(m));
}

}  // namespace internal
}  // namespace epd
