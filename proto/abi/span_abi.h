// The command channel of a client-launched endpoint of a group that spans nodes, on the CUDA
// backend (DESIGN.md §5.5 "Client-launched"): the rank's host mirror lives in the data part
// of its endpoint region (a sealed memfd the client maps too, ComputeEndpointShmLayout), and
// a SpanControl block after it carries one command from the client's kernels to the
// daemon's engine and the daemon's answer back. Layout of that data part:
//   [mirror: the EndpointLayout regions before ll_routing, at their own offsets]
//   [padding to 4096][SpanControl]
// Covered by kShmAbiVersion (shm_abi.h) and by SpanControl's own magic and version, which
// the daemon writes at attach and the client checks before it maps the block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "proto/abi/shm_abi.h"

namespace epd::abi {

inline constexpr uint32_t kSpanControlMagic = 0x5350434c;  // "SPCL"
inline constexpr uint32_t kSpanControlVersion = 1;
inline constexpr uint32_t kSpanCommandMagic = 0x53434d44;  // "SCMD"
/// Most copies one answer lists (kernels::kMaxAreaSpans, checked where both are seen).
inline constexpr uint32_t kMaxSpanCopies = 256;

/// One op of the rank, written by the client's posting kernel into the mirror: every field,
/// then `seq` (release at system scope). The daemon's engine polls `seq`; once it equals the
/// rank's next op it copies the record out once and validates only that copy (the block is
/// client-writable). One command is in flight per endpoint: the client's stream waits for
/// the answer (done_seq) before its next op's command.
struct SpanCommand {
  uint64_t seq;              ///< The group op number (EndpointInfo.first_seq, then +1). Last.
  uint32_t magic;            ///< kSpanCommandMagic.
  uint32_t op;               ///< OpKind (the data ops 1-5).
  uint32_t flags;            ///< RequestFlags (kFlagStreamOrdered is not used here).
  int32_t num_tokens;        ///< T (as RequestSlot::num_tokens), read on the device.
  int32_t expert_alignment;  ///< Dispatch: >= 1.
  /// Low-latency ops: the buffer set the client's views use (dispatch: the one it writes;
  /// combine: ll_combined_x's). The daemon's own buffer (its parity) may differ: its answer
  /// maps one onto the other.
  int32_t client_buffer;
  uint64_t handle_seq;  ///< Combine / cached Dispatch / LL combine: the dispatch's op number.
  uint64_t reserved[3];
};
static_assert(std::is_trivially_copyable_v<SpanCommand>);
static_assert(sizeof(SpanCommand) == 64);
static_assert(offsetof(SpanCommand, seq) == 0 && offsetof(SpanCommand, handle_seq) == 32);

/// One range the client's kernel copies from the mirror into the GPU data area after the
/// op: [src_offset, +bytes) of the mirror to [dst_offset, +bytes) of the area.
struct SpanCopy {
  uint64_t src_offset;
  uint64_t dst_offset;
  uint64_t bytes;
};
static_assert(std::is_trivially_copyable_v<SpanCopy>);
static_assert(sizeof(SpanCopy) == 24);

/// The daemon's answer to op `seq`, kept in SpanControl::results[seq % kCompletionCapacity]
/// for the client's host (its message); written before done_seq.
struct SpanResult {
  uint64_t seq;
  int32_t status_code;      ///< absl::StatusCode.
  int32_t num_recv_tokens;  ///< Dispatch: N.
  uint32_t reserved[4];
  char message[kCompletionMessageBytes];  ///< NUL-terminated ("" when OK).
};
static_assert(std::is_trivially_copyable_v<SpanResult>);
static_assert(sizeof(SpanResult) == 248);

/// The block after the mirror (SpanControlOffset). Zeroed at creation, then magic and
/// version written by the daemon.
struct SpanControl {
  uint32_t magic;    ///< kSpanControlMagic.
  uint32_t version;  ///< kSpanControlVersion.
  /// The op number the client's device counter starts from (EndpointInfo.first_seq).
  uint64_t first_seq;
  /// Bumped by the client's host when it enqueued an op and rang the engine's doorbell:
  /// the engine then polls the command word for a while (the kernel posts it later).
  uint64_t client_wakes;
  uint8_t reserved0[40];
  SpanCommand command;  ///< Client → daemon.
  // ---- daemon → client; written before done_seq ----
  /// The op the answer below is for; stored last (release). The client's kernel waits for
  /// done_seq == its op's seq (bounded by op_timeout).
  uint64_t done_seq;
  int32_t done_status_code;      ///< absl::StatusCode of the op at this rank.
  int32_t done_num_recv_tokens;  ///< Dispatch: N.
  uint32_t num_copies;           ///< Valid entries of `copies` (0 unless OK).
  uint32_t reserved1;
  uint8_t reserved2[40];
  SpanCopy copies[kMaxSpanCopies];
  SpanResult results[kCompletionCapacity];
};
static_assert(std::is_trivially_copyable_v<SpanControl>);
static_assert(offsetof(SpanControl, client_wakes) == 16);
static_assert(offsetof(SpanControl, command) == 64);
static_assert(offsetof(SpanControl, done_seq) == 128);
static_assert(offsetof(SpanControl, copies) == 192);
static_assert(offsetof(SpanControl, results) == 192 + 24 * kMaxSpanCopies);
static_assert(sizeof(SpanControl) == 192 + 24 * kMaxSpanCopies + 248 * kCompletionCapacity);

/// Offset of the SpanControl block in the endpoint region's data part, after a mirror of
/// `mirror_bytes` (the EndpointLayout's ll_routing.offset).
constexpr uint64_t SpanControlOffset(uint64_t mirror_bytes) {
  return (mirror_bytes + 4095) / 4096 * 4096;
}
/// Bytes of the endpoint region's data part of such an endpoint.
constexpr uint64_t SpanDataBytes(uint64_t mirror_bytes) {
  return SpanControlOffset(mirror_bytes) + sizeof(SpanControl);
}

}  // namespace epd::abi
