// The shared-memory ABI between libepdclient and the epd daemon (DESIGN.md §3.2). One region
// per endpoint: [EndpointShmHeader][RequestSlot x ring_capacity][Completion x
// completion_capacity][data area (host backend only)], plus one DoorbellPage per engine.
// Both are sealed memfds (common/os/shm_region.h) passed on the fd channel. Every struct is
// fixed-size POD with static_asserts on its size and offsets; shared counters are accessed
// through std::atomic_ref; the reader checks `magic` and `version`. Bump kShmAbiVersion
// when a byte moves or a meaning changes (here or in launch_flags.h); comments and new
// helpers that leave every byte and its meaning alone need no bump.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace epd::abi {

inline constexpr uint32_t kShmAbiVersion = 10;  // 10: the normal_tiles region in EndpointLayout.
inline constexpr uint32_t kEndpointMagic = 0x45504431;    // "EPD1"
inline constexpr uint32_t kRequestMagic = 0x52455131;     // "REQ1"
inline constexpr uint32_t kDoorbellMagic = 0x44424c31;    // "DBL1"
inline constexpr uint32_t kRingCapacity = 64;             // Request slots (power of two).
inline constexpr uint32_t kCompletionCapacity = 64;       // Completion records.
inline constexpr uint32_t kMessageBytes = 232;            // Error text in the endpoint header.
inline constexpr uint32_t kCompletionMessageBytes = 216;  // Error text in a completion.

/// The first 8 bytes a client sends on a connection to epd's unix socket that is an fd
/// channel (docs/SECURITY.md "Shared memory the client cannot resize") rather than gRPC
/// (whose connections start with the HTTP/2 preface "PRI * HTTP/2.0"). epd's listener
/// routes each accepted connection by its first bytes.
inline constexpr char kFdChannelPreamble[8] = {'E', 'P', 'D', 'F', 'D', 'C', 'H', '1'};

/// Data-plane operations carried by a RequestSlot.
enum class OpKind : uint32_t {
  kInvalid = 0,
  kGetDispatchLayout = 1,
  kDispatch = 2,
  kCombine = 3,
  kLowLatencyDispatch = 4,
  kLowLatencyCombine = 5,
  /// Graph mode (DESIGN.md §3.2, CUDA backend, daemon-launched): registers the program
  /// encoded in RequestSlot::program_num_steps/program_steps (EncodeProgramStep). A lockstep op:
  /// every rank submits the same program; it is armed when all have. Completes without any stream
  /// ordering.
  kRegisterProgram = 6,
  /// Disarms the endpoint's group's program (a lockstep op; OK when none is armed).
  kUnregisterProgram = 7,
};
inline constexpr uint32_t kMaxOpKind = 7;

/// The op's name as the client API spells it ("Dispatch", ...); "Invalid" for any other
/// value (e.g. a garbage ring slot).
inline const char* OpKindName(uint32_t op) {
  switch (static_cast<OpKind>(op)) {
    case OpKind::kGetDispatchLayout:
      return "GetDispatchLayout";
    case OpKind::kDispatch:
      return "Dispatch";
    case OpKind::kCombine:
      return "Combine";
    case OpKind::kLowLatencyDispatch:
      return "LowLatencyDispatch";
    case OpKind::kLowLatencyCombine:
      return "LowLatencyCombine";
    case OpKind::kRegisterProgram:
      return "RegisterProgram";
    case OpKind::kUnregisterProgram:
      return "UnregisterProgram";
    default:
      return "Invalid";
  }
}
inline const char* OpKindName(OpKind op) { return OpKindName(static_cast<uint32_t>(op)); }

/// RequestSlot::flags bits.
enum RequestFlags : uint32_t {
  kFlagFp8 = 1u << 0,              ///< Dispatch: x is e4m3 + scales. LL dispatch: quantize.
  kFlagRoundScale = 1u << 1,       ///< LL dispatch: power-of-two FP8 scales.
  kFlagCachedHandle = 1u << 2,     ///< Dispatch: reuse the routing of `handle_seq`.
  kFlagCombineWeights = 1u << 3,   ///< Combine: also reduce topk_weights.
  kFlagDispatchWeights = 1u << 4,  ///< Dispatch: topk_weights were staged.
  kFlagClientError = 1u << 5,      ///< The client rejected its own inputs: the op fails
                                   ///< for every rank (keeps ranks in lockstep).
  /// CUDA backend, daemon-launched (DESIGN.md §3.2): the client's stream writes
  /// launch_flags.ready_seq = seq once the inputs are staged (it may not have happened
  /// yet when the slot is read). The engine makes the rank's stream wait for
  /// ready_seq >= seq before the op's kernels, and done_seq = seq is written once the op's
  /// outputs are complete (by a low-latency op's kernel itself, else by the engine's stream
  /// after the kernels), and also for an op that fails before launch, so a client stream is
  /// never left waiting.
  kFlagStreamOrdered = 1u << 6,
  /// LL dispatch (with kFlagFp8 and kFlagRoundScale): the scales are written as UE8M0
  /// exponent bytes packed four to an int32 (DeepEP's use_ue8m0; layout.h
  /// LowLatencyScaleOffset).
  kFlagUe8m0 = 1u << 7,
};
inline constexpr uint32_t kAllRequestFlags = 0xff;

/// Graph-mode program encoding in a kRegisterProgram RequestSlot (DESIGN.md §3.2):
/// program_num_steps = number of steps S in [1, kMaxProgramSteps]; step i is the byte
/// (program_steps[i / 8] >> (8 * (i % 8))) & 0xff: bits 0-3 the OpKind (kLowLatencyDispatch or
/// kLowLatencyCombine), bit 4 use_fp8, bit 5 round_scale, bit 6 use_ue8m0 (dispatch only).
inline constexpr uint32_t kMaxProgramSteps = 16;
inline constexpr uint8_t kProgramStepFp8 = 1u << 4;
inline constexpr uint8_t kProgramStepRoundScale = 1u << 5;
inline constexpr uint8_t kProgramStepUe8m0 = 1u << 6;
/// Byte of one step.
constexpr uint8_t EncodeProgramStep(OpKind op, bool use_fp8, bool round_scale,
                                    bool use_ue8m0 = false) {
  return static_cast<uint8_t>((static_cast<uint32_t>(op) & 0xf) | (use_fp8 ? kProgramStepFp8 : 0) |
                              (round_scale ? kProgramStepRoundScale : 0) |
                              (use_ue8m0 ? kProgramStepUe8m0 : 0));
}

/// EndpointShmHeader::daemon_closed values.
inline constexpr uint32_t kClosedShutdown = 1;     ///< epd is shutting down.
inline constexpr uint32_t kClosedRankRemoved = 2;  ///< The rank was detached from its group
                                                   ///< (LeaveGroup, or its Session ended).

/// One request, written by the client into ring slot `seq % kRingCapacity`, then
/// published by advancing EndpointShmHeader::ring_head (release).
struct RequestSlot {
  uint32_t magic;            ///< kRequestMagic.
  uint32_t op;               ///< OpKind.
  uint64_t seq;              ///< Group op number: EndpointInfo.first_seq, then +1 per op.
  uint32_t flags;            ///< RequestFlags.
  int32_t num_tokens;        ///< T (dispatch, layout, LL ops) or T of the handle (combine).
  int32_t expert_alignment;  ///< Dispatch: >= 1.
  int32_t num_sms;           ///< Kernel SM budget; 0 = the computed default.
  uint64_t handle_seq;       ///< Combine / cached dispatch / LL combine: dispatch seq.
  /// kRegisterProgram: the number of steps S; 0 for every other op.
  uint64_t program_num_steps;
  /// kRegisterProgram: the step bytes, step i at bits [8 * (i % 8), +8) of word i / 8
  /// (EncodeProgramStep); 0 for every other op.
  uint64_t program_steps[kMaxProgramSteps / 8];
};
static_assert(std::is_trivially_copyable_v<RequestSlot>);
static_assert(sizeof(RequestSlot) == 64);
static_assert(offsetof(RequestSlot, seq) == 8);
static_assert(offsetof(RequestSlot, handle_seq) == 32);
static_assert(offsetof(RequestSlot, program_num_steps) == 40);
static_assert(offsetof(RequestSlot, program_steps) == 48);

/// Sets step i (< kMaxProgramSteps) of a kRegisterProgram slot to `byte` (EncodeProgramStep).
constexpr void SetProgramStep(RequestSlot& slot, uint32_t i, uint8_t byte) {
  slot.program_steps[i / 8] |= static_cast<uint64_t>(byte) << (8 * (i % 8));
}

/// Step i (< kMaxProgramSteps) of a kRegisterProgram slot.
constexpr uint8_t ProgramStepByte(const RequestSlot& slot, uint32_t i) {
  return static_cast<uint8_t>((slot.program_steps[i / 8] >> (8 * (i % 8))) & 0xff);
}

/// The daemon's answer to request `seq`, in record `seq % kCompletionCapacity`. The
/// daemon writes every field, then stores `seq` (release); the client waits for
/// `seq` (acquire) and then reads the rest.
struct Completion {
  uint64_t seq;             ///< Written last.
  int32_t status_code;      ///< absl::StatusCode.
  int32_t num_recv_tokens;  ///< Dispatch: N rows received; LL combine: this rank's T.
  int32_t buffer;           ///< Low-latency ops: the buffer set (0/1) the op used.
  /// The error's catalog reason (proto/epd/v1/errors.proto ErrorReason); 0 when OK or none.
  uint32_t reason;
  /// The group's rank mask the op ran with: its epoch (0 = no rank was ever masked) and how
  /// many ranks it masks; the client reads the ranks with the mask API.
  uint32_t mask_epoch;
  uint32_t num_masked;
  /// This rank's token-expert pairs dropped because their expert's rank was masked.
  int32_t dropped_pairs;
  uint32_t reserved;                      ///< 0.
  char message[kCompletionMessageBytes];  ///< NUL-terminated error text ("" when OK).
};
static_assert(std::is_trivially_copyable_v<Completion>);
static_assert(sizeof(Completion) == 256);
static_assert(offsetof(Completion, reason) == 20);
static_assert(offsetof(Completion, message) == 40);

/// Start of every endpoint region. Counters sit on their own cache lines.
struct EndpointShmHeader {
  uint32_t size;           ///< sizeof(EndpointShmHeader).
  uint32_t magic;          ///< kEndpointMagic.
  uint32_t version;        ///< kShmAbiVersion.
  uint32_t ring_capacity;  ///< kRingCapacity.
  uint32_t completion_capacity;
  uint32_t reserved0;
  uint64_t endpoint_id;
  uint64_t ring_offset;        ///< Bytes from the region start to RequestSlot[0].
  uint64_t completion_offset;  ///< To Completion[0].
  uint64_t data_offset;        ///< To the data area (0 when the data area is on a GPU).
  uint64_t data_bytes;
  uint64_t total_bytes;
  alignas(64) uint64_t ring_head;      ///< Next seq the client will write - 1 (client).
  alignas(64) uint64_t ring_tail;      ///< Requests consumed (daemon).
  alignas(64) uint32_t client_mapped;  ///< Client sets 1 after mapping (diagnostics only).
  uint32_t client_pid;
  alignas(64) uint32_t completion_futex;   ///< Bumped by the daemon on every completion.
  uint32_t client_waiting;                 ///< Client sleeps on completion_futex when set.
  alignas(64) uint64_t rejected_requests;  ///< Malformed slots seen (diagnostics).
  uint32_t daemon_closed;  ///< Set by the daemon when it stops serving this endpoint:
                           ///< kClosedShutdown (waits and submits then fail with
                           ///< UNAVAILABLE) or kClosedRankRemoved (FAILED_PRECONDITION).
  uint8_t pad1[52];
  // ---- graph-mode program status (DESIGN.md §3.2), written by the daemon's engine ----
  /// Program instances (1, 2, ...) whose device status the engine has checked (release,
  /// written after the error fields below). Compared with the launch_flags instance word.
  alignas(64) uint64_t program_checked;
  /// Errors seen so far (release-stored after the error fields; the client re-reads it
  /// to detect a concurrent update).
  uint64_t program_errors;
  uint64_t program_error_instance;  ///< Instance of the latest error.
  int32_t program_error_code;       ///< absl::StatusCode of the latest error.
  int32_t program_error_step;       ///< Step index of the latest error.
  uint32_t program_armed;           ///< 1 while the group's program is armed.
  uint32_t reserved1;
  char program_error_message[kMessageBytes];  ///< NUL-terminated text of the latest error.
};
static_assert(std::is_trivially_copyable_v<EndpointShmHeader>);
static_assert(sizeof(EndpointShmHeader) == 768);
static_assert(offsetof(EndpointShmHeader, program_checked) == 448);
static_assert(offsetof(EndpointShmHeader, ring_head) == 128);
static_assert(offsetof(EndpointShmHeader, ring_tail) == 192);
static_assert(offsetof(EndpointShmHeader, client_mapped) == 256);
static_assert(offsetof(EndpointShmHeader, completion_futex) == 320);
static_assert(offsetof(EndpointShmHeader, rejected_requests) == 384);
static_assert(offsetof(EndpointShmHeader, daemon_closed) == 392);

/// An engine's wake-up page. The engine sets `engine_sleeping` before a futex wait on
/// `futex_word`; a client that published a request and sees it set bumps `futex_word`
/// and issues FUTEX_WAKE. Every client of the engine may write the whole page: the engine
/// uses `futex_word` only as FUTEX_WAIT's expected value and never reads the header, and a
/// client checks nothing of it but its size (docs/SECURITY.md "The doorbell page").
struct DoorbellPage {
  uint32_t size;
  uint32_t magic;    ///< kDoorbellMagic.
  uint32_t version;  ///< kShmAbiVersion.
  uint32_t reserved0;
  alignas(64) uint32_t futex_word;
  uint32_t engine_sleeping;
  uint8_t pad[56];
};
static_assert(std::is_trivially_copyable_v<DoorbellPage>);
static_assert(sizeof(DoorbellPage) == 128);
static_assert(offsetof(DoorbellPage, futex_word) == 64);

/// Byte layout of an endpoint region with `data_bytes` of host data area.
struct EndpointShmLayout {
  uint64_t ring_offset;
  uint64_t completion_offset;
  uint64_t data_offset;
  uint64_t total_bytes;
};
constexpr EndpointShmLayout ComputeEndpointShmLayout(uint64_t data_bytes) {
  EndpointShmLayout l{};
  l.ring_offset = sizeof(EndpointShmHeader);
  l.completion_offset = l.ring_offset + sizeof(RequestSlot) * kRingCapacity;
  uint64_t end = l.completion_offset + sizeof(Completion) * kCompletionCapacity;
  l.data_offset = (end + 4095) / 4096 * 4096;
  l.total_bytes = l.data_offset + (data_bytes + 4095) / 4096 * 4096;
  return l;
}

/// Atomic view of a shared field.
template <typename T>
std::atomic_ref<T> Atomic(T& field) {
  return std::atomic_ref<T>(field);
}

}  // namespace epd::abi
