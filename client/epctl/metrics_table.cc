// `epctl metrics`: the metrics snapshot GetStats carries (proto/epd/v1/metrics.proto) as
// tables a person reads: ops per group and kind with P50/P95/P99, then every other series.
#include <map>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/epctl/format.h"

namespace epd::epctl {
namespace {

std::string Label(const v1::MetricSample& s, const std::string& name) {
  for (const v1::MetricLabel& l : s.labels()) {
    if (l.name() == name) return l.value();
  }
  return "";
}

std::string Labels(const v1::MetricSample& s) {
  std::vector<std::string> parts;
  for (const v1::MetricLabel& l : s.labels())
    parts.push_back(absl::StrCat(l.name(), "=", l.value()));
  return parts.empty() ? "-" : absl::StrJoin(parts, ",");
}

std::string Number(double v) {
  if (v == static_cast<double>(static_cast<int64_t>(v))) {
    return absl::StrCat(static_cast<int64_t>(v));
  }
  return absl::StrFormat("%.10g", v);
}

}  // namespace

std::string Seconds(double s) {
  if (s <= 0) return "0";
  if (s < 1e-3) return absl::StrFormat("%.1fus", s * 1e6);
  if (s < 1) return absl::StrFormat("%.2fms", s * 1e3);
  return absl::StrFormat("%.2fs", s);
}

std::string FormatMetrics(const v1::MetricsSnapshot& snapshot) {
  struct OpRow {
    double ops = 0, failed = 0, bytes = 0;
    const v1::HistogramValue* latency = nullptr;
  };
  std::map<std::pair<std::string, std::string>, OpRow> ops;  // (group, op)
  Table other({"METRIC", "LABELS", "VALUE"});
  for (const v1::MetricFamily& f : snapshot.families()) {
    for (const v1::MetricSample& s : f.samples()) {
      const auto key = std::make_pair(Label(s, "group"), Label(s, "op"));
      if (f.name() == "epd_ops_total") {
        ops[key].ops = s.value();
      } else if (f.name() == "epd_op_failures_total") {
        ops[key].failed += s.value();
        other.AddRow({f.name(), Labels(s), Number(s.value())});
      } else if (f.name() == "epd_op_bytes_total") {
        ops[key].bytes = s.value();
      } else if (f.name() == "epd_op_latency_seconds") {
        ops[key].latency = &s.histogram();
      } else if (f.type() == v1::METRIC_TYPE_HISTOGRAM) {
        const v1::HistogramValue& h = s.histogram();
        other.AddRow({f.name(), Labels(s),
                      absl::StrCat("count ", h.count(), " p50 ", Seconds(h.p50()), " p95 ",
                                   Seconds(h.p95()), " p99 ", Seconds(h.p99()))});
      } else {
        other.AddRow({f.name(), Labels(s), Number(s.value())});
      }
    }
  }
  std::string out;
  if (!ops.empty()) {
    Table t({"GROUP", "OP", "OPS", "FAILED", "BYTES", "P50", "P95", "P99"});
    for (const auto& [key, row] : ops) {
      const v1::HistogramValue* h = row.latency;
      t.AddRow({key.first, key.second, Number(row.ops), Number(row.failed),
                HumanBytes(static_cast<uint64_t>(row.bytes)), h ? Seconds(h->p50()) : "-",
                h ? Seconds(h->p95()) : "-", h ? Seconds(h->p99()) : "-"});
    }
    absl::StrAppend(&out, t.Render(), "\n");
  }
  absl::StrAppend(&out, other.Render());
  return out;
}

}  // namespace epd::epctl
