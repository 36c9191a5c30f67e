// One rank's device resources on the CUDA backend: its data area (one cudaMalloc, zeroed,
// exported by CUDA IPC and recorded in this process's registry), its stream, events and
// pinned read-back. The future home of RDMA memory registration. docs/CUDA_BACKEND.md.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/cuda/cuda_handles.h"
#include "common/cuda/device_alloc.h"
#include "daemon/dataplane/deferred_release.h"
#include "daemon/dataplane/exchange/rank_routing.h"
#include "daemon/dataplane/lockstep_group.h"
#include "daemon/metrics/expert_tally.h"
#include "epd/kernels/cuda_gather.h"
#include "epd/kernels/cuda_mirror.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/row_reduce.h"
#include "proto/abi/launch_flags.h"
#include "proto/abi/span_abi.h"

namespace epd {

/// What the engine reads back after each op, per rank: pinned host memory mapped into the
/// device address space, written by kernels (never by a copy: no copy engine on the op path).
struct Readback {
  kernels::cuda::DeviceStatus status;
  int32_t recv_count;  ///< N of a normal dispatch (NormalDispatchArgs::recv_count_out).
  /// The staging_seq or ready_seq a daemon-launched low-latency op's WaitFlagAsync saw
  /// (written by that kernel once its wait passed): tells the engine whether the client's
  /// staging ever started for the op.
  uint64_t ready_seen;
  /// Written by the engine (plain stores) before it launches an op through the group's
  /// per-GPU op graphs, read by that graph's kernels (host-mapped): the op's seq (the
  /// ready and done value, KernelHandoff::seq_word) and this rank's T (a low-latency
  /// dispatch's token count). Daemon-private: no client writes them.
  uint64_t op_seq;
  int32_t op_num_tokens;
  /// The rank's ready_seq, copied here by a one-thread kernel (ReadWordAsync) on the
  /// engine's aux stream while a graceful stop waits for the rank's client to stage an op
  /// in flight (CudaGroup::StagingsLanded); 0 until then.
  uint64_t stop_ready;
};

/// A rank of a group that spans nodes (DESIGN.md §5.5): the host side of its data area that
/// the exchange (daemon/dataplane/exchange/) reads and writes. `base` mirrors the GPU area's
/// EndpointLayout regions up to (not including) ll_routing, at the same offsets; kernels copy
/// an op's inputs into it and its outputs back, so no device-to-host copy runs on the op
/// path. Daemon-launched: daemon-private pinned memory (`data`), copied by the daemon's
/// kernels (kernels::cuda::CopySpansAsync). Client-launched: the data part of the rank's
/// endpoint region (a sealed memfd the client maps too, proto/abi/span_abi.h), copied by
/// the client's kernels, with the command block `control` after it; client-writable, so
/// the exchange treats it as it treats the host backend's areas. Allocated at join; an op
/// allocates nothing.
struct CudaRankMirror {
  /// The mirror's first byte: data.get(), or the endpoint region's data part.
  uint8_t* base = nullptr;
  /// Client-launched: the command block in the endpoint region (null otherwise). The
  /// region outlives every op that uses it (LockstepGroup keeps a departed rank's endpoint
  /// until its running op finished).
  abi::SpanControl* control = nullptr;
  /// Client-launched: the copy of the command of the rank's current op (TakeSpanCommand).
  abi::SpanCommand command{};
  /// Client-launched: the control block's client_wakes last seen (ClientCommandsHot).
  uint64_t client_wakes = 0;
  PinnedArray<uint8_t> data;               ///< [MirrorBytes(layout)], mapped (daemon-launched).
  PinnedArray<kernels::Region> in_spans;   ///< [kMaxAreaSpans], mapped.
  PinnedArray<kernels::Region> out_spans;  ///< [kMaxAreaSpans], mapped.
  /// [1], mapped: the seq of the op whose inputs the copy-in kernel has landed in `data`
  /// (stored by its last block, release at system scope; the engine polls it).
  PinnedArray<uint64_t> staged;
  /// Daemon-launched: where a dispatch's received rows are, for the gather kernel to copy
  /// into the GPU area (DESIGN.md §5.5 "Rows on the GPU"): [kernels::RowSourceRows]
  /// RowSources, mapped, written by the exchange (NodeExchangeHost::ExchangeRowSources);
  /// the gather's windows [kMaxGatherWindows], mapped; and whether the running op's rows
  /// were left to it.
  PinnedArray<kernels::RowSource> row_sources;
  PinnedArray<kernels::cuda::GatherWindow> windows;
  bool rows_pending = false;
  /// The op whose windows `windows` holds (CudaGroup::OpWindows builds them once per op,
  /// for the pack and the gather alike) and how many.
  uint64_t windows_seq = 0;
  int32_t num_windows = 0;
  /// Recorded after the rank's pack of its rows into the send staging (the exchange posts
  /// once it passed: NodeExchangeHost::ExchangeRowsPacked) and after its gather (every
  /// stream-ordered local rank's done_seq waits for the others': they may read its area).
  EventHandle packed;
  EventHandle gathered;
  bool gathered_this_op = false;
  /// Daemon-launched: where a combine records the rank's combined rows for the reduce kernel
  /// to sum into the GPU area (DESIGN.md §5.5 "Rows on the GPU"): [ReduceTableRows *
  /// ReduceTermsPerRow] ReduceTerms, mapped, written by the exchange through `reduce`
  /// (NodeExchangeHost::ExchangeReduceTable, which also sets its rows); and whether the
  /// running op's rows were left to it.
  PinnedArray<kernels::ReduceTerm> reduce_terms;
  kernels::ReduceTable reduce;
  bool reduce_pending = false;
  static uint64_t ReduceTermsCount(const kernels::GroupShape& shape) {
    return static_cast<uint64_t>(kernels::ReduceTableRows(shape)) *
           kernels::ReduceTermsPerRow(shape);
  }
  /// The low-latency FP8 dispatch whose tokens the GPU quantized into the exchange's rows
  /// (NodeExchangeHost::ExchangeRowsQuantized); 0: none.
  uint64_t quantized_seq = 0;
  /// Daemon-launched, low-latency ops on: the GPU's copy of those quantized tokens
  /// ([Mll, H] e4m3, then [Mll, S] f32 at QuantScalesOffset), which the gather reads for
  /// this node's rows instead of the host's.
  DeviceMemory quant_rows;
  static uint64_t QuantScalesOffset(const kernels::GroupShape& shape) {
    return (static_cast<uint64_t>(shape.ll_max_tokens_per_rank) * shape.hidden + 15) / 16 * 16;
  }
  /// quant_rows' tokens and scales (null when there is none).
  kernels::e4m3_bits* quant_x_copy() const {
    return reinterpret_cast<kernels::e4m3_bits*>(quant_rows.get());
  }
  float* quant_scales_copy(const kernels::GroupShape& shape) const {
    return quant_rows ? reinterpret_cast<float*>(quant_rows.get() + QuantScalesOffset(shape))
                      : nullptr;
  }
  static uint64_t QuantRowsBytes(const kernels::GroupShape& shape) {
    return shape.ll_max_tokens_per_rank <= 0
               ? 0
               : QuantScalesOffset(shape) +
                     static_cast<uint64_t>(shape.ll_max_tokens_per_rank) * shape.num_scales() * 4;
  }
  DeviceMemory counter;  ///< The copy kernels' ticket word (uint32, zeroed).
  RankRouting routing;   ///< The rank's private routing state (as the host backend's).
  /// Unique to this mirror in the process (NodeExchangeHost::ExchangeRankRegion's id).
  uint64_t memory_id = 0;

  explicit CudaRankMirror(const kernels::GroupShape& shape)
      : routing(shape), memory_id(NextMemoryId()) {}
  /// Bytes of `data` for `layout`: every region before ll_routing.
  static uint64_t MirrorBytes(const kernels::EndpointLayout& layout) {
    return layout.ll_routing.offset;
  }
  static uint64_t NextMemoryId() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1, std::memory_order_relaxed);
  }
  /// Bytes of one rank's mirror of a group of `shape` (data, span tables, routing, row
  /// tables: host; the quantized rows' copy: GPU).
  static uint64_t BytesFor(const kernels::GroupShape& shape) {
    return MirrorBytes(kernels::EndpointLayout::Compute(shape)) +
           2 * sizeof(kernels::Region) * kernels::kMaxAreaSpans + RankRouting::BytesFor(shape) +
           static_cast<uint64_t>(kernels::RowSourceRows(shape)) * sizeof(kernels::RowSource) +
           sizeof(kernels::cuda::GatherWindow) * kernels::cuda::kMaxGatherWindows +
           ReduceTermsCount(shape) * sizeof(kernels::ReduceTerm) + QuantRowsBytes(shape);
  }
};

/// One attached rank on the CUDA backend. Destroyed when the rank has detached and no op
/// still running holds it: nothing writes its area any more. The destructor removes the
/// area from the registry and synchronises the stream (bounded: every kernel wait is).
struct CudaRank : RankResources {
  int device = 0;  ///< The daemon's CUDA ordinal.
  int32_t rank = 0;
  uint64_t bytes = 0;
  uint64_t launch_flags_offset = 0;  ///< EndpointLayout::launch_flags.offset.
  bool client_launched = false;      ///< LAUNCH_MODE_CLIENT: the engine runs nothing.
  std::string ipc_handle;            ///< cudaIpcMemHandle_t bytes of `area`.
  StreamHandle stream;               // Declared before area: destroyed after it is synchronised.
  /// Recorded after each daemon-launched op (timing enabled: the op's GPU time ends here).
  EventHandle done;
  EventHandle waited;              ///< Recorded once a stream-ordered op's ready wait has passed.
  EventHandle op_begin;            ///< Recorded before each daemon-launched op's kernels (timing).
  PinnedArray<Readback> readback;  ///< [1], mapped.
  DeviceMemory area;
  std::unique_ptr<CudaRankMirror> mirror;  ///< A spanning group's rank; null otherwise.
  /// The rank's per-local-expert received-token totals (kernels::cuda::ExpertTokenStats):
  /// [2 * El] uint64 on the GPU, zeroed (the totals, then the last normal dispatch's
  /// counts), and the totals' host-mapped copy [El], counted by the group's tally from
  /// AddCudaRankExpertStats until this rank is destroyed. Empty when not kept.
  DeviceMemory expert_totals;
  int32_t experts_per_rank = 0;
  PinnedArray<uint64_t> expert_mirror;
  std::shared_ptr<metrics::ExpertTokenTally> expert_tally;

  ~CudaRank() override;

  /// What the rank's dispatch kernels add their per-expert counts to (off when not kept).
  kernels::cuda::ExpertTokenStats expert_stats() const {
    auto* totals = reinterpret_cast<uint64_t*>(expert_totals.get());
    return {totals, totals != nullptr ? totals + experts_per_rank : nullptr, expert_mirror.get()};
  }

  /// launch_flags.ready_seq / done_seq / staging_seq in the rank's area (layout.h).
  uint8_t* ready_flag() const { return flag(abi::kReadyFlagOffset); }
  uint8_t* done_flag() const { return flag(abi::kDoneFlagOffset); }
  uint8_t* staging_flag() const { return flag(abi::kStagingFlagOffset); }
  /// The launch-flag word at `offset` of launch_flags (abi::k*Offset, proto/abi/launch_flags.h).
  uint8_t* flag(uint64_t offset) const { return area.get() + launch_flags_offset + offset; }
};

/// Creates rank `rank`'s resources on `device`: a stream, its events, the pinned read-back
/// and a zeroed data area of layout.total_bytes, exported by CUDA IPC and registered for
/// FindInProcessCudaArea. With `release`, the CudaRank is not destroyed where its last
/// reference is dropped but handed to `release` (which must outlive it), so its memory is
/// freed only between engine rounds (deferred_release.h); null: destroyed in place. Errors:
/// RESOURCE_EXHAUSTED (GPU full), INTERNAL (CUDA, naming the call).
absl::StatusOr<std::shared_ptr<CudaRank>> CreateCudaRank(int device, int32_t rank,
                                                         const kernels::EndpointLayout& layout,
                                                         bool client_launched,
                                                         DeferredRelease* release = nullptr);

/// Gives `rank` its per-expert received-token totals (CudaRank::expert_totals: 2 *
/// `experts_per_rank` uint64 on its GPU, zeroed, and the totals' mapped host copy) and
/// enters the copy into `tally` until the rank is destroyed. No-op when `experts_per_rank`
/// is 0 or `tally` null. Errors: RESOURCE_EXHAUSTED (GPU full), INTERNAL (pinned memory,
/// CUDA).
absl::Status AddCudaRankExpertStats(CudaRank& rank, int32_t experts_per_rank,
                                    std::shared_ptr<metrics::ExpertTokenTally> tally);

/// Gives `rank` (created by CreateCudaRank for a group of `shape`) its CudaRankMirror:
/// daemon-launched, pinned host memory; client-launched, only its routing state (`base`
/// and `control` are set once the endpoint region exists, CudaGroup::RankRegionReady).
/// Errors: RESOURCE_EXHAUSTED when pinned host memory runs out, INTERNAL (CUDA).
absl::Status AddCudaRankMirror(CudaRank& rank, const kernels::GroupShape& shape,
                               const kernels::EndpointLayout& layout);

}  // namespace epd
