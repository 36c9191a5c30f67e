// GPU tests of the fused low-latency launches (cuda_ops.h LowLatencyDispatchRanks,
// LowLatencyCombineRanks, WaitFlagsAsync): every rank of a group in one kernel launch must
// give exactly what one launch per rank gives (ll_test.cu checks those against the host):
// every output region of every rank byte for byte (the regions are filled with a pattern
// before each op, so rows an op must leave alone are compared too) and every rank's status;
// fused and per-rank launches mixed from op to op; the daemon-launched hand-off (ready
// waits of every rank in one WaitFlagsAsync, done flags and status_out per rank); a rank
// whose ready never comes; and the host-side checks (those need no GPU).
//
// nvcc (EDG) warns about assigning an absl::Status ([[nodiscard]] on operator=) by mistake.
#pragma nv_diag_suppress 2810

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/cuda/cuda_handles.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_ops.h"
#include "epd/kernels/cuda_specialise.h"
#include "proto/abi/launch_flags.h"
#include "tests/gpu/gpu_test_util.h"

namespace epd::testing {
namespace {

namespace kc = ::epd::kernels::cuda;
using kernels::bf16_bits;
using kernels::EndpointLayout;
using kernels::GroupShape;
using kernels::Region;

// ---- one case: a group shape, the dispatch's format, and how the ranks differ ------------

// FusedCase::flags.
enum CaseFlag : uint32_t {
  kFp8 = 1,           // use_fp8
  kRoundScale = 2,    // round_scale
  kUe8m0 = 4,         // use_ue8m0
  kLargePath = 8,     // large_path
  kSpecialised = 16,  // SetLowLatencySpecialisation(kOn): the specialised instances
  kGpuScope = 32,     // CudaRankContext::all_ranks_on_device
  kBadId = 64,        // rank 1 routes one slot to E + 3 (counted; its status says so)
};

struct FusedCase {
  const char* name;
  int32_t ranks;
  int32_t experts;
  int32_t hidden;
  int32_t topk;
  int32_t mll;
  uint32_t flags;  // CaseFlag bits
  bool has(CaseFlag f) const { return (flags & f) != 0; }
};

void PrintTo(const FusedCase& c, std::ostream* os) { *os << c.name; }

GroupShape ShapeOf(const FusedCase& c) {
  GroupShape s;
  s.num_ranks = c.ranks;
  s.num_experts = c.experts;
  s.hidden = c.hidden;
  s.num_topk = c.topk;
  s.max_tokens_per_rank = 1;
  s.ll_max_tokens_per_rank = c.mll;
  s.use_fp8 = c.has(kFp8);
  return s;
}

// Rank r's T: the ranks differ, and 0 and Mll both occur (at ranks 0 and 1).
int32_t TokensOf(int32_t r, int32_t mll) {
  const int32_t cycle[8] = {0, mll, 1, 77, 33, mll - 1, 5, 0};
  return std::min(cycle[r % 8], mll);
}

// Fills `n` bf16 at `p` with finite values from a hash of the index and `seed`
// (magnitudes in [2^-7, 2), both signs): every expert-output row differs.
__global__ void FillBf16Kernel(bf16_bits* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t h =
        (static_cast<uint32_t>(i) * 2654435761u) ^ (seed * 40503u) ^ static_cast<uint32_t>(i >> 32);
    p[i] = static_cast<bf16_bits>(((h >> 16) & 0x8000u) | 0x3c00u | (h & 0x03ffu));
  }
}

// Uploads every rank's inputs (T = TokensOf; x, topk_idx with some -1 and duplicate
// experts, weights), writes the odd ranks' T into their token-count slot (the even ranks
// pass it by value), and fills the expert outputs (in_ll_combine_x).
absl::Status UploadInputs(VirtualRankGroup& g, const FusedCase& c, uint64_t seed) {
  const GroupShape& s = g.shape();
  const EndpointLayout& l = g.layout();
  std::mt19937_64 rng(seed);
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    const int32_t t = TokensOf(r, s.ll_max_tokens_per_rank);
    const std::vector<bf16_bits> x = RandomBf16(static_cast<size_t>(t) * s.hidden, rng);
    RoutingOptions ro;
    ro.masked_fraction = 0.1;
    ro.duplicate_fraction = 0.2;
    std::vector<int64_t> topk = RandomTopk(t, s.num_topk, s.num_experts, ro, rng);
    if (c.has(kBadId) && r == 1 && !topk.empty()) topk[0] = s.num_experts + 3;
    const std::vector<float> w = RandomFloats(static_cast<size_t>(t) * s.num_topk, rng, -1, 1);
    EPD_RETURN_IF_ERROR(g.Upload(r, l.in_x, x.data(), x.size() * 2));
    EPD_RETURN_IF_ERROR(g.Upload(r, l.in_topk_idx, topk.data(), topk.size() * 8));
    EPD_RETURN_IF_ERROR(g.Upload(r, l.in_topk_weights, w.data(), w.size() * 4));
    EPD_RETURN_IF_ERROR(kc::SetLowLatencyNumTokensAsync(g.Context(r), t, g.stream(r)));
    FillBf16Kernel<<<64, 256, 0, g.stream(r)>>>(g.At<bf16_bits>(r, l.in_ll_combine_x),
                                                l.in_ll_combine_x.bytes / 2,
                                                static_cast<uint32_t>(seed + r));
    EPD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return g.SynchronizeAll();
}

// Every rank's dispatch args of case `c` on buffer `b` (T by value on even ranks).
std::vector<kc::LowLatencyDispatchArgs> DispatchArgs(const VirtualRankGroup& g, const FusedCase& c,
                                                     int32_t b) {
  std::vector<kc::LowLatencyDispatchArgs> args(g.num_ranks());
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    args[r].buffer = b;
    args[r].use_fp8 = c.has(kFp8);
    args[r].round_scale = c.has(kRoundScale);
    args[r].use_ue8m0 = c.has(kUe8m0);
    args[r].large_path = c.has(kLargePath);
    if (r % 2 == 0) args[r].num_tokens_value = TokensOf(r, g.shape().ll_max_tokens_per_rank);
  }
  return args;
}

std::vector<kc::LowLatencyCombineArgs> CombineArgs(const VirtualRankGroup& g, int32_t b) {
  std::vector<kc::LowLatencyCombineArgs> args(g.num_ranks());
  for (kc::LowLatencyCombineArgs& a : args) a.buffer = b;
  return args;
}

std::vector<kc::CudaRankContext> Contexts(const VirtualRankGroup& g, int32_t first, int32_t last) {
  std::vector<kc::CudaRankContext> ctxs;
  for (int32_t r = first; r < last; ++r) ctxs.push_back(g.Context(r));
  return ctxs;
}

// ---- outputs: fill, snapshot, compare ----------------------------------------------------

std::vector<Region> DispatchRegions(const EndpointLayout& l, int32_t b) {
  return {l.ll_recv_x[b], l.ll_recv_scales[b], l.ll_recv_count[b], l.ll_recv_src_info[b],
          l.ll_handle_pos[b]};
}
constexpr const char* kDispatchRegionNames[] = {"ll_recv_x", "ll_recv_scales", "ll_recv_count",
                                                "ll_recv_src_info", "ll_handle_pos"};
std::vector<Region> CombineRegions(const EndpointLayout& l, int32_t b) {
  return {l.ll_combined_x[b]};
}
constexpr const char* kCombineRegionNames[] = {"ll_combined_x"};

// Every rank's regions' bytes and statuses after one op.
struct Snapshot {
  std::vector<std::vector<uint8_t>> bytes;  // [rank * regions + i]
  std::vector<std::string> statuses;        // [rank]
};

// Fills `regions` of every rank with 0xa5 bytes (before an op, so the bytes an op leaves
// alone are the same in both runs).
absl::Status FillRegions(VirtualRankGroup& g, const std::vector<Region>& regions) {
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    for (const Region& region : regions) {
      EPD_CUDA_RETURN_IF_ERROR(cudaMemset(g.At<uint8_t>(r, region), 0xa5, region.bytes));
    }
  }
  return EPD_CUDA_STATUS(cudaDeviceSynchronize());
}

// Waits for every stream, reads and clears every rank's status (as a string), downloads
// `regions` of every rank.
absl::StatusOr<Snapshot> TakeSnapshot(VirtualRankGroup& g, const std::vector<Region>& regions,
                                      const char* op) {
  EPD_RETURN_IF_ERROR(g.SynchronizeAll());
  Snapshot snap;
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    snap.statuses.push_back(kc::ReadAndClearStatus(g.Context(r), g.stream(r), op).ToString());
    for (const Region& region : regions) {
      std::vector<uint8_t> bytes(region.bytes);
      if (region.bytes > 0) EPD_RETURN_IF_ERROR(g.Download(r, region, bytes.data(), bytes.size()));
      snap.bytes.push_back(std::move(bytes));
    }
  }
  return snap;
}

// OK when both snapshots are equal byte for byte and status for status; else names the
// first difference.
absl::Status SameSnapshot(const Snapshot& expected, const Snapshot& actual,
                          const char* const* names, const std::string& what) {
  if (expected.bytes.size() != actual.bytes.size() ||
      expected.statuses.size() != actual.statuses.size()) {
    return absl::InternalError(absl::StrCat(what, ": snapshots of different sizes"));
  }
  const size_t ranks = expected.statuses.size();
  const size_t regions = expected.bytes.size() / ranks;
  for (size_t r = 0; r < ranks; ++r) {
    if (expected.statuses[r] != actual.statuses[r]) {
      return absl::InternalError(absl::StrCat(what, ": rank ", r, " status '", actual.statuses[r],
                                              "', expected '", expected.statuses[r], "'"));
    }
    for (size_t i = 0; i < regions; ++i) {
      const std::vector<uint8_t>& e = expected.bytes[r * regions + i];
      const std::vector<uint8_t>& a = actual.bytes[r * regions + i];
      EPD_RETURN_IF_ERROR(CompareBytes(e.data(), a.data(), e.size(),
                                       absl::StrCat(what, ": rank ", r, " ", names[i])));
    }
  }
  return absl::OkStatus();
}

// ---- launches ------------------------------------------------------------------------------

// How the ranks of one op are launched: one kernel per rank on its stream, all ranks in one
// fused kernel on rank 0's stream, or ranks [0, R/2) fused and the others one by one.
enum class Launch { kPerRank, kFused, kSplit };

// Launches one op of every rank `how`: `fused` for the fused ranks (on rank 0's stream),
// `per_rank` for the others (each on its stream).
template <typename Args>
absl::Status LaunchOp(VirtualRankGroup& g, Launch how, const std::vector<Args>& args,
                      absl::Status (*per_rank)(const kc::CudaRankContext&, const Args&,
                                               cudaStream_t),
                      absl::Status (*fused)(std::span<const kc::CudaRankContext>,
                                            std::span<const Args>, cudaStream_t)) {
  const int32_t R = g.num_ranks();
  const int32_t fused_end = how == Launch::kPerRank ? 0 : how == Launch::kFused ? R : R / 2;
  if (fused_end > 0) {
    const std::vector<kc::CudaRankContext> ctxs = Contexts(g, 0, fused_end);
    EPD_RETURN_IF_ERROR(fused(ctxs, std::span(args).subspan(0, fused_end), g.stream(0)));
  }
  for (int32_t r = fused_end; r < R; ++r) {
    EPD_RETURN_IF_ERROR(per_rank(g.Context(r), args[r], g.stream(r)));
  }
  return absl::OkStatus();
}

// One dispatch (then combine) of `g` launched `how`, each op's outputs and statuses
// snapshotted after its regions were filled with the pattern.
absl::Status RunOp(VirtualRankGroup& g, const FusedCase& c, int32_t b, Launch how,
                   Snapshot* dispatch, Snapshot* combine) {
  EPD_RETURN_IF_ERROR(FillRegions(g, DispatchRegions(g.layout(), b)));
  EPD_RETURN_IF_ERROR(LaunchOp(g, how, DispatchArgs(g, c, b), &kc::LowLatencyDispatch,
                               &kc::LowLatencyDispatchRanks));
  EPD_ASSIGN_OR_RETURN(*dispatch, TakeSnapshot(g, DispatchRegions(g.layout(), b), "dispatch"));
  EPD_RETURN_IF_ERROR(FillRegions(g, CombineRegions(g.layout(), b)));
  EPD_RETURN_IF_ERROR(
      LaunchOp(g, how, CombineArgs(g, b), &kc::LowLatencyCombine, &kc::LowLatencyCombineRanks));
  EPD_ASSIGN_OR_RETURN(*combine, TakeSnapshot(g, CombineRegions(g.layout(), b), "combine"));
  return absl::OkStatus();
}

// Restores the environment's choice of specialised kernels when a test ends.
struct SpecialisationScope {
  explicit SpecialisationScope(bool on) {
    if (on) kc::SetLowLatencySpecialisation(kc::LowLatencySpecialisation::kOn);
  }
  ~SpecialisationScope() {
    kc::SetLowLatencySpecialisation(kc::LowLatencySpecialisation::kEnvironment);
  }
};

// The group of tests 2 to 4: 8 ranks, FP8, flags at .gpu scope.
constexpr FusedCase kEightRanksFp8{"R8_fp8_gpu_scope", 8, 64, 2048, 8, 128, kFp8 | kGpuScope};

// PreloadKernels, then a group of case `c` (each rank's waits bounded by `timeout_ns`) with
// its inputs drawn from `seed`.
absl::StatusOr<std::unique_ptr<VirtualRankGroup>> MakeGroup(const FusedCase& c, uint64_t seed,
                                                            int64_t timeout_ns = 5'000'000'000) {
  EPD_RETURN_IF_ERROR(kc::PreloadKernels());
  EPD_ASSIGN_OR_RETURN(std::unique_ptr<VirtualRankGroup> g,
                       VirtualRankGroup::Create(ShapeOf(c), timeout_ns));
  g->set_all_ranks_on_device(c.has(kGpuScope));
  EPD_RETURN_IF_ERROR(UploadInputs(*g, c, seed));
  return g;
}

// ---- 1. fused == per rank, bit for bit -------------------------------------------------------

class LowLatencyFusedTest : public ::testing::TestWithParam<FusedCase> {};

// Per buffer: a per-rank dispatch and combine (the reference), then the same ops fused;
// every region of every rank and every status must be the same.
TEST_P(LowLatencyFusedTest, MatchesPerRankBitForBit) {
  REQUIRE_GPU();
  const FusedCase& c = GetParam();
  SpecialisationScope scope(c.has(kSpecialised));
  auto group = MakeGroup(c, 17);
  ASSERT_TRUE(group.ok()) << group.status();
  VirtualRankGroup& g = **group;
  ASSERT_EQ(kc::LowLatencySpecialisedFor(g.shape()), c.has(kSpecialised));
  for (int32_t b = 0; b < 2; ++b) {
    SCOPED_TRACE(absl::StrCat("buffer ", b));
    Snapshot ref_dispatch, ref_combine, dispatch, combine;
    EPD_ASSERT_OK(RunOp(g, c, b, Launch::kPerRank, &ref_dispatch, &ref_combine));
    EPD_ASSERT_OK(RunOp(g, c, b, Launch::kFused, &dispatch, &combine));
    EPD_ASSERT_OK(SameSnapshot(ref_dispatch, dispatch, kDispatchRegionNames, "fused dispatch"));
    EPD_ASSERT_OK(SameSnapshot(ref_combine, combine, kCombineRegionNames, "fused combine"));
    // The op did something: some rank received rows, and the statuses are as the case says.
    bool any_rows = false;
    for (int32_t r = 0; r < g.num_ranks(); ++r) {
      std::vector<int32_t> count(g.shape().num_local_experts());
      std::memcpy(count.data(), dispatch.bytes[r * 5 + 2].data(), count.size() * 4);
      for (int32_t n : count) any_rows |= n > 0;
      const bool bad = c.has(kBadId) && r == 1;
      EXPECT_EQ(dispatch.statuses[r] == "OK", !bad) << "rank " << r << ": " << dispatch.statuses[r];
    }
    EXPECT_TRUE(any_rows);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LowLatencyFusedTest,
    ::testing::Values(
        //        name                    R   E    H     K   Mll  flags
        FusedCase{"R8_bf16", 8, 64, 2048, 8, 128, kGpuScope},
        FusedCase{"R8_fp8", 8, 64, 2048, 8, 128, kFp8},
        FusedCase{"R8_fp8_ue8m0", 8, 64, 2048, 8, 128, kFp8 | kRoundScale | kUe8m0 | kGpuScope},
        FusedCase{"R8_fp8_large", 8, 64, 2048, 8, 128, kFp8 | kLargePath | kGpuScope},
        FusedCase{"R8_bf16_large_bad_id", 8, 64, 2048, 8, 128, kLargePath | kBadId},
        FusedCase{"R3_fp8_round", 3, 48, 1024, 6, 96, kFp8 | kRoundScale | kGpuScope},
        FusedCase{"R3_fp8_ue8m0_large", 3, 48, 1024, 6, 96,
                  kFp8 | kRoundScale | kUe8m0 | kLargePath},
        // BF16 rows of H % 8 != 0 (the scalar dispatch, the scalar combine), K > 32 (the
        // large path and the batched combine).
        FusedCase{"R3_bf16_scalar_K40", 3, 48, 100, 40, 64, kBadId},
        // The specialised instances (DeepSeek-V3's H, K, experts per rank; a small Mll).
        FusedCase{"R8_fp8_specialised", 8, 256, 7168, 8, 16, kFp8 | kSpecialised | kGpuScope},
        FusedCase{"R8_bf16_specialised", 8, 256, 7168, 8, 16, kSpecialised}),
    [](const ::testing::TestParamInfo<FusedCase>& info) { return std::string(info.param.name); });

// ---- 2. fused and per-rank launches mixed from op to op --------------------------------------

// The ranks' sync state (op counters, flags) is the same whichever way an op was launched:
// ops launched per rank, fused, and half fused half per rank, in any order, each match the
// first per-rank op of their buffer.
TEST(LowLatencyFusedMixed, AlternatingWithPerRankLaunchesStaysInStep) {
  REQUIRE_GPU();
  const FusedCase& c = kEightRanksFp8;
  auto group = MakeGroup(c, 23);
  ASSERT_TRUE(group.ok()) << group.status();
  VirtualRankGroup& g = **group;
  Snapshot ref_dispatch[2], ref_combine[2];
  for (int32_t b = 0; b < 2; ++b) {
    EPD_ASSERT_OK(RunOp(g, c, b, Launch::kPerRank, &ref_dispatch[b], &ref_combine[b]));
  }
  const Launch order[] = {Launch::kFused, Launch::kFused,   Launch::kPerRank, Launch::kSplit,
                          Launch::kFused, Launch::kPerRank, Launch::kSplit,   Launch::kFused};
  for (int i = 0; i < 8; ++i) {
    const int32_t b = i % 2;
    SCOPED_TRACE(absl::StrCat("op ", i, " launch ", static_cast<int>(order[i])));
    Snapshot dispatch, combine;
    EPD_ASSERT_OK(RunOp(g, c, b, order[i], &dispatch, &combine));
    EPD_ASSERT_OK(SameSnapshot(ref_dispatch[b], dispatch, kDispatchRegionNames, "dispatch"));
    EPD_ASSERT_OK(SameSnapshot(ref_combine[b], combine, kCombineRegionNames, "combine"));
  }
}

// ---- 3. / 4. the daemon-launched hand-off ----------------------------------------------------

// Host memory the hand-off tests share: a `seen` word per rank (WaitFlagsAsync), a
// DeviceStatus per rank (status_out), a word the host copies ready values from, and a
// stream of the host's own for those copies.
struct HandoffMemory {
  PinnedMemory pinned;
  CudaStream host_stream;
  uint64_t* seen = nullptr;
  kc::DeviceStatus* status_out = nullptr;
  uint64_t* value = nullptr;

  static absl::StatusOr<HandoffMemory> Create(int32_t R) {
    HandoffMemory m;
    void* p = nullptr;
    const size_t bytes = R * (sizeof(uint64_t) + sizeof(kc::DeviceStatus)) + 64;
    EPD_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
    m.pinned.reset(static_cast<uint8_t*>(p));
    std::memset(p, 0, bytes);
    m.status_out = reinterpret_cast<kc::DeviceStatus*>(p);
    m.seen = reinterpret_cast<uint64_t*>(m.status_out + R);
    m.value = m.seen + R;
    EPD_ASSIGN_OR_RETURN(m.host_stream, CudaStream::Create());
    return m;
  }

  // Writes `v` to rank r's ready word from the host (a copy on the host's own stream).
  absl::Status SetReady(VirtualRankGroup& g, int32_t r, uint64_t v) {
    *value = v;
    EPD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(LaunchFlag(g, r, abi::kReadyFlagOffset), value,
                                             sizeof(uint64_t), cudaMemcpyHostToDevice,
                                             host_stream.get()));
    return EPD_CUDA_STATUS(cudaStreamSynchronize(host_stream.get()));
  }
};

// What the hand-off tests share: a kEightRanksFp8 group, its HandoffMemory, and the
// outputs of a per-rank dispatch and combine on buffer 0 (the reference).
struct HandoffRig {
  std::unique_ptr<VirtualRankGroup> group;
  HandoffMemory memory;
  Snapshot ref_dispatch, ref_combine;

  static absl::StatusOr<std::unique_ptr<HandoffRig>> Create(uint64_t seed, int64_t timeout_ns) {
    auto rig = std::make_unique<HandoffRig>();
    EPD_ASSIGN_OR_RETURN(rig->group, MakeGroup(kEightRanksFp8, seed, timeout_ns));
    EPD_ASSIGN_OR_RETURN(rig->memory, HandoffMemory::Create(rig->group->num_ranks()));
    EPD_RETURN_IF_ERROR(RunOp(*rig->group, kEightRanksFp8, 0, Launch::kPerRank, &rig->ref_dispatch,
                              &rig->ref_combine));
    return rig;
  }
};

// The daemon's enqueue of one op of every rank (seq): one WaitFlagsAsync on every rank's
// ready word, then the fused op launched programmatically, each rank storing done = seq and
// its status to status_out[r].
std::vector<kc::FlagWait> ReadyWaits(VirtualRankGroup& g, uint64_t seq, uint64_t* seen) {
  std::vector<kc::FlagWait> waits(g.num_ranks());
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    waits[r].flag = LaunchFlag(g, r, abi::kReadyFlagOffset);
    waits[r].value = seq;
    waits[r].seen = seen + r;
  }
  return waits;
}

kc::KernelHandoff Handoff(VirtualRankGroup& g, int32_t r, uint64_t seq,
                          kc::DeviceStatus* status_out) {
  kc::KernelHandoff h = DaemonHandoff(g, r, seq);
  h.status_out = status_out + r;
  return h;
}

constexpr int64_t kWaitNs = 10'000'000'000;

// Expects done = seq, seen = seq and an OK status_out for every rank; the device status
// cleared.
void ExpectHandedOff(VirtualRankGroup& g, HandoffMemory& m, uint64_t seq, const char* op) {
  for (int32_t r = 0; r < g.num_ranks(); ++r) {
    EXPECT_EQ(ReadWord(LaunchFlag(g, r, abi::kDoneFlagOffset)), seq) << "rank " << r;
    EXPECT_EQ(m.seen[r], seq) << "rank " << r;
    const absl::Status st = kc::StatusFromDevice(m.status_out[r], g.shape(), r, op, true);
    EXPECT_TRUE(st.ok()) << "rank " << r << ": " << st;
    const absl::Status left = kc::ReadAndClearStatus(g.Context(r), g.stream(0), op);
    EXPECT_TRUE(left.ok()) << "rank " << r << ": status not cleared: " << left;
  }
}

// As the daemon runs an op of every rank of a GPU: one WaitFlagsAsync, then the fused kernel
// (programmatic). Nothing runs before every rank's ready word is written (from the host,
// after the launch, one rank at a time); then every rank stores its done and status, and
// the outputs are those of per-rank launches. Dispatch, then combine.
TEST(LowLatencyFusedHandoff, OneWaitForEveryRankThenTheFusedKernel) {
  REQUIRE_GPU();
  const FusedCase& c = kEightRanksFp8;
  auto rig = HandoffRig::Create(29, 5'000'000'000);
  ASSERT_TRUE(rig.ok()) << rig.status();
  VirtualRankGroup& g = *(*rig)->group;
  HandoffMemory& m = (*rig)->memory;
  const Snapshot& ref_dispatch = (*rig)->ref_dispatch;
  const Snapshot& ref_combine = (*rig)->ref_combine;

  // ---- dispatch (seq 1) ----
  EPD_ASSERT_OK(FillRegions(g, DispatchRegions(g.layout(), 0)));
  std::vector<kc::LowLatencyDispatchArgs> da = DispatchArgs(g, c, 0);
  for (int32_t r = 0; r < g.num_ranks(); ++r) da[r].handoff = Handoff(g, r, 1, m.status_out);
  const std::vector<kc::CudaRankContext> ctxs = Contexts(g, 0, g.num_ranks());
  EPD_ASSERT_OK(kc::WaitFlagsAsync(ReadyWaits(g, 1, m.seen), kWaitNs, g.stream(0)));
  EPD_ASSERT_OK(kc::LowLatencyDispatchRanks(ctxs, da, g.stream(0)));
  for (int32_t r = g.num_ranks() - 1; r >= 0; --r) {
    std::this_thread::sleep_for(std::chrono::milliseconds(r == g.num_ranks() - 1 ? 200 : 10));
    EXPECT_EQ(cudaStreamQuery(g.stream(0)), cudaErrorNotReady) << "ran before rank " << r;
    for (int32_t q = 0; q < g.num_ranks(); ++q) {
      ASSERT_EQ(ReadWord(LaunchFlag(g, q, abi::kDoneFlagOffset)), 0u) << "rank " << q;
      // A rank whose ready is written passes its own wait (seen) at once; not the others.
      if (q <= r) ASSERT_EQ(m.seen[q], 0u) << "rank " << q;
    }
    EPD_ASSERT_OK(m.SetReady(g, r, 1));
  }
  ASSERT_EQ(cudaStreamSynchronize(g.stream(0)), cudaSuccess);
  ExpectHandedOff(g, m, 1, "LowLatencyDispatch");
  auto dispatch = TakeSnapshot(g, DispatchRegions(g.layout(), 0), "dispatch");
  ASSERT_TRUE(dispatch.ok()) << dispatch.status();
  EPD_ASSERT_OK(SameSnapshot(ref_dispatch, *dispatch, kDispatchRegionNames, "handed-off dispatch"));

  // ---- combine (seq 2) ----
  EPD_ASSERT_OK(FillRegions(g, CombineRegions(g.layout(), 0)));
  std::vector<kc::LowLatencyCombineArgs> ca = CombineArgs(g, 0);
  for (int32_t r = 0; r < g.num_ranks(); ++r) ca[r].handoff = Handoff(g, r, 2, m.status_out);
  EPD_ASSERT_OK(kc::WaitFlagsAsync(ReadyWaits(g, 2, m.seen), kWaitNs, g.stream(0)));
  EPD_ASSERT_OK(kc::LowLatencyCombineRanks(ctxs, ca, g.stream(0)));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(cudaStreamQuery(g.stream(0)), cudaErrorNotReady) << "combine ran before ready";
  for (int32_t r = 0; r < g.num_ranks(); ++r) EPD_ASSERT_OK(m.SetReady(g, r, 2));
  ASSERT_EQ(cudaStreamSynchronize(g.stream(0)), cudaSuccess);
  ExpectHandedOff(g, m, 2, "LowLatencyCombine");
  auto combine = TakeSnapshot(g, CombineRegions(g.layout(), 0), "combine");
  ASSERT_TRUE(combine.ok()) << combine.status();
  EPD_ASSERT_OK(SameSnapshot(ref_combine, *combine, kCombineRegionNames, "handed-off combine"));
}

// The last rank's ready never comes. Its bound (timeout_ns) is twice the others', so they
// give up on it for certain before it goes on: every rank's status_out says
// DEADLINE_EXCEEDED naming rank 7, every done is stored, the kernel ends within its bounds,
// and after ResetLowLatencySync the next fused op is right.
TEST(LowLatencyFusedHandoff, MissingReadyTimesOutEveryRankThenResetWorks) {
  REQUIRE_GPU();
  const FusedCase& c = kEightRanksFp8;
  constexpr int64_t kTimeoutNs = 500'000'000;
  constexpr int64_t kWaitsNs = 200'000'000;
  auto rig = HandoffRig::Create(31, kTimeoutNs);
  ASSERT_TRUE(rig.ok()) << rig.status();
  VirtualRankGroup& g = *(*rig)->group;
  HandoffMemory& m = (*rig)->memory;
  const int32_t R = g.num_ranks();
  std::memset(m.status_out, 0xff, R * sizeof(kc::DeviceStatus));

  std::vector<kc::CudaRankContext> ctxs = Contexts(g, 0, R);
  ctxs[R - 1].timeout_ns = 2 * kTimeoutNs;
  std::vector<kc::LowLatencyDispatchArgs> da = DispatchArgs(g, c, 0);
  for (int32_t r = 0; r < R; ++r) da[r].handoff = Handoff(g, r, 1, m.status_out);
  for (int32_t r = 0; r < R - 1; ++r) EPD_ASSERT_OK(m.SetReady(g, r, 1));
  const auto start = std::chrono::steady_clock::now();
  EPD_ASSERT_OK(kc::WaitFlagsAsync(ReadyWaits(g, 1, m.seen), kWaitsNs, g.stream(0)));
  EPD_ASSERT_OK(kc::LowLatencyDispatchRanks(ctxs, da, g.stream(0)));
  ASSERT_EQ(cudaStreamSynchronize(g.stream(0)), cudaSuccess);
  const double elapsed_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The waits' bound, then the kernel's: rank 7's ready wait, then (done) its bounded wait
  // for its own blocks; slack for the launch.
  EXPECT_LE(elapsed_s, (kWaitsNs + 2 * 2 * kTimeoutNs) * 1e-9 + 1.0);
  for (int32_t r = 0; r < R; ++r) {
    EXPECT_EQ(ReadWord(LaunchFlag(g, r, abi::kDoneFlagOffset)), 1u) << "rank " << r;
    EXPECT_EQ(m.seen[r], r == R - 1 ? 0u : 1u) << "rank " << r;
    const absl::Status st =
        kc::StatusFromDevice(m.status_out[r], g.shape(), r, "LowLatencyDispatch", true);
    EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << "rank " << r << ": " << st;
    EXPECT_NE(st.message().find("7"), std::string::npos) << "rank " << r << ": " << st;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);

  for (int32_t r = 0; r < R; ++r) EPD_ASSERT_OK(kc::ResetLowLatencySync(g.Context(r), g.stream(0)));
  ASSERT_EQ(cudaStreamSynchronize(g.stream(0)), cudaSuccess);
  Snapshot dispatch, combine;
  EPD_ASSERT_OK(RunOp(g, c, 0, Launch::kFused, &dispatch, &combine));
  EPD_ASSERT_OK(
      SameSnapshot((*rig)->ref_dispatch, dispatch, kDispatchRegionNames, "dispatch after reset"));
  EPD_ASSERT_OK(
      SameSnapshot((*rig)->ref_combine, combine, kCombineRegionNames, "combine after reset"));
}

// ---- 5. host-side checks (no GPU work: refused before anything is launched) -----------------

// Contexts of a group whose data areas are never touched (fake addresses): the launchers'
// checks run on the host and refuse before any CUDA call. num_sms set, so no device query.
struct FakeGroup {
  GroupShape shape;
  EndpointLayout layout;
  std::vector<kc::CudaRankContext> ctxs;

  explicit FakeGroup(int32_t R) {
    shape = ShapeOf(FusedCase{"fake", R, 8 * R, 2048, 8, 128, kFp8});
    layout = EndpointLayout::Compute(shape);
    const uintptr_t base = uintptr_t{1} << 40;
    for (int32_t r = 0; r < R; ++r) {
      kc::CudaRankContext c;
      c.shape = shape;
      c.layout = layout;
      c.rank = r;
      c.peer_bases = reinterpret_cast<uint8_t* const*>(base - 4096);
      c.own_base = reinterpret_cast<uint8_t*>(base + r * (layout.total_bytes + 4096));
      c.num_sms = 4;
      ctxs.push_back(c);
    }
  }
};

// INVALID_ARGUMENT whose message holds every one of `parts`.
void ExpectRefused(const absl::Status& st, std::initializer_list<const char*> parts) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  for (const char* part : parts) EXPECT_NE(st.message().find(part), std::string::npos) << st;
}

TEST(LowLatencyFusedArgs, DispatchRefusesWhatOneLaunchCannotCover) {
  FakeGroup f(8);
  std::vector<kc::LowLatencyDispatchArgs> args(8);
  for (auto& a : args) a.use_fp8 = true;
  auto dispatch = [&](std::span<const kc::CudaRankContext> ctxs,
                      std::span<const kc::LowLatencyDispatchArgs> a) {
    return kc::LowLatencyDispatchRanks(ctxs, a, nullptr);
  };
  ExpectRefused(dispatch({}, {}), {"ctxs.size() = 0"});
  ExpectRefused(dispatch(f.ctxs, std::span(args).subspan(0, 7)), {"args.size() = 7"});
  {
    FakeGroup nine(9);
    std::vector<kc::LowLatencyDispatchArgs> a9(9, args[0]);
    ExpectRefused(dispatch(nine.ctxs, a9), {"ctxs.size() = 9", "kMaxFusedRanks"});
  }
  struct Field {
    const char* name;
    void (*change)(kc::LowLatencyDispatchArgs*);
  };
  const Field fields[] = {
      {"args.buffer", [](kc::LowLatencyDispatchArgs* a) { a->buffer = 1; }},
      {"args.use_fp8", [](kc::LowLatencyDispatchArgs* a) { a->use_fp8 = false; }},
      {"args.round_scale", [](kc::LowLatencyDispatchArgs* a) { a->round_scale = true; }},
      {"args.large_path", [](kc::LowLatencyDispatchArgs* a) { a->large_path = true; }},
      {"args.handoff.programmatic",
       [](kc::LowLatencyDispatchArgs* a) { a->handoff.programmatic = true; }},
  };
  for (const Field& field : fields) {
    std::vector<kc::LowLatencyDispatchArgs> a = args;
    field.change(&a[3]);
    ExpectRefused(dispatch(f.ctxs, a),
                  {"LowLatencyDispatchRanks", "ranks[3] (rank 3)", field.name});
  }
  {  // use_ue8m0 alone (every rank rounds its scales).
    std::vector<kc::LowLatencyDispatchArgs> a = args;
    for (auto& x : a) x.round_scale = true;
    a[5].use_ue8m0 = true;
    ExpectRefused(dispatch(f.ctxs, a), {"ranks[5] (rank 5)", "args.use_ue8m0"});
  }
  {  // BF16: one rank's x not 16-byte aligned takes the scalar kernel, the others' not.
    std::vector<kc::LowLatencyDispatchArgs> a(8);
    a[2].x = reinterpret_cast<const bf16_bits*>(f.ctxs[2].own_base + f.layout.in_x.offset + 2);
    ExpectRefused(dispatch(f.ctxs, a), {"ranks[2] (rank 2)", "x (kernel variant"});
  }
  {  // A rank's own error, as LowLatencyDispatch says it, with the rank named.
    std::vector<kc::LowLatencyDispatchArgs> a = args;
    a[4].buffer = 2;
    ExpectRefused(dispatch(f.ctxs, a), {"ranks[4] (rank 4)", "buffer = 2"});
  }
  {
    std::vector<kc::CudaRankContext> ctxs = f.ctxs;
    ctxs[2].num_sms = 5;
    ExpectRefused(dispatch(ctxs, args), {"ranks[2] (rank 2)", "num_sms"});
  }
  {
    std::vector<kc::CudaRankContext> ctxs = f.ctxs;
    ctxs[6].shape.hidden = 1024;
    ExpectRefused(dispatch(ctxs, args), {"ranks[6] (rank 6)", "shape.hidden"});
  }
  {
    std::vector<kc::CudaRankContext> ctxs = f.ctxs;
    ctxs[7].rank = 1;
    ExpectRefused(dispatch(ctxs, args), {"ranks[7] (rank 1)", "rank given twice"});
  }
  {  // A subset of the group's ranks: named by index in the span and by rank.
    std::vector<kc::LowLatencyDispatchArgs> a = args;
    a[1].buffer = 1;
    ExpectRefused(dispatch(std::span(f.ctxs).subspan(1, 3), std::span(a).subspan(1, 3)),
                  {"ranks[1] (rank 2)", "args.buffer"});
  }
}

TEST(LowLatencyFusedArgs, CombineRefusesWhatOneLaunchCannotCover) {
  FakeGroup f(4);
  std::vector<kc::LowLatencyCombineArgs> args(4);
  auto combine = [&](std::span<const kc::CudaRankContext> ctxs,
                     std::span<const kc::LowLatencyCombineArgs> a) {
    return kc::LowLatencyCombineRanks(ctxs, a, nullptr);
  };
  ExpectRefused(combine(f.ctxs, std::span(args).subspan(0, 2)), {"args.size() = 2"});
  {
    std::vector<kc::LowLatencyCombineArgs> a = args;
    a[1].buffer = 1;
    ExpectRefused(combine(f.ctxs, a),
                  {"LowLatencyCombineRanks", "ranks[1] (rank 1)", "args.buffer"});
  }
  {
    std::vector<kc::LowLatencyCombineArgs> a = args;
    a[2].x_offset = f.layout.ll_recv_x[0].offset;
    ExpectRefused(combine(f.ctxs, a), {"ranks[2] (rank 2)", "args.x_offset"});
  }
  {
    std::vector<kc::LowLatencyCombineArgs> a = args;
    a[3].handoff.programmatic = true;
    ExpectRefused(combine(f.ctxs, a), {"ranks[3] (rank 3)", "args.handoff.programmatic"});
  }
  {
    std::vector<kc::LowLatencyCombineArgs> a = args;
    a[1].combined_x = reinterpret_cast<bf16_bits*>(f.ctxs[1].own_base + 2);
    ExpectRefused(combine(f.ctxs, a), {"ranks[1] (rank 1)", "combined_x (kernel variant"});
  }
  {
    std::vector<kc::LowLatencyCombineArgs> a = args;
    a[0].x_offset = 3;
    ExpectRefused(combine(f.ctxs, a), {"ranks[0] (rank 0)", "x_offset = 3"});
  }
  {
    std::vector<kc::CudaRankContext> ctxs = f.ctxs;
    ctxs[3].num_sms = 3;
    ExpectRefused(combine(ctxs, args), {"ranks[3] (rank 3)", "num_sms"});
  }
}

TEST(LowLatencyFusedArgs, WaitFlagsRefusesBadWaits) {
  uint64_t word = 0;
  std::vector<kc::FlagWait> waits(3, kc::FlagWait{&word, nullptr, 1, nullptr});
  ExpectRefused(kc::WaitFlagsAsync({}, 1000, nullptr), {"waits.size() = 0"});
  ExpectRefused(kc::WaitFlagsAsync(waits, 0, nullptr), {"timeout_ns = 0"});
  std::vector<kc::FlagWait> nine(9, waits[0]);
  ExpectRefused(kc::WaitFlagsAsync(nine, 1000, nullptr), {"waits.size() = 9"});
  waits[2].flag = nullptr;
  ExpectRefused(kc::WaitFlagsAsync(waits, 1000, nullptr), {"waits[2].flag is null"});
}

}  // namespace
}  // namespace epd::testing
