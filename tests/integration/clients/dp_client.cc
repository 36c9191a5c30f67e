// epd_dp_client: a real client process for the data-plane integration tests.
//
//   --scenario=bad_inputs   Ranks 0 and 1 of group --group (threads of this process) go
//                           through the bad-input matrix of DESIGN §3.4; for each case
//                           rank 0 misbehaves, and the test expects a clear error, then a
//                           good round on which both ranks succeed. Prints one line per
//                           case; exit 0 when every expectation held.
//   --scenario=loop         Joins as --rank of a --num_ranks group and runs ops in a loop,
//                           printing "op <i> OK" or "op <i> <CODE> after <ms> ms: <msg>".
//                           With --exit_after_recovery it exits 0 once it has seen a failed
//                           op followed by 3 good ones.
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "epd/client.h"
#include "epd/kernels/types.h"
#include "proto/abi/shm_abi.h"
#include "tests/common/dtypes.h"
#include "tests/common/specs.h"

ABSL_FLAG(std::string, socket, "", "epd socket");
ABSL_FLAG(std::string, scenario, "bad_inputs", "bad_inputs or loop");
ABSL_FLAG(std::string, group, "dp", "group name");
ABSL_FLAG(int, rank, 0, "loop: rank");
ABSL_FLAG(int, num_ranks, 2, "loop: ranks");
ABSL_FLAG(int, max_ops, 0, "loop: stop after this many ops (0 = forever)");
ABSL_FLAG(bool, exit_after_recovery, false, "loop: exit 0 after a failure then 3 OKs");

namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kF32;
using ::epd::testing::kI64;

using epd::kernels::FloatToBf16;

constexpr int kE = 4, kH = 256, kK = 2, kM = 8;

epd::v1::GroupSpec Spec(const std::string& name, int R, int H = kH, bool fp8 = true) {
  return epd::testing::MakeSpec(name, {.num_ranks = R,
                                       .num_experts = kE,
                                       .hidden = H,
                                       .num_topk = kK,
                                       .max_tokens_per_rank = kM,
                                       .ll_max_tokens_per_rank = kM,
                                       .use_fp8 = fp8});
}

/// Host tensors of one rank's op.
struct Inputs {
  std::vector<uint16_t> x;
  std::vector<float> xf;
  std::vector<int64_t> idx;
  std::vector<float> w;
  std::vector<int64_t> xs, xfs, ks;
  DLTensor x_t{}, xf_t{}, idx_t{}, w_t{};
  void Make(int T, int H, uint32_t seed) {
    std::mt19937 rng(seed);
    x.resize(size_t(T) * H);
    xf.resize(size_t(T) * H);
    for (size_t i = 0; i < x.size(); ++i) {
      xf[i] = float(rng() % 100) / 50.f - 1.f;
      x[i] = FloatToBf16(xf[i]);
    }
    idx.resize(size_t(T) * kK);
    w.assign(size_t(T) * kK, 0.5f);
    for (int t = 0; t < T; ++t) {
      idx[t * kK] = rng() % kE;
      idx[t * kK + 1] = (idx[t * kK] + 1 + rng() % (kE - 1)) % kE;
    }
    xs = {T, H};
    xfs = {T, H};
    ks = {T, kK};
    x_t = epd::MakeDLTensor(x.data(), kBf16, xs);
    xf_t = epd::MakeDLTensor(xf.data(), kF32, xfs);
    idx_t = epd::MakeDLTensor(idx.data(), kI64, ks);
    w_t = epd::MakeDLTensor(w.data(), kF32, ks);
  }
};

/// Runs a dispatch with `in` on `ep` and waits.
absl::StatusOr<epd::DispatchResult> Dispatch(epd::Endpoint& ep, Inputs& in,
                                             const DLTensor* x = nullptr) {
  epd::DispatchArgs a;
  a.x = x ? x : &in.x_t;
  a.topk_idx = &in.idx_t;
  a.topk_weights = &in.w_t;
  auto op = ep.Dispatch(a);
  if (!op.ok()) return op.status();
  return op->Wait(absl::Seconds(30));
}

absl::Status Combine(epd::Endpoint& ep, const epd::DispatchResult& d) {
  std::vector<uint16_t> y(size_t(d.num_recv_tokens) * ep.spec().hidden());
  std::memcpy(y.data(), d.recv_x.data(), y.size() * 2);
  std::vector<int64_t> ys{d.num_recv_tokens, ep.spec().hidden()};
  DLTensor yt = epd::MakeDLTensor(y.data(), kBf16, ys);
  epd::CombineArgs c;
  c.x = &yt;
  c.handle = &d.handle;
  auto op = ep.Combine(c);
  if (!op.ok()) return op.status();
  return op->Wait(absl::Seconds(30)).status();
}

/// Runs fn(0) and fn(1) on two threads; returns both statuses.
std::pair<absl::Status, absl::Status> Both(const std::function<absl::Status(int)>& fn) {
  absl::Status s0, s1;
  std::thread t0([&] { s0 = fn(0); });
  std::thread t1([&] { s1 = fn(1); });
  t0.join();
  t1.join();
  return {s0, s1};
}

/// The endpoint shm regions this process has mapped (from /proc/self/maps).
std::vector<uint8_t*> MappedEndpointRegions() {
  std::vector<uint8_t*> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (!absl::StrContains(line, "/memfd:epd-ep")) continue;
    out.push_back(
        reinterpret_cast<uint8_t*>(std::stoull(line.substr(0, line.find('-')), nullptr, 16)));
  }
  return out;
}

int BadInputs() {
  epd::ClientOptions opt;
  opt.socket_path = absl::GetFlag(FLAGS_socket);
  opt.client_name = "dp_client bad_inputs";
  auto client = epd::Client::Connect(opt);
  if (!client.ok()) {
    std::printf("connect: %s\n", client.status().ToString().c_str());
    return 2;
  }
  const std::string g = absl::GetFlag(FLAGS_group);
  std::vector<std::unique_ptr<epd::Endpoint>> ep(2);
  auto join = [&](int r) -> absl::Status {
    epd::JoinOptions j;
    j.spec = Spec(g, 2);
    j.rank = r;
    auto e = (*client)->Join(j);
    if (!e.ok()) return e.status();
    ep[r] = std::move(*e);
    return absl::OkStatus();
  };
  for (int r = 0; r < 2; ++r) {
    if (absl::Status st = join(r); !st.ok()) {
      std::printf("join: %s\n", st.ToString().c_str());
      return 2;
    }
  }
  Inputs in[2];
  in[0].Make(5, kH, 1);
  in[1].Make(7, kH, 2);
  int failures = 0;
  auto good_round = [&]() {
    auto [a, b] = Both([&](int r) -> absl::Status {
      auto d = Dispatch(*ep[r], in[r]);
      if (!d.ok()) return d.status();
      return Combine(*ep[r], *d);
    });
    return a.ok() && b.ok() ? absl::OkStatus() : (!a.ok() ? a : b);
  };
  // expect: rank 0's error code and a fragment of its message.
  auto check = [&](const std::string& name, const absl::Status& s0, const absl::Status& s1,
                   absl::StatusCode code, const std::string& fragment) {
    bool ok = s0.code() == code && absl::StrContains(s0.message(), fragment);
    absl::Status recovery = good_round();
    std::printf("case %-26s rank0: %s | rank1: %s | recovery: %s => %s\n", name.c_str(),
                s0.ToString().c_str(), s1.ToString().c_str(), recovery.ToString().c_str(),
                ok && recovery.ok() ? "PASS" : "FAIL");
    std::fflush(stdout);
    failures += !(ok && recovery.ok());
  };
  if (absl::Status st = good_round(); !st.ok()) {
    std::printf("first good round: %s\n", st.ToString().c_str());
    return 1;
  }
  // Shape mismatch: x has H + 128 channels.
  Inputs wide;
  wide.Make(5, kH + 128, 3);
  {
    auto [a, b] =
        Both([&](int r) { return Dispatch(*ep[r], in[r], r == 0 ? &wide.x_t : nullptr).status(); });
    check("shape_mismatch", a, b, absl::StatusCode::kInvalidArgument, "shape");
  }
  {
    auto [a, b] = Both(
        [&](int r) { return Dispatch(*ep[r], in[r], r == 0 ? &in[0].xf_t : nullptr).status(); });
    check("dtype_mismatch", a, b, absl::StatusCode::kInvalidArgument, "dtype");
  }
  // Malformed DLTensors: a negative ndim, and a null shape array.
  {
    DLTensor negative = in[0].x_t;
    negative.ndim = -1;
    auto [a, b] =
        Both([&](int r) { return Dispatch(*ep[r], in[r], r == 0 ? &negative : nullptr).status(); });
    check("negative_ndim", a, b, absl::StatusCode::kInvalidArgument, "malformed DLTensor");
    DLTensor no_shape = in[0].x_t;
    no_shape.shape = nullptr;
    auto [c, d] =
        Both([&](int r) { return Dispatch(*ep[r], in[r], r == 0 ? &no_shape : nullptr).status(); });
    check("null_shape", c, d, absl::StatusCode::kInvalidArgument, "null shape array");
  }
  Inputs many;
  many.Make(kM + 1, kH, 4);
  {
    auto [a, b] = Both([&](int r) { return Dispatch(*ep[r], r == 0 ? many : in[r]).status(); });
    check("tokens_over_max", a, b, absl::StatusCode::kInvalidArgument, "max_tokens_per_rank");
  }
  for (int64_t bad : {int64_t{kE}, int64_t{-5}}) {
    in[0].idx[3] = bad;
    auto [a, b] = Both([&](int r) { return Dispatch(*ep[r], in[r]).status(); });
    in[0].idx[3] = 0;
    check(absl::StrCat("topk_idx_", bad), a, b, absl::StatusCode::kInvalidArgument,
          absl::StrCat(bad));
  }
  // FP8 with H % 128 != 0: refused at join (spec) and by LowLatencyDispatch.
  {
    epd::JoinOptions j;
    j.spec = Spec(g + "-h192-fp8", 2, 192, true);
    auto e = (*client)->Join(j);
    check("fp8_hidden_192_join", e.status(), absl::OkStatus(), absl::StatusCode::kInvalidArgument,
          "hidden");
  }
  std::vector<std::unique_ptr<epd::Endpoint>> other(2);
  for (int r = 0; r < 2; ++r) {
    epd::JoinOptions j;
    j.spec = Spec(g + "-h192", 2, 192, false);
    j.rank = r;
    auto e = (*client)->Join(j);
    if (!e.ok()) {
      std::printf("join h192: %s\n", e.status().ToString().c_str());
      return 1;
    }
    other[r] = std::move(*e);
  }
  {
    Inputs h192[2];
    h192[0].Make(3, 192, 5);
    h192[1].Make(3, 192, 6);
    auto [a, b] = Both([&](int r) {
      epd::LowLatencyDispatchArgs l;
      l.x = &h192[r].x_t;
      l.topk_idx = &h192[r].idx_t;
      l.use_fp8 = true;
      auto op = other[r]->LowLatencyDispatch(l);
      return op.ok() ? op->Wait(absl::Seconds(30)).status() : op.status();
    });
    check("fp8_hidden_192_ll_dispatch", a, b, absl::StatusCode::kInvalidArgument, "hidden % 128");
  }
  // Combine with a handle from another group: rank 0 hands group g's endpoint a handle of
  // its endpoint in the other group.
  {
    Inputs h192[2];
    h192[0].Make(3, 192, 7);
    h192[1].Make(3, 192, 8);
    auto od = Both([&](int r) { return Dispatch(*other[r], h192[r]).status(); });
    std::vector<epd::DispatchResult> d(2);
    auto [a0, b0] = Both([&](int r) -> absl::Status {
      auto res = Dispatch(*ep[r], in[r]);
      if (res.ok()) d[r] = *res;
      return res.status();
    });
    epd::Handle foreign = d[0].handle;
    foreign.endpoint_id = other[0]->info().endpoint_id();
    auto [a, b] = Both([&](int r) -> absl::Status {
      epd::DispatchResult dr = d[r];
      if (r == 0) dr.handle = foreign;
      return Combine(*ep[r], dr);
    });
    check("combine_foreign_handle", a, b, absl::StatusCode::kFailedPrecondition,
          "another endpoint");
    (void)od;
    (void)a0;
    (void)b0;
  }
  // Combine and cached re-dispatch with a handle whose N is known only on the device (as
  // PendingOp::Enqueued returns for a Dispatch without a cached handle).
  {
    std::vector<epd::DispatchResult> d(2);
    Both([&](int r) -> absl::Status {
      auto res = Dispatch(*ep[r], in[r]);
      if (res.ok()) d[r] = *res;
      return res.status();
    });
    auto [a, b] = Both([&](int r) -> absl::Status {
      epd::DispatchResult dr = d[r];
      if (r == 0) dr.handle.num_recv_tokens = -1;
      return Combine(*ep[r], dr);
    });
    check("combine_device_only_handle", a, b, absl::StatusCode::kFailedPrecondition,
          "known only on the device");
    auto [c, e] = Both([&](int r) -> absl::Status {
      epd::DispatchArgs args;
      args.x = &in[r].x_t;
      args.cached = d[r].handle;
      if (r == 0) args.cached->num_recv_tokens = -1;
      auto op = ep[r]->Dispatch(args);
      return op.ok() ? op->Wait(absl::Seconds(30)).status() : op.status();
    });
    check("cached_device_only_handle", c, e, absl::StatusCode::kFailedPrecondition,
          "known only on the device");
  }
  // Combine with the handle of an older dispatch (its routing was replaced).
  {
    std::vector<epd::DispatchResult> first(2), second(2);
    Both([&](int r) -> absl::Status {
      auto res = Dispatch(*ep[r], in[r]);
      if (res.ok()) first[r] = *res;
      return res.status();
    });
    Both([&](int r) -> absl::Status {
      auto res = Dispatch(*ep[r], in[r]);
      if (res.ok()) second[r] = *res;
      return res.status();
    });
    auto [a, b] = Both([&](int r) { return Combine(*ep[r], r == 0 ? first[r] : second[r]); });
    check("combine_stale_handle", a, b, absl::StatusCode::kFailedPrecondition, "handle");
  }
  // Garbage written straight into rank 0's ring slot in shm: dropped, never executed.
  {
    std::vector<uint8_t*> regions = MappedEndpointRegions();
    uint64_t rejected = 0;
    for (uint8_t* base : regions) {
      auto* h = reinterpret_cast<epd::abi::EndpointShmHeader*>(base);
      if (h->magic != epd::abi::kEndpointMagic || h->endpoint_id != ep[0]->info().endpoint_id())
        continue;
      auto* ring = reinterpret_cast<epd::abi::RequestSlot*>(base + h->ring_offset);
      uint64_t head = epd::abi::Atomic(h->ring_head).load();
      std::memset(&ring[(head + 1) % epd::abi::kRingCapacity], 0x5a, sizeof(epd::abi::RequestSlot));
      epd::abi::Atomic(h->ring_head).store(head + 1);
      absl::Status r0 = good_round();
      rejected = epd::abi::Atomic(h->rejected_requests).load();
      check("garbage_ring_slot", r0, absl::OkStatus(), absl::StatusCode::kOk, "");
    }
    std::printf("garbage: %zu endpoint region(s) mapped, %llu slot(s) rejected by epd\n",
                regions.size(), static_cast<unsigned long long>(rejected));
    failures += rejected == 0;
  }
  // An op after LeaveGroup fails on the client; rejoining restores the group.
  {
    (void)ep[0]->Leave();
    auto op = ep[0]->GetDispatchLayout(in[0].idx_t);
    absl::Status left = op.status();
    ep[0].reset();
    absl::Status rejoin = join(0);
    check("op_after_leave", left, rejoin, absl::StatusCode::kFailedPrecondition, "left");
  }
  std::printf("bad_inputs: %s (%d failed)\n", failures ? "FAILED" : "all cases passed", failures);
  return failures ? 1 : 0;
}

int Loop() {
  epd::ClientOptions opt;
  opt.socket_path = absl::GetFlag(FLAGS_socket);
  const int rank = absl::GetFlag(FLAGS_rank);
  opt.client_name = absl::StrCat("dp_client loop rank ", rank);
  auto client = epd::Client::Connect(opt);
  if (!client.ok()) {
    std::printf("connect: %s\n", client.status().ToString().c_str());
    return 2;
  }
  epd::JoinOptions j;
  j.spec = Spec(absl::GetFlag(FLAGS_group), absl::GetFlag(FLAGS_num_ranks));
  j.rank = rank;
  auto ep = (*client)->Join(j);
  if (!ep.ok()) {
    std::printf("join: %s\n", ep.status().ToString().c_str());
    return 2;
  }
  std::printf("joined rank %d\n", rank);
  std::fflush(stdout);
  Inputs in;
  in.Make(4, kH, 100 + rank);
  bool seen_failure = false;
  int oks_after = 0;
  for (int i = 0; absl::GetFlag(FLAGS_max_ops) == 0 || i < absl::GetFlag(FLAGS_max_ops); ++i) {
    auto start = std::chrono::steady_clock::now();
    auto d = Dispatch(**ep, in);
    absl::Status st = d.ok() ? Combine(**ep, *d) : d.status();
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (st.ok()) {
      std::printf("op %d OK\n", i);
      if (seen_failure && ++oks_after >= 3 && absl::GetFlag(FLAGS_exit_after_recovery)) {
        std::printf("recovered\n");
        return 0;
      }
    } else {
      std::printf("op %d %s after %.0f ms: %s\n", i, absl::StatusCodeToString(st.code()).c_str(),
                  ms, std::string(st.message()).c_str());
      seen_failure = true;
      oks_after = 0;
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string s = absl::GetFlag(FLAGS_scenario);
  if (s == "bad_inputs") return BadInputs();
  if (s == "loop") return Loop();
  std::fprintf(stderr, "unknown --scenario=%s\n", s.c_str());
  return 2;
}
