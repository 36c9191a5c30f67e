// NodeExchange: runs a group's ops across nodes (DESIGN.md §5.1), backend-neutral. A
// spanning group at a daemon is one node of it; once every local rank's request is in, the
// exchange sends this node's part of the op to every other node over the group's transport
// link, waits for theirs, and computes the local ranks' outputs with kernels/host. It reads
// and writes each local rank's data area through a HOST pointer laid out by the group's
// kernels::EndpointLayout: the host backend hands it the endpoints' shm data areas, the CUDA
// backend each rank's pinned host mirror (DESIGN.md §5.5).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/dataplane/exchange/rank_routing.h"
#include "daemon/dataplane/lockstep_group.h"
#include "daemon/peer/peer_mesh.h"
#include "daemon/transport/transport.h"
#include "daemon/transport/transport_set.h"
#include "epd/kernels/host_node_ops.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/row_gather.h"
#include "epd/kernels/row_reduce.h"
#include "epd/v1/control.pb.h"
#include "proto/abi/exchange_abi.h"
#include "proto/abi/shm_abi.h"

namespace epd {

/// The exchange's receive region, send staging, private copies of the peers' indices and
/// pack table of a group that spans nodes, at its largest node (DESIGN.md §5.1); 0 for a
/// one-node group. Counted in the backends' GroupPrivateBytes.
uint64_t NodeExchangeBytes(const v1::GroupSpec& spec, const kernels::GroupShape& shape);

/// The transport of a group that spans nodes: `transport` null for a one-node spec; for a
/// spanning one the set's transport named by spec.transport ("" = the set's default) and
/// its resolved name (which the Peer mesh registration carries, so that the rendezvous
/// compares it across nodes).
struct SpanTransport {
  transport::Transport* transport = nullptr;
  std::string name;
};

/// SpanTransport of `spec`. Errors: FAILED_PRECONDITION when the spec spans nodes and this
/// daemon has no Peer mesh or transports (its Peer listener is off), or cannot run the
/// transport the spec asks for (naming spec.transport and why).
absl::StatusOr<SpanTransport> TransportForSpan(const v1::GroupSpec& spec,
                                               const peer::PeerMesh* peer_mesh,
                                               const transport::TransportSet* transports);

/// Undoes NodeExchangeHost::ExchangeMapHostMemory when destroyed.
class ExchangeHostMapping {
 public:
  virtual ~ExchangeHostMapping() = default;
};

/// What the exchange needs of its group. Called on the engine thread with the group's mu_
/// held; only for this node's ranks. A rank may detach while an op runs on (it stays part
/// of the op): the data and routing of every rank that started the op must stay valid
/// until Poll returned true; the handles are read at Start only.
class NodeExchangeHost {
 public:
  virtual ~NodeExchangeHost() = default;
  /// Host pointer to rank `rank`'s data area (EndpointLayout regions), valid for the op.
  virtual uint8_t* ExchangeRankData(int32_t rank) const = 0;
  /// Rank `rank`'s data area as one region of host memory (ExchangeRankData and its size;
  /// pinned or not), with in `*memory_id` what tells this memory apart: it differs whenever
  /// the area is new memory (the rank attached anew), even at the same address. A combine
  /// writes its rows to the peers straight from it, so the exchange declares it to the
  /// transport link (GroupLink::AddSendRegion) at the first op that needs it after it changed.
  virtual transport::MemoryRegion ExchangeRankRegion(int32_t rank, uint64_t* memory_id) const = 0;
  /// Rank `rank`'s private routing state.
  virtual RankRouting& ExchangeRankRouting(int32_t rank) const = 0;
  /// Rank `rank`'s handle table (which dispatch's routing is current); read by Start only.
  virtual const rules::HandleTable& ExchangeRankHandles(int32_t rank) const = 0;
  /// The op being collected or running, in this node's numbering (LockstepGroup).
  virtual uint64_t ExchangeCurrentSeq() const = 0;
  /// Logs a warning the group's clients can cause (rate-limited by the group).
  virtual void ExchangeWarning(const std::string& message) const = 0;
  /// [R] the group's mask as LockstepGroup keeps it (rank_masked()): only this node's ranks'
  /// entries are read (a masked local rank takes part with no tokens, and ExchangeRankData
  /// and ExchangeRankRouting give its stand-in; its handles are not read).
  virtual const std::vector<uint8_t>& ExchangeRankMasked() const = 0;

  /// Rows on the backend (DESIGN.md §5.5 "Rows on the GPU"): makes [p, p + bytes) of the
  /// exchange's own host memory (its receive region and quantized rows) readable by the
  /// backend's gather of a dispatch's received rows (kernels::RowGather) at the same
  /// addresses; the returned object undoes it when destroyed (before the memory is freed).
  /// Null (the default) when the backend does not gather rows or cannot map them: then the
  /// exchange copies every row into ExchangeRankData itself.
  virtual std::unique_ptr<ExchangeHostMapping> ExchangeMapHostMemory(void* /*p*/,
                                                                     uint64_t /*bytes*/) const {
    return nullptr;
  }
  /// Where a dispatch records rank `rank`'s received rows for the backend to gather:
  /// [kernels::RowSourceRows(shape)] RowSources, or null to have them copied. Asked once per
  /// dispatch per local rank by the exchange as it computes the outputs; the table must
  /// stay valid and unread by anyone else until the backend gathered the op's rows.
  virtual kernels::RowSource* ExchangeRowSources(int32_t /*rank*/) const { return nullptr; }
  /// Whether the backend has already quantized local rank `rank`'s tokens of low-latency
  /// FP8 dispatch `seq` into NodeExchange::QuantizedRowsOf(rank) (then the exchange does
  /// not quantize them again). False (the default): the exchange quantizes.
  virtual bool ExchangeRowsQuantized(int32_t /*rank*/, uint64_t /*seq*/) const { return false; }
  /// Rows on the backend, the send side: whether the backend packs local rank `rank`'s rows
  /// of the running dispatch into the send staging (ExchangePackRows) instead of the
  /// exchange copying them. Asked once per dispatch per local rank, only when every
  /// ExchangeMapHostMemory succeeded. False (the default): the exchange copies.
  virtual bool ExchangePacksRows(int32_t /*rank*/) const { return false; }
  /// Enqueues the copy of one block of local rank `rank`'s rows into the send staging for
  /// one node: `g` has one block (counts: the rows the exchange packed), x and scales in the
  /// staging and sources in the exchange's table (both mapped by ExchangeMapHostMemory);
  /// every source is a row of the rank's data area (ExchangeRankData) or of its
  /// QuantizedRows. Both stay valid and unchanged until ExchangeRowsPacked(rank) is true.
  /// An error fails the op at this node. Called only when ExchangePacksRows(rank).
  virtual absl::Status ExchangePackRows(int32_t /*rank*/, const kernels::RowGather& /*g*/) const {
    return absl::UnimplementedError("this backend does not pack rows");
  }
  /// Whether every ExchangePackRows of `rank` in the running op has written its rows (the
  /// exchange posts the staging only then). An error fails the op at this node.
  virtual absl::StatusOr<bool> ExchangeRowsPacked(int32_t /*rank*/) const { return true; }

  /// The combines' reduce on the backend (DESIGN.md §5.5 "Rows on the GPU"): where a
  /// combine (normal or low-latency) records local rank `rank`'s combined rows as terms
  /// (kernels::ReduceTable, its terms [ReduceTableRows * ReduceTermsPerRow] in memory no
  /// client maps) instead of summing them into ExchangeRankData; the backend then reduces
  /// them into the rank's outputs (kernels::RowReduce). Null (the default): the exchange
  /// reduces. Asked once per combine per local rank, only while the exchange's memory is
  /// mapped (ExchangeMapHostMemory: the peers' rows are read where they landed), after the
  /// op's checks of the peers' messages; the table must stay valid and unread by anyone
  /// else until the backend reduced the op's rows.
  virtual kernels::ReduceTable* ExchangeReduceTable(int32_t /*rank*/) const { return nullptr; }
};

/// Options of one group's exchange.
struct NodeExchangeOptions {
  uint32_t op_timeout_ms = 10000;  ///< Bound on waiting for the peers' messages.
  /// kernels/host's execution: threads per op, and the persistent pool and scratch (not
  /// owned; outlive the exchange).
  kernels::host::HostExecution exec;
  /// Test hook around calls into kernels/host (KernelScope); may be null. Not owned.
  const std::function<void(bool)>* on_kernels = nullptr;
  peer::PeerMesh* peer_mesh = nullptr;        ///< Not owned; must outlive the exchange.
  transport::Transport* transport = nullptr;  ///< Not owned; must outlive the exchange.
  std::string transport_name;                 ///< Its resolved name (SpanTransport).
  std::function<void()> wake;                 ///< Wakes the group's engine.
  std::string join_secret_digest;             ///< Carried by the Peer mesh registration.
};

/// One spanning group's exchange at this node. Not thread-safe: every call comes from the
/// group with its mu_ held. Allocates at Init only (README "Hot path").
class NodeExchange {
 public:
  /// `host` must outlive the exchange.
  NodeExchange(const v1::GroupSpec& spec, const kernels::GroupShape& shape,
               const kernels::EndpointLayout& layout, NodeExchangeHost* host,
               NodeExchangeOptions options);
  ~NodeExchange();
  NodeExchange(const NodeExchange&) = delete;
  NodeExchange& operator=(const NodeExchange&) = delete;

  /// This daemon is node `node` of the group (ranks [local_first, local_first +
  /// local_count)): sizes the receive region and staging, creates the transport link and
  /// registers with the Peer mesh. Errors: RESOURCE_EXHAUSTED, those of the transport and
  /// the mesh.
  absl::Status Init(int32_t node, int32_t local_first, int32_t local_count);
  /// Whether Init succeeded.
  bool ready() const { return span_.peers != nullptr; }

  /// Starts op `plan` with the local ranks' validated `slots` ([R]; both must live until
  /// Poll returned true): packs and posts this node's part to every peer.
  void Start(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots);
  /// True once the running op finished, with every local rank's outcome written into
  /// `outcomes` ([R]); false while peers' messages or this node's writes are outstanding.
  bool Poll(std::span<RankOutcome> outcomes);
  /// LockstepGroup hooks (see there).
  void OpFailedHere(uint64_t seq, uint32_t op, const absl::Status& status);
  absl::Status PeerFailure(uint64_t seq, int64_t local_op);
  bool ReadyToStart();
  std::string NotReadyReason() const;
  bool PollBackground();
  /// Publishes which of this node's ranks are joined (bits[i]: rank local_first + i).
  void SetLocalRanksJoined(const std::vector<bool>& bits);
  /// The largest rank mask epoch a group reaches (an op that would pass it fails with
  /// OUT_OF_RANGE; a peer's epoch past it is DATA_LOSS): epochs never wrap.
  static constexpr uint32_t kMaxMaskEpoch = 0x7fffffff;
  /// How far a peer's epoch may lead this node's (DATA_LOSS beyond): an epoch steps by at
  /// most one per op, and a node behind by this many mask changes is not a real peer.
  static constexpr uint32_t kMaxMaskEpochAhead = uint32_t{1} << 20;
  /// Rank masking across nodes (GroupSpec.on_rank_failure = MASK): the mask [R] and epoch
  /// the last op that finished OK ran with, the same at every node that ran it (DESIGN.md
  /// §5.1 "Rank masking").
  const std::vector<uint8_t>& OpMask() const { return view_mask_; }
  uint32_t OpMaskEpoch() const { return view_epoch_; }
  /// The mask ([R], into `*mask`, sized R) and epoch (returned) this node's next op puts in
  /// its header: OpMask() with this node's ranks as ExchangeRankMasked() has them now, the
  /// epoch + 1 when they differ. What QueryRankMask answers across nodes.
  uint32_t NextMask(std::vector<uint8_t>* mask) const;
  /// A low-latency FP8 dispatch's quantized tokens of a local rank: [Mll, H] e4m3 and
  /// [Mll, S] f32, which the exchange sends and fans out from.
  struct QuantizedRows {
    kernels::e4m3_bits* x = nullptr;
    float* scales = nullptr;
  };
  /// Whether the backend's gather and pack memory is mapped (ExchangeMapHostMemory
  /// succeeded for all of it): dispatches then ask for ExchangeRowSources and
  /// ExchangePacksRows.
  bool rows_on_backend() const { return gathers_rows() && packs_rows(); }
  /// Whether the running op's posts wait for the backend's pack (ExchangePackRows): the
  /// engine must poll, not sleep, until they went out.
  bool packing() const { return span_.packing; }
  /// Local rank `rank`'s QuantizedRows when the backend may write them (its gather mapped
  /// them: NodeExchangeHost::ExchangeRowsQuantized), else null pointers.
  QuantizedRows QuantizedRowsOf(int32_t rank) {
    if (!gathers_rows() || span_.quant_x.empty()) return {};
    const size_t i = static_cast<size_t>(rank - local_first_);
    return {span_.quant_x.data() + i * shape_.ll_max_tokens_per_rank * shape_.hidden,
            span_.quant_scales.data() + i * shape_.ll_max_tokens_per_rank * shape_.num_scales()};
  }
  /// The memory mapped for the backend's gather and pack (the receive region, quantized
  /// rows, send staging and pack table) with its mappings, handed over: the returned object
  /// unmaps it, then frees it, when destroyed, so that a backend whose unmapping must not
  /// run beside another group's launches (CUDA) can drop it later. Destroy the exchange
  /// first (its transport link writes into the receive region and reads the send staging
  /// until then). Null when nothing is mapped.
  std::shared_ptr<void> TakeMappedMemory();
  /// Rows of low-latency buffer `b`'s last dispatch from every rank to every expert
  /// ([R, E], source major): what a LowLatencyCombine on it reads per expert.
  const std::vector<int32_t>& LowLatencyCounts(int b) const { return span_.ll_counts[b]; }
  /// Rows of the last normal dispatch from every rank to every rank ([R, R], source major):
  /// what a Combine on it reads per source.
  const std::vector<int32_t>& DispatchCounts() const { return span_.dispatch_counts; }

 private:
  const v1::GroupSpec& spec() const { return spec_; }
  const kernels::GroupShape& shape() const { return shape_; }
  const kernels::EndpointLayout& layout() const { return layout_; }
  int32_t local_first() const { return local_first_; }
  int32_t local_count() const { return local_count_; }
  template <typename T>
  T* Ptr(int rank, const kernels::Region& r) const {
    return RegionPtr<T>(host_->ExchangeRankData(rank), r);
  }
  RankRouting& Private(int rank) const { return host_->ExchangeRankRouting(rank); }
  absl::StatusOr<const int64_t*> TakeTopkIdx(int rank, int32_t num_tokens) const {
    return epd::TakeTopkIdx(shape_, layout_, host_->ExchangeRankData(rank), Private(rank), rank,
                            num_tokens);
  }
  void Publish(int rank, const std::vector<int32_t>& src, int64_t rows, int64_t row_elems,
               const kernels::Region& dst) const {
    PublishRouting(host_->ExchangeRankData(rank), src, rows, row_elems, dst);
  }
  absl::Status RunLayout(int rank, const abi::RequestSlot& slot) const {
    return RunLayoutOp(shape_, layout_, host_->ExchangeRankData(rank), Private(rank), rank, slot,
                       options_.exec, options_.on_kernels);
  }

  /// Op `seq` (this node's numbering) as the link to node `n` numbers it: ops since that
  /// link was (re)built, the numbering both ends share (DESIGN.md §5.1). Everything that
  /// crosses to node n (immediates, header seq, slot and combine-area parity) uses it.
  uint64_t LinkSeq(int32_t n, uint64_t seq) const { return seq - span_.link_base[n]; }
  /// Node `n`'s slot of op `seq`'s link parity in this node's receive region.
  uint8_t* RecvSlot(int32_t n, uint64_t seq) {
    return reinterpret_cast<uint8_t*>(span_.recv.data()) + span_.recv_offset[n] +
           (LinkSeq(n, seq) % 2) * span_.in_layout[n].total;
  }
  /// This node's combine area of op `seq`'s parity on the link to node `n` (the rows node
  /// n's ranks send back).
  const uint8_t* CombineArea(int32_t n, uint64_t seq) {
    return reinterpret_cast<const uint8_t*>(span_.recv.data()) + span_.combine_offset[span_.self] +
           (LinkSeq(n, seq) % 2) * span_.combine_layout[span_.self].total;
  }
  /// Rank `s` (not on this node) among the ranks of the other nodes: its block in
  /// span_.in_ids / in_idx / in_pos.
  size_t RemoteIndex(int32_t s) const {
    return static_cast<size_t>(s < local_first_ ? s : s - local_count_);
  }
  int32_t NodeOf(int32_t rank) const {
    for (int32_t n = 0; n < span_.num_nodes; ++n) {
      if (rank >= span_.first[n] && rank < span_.first[n] + span_.count[n]) return n;
    }
    return -1;
  }
  /// Posts a header (and `pieces` of payload) of op `seq` to node `n`. The header and
  /// metadata are already in send staging n.
  absl::Status PostToNode(int32_t n, uint64_t seq, std::span<const transport::WritePiece> pieces);
  /// Ops between `handle_seq` and op `seq` (0 when it is not before).
  static uint64_t HandleAge(uint64_t seq, uint64_t handle_seq) {
    return handle_seq < seq ? seq - handle_seq : 0;
  }
  /// Fills send staging n's header for op `seq` (`handle_age`: HandleAge of an LL combine).
  abi::ExchangeHeader& StageHeader(int32_t n, uint64_t seq, uint32_t op, uint32_t flags,
                                   int32_t alignment, uint64_t handle_age,
                                   const absl::Status& status);
  /// Packs and posts this node's part of the running op to every peer.
  absl::Status SendOp(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots);
  // A dispatch's local sources for the send staging (span_.pack_sources); a low-latency FP8
  // dispatch's tokens quantized, once, into span_.quant_x / quant_scales.
  void StagePackSources(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots);
  /// Copies node n's header of op `seq` out of the receive region into span_.headers[n] and
  /// checks the copy (which is all that is read of it afterwards). Returns node n's own
  /// failure of the op when its (well-formed) header reports one, with the op it submitted
  /// (abi::OpKind, as sent) in `*failed_op`; an error this node finds in the message
  /// (DATA_LOSS naming node n) leaves `*failed_op` at -1, as does OK. `failed_op` may be null.
  absl::Status CheckHeader(int32_t n, uint64_t seq, int64_t* failed_op = nullptr);
  /// True when every node whose message of the running op is missing is alive: its Peer
  /// service healthy (GroupPeers::Health OK) and its data link ready.
  bool MissingPeersAlive() const;
  /// `status` of a node op that failed on rank `source`'s rows: when `source` is another
  /// node's rank, DATA_LOSS naming that node (its daemon sent rows that contradict its own
  /// counts), else `status` as it is.
  absl::Status PeerAtFault(uint64_t seq, int32_t source, const absl::Status& status) const;
  /// Runs this node's part of the op once every peer's message is in.
  absl::Status FinishExchange(const OpPlan& plan, const std::vector<abi::RequestSlot>& slots,
                              std::span<RankOutcome> out);
  /// Row offsets in node m's combine area of every block (ExchangeCombineLayout): for a
  /// normal combine (width R, counts [R, R]) a block per rank not on m, for a low-latency
  /// one (width E, counts [R, E]) a block per expert not on m, in ascending order, each of
  /// the rows it holds of node m's tokens. Fills span_.combine_off [width] (blocks of m's own
  /// ranks/experts get the offset of the next block) and returns the total rows.
  int64_t CombineOffsets(int32_t m, const std::vector<int32_t>& counts, int32_t width);
  /// Declares every local rank's data area to the link (GroupLink::AddSendRegion) where it
  /// is new memory since the last declaration; a region withdrawn once the writes posted
  /// before are complete (retired_regions_ until then). Allocates only when an area changed.
  /// Errors: the link's, naming the rank.
  absl::Status DeclareRankRegions();
  /// Withdraws the retired regions whose writes are complete (every one when `all`).
  void WithdrawRetiredRegions(bool all);
  /// Pops node n's next immediate into span_.pending[n]; returns whether one is pending for
  /// `seq` (older ones are dropped).
  bool ImmFor(int32_t n, uint64_t seq);
  /// Under MASK: whether node n is lost: it was connected and its link is no longer ready,
  /// its link failed, or the Peer service lost it. Its ranks are masked while it is.
  bool NodeLost(int32_t n) const;
  /// Under MASK, once every message of the running op is in: the op's mask (op_mask_) and
  /// epoch (op_epoch_) from every node's header and the nodes it runs without (DESIGN.md
  /// §5.1 "Rank masking"). OUT_OF_RANGE when the epoch would pass kMaxMaskEpoch (it never
  /// wraps; nothing is changed then).
  absl::Status ComputeOpMask(uint64_t seq);
  /// Once every message of the running op is in: the error this node's ranks get, OK when no
  /// node failed it. A node's error is taken only by the nodes that submitted the same op:
  /// the first in node order among this node's own (`span_.local_status`), the errors it
  /// finds in the peers' messages and the failures reported by peers that submitted this
  /// node's op, so that nodes running one op all report the same error. When only peers that
  /// submitted another op failed it, FAILED_PRECONDITION naming this node's op and the first
  /// of theirs (NotInStep): no rank gets the error of a request it did not make.
  absl::Status FailedOpStatus(const OpPlan& plan);
  /// FAILED_PRECONDITION: nodes `a` and `b` submitted ops `op_a` and `op_b` for op `seq`
  /// (named in node order), and node `b` failed it with `st` (its text carried).
  absl::Status NotInStep(uint64_t seq, int32_t a, uint32_t op_a, int32_t b, uint32_t op_b,
                         const absl::Status& st) const;

  struct Span {
    int32_t num_nodes = 0, self = 0;
    std::vector<int32_t> first, count;  // [N] each node's ranks
    abi::ExchangeShape xs;
    std::vector<abi::ExchangeSlotLayout> in_layout, out_layout;  // [N]
    std::vector<uint64_t> recv_offset;                           // [N]
    std::vector<uint64_t> remote_offset;  // [N]: this node's parity-0 slot at node n.
    std::vector<abi::ExchangeCombineLayout> combine_layout;  // [N] each node's area.
    std::vector<uint64_t> combine_offset;      // [N]: each node's parity-0 combine area.
    std::vector<int64_t> combine_off;          // [max(R, E) + 1]: CombineOffsets' output.
    std::vector<int64_t> block_start;          // [E]: LL combine remote blocks.
    std::vector<abi::ExchangeHeader> headers;  // [N] each peer's, as CheckHeader copied it.
    // The running dispatch's token ids, topk_idx and cached send_pos of every rank on another
    // node, copied out of the receive region (which a peer may write again at any time)
    // before anything checks them: block RemoteIndex(s) of C = in_layout block_rows rows,
    // [C] int32, [C, K] int64 and [C, R] int32. The kernels read only these copies.
    std::vector<int32_t> in_ids;
    std::vector<int64_t> in_idx;
    std::vector<int32_t> in_pos;
    const OpPlan* plan = nullptr;  // The running op (LockstepGroup's running_).
    const std::vector<abi::RequestSlot>* slots = nullptr;
    std::vector<uint64_t> recv;                    // The receive region.
    std::vector<std::vector<uint64_t>> send;       // [N] send staging.
    std::vector<std::vector<uint64_t>> fail_send;  // [N] error headers.
    std::vector<uint64_t> posted, fail_posted;     // [N] writes posted.
    std::unique_ptr<transport::GroupLink> link;
    std::unique_ptr<peer::GroupPeers> peers;
    std::vector<uint8_t> connected;     // [N]
    std::vector<uint64_t> incarnation;  // [N] of the peer connected to.
    // [N] why the last Connect to each node failed ("" when it did not): told with "not
    // connected", since the op itself only times out.
    std::vector<std::string> connect_error;
    std::vector<uint64_t> link_base;  // [N] this node's seq when the link was (re)built.
    bool in_op = false;               // An op is being exchanged.
    std::chrono::steady_clock::time_point next_descriptor_check;
    std::vector<std::optional<uint32_t>> pending;  // [N] an immediate not yet used.
    std::vector<uint8_t> got;                      // [N] this op's message is in.
    std::chrono::steady_clock::time_point started;
    // When this op first saw the Peer service report a node lost.
    std::optional<std::chrono::steady_clock::time_point> lost_seen;
    absl::Status local_status;  // This node's part of the op.
    std::vector<transport::WritePiece> pieces;
    std::vector<int32_t> local_counts;                            // [Rl, E] this op's counts here.
    std::vector<int32_t> counts;                                  // [R, E] or [R, R]: every node's.
    std::vector<int32_t> dispatch_counts;                         // [R, R] of the routing dispatch.
    std::vector<int32_t> ll_counts[kernels::kLowLatencyBuffers];  // [R, E] per buffer.
    std::vector<int32_t> remote_first, remote_rows;  // [R * El] LL combine remote views.
    std::vector<kernels::host::NodeDispatchSource> dispatch_sources;  // [R]
    std::vector<kernels::host::NodeLowLatencySource> ll_sources;      // [R]
    std::vector<kernels::host::NodePackSource> pack_sources;  // [Rl] this op's local sources.
    std::vector<kernels::host::NodePackJob> pack_jobs;        // [Rl] one node's send staging.
    std::vector<kernels::e4m3_bits> quant_x;                  // [Rl, Mll, H] LL FP8 rows.
    std::vector<float> quant_scales;                          // [Rl, Mll, S] their scales.
    // Rows on the backend, the send side (NodeExchangeHost::ExchangePacksRows): where each
    // local rank's rows to each node are, [Rl, N, C] (PackNodeRows' x_sources), mapped for
    // the backend's pack into the send staging; which ranks' rows it packs this op; and the
    // posts of every node, held until it has (Poll).
    std::vector<kernels::RowSource> pack_rows;
    std::vector<uint8_t> packs;                                // [Rl]
    std::vector<std::vector<transport::WritePiece>> deferred;  // [N]
    bool packing = false;
  };

  v1::GroupSpec spec_;
  kernels::GroupShape shape_;
  kernels::EndpointLayout layout_;
  NodeExchangeHost* host_;
  NodeExchangeOptions options_;
  int32_t local_first_ = 0, local_count_ = 0;
  Span span_;
  /// [nodes] each peer node's counters in metrics::Default() (null for this node), made
  /// at Init.
  std::vector<std::shared_ptr<metrics::LinkMetrics>> link_metrics_;
  // Each op kind's kernel arguments, [R], filled in per op (sized once: README "Hot path").
  std::vector<kernels::host::DispatchRankArgs> dispatch_args_;
  std::vector<kernels::host::CombineRankArgs> combine_args_;
  std::vector<kernels::host::LowLatencyDispatchRankArgs> ll_dispatch_args_;
  std::vector<kernels::host::LowLatencyCombineRankArgs> ll_combine_args_;
  // [R] each local rank's handles (N and T of its routing dispatch) as the running op
  // started (Start), read instead of the handle table afterwards.
  std::vector<int32_t> recv_tokens_, routing_tokens_;
  // [Rl] each local rank's data area as declared to the link: AddSendRegion's handle (-1:
  // none yet) and the memory id it was declared for (ExchangeRankRegion).
  std::vector<int> rank_region_;
  std::vector<uint64_t> rank_memory_id_;
  /// Handles of rank areas replaced while writes were in flight, with the writes posted to
  /// each node then ([N]): withdrawn once those completed.
  struct RetiredRegion {
    int handle = -1;
    std::vector<uint64_t> posted;
  };
  std::vector<RetiredRegion> retired_regions_;
  // Rank masking across nodes (spec MASK; sized at Init, nothing allocated per op).
  bool masking_ = false;
  std::vector<uint8_t> view_mask_;  ///< [R] the last OK op's mask (OpMask()).
  uint32_t view_epoch_ = 0;
  std::vector<uint8_t> self_mask_;  ///< [R] this node's mask in the running op's header.
  uint32_t self_epoch_ = 0;
  std::vector<uint8_t> op_mask_;  ///< [R] the running op's mask (ComputeOpMask).
  uint32_t op_epoch_ = 0;
  /// [N, R] each peer's mask and its epoch as CheckHeader copied them for the running op.
  std::vector<uint8_t> peer_mask_;
  std::vector<uint32_t> peer_epoch_;
  /// [N] the epoch each peer brought to the last op this node finished with it (0 after its
  /// link is formed): a peer's epoch never goes below it (CheckHeader).
  std::vector<uint32_t> agreed_epoch_;
  std::vector<uint8_t> excluded_;           ///< [N] nodes the running op runs without.
  std::vector<uint8_t> excluded_at_start_;  ///< [N] of those, the ones lost as it started.
  std::vector<uint64_t> mask_words_;        ///< [ExchangeMaskWords(R)] CheckHeader's copy.
  /// Rows on the backend: the receive region and quantized rows mapped for its gather
  /// (declared after span_: unmapped before that memory is freed); empty unless every
  /// mapping succeeded (then dispatches ask for ExchangeRowSources).
  std::vector<std::unique_ptr<ExchangeHostMapping>> gather_maps_;
  bool gathers_rows() const { return !gather_maps_.empty(); }
  /// The send staging and pack table mapped for the backend's pack (only with the gather's
  /// memory); empty unless every mapping succeeded (then dispatches ask ExchangePacksRows).
  std::vector<std::unique_ptr<ExchangeHostMapping>> pack_maps_;
  bool packs_rows() const { return !pack_maps_.empty(); }
  /// Maps the receive region, quantized rows, send staging and pack table for the
  /// backend's gather and pack (Init), all or none.
  void MapGatherMemory();
  /// While the running op's rows are being packed by the backend: posts every node's
  /// message once they are (OK), or its header with the error (the pack failed or timed
  /// out, which becomes this node's error of the op). False while still packing.
  bool PollPack();
  /// Posts every node's held message (span_.deferred) for op `seq`: all of it when
  /// `status` is OK, else its first piece with `status` in the header. A post's error
  /// becomes this node's error of the op.
  void PostDeferred(uint64_t seq, const absl::Status& status);
  /// Writes `status` (code, reason, message) into header `h`.
  static void SetHeaderStatus(abi::ExchangeHeader& h, const absl::Status& status);
};

}  // namespace epd
