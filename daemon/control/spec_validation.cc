#include "daemon/control/spec_validation.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/errors/reason.h"
#include "daemon/dataplane/lockstep_group.h"
#include "epd/kernels/cuda_limits.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/text_format.h"

namespace epd {
namespace {

/// Elements of a repeated field DiffGroupSpecs names one by one before it summarises.
constexpr int kMaxReportedElementDiffs = 8;

absl::Status Invalid(absl::string_view field, int64_t value, absl::string_view rule) {
  return errors::WithReason(
      absl::InvalidArgumentError(absl::StrCat("spec.", field, ": ", value, " ", rule)),
      errors::Reason::kSpecInvalid);
}

bool IsNameChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == '-';
}

/// The value of `field` as text; a repeated field as "[item, item]" (each a message in
/// braces).
std::string FieldValueText(const google::protobuf::Message& message,
                           const google::protobuf::FieldDescriptor* field) {
  std::string text;
  if (!field->is_repeated()) {
    google::protobuf::TextFormat::PrintFieldValueToString(message, field, -1, &text);
    return text;
  }
  const bool braces = field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE;
  const int size = message.GetReflection()->FieldSize(message, field);
  text = "[";
  for (int i = 0; i < size; ++i) {
    std::string item;
    google::protobuf::TextFormat::PrintFieldValueToString(message, field, i, &item);
    absl::StrAppend(&text, i == 0 ? "" : ", ", braces ? "{" : "", item, braces ? "}" : "");
  }
  return text + "]";
}

absl::Status ValidateNodes(const v1::GroupSpec& spec) {
  if (!spec.transport().empty() && spec.transport() != "tcp" && spec.transport() != "rdma") {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.transport: \"", EscapeClientText(spec.transport()),
                     "\" is not a transport (\"\" = the daemons' default, \"tcp\" or \"rdma\")"));
  }
  if (!spec.transport().empty() && spec.nodes_size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.transport: \"", spec.transport(),
                     "\" is set for a group without nodes (a one-node group uses no transport)"));
  }
  if (spec.nodes_size() == 0) return absl::OkStatus();
  if (spec.nodes_size() > kMaxNodes) {
    return Invalid("nodes", spec.nodes_size(),
                   absl::StrCat("entries: more than the ", kMaxNodes, " nodes a group may span"));
  }
  int64_t total = 0;
  absl::flat_hash_set<absl::string_view> seen;
  for (int32_t i = 0; i < spec.nodes_size(); ++i) {
    const v1::NodeSpec& node = spec.nodes(i);
    if (!PeerAddressIsWellFormed(node.peer_address())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.nodes[", i, "].peer_address: \"", EscapeClientText(node.peer_address()),
          "\" is not host:port (a DNS name, IPv4 address or [IPv6] address, and a port "
          "1-65535, at most ",
          kMaxPeerAddressBytes, " bytes; e.g. \"10.0.0.2:7100\")"));
    }
    if (!seen.insert(node.peer_address()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.nodes[", i, "].peer_address: \"", node.peer_address(),
                       "\" is listed twice (each node's daemon once)"));
    }
    if (node.num_ranks() < 1) {
      return Invalid(absl::StrCat("nodes[", i, "].num_ranks"), node.num_ranks(),
                     "is below 1 (every listed node hosts at least one rank)");
    }
    total += node.num_ranks();
  }
  if (total != spec.num_ranks()) {
    return Invalid("nodes", total,
                   absl::StrCat("ranks in all (the sum of nodes[].num_ranks) differ from "
                                "num_ranks ",
                                spec.num_ranks()));
  }
  return absl::OkStatus();
}

/// One diff of a repeated field, "nodes: live=[...] requested=[...]": the entry counts when
/// they differ, else the differing entries ("#1 {...}"), at most kMaxReportedElementDiffs.
void AppendRepeatedDiff(const google::protobuf::Message& live,
                        const google::protobuf::Message& requested,
                        const google::protobuf::FieldDescriptor* field,
                        std::vector<std::string>* diffs) {
  const google::protobuf::Reflection* reflection = live.GetReflection();
  const int a = reflection->FieldSize(live, field);
  const int b = reflection->FieldSize(requested, field);
  if (a != b) {
    diffs->push_back(
        absl::StrCat(field->name(), ": live=[", a, " entries] requested=[", b, " entries]"));
    return;
  }
  std::vector<std::string> x;
  std::vector<std::string> y;
  int differing = 0;
  for (int i = 0; i < a; ++i) {
    std::string u;
    std::string v;
    google::protobuf::TextFormat::PrintFieldValueToString(live, field, i, &u);
    google::protobuf::TextFormat::PrintFieldValueToString(requested, field, i, &v);
    if (u == v) continue;
    if (++differing > kMaxReportedElementDiffs) continue;
    x.push_back(absl::StrCat("#", i, " {", absl::StripAsciiWhitespace(u), "}"));
    y.push_back(absl::StrCat("#", i, " {", absl::StripAsciiWhitespace(v), "}"));
  }
  if (differing == 0) return;
  const std::string more = differing > kMaxReportedElementDiffs
                               ? absl::StrCat(", ... (", differing, " entries differ)")
                               : "";
  diffs->push_back(absl::StrCat(field->name(), ": live=[", absl::StrJoin(x, ", "), more,
                                "] requested=[", absl::StrJoin(y, ", "), more, "]"));
}

}  // namespace

namespace {

absl::Status ValidateSpecFields(const v1::GroupSpec& spec) {
  const std::string& name = spec.name();
  if (name.empty() || name.size() > kMaxGroupNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("spec.name: \"", EscapeClientText(name),
                                                   "\" must be 1 to ", kMaxGroupNameBytes,
                                                   " characters [A-Za-z0-9_.-]"));
  }
  for (char c : name) {
    if (!IsNameChar(c)) {
      return absl::InvalidArgumentError(
          absl::StrCat("spec.name: \"", EscapeClientText(name), "\" has character '",
                       absl::CHexEscape(std::string(1, c)), "' outside [A-Za-z0-9_.-]"));
    }
  }
  if (spec.num_ranks() < 1 || spec.num_ranks() > kMaxRanks) {
    return Invalid("num_ranks", spec.num_ranks(), absl::StrCat("is outside [1, ", kMaxRanks, "]"));
  }
  if (spec.num_experts() < 1 || spec.num_experts() > kMaxExperts) {
    return Invalid("num_experts", spec.num_experts(),
                   absl::StrCat("is outside [1, ", kMaxExperts, "]"));
  }
  if (spec.num_experts() % spec.num_ranks() != 0) {
    return Invalid("num_experts", spec.num_experts(),
                   absl::StrCat("is not a multiple of num_ranks ", spec.num_ranks(),
                                " (num_experts % num_ranks must be 0)"));
  }
  if (spec.hidden() < 1 || spec.hidden() > kMaxHidden) {
    return Invalid("hidden", spec.hidden(), absl::StrCat("is outside [1, ", kMaxHidden, "]"));
  }
  if (spec.use_fp8() && spec.hidden() % kFp8HiddenMultiple != 0) {
    return Invalid("hidden", spec.hidden(),
                   absl::StrCat("is not a multiple of ", kFp8HiddenMultiple,
                                ", required with use_fp8 (one scale per 128 channels)"));
  }
  if (spec.num_topk() < 1 || spec.num_topk() > spec.num_experts()) {
    return Invalid("num_topk", spec.num_topk(),
                   absl::StrCat("is outside [1, num_experts = ", spec.num_experts(), "]"));
  }
  if (spec.max_tokens_per_rank() < 1 || spec.max_tokens_per_rank() > kMaxTokensPerRank) {
    return Invalid("max_tokens_per_rank", spec.max_tokens_per_rank(),
                   absl::StrCat("is outside [1, ", kMaxTokensPerRank, "]"));
  }
  if (spec.ll_max_tokens_per_rank() < 0 || spec.ll_max_tokens_per_rank() > kMaxTokensPerRank) {
    return Invalid("ll_max_tokens_per_rank", spec.ll_max_tokens_per_rank(),
                   absl::StrCat("is outside [0, ", kMaxTokensPerRank, "] (0 = low-latency off)"));
  }
  if (!v1::RankFailurePolicy_IsValid(spec.on_rank_failure())) {
    return Invalid("on_rank_failure", spec.on_rank_failure(),
                   "is not a RankFailurePolicy (0 = unspecified, as FAIL; 1 = FAIL; 2 = MASK)");
  }
  return errors::WithDefaultReason(ValidateNodes(spec), errors::Reason::kNodesInvalid);
}

}  // namespace

absl::Status ValidateGroupSpec(const v1::GroupSpec& spec) {
  return errors::WithDefaultReason(ValidateSpecFields(spec), errors::Reason::kSpecInvalid);
}

bool PeerAddressIsWellFormed(absl::string_view address) {
  if (address.empty() || address.size() > kMaxPeerAddressBytes) return false;
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return false;
  absl::string_view port_text = address.substr(colon + 1);
  uint32_t port = 0;
  if (port_text.empty() || port_text.size() > 5 ||
      !std::all_of(port_text.begin(), port_text.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port_text, &port) || port < 1 || port > 65535) {
    return false;
  }
  absl::string_view host = address.substr(0, colon);
  if (host.front() == '[') {
    if (host.size() < 4 || host.back() != ']') return false;
    absl::string_view v6 = host.substr(1, host.size() - 2);
    return std::all_of(v6.begin(), v6.end(),
                       [](char c) { return absl::ascii_isxdigit(c) || c == ':' || c == '.'; });
  }
  if (host.front() == '-' || host.front() == '.') return false;
  return std::all_of(host.begin(), host.end(),
                     [](char c) { return absl::ascii_isalnum(c) || c == '-' || c == '.'; });
}

int32_t NodeOfRank(const v1::GroupSpec& spec, int32_t rank, int32_t* first_rank) {
  int32_t first = 0;
  for (int32_t i = 0; i < spec.nodes_size(); ++i) {
    const int32_t n = spec.nodes(i).num_ranks();
    if (rank >= first && rank - first < n) {
      if (first_rank != nullptr) *first_rank = first;
      return i;
    }
    first += n;
  }
  return -1;
}

absl::Status CheckRankFailurePolicy(const v1::GroupSpec& spec, absl::string_view backend,
                                    v1::LaunchMode launch_mode) {
  if (spec.on_rank_failure() != v1::RANK_FAILURE_POLICY_MASK) return absl::OkStatus();
  if (SpansNodes(spec) && backend != "host") {
    return absl::FailedPreconditionError(
        absl::StrCat("spec.on_rank_failure: RANK_FAILURE_POLICY_MASK across nodes (",
                     spec.nodes_size(), " nodes) runs on the host backend only; the ", backend,
                     " backend's exchange gives a masked rank no stand-in mirror yet; use "
                     "RANK_FAILURE_POLICY_FAIL, or daemons with --backend=host"));
  }
  if (backend == "cuda" && launch_mode == v1::LAUNCH_MODE_CLIENT) {
    return absl::FailedPreconditionError(
        "spec.on_rank_failure: RANK_FAILURE_POLICY_MASK is not supported with launch_mode "
        "LAUNCH_MODE_CLIENT: a masked rank's kernels must still run for the others' to "
        "complete, and no one launches a dead client's; use LAUNCH_MODE_DAEMON (or leave "
        "launch_mode unspecified), or RANK_FAILURE_POLICY_FAIL");
  }
  if (backend != "host" && backend != "cuda") {
    return absl::FailedPreconditionError(absl::StrCat(
        "spec.on_rank_failure: RANK_FAILURE_POLICY_MASK is not supported on the ", backend,
        " backend; use RANK_FAILURE_POLICY_FAIL, or a daemon with --backend=host or cuda"));
  }
  return absl::OkStatus();
}

absl::Status ValidateGroupSpecForBackend(const v1::GroupSpec& spec, absl::string_view backend) {
  if (backend != "cuda") return absl::OkStatus();
  // A group across nodes runs on the CUDA backend too (DESIGN.md §5.5), within the same
  // kernel limits (its ranks' areas are the same).
  return errors::WithDefaultReason(kernels::cuda::CheckCudaShape(ShapeOf(spec)),
                                   errors::Reason::kSpecInvalid);
}

absl::Status ValidateRank(const v1::GroupSpec& spec, int32_t rank) {
  if (rank < 0 || rank >= spec.num_ranks()) {
    return errors::WithReason(absl::InvalidArgumentError(
                                  absl::StrCat("rank: ", rank, " is outside [0, ", spec.num_ranks(),
                                               ") of group \"", spec.name(), "\"")),
                              errors::Reason::kRankInvalid);
  }
  return absl::OkStatus();
}

absl::Status CheckBuffersFit(const v1::GroupSpec& spec, uint64_t bytes_needed, uint64_t bytes_free,
                             const std::string& where) {
  if (bytes_needed <= bytes_free) return absl::OkStatus();
  return errors::WithReason(
      absl::ResourceExhaustedError(absl::StrFormat(
          "group \"%s\" needs %d bytes per rank (%.2f GiB) but %s has %d bytes free (%.2f GiB); "
          "lower max_tokens_per_rank, ll_max_tokens_per_rank or hidden, or free memory",
          spec.name(), bytes_needed, bytes_needed / double(1ull << 30), where, bytes_free,
          bytes_free / double(1ull << 30))),
      errors::Reason::kGpuOutOfMemory);
}

std::vector<std::string> DiffGroupSpecs(const v1::GroupSpec& live_spec,
                                        const v1::GroupSpec& requested_spec) {
  // on_rank_failure: unspecified reads as FAIL.
  auto normalized = [](const v1::GroupSpec& spec) {
    v1::GroupSpec n = spec;
    if (n.on_rank_failure() == v1::RANK_FAILURE_POLICY_UNSPECIFIED) {
      n.set_on_rank_failure(v1::RANK_FAILURE_POLICY_FAIL);
    }
    return n;
  };
  const v1::GroupSpec live = normalized(live_spec);
  const v1::GroupSpec requested = normalized(requested_spec);
  std::vector<std::string> diffs;
  const google::protobuf::Descriptor* descriptor = v1::GroupSpec::descriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    if (field->is_repeated()) {
      AppendRepeatedDiff(live, requested, field, &diffs);
      continue;
    }
    std::string a = FieldValueText(live, field);
    std::string b = FieldValueText(requested, field);
    if (a != b) diffs.push_back(absl::StrCat(field->name(), ": live=", a, " requested=", b));
  }
  return diffs;
}

absl::Status CheckSameSpec(const v1::GroupSpec& live, const v1::GroupSpec& requested) {
  std::vector<std::string> diffs = DiffGroupSpecs(live, requested);
  if (diffs.empty()) return absl::OkStatus();
  return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                "spec differs from live group \"", live.name(), "\" in ",
                                diffs.size(), " field(s): ", absl::StrJoin(diffs, "; "))),
                            errors::Reason::kSpecMismatch);
}

std::string SpecSummary(const v1::GroupSpec& spec) {
  std::string summary = absl::StrFormat("\"%s\" R=%d E=%d H=%d K=%d M=%d fp8=%d Mll=%d",
                                        spec.name(), spec.num_ranks(), spec.num_experts(),
                                        spec.hidden(), spec.num_topk(), spec.max_tokens_per_rank(),
                                        spec.use_fp8() ? 1 : 0, spec.ll_max_tokens_per_rank());
  if (spec.nodes_size() > 0) absl::StrAppend(&summary, " nodes=", spec.nodes_size());
  return summary;
}

}  // namespace epd
