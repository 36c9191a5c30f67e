// Endpoint::Impl: what one endpoint keeps (identity, mapping, ring channel, staging state,
// graph-mode program, runner). Its methods live by concept: staging.cc (streams and
// staging), result_views.cc (output views and PendingOp), graph_program.cc,
// open_endpoint.cc; the ops in endpoint.cc. Internal to libepdclient.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/endpoint/joined_endpoints.h"
#include "client/endpoint/op_runner.h"
#include "client/endpoint/ring_channel.h"
#include "client/session_watch.h"
#include "epd/client.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/op_rules.h"
#include "epd/v1/control.pb.h"
#include "proto/abi/shm_abi.h"

#if EPD_HAVE_CUDA
#include <cuda_runtime.h>

#include "client/cuda/cuda_ipc.h"
#include "client/cuda/device_guard.h"
#include "common/cuda/cuda_handles.h"
#include "common/cuda/device_alloc.h"
#include "epd/kernels/cuda_ops.h"
#endif

namespace epd {

struct Endpoint::Impl {
  // ---- identity and memory ----
  v1::EndpointInfo info;
  v1::GroupSpec spec;
  kernels::GroupShape shape;
  kernels::EndpointLayout layout;
  internal::RingChannel ring;
  uint8_t* data = nullptr;  ///< The data area (shm region, or the CUDA mapping).
  DLDevice device{kDLCPU, 0};
  bool cuda = false;             ///< CUDA backend: `data` is device memory.
  bool client_launched = false;  ///< LAUNCH_MODE_CLIENT (CUDA only).
  /// Daemon-launched CUDA: EndpointInfo kernel_done_wait, and this process sees MPS on the
  /// endpoint's GPU too. A low-latency op's staging kernel (DaemonLaunch) then waits for
  /// done_seq itself (kc::DoneWait) instead of a stream wait; without MPS here a spinning
  /// client kernel would hold the GPU's time slice the daemon's kernels need.
  bool kernel_done_wait = false;
  /// The same for a graph-mode program step (EndpointInfo program_kernel_done_wait and
  /// MPS here): its staging kernel waits for program_done and acknowledges it
  /// (graph_program.cc HandOffProgramStep).
  bool program_kernel_done_wait = false;
  uint64_t next_seq = 1;                            ///< The next op's seq (both runners).
  std::shared_ptr<internal::SessionWatch> session;  ///< See OpenEndpoint.
  uint64_t session_hook = 0;                        ///< Our hook in `session` (0 = none).
  std::function<absl::Status()> leave;
  /// See OpenEndpoint (internal::RankMaskFn).
  std::function<absl::StatusOr<v1::RankMask>(const v1::UpdateRankMaskRequest*)> rank_mask;
  bool left = false;
  std::unique_ptr<internal::OpRunner> runner;
  /// The Client's record of its endpoints (Leave removes this one); null for an endpoint
  /// Client::Join did not record.
  std::shared_ptr<internal::JoinedEndpoints> joined;
  /// Set by Retire: Client::Reconnect re-bound the Endpoint, so ops of this binding fail
  /// with UNAVAILABLE.
  bool retired = false;
  /// The binding Client::Reconnect replaced (retired), kept while the Endpoint lives for
  /// its pending ops and, on the host backend, the buffers stale views point into.
  std::shared_ptr<Impl> previous;

  /// The low-latency buffers of the group's next ops (rules::LowLatencyParity), counted from
  /// EndpointInfo's first_ll_* on: every low-latency op the runners hand over, failed ones
  /// included, advances it, as the daemon counts them.
  rules::LowLatencyParity parity;

  // ---- staging (staging.cc) ----
#if EPD_HAVE_CUDA
  std::shared_ptr<const internal::CudaAreaMapping> mapping;  ///< The data area.
  StreamHandle aux_stream;   ///< The library's own stream (releases, reads).
  StreamHandle own_stream;   ///< Runs the ops given no stream (OpStream).
  EventHandle legacy_event;  ///< Orders own_stream after the legacy stream.
  /// Daemon-launched: copies of the op being built that one kernel does together with the
  /// ready signal (StageForSubmit; kc::CopyDeviceBatchAsync).
  std::array<kernels::cuda::DeviceCopy, kernels::cuda::kMaxBatchCopies> pending_copies{};
  int num_pending_copies = 0;
#endif
  /// Ops given no stream, by seq % size: Enqueued() refuses them.
  std::array<uint64_t, abi::kCompletionCapacity> unordered_ops{};

  // ---- graph mode (graph_program.cc): the registered program (empty = none), the next
  // step's index, and the daemon's error count already returned by ProgramStatus.
  std::vector<ProgramStep> program;
  std::vector<int> program_buffer;      ///< Per step: dispatch/handle buffer (see client.h).
  std::vector<int> program_out_buffer;  ///< Per step: combine output buffer.
  size_t program_next = 0;
  uint64_t program_errors_seen = 0;
#if EPD_HAVE_CUDA
  /// Pinned uint64 ProgramStatus reads launch_flags' program instance into (with a kernel:
  /// a device-to-host copy could queue behind the daemon's waiting instances, see
  /// epd/kernels/cuda_program.h). Allocated by the first RegisterProgram.
  PinnedMemory program_word;
#endif

  ~Impl();

  /// Retires this binding (Endpoint::Rebind): marks it left and retired (no LeaveGroup is
  /// sent: the daemon that granted it is gone), releases streams still waiting for it,
  /// drops its runner and, on CUDA, its device mapping; the host region stays mapped.
  void Retire();
  /// UNAVAILABLE naming op `seq` when this binding is retired, else OK (`what`: the call).
  absl::Status CheckNotRetired(const char* what, uint64_t seq) const;

  uint8_t* At(const kernels::Region& r) const { return data + r.offset; }

  /// OK while the endpoint can run ops: not left, not closed by the daemon, its Session
  /// not lost (FAILED_PRECONDITION / UNAVAILABLE otherwise).
  absl::Status CheckUsable() const;
  /// The rank mask RPC (`rank_mask`): UpdateRankMask with `update`, or GetRankMask when
  /// null. FAILED_PRECONDITION when left or without a control channel.
  absl::StatusOr<RankMask> CallRankMask(const v1::UpdateRankMaskRequest* update);
  /// Ring ops of an endpoint with a registered graph-mode program are refused here, before
  /// any stream work or ring slot (the daemon refuses them too, for every rank).
  absl::Status CheckNoProgram() const;
  /// The plan of ring op `op` (public name `name`, for errors) after CheckUsable and
  /// CheckNoProgram, with OpStream(stream) as its stream; their error otherwise.
  absl::StatusOr<internal::OpPlan> BeginOp(abi::OpKind op, const char* name, void* stream);

  /// Publishes a request that is not stream-ordered (program registration) and returns
  /// its seq. `program`: a slot whose program fields (program_num_steps, program_steps)
  /// the request carries; only those are read.
  absl::StatusOr<uint64_t> SubmitUnordered(abi::OpKind op, const abi::RequestSlot& program = {});
  /// The RequestSlot of an op (magic, kind, seq and values).
  static abi::RequestSlot MakeRequest(abi::OpKind op, uint64_t seq, uint32_t flags,
                                      int32_t num_tokens, int32_t expert_alignment,
                                      uint64_t handle_seq, int32_t num_sms,
                                      const abi::RequestSlot& program = {});

  // ---- streams and staging (staging.cc) ----

  /// The stream an op runs on (CUDA backend): the caller's `stream`; or, for a null
  /// stream, the endpoint's own stream, made to wait (on the GPU) for the caller's earlier
  /// work on the legacy default stream. An op given no stream is not ordered before any
  /// caller work: its results are valid once Wait returns. (Ordering it on the legacy
  /// stream itself would put every endpoint of a process that passes no stream on one
  /// stream, where one rank's op waits for another's, which waits for the first.)
  /// Host backend: null.
  absl::StatusOr<void*> OpStream(void* stream);
  /// Records whether op `seq` was given no stream (see OpStream).
  void NoteStream(uint64_t seq, const void* caller_stream);
  /// Copies `t` into region `r` (no copy when it already lives there). CUDA backend: on
  /// `stream` (ordered before the op's ready flag or kernels), a copy kernel for a tensor
  /// on the area's GPU, else cudaMemcpyAsync. With `for_submit` (a daemon-launched op
  /// about to Submit) a copy on the area's GPU is only recorded: Submit does it in the
  /// kernel that signals ready (one kernel per op instead of one per input plus a stream
  /// memory write, kc::CopyDeviceBatchAsync). INVALID_ARGUMENT when `t` does not fit `r`.
  absl::Status Stage(const char* op, const char* name, const DLTensor* t, const kernels::Region& r,
                     void* stream, bool for_submit = false);
  /// Stage(..., for_submit = true): daemon-launched inputs, copied by Submit's kernel.
  absl::Status StageForSubmit(const char* op, const char* name, const DLTensor* t,
                              const kernels::Region& r, void* stream) {
    return Stage(op, name, t, r, stream, /*for_submit=*/true);
  }

  // ---- result views (result_views.cc) ----

  /// A view of region `r` (no allocation: TensorShape keeps up to 4 dimensions inline).
  TensorView View(const kernels::Region& r, DLDataType dtype, TensorShape shape) const;
  void LayoutViews(LayoutResult& r, int64_t T) const;
  /// Dispatch's receive views for N received tokens.
  void DispatchViews(DispatchResult& r, int32_t N) const;
  /// LowLatencyDispatch's receive views of buffer `b`.
  void LowLatencyDispatchViews(LowLatencyDispatchResult& r, int b) const;
};

}  // namespace epd
