// The CUDA kernels' shared interface: the per-rank context every CUDA op takes
// (CudaRankContext), the status word the kernels report GPU-side errors through
// (DeviceStatus) and its read-back, the stream-ordered hand-off helpers of daemon-launched
// mode, the low-latency launchers (LowLatencyDispatch, LowLatencyCombine) and eager kernel
// loading. Launchers only enqueue work on the given stream; they fail only for host-side
// argument errors and CUDA launch errors. Semantics are exactly kernels/host (host_ops.h),
// outputs bit-identical. The model (peer_bases, layout offsets, where GPU-side errors go):
// docs/CUDA_BACKEND.md "Kernels".
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "epd/kernels/cuda_limits.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/types.h"

namespace epd::kernels::cuda {

/// The per-rank error word at `sync + kSyncStatusOffset`. Kernels only ever add to it
/// (atomics); ReadAndClearStatus / EnqueueStatusReadback clear it. POD, 256 bytes.
struct DeviceStatus {
  uint32_t bad_expert_ids;      ///< Count of topk_idx values outside [-1, E) seen by the op.
  int32_t bad_num_tokens;       ///< A run-time T outside [0, Mll] (valid when has_bad_num_tokens).
  uint32_t has_bad_num_tokens;  ///< Nonzero when T was out of range (the op then used T = 0).
  uint32_t timed_out;           ///< Nonzero when a wait of this rank passed timeout_ns.
  uint32_t missing_ranks[kMaxStatusRanks / 32];  ///< Bit r: peer rank r never arrived.
  /// Count of routing values read from endpoint memory (send_pos rows, low-latency handle
  /// positions, rows computed from the exchanged counts) outside their region: the kernels
  /// skip them (an endpoint's memory is client-writable through its CUDA IPC mapping).
  uint32_t bad_routing;
  /// Rank masking (CudaRankContext::rank_masked): how many of this rank's token-expert
  /// pairs (low-latency ops, normal dispatch) or token-rank routes (cached normal dispatch,
  /// normal combine) the op dropped because their rank is masked. Not an error.
  uint32_t dropped_pairs;
  uint32_t reserved[64 - 6 - kMaxStatusRanks / 32];
};
static_assert(sizeof(DeviceStatus) == 256, "DeviceStatus must fill [0, 256) of sync");

// ---- shared per-rank context ------------------------------------------------------------

/// Everything a CUDA op of one rank needs besides its own arguments. Shared by the
/// low-latency launchers here and the normal-mode launchers (cuda_normal.h).
struct CudaRankContext {
  GroupShape shape;       ///< The group shape.
  EndpointLayout layout;  ///< EndpointLayout::Compute(shape).
  int32_t rank = 0;       ///< This rank, in [0, R).
  /// Device array [R] of every rank's data-area base as seen by the launching context
  /// (peer_bases[rank] is this rank's own base). Must stay valid while ops run.
  uint8_t* const* peer_bases = nullptr;
  /// Host copy of peer_bases[rank] (this rank's own base), for host-side address
  /// computations (default input/output pointers, status read-back).
  uint8_t* own_base = nullptr;
  /// Blocks (one per SM) per op; 0 = default: floor((SM count - ranks_on_device *
  /// sms_left_per_rank) / ranks_on_device), so the kernels of every rank on the GPU are
  /// resident at once (ranks spin on each other).
  int32_t num_sms = 0;
  /// SMs per rank on this GPU that the default grid leaves to other work: 1 for the
  /// daemon's low-latency ops and graph-mode program steps under MPS, whose clients wait
  /// for done in their staging kernel (DoneWait): its one spinning block per rank must find
  /// an SM beside the grids. An explicit num_sms is capped to leave them free too.
  int32_t sms_left_per_rank = 0;
  /// Ranks of this group (or of all groups that may run at once) whose kernels share this
  /// GPU; 0 = all R ranks (the virtual-rank case, the safe default).
  int32_t ranks_on_device = 0;
  /// Every rank of the group has its data area on this same GPU (virtual ranks, or ranks
  /// of several processes sharing one GPU). The low-latency kernels then order their
  /// inter-rank flags at .gpu scope instead of .sys, which is correct only then and is
  /// cheaper (docs/CUDA_BACKEND.md "Memory scope of the flags"). false (the safe default)
  /// when any peer may be on another GPU.
  bool all_ranks_on_device = false;
  /// Bound of every spin wait, in nanoseconds of %globaltimer. On expiry the op records a
  /// timeout (DEADLINE_EXCEEDED) in DeviceStatus and returns without deadlocking.
  int64_t timeout_ns = 10'000'000'000;
  /// Rank masking (docs/RELIABILITY.md "Rank masking"): device array [R] of this GPU, one
  /// byte per rank, nonzero = masked; null = no rank masked. The ops treat every expert of
  /// a masked rank as -1 (low-latency ops and normal dispatch: the pair is dropped; cached
  /// normal dispatch and normal combine: the route to that rank is dropped) and count each
  /// drop in DeviceStatus::dropped_pairs. A masked rank itself still launches its part of
  /// every op (with T = 0, so it sends nothing): the ranks' waits stay paired. Must not
  /// change while an op of the group runs. GetDispatchLayout ignores it.
  const uint8_t* rank_masked = nullptr;
  /// The daemon's shutdown word (host-mapped pinned memory, uint32; null = none, as in a
  /// client's launches): once the host stores nonzero there, every spin wait of the op
  /// (ready, peers' flags, the done path) ends as if it had timed out (DEADLINE_EXCEEDED in
  /// DeviceStatus), within about 2 * kAbortPollNs (abort_poll.h) of the store, and the op
  /// still writes done and its status. Read with a relaxed system-scope load, only after a
  /// wait has spun kAbortPollNs and then once per kAbortPollNs. Must outlive the launches.
  const uint32_t* abort_flag = nullptr;
};

/// Checks the context: 0 <= rank < R, peer_bases and own_base set, R <= kMaxStatusRanks,
/// timeout_ns > 0, and that `layout.sync` can hold the low-latency exchange
/// (2 * R * E * 4 bytes + flags). INVALID_ARGUMENT naming the field otherwise.
absl::Status ValidateContext(const CudaRankContext& ctx);

/// Blocks the op's grid uses for `ctx` on the current device: fit = max(1, (SM count -
/// ranks_on_device * sms_left_per_rank) / ranks_on_device); ctx.num_sms if set, capped at
/// fit when sms_left_per_rank > 0 (taken as given otherwise); else fit. Errors: CUDA device
/// queries.
absl::Status ResolveNumBlocks(const CudaRankContext& ctx, int32_t* num_blocks);

// ---- status read-back -------------------------------------------------------------------

/// Turns a DeviceStatus copied from the GPU into absl::Status for `op` at `rank`:
/// DEADLINE_EXCEEDED naming the peer ranks that never arrived (a timeout wins, the other
/// findings are appended); else INVALID_ARGUMENT naming the count of bad expert ids, of
/// out-of-range routing values (bad_routing) and/or the bad run-time T; else OK.
/// `low_latency`: the op is LowLatencyDispatch/Combine, whose run-time T is bounded by
/// shape.ll_max_tokens_per_rank (named in the bad-T message); otherwise (normal ops) by
/// shape.max_tokens_per_rank.
absl::Status StatusFromDevice(const DeviceStatus& status, const GroupShape& shape, int32_t rank,
                              const char* op, bool low_latency);

/// Enqueues on `stream` one tiny kernel that copies the rank's DeviceStatus (256 bytes) into
/// `host_dst` and clears the device word. `host_dst` must be pinned host memory
/// (cudaHostAlloc / cudaMallocHost: under unified addressing every kernel can write it).
/// A kernel, not cudaMemcpyAsync: a copy goes to a copy-engine queue that all the
/// context's streams share and waits there for its own stream's earlier work, so the
/// read-back of one rank (behind its op's ready wait and kernels) would hold every other
/// stream's device-to-host copies (cuda_program.h). Nothing waits: read `*host_dst` after
/// the stream has passed this point (e.g. an event) and convert it with StatusFromDevice.
/// Errors: INVALID_ARGUMENT for a null pointer, INTERNAL for a launch error.
absl::Status EnqueueStatusReadback(const CudaRankContext& ctx, cudaStream_t stream,
                                   DeviceStatus* host_dst);

/// Copies `bytes` bytes from `src` to `dst`, both device memory this context can address
/// (its own allocations, CUDA IPC mappings, peers with access enabled), with one kernel on
/// `stream` (16-byte vectors when both are 16-byte aligned; one 512-thread block per
/// 64 KiB, at most 32: 1.8 MB, one rank's DeepSeek-V3 decode tokens, takes 28). A kernel, not
/// cudaMemcpyAsync: a copy goes to a copy-engine queue shared by the context's streams
/// (see EnqueueStatusReadback), and small copies run sooner on SMs. Errors:
/// INVALID_ARGUMENT for a null pointer with bytes > 0, INTERNAL for a launch error.
absl::Status CopyDeviceAsync(void* dst, const void* src, uint64_t bytes, cudaStream_t stream);

// ---- stream-ordered hand-off inside kernels (daemon-launched mode, DESIGN.md §3.2) -------
//
// Kernels, not cuStreamWaitValue64 / cuStreamWriteValue64: a stream memory wait is polled
// by the GPU's front end and released well after its flag is written, where a kernel that
// spins on the flag sees it at once; a stream memory write queued behind a kernel lands
// well after the kernel ends, a store by its last block at once. The same holds between two
// streams of one process as between MPS clients (docs/BENCHMARKS.md "Hand-off").

/// One copy of CopyDeviceBatchAsync: `bytes` bytes from `src` to `dst`, device memory of
/// the current GPU's address space (own allocations, CUDA IPC mappings, peers).
struct DeviceCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  uint64_t bytes = 0;
};

/// CopyDeviceBatchAsync's optional wait for the daemon's done word, on the GPU: the
/// endpoint's done_seq (a daemon-launched op), or its program_done with `clear` (a
/// graph-mode program step; proto/abi/launch_flags.h).
struct DoneWait {
  /// Device word of this stream's GPU (done_seq or program_done), read with acquire at GPU
  /// scope; null = no wait. Written with atomicCAS when `clear` is set.
  uint64_t* flag = nullptr;
  /// Passes once *flag >= value (the op's seq; kReleasedSeq, which the client writes from
  /// the host when the daemon is gone, passes every wait; a program step: 1, and
  /// kProgramReleased passes too).
  uint64_t value = 0;
  /// Bound of the wait, ns of %globaltimer (> 0 with a flag), from the signal. The client
  /// gives 4 * op_timeout + 20 s: past the latest a working daemon stores done (its wait for
  /// the other ranks' requests, a fused launch held for another rank's staging, then the
  /// kernel's bounded waits: KernelDoneWaitTimeoutNs in client/endpoint/daemon_launch.h), so
  /// the stream goes on without the outputs only when the daemon is gone or stuck, and then
  /// the op's Wait fails.
  int64_t timeout_ns = 0;
  /// The program step's acknowledgement folded into the wait (ProgramAckAsync's atomicCAS,
  /// without its kernel): once the wait passes having read exactly `value`, the waiting
  /// thread swaps it back to 0 (atomicCAS(flag, value, 0), so a value written meanwhile,
  /// e.g. kProgramReleased, stays). A larger value read (kProgramReleased) is left as it
  /// is; a timed-out wait writes nothing. Needs a flag and value > 0 (a wait for >= 0
  /// passes at once and has nothing to clear).
  bool clear = false;
};

/// Most copies one CopyDeviceBatchAsync takes (an op stages at most x, topk_idx,
/// topk_weights and one more).
inline constexpr int kMaxBatchCopies = 4;

/// Enqueues ONE kernel on `stream` that does every copy of `copies` (16-byte vectors where
/// both ends are 16-byte aligned; blocks sized as CopyDeviceAsync for the largest) and then,
/// when `signal` is not null, stores `signal_value` to *signal (uint64, release at GPU
/// scope: `signal` must be device memory of this stream's GPU, read by kernels or stream
/// memory waits on that GPU, any process; common.cuh LdAcquireGpu64 says why) once every
/// block's copies are done: the last block to finish (a ticket taken on *counter, a uint32
/// device word that is 0 before and after: two batch copies sharing a counter must not run
/// at the same time; the client orders an endpoint's ops on one stream order for that, see
/// DaemonLaunch::OrderAfterPreviousOp, client/endpoint/daemon_launch.h) stores it. This is
/// the client's "inputs are staged" (ready) flag of daemon-launched mode: the daemon's
/// WaitFlagAsync sees it at once. With no copies it is a one-thread kernel that stores the
/// signal. Errors: INVALID_ARGUMENT for more than kMaxBatchCopies copies, a null dst/src
/// with bytes > 0, or a signal without a counter, or `started` without a signal (or without
/// a counter for a multi-block copy); INTERNAL for a launch error.
///
/// `started` (optional; daemon-launched: the endpoint's staging_seq, layout.h): once every
/// block of the kernel is resident (the last block to start; a ticket in the low half of
/// *counter, finished blocks count in the high half), one thread stores `signal_value`
/// there (relaxed, GPU scope), before its copies. The daemon's WaitFlagAsync passes on it
/// and launches the low-latency kernel behind it while the copies run, so the programmatic
/// launch overlaps the staging; that kernel's blocks wait for the signal themselves
/// (KernelHandoff), so they are resident only for the rest of this kernel, never while the
/// caller's earlier work runs (docs/CUDA_BACKEND.md "Launch modes"). Not before every block
/// is resident: a low-latency kernel's blocks each take a whole SM's registers, and a
/// staging block left out could then never start.
///
/// `done_wait` (optional; daemon-launched low-latency ops under MPS, EndpointInfo
/// kernel_done_wait): after storing the signal, the block that stored it keeps one thread
/// spinning until *done_wait.flag >= done_wait.value, so the stream's next work starts
/// when the daemon's kernel has stored done_seq, as after a cuStreamWaitValue64 on it, but
/// without the GPU front end's wake-up of a blocked stream, which it pays per waiting stream
/// and in series (docs/CUDA_BACKEND.md "Launch modes"). The kernel then holds one block of
/// one SM for the op, which the daemon leaves free (CudaRankContext::sms_left_per_rank); the
/// others' blocks exit as before. A graph-mode program step under MPS uses the same wait
/// on program_done with `clear` (client/endpoint/graph_program.cc), in place of a stream
/// wait and ProgramAckAsync; the kernel then stays capturable: every argument is a constant.
/// Errors (INVALID_ARGUMENT naming the field): a done wait without a signal or with
/// done_wait.timeout_ns <= 0; done_wait.clear without done_wait.flag or with
/// done_wait.value = 0.
absl::Status CopyDeviceBatchAsync(const DeviceCopy* copies, int num_copies, uint64_t* signal,
                                  uint64_t signal_value, uint32_t* counter, cudaStream_t stream,
                                  uint64_t* started = nullptr, const DoneWait& done_wait = {});

/// Enqueues a one-warp kernel on `stream` that spins until *flag >= value (uint64, acquire
/// at GPU scope: a word of this GPU's memory written on this GPU), or *alt_flag >= value
/// when `alt_flag` is not null, or `timeout_ns` of %globaltimer passed; on arrival it stores the
/// value it read to *seen (when not null: pinned host memory the engine reads, so it can tell
/// whether the stream got past the wait), then lets the next kernel of the stream start
/// (griddepcontrol.launch_dependents: a kernel launched right after it with
/// KernelHandoff::programmatic set starts at once instead of after this one's exit).
/// The daemon's ready wait of a daemon-launched low-latency op: it holds one warp of one
/// SM while it waits, never a whole grid (the low-latency kernel behind it is not resident
/// before every block of the client's staging kernel is, so it takes no SM from the
/// client's earlier work on that stream).
/// Errors: INVALID_ARGUMENT for a null flag or timeout_ns <= 0; INTERNAL for a launch error.
///
/// `value_word` (optional): when set, the value is read from it instead (one volatile load
/// when the kernel starts; device or host-mapped memory the host writes before the launch),
/// so a CUDA graph that captured the wait replays with each op's value.
///
/// `abort_flag` (optional): the daemon's shutdown word (CudaRankContext::abort_flag); once
/// nonzero the wait ends as a timed-out one (`seen` untouched) and lets the next kernel start.
absl::Status WaitFlagAsync(const uint64_t* flag, uint64_t value, int64_t timeout_ns, uint64_t* seen,
                           cudaStream_t stream, const uint64_t* alt_flag = nullptr,
                           const uint64_t* value_word = nullptr,
                           const uint32_t* abort_flag = nullptr);

/// The most ranks one fused launch (WaitFlagsAsync, LowLatencyDispatchRanks,
/// LowLatencyCombineRanks) covers (their parameters travel in the kernel's parameter space).
inline constexpr int32_t kMaxFusedRanks = 8;

/// One wait of WaitFlagsAsync: until *flag >= value, or *alt_flag >= value when alt_flag
/// is set; the value read is stored to *seen when seen is set (as WaitFlagAsync).
struct FlagWait {
  /// uint64 word of this GPU (acquire at GPU scope); required.
  const uint64_t* flag = nullptr;
  /// Optional second word, read when *flag < value.
  const uint64_t* alt_flag = nullptr;
  uint64_t value = 0;
  /// Optional, pinned host (or device) memory: the value that passed the wait; left
  /// untouched when the wait timed out.
  uint64_t* seen = nullptr;
};

/// WaitFlagAsync for several flags in one kernel (one warp per wait, 1..kMaxFusedRanks
/// waits; one block), each bounded by timeout_ns of %globaltimer from the kernel's start;
/// lets the next kernel start (griddepcontrol.launch_dependents, for a kernel launched with
/// KernelHandoff::programmatic) once every wait has passed or timed out. The daemon's ready
/// waits of every rank of a GPU before one LowLatencyDispatchRanks / LowLatencyCombineRanks.
/// `waits` is copied into the launch (it need not outlive the call); the words must stay
/// valid until the kernel has run. Errors: INVALID_ARGUMENT (naming the wait) for no waits,
/// more than kMaxFusedRanks, a null flag or timeout_ns <= 0, nothing launched then; INTERNAL
/// for a launch error.
/// `abort_flag` (optional): as WaitFlagAsync's, for every wait.
absl::Status WaitFlagsAsync(std::span<const FlagWait> waits, int64_t timeout_ns,
                            cudaStream_t stream, const uint32_t* abort_flag = nullptr);

/// The hand-off of a daemon-launched low-latency op done by the op's kernel itself (all
/// fields optional; the defaults do nothing):
///   ready: every block's first thread waits until *ready_flag >= ready_value (acquire at
///          GPU scope; bounded by CudaRankContext::timeout_ns, then DeviceStatus.timed_out
///          is set and the op goes on) before it reads any input, so inputs staged by
///          another stream or process are visible to the whole block;
///   done:  once this rank's outputs are complete (dispatch: every sender's rows landed in
///          its receive buffers; combine: combined_x written) one thread stores done_value to
///          *done_flag (uint64, release at GPU scope; the flags are words of the
///          rank's GPU, read there), which the client's stream waits for;
///   instance: when instance_flag is set, instance_value is stored there (relaxed) just
///          before done (graph mode: the program instance whose results done announces);
///   programmatic: launch with programmatic stream serialization (cudaLaunchKernelEx), so
///          the kernel starts as soon as a WaitFlagAsync just before it on the stream passes;
///   status_out: with done_flag, when set, the thread that stores done then copies the
///          rank's DeviceStatus to *status_out (pinned host memory) and zeroes it, as
///          EnqueueStatusReadback does, so the daemon's stream needs no read-back kernel
///          behind the op (such kernels, launched as every rank's op ends, delay the clients'
///          streams: docs/CUDA_BACKEND.md "Launch modes").
/// Flags are the endpoint's launch_flags words (abi::kReadyFlagOffset / kDoneFlagOffset).
struct KernelHandoff {
  const uint64_t* ready_flag = nullptr;
  uint64_t ready_value = 0;
  uint64_t* done_flag = nullptr;
  uint64_t done_value = 0;
  uint64_t* instance_flag = nullptr;
  uint64_t instance_value = 0;
  bool programmatic = false;
  DeviceStatus* status_out = nullptr;
  /// When set, ready_value and done_value are both taken from this word instead (one
  /// volatile load per use, by the thread that waits or stores): device or host-mapped
  /// memory the host writes before the launch, so a CUDA graph that captured the kernel
  /// replays with each op's sequence number (the daemon's per-GPU op graphs).
  const uint64_t* seq_word = nullptr;
};

/// Cumulative per-expert received-token counters that a dispatch kernel adds to (as
/// DeepEP's cumulative_local_expert_recv_stats): entry j (a local expert of this rank,
/// [0, El)) grows by the tokens that expert received in the op: the low-latency dispatch's
/// recv_count[j], a normal dispatch's unaligned count (a duplicate expert in a token's row
/// once; a cached dispatch re-sends the previous dispatch's tokens and adds its counts
/// again, as the host backend does). One thread of the kernel writes each entry, so no
/// atomics: one op of the rank at a time. Null `totals` = off (the client's launches).
struct ExpertTokenStats {
  /// [El] uint64 device memory on the rank's GPU, zeroed by its owner: the running totals.
  uint64_t* totals = nullptr;
  /// [El] uint64 device memory: the last normal dispatch's counts (what a cached dispatch
  /// adds). Null: cached dispatches add nothing.
  uint64_t* last_normal = nullptr;
  /// [El] uint64 host-mapped pinned memory (may be null): each new total is stored there
  /// too (a store over the bus, no read), so the host reads the totals without a copy.
  uint64_t* mirror = nullptr;
};

/// Synchronizes `stream`, reads and clears the rank's DeviceStatus and converts it with
/// StatusFromDevice(op). For tests and slow paths (it blocks the CPU). A CUDA error of the
/// stream itself is returned as INTERNAL.
absl::Status ReadAndClearStatus(const CudaRankContext& ctx, cudaStream_t stream, const char* op);

/// Zeroes this rank's low-latency sync state (counters, flags, count exchange) on
/// `stream`; keeps the token-count slot and each buffer's dispatch T, so a combine after
/// the reset still runs on its dispatch's tokens. After a DEADLINE_EXCEEDED where a rank never
/// arrived at all, the ranks' op counters disagree; call this for every rank of the group, once
/// every rank's stream is idle (no op in flight anywhere in the group), before the next low-latency
/// op. A rank that was merely late needs no reset (its late op pairs with the others' timed- out
/// op, so the counters stay in step). Errors: CUDA launch errors.
absl::Status ResetLowLatencySync(const CudaRankContext& ctx, cudaStream_t stream);

/// Calls cudaFuncGetAttributes on every kernel of this library (low-latency, normal,
/// status helpers), so none is loaded lazily at its first launch (DESIGN.md §3.2: with
/// lazy loading the first launch waits for running kernels, which deadlocks kernels that
/// spin on each other). Call once per device at start-up, before any op.
absl::Status PreloadKernels();

/// Registers a preload hook for kernels defined in another file of this library (the
/// normal-mode kernels register theirs); PreloadKernels calls every registered hook.
/// Returns true so it can initialise a namespace-scope constant.
bool RegisterPreloadHook(absl::Status (*hook)());

// ---- graph-mode program hand-off (DESIGN.md §3.2; abi::kProgram*Offset) ----------------

/// Enqueues on `stream` a one-thread kernel that replaces the value 1 of the 64-bit word
/// `program_done` (launch_flags + kProgramDoneOffset) by 0 (atomicCAS), leaving any other
/// value (0, kProgramReleased) as it is. The client's captured program step runs it after
/// its stream wait for done >= 1 (under MPS its staging kernel does the same CAS instead:
/// DoneWait::clear), so the next step waits for the daemon again; capturable, no host
/// argument changes between replays. Errors: CUDA launch errors (INTERNAL).
absl::Status ProgramAckAsync(uint64_t* program_done, cudaStream_t stream);

// ---- run-time token count ---------------------------------------------------------------

/// Device address of this rank's low-latency token-count slot (int32 in its sync region).
/// LowLatencyDispatch reads T from it unless its args name another device int32. Write it
/// with SetLowLatencyNumTokensAsync, a cudaMemcpyAsync, or a kernel of your own: a CUDA
/// graph that captured the dispatch then replays with whatever T the slot holds.
int32_t* LowLatencyNumTokensSlot(const CudaRankContext& ctx);

/// Enqueues a write of `num_tokens` into the rank's token-count slot (a one-thread kernel:
/// capturable, but then the value is fixed in the graph). Errors: CUDA launch errors.
absl::Status SetLowLatencyNumTokensAsync(const CudaRankContext& ctx, int32_t num_tokens,
                                         cudaStream_t stream);

// ---- low-latency dispatch ---------------------------------------------------------------

/// Arguments of one rank's LowLatencyDispatch (host_ops.h: LowLatencyDispatch).
///
/// Double buffering: outputs go to buffer `buffer` (0 or 1) of the rank's ll_* regions.
/// The caller alternates the buffer per dispatch (a per-endpoint counter, or fixed per
/// captured dispatch in a CUDA graph); a view into buffer b stays valid until the next
/// dispatch that uses b, i.e. until the op after next when buffers alternate.
///
/// Outputs (all in this rank's area, buffer b; Mll = ll_max_tokens_per_rank, El = E/R):
///   ll_recv_x[b]        [El, R*Mll, H] bf16, or e4m3 when use_fp8 (rows of H bytes);
///                       rows [0, recv_count[j]) of expert j packed, grouped by source
///                       rank ascending, token ascending within a source; later rows
///                       untouched.
///   ll_recv_scales[b]   when use_fp8, token index fastest (layout.h LowLatencyScaleOffset):
///                       [El, S, R*Mll] f32 Fp8Scale(amax, round_scale), or with
///                       use_ue8m0 [El, S/4, R*Mll] int32 of Ue8m0Code bytes.
///   ll_recv_count[b]    [El] int32.
///   ll_recv_src_info[b] [El, R*Mll] int32: src_rank * Mll + src_token.
///   ll_handle_pos[b]    [Mll, K] int32 (source side, rows [0, T)): row of (t, k) in the
///                       block of expert topk_idx[t, k] at its rank; -1 for k == -1; a
///                       duplicate expert in a row has the same row.
/// The token count T of this dispatch is also kept (per buffer) for the matching combine.
///
/// Device-side errors: ids outside [-1, E) are counted in DeviceStatus and treated as -1
/// (outputs then do not match host semantics, which reject the op); T outside [0, Mll] is
/// recorded and the rank sends nothing (T = 0). Every rank of the group must launch each
/// dispatch; a peer that does not arrive within timeout_ns is recorded (DEADLINE_EXCEEDED).
struct LowLatencyDispatchArgs {
  int32_t buffer = 0;        ///< Low-latency buffer set, 0 or 1.
  bool use_fp8 = false;      ///< Quantize to e4m3 (needs shape.use_fp8, H%128==0).
  bool round_scale = false;  ///< Power-of-two FP8 scales (types.h Fp8Scale).
  /// UE8M0-packed scales (needs use_fp8, round_scale, H % 512 == 0: CheckScaleFormat).
  bool use_ue8m0 = false;
  /// Device int32 holding T; null = LowLatencyNumTokensSlot(ctx).
  const int32_t* num_tokens = nullptr;
  /// T given by the host (>= 0): passed to the kernel by value, so no write of the
  /// token-count slot has to be enqueued before the dispatch (one stream op less per op).
  /// -1 = read T from device memory (`num_tokens`), as a CUDA graph replaying with a new T
  /// needs. A value outside [0, Mll] is recorded in DeviceStatus as for device T.
  int32_t num_tokens_value = -1;
  /// [T, H] bf16 on this GPU; null = this rank's in_x region.
  const bf16_bits* x = nullptr;
  /// [T, K] int64 on this GPU; null = this rank's in_topk_idx region.
  const int64_t* topk_idx = nullptr;
  /// Daemon-launched stream-ordered hand-off (KernelHandoff); default none.
  KernelHandoff handoff;
  /// Route through the large path (cuda_limits.h LowLatencyRoutingPlan) even where the
  /// small one fits, e.g. to test it at small capacities. Outputs are the same.
  bool large_path = false;
  /// Per-expert received-token totals to add this op's recv_count to; default off.
  ExpertTokenStats expert_stats;
};

/// Enqueues one rank's low-latency dispatch on `stream`. Any Mll and K: the routing of a
/// rank's tokens takes the small or the large path (cuda_limits.h PlanLowLatencyRouting),
/// chosen here from the shape alone. Errors: INVALID_ARGUMENT for a bad context or
/// arguments (buffer not 0/1, FP8 without shape.use_fp8 or H % 128 != 0, Mll == 0, an
/// exchange that does not fit the sync region, a device with less shared memory than the
/// routing needs: none since Volta); INTERNAL for CUDA launch errors.
absl::Status LowLatencyDispatch(const CudaRankContext& ctx, const LowLatencyDispatchArgs& args,
                                cudaStream_t stream);

// ---- low-latency combine ----------------------------------------------------------------

/// Arguments of one rank's LowLatencyCombine (host_ops.h: LowLatencyCombine).
///
/// combined_x[t] = bf16(Σ_{k ascending, topk_idx[t,k] >= 0} w[t,k] * f32(y)), y being row
/// handle_pos[t,k] of expert topk_idx[t,k]'s block in its owner's expert-output region,
/// each product rounded to f32 and then added (no fma): bit-identical to the host.
/// T is the T of the dispatch that wrote buffer `buffer`. Each rank pulls the rows of its
/// own tokens from the owner ranks once every owner has entered its combine (so the
/// owner's expert outputs, written on its stream before, are complete).
/// Output: ll_combined_x[buffer] [Mll, H] bf16 (rows [0, T)), or `combined_x`.
struct LowLatencyCombineArgs {
  int32_t buffer = 0;  ///< The buffer of the dispatch whose handle this is.
  /// Byte offset, inside every rank's data area, of the expert outputs [El, R*Mll, H] bf16
  /// (the same offset at every rank); 0 = layout.in_ll_combine_x.offset. Pass
  /// layout.ll_recv_x[b].offset for experts that write their output in place.
  uint64_t x_offset = 0;
  /// [T, K] int64 / f32 on this GPU; null = this rank's in_topk_idx / in_topk_weights.
  const int64_t* topk_idx = nullptr;
  const float* topk_weights = nullptr;
  /// [T, H] bf16 output on this GPU; null = this rank's ll_combined_x[buffer].
  bf16_bits* combined_x = nullptr;
  /// Daemon-launched stream-ordered hand-off (KernelHandoff); default none.
  KernelHandoff handoff;
  /// >= 0: the T this rank combines instead of its dispatch's (at most that T; 0 for a
  /// masked rank's part, which then reads and writes no row). -1 = the dispatch's T.
  int32_t num_tokens_value = -1;
};

/// Enqueues one rank's low-latency combine on `stream`. Errors: INVALID_ARGUMENT for a bad
/// context/arguments (buffer, x_offset not 16-byte aligned or past the area), INTERNAL for
/// CUDA launch errors. Device-side: bad ids counted, timeouts recorded, as for dispatch.
absl::Status LowLatencyCombine(const CudaRankContext& ctx, const LowLatencyCombineArgs& args,
                               cudaStream_t stream);

// ---- every rank of a GPU in one launch ---------------------------------------------------

/// LowLatencyDispatch of every rank in `ctxs` (1..kMaxFusedRanks ranks of ONE group, all on
/// the current device, ctxs[i] paired with args[i]) as one kernel launch on `stream`;
/// outputs, statuses and hand-offs exactly as one LowLatencyDispatch per rank (each rank's
/// blocks run the per-rank kernel's code with that rank's parameters; the grid is the sum of
/// the ranks' grids, ResolveNumBlocks each, so every block must be resident at once, as the
/// per-rank kernels of every rank of the GPU must be). Fused and per-rank launches of a
/// group may alternate from op to op (they keep the same sync state). Both spans are read
/// during the call only.
/// args must agree on buffer, use_fp8, round_scale, use_ue8m0, large_path and
/// handoff.programmatic; everything else (x, topk_idx, num_tokens / num_tokens_value,
/// handoff flags and values, status_out, expert_stats) is per rank.
/// Errors: INVALID_ARGUMENT (naming the rank and field) for anything LowLatencyDispatch
/// refuses, sizes that differ, more than kMaxFusedRanks ranks (or none), a rank given twice,
/// ranks of differing shapes, grids (num_sms, sms_left_per_rank, ranks_on_device) or kernels
/// (a BF16 x of one rank not 16-byte aligned where another's is) or disagreeing args;
/// nothing is launched then. INTERNAL for launch errors.
absl::Status LowLatencyDispatchRanks(std::span<const CudaRankContext> ctxs,
                                     std::span<const LowLatencyDispatchArgs> args,
                                     cudaStream_t stream);

/// The same for LowLatencyCombine: args agree on buffer, x_offset and handoff.programmatic
/// (and on the kernel: a combined_x of one rank not 16-byte aligned where another's is is
/// refused); combined_x, topk_idx / topk_weights, num_tokens_value and handoff are per rank.
/// Errors as LowLatencyDispatchRanks.
absl::Status LowLatencyCombineRanks(std::span<const CudaRankContext> ctxs,
                                    std::span<const LowLatencyCombineArgs> args,
                                    cudaStream_t stream);

}  // namespace epd::kernels::cuda
