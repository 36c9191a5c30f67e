// GroupSpecs for tests: one builder (MakeSpec) over a SpecShape with designated fields, so a
// test states only the numbers it cares about.
#pragma once

#include <string>

#include "epd/v1/control.pb.h"

namespace epd::testing {

/// The numbers of a GroupSpec (epd.v1.GroupSpec, control.proto). The defaults are a small
/// valid group: 2 ranks, 8 experts, hidden 256, top-2, 16 tokens per rank, no low-latency
/// ops, BF16 only. Validity is the daemon's to judge: tests build invalid shapes on purpose.
struct SpecShape {
  int num_ranks = 2;
  int num_experts = 8;
  int hidden = 256;
  int num_topk = 2;
  int max_tokens_per_rank = 16;
  int ll_max_tokens_per_rank = 0;  // 0: low-latency ops disabled.
  bool use_fp8 = false;
};

/// The GroupSpec named `name` with every field of `shape`.
///   MakeSpec("g", {.num_ranks = 4, .num_experts = 16, .use_fp8 = true})
v1::GroupSpec MakeSpec(const std::string& name, const SpecShape& shape = {});

/// MakeSpec(name) with the default SpecShape: the small valid group of the unit tests.
inline v1::GroupSpec SmallSpec(const std::string& name = "g") { return MakeSpec(name); }

}  // namespace epd::testing
