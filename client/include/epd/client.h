// libepdclient, the client side of epd: Client (a process's Session with the daemon),
// Endpoint (one rank of a group, running dispatch/combine ops through a shared-memory
// ring), PendingOp (a submitted op) and the DLPack-based argument and result types.
// Behaviour contracts (streams, launch modes, lockstep, errors, result lifetimes, graph
// mode) are in docs/CLIENT_API.md; op semantics in docs/DESIGN.md §3.3.
// Letters: T tokens, H hidden, K top-k, R ranks, E experts, M / Mll max tokens per rank
// (normal / low-latency), N rows received, C a capacity (rows given, >= T).
// Errors are absl::Status. Thread-safety: a Client from several threads, an Endpoint from
// one thread at a time.
#pragma once

#include <dlpack/dlpack.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "epd/v1/control.pb.h"

namespace epd {

class Endpoint;
struct EndpointShared;

/// DLPack >= 1.1 type code of float8_e4m3fn (kDLFloat8_e4m3fn); Debian's dlpack.h (0.6)
/// predates it, so epd spells the value; FP8 tensors (e4m3 x of Dispatch, the e4m3 recv_x
/// views) carry dtype kDLFloat8E4m3fn.
inline constexpr uint8_t kDLFloat8E4m3fnCode = 10;
/// The DLDataType of e4m3 tensors: {kDLFloat8E4m3fnCode, 8 bits, 1 lane}.
inline constexpr DLDataType kDLFloat8E4m3fn{kDLFloat8E4m3fnCode, 8, 1};

/// A compact row-major DLTensor over caller-owned memory: `data` [shape...] of `dtype` on
/// `device` (default kDLCPU). The DLTensor points at `shape`, which must outlive it.
/// Convenience for callers that hold plain buffers rather than framework tensors.
inline DLTensor MakeDLTensor(void* data, DLDataType dtype, std::vector<int64_t>& shape,
                             DLDevice device = {kDLCPU, 0}) {
  DLTensor t{};
  t.data = data;
  t.device = device;
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = dtype;
  t.shape = shape.data();
  return t;
}

class TensorView;

/// The dimensions of a TensorView in elements, outermost first (e.g. [N, H]). Up to
/// kInlineDims are stored inline (no heap allocation); reads like a std::vector<int64_t>.
class TensorShape {
 public:
  static constexpr size_t kInlineDims = 4;
  using value_type = int64_t;
  using size_type = size_t;
  using const_iterator = const int64_t*;
  using iterator = const_iterator;

  TensorShape() = default;
  TensorShape(std::initializer_list<int64_t> dims) : dims_(dims) {}
  /// From a vector (implicit, so a std::vector<int64_t> converts).
  TensorShape(const std::vector<int64_t>& dims)  // NOLINT(google-explicit-constructor)
      : dims_(dims.begin(), dims.end()) {}

  size_t size() const { return dims_.size(); }
  bool empty() const { return dims_.empty(); }
  const int64_t* data() const { return dims_.data(); }
  const int64_t& operator[](size_t i) const { return dims_[i]; }
  const_iterator begin() const { return dims_.data(); }
  const_iterator end() const { return dims_.data() + dims_.size(); }
  /// A copy as a std::vector (allocates).
  operator std::vector<int64_t>() const {  // NOLINT(google-explicit-constructor)
    return std::vector<int64_t>(begin(), end());
  }

  friend bool operator==(const TensorShape& a, const TensorShape& b) { return a.dims_ == b.dims_; }
  friend bool operator==(const TensorShape& a, const std::vector<int64_t>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  friend class TensorView;
  int64_t* mutable_data() { return dims_.data(); }
  absl::InlinedVector<int64_t, kInlineDims> dims_;
};

/// A read-only tensor in an endpoint's buffers: compact row-major, or with explicit strides
/// (the low-latency dispatch's recv_scales, stored token index fastest). `dl()` (shape and
/// strides) points into this object: keep the view alive while the DLTensor is used.
/// Copies of up to 4 dims allocate nothing.
class TensorView {
 public:
  TensorView() = default;
  /// A view of `data` [shape...] of `dtype` on `device`, compact row-major.
  TensorView(void* data, DLDataType dtype, DLDevice device, TensorShape shape);
  /// A view with `strides` (elements, one per dim of `shape`): element [i0, i1, ...] is at
  /// data + Σ i_d * strides[d] elements.
  TensorView(void* data, DLDataType dtype, DLDevice device, TensorShape shape, TensorShape strides);
  TensorView(const TensorView& other);
  TensorView& operator=(const TensorView& other);

  /// The DLPack view (ndim = shape().size(); strides NULL when compact row-major, else
  /// strides()).
  const DLTensor& dl() const { return tensor_; }
  void* data() const { return tensor_.data; }
  /// The dimensions in elements (see TensorShape), outermost first.
  const TensorShape& shape() const { return shape_; }
  /// The strides in elements, one per dimension; empty for a compact row-major view.
  const TensorShape& strides() const { return strides_; }
  /// Number of elements.
  int64_t numel() const;
  /// Bytes of the element data (numel() elements; a strided view's strides permute a
  /// compact block of this size).
  int64_t nbytes() const;
  template <typename T>
  T* as() const {
    return static_cast<T*>(tensor_.data);
  }

 private:
  void Rebind();
  TensorShape shape_;
  TensorShape strides_;
  DLTensor tensor_{};
};

/// What combine and cached re-dispatch need from an earlier dispatch; bound to its endpoint
/// and dispatch. Usable until the next non-cached normal Dispatch (normal mode) or the
/// low-latency dispatch after next (low-latency); a stale one gives FAILED_PRECONDITION.
struct Handle {
  uint64_t endpoint_id = 0;  ///< Endpoint that produced it.
  uint64_t seq = 0;          ///< Sequence number of the dispatch.
  bool low_latency = false;
  int32_t num_tokens = 0;       ///< T of that dispatch.
  int32_t num_recv_tokens = 0;  ///< N received by this rank (normal mode).
  int32_t buffer = 0;           ///< Low-latency buffer set (0 or 1).
  bool use_fp8 = false;         ///< The dispatch moved FP8 data.
  bool use_ue8m0 = false;       ///< Low-latency: its scales are UE8M0-packed int32.
};

// ---- op arguments and results ---------------------------------------------------------

/// The rank mask an op ran with (docs/RELIABILITY.md), in every op result.
struct OpMask {
  uint32_t epoch = 0;         ///< The group's mask epoch (0 = no rank ever masked).
  int32_t num_masked = 0;     ///< Ranks masked in that epoch (Endpoint::QueryRankMask).
  int32_t dropped_pairs = 0;  ///< This rank's token-expert pairs whose expert was masked.
};

/// A group's rank mask.
struct RankMask {
  uint32_t epoch = 0;
  std::vector<int32_t> masked_ranks;  ///< Ascending.
};

/// GetDispatchLayout output for topk_idx [T, K] int64 (-1 = none); a repeated expert in a
/// row counts the token once.
struct LayoutResult {
  TensorView num_tokens_per_rank;    ///< [R] int32: tokens with an expert on rank r.
  TensorView num_tokens_per_expert;  ///< [E] int32: tokens routed to expert e.
  /// [T, R] uint8 {kDLUInt, 8, 1}, 0 or 1 (DLPack 0.6 has no bool).
  TensorView is_token_in_rank;
  // Valid until the next GetDispatchLayout on this endpoint.
};

/// Normal (high-throughput) dispatch inputs.
struct DispatchArgs {
  const DLTensor* x = nullptr;         ///< [T, H] bf16, or [T, H] e4m3 (float8_e4m3fn).
  const DLTensor* x_scales = nullptr;  ///< [T, H/128] f32, required with e4m3 x.
  /// [T, K] int64 (-1 = none); not read with `cached`.
  const DLTensor* topk_idx = nullptr;
  const DLTensor* topk_weights = nullptr;  ///< [T, K] f32, optional; not read with `cached`.
  int32_t expert_alignment = 1;            ///< >= 1; per-expert counts rounded up to it.
  /// Re-dispatch x (and x_scales) with this handle's routing; the routing views of the
  /// result are the routing dispatch's, not rewritten (docs/CLIENT_API.md §9).
  std::optional<Handle> cached;
  int32_t num_sms = 0;     ///< Kernel SM budget (0 = default).
  void* stream = nullptr;  ///< CUDA backend: the op's cudaStream_t.
};
/// Normal dispatch outputs. Valid until the next normal Dispatch on this endpoint.
struct DispatchResult {
  TensorView recv_x;       ///< [N, H] bf16 or e4m3.
  TensorView recv_scales;  ///< [N, H/128] f32 (FP8 only).
  /// [N, K] int64: local expert id at each k, -1 where the expert is not on this rank.
  TensorView recv_topk_idx;
  /// [N, K] f32: weight at each k with a local id, else 0 (all 0 without topk_weights).
  TensorView recv_topk_weights;
  TensorView num_recv_tokens_per_expert;  ///< [E/R] int32, aligned.
  TensorView recv_src_info;               ///< [N] int32: src_rank * M + src_token.
  /// [1] int32: N, in the endpoint's (device) memory, written by the op itself.
  TensorView recv_count;
  Handle handle;
  /// N (read back by Wait); -1 from Enqueued() of a non-cached Dispatch, whose views then
  /// have the capacity R*M rows, rows [0, recv_count[0]) valid.
  int32_t num_recv_tokens = 0;
  OpMask mask;  ///< Set by Wait.
};

/// Normal combine inputs.
struct CombineArgs {
  const DLTensor* x = nullptr;             ///< [N, H] bf16 expert outputs, rows as received.
  const Handle* handle = nullptr;          ///< From the matching Dispatch.
  const DLTensor* topk_weights = nullptr;  ///< [N, K] f32, optional: reduced too.
  int32_t num_sms = 0;
  void* stream = nullptr;  ///< CUDA backend: the op's cudaStream_t.
};
/// Normal combine outputs. Valid until the next normal Combine on this endpoint.
struct CombineResult {
  TensorView combined_x;             ///< [T, H] bf16.
  TensorView combined_topk_weights;  ///< [T, K] f32 (when topk_weights was given).
  OpMask mask;                       ///< Set by Wait.
};

/// Low-latency dispatch inputs.
struct LowLatencyDispatchArgs {
  const DLTensor* x = nullptr;               ///< [T, H] bf16, T <= Mll.
  const DLTensor* topk_idx = nullptr;        ///< [T, K] int64.
  int32_t max_dispatch_tokens_per_rank = 0;  ///< Mll; must equal the spec's (0 = spec's).
  /// e4m3 out with one f32 scale per 128 channels: scale = max(amax, 1e-4) / 448 (DeepEP's
  /// bytes; docs/CLIENT_API.md §9).
  bool use_fp8 = false;
  /// Power-of-two FP8 scales: 2^ceil(log2(max(amax, 1e-4) / 448)).
  bool round_scale = false;
  /// DeepEP's use_ue8m0: recv_scales as int32 words of four UE8M0 exponent bytes (scale =
  /// 2^(byte - 127); block 4j + i in byte i, least significant first). Needs use_fp8,
  /// round_scale and hidden % 512 == 0 (else INVALID_ARGUMENT naming the field).
  bool use_ue8m0 = false;
  void* stream = nullptr;  ///< CUDA backend: the op's cudaStream_t.
  /// Client-launched only, optional: [1] int32 on the endpoint's GPU holding T, read at run
  /// time; x and topk_idx then have C >= T rows and the handle's num_tokens is C. A T
  /// outside [0, Mll] sends nothing and Wait returns INVALID_ARGUMENT.
  const DLTensor* num_tokens = nullptr;
};
/// Low-latency dispatch outputs. Double-buffered: valid until the low-latency dispatch
/// after next on this endpoint.
struct LowLatencyDispatchResult {
  TensorView recv_x;  ///< [E/R, R*Mll, H] bf16 or e4m3.
  /// FP8 only, stored token index fastest (DeepEP's / DeepGEMM's layout): shape
  /// [E/R, R*Mll, H/128] f32 with strides {H/128 * R*Mll, 1, R*Mll}; with use_ue8m0
  /// [E/R, R*Mll, H/512] int32 with strides {H/512 * R*Mll, 1, R*Mll}.
  TensorView recv_scales;
  TensorView recv_count;     ///< [E/R] int32.
  TensorView recv_src_info;  ///< [E/R, R*Mll] int32: src_rank*Mll + token.
  Handle handle;
  OpMask mask;  ///< Set by Wait.
};

/// Low-latency combine inputs.
struct LowLatencyCombineArgs {
  const DLTensor* x = nullptr;             ///< [E/R, R*Mll, H] bf16 expert outputs.
  const DLTensor* topk_idx = nullptr;      ///< [T, K] int64, as dispatched.
  const DLTensor* topk_weights = nullptr;  ///< [T, K] f32.
  const Handle* handle = nullptr;
  void* stream = nullptr;  ///< CUDA backend: the op's cudaStream_t.
};
/// Low-latency combine output. Valid until the low-latency combine after next.
struct LowLatencyCombineResult {
  TensorView combined_x;  ///< [T, H] bf16.
  OpMask mask;            ///< Set by Wait.
};

// ---- graph mode (DESIGN.md §3.2): daemon-launched ops inside CUDA graphs ----------------

/// One step of a graph-mode program.
struct ProgramStep {
  enum class Op { kLowLatencyDispatch, kLowLatencyCombine };
  Op op = Op::kLowLatencyDispatch;
  bool use_fp8 = false;      ///< Dispatch: e4m3 out with f32 scales per 128 channels.
  bool round_scale = false;  ///< Dispatch: power-of-two FP8 scales (needs use_fp8).
  /// Dispatch: UE8M0-packed int32 scales (needs use_fp8, round_scale, hidden % 512 == 0).
  bool use_ue8m0 = false;
};

/// Inputs of a program's LowLatencyDispatch step: kDLCUDA memory of the endpoint's GPU,
/// read at run time (every replay). x and topk_idx have C rows, 0 <= C <= Mll.
struct ProgramDispatchArgs {
  const DLTensor* x = nullptr;           ///< [C, H] bf16.
  const DLTensor* topk_idx = nullptr;    ///< [C, K] int64 (-1 = none).
  const DLTensor* num_tokens = nullptr;  ///< [1] int32: T, 0 <= T <= C (read at run time).
  void* stream = nullptr;                ///< The cudaStream_t the step is ordered on.
};

/// Inputs of a program's LowLatencyCombine step (kDLCUDA, read at run time); C and T are
/// the matching dispatch's.
struct ProgramCombineArgs {
  /// [E/R, R*Mll, H] bf16 expert outputs (not copied if LowLatencyCombineInput()).
  const DLTensor* x = nullptr;
  const DLTensor* topk_idx = nullptr;      ///< [C, K] int64, as dispatched.
  const DLTensor* topk_weights = nullptr;  ///< [C, K] f32.
  void* stream = nullptr;                  ///< The cudaStream_t the step is ordered on.
};

/// A submitted op (defined below Endpoint).
template <typename Result>
class PendingOp;

/// One node of a group that spans several epd daemons: its daemon's advertised Peer address
/// ("host:port", as that daemon's GetStats().peer_address() / Client::PeerAddress() tells)
/// and how many consecutive ranks it hosts (>= 1).
struct GroupNode {
  std::string peer_address;
  int32_t num_ranks = 0;
};

/// Makes `spec` a group across `nodes`, in node order: node i hosts the num_ranks ranks
/// after nodes 0..i-1's. Replaces spec->nodes and sets spec->num_ranks to the sum. An empty
/// list makes a one-node group (no nodes; num_ranks left as it is). Every joiner on every
/// node must present the same list; each rank joins the daemon of its own node. Checks
/// nothing: Client::Join and the daemon do.
///   SetNodes(&spec, {{"10.0.0.1:7300", 4}, {"10.0.0.2:7300", 4}});  // ranks 0-3, 4-7
void SetNodes(v1::GroupSpec* spec, const std::vector<GroupNode>& nodes);

/// The nodes of a group from each rank's daemon Peer address (index = rank), as a launcher
/// that gathered them (e.g. over its process group) derives them: consecutive ranks with
/// the same address form one node. All addresses equal (or all "") give an empty list (a
/// one-node group). INVALID_ARGUMENT naming the rank and address when a node's ranks are not
/// contiguous (an address seen again after another one), or when some addresses are ""
/// and others are not (a daemon without a Peer listener in a group across daemons).
absl::StatusOr<std::vector<GroupNode>> NodesFromRankAddresses(
    const std::vector<std::string>& rank_peer_addresses);

/// Options of Client::Join.
struct JoinOptions {
  /// The group's spec; a group across daemons lists its nodes (SetNodes).
  v1::GroupSpec spec;
  int32_t rank = 0;
  std::string gpu_uuid;  ///< GPU UUID or PCI bus id; "" on host backend.
  v1::LaunchMode launch_mode = v1::LAUNCH_MODE_UNSPECIFIED;
  /// The group's join secret: any bytes, at most 256; empty = none (then only the creator's
  /// uid may join). Set by the first joiner; never logged or returned.
  std::string join_secret;
};

/// One rank of a group on this node. Created by Client::Join.
class Endpoint {
 public:
  /// Leaves the group and unmaps the buffers. CUDA backend: Wait for every op (or sync its
  /// stream) first, since queued work may still read the buffers.
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  const v1::EndpointInfo& info() const;
  const v1::GroupSpec& spec() const;
  int32_t rank() const;

  /// Routing statistics of topk_idx [T, K] int64, ordered on `stream` (CUDA backend).
  absl::StatusOr<PendingOp<LayoutResult>> GetDispatchLayout(const DLTensor& topk_idx,
                                                            void* stream = nullptr);
  /// Normal dispatch (DESIGN §3.3): rows ordered by source rank, then token index.
  absl::StatusOr<PendingOp<DispatchResult>> Dispatch(const DispatchArgs& args);
  /// Normal combine: combined_x[t] = Σ over ranks that received t of their row (f32, ascending
  /// rank, rounded once to bf16).
  absl::StatusOr<PendingOp<CombineResult>> Combine(const CombineArgs& args);
  /// Low-latency dispatch into [E/R, R*Mll, H], packed by source rank, then token.
  absl::StatusOr<PendingOp<LowLatencyDispatchResult>> LowLatencyDispatch(
      const LowLatencyDispatchArgs& args);
  /// Low-latency combine: combined_x[t] = Σ_k w[t,k]·y_{e_k}(t) over topk_idx[t,k] >= 0
  /// (f32, ascending k, rounded once to bf16).
  absl::StatusOr<PendingOp<LowLatencyCombineResult>> LowLatencyCombine(
      const LowLatencyCombineArgs& args);
  /// The low-latency combine input region, [E/R, R*Mll, H] bf16; passing it as x skips a
  /// copy. Empty without low-latency mode; valid while the endpoint lives. Write it only
  /// after this rank's next LowLatencyDispatch (docs/CLIENT_API.md §9).
  TensorView LowLatencyCombineInput() const;
  /// The low-latency dispatch input region, [Mll, H] bf16; passing rows [0, T) as x skips
  /// the daemon-launched staging copy. Empty without low-latency mode; valid while the
  /// endpoint lives. Write it only after the previous LowLatencyDispatch is done.
  TensorView LowLatencyDispatchInput() const;

  // ---- graph mode (CUDA backend, daemon-launched; docs/CLIENT_API.md §11) ----
  // A fixed program of low-latency steps, registered once by every rank and run in program
  // order, cyclically; each step enqueues only device work, so it can be captured.

  /// Registers 1 to 16 steps and blocks until every rank registered the same program and
  /// the daemon armed it, or `timeout`. While armed, other ops of the group fail with
  /// FAILED_PRECONDITION. Errors: FAILED_PRECONDITION (programs differ, already armed,
  /// client-launched, no low-latency mode), UNIMPLEMENTED (host backend), INVALID_ARGUMENT
  /// (bad steps), DEADLINE_EXCEEDED, UNAVAILABLE.
  absl::Status RegisterProgram(const std::vector<ProgramStep>& steps,
                               absl::Duration timeout = absl::InfiniteDuration());
  /// Enqueues the next step (a LowLatencyDispatch) on args.stream and returns its views at
  /// once, valid until the program's next dispatch into the same buffer. GPU-side errors
  /// come from ProgramStatus. Errors: FAILED_PRECONDITION (no program, or the next step is
  /// a combine), INVALID_ARGUMENT (a tensor), INTERNAL (CUDA).
  absl::StatusOr<LowLatencyDispatchResult> RunProgramDispatch(const ProgramDispatchArgs& args);
  /// Enqueues the next step (a LowLatencyCombine) on args.stream; combined_x [C, H] bf16,
  /// rows [0, T) written, valid until the program's next combine into that buffer. Errors
  /// as RunProgramDispatch.
  absl::StatusOr<LowLatencyCombineResult> RunProgramCombine(const ProgramCombineArgs& args);
  /// The latest device-side error of the instances this endpoint's streams have seen, once
  /// the daemon checked them (waits up to op_timeout + 5 s), or OK: INVALID_ARGUMENT,
  /// DEADLINE_EXCEEDED (program disarmed), FAILED_PRECONDITION, UNAVAILABLE. Blocks the CPU.
  absl::Status ProgramStatus();
  /// Disarms the program and blocks until every rank unregistered it (or `timeout`);
  /// waiting instances are released. OK when no program is armed.
  absl::Status UnregisterProgram(absl::Duration timeout = absl::InfiniteDuration());

  // ---- rank masking (docs/RELIABILITY.md) ----

  /// Masks `mask` and unmasks `unmask` (ranks of this group, each in [0, R)), between two
  /// ops of the group; returns the new mask. Errors: INVALID_ARGUMENT naming the rank,
  /// FAILED_PRECONDITION (left, or the group's on_rank_failure is not MASK), UNAVAILABLE.
  absl::StatusOr<RankMask> UpdateRankMask(const std::vector<int32_t>& mask,
                                          const std::vector<int32_t>& unmask);
  /// The group's current mask. Errors as UpdateRankMask.
  absl::StatusOr<RankMask> QueryRankMask();
  /// Unmasks every rank (those not joined stay masked until they rejoin).
  absl::StatusOr<RankMask> CleanRankMask();

  /// Leaves the group explicitly (the daemon frees the rank). Later ops return
  /// FAILED_PRECONDITION. Idempotent.
  absl::Status Leave();

  /// Internal: used by Client::Join and PendingOp.
  struct Impl;
  explicit Endpoint(std::unique_ptr<Impl> impl);
  Impl& impl() { return *impl_; }
  /// Internal (Client::Reconnect): takes over `fresh`'s binding (a new join of this rank),
  /// leaving `fresh` empty; this endpoint's earlier binding is retired (its pending ops
  /// fail with UNAVAILABLE).
  void Rebind(Endpoint& fresh);

 private:
  /// Shared only with weak_ptrs (PendingOp): destroyed with the Endpoint.
  std::shared_ptr<Impl> impl_;
};

/// A submitted op. Wait() returns its result once every rank's part is done. After its
/// Endpoint is destroyed, Wait and Enqueued return FAILED_PRECONDITION.
template <typename Result>
class [[nodiscard]] PendingOp {
 public:
  /// Blocks until the op completes (its result or its own error) or `timeout` passes
  /// (DEADLINE_EXCEEDED; the op stays pending). FAILED_PRECONDITION for an op older than the
  /// latest 64. Client-launched: device-side errors and graph replays as in
  /// docs/CLIENT_API.md §10.
  absl::StatusOr<Result> Wait(absl::Duration timeout = absl::InfiniteDuration());
  /// The result without a CPU wait, for work enqueued after the op on its stream (CUDA
  /// backend); errors still come from Wait. FAILED_PRECONDITION on the host backend or
  /// with no stream. A non-cached Dispatch gives R*M-row views and num_recv_tokens = -1.
  /// Daemon-launched: the low-latency buffer of the views is the one the daemon uses (both
  /// count the group's low-latency ops, failed ones included: rules::LowLatencyParity),
  /// except after an op whose ranks submitted different kinds (docs/CLIENT_API.md §10).
  absl::StatusOr<Result> Enqueued() const;
  uint64_t seq() const { return seq_; }

 private:
  friend class Endpoint;
  PendingOp(std::weak_ptr<Endpoint::Impl> endpoint, uint64_t seq, Result partial)
      : endpoint_(std::move(endpoint)), seq_(seq), partial_(std::move(partial)) {}
  std::weak_ptr<Endpoint::Impl> endpoint_;  ///< Expires when the Endpoint is destroyed.
  uint64_t seq_;
  Result partial_;
};

/// Options of Client::Connect.
struct ClientOptions {
  /// The daemon's unix socket (or "unix:///..."); Control is served only there.
  std::string socket_path = "/run/epd/epd.sock";
  std::string client_name;  ///< Shown by `epctl groups`.
  absl::Duration connect_timeout = absl::Seconds(5);
};

/// A connection to the local epd daemon, holding this process's Session.
class Client {
 public:
  /// Connects and opens the Session. UNAVAILABLE when no daemon answers on the socket
  /// within connect_timeout (the message names the socket).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  /// Joins `options.spec` as `options.rank` and maps the endpoint. Errors (the daemon's):
  /// INVALID_ARGUMENT (spec field, rank, secret; backend limits), PERMISSION_DENIED (join
  /// secret or uid), FAILED_PRECONDITION (spec differs from the live group's),
  /// ALREADY_EXISTS (rank taken), NOT_FOUND (GPU), RESOURCE_EXHAUSTED (memory, quota),
  /// UNAVAILABLE (daemon draining or gone).
  absl::StatusOr<std::unique_ptr<Endpoint>> Join(const JoinOptions& options);

  absl::StatusOr<v1::GetStatsResponse> GetStats();
  /// This daemon's advertised Peer address ("host:port", the NodeSpec.peer_address that names
  /// it in a spec across nodes), from GetStats; "" when its Peer listener is off (it then
  /// serves one-node groups only).
  absl::StatusOr<std::string> PeerAddress();
  /// The groups this process's uid owns or holds a rank of (every group for root and
  /// epd's own uid).
  absl::StatusOr<v1::ListGroupsResponse> ListGroups();
  /// After the daemon restarted (ops and RPCs return UNAVAILABLE): connects again to the
  /// same socket, opens a new Session and rejoins every Endpoint this Client made (and has
  /// not left), with its JoinOptions; the Endpoint objects stay valid, bound to their new
  /// endpoints (new buffers, ring and endpoint_id). Their ops submitted before, pending
  /// or not, fail with UNAVAILABLE; results, views and handles from before are void (on
  /// the host backend the old buffers stay mapped, so a stale view reads stale data, until
  /// the Endpoint is destroyed); a graph-mode program must be registered again. Every rank
  /// of a group must rejoin (each calls Reconnect) before the group's next op completes.
  /// With the Session still open it opens none and only rejoins endpoints a failed
  /// Reconnect left unbound (OK when there are none): a failed Reconnect may be retried.
  /// Waits up to `timeout` for the daemon to answer (retrying while it restarts).
  /// Errors: UNAVAILABLE (no daemon answered within `timeout`), PERMISSION_DENIED (the
  /// socket), the rejoins' errors naming the group and rank (the first one; the other
  /// endpoints are still rejoined).
  /// Threads: one Reconnect at a time; Join and the RPCs may run on other threads (a Join
  /// waits for the rejoins). While it runs, none of this Client's Endpoints may be used,
  /// destroyed or left, and session_id()'s reference is invalidated.
  absl::Status Reconnect(absl::Duration timeout = absl::Seconds(30));
  /// The Session id the daemon assigned (a new one after Reconnect, which invalidates the
  /// reference).
  const std::string& session_id() const;

  struct Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epd
