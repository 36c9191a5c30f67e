// ClientLaunch: the OpRunner of client-launched endpoints (CUDA only). The client launches
// the kernels of epd/kernels/{cuda_ops.h,cuda_normal.h} itself on the caller's stream, on
// every rank's data area (mapped once, from GetGroupEndpoints, before the first op); the
// daemon's ring is not used. It keeps the handle table (which routing and low-latency
// buffers are current), and a rejected rank still takes part with T = 0. Wait waits for an
// event recorded after the op and reads the op's DeviceStatus.
#pragma once

#if EPD_HAVE_CUDA

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "client/cuda/cuda_ipc.h"
#include "client/cuda/device_guard.h"
#include "client/endpoint/endpoint_internal.h"
#include "client/endpoint/op_runner.h"
#include "common/cuda/cuda_handles.h"
#include "common/cuda/device_alloc.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_span.h"
#include "epd/kernels/op_rules.h"
#include "proto/abi/span_abi.h"

namespace epd::internal {

/// Loads every kernel on the current device once per process (DESIGN.md §3.2: a lazily
/// loaded kernel's first launch waits for running kernels, which deadlocks kernels that
/// spin on each other). Errors: CUDA's, as INTERNAL.
absl::Status PreloadKernelsOnce(int device);

class ClientLaunch final : public OpRunner {
 public:
  /// `endpoint` outlives the runner; `group_endpoints` lists the group's endpoints at the
  /// first op (without it that op fails with FAILED_PRECONDITION).
  ClientLaunch(Endpoint::Impl& endpoint, GroupEndpointsFn group_endpoints);

  /// Validates the op's handle against the handle table, then launches the op's kernels.
  /// A rejected op (plan.status, or a stale handle) still launches them with T = 0 (no
  /// inputs; a combine's inputs zeroed) so the peers' op completes, and returns its error.
  absl::StatusOr<uint64_t> Run(const OpPlan& plan) override;
  /// The op's status (and N for Dispatch) once its stream has passed it. Bounded by
  /// `timeout` and by op_timeout + 5 s (DEADLINE_EXCEEDED; the op stays pending). A
  /// captured op is not waited for (see Endpoint docs).
  absl::StatusOr<OpOutcome> Wait(uint64_t seq, abi::OpKind op, absl::Duration timeout) override;
  void ForgetLowLatencyHandles() override;
  /// Sets up now when that needs no peer (a group across nodes: its mirror, its device
  /// state), so that no op, captured or not, pays for it; a no-op otherwise (one node: the
  /// first op maps the peers' areas). Errors as the first op's set-up.
  absl::Status PrepareWithoutPeers() { return spanning_ ? EnsureSetUp() : absl::OkStatus(); }

 private:
  /// Ops whose completion records are kept: Wait works for the latest kSlots ops.
  static constexpr uint32_t kSlots = abi::kCompletionCapacity;
  /// What an op's kernels write back (pinned host memory, mapped: no copy engine).
  struct Readback {
    kernels::cuda::DeviceStatus status;  ///< By EnqueueStatusReadback's kernel.
    int32_t recv_count;  ///< Dispatch: N, by its kernel (NormalDispatchArgs::recv_count_out).
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

  /// Sets up once: every rank's area (GetGroupEndpoints, waiting up to op_timeout for every
  /// rank to join), the device array of bases, the kernels, the completion records.
  /// Errors: FAILED_PRECONDITION (no control channel, a rank not client-launched, a stale
  /// endpoint), the RPC's errors, CUDA errors (INTERNAL).
  absl::Status EnsureSetUp();
  /// The handle table's verdict on a (so far valid) op, and the low-latency buffer it
  /// reads (`*buffer`). Returns false when the rank takes no part at all (`*st` says why).
  bool CheckHandle(const OpPlan& p, absl::Status* st, int* buffer) const;
  /// Launches the op's kernels: with plan.num_tokens, or T = 0 and no inputs when
  /// `rejected` (`in_place`: the inputs read in place, by index; null = the region). A
  /// dispatch's kernel writes N into `recv_count_out` (mapped pinned memory) unless null.
  absl::Status Launch(const OpPlan& p, bool rejected, int buffer,
                      const std::array<const void*, 4>& in_place, int32_t* recv_count_out,
                      cudaStream_t s);
  /// Says whether `stream` is capturing a CUDA graph and assigns the op's seq. Call with
  /// the endpoint's device current.
  absl::StatusOr<uint64_t> Begin(cudaStream_t stream, bool* capturing);
  /// Unless capturing, records the slot's event (which Wait polls) after the read-back of
  /// the op's DeviceStatus (a Dispatch's kernel has written N itself). A low-latency op gets
  /// no read-back here: Wait enqueues it on the op's stream. A captured op gets no
  /// read-back: Wait reads the device status itself once the graph's replay is done.
  absl::Status End(uint64_t seq, abi::OpKind op, cudaStream_t stream, bool capturing);
  /// After an op's kernels were enqueued (or refused with `st`): advances the buffer rule,
  /// updates the handle table, then End. Returns `st` or End's error.
  absl::Status Record(const OpPlan& p, uint64_t seq, int buffer, bool rejected, bool runtime_tokens,
                      const absl::Status& st, cudaStream_t s, bool capturing);
  Readback& readback(uint32_t i) { return readback_memory_.get()[i]; }

  // ---- a group that spans nodes (span_launch.cc, DESIGN.md §5.5 "Client-launched") ----
  // The daemon runs the exchange; the client's kernels post each op as a command into the
  // rank's mirror (its endpoint region, mapped here) and copy the answer back. No other
  // rank's area is mapped.
  /// Maps the mirror and its command block for the GPU, the device state, the read-backs.
  /// Errors: FAILED_PRECONDITION (a region without the block, a bad magic or version),
  /// CUDA errors (INTERNAL).
  absl::Status SetUpSpanning();
  /// Run of a spanning group's op: its inputs staged into the GPU area, then the posting
  /// and the await kernel on the op's stream. A rejected op posts a command with
  /// kFlagClientError (the daemon fails the op for every rank) and copies nothing.
  absl::StatusOr<uint64_t> RunSpanning(const OpPlan& p);
  /// The posting kernel's arguments for `p` (its input ranges, T, the handle).
  kernels::cuda::SpanPostArgs PostArgs(const OpPlan& p, int buffer, bool rejected) const;
  /// The outcome of a spanning op from its read-back (and the daemon's message).
  absl::StatusOr<OpOutcome> SpanOutcome(uint64_t seq, abi::OpKind op,
                                        const kernels::cuda::SpanReadback& rb) const;
  /// SpanOutcome, forgetting a handle the op produced when it failed (as Wait does).
  absl::StatusOr<OpOutcome> SpanWaited(uint64_t seq, abi::OpKind op,
                                       const kernels::cuda::SpanReadback& rb) {
    absl::StatusOr<OpOutcome> outcome = SpanOutcome(seq, op, rb);
    if (!outcome.ok()) handles_.Forget(seq);
    return outcome;
  }
  kernels::cuda::SpanReadback& span_readback(uint32_t i) { return span_readback_.get()[i]; }

  const bool spanning_;
  abi::SpanControl* control_host_ = nullptr;  ///< In the endpoint region (ring's mapping).
  HostRegistration mirror_registration_;      ///< The mirror and its block, for the GPU.
  uint8_t* mirror_device_ = nullptr;
  abi::SpanControl* control_device_ = nullptr;
  DeviceMemory span_state_;  ///< kernels::cuda::SpanDeviceState.
  /// [kSlots + 1], mapped: the await kernel's; the last for captured ops.
  PinnedArray<kernels::cuda::SpanReadback> span_readback_;

  Endpoint::Impl& m_;
  GroupEndpointsFn group_endpoints_;
  bool set_up_ = false;
  std::vector<std::shared_ptr<const CudaAreaMapping>> areas_;  ///< [R], own included.
  DeviceMemory peer_bases_;  ///< Device array [R] of the areas' bases.
  kernels::cuda::CudaRankContext ctx_;
  PinnedArray<Readback> readback_memory_;  ///< Readback [kSlots + 1]; the last for Wait of a
                                           ///< captured op (synchronous read).
  std::vector<EventHandle> events_;        ///< [kSlots]: recorded after each op.
  std::array<Slot, kSlots> slots_;

  /// The handle table: client-launched, the client is its authority.
  rules::HandleTable handles_;
  bool ll_runtime_tokens_[kernels::kLowLatencyBuffers] = {false, false};  ///< T on device.
};

}  // namespace epd::internal

#endif  // EPD_HAVE_CUDA
