// The client's kernels of a client-launched endpoint of a group that spans nodes (DESIGN.md
// §5.5 "Client-launched", proto/abi/span_abi.h): one posts the op (copies its inputs from the
// rank's GPU data area into the host mirror the client maps, then publishes a command), the
// other waits for the daemon's answer and copies the outputs back. Both take every value by
// argument or from device memory, so a stream capturing a CUDA graph captures them, and a
// replay posts a new op (the op number comes from a device counter). No CPU wait, no copy
// engine, no __trap: every wait is bounded.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "epd/kernels/layout.h"
#include "proto/abi/span_abi.h"

namespace epd::kernels::cuda {

/// Most input ranges of one posting kernel.
inline constexpr int kMaxPostSpans = 64;

/// One input range: `rows` rows of `row_bytes` at byte `offset` of the area, copied to the
/// same offset of the mirror, at most `max_bytes` (the region). With `rows_ptr` (an int32 in
/// device or host-mapped memory) the rows are read there when the kernel runs.
struct PostSpan {
  uint64_t offset = 0;
  uint64_t max_bytes = 0;
  uint64_t row_bytes = 0;
  int64_t rows = 0;
  const int32_t* rows_ptr = nullptr;
};

/// The device words of one endpoint's command channel (device memory, zeroed, then
/// next_seq = the endpoint's first op number). Written only by the two kernels, in stream
/// order (one command in flight per endpoint).
struct SpanDeviceState {
  uint64_t next_seq;     ///< The op number the next posting kernel takes.
  uint64_t current_seq;  ///< The op posted last (what the await kernel waits for).
  uint64_t routing_seq;  ///< The latest non-cached Dispatch (the normal-mode handle).
  uint64_t ll_seq[kLowLatencyBuffers];    ///< The LL dispatch whose outputs buffer b holds.
  int32_t ll_tokens[kLowLatencyBuffers];  ///< Its T.
  uint32_t post_ticket;                   ///< 0 between kernels.
  uint32_t await_ticket;                  ///< 0 between kernels.
  uint32_t await_timed_out;               ///< Blocks of the await kernel that timed out.
  uint32_t await_bad_copies;              ///< Answer copies outside the area or mirror.
  uint32_t reserved[12];
};
static_assert(sizeof(SpanDeviceState) == 112);

/// What the await kernel writes back (host-mapped pinned memory the client's Wait reads).
struct SpanReadback {
  uint64_t seq;             ///< The op answered (its device op number).
  int32_t status_code;      ///< The daemon's absl::StatusCode; 4 (DEADLINE_EXCEEDED) on timeout.
  int32_t num_recv_tokens;  ///< Dispatch: N.
  uint32_t timed_out;       ///< Nonzero: no answer within the timeout.
  uint32_t bad_copies;      ///< Answer copies skipped (outside the area or mirror).
  uint32_t reserved[2];
};
static_assert(sizeof(SpanReadback) == 32);

/// How the posting kernel fills the command's handle_seq and T.
enum class SpanHandle : int32_t {
  kNone = 0,
  kRouting = 1,    ///< handle_seq = state.routing_seq (Combine, cached Dispatch).
  kLowLatency = 2  ///< handle_seq = state.ll_seq[handle_buffer], T = state.ll_tokens[...].
};

struct SpanPostArgs {
  uint8_t* area = nullptr;              ///< The rank's GPU data area.
  uint8_t* mirror = nullptr;            ///< The mirror (device pointer of the mapped region).
  abi::SpanControl* control = nullptr;  ///< Its command block (device pointer).
  SpanDeviceState* state = nullptr;
  PostSpan spans[kMaxPostSpans];
  int32_t num_spans = 0;
  uint64_t max_total_bytes = 0;  ///< Sizes the grid: the spans' largest sum.
  // ---- the command ----
  uint32_t op = 0;
  uint32_t flags = 0;
  int32_t expert_alignment = 1;
  int32_t client_buffer = 0;
  int32_t num_tokens = 0;                   ///< T, unless read from num_tokens_ptr.
  const int32_t* num_tokens_ptr = nullptr;  ///< T on the device (LL dispatch).
  SpanHandle handle = SpanHandle::kNone;
  int32_t handle_buffer = 0;     ///< kLowLatency: the client buffer of the handle's dispatch.
  bool records_routing = false;  ///< A non-cached Dispatch: routing_seq = its seq.
  bool records_ll = false;       ///< An LL dispatch: ll_seq/ll_tokens[client_buffer].
};

/// Enqueues the posting kernel. Errors: INVALID_ARGUMENT (num_spans outside [0,
/// kMaxPostSpans], a null pointer), INTERNAL (launch).
absl::Status SpanPostAsync(const SpanPostArgs& args, cudaStream_t stream);

struct SpanAwaitArgs {
  uint8_t* area = nullptr;
  uint64_t area_bytes = 0;
  const uint8_t* mirror = nullptr;
  uint64_t mirror_bytes = 0;
  const abi::SpanControl* control = nullptr;
  SpanDeviceState* state = nullptr;
  SpanReadback* readback = nullptr;  ///< Host-mapped; written by the kernel's last block.
  uint64_t timeout_ns = 0;           ///< Bound on the wait for done_seq.
  uint64_t max_total_bytes = 0;      ///< Sizes the grid: the op's largest output.
};

/// Enqueues the await kernel: waits (bounded by timeout_ns) for the control block's
/// done_seq to equal state.current_seq, then, when the answer is OK, copies its ranges from
/// the mirror into the area (a range outside either is skipped and counted), and writes
/// the readback. Errors as SpanPostAsync.
absl::Status SpanAwaitAsync(const SpanAwaitArgs& args, cudaStream_t stream);

}  // namespace epd::kernels::cuda
