// The Prometheus text exposition format (version 0.0.4) of a metrics snapshot, and the
// filter GetStats applies to it.
#pragma once

#include <set>
#include <string>

#include "epd/v1/metrics.pb.h"

namespace epd::metrics {

/// The Content-Type of RenderPrometheus's text.
inline constexpr char kPrometheusContentType[] = "text/plain; version=0.0.4; charset=utf-8";

/// `snapshot` in the text format: per family "# HELP", "# TYPE" and one line per sample
/// (histograms as _bucket{le=...}, _sum and _count); label values and help escaped.
std::string RenderPrometheus(const v1::MetricsSnapshot& snapshot);

/// Drops every sample labelled with a group not in `groups` (and families left empty).
void KeepGroups(v1::MetricsSnapshot* snapshot, const std::set<std::string>& groups);

}  // namespace epd::metrics
