// The CUDA backend's limits on a group spec, checked without a GPU (epd/kernels/cuda_limits.h
// is pure): every spec within them is accepted at Join on "cuda" (low-latency capacities up
// to 4096 and far past, top-k up to E, any hidden size), a spec past one is refused at Join
// with INVALID_ARGUMENT naming the field, the value and the largest value that works, and
// the low-latency dispatch's routing plan stays within the shared memory it launches with.
#include "epd/kernels/cuda_limits.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/control/group_registry.h"
#include "daemon/control/spec_validation.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/specs.h"
#include "tests/unit/fake_data_plane.h"

namespace epd {
namespace {

namespace kc = kernels::cuda;
using ::testing::AllOf;
using ::testing::HasSubstr;

v1::GroupSpec Spec(int R, int E, int H, int K, int Mll, bool fp8 = false) {
  return testing::MakeSpec("limits", {.num_ranks = R,
                                      .num_experts = E,
                                      .hidden = H,
                                      .num_topk = K,
                                      .max_tokens_per_rank = 64,
                                      .ll_max_tokens_per_rank = Mll,
                                      .use_fp8 = fp8});
}

kernels::GroupShape Shape(int R, int E, int H, int K, int Mll) {
  return kernels::GroupShape{R, E, H, K, /*max_tokens_per_rank=*/64, Mll, /*use_fp8=*/false};
}

absl::Status OnCuda(const v1::GroupSpec& spec) {
  absl::Status valid = ValidateGroupSpec(spec);
  if (!valid.ok()) return valid;
  return ValidateGroupSpecForBackend(spec, "cuda");
}

TEST(CudaLimitsTest, LowLatencyCapacityTopkAndHiddenHaveNoLimitOnCuda) {
  // The specs the conformance check found failing at the first op, DeepSeek-V3's, and a
  // grid of capacities, top-k and hidden sizes (top-k up to E; capacity up to the spec's).
  EXPECT_TRUE(OnCuda(Spec(4, 16, 1024, 4, 1024, true)).ok());
  EXPECT_TRUE(OnCuda(Spec(4, 32, 256, 2, 1100)).ok());
  EXPECT_TRUE(OnCuda(Spec(2, 16, 128, 8, 3000, true)).ok());
  EXPECT_TRUE(OnCuda(Spec(8, 256, 7168, 8, 128, true)).ok());
  for (int Mll : {1, 128, 1024, 3000, 4096, 1 << 20}) {
    for (int K : {1, 8, 32, 48, 64, 128, 256}) {
      for (int H : {128, 7168, 65536}) {
        const v1::GroupSpec spec = Spec(8, 256, H, K, Mll, true);
        if (static_cast<int64_t>(Mll) * ((H + 31) / 32) >= (int64_t{1} << 31)) {
          continue;  // Past the 32-bit unit count (LowLatencyUnitCountIsBounded).
        }
        EXPECT_TRUE(OnCuda(spec).ok()) << SpecSummary(spec) << ": " << OnCuda(spec);
      }
    }
  }
  // Top-k equal to the largest E the exchange allows, with one rank.
  EXPECT_TRUE(OnCuda(Spec(1, 4224, 128, 4224, 4096)).ok());
}

// The low-latency kernels number (token, 32-channel chunk) units in 32 bits: at the largest
// hidden Join accepts, the capacity whose unit count reaches 2^31 is refused at Join, naming
// the field, the value and the largest that works; that one is accepted.
TEST(CudaLimitsTest, LowLatencyUnitCountIsBounded) {
  const int H = 65536;  // 2048 chunks of 32 channels.
  const int most = static_cast<int>((int64_t{1} << 31) / 2048 - 1);
  EXPECT_TRUE(OnCuda(Spec(2, 16, H, 2, most)).ok()) << OnCuda(Spec(2, 16, H, 2, most));
  const absl::Status past = OnCuda(Spec(2, 16, H, 2, most + 1));
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument) << past;
  EXPECT_THAT(std::string(past.message()),
              AllOf(HasSubstr("spec.ll_max_tokens_per_rank: " + std::to_string(most + 1)),
                    HasSubstr("the largest ll_max_tokens_per_rank that works with this hidden "
                              "is " +
                              std::to_string(most))));
}

TEST(CudaLimitsTest, ASpecPastALimitIsRefusedNamingFieldValueAndLargestThatWorks) {
  // More ranks than the normal-mode kernels take.
  absl::Status st = OnCuda(Spec(65, 130, 256, 2, 0));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()),
              AllOf(HasSubstr("spec.num_ranks: 65"), HasSubstr("largest num_ranks that works"),
                    HasSubstr(" 64")));
  EXPECT_TRUE(OnCuda(Spec(64, 64, 256, 2, 128)).ok());
  EXPECT_TRUE(OnCuda(Spec(64, 128, 256, 2, 0)).ok());

  // The low-latency count exchange: with 8 ranks, E = 528 fits, 536 does not.
  st = OnCuda(Spec(8, 536, 256, 8, 128));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()),
              AllOf(HasSubstr("spec.num_experts: 536"), HasSubstr("num_ranks = 8"),
                    HasSubstr("count exchange"),
                    HasSubstr("largest num_experts that works with 8 ranks is 528"),
                    HasSubstr("6048 with ll_max_tokens_per_rank = 0")));
  EXPECT_TRUE(OnCuda(Spec(8, 528, 256, 8, 128)).ok());
  EXPECT_TRUE(OnCuda(Spec(8, 536, 256, 8, 0)).ok());  // No low-latency mode: no exchange.

  // The normal-mode sync state: with 8 ranks, E = 6048 fits, 6056 does not.
  st = OnCuda(Spec(8, 6056, 256, 8, 0));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()),
              AllOf(HasSubstr("spec.num_experts: 6056"), HasSubstr("normal mode's sync state"),
                    HasSubstr("largest num_experts that works with 8 ranks is 6048")));
  EXPECT_TRUE(OnCuda(Spec(8, 6048, 256, 8, 0)).ok());

  // The host backend has none of these limits.
  for (const v1::GroupSpec& spec :
       {Spec(65, 130, 256, 2, 0), Spec(8, 536, 256, 8, 128), Spec(8, 6056, 256, 8, 0)}) {
    EXPECT_TRUE(ValidateGroupSpecForBackend(spec, "host").ok()) << SpecSummary(spec);
  }
}

TEST(CudaLimitsTest, TheLargestValueNamedWorksAndTheNextDoesNotForEveryRankCount) {
  for (int R = 1; R <= kc::kNormalMaxRanks; ++R) {
    for (int Mll : {0, 64}) {
      // Past the limit by a wide margin; the message names the largest E that works.
      const kernels::GroupShape past = Shape(R, 8192 / R * R + R, 256, 1, Mll);
      const absl::Status st = kc::CheckCudaShape(past);
      ASSERT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << "R=" << R << " Mll=" << Mll;
      const std::string message(st.message());
      const std::string key = absl::StrCat("works with ", R, " ranks is ");
      const size_t at = message.find(key);
      ASSERT_NE(at, std::string::npos) << message;
      const int largest = std::stoi(message.substr(at + key.size()));
      ASSERT_GE(largest, R) << message;
      ASSERT_EQ(largest % R, 0) << message;
      EXPECT_TRUE(kc::CheckCudaShape(Shape(R, largest, 256, 1, Mll)).ok()) << message;
      EXPECT_FALSE(kc::CheckCudaShape(Shape(R, largest + R, 256, 1, Mll)).ok()) << message;
    }
  }
}

TEST(CudaLimitsTest, JoinOnTheCudaBackendRefusesASpecPastALimitBeforeCreatingTheGroup) {
  auto state = std::make_shared<testing::FakeDataPlaneState>();
  state->backend = "cuda";
  testing::FakeDataPlane plane(state);
  GroupRegistry registry(&plane, testing::OneGpu(), GroupRegistry::Options{.max_groups = 4});
  absl::StatusOr<std::string> session =
      registry.OpenSession(PeerCredentials{.pid = 1, .uid = 1000, .gid = 1000}, "test");
  ASSERT_TRUE(session.ok()) << session.status();
  auto join = [&](const v1::GroupSpec& spec) {
    v1::JoinGroupRequest request;
    *request.mutable_spec() = spec;
    request.set_rank(0);
    request.set_session_id(*session);
    request.set_gpu_uuid(testing::kGpuA);
    return registry.Join(request);
  };
  v1::GroupSpec past = Spec(8, 1024, 7168, 8, 128, true);
  past.set_name("past");
  absl::StatusOr<v1::EndpointInfo> refused = join(past);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              AllOf(HasSubstr("spec.num_experts: 1024"), HasSubstr("is 528")));
  EXPECT_EQ(state->groups_created, 0);
  // A large low-latency capacity and top-k are accepted.
  v1::GroupSpec large = Spec(2, 64, 7168, 64, 4096, true);
  large.set_name("large");
  absl::StatusOr<v1::EndpointInfo> accepted = join(large);
  EXPECT_TRUE(accepted.ok()) << accepted.status();
}

TEST(CudaLimitsTest, RoutingPlanFitsTheSharedMemoryItLaunchesWith) {
  // DeepSeek-V3 decode keeps the small path.
  kc::LowLatencyRoutingPlan plan = kc::PlanLowLatencyRouting(Shape(8, 256, 7168, 8, 128));
  EXPECT_FALSE(plan.tiled);
  EXPECT_EQ(plan.small_smem_bytes, 23040u);
  // The failing capacities and top-k past the small path's take the large path.
  EXPECT_TRUE(kc::PlanLowLatencyRouting(Shape(4, 16, 1024, 4, 1024)).tiled);
  EXPECT_TRUE(kc::PlanLowLatencyRouting(Shape(8, 256, 7168, 33, 1)).tiled);
  for (int E : {1, 16, 256, 528, 4224}) {
    for (int K : {1, 8, 32, 33, 64}) {
      if (K > E) continue;
      for (int Mll : {1, 31, 32, 33, 128, 1024, 3000, 4096, 1 << 20}) {
        plan = kc::PlanLowLatencyRouting(Shape(1, E, 128, K, Mll));
        const std::string what = absl::StrCat("E=", E, " K=", K, " Mll=", Mll);
        EXPECT_EQ(plan.tiled,
                  K > 32 || plan.small_smem_bytes > kc::kLowLatencyDefaultDynamicSmemBytes)
            << what;
        EXPECT_LE(plan.tiled_smem_bytes, kc::kLowLatencyTiledSmemBudget) << what;
        EXPECT_GE(plan.tile_groups, 1) << what;
        EXPECT_LE(plan.tile_groups, (Mll + 31) / 32) << what;
        EXPECT_EQ(plan.tiled_smem_bytes, 8ull * E * (1 + plan.tile_groups)) << what;
        EXPECT_EQ(plan.mask_stride % 2, 1) << what;
      }
    }
  }
}

}  // namespace
}  // namespace epd
