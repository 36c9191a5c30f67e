// What the multinode data-path tests (data_*_test.cc) and their client program
// (clients/mn_client.cc) share: the group shape and how a node list travels on the command
// line ("ADDRESS=RANKS,ADDRESS=RANKS": node i hosts the RANKS ranks after nodes 0..i-1's).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "epd/client.h"
#include "tests/common/specs.h"

namespace epd::multinode {

/// Tiny, but every op and option fits: hidden 512 (UE8M0 scales need H % 512 == 0), two
/// experts per rank, top-3, 8 tokens per rank in both modes, FP8 allowed.
inline constexpr int kExpertsPerRank = 2;
inline constexpr int kHidden = 512;
inline constexpr int kNumTopk = 3;
inline constexpr int kMaxTokens = 8;
inline constexpr int kLlMaxTokens = 8;

/// The spec of group `name` across `nodes` (num_ranks = their sum); a single node gives a
/// one-node group (no node list), which any daemon serves.
inline v1::GroupSpec DataSpec(const std::string& name, const std::vector<GroupNode>& nodes) {
  int num_ranks = 0;
  for (const GroupNode& n : nodes) num_ranks += n.num_ranks;
  v1::GroupSpec spec = testing::MakeSpec(name, {.num_ranks = num_ranks,
                                                .num_experts = kExpertsPerRank * num_ranks,
                                                .hidden = kHidden,
                                                .num_topk = kNumTopk,
                                                .max_tokens_per_rank = kMaxTokens,
                                                .ll_max_tokens_per_rank = kLlMaxTokens,
                                                .use_fp8 = true});
  if (nodes.size() > 1) SetNodes(&spec, nodes);
  return spec;
}

/// "ADDRESS=RANKS,..." of `nodes`.
inline std::string NodesFlag(const std::vector<GroupNode>& nodes) {
  std::string out;
  for (const GroupNode& n : nodes) {
    absl::StrAppend(&out, out.empty() ? "" : ",", n.peer_address, "=", n.num_ranks);
  }
  return out;
}

/// The nodes of a NodesFlag text; INVALID_ARGUMENT naming the flag and what it got for an
/// empty list, or naming the entry for a malformed one (not ADDRESS=RANKS, RANKS < 1).
inline absl::StatusOr<std::vector<GroupNode>> ParseNodesFlag(const std::string& text) {
  std::vector<GroupNode> nodes;
  for (absl::string_view entry : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const size_t eq = entry.rfind('=');
    GroupNode node;
    if (eq == absl::string_view::npos || !absl::SimpleAtoi(entry.substr(eq + 1), &node.num_ranks)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--nodes entry '", entry, "' is not ADDRESS=RANKS (a host:port, '=', a rank count)"));
    }
    if (node.num_ranks < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--nodes entry '", entry, "' gives ",
                                                     node.num_ranks, " ranks; it needs >= 1"));
    }
    node.peer_address = std::string(entry.substr(0, eq));
    nodes.push_back(std::move(node));
  }
  if (nodes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nodes must list at least one node as host:port=RANKS (comma-separated), got '", text,
        "'"));
  }
  return nodes;
}

}  // namespace epd::multinode
