#include "client/epctl/format.h"

#include <pwd.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"

namespace epd::epctl {

std::string Table::Render(const std::string& indent) const {
  std::vector<size_t> widths;
  for (const auto& row : rows_) {
    if (widths.size() < row.size()) widths.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  std::string out;
  for (const auto& row : rows_) {
    std::string line = indent;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line.append(widths[i] - row[i].size() + 2, ' ');
    }
    out += line + "\n";
  }
  return out;
}

std::string JsonOutput(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) return absl::StrCat("{\"error\": \"", status.ToString(), "\"}\n");
  if (json.empty() || json.back() != '\n') json += "\n";
  return json;
}

std::string HumanBytes(uint64_t bytes) {
  if (bytes >= (1ull << 30)) return absl::StrFormat("%.1f GiB", bytes / double(1ull << 30));
  if (bytes >= (1ull << 20)) return absl::StrFormat("%.1f MiB", bytes / double(1ull << 20));
  if (bytes >= (1ull << 10)) return absl::StrFormat("%.1f KiB", bytes / double(1ull << 10));
  return absl::StrCat(bytes, " B");
}

std::string UidAndName(uint32_t uid) {
  struct passwd entry {};
  struct passwd* found = nullptr;
  std::vector<char> buffer(4096);
  if (::getpwuid_r(uid, &entry, buffer.data(), buffer.size(), &found) == 0 && found != nullptr) {
    return absl::StrCat(uid, " (", found->pw_name, ")");
  }
  return absl::StrCat(uid);
}

std::string HumanDurationMs(uint64_t ms) {
  // absl formats a zero duration as "0": say "0s" like every other value.
  if (ms < 1000) return "0s";
  return absl::FormatDuration(absl::Trunc(absl::Milliseconds(ms), absl::Seconds(1)));
}

namespace {

/// A GPU the daemon marked unsupported (a daemon that predates the mark sets neither field).
bool Unsupported(const v1::GpuInfo& g) { return !g.supported() && !g.unsupported_reason().empty(); }

}  // namespace

std::string FormatStatus(const v1::GetStatsResponse& s, const std::string& target) {
  std::string out = absl::StrFormat("epd %s  pid %d  %s  %s  up %s\n", s.version(), s.pid(), target,
                                    s.serving_status(), HumanDurationMs(s.uptime_ms()));
  if (s.draining()) {
    absl::StrAppend(&out,
                    "drained: yes (`epctl drain`): live groups are served, new groups are "
                    "refused; `epctl undrain` serves new groups again\n");
  }
  absl::StrAppend(&out, "backend: ", s.backend(), " (", s.backend_reason(), ")\n");
  absl::StrAppend(&out, "MPS: ", s.mps_active() ? "active" : "not active", "\n");
  absl::StrAppend(&out, "peer: ", s.peer_address().empty() ? "off" : s.peer_address(), "\n");
  absl::StrAppendFormat(&out, "groups: %d  sessions: %d  ops: %d completed, %d failed\n",
                        s.num_groups(), s.num_sessions(), s.ops_completed(), s.ops_failed());
  if (s.gpus().empty()) {
    absl::StrAppend(&out, "GPUs: none\n");
  } else {
    absl::StrAppend(&out, "GPUs: ", s.gpus_size(), "\n");
    Table table(
        {"ORD", "UUID", "PCI BUS ID", "NAME", "SMS", "MEM FREE/TOTAL", "CC", "PEER ACCESS"});
    for (const v1::GpuInfo& g : s.gpus()) {
      std::string peers;
      for (int j = 0; j < g.peer_access_size(); ++j) {
        peers += j == g.ordinal() ? '-' : (g.peer_access(j) ? 'Y' : 'n');
      }
      table.AddRow({absl::StrCat(g.ordinal()), g.uuid(), g.pci_bus_id(), g.name(),
                    absl::StrCat(g.sm_count()),
                    absl::StrCat(HumanBytes(g.free_memory_bytes()), " / ",
                                 HumanBytes(g.total_memory_bytes())),
                    absl::StrCat(g.compute_capability_major(), ".", g.compute_capability_minor(),
                                 Unsupported(g) ? " (unsupported)" : ""),
                    peers.empty() ? "-" : peers});
    }
    absl::StrAppend(&out, table.Render("  "));
    for (const v1::GpuInfo& g : s.gpus()) {
      if (Unsupported(g)) absl::StrAppend(&out, "  ", g.unsupported_reason(), "\n");
    }
  }
  absl::StrAppend(&out, FormatTransports(s));
  return out;
}

std::string FormatTransports(const v1::GetStatsResponse& s) {
  std::string out = absl::StrCat(
      "transports: ",
      s.transports().empty() ? (s.peer_address().empty() ? "none (peer listener off)" : "none")
                             : absl::StrJoin(s.transports(), ", "),
      // The one a group whose spec names none uses.
      s.effective_config().transport().empty()
          ? ""
          : absl::StrCat(" (default: ", s.effective_config().transport(), ")"),
      "\n");
  if (s.nics().empty()) {
    absl::StrAppend(&out, "NICs: none\n");
  } else {
    absl::StrAppend(&out, "NICs: ", s.nics_size(), "\n");
    Table table({"PORT", "STATE", "LINK", "RATE", "GID INDEX", "GID", "NUMA", "PCI BUS ID", "GPUS",
                 "GPUDIRECT", "USED"});
    for (const v1::NicInfo& n : s.nics()) {
      // GPUs by ordinal where GetStats lists them, else by UUID.
      std::vector<std::string> gpus;
      for (const std::string& uuid : n.gpu_uuids()) {
        std::string name = uuid;
        for (const v1::GpuInfo& g : s.gpus()) {
          if (g.uuid() == uuid) name = absl::StrCat(g.ordinal());
        }
        gpus.push_back(std::move(name));
      }
      table.AddRow({absl::StrCat(n.device(), ":", n.port()), n.state(),
                    n.link_layer().empty() ? "-" : n.link_layer(),
                    n.rate_gbps() == 0 ? "-" : absl::StrCat(n.rate_gbps(), " Gb/s"),
                    n.gid_index() < 0 ? "none" : absl::StrCat(n.gid_index()),
                    n.gid().empty() ? "-" : n.gid(),
                    n.numa_node() < 0 ? "-" : absl::StrCat(n.numa_node()),
                    n.pci_bus_id().empty() ? "-" : n.pci_bus_id(),
                    gpus.empty() ? "-" : absl::StrJoin(gpus, ","), n.gpudirect() ? "yes" : "no",
                    n.selected() ? "yes" : "no"});
    }
    absl::StrAppend(&out, table.Render("  "));
  }
  if (s.preflight().empty()) {
    absl::StrAppend(&out, "preflight: ok\n");
  } else {
    // Each line starts with its severity: "refuse:" (RDMA cannot run until it is fixed)
    // or "warn:" (RDMA runs with it).
    const auto count = [&s](absl::string_view prefix) {
      return std::count_if(s.preflight().begin(), s.preflight().end(),
                           [prefix](const std::string& l) { return absl::StartsWith(l, prefix); });
    };
    absl::StrAppend(&out, "preflight: ", s.preflight_size(), " problem(s) (", count("refuse: "),
                    " refusing rdma, ", count("warn: "), " warning)\n");
    for (const std::string& line : s.preflight()) absl::StrAppend(&out, "  ", line, "\n");
  }
  return out;
}

std::string NodeStateName(v1::NodeState state) {
  switch (state) {
    case v1::NODE_STATE_SELF:
      return "self";
    case v1::NODE_STATE_REGISTERED:
      return "registered";
    case v1::NODE_STATE_MISSING:
      return "missing";
    case v1::NODE_STATE_LOST:
      return "lost";
    case v1::NODE_STATE_MISMATCH:
      return "mismatch";
    default:
      return "-";
  }
}

namespace {

/// The MASKED column: a MASK group's masked ranks (at most 8 named, then "+N") and mask
/// epoch, e.g. "1,3 (epoch 4)" or "none (epoch 2)"; "-" for other groups.
std::string MaskedRanks(const v1::GroupInfo& g) {
  if (!g.has_rank_mask()) return "-";
  const v1::RankMask& m = g.rank_mask();
  constexpr int kNamed = 8;
  std::string ranks;
  for (int i = 0; i < m.masked_ranks_size() && i < kNamed; ++i) {
    absl::StrAppend(&ranks, i == 0 ? "" : ",", m.masked_ranks(i));
  }
  if (m.masked_ranks_size() > kNamed) absl::StrAppend(&ranks, ",+", m.masked_ranks_size() - kNamed);
  return absl::StrCat(ranks.empty() ? "none" : ranks, " (epoch ", m.epoch(), ")");
}

}  // namespace

std::string FormatGroups(const v1::ListGroupsResponse& groups) {
  if (groups.groups().empty()) return "no groups\n";
  Table table({"GROUP", "OWNER", "SECRET", "RANKS", "EXPERTS", "HIDDEN", "TOPK", "MAX_TOKENS",
               "LL_MAX_TOKENS", "FP8", "LAUNCH", "ON_RANK_FAILURE", "MASKED", "BYTES/RANK",
               "OPS OK", "OPS FAILED"});
  Table ranks({"GROUP", "RANK", "PID", "UID", "GPU", "SESSION", "OPS OK"});
  Table nodes(
      {"GROUP", "NODE", "PEER ADDRESS", "RANKS", "STATE", "JOINED", "INCARNATION", "REASON"});
  bool any_nodes = false;
  for (const v1::GroupInfo& g : groups.groups()) {
    const v1::GroupSpec& spec = g.spec();
    table.AddRow({spec.name(), UidAndName(g.owner_uid()), g.join_secret_set() ? "yes" : "no",
                  absl::StrCat(g.ranks_size(), "/", spec.num_ranks()),
                  absl::StrCat(spec.num_experts()), absl::StrCat(spec.hidden()),
                  absl::StrCat(spec.num_topk()), absl::StrCat(spec.max_tokens_per_rank()),
                  absl::StrCat(spec.ll_max_tokens_per_rank()), spec.use_fp8() ? "yes" : "no",
                  g.launch_mode() == v1::LAUNCH_MODE_CLIENT   ? "client"
                  : g.launch_mode() == v1::LAUNCH_MODE_DAEMON ? "daemon"
                                                              : "-",
                  spec.on_rank_failure() == v1::RANK_FAILURE_POLICY_MASK ? "mask" : "fail",
                  MaskedRanks(g), HumanBytes(g.buffer_bytes_per_rank()),
                  absl::StrCat(g.ops_completed()), absl::StrCat(g.ops_failed())});
    for (const v1::RankInfo& r : g.ranks()) {
      ranks.AddRow({spec.name(), absl::StrCat(r.rank()), absl::StrCat(r.client_pid()),
                    absl::StrCat(r.uid()), r.gpu_uuid().empty() ? "-" : r.gpu_uuid(),
                    r.session_id(), absl::StrCat(r.ops_completed())});
    }
    for (const v1::GroupNodeInfo& n : g.nodes()) {
      any_nodes = true;
      nodes.AddRow({spec.name(), absl::StrCat(n.node()), n.peer_address(),
                    n.num_ranks() == 1
                        ? absl::StrCat(n.first_rank())
                        : absl::StrCat(n.first_rank(), "-", n.first_rank() + n.num_ranks() - 1),
                    NodeStateName(n.state()),
                    n.joined_ranks() < 0 ? "-" : absl::StrCat(n.joined_ranks(), "/", n.num_ranks()),
                    n.incarnation() == 0 ? "-" : absl::StrCat(absl::Hex(n.incarnation())),
                    n.reason().empty() ? "-" : n.reason()});
    }
  }
  if (any_nodes) return absl::StrCat(table.Render(), "\n", ranks.Render(), "\n", nodes.Render());
  return absl::StrCat(table.Render(), "\n", ranks.Render());
}

std::string FormatDrain(const v1::DrainResponse& r) {
  if (r.draining()) {
    return absl::StrCat(r.was_draining() ? "already drained" : "drained",
                        ": live groups are served, new groups are refused, health is "
                        "NOT_SERVING (`epctl undrain` serves new groups again)\n");
  }
  return absl::StrCat(r.was_draining() ? "undrained" : "not drained",
                      ": new groups are accepted (health is SERVING unless `epctl status` "
                      "says otherwise)\n");
}

std::string FormatReload(const v1::ReloadConfigResponse& r) {
  std::string out = absl::StrCat("reload: ", r.result(), "\n");
  absl::StrAppend(&out, "applied: ",
                  r.applied().empty() ? "nothing changed" : absl::StrJoin(r.applied(), ", "), "\n");
  if (!r.refused().empty()) {
    absl::StrAppend(&out, "refused (restart epd to apply): ", absl::StrJoin(r.refused(), ", "),
                    "\n");
  }
  for (const v1::FlagOverride& o : r.overridden()) {
    absl::StrAppend(&out, "overridden: ", o.field(), ": set by ", o.flag(),
                    " on epd's command line, the file's value is not applied\n");
  }
  return out;
}

std::string FormatStats(const v1::GetStatsResponse& s) {
  Table table({"FIELD", "VALUE"});
  table.AddRow({"serving_status", s.serving_status()});
  table.AddRow({"draining", s.draining() ? "true" : "false"});
  table.AddRow({"version", s.version()});
  table.AddRow({"pid", absl::StrCat(s.pid())});
  table.AddRow({"uptime", HumanDurationMs(s.uptime_ms())});
  table.AddRow({"backend", s.backend()});
  table.AddRow({"peer_address", s.peer_address().empty() ? "-" : s.peer_address()});
  table.AddRow({"num_groups", absl::StrCat(s.num_groups())});
  table.AddRow({"num_sessions", absl::StrCat(s.num_sessions())});
  table.AddRow({"ops_completed", absl::StrCat(s.ops_completed())});
  table.AddRow({"ops_failed", absl::StrCat(s.ops_failed())});
  table.AddRow({"mps_active", s.mps_active() ? "true" : "false"});
  table.AddRow({"gpus", absl::StrCat(s.gpus_size())});
  return table.Render();
}

std::string FormatConfig(const v1::DaemonConfig& config) {
  // Print every field, defaults included: "the effective value of everything".
  std::string out;
  const google::protobuf::Descriptor* d = config.GetDescriptor();
  const google::protobuf::Reflection* r = config.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) {
      if (r->FieldSize(config, f) == 0) absl::StrAppend(&out, "# ", f->name(), ": (none)\n");
      for (int j = 0; j < r->FieldSize(config, f); ++j) {
        std::string value;
        google::protobuf::TextFormat::PrintFieldValueToString(config, f, j, &value);
        absl::StrAppend(&out, f->name(), ": ", value, "\n");
      }
      continue;
    }
    std::string value;
    google::protobuf::TextFormat::PrintFieldValueToString(config, f, -1, &value);
    absl::StrAppend(&out, f->name(), ": ", value, "\n");
  }
  return out;
}

}  // namespace epd::epctl
