#include "tests/common/specs.h"

namespace epd::testing {

v1::GroupSpec MakeSpec(const std::string& name, const SpecShape& shape) {
  v1::GroupSpec spec;
  spec.set_name(name);
  spec.set_num_ranks(shape.num_ranks);
  spec.set_num_experts(shape.num_experts);
  spec.set_hidden(shape.hidden);
  spec.set_num_topk(shape.num_topk);
  spec.set_max_tokens_per_rank(shape.max_tokens_per_rank);
  spec.set_ll_max_tokens_per_rank(shape.ll_max_tokens_per_rank);
  spec.set_use_fp8(shape.use_fp8);
  return spec;
}

}  // namespace epd::testing
