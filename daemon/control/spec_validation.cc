#include "daemon/control/spec_validation.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "daemon/dataplane/lockstep_group.h"
#include "epd/kernels/cuda_limits.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/text_format.h"

namespace epd {
namespace {

absl::Status Invalid(absl::string_view field, int64_t value, absl::string_view rule) {
  return absl::InvalidArgumentError(absl::StrCat("spec.", field, ": ", value, " ", rule));
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

}  // namespace

std::string EscapeClientText(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return absl::CHexEscape(text);
  return absl::StrCat(absl::CHexEscape(text.substr(0, max_bytes)), "...(", text.size(), " bytes)");
}

absl::Status ValidateGroupSpec(const v1::GroupSpec& spec) {
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
  return absl::OkStatus();
}

absl::Status ValidateGroupSpecForBackend(const v1::GroupSpec& spec, absl::string_view backend) {
  if (backend != "cuda") return absl::OkStatus();
  return kernels::cuda::CheckCudaShape(ShapeOf(spec));
}

absl::Status ValidateRank(const v1::GroupSpec& spec, int32_t rank) {
  if (rank < 0 || rank >= spec.num_ranks()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank: ", rank, " is outside [0, ", spec.num_ranks(), ") of group \"", spec.name(), "\""));
  }
  return absl::OkStatus();
}

absl::Status CheckBuffersFit(const v1::GroupSpec& spec, uint64_t bytes_needed, uint64_t bytes_free,
                             const std::string& where) {
  if (bytes_needed <= bytes_free) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "group \"%s\" needs %d bytes per rank (%.2f GiB) but %s has %d bytes free (%.2f GiB); "
      "lower max_tokens_per_rank, ll_max_tokens_per_rank or hidden, or free memory",
      spec.name(), bytes_needed, bytes_needed / double(1ull << 30), where, bytes_free,
      bytes_free / double(1ull << 30)));
}

std::vector<std::string> DiffGroupSpecs(const v1::GroupSpec& live, const v1::GroupSpec& requested) {
  std::vector<std::string> diffs;
  const google::protobuf::Descriptor* descriptor = v1::GroupSpec::descriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    std::string a = FieldValueText(live, field);
    std::string b = FieldValueText(requested, field);
    if (a != b) diffs.push_back(absl::StrCat(field->name(), ": live=", a, " requested=", b));
  }
  return diffs;
}

absl::Status CheckSameSpec(const v1::GroupSpec& live, const v1::GroupSpec& requested) {
  std::vector<std::string> diffs = DiffGroupSpecs(live, requested);
  if (diffs.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("spec differs from live group \"", live.name(),
                                                    "\" in ", diffs.size(),
                                                    " field(s): ", absl::StrJoin(diffs, "; ")));
}

std::string SpecSummary(const v1::GroupSpec& spec) {
  return absl::StrFormat("\"%s\" R=%d E=%d H=%d K=%d M=%d fp8=%d Mll=%d", spec.name(),
                         spec.num_ranks(), spec.num_experts(), spec.hidden(), spec.num_topk(),
                         spec.max_tokens_per_rank(), spec.use_fp8() ? 1 : 0,
                         spec.ll_max_tokens_per_rank());
}

}  // namespace epd
