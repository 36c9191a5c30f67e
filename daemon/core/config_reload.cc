#include "daemon/core/config_reload.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/message_differencer.h"

namespace epd {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr const char* kLiveFields[] = {
    "log_level",
    "max_groups",
    "max_groups_per_uid",
    "max_endpoints_per_uid",
    "max_endpoint_bytes_per_uid",
    "max_sessions_per_uid",
    "max_connections_per_uid",
    "metrics_listen",
};

/// `message` with every field but `keep` cleared.
std::unique_ptr<Message> OnlyField(const Message& message, const FieldDescriptor* keep) {
  std::unique_ptr<Message> copy(message.New());
  copy->CopyFrom(message);
  const Descriptor* descriptor = copy->GetDescriptor();
  const Reflection* reflection = copy->GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    if (field != keep) reflection->ClearField(copy.get(), field);
  }
  reflection->MutableUnknownFields(copy.get())->Clear();
  return copy;
}

/// Appends the names (prefixed) of the fields of `a` and `b` that differ; a singular message
/// field is compared field by field.
void DiffFields(const Message& a, const Message& b, const std::string& prefix,
                std::vector<std::string>* out) {
  const Descriptor* descriptor = a.GetDescriptor();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    const std::string name = absl::StrCat(prefix, field->name());
    if (field->type() == FieldDescriptor::TYPE_MESSAGE && !field->is_repeated()) {
      const Reflection* ra = a.GetReflection();
      const Reflection* rb = b.GetReflection();
      DiffFields(ra->GetMessage(a, field), rb->GetMessage(b, field), name + ".", out);
      continue;
    }
    // Presence counts: an `optional` field set to its default differs from an absent one.
    if (!google::protobuf::util::MessageDifferencer::Equals(*OnlyField(a, field),
                                                            *OnlyField(b, field))) {
      out->push_back(name);
    }
  }
}

}  // namespace

absl::Span<const char* const> LiveConfigFields() { return kLiveFields; }

bool IsLiveConfigField(absl::string_view field) {
  return std::any_of(std::begin(kLiveFields), std::end(kLiveFields),
                     [field](const char* live) { return field == live; });
}

std::vector<std::string> DifferingConfigFields(const v1::DaemonConfig& a,
                                               const v1::DaemonConfig& b) {
  std::vector<std::string> changed;
  DiffFields(a, b, "", &changed);
  return changed;
}

ConfigDiff DiffDaemonConfig(const v1::DaemonConfig& running, const v1::DaemonConfig& next) {
  ConfigDiff diff;
  for (std::string& name : DifferingConfigFields(running, next)) {
    (IsLiveConfigField(name) ? diff.live : diff.refused).push_back(std::move(name));
  }
  return diff;
}

std::string ConfigFieldText(const v1::DaemonConfig& config, absl::string_view field) {
  const Message* message = &config;
  const std::vector<std::string> parts = absl::StrSplit(field, '.');
  const FieldDescriptor* leaf = nullptr;
  for (size_t i = 0; i < parts.size(); ++i) {
    leaf = message->GetDescriptor()->FindFieldByName(parts[i]);
    if (leaf == nullptr) return absl::StrCat(field, " (no such field)");
    if (i + 1 == parts.size()) break;
    if (leaf->type() != FieldDescriptor::TYPE_MESSAGE || leaf->is_repeated()) {
      return absl::StrCat(field, " (no such field)");
    }
    message = &message->GetReflection()->GetMessage(*message, leaf);
  }
  const Reflection* reflection = message->GetReflection();
  std::string value;
  if (leaf->is_repeated()) {
    std::vector<std::string> items;
    for (int i = 0; i < reflection->FieldSize(*message, leaf); ++i) {
      google::protobuf::TextFormat::PrintFieldValueToString(*message, leaf, i, &value);
      items.push_back(value);
    }
    return absl::StrCat(field, ": [", absl::StrJoin(items, ", "), "]");
  }
  if (leaf->has_presence() && !reflection->HasField(*message, leaf)) {
    return absl::StrCat(field, " unset");
  }
  google::protobuf::TextFormat::PrintFieldValueToString(*message, leaf, -1, &value);
  return absl::StrCat(field, ": ", value);
}

v1::DaemonConfig WithLiveFields(const v1::DaemonConfig& running, const v1::DaemonConfig& next) {
  v1::DaemonConfig out = running;
  const Descriptor* descriptor = out.GetDescriptor();
  const Reflection* reflection = out.GetReflection();
  for (const char* name : kLiveFields) {
    const FieldDescriptor* field = descriptor->FindFieldByName(name);
    if (field == nullptr) continue;
    reflection->ClearField(&out, field);
    // Copies the one field, with its presence.
    std::unique_ptr<Message> only = OnlyField(next, field);
    static_cast<Message&>(out).MergeFrom(*only);
  }
  return out;
}

}  // namespace epd
