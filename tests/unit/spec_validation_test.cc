// The spec-validation table: every rule of ValidateGroupSpec / ValidateRank /
// CheckBuffersFit / CheckSameSpec with valid and invalid cases; each error must name the
// field and the value.
#include "daemon/control/spec_validation.h"

#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_data_plane.h"

namespace epd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::SizeIs;

struct SpecCase {
  std::string label;
  std::function<void(v1::GroupSpec*)> mutate;
  bool valid;
  std::vector<std::string> message_parts;  ///< Field and value the error must name.
};

class SpecTableTest : public ::testing::TestWithParam<SpecCase> {};

TEST_P(SpecTableTest, ValidatesAndNamesFieldAndValue) {
  const SpecCase& c = GetParam();
  v1::GroupSpec spec = testing::SmallSpec();
  c.mutate(&spec);
  absl::Status status = ValidateGroupSpec(spec);
  if (c.valid) {
    EXPECT_TRUE(status.ok()) << status;
    return;
  }
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  for (const std::string& part : c.message_parts) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(part));
  }
}

std::vector<SpecCase> Cases() {
  using S = v1::GroupSpec;
  return {
      {"small_spec", [](S*) {}, true, {}},
      {"deepseek_v3",
       [](S* s) {
         s->set_num_ranks(8);
         s->set_num_experts(256);
         s->set_hidden(7168);
         s->set_num_topk(8);
         s->set_max_tokens_per_rank(4096);
         s->set_use_fp8(true);
         s->set_ll_max_tokens_per_rank(128);
       },
       true,
       {}},
      // name: [A-Za-z0-9_.-]{1,64}
      {"name_all_allowed_chars", [](S* s) { s->set_name("Model_v3.layer-0"); }, true, {}},
      {"name_64_chars", [](S* s) { s->set_name(std::string(64, 'a')); }, true, {}},
      {"name_empty", [](S* s) { s->set_name(""); }, false, {"spec.name", "\"\""}},
      {"name_65_chars", [](S* s) { s->set_name(std::string(65, 'a')); }, false, {"spec.name"}},
      {"name_slash", [](S* s) { s->set_name("a/b"); }, false, {"spec.name", "a/b", "'/'"}},
      {"name_space", [](S* s) { s->set_name("a b"); }, false, {"spec.name", "a b"}},
      // num_ranks >= 1
      {"ranks_1", [](S* s) { s->set_num_ranks(1); }, true, {}},
      {"ranks_0", [](S* s) { s->set_num_ranks(0); }, false, {"spec.num_ranks", ": 0"}},
      {"ranks_negative", [](S* s) { s->set_num_ranks(-2); }, false, {"spec.num_ranks", "-2"}},
      {"ranks_too_many",
       [](S* s) {
         s->set_num_ranks(kMaxRanks + 1);
         s->set_num_experts(kMaxRanks + 1);
       },
       false,
       {"spec.num_ranks", std::to_string(kMaxRanks + 1)}},
      // num_experts % num_ranks == 0
      {"experts_multiple",
       [](S* s) {
         s->set_num_ranks(4);
         s->set_num_experts(12);
       },
       true,
       {}},
      {"experts_not_multiple",
       [](S* s) {
         s->set_num_ranks(4);
         s->set_num_experts(10);
       },
       false,
       {"spec.num_experts", "10", "num_ranks 4"}},
      {"experts_0", [](S* s) { s->set_num_experts(0); }, false, {"spec.num_experts", ": 0"}},
      {"experts_too_many",
       [](S* s) { s->set_num_experts(kMaxExperts * 2); },
       false,
       {"spec.num_experts", std::to_string(kMaxExperts * 2)}},
      // hidden >= 1; hidden % 128 == 0 when FP8 is on
      {"hidden_odd_without_fp8", [](S* s) { s->set_hidden(100); }, true, {}},
      {"hidden_7168_fp8",
       [](S* s) {
         s->set_hidden(7168);
         s->set_use_fp8(true);
       },
       true,
       {}},
      {"hidden_not_128_fp8",
       [](S* s) {
         s->set_hidden(100);
         s->set_use_fp8(true);
       },
       false,
       {"spec.hidden", "100", "128", "use_fp8"}},
      {"hidden_0", [](S* s) { s->set_hidden(0); }, false, {"spec.hidden", ": 0"}},
      {"hidden_too_big",
       [](S* s) { s->set_hidden(kMaxHidden + 1); },
       false,
       {"spec.hidden", std::to_string(kMaxHidden + 1)}},
      // 1 <= num_topk <= num_experts, no top-k cap below 128
      {"topk_1", [](S* s) { s->set_num_topk(1); }, true, {}},
      {"topk_equals_experts", [](S* s) { s->set_num_topk(8); }, true, {}},
      {"topk_128",
       [](S* s) {
         s->set_num_experts(256);
         s->set_num_topk(128);
       },
       true,
       {}},
      {"topk_200",
       [](S* s) {
         s->set_num_experts(256);
         s->set_num_topk(200);
       },
       true,
       {}},
      {"topk_0", [](S* s) { s->set_num_topk(0); }, false, {"spec.num_topk", ": 0"}},
      {"topk_negative", [](S* s) { s->set_num_topk(-1); }, false, {"spec.num_topk", "-1"}},
      {"topk_above_experts",
       [](S* s) { s->set_num_topk(9); },
       false,
       {"spec.num_topk", "9", "num_experts = 8"}},
      // max_tokens_per_rank >= 1
      {"max_tokens_1", [](S* s) { s->set_max_tokens_per_rank(1); }, true, {}},
      {"max_tokens_0",
       [](S* s) { s->set_max_tokens_per_rank(0); },
       false,
       {"spec.max_tokens_per_rank", ": 0"}},
      {"max_tokens_negative",
       [](S* s) { s->set_max_tokens_per_rank(-5); },
       false,
       {"spec.max_tokens_per_rank", "-5"}},
      {"max_tokens_too_big",
       [](S* s) { s->set_max_tokens_per_rank(kMaxTokensPerRank + 1); },
       false,
       {"spec.max_tokens_per_rank", std::to_string(kMaxTokensPerRank + 1)}},
      // ll_max_tokens_per_rank >= 0
      {"ll_0_disabled", [](S* s) { s->set_ll_max_tokens_per_rank(0); }, true, {}},
      {"ll_128", [](S* s) { s->set_ll_max_tokens_per_rank(128); }, true, {}},
      {"ll_negative",
       [](S* s) { s->set_ll_max_tokens_per_rank(-1); },
       false,
       {"spec.ll_max_tokens_per_rank", "-1"}},
  };
}

INSTANTIATE_TEST_SUITE_P(Rules, SpecTableTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<SpecCase>& info) {
                           return info.param.label;
                         });

TEST(ValidateRankTest, InsideAndOutsideRange) {
  v1::GroupSpec spec = testing::SmallSpec();  // 2 ranks.
  EXPECT_TRUE(ValidateRank(spec, 0).ok());
  EXPECT_TRUE(ValidateRank(spec, 1).ok());
  for (int32_t rank : {-1, 2, 100}) {
    absl::Status status = ValidateRank(spec, rank);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()),
                AllOf(HasSubstr("rank: " + std::to_string(rank)), HasSubstr("[0, 2)")));
  }
}

TEST(CheckBuffersFitTest, FitsOrNamesBytesNeededAndFree) {
  v1::GroupSpec spec = testing::SmallSpec();
  EXPECT_TRUE(CheckBuffersFit(spec, 100, 100, "GPU-x").ok());
  EXPECT_TRUE(CheckBuffersFit(spec, 0, 0, "GPU-x").ok());
  absl::Status status = CheckBuffersFit(spec, 123456789, 1000, "GPU-abc");
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("123456789 bytes"), HasSubstr("1000 bytes free"),
                    HasSubstr("GPU-abc"), HasSubstr("\"g\"")));
}

TEST(CheckSameSpecTest, EqualSpecsPass) {
  EXPECT_TRUE(CheckSameSpec(testing::SmallSpec(), testing::SmallSpec()).ok());
  EXPECT_THAT(DiffGroupSpecs(testing::SmallSpec(), testing::SmallSpec()), SizeIs(0));
}

TEST(CheckSameSpecTest, ListsEveryDifferingField) {
  v1::GroupSpec live = testing::SmallSpec();
  v1::GroupSpec requested = live;
  requested.set_hidden(512);
  requested.set_num_topk(4);
  requested.set_use_fp8(true);
  std::vector<std::string> diffs = DiffGroupSpecs(live, requested);
  EXPECT_THAT(diffs, SizeIs(3));
  absl::Status status = CheckSameSpec(live, requested);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("3 field(s)"), HasSubstr("hidden: live=256 requested=512"),
                    HasSubstr("num_topk: live=2 requested=4"),
                    HasSubstr("use_fp8: live=false requested=true")));
  EXPECT_THAT(std::string(status.message()), ::testing::Not(HasSubstr("num_experts")));
}

}  // namespace
}  // namespace epd

namespace epd {
namespace {

TEST(CheckSameSpecTest, ComparesTheNodeListsEntryByEntry) {
  v1::GroupSpec live = testing::MakeSpec("g", {.num_ranks = 4});
  for (const char* address : {"a:1", "b:2"}) {
    v1::NodeSpec* node = live.add_nodes();
    node->set_peer_address(address);
    node->set_num_ranks(2);
  }
  v1::GroupSpec requested = live;
  EXPECT_TRUE(CheckSameSpec(live, requested).ok());
  requested.mutable_nodes(1)->set_peer_address("c:3");
  absl::Status status = CheckSameSpec(live, requested);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()), HasSubstr("nodes: live=["));
  EXPECT_THAT(std::string(status.message()), HasSubstr("c:3"));
  requested.clear_nodes();
  EXPECT_EQ(CheckSameSpec(live, requested).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace epd
