// The reference semantics of every epd op (DESIGN.md §3.3) on CPU threads: each function
// runs one op for a whole group, given every rank's input and output views. It is the
// oracle of the CUDA kernels and what the host backend's engine runs. Conventions: bf16 /
// e4m3 are raw bits (bf16_bits, e4m3_bits); tensors dense row-major; topk_idx -1 = no
// expert; a repeated expert in a row gets the token once, combines sum every k; f32 sums
// from +0.0f in the order each function states, rounded once to bf16; weights are "given"
// when any rank with rows passes them (then every such rank must); outputs to be written
// must be non-null; rows past the counts are not written; use_fp8 is the daemon's check.
// Errors: INVALID_ARGUMENT (an expert id outside [-1, E), naming rank, token, k and value;
// or a shape past the capacities), with outputs untouched.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/row_gather.h"
#include "epd/kernels/row_reduce.h"
#include "epd/kernels/types.h"

namespace epd::kernels::host {

namespace internal {
class WorkerPoolState;
struct ScratchState;
}  // namespace internal

/// Persistent worker threads for the host ops. Without one (HostExecution::pool null) an
/// op starts the threads it needs and joins them before it returns (a few heap allocations
/// and thread starts per op). With one, the threads are started once, when an op first
/// needs them (or by Start), and each op hands them its work through a mutex and condition
/// variable: no allocation per op once they run. Threads that cannot be started are left
/// out (the ops then run on fewer threads, at least the caller's).
/// Thread-safety: one op at a time per pool (the ops' calling thread takes part in the
/// work; a second concurrent op on the same pool is a bug). Not copyable or movable; the
/// destructor stops and joins the threads (no op may be running).
class HostWorkerPool {
 public:
  /// `on_thread_start`, when set, runs first on every worker thread the pool starts (a test
  /// seam: tests/unit/hot_path_alloc_test.cc marks the threads whose allocations it counts).
  explicit HostWorkerPool(std::function<void()> on_thread_start = {});
  ~HostWorkerPool();
  HostWorkerPool(const HostWorkerPool&) = delete;
  HostWorkerPool& operator=(const HostWorkerPool&) = delete;

  /// Starts worker threads until the pool has `num_threads - 1` (the caller is the last
  /// one; 0 = std::thread::hardware_concurrency()). Allocates; call it outside the hot path.
  /// Safe to call from any thread, also while an op runs on the pool.
  void Start(int num_threads);
  /// Worker threads running now (not counting callers). Safe from any thread.
  int num_workers() const;

  /// For kernels/host only (internal.h).
  internal::WorkerPoolState& state() { return *state_; }

 private:
  std::unique_ptr<internal::WorkerPoolState> state_;
};

/// Scratch buffers of the host ops (routing temporaries, per-thread accumulators, token
/// chunk tables). Without one (HostExecution::scratch null) an op allocates its own
/// scratch and frees it before it returns. With one, the buffers keep their capacity from
/// op to op and are only resized within it, so an op allocates nothing once the scratch
/// has grown to its shape: at once after Reserve(shape, num_threads), or after the first
/// op of each kind at the largest token counts otherwise.
/// Thread-safety: one op at a time per scratch (results never depend on what a scratch held
/// before). Not copyable or movable.
class HostScratch {
 public:
  HostScratch();
  ~HostScratch();
  HostScratch(const HostScratch&) = delete;
  HostScratch& operator=(const HostScratch&) = delete;

  /// Grows every buffer to what any op on a group of `shape` (T <= max_tokens_per_rank,
  /// T <= ll_max_tokens_per_rank) run on up to `num_threads` threads (0 =
  /// hardware_concurrency()) needs: R*M*R + R*(R + 2E) int32 of routing, R*M bytes of
  /// cached-row marks, per thread H f32 accumulators, H e4m3 bytes and H/128 f32 scales of
  /// an FP8 row, and small per-rank tables. Allocates (std::bad_alloc when memory is out); call it
  /// at group creation. `shape` must pass the ops' shape checks (else it reserves nothing).
  void Reserve(const GroupShape& shape, int num_threads);

  /// Bytes Reserve(shape, num_threads) allocates (0 when `shape` fails the shape checks),
  /// for a caller to check against free memory before it reserves.
  static uint64_t ReservedBytes(const GroupShape& shape, int num_threads);

  /// For kernels/host only (internal.h).
  internal::ScratchState& state() { return *state_; }

 private:
  std::unique_ptr<internal::ScratchState> state_;
};

/// How the host ops run: threads, and the optional persistent pool and scratch (see
/// HostWorkerPool, HostScratch; null = the op starts its own threads and allocates its own
/// scratch, as a one-off caller wants). A `{n}` initializer keeps both null.
struct HostExecution {
  int num_threads = 0;             ///< Threads per op (0 = hardware_concurrency()).
  HostWorkerPool* pool = nullptr;  ///< Persistent workers, or null.
  HostScratch* scratch = nullptr;  ///< Persistent scratch, or null.
  /// Test seam (null in the daemon): called by NodeDispatch and NodeLowLatencyDispatch on
  /// the caller's thread once every input is checked, before the outputs are written (a
  /// test rewrites a peer's inputs there to show that nothing is read twice). Not owned.
  const std::function<void()>* on_inputs_checked = nullptr;
};

// ---- GetDispatchLayout -----------------------------------------------------------------

/// Inputs of GetDispatchLayout for one rank.
struct LayoutRankArgs {
  int32_t num_tokens = 0;                    ///< T.
  const int64_t* topk_idx = nullptr;         ///< [T, K] int64, -1 = none.
  int32_t* num_tokens_per_rank = nullptr;    ///< out [R] int32: tokens with >= 1 expert on r.
  int32_t* num_tokens_per_expert = nullptr;  ///< out [E] int32: tokens routed to e.
  uint8_t* is_token_in_rank = nullptr;       ///< out [T, R] bool (0/1 bytes).
};

/// GetDispatchLayout for one rank (it needs no other rank's data). Expert e lives on
/// rank e / (E / R) (DeepEP's contiguous expert placement). Its errors name the token, k
/// and value but not the rank (the args carry none): callers that need the rank in the
/// message run CheckTopkIdx first, as the daemon's engine does. Runs on up to
/// exec.num_threads threads (one per 1024 tokens).
absl::Status GetDispatchLayout(const GroupShape& shape, const LayoutRankArgs& args,
                               const HostExecution& exec = {});

// ---- normal (high-throughput) dispatch ------------------------------------------------

/// One rank's view of a normal dispatch.
struct DispatchRankArgs {
  int32_t num_tokens = 0;               ///< T <= M.
  const void* x = nullptr;              ///< [T, H] bf16, or e4m3 when fp8.
  const float* x_scales = nullptr;      ///< [T, S] f32 when fp8.
  const int64_t* topk_idx = nullptr;    ///< [T, K]; unused with a cached handle.
  const float* topk_weights = nullptr;  ///< [T, K] f32, or null (then no weights out).
  /// Cached-handle re-dispatch: this rank's `send_pos` [T, R] from the earlier dispatch
  /// (same T). When set, routing is taken from it; topk_idx/weights are not read and
  /// recv_topk_* are not written.
  const int32_t* cached_send_pos = nullptr;
  /// Cached re-dispatch: each receiving rank's row count from the earlier dispatch.
  int32_t cached_num_recv_tokens = 0;

  // Outputs (capacity rows = recv_capacity).
  int64_t recv_capacity = 0;         ///< Rows available in recv_* (R * M).
  void* recv_x = nullptr;            ///< out [N, H] bf16 / e4m3.
  float* recv_scales = nullptr;      ///< out [N, S] f32 when fp8.
  int64_t* recv_topk_idx = nullptr;  ///< out [N, K]: local expert id or -1.
  /// out [N, K]: weight, 0 where id is -1; all 0 without topk_weights (null: not written;
  /// needed with topk_weights).
  float* recv_topk_weights = nullptr;
  int32_t* recv_tokens_per_expert = nullptr;  ///< out [El]: count rounded up to alignment.
  int32_t* recv_src_info = nullptr;           ///< out [N]: src_rank * M + src_token.
  int32_t* send_pos = nullptr;                ///< out [T, R]: handle (source side).
  int32_t* rank_prefix = nullptr;             ///< out [R]: first row of each source rank.
  int32_t num_recv_tokens = 0;                ///< out: N, rows received by this rank.
  /// NodeDispatch only (host_node_ops.h): when set ([recv_capacity]), the rows' x bytes and
  /// FP8 scales are not copied into recv_x / recv_scales; row n's RowSource is written here
  /// instead (the caller gathers them: row_gather.h). Every other output is written.
  RowSource* recv_row_src = nullptr;
};

/// Options of a normal dispatch shared by every rank.
struct DispatchOptions {
  bool fp8 = false;              ///< x is e4m3 + scales (moved as is, not requantized).
  int32_t expert_alignment = 1;  ///< >= 1; recv_tokens_per_expert rounded up to it.
};

/// Normal dispatch over all ranks (args.size() == R).
/// Rank r receives every token t of every source rank s that has at least one top-k
/// expert on r, exactly once, at row `rank_prefix_r[s] + (number of earlier tokens of s
/// sent to r)`: rows ordered by source rank, then by source token index.
/// recv_topk_idx holds `e - r * El` for experts on r, -1 elsewhere; recv_topk_weights
/// the weight where the id is local, 0 elsewhere (DeepEP's convention), all 0 without
/// topk_weights.
/// send_pos[t, r] records that row (or -1), and is the handle for combine and for
/// cached re-dispatch. recv_src_info uses M = shape.max_tokens_per_rank.
/// Cached re-dispatch (any rank passes cached_send_pos; then every rank with T > 0 must):
/// the cached rows must fill [0, cached_num_recv_tokens) of each receiver exactly once;
/// recv_x (+ scales), recv_src_info, rank_prefix, num_recv_tokens and send_pos are
/// written; recv_tokens_per_expert and recv_topk_* are not (no topk_idx, as in DeepEP).
absl::Status Dispatch(const GroupShape& shape, const DispatchOptions& options,
                      std::span<DispatchRankArgs> args, const HostExecution& exec = {});

// ---- normal combine -------------------------------------------------------------------

/// One rank's view of a normal combine.
struct CombineRankArgs {
  int32_t num_tokens = 0;                  ///< T of the dispatch whose handle this is.
  const int32_t* send_pos = nullptr;       ///< [T, R] handle from that dispatch.
  int32_t num_recv_tokens = 0;             ///< N of that dispatch at this rank.
  const bf16_bits* x = nullptr;            ///< [N, H] bf16: this rank's expert outputs.
  const float* topk_weights = nullptr;     ///< [N, K] f32 or null.
  bf16_bits* combined_x = nullptr;         ///< out [T, H] bf16.
  float* combined_topk_weights = nullptr;  ///< out [T, K] f32 (when topk_weights given).
  /// x and topk_weights start at this row: they hold rows [x_first_row, N) only (a node
  /// of a group that spans nodes holds the rows of another node's rank that belong to its
  /// own tokens; host_node_ops.h). Every send_pos entry naming this rank must be in that
  /// range. 0 for a rank whose every row is present.
  int32_t x_first_row = 0;
  /// When set (a node of a group that spans nodes, its reduce left to the backend:
  /// row_reduce.h), combined_x and combined_topk_weights are not written: after every check,
  /// each of the T tokens' rows is recorded here instead (one term per rank it sums, in
  /// rank order, with its topk_weights row when weights are given), and `rows` set to T.
  /// INVALID_ARGUMENT when a token's send_pos names more than ReduceTermsPerRow ranks.
  ReduceTable* reduce = nullptr;
};

/// Normal combine over all ranks. combined_x[t] of source rank s =
/// bf16(Σ_{r ascending, send_pos_s[t,r] >= 0} f32(x_r[send_pos_s[t,r]])), the sum taken
/// in f32 in ascending rank order; a token sent nowhere gets zeros.
/// combined_topk_weights[t,k] = Σ_r topk_weights_r[row, k] in the same order.
absl::Status Combine(const GroupShape& shape, std::span<CombineRankArgs> args,
                     const HostExecution& exec = {});

// ---- low-latency dispatch -------------------------------------------------------------

/// One rank's view of a low-latency dispatch. Mll = shape.ll_max_tokens_per_rank.
struct LowLatencyDispatchRankArgs {
  int32_t num_tokens = 0;             ///< T <= Mll.
  const bf16_bits* x = nullptr;       ///< [T, H] bf16.
  const int64_t* topk_idx = nullptr;  ///< [T, K].
  void* recv_x = nullptr;             ///< out [El, R*Mll, H] bf16 or e4m3.
  /// out when fp8: the ll_recv_scales layout (layout.h LowLatencyScaleOffset, token index
  /// fastest): [El, S, R*Mll] f32, or [El, S/4, R*Mll] int32 with use_ue8m0.
  void* recv_scales = nullptr;
  int32_t* recv_count = nullptr;     ///< out [El] int32.
  int32_t* recv_src_info = nullptr;  ///< out [El, R*Mll] int32: src_rank*Mll + t.
  int32_t* handle_pos = nullptr;     ///< out [Mll, K] int32: handle (source side).
  /// NodeLowLatencyDispatch only (host_node_ops.h): when set ([El, R*Mll], as recv_x), the
  /// rows' x bytes and FP8 scales are not written into recv_x / recv_scales; each row's
  /// RowSource is written here instead (row_gather.h). Needs every FP8 source quantized.
  RowSource* recv_row_src = nullptr;
};

struct LowLatencyDispatchOptions {
  bool use_fp8 = false;      ///< Quantize to e4m3 with one scale per 128 channels.
  bool round_scale = false;  ///< Scales rounded up to powers of two (see Fp8Scale).
  /// Scales stored as UE8M0 bytes (Ue8m0Code), four blocks per int32; needs use_fp8,
  /// round_scale and H % 512 == 0 (rules::CheckScaleFormat).
  bool use_ue8m0 = false;
};

/// Low-latency dispatch over all ranks. For local expert j of rank r (global expert
/// e = r*El + j), rows [0, recv_count[j]) of recv_x[j] are packed: grouped by source rank
/// ascending, token index ascending within a source. Rows past recv_count are not
/// written. handle_pos_s[t,k] = the row of token t in expert topk_idx[t,k]'s block at its
/// rank, or -1 for a masked k (a duplicate expert in a row gets the same row).
/// FP8: scale per 128 channels = Fp8Scale(amax of the bf16 values, round_scale), value =
/// QuantizeE4m3(x, scale); the scale of block g of row i of expert j goes to byte
/// LowLatencyScaleOffset(shape, use_ue8m0, j, i, g) of recv_scales: the f32, or with
/// use_ue8m0 its Ue8m0Code byte. INVALID_ARGUMENT for a scale format CheckScaleFormat
/// refuses.
absl::Status LowLatencyDispatch(const GroupShape& shape, const LowLatencyDispatchOptions& options,
                                std::span<LowLatencyDispatchRankArgs> args,
                                const HostExecution& exec = {});

// ---- low-latency combine --------------------------------------------------------------

/// One rank's view of a low-latency combine.
struct LowLatencyCombineRankArgs {
  int32_t num_tokens = 0;               ///< T of the matching dispatch.
  const int64_t* topk_idx = nullptr;    ///< [T, K] (as given to that dispatch).
  const float* topk_weights = nullptr;  ///< [T, K] f32.
  const int32_t* handle_pos = nullptr;  ///< [Mll, K] handle of that dispatch.
  const bf16_bits* x = nullptr;         ///< [El, R*Mll, H] bf16 expert outputs.
  bf16_bits* combined_x = nullptr;      ///< out [T, H] bf16.
  /// When set, x holds part of each expert's rows (a node of a group that spans nodes
  /// holds, of another node's rank, the rows of its own tokens; host_node_ops.h): expert
  /// j's rows [x_first_row[j], x_first_row[j] + x_num_rows[j]) start at row
  /// x_block_start[j] of x, and every handle_pos naming the expert must be in that range.
  const int32_t* x_first_row = nullptr;    ///< [El] or null (every row present).
  const int32_t* x_num_rows = nullptr;     ///< [El] with x_first_row.
  const int64_t* x_block_start = nullptr;  ///< [El] with x_first_row.
  /// As CombineRankArgs::reduce: combined_x is not written; each token's rows are recorded
  /// here instead (one weighted term per k with an expert, in k order).
  ReduceTable* reduce = nullptr;
};

/// Low-latency combine over all ranks: combined_x[t] = bf16(Σ_{k ascending, idx >= 0}
/// w[t,k] * f32(x_{owner(e)}[e % El][handle_pos[t,k]])), each product computed in f32
/// and added in ascending k order (fmaf is not used: product rounded, then added).
absl::Status LowLatencyCombine(const GroupShape& shape, std::span<LowLatencyCombineRankArgs> args,
                               const HostExecution& exec = {});

// ---- helpers --------------------------------------------------------------------------

/// Quantizes one token row [H] bf16 to e4m3 [H] with scales [S] (same rule as
/// LowLatencyDispatch). Exposed for tests and for the example's FP8 inputs.
void QuantizeRowFp8(const bf16_bits* x, int32_t hidden, bool round_scale, e4m3_bits* out,
                    float* scales);

// ---- rank masking ----------------------------------------------------------------------

/// Drops the token-expert pairs of topk_idx [T, K] whose expert lives on a masked rank
/// (expert e on rank e / (E / R)): sets each such id to -1, so that every op then treats it
/// as no expert (nothing sent, zeros in combine). `rank_masked` [R]: nonzero = masked. Ids
/// outside [0, E) are left as they are (CheckTopkIdx reports them). Returns how many ids it
/// set to -1. Allocates nothing.
int32_t DropMaskedExperts(const GroupShape& shape, std::span<const uint8_t> rank_masked,
                          int32_t num_tokens, int64_t* topk_idx);

/// The same for a normal dispatch's handle send_pos [T, R]: the row sent to each masked
/// rank becomes -1 (combine then takes nothing from it). Returns how many it set to -1.
int32_t DropMaskedRoutes(const GroupShape& shape, std::span<const uint8_t> rank_masked,
                         int32_t num_tokens, int32_t* send_pos);

/// Checks every id of topk_idx [T, K] is in [-1, E); else INVALID_ARGUMENT naming the
/// rank, token, k and value.
absl::Status CheckTopkIdx(const GroupShape& shape, int32_t rank, int32_t num_tokens,
                          const int64_t* topk_idx);

}  // namespace epd::kernels::host
