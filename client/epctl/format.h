// epctl output: human-readable tables of epd's GetStats / ListGroups / config, and the
// helpers they share. JSON output uses protobuf's JSON printer (JsonOutput).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epd/v1/control.pb.h"
#include "google/protobuf/message.h"

namespace epd::epctl {

/// A left-aligned text table: column widths fit the widest cell, two spaces apart.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void AddRow(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  std::string Render(const std::string& indent = "") const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

/// `message` as indented JSON with every field (defaults included) and proto field
/// names (protobuf JsonPrintOptions), ending in a newline.
std::string JsonOutput(const google::protobuf::Message& message);

/// `epctl status`: daemon line, backend and reason, MPS, Peer address, counters, GPUs, then
/// FormatTransports.
std::string FormatStatus(const v1::GetStatsResponse& stats, const std::string& target);
/// The transports this daemon can run, the NIC table (device:port, state, link layer,
/// rate, GID index and GID, NUMA node, PCI bus id, the GPUs using it by ordinal, GPUDirect,
/// whether epd uses it) and the preflight lines ("preflight: ok" when none).
std::string FormatTransports(const v1::GetStatsResponse& stats);
/// "self", "registered", "missing", "lost", "mismatch" ("-" for an unknown value).
std::string NodeStateName(v1::NodeState state);
/// `epctl groups`: one row per group, then one row per joined rank, then (for groups that
/// span nodes) one row per node with its state as this daemon sees it.
std::string FormatGroups(const v1::ListGroupsResponse& groups);
/// `epctl stats`: counters.
std::string FormatStats(const v1::GetStatsResponse& stats);
/// `epctl metrics` (metrics_table.cc): one row per group and op kind (ops, failed, bytes,
/// latency P50/P95/P99 read from its histogram), then one row per other series (metric,
/// labels, value; histograms as count and quantiles).
std::string FormatMetrics(const v1::MetricsSnapshot& snapshot);
/// "12.5us", "3.40ms", "1.20s": a duration in seconds; "0" for 0.
std::string Seconds(double s);
/// `epctl config`: the effective DaemonConfig in its text format (every field shown).
std::string FormatConfig(const v1::DaemonConfig& config);

/// `epctl drain` / `undrain`: the state now and what it means.
std::string FormatDrain(const v1::DrainResponse& response);
/// `epctl reload`: the result, the fields applied, those that need a restart and those a
/// flag of epd's overrides (the file's value not applied), one line each.
std::string FormatReload(const v1::ReloadConfigResponse& response);

/// "1000 (alice)": a uid and its user name on this machine, or the uid alone.
std::string UidAndName(uint32_t uid);
/// "12.3 GiB" style byte counts; "1h2m3s" style durations from milliseconds.
std::string HumanBytes(uint64_t bytes);
std::string HumanDurationMs(uint64_t ms);

}  // namespace epd::epctl
