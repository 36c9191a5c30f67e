// DaemonLaunch: the OpRunner of daemon-launched endpoints (and of every host-backend
// endpoint). Inputs are staged, the request goes through the ring, and the daemon runs the
// op. On the CUDA backend the hand-off is stream-ordered (DESIGN.md §3.2): one kernel on the
// caller's stream copies the inputs and sets ready_seq, then the stream waits for the
// daemon's done_seq (or, for a low-latency op under MPS, that kernel waits for it itself).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

#include "client/endpoint/op_runner.h"
#include "epd/client.h"
#include "proto/abi/launch_flags.h"

namespace epd::internal {

/// Bound of a staging kernel's wait for done (kc::DoneWait::timeout_ns), in ns:
/// 4 * op_timeout + 20 s, counted from the staging. A successful op stores done within
/// about 2 * op_timeout of it (the daemon waits up to op_timeout for the other ranks'
/// requests, then the kernel's peer waits up to op_timeout) and a failed dispatch within
/// one more (its block 0 waits for the others' tickets). A fused launch (every rank of a
/// GPU in one kernel) starts once every rank's staging has, or at the engine's give-up
/// (op_timeout + 5 s after its launch) when one never does: up to one more op_timeout and
/// 5 s. A graph-mode program step's done comes sooner: its instance is enqueued ahead and
/// waits for this go only, then its kernel's peer waits take up to op_timeout. So the bound
/// passes only when the daemon is gone or stuck, whose op's Wait (or ProgramStatus) fails
/// anyway.
int64_t KernelDoneWaitTimeoutNs(int64_t op_timeout_ms);

class DaemonLaunch final : public OpRunner {
 public:
  /// `endpoint` outlives the runner; its kernel_done_wait says whether a low-latency op's
  /// staging kernel waits for done itself.
  explicit DaemonLaunch(Endpoint::Impl& endpoint);

  /// A rejected op (plan.status) is reported to the group as a client error, so the other
  /// ranks' op fails promptly and sequence numbers stay aligned, and its error returned
  /// at once (its completion is not waited for).
  absl::StatusOr<uint64_t> Run(const OpPlan& plan) override;
  absl::StatusOr<OpOutcome> Wait(uint64_t seq, abi::OpKind op, absl::Duration timeout) override;
  /// CUDA backend: releases every stream still waiting for a done flag of this endpoint
  /// by writing done_seq = kReleasedSeq (and a program step's done) from the host, on the
  /// library's own stream. Only when some stream-ordered op has no completion yet. Once.
  void ReleaseStreams() override;

 private:
  /// Starts an op on `stream` (before its staging). The ops of an endpoint share its
  /// staging regions, its ready_seq word and the staging kernel's ticket word, so they
  /// must reach the GPU in seq order: when the previous stream-ordered op ran on another
  /// stream, `stream` first waits (on the GPU) for its done_seq.
  absl::Status OrderAfterPreviousOp(void* stream);
  /// Whether the staging kernel of `op` waits for its done_seq itself
  /// (Endpoint::Impl::kernel_done_wait: low-latency ops under MPS) instead of a stream wait
  /// after it.
  bool KernelWaitsForDone(abi::OpKind op) const;
  /// Publishes one request; returns its seq. Stream-ordered on `stream` on the CUDA
  /// backend unless it carries kFlagClientError.
  absl::StatusOr<uint64_t> Submit(abi::OpKind op, uint32_t flags, int32_t num_tokens,
                                  int32_t expert_alignment, uint64_t handle_seq, int32_t num_sms,
                                  void* stream);
  Endpoint::Impl& m_;
  std::atomic<bool> stream_released_{false};
  /// Stream-ordered ops published, by seq % size (ReleaseStreams checks which are done).
  std::array<std::atomic<uint64_t>, abi::kCompletionCapacity> ordered_ops_{};
  /// The stream and seq of the last stream-ordered op (OrderAfterPreviousOp).
  void* last_ordered_stream_ = nullptr;
  uint64_t last_ordered_seq_ = 0;
};

}  // namespace epd::internal
