// libepdclient: the client side of epd (DESIGN.md §3.3).
//
// A process connects once (`Client::Connect`), which opens its Session with the daemon:
// when the process exits or crashes, the daemon releases everything it held within 1 s.
// It then joins a group as one rank (`Client::Join`) and gets an `Endpoint`, on which it
// runs dispatch/combine ops. Ops go through a shared-memory ring, never through gRPC.
//
// Tensors are DLPack `DLTensor`s: kDLCPU on the host backend, kDLCUDA on the CUDA
// backend. Inputs must be compact row-major (strides null or dense). Results are
// `TensorView`s into daemon-owned buffers mapped into this process; each result type says
// how long its views stay valid.
//
// Every op is two steps: the op call validates and submits, returning a `PendingOp`;
// `PendingOp::Wait` returns the op's status and result. Neither allocates heap memory when
// the op succeeds (results hold their shapes inline: TensorShape), so a steady stream of
// ops allocates nothing on the calling thread (README "Hot path"); errors may.
//
// CUDA backend: every op is ordered on the CUDA stream its args name (`stream`, a
// cudaStream_t of the endpoint's GPU, e.g. cudaStreamLegacy for the legacy default
// stream): it reads its inputs after the stream's earlier work, and the stream's later
// work sees its outputs (PendingOp::Enqueued gives the views without waiting on the CPU).
// Nothing synchronises the CPU per op. Each endpoint of a process needs a stream of its
// own: ops of two ranks of a group on one stream wait for each other until op_timeout.
// A null `stream` (the default) orders the op after the caller's earlier work on the
// legacy default stream but before none of the caller's later work: the op runs on a
// stream of the endpoint, and its results are valid once Wait returns (so several
// endpoints may be driven with no stream, e.g. one thread per rank).
// Two launch modes, fixed per group at the first Join
// (JoinOptions::launch_mode; EndpointInfo::launch_mode says the one granted), with
// identical results:
//   daemon-launched  the daemon's engine runs the kernels on its own stream; the caller's
//                    stream waits for them on the GPU (DESIGN.md §3.2 stream-ordered
//                    hand-off). If the daemon dies or closes the endpoint, the library
//                    releases the waiting stream and Wait returns UNAVAILABLE.
//   client-launched  this library launches the kernels itself on the caller's stream, on
//                    the buffers of every rank of the group (mapped once, before the
//                    endpoint's first op, which may wait up to op_timeout for every rank
//                    to join). Ops may be captured into a CUDA graph and replayed (see
//                    PendingOp::Wait and LowLatencyDispatchArgs::num_tokens). Errors
//                    found on the GPU (bad expert ids, a timeout) are reported by Wait of
//                    the rank that saw them only (a peer's bad id is not reported to the
//                    other ranks, whose results then lack that entry's routes). A rank
//                    whose inputs the library rejects still takes part in the op where its
//                    peers need it (it sends nothing: T = 0; in a combine its experts give
//                    zeros), so the peers complete instead of timing out; the op call then
//                    returns the error. After a DEADLINE_EXCEEDED (a rank never arrived),
//                    the group must be left and rejoined (the kernels' sync state of the
//                    ranks is out of step).
// Lockstep: the ops of a group run in lockstep on group sequence numbers (DESIGN.md §3.3),
// so every rank must issue the same ops in the same order (kinds and options are checked:
// a disagreement fails that op for every rank, naming each rank's op, and the group
// continues). A rank that skips an op, or issues one more, puts the group out of step:
// each later op then fails with DEADLINE_EXCEEDED after op_timeout on one side and "arrived
// after op S had failed" on the other, until the ranks that skipped leave and rejoin.
// Dtypes (DLPack): bf16 {kDLBfloat, 16, 1}; e4m3 kDLFloat8E4m3fn (below); f32 scales and
// weights {kDLFloat, 32, 1}; topk_idx {kDLInt, 64, 1}.
// Errors are absl::Status:
//   INVALID_ARGUMENT     bad shape/dtype/device/value (names the field and the value);
//   FAILED_PRECONDITION  the endpoint has left its group, or a stale/foreign handle;
//   DEADLINE_EXCEEDED    a rank of the op never arrived within the daemon's op_timeout, or
//                        left the group before arriving (then at once); the message names
//                        the ranks;
//   UNAVAILABLE          the daemon is gone or shutting down.
// Thread-safety: a Client may be used from several threads; an Endpoint from one thread
// at a time.
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

/// DLPack >= 1.1 type code of float8_e4m3fn (kDLFloat8_e4m3fn). Debian's dlpack.h (0.6)
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

/// The dimensions of a TensorView, in elements, outermost first (e.g. [N, H] for recv_x).
/// Up to kInlineDims (4) dimensions are stored inside the object (every view epd returns
/// has 1 to 3), so results are built and copied with no heap allocation (README "Hot
/// path"); more would be stored on the heap. Reads like the std::vector<int64_t> it
/// replaces: size(), empty(), operator[], data(), begin()/end(), == with a
/// std::vector<int64_t> (or another TensorShape), and it converts to a std::vector<int64_t>.
class TensorShape {
 public:
  static constexpr size_t kInlineDims = 4;
  using value_type = int64_t;
  using size_type = size_t;
  using const_iterator = const int64_t*;
  using iterator = const_iterator;

  TensorShape() = default;
  TensorShape(std::initializer_list<int64_t> dims) : dims_(dims) {}
  /// From a vector (implicit, as the API took std::vector<int64_t> before).
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

/// A read-only description of a tensor living in an endpoint's buffers.
/// `dl()` returns a DLTensor that points into this object (its shape array), so keep the
/// TensorView alive while the DLTensor is used. Building, copying and assigning a view of
/// up to 4 dimensions allocates nothing.
class TensorView {
 public:
  TensorView() = default;
  /// A view of `data` [shape...] of `dtype` on `device`, compact row-major.
  TensorView(void* data, DLDataType dtype, DLDevice device, TensorShape shape);
  TensorView(const TensorView& other);
  TensorView& operator=(const TensorView& other);

  /// The DLPack view (ndim = shape().size(), compact strides).
  const DLTensor& dl() const { return tensor_; }
  void* data() const { return tensor_.data; }
  /// The dimensions in elements (see TensorShape), outermost first.
  const TensorShape& shape() const { return shape_; }
  /// Number of elements.
  int64_t numel() const;
  /// Bytes of the element data.
  int64_t nbytes() const;
  template <typename T>
  T* as() const {
    return static_cast<T*>(tensor_.data);
  }

 private:
  void Rebind();
  TensorShape shape_;
  DLTensor tensor_{};
};

/// What combine and cached re-dispatch need from an earlier dispatch. Cheap to copy; a
/// handle is bound to the endpoint and the dispatch that produced it. A normal-mode
/// handle stays usable until the next non-cached normal Dispatch; a low-latency handle
/// until the low-latency dispatch after next.
struct Handle {
  uint64_t endpoint_id = 0;  ///< Endpoint that produced it.
  uint64_t seq = 0;          ///< Sequence number of the dispatch.
  bool low_latency = false;
  int32_t num_tokens = 0;       ///< T of that dispatch.
  int32_t num_recv_tokens = 0;  ///< N received by this rank (normal mode).
  int32_t buffer = 0;           ///< Low-latency buffer set (0 or 1).
  bool use_fp8 = false;         ///< The dispatch moved FP8 data.
};

// ---- op arguments and results ---------------------------------------------------------

/// GetDispatchLayout input: topk_idx [T, K] int64 (-1 = none). An expert that appears
/// more than once in a token's row counts that token once (as Dispatch and
/// LowLatencyDispatch send it once).
struct LayoutResult {
  TensorView num_tokens_per_rank;    ///< [R] int32: tokens with an expert on rank r.
  TensorView num_tokens_per_expert;  ///< [E] int32: tokens routed to expert e.
  /// [T, R] bytes 0 or 1, dtype {kDLUInt, 8, 1} (uint8): DLPack 0.6 has no bool type
  /// (in PyTorch, `.bool()` makes it a mask).
  TensorView is_token_in_rank;
  // Valid until the next GetDispatchLayout on this endpoint.
};

/// Normal (high-throughput) dispatch inputs.
struct DispatchArgs {
  const DLTensor* x = nullptr;         ///< [T, H] bf16, or [T, H] e4m3 (float8_e4m3fn).
  const DLTensor* x_scales = nullptr;  ///< [T, H/128] f32, required with e4m3 x.
  /// [T, K] int64 (-1 = none); not read with `cached`. An expert repeated in a row gets
  /// the token once (one row, counted once in num_recv_tokens_per_expert).
  const DLTensor* topk_idx = nullptr;
  const DLTensor* topk_weights = nullptr;  ///< [T, K] f32, optional; not read with `cached`.
  int32_t expert_alignment = 1;            ///< >= 1; per-expert counts rounded up to it.
  /// Re-dispatch x (and x_scales) with this handle's routing. The result's recv_x,
  /// recv_scales and recv_src_info hold the new rows; its recv_topk_idx,
  /// recv_topk_weights and num_recv_tokens_per_expert are the routing dispatch's views
  /// (the same memory), not rewritten.
  std::optional<Handle> cached;
  int32_t num_sms = 0;     ///< Kernel SM budget (0 = default).
  void* stream = nullptr;  ///< CUDA backend: the op's cudaStream_t.
};
/// Normal dispatch outputs. Valid until the next normal Dispatch on this endpoint.
struct DispatchResult {
  TensorView recv_x;       ///< [N, H] bf16 or e4m3.
  TensorView recv_scales;  ///< [N, H/128] f32 (FP8 only).
  /// [N, K] int64: at each k the local id of the token's expert there, -1 where it is not
  /// on this rank (a repeated expert shows at each of its k's).
  TensorView recv_topk_idx;
  /// [N, K] f32: the token's weight at each k with a local id, 0 where the id is -1; all
  /// zeros for a Dispatch given no topk_weights.
  TensorView recv_topk_weights;
  TensorView num_recv_tokens_per_expert;  ///< [E/R] int32, aligned.
  TensorView recv_src_info;               ///< [N] int32: src_rank * M + src_token.
  /// [1] int32: N, in the endpoint's memory (on the GPU on the CUDA backend), written by
  /// the op itself: the received count is always on the device; num_recv_tokens below
  /// copies it to the host only when asked (Wait, a CPU synchronisation).
  TensorView recv_count;
  Handle handle;
  /// N; -1 in a result from Enqueued() of a Dispatch without a cached handle, whose views
  /// then have the capacity R*M rows (rows [0, recv_count[0]) valid, DeepEP's "worst case
  /// tokens" style): work on the op's stream can consume them with no CPU synchronisation.
  int32_t num_recv_tokens = 0;
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
};

/// Low-latency dispatch inputs.
struct LowLatencyDispatchArgs {
  const DLTensor* x = nullptr;               ///< [T, H] bf16, T <= Mll.
  const DLTensor* topk_idx = nullptr;        ///< [T, K] int64.
  int32_t max_dispatch_tokens_per_rank = 0;  ///< Mll; must equal the spec's (0 = spec's).
  /// e4m3 out with one f32 scale per 128 channels of a token: scale = max(amax, 1e-4) /
  /// 448, amax the block's largest |x|, values e4m3(x / scale). The floor is DeepEP's (the
  /// same bytes as its dispatch): an all-zero block gets a normal scale instead of 0 (no
  /// division by zero, no denormal scale for DeepGEMM to multiply by). So a block whose
  /// amax is under 1e-4 is quantised as if it were 1e-4: its values under about 2.2e-10
  /// in magnitude become 0 (a token with |x| ~ 1e-12 comes out all zeros).
  bool use_fp8 = false;
  /// Power-of-two FP8 scales: 2^ceil(log2(max(amax, 1e-4) / 448)).
  bool round_scale = false;
  void* stream = nullptr;  ///< CUDA backend: the op's cudaStream_t.
  /// Client-launched mode only, optional: [1] int32 on the endpoint's GPU holding T,
  /// read by the kernel at run time (x and topk_idx then give only the capacity, their
  /// first dimension >= T). Lets one captured CUDA graph replay with any T <= Mll.
  /// The handle's num_tokens is then that capacity C: the matching combine takes
  /// topk_idx / topk_weights of [C, K] and its combined_x view has C rows, of which the
  /// first T are written. x and topk_idx are read in place when they are device memory
  /// of the endpoint's GPU with C = Mll; otherwise they are copied into the endpoint's
  /// Mll-row staging regions (so a T above C can never read past the caller's memory).
  /// A T outside [0, Mll] makes the rank send nothing and Wait return INVALID_ARGUMENT.
  const DLTensor* num_tokens = nullptr;
};
/// Low-latency dispatch outputs. Double-buffered: valid until the low-latency dispatch
/// after next on this endpoint.
struct LowLatencyDispatchResult {
  TensorView recv_x;         ///< [E/R, R*Mll, H] bf16 or e4m3.
  TensorView recv_scales;    ///< [E/R, R*Mll, H/128] f32 (FP8 only).
  TensorView recv_count;     ///< [E/R] int32.
  TensorView recv_src_info;  ///< [E/R, R*Mll] int32: src_rank*Mll + token.
  Handle handle;
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
};

// ---- graph mode (DESIGN.md §3.2): daemon-launched ops inside CUDA graphs ----------------

/// One step of a graph-mode program.
struct ProgramStep {
  enum class Op { kLowLatencyDispatch, kLowLatencyCombine };
  Op op = Op::kLowLatencyDispatch;
  bool use_fp8 = false;      ///< Dispatch: e4m3 out with f32 scales per 128 channels.
  bool round_scale = false;  ///< Dispatch: power-of-two FP8 scales (needs use_fp8).
};

/// Inputs of a program's LowLatencyDispatch step. Every tensor is kDLCUDA memory of the
/// endpoint's GPU and is read at run time (so a captured step reads new contents on every
/// replay). C is the capacity: x and topk_idx have C rows, 0 <= C <= Mll; the T tokens
/// actually dispatched are rows [0, T).
struct ProgramDispatchArgs {
  const DLTensor* x = nullptr;           ///< [C, H] bf16.
  const DLTensor* topk_idx = nullptr;    ///< [C, K] int64 (-1 = none).
  const DLTensor* num_tokens = nullptr;  ///< [1] int32: T, 0 <= T <= C (read at run time).
  void* stream = nullptr;                ///< The cudaStream_t the step is ordered on.
};

/// Inputs of a program's LowLatencyCombine step (kDLCUDA memory of the endpoint's GPU,
/// read at run time). topk_idx / topk_weights have the C rows of the matching dispatch's
/// topk_idx; T is that dispatch's.
struct ProgramCombineArgs {
  /// [E/R, R*Mll, H] bf16 expert outputs; copied into the endpoint's combine input unless
  /// it is Endpoint::LowLatencyCombineInput() itself.
  const DLTensor* x = nullptr;
  const DLTensor* topk_idx = nullptr;      ///< [C, K] int64, as dispatched.
  const DLTensor* topk_weights = nullptr;  ///< [C, K] f32.
  void* stream = nullptr;                  ///< The cudaStream_t the step is ordered on.
};

/// A submitted op (defined below Endpoint).
template <typename Result>
class PendingOp;

/// Options of Client::Join.
struct JoinOptions {
  v1::GroupSpec spec;
  int32_t rank = 0;
  std::string gpu_uuid;  ///< GPU UUID or PCI bus id; "" on host backend.
  v1::LaunchMode launch_mode = v1::LAUNCH_MODE_UNSPECIFIED;
  /// The group's join secret: any bytes, at most 256; empty = none. The first rank to join
  /// a group sets it and every other rank must present the same bytes (PERMISSION_DENIED
  /// otherwise); a group created without one admits only processes of its creator's uid.
  /// Distribute it to the ranks as MASTER_ADDR is (e.g. the environment variable
  /// EPD_JOIN_SECRET, as client/examples/moe_layer.cc does). epd never logs or returns it.
  std::string join_secret;
};

/// One rank of a group on this node. Created by Client::Join.
class Endpoint {
 public:
  /// Leaves the group and unmaps the buffers. CUDA backend: Wait for every op of the
  /// endpoint (or synchronise their streams) first: work still queued on a stream may
  /// read the buffers. (A stream still held by a daemon-launched op is released first,
  /// best effort.)
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
  /// Normal combine: combined_x[t] = Σ over ranks that received t of their row (f32 sum
  /// from +0 in ascending rank order, rounded once to bf16; a token sent nowhere is +0,
  /// bits 0x0000); combined_topk_weights likewise.
  absl::StatusOr<PendingOp<CombineResult>> Combine(const CombineArgs& args);
  /// Low-latency dispatch into [E/R, R*Mll, H] (packed by source rank, then token;
  /// Mll = spec.ll_max_tokens_per_rank). An expert repeated in a token's row gets the token
  /// once (one row, counted once in recv_count).
  absl::StatusOr<PendingOp<LowLatencyDispatchResult>> LowLatencyDispatch(
      const LowLatencyDispatchArgs& args);
  /// Low-latency combine: combined_x[t] = Σ_k w[t,k]·y_{e_k}(t) over the k with
  /// topk_idx[t,k] >= 0, each with its own weight (an expert repeated in the row adds its
  /// one row once per k), in f32 from +0 in ascending k, each product rounded to f32 before
  /// the add, rounded once to bf16: a token with no expert is +0 (bits 0x0000).
  absl::StatusOr<PendingOp<LowLatencyCombineResult>> LowLatencyCombine(
      const LowLatencyCombineArgs& args);
  /// The endpoint's low-latency combine input region, [E/R, R*Mll, H] bf16 (kDLCUDA on the
  /// CUDA backend); empty when the group has no low-latency mode. Experts that write their
  /// outputs here and pass this view as LowLatencyCombineArgs::x skip the copy of x
  /// (otherwise x is copied into it). Valid while the endpoint lives; its contents are
  /// read by every rank's LowLatencyCombine (peers keep reading it after this rank's
  /// combine is done), so write it only once this rank's next LowLatencyDispatch is done:
  /// that dispatch cannot finish before every rank has finished the combine before it
  /// (experts that run on the dispatch's stream after it do exactly that).
  TensorView LowLatencyCombineInput() const;
  /// The endpoint's low-latency dispatch input region, [Mll, H] bf16 (kDLCUDA on the CUDA
  /// backend); empty when the group has no low-latency mode. A caller that produces its
  /// tokens here (e.g. the layer before writes its output into it) and passes rows [0, T)
  /// of it as LowLatencyDispatchArgs::x skips the copy of x into the daemon's staging area
  /// (daemon-launched mode copies x otherwise: 1.8 MB per rank at DeepSeek-V3 decode,
  /// ~2 µs of HBM time per rank on an H200, plus the staging kernel's place on the
  /// critical path). Client-launched ops read a caller's x in place anyway. Valid while
  /// the endpoint lives; read by this rank's next LowLatencyDispatch, so write it only
  /// after the previous one's done (stream order on the op's stream does that).
  TensorView LowLatencyDispatchInput() const;

  // ---- graph mode (DESIGN.md §3.2; CUDA backend, daemon-launched endpoints) ----
  //
  // A daemon-launched op needs the CPU (a ring slot with a new seq) on every call, which a
  // replayed CUDA graph cannot do. Instead, every rank registers a fixed program once;
  // the daemon then keeps its next instances enqueued on the rank's daemon stream, each
  // waiting on the GPU for the client's "go". A program step called on a stream (also
  // while it captures a CUDA graph) enqueues only device work on it: one kernel that copies
  // its inputs into the endpoint's staging regions (none for an input already there:
  // LowLatencyDispatchInput / LowLatencyCombineInput) and T into the rank's token-count slot
  // and then writes "go", a wait for the daemon's "done" (cuStreamWaitValue64), and a
  // one-thread kernel acknowledging it. Words and
  // values are constants (layout.h kProgram*Offset), so a captured graph replays any
  // number of times; no CPU takes part per step, on either side.
  // Steps must be run in program order, cyclically (step i of instance n is program step
  // i % S); every rank runs every step. The engine polls without sleeping while a program
  // is armed (one CPU core), and keeps the GPUs of the group claimed: another group's
  // daemon-launched ops on those GPUs wait (and fail with DEADLINE_EXCEEDED after
  // op_timeout) until the program is unregistered.

  /// Registers `steps` (1 to 16 LowLatencyDispatch / LowLatencyCombine steps) and blocks
  /// until every rank of the group has registered the same program and the daemon armed
  /// it, or `timeout`. Fixed buffers per step (so replays see the same views): the i-th
  /// dispatch of the program writes low-latency buffer i % 2, a combine uses the buffer
  /// of the nearest dispatch before it (cyclically) and writes combine output buffer
  /// j % 2 for the j-th combine. Earlier low-latency handles become invalid. While armed,
  /// every other op of the group (every rank) fails with FAILED_PRECONDITION. Call it
  /// with no program step of this endpoint still running on a stream.
  /// Errors: FAILED_PRECONDITION (ranks registered different programs: the message names
  /// the first differing step; a program already armed; a client-launched endpoint; no
  /// low-latency mode); UNIMPLEMENTED (host backend); INVALID_ARGUMENT (bad steps: count,
  /// FP8 without spec.use_fp8 or hidden % 128 != 0, round_scale without FP8, a combine
  /// without a dispatch); DEADLINE_EXCEEDED (a rank did not register within op_timeout,
  /// or `timeout` passed: then the registration is still pending); UNAVAILABLE.
  absl::Status RegisterProgram(const std::vector<ProgramStep>& steps,
                               absl::Duration timeout = absl::InfiniteDuration());
  /// Enqueues the next program step, which must be a LowLatencyDispatch, on args.stream.
  /// Returns at once the views of its outputs (low-latency dispatch outputs, fixed buffer
  /// of the step: recv_x [E/R, R*Mll, H] bf16 or e4m3, recv_scales (FP8), recv_count
  /// [E/R] int32, recv_src_info), valid for work enqueued after it on the stream until the
  /// program's next dispatch into the same buffer. handle.num_tokens is C. Errors found on
  /// the GPU (bad expert ids, T outside [0, Mll], a peer that never arrived) are reported
  /// by ProgramStatus. Errors here: FAILED_PRECONDITION (no program registered, or the
  /// next step is a combine), INVALID_ARGUMENT (a tensor: dtype, shape, not kDLCUDA, C >
  /// Mll), INTERNAL (CUDA).
  absl::StatusOr<LowLatencyDispatchResult> RunProgramDispatch(const ProgramDispatchArgs& args);
  /// Enqueues the next program step, which must be a LowLatencyCombine, on args.stream.
  /// Returns the view of combined_x [C, H] bf16 (rows [0, T) written; fixed buffer of the
  /// step, valid until the program's next combine into it). Errors as RunProgramDispatch.
  absl::StatusOr<LowLatencyCombineResult> RunProgramCombine(const ProgramCombineArgs& args);
  /// Device-side errors of the program's instances that the daemon has checked, e.g.
  /// after a replay was synchronised: waits (bounded by op_timeout + 5 s) until the daemon
  /// has checked every instance whose results this endpoint's streams have seen, then
  /// returns the latest error not yet returned (INVALID_ARGUMENT for bad expert ids or T,
  /// DEADLINE_EXCEEDED for a peer that never arrived — the program is then disarmed — with
  /// the instance, step and rank in the message, and how many errors were not returned),
  /// or OK. An error makes that instance's outputs undefined for every rank; later
  /// instances are correct. FAILED_PRECONDITION when the daemon disarmed the program (a
  /// rank left) after that was reported; UNAVAILABLE when the daemon is gone. Blocks the
  /// CPU; not for the hot path.
  absl::Status ProgramStatus();
  /// Disarms the program and blocks until every rank of the group has unregistered it (or
  /// `timeout`). Every instance still waiting on the daemon's streams is released, and any
  /// later program step run on a stream returns at once without running (its outputs are
  /// then stale), so no stream waits forever. OK when no program is armed. Leave, a rank
  /// leaving, and the daemon's shutdown disarm the program as well.
  absl::Status UnregisterProgram(absl::Duration timeout = absl::InfiniteDuration());

  /// Leaves the group explicitly (the daemon frees the rank). Later ops return
  /// FAILED_PRECONDITION. Idempotent.
  absl::Status Leave();

  /// Internal: used by Client::Join and PendingOp.
  struct Impl;
  explicit Endpoint(std::unique_ptr<Impl> impl);
  Impl& impl() { return *impl_; }

 private:
  /// Shared only with weak_ptrs (PendingOp): destroyed with the Endpoint.
  std::shared_ptr<Impl> impl_;
};

/// A submitted op. Wait() returns its result once every rank's part is done.
/// A PendingOp may outlive its Endpoint: Wait and Enqueued then return FAILED_PRECONDITION
/// ("endpoint destroyed"), whether or not the op had completed, since its outputs were
/// views of the endpoint's buffers, which are gone. (Wait for an op before destroying its
/// Endpoint.)
template <typename Result>
class [[nodiscard]] PendingOp {
 public:
  /// Blocks until the op completes or `timeout` passes (DEADLINE_EXCEEDED, the op stays
  /// pending and Wait may be called again). Returns the op's own error otherwise. Only the
  /// latest 64 ops of an endpoint can be waited for (FAILED_PRECONDITION at once for older
  /// ones: their completion records were reused).
  /// Client-launched: waits (polling, bounded by `timeout` and by op_timeout + 5 s) for an
  /// event recorded on the op's stream after the op, then returns the status its kernels
  /// left. An op enqueued while its stream was capturing a CUDA graph is not
  /// waited for: call Wait once a replay of the graph has completed (e.g. after
  /// cudaStreamSynchronize); it then reads and clears the rank's device status, so it
  /// reports the errors of every replay since the last Wait, and for a Dispatch the N of
  /// the latest replay.
  /// Client-launched low-latency ops enqueue no status read-back of their own (it would
  /// add two stream operations to every decode op, which is rarely waited for): their Wait
  /// reads and clears the rank's device status on the op's stream, after everything
  /// enqueued there so far, and synchronises that stream. So a device-side error (a bad
  /// expert id, a peer that never arrived) is reported by the first Wait at or after the
  /// op that hit it, never lost; a later op whose error an earlier Wait reported then
  /// returns OK.
  absl::StatusOr<Result> Wait(absl::Duration timeout = absl::InfiniteDuration());
  /// The result without waiting on the CPU, for stream-ordered use (CUDA backend): work
  /// enqueued on the op's stream after the op reads the views correctly; errors still
  /// come from Wait. FAILED_PRECONDITION on the host backend and for an op given no
  /// stream. A Dispatch without a cached handle gives views of the capacity R*M rows, N in
  /// its device `recv_count` and num_recv_tokens = -1; Combine and cached re-dispatch need
  /// the handle that Wait returns (FAILED_PRECONDITION for this one).
  /// Daemon-launched: the low-latency buffer of the views is the daemon's: both count the
  /// group's low-latency ops, failed ones included (epd/kernels/op_rules.h
  /// LowLatencyParity).
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
  /// The daemon's unix socket (or "unix:///..."). Control is served on the unix socket
  /// only; a TCP listener (--listen) answers grpc.health.v1 probes and nothing else.
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

  /// Joins `options.spec` as `options.rank` and maps the endpoint. Every spec Join accepts
  /// runs on the daemon's backend: the CUDA backend refuses one past its kernels' limits
  /// (num_ranks <= 64; num_experts within the sync region: with 8 ranks at most 6048, or
  /// 528 with low-latency mode on; DESIGN.md §3.3) with INVALID_ARGUMENT naming the field,
  /// the value and the largest value that works there. Low-latency capacity, top-k and
  /// hidden size have no limit beyond the spec's own. Errors are the daemon's:
  /// INVALID_ARGUMENT (a spec field, the rank, a join secret over 256 bytes),
  /// PERMISSION_DENIED (the group exists and this join's secret is not the group's, or the
  /// group has none and belongs to another uid), FAILED_PRECONDITION (spec differs from the
  /// live group's), ALREADY_EXISTS (rank taken), NOT_FOUND (GPU), RESOURCE_EXHAUSTED
  /// (memory, max_groups, or a per-uid quota of the daemon's config), UNAVAILABLE (daemon
  /// draining or gone).
  absl::StatusOr<std::unique_ptr<Endpoint>> Join(const JoinOptions& options);

  absl::StatusOr<v1::GetStatsResponse> GetStats();
  /// The groups this process's uid owns or holds a rank of (every group for root and
  /// epd's own uid).
  absl::StatusOr<v1::ListGroupsResponse> ListGroups();
  /// The Session id the daemon assigned.
  const std::string& session_id() const;

  struct Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epd
