// epd_dp_reconnect: one rank of a 2-rank group for tests/integration/reconnect_test.cc, a
// real libepdclient process that lives through a daemon restart. It joins --rank of group
// --group, then runs the commands read from stdin, one per line, printing one line each:
//   round         Dispatch + Combine and LowLatencyDispatch + LowLatencyCombine, each result
//                 checked against what this rank computes alone (inputs are a pure
//                 function of rank and round): "ROUND <n> OK", "ROUND <n> MISMATCH <what>"
//                 or "ROUND <n> ERROR <op> <CODE>: <message>".
//   probe         A GetDispatchLayout, waited for up to 5 s: "PROBE <CODE>" (OK, or its
//                 error's code).
//   submit        Submits a Dispatch and keeps it pending: "SUBMITTED <seq>" or "SUBMIT <CODE>".
//   wait_pending  Waits (up to 5 s) for the kept op: "PENDING <CODE>".
//   reconnect     Client::Reconnect(20 s): "RECONNECT OK <session id> <endpoint id>" or
//                 "RECONNECT <CODE>: <message>".
// Exit 0 at EOF on stdin, 1 when an OK result was wrong, 2 when connect or join failed.
#include <dlpack/dlpack.h>

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "epd/client.h"
#include "epd/kernels/types.h"
#include "tests/common/dtypes.h"
#include "tests/common/specs.h"

ABSL_FLAG(std::string, socket, "", "epd socket");
ABSL_FLAG(std::string, group, "rc", "group name");
ABSL_FLAG(int, rank, 0, "this process's rank (of 2)");

namespace {

using epd::kernels::bf16_bits;
using epd::kernels::Bf16ToFloat;
using epd::kernels::FloatToBf16;
using epd::testing::kBf16;
using epd::testing::kF32;
using epd::testing::kI64;

constexpr int kR = 2, kE = 4, kH = 128, kK = 2, kM = 8, kT = 5;
constexpr int kLocalExperts = kE / kR;

/// Token t's hidden values of rank `rank` in round `round`: multiples of 1/4 in [-2, 2].
bf16_bits XAt(int rank, int round, int t, int h) {
  return FloatToBf16(float((rank * 7 + t * 3 + h + round) % 17 - 8) / 4.f);
}
/// Token t's experts (k = 1 is -1 for t == 3).
int64_t ExpertAt(int rank, int round, int t, int k) {
  const int64_t e0 = (t + rank + round) % kE;
  if (k == 0) return e0;
  return t == 3 ? -1 : (e0 + 1 + t % 2) % kE;
}
float WeightAt(int k) { return k == 0 ? 0.5f : 0.25f; }

struct Inputs {
  std::vector<bf16_bits> x;
  std::vector<int64_t> idx;
  std::vector<float> w;
  std::vector<int64_t> xs{kT, kH}, ks{kT, kK};
  DLTensor x_t{}, idx_t{}, w_t{};
  void Make(int rank, int round) {
    x.resize(size_t(kT) * kH);
    idx.resize(size_t(kT) * kK);
    w.resize(size_t(kT) * kK);
    for (int t = 0; t < kT; ++t) {
      for (int h = 0; h < kH; ++h) x[size_t(t) * kH + h] = XAt(rank, round, t, h);
      for (int k = 0; k < kK; ++k) {
        idx[size_t(t) * kK + k] = ExpertAt(rank, round, t, k);
        w[size_t(t) * kK + k] = WeightAt(k);
      }
    }
    x_t = epd::MakeDLTensor(x.data(), kBf16, xs);
    idx_t = epd::MakeDLTensor(idx.data(), kI64, ks);
    w_t = epd::MakeDLTensor(w.data(), kF32, ks);
  }
};

/// Whether token t of `src` has an expert on rank `dst`.
bool SendsTo(int src, int round, int t, int dst) {
  for (int k = 0; k < kK; ++k) {
    const int64_t e = ExpertAt(src, round, t, k);
    if (e >= 0 && e / kLocalExperts == dst) return true;
  }
  return false;
}

class Rank {
 public:
  Rank(std::unique_ptr<epd::Client> client, std::unique_ptr<epd::Endpoint> endpoint, int rank)
      : client_(std::move(client)), endpoint_(std::move(endpoint)), rank_(rank) {}

  bool failed() const { return failed_; }

  void Round() {
    ++round_;
    const std::string prefix = absl::StrCat("ROUND ", round_);
    const std::string verdict = RunRound();
    std::printf("%s %s\n", prefix.c_str(), verdict.c_str());
    std::fflush(stdout);
  }

  void Probe() {
    std::vector<int64_t> ks{kT, kK};
    std::vector<int64_t> idx(size_t(kT) * kK, 0);
    DLTensor t = epd::MakeDLTensor(idx.data(), kI64, ks);
    // Submitted, then waited for: a submission can land before this process has seen the
    // Session end; the wait cannot.
    auto op = endpoint_->GetDispatchLayout(t);
    Print("PROBE", op.ok() ? op->Wait(absl::Seconds(5)).status() : op.status());
  }

  void Submit() {
    pending_inputs_.Make(rank_, 100);
    epd::DispatchArgs a;
    a.x = &pending_inputs_.x_t;
    a.topk_idx = &pending_inputs_.idx_t;
    auto op = endpoint_->Dispatch(a);
    if (!op.ok()) return Print("SUBMIT", op.status());
    std::printf("SUBMITTED %llu\n", static_cast<unsigned long long>(op->seq()));
    std::fflush(stdout);
    pending_.emplace(std::move(*op));
  }

  void WaitPending() {
    if (!pending_) return Print("PENDING", absl::FailedPreconditionError("nothing submitted"));
    absl::Status status = pending_->Wait(absl::Seconds(5)).status();
    pending_.reset();
    Print("PENDING", status);
  }

  void Reconnect() {
    absl::Status status = client_->Reconnect(absl::Seconds(20));
    if (!status.ok()) return Print("RECONNECT", status);
    std::printf("RECONNECT OK %s %llu\n", client_->session_id().c_str(),
                static_cast<unsigned long long>(endpoint_->info().endpoint_id()));
    std::fflush(stdout);
  }

 private:
  static void Print(const char* what, const absl::Status& status) {
    std::printf("%s %s%s%s\n", what, absl::StatusCodeToString(status.code()).c_str(),
                status.ok() ? "" : ": ", std::string(status.message()).c_str());
    std::fflush(stdout);
  }

  std::string Mismatch(const std::string& what) {
    failed_ = true;
    return "MISMATCH " + what;
  }

  /// One round; "OK" or what went wrong.
  std::string RunRound() {
    Inputs in;
    in.Make(rank_, round_);
    // ---- normal dispatch: rows by source rank, then token; each row the source's x.
    epd::DispatchArgs da;
    da.x = &in.x_t;
    da.topk_idx = &in.idx_t;
    da.topk_weights = &in.w_t;
    auto dop = endpoint_->Dispatch(da);
    if (!dop.ok()) return Error("Dispatch", dop.status());
    auto d = dop->Wait(absl::Seconds(30));
    if (!d.ok()) return Error("Dispatch", d.status());
    int expected_n = 0;
    for (int src = 0; src < kR; ++src) {
      for (int t = 0; t < kT; ++t) expected_n += SendsTo(src, round_, t, rank_) ? 1 : 0;
    }
    if (d->num_recv_tokens != expected_n) {
      return Mismatch(absl::StrCat("Dispatch N ", d->num_recv_tokens, " != ", expected_n));
    }
    const int32_t* src_info = d->recv_src_info.as<int32_t>();
    const bf16_bits* recv_x = d->recv_x.as<bf16_bits>();
    int row = 0;
    for (int src = 0; src < kR; ++src) {
      for (int t = 0; t < kT; ++t) {
        if (!SendsTo(src, round_, t, rank_)) continue;
        if (src_info[row] != src * kM + t) {
          return Mismatch(absl::StrCat("Dispatch src_info[", row, "] ", src_info[row]));
        }
        for (int h = 0; h < kH; ++h) {
          if (recv_x[size_t(row) * kH + h] != XAt(src, round_, t, h)) {
            return Mismatch(absl::StrCat("Dispatch recv_x[", row, ", ", h, "]"));
          }
        }
        ++row;
      }
    }
    // ---- normal combine of the rows as received: Σ over the ranks t went to of x[t].
    std::vector<bf16_bits> y(recv_x, recv_x + size_t(expected_n) * kH);
    std::vector<int64_t> ys{expected_n, kH};
    DLTensor y_t = epd::MakeDLTensor(y.data(), kBf16, ys);
    epd::CombineArgs ca;
    ca.x = &y_t;
    ca.handle = &d->handle;
    auto cop = endpoint_->Combine(ca);
    if (!cop.ok()) return Error("Combine", cop.status());
    auto c = cop->Wait(absl::Seconds(30));
    if (!c.ok()) return Error("Combine", c.status());
    const bf16_bits* combined = c->combined_x.as<bf16_bits>();
    for (int t = 0; t < kT; ++t) {
      int ranks = 0;
      for (int r = 0; r < kR; ++r) ranks += SendsTo(rank_, round_, t, r) ? 1 : 0;
      for (int h = 0; h < kH; ++h) {
        const float want = ranks * Bf16ToFloat(XAt(rank_, round_, t, h));
        if (Bf16ToFloat(combined[size_t(t) * kH + h]) != want) {
          return Mismatch(absl::StrCat("Combine combined_x[", t, ", ", h, "]"));
        }
      }
    }
    // ---- low-latency dispatch and combine with identity experts: Σ_k w[t,k] x[t].
    epd::LowLatencyDispatchArgs la;
    la.x = &in.x_t;
    la.topk_idx = &in.idx_t;
    auto lop = endpoint_->LowLatencyDispatch(la);
    if (!lop.ok()) return Error("LowLatencyDispatch", lop.status());
    auto l = lop->Wait(absl::Seconds(30));
    if (!l.ok()) return Error("LowLatencyDispatch", l.status());
    epd::LowLatencyCombineArgs lc;
    lc.x = &l->recv_x.dl();
    lc.topk_idx = &in.idx_t;
    lc.topk_weights = &in.w_t;
    lc.handle = &l->handle;
    auto lcop = endpoint_->LowLatencyCombine(lc);
    if (!lcop.ok()) return Error("LowLatencyCombine", lcop.status());
    auto lr = lcop->Wait(absl::Seconds(30));
    if (!lr.ok()) return Error("LowLatencyCombine", lr.status());
    const bf16_bits* ll = lr->combined_x.as<bf16_bits>();
    for (int t = 0; t < kT; ++t) {
      float weight = 0;
      for (int k = 0; k < kK; ++k) weight += ExpertAt(rank_, round_, t, k) >= 0 ? WeightAt(k) : 0;
      for (int h = 0; h < kH; ++h) {
        const float want = weight * Bf16ToFloat(XAt(rank_, round_, t, h));
        if (Bf16ToFloat(ll[size_t(t) * kH + h]) != want) {
          return Mismatch(absl::StrCat("LowLatencyCombine combined_x[", t, ", ", h, "]"));
        }
      }
    }
    return "OK";
  }

  static std::string Error(const char* op, const absl::Status& status) {
    return absl::StrCat("ERROR ", op, " ", absl::StatusCodeToString(status.code()), ": ",
                        status.message());
  }

  std::unique_ptr<epd::Client> client_;
  std::unique_ptr<epd::Endpoint> endpoint_;
  int rank_ = 0;
  int round_ = 0;
  bool failed_ = false;
  Inputs pending_inputs_;
  std::optional<epd::PendingOp<epd::DispatchResult>> pending_;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  epd::ClientOptions options;
  options.socket_path = absl::GetFlag(FLAGS_socket);
  options.client_name = absl::StrCat("dp_reconnect-", absl::GetFlag(FLAGS_rank));
  auto client = epd::Client::Connect(options);
  if (!client.ok()) {
    std::printf("CONNECT %s\n", client.status().ToString().c_str());
    return 2;
  }
  epd::JoinOptions join;
  join.spec = epd::testing::MakeSpec(absl::GetFlag(FLAGS_group), {.num_ranks = kR,
                                                                  .num_experts = kE,
                                                                  .hidden = kH,
                                                                  .num_topk = kK,
                                                                  .max_tokens_per_rank = kM,
                                                                  .ll_max_tokens_per_rank = kM});
  join.rank = absl::GetFlag(FLAGS_rank);
  auto endpoint = (*client)->Join(join);
  if (!endpoint.ok()) {
    std::printf("JOIN %s\n", endpoint.status().ToString().c_str());
    return 2;
  }
  std::printf("JOINED %s %llu\n", (*client)->session_id().c_str(),
              static_cast<unsigned long long>((*endpoint)->info().endpoint_id()));
  std::fflush(stdout);
  Rank rank(std::move(*client), std::move(*endpoint), join.rank);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "round") {
      rank.Round();
    } else if (line == "probe") {
      rank.Probe();
    } else if (line == "submit") {
      rank.Submit();
    } else if (line == "wait_pending") {
      rank.WaitPending();
    } else if (line == "reconnect") {
      rank.Reconnect();
    } else if (!line.empty()) {
      std::printf("UNKNOWN %s\n", line.c_str());
      std::fflush(stdout);
    }
  }
  return rank.failed() ? 1 : 0;
}
