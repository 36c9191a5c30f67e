// epd_victim: one rank of a victim group for the security suite (tests/security/): a real
// libepdclient process that joins --group as --rank and runs rounds of every op kind while
// an attacker goes at epd beside it, recomputing the whole group's op with kernels/host
// (inputs are a pure function of seed, round and rank) and checking every OK result byte
// for byte. It stops at EOF on stdin or after --max_seconds; exit 0, or 1 when a result was
// wrong. The round and the output lines: docs/SECURITY.md "The suite's programs".
#include <dlpack/dlpack.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "daemon/dataplane/lockstep_group.h"
#include "epd/client.h"
#include "epd/kernels/host_ops.h"
#include "epd/kernels/types.h"
#include "tests/common/dtypes.h"
#include "tests/common/op_reference.h"
#include "tests/common/stdin_eof.h"
#include "tests/security/security_spec.h"

ABSL_FLAG(std::string, socket, "", "epd's unix socket");
ABSL_FLAG(std::string, group, "victim", "group name");
ABSL_FLAG(int, rank, 0, "this process's rank");
ABSL_FLAG(int, num_ranks, epd::security::kNumRanks, "ranks of the group");
ABSL_FLAG(uint64_t, seed, 1, "input seed (every rank of a group must use the same)");
ABSL_FLAG(std::string, join_secret, "", "the group's join secret ('' = none)");
ABSL_FLAG(int, max_seconds, 120, "stop after this long even without EOF on stdin");

namespace {

namespace host = epd::kernels::host;
using epd::kernels::bf16_bits;
using epd::kernels::e4m3_bits;
using epd::kernels::GroupShape;

using epd::testing::kBf16;
using epd::testing::kF32;
using epd::testing::kI64;
constexpr int32_t kAlignment = 2;
constexpr absl::Duration kWaitTimeout = absl::Seconds(10);

std::atomic<bool> g_stop{false};

/// A compact DLTensor over a vector's data, owning its shape.
struct Tensor {
  std::vector<int64_t> shape;
  DLTensor dl{};
  template <typename T>
  void Bind(std::vector<T>& data, DLDataType dtype, std::vector<int64_t> dims) {
    shape = std::move(dims);
    dl = epd::MakeDLTensor(data.data(), dtype, shape);
  }
};

/// One rank's inputs of one round.
struct RankInputs {
  int32_t T = 0, Tll = 0;
  std::vector<bf16_bits> x, x2;  ///< [T, H]: Dispatch, cached re-dispatch.
  std::vector<int64_t> idx;      ///< [T, K].
  std::vector<float> w;          ///< [T, K].
  std::vector<bf16_bits> xll;    ///< [Tll, H].
  std::vector<int64_t> idxll;    ///< [Tll, K].
  std::vector<float> wll;        ///< [Tll, K].
  std::vector<bf16_bits> yll;    ///< [El, R*Mll, H]: the rank's low-latency expert outputs.
};

/// Rank `rank`'s inputs of round `round`: T in [1, M], Tll in [1, Mll]; expert ids of
/// each row distinct, the second one masked (-1) one time in four; values exact in bf16.
RankInputs MakeInputs(const GroupShape& s, uint64_t seed, int64_t round, int rank) {
  std::mt19937_64 rng(seed * 1000003ull + static_cast<uint64_t>(round) * 7919ull +
                      static_cast<uint64_t>(rank) * 104729ull);
  auto value = [&] { return epd::kernels::FloatToBf16(float(int(rng() % 255) - 127) / 32.f); };
  auto ids = [&](int32_t T, std::vector<int64_t>& idx, std::vector<float>& w) {
    idx.resize(size_t(T) * s.num_topk);
    w.resize(idx.size());
    for (int32_t t = 0; t < T; ++t) {
      for (int k = 0; k < s.num_topk; ++k) {
        int64_t e = -1;
        if (k == 0 || rng() % 4 != 0) {
          do {
            e = static_cast<int64_t>(rng() % s.num_experts);
          } while (std::find(idx.begin() + t * s.num_topk, idx.begin() + t * s.num_topk + k, e) !=
                   idx.begin() + t * s.num_topk + k);
        }
        idx[size_t(t) * s.num_topk + k] = e;
        w[size_t(t) * s.num_topk + k] = float(1 + rng() % 8) / 8.f;
      }
    }
  };
  RankInputs in;
  in.T = 1 + static_cast<int32_t>(rng() % s.max_tokens_per_rank);
  in.Tll = 1 + static_cast<int32_t>(rng() % s.ll_max_tokens_per_rank);
  in.x.resize(size_t(in.T) * s.hidden);
  in.x2.resize(in.x.size());
  for (auto& v : in.x) v = value();
  for (auto& v : in.x2) v = value();
  ids(in.T, in.idx, in.w);
  in.xll.resize(size_t(in.Tll) * s.hidden);
  for (auto& v : in.xll) v = value();
  ids(in.Tll, in.idxll, in.wll);
  in.yll.resize(size_t(s.num_local_experts()) * s.ll_rows_per_expert() * s.hidden);
  for (auto& v : in.yll) v = value();
  return in;
}

using epd::testing::DispatchRef;
using epd::testing::LowLatencyRef;

/// One rank's expected results of a round (kernels/host over the whole group).
struct RankRef {
  std::vector<int32_t> tokens_per_rank, tokens_per_expert;
  std::vector<uint8_t> in_rank;
  DispatchRef dispatch, cached;
  std::vector<bf16_bits> combined;
  std::vector<float> combined_w;
  LowLatencyRef ll, ll8;
  std::vector<bf16_bits> ll_combined;
};

/// Every rank's expected results of the round with inputs `in`.
absl::StatusOr<std::vector<RankRef>> Reference(const GroupShape& s, std::vector<RankInputs>& in) {
  const int R = s.num_ranks, H = s.hidden, K = s.num_topk, E = s.num_experts;
  std::vector<RankRef> ref(R);
  for (int r = 0; r < R; ++r) {
    RankRef& o = ref[r];
    o.tokens_per_rank.assign(R, 0);
    o.tokens_per_expert.assign(E, 0);
    o.in_rank.assign(size_t(in[r].T) * R, 0);
    host::LayoutRankArgs a;
    a.num_tokens = in[r].T;
    a.topk_idx = in[r].idx.data();
    a.num_tokens_per_rank = o.tokens_per_rank.data();
    a.num_tokens_per_expert = o.tokens_per_expert.data();
    a.is_token_in_rank = o.in_rank.data();
    if (absl::Status st = host::GetDispatchLayout(s, a); !st.ok()) return st;
  }
  host::DispatchOptions dopt;
  dopt.expert_alignment = kAlignment;
  // The dispatch, then (after the combine) the cached re-dispatch of x2 on its routing.
  for (bool cached : {false, true}) {
    std::vector<host::DispatchRankArgs> d(R);
    for (int r = 0; r < R; ++r) {
      RankRef& o = ref[r];
      d[r].num_tokens = in[r].T;
      if (cached) {
        d[r].x = in[r].x2.data();
        d[r].cached_send_pos = o.dispatch.send_pos.data();
        d[r].cached_num_recv_tokens = o.dispatch.N;
      } else {
        d[r].x = in[r].x.data();
        d[r].topk_idx = in[r].idx.data();
        d[r].topk_weights = in[r].w.data();
      }
      (cached ? o.cached : o.dispatch).Bind(s, d[r]);
    }
    if (absl::Status st = host::Dispatch(s, dopt, std::span(d)); !st.ok()) return st;
    for (int r = 0; r < R; ++r) (cached ? ref[r].cached : ref[r].dispatch).N = d[r].num_recv_tokens;
    if (cached) break;
    std::vector<host::CombineRankArgs> c(R);
    for (int r = 0; r < R; ++r) {
      RankRef& o = ref[r];
      o.combined.assign(size_t(in[r].T) * H, 0);
      o.combined_w.assign(size_t(in[r].T) * K, 0);
      c[r].num_tokens = in[r].T;
      c[r].send_pos = o.dispatch.send_pos.data();
      c[r].num_recv_tokens = o.dispatch.N;
      c[r].x = o.dispatch.bf16();
      c[r].topk_weights = o.dispatch.recv_w.data();
      c[r].combined_x = o.combined.data();
      c[r].combined_topk_weights = o.combined_w.data();
    }
    if (absl::Status st = host::Combine(s, std::span(c)); !st.ok()) return st;
  }
  // Low-latency: bf16 dispatch, its combine, then the FP8 dispatch.
  for (bool fp8 : {false, true}) {
    std::vector<host::LowLatencyDispatchRankArgs> l(R);
    for (int r = 0; r < R; ++r) {
      l[r].num_tokens = in[r].Tll;
      l[r].x = in[r].xll.data();
      l[r].topk_idx = in[r].idxll.data();
      (fp8 ? ref[r].ll8 : ref[r].ll).Bind(s, fp8, l[r]);
    }
    host::LowLatencyDispatchOptions lopt;
    lopt.use_fp8 = fp8;
    if (absl::Status st = host::LowLatencyDispatch(s, lopt, std::span(l)); !st.ok()) return st;
    if (fp8) break;
    std::vector<host::LowLatencyCombineRankArgs> lc(R);
    for (int r = 0; r < R; ++r) {
      RankRef& o = ref[r];
      o.ll_combined.assign(size_t(in[r].Tll) * H, 0);
      lc[r].num_tokens = in[r].Tll;
      lc[r].topk_idx = in[r].idxll.data();
      lc[r].topk_weights = in[r].wll.data();
      lc[r].handle_pos = o.ll.pos.data();
      lc[r].x = in[r].yll.data();
      lc[r].combined_x = o.ll_combined.data();
    }
    if (absl::Status st = host::LowLatencyCombine(s, std::span(lc)); !st.ok()) return st;
  }
  return ref;
}

/// Runs the victim's rounds on `ep` until stopped; returns the process exit code.
class Victim {
 public:
  Victim(epd::Endpoint& ep, uint64_t seed) : ep_(ep), seed_(seed) {
    shape_ = epd::ShapeOf(ep.spec());
    rank_ = ep.rank();
  }

  int Run(absl::Duration max_time) {
    const absl::Time end = absl::Now() + max_time;
    int64_t round = 0;
    if (!AwaitGroup(end)) {
      std::printf("VICTIM rank %d never saw its whole group\n", rank_);
      return 0;
    }
    for (; !g_stop.load() && absl::Now() < end; ++round) {
      round_failed_ = false;
      RunRound(round);
      if (g_stop.load() && round_failed_) {
        std::printf("ROUND %lld STOPPED\n", static_cast<long long>(round));
        continue;
      }
      if (round_failed_) {
        ++errors_;
      } else if (round_mismatch_) {
        // Counted per field in mismatches_.
      } else {
        ++ok_;
        std::printf("ROUND %lld OK\n", static_cast<long long>(round));
      }
    }
    std::printf("VICTIM rank %d rounds=%lld ok=%lld errors=%lld mismatches=%lld\n", rank_,
                static_cast<long long>(round), static_cast<long long>(ok_),
                static_cast<long long>(errors_), static_cast<long long>(mismatches_));
    return mismatches_ > 0 ? 1 : 0;
  }

 private:
  /// Waits until every rank of the group has joined: a GetDispatchLayout repeated until it
  /// succeeds (it completes once every rank has submitted it, so the ranks start their
  /// rounds on the same op). False when stopped or past `end` first.
  bool AwaitGroup(absl::Time end) {
    std::vector<int64_t> idx = {0, 1 % shape_.num_experts}, dims = {1, shape_.num_topk};
    idx.resize(size_t(shape_.num_topk), -1);
    DLTensor t = epd::MakeDLTensor(idx.data(), kI64, dims);
    while (!g_stop.load() && absl::Now() < end) {
      absl::StatusOr<epd::LayoutResult> layout = Finish(ep_.GetDispatchLayout(t));
      if (layout.ok()) {
        std::printf("GROUP_READY\n");
        return true;
      }
      std::printf("WAITING_FOR_GROUP %s\n", std::string(layout.status().message()).c_str());
    }
    return false;
  }

  /// True (and the round failed) once the test asked the victim to stop.
  bool Stopping() {
    if (!g_stop.load()) return false;
    round_failed_ = true;
    return true;
  }

  /// Records op `op`'s error (the round then counts as failed, not as OK).
  void Error(int64_t round, const char* op, const absl::Status& st) {
    round_failed_ = true;
    std::printf("ROUND %lld ERROR %s %s: %s\n", static_cast<long long>(round), op,
                absl::StatusCodeToString(st.code()).c_str(), std::string(st.message()).c_str());
  }

  /// Compares `n` elements of an OK result with the reference; prints a MISMATCH line.
  template <typename T>
  void Check(int64_t round, const char* op, const char* field, const void* actual,
             const T* expected, int64_t n) {
    if (std::string diff = epd::testing::FirstDifference(actual, expected, n); !diff.empty()) {
      Mismatch(round, op, field, diff);
    }
  }
  void Mismatch(int64_t round, const char* op, const char* field, const std::string& detail) {
    round_mismatch_ = true;
    ++mismatches_;
    std::printf("MISMATCH round %lld %s %s %s\n", static_cast<long long>(round), op, field,
                detail.c_str());
  }
  template <typename T>
  void CheckEq(int64_t round, const char* op, const char* field, T actual, T expected) {
    if (actual != expected) {
      Mismatch(round, op, field, absl::StrCat("got ", actual, ", want ", expected));
    }
  }
  /// Expects a view of exactly `dims`.
  bool CheckShape(int64_t round, const char* op, const char* field, const epd::TensorView& v,
                  std::vector<int64_t> dims) {
    if (v.shape() == dims) return true;
    Mismatch(round, op, field,
             absl::StrCat("shape has ", v.shape().size(), " dims, first ",
                          v.shape().empty() ? -1 : v.shape()[0], "; want first ", dims[0]));
    return false;
  }

  template <typename Result>
  absl::StatusOr<Result> Finish(absl::StatusOr<epd::PendingOp<Result>> op) {
    if (!op.ok()) return op.status();
    return op->Wait(kWaitTimeout);
  }

  void RunRound(int64_t round) {
    round_mismatch_ = false;
    const GroupShape& s = shape_;
    const int R = s.num_ranks, H = s.hidden, K = s.num_topk, E = s.num_experts;
    const int El = s.num_local_experts();
    const int64_t llrows = s.ll_rows_per_expert();
    std::vector<RankInputs> in(R);
    for (int r = 0; r < R; ++r) in[r] = MakeInputs(s, seed_, round, r);
    absl::StatusOr<std::vector<RankRef>> refs = Reference(s, in);
    if (!refs.ok()) {
      Mismatch(round, "reference", "-", std::string(refs.status().message()));
      return;
    }
    RankRef& ref = (*refs)[rank_];
    RankInputs& mine = in[rank_];
    Tensor x, x2, idx, w, xll, idxll, wll, yll;
    x.Bind(mine.x, kBf16, {mine.T, H});
    x2.Bind(mine.x2, kBf16, {mine.T, H});
    idx.Bind(mine.idx, kI64, {mine.T, K});
    w.Bind(mine.w, kF32, {mine.T, K});
    xll.Bind(mine.xll, kBf16, {mine.Tll, H});
    idxll.Bind(mine.idxll, kI64, {mine.Tll, K});
    wll.Bind(mine.wll, kF32, {mine.Tll, K});
    yll.Bind(mine.yll, kBf16, {El, llrows, H});

    // GetDispatchLayout.
    if (auto l = Finish(ep_.GetDispatchLayout(idx.dl)); !l.ok()) {
      Error(round, "GetDispatchLayout", l.status());
    } else {
      Check(round, "GetDispatchLayout", "num_tokens_per_rank", l->num_tokens_per_rank.data(),
            ref.tokens_per_rank.data(), R);
      Check(round, "GetDispatchLayout", "num_tokens_per_expert", l->num_tokens_per_expert.data(),
            ref.tokens_per_expert.data(), E);
      if (CheckShape(round, "GetDispatchLayout", "is_token_in_rank", l->is_token_in_rank,
                     {mine.T, R})) {
        Check(round, "GetDispatchLayout", "is_token_in_rank", l->is_token_in_rank.data(),
              ref.in_rank.data(), int64_t(mine.T) * R);
      }
    }

    if (Stopping()) return;
    // Dispatch.
    epd::DispatchArgs da;
    da.x = &x.dl;
    da.topk_idx = &idx.dl;
    da.topk_weights = &w.dl;
    da.expert_alignment = kAlignment;
    absl::StatusOr<epd::DispatchResult> d = Finish(ep_.Dispatch(da));
    // Combine inputs: the reference's received rows and weights (identity experts).
    std::vector<bf16_bits> cx(ref.dispatch.bf16(),
                              ref.dispatch.bf16() + int64_t(ref.dispatch.N) * H);
    std::vector<float> cw(ref.dispatch.recv_w.begin(),
                          ref.dispatch.recv_w.begin() + int64_t(ref.dispatch.N) * K);
    Tensor cxt, cwt;
    cxt.Bind(cx, kBf16, {ref.dispatch.N, H});
    cwt.Bind(cw, kF32, {ref.dispatch.N, K});
    epd::Handle handle;
    if (!d.ok()) {
      Error(round, "Dispatch", d.status());
    } else {
      handle = d->handle;
      CheckDispatch(round, "Dispatch", *d, ref.dispatch, /*routing=*/true);
    }

    if (Stopping()) return;
    // Combine (with the handle of this round's dispatch; a failed dispatch leaves an empty
    // handle, which the library refuses for every rank).
    epd::CombineArgs ca;
    ca.x = &cxt.dl;
    ca.topk_weights = &cwt.dl;
    ca.handle = &handle;
    if (auto c = Finish(ep_.Combine(ca)); !c.ok()) {
      Error(round, "Combine", c.status());
    } else {
      Check(round, "Combine", "combined_x", c->combined_x.data(), ref.combined.data(),
            int64_t(mine.T) * H);
      Check(round, "Combine", "combined_topk_weights", c->combined_topk_weights.data(),
            ref.combined_w.data(), int64_t(mine.T) * K);
    }

    if (Stopping()) return;
    // Dispatch with the cached handle, new x.
    epd::DispatchArgs cd;
    cd.x = &x2.dl;
    cd.expert_alignment = kAlignment;
    cd.cached = handle;
    if (auto d2 = Finish(ep_.Dispatch(cd)); !d2.ok()) {
      Error(round, "Dispatch(cached)", d2.status());
    } else {
      CheckDispatch(round, "Dispatch(cached)", *d2, ref.cached, /*routing=*/false);
    }

    if (Stopping()) return;
    // LowLatencyDispatch (bf16), its combine, then an FP8 one.
    epd::LowLatencyDispatchArgs la;
    la.x = &xll.dl;
    la.topk_idx = &idxll.dl;
    absl::StatusOr<epd::LowLatencyDispatchResult> ll = Finish(ep_.LowLatencyDispatch(la));
    epd::Handle ll_handle;
    if (!ll.ok()) {
      Error(round, "LowLatencyDispatch", ll.status());
    } else {
      ll_handle = ll->handle;
      CheckLowLatency(round, "LowLatencyDispatch", *ll, ref.ll, /*fp8=*/false);
    }
    if (Stopping()) return;
    epd::LowLatencyCombineArgs lca;
    lca.x = &yll.dl;
    lca.topk_idx = &idxll.dl;
    lca.topk_weights = &wll.dl;
    lca.handle = &ll_handle;
    if (auto lc = Finish(ep_.LowLatencyCombine(lca)); !lc.ok()) {
      Error(round, "LowLatencyCombine", lc.status());
    } else {
      Check(round, "LowLatencyCombine", "combined_x", lc->combined_x.data(), ref.ll_combined.data(),
            int64_t(mine.Tll) * H);
    }
    if (Stopping()) return;
    la.use_fp8 = true;
    if (auto l8 = Finish(ep_.LowLatencyDispatch(la)); !l8.ok()) {
      Error(round, "LowLatencyDispatch(fp8)", l8.status());
    } else {
      CheckLowLatency(round, "LowLatencyDispatch(fp8)", *l8, ref.ll8, /*fp8=*/true);
    }
    std::fflush(stdout);
  }

  /// Checks a normal dispatch: N, then rows [0, N) of the received tensors; with `routing`
  /// (not a cached re-dispatch) also the received expert ids, weights and counts.
  void CheckDispatch(int64_t round, const char* op, const epd::DispatchResult& d,
                     const DispatchRef& ref, bool routing) {
    const int64_t N = ref.N, H = shape_.hidden, K = shape_.num_topk;
    CheckEq(round, op, "num_recv_tokens", d.num_recv_tokens, ref.N);
    if (d.num_recv_tokens == ref.N) {
      Check(round, op, "recv_x", d.recv_x.data(), ref.bf16(), N * H);
      Check(round, op, "recv_src_info", d.recv_src_info.data(), ref.src_info.data(), N);
      if (routing) {
        Check(round, op, "recv_topk_idx", d.recv_topk_idx.data(), ref.recv_idx.data(), N * K);
        Check(round, op, "recv_topk_weights", d.recv_topk_weights.data(), ref.recv_w.data(), N * K);
      }
    }
    if (routing) {
      Check(round, op, "num_recv_tokens_per_expert", d.num_recv_tokens_per_expert.data(),
            ref.per_expert.data(), shape_.num_local_experts());
    }
  }

  /// Checks a low-latency dispatch: counts, then each expert's rows [0, count).
  void CheckLowLatency(int64_t round, const char* op, const epd::LowLatencyDispatchResult& res,
                       const LowLatencyRef& ref, bool fp8) {
    const int El = shape_.num_local_experts(), H = shape_.hidden, S = shape_.num_scales();
    const int64_t rows = shape_.ll_rows_per_expert();
    Check(round, op, "recv_count", res.recv_count.data(), ref.count.data(), El);
    const auto* got_count = res.recv_count.as<const int32_t>();
    if (got_count == nullptr) return;
    for (int j = 0; j < El; ++j) {
      if (got_count[j] != ref.count[j]) return;  // Reported above.
      const int64_t n = ref.count[j];
      Check(round, op, "recv_src_info", res.recv_src_info.as<const int32_t>() + j * rows,
            ref.src.data() + j * rows, n);
      if (fp8) {
        Check(round, op, "recv_x", res.recv_x.as<const e4m3_bits>() + j * rows * H,
              ref.x.data() + j * rows * H, n * H);
        // Scales are stored [El, S, rows] (token fastest): n per block of expert j.
        for (int g = 0; g < S; ++g) {
          Check(round, op, "recv_scales", res.recv_scales.as<const float>() + (j * S + g) * rows,
                ref.scales.data() + (j * S + g) * rows, n);
        }
      } else {
        Check(round, op, "recv_x", res.recv_x.as<const bf16_bits>() + j * rows * H,
              reinterpret_cast<const bf16_bits*>(ref.x.data()) + j * rows * H, n * H);
      }
    }
  }

  epd::Endpoint& ep_;
  const uint64_t seed_;
  GroupShape shape_;
  int rank_ = 0;
  bool round_failed_ = false;
  bool round_mismatch_ = false;
  int64_t ok_ = 0, errors_ = 0, mismatches_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  // The test closes stdin to stop the victim.
  epd::testing::StopAtStdinEof(&g_stop);

  epd::ClientOptions options;
  options.socket_path = absl::GetFlag(FLAGS_socket);
  options.client_name = absl::StrCat("epd_victim rank ", absl::GetFlag(FLAGS_rank));
  auto client = epd::Client::Connect(options);
  if (!client.ok()) {
    std::printf("CONNECT_ERROR %s %s\n", absl::StatusCodeToString(client.status().code()).c_str(),
                std::string(client.status().message()).c_str());
    return 2;
  }
  epd::JoinOptions join;
  join.spec =
      epd::security::SecuritySpec(absl::GetFlag(FLAGS_group), absl::GetFlag(FLAGS_num_ranks));
  join.rank = absl::GetFlag(FLAGS_rank);
  const std::string secret = absl::GetFlag(FLAGS_join_secret);
  const bool secret_set = epd::security::SetJoinSecret(join, secret);
  auto ep = (*client)->Join(join);
  if (!ep.ok()) {
    std::printf("JOIN_ERROR %s %s\n", absl::StatusCodeToString(ep.status().code()).c_str(),
                std::string(ep.status().message()).c_str());
    return 3;
  }
  std::printf("JOINED rank %d join_secret: %s\n", join.rank,
              secret.empty() ? "none" : (secret_set ? "set" : "unsupported"));
  Victim victim(**ep, absl::GetFlag(FLAGS_seed));
  const int rc = victim.Run(absl::Seconds(absl::GetFlag(FLAGS_max_seconds)));
  (void)(*ep)->Leave();
  std::fflush(stdout);
  return rc;
}
