// The semantics of epd's ops, written once: pure functions on plain values, used by the
// daemon's validation, the client's checks, the client-launched launches and both
// backends. Design: docs/DESIGN.md §8.4 "Op rules".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "epd/kernels/layout.h"
#include "proto/abi/shm_abi.h"

namespace epd::rules {

// ---- op descriptor table ----------------------------------------------------------------

/// What an op kind is. One row per abi::OpKind (kInvalid included).
struct OpDescriptor {
  abi::OpKind op = abi::OpKind::kInvalid;
  const char* name = "Invalid";  ///< abi::OpKindName.
  bool data_op = false;          ///< Moves tokens (checked num_tokens/num_sms; not programs).
  bool low_latency = false;      ///< Uses the low-latency buffers and ll_max_tokens_per_rank.
  bool program_op = false;       ///< RegisterProgram / UnregisterProgram.
  /// One rank's error makes every rank's output undefined, so every rank gets it (every
  /// op but GetDispatchLayout).
  bool exchanges_data = false;
  bool may_use_fp8 = false;  ///< kFlagFp8 means something for it.
  /// Request flags that carry meaning for this op (kFlagClientError and kFlagStreamOrdered
  /// are accepted on every op and not listed).
  uint32_t option_flags = 0;
};

/// The descriptor of `op` (the kInvalid row for a value outside [1, abi::kMaxOpKind]).
const OpDescriptor& Describe(uint32_t op);
inline const OpDescriptor& Describe(abi::OpKind op) { return Describe(static_cast<uint32_t>(op)); }
/// LowLatencyDispatch or LowLatencyCombine.
inline bool IsLowLatency(abi::OpKind op) { return Describe(op).low_latency; }

/// Request flags every rank of an op must agree on (the op fails when they differ).
inline constexpr uint32_t kAgreedFlags = abi::kFlagFp8 | abi::kFlagCachedHandle |
                                         abi::kFlagCombineWeights | abi::kFlagDispatchWeights |
                                         abi::kFlagRoundScale | abi::kFlagUe8m0;

/// A request's flags, decoded: what the backends turn into kernel Args.
struct RequestOptions {
  bool use_fp8 = false;           ///< kFlagFp8: FP8 (e4m3) data.
  bool round_scale = false;       ///< kFlagRoundScale: power-of-two FP8 scales.
  bool use_ue8m0 = false;         ///< kFlagUe8m0: UE8M0-packed scales (LL dispatch).
  bool cached_handle = false;     ///< kFlagCachedHandle: Dispatch reuses handle_seq's routing.
  bool combine_weights = false;   ///< kFlagCombineWeights: Combine also reduces topk_weights.
  bool dispatch_weights = false;  ///< kFlagDispatchWeights: Dispatch got topk_weights.
  bool stream_ordered = false;    ///< kFlagStreamOrdered.
  bool client_error = false;      ///< kFlagClientError.
};
RequestOptions DecodeFlags(uint32_t flags);
uint32_t EncodeFlags(const RequestOptions& options);

// ---- spec, FP8 and limits ---------------------------------------------------------------

/// The kernels' GroupShape of a validated group spec (any type with the v1::GroupSpec
/// accessors; a template so that this library needs no protobuf).
template <typename Spec>
kernels::GroupShape ShapeOf(const Spec& spec) {
  kernels::GroupShape s;
  s.num_ranks = spec.num_ranks();
  s.num_experts = spec.num_experts();
  s.hidden = spec.hidden();
  s.num_topk = spec.num_topk();
  s.max_tokens_per_rank = spec.max_tokens_per_rank();
  s.ll_max_tokens_per_rank = spec.ll_max_tokens_per_rank();
  s.use_fp8 = spec.use_fp8();
  return s;
}

/// Whether FP8 data may be used by `op` in a group of `shape`: spec.use_fp8, and for the
/// low-latency dispatch (which quantizes) hidden % kFp8BlockChannels == 0.
/// INVALID_ARGUMENT "<what>: use_fp8 needs hidden % 128 == 0, hidden = H" or
/// "<what>: use_fp8 but group <group> has use_fp8 = false" (hidden checked first). `what`
/// names the op (or program step) in the message.
absl::Status CheckFp8(abi::OpKind op, absl::string_view what, const kernels::GroupShape& shape,
                      absl::string_view group);
/// CheckFp8(...).ok() without the message.
bool Fp8Allowed(abi::OpKind op, const kernels::GroupShape& shape);

/// The scale-format rule of a low-latency dispatch (request or program step): use_ue8m0
/// (DeepEP's packed UE8M0 scales) needs use_fp8, round_scale and hidden % 512 == 0.
/// INVALID_ARGUMENT "<what>: use_ue8m0 needs use_fp8" / "... needs round_scale" / "... needs
/// hidden % 512 == 0, hidden = H". OK without use_ue8m0.
absl::Status CheckScaleFormat(absl::string_view what, bool use_fp8, bool round_scale,
                              bool use_ue8m0, const kernels::GroupShape& shape);

/// Tokens per rank `op` may carry: ll_max_tokens_per_rank for low-latency ops, else
/// max_tokens_per_rank.
int32_t MaxTokens(abi::OpKind op, const kernels::GroupShape& shape);

/// The shape checks of a request for `op` (a data op): FAILED_PRECONDITION when a
/// low-latency op meets a group with ll_max_tokens_per_rank == 0; INVALID_ARGUMENT for
/// num_tokens outside [0, MaxTokens], num_sms < 0, a Dispatch expert_alignment outside
/// [1, 2^20], FP8 not allowed (CheckFp8), a LowLatencyDispatch scale format that breaks
/// CheckScaleFormat. `group` names the group in messages.
absl::Status CheckRequestShape(abi::OpKind op, const RequestOptions& options, int32_t num_tokens,
                               int32_t num_sms, int32_t expert_alignment,
                               const kernels::GroupShape& shape, absl::string_view group);

// ---- low-latency buffer parity ----------------------------------------------------------

/// The low-latency buffer rule, a pure function of the op kinds of the group's ops so far
/// (counted from the endpoint's EndpointInfo.first_seq on, failures included): the n-th
/// low-latency dispatch of the group (from 0) writes buffer n % 2 and the n-th low-latency
/// combine writes ll_combined_x[n % 2]. Every op counts, whatever its outcome (a failed
/// dispatch takes its buffer too, and kills the handle that owned it): the daemon and the
/// client count the same ops, so neither predicts nor undoes anything. One exception: an op
/// whose ranks submitted different kinds fails for all and the daemon counts it under the
/// lowest rank's kind, so a rank that submitted another kind is one count off from then on
/// (its Enqueued() views may name the other buffer; Wait uses the completion's buffer; a
/// rejoin starts from the daemon's counts). docs/CLIENT_API.md §10.
struct LowLatencyParity {
  uint64_t dispatches = 0;  ///< Low-latency dispatches counted.
  uint64_t combines = 0;    ///< Low-latency combines counted.

  /// Buffer set the next low-latency dispatch writes.
  int DispatchBuffer() const { return static_cast<int>(dispatches % kernels::kLowLatencyBuffers); }
  /// ll_combined_x buffer the next low-latency combine writes.
  int CombineOutBuffer() const { return static_cast<int>(combines % kernels::kLowLatencyBuffers); }
  /// Buffer of the latest low-latency dispatch counted; -1 before the first.
  int LatestDispatchBuffer() const {
    return dispatches == 0 ? -1 : static_cast<int>((dispatches - 1) % kernels::kLowLatencyBuffers);
  }
  /// Counts one op of kind `op` (any kind; only the low-latency ones move the parity).
  void Advance(abi::OpKind op) {
    if (op == abi::OpKind::kLowLatencyDispatch) ++dispatches;
    if (op == abi::OpKind::kLowLatencyCombine) ++combines;
  }
  bool operator==(const LowLatencyParity&) const = default;
};

// ---- handle table -----------------------------------------------------------------------

/// One endpoint's handle state: which dispatch's routing (normal mode) and which
/// low-latency dispatches' buffers are current. The daemon keeps one per endpoint for the
/// daemon-launched mode; a client-launched client keeps its own (it is then the authority).
class HandleTable {
 public:
  /// Whether a request of `op` with `flags` uses the normal routing handle (Combine, and
  /// Dispatch with kFlagCachedHandle).
  static bool UsesRouting(abi::OpKind op, uint32_t flags);

  /// Validates the handle of a request. Routing: FAILED_PRECONDITION when handle_seq is
  /// not in [routing_seq, last_dispatch_seq] (a handle dies at the next non-cached
  /// Dispatch); INVALID_ARGUMENT when num_tokens != the handle's T. LowLatencyCombine:
  /// FAILED_PRECONDITION when handle_seq owns neither buffer; INVALID_ARGUMENT when
  /// num_tokens != its T. OK for other ops.
  absl::Status Check(abi::OpKind op, uint32_t flags, uint64_t handle_seq, int32_t num_tokens) const;
  /// The buffer low-latency dispatch `handle_seq` wrote, when it still owns it; -1 otherwise.
  int LowLatencyBufferOf(uint64_t handle_seq) const;

  /// A Dispatch (op `seq`) succeeded: a non-cached one makes its routing current.
  void DispatchDone(uint64_t seq, bool cached, int32_t num_tokens, int32_t num_recv_tokens,
                    bool fp8);
  /// A low-latency dispatch (op `seq`) took buffer `buffer` (LowLatencyParity). ok: it now
  /// owns the buffer with T = num_tokens; failed: the buffer is owned by nobody (what it
  /// held may be overwritten).
  void LowLatencyDispatchEnded(uint64_t seq, int buffer, int32_t num_tokens, bool ok);
  /// Every low-latency handle dies (a graph-mode program now runs on the buffers).
  void ClearLowLatency();
  /// Op `seq` failed after it was counted as done: a handle it produced is not usable.
  void Forget(uint64_t seq);

  uint64_t routing_seq() const { return routing_seq_; }
  uint64_t last_dispatch_seq() const { return last_dispatch_seq_; }
  int32_t routing_tokens() const { return routing_tokens_; }
  int32_t num_recv_tokens() const { return num_recv_tokens_; }
  bool routing_fp8() const { return routing_fp8_; }
  uint64_t ll_seq(int buffer) const { return ll_seq_[buffer]; }
  int32_t ll_tokens(int buffer) const { return ll_tokens_[buffer]; }

 private:
  uint64_t routing_seq_ = 0;        ///< Dispatch that wrote send_pos (0: none).
  uint64_t last_dispatch_seq_ = 0;  ///< Latest successful dispatch (cached or not).
  int32_t routing_tokens_ = 0;      ///< T of the routing dispatch.
  int32_t num_recv_tokens_ = 0;     ///< N of the routing dispatch.
  bool routing_fp8_ = false;
  uint64_t ll_seq_[kernels::kLowLatencyBuffers] = {0, 0};  ///< Owner of buffer b (0: none).
  int32_t ll_tokens_[kernels::kLowLatencyBuffers] = {0, 0};
};

// ---- graph-program plan -----------------------------------------------------------------

/// One step of a graph-mode program with its fixed low-latency buffers. Buffers are a pure
/// function of the step's position, so every replay of a captured program sees the same
/// views: the i-th dispatch of the program (from 0) writes buffer i % 2; a combine uses
/// the buffer of the nearest dispatch before it (cyclically: a combine before the first
/// dispatch pairs with the program's last one) and writes ll_combined_x[j % 2] for the
/// j-th combine.
struct ProgramStepPlan {
  abi::OpKind op = abi::OpKind::kInvalid;
  bool use_fp8 = false;      ///< Dispatch: quantize to e4m3.
  bool round_scale = false;  ///< Dispatch: power-of-two scales.
  bool use_ue8m0 = false;    ///< Dispatch: UE8M0-packed scales.
  int buffer = 0;            ///< Dispatch: buffer written; combine: its dispatch's buffer.
  int out_buffer = 0;        ///< Combine: ll_combined_x buffer written.
};

/// Plans the buffers of a program whose steps are `steps` (op, use_fp8, round_scale set;
/// buffer fields ignored) in place. Does not validate (PlanProgram does).
void AssignProgramBuffers(std::vector<ProgramStepPlan>& steps);

/// Decodes and validates the program of a kRegisterProgram `slot` (its program_num_steps and
/// program_steps, shm_abi.h) for a group of `shape`, and plans its buffers.
/// INVALID_ARGUMENT naming the step for: a count outside [1, kMaxProgramSteps], a step
/// that is not LowLatencyDispatch/LowLatencyCombine, FP8 without shape.use_fp8 or with
/// hidden % 128 != 0, round_scale without FP8, use_ue8m0 against CheckScaleFormat, a
/// combine with FP8 options, a combine
/// without any dispatch; FAILED_PRECONDITION when ll_max_tokens_per_rank == 0.
absl::StatusOr<std::vector<ProgramStepPlan>> PlanProgram(const abi::RequestSlot& slot,
                                                         const kernels::GroupShape& shape);

/// "LowLatencyDispatch{use_fp8=true, round_scale=false}" (", use_ue8m0=true" added when set)
/// / "LowLatencyCombine".
std::string ProgramStepName(const ProgramStepPlan& step);

// ---- host backend -----------------------------------------------------------------------

/// The flat index (token * num_topk + k) of the first of `num_tokens` x shape.num_topk
/// expert ids that is neither -1 nor in [0, num_experts), or -1 when every id is valid
/// (the topk_idx range rule every host kernel and the host data plane apply).
int64_t FirstBadTopkEntry(const kernels::GroupShape& shape, int32_t num_tokens,
                          const int64_t* topk_idx);

}  // namespace epd::rules
