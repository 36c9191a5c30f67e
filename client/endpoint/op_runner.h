// OpRunner: how an endpoint runs a validated op. An op is validated and described as an
// OpPlan (its inputs and their staging regions, the request flags and values) by
// endpoint.cc, then run by one of two runners: DaemonLaunch (daemon_launch.h: the ring, and
// on CUDA the stream-ordered hand-off) or ClientLaunch (client_launch.h: the client
// launches the kernels on every rank's mapped area).
#pragma once

#include <array>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "epd/client.h"
#include "epd/kernels/layout.h"
#include "proto/abi/shm_abi.h"

namespace epd::internal {

/// One input of an op: the caller's tensor and the endpoint region it is staged into.
struct OpInput {
  const char* name = nullptr;  ///< The argument's name, for errors.
  const DLTensor* tensor = nullptr;
  kernels::Region region;
  /// Client-launched: the kernel takes this input by pointer, so it may read the caller's
  /// memory in place (when ClientLaunch allows it) instead of `region`.
  bool by_pointer = false;
  uintptr_t alignment = 1;  ///< With by_pointer: the alignment the kernel needs in place.
};

/// A validated op, as both runners take it. `status` is the validation's verdict: a
/// rejected op is still run so the group's other ranks are not left waiting (each runner
/// says how) and Run then returns `status`.
struct OpPlan {
  abi::OpKind op = abi::OpKind::kGetDispatchLayout;
  const char* name = "";  ///< The public op's name, for errors.
  absl::Status status;
  void* stream = nullptr;  ///< OpStream's stream (CUDA backend), null on the host backend.
  uint32_t flags = 0;      ///< abi::kFlag* of the request (kFlagFp8, kFlagCachedHandle, ...).
  int32_t num_tokens = 0;  ///< T (for a rejected op, what validation saw: 0 when unknown).
  int32_t expert_alignment = 1;
  uint64_t handle_seq = 0;  ///< The handle's dispatch (Combine, cached Dispatch, LL combine).
  int32_t num_sms = 0;
  /// LowLatencyDispatch with T on the device (client-launched only).
  const DLTensor* device_num_tokens = nullptr;
  int buffer = 0;      ///< Low-latency ops: the dispatch buffer (client-launched dispatch).
  int out_buffer = 0;  ///< LowLatencyCombine: the output buffer.
  std::array<OpInput, 4> inputs{};
  int num_inputs = 0;

  /// Adds an input (at most 4).
  void Add(const char* input_name, const DLTensor* t, const kernels::Region& r,
           bool by_pointer = false, uintptr_t alignment = 1) {
    inputs[num_inputs++] = {input_name, t, r, by_pointer, alignment};
  }
};

/// What Wait learnt of a finished op, beyond what the op's call already built.
struct OpOutcome {
  /// Dispatch: N; LowLatencyCombine: this rank's T. -1 when not reported.
  int32_t num_recv_tokens = -1;
  /// Low-latency ops: the buffer the op used, -1 when the one planned.
  int buffer = -1;
  /// Dispatch: the views are rebuilt from num_recv_tokens even when the op built them.
  bool replaces_views = false;
  /// The rank mask the op ran with (the completion's; zeros when not reported).
  OpMask mask;
};

/// Runs validated ops of one endpoint. Not thread-safe (an endpoint is driven by one
/// thread at a time).
class OpRunner {
 public:
  virtual ~OpRunner() = default;
  /// Runs `plan` (ordered on plan.stream); returns the op's seq, or plan.status for a
  /// rejected op, or the runner's own error (ring full, CUDA errors).
  virtual absl::StatusOr<uint64_t> Run(const OpPlan& plan) = 0;
  /// Waits up to `timeout` for op `seq` of kind `op`; returns its outcome or error.
  virtual absl::StatusOr<OpOutcome> Wait(uint64_t seq, abi::OpKind op, absl::Duration timeout) = 0;
  /// Releases every stream still waiting for this endpoint's daemon (the daemon is gone,
  /// or the endpoint is destroyed). Best effort, idempotent.
  virtual void ReleaseStreams() {}
  /// A graph-mode program was registered: the low-latency handles of earlier ops are void.
  virtual void ForgetLowLatencyHandles() {}
};

}  // namespace epd::internal
