// The Prometheus text format (exposition.h).
#include "daemon/metrics/exposition.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace epd::metrics {
namespace {

/// Backslash and newline escaped, and with `quote` the double quote too: help text
/// (quote = false) and label values (quote = true) of the text format.
std::string Escape(const std::string& s, bool quote) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\' || (quote && c == '"')) {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string Number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.15g", v);
}

/// "{a="x",b="y"}" with `extra` (name, value) appended; "" when there are no labels.
std::string LabelText(const v1::MetricSample& s, const char* extra_name = nullptr,
                      const std::string& extra_value = "") {
  std::string out;
  for (const v1::MetricLabel& l : s.labels()) {
    absl::StrAppend(&out, out.empty() ? "" : ",", l.name(), "=\"", Escape(l.value(), true), "\"");
  }
  if (extra_name != nullptr) {
    absl::StrAppend(&out, out.empty() ? "" : ",", extra_name, "=\"", extra_value, "\"");
  }
  return out.empty() ? out : absl::StrCat("{", out, "}");
}

const char* TypeName(v1::MetricType t) {
  switch (t) {
    case v1::METRIC_TYPE_COUNTER:
      return "counter";
    case v1::METRIC_TYPE_GAUGE:
      return "gauge";
    case v1::METRIC_TYPE_HISTOGRAM:
      return "histogram";
    default:
      return "untyped";
  }
}

}  // namespace

std::string RenderPrometheus(const v1::MetricsSnapshot& snapshot) {
  std::string out;
  for (const v1::MetricFamily& f : snapshot.families()) {
    absl::StrAppend(&out, "# HELP ", f.name(), " ", Escape(f.help(), false), "\n");
    absl::StrAppend(&out, "# TYPE ", f.name(), " ", TypeName(f.type()), "\n");
    for (const v1::MetricSample& s : f.samples()) {
      if (f.type() != v1::METRIC_TYPE_HISTOGRAM) {
        absl::StrAppend(&out, f.name(), LabelText(s), " ", Number(s.value()), "\n");
        continue;
      }
      const v1::HistogramValue& h = s.histogram();
      for (int i = 0; i < h.cumulative_counts_size(); ++i) {
        const std::string le = i < h.upper_bounds_size() ? Number(h.upper_bounds(i)) : "+Inf";
        absl::StrAppend(&out, f.name(), "_bucket", LabelText(s, "le", le), " ",
                        h.cumulative_counts(i), "\n");
      }
      absl::StrAppend(&out, f.name(), "_sum", LabelText(s), " ", Number(h.sum()), "\n");
      absl::StrAppend(&out, f.name(), "_count", LabelText(s), " ", h.count(), "\n");
    }
  }
  return out;
}

void KeepGroups(v1::MetricsSnapshot* snapshot, const std::set<std::string>& groups) {
  auto* families = snapshot->mutable_families();
  for (int fi = families->size() - 1; fi >= 0; --fi) {
    auto* samples = families->Mutable(fi)->mutable_samples();
    for (int si = samples->size() - 1; si >= 0; --si) {
      for (const v1::MetricLabel& l : samples->Get(si).labels()) {
        if (l.name() == "group" && !groups.count(l.value())) {
          samples->DeleteSubrange(si, 1);
          break;
        }
      }
    }
    if (samples->empty()) families->DeleteSubrange(fi, 1);
  }
}

}  // namespace epd::metrics
