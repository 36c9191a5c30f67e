// Graph mode on the client (client.h RegisterProgram): the program's registration through
// the ring, and each step's hand-off to the daemon's captured program on the caller's
// stream (go / done / ack words of launch_flags, layout.h).
#include <array>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/endpoint/endpoint_state.h"
#include "client/endpoint/tensor_checks.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "epd/kernels/op_rules.h"

#if EPD_HAVE_CUDA
#include "client/endpoint/client_launch.h"
#include "client/endpoint/daemon_launch.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/device_alloc.h"
#include "common/cuda/stream_memops.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_program.h"
#include "epd/kernels/rank_context.h"
#include "proto/abi/launch_flags.h"
#endif

namespace epd {

using internal::CheckStepTensor;
using internal::kBf16;
using internal::kF32;
using internal::kI32;
using internal::kI64;
using internal::TensorBytes;
#if EPD_HAVE_CUDA
namespace kc = kernels::cuda;
#endif

absl::Status Endpoint::RegisterProgram(const std::vector<ProgramStep>& steps,
                                       absl::Duration timeout) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  if (steps.empty() || steps.size() > abi::kMaxProgramSteps) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(
            "RegisterProgram: ", steps.size(), " steps, outside [1, ", abi::kMaxProgramSteps, "]")),
        errors::Reason::kProgramInvalid);
  }
  if (!m.program.empty()) {
    return errors::WithReason(
        absl::FailedPreconditionError(
            "RegisterProgram: this endpoint already has a program; UnregisterProgram first"),
        errors::Reason::kProgramInvalid);
  }
  abi::RequestSlot program{};
  program.program_num_steps = steps.size();
  std::vector<rules::ProgramStepPlan> plan(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    plan[i].op = steps[i].op == ProgramStep::Op::kLowLatencyDispatch
                     ? abi::OpKind::kLowLatencyDispatch
                     : abi::OpKind::kLowLatencyCombine;
    plan[i].use_fp8 = steps[i].use_fp8;
    plan[i].round_scale = steps[i].round_scale;
    plan[i].use_ue8m0 = steps[i].use_ue8m0;
    const uint8_t b =
        abi::EncodeProgramStep(plan[i].op, plan[i].use_fp8, plan[i].round_scale, plan[i].use_ue8m0);
    abi::SetProgramStep(program, static_cast<uint32_t>(i), b);
  }
  // The daemon's plan (PlanProgram), which it validates.
  rules::AssignProgramBuffers(plan);
  std::vector<int> buffer(steps.size()), out_buffer(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    buffer[i] = plan[i].buffer;
    out_buffer[i] = plan[i].out_buffer;
  }
#if EPD_HAVE_CUDA
  // The step's acknowledging kernel is loaded now, not lazily inside a capture or while
  // the group's kernels spin (DESIGN.md §3.2).
  if (m.cuda) {
    internal::DeviceGuard guard(m.mapping->device());
    EPD_RETURN_IF_ERROR(internal::PreloadKernelsOnce(m.mapping->device()));
    if (!m.client_launched && m.program_word == nullptr) {
      // Mapped: ReadWordAsync's kernel writes it.
      EPD_ASSIGN_OR_RETURN(
          m.program_word,
          AllocatePinned(sizeof(uint64_t), cudaHostAllocPortable | cudaHostAllocMapped));
    }
  }
#endif
  EPD_ASSIGN_OR_RETURN(uint64_t seq, m.SubmitUnordered(abi::OpKind::kRegisterProgram, program));
  abi::Completion c;
  EPD_RETURN_IF_ERROR(m.ring.WaitCompletion(seq, timeout, &c));
  m.program = steps;
  m.program_buffer = std::move(buffer);
  m.program_out_buffer = std::move(out_buffer);
  m.program_next = 0;
  m.program_errors_seen = 0;
  m.runner->ForgetLowLatencyHandles();
  return absl::OkStatus();
}

absl::Status Endpoint::UnregisterProgram(absl::Duration timeout) {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  EPD_ASSIGN_OR_RETURN(uint64_t seq, m.SubmitUnordered(abi::OpKind::kUnregisterProgram));
  abi::Completion c;
  EPD_RETURN_IF_ERROR(m.ring.WaitCompletion(seq, timeout, &c));
  m.program.clear();
  m.program_next = 0;
  return absl::OkStatus();
}

/// The checks every program step shares: a registered program on a daemon-launched CUDA
/// endpoint, and `want` as the next step.
static absl::Status CheckProgramStep(Endpoint::Impl& m, ProgramStep::Op want, const char* op) {
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  if (m.program.empty()) {
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                  op, ": no graph-mode program is registered on this endpoint")),
                              errors::Reason::kProgramInvalid);
  }
  const ProgramStep& next = m.program[m.program_next];
  if (next.op != want) {
    return errors::WithReason(
        absl::FailedPreconditionError(
            absl::StrCat(op, ": the program's next step (", m.program_next, ") is ",
                         next.op == ProgramStep::Op::kLowLatencyDispatch ? "LowLatencyDispatch"
                                                                         : "LowLatencyCombine",
                         "; steps run in program order")),
        errors::Reason::kProgramInvalid);
  }
  return absl::OkStatus();
}

#if EPD_HAVE_CUDA
/// The go / done / ack sequence of one program step on `stream` (layout.h): the step's
/// inputs recorded by StageForSubmit are copied by one kernel whose last block stores go = 1
/// (kc::CopyDeviceBatchAsync: a kernel's store reaches the daemon's stream sooner than a
/// stream memory write queued behind the caller's kernels, cuda_ops.h). Under MPS
/// (Impl::program_kernel_done_wait) that block then waits for done >= 1 itself and swaps 1 back to
/// 0 (kc::DoneWait with clear: the acknowledgement, no stream wait for the GPU front end to
/// wake, no second kernel); it holds one SM, which the daemon's program instances leave
/// free as its low-latency ops do (CudaRankContext::sms_left_per_rank). Otherwise the
/// stream waits for done and a one-thread kernel acknowledges it. Either way every
/// argument is a constant, so a captured graph replays it.
static absl::Status HandOffProgramStep(Endpoint::Impl& m, cudaStream_t stream) {
  uint8_t* flags = m.At(m.layout.launch_flags);
  uint64_t* done = reinterpret_cast<uint64_t*>(flags + abi::kProgramDoneOffset);
  const int num_copies = std::exchange(m.num_pending_copies, 0);
  kc::DoneWait done_wait;
  if (m.program_kernel_done_wait) {
    done_wait.flag = done;
    done_wait.value = 1;
    done_wait.clear = true;
    done_wait.timeout_ns = internal::KernelDoneWaitTimeoutNs(m.info.op_timeout_ms());
  }
  EPD_RETURN_IF_ERROR(
      kc::CopyDeviceBatchAsync(m.pending_copies.data(), num_copies,
                               reinterpret_cast<uint64_t*>(flags + abi::kProgramGoOffset), 1,
                               reinterpret_cast<uint32_t*>(flags + abi::kReadySignalCounterOffset),
                               stream, nullptr, done_wait));
  if (m.program_kernel_done_wait) return absl::OkStatus();
  EPD_RETURN_IF_ERROR(StreamWaitValue64Geq(stream, flags + abi::kProgramDoneOffset, 1));
  return kc::ProgramAckAsync(done, stream);
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
  std::array<int64_t, 2> xs{-1, m.shape.hidden};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "x", args.x, {kBf16}, xs, device));
  const int64_t C = xs[0];
  if (C > Mll) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  kOp, ": x has ", C, " rows > ll_max_tokens_per_rank ", Mll)),
                              errors::Reason::kProgramInvalid);
  }
  std::array<int64_t, 2> ts{C, m.shape.num_topk};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "topk_idx", args.topk_idx, {kI64}, ts, device));
  std::array<int64_t, 1> ns{1};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "num_tokens", args.num_tokens, {kI32}, ns, device));
  EPD_ASSIGN_OR_RETURN(void* const stream, m.OpStream(args.stream));
  internal::DeviceGuard guard(device);
  m.num_pending_copies = 0;
  EPD_RETURN_IF_ERROR(m.StageForSubmit(kOp, "x", args.x, m.layout.in_x, stream));
  EPD_RETURN_IF_ERROR(
      m.StageForSubmit(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx, stream));
  // A context that only addresses this rank's own area (LowLatencyNumTokensSlot).
  kc::RankPlacement at;
  at.rank = m.info.rank();
  at.own_base = m.data;
  at.op_timeout_ms = m.info.op_timeout_ms();
  const kc::CudaRankContext ctx = kc::MakeRankContext(m.shape, m.layout, at);
  // T into the rank's token-count slot, by the same kernel (x and topk_idx take two of its
  // kc::kMaxBatchCopies copies at most).
  m.pending_copies[m.num_pending_copies++] = {kc::LowLatencyNumTokensSlot(ctx),
                                              TensorBytes(args.num_tokens), sizeof(int32_t)};
  EPD_RETURN_IF_ERROR(HandOffProgramStep(m, static_cast<cudaStream_t>(stream)));
  const size_t i = m.program_next;
  m.program_next = (i + 1) % m.program.size();
  LowLatencyDispatchResult r;
  r.handle.endpoint_id = m.info.endpoint_id();
  r.handle.low_latency = true;
  r.handle.num_tokens = static_cast<int32_t>(C);
  r.handle.use_fp8 = m.program[i].use_fp8;
  r.handle.use_ue8m0 = m.program[i].use_fp8 && m.program[i].use_ue8m0;
  m.LowLatencyDispatchViews(r, m.program_buffer[i]);
  return r;
#else
  (void)args;
  return errors::WithReason(absl::FailedPreconditionError("RunProgramDispatch: built without CUDA"),
                            errors::Reason::kProgramInvalid);
#endif
}

absl::StatusOr<LowLatencyCombineResult> Endpoint::RunProgramCombine(
    const ProgramCombineArgs& args) {
  Impl& m = *impl_;
  constexpr const char* kOp = "RunProgramCombine";
  EPD_RETURN_IF_ERROR(CheckProgramStep(m, ProgramStep::Op::kLowLatencyCombine, kOp));
#if EPD_HAVE_CUDA
  const int device = m.mapping->device();
  std::array<int64_t, 3> xs{m.shape.num_local_experts(), m.shape.ll_rows_per_expert(),
                            m.shape.hidden};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "x", args.x, {kBf16}, xs, device));
  std::array<int64_t, 2> ts{-1, m.shape.num_topk};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "topk_idx", args.topk_idx, {kI64}, ts, device));
  const int64_t C = ts[0];
  if (C > m.shape.ll_max_tokens_per_rank) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  kOp, ": topk_idx has ", C, " rows > ll_max_tokens_per_rank ",
                                  m.shape.ll_max_tokens_per_rank)),
                              errors::Reason::kProgramInvalid);
  }
  std::array<int64_t, 2> ws{C, m.shape.num_topk};
  EPD_RETURN_IF_ERROR(CheckStepTensor(kOp, "topk_weights", args.topk_weights, {kF32}, ws, device));
  EPD_ASSIGN_OR_RETURN(void* const stream, m.OpStream(args.stream));
  internal::DeviceGuard guard(device);
  m.num_pending_copies = 0;
  EPD_RETURN_IF_ERROR(m.StageForSubmit(kOp, "x", args.x, m.layout.in_ll_combine_x, stream));
  EPD_RETURN_IF_ERROR(
      m.StageForSubmit(kOp, "topk_idx", args.topk_idx, m.layout.in_topk_idx, stream));
  EPD_RETURN_IF_ERROR(
      m.StageForSubmit(kOp, "topk_weights", args.topk_weights, m.layout.in_topk_weights, stream));
  EPD_RETURN_IF_ERROR(HandOffProgramStep(m, static_cast<cudaStream_t>(stream)));
  const size_t i = m.program_next;
  m.program_next = (i + 1) % m.program.size();
  LowLatencyCombineResult r;
  r.combined_x =
      m.View(m.layout.ll_combined_x[m.program_out_buffer[i]], kBf16, {C, m.shape.hidden});
  return r;
#else
  (void)args;
  return errors::WithReason(absl::FailedPreconditionError("RunProgramCombine: built without CUDA"),
                            errors::Reason::kProgramInvalid);
#endif
}

absl::Status Endpoint::ProgramStatus() {
  Impl& m = *impl_;
  EPD_RETURN_IF_ERROR(m.CheckUsable());
  abi::EndpointShmHeader* h = &m.ring.header();
  uint64_t instance = 0;
#if EPD_HAVE_CUDA
  if (m.cuda && !m.client_launched && m.program_word != nullptr) {
    // The latest instance whose results this endpoint's streams have seen (written by the
    // daemon's stream before done), read by a kernel (see program_word).
    internal::DeviceGuard guard(m.mapping->device());
    const auto* word = reinterpret_cast<const uint64_t*>(m.At(m.layout.launch_flags) +
                                                         abi::kProgramInstanceOffset);
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
      return errors::WithReason(absl::UnavailableError(absl::StrCat(
                                    "ProgramStatus: epd did not check program instance ", instance,
                                    " within op_timeout + 5 s; the daemon is gone or stuck")),
                                errors::Reason::kDaemonUnavailable);
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
    return errors::WithReason(
        absl::FailedPreconditionError(
            "ProgramStatus: the daemon disarmed this endpoint's program (see the error it "
            "reported); UnregisterProgram, then register it again"),
        errors::Reason::kProgramInvalid);
  }
  return absl::OkStatus();
}

}  // namespace epd
