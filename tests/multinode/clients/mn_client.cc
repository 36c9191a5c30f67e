// epd_mn_client: one rank of a group across nodes (tests/multinode/data_*_test.cc), a real
// libepdclient process joining its own node's daemon. Inputs are a pure function of --seed,
// the rank and --tokens (every rank's T), so each process recomputes the whole group's
// answer with kernels/host (all R ranks here) and checks its own results bit for bit.
//
//   --scenario=ops   One pass of every op and option of both families: GetDispatchLayout;
//                    Dispatch BF16 with weights, Combine with weights, cached re-dispatch,
//                    Combine without weights, Dispatch FP8 without weights; LowLatencyDispatch
//                    BF16, FP8, FP8+round_scale, FP8+round_scale+UE8M0, each followed by a
//                    LowLatencyCombine. Prints "OK <op>", "MISMATCH <op> <field> ..." or
//                    "ERROR <op> <CODE>: <message>" per op, then "DONE ok=<n> bad=<n>";
//                    exit 0 when every op was OK and exact.
//   --scenario=graph (CUDA, --launch_mode=client) LowLatencyDispatch with T on the device
//                    and its LowLatencyCombine captured once in a CUDA graph on the rank's
//                    stream (after one round of the same ops not captured), replayed
//                    --graph_rounds times with every rank's T changed between replays
//                    (T = (tokens + 3 * round) % (Mll + 1): some 0, some Mll); each round's
//                    recv_count, recv_x, recv_src_info and combined_x are checked. Prints
//                    "GRAPH <i> OK" per round, then "DONE ok=<n> bad=<n>" (n: rounds + 1).
//   --scenario=loop  Rounds of Dispatch + Combine + LowLatencyDispatch + LowLatencyCombine,
//                    printing "ROUND <i> OK" or "ROUND <i> ERROR <op> <CODE> after <ms> ms:
//                    <message>" (and MISMATCH lines), until EOF on stdin or --max_seconds;
//                    with --exit_after_recovery it exits 0 once a failed round was followed
//                    by 3 OK ones. Exit 1 when an OK result was wrong.
//   --scenario=probes Bad input in step on every rank (tests/chaos): rank --probe_rank
//                    passes an expert id >= E, then -2, T = M + 1 to Dispatch and
//                    LowLatencyDispatch, an x of dtype float32 and one of hidden H + 1;
//                    every rank expects INVALID_ARGUMENT ("PROBE <name> OK" or "PROBE
//                    <name> BAD <what>"), then one pass of every op must be exact.
//   --on_rank_failure=mask (loop) The group masks failed ranks (docs/RELIABILITY.md "Rank
//                    masking and re-attach"). Each OK result is checked against kernels/host
//                    run with the masks the op ran with: the ranks its OpMask epoch masked
//                    (QueryRankMask; when the mask changed again before the query, each set
//                    of num_masked other ranks is tried and the result must equal one), and
//                    for a combine those its dispatch ran with; masked ranks send nothing and
//                    their experts' pairs are dropped. OpMask's dropped_pairs and num_masked
//                    are checked too, and epochs never go back. Each OK round first prints
//                    "MASK <i> epoch=<e> masked=<ranks|->" (its last op's). --unmask_self
//                    unmasks this rank when an op is refused as masked ("UNMASK_SELF ...");
//                    --mask_self=V:A:B masks rank V after round A and unmasks it after round
//                    B ("SELFMASK mask|unmask rank V epoch=<e> masked=<ranks>").
//   --reconnect      (loop) After an op answered UNAVAILABLE (the daemon restarted):
//                    Client::Reconnect, "RECONNECTED session <id>" (or "RECONNECT FAILED"),
//                    and the loop goes on with the same Endpoint.
// Every scenario ends with "max_op_ms=<n>" on its DONE / STOPPED line: the longest any op
// of this process took from submit to result (errors included); --report_slow_ms prints a
// "SLOW" line for each op slower than that.
// Join barrier: after "JOINED", every scenario waits (polling ListGroups every 50 ms, at
// most --join_barrier_ms, default --wait_seconds) until the group reports all its ranks
// joined, so that a rank that joined seconds before another does not spend its first op's
// op_timeout on it; past the bound it prints "JOIN_BARRIER not every rank joined within
// <ms> ms ..." and starts anyway. --join_delay_ms makes a rank join late (a test's slow
// joiner).
// Exit 2: connect or join failed (the line says why).
// Against a CUDA daemon (tests/gpu/multinode_cuda_test.cc) the results live in device
// memory: each op's views are copied to host memory (cudaMemcpy) before they are checked.
#include <dlpack/dlpack.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "epd/client.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/op_rules.h"
#include "epd/kernels/types.h"
#include "tests/common/dtypes.h"
#include "tests/common/mask_reference.h"
#include "tests/common/op_reference.h"
#include "tests/common/stdin_eof.h"
#include "tests/multinode/data_spec.h"

#if EPD_MN_CLIENT_CUDA
#include <cuda_runtime.h>
#endif

ABSL_FLAG(std::string, socket, "", "this rank's node's epd socket");
ABSL_FLAG(std::string, group, "mn", "group name");
ABSL_FLAG(std::string, nodes, "", "the group's nodes: ADDRESS=RANKS,...");
ABSL_FLAG(int, rank, 0, "this process's rank");
ABSL_FLAG(std::string, tokens, "", "T of every rank, comma-separated (default: 5 each)");
ABSL_FLAG(bool, to_first_node, false, "route every token to experts of node 0's ranks");
ABSL_FLAG(std::string, skew, "none",
          "none; expert: every token to expert --skew_target only; rank: every token to "
          "experts of rank --skew_target only");
ABSL_FLAG(int, skew_target, 0, "the expert or rank of --skew");
ABSL_FLAG(int, probe_rank, 0, "probes: the rank that passes the bad input");
ABSL_FLAG(int, report_slow_ms, 0, "print a SLOW line for each op slower than this (0: none)");
ABSL_FLAG(uint64_t, seed, 1, "input seed (every rank of a group uses the same)");
ABSL_FLAG(std::string, scenario, "ops", "ops or loop");
ABSL_FLAG(std::string, transport, "", "spec.transport (\"\" = the daemons' default)");
ABSL_FLAG(bool, exit_after_recovery, false, "loop: exit 0 after a failed round and 3 OK ones");
ABSL_FLAG(int, max_seconds, 60, "loop: stop after this long");
ABSL_FLAG(int, wait_seconds, 30, "bound of each op's Wait");
ABSL_FLAG(int, round_pause_ms, 0, "loop: pause between rounds");
ABSL_FLAG(std::string, launch_mode, "",
          "client or daemon: the endpoints' launch mode (\"\" = the daemon's default)");
ABSL_FLAG(int, graph_rounds, 6, "graph: replays of the captured graph");
ABSL_FLAG(std::string, gpu_uuid, "",
          "the GPU to join on (a CUDA daemon); \"\" on the host backend");
ABSL_FLAG(std::string, on_rank_failure, "",
          "spec.on_rank_failure: \"\" (unspecified), fail or mask (mask: --scenario=loop)");
ABSL_FLAG(std::string, mask_self, "",
          "V:A:B (mask): after its round A this process masks rank V (UpdateRankMask), after "
          "round B it unmasks it");
ABSL_FLAG(bool, unmask_self, false,
          "mask: when an op is refused because this rank is masked, unmask it (UpdateRankMask)");
ABSL_FLAG(
    bool, reconnect, false,
    "loop: when an op answers UNAVAILABLE (the daemon restarted), Client::Reconnect and go on");
ABSL_FLAG(int, join_barrier_ms, -1,
          "after Join, wait up to this long (ms) until the group reports every rank joined "
          "before the first op (-1: --wait_seconds; 0: no wait)");
ABSL_FLAG(int, join_delay_ms, 0,
          "sleep this long (ms) between Connect and Join (a rank joining late, for tests)");
ABSL_FLAG(bool, testing_ignore_mask, false,
          "mask: check results against the unmasked reference (epd_chaos --self_check: a wrong "
          "reference under a mask must be caught)");

namespace {

namespace host = epd::kernels::host;
using epd::kernels::bf16_bits;
using epd::kernels::e4m3_bits;
using epd::kernels::GroupShape;
using epd::testing::kBf16;
using epd::testing::kF32;
using epd::testing::kI64;

constexpr int32_t kAlignment = 2;
const DLDataType kE4m3 = epd::kDLFloat8E4m3fn;

std::atomic<bool> g_stop{false};

/// A vector of at least one element (so that a [0, ...] tensor still has a data pointer)
/// with a DLTensor of `dims` over it.
template <typename T>
struct Buf {
  std::vector<T> v;
  std::vector<int64_t> dims;
  DLTensor dl{};
  void Make(std::vector<int64_t> shape, DLDataType dtype) {
    dims = std::move(shape);
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    v.assign(std::max<int64_t>(n, 1), T{});
    dl = epd::MakeDLTensor(v.data(), dtype, dims);
  }
  T* data() { return v.data(); }
};

/// One rank's inputs.
struct RankInputs {
  int32_t T = 0, Tll = 0;
  Buf<bf16_bits> x, x2, xll;
  Buf<e4m3_bits> x8;
  Buf<float> x8_scales, w, wll;
  Buf<int64_t> idx, idxll;
  Buf<bf16_bits> yll;  ///< [El, R*Mll, H]: its low-latency expert outputs.
};

/// Rank `rank`'s inputs: values exact in bf16, distinct experts per row (some k masked
/// with -1), drawn from [first_target, first_target + num_target_experts).
void MakeInputs(const GroupShape& s, uint64_t seed, int rank, int32_t T, int first_target,
                int num_target_experts, RankInputs& in) {
  std::mt19937_64 rng(seed * 1000003ull + static_cast<uint64_t>(rank) * 104729ull);
  const int H = s.hidden, K = s.num_topk;
  auto value = [&] { return epd::kernels::FloatToBf16(float(int(rng() % 255) - 127) / 32.f); };
  auto route = [&](int32_t rows, Buf<int64_t>& idx, Buf<float>& w) {
    idx.Make({rows, K}, kI64);
    w.Make({rows, K}, kF32);
    for (int32_t t = 0; t < rows; ++t) {
      int64_t* row = idx.data() + int64_t(t) * K;
      for (int k = 0; k < K; ++k) {
        int64_t e = -1;
        if ((k == 0 || rng() % 4 != 0) && k < num_target_experts) {
          do {
            e = first_target + static_cast<int64_t>(rng() % num_target_experts);
          } while (std::find(row, row + k, e) != row + k);
        }
        row[k] = e;
        w.data()[int64_t(t) * K + k] = float(1 + rng() % 8) / 8.f;
      }
    }
  };
  in.T = T;
  in.Tll = std::min(T, s.ll_max_tokens_per_rank);
  in.x.Make({T, H}, kBf16);
  in.x2.Make({T, H}, kBf16);
  for (int64_t i = 0; i < int64_t(T) * H; ++i) in.x.data()[i] = value();
  for (int64_t i = 0; i < int64_t(T) * H; ++i) in.x2.data()[i] = value();
  in.x8.Make({T, H}, kE4m3);
  for (int64_t i = 0; i < int64_t(T) * H; ++i) {
    in.x8.data()[i] = static_cast<e4m3_bits>(rng() % 0x7e);  // Finite, positive and negative.
    if (rng() % 2) in.x8.data()[i] |= 0x80;
  }
  in.x8_scales.Make({T, s.num_scales()}, kF32);
  for (int64_t i = 0; i < int64_t(T) * s.num_scales(); ++i) {
    in.x8_scales.data()[i] = float(1 + rng() % 64) / 16.f;
  }
  route(T, in.idx, in.w);
  in.xll.Make({in.Tll, H}, kBf16);
  for (int64_t i = 0; i < int64_t(in.Tll) * H; ++i) in.xll.data()[i] = value();
  route(in.Tll, in.idxll, in.wll);
  in.yll.Make({s.num_local_experts(), s.ll_rows_per_expert(), H}, kBf16);
  for (bf16_bits& v : in.yll.v) v = value();
}

/// Host copies of result views that live in device memory (a CUDA daemon's endpoints): each
/// view is replaced by a view of its host copy, kept until Clear().
class HostViews {
 public:
  void Clear() { buffers_.clear(); }
  absl::Status ToHost(epd::LayoutResult& r) {
    return Each({&r.num_tokens_per_rank, &r.num_tokens_per_expert, &r.is_token_in_rank});
  }
  absl::Status ToHost(epd::DispatchResult& r) {
    return Each({&r.recv_x, &r.recv_scales, &r.recv_topk_idx, &r.recv_topk_weights,
                 &r.num_recv_tokens_per_expert, &r.recv_src_info, &r.recv_count});
  }
  absl::Status ToHost(epd::CombineResult& r) {
    return Each({&r.combined_x, &r.combined_topk_weights});
  }
  absl::Status ToHost(epd::LowLatencyDispatchResult& r) {
    return Each({&r.recv_x, &r.recv_scales, &r.recv_count, &r.recv_src_info});
  }
  absl::Status ToHost(epd::LowLatencyCombineResult& r) { return Each({&r.combined_x}); }

 private:
  absl::Status Each(std::initializer_list<epd::TensorView*> views) {
    for (epd::TensorView* v : views) EPD_RETURN_IF_ERROR(Copy(*v));
    return absl::OkStatus();
  }
  absl::Status Copy(epd::TensorView& v) {
    if (v.data() == nullptr || v.dl().device.device_type != kDLCUDA) return absl::OkStatus();
    // The elements the view spans: compact, or up to its last strided element.
    int64_t elems = 1;
    const bool strided = !v.strides().empty();
    if (strided) {
      for (size_t d = 0; d < v.shape().size(); ++d) {
        if (v.shape()[d] == 0) elems = 0;
      }
      if (elems != 0) {
        for (size_t d = 0; d < v.shape().size(); ++d) {
          elems += (v.shape()[d] - 1) * v.strides()[d];
        }
      }
    } else {
      for (int64_t d : v.shape()) elems *= d;
    }
    const DLDataType t = v.dl().dtype;
    const size_t bytes = static_cast<size_t>(elems) * ((t.bits * t.lanes + 7) / 8);
    std::vector<uint8_t>& buf = buffers_.emplace_back(std::max<size_t>(bytes, 1));
#if EPD_MN_CLIENT_CUDA
    if (bytes > 0) {
      const cudaError_t err = cudaMemcpy(buf.data(), v.data(), bytes, cudaMemcpyDeviceToHost);
      if (err != cudaSuccess) {
        return absl::InternalError(
            absl::StrCat("cudaMemcpy of a result: ", cudaGetErrorString(err)));
      }
    }
#else
    return absl::FailedPreconditionError("a result in device memory, but built without CUDA");
#endif
    const DLDevice host{kDLCPU, 0};
    v = strided ? epd::TensorView(buf.data(), t, host, v.shape(), v.strides())
                : epd::TensorView(buf.data(), t, host, v.shape());
    return absl::OkStatus();
  }
  std::deque<std::vector<uint8_t>> buffers_;
};

using epd::testing::DispatchRef;
using epd::testing::LowLatencyRef;

/// The low-latency variants run, in order.
struct LowLatencyVariant {
  const char* name;
  host::LowLatencyDispatchOptions options;
};
constexpr LowLatencyVariant kLowLatencyVariants[] = {
    {"LowLatencyDispatch(bf16)", {false, false, false}},
    {"LowLatencyDispatch(fp8)", {true, false, false}},
    {"LowLatencyDispatch(fp8,round_scale)", {true, true, false}},
    {"LowLatencyDispatch(fp8,round_scale,ue8m0)", {true, true, true}},
};
constexpr int kNumLowLatencyVariants = 4;

/// One rank's expected results.
struct RankRef {
  std::vector<int32_t> tokens_per_rank, tokens_per_expert;
  std::vector<uint8_t> in_rank;
  DispatchRef dispatch, cached, fp8;
  std::vector<bf16_bits> combined, combined_cached;
  std::vector<float> combined_w;
  LowLatencyRef ll[kNumLowLatencyVariants];
  std::vector<bf16_bits> ll_combined;
  /// OpMask::dropped_pairs of this rank's Dispatch (pairs), Combine (routes),
  /// LowLatencyDispatch and LowLatencyCombine (pairs) under the reference's masks.
  int32_t dropped_dispatch = 0, dropped_combine = 0, dropped_ll = 0, dropped_ll_combine = 0;
};

/// A set of ranks (bit r: rank r), e.g. the ranks an op ran with masked.
using RankSet = uint32_t;

/// `set` as [R] flags (nonzero = in the set), as kernels/host's mask functions take it.
std::vector<uint8_t> Flags(RankSet set, int R) {
  std::vector<uint8_t> out(R, 0);
  for (int r = 0; r < R; ++r) out[r] = (set >> r) & 1u;
  return out;
}

/// "a,b" ("-" for none).
std::string SetString(RankSet set) {
  std::string out;
  for (int r = 0; r < 32; ++r) {
    if ((set >> r) & 1u) absl::StrAppend(&out, out.empty() ? "" : ",", r);
  }
  return out.empty() ? "-" : out;
}

/// What each rank sends to a Dispatch (normal) or LowLatencyDispatch (`ll`): its T and
/// topk_idx, with the experts of the ranks masked at the dispatch dropped (and nothing
/// from a masked rank itself); dropped[r]: the pairs rank r's OpMask reports dropped.
struct Routing {
  std::vector<int32_t> T, dropped;
  std::vector<std::vector<int64_t>> idx;
  Routing(const GroupShape& s, const std::vector<RankInputs>& in,
          std::span<const uint8_t> dispatch_masked, bool ll)
      : T(s.num_ranks), dropped(s.num_ranks), idx(s.num_ranks) {
    for (int r = 0; r < s.num_ranks; ++r) {
      const RankInputs& i = in[r];
      dropped[r] =
          epd::testing::MaskedIds(s, ll ? i.Tll : i.T, ll ? i.idxll.v.data() : i.idx.v.data(), r,
                                  dispatch_masked, &idx[r], &T[r]);
      idx[r].push_back(-1);  // Never empty: a [0, K] tensor still has a data pointer.
    }
  }
};

/// Runs host::Dispatch for every rank: `mode` 0 = BF16 with weights, 1 = cached re-dispatch
/// of x2 on mode 0's routing, 2 = FP8 without weights; `route` gives each rank's T and ids.
absl::Status ReferenceDispatch(const GroupShape& s, std::vector<RankInputs>& in,
                               const Routing& route, std::vector<RankRef>& ref, int mode) {
  const int R = s.num_ranks;
  std::vector<host::DispatchRankArgs> d(R);
  for (int r = 0; r < R; ++r) {
    d[r].num_tokens = route.T[r];
    DispatchRef* out = &ref[r].dispatch;
    if (mode == 0) {
      d[r].x = in[r].x.data();
      d[r].topk_idx = route.idx[r].data();
      d[r].topk_weights = in[r].w.data();
    } else if (mode == 1) {
      out = &ref[r].cached;
      d[r].x = in[r].x2.data();
      d[r].cached_send_pos = ref[r].dispatch.send_pos.data();
      d[r].cached_num_recv_tokens = ref[r].dispatch.N;
    } else {
      out = &ref[r].fp8;
      d[r].x = in[r].x8.data();
      d[r].x_scales = in[r].x8_scales.data();
      d[r].topk_idx = route.idx[r].data();
    }
    out->Bind(s, d[r], /*fp8=*/mode == 2);
  }
  host::DispatchOptions options;
  options.fp8 = mode == 2;
  options.expert_alignment = kAlignment;
  EPD_RETURN_IF_ERROR(host::Dispatch(s, options, std::span(d)));
  for (int r = 0; r < R; ++r) {
    (mode == 0 ? ref[r].dispatch : mode == 1 ? ref[r].cached : ref[r].fp8).N = d[r].num_recv_tokens;
  }
  return absl::OkStatus();
}

/// Every rank's expected results, computed with kernels/host over the whole group, for ops
/// that ran with the ranks of `dispatch_masked` masked at the dispatch and those of
/// `combine_masked` at the combine (docs/RELIABILITY.md "What masking does": a masked rank
/// sends nothing, the pairs routed to its experts are dropped, and a combine leaves out what
/// a rank masked at it would have sent back). Under a mask only the loop's round is
/// computed: Dispatch BF16 with weights, Combine with weights, LowLatencyDispatch BF16 and
/// its LowLatencyCombine.
absl::StatusOr<std::vector<RankRef>> Reference(const GroupShape& s, std::vector<RankInputs>& in,
                                               RankSet dispatch_masked = 0,
                                               RankSet combine_masked = 0) {
  const int R = s.num_ranks, H = s.hidden, K = s.num_topk;
  const bool masked = dispatch_masked != 0 || combine_masked != 0;
  const std::vector<uint8_t> dm = Flags(dispatch_masked, R), cm = Flags(combine_masked, R);
  const Routing route(s, in, dm, /*ll=*/false), route_ll(s, in, dm, /*ll=*/true);
  std::vector<RankRef> ref(R);
  for (int r = 0; r < R && !masked; ++r) {
    RankRef& o = ref[r];
    o.tokens_per_rank.assign(R, 0);
    o.tokens_per_expert.assign(s.num_experts, 0);
    o.in_rank.assign(std::max<size_t>(size_t(in[r].T) * R, 1), 0);
    host::LayoutRankArgs a{in[r].T, in[r].idx.data(), o.tokens_per_rank.data(),
                           o.tokens_per_expert.data(), o.in_rank.data()};
    EPD_RETURN_IF_ERROR(host::GetDispatchLayout(s, a));
  }
  EPD_RETURN_IF_ERROR(ReferenceDispatch(s, in, route, ref, 0));
  if (!masked) {
    EPD_RETURN_IF_ERROR(ReferenceDispatch(s, in, route, ref, 1));
    EPD_RETURN_IF_ERROR(ReferenceDispatch(s, in, route, ref, 2));
  }
  // Combine with weights (of the first dispatch's rows), then without (the cached rows).
  std::vector<std::vector<int32_t>> send_pos(R);
  for (bool weights : {true, false}) {
    if (!weights && masked) break;
    std::vector<host::CombineRankArgs> c(R);
    for (int r = 0; r < R; ++r) {
      RankRef& o = ref[r];
      const DispatchRef& d = weights ? o.dispatch : o.cached;
      std::vector<bf16_bits>& out = weights ? o.combined : o.combined_cached;
      // A rank masked at the combine sends nothing back; the routes to it are dropped.
      const bool out_of_it = dm[r] != 0 || cm[r] != 0;
      send_pos[r] = d.send_pos;
      out.assign(std::max<size_t>(size_t(in[r].T) * H, 1), 0);
      c[r].num_tokens = out_of_it ? 0 : in[r].T;
      if (weights) {
        o.dropped_combine = host::DropMaskedRoutes(s, cm, c[r].num_tokens, send_pos[r].data());
      }
      c[r].send_pos = send_pos[r].data();
      c[r].num_recv_tokens = out_of_it ? 0 : d.N;
      c[r].x = d.bf16();
      c[r].combined_x = out.data();
      if (weights) {
        o.combined_w.assign(std::max<size_t>(size_t(in[r].T) * K, 1), 0);
        c[r].topk_weights = d.recv_w.data();
        c[r].combined_topk_weights = o.combined_w.data();
      }
    }
    EPD_RETURN_IF_ERROR(host::Combine(s, std::span(c)));
  }
  for (int v = 0; v < (masked ? 1 : kNumLowLatencyVariants); ++v) {
    std::vector<host::LowLatencyDispatchRankArgs> l(R);
    for (int r = 0; r < R; ++r) {
      l[r].num_tokens = route_ll.T[r];
      l[r].x = in[r].xll.data();
      l[r].topk_idx = route_ll.idx[r].data();
      ref[r].ll[v].Bind(s, kLowLatencyVariants[v].options.use_fp8, l[r]);
    }
    EPD_RETURN_IF_ERROR(host::LowLatencyDispatch(s, kLowLatencyVariants[v].options, std::span(l)));
  }
  // Every variant routes the same tokens: one combine answer. Its pairs to ranks masked at
  // the combine are dropped (counted) as are those the dispatch dropped.
  std::vector<host::LowLatencyCombineRankArgs> lc(R);
  std::vector<std::vector<int64_t>> combine_idx(R);
  for (int r = 0; r < R; ++r) {
    RankRef& o = ref[r];
    const int32_t T = dm[r] != 0 || cm[r] != 0 ? 0 : in[r].Tll;
    combine_idx[r].assign(in[r].idxll.v.begin(), in[r].idxll.v.end());
    o.dropped_ll = route_ll.dropped[r];
    o.dropped_ll_combine = host::DropMaskedExperts(s, cm, T, combine_idx[r].data());
    host::DropMaskedExperts(s, dm, T, combine_idx[r].data());
    o.dropped_dispatch = route.dropped[r];
    o.ll_combined.assign(std::max<size_t>(size_t(in[r].Tll) * H, 1), 0);
    lc[r].num_tokens = T;
    lc[r].topk_idx = combine_idx[r].data();
    lc[r].topk_weights = in[r].wll.data();
    lc[r].handle_pos = o.ll[0].pos.data();
    lc[r].x = in[r].yll.data();
    lc[r].combined_x = o.ll_combined.data();
  }
  EPD_RETURN_IF_ERROR(host::LowLatencyCombine(s, std::span(lc)));
  return ref;
}

/// Under on_rank_failure = MASK: the set of ranks each mask epoch masked (from QueryRankMask
/// and this process's own UpdateRankMask calls) and kernels/host's reference for each pair
/// of masks a dispatch and its combine ran with (computed once each).
class MaskTracker {
 public:
  /// `unmasked`: this rank's reference without a mask (Reference's), kept by the caller.
  /// `ignore_mask` (--testing_ignore_mask, for epd_chaos --self_check): every reference is
  /// the unmasked one, so that results under a mask must be reported as mismatches.
  MaskTracker(epd::Endpoint& ep, const GroupShape& shape, std::vector<RankInputs>& in,
              const RankRef* unmasked, bool ignore_mask)
      : ep_(ep), s_(shape), in_(in), unmasked_(unmasked), ignore_mask_(ignore_mask) {
    Reset();
  }

  /// The sets of masked ranks an op whose result reports `m` may have run with: the set of
  /// its epoch when known (asked with QueryRankMask when not yet); else, when the mask
  /// changed again before the query answered, every set of m.num_masked ranks without this
  /// rank (which took part), to be told apart by the results (counted in inferred()).
  std::vector<RankSet> Candidates(const epd::OpMask& m) {
    if (m.num_masked == 0) return {0};
    if (auto it = sets_.find(m.epoch); it != sets_.end()) return {it->second};
    if (auto q = ep_.QueryRankMask(); q.ok()) Learn(*q);
    if (auto it = sets_.find(m.epoch); it != sets_.end()) return {it->second};
    ++inferred_;
    std::vector<RankSet> out;
    for (RankSet set = 0; set < (RankSet{1} << s_.num_ranks); ++set) {
      if (!((set >> ep_.rank()) & 1u) && std::popcount(set) == m.num_masked) out.push_back(set);
    }
    return out;
  }
  /// Records the set of `m`'s epoch.
  void Learn(const epd::RankMask& m) {
    RankSet set = 0;
    for (int32_t r : m.masked_ranks) set |= RankSet{1} << r;
    sets_[m.epoch] = set;
  }
  /// This rank's reference for a dispatch under `dispatch_masked` and its combine under
  /// `combine_masked`.
  absl::StatusOr<const RankRef*> Ref(RankSet dispatch_masked, RankSet combine_masked) {
    if (ignore_mask_ || (dispatch_masked == 0 && combine_masked == 0)) return unmasked_;
    const auto key = std::make_pair(dispatch_masked, combine_masked);
    auto it = refs_.find(key);
    if (it == refs_.end()) {
      EPD_ASSIGN_OR_RETURN(std::vector<RankRef> ref,
                           Reference(s_, in_, dispatch_masked, combine_masked));
      it = refs_.emplace(key, std::move(ref)).first;
    }
    return &it->second[ep_.rank()];
  }
  /// After Client::Reconnect: a new group, whose mask epochs start again at 0.
  void Reset() {
    sets_.clear();
    sets_[0] = 0;
    floor_epoch_ = 0;
  }
  /// The least epoch this process's next op may run with: epochs never go back, and a mask
  /// this process asked for (UpdateRankMask) applies from its next op on.
  uint32_t& floor_epoch() { return floor_epoch_; }
  int64_t inferred() const { return inferred_; }

 private:
  epd::Endpoint& ep_;
  const GroupShape& s_;
  std::vector<RankInputs>& in_;
  const RankRef* unmasked_;
  const bool ignore_mask_;
  std::map<uint32_t, RankSet> sets_;
  std::map<std::pair<RankSet, RankSet>, std::vector<RankRef>> refs_;
  uint32_t floor_epoch_ = 0;
  int64_t inferred_ = 0;
};

/// Runs this rank's ops and checks each result against the reference.
class Rank {
 public:
  Rank(epd::Endpoint& ep, const GroupShape& shape, RankInputs& in, RankRef& ref)
      : ep_(ep), s_(shape), in_(in), ref_(ref) {}
  /// Under MASK: each result is checked against the reference of the mask it ran with.
  void SetMasking(MaskTracker* mask) { mask_ = mask; }

  /// One pass of every op; false when one failed or mismatched.
  bool RunAll() {
    bool ok = Layout();
    ok &= NormalOps(/*all=*/true);
    for (int v = 0; v < kNumLowLatencyVariants; ++v) ok &= LowLatency(v);
    return ok;
  }
  /// Dispatch + Combine + LowLatencyDispatch + LowLatencyCombine (the loop's round).
  bool RunRound() {
    last_error_.clear();
    last_code_ = absl::StatusCode::kOk;
    return NormalOps(/*all=*/false) && LowLatency(0);
  }

  /// The probes of --scenario=probes (rank `culprit` passes the bad input), then one pass
  /// of every op; false when a probe did not fail as documented or an op was not exact.
  bool Probes(int culprit) {
    const bool me = ep_.rank() == culprit;
    const int H = s_.hidden, K = s_.num_topk;
    const int32_t M = s_.max_tokens_per_rank, Mll = s_.ll_max_tokens_per_rank;
    bool ok = true;
    // Every rank's inputs: one token to expert 0, or the culprit's bad ones.
    auto dispatch = [&](const char* name, int32_t rows, DLDataType dtype, int64_t hidden,
                        int64_t bad_id) {
      Buf<bf16_bits> x;
      Buf<float> xf;
      Buf<int64_t> idx;
      idx.Make({rows, K}, kI64);
      std::fill(idx.v.begin(), idx.v.end(), -1);
      for (int32_t t = 0; t < rows; ++t) idx.data()[int64_t(t) * K] = 0;
      if (bad_id != -1) idx.data()[K - 1] = bad_id;
      const DLTensor* xt = nullptr;
      if (dtype.code == kF32.code && dtype.bits == 32) {
        xf.Make({rows, hidden}, kF32);
        xt = &xf.dl;
      } else {
        x.Make({rows, hidden}, kBf16);
        xt = &x.dl;
      }
      Begin();
      epd::DispatchArgs args;
      args.x = xt;
      args.topk_idx = &idx.dl;
      args.expert_alignment = kAlignment;
      ok &= Expect(name, Finish(ep_.Dispatch(args)).status());
    };
    dispatch("expert_id_E", 1, kBf16, H, me ? s_.num_experts : -1);
    dispatch("expert_id_-2", 1, kBf16, H, me ? -2 : -1);
    dispatch("T_over_M", me ? M + 1 : 1, kBf16, H, -1);
    dispatch("dtype_float32", 1, me ? kF32 : kBf16, H, -1);
    dispatch("hidden_H+1", 1, kBf16, me ? H + 1 : H, -1);
    {
      const int32_t rows = me ? Mll + 1 : 1;
      Buf<bf16_bits> x;
      Buf<int64_t> idx;
      x.Make({rows, H}, kBf16);
      idx.Make({rows, K}, kI64);
      std::fill(idx.v.begin(), idx.v.end(), -1);
      Begin();
      epd::LowLatencyDispatchArgs la;
      la.x = &x.dl;
      la.topk_idx = &idx.dl;
      ok &= Expect("low_latency_T_over_Mll", Finish(ep_.LowLatencyDispatch(la)).status());
    }
    // The group is whole again: every op and option, exact.
    return RunAll() && ok;
  }

  int64_t max_ms() const { return max_ms_; }
  int64_t oks() const { return oks_; }
  int64_t bad() const { return bad_; }
  int64_t mismatches() const { return mismatches_; }
  const std::string& last_error() const { return last_error_; }
  absl::StatusCode last_code() const { return last_code_; }
  /// The OpMask of the last OK op and the masked ranks it ran with (MASK).
  const epd::OpMask& last_mask() const { return last_mask_; }
  RankSet last_set() const { return cur_set_; }
  /// A wrong answer of something other than an op (the mask API): fails the process.
  void Wrong(const std::string& what) {
    ++mismatches_;
    std::printf("MISMATCH rank %d %s\n", ep_.rank(), what.c_str());
  }

 private:
  template <typename Result>
  absl::StatusOr<Result> Finish(absl::StatusOr<epd::PendingOp<Result>> op) {
    if (!op.ok()) return op.status();
    absl::StatusOr<Result> result = op->Wait(absl::Seconds(absl::GetFlag(FLAGS_wait_seconds)));
    const int64_t ms = ElapsedMs();
    max_ms_ = std::max(max_ms_, ms);
    if (const int slow = absl::GetFlag(FLAGS_report_slow_ms); slow > 0 && ms > slow) {
      std::printf("SLOW op %d of this process took %lld ms (%s)\n", ops_,
                  static_cast<long long>(ms),
                  result.ok() ? "OK" : result.status().ToString().c_str());
    }
    ++ops_;
    if (result.ok()) EPD_RETURN_IF_ERROR(host_views_.ToHost(*result));
    return result;
  }

  /// Records an op's outcome: its error, or the mismatches Check found since Begin.
  int64_t ElapsedMs() const {
    return static_cast<int64_t>(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
            .count());
  }

  /// A probe's outcome: INVALID_ARGUMENT is what the API documents for bad input.
  bool Expect(const char* probe, const absl::Status& status) {
    if (status.code() == absl::StatusCode::kInvalidArgument) {
      std::printf("PROBE %s OK after %lld ms\n", probe, static_cast<long long>(ElapsedMs()));
      return true;
    }
    ++bad_;
    std::printf("PROBE %s BAD after %lld ms: want INVALID_ARGUMENT, got %s\n", probe,
                static_cast<long long>(ElapsedMs()), status.ToString().c_str());
    return false;
  }

  template <typename Result>
  bool Done(const char* op, const absl::StatusOr<Result>& result) {
    if (!result.ok()) {
      ++bad_;
      last_code_ = result.status().code();
      last_error_ =
          absl::StrCat("ERROR ", op, " ", absl::StatusCodeToString(result.status().code()),
                       " after ", ElapsedMs(), " ms: ", result.status().message());
      // The loop prints it in its ROUND line.
      if (absl::GetFlag(FLAGS_scenario) != "loop") std::printf("%s\n", last_error_.c_str());
      return false;
    }
    return true;
  }
  void Begin() {
    host_views_.Clear();
    start_ = std::chrono::steady_clock::now();
    op_mismatch_ = false;
  }
  bool End(const char* op) {
    if (op_mismatch_) {
      ++bad_;
      return false;
    }
    ++oks_;
    if (absl::GetFlag(FLAGS_scenario) != "loop") std::printf("OK %s\n", op);
    return true;
  }

  template <typename T>
  void Check(const char* op, const char* field, const void* actual, const T* expected, int64_t n) {
    if (std::string diff = epd::testing::FirstDifference(actual, expected, n); !diff.empty()) {
      Mismatch(op, field, diff);
    }
  }
  void Mismatch(const char* op, const char* field, const std::string& detail) {
    op_mismatch_ = true;
    if (quiet_) return;
    ++mismatches_;
    std::printf("MISMATCH rank %d %s %s %s\n", ep_.rank(), op, field, detail.c_str());
  }

  /// Checks an OK result: `check` compares it with a RankRef. Without masking, with ref_.
  /// Under MASK, with the reference of the masks it ran with: its own (from m.epoch, see
  /// MaskTracker::Candidates) and, for a combine, its dispatch's (`dispatch_sets`: the sets
  /// its dispatch's result matched; null for a dispatch, which uses its own). When several
  /// pairs are possible, each is tried silently and the first the result matches is taken
  /// (the others that match too are kept in matched_sets_). Also checks `m`: dropped_pairs
  /// (RankRef::*dropped), num_masked, and that epochs never go back. Sets cur_ and cur_set_
  /// to the reference and set taken.
  void Verify(const char* op, const epd::OpMask& m, const std::vector<RankSet>* dispatch_sets,
              int32_t RankRef::*dropped, const std::function<void(const RankRef&)>& check) {
    cur_ = &ref_;
    cur_set_ = 0;
    matched_sets_ = {0};
    if (mask_ == nullptr) return check(ref_);
    last_mask_ = m;
    // (dispatch mask, this op's mask) pairs it may have run with.
    std::vector<std::pair<RankSet, RankSet>> pairs;
    for (RankSet set : mask_->Candidates(m)) {
      for (RankSet d : dispatch_sets != nullptr ? *dispatch_sets : std::vector<RankSet>{set}) {
        pairs.emplace_back(d, set);
      }
    }
    if (pairs.empty()) {
      return Mismatch(op, "mask",
                      absl::StrCat("num_masked ", m.num_masked, " of ", s_.num_ranks,
                                   " ranks, this one not masked"));
    }
    auto ref_of = [&](std::pair<RankSet, RankSet> p) -> const RankRef* {
      absl::StatusOr<const RankRef*> ref = mask_->Ref(p.first, p.second);
      if (!ref.ok()) Mismatch(op, "reference", ref.status().ToString());
      return ref.ok() ? *ref : nullptr;
    };
    std::pair<RankSet, RankSet> taken = pairs[0];
    matched_sets_.clear();
    for (size_t i = 0; pairs.size() > 1 && i < pairs.size(); ++i) {
      quiet_ = true;
      const RankRef* ref = ref_of(pairs[i]);
      if (ref != nullptr) {
        check(*ref);
        if (ref->*dropped != m.dropped_pairs) op_mismatch_ = true;
      }
      quiet_ = false;
      if (ref != nullptr && !op_mismatch_) {
        if (matched_sets_.empty()) taken = pairs[i];
        if (std::find(matched_sets_.begin(), matched_sets_.end(), pairs[i].second) ==
            matched_sets_.end()) {
          matched_sets_.push_back(pairs[i].second);
        }
      }
      op_mismatch_ = false;
    }
    if (matched_sets_.empty()) matched_sets_ = {taken.second};
    const RankRef* ref = ref_of(taken);
    if (ref == nullptr) return;
    cur_ = ref;
    cur_set_ = taken.second;
    check(*ref);
    const std::string masks = absl::StrCat(
        "(epoch ", m.epoch, ", masked ranks ", SetString(taken.second),
        dispatch_sets != nullptr ? absl::StrCat(", at its dispatch ", SetString(taken.first)) : "",
        ")");
    if (ref->*dropped != m.dropped_pairs) {
      Mismatch(op, "dropped_pairs",
               absl::StrCat("got ", m.dropped_pairs, ", want ", ref->*dropped, " ", masks));
    }
    if (std::popcount(taken.second) != m.num_masked || ((taken.second >> ep_.rank()) & 1u)) {
      Mismatch(op, "num_masked", absl::StrCat("got ", m.num_masked, " ", masks));
    }
    if (m.epoch < mask_->floor_epoch()) {
      Mismatch(op, "mask epoch",
               absl::StrCat("got ", m.epoch, ", older than ", mask_->floor_epoch(),
                            " (an earlier op's, or what UpdateRankMask returned)"));
    }
    mask_->floor_epoch() = std::max(mask_->floor_epoch(), m.epoch);
  }

  bool Layout() {
    const char* op = "GetDispatchLayout";
    Begin();
    auto l = Finish(ep_.GetDispatchLayout(in_.idx.dl));
    if (!Done(op, l)) return false;
    const int R = s_.num_ranks;
    Check(op, "num_tokens_per_rank", l->num_tokens_per_rank.data(), ref_.tokens_per_rank.data(), R);
    Check(op, "num_tokens_per_expert", l->num_tokens_per_expert.data(),
          ref_.tokens_per_expert.data(), s_.num_experts);
    Check(op, "is_token_in_rank", l->is_token_in_rank.data(), ref_.in_rank.data(),
          int64_t(in_.T) * R);
    return End(op);
  }

  void CheckDispatch(const char* op, const epd::DispatchResult& d, const DispatchRef& ref,
                     bool routing, bool fp8) {
    const int64_t N = ref.N, H = s_.hidden, K = s_.num_topk;
    if (d.num_recv_tokens != ref.N) {
      return Mismatch(op, "num_recv_tokens",
                      absl::StrCat("got ", d.num_recv_tokens, ", want ", ref.N));
    }
    if (fp8) {
      Check(op, "recv_x", d.recv_x.data(), ref.recv_x.data(), N * H);
      Check(op, "recv_scales", d.recv_scales.data(), ref.recv_scales.data(), N * s_.num_scales());
    } else {
      Check(op, "recv_x", d.recv_x.data(), ref.bf16(), N * H);
    }
    Check(op, "recv_src_info", d.recv_src_info.data(), ref.src_info.data(), N);
    if (routing) {
      Check(op, "recv_topk_idx", d.recv_topk_idx.data(), ref.recv_idx.data(), N * K);
      Check(op, "recv_topk_weights", d.recv_topk_weights.data(), ref.recv_w.data(), N * K);
      Check(op, "num_recv_tokens_per_expert", d.num_recv_tokens_per_expert.data(),
            ref.per_expert.data(), s_.num_local_experts());
    }
  }

  /// Dispatch (BF16, weights) and Combine (weights); with `all` also the cached re-dispatch,
  /// Combine without weights and Dispatch FP8 without weights.
  bool NormalOps(bool all) {
    const int H = s_.hidden, K = s_.num_topk;
    std::optional<epd::Handle> routed =
        RoutedDispatch("Dispatch(bf16,weights)", in_.x.dl, nullptr, &in_.w.dl, &RankRef::dispatch);
    if (!routed.has_value()) return false;
    const epd::Handle handle = *routed;
    const DispatchRef& dispatched = cur_->dispatch;  // Under the mask the dispatch ran with.
    const std::vector<RankSet> dispatch_sets = matched_sets_;

    // Identity experts: the combine's x is the reference's received rows.
    Buf<bf16_bits> cx;
    Buf<float> cw;
    cx.Make({dispatched.N, H}, kBf16);
    cw.Make({dispatched.N, K}, kF32);
    std::memcpy(cx.data(), dispatched.recv_x.data(), size_t(dispatched.N) * H * 2);
    std::memcpy(cw.data(), dispatched.recv_w.data(), size_t(dispatched.N) * K * 4);
    const char* op = "Combine(weights)";
    Begin();
    epd::CombineArgs ca;
    ca.x = &cx.dl;
    ca.topk_weights = &cw.dl;
    ca.handle = &handle;
    auto c = Finish(ep_.Combine(ca));
    if (!Done(op, c)) return false;
    Verify(op, c->mask, &dispatch_sets, &RankRef::dropped_combine, [&](const RankRef& ref) {
      Check(op, "combined_x", c->combined_x.data(), ref.combined.data(), int64_t(in_.T) * H);
      Check(op, "combined_topk_weights", c->combined_topk_weights.data(), ref.combined_w.data(),
            int64_t(in_.T) * K);
    });
    if (!End(op)) return false;
    if (!all) return true;

    op = "Dispatch(cached)";
    Begin();
    epd::DispatchArgs cd;
    cd.x = &in_.x2.dl;
    cd.expert_alignment = kAlignment;
    cd.cached = handle;
    auto d2 = Finish(ep_.Dispatch(cd));
    if (!Done(op, d2)) return false;
    CheckDispatch(op, *d2, ref_.cached, /*routing=*/false, /*fp8=*/false);
    if (!End(op)) return false;

    op = "Combine(no weights)";
    Begin();
    Buf<bf16_bits> cx2;
    cx2.Make({ref_.cached.N, H}, kBf16);
    std::memcpy(cx2.data(), ref_.cached.recv_x.data(), size_t(ref_.cached.N) * H * 2);
    const epd::Handle cached_handle = d2->handle;
    epd::CombineArgs ca2;
    ca2.x = &cx2.dl;
    ca2.handle = &cached_handle;
    auto c2 = Finish(ep_.Combine(ca2));
    if (!Done(op, c2)) return false;
    Check(op, "combined_x", c2->combined_x.data(), ref_.combined_cached.data(), int64_t(in_.T) * H);
    if (!End(op)) return false;

    return RoutedDispatch("Dispatch(fp8,no weights)", in_.x8.dl, &in_.x8_scales.dl, nullptr,
                          &RankRef::fp8)
        .has_value();
  }

  /// A Dispatch of `x` (e4m3 with `x_scales`) routed by this rank's topk_idx, with
  /// `weights` or none, checked against the reference's `field`: its handle, or nullopt
  /// when it failed.
  std::optional<epd::Handle> RoutedDispatch(const char* op, const DLTensor& x,
                                            const DLTensor* x_scales, const DLTensor* weights,
                                            DispatchRef RankRef::*field) {
    Begin();
    epd::DispatchArgs args;
    args.x = &x;
    args.x_scales = x_scales;
    args.topk_idx = &in_.idx.dl;
    args.topk_weights = weights;
    args.expert_alignment = kAlignment;
    auto d = Finish(ep_.Dispatch(args));
    if (!Done(op, d)) return std::nullopt;
    Verify(op, d->mask, nullptr, &RankRef::dropped_dispatch, [&](const RankRef& ref) {
      CheckDispatch(op, *d, ref.*field, /*routing=*/true, /*fp8=*/x_scales != nullptr);
    });
    if (!End(op)) return std::nullopt;
    return d->handle;
  }

  /// LowLatencyDispatch of variant `v`, then its LowLatencyCombine.
  bool LowLatency(int v) {
    const LowLatencyVariant& variant = kLowLatencyVariants[v];
    const char* op = variant.name;
    Begin();
    epd::LowLatencyDispatchArgs la;
    la.x = &in_.xll.dl;
    la.topk_idx = &in_.idxll.dl;
    la.use_fp8 = variant.options.use_fp8;
    la.round_scale = variant.options.round_scale;
    la.use_ue8m0 = variant.options.use_ue8m0;
    auto l = Finish(ep_.LowLatencyDispatch(la));
    if (!Done(op, l)) return false;
    const int El = s_.num_local_experts(), H = s_.hidden;
    const int64_t rows = s_.ll_rows_per_expert();
    // Scale columns as stored: f32 per 128 channels, or int32 words of four UE8M0 bytes.
    const int S = variant.options.use_ue8m0 ? s_.num_scales() / 4 : s_.num_scales();
    Verify(op, l->mask, nullptr, &RankRef::dropped_ll, [&](const RankRef& rank_ref) {
      const LowLatencyRef& ref = rank_ref.ll[v];
      Check(op, "recv_count", l->recv_count.data(), ref.count.data(), El);
      const auto* count = l->recv_count.as<const int32_t>();
      for (int j = 0; count != nullptr && j < El && !op_mismatch_; ++j) {
        const int64_t n = ref.count[j];
        Check(op, "recv_src_info", l->recv_src_info.as<const int32_t>() + j * rows,
              ref.src.data() + j * rows, n);
        if (variant.options.use_fp8) {
          Check(op, "recv_x", l->recv_x.as<const e4m3_bits>() + j * rows * H,
                ref.x.data() + j * rows * H, n * H);
          for (int g = 0; g < S; ++g) {
            Check(op, "recv_scales", l->recv_scales.as<const uint32_t>() + (j * S + g) * rows,
                  reinterpret_cast<const uint32_t*>(ref.scales.data()) + (j * S + g) * rows, n);
          }
        } else {
          Check(op, "recv_x", l->recv_x.as<const bf16_bits>() + j * rows * H,
                reinterpret_cast<const bf16_bits*>(ref.x.data()) + j * rows * H, n * H);
        }
      }
    });
    const std::vector<RankSet> dispatch_sets = matched_sets_;
    if (!End(op)) return false;

    const std::string combine_op = absl::StrCat("LowLatencyCombine after ", variant.name);
    Begin();
    const epd::Handle handle = l->handle;
    epd::LowLatencyCombineArgs lc;
    lc.x = &in_.yll.dl;
    lc.topk_idx = &in_.idxll.dl;
    lc.topk_weights = &in_.wll.dl;
    lc.handle = &handle;
    auto c = Finish(ep_.LowLatencyCombine(lc));
    if (!Done(combine_op.c_str(), c)) return false;
    Verify(combine_op.c_str(), c->mask, &dispatch_sets, &RankRef::dropped_ll_combine,
           [&](const RankRef& ref) {
             Check(combine_op.c_str(), "combined_x", c->combined_x.data(), ref.ll_combined.data(),
                   int64_t(in_.Tll) * H);
           });
    return End(combine_op.c_str());
  }

  epd::Endpoint& ep_;
  const GroupShape& s_;
  RankInputs& in_;
  RankRef& ref_;
  MaskTracker* mask_ = nullptr;
  /// The reference the last OK op was checked against, and the masked ranks it ran with.
  const RankRef* cur_ = &ref_;
  RankSet cur_set_ = 0;
  /// The sets the last op's result matched (a combine tries each as its dispatch's).
  std::vector<RankSet> matched_sets_ = {0};
  epd::OpMask last_mask_;
  /// Verify tries a possible mask: mismatches are noted in op_mismatch_ only.
  bool quiet_ = false;
  absl::StatusCode last_code_ = absl::StatusCode::kOk;
  std::chrono::steady_clock::time_point start_;
  bool op_mismatch_ = false;
  int64_t oks_ = 0, bad_ = 0, mismatches_ = 0, max_ms_ = 0;
  int ops_ = 0;
  std::string last_error_;
  HostViews host_views_;
};

/// What the loop does besides its rounds (flags --reconnect, --unmask_self, --mask_self).
struct LoopOptions {
  epd::Client* client = nullptr;
  epd::Endpoint* endpoint = nullptr;
  MaskTracker* mask = nullptr;  ///< Under MASK.
  bool reconnect = false;
  bool unmask_self = false;
  int self_mask_rank = -1, self_mask_round = -1, self_unmask_round = -1;
};

/// --mask_self: this process masks (or unmasks) rank `target` with UpdateRankMask, printing
/// "SELFMASK mask|unmask rank <r> epoch=<e> masked=<ranks>". A mask it asked for must be in
/// the answer, and this process's later ops run with that epoch or a later one.
void SelfMask(Rank& rank, const LoopOptions& o, int target, bool mask) {
  const char* what = mask ? "mask" : "unmask";
  absl::StatusOr<epd::RankMask> m =
      mask ? o.endpoint->UpdateRankMask({target}, {}) : o.endpoint->UpdateRankMask({}, {target});
  if (!m.ok()) {
    return rank.Wrong(
        absl::StrCat("UpdateRankMask (", what, " rank ", target, "): ", m.status().ToString()));
  }
  o.mask->Learn(*m);
  // Applied at once: this process's next op (not yet submitted) runs with it or a later one.
  if (mask) o.mask->floor_epoch() = std::max(o.mask->floor_epoch(), m->epoch);
  RankSet set = 0;
  for (int32_t r : m->masked_ranks) set |= RankSet{1} << r;
  std::printf("SELFMASK %s rank %d epoch=%u masked=%s\n", what, target, m->epoch,
              SetString(set).c_str());
  if (mask && !((set >> target) & 1u)) {
    rank.Wrong(absl::StrCat("UpdateRankMask (mask rank ", target, ") answered masked ranks ",
                            SetString(set)));
  }
}

/// After a failed round: --reconnect on UNAVAILABLE (the daemon restarted) calls
/// Client::Reconnect; --unmask_self, when this rank was refused as masked, unmasks it.
void AfterError(Rank& rank, const LoopOptions& o) {
  if (o.reconnect && rank.last_code() == absl::StatusCode::kUnavailable) {
    const absl::Status st = o.client->Reconnect(absl::Seconds(30));
    if (st.ok()) {
      if (o.mask != nullptr) o.mask->Reset();
      std::printf("RECONNECTED session %s\n", o.client->session_id().c_str());
    } else {
      std::printf("RECONNECT FAILED %s\n", st.ToString().c_str());
    }
  }
  if (o.unmask_self && rank.last_code() == absl::StatusCode::kFailedPrecondition &&
      absl::StrContains(rank.last_error(), "the rank is masked")) {
    absl::StatusOr<epd::RankMask> m = o.endpoint->UpdateRankMask({}, {o.endpoint->rank()});
    if (m.ok()) {
      o.mask->Learn(*m);
      std::printf("UNMASK_SELF epoch=%u\n", m->epoch);
    } else {
      std::printf("UNMASK_SELF FAILED %s\n", m.status().ToString().c_str());
    }
  }
}

int Loop(Rank& rank, const LoopOptions& o) {
  const auto end =
      std::chrono::steady_clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_max_seconds));
  bool failed = false;
  int oks_after = 0;
  for (int64_t i = 0; !g_stop.load() && std::chrono::steady_clock::now() < end; ++i) {
    const int64_t mismatches = rank.mismatches();
    if (rank.RunRound()) {
      if (o.mask != nullptr) {
        // The mask the round's last op ran with (every op's was checked).
        std::printf("MASK %lld epoch=%u masked=%s\n", static_cast<long long>(i),
                    rank.last_mask().epoch, SetString(rank.last_set()).c_str());
      }
      std::printf("ROUND %lld OK\n", static_cast<long long>(i));
      if (failed && ++oks_after >= 3 && absl::GetFlag(FLAGS_exit_after_recovery)) {
        std::printf("RECOVERED max_op_ms=%lld\n", static_cast<long long>(rank.max_ms()));
        return rank.mismatches() > 0 ? 1 : 0;
      }
    } else {
      if (rank.mismatches() == mismatches) {
        std::printf("ROUND %lld %s\n", static_cast<long long>(i), rank.last_error().c_str());
      }
      failed = true;
      oks_after = 0;
      AfterError(rank, o);
    }
    if (i == o.self_mask_round) SelfMask(rank, o, o.self_mask_rank, /*mask=*/true);
    if (i == o.self_unmask_round) SelfMask(rank, o, o.self_mask_rank, /*mask=*/false);
    std::fflush(stdout);
    // A rank masked for being late is behind the group: each request of an op that ran
    // without it fails at once and moves it one op on, so it catches up only without a pause.
    const bool behind = o.mask != nullptr && !rank.last_error().empty() &&
                        rank.last_code() == absl::StatusCode::kFailedPrecondition &&
                        absl::StrContains(rank.last_error(), "which was masked");
    if (!behind) {
      std::this_thread::sleep_for(std::chrono::milliseconds(absl::GetFlag(FLAGS_round_pause_ms)));
    }
  }
  std::printf(
      "STOPPED mismatches=%lld %smax_op_ms=%lld\n", static_cast<long long>(rank.mismatches()),
      o.mask != nullptr ? absl::StrCat("mask_sets_inferred=", o.mask->inferred(), " ").c_str() : "",
      static_cast<long long>(rank.max_ms()));
  return rank.mismatches() > 0 ? 1 : 0;
}

#if EPD_MN_CLIENT_CUDA
/// A device copy of a host buffer, with a DLTensor on it (the same dims and dtype).
struct DeviceCopy {
  void* p = nullptr;
  DLTensor dl{};
  DeviceCopy() = default;
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  ~DeviceCopy() {
    if (p != nullptr) cudaFree(p);
  }
  template <typename T>
  absl::Status From(const Buf<T>& b, int device) {
    const size_t bytes = b.v.size() * sizeof(T);
    if (cudaMalloc(&p, bytes) != cudaSuccess ||
        cudaMemcpy(p, b.v.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
      return absl::InternalError("cudaMalloc/cudaMemcpy of a graph input");
    }
    dl = b.dl;
    dl.data = p;
    dl.device = DLDevice{kDLCUDA, device};
    return absl::OkStatus();
  }
};

/// --scenario=graph (see the file comment). Returns the exit code.
int Graph(epd::Endpoint& ep, const GroupShape& s, const std::vector<int32_t>& tokens, int targets,
          int rank) {
  const int R = s.num_ranks, Mll = s.ll_max_tokens_per_rank, H = s.hidden;
  const int El = s.num_local_experts();
  const int64_t rows = s.ll_rows_per_expert();
  std::vector<RankInputs> in(R);  // Every rank's inputs at capacity (Mll rows).
  for (int r = 0; r < R; ++r) {
    MakeInputs(s, absl::GetFlag(FLAGS_seed) + 1000, r, Mll, /*first_target=*/0, targets, in[r]);
  }
  const RankInputs& mine = in[rank];
  const int device = ep.LowLatencyCombineInput().dl().device.device_id;
  cudaSetDevice(device);
  DeviceCopy x, idx, w, y, T;
  Buf<int32_t> t_host;
  t_host.Make({1}, epd::testing::kI32);
  absl::Status up = x.From(mine.xll, device);
  if (up.ok()) up = idx.From(mine.idxll, device);
  if (up.ok()) up = w.From(mine.wll, device);
  if (up.ok()) up = y.From(mine.yll, device);
  if (up.ok()) up = T.From(t_host, device);
  cudaStream_t stream = nullptr;
  if (up.ok() && cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    up = absl::InternalError("cudaStreamCreate");
  }
  auto fail = [](const std::string& what) {
    std::printf("ERROR graph %s\n", what.c_str());
    return 1;
  };
  if (!up.ok()) return fail(std::string(up.message()));
  // The dispatch (T on the device) and its combine, enqueued on `stream`.
  struct Ops {
    absl::StatusOr<epd::PendingOp<epd::LowLatencyDispatchResult>> dop = absl::UnknownError("");
    absl::StatusOr<epd::PendingOp<epd::LowLatencyCombineResult>> cop = absl::UnknownError("");
    absl::StatusOr<epd::LowLatencyDispatchResult> d = absl::UnknownError("");
    absl::StatusOr<epd::LowLatencyCombineResult> c = absl::UnknownError("");
  };
  auto enqueue = [&]() {
    Ops o;
    epd::LowLatencyDispatchArgs la;
    la.x = &x.dl;
    la.topk_idx = &idx.dl;
    la.num_tokens = &T.dl;
    la.stream = stream;
    o.dop = ep.LowLatencyDispatch(la);
    o.d = o.dop.ok() ? o.dop->Enqueued() : o.dop.status();
    if (!o.d.ok()) return o;
    epd::LowLatencyCombineArgs lc;
    lc.x = &y.dl;
    lc.topk_idx = &idx.dl;
    lc.topk_weights = &w.dl;
    lc.handle = &o.d->handle;
    lc.stream = stream;
    o.cop = ep.LowLatencyCombine(lc);
    o.c = o.cop.ok() ? o.cop->Enqueued() : o.cop.status();
    return o;
  };
  int64_t oks = 0, bad = 0;
  // Round `round`'s outputs (views `dv`, `cv`) against kernels/host with every rank's `Ts`.
  auto check = [&](int round, const std::vector<int32_t>& Ts,
                   const epd::LowLatencyDispatchResult& dv,
                   const epd::LowLatencyCombineResult& cv) -> absl::Status {
    std::vector<epd::testing::LowLatencyRef> ref(R);
    std::vector<host::LowLatencyDispatchRankArgs> l(R);
    for (int r = 0; r < R; ++r) {
      l[r].num_tokens = Ts[r];
      l[r].x = in[r].xll.data();
      l[r].topk_idx = in[r].idxll.data();
      ref[r].Bind(s, false, l[r]);
    }
    EPD_RETURN_IF_ERROR(host::LowLatencyDispatch(s, {}, std::span(l)));
    std::vector<std::vector<bf16_bits>> combined(R);
    std::vector<host::LowLatencyCombineRankArgs> lc(R);
    for (int r = 0; r < R; ++r) {
      combined[r].assign(std::max<size_t>(size_t(Ts[r]) * H, 1), 0);
      lc[r].num_tokens = Ts[r];
      lc[r].topk_idx = in[r].idxll.data();
      lc[r].topk_weights = in[r].wll.data();
      lc[r].handle_pos = ref[r].pos.data();
      lc[r].x = in[r].yll.data();
      lc[r].combined_x = combined[r].data();
    }
    EPD_RETURN_IF_ERROR(host::LowLatencyCombine(s, std::span(lc)));
    std::vector<int32_t> count(El);
    std::vector<int32_t> src(size_t(El) * rows);
    std::vector<bf16_bits> rx(size_t(El) * rows * H);
    std::vector<bf16_bits> cx(size_t(std::max(Ts[rank], 1)) * H);
    const bool copied = cudaMemcpy(count.data(), dv.recv_count.data(), count.size() * 4,
                                   cudaMemcpyDeviceToHost) == cudaSuccess &&
                        cudaMemcpy(src.data(), dv.recv_src_info.data(), src.size() * 4,
                                   cudaMemcpyDeviceToHost) == cudaSuccess &&
                        cudaMemcpy(rx.data(), dv.recv_x.data(), rx.size() * 2,
                                   cudaMemcpyDeviceToHost) == cudaSuccess &&
                        cudaMemcpy(cx.data(), cv.combined_x.data(), size_t(Ts[rank]) * H * 2,
                                   cudaMemcpyDeviceToHost) == cudaSuccess;
    if (!copied) return absl::InternalError("cudaMemcpy of a view");
    std::string diff = epd::testing::FirstDifference(count.data(), ref[rank].count.data(), El);
    for (int j = 0; j < El && diff.empty(); ++j) {
      const int64_t n = ref[rank].count[j];
      diff =
          epd::testing::FirstDifference(src.data() + j * rows, ref[rank].src.data() + j * rows, n);
      if (diff.empty()) {
        diff = epd::testing::FirstDifference(
            rx.data() + j * rows * H,
            reinterpret_cast<const bf16_bits*>(ref[rank].x.data()) + j * rows * H, n * H);
      }
    }
    if (diff.empty()) {
      diff = epd::testing::FirstDifference(cx.data(), combined[rank].data(), int64_t(Ts[rank]) * H);
    }
    if (!diff.empty()) {
      ++bad;
      std::printf("MISMATCH rank %d graph %d (T %d): %s\n", rank, round, Ts[rank], diff.c_str());
    } else {
      ++oks;
      std::printf("GRAPH %d OK (T %d)\n", round, Ts[rank]);
    }
    std::fflush(stdout);
    return absl::OkStatus();
  };
  auto tokens_of = [&](int round) {
    std::vector<int32_t> Ts(R);
    for (int r = 0; r < R; ++r) Ts[r] = (tokens[r] + 3 * round) % (Mll + 1);
    return Ts;
  };
  const absl::Duration wait = absl::Seconds(absl::GetFlag(FLAGS_wait_seconds));
  // Round 0, not captured: the same ops outside a graph.
  std::vector<int32_t> Ts = tokens_of(0);
  if (cudaMemcpy(T.p, &Ts[rank], 4, cudaMemcpyHostToDevice) != cudaSuccess) {
    return fail("cudaMemcpy of T");
  }
  {
    Ops o = enqueue();
    if (!o.c.ok()) return fail(absl::StrCat("round 0: ", o.c.status().ToString()));
    auto dw = o.dop->Wait(wait);
    auto cw = o.cop->Wait(wait);
    if (!dw.ok() || !cw.ok()) {
      return fail(absl::StrCat("round 0: ", (!dw.ok() ? dw.status() : cw.status()).ToString()));
    }
    if (absl::Status st = check(0, Ts, *dw, *cw); !st.ok()) return fail(st.ToString());
  }
  // Rounds 1..: one capture, replayed with new T.
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    return fail("cudaStreamBeginCapture");
  }
  Ops g = enqueue();
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (!g.c.ok()) return fail(absl::StrCat("capture: ", g.c.status().ToString()));
  cudaGraphExec_t exec = nullptr;
  if (ended != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
    return fail("cudaStreamEndCapture / cudaGraphInstantiate");
  }
  for (int round = 1; round <= absl::GetFlag(FLAGS_graph_rounds); ++round) {
    Ts = tokens_of(round);
    if (cudaMemcpy(T.p, &Ts[rank], 4, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaGraphLaunch(exec, stream) != cudaSuccess ||
        cudaStreamSynchronize(stream) != cudaSuccess) {
      return fail(absl::StrCat("replay ", round, ": CUDA error"));
    }
    auto dw = g.dop->Wait(wait);
    auto cw = g.cop->Wait(wait);
    if (!dw.ok() || !cw.ok()) {
      ++bad;
      std::printf("GRAPH %d ERROR %s\n", round,
                  (!dw.ok() ? dw.status() : cw.status()).ToString().c_str());
      continue;
    }
    // The captured views (a replay writes the buffers the capture's views show).
    if (absl::Status st = check(round, Ts, *g.d, *g.c); !st.ok()) return fail(st.ToString());
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  std::printf("DONE ok=%lld bad=%lld\n", static_cast<long long>(oks), static_cast<long long>(bad));
  return bad == 0 && oks > 0 ? 0 : 1;
}
#endif  // EPD_MN_CLIENT_CUDA

/// How many of group `spec`'s ranks have joined, as `client`'s daemon reports them
/// (ListGroups): for a group across nodes the sum of every node's joined ranks, as each
/// last published them (0 for a node not registered yet); otherwise the joined ranks of the
/// group on this daemon. -1 when the daemon could not be asked (the error is ignored: the
/// caller polls again).
int JoinedRanks(epd::Client& client, const epd::v1::GroupSpec& spec) {
  absl::StatusOr<epd::v1::ListGroupsResponse> groups = client.ListGroups();
  if (!groups.ok()) return -1;
  for (const epd::v1::GroupInfo& g : groups->groups()) {
    if (g.spec().name() != spec.name()) continue;
    if (spec.nodes_size() <= 1) return g.ranks_size();
    int joined = 0;
    for (const epd::v1::GroupNodeInfo& n : g.nodes()) {
      if (n.state() == epd::v1::NODE_STATE_SELF || n.state() == epd::v1::NODE_STATE_REGISTERED) {
        joined += std::max(n.joined_ranks(), 0);
      }
    }
    return joined;
  }
  return 0;
}

/// The join barrier: after its Join, a rank waits until every rank of the group has joined
/// (polled every 50 ms, at most `bound`), so that its first op does not spend its op_timeout
/// waiting for a rank still joining (ranks of a loaded machine join seconds apart). When the
/// bound passes it prints one line and goes on: the first op's own bound then reports the
/// missing rank.
void WaitForEveryRank(epd::Client& client, const epd::v1::GroupSpec& spec, absl::Duration bound) {
  if (bound <= absl::ZeroDuration()) return;
  const absl::Time start = absl::Now();
  int joined = JoinedRanks(client, spec);
  while (joined < spec.num_ranks()) {
    if (absl::Now() - start >= bound) {
      std::printf(
          "JOIN_BARRIER not every rank joined within %lld ms (%d of %d seen): starting "
          "the ops anyway\n",
          static_cast<long long>(absl::ToInt64Milliseconds(bound)), std::max(joined, 0),
          spec.num_ranks());
      std::fflush(stdout);
      return;
    }
    absl::SleepFor(absl::Milliseconds(50));
    joined = JoinedRanks(client, spec);
  }
}

int Main() {
  auto nodes = epd::multinode::ParseNodesFlag(absl::GetFlag(FLAGS_nodes));
  if (!nodes.ok()) {
    std::printf("FLAGS %s\n", std::string(nodes.status().message()).c_str());
    return 2;
  }
  epd::v1::GroupSpec spec = epd::multinode::DataSpec(absl::GetFlag(FLAGS_group), *nodes);
  spec.set_transport(absl::GetFlag(FLAGS_transport));
  const std::string policy = absl::GetFlag(FLAGS_on_rank_failure);
  const bool masking = policy == "mask";
  if (masking) {
    spec.set_on_rank_failure(epd::v1::RANK_FAILURE_POLICY_MASK);
  } else if (policy == "fail") {
    spec.set_on_rank_failure(epd::v1::RANK_FAILURE_POLICY_FAIL);
  } else if (!policy.empty()) {
    std::printf("FLAGS --on_rank_failure=%s is not fail or mask\n", policy.c_str());
    return 2;
  }
  if (masking && absl::GetFlag(FLAGS_scenario) != "loop") {
    std::printf("FLAGS --on_rank_failure=mask checks --scenario=loop only\n");
    return 2;
  }
  const GroupShape shape = epd::rules::ShapeOf(spec);
  const int R = shape.num_ranks, rank = absl::GetFlag(FLAGS_rank);
  std::vector<int32_t> tokens(R, 5);
  const std::string tokens_flag = absl::GetFlag(FLAGS_tokens);
  if (!tokens_flag.empty()) {
    std::vector<std::string> parts = absl::StrSplit(tokens_flag, ',');
    if (static_cast<int>(parts.size()) != R) {
      std::printf("FLAGS --tokens has %zu entries for %d ranks\n", parts.size(), R);
      return 2;
    }
    for (int r = 0; r < R; ++r) {
      if (!absl::SimpleAtoi(parts[r], &tokens[r])) {
        std::printf("FLAGS --tokens entry %d \"%s\" is not a number\n", r, parts[r].c_str());
        return 2;
      }
    }
  }
  int first = 0;
  int targets = absl::GetFlag(FLAGS_to_first_node) && !nodes->empty()
                    ? (*nodes)[0].num_ranks * epd::multinode::kExpertsPerRank
                    : shape.num_experts;
  const std::string skew = absl::GetFlag(FLAGS_skew);
  const int skew_target = absl::GetFlag(FLAGS_skew_target);
  if (skew == "expert" || skew == "rank") {
    targets = skew == "expert" ? 1 : epd::multinode::kExpertsPerRank;
    first = skew_target * targets;
    if (first < 0 || first + targets > shape.num_experts) {
      std::printf("FLAGS --skew_target=%d is out of range for --skew=%s\n", skew_target,
                  skew.c_str());
      return 2;
    }
  } else if (skew != "none") {
    std::printf("FLAGS --skew=%s is not none, expert or rank\n", skew.c_str());
    return 2;
  }
  std::vector<RankInputs> in(R);
  for (int r = 0; r < R; ++r) {
    MakeInputs(shape, absl::GetFlag(FLAGS_seed), r, tokens[r], first, targets, in[r]);
  }
  auto ref = Reference(shape, in);
  if (!ref.ok()) {
    std::printf("REFERENCE %s\n", ref.status().ToString().c_str());
    return 2;
  }

  epd::ClientOptions options;
  options.socket_path = absl::GetFlag(FLAGS_socket);
  options.client_name = absl::StrCat("mn_client rank ", rank);
  auto client = epd::Client::Connect(options);
  if (!client.ok()) {
    std::printf("CONNECT_ERROR %s\n", client.status().ToString().c_str());
    return 2;
  }
  epd::JoinOptions join;
  join.spec = spec;
  join.rank = rank;
  join.gpu_uuid = absl::GetFlag(FLAGS_gpu_uuid);
  const std::string launch_mode = absl::GetFlag(FLAGS_launch_mode);
  if (launch_mode == "client") join.launch_mode = epd::v1::LAUNCH_MODE_CLIENT;
  if (launch_mode == "daemon") join.launch_mode = epd::v1::LAUNCH_MODE_DAEMON;
  absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_join_delay_ms)));
  auto ep = (*client)->Join(join);
  if (!ep.ok()) {
    std::printf("JOIN_ERROR %s\n", ep.status().ToString().c_str());
    return 2;
  }
  std::printf("JOINED rank %d of %d\n", rank, R);
  std::fflush(stdout);
  const int barrier_ms = absl::GetFlag(FLAGS_join_barrier_ms);
  WaitForEveryRank(**client, spec,
                   barrier_ms < 0 ? absl::Seconds(absl::GetFlag(FLAGS_wait_seconds))
                                  : absl::Milliseconds(barrier_ms));
  Rank runner(**ep, shape, in[rank], (*ref)[rank]);
  LoopOptions loop;
  loop.client = client->get();
  loop.endpoint = ep->get();
  loop.reconnect = absl::GetFlag(FLAGS_reconnect);
  std::optional<MaskTracker> tracker;
  if (masking) {
    tracker.emplace(**ep, shape, in, &(*ref)[rank], absl::GetFlag(FLAGS_testing_ignore_mask));
    runner.SetMasking(&*tracker);
    loop.mask = &*tracker;
    loop.unmask_self = absl::GetFlag(FLAGS_unmask_self);
    if (const std::string m = absl::GetFlag(FLAGS_mask_self); !m.empty()) {
      std::vector<std::string> parts = absl::StrSplit(m, ':');
      if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &loop.self_mask_rank) ||
          !absl::SimpleAtoi(parts[1], &loop.self_mask_round) ||
          !absl::SimpleAtoi(parts[2], &loop.self_unmask_round)) {
        std::printf("FLAGS --mask_self=%s is not RANK:ROUND:ROUND\n", m.c_str());
        return 2;
      }
    }
  }
  if (absl::GetFlag(FLAGS_scenario) == "loop") return Loop(runner, loop);
  if (absl::GetFlag(FLAGS_scenario) == "graph") {
#if EPD_MN_CLIENT_CUDA
    return Graph(**ep, shape, tokens, targets, rank);
#else
    std::printf("FLAGS --scenario=graph needs a CUDA build\n");
    return 2;
#endif
  }
  const bool ok = absl::GetFlag(FLAGS_scenario) == "probes"
                      ? runner.Probes(absl::GetFlag(FLAGS_probe_rank))
                      : runner.RunAll();
  std::printf("DONE ok=%lld bad=%lld max_op_ms=%lld\n", static_cast<long long>(runner.oks()),
              static_cast<long long>(runner.bad()), static_cast<long long>(runner.max_ms()));
  return ok && runner.bad() == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  // The test closes stdin to stop a loop.
  epd::testing::StopAtStdinEof(&g_stop);
  return Main();
}
