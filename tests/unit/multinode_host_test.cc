// The host backend across nodes in one process: several HostDataPlanes act as the nodes of
// a group, joined by the in-process fakes of fake_exchange.h (a memcpy transport and a
// peer registry); clients are simulated by writing ring slots and inputs into each rank's
// shm region (RawRing). Every op's outputs equal, bit for bit, those of kernels/host run
// on the whole group; a bad request on one node fails every node's ranks with its error; a
// lost peer fails the op within op_timeout naming the node; a restarted node rejoins and the
// group re-forms though the nodes number their ops differently; garbage from a peer is an
// error, never an out-of-bounds access (this file runs under ASan in tests/sanitize.sh).
// The fake links refuse, as RDMA does, a write whose source lies outside the regions the
// exchange declared to them: every exchange write passes RDMA's registration rule.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "daemon/dataplane/exchange/node_exchange.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "daemon/metrics/exposition.h"
#include "daemon/metrics/metrics.h"
#include "daemon/transport/transport_set.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/layout.h"
#include "epd/kernels/op_rules.h"
#include "proto/abi/exchange_abi.h"
#include "tests/unit/fake_exchange.h"
#include "tests/unit/raw_ring.h"

namespace epd {
namespace {

using kernels::bf16_bits;
using std::chrono::milliseconds;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

class MultinodeHostTest : public ::testing::Test {
 protected:
  /// Nodes with `ranks_per_node` ranks each; `op_timeout_ms` for every plane.
  /// `mirror`: HostDataPlaneOptions::stage_through_mirror on every plane; `gather`: and
  /// its gather_rows.
  void Start(const std::vector<int>& ranks_per_node, uint32_t op_timeout_ms = 2000, bool fp8 = true,
             int hidden = 512, bool mirror = false, bool gather = false) {
    spec_.set_name("mn");
    int R = 0;
    for (size_t n = 0; n < ranks_per_node.size(); ++n) {
      v1::NodeSpec* ns = spec_.add_nodes();
      ns->set_peer_address("10.0.0." + std::to_string(n + 1) + ":7100");
      ns->set_num_ranks(ranks_per_node[n]);
      R += ranks_per_node[n];
    }
    spec_.set_num_ranks(R);
    spec_.set_num_experts(R * 2);
    spec_.set_hidden(hidden);
    spec_.set_num_topk(3);
    spec_.set_max_tokens_per_rank(6);
    spec_.set_ll_max_tokens_per_rank(5);
    spec_.set_use_fp8(fp8);
    if (mask_) spec_.set_on_rank_failure(v1::RANK_FAILURE_POLICY_MASK);
    shape_ = rules::ShapeOf(spec_);
    layout_ = kernels::EndpointLayout::Compute(shape_);
    int rank = 0;
    for (size_t n = 0; n < ranks_per_node.size(); ++n) {
      auto node = std::make_unique<Node>();
      node->transport = std::make_unique<testing::FakeTransport>(&hub_);
      if (n == 1) node->transport->descriptor = node1_descriptor_;
      node->mesh = std::make_unique<testing::FakeMesh>(&hub_, spec_.nodes(n).peer_address());
      HostDataPlaneOptions o;
      o.op_timeout_ms = op_timeout_ms;
      o.host_threads = 2;
      o.peer_mesh = node->mesh.get();
      node->transports.Add("tcp", node->transport.get());
      o.transports = &node->transports;
      o.stage_through_mirror = mirror;
      o.gather_rows = gather;
      if (n == 0) o.on_inputs_checked = node0_inputs_checked_;
      o.on_pack_poll = pack_poll_;
      auto plane = MakeHostDataPlane(o);
      ASSERT_TRUE(plane.ok()) << plane.status();
      node->plane = std::move(*plane);
      auto g = node->plane->CreateGroup(spec_, GroupCreateOptions{join_secret_});
      ASSERT_TRUE(g.ok()) << g.status();
      node->group = std::move(*g);
      for (int i = 0; i < ranks_per_node[n]; ++i, ++rank) {
        v1::EndpointInfo info;
        absl::Status st = node->group->AttachRank(rank, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info);
        ASSERT_TRUE(st.ok()) << st;
        rings_.push_back(testing::RawRing::Open(info, *node->group));
        ASSERT_NE(rings_.back(), nullptr);
        node_of_.push_back(static_cast<int>(n));
      }
      nodes_.push_back(std::move(node));
    }
  }

  void EveryOpMatches(bool mirror, bool gather = false);

  /// Region `region` of rank r's data area (a zeroed stand-in while r has no ring).
  template <typename T>
  T* At(int r, const kernels::Region& region) {
    if (!rings_[r]) {
      blank_.assign(layout_.total_bytes, 0);
      return reinterpret_cast<T*>(blank_.data() + region.offset);
    }
    return reinterpret_cast<T*>(rings_[r]->data() + region.offset);
  }
  std::vector<uint8_t> blank_;

  /// Writes rank r's low-latency combine input (in_ll_combine_x, every row) and returns it.
  bf16_bits* FillLowLatencyCombineX(int r) {
    auto* y = At<bf16_bits>(r, layout_.in_ll_combine_x);
    const int64_t n = shape_.num_local_experts() * shape_.ll_rows_per_expert() * shape_.hidden;
    for (int64_t i = 0; i < n; ++i) {
      y[i] = kernels::FloatToBf16(static_cast<float>((i * 5 + r * 3) % 211 - 105) / 9.0f);
    }
    return y;
  }
  /// Writes rank r's combine input x, `rows` rows, and returns it.
  bf16_bits* FillCombineX(int r, int rows) {
    auto* y = At<bf16_bits>(r, layout_.in_combine_x);
    for (int i = 0; i < rows * shape_.hidden; ++i) {
      y[i] = kernels::FloatToBf16(static_cast<float>((i * 7 + r * 13) % 301 - 150) / 11.0f);
    }
    return y;
  }

  /// The whole group's ops by kernels/host: the reference every node's outputs are held
  /// to. [R] per rank, sized by the Ref* calls.
  struct Reference {
    std::vector<kernels::host::DispatchRankArgs> da;
    std::vector<std::vector<uint8_t>> rx;
    std::vector<std::vector<float>> rs, rw;
    std::vector<std::vector<int64_t>> ri;
    std::vector<std::vector<int32_t>> rpe, rsi, rsp, rpf;
    std::vector<std::vector<bf16_bits>> cx;
    std::vector<std::vector<float>> cw;
    std::vector<std::vector<uint8_t>> lx, ls;
    std::vector<std::vector<int32_t>> lc, lsi, lh;
    std::vector<std::vector<bf16_bits>> lcx;
  };
  /// Rank r's topk_idx for a reference: idx[r], or its in_topk_idx when idx is empty.
  const int64_t* RefIdx(const std::vector<const int64_t*>& idx, int r) {
    return idx.empty() ? At<int64_t>(r, layout_.in_topk_idx) : idx[r];
  }
  /// Dispatch (with weights) of every rank's tokens_[r] tokens routed by RefIdx.
  absl::Status RefDispatch(bool fp8, const std::vector<const int64_t*>& idx, Reference* ref) {
    const int R = shape_.num_ranks, K = shape_.num_topk, H = shape_.hidden;
    const int64_t N = shape_.max_recv_tokens();
    kernels::host::DispatchOptions dopt;
    dopt.fp8 = fp8;
    dopt.expert_alignment = 1;
    ref->da.assign(R, {});
    ref->rx.assign(R, std::vector<uint8_t>(N * H * 2));
    ref->rs.assign(R, std::vector<float>(N * shape_.num_scales()));
    ref->rw.assign(R, std::vector<float>(N * K));
    ref->ri.assign(R, std::vector<int64_t>(N * K));
    ref->rpe.assign(R, std::vector<int32_t>(shape_.num_local_experts()));
    ref->rsi.assign(R, std::vector<int32_t>(N));
    ref->rsp.assign(R, std::vector<int32_t>(shape_.max_tokens_per_rank * R));
    ref->rpf.assign(R, std::vector<int32_t>(R));
    for (int r = 0; r < R; ++r) {
      auto& a = ref->da[r];
      a.num_tokens = tokens_[r];
      a.x = At<void>(r, layout_.in_x);
      a.x_scales = fp8 ? At<float>(r, layout_.in_scales) : nullptr;
      a.topk_idx = RefIdx(idx, r);
      a.topk_weights = At<float>(r, layout_.in_topk_weights);
      a.recv_capacity = N;
      a.recv_x = ref->rx[r].data();
      a.recv_scales = fp8 ? ref->rs[r].data() : nullptr;
      a.recv_topk_idx = ref->ri[r].data();
      a.recv_topk_weights = ref->rw[r].data();
      a.recv_tokens_per_expert = ref->rpe[r].data();
      a.recv_src_info = ref->rsi[r].data();
      a.send_pos = ref->rsp[r].data();
      a.rank_prefix = ref->rpf[r].data();
    }
    return kernels::host::Dispatch(shape_, dopt, ref->da, {1});
  }
  /// Combine on RefDispatch's handles, each rank's rows from FillCombineX (and, with
  /// `weights`, in_combine_weights filled here).
  absl::Status RefCombine(bool weights, Reference* ref) {
    const int R = shape_.num_ranks, K = shape_.num_topk;
    std::vector<kernels::host::CombineRankArgs> ca(R);
    ref->cx.assign(R, std::vector<bf16_bits>(shape_.max_tokens_per_rank * shape_.hidden));
    ref->cw.assign(R, std::vector<float>(shape_.max_tokens_per_rank * K));
    for (int r = 0; r < R; ++r) {
      const int n = ref->da[r].num_recv_tokens;
      ca[r].x = FillCombineX(r, n);
      if (weights) {
        auto* yw = At<float>(r, layout_.in_combine_weights);
        for (int i = 0; i < n * K; ++i) yw[i] = static_cast<float>(i % 17) / 3.0f;
        ca[r].topk_weights = yw;
        ca[r].combined_topk_weights = ref->cw[r].data();
      }
      ca[r].num_tokens = tokens_[r];
      ca[r].send_pos = ref->rsp[r].data();
      ca[r].num_recv_tokens = n;
      ca[r].combined_x = ref->cx[r].data();
    }
    return kernels::host::Combine(shape_, ca, {1});
  }
  /// LowLatencyDispatch of every rank's ll_tokens[r] tokens routed by RefIdx.
  absl::Status RefLowLatencyDispatch(const kernels::host::LowLatencyDispatchOptions& opt,
                                     const std::vector<int>& ll_tokens,
                                     const std::vector<const int64_t*>& idx, Reference* ref) {
    const int R = shape_.num_ranks, El = shape_.num_local_experts();
    const int64_t rows = shape_.ll_rows_per_expert();
    std::vector<kernels::host::LowLatencyDispatchRankArgs> la(R);
    ref->lx.assign(R, std::vector<uint8_t>(El * rows * shape_.hidden * 2));
    ref->ls.assign(R, std::vector<uint8_t>(El * rows * shape_.num_scales() * 4));
    ref->lc.assign(R, std::vector<int32_t>(El));
    ref->lsi.assign(R, std::vector<int32_t>(El * rows));
    ref->lh.assign(R, std::vector<int32_t>(shape_.ll_max_tokens_per_rank * shape_.num_topk));
    for (int r = 0; r < R; ++r) {
      la[r].num_tokens = ll_tokens[r];
      la[r].x = At<bf16_bits>(r, layout_.in_x);
      la[r].topk_idx = RefIdx(idx, r);
      la[r].recv_x = ref->lx[r].data();
      la[r].recv_scales = opt.use_fp8 ? ref->ls[r].data() : nullptr;
      la[r].recv_count = ref->lc[r].data();
      la[r].recv_src_info = ref->lsi[r].data();
      la[r].handle_pos = ref->lh[r].data();
    }
    return kernels::host::LowLatencyDispatch(shape_, opt, la, {1});
  }
  /// LowLatencyCombine on RefLowLatencyDispatch's handles, each rank's rows from
  /// FillLowLatencyCombineX.
  absl::Status RefLowLatencyCombine(const std::vector<int>& ll_tokens,
                                    const std::vector<const int64_t*>& idx, Reference* ref) {
    const int R = shape_.num_ranks;
    std::vector<kernels::host::LowLatencyCombineRankArgs> lca(R);
    ref->lcx.assign(R, std::vector<bf16_bits>(shape_.ll_max_tokens_per_rank * shape_.hidden));
    for (int r = 0; r < R; ++r) {
      lca[r].num_tokens = ll_tokens[r];
      lca[r].topk_idx = RefIdx(idx, r);
      lca[r].topk_weights = At<float>(r, layout_.in_topk_weights);
      lca[r].handle_pos = ref->lh[r].data();
      lca[r].x = FillLowLatencyCombineX(r);
      lca[r].combined_x = ref->lcx[r].data();
    }
    return kernels::host::LowLatencyCombine(shape_, lca, {1});
  }

  /// Random inputs of every rank: T, x (bf16, or e4m3 bytes + scales), topk_idx, weights.
  void MakeInputs(uint64_t seed, bool one_node_only = false) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    const int R = shape_.num_ranks, K = shape_.num_topk, H = shape_.hidden;
    tokens_.assign(R, 0);
    const int node0_experts = spec_.nodes(0).num_ranks() * shape_.num_local_experts();
    for (int r = 0; r < R; ++r) {
      const int T = static_cast<int>(rng() % (shape_.max_tokens_per_rank + 1));
      tokens_[r] = r == 0 ? 0 : T;  // Rank 0 sends nothing.
      auto* x = At<bf16_bits>(r, layout_.in_x);
      for (int i = 0; i < shape_.max_input_tokens() * H; ++i) {
        x[i] =
            kernels::FloatToBf16(static_cast<float>(static_cast<int>(rng() % 401) - 200) / 17.0f);
      }
      auto* sc = At<float>(r, layout_.in_scales);
      for (int i = 0; i < shape_.max_tokens_per_rank * shape_.num_scales(); ++i) {
        sc[i] = static_cast<float>(rng() % 100) / 7.0f;
      }
      auto* idx = At<int64_t>(r, layout_.in_topk_idx);
      const int range = one_node_only ? node0_experts : shape_.num_experts;
      for (int i = 0; i < shape_.max_input_tokens() * K; ++i) {
        idx[i] = rng() % 6 == 0 ? -1 : static_cast<int64_t>(rng() % range);
      }
      auto* w = At<float>(r, layout_.in_topk_weights);
      for (int i = 0; i < shape_.max_input_tokens() * K; ++i) {
        w[i] = static_cast<float>(rng() % 1000) / 999.0f;
      }
    }
  }

  /// Submits op on every rank and waits for every completion.
  std::vector<abi::Completion> RunOnAll(abi::OpKind op, uint32_t flags,
                                        const std::vector<int>& tokens, uint64_t handle_seq = 0,
                                        milliseconds timeout = milliseconds(10000)) {
    std::vector<uint64_t> seqs;
    for (size_t r = 0; r < rings_.size(); ++r) {
      seqs.push_back(rings_[r]->Submit(op, flags, tokens[r], handle_seq));
    }
    std::vector<abi::Completion> out;
    for (size_t r = 0; r < rings_.size(); ++r) {
      auto c = rings_[r]->Await(seqs[r], timeout);
      EXPECT_TRUE(c.has_value()) << "rank " << r << " got no completion";
      out.push_back(c.value_or(abi::Completion{}));
    }
    last_seq_ = seqs[0];
    return out;
  }

  /// On a group of two one-rank nodes: runs a dispatch on both, makes node 0's link refuse
  /// rank 0's area with `refusal`, then submits rank 0's combine of that dispatch and rank
  /// 1's `op_1` (a dispatch, or a combine of that dispatch), rank `first`'s 50 ms ahead so
  /// that its node's op starts alone. Returns both completions (rank 0's first); the link
  /// takes areas again after.
  std::array<abi::Completion, 2> RefuseAreaAndSubmitApart(int first, abi::OpKind op_1,
                                                          const absl::Status& refusal) {
    std::array<abi::Completion, 2> out{};
    auto done = RunOnAll(abi::OpKind::kDispatch, 0, tokens_);
    const uint64_t dispatch_seq = last_seq_;
    for (size_t r = 0; r < done.size(); ++r) {
      EXPECT_EQ(done[r].status_code, 0) << Message(done[r]);
      if (done[r].status_code != 0) return out;
    }
    nodes_[0]->transport->last_link()->add_region_error = refusal;
    auto submit = [&](int r) {
      const abi::OpKind op = r == 0 ? abi::OpKind::kCombine : op_1;
      return rings_[r]->Submit(op, 0, tokens_[r], op == abi::OpKind::kCombine ? dispatch_seq : 0);
    };
    uint64_t seqs[2];
    seqs[first] = submit(first);
    std::this_thread::sleep_for(milliseconds(50));
    seqs[1 - first] = submit(1 - first);
    for (int r = 0; r < 2; ++r) {
      auto c = rings_[r]->Await(seqs[r], milliseconds(10000));
      EXPECT_TRUE(c.has_value()) << "rank " << r << " got no completion";
      out[r] = c.value_or(abi::Completion{});
    }
    nodes_[0]->transport->last_link()->add_region_error = absl::OkStatus();
    return out;
  }

  static std::string Message(const abi::Completion& c) {
    return std::string(c.message, strnlen(c.message, sizeof(c.message)));
  }

  struct Node {
    std::unique_ptr<testing::FakeTransport> transport;
    transport::TransportSet transports;  ///< "tcp" = `transport`.
    std::unique_ptr<testing::FakeMesh> mesh;
    std::unique_ptr<DataPlane> plane;
    std::unique_ptr<DataPlaneGroup> group;
  };

  /// Asserts that node `n`'s link holds its receive region, its send staging and error
  /// headers (two per peer) and one region per local rank: no rank area declared twice or
  /// left behind by a re-attach.
  void ExpectLinkRegions(int n) {
    testing::FakeLink* link = nodes_[n]->transport->last_link();
    ASSERT_NE(link, nullptr);
    const size_t peers = spec_.nodes_size() - 1;
    EXPECT_EQ(link->num_source_regions(), 1 + 2 * peers + spec_.nodes(n).num_ranks())
        << "node " << n;
    EXPECT_EQ(link->refused_sources(), 0u) << "node " << n;
  }

  void TearDown() override {
    rings_.clear();
    for (auto& n : nodes_) n->group.reset();
    for (auto& n : nodes_) n->plane.reset();
  }

  testing::FakeHub hub_;
  v1::GroupSpec spec_;
  std::string join_secret_;  ///< Every node's group is created with it.
  kernels::GroupShape shape_;
  kernels::EndpointLayout layout_;
  std::vector<std::unique_ptr<Node>> nodes_;
  std::vector<std::unique_ptr<testing::RawRing>> rings_;
  std::vector<int> node_of_;
  std::vector<int> tokens_;
  uint64_t last_seq_ = 0;
  /// HostDataPlaneOptions::on_inputs_checked of node 0 (set before Start).
  std::function<void()> node0_inputs_checked_;
  /// Every node's HostDataPlaneOptions::on_pack_poll (with gather_rows).
  std::function<absl::StatusOr<bool>(int32_t)> pack_poll_;
  /// Not "": the transport descriptor node 1 publishes (one node 0 refuses).
  std::string node1_descriptor_;
  /// Start makes a RANK_FAILURE_POLICY_MASK group.
  bool mask_ = false;
};

template <typename T>
bool Same(const T* a, const T* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(T)) == 0;
}

// Normal dispatch (FP8 and BF16, weights, expert_alignment), combine with weights, a
// cached re-dispatch and its combine, then low-latency dispatch (FP8 round_scale UE8M0,
// then BF16) and combine: every node's outputs equal kernels/host on the whole group.
/// Every op and option on 2 and 4 nodes, each result bit for bit that of kernels/host on
/// the whole group; `mirror`: through HostDataPlaneOptions::stage_through_mirror (`gather`:
/// with the received rows gathered, gather_rows).
void MultinodeHostTest::EveryOpMatches(bool mirror, bool gather) {
  for (const std::vector<int>& layout : {std::vector<int>{2, 1}, std::vector<int>{1, 3, 2, 1}}) {
    SCOPED_TRACE(::testing::Message() << layout.size() << " nodes");
    rings_.clear();
    nodes_.clear();
    node_of_.clear();
    spec_.Clear();
    Start(layout, 2000, true, 512, mirror, gather);
    if (HasFatalFailure()) return;
    const int R = shape_.num_ranks, K = shape_.num_topk, H = shape_.hidden;
    const int S = shape_.num_scales(), El = shape_.num_local_experts();
    for (int round = 0; round < 4; ++round) {
      SCOPED_TRACE(::testing::Message() << "round " << round);
      MakeInputs(100 + round + layout.size(), /*one_node_only=*/round == 3);
      const bool fp8 = round % 2 == 1;
      // ---- reference: the whole group
      Reference ref;
      ASSERT_TRUE(RefDispatch(fp8, {}, &ref).ok());
      const auto& da = ref.da;
      const auto& rx = ref.rx;
      const auto& ri = ref.ri;
      const auto& rs = ref.rs;
      const auto& rw = ref.rw;
      const auto &rpe = ref.rpe, &rsi = ref.rsi, &rsp = ref.rsp, &rpf = ref.rpf;
      // ---- the nodes
      const uint32_t flags = abi::kFlagDispatchWeights | (fp8 ? abi::kFlagFp8 : 0);
      auto done = RunOnAll(abi::OpKind::kDispatch, flags, tokens_);
      const uint64_t dispatch_seq = last_seq_;
      for (int r = 0; r < R; ++r) {
        ASSERT_EQ(done[r].status_code, 0) << "rank " << r << ": " << Message(done[r]);
        const int n = da[r].num_recv_tokens;
        EXPECT_EQ(*At<int32_t>(r, layout_.recv_count), n) << r;
        const int64_t xb = fp8 ? H : 2 * H;
        EXPECT_TRUE(Same(At<uint8_t>(r, layout_.recv_x), rx[r].data(), n * xb)) << r;
        if (fp8) EXPECT_TRUE(Same(At<float>(r, layout_.recv_scales), rs[r].data(), n * S)) << r;
        EXPECT_TRUE(Same(At<int64_t>(r, layout_.recv_topk_idx), ri[r].data(), n * K)) << r;
        EXPECT_TRUE(Same(At<float>(r, layout_.recv_topk_weights), rw[r].data(), n * K)) << r;
        EXPECT_TRUE(Same(At<int32_t>(r, layout_.recv_tokens_per_expert), rpe[r].data(), El)) << r;
        EXPECT_TRUE(Same(At<int32_t>(r, layout_.recv_src_info), rsi[r].data(), n)) << r;
        EXPECT_TRUE(Same(At<int32_t>(r, layout_.rank_prefix), rpf[r].data(), R)) << r;
        EXPECT_TRUE(Same(At<int32_t>(r, layout_.send_pos), rsp[r].data(), tokens_[r] * R)) << r;
      }
      // Combine with weights; its outputs start as 0xA5 (a row the reduce misses shows).
      ASSERT_TRUE(RefCombine(/*weights=*/true, &ref).ok());
      const auto& cx = ref.cx;
      const auto& cw = ref.cw;
      for (int r = 0; r < R; ++r) {
        std::memset(At<uint8_t>(r, layout_.combined_x), 0xA5, layout_.combined_x.bytes);
        std::memset(At<uint8_t>(r, layout_.combined_topk_weights), 0xA5,
                    layout_.combined_topk_weights.bytes);
      }
      done = RunOnAll(abi::OpKind::kCombine, abi::kFlagCombineWeights, tokens_, dispatch_seq);
      for (int r = 0; r < R; ++r) {
        ASSERT_EQ(done[r].status_code, 0) << "rank " << r << ": " << Message(done[r]);
        EXPECT_TRUE(Same(At<bf16_bits>(r, layout_.combined_x), cx[r].data(), tokens_[r] * H)) << r;
        EXPECT_TRUE(Same(At<float>(r, layout_.combined_topk_weights), cw[r].data(), tokens_[r] * K))
            << r;
      }
      // Cached re-dispatch: the same rows again.
      for (int r = 0; r < R; ++r)
        std::memset(At<uint8_t>(r, layout_.recv_x), 0, layout_.recv_x.bytes);
      done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagCachedHandle | (fp8 ? abi::kFlagFp8 : 0),
                      tokens_, dispatch_seq);
      for (int r = 0; r < R; ++r) {
        ASSERT_EQ(done[r].status_code, 0) << "rank " << r << ": " << Message(done[r]);
        const int64_t xb = fp8 ? H : 2 * H;
        EXPECT_TRUE(Same(At<uint8_t>(r, layout_.recv_x), rx[r].data(), da[r].num_recv_tokens * xb))
            << r;
      }
      // Low-latency dispatch and combine.
      kernels::host::LowLatencyDispatchOptions lopt{fp8, fp8, fp8 && H % 512 == 0};
      const int64_t rows = shape_.ll_rows_per_expert();
      std::vector<int> ll_tokens(R);
      for (int r = 0; r < R; ++r)
        ll_tokens[r] = std::min(tokens_[r], shape_.ll_max_tokens_per_rank);
      ASSERT_TRUE(RefLowLatencyDispatch(lopt, ll_tokens, {}, &ref).ok());
      const auto &lx = ref.lx, &ls = ref.ls;
      const auto &lc = ref.lc, &lsi = ref.lsi, &lh = ref.lh;
      const uint32_t lflags =
          fp8 ? (abi::kFlagFp8 | abi::kFlagRoundScale | (lopt.use_ue8m0 ? abi::kFlagUe8m0 : 0u))
              : 0u;
      done = RunOnAll(abi::OpKind::kLowLatencyDispatch, lflags, ll_tokens);
      const uint64_t ll_seq = last_seq_;
      for (int r = 0; r < R; ++r) {
        ASSERT_EQ(done[r].status_code, 0) << "rank " << r << ": " << Message(done[r]);
        const int b = done[r].buffer;
        EXPECT_TRUE(Same(At<int32_t>(r, layout_.ll_recv_count[b]), lc[r].data(), El)) << r;
        const int64_t xb = fp8 ? H : 2 * H;
        for (int j = 0; j < El; ++j) {
          EXPECT_TRUE(Same(At<uint8_t>(r, layout_.ll_recv_x[b]) + j * rows * xb,
                           lx[r].data() + j * rows * xb, lc[r][j] * xb))
              << r;
          EXPECT_TRUE(Same(At<int32_t>(r, layout_.ll_recv_src_info[b]) + j * rows,
                           lsi[r].data() + j * rows, lc[r][j]))
              << r;
          for (int i = 0; fp8 && i < lc[r][j]; ++i) {
            for (int g = 0; g < S; ++g) {
              const uint64_t at = kernels::LowLatencyScaleOffset(shape_, lopt.use_ue8m0, j, i, g);
              EXPECT_EQ(At<uint8_t>(r, layout_.ll_recv_scales[b])[at], ls[r][at]) << r;
            }
          }
        }
        EXPECT_TRUE(Same(At<int32_t>(r, layout_.ll_handle_pos[b]), lh[r].data(), ll_tokens[r] * K))
            << r;
      }
      ASSERT_TRUE(RefLowLatencyCombine(ll_tokens, {}, &ref).ok());
      const auto& lcx = ref.lcx;
      for (int r = 0; r < R; ++r) {
        for (const kernels::Region& out : layout_.ll_combined_x) {
          std::memset(At<uint8_t>(r, out), 0xA5, out.bytes);
        }
      }
      done = RunOnAll(abi::OpKind::kLowLatencyCombine, 0, ll_tokens, ll_seq);
      for (int r = 0; r < R; ++r) {
        ASSERT_EQ(done[r].status_code, 0) << "rank " << r << ": " << Message(done[r]);
        EXPECT_TRUE(Same(At<bf16_bits>(r, layout_.ll_combined_x[done[r].buffer]), lcx[r].data(),
                         ll_tokens[r] * H))
            << r;
      }
      // GetDispatchLayout needs no exchange beyond the header; each rank's own layout.
      for (int r = 0; r < R; ++r) {
        std::memset(At<uint8_t>(r, layout_.layout_tokens_per_rank), 0xEE,
                    layout_.layout_tokens_per_rank.bytes);
        std::memset(At<uint8_t>(r, layout_.layout_is_token_in_rank), 0xEE,
                    layout_.layout_is_token_in_rank.bytes);
      }
      done = RunOnAll(abi::OpKind::kGetDispatchLayout, 0, tokens_);
      for (int r = 0; r < R; ++r) {
        EXPECT_EQ(done[r].status_code, 0) << Message(done[r]);
        std::vector<int32_t> per_rank(R), per_expert(shape_.num_experts);
        std::vector<uint8_t> in_rank(static_cast<size_t>(shape_.max_tokens_per_rank) * R);
        kernels::host::LayoutRankArgs a;
        a.num_tokens = tokens_[r];
        a.topk_idx = At<int64_t>(r, layout_.in_topk_idx);
        a.num_tokens_per_rank = per_rank.data();
        a.num_tokens_per_expert = per_expert.data();
        a.is_token_in_rank = in_rank.data();
        ASSERT_TRUE(kernels::host::GetDispatchLayout(shape_, a, {1}).ok());
        EXPECT_TRUE(Same(At<int32_t>(r, layout_.layout_tokens_per_rank), per_rank.data(), R)) << r;
        EXPECT_TRUE(Same(At<int32_t>(r, layout_.layout_tokens_per_expert), per_expert.data(),
                         shape_.num_experts))
            << r;
        EXPECT_TRUE(
            Same(At<uint8_t>(r, layout_.layout_is_token_in_rank), in_rank.data(), tokens_[r] * R))
            << r;
      }
    }
    for (size_t n = 0; n < layout.size(); ++n) ExpectLinkRegions(static_cast<int>(n));
  }
}

TEST_F(MultinodeHostTest, EveryOpMatchesTheWholeGroup) { EveryOpMatches(/*mirror=*/false); }

// The fake links take write sources only inside the regions they were given, as RDMA does:
// the check the exchange's writes pass in every test here.
TEST(FakeExchangeStrict, RefusesSourcesOutsideTheLinksRegions) {
  testing::FakeHub hub;
  std::vector<uint8_t> recv0(64), recv1(64), staging(32), area(32);
  transport::GroupLinkOptions o;
  o.group = "g";
  o.num_nodes = 2;
  o.self_node = 0;
  o.recv_base = recv0.data();
  o.recv_bytes = recv0.size();
  o.send_regions.push_back({staging.data(), staging.size()});
  testing::FakeTransport t0(&hub), t1(&hub);
  auto l0 = t0.CreateGroupLink(o);
  o.self_node = 1;
  o.recv_base = recv1.data();
  o.send_regions.clear();
  auto l1 = t1.CreateGroupLink(o);
  ASSERT_TRUE(l0.ok() && l1.ok());
  ASSERT_TRUE((*l0)->Connect(1, "fake:1").ok());
  const transport::WritePiece from_staging{staging.data() + 8, 24, 0};
  const transport::WritePiece from_area{area.data(), 32, 32};
  const transport::WritePiece past_staging{staging.data() + 8, 25, 0};
  EXPECT_TRUE((*l0)->PostWrite(1, {&from_staging, 1}, 1).ok());
  EXPECT_EQ((*l0)->PostWrite(1, {&from_area, 1}, 2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*l0)->PostWrite(1, {&past_staging, 1}, 3).code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<int> h = (*l0)->AddSendRegion({area.data(), area.size()});
  ASSERT_TRUE(h.ok()) << h.status();
  const transport::WritePiece both[] = {from_staging, from_area};
  EXPECT_TRUE((*l0)->PostWrite(1, both, 4).ok());
  (*l0)->RemoveSendRegion(*h);
  const absl::Status st = (*l0)->PostWrite(1, {&from_area, 1}, 5);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("piece 0"), std::string::npos) << st;
  EXPECT_EQ(t0.last_link()->refused_sources(), 3u);
  // Without the rule (TCP's): sources anywhere.
  testing::FakeTransport loose(&hub, /*strict_sources=*/false);
  o.self_node = 0;
  o.recv_base = recv0.data();
  auto l2 = loose.CreateGroupLink(o);
  ASSERT_TRUE(l2.ok());
  ASSERT_TRUE((*l2)->Connect(1, "fake:1").ok());
  EXPECT_TRUE((*l2)->PostWrite(1, {&from_area, 1}, 6).ok());
}

// A rank's data area the link cannot take (RDMA: the locked-memory limit): the combine fails
// on every node naming the rank and the link's reason; the ops that do not send from it run.
TEST_F(MultinodeHostTest, ARankAreaTheLinkRefusesFailsTheCombineEverywhere) {
  Start({1, 1});
  if (HasFatalFailure()) return;
  nodes_[0]->transport->last_link()->add_region_error =
      absl::FailedPreconditionError("ibv_reg_mr: raise the locked-memory limit");
  MakeInputs(50);
  auto done = RunOnAll(abi::OpKind::kDispatch, 0, tokens_);
  const uint64_t dispatch_seq = last_seq_;
  for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
  done = RunOnAll(abi::OpKind::kCombine, 0, tokens_, dispatch_seq);
  for (size_t r = 0; r < done.size(); ++r) {
    EXPECT_EQ(done[r].status_code, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition))
        << r;
    EXPECT_NE(Message(done[r]).find("rank 0: declaring its data area"), std::string::npos)
        << Message(done[r]);
    EXPECT_NE(Message(done[r]).find("locked-memory limit"), std::string::npos) << Message(done[r]);
  }
  nodes_[0]->transport->last_link()->add_region_error = absl::OkStatus();
  done = RunOnAll(abi::OpKind::kDispatch, 0, tokens_);
  for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
  done = RunOnAll(abi::OpKind::kCombine, 0, tokens_, last_seq_);
  for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
  ExpectLinkRegions(0);
}

// The same refusal with the nodes' requests apart, either node's first (its op starts
// alone: node 0's combine fails where it starts, before or after node 1's message is in).
// Node 1 submitting the combine too gets the area's error, as node 0 does: node 0 reads
// which op node 1 submitted from node 1's header of this op, never from the previous op's
// (a dispatch). Node 1 submitting a dispatch instead gets FAILED_PRECONDITION "not in step"
// naming both ops (the area's error is not its request's), while node 0 keeps its own error.
TEST_F(MultinodeHostTest, ARefusedRankAreaFailsEveryCombineWhicheverNodeSubmitsFirst) {
  Start({1, 1});
  if (HasFatalFailure()) return;
  MakeInputs(50);
  for (abi::OpKind op_1 : {abi::OpKind::kCombine, abi::OpKind::kDispatch}) {
    for (int first : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << "node 1 submits " << OpName(static_cast<uint32_t>(op_1))
                                        << ", node " << first << " first");
      const auto done = RefuseAreaAndSubmitApart(
          first, op_1, absl::FailedPreconditionError("ibv_reg_mr: raise the locked-memory limit"));
      if (HasFatalFailure()) return;
      for (size_t r = 0; r < done.size(); ++r) {
        EXPECT_EQ(done[r].status_code, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition))
            << r << ": " << Message(done[r]);
        if (r == 1 && op_1 == abi::OpKind::kDispatch) {
          EXPECT_THAT(Message(done[r]), AllOf(HasSubstr("not in step"),
                                              HasSubstr("node 0 (ranks 0-0) submitted Combine"),
                                              HasSubstr("node 1 (ranks 1-1) submitted Dispatch")));
        } else {
          EXPECT_THAT(Message(done[r]),
                      AllOf(HasSubstr("rank 0: declaring its data area"),
                            HasSubstr("locked-memory limit"), Not(HasSubstr("not in step"))))
              << r;
        }
      }
    }
  }
  auto done = RunOnAll(abi::OpKind::kDispatch, 0, tokens_);
  for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
  done = RunOnAll(abi::OpKind::kCombine, 0, tokens_, last_seq_);
  for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
}

// Rows packed by the backend (gather_rows): while a node's packs have not run, its engine
// polls them instead of sleeping (no transport wake comes: every node holds its posts until
// its own pack ran); a pack that fails sends node 0's error to every node instead of its
// rows; one that never finishes fails the op within op_timeout, and the peers report node
// 0's reason rather than time out.
TEST_F(MultinodeHostTest, PacksOnTheBackendArePolledAndTheirFailuresReachEveryNode) {
  using Clock = std::chrono::steady_clock;
  std::mutex mu;
  std::array<std::optional<Clock::time_point>, 3> first_poll;  // [rank] this op's.
  milliseconds hold{0};
  Clock::duration quickest = std::chrono::hours(1);  // From a held pack's first poll to its run.
  bool fail = false, never = false;
  pack_poll_ = [&](int32_t rank) -> absl::StatusOr<bool> {
    std::lock_guard<std::mutex> lock(mu);
    const bool node0 = rank < 2;
    if (node0 && fail) return absl::InternalError("the pack kernel's launch failed");
    if (node0 && never) return false;
    std::optional<Clock::time_point>& first = first_poll[static_cast<size_t>(rank)];
    if (!first) first = Clock::now();
    const Clock::duration since = Clock::now() - *first;
    if (since < hold) return false;
    first.reset();
    if (hold > milliseconds(0)) quickest = std::min(quickest, since);
    return true;
  };
  Start({2, 1}, /*op_timeout_ms=*/600, true, 512, /*mirror=*/true, /*gather=*/true);
  if (HasFatalFailure()) return;
  MakeInputs(60);
  // Packs of 2 ms on every node. An engine that slept while its pack is pending (up to 20
  // ms a sleep, and no wake: every node's message waits for its own pack) would run each
  // pack 20 ms or so after its first poll; one that polls runs it right after the 2 ms.
  {
    std::lock_guard<std::mutex> lock(mu);
    hold = milliseconds(2);
  }
  for (int i = 0; i < 10; ++i) {
    const auto done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens_);
    for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_LT(quickest, milliseconds(10));
  }
  // A failed pack: every rank of every node gets node 0's error.
  {
    std::lock_guard<std::mutex> lock(mu);
    hold = milliseconds(0);
    fail = true;
  }
  auto done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens_);
  for (size_t r = 0; r < done.size(); ++r) {
    EXPECT_EQ(done[r].status_code, static_cast<int32_t>(absl::StatusCode::kInternal)) << r;
    EXPECT_THAT(Message(done[r]), HasSubstr("the pack kernel's launch failed")) << r;
  }
  // A pack that never finishes: DEADLINE_EXCEEDED naming the pack, on every node.
  {
    std::lock_guard<std::mutex> lock(mu);
    fail = false;
    never = true;
  }
  done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens_);
  for (size_t r = 0; r < done.size(); ++r) {
    EXPECT_EQ(done[r].status_code, static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded)) << r;
    EXPECT_THAT(Message(done[r]), HasSubstr("did not pack this node's rows")) << r;
  }
  // And the group goes on.
  {
    std::lock_guard<std::mutex> lock(mu);
    never = false;
    for (auto& f : first_poll) f.reset();
  }
  done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens_);
  for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
  done = RunOnAll(abi::OpKind::kCombine, 0, tokens_, last_seq_);
  for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
}

// A rank attached anew between ops (new endpoint, new shm memory): the next combine sends its
// rows from the new memory, which the exchange declares to the link in place of the old.
TEST_F(MultinodeHostTest, ReattachedRankCombinesFromItsNewMemory) {
  Start({2, 1});
  if (HasFatalFailure()) return;
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    if (round == 1) {
      rings_[1].reset();
      nodes_[0]->group->DetachRank(1);
      v1::EndpointInfo info;
      absl::Status st = nodes_[0]->group->AttachRank(1, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info);
      ASSERT_TRUE(st.ok()) << st;
      rings_[1] = testing::RawRing::Open(info, *nodes_[0]->group);
      ASSERT_NE(rings_[1], nullptr);
    }
    MakeInputs(40 + round);
    for (int r = 0; r < shape_.num_ranks; ++r) tokens_[r] = shape_.ll_max_tokens_per_rank;
    auto done = RunOnAll(abi::OpKind::kDispatch, 0, tokens_);
    const uint64_t dispatch_seq = last_seq_;
    for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
    done = RunOnAll(abi::OpKind::kCombine, 0, tokens_, dispatch_seq);
    for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
    done = RunOnAll(abi::OpKind::kLowLatencyDispatch, 0, tokens_);
    const uint64_t ll_seq = last_seq_;
    for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
    done = RunOnAll(abi::OpKind::kLowLatencyCombine, 0, tokens_, ll_seq);
    for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
    ExpectLinkRegions(0);
    ExpectLinkRegions(1);
  }
}

// As the CUDA backend across nodes stages them (DESIGN.md §5.5): the exchange works on a
// copy of each rank's area that holds only the ranges MirrorInputSpans names (the rest is
// 0xA5), and only the MirrorOutputSpans ranges come back. Exact results mean those ranges
// cover everything the exchange reads and writes.
TEST_F(MultinodeHostTest, EveryOpMatchesThroughTheCudaMirrorSpans) {
  EveryOpMatches(/*mirror=*/true);
}

// As the CUDA backend's daemon-launched ranks run across nodes (DESIGN.md §5.5 "Rows on the
// GPU"): the mirror ranges, the dispatches' received rows left to a RowSource table that
// kernels::host::GatherRows (the CUDA gather's reference) writes into the client's area, and
// the combines' rows left to a ReduceTable that kernels::host::ReduceRows (the CUDA reduce's
// reference) sums into it. The mirror's rows are 0xA5, and so are the client's combine
// outputs before each combine: a row or term a table misses or misplaces fails the
// comparison (the terms' order: HostRowReduceTest).
TEST_F(MultinodeHostTest, EveryOpMatchesWithTheReceivedRowsGathered) {
  EveryOpMatches(/*mirror=*/true, /*gather=*/true);
}

// A rank of node 1 with an expert id out of range: every rank of every node fails with
// its error (INVALID_ARGUMENT naming the rank and value); the group goes on.
TEST_F(MultinodeHostTest, BadRequestOnOneNodeFailsEveryNode) {
  Start({2, 2});
  if (HasFatalFailure()) return;
  MakeInputs(7);
  At<int64_t>(2, layout_.in_topk_idx)[0] = 999;
  std::vector<int> tokens(4, 3);
  auto done = RunOnAll(abi::OpKind::kDispatch, 0, tokens);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(done[r].status_code, static_cast<int>(absl::StatusCode::kInvalidArgument)) << r;
    EXPECT_NE(Message(done[r]).find("999"), std::string::npos) << Message(done[r]);
    EXPECT_NE(Message(done[r]).find("rank 2"), std::string::npos) << Message(done[r]);
  }
  At<int64_t>(2, layout_.in_topk_idx)[0] = 1;
  done = RunOnAll(abi::OpKind::kDispatch, 0, tokens);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(done[r].status_code, 0) << Message(done[r]);
}

// GetDispatchLayout exchanges nothing but its header: a bad topk_idx fails its own rank
// only, as on one node, and the layout of every other rank is that of kernels/host.
TEST_F(MultinodeHostTest, LayoutErrorIsTheRanksOwn) {
  Start({1, 2});
  if (HasFatalFailure()) return;
  MakeInputs(8);
  At<int64_t>(1, layout_.in_topk_idx)[0] = -7;
  std::vector<int> tokens = {3, 3, 3};
  auto done = RunOnAll(abi::OpKind::kGetDispatchLayout, 0, tokens);
  EXPECT_EQ(done[0].status_code, 0) << Message(done[0]);
  EXPECT_EQ(done[1].status_code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(Message(done[1]).find("-7"), std::string::npos) << Message(done[1]);
  EXPECT_EQ(done[2].status_code, 0) << Message(done[2]);
  for (int r : {0, 2}) {
    std::vector<int32_t> per_rank(3), per_expert(shape_.num_experts);
    std::vector<uint8_t> in_rank(shape_.max_tokens_per_rank * 3);
    kernels::host::LayoutRankArgs a;
    a.num_tokens = 3;
    a.topk_idx = At<int64_t>(r, layout_.in_topk_idx);
    a.num_tokens_per_rank = per_rank.data();
    a.num_tokens_per_expert = per_expert.data();
    a.is_token_in_rank = in_rank.data();
    ASSERT_TRUE(kernels::host::GetDispatchLayout(shape_, a, {1}).ok());
    EXPECT_TRUE(Same(At<int32_t>(r, layout_.layout_tokens_per_rank), per_rank.data(), 3)) << r;
    EXPECT_TRUE(Same(At<int32_t>(r, layout_.layout_tokens_per_expert), per_expert.data(),
                     per_expert.size()))
        << r;
    EXPECT_TRUE(Same(At<uint8_t>(r, layout_.layout_is_token_in_rank), in_rank.data(), 3 * 3)) << r;
  }
}

// Nodes disagreeing on the op: INVALID_ARGUMENT on every node.
TEST_F(MultinodeHostTest, NodesDisagreeingOnTheOpFailEverywhere) {
  Start({1, 1});
  if (HasFatalFailure()) return;
  MakeInputs(3);
  const uint64_t a = rings_[0]->Submit(abi::OpKind::kDispatch, 0, 2);
  const uint64_t b = rings_[1]->Submit(abi::OpKind::kDispatch, abi::kFlagFp8, 2);
  for (auto [r, s] : {std::pair{0, a}, std::pair{1, b}}) {
    auto c = rings_[r]->Await(s, milliseconds(10000));
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->status_code, static_cast<int>(absl::StatusCode::kInvalidArgument)) << Message(*c);
    EXPECT_NE(Message(*c).find("nodes disagree"), std::string::npos) << Message(*c);
  }
}

// One node's request fails where it is made, and the other node submitted another op: the
// other node's rank does not get the error of a request it did not make. Rank 1's
// low-latency combine of a handle it never had is its own error (FAILED_PRECONDITION naming
// the handle); rank 0's dispatch fails with FAILED_PRECONDITION naming both nodes' ops.
TEST_F(MultinodeHostTest, AFailedRequestOfAnotherOpIsNotBlamedOnTheOtherNode) {
  Start({1, 1});
  if (HasFatalFailure()) return;
  MakeInputs(3);
  const uint64_t a = rings_[0]->Submit(abi::OpKind::kDispatch, 0, 2);
  std::this_thread::sleep_for(milliseconds(50));  // Rank 0's dispatch is collected first.
  const uint64_t b = rings_[1]->Submit(abi::OpKind::kLowLatencyCombine, 0, 2, /*handle_seq=*/0);
  auto c = rings_[0]->Await(a, milliseconds(10000));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->status_code, static_cast<int>(absl::StatusCode::kFailedPrecondition)) << Message(*c);
  EXPECT_THAT(Message(*c),
              AllOf(HasSubstr("not in step"), HasSubstr("node 0 (ranks 0-0) submitted Dispatch"),
                    HasSubstr("node 1 (ranks 1-1) submitted LowLatencyCombine")));
  c = rings_[1]->Await(b, milliseconds(10000));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->status_code, static_cast<int>(absl::StatusCode::kFailedPrecondition)) << Message(*c);
  EXPECT_THAT(Message(*c), AllOf(HasSubstr("rank 1: LowLatencyCombine: handle of op 0"),
                                 Not(HasSubstr("not in step"))));
}

// A remote rank cannot attach here; the node is chosen by the first joiner.
TEST_F(MultinodeHostTest, RemoteRankIsRefusedNamingItsNode) {
  Start({1, 2});
  if (HasFatalFailure()) return;
  v1::EndpointInfo info;
  absl::Status st = nodes_[0]->group->AttachRank(2, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("node 1"), std::string::npos) << st;
}

// A rank detaches while its spanning op waits for the other node (its client left): the op
// runs on with the rank's memory kept until it finished (the exchange and the transport
// still use it), and every other rank's op completes OK.
TEST_F(MultinodeHostTest, RankLeavingDuringASpanningOpKeepsItsMemoryForTheOp) {
  Start({2, 2});
  if (HasFatalFailure()) return;
  MakeInputs(5);
  const uint32_t flags = abi::kFlagDispatchWeights;
  std::vector<uint64_t> seqs(4);
  for (int r = 0; r < 2; ++r)
    seqs[r] = rings_[r]->Submit(abi::OpKind::kDispatch, flags, tokens_[r]);
  std::this_thread::sleep_for(milliseconds(100));  // Node 0 runs it and waits for node 1.
  nodes_[0]->group->DetachRank(1);
  for (int r = 2; r < 4; ++r)
    seqs[r] = rings_[r]->Submit(abi::OpKind::kDispatch, flags, tokens_[r]);
  for (int r : {0, 2, 3}) {
    auto c = rings_[r]->Await(seqs[r], milliseconds(5000));
    ASSERT_TRUE(c.has_value()) << "rank " << r << " got no completion";
    EXPECT_EQ(c->status_code, 0) << "rank " << r << ": " << Message(*c);
  }
}

// Without a mesh and a transport a spanning group is refused naming peer_listen.
TEST(MultinodeHostPlain, SpanningGroupNeedsThePeerListener) {
  HostDataPlaneOptions o;
  auto plane = MakeHostDataPlane(o);
  ASSERT_TRUE(plane.ok());
  v1::GroupSpec spec;
  spec.set_name("g");
  spec.set_num_ranks(2);
  spec.set_num_experts(2);
  spec.set_hidden(128);
  spec.set_num_topk(1);
  spec.set_max_tokens_per_rank(2);
  for (int n = 0; n < 2; ++n) {
    auto* ns = spec.add_nodes();
    ns->set_peer_address("h:1");
    ns->set_num_ranks(1);
  }
  auto g = (*plane)->CreateGroup(spec);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(g.status().message().find("peer_listen"), std::string::npos) << g.status();
}

// The group's join secret reaches the Peer mesh as its keyed digest, never as itself.
TEST_F(MultinodeHostTest, JoinSecretReachesTheMeshAsItsDigest) {
  join_secret_ = "s3cret";
  Start({1, 1});
  if (HasFatalFailure()) return;
  for (const auto& node : nodes_) {
    EXPECT_EQ(node->mesh->registered_join_secret_digest(),
              node->mesh->JoinSecretDigest("mn", "s3cret"));
    EXPECT_EQ(node->mesh->registered_join_secret_digest().find("s3cret"), std::string::npos);
  }
}

// A node lost mid-op: the other node's op fails within op_timeout (+ slack), naming it.
TEST_F(MultinodeHostTest, LostPeerFailsTheOpNamingTheNode) {
  Start({1, 1}, /*op_timeout_ms=*/800);
  if (HasFatalFailure()) return;
  MakeInputs(9);
  // Node 1's rank never submits; node 0's waits for it; then node 1 dies.
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t s = rings_[0]->Submit(abi::OpKind::kDispatch, 0, 2);
  std::this_thread::sleep_for(milliseconds(100));
  hub_.Kill(1);
  auto c = rings_[0]->Await(s, milliseconds(5000));
  ASSERT_TRUE(c.has_value());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(800 + 1000));
  EXPECT_EQ(c->status_code, static_cast<int>(absl::StatusCode::kUnavailable)) << Message(*c);
  EXPECT_NE(Message(*c).find("node 1"), std::string::npos) << Message(*c);
}

// The exchange's per-peer counters (metrics::Default(), docs/OPERATIONS.md): the writes and
// bytes node 0 sent node 1, the link's retransmits, and node 1 lost counted as an error.
TEST_F(MultinodeHostTest, TransportMetricsCountWritesBytesAndALostPeer) {
  Start({1, 1}, /*op_timeout_ms=*/800);
  if (HasFatalFailure()) return;
  MakeInputs(5);
  // The value of node 0's series `name` for its peer node 1 (-1 when there is none).
  auto to_node1 = [](const std::string& name) {
    const std::string text = metrics::RenderPrometheus(metrics::Default().Collect());
    const std::string prefix = name + "{group=\"mn\",peer=\"10.0.0.2:7100\",transport=";
    for (size_t at = text.find(prefix); at != std::string::npos; at = text.find(prefix, at + 1)) {
      const size_t end = text.find('\n', at);
      const size_t space = text.rfind(' ', end);
      return std::stod(text.substr(space + 1, end - space - 1));
    }
    return -1.0;
  };
  for (int i = 0; i < 2; ++i) {
    auto done = RunOnAll(abi::OpKind::kDispatch, 0, tokens_);
    for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
  }
  EXPECT_GE(to_node1("epd_transport_writes_total"), 2);
  EXPECT_GT(to_node1("epd_transport_sent_bytes_total"), 0);
  EXPECT_EQ(to_node1("epd_transport_errors_total"), 0);
  // The link's own counts, read through the exchange's probe at scrape time (FakeLink: 10 +
  // node); what it does not know has no series.
  EXPECT_EQ(to_node1("epd_transport_retransmits_total"), 11);
  EXPECT_EQ(to_node1("epd_transport_error_completions_total"), -1);
  const uint64_t s = rings_[0]->Submit(abi::OpKind::kDispatch, 0, 2);
  std::this_thread::sleep_for(milliseconds(100));
  hub_.Kill(1);
  auto c = rings_[0]->Await(s, milliseconds(5000));
  ASSERT_TRUE(c.has_value());
  EXPECT_NE(c->status_code, 0);
  EXPECT_GE(to_node1("epd_transport_errors_total") + to_node1("epd_transport_timeouts_total"), 1);
}

// A node's daemon restarts (its group torn down, registered anew: a new incarnation, its
// ranks rejoin at seq 1) while the other node's ranks stay at their later seq: after one
// failed op the group re-forms and a Dispatch is exact again.
TEST_F(MultinodeHostTest, RestartedNodeRejoinsAndTheGroupReforms) {
  Start({2, 2}, /*op_timeout_ms=*/300);
  if (HasFatalFailure()) return;
  MakeInputs(21);
  for (int i = 0; i < 3; ++i) {
    auto done = RunOnAll(abi::OpKind::kGetDispatchLayout, 0, tokens_);
    for (size_t r = 0; r < done.size(); ++r) ASSERT_EQ(done[r].status_code, 0) << Message(done[r]);
  }
  // Node 1 goes away; node 0's next op fails (bounded by op_timeout), naming node 1.
  rings_[2].reset();
  rings_[3].reset();
  nodes_[1]->group.reset();
  const uint64_t s0 = rings_[0]->Submit(abi::OpKind::kGetDispatchLayout, 0, tokens_[0]);
  const uint64_t s1 = rings_[1]->Submit(abi::OpKind::kGetDispatchLayout, 0, tokens_[1]);
  for (auto [ring, seq] : {std::pair{0, s0}, std::pair{1, s1}}) {
    auto c = rings_[ring]->Await(seq, milliseconds(5000));
    ASSERT_TRUE(c.has_value());
    EXPECT_NE(c->status_code, 0);
    EXPECT_NE(Message(*c).find("node 1"), std::string::npos) << Message(*c);
  }
  // Node 1 comes back: a new group, its ranks at seq 1.
  auto g = nodes_[1]->plane->CreateGroup(spec_);
  ASSERT_TRUE(g.ok()) << g.status();
  nodes_[1]->group = std::move(*g);
  for (int rank = 2; rank < 4; ++rank) {
    v1::EndpointInfo info;
    absl::Status st =
        nodes_[1]->group->AttachRank(rank, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info);
    ASSERT_TRUE(st.ok()) << st;
    rings_[rank] = testing::RawRing::Open(info, *nodes_[1]->group);
    ASSERT_NE(rings_[rank], nullptr);
  }
  MakeInputs(22);
  const int R = shape_.num_ranks, H = shape_.hidden;
  const int64_t N = shape_.max_recv_tokens();
  std::vector<kernels::host::DispatchRankArgs> da(R);
  std::vector<std::vector<uint8_t>> rx(R, std::vector<uint8_t>(N * H * 2));
  std::vector<std::vector<int32_t>> rsi(R, std::vector<int32_t>(N));
  std::vector<std::vector<int32_t>> rsp(R, std::vector<int32_t>(shape_.max_tokens_per_rank * R));
  std::vector<std::vector<int32_t>> rpf(R, std::vector<int32_t>(R)),
      rpe(R, std::vector<int32_t>(shape_.num_local_experts()));
  std::vector<std::vector<int64_t>> ri(R, std::vector<int64_t>(N * shape_.num_topk));
  for (int r = 0; r < R; ++r) {
    da[r].rank_prefix = rpf[r].data();
    da[r].recv_tokens_per_expert = rpe[r].data();
    da[r].recv_topk_idx = ri[r].data();
    da[r].num_tokens = tokens_[r];
    da[r].x = At<void>(r, layout_.in_x);
    da[r].topk_idx = At<int64_t>(r, layout_.in_topk_idx);
    da[r].recv_capacity = N;
    da[r].recv_x = rx[r].data();
    da[r].recv_src_info = rsi[r].data();
    da[r].send_pos = rsp[r].data();
  }
  kernels::host::DispatchOptions dopt;
  dopt.expert_alignment = 1;
  const absl::Status ref = kernels::host::Dispatch(shape_, dopt, da, {1});
  ASSERT_TRUE(ref.ok()) << ref;
  auto done = RunOnAll(abi::OpKind::kDispatch, 0, tokens_);
  for (int r = 0; r < R; ++r) {
    ASSERT_EQ(done[r].status_code, 0) << "rank " << r << ": " << Message(done[r]);
    const int n = da[r].num_recv_tokens;
    EXPECT_EQ(*At<int32_t>(r, layout_.recv_count), n) << r;
    EXPECT_TRUE(Same(At<uint8_t>(r, layout_.recv_x), rx[r].data(), n * 2 * H)) << r;
    EXPECT_TRUE(Same(At<int32_t>(r, layout_.recv_src_info), rsi[r].data(), n)) << r;
  }
}

// A node whose daemon has not (or no longer) registered the group: the op waits, bounded
// by op_timeout, and fails naming the node and that it has not joined.
TEST_F(MultinodeHostTest, MissingNodeTimesOutNamingIt) {
  Start({1, 1}, /*op_timeout_ms=*/300);
  if (HasFatalFailure()) return;
  MakeInputs(2);
  rings_.resize(1);
  nodes_[1]->group.reset();  // Node 1 leaves: its registration and link go.
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t s = rings_[0]->Submit(abi::OpKind::kDispatch, 0, 1);
  auto c = rings_[0]->Await(s, milliseconds(5000));
  ASSERT_TRUE(c.has_value());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(300 + 1000));
  EXPECT_EQ(c->status_code, static_cast<int>(absl::StatusCode::kDeadlineExceeded)) << Message(*c);
  EXPECT_NE(Message(*c).find("node 1 (10.0.0.2:7100"), std::string::npos) << Message(*c);
  EXPECT_NE(Message(*c).find("has not joined"), std::string::npos) << Message(*c);
  // Why the node is missing comes before the transport's "not connected" (the message is cut).
  EXPECT_NE(Message(*c).find("is not connected"), std::string::npos) << Message(*c);
  EXPECT_LT(Message(*c).find("has not joined"), Message(*c).find("is not connected"))
      << Message(*c);
}

// A node whose transport descriptor the others refuse (RDMA: another qps_per_peer or link
// layer): the op times out, and its message says why that node is not connected.
TEST_F(MultinodeHostTest, RefusedDescriptorIsNamedWhenTheOpTimesOut) {
  node1_descriptor_ = "other-qps";
  Start({1, 1}, /*op_timeout_ms=*/300);
  if (HasFatalFailure()) return;
  MakeInputs(2);
  const uint64_t s = rings_[0]->Submit(abi::OpKind::kDispatch, 0, 1);
  auto c = rings_[0]->Await(s, milliseconds(5000));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->status_code, static_cast<int>(absl::StatusCode::kDeadlineExceeded)) << Message(*c);
  EXPECT_NE(Message(*c).find("node 1 (10.0.0.2:7100, rank 1) is not connected (bad descriptor "
                             "other-qps)"),
            std::string::npos)
      << Message(*c);
}

// A rank that leaves while its node's op waits for another node (its client was killed
// mid-op), with or without a new client taking its place at once: the op runs on with the
// departed rank's memory kept for it, every other rank's op completes OK, and the new
// client's endpoint is not part of the op.
class RankLeavingMidOpTest : public MultinodeHostTest,
                             public ::testing::WithParamInterface<bool> {};

TEST_P(RankLeavingMidOpTest, TheOpCompletesForTheOthers) {
  const bool reattach = GetParam();
  Start({2, 1});
  if (HasFatalFailure()) return;
  MakeInputs(3);
  const uint64_t a = rings_[0]->Submit(abi::OpKind::kLowLatencyDispatch, 0, tokens_[0]);
  const uint64_t b = rings_[1]->Submit(abi::OpKind::kLowLatencyDispatch, 0, tokens_[1]);
  // Node 0 starts the op once both its ranks arrived, then waits for node 1's message.
  std::this_thread::sleep_for(milliseconds(200));
  nodes_[0]->group->DetachRank(1);
  if (reattach) {  // A new client takes rank 1 while the op still waits: not part of it.
    v1::EndpointInfo info;
    ASSERT_TRUE(nodes_[0]->group->AttachRank(1, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info).ok());
  }
  const uint64_t c = rings_[2]->Submit(abi::OpKind::kLowLatencyDispatch, 0, tokens_[2]);
  for (auto [ring, seq] : {std::pair{0, a}, std::pair{2, c}}) {
    auto done = rings_[ring]->Await(seq, milliseconds(5000));
    ASSERT_TRUE(done.has_value()) << "rank " << ring;
    EXPECT_EQ(done->status_code, 0) << "rank " << ring << ": " << Message(*done);
  }
  (void)b;
}

INSTANTIATE_TEST_SUITE_P(MultinodeHostTest, RankLeavingMidOpTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "AnotherClientTakesItsPlace" : "NoneTakesItsPlace";
                         });

// A peer that never sends: DEADLINE_EXCEEDED within op_timeout, naming the node's ranks.
TEST_F(MultinodeHostTest, SilentPeerTimesOutNamingTheNode) {
  Start({1, 2}, /*op_timeout_ms=*/300);
  if (HasFatalFailure()) return;
  MakeInputs(4);
  // Rank 2 of node 1 never arrives: node 1 times out and tells node 0.
  const uint64_t a = rings_[0]->Submit(abi::OpKind::kDispatch, 0, 1);
  const uint64_t b = rings_[1]->Submit(abi::OpKind::kDispatch, 0, 1);
  for (auto [r, s] : {std::pair{0, a}, std::pair{1, b}}) {
    auto c = rings_[r]->Await(s, milliseconds(5000));
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(c->status_code, static_cast<int>(absl::StatusCode::kDeadlineExceeded)) << Message(*c);
    EXPECT_NE(Message(*c).find("2"), std::string::npos) << Message(*c);
  }
}

// A joined rank of node 1 that never submits: node 1 fails the op at its op_timeout naming
// the rank and tells node 0, which waits op_timeout plus the grace (min(1 s, op_timeout))
// for a live peer, so node 0's ranks get the same error, naming rank 3, within the bound.
TEST_F(MultinodeHostTest, SilentRankIsNamedOnEveryNode) {
  constexpr int kTimeoutMs = 300;
  Start({2, 2}, kTimeoutMs);
  if (HasFatalFailure()) return;
  MakeInputs(11);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::pair<int, uint64_t>> subs;
    subs.push_back({0, rings_[0]->Submit(abi::OpKind::kDispatch, 0, 1)});
    subs.push_back({1, rings_[1]->Submit(abi::OpKind::kDispatch, 0, 1)});
    // Node 1's op (and its op_timeout) starts later than node 0's: without the grace
    // node 0 would give up first and name only node 1.
    std::this_thread::sleep_for(milliseconds(100));
    subs.push_back({2, rings_[2]->Submit(abi::OpKind::kDispatch, 0, 1)});
    for (auto [r, s] : subs) {
      auto c = rings_[r]->Await(s, milliseconds(5000));
      ASSERT_TRUE(c.has_value()) << "rank " << r;
      EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(2 * kTimeoutMs + 1000 + 100))
          << "rank " << r;
      EXPECT_EQ(c->status_code, static_cast<int>(absl::StatusCode::kDeadlineExceeded))
          << "rank " << r << ": " << Message(*c);
      EXPECT_NE(Message(*c).find("rank(s) 3 did not arrive within op_timeout"), std::string::npos)
          << "rank " << r << ": " << Message(*c);
    }
    // Rank 3 comes late: its op failed already, so it gets the same error.
    const uint64_t late = rings_[3]->Submit(abi::OpKind::kDispatch, 0, 1);
    auto c = rings_[3]->Await(late, milliseconds(5000));
    ASSERT_TRUE(c.has_value());
    EXPECT_NE(c->status_code, 0);
  }
}

// A node whose ranks joined but none submits sends nothing: its Peer service and link are
// alive, so node 0 waits op_timeout plus the grace, then fails naming node 1 (not sooner,
// not later than the bound).
TEST_F(MultinodeHostTest, SilentLiveNodeTimesOutAfterTheGrace) {
  constexpr int kTimeoutMs = 300;
  Start({1, 1}, kTimeoutMs);
  if (HasFatalFailure()) return;
  MakeInputs(12);
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t s = rings_[0]->Submit(abi::OpKind::kDispatch, 0, 1);
  auto c = rings_[0]->Await(s, milliseconds(5000));
  ASSERT_TRUE(c.has_value());
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited, milliseconds(2 * kTimeoutMs));
  EXPECT_LT(waited, milliseconds(2 * kTimeoutMs + 1000));
  EXPECT_EQ(c->status_code, static_cast<int>(absl::StatusCode::kDeadlineExceeded)) << Message(*c);
  EXPECT_NE(Message(*c).find("node 1 (10.0.0.2:7100, ranks 1-1) sent nothing within op_timeout "
                             "300 ms (+ 300 ms grace for a live peer)"),
            std::string::npos)
      << Message(*c);
}

// Garbage in the receive region (a hostile peer): the op fails with an error, nothing is
// read out of bounds (ASan), and the honest node reports it.
// A peer's failure header with control bytes in its message: the ranks get the peer's error
// code and text with those bytes escaped.
TEST_F(MultinodeHostTest, APeersErrorTextIsEscaped) {
  hub_.Hostile(1, [](uint8_t* base, uint64_t offset, uint64_t bytes) {
    abi::ExchangeHeader h;
    if (bytes < sizeof h) return;
    std::memcpy(&h, base + offset, sizeof h);
    if (h.magic != abi::kExchangeMagic) return;
    const char text[] =
        "evil\n\x1b[2J\x01"
        "end";
    h.status_code = static_cast<int32_t>(absl::StatusCode::kInvalidArgument);
    h.message_bytes = sizeof text - 1;
    std::memcpy(h.message, text, sizeof text - 1);
    std::memcpy(base + offset, &h, sizeof h);
  });
  Start({1, 1});
  if (HasFatalFailure()) return;
  MakeInputs(6);
  auto done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, {2, 2});
  EXPECT_EQ(done[0].status_code, static_cast<int>(absl::StatusCode::kInvalidArgument))
      << Message(done[0]);
  EXPECT_EQ(Message(done[0]), "evil\\x0a\\x1b[2J\\x01end");
}

TEST_F(MultinodeHostTest, GarbageFromAPeerIsAnErrorNotACrash) {
  for (int mode = 0; mode < 3; ++mode) {
    SCOPED_TRACE(::testing::Message() << "mode " << mode);
    rings_.clear();
    nodes_.clear();
    node_of_.clear();
    spec_.Clear();
    hub_.Hostile(1, [mode](uint8_t* base, uint64_t offset, uint64_t bytes) {
      if (mode == 0) {
        std::memset(base + offset, 0xFF, bytes);  // Everything.
      } else if (bytes > 512 && mode == 1) {
        std::memset(base + offset + 512, 0x7F, bytes - 512);  // Counts and rows, not the header.
      } else if (mode == 2 && bytes >= 8) {
        base[offset + bytes - 1] ^= 0x55;  // A flipped byte in each piece.
      }
    });
    Start({1, 1});
    if (HasFatalFailure()) return;
    MakeInputs(5);
    std::vector<int> tokens = {4, 4};
    auto done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens);
    // Node 0 must not report success with garbage it could not check, unless mode 2 only
    // touched values (then the op may succeed with wrong bytes from the peer, which it sent).
    if (mode < 2) EXPECT_NE(done[0].status_code, 0) << Message(done[0]);
    done = RunOnAll(abi::OpKind::kLowLatencyDispatch, 0, tokens);
    if (mode < 2) EXPECT_NE(done[0].status_code, 0) << Message(done[0]);
    hub_.Hostile(1, [](uint8_t*, uint64_t, uint64_t) {});
  }
}

// Token ids a peer sent that are out of range are the peer's data fault: DATA_LOSS naming
// its node and address, not INVALID_ARGUMENT naming a rank of this node.
TEST_F(MultinodeHostTest, APeersBadTokenIdsAreDataLossNamingTheNode) {
  for (const bool ll : {false, true}) {
    SCOPED_TRACE(ll ? "low-latency dispatch" : "dispatch");
    rings_.clear();
    nodes_.clear();
    node_of_.clear();
    spec_.Clear();
    auto slot = std::make_shared<std::atomic<int64_t>>(-1);
    hub_.Hostile(1, [this, slot](uint8_t* base, uint64_t offset, uint64_t bytes) {
      uint32_t magic = 0;
      if (bytes >= sizeof(abi::ExchangeHeader)) std::memcpy(&magic, base + offset, sizeof magic);
      if (magic == abi::kExchangeMagic) *slot = static_cast<int64_t>(offset);
      if (*slot < 0) return;
      // After every piece of the message (whichever comes last): every row's token id far
      // beyond the group's tokens per rank.
      const abi::ExchangeShape xs{
          shape_.num_ranks, shape_.num_experts,         shape_.hidden,
          shape_.num_topk,  shape_.max_tokens_per_rank, shape_.ll_max_tokens_per_rank};
      const abi::ExchangeSlotLayout sl = abi::ExchangeSlotLayout::Compute(xs, 1, 1);
      uint8_t* blk = base + *slot + sl.payload;
      for (uint64_t i = 0; i < sl.block_rows; ++i) {
        const int32_t id = INT32_MAX - static_cast<int32_t>(i);
        std::memcpy(blk + sl.ids + 4 * i, &id, 4);
      }
    });
    Start({1, 1}, 2000, /*fp8=*/false);
    if (HasFatalFailure()) return;
    MakeInputs(11);
    auto done = ll ? RunOnAll(abi::OpKind::kLowLatencyDispatch, 0, {4, 5})
                   : RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, {4, 6});
    EXPECT_EQ(done[0].status_code, static_cast<int>(absl::StatusCode::kDataLoss))
        << Message(done[0]);
    EXPECT_THAT(Message(done[0]), AllOf(HasSubstr("node 1 (10.0.0.2:7100) sent token index"),
                                        HasSubstr("of rank 1, not ascending within [0, ")));
    hub_.Hostile(1, [](uint8_t*, uint64_t, uint64_t) {});
  }
}

// A peer holding the secret may write its next message into the slot as soon as the
// previous one's immediate arrived, while this node still runs the op on it. Here node 1's
// token ids, topk_idx and cached send_pos are rewritten in node 0's receive slot after the
// kernels checked them and before they write the outputs (send_pos far out of range: a
// write out of bounds if it were used). Node 0 reads only what it copied out of the slot
// before the checks: every op completes with the outputs of an undisturbed run.
TEST_F(MultinodeHostTest, PeerRewritingItsSlotMidOpChangesNothing) {
  // Shared with the hooks, which the fixture's planes and hub may outlive the test body with.
  struct Hooks {
    std::atomic<uint8_t*> region{nullptr};
    std::atomic<uint64_t> slot{0};
    std::atomic<bool> armed{false};
    std::atomic<int> rewrites{0};
  };
  auto hooks = std::make_shared<Hooks>();
  std::atomic<uint8_t*>& region = hooks->region;
  std::atomic<uint64_t>& slot = hooks->slot;
  std::atomic<bool>& armed = hooks->armed;
  std::atomic<int>& rewrites = hooks->rewrites;
  hub_.Hostile(1, [hooks](uint8_t* base, uint64_t offset, uint64_t bytes) {
    std::atomic<uint8_t*>& region = hooks->region;
    std::atomic<uint64_t>& slot = hooks->slot;
    uint32_t magic = 0;
    if (bytes < sizeof(abi::ExchangeHeader)) return;
    std::memcpy(&magic, base + offset, sizeof magic);
    if (magic != abi::kExchangeMagic) return;
    slot = offset;  // The header opens the slot of node 1's message.
    region = base;
  });
  node0_inputs_checked_ = [this, hooks] {
    std::atomic<uint8_t*>& region = hooks->region;
    std::atomic<uint64_t>& slot = hooks->slot;
    std::atomic<bool>& armed = hooks->armed;
    std::atomic<int>& rewrites = hooks->rewrites;
    if (!armed || region.load() == nullptr) return;
    const abi::ExchangeShape xs{
        shape_.num_ranks, shape_.num_experts,         shape_.hidden,
        shape_.num_topk,  shape_.max_tokens_per_rank, shape_.ll_max_tokens_per_rank};
    const abi::ExchangeSlotLayout sl = abi::ExchangeSlotLayout::Compute(xs, 1, 1);
    uint8_t* blk = region.load() + slot.load() + sl.payload;
    const int64_t C = static_cast<int64_t>(sl.block_rows), K = shape_.num_topk;
    const int64_t R = shape_.num_ranks;
    for (int64_t i = 0; i < C; ++i) {
      const int32_t id = INT32_MAX - static_cast<int32_t>(i);
      std::memcpy(blk + sl.ids + 4 * i, &id, 4);
    }
    const int64_t expert0 = 0;  // Every row to rank 0, more than its counts say.
    for (int64_t i = 0; i < C * K; ++i) std::memcpy(blk + sl.idx + 8 * i, &expert0, 8);
    const int32_t far = 1 << 30;
    for (int64_t i = 0; i < C * R; ++i) std::memcpy(blk + sl.pos + 4 * i, &far, 4);
    ++rewrites;
  };
  Start({1, 1}, 2000, /*fp8=*/false);
  if (HasFatalFailure()) return;
  MakeInputs(11);
  const std::vector<int> tokens = {4, 6};
  const int K = shape_.num_topk, H = shape_.hidden, El = shape_.num_local_experts();
  auto snapshot = [&](const std::vector<kernels::Region>& regions) {
    std::vector<uint8_t> out;
    for (const kernels::Region& r : regions) {
      const uint8_t* p = At<uint8_t>(0, r);
      out.insert(out.end(), p, p + r.bytes);
    }
    return out;
  };
  auto clear = [&](const std::vector<kernels::Region>& regions) {
    for (const kernels::Region& r : regions) std::memset(At<uint8_t>(0, r), 0, r.bytes);
  };
  const std::vector<kernels::Region> normal = {layout_.recv_x,
                                               layout_.recv_src_info,
                                               layout_.recv_topk_idx,
                                               layout_.recv_topk_weights,
                                               layout_.recv_count,
                                               layout_.rank_prefix,
                                               layout_.recv_tokens_per_expert};

  // Normal dispatch, undisturbed and then rewritten mid-op.
  clear(normal);
  auto done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens);
  ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
  const int32_t num_recv = *At<int32_t>(0, layout_.recv_count);
  ASSERT_GT(num_recv, 0);
  const std::vector<uint8_t> want = snapshot(normal);
  clear(normal);
  armed = true;
  done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens);
  armed = false;
  EXPECT_EQ(rewrites.exchange(0), 1);
  ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
  const uint64_t dispatch_seq = last_seq_;
  EXPECT_TRUE(snapshot(normal) == want) << "dispatch outputs changed by the rewrite";
  for (int32_t i = 0; i < num_recv; ++i) {
    const int32_t src = At<int32_t>(0, layout_.recv_src_info)[i];
    EXPECT_TRUE(src >= 0 && src < shape_.num_ranks * shape_.max_tokens_per_rank) << src;
    for (int k = 0; k < K; ++k) {
      const int64_t e = At<int64_t>(0, layout_.recv_topk_idx)[int64_t{i} * K + k];
      EXPECT_TRUE(e >= -1 && e < El) << e;
    }
  }

  // Cached dispatch of the second dispatch's handle: the rewritten send_pos would land rows
  // 2^30 rows past the receive buffer.
  clear({layout_.recv_x});
  armed = true;
  done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagCachedHandle, tokens, dispatch_seq);
  armed = false;
  EXPECT_EQ(rewrites.exchange(0), 1);
  ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
  EXPECT_TRUE(Same(At<uint8_t>(0, layout_.recv_x), want.data(), int64_t{num_recv} * 2 * H));

  // Low-latency dispatch: undisturbed into one buffer, rewritten into the other.
  const std::vector<int> ll_tokens = {4, 5};
  done = RunOnAll(abi::OpKind::kLowLatencyDispatch, 0, ll_tokens);
  ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
  const int b0 = done[0].buffer;
  const std::vector<uint8_t> ll_want =
      snapshot({layout_.ll_recv_x[b0], layout_.ll_recv_src_info[b0], layout_.ll_recv_count[b0]});
  armed = true;
  done = RunOnAll(abi::OpKind::kLowLatencyDispatch, 0, ll_tokens);
  armed = false;
  EXPECT_EQ(rewrites.exchange(0), 1);
  ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
  const int b1 = done[0].buffer;
  ASSERT_NE(b0, b1);
  const int32_t* count = At<int32_t>(0, layout_.ll_recv_count[b1]);
  const int64_t rows = shape_.ll_rows_per_expert();
  const auto* want_count = reinterpret_cast<const int32_t*>(
      ll_want.data() + layout_.ll_recv_x[b0].bytes + layout_.ll_recv_src_info[b0].bytes);
  const auto* want_src =
      reinterpret_cast<const int32_t*>(ll_want.data() + layout_.ll_recv_x[b0].bytes);
  for (int j = 0; j < El; ++j) {
    ASSERT_EQ(count[j], want_count[j]) << "expert " << j;
    EXPECT_TRUE(Same(At<uint8_t>(0, layout_.ll_recv_x[b1]) + j * rows * 2 * H,
                     ll_want.data() + j * rows * 2 * H, int64_t{count[j]} * 2 * H))
        << "expert " << j;
    EXPECT_TRUE(Same(At<int32_t>(0, layout_.ll_recv_src_info[b1]) + j * rows, want_src + j * rows,
                     count[j]))
        << "expert " << j;
  }
}

// ---- Rank masking across nodes (RANK_FAILURE_POLICY_MASK; DESIGN.md §5.1 "Rank masking")

class MultinodeMaskTest : public MultinodeHostTest {
 protected:
  /// Submits op on every rank that has a ring and waits for their completions ([R]; a rank
  /// without a ring gets an empty one).
  /// `handles`: each rank's handle (its dispatch's seq; the nodes number ops on their own).
  std::vector<abi::Completion> RunOnLive(abi::OpKind op, uint32_t flags,
                                         const std::vector<int>& tokens,
                                         const std::vector<uint64_t>& handles = {}) {
    std::vector<uint64_t>& seqs = live_seqs_;
    seqs.assign(rings_.size(), 0);
    for (size_t r = 0; r < rings_.size(); ++r) {
      if (rings_[r])
        seqs[r] = rings_[r]->Submit(op, flags, tokens[r], handles.empty() ? 0 : handles[r]);
    }
    std::vector<abi::Completion> out(rings_.size());
    for (size_t r = 0; r < rings_.size(); ++r) {
      if (!rings_[r]) continue;
      auto c = rings_[r]->Await(seqs[r], milliseconds(10000));
      EXPECT_TRUE(c.has_value()) << "rank " << r << " got no completion";
      out[r] = c.value_or(abi::Completion{});
    }
    return out;
  }
  std::vector<uint64_t> live_seqs_;  ///< RunOnLive's seqs, per rank.

  /// One low-latency dispatch and combine, then a normal dispatch and combine, on the ranks
  /// with a ring, while the ranks in `masked` are masked (left, or on a lost node): every
  /// result equals kernels/host on the whole group with the pairs routed to the masked
  /// ranks' experts dropped and the masked ranks sending nothing; every completion reports
  /// the same mask (num_masked, one epoch, never going back) and this rank's dropped pairs.
  void RoundMatches(const std::vector<int>& masked, uint64_t seed, uint32_t* epoch) {
    const int R = shape_.num_ranks, K = shape_.num_topk, H = shape_.hidden;
    const int El = shape_.num_local_experts();
    MakeInputs(seed);
    std::vector<uint8_t> m(R, 0);
    for (int r : masked) m[r] = 1;
    // The reference's inputs: masked ranks send nothing; pairs to their experts dropped.
    std::vector<int> ll_tokens(R);
    std::vector<std::vector<int64_t>> idx(R);
    std::vector<int32_t> dropped(R, 0);
    for (int r = 0; r < R; ++r) {
      if (m[r]) tokens_[r] = 0;
      ll_tokens[r] = std::min(tokens_[r], shape_.ll_max_tokens_per_rank);
      const int64_t* in = At<int64_t>(r, layout_.in_topk_idx);
      idx[r].assign(in, in + shape_.max_input_tokens() * K);
    }
    // ---- low-latency dispatch and combine (dropped pairs over the LL tokens)
    std::vector<std::vector<int64_t>> ll_idx = idx;
    for (int r = 0; r < R; ++r) {
      dropped[r] = kernels::host::DropMaskedExperts(shape_, m, ll_tokens[r], ll_idx[r].data());
    }
    const int64_t rows = shape_.ll_rows_per_expert();
    std::vector<const int64_t*> ll_in(R), n_in(R);
    for (int r = 0; r < R; ++r) ll_in[r] = ll_idx[r].data();
    Reference ref;
    ASSERT_TRUE(RefLowLatencyDispatch({}, ll_tokens, ll_in, &ref).ok());
    const auto& lx = ref.lx;
    const auto &lc = ref.lc, &lsi = ref.lsi;
    auto check_mask = [&](const std::vector<abi::Completion>& done, const char* what) {
      std::optional<uint32_t> e;
      for (int r = 0; r < R; ++r) {
        if (!rings_[r]) continue;
        ASSERT_EQ(done[r].status_code, 0) << what << " rank " << r << ": " << Message(done[r]);
        EXPECT_EQ(done[r].num_masked, masked.size()) << what << " rank " << r;
        EXPECT_EQ(done[r].dropped_pairs, dropped[r]) << what << " rank " << r;
        if (e) EXPECT_EQ(done[r].mask_epoch, *e) << what << " rank " << r << ": every node agrees";
        e = done[r].mask_epoch;
      }
      if (e) {
        EXPECT_GE(*e, *epoch) << what << ": the epoch never goes back";
        if (masked.empty() && *epoch == 0) EXPECT_EQ(*e, 0u);
        *epoch = *e;
      }
    };
    auto done = RunOnLive(abi::OpKind::kLowLatencyDispatch, 0, ll_tokens);
    const std::vector<uint64_t> ll_seq = live_seqs_;
    check_mask(done, "LowLatencyDispatch");
    if (HasFatalFailure()) return;
    for (int r = 0; r < R; ++r) {
      if (!rings_[r] || m[r]) continue;
      const int b = done[r].buffer;
      EXPECT_TRUE(Same(At<int32_t>(r, layout_.ll_recv_count[b]), lc[r].data(), El)) << r;
      for (int j = 0; j < El; ++j) {
        EXPECT_TRUE(Same(At<uint8_t>(r, layout_.ll_recv_x[b]) + j * rows * 2 * H,
                         lx[r].data() + j * rows * 2 * H, lc[r][j] * 2 * H))
            << r;
        EXPECT_TRUE(Same(At<int32_t>(r, layout_.ll_recv_src_info[b]) + j * rows,
                         lsi[r].data() + j * rows, lc[r][j]))
            << r;
      }
    }
    ASSERT_TRUE(RefLowLatencyCombine(ll_tokens, ll_in, &ref).ok());
    done = RunOnLive(abi::OpKind::kLowLatencyCombine, 0, ll_tokens, ll_seq);
    check_mask(done, "LowLatencyCombine");
    if (HasFatalFailure()) return;
    for (int r = 0; r < R; ++r) {
      if (!rings_[r] || m[r]) continue;
      EXPECT_TRUE(Same(At<bf16_bits>(r, layout_.ll_combined_x[done[r].buffer]), ref.lcx[r].data(),
                       ll_tokens[r] * H))
          << r;
    }
    // ---- normal dispatch (BF16) and combine
    std::vector<std::vector<int64_t>> n_idx = idx;
    for (int r = 0; r < R; ++r) {
      dropped[r] = kernels::host::DropMaskedExperts(shape_, m, tokens_[r], n_idx[r].data());
    }
    for (int r = 0; r < R; ++r) n_in[r] = n_idx[r].data();
    ASSERT_TRUE(RefDispatch(/*fp8=*/false, n_in, &ref).ok());
    const auto& da = ref.da;
    const auto& rx = ref.rx;
    const auto &rsi = ref.rsi, &rsp = ref.rsp, &rpf = ref.rpf;
    done = RunOnLive(abi::OpKind::kDispatch, 0, tokens_);
    const std::vector<uint64_t> dispatch_seq = live_seqs_;
    check_mask(done, "Dispatch");
    if (HasFatalFailure()) return;
    for (int r = 0; r < R; ++r) {
      if (!rings_[r] || m[r]) continue;
      const int n = da[r].num_recv_tokens;
      EXPECT_EQ(*At<int32_t>(r, layout_.recv_count), n) << r;
      EXPECT_TRUE(Same(At<uint8_t>(r, layout_.recv_x), rx[r].data(), n * 2 * H)) << r;
      EXPECT_TRUE(Same(At<int32_t>(r, layout_.recv_src_info), rsi[r].data(), n)) << r;
      EXPECT_TRUE(Same(At<int32_t>(r, layout_.rank_prefix), rpf[r].data(), R)) << r;
      EXPECT_TRUE(Same(At<int32_t>(r, layout_.send_pos), rsp[r].data(), tokens_[r] * R)) << r;
    }
    ASSERT_TRUE(RefCombine(/*weights=*/false, &ref).ok());
    std::fill(dropped.begin(), dropped.end(), 0);  // Its routes were dropped at the dispatch.
    done = RunOnLive(abi::OpKind::kCombine, 0, tokens_, dispatch_seq);
    check_mask(done, "Combine");
    if (HasFatalFailure()) return;
    for (int r = 0; r < R; ++r) {
      if (!rings_[r] || m[r]) continue;
      EXPECT_TRUE(Same(At<bf16_bits>(r, layout_.combined_x), ref.cx[r].data(), tokens_[r] * H))
          << r;
    }
  }

  /// The exchange slot a node of one rank sends (two nodes of one rank each).
  abi::ExchangeSlotLayout OneRankSlot() const {
    return abi::ExchangeSlotLayout::Compute(
        {shape_.num_ranks, shape_.num_experts, shape_.hidden, shape_.num_topk,
         shape_.max_tokens_per_rank, shape_.ll_max_tokens_per_rank},
        1, 1);
  }

  /// Whether a write of `bytes` at `offset` of a peer's region is an OK message's header
  /// and mask (what a Hostile rewrite of the mask or its epoch targets).
  static bool CarriesMask(const abi::ExchangeSlotLayout& sl, const uint8_t* base, uint64_t offset,
                          uint64_t bytes) {
    uint32_t magic = 0;
    if (bytes >= sl.tokens) std::memcpy(&magic, base + offset, sizeof magic);
    return magic == abi::kExchangeMagic;
  }

  /// Attaches rank `rank` to node `n`'s group anew (a new process in its slot).
  void Reattach(int n, int rank) {
    v1::EndpointInfo info;
    absl::Status st =
        nodes_[n]->group->AttachRank(rank, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info);
    ASSERT_TRUE(st.ok()) << st;
    rings_[rank] = testing::RawRing::Open(info, *nodes_[n]->group);
    ASSERT_NE(rings_[rank], nullptr);
  }
};

// A rank of node 1 leaves (its process died): node 1 masks it, node 0 learns it from node
// 1's header, and every op of every node completes without it, exact, reporting one mask.
// A new process in its slot is unmasked at the next op boundary and the group is whole.
TEST_F(MultinodeMaskTest, RankLeavingOnOneNodeIsMaskedOnEveryNodeThenRejoins) {
  mask_ = true;
  Start({2, 2});
  if (HasFatalFailure()) return;
  uint32_t epoch = 0;
  RoundMatches({}, 31, &epoch);
  if (HasFatalFailure()) return;
  rings_[3].reset();
  nodes_[1]->group->DetachRank(3);
  RoundMatches({3}, 32, &epoch);
  if (HasFatalFailure()) return;
  EXPECT_GE(epoch, 1u);
  RoundMatches({3}, 33, &epoch);  // Still masked; the epoch stays.
  if (HasFatalFailure()) return;
  // Every node's QueryRankMask names the group's masked ranks with the ops' epoch.
  for (int n = 0; n < 2; ++n) {
    absl::StatusOr<v1::RankMask> q = nodes_[n]->group->GetRankMask();
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_EQ(q->epoch(), epoch) << "node " << n;
    EXPECT_THAT(q->masked_ranks(), ::testing::ElementsAre(3)) << "node " << n;
  }
  // A rank of another node is masked at its own node's daemon.
  const int32_t other[1] = {3};
  EXPECT_EQ(nodes_[0]->group->UpdateRankMask(other, {}, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const uint32_t masked_epoch = epoch;
  // A rank of node 0 leaves too: two nodes' masks at once.
  rings_[0].reset();
  nodes_[0]->group->DetachRank(0);
  RoundMatches({0, 3}, 34, &epoch);
  if (HasFatalFailure()) return;
  EXPECT_GT(epoch, masked_epoch);
  Reattach(1, 3);
  Reattach(0, 0);
  if (HasFatalFailure()) return;
  RoundMatches({}, 35, &epoch);
}

// The same through the mirrors with the received rows gathered (DESIGN.md §5.5 "Rows on
// the GPU"), as the CUDA backend's daemon-launched ranks run: a masked rank gets no table
// (its stand-in's rows are copied), the others' rows are gathered, every result exact.
TEST_F(MultinodeMaskTest, RankLeavingIsMaskedWithTheReceivedRowsGathered) {
  mask_ = true;
  Start({2, 2}, 2000, /*fp8=*/true, 512, /*mirror=*/true, /*gather=*/true);
  if (HasFatalFailure()) return;
  uint32_t epoch = 0;
  RoundMatches({}, 41, &epoch);
  if (HasFatalFailure()) return;
  rings_[3].reset();
  nodes_[1]->group->DetachRank(3);
  RoundMatches({3}, 42, &epoch);
  if (HasFatalFailure()) return;
  rings_[0].reset();
  nodes_[0]->group->DetachRank(0);
  RoundMatches({0, 3}, 43, &epoch);
  if (HasFatalFailure()) return;
  Reattach(1, 3);
  Reattach(0, 0);
  if (HasFatalFailure()) return;
  RoundMatches({}, 44, &epoch);
}

// A peer daemon is lost (its group gone: killed) under MASK: node 0's ops complete without
// node 1's rank, exact; once node 1 is back and its rank joins, the group is whole again.
TEST_F(MultinodeMaskTest, LostPeerIsMaskedAndARestartedPeerRejoins) {
  mask_ = true;
  Start({2, 1}, /*op_timeout_ms=*/1000);
  if (HasFatalFailure()) return;
  uint32_t epoch = 0;
  RoundMatches({}, 41, &epoch);
  if (HasFatalFailure()) return;
  rings_[2].reset();
  nodes_[1]->group.reset();
  const auto t0 = std::chrono::steady_clock::now();
  RoundMatches({2}, 42, &epoch);
  if (HasFatalFailure()) return;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(1000)) << "not after op_timeout";
  EXPECT_GE(epoch, 1u);
  RoundMatches({2}, 43, &epoch);
  if (HasFatalFailure()) return;
  // Node 1 restarts: a new group (a new incarnation) and its rank at seq 1.
  auto g = nodes_[1]->plane->CreateGroup(spec_, GroupCreateOptions{join_secret_});
  ASSERT_TRUE(g.ok()) << g.status();
  nodes_[1]->group = std::move(*g);
  Reattach(1, 2);
  if (HasFatalFailure()) return;
  std::this_thread::sleep_for(milliseconds(200));  // Both ends re-form the link.
  RoundMatches({}, 44, &epoch);
}

// Three nodes: a rank leaving on node 1, then node 2 lost, are masked alike on every node
// (the op's mask is each node's own ranks' bits plus a lost node's ranks, one epoch).
TEST_F(MultinodeMaskTest, ThreeNodesAgreeOnEveryMask) {
  mask_ = true;
  Start({1, 2, 1}, /*op_timeout_ms=*/1000);
  if (HasFatalFailure()) return;
  uint32_t epoch = 0;
  RoundMatches({}, 51, &epoch);
  if (HasFatalFailure()) return;
  rings_[2].reset();
  nodes_[1]->group->DetachRank(2);
  RoundMatches({2}, 52, &epoch);
  if (HasFatalFailure()) return;
  rings_[3].reset();
  nodes_[2]->group.reset();
  RoundMatches({2, 3}, 53, &epoch);
  if (HasFatalFailure()) return;
  Reattach(1, 2);
  if (HasFatalFailure()) return;
  RoundMatches({3}, 54, &epoch);
}

// A peer's mask naming a rank beyond the group is DATA_LOSS naming the node.
TEST_F(MultinodeMaskTest, AMaskBitBeyondTheGroupIsDataLossNamingTheNode) {
  mask_ = true;
  Start({1, 1});
  if (HasFatalFailure()) return;
  MakeInputs(3);
  hub_.Hostile(1, [this](uint8_t* base, uint64_t offset, uint64_t bytes) {
    const abi::ExchangeSlotLayout sl = OneRankSlot();
    if (CarriesMask(sl, base, offset, bytes)) base[offset + sl.mask] |= 0x80;  // Rank 7 of 2.
  });
  auto done = RunOnAll(abi::OpKind::kDispatch, 0, tokens_);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(done[r].status_code,
              r == 0 ? static_cast<int>(absl::StatusCode::kDataLoss) : done[r].status_code)
        << Message(done[r]);
  }
  EXPECT_THAT(Message(done[0]), AllOf(HasSubstr("node 1"), HasSubstr("rank 7")));
}

// A peer's mask epoch is checked before it is used (DESIGN.md §5.1 "Rank masking"): one
// past the limit (here the last before a wrap), one leading this node's by more than
// kMaxMaskEpochAhead, or one below what the peer brought to the last op is DATA_LOSS naming
// the node; the epoch this node reports never wraps nor goes back.
TEST_F(MultinodeMaskTest, APeerMaskEpochThatWrapsLeapsOrGoesBackIsDataLoss) {
  mask_ = true;
  Start({1, 1});
  if (HasFatalFailure()) return;
  MakeInputs(3);
  std::atomic<uint32_t> forced{5};
  hub_.Hostile(1, [&](uint8_t* base, uint64_t offset, uint64_t bytes) {
    if (!CarriesMask(OneRankSlot(), base, offset, bytes)) return;
    const uint32_t e = forced.load();
    std::memcpy(base + offset + offsetof(abi::ExchangeHeader, mask_epoch), &e, sizeof e);
  });
  // Epoch 5 is a plausible count: node 0 takes it.
  auto done = RunOnAll(abi::OpKind::kDispatch, 0, tokens_);
  ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
  EXPECT_EQ(done[0].mask_epoch, 5u);
  done = RunOnAll(abi::OpKind::kCombine, 0, tokens_, last_seq_);
  ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
  const struct {
    uint32_t epoch;
    const char* what;
  } bad[] = {{0xffffffffu, "4294967295"},
             {5 + NodeExchange::kMaxMaskEpochAhead + 1, "1048582"},
             {3, "epoch 3"}};
  for (const auto& b : bad) {
    SCOPED_TRACE(b.what);
    forced = b.epoch;
    done = RunOnAll(abi::OpKind::kDispatch, 0, tokens_);
    EXPECT_EQ(done[0].status_code, static_cast<int>(absl::StatusCode::kDataLoss))
        << Message(done[0]) << " epoch " << done[0].mask_epoch;
    EXPECT_THAT(Message(done[0]), AllOf(HasSubstr("node 1"), HasSubstr(b.what)));
    forced = 5;  // In step again: the next op runs at epoch 5, never back, never wrapped.
    done = RunOnAll(abi::OpKind::kDispatch, 0, tokens_);
    ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
    EXPECT_EQ(done[0].mask_epoch, 5u);
    done = RunOnAll(abi::OpKind::kCombine, 0, tokens_, last_seq_);
    ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
  }
}

// ---- Hostile peers and clients against the cross-node path --------------------------------
// Each test also prints what it saw (HOSTILE lines): the error texts a user would read.

/// Slot layout of node 1's message at node 0 in a group of two one-rank nodes.
abi::ExchangeSlotLayout HostileSlot(const kernels::GroupShape& g) {
  const abi::ExchangeShape xs{g.num_ranks, g.num_experts,         g.hidden,
                              g.num_topk,  g.max_tokens_per_rank, g.ll_max_tokens_per_rank};
  return abi::ExchangeSlotLayout::Compute(xs, 1, 1);
}

struct HostileHook {
  std::atomic<int> mode{0};       ///< What to scribble (per test).
  std::atomic<int32_t> value{0};  ///< The value to write.
  std::atomic<uint32_t> op{0};    ///< Only messages of this op kind.
  std::atomic<int> hits{0};
};

class MultinodeHostileTest : public MultinodeHostTest {
 protected:
  /// node 1's writes into node 0: on the first piece (header + counts + rows) of a message
  /// whose op is hook->op, mode 1: counts[0][0] (its rank 1 to rank 0) = value (absolute),
  /// mode 2: counts[0][0] += value, mode 3: rows[0] += value, mode 4: every cached send_pos
  /// of the block = value (written when the pos piece lands), mode 5: combine area bytes
  /// 0x7F (the rows' values).
  void Arm(std::shared_ptr<HostileHook> hook) {
    const abi::ExchangeSlotLayout sl =
        HostileSlot(shape_.num_ranks ? shape_ : rules::ShapeOf(spec_));
    auto slot = std::make_shared<std::atomic<int64_t>>(-1);
    hub_.Hostile(1, [hook, sl, slot](uint8_t* base, uint64_t offset, uint64_t bytes) {
      abi::ExchangeHeader h;
      if (bytes >= sizeof h) {
        std::memcpy(&h, base + offset, sizeof h);
        if (h.magic == abi::kExchangeMagic) {
          *slot = static_cast<int64_t>(offset);
          if (h.op != hook->op.load() || h.status_code != 0) return;
          const int m = hook->mode.load();
          int32_t* counts = reinterpret_cast<int32_t*>(base + offset + sl.counts);
          int32_t* rows = reinterpret_cast<int32_t*>(base + offset + sl.rows);
          if (m == 1) counts[0] = hook->value, ++hook->hits;
          if (m == 2) counts[0] += hook->value, ++hook->hits;
          if (m == 3) rows[0] += hook->value, ++hook->hits;
          return;
        }
      }
      if (*slot < 0) return;
      const int m = hook->mode.load();
      const uint64_t blk = static_cast<uint64_t>(*slot) + sl.payload;
      if (m == 4 && offset == blk + sl.pos) {
        for (uint64_t i = 0; i < bytes / 4; ++i) {
          const int32_t v = hook->value;
          std::memcpy(base + offset + 4 * i, &v, 4);
        }
        ++hook->hits;
      }
      if (m == 5 && (offset < static_cast<uint64_t>(*slot) ||
                     offset >= static_cast<uint64_t>(*slot) + sl.total)) {
        std::memset(base + offset, 0x7F, bytes);  // A combine-area piece.
        ++hook->hits;
      }
    });
  }
  /// A fresh group of two one-rank nodes (BF16, H = 512; `gather`: stage_through_mirror
  /// and gather_rows) with `hook` armed on node 1's writes.
  void StartArmed(std::shared_ptr<HostileHook> hook, bool gather) {
    rings_.clear();
    nodes_.clear();
    node_of_.clear();
    spec_.Clear();
    Start({1, 1}, 2000, /*fp8=*/false, 512, gather, gather);
    if (HasFatalFailure()) return;
    Arm(std::move(hook));
  }
  void Disarm() {
    hub_.Hostile(1, [](uint8_t*, uint64_t, uint64_t) {});
  }

  /// Dispatch + Combine with weights + LL dispatch + LL combine on every rank, each result
  /// exact against kernels/host on the whole group: the group recovered.
  void ExpectGroupRecovered(const std::string& what) {
    SCOPED_TRACE(what);
    const int R = shape_.num_ranks, H = shape_.hidden, K = shape_.num_topk;
    Reference ref;
    ASSERT_TRUE(RefDispatch(false, {}, &ref).ok());
    auto done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens_);
    const uint64_t dseq = last_seq_;
    for (int r = 0; r < R; ++r) ASSERT_EQ(done[r].status_code, 0) << r << ": " << Message(done[r]);
    for (int r = 0; r < R; ++r) {
      EXPECT_TRUE(Same(At<uint8_t>(r, layout_.recv_x), ref.rx[r].data(),
                       int64_t{ref.da[r].num_recv_tokens} * 2 * H))
          << r;
    }
    ASSERT_TRUE(RefCombine(true, &ref).ok());
    for (int r = 0; r < R; ++r)
      std::memset(At<uint8_t>(r, layout_.combined_x), 0xA5, layout_.combined_x.bytes);
    done = RunOnAll(abi::OpKind::kCombine, abi::kFlagCombineWeights, tokens_, dseq);
    for (int r = 0; r < R; ++r) {
      ASSERT_EQ(done[r].status_code, 0) << r << ": " << Message(done[r]);
      EXPECT_TRUE(Same(At<bf16_bits>(r, layout_.combined_x), ref.cx[r].data(), tokens_[r] * H))
          << r;
      EXPECT_TRUE(
          Same(At<float>(r, layout_.combined_topk_weights), ref.cw[r].data(), tokens_[r] * K))
          << r;
    }
    std::vector<int> ll(R);
    for (int r = 0; r < R; ++r) ll[r] = std::min(tokens_[r], shape_.ll_max_tokens_per_rank);
    kernels::host::LowLatencyDispatchOptions lopt{false, false, false};
    ASSERT_TRUE(RefLowLatencyDispatch(lopt, ll, {}, &ref).ok());
    done = RunOnAll(abi::OpKind::kLowLatencyDispatch, 0, ll);
    const uint64_t lseq = last_seq_;
    for (int r = 0; r < R; ++r) ASSERT_EQ(done[r].status_code, 0) << r << ": " << Message(done[r]);
    ASSERT_TRUE(RefLowLatencyCombine(ll, {}, &ref).ok());
    done = RunOnAll(abi::OpKind::kLowLatencyCombine, 0, ll, lseq);
    for (int r = 0; r < R; ++r) {
      ASSERT_EQ(done[r].status_code, 0) << r << ": " << Message(done[r]);
      EXPECT_TRUE(Same(At<bf16_bits>(r, layout_.ll_combined_x[done[r].buffer]), ref.lcx[r].data(),
                       ll[r] * H))
          << r;
    }
  }
};

// A peer whose dispatch counts disagree with the rows it sends (node 1's count for its rank
// to rank 0): +1, -1, negative, > M, INT32_MAX, INT32_MIN. Node 0 must refuse (an error,
// never an out-of-bounds access) and the group must then run every op exactly; with the
// received rows gathered (gather_rows) and without.
TEST_F(MultinodeHostileTest, CountsThatDisagreeWithTheRows) {
  for (const bool gather : {false, true}) {
    for (const auto& [mode, value] : std::vector<std::pair<int, int32_t>>{
             {2, 1}, {2, -1}, {1, -5}, {1, 7}, {1, INT32_MAX}, {1, INT32_MIN}}) {
      SCOPED_TRACE(::testing::Message()
                   << "gather " << gather << " mode " << mode << " value " << value);
      auto hook = std::make_shared<HostileHook>();
      StartArmed(hook, gather);
      if (HasFatalFailure()) return;
      MakeInputs(21);
      tokens_ = {4, 6};
      hook->op = static_cast<uint32_t>(abi::OpKind::kDispatch);
      hook->mode = mode;
      hook->value = value;
      auto done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens_);
      hook->mode = 0;
      EXPECT_GE(hook->hits.load(), 1);
      EXPECT_EQ(done[0].status_code, static_cast<int>(absl::StatusCode::kDataLoss))
          << Message(done[0]);
      EXPECT_THAT(Message(done[0]), HasSubstr("node 1 (10.0.0.2:7100)"));
      std::printf("HOSTILE counts gather=%d mode=%d value=%d: node0 %d '%s' | node1 %d '%s'\n",
                  gather, mode, value, done[0].status_code, Message(done[0]).c_str(),
                  done[1].status_code, Message(done[1]).c_str());
      // LL dispatch counts (per expert) too.
      hook->op = static_cast<uint32_t>(abi::OpKind::kLowLatencyDispatch);
      hook->mode = mode;
      done = RunOnAll(abi::OpKind::kLowLatencyDispatch, 0, {4, 5});
      hook->mode = 0;
      EXPECT_EQ(done[0].status_code, static_cast<int>(absl::StatusCode::kDataLoss))
          << Message(done[0]);
      EXPECT_THAT(Message(done[0]), HasSubstr("node 1 (10.0.0.2:7100)"));
      std::printf("HOSTILE ll counts gather=%d mode=%d value=%d: node0 %d '%s' | node1 %d '%s'\n",
                  gather, mode, value, done[0].status_code, Message(done[0]).c_str(),
                  done[1].status_code, Message(done[1]).c_str());
      Disarm();
      ExpectGroupRecovered("after bad counts");
      if (HasFatalFailure()) return;
    }
  }
}

// A combine message whose rows are fewer (or more) than the dispatch said: node 0 must
// refuse it (DATA_LOSS naming node 1) and the group must go on exactly; the reduce that
// gather_rows records must not run on a failed combine.
TEST_F(MultinodeHostileTest, CombineRowsDisagreeingWithTheDispatch) {
  for (const bool gather : {false, true}) {
    for (const int32_t delta : {-1, 1, -1000, 1 << 30}) {
      for (const bool ll : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "gather " << gather << " delta " << delta << " ll " << ll);
        auto hook = std::make_shared<HostileHook>();
        StartArmed(hook, gather);
        if (HasFatalFailure()) return;
        MakeInputs(22);
        tokens_ = {5, 6};
        std::vector<int> ll_tokens = {5, 5};
        auto done = ll ? RunOnAll(abi::OpKind::kLowLatencyDispatch, 0, ll_tokens)
                       : RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens_);
        ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
        ASSERT_EQ(done[1].status_code, 0) << Message(done[1]);
        const uint64_t dseq = last_seq_;
        for (int r = 0; r < 2; ++r) {
          std::memset(At<uint8_t>(r, layout_.combined_x), 0xA5, layout_.combined_x.bytes);
          FillCombineX(r, shape_.max_recv_tokens());
          FillLowLatencyCombineX(r);
        }
        hook->op =
            static_cast<uint32_t>(ll ? abi::OpKind::kLowLatencyCombine : abi::OpKind::kCombine);
        hook->mode = 3;
        hook->value = delta;
        done = ll ? RunOnAll(abi::OpKind::kLowLatencyCombine, 0, ll_tokens, dseq)
                  : RunOnAll(abi::OpKind::kCombine, abi::kFlagCombineWeights, tokens_, dseq);
        hook->mode = 0;
        std::printf(
            "HOSTILE combine rows gather=%d delta=%d ll=%d: node0 %d '%s' | node1 %d '%s'\n",
            gather, delta, ll, done[0].status_code, Message(done[0]).c_str(), done[1].status_code,
            Message(done[1]).c_str());
        EXPECT_GE(hook->hits.load(), 1);
        EXPECT_EQ(done[0].status_code, static_cast<int>(absl::StatusCode::kDataLoss))
            << Message(done[0]);
        Disarm();
        ExpectGroupRecovered("after bad combine rows");
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Node 1's combine rows overwritten in node 0's combine area (values only): the op is OK
// (node 0 cannot tell) and nothing is read out of bounds; with the recorded reduce, the
// terms point into the area and read its values after the checks.
TEST_F(MultinodeHostileTest, CombineAreaValuesRewritten) {
  for (const bool gather : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "gather " << gather);
    auto hook = std::make_shared<HostileHook>();
    StartArmed(hook, gather);
    if (HasFatalFailure()) return;
    MakeInputs(23);
    tokens_ = {5, 6};
    auto done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens_);
    ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
    const uint64_t dseq = last_seq_;
    hook->mode = 5;
    done = RunOnAll(abi::OpKind::kCombine, abi::kFlagCombineWeights, tokens_, dseq);
    hook->mode = 0;
    std::printf("HOSTILE combine values gather=%d hits=%d: node0 %d '%s'\n", gather,
                hook->hits.load(), done[0].status_code, Message(done[0]).c_str());
    Disarm();
    ExpectGroupRecovered("after rewritten combine values");
    if (HasFatalFailure()) return;
  }
}

// A cached dispatch whose send_pos disagree with the counts (every row to one row, -2, far
// out of range): node 0 refuses, the group goes on.
TEST_F(MultinodeHostileTest, CachedSendPosThatDisagreeWithTheCounts) {
  for (const bool gather : {false, true}) {
    for (const int32_t v : {0, -2, 1 << 30, -1}) {
      SCOPED_TRACE(::testing::Message() << "gather " << gather << " send_pos " << v);
      auto hook = std::make_shared<HostileHook>();
      StartArmed(hook, gather);
      if (HasFatalFailure()) return;
      MakeInputs(24);
      tokens_ = {5, 6};
      auto done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens_);
      ASSERT_EQ(done[0].status_code, 0) << Message(done[0]);
      const uint64_t dseq = last_seq_;
      hook->op = static_cast<uint32_t>(abi::OpKind::kDispatch);
      hook->mode = 4;
      hook->value = v;
      done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagCachedHandle, tokens_, dseq);
      hook->mode = 0;
      std::printf("HOSTILE send_pos gather=%d v=%d hits=%d: node0 %d '%s' | node1 %d '%s'\n",
                  gather, v, hook->hits.load(), done[0].status_code, Message(done[0]).c_str(),
                  done[1].status_code, Message(done[1]).c_str());
      Disarm();
      ExpectGroupRecovered("after bad send_pos");
      if (HasFatalFailure()) return;
    }
  }
}

// A client that rewrites its area (topk_idx to garbage, x, num tokens' worth of weights)
// after the daemon checked its inputs, and again while its rows' pack is held: every node's
// op still routes by what was checked (no error, no out-of-bounds), and the next ops are
// exact.
TEST_F(MultinodeHostileTest, ClientRewritingItsAreaMidOp) {
  std::atomic<bool> hold{false};
  std::atomic<int> polls{0};
  std::atomic<bool> armed{false};
  pack_poll_ = [&](int32_t rank) -> absl::StatusOr<bool> {
    if (rank == 0 && hold) {
      ++polls;
      return false;
    }
    return true;
  };
  node0_inputs_checked_ = [this, &armed] {
    if (!armed) return;
    auto* idx = At<int64_t>(0, layout_.in_topk_idx);
    for (int i = 0; i < shape_.max_input_tokens() * shape_.num_topk; ++i) idx[i] = 1LL << 40;
    std::memset(At<uint8_t>(0, layout_.in_x), 0x7F, layout_.in_x.bytes);
    std::memset(At<uint8_t>(0, layout_.in_topk_weights), 0xFF, layout_.in_topk_weights.bytes);
  };
  Start({1, 1}, 2000, false, 512, true, true);
  if (HasFatalFailure()) return;
  MakeInputs(25);
  tokens_ = {5, 6};
  // The pack of rank 0 held; meanwhile its client rewrites topk_idx and x.
  hold = true;
  const uint64_t s0 = rings_[0]->Submit(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, 5);
  const uint64_t s1 = rings_[1]->Submit(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, 6);
  std::this_thread::sleep_for(milliseconds(200));
  auto* idx = At<int64_t>(0, layout_.in_topk_idx);
  for (int i = 0; i < shape_.max_input_tokens() * shape_.num_topk; ++i) idx[i] = -7;
  std::memset(At<uint8_t>(0, layout_.in_x), 0x55, layout_.in_x.bytes);
  hold = false;
  auto c0 = rings_[0]->Await(s0, milliseconds(5000));
  auto c1 = rings_[1]->Await(s1, milliseconds(5000));
  ASSERT_TRUE(c0 && c1);
  std::printf("HOSTILE rewrite during held pack (polls %d): node0 %d '%s' | node1 %d '%s'\n",
              polls.load(), c0->status_code, Message(*c0).c_str(), c1->status_code,
              Message(*c1).c_str());
  EXPECT_EQ(c0->status_code, 0);
  EXPECT_EQ(c1->status_code, 0);
  // Rewritten after the checks of node 0's NodeDispatch.
  MakeInputs(26);
  armed = true;
  auto done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, {5, 6});
  armed = false;
  std::printf("HOSTILE rewrite after checks: node0 %d '%s' | node1 %d '%s'\n", done[0].status_code,
              Message(done[0]).c_str(), done[1].status_code, Message(done[1]).c_str());
  const uint64_t dseq = last_seq_;
  done = RunOnAll(abi::OpKind::kCombine, abi::kFlagCombineWeights, {5, 6}, dseq);
  std::printf("HOSTILE its combine: node0 %d '%s' | node1 %d '%s'\n", done[0].status_code,
              Message(done[0]).c_str(), done[1].status_code, Message(done[1]).c_str());
  MakeInputs(27);
  tokens_ = {5, 6};
  ExpectGroupRecovered("after a client rewrote its area");
}

// A rank that leaves (DetachRank) while its node's pack is held: the pack then runs on
// its area, which must still be alive (ASan), and the other node is told.
TEST_F(MultinodeHostileTest, RankLeavingWhileItsPackIsHeld) {
  std::atomic<bool> hold{false};
  pack_poll_ = [&](int32_t rank) -> absl::StatusOr<bool> { return !(rank == 0 && hold.load()); };
  Start({2, 1}, 2000, false, 512, true, true);
  if (HasFatalFailure()) return;
  MakeInputs(28);
  tokens_ = {5, 6, 4};
  hold = true;
  std::vector<uint64_t> seqs(3);
  for (int r = 0; r < 3; ++r)
    seqs[r] = rings_[r]->Submit(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens_[r]);
  std::this_thread::sleep_for(milliseconds(200));
  nodes_[0]->group->DetachRank(0);
  std::this_thread::sleep_for(milliseconds(50));
  hold = false;
  for (int r : {0, 1, 2}) {
    auto c = rings_[r]->Await(seqs[r], milliseconds(5000));
    std::printf("HOSTILE leave during held pack: rank %d %s %d '%s'\n", r, c ? "done" : "NONE",
                c ? c->status_code : -1, c ? Message(*c).c_str() : "");
  }
}

// Random scribbles on every piece node 1 lands in node 0 (header fields included), with
// the received rows gathered and the combines' reduce recorded (gather_rows): every op of
// both families completes (an error or OK, never a hang past op_timeout + grace), nothing
// is read or written out of bounds (ASan/UBSan build), and once the scribbling stops the
// group runs every op exactly.
TEST_F(MultinodeHostileTest, RandomScribblesWithRowsOnTheBackend) {
  auto rng = std::make_shared<std::mt19937>(1234);
  auto on = std::make_shared<std::atomic<bool>>(false);
  Start({2, 1}, /*op_timeout_ms=*/800, /*fp8=*/true, 512, true, true);
  if (HasFatalFailure()) return;
  const int32_t M = shape_.max_tokens_per_rank;
  hub_.Hostile(1, [rng, on, M](uint8_t* base, uint64_t offset, uint64_t bytes) {
    if (!*on || bytes < 4) return;
    std::mt19937& g = *rng;
    const int n = 1 + static_cast<int>(g() % 6);
    const int32_t values[] = {0, -1, 1, INT32_MAX, INT32_MIN, M, M + 1, -2, 2, 1 << 20};
    for (int i = 0; i < n; ++i) {
      // Biased to the first 1 KiB (header, mask, tokens, counts, rows).
      const uint64_t span = (g() % 2) ? std::min<uint64_t>(bytes, 1024) : bytes;
      const uint64_t at = (g() % (span / 4)) * 4;
      const int32_t v = (g() % 3) ? values[g() % 10] : static_cast<int32_t>(g());
      std::memcpy(base + offset + at, &v, 4);
    }
  });
  const int R = shape_.num_ranks;
  int ok = 0, failed = 0;
  std::map<int, int> codes;
  for (int round = 0; round < 60; ++round) {
    MakeInputs(300 + round);
    *on = true;
    const bool fp8 = round % 2;
    auto tally = [&](const std::vector<abi::Completion>& done) {
      for (int r = 0; r < R; ++r) {
        ++codes[done[r].status_code];
        (done[r].status_code == 0 ? ok : failed)++;
      }
    };
    auto done =
        RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights | (fp8 ? abi::kFlagFp8 : 0u),
                 tokens_, 0, milliseconds(5000));
    tally(done);
    const uint64_t d = last_seq_;
    tally(
        RunOnAll(abi::OpKind::kCombine, abi::kFlagCombineWeights, tokens_, d, milliseconds(5000)));
    tally(RunOnAll(abi::OpKind::kDispatch, abi::kFlagCachedHandle, tokens_, d, milliseconds(5000)));
    std::vector<int> ll(R);
    for (int r = 0; r < R; ++r) ll[r] = std::min(tokens_[r], shape_.ll_max_tokens_per_rank);
    tally(RunOnAll(abi::OpKind::kLowLatencyDispatch, fp8 ? abi::kFlagFp8 : 0u, ll, 0,
                   milliseconds(5000)));
    const uint64_t l = last_seq_;
    tally(RunOnAll(abi::OpKind::kLowLatencyCombine, 0, ll, l, milliseconds(5000)));
    tally(RunOnAll(abi::OpKind::kGetDispatchLayout, 0, tokens_, 0, milliseconds(5000)));
    if (HasFailure()) break;
  }
  *on = false;
  std::printf("HOSTILE random scribbles: %d OK, %d failed;", ok, failed);
  for (const auto& [c, n] : codes) std::printf(" code %d x%d", c, n);
  std::printf("\n");
  hub_.Hostile(1, [](uint8_t*, uint64_t, uint64_t) {});
  MakeInputs(999);
  tokens_[0] = 3;
  ExpectGroupRecovered("after random scribbles");
}

// DESIGN.md §5.1 "Checks": a peer's counts that disagree with its rows are the peer's data
// fault, DATA_LOSS naming its node (as for its token ids), not INVALID_ARGUMENT of this
// node's ranks. Fails today (review finding): INVALID_ARGUMENT "Dispatch: source rank 1
// presents 4 rows for rank 0, its count says 5", no node named.
TEST_F(MultinodeHostileTest, APeersBadCountsAreDataLossNamingTheNode) {
  auto hook = std::make_shared<HostileHook>();
  Start({1, 1}, 2000, /*fp8=*/false, 512, true, true);
  if (HasFatalFailure()) return;
  Arm(hook);
  MakeInputs(21);
  tokens_ = {4, 6};
  hook->op = static_cast<uint32_t>(abi::OpKind::kDispatch);
  hook->mode = 2;
  hook->value = 1;
  auto done = RunOnAll(abi::OpKind::kDispatch, abi::kFlagDispatchWeights, tokens_);
  hook->mode = 0;
  EXPECT_EQ(done[0].status_code, static_cast<int>(absl::StatusCode::kDataLoss)) << Message(done[0]);
  EXPECT_THAT(Message(done[0]), HasSubstr("node 1 (10.0.0.2:7100)"));
}
}  // namespace
}  // namespace epd
