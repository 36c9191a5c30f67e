// What the security suite's programs share (tests/security/: epd_victim.cc,
// epd_attacker.cc and the gtest files): the group shape every victim and attacker group
// uses, and how a join secret is passed to epd (JoinOptions::join_secret,
// JoinGroupRequest.join_secret), set where this build has them (compile time and proto
// reflection) so the suite compiles with and without that API; docs/SECURITY.md "The
// suite's programs".
#pragma once

#include <cstdint>
#include <string>

#include "epd/v1/control.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "tests/common/specs.h"

namespace epd::security {

/// The shape of every group of the suite: small enough that a victim can recompute every
/// rank's results with kernels/host on each round, large enough for every op kind (FP8
/// needs hidden % 128 == 0; low-latency ops need ll_max_tokens_per_rank > 0).
inline constexpr int kNumRanks = 2;
inline constexpr int kNumExperts = 4;
inline constexpr int kHidden = 128;
inline constexpr int kNumTopk = 2;
inline constexpr int kMaxTokens = 8;
inline constexpr int kLlMaxTokens = 8;

/// GroupSpec `name` of that shape with `num_ranks` ranks (num_experts = 2 per rank).
inline v1::GroupSpec SecuritySpec(const std::string& name, int num_ranks = kNumRanks) {
  return testing::MakeSpec(name,
                           {.num_ranks = num_ranks,
                            .num_experts = num_ranks == kNumRanks ? kNumExperts : 2 * num_ranks,
                            .hidden = kHidden,
                            .num_topk = kNumTopk,
                            .max_tokens_per_rank = kMaxTokens,
                            .ll_max_tokens_per_rank = kLlMaxTokens,
                            .use_fp8 = true});
}

/// Sets options.join_secret = secret when the client library's JoinOptions has that member.
/// Returns false when it has none and `secret` is not empty (the join then goes without).
template <typename JoinOptionsT>
bool SetJoinSecret(JoinOptionsT& options, const std::string& secret) {
  if constexpr (requires { options.join_secret = secret; }) {
    options.join_secret = secret;
    return true;
  } else {
    return secret.empty();
  }
}

/// Sets the string (or bytes) field `join_secret` of a JoinGroupRequest (by reflection). Returns
/// false when the proto has no such field and `secret` is not empty.
inline bool SetRequestJoinSecret(google::protobuf::Message& request, const std::string& secret) {
  const google::protobuf::FieldDescriptor* field =
      request.GetDescriptor()->FindFieldByName("join_secret");
  if (field == nullptr || field->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_STRING ||
      field->is_repeated()) {
    return secret.empty();
  }
  request.GetReflection()->SetString(&request, field, secret);
  return true;
}

}  // namespace epd::security
