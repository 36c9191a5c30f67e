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
// Every scenario ends with "max_op_ms=<n>" on its DONE / STOPPED line: the longest any op
// of this process took from submit to result (errors included); --report_slow_ms prints a
// "SLOW" line for each op slower than that.
// Exit 2: connect or join failed (the line says why).
// Against a CUDA daemon (tests/gpu/multinode_cuda_test.cc) the results live in device
// memory: each op's views are copied to host memory (cudaMemcpy) before they are checked.
#include <dlpack/dlpack.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "epd/client.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/op_rules.h"
#include "epd/kernels/types.h"
#include "tests/common/dtypes.h"
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
};

/// Runs host::Dispatch for every rank: `mode` 0 = BF16 with weights, 1 = cached re-dispatch
/// of x2 on mode 0's routing, 2 = FP8 without weights.
absl::Status ReferenceDispatch(const GroupShape& s, std::vector<RankInputs>& in,
                               std::vector<RankRef>& ref, int mode) {
  const int R = s.num_ranks;
  std::vector<host::DispatchRankArgs> d(R);
  for (int r = 0; r < R; ++r) {
    d[r].num_tokens = in[r].T;
    DispatchRef* out = &ref[r].dispatch;
    if (mode == 0) {
      d[r].x = in[r].x.data();
      d[r].topk_idx = in[r].idx.data();
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
      d[r].topk_idx = in[r].idx.data();
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

/// Every rank's expected results, computed with kernels/host over the whole group.
absl::StatusOr<std::vector<RankRef>> Reference(const GroupShape& s, std::vector<RankInputs>& in) {
  const int R = s.num_ranks, H = s.hidden, K = s.num_topk;
  std::vector<RankRef> ref(R);
  for (int r = 0; r < R; ++r) {
    RankRef& o = ref[r];
    o.tokens_per_rank.assign(R, 0);
    o.tokens_per_expert.assign(s.num_experts, 0);
    o.in_rank.assign(std::max<size_t>(size_t(in[r].T) * R, 1), 0);
    host::LayoutRankArgs a{in[r].T, in[r].idx.data(), o.tokens_per_rank.data(),
                           o.tokens_per_expert.data(), o.in_rank.data()};
    EPD_RETURN_IF_ERROR(host::GetDispatchLayout(s, a));
  }
  EPD_RETURN_IF_ERROR(ReferenceDispatch(s, in, ref, 0));
  EPD_RETURN_IF_ERROR(ReferenceDispatch(s, in, ref, 1));
  EPD_RETURN_IF_ERROR(ReferenceDispatch(s, in, ref, 2));
  // Combine with weights (of the first dispatch's rows), then without (the cached rows).
  for (bool weights : {true, false}) {
    std::vector<host::CombineRankArgs> c(R);
    for (int r = 0; r < R; ++r) {
      RankRef& o = ref[r];
      const DispatchRef& d = weights ? o.dispatch : o.cached;
      std::vector<bf16_bits>& out = weights ? o.combined : o.combined_cached;
      out.assign(std::max<size_t>(size_t(in[r].T) * H, 1), 0);
      c[r].num_tokens = in[r].T;
      c[r].send_pos = d.send_pos.data();
      c[r].num_recv_tokens = d.N;
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
  for (int v = 0; v < kNumLowLatencyVariants; ++v) {
    std::vector<host::LowLatencyDispatchRankArgs> l(R);
    for (int r = 0; r < R; ++r) {
      l[r].num_tokens = in[r].Tll;
      l[r].x = in[r].xll.data();
      l[r].topk_idx = in[r].idxll.data();
      ref[r].ll[v].Bind(s, kLowLatencyVariants[v].options.use_fp8, l[r]);
    }
    EPD_RETURN_IF_ERROR(host::LowLatencyDispatch(s, kLowLatencyVariants[v].options, std::span(l)));
  }
  // Every variant routes the same tokens: one combine answer.
  std::vector<host::LowLatencyCombineRankArgs> lc(R);
  for (int r = 0; r < R; ++r) {
    RankRef& o = ref[r];
    o.ll_combined.assign(std::max<size_t>(size_t(in[r].Tll) * H, 1), 0);
    lc[r].num_tokens = in[r].Tll;
    lc[r].topk_idx = in[r].idxll.data();
    lc[r].topk_weights = in[r].wll.data();
    lc[r].handle_pos = o.ll[0].pos.data();
    lc[r].x = in[r].yll.data();
    lc[r].combined_x = o.ll_combined.data();
  }
  EPD_RETURN_IF_ERROR(host::LowLatencyCombine(s, std::span(lc)));
  return ref;
}

/// Runs this rank's ops and checks each result against the reference.
class Rank {
 public:
  Rank(epd::Endpoint& ep, const GroupShape& shape, RankInputs& in, RankRef& ref)
      : ep_(ep), s_(shape), in_(in), ref_(ref) {}

  /// One pass of every op; false when one failed or mismatched.
  bool RunAll() {
    bool ok = Layout();
    ok &= NormalOps(/*all=*/true);
    for (int v = 0; v < kNumLowLatencyVariants; ++v) ok &= LowLatency(v);
    return ok;
  }
  /// Dispatch + Combine + LowLatencyDispatch + LowLatencyCombine (the loop's round).
  bool RunRound() { return NormalOps(/*all=*/false) && LowLatency(0); }

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
    ++mismatches_;
    std::printf("MISMATCH rank %d %s %s %s\n", ep_.rank(), op, field, detail.c_str());
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
        RoutedDispatch("Dispatch(bf16,weights)", in_.x.dl, nullptr, &in_.w.dl, ref_.dispatch);
    if (!routed.has_value()) return false;
    const epd::Handle handle = *routed;

    // Identity experts: the combine's x is the reference's received rows.
    Buf<bf16_bits> cx;
    Buf<float> cw;
    cx.Make({ref_.dispatch.N, H}, kBf16);
    cw.Make({ref_.dispatch.N, K}, kF32);
    std::memcpy(cx.data(), ref_.dispatch.recv_x.data(), size_t(ref_.dispatch.N) * H * 2);
    std::memcpy(cw.data(), ref_.dispatch.recv_w.data(), size_t(ref_.dispatch.N) * K * 4);
    const char* op = "Combine(weights)";
    Begin();
    epd::CombineArgs ca;
    ca.x = &cx.dl;
    ca.topk_weights = &cw.dl;
    ca.handle = &handle;
    auto c = Finish(ep_.Combine(ca));
    if (!Done(op, c)) return false;
    Check(op, "combined_x", c->combined_x.data(), ref_.combined.data(), int64_t(in_.T) * H);
    Check(op, "combined_topk_weights", c->combined_topk_weights.data(), ref_.combined_w.data(),
          int64_t(in_.T) * K);
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
                          ref_.fp8)
        .has_value();
  }

  /// A Dispatch of `x` (e4m3 with `x_scales`) routed by this rank's topk_idx, with
  /// `weights` or none, checked against `ref`: its handle, or nullopt when it failed.
  std::optional<epd::Handle> RoutedDispatch(const char* op, const DLTensor& x,
                                            const DLTensor* x_scales, const DLTensor* weights,
                                            const DispatchRef& ref) {
    Begin();
    epd::DispatchArgs args;
    args.x = &x;
    args.x_scales = x_scales;
    args.topk_idx = &in_.idx.dl;
    args.topk_weights = weights;
    args.expert_alignment = kAlignment;
    auto d = Finish(ep_.Dispatch(args));
    if (!Done(op, d)) return std::nullopt;
    CheckDispatch(op, *d, ref, /*routing=*/true, /*fp8=*/x_scales != nullptr);
    if (!End(op)) return std::nullopt;
    return d->handle;
  }

  /// LowLatencyDispatch of variant `v`, then its LowLatencyCombine.
  bool LowLatency(int v) {
    const LowLatencyVariant& variant = kLowLatencyVariants[v];
    const LowLatencyRef& ref = ref_.ll[v];
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
    Check(combine_op.c_str(), "combined_x", c->combined_x.data(), ref_.ll_combined.data(),
          int64_t(in_.Tll) * H);
    return End(combine_op.c_str());
  }

  epd::Endpoint& ep_;
  const GroupShape& s_;
  RankInputs& in_;
  RankRef& ref_;
  std::chrono::steady_clock::time_point start_;
  bool op_mismatch_ = false;
  int64_t oks_ = 0, bad_ = 0, mismatches_ = 0, max_ms_ = 0;
  int ops_ = 0;
  std::string last_error_;
  HostViews host_views_;
};

int Loop(Rank& rank) {
  const auto end =
      std::chrono::steady_clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_max_seconds));
  bool failed = false;
  int oks_after = 0;
  for (int64_t i = 0; !g_stop.load() && std::chrono::steady_clock::now() < end; ++i) {
    const int64_t mismatches = rank.mismatches();
    if (rank.RunRound()) {
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
    }
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::milliseconds(absl::GetFlag(FLAGS_round_pause_ms)));
  }
  std::printf("STOPPED mismatches=%lld max_op_ms=%lld\n", static_cast<long long>(rank.mismatches()),
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

int Main() {
  auto nodes = epd::multinode::ParseNodesFlag(absl::GetFlag(FLAGS_nodes));
  if (!nodes.ok()) {
    std::printf("FLAGS %s\n", std::string(nodes.status().message()).c_str());
    return 2;
  }
  epd::v1::GroupSpec spec = epd::multinode::DataSpec(absl::GetFlag(FLAGS_group), *nodes);
  spec.set_transport(absl::GetFlag(FLAGS_transport));
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
  auto ep = (*client)->Join(join);
  if (!ep.ok()) {
    std::printf("JOIN_ERROR %s\n", ep.status().ToString().c_str());
    return 2;
  }
  std::printf("JOINED rank %d of %d\n", rank, R);
  std::fflush(stdout);
  Rank runner(**ep, shape, in[rank], (*ref)[rank]);
  if (absl::GetFlag(FLAGS_scenario) == "loop") return Loop(runner);
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
