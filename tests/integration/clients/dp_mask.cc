// epd_dp_mask: a real client process of a rank-masking group (on_rank_failure = MASK) for
// the integration tests and epd_bench. Joins --rank of a --num_ranks group --group and runs
// low-latency rounds (LowLatencyDispatch, identity experts, LowLatencyCombine) in a loop.
// Every rank's inputs are a function of its rank only, so each process computes the
// reference of every round itself (tests/common/mask_reference.h: kernels/host with the
// masked ranks' experts dropped), from the mask the round ran with (OpMask, and the ranks
// from QueryRankMask). Prints, flushed:
//   "joined rank R at NS"                       (NS: steady_clock, shared by processes)
//   "round I OK epoch E masked M dropped D at NS verified"   (or "unverified": the mask
//                                               changed between the round and the query)
//   "round I CODE at NS: MESSAGE"               (a failed round)
//   "MISMATCH round I: ..."                     (a result differing from the reference;
//                                               exits 1)
// --api_checks: first checks UpdateRankMask's bad-rank errors and QueryRankMask, printing
// "api_checks OK" or "api_checks FAILED: ...".
// Against a CUDA daemon (tests/gpu/mask_process_test.cc; built with EPD_DP_MASK_CUDA) the
// views are device memory: the combine input is copied on the GPU and combined_x to the host.
#if EPD_DP_MASK_CUDA
#include <cuda_runtime.h>
#endif

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "epd/client.h"
#include "epd/kernels/op_rules.h"
#include "tests/common/dtypes.h"
#include "tests/common/mask_reference.h"
#include "tests/common/specs.h"

ABSL_FLAG(std::string, socket, "", "epd socket");
ABSL_FLAG(std::string, group, "mask", "group name");
ABSL_FLAG(int, rank, 0, "rank");
ABSL_FLAG(int, num_ranks, 4, "ranks");
ABSL_FLAG(int, max_rounds, 0, "stop after this many rounds (0 = forever)");
ABSL_FLAG(bool, api_checks, false, "check the mask API's errors first");
ABSL_FLAG(std::string, gpu_uuid, "",
          "the GPU to join on (cuda backend; \"\": the daemon's first GPU, from GetStats)");

namespace {

using ::epd::testing::kBf16;
using ::epd::testing::kF32;
using ::epd::testing::kI64;
using ::epd::testing::LlRoundInputs;

constexpr int kExpertsPerRank = 2, kH = 128, kK = 2, kMll = 8;

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// Rank r's inputs (the same in every process): T = kMll - r % 4 tokens, two experts each.
LlRoundInputs InputsOf(int r, int num_experts) {
  LlRoundInputs in;
  in.num_tokens = kMll - r % 4;
  std::mt19937 rng(70 + r);
  in.x.resize(size_t(in.num_tokens) * kH);
  for (auto& v : in.x) v = epd::kernels::FloatToBf16(float(rng() % 200) / 100.f - 1.f);
  for (int t = 0; t < in.num_tokens; ++t) {
    const int64_t a = rng() % num_experts, b = (a + 1 + rng() % (num_experts - 1)) % num_experts;
    in.topk_idx.push_back(a);
    in.topk_idx.push_back(b);
    in.topk_weights.push_back(0.25f + float(rng() % 4) / 8);
    in.topk_weights.push_back(0.5f);
  }
  return in;
}

bool OnGpu(const epd::TensorView& v) { return v.dl().device.device_type == kDLCUDA; }

/// Copies `bytes` bytes between two views of this process (host, or device memory of a CUDA
/// endpoint). False on a CUDA error, or device memory without CUDA support.
bool CopyBytes(void* dst, const void* src, size_t bytes, bool gpu) {
  if (!gpu) {
    std::memcpy(dst, src, bytes);
    return true;
  }
#if EPD_DP_MASK_CUDA
  return cudaMemcpy(dst, src, bytes, cudaMemcpyDefault) == cudaSuccess;
#else
  return false;
#endif
}

int ApiChecks(epd::Endpoint& ep, int num_ranks) {
  auto fail = [](const std::string& why) {
    std::printf("api_checks FAILED: %s\n", why.c_str());
    std::fflush(stdout);
    return 1;
  };
  auto bad = ep.UpdateRankMask({num_ranks + 5}, {});
  if (bad.status().code() != absl::StatusCode::kInvalidArgument ||
      !absl::StrContains(bad.status().message(), absl::StrCat(num_ranks + 5))) {
    return fail(absl::StrCat("mask of rank ", num_ranks + 5, ": ", bad.status().ToString()));
  }
  bad = ep.UpdateRankMask({}, {-2});
  if (bad.status().code() != absl::StatusCode::kInvalidArgument ||
      !absl::StrContains(bad.status().message(), "-2")) {
    return fail(absl::StrCat("unmask of rank -2: ", bad.status().ToString()));
  }
  auto q = ep.QueryRankMask();
  if (!q.ok()) return fail(absl::StrCat("QueryRankMask: ", q.status().ToString()));
  std::printf("api_checks OK (epoch %u, %zu masked)\n", q->epoch, q->masked_ranks.size());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int rank = absl::GetFlag(FLAGS_rank), R = absl::GetFlag(FLAGS_num_ranks);
  const int E = R * kExpertsPerRank;
  epd::ClientOptions opt;
  opt.socket_path = absl::GetFlag(FLAGS_socket);
  opt.client_name = absl::StrCat("dp_mask rank ", rank);
  auto client = epd::Client::Connect(opt);
  if (!client.ok()) {
    std::printf("connect: %s\n", client.status().ToString().c_str());
    return 2;
  }
  epd::JoinOptions j;
  j.spec = epd::testing::MakeSpec(absl::GetFlag(FLAGS_group), {.num_ranks = R,
                                                               .num_experts = E,
                                                               .hidden = kH,
                                                               .num_topk = kK,
                                                               .max_tokens_per_rank = kMll,
                                                               .ll_max_tokens_per_rank = kMll});
  j.spec.set_on_rank_failure(epd::v1::RANK_FAILURE_POLICY_MASK);
  j.rank = rank;
  j.gpu_uuid = absl::GetFlag(FLAGS_gpu_uuid);
#if EPD_DP_MASK_CUDA
  if (j.gpu_uuid.empty()) {  // A CUDA daemon: its first GPU; a host daemon: none.
    auto stats = (*client)->GetStats();
    if (!stats.ok()) {
      std::printf("join: GetStats: %s\n", stats.status().ToString().c_str());
      return 2;
    }
    if (stats->backend() == "cuda" && stats->gpus_size() > 0) j.gpu_uuid = stats->gpus(0).uuid();
  }
#endif
  auto ep = (*client)->Join(j);
  if (!ep.ok()) {
    std::printf("join: %s\n", ep.status().ToString().c_str());
    return 2;
  }
  std::printf("joined rank %d at %lld\n", rank, static_cast<long long>(NowNs()));
  std::fflush(stdout);
  if (absl::GetFlag(FLAGS_api_checks) && ApiChecks(**ep, R) != 0) return 1;
  const epd::kernels::GroupShape shape = epd::rules::ShapeOf(j.spec);
  std::vector<LlRoundInputs> in;
  for (int r = 0; r < R; ++r) in.push_back(InputsOf(r, E));
  LlRoundInputs& mine = in[rank];
  std::vector<int64_t> xs{mine.num_tokens, kH}, ks{mine.num_tokens, kK};
  DLTensor x = epd::MakeDLTensor(mine.x.data(), kBf16, xs);
  DLTensor idx = epd::MakeDLTensor(mine.topk_idx.data(), kI64, ks);
  DLTensor w = epd::MakeDLTensor(mine.topk_weights.data(), kF32, ks);
  epd::RankMask known;  // The ranks of the last epoch queried.
  for (int i = 0; absl::GetFlag(FLAGS_max_rounds) == 0 || i < absl::GetFlag(FLAGS_max_rounds);
       ++i) {
    epd::LowLatencyDispatchArgs d;
    d.x = &x;
    d.topk_idx = &idx;
    absl::StatusOr<epd::LowLatencyDispatchResult> dres = [&] {
      auto op = (*ep)->LowLatencyDispatch(d);
      return op.ok() ? op->Wait(absl::Seconds(30))
                     : absl::StatusOr<epd::LowLatencyDispatchResult>(op.status());
    }();
    absl::StatusOr<epd::LowLatencyCombineResult> cres = absl::UnknownError("not run");
    if (!dres.ok()) cres = dres.status();
    if (dres.ok()) {
      epd::TensorView input = (*ep)->LowLatencyCombineInput();
      if (!CopyBytes(input.data(), dres->recv_x.data(), dres->recv_x.nbytes(), OnGpu(input))) {
        std::printf("MISMATCH round %d: copying the combine input failed\n", i);
        return 1;
      }
      epd::LowLatencyCombineArgs c;
      c.x = &input.dl();
      c.topk_idx = &idx;
      c.topk_weights = &w;
      c.handle = &dres->handle;
      auto op = (*ep)->LowLatencyCombine(c);
      cres = op.ok() ? op->Wait(absl::Seconds(30))
                     : absl::StatusOr<epd::LowLatencyCombineResult>(op.status());
    }
    const long long at = static_cast<long long>(NowNs());
    if (!cres.ok()) {
      std::printf("round %d %s at %lld: %s\n", i,
                  absl::StatusCodeToString(cres.status().code()).c_str(), at,
                  std::string(cres.status().message()).c_str());
      std::fflush(stdout);
      continue;
    }
    const epd::OpMask m = cres->mask;
    bool verified = false;
    if (m.epoch == dres->mask.epoch) {
      if (m.epoch != known.epoch) {
        auto q = (*ep)->QueryRankMask();
        if (q.ok()) known = *q;
      }
      if (m.epoch == known.epoch) {
        std::vector<uint8_t> masked(R, 0);
        for (int32_t r : known.masked_ranks) masked[r] = 1;
        auto ref = epd::testing::LowLatencyRoundReference(shape, in, masked, masked);
        if (!ref.ok()) {
          std::printf("MISMATCH round %d: reference: %s\n", i, ref.status().ToString().c_str());
          return 1;
        }
        const size_t bytes = ref->combined_x[rank].size() * 2;
        std::vector<uint8_t> got(bytes);
        if (static_cast<int>(known.masked_ranks.size()) != m.num_masked ||
            ref->dropped_pairs[rank] != m.dropped_pairs ||
            cres->combined_x.nbytes() < static_cast<int64_t>(bytes) ||
            !CopyBytes(got.data(), cres->combined_x.data(), bytes, OnGpu(cres->combined_x)) ||
            std::memcmp(got.data(), ref->combined_x[rank].data(), bytes) != 0) {
          std::printf("MISMATCH round %d: epoch %u, %d masked (query: %zu), dropped %d (ref %d)\n",
                      i, m.epoch, m.num_masked, known.masked_ranks.size(), m.dropped_pairs,
                      ref->dropped_pairs[rank]);
          std::fflush(stdout);
          return 1;
        }
        verified = true;
      }
    }
    std::printf("round %d OK epoch %u masked %d dropped %d at %lld %s\n", i, m.epoch, m.num_masked,
                m.dropped_pairs, at, verified ? "verified" : "unverified");
    std::fflush(stdout);
  }
  return 0;
}
