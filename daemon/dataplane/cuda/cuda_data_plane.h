// CudaDataPlane: the CUDA backend (DESIGN.md §1, §3.2, §4; issue 4 "Backend"), compiled
// only with CUDA (daemon/CMakeLists.txt adds daemon/cuda/ when EPD_HAVE_CUDA).
//
// At start-up: every allowed GPU is enumerated, peer access is enabled among them, every
// kernel is loaded eagerly on each (kernels::cuda::PreloadKernels, DESIGN §3.2), and one
// engine thread per GPU starts (daemon/engine.h, with its own doorbell page).
//
// Per endpoint (one rank): the data area (EndpointLayout) is one cudaMalloc on the rank's
// GPU (chosen by UUID; "" = the first GPU), zeroed, exported with cudaIpcGetMemHandle
// (EndpointInfo.cuda_ipc_handle, backend "cuda"); the endpoint's shm region holds only the
// request ring and the completions (EndpointShmHeader.data_offset = 0). Each rank has one
// CUDA stream; each group keeps, per GPU it uses, a device array [R] of its ranks' data-area
// bases as seen by the daemon's context (CudaRankContext::peer_bases).
//
// Launch modes (DESIGN.md §3.2; a group's mode is fixed by its first joiner, see
// GroupRegistry::Join):
//  * Daemon-launched. A group is served by the engine of the GPU of the first rank that
//    attached. Ops run in lockstep (daemon/group_ops.h): once every rank has submitted op
//    n, the engine launches each rank's kernel on that rank's stream (grids sized so that
//    every rank's kernel of the group is resident at once: virtual ranks on one GPU),
//    enqueues each rank's DeviceStatus read-back into pinned memory (a kernel; a
//    stream-ordered low-latency kernel copies its status itself) and an event, and polls
//    the events without blocking; then it writes the completions. Only one group op runs on
//    a GPU at a time (residency of spinning kernels). A rank that never arrives fails the op
//    on the CPU after op_timeout (no kernel of a partial op is ever launched, so nothing
//    spins on the GPU). After a device-side timeout or a launch error, the group's kernel
//    sync state is reset before its next op.
//    Stream-ordered requests (abi::kFlagStreamOrdered): the rank's stream first waits on
//    the GPU for launch_flags.ready_seq >= seq (the client's staging kernel writes it once
//    the inputs are staged), then runs the kernels and the read-back, and done_seq = seq is
//    written, which the client's stream waits for (cuStreamWaitValue64). Low-latency ops
//    hand off inside kernels (kernels/cuda_ops.h KernelHandoff; ~60 µs less per op on the
//    H200 under MPS than stream memory operations, docs/BENCHMARKS.md "Hand-off"): under
//    MPS (CudaDataPlaneOptions::kernel_ready_wait) a one-warp WaitFlagAsync kernel waits
//    for ready_seq and the op's kernel is launched programmatically behind it (it starts
//    the moment the wait passes, and is not resident before, so it takes no SM from the
//    client's own work); without MPS cuStreamWaitValue64 waits (a spinning kernel would hold
//    the time slice the client needs). The op's kernel checks ready_seq itself and writes
//    done_seq once the rank's outputs are complete (dispatch: block 0, after every sender's
//    rows landed; combine: the last block to finish), then copies the rank's DeviceStatus to
//    the pinned read-back itself (KernelHandoff::status_out: no read-back kernel behind it,
//    only the event; the hand-off words at .gpu scope, common.cuh). Other ops wait with
//    cuStreamWaitValue64 and write done_seq with cuStreamWriteValue64 after the read-back. An op
//    that ends without its kernels (rejected slot, client error, a rank that never arrived or left,
//    shutdown) still gets done_seq = seq on the stream of every rank whose request had the flag
//    (LockstepGroup::OpEndedWithoutLaunch). If a client never writes ready_seq, the engine gives
//    the op up after op_timeout + 5 s and writes ready_seq = seq from the host so the stream (and
//    the group) moves on (the WaitFlagAsync kernel's bound, op_timeout + 10 s, outlasts that; its
//    pinned ready_seen word tells the engine whether it passed). Both driver calls are resolved at
//    run time (cudaGetDriverEntryPointByVersion): the daemon does not link libcuda.
//  * Client-launched (LAUNCH_MODE_CLIENT): the endpoint gets the same zeroed area and IPC
//    handle (GetGroupEndpoints hands every rank's to the client, which launches the
//    kernels itself); the engine never launches anything for it and completes every slot
//    of its ring at once with FAILED_PRECONDITION.
//
//  * Graph mode (DESIGN.md §3.2; daemon-launched endpoints; client.h RegisterProgram): every
//    rank registers the same program of low-latency steps with a lockstep ring op
//    (abi::OpKind::kRegisterProgram; LockstepGroup checks that the ranks agree, naming the
//    first differing step). Arming claims the group's GPUs until the program is disarmed
//    (other groups' ops on them wait, and fail after op_timeout). While armed the engine
//    keeps kProgramDepth (2) instances enqueued on every rank's stream: instance k waits on
//    the GPU for launch_flags go >= 1 (cuStreamWaitValue64; the client's captured step
//    writes 1 once its inputs and T are staged), writes go = 0, runs the step's kernels
//    (a dispatch reads T from the rank's token-count slot; fixed buffers per step, group_ops.h
//    ProgramStepPlan; the step's kernel writes the instance number and done = 1 itself once
//    its outputs are complete, then copies its status into mapped pinned memory,
//    KernelHandoff::status_out; a failed launch gets kc::EnqueueStatusReadback). The engine
//    polls each instance's events (it does not sleep while armed), publishes errors and the
//    checked instance in the endpoint's shm header (program_* fields, read by
//    Endpoint::ProgramStatus), and enqueues the next instance. A device-side timeout or a
//    launch error disarms the program. Disarming (UnregisterProgram, a rank leaving, a
//    timeout, shutdown) releases every instance still waiting (go = 1 by a stream memory
//    write on the engine's aux stream, in instance order), then writes done =
//    kProgramReleased on every rank's stream (sticky: client streams running further steps
//    pass at once), and resets the kernels' sync state before the group's next op. Ring ops
//    of an armed group fail with FAILED_PRECONDITION for every rank; stream-ordered ones get
//    done_seq from the host by a stream memory write on the aux stream (their ranks' streams
//    are held by the program's waits). EPD_PROGRAM_TRACE=1 logs every instance enqueued and
//    completed, each disarm, and once a second the state of pending instances per rank.
//    No copy (cudaMemcpyAsync/cudaMemsetAsync) is ever enqueued behind a program's go wait,
//    nor used to write the hand-off words from the host: the first GPU run hung because the
//    status read-back was a device-to-host copy (EnqueueStatusReadback's former copy). A copy goes
//    to a copy-engine queue that the process's streams share, and waits there for its stream's
//    earlier work; the instances enqueued ahead (waiting for a go that comes only with the next
//    replay) thus held the device-to-host queue, and the next device-to-host copy of any stream of
//    the process (the test's cudaMemcpy of the results after replay 0) waited behind them for ever.
//    Found with the test's hang watchdog (tests/gpu/graph_program_test.cc): both test streams had
//    drained, and the scenario was stuck in that cudaMemcpy. With the read-back as a kernel, both
//    GPU tests pass (R = 2 and 8, 100 replays each, bit-exact with kernels/host). Caveat
//    (in-process use, e.g. tests): stream memory waits enqueued ahead hold their hardware queue;
//    streams beyond CUDA_DEVICE_MAX_CONNECTIONS (32) share queues, and a write queued behind such a
//    wait waits with it. The daemon creates its aux stream at start-up; a daemon with more than 32
//    streams per GPU has the same hazard.
//
// Hot path (issue 4, README "Hot path"): a successful daemon-launched op, and a graph-mode
// instance, allocate nothing on the engine thread. The per-op state (the GpuOp of the op on
// the GPU, the per-rank event results, the program's ring of kProgramDepth instances, the
// GPU claim table) is sized once (group creation, ArmProgram, start-up) and reused; the
// engine polls an op with cudaEventQuery only. Error paths allocate (messages).
// tests/gpu/cuda_hot_path_alloc_test.cc counts the engine thread's operator new per op kind.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/dataplane/data_plane.h"

namespace epd {

/// Options of the CUDA data plane (from DaemonConfig).
struct CudaDataPlaneOptions {
  uint32_t op_timeout_ms = 10000;      ///< Bound on waiting for the ranks of an op, and of
                                       ///< every spin wait in the kernels.
  uint32_t engine_idle_us = 100;       ///< An engine sleeps after this long with no request.
  std::vector<std::string> gpu_uuids;  ///< GPUs to use; empty = every visible GPU.
  int32_t num_sms = 0;                 ///< Blocks per rank's kernel; 0 = SM count / ranks of
                                       ///< the group on that GPU (every rank resident).
  /// How a daemon-launched low-latency op waits for its client's ready flag: true = a
  /// one-warp spinning kernel with the op's kernel launched programmatically behind it
  /// (docs/BENCHMARKS.md "Hand-off": ~13 µs less per op under MPS); false =
  /// cuStreamWaitValue64, which without MPS is the only sane choice: the client's and the
  /// daemon's contexts then time-slice the GPU, and a spinning kernel would hold the slice
  /// the client's staging kernel needs (~2 ms a hop, DESIGN.md §3.2). Unset = true exactly
  /// when MPS is active for this daemon (DetectMps at start-up). Either way the op's kernel
  /// checks ready_seq and writes done_seq itself.
  std::optional<bool> kernel_ready_wait;
  /// Test seam (unset in the daemon): called once on each engine thread (one per GPU)
  /// before its first poll. tests/gpu/cuda_hot_path_alloc_test.cc marks the engine threads
  /// with it to count their heap allocations per op.
  std::function<void()> on_engine_start;
};

/// Creates the CUDA data plane and starts its engines. Errors: FAILED_PRECONDITION when no
/// GPU is usable, NOT_FOUND for an unknown entry of gpu_uuids, INTERNAL for CUDA errors
/// (naming the call), and those of creating the doorbell pages.
absl::StatusOr<std::unique_ptr<DataPlane>> MakeCudaDataPlane(const CudaDataPlaneOptions& options);

/// The device address of the data area exported as `cuda_ipc_handle` by a CUDA data plane
/// of THIS process. CUDA cannot open an IPC handle in the process that exported it, so an
/// in-process client (tests; a daemon embedded in its client) maps its endpoint through
/// this instead of cudaIpcOpenMemHandle. NOT_FOUND when no live endpoint of this process
/// has that handle.
absl::StatusOr<void*> FindInProcessCudaArea(const std::string& cuda_ipc_handle);

}  // namespace epd
