// DaemonLaunch (daemon_launch.h).
#include "client/endpoint/daemon_launch.h"

#include <utility>

#include "client/endpoint/endpoint_state.h"
#include "common/status_macros.h"
#include "epd/kernels/op_rules.h"

#if EPD_HAVE_CUDA
#include "common/cuda/stream_memops.h"
#include "epd/kernels/cuda_ops.h"
#include "proto/abi/launch_flags.h"
#endif

namespace epd::internal {
namespace {

/// KernelDoneWaitTimeoutNs: 4 * op_timeout + kDoneWaitSlackMs, counted from the staging.
constexpr int64_t kDoneWaitTimeouts = 4;
constexpr int64_t kDoneWaitSlackMs = 20'000;

#if EPD_HAVE_CUDA
namespace kc = kernels::cuda;
cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }
#endif

}  // namespace

int64_t KernelDoneWaitTimeoutNs(int64_t op_timeout_ms) {
  return (kDoneWaitTimeouts * op_timeout_ms + kDoneWaitSlackMs) * 1'000'000;
}

DaemonLaunch::DaemonLaunch(Endpoint::Impl& endpoint) : m_(endpoint) {}

absl::StatusOr<uint64_t> DaemonLaunch::Run(const OpPlan& p) {
  absl::Status st = p.status;
  if (st.ok()) st = OrderAfterPreviousOp(p.stream);
  for (int i = 0; i < p.num_inputs && st.ok(); ++i) {
    const OpInput& in = p.inputs[i];
    st = m_.StageForSubmit(p.name, in.name, in.tensor, in.region, p.stream);
  }
  if (!st.ok()) {
    (void)Submit(p.op, abi::kFlagClientError, 0, 1, 0, 0, nullptr);
    return st;
  }
  return Submit(p.op, p.flags, p.num_tokens, p.expert_alignment, p.handle_seq, p.num_sms, p.stream);
}

absl::StatusOr<OpOutcome> DaemonLaunch::Wait(uint64_t seq, abi::OpKind /*op*/,
                                             absl::Duration timeout) {
  abi::Completion c{};
  absl::Status st = m_.ring.WaitCompletion(seq, timeout, &c);
  if (st.code() == absl::StatusCode::kUnavailable) ReleaseStreams();
  if (!st.ok()) return st;
  OpOutcome outcome;
  // (Low-latency combine: the daemon reports this rank's T in num_recv_tokens.)
  outcome.num_recv_tokens = c.num_recv_tokens;
  outcome.buffer = static_cast<int>(c.buffer & 1);
  outcome.replaces_views = true;
  outcome.mask.epoch = c.mask_epoch;
  outcome.mask.num_masked = static_cast<int32_t>(c.num_masked);
  outcome.mask.dropped_pairs = c.dropped_pairs;
  return outcome;
}

absl::Status DaemonLaunch::OrderAfterPreviousOp(void* stream) {
#if EPD_HAVE_CUDA
  m_.num_pending_copies = 0;
  if (!m_.cuda || last_ordered_seq_ == 0 || stream == last_ordered_stream_) {
    return absl::OkStatus();
  }
  DeviceGuard guard(m_.mapping->device());
  return StreamWaitValue64Geq(
      AsStream(stream), m_.At(m_.layout.launch_flags) + abi::kDoneFlagOffset, last_ordered_seq_);
#else
  (void)stream;
  return absl::OkStatus();
#endif
}

bool DaemonLaunch::KernelWaitsForDone(abi::OpKind op) const {
  return m_.kernel_done_wait && rules::IsLowLatency(op);
}

absl::StatusOr<uint64_t> DaemonLaunch::Submit(abi::OpKind op, uint32_t flags, int32_t num_tokens,
                                              int32_t expert_alignment, uint64_t handle_seq,
                                              int32_t num_sms, void* stream) {
#if EPD_HAVE_CUDA
  // The copies StageForSubmit recorded belong to this op only, whichever way it ends.
  const int num_copies = std::exchange(m_.num_pending_copies, 0);
#endif
  EPD_RETURN_IF_ERROR(m_.ring.WaitForSpace());
  const uint64_t seq = m_.next_seq++;
  absl::Status ordered_error;
#if EPD_HAVE_CUDA
  const bool ordered = m_.cuda && (flags & abi::kFlagClientError) == 0;
  uint8_t* launch_flags = m_.At(m_.layout.launch_flags);
  if (ordered) {
    DeviceGuard guard(m_.mapping->device());
    // ready_seq = seq by a kernel (with the inputs StageForSubmit recorded): a kernel's
    // store is seen by the daemon's WaitFlagAsync at once, where a stream memory write
    // queued behind the caller's kernels lands well after them (cuda_ops.h). The same
    // kernel writes staging_seq = seq once all its blocks are resident, so the daemon's
    // kernel is launched while the copies run (layout.h). Under MPS a low-latency op's
    // kernel then also waits for done_seq (kernel_done_wait), in place of the stream wait
    // below.
    kc::DoneWait done_wait;
    if (KernelWaitsForDone(op)) {
      done_wait.flag = reinterpret_cast<uint64_t*>(launch_flags + abi::kDoneFlagOffset);
      done_wait.value = seq;
      done_wait.timeout_ns = KernelDoneWaitTimeoutNs(m_.info.op_timeout_ms());
    }
    ordered_error = kc::CopyDeviceBatchAsync(
        m_.pending_copies.data(), num_copies,
        reinterpret_cast<uint64_t*>(launch_flags + abi::kReadyFlagOffset), seq,
        reinterpret_cast<uint32_t*>(launch_flags + abi::kReadySignalCounterOffset),
        AsStream(stream), reinterpret_cast<uint64_t*>(launch_flags + abi::kStagingFlagOffset),
        done_wait);
    // Without the ready flag the daemon could not order its kernels: fail the op for
    // every rank instead (as a client error), and return the driver's error.
    flags |= ordered_error.ok() ? abi::kFlagStreamOrdered : abi::kFlagClientError;
  }
#else
  (void)stream;
#endif
  m_.ring.Publish(Endpoint::Impl::MakeRequest(op, seq, flags, num_tokens, expert_alignment,
                                              handle_seq, num_sms));
  m_.parity.Advance(op);  // The daemon counts every op it is handed, failed ones too.
#if EPD_HAVE_CUDA
  if (ordered && ordered_error.ok()) {
    ordered_ops_[seq % ordered_ops_.size()].store(seq, std::memory_order_release);
    DeviceGuard guard(m_.mapping->device());
    if (!KernelWaitsForDone(op)) {
      ordered_error =
          StreamWaitValue64Geq(AsStream(stream), launch_flags + abi::kDoneFlagOffset, seq);
    }
    if (ordered_error.ok()) {
      last_ordered_stream_ = stream;
      last_ordered_seq_ = seq;
    }
  }
#endif
  if (!ordered_error.ok()) return ordered_error;
  return seq;
}

void DaemonLaunch::ReleaseStreams() {
#if EPD_HAVE_CUDA
  if (!m_.cuda || m_.aux_stream == nullptr || stream_released_.load()) return;
  uint8_t* launch_flags = m_.At(m_.layout.launch_flags);
  if (!m_.program.empty()) {
    // A stream at a program step's done wait: done = kProgramReleased, which no ack
    // clears (layout.h); a stream memory write, as for done_seq below.
    DeviceGuard guard(m_.mapping->device());
    (void)StreamWriteValue64(m_.aux_stream.get(), launch_flags + abi::kProgramDoneOffset,
                             abi::kProgramReleased);
    cudaStreamSynchronize(m_.aux_stream.get());
    cudaGetLastError();
  }
  bool waiting = false;
  for (const std::atomic<uint64_t>& ordered : ordered_ops_) {
    const uint64_t seq = ordered.load(std::memory_order_acquire);
    if (seq != 0 && !m_.ring.Completed(seq)) waiting = true;
  }
  if (!waiting || stream_released_.exchange(true)) return;
  DeviceGuard guard(m_.mapping->device());
  // A stream memory write, not a copy: a copy would queue on the copy engine that the
  // process's other streams share, where one held behind a stream-ordered op could keep
  // the release from landing. (Stream memory operations are there: the daemon accepts no
  // stream-ordered op without them, CudaGroup::CheckRequest.)
  (void)StreamWriteValue64(m_.aux_stream.get(), launch_flags + abi::kDoneFlagOffset,
                           abi::kReleasedSeq);
  cudaStreamSynchronize(m_.aux_stream.get());
  cudaGetLastError();
#endif
}

}  // namespace epd::internal
