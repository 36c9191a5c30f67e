// The metrics registry (metrics.h).
#include "daemon/metrics/metrics.h"

#include <algorithm>
#include <cctype>
#include <chrono>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace epd::metrics {
namespace {

constexpr std::array<double, 22> kLatencyBuckets = {
    1e-6, 2.5e-6, 5e-6,   1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
    5e-3, 1e-2,   2.5e-2, 5e-2, 0.1,    0.25, 0.5,  1.0,    2.5,  5.0,  10.0};

/// "OK", "INVALID_ARGUMENT", ... as Prometheus label values (absl's names, upper case).
std::string CodeName(int code) {
  std::string s = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  for (char& c : s) c = c == ' ' ? '_' : static_cast<char>(std::toupper(c));
  return s;
}

Labels With(Labels labels, std::string name, std::string value) {
  labels.emplace_back(std::move(name), std::move(value));
  std::sort(labels.begin(), labels.end());
  return labels;
}

void SetLabels(const Labels& labels, v1::MetricSample* s) {
  for (const auto& [k, v] : labels) {
    v1::MetricLabel* l = s->add_labels();
    l->set_name(k);
    l->set_value(v);
  }
}

}  // namespace

std::span<const double> LatencyBuckets() { return kLatencyBuckets; }

Histogram::Histogram(std::span<const double> upper_bounds) {
  num_bounds_ = std::min(upper_bounds.size(), kMaxBuckets);
  for (size_t i = 0; i < num_bounds_; ++i) {
    bounds_[i] = upper_bounds[i];
    bounds_ns_[i] = static_cast<uint64_t>(upper_bounds[i] * 1e9 + 0.5);
  }
}

uint64_t Histogram::count() const {
  uint64_t n = 0;
  for (size_t i = 0; i <= num_bounds_; ++i) n += counts_[i].load(std::memory_order_relaxed);
  return n;
}

void Histogram::Read(v1::HistogramValue* out) const {
  out->Clear();
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= num_bounds_; ++i) {
    cumulative += counts_[i].load(std::memory_order_relaxed);
    if (i < num_bounds_) out->add_upper_bounds(bounds_[i]);
    out->add_cumulative_counts(cumulative);
  }
  out->set_count(cumulative);
  out->set_sum(static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) * 1e-9);
  const std::span<const double> bounds(out->upper_bounds().data(), out->upper_bounds_size());
  const std::span<const uint64_t> counts(out->cumulative_counts().data(),
                                         out->cumulative_counts_size());
  out->set_p50(HistogramQuantile(bounds, counts, 0.50));
  out->set_p95(HistogramQuantile(bounds, counts, 0.95));
  out->set_p99(HistogramQuantile(bounds, counts, 0.99));
}

double HistogramQuantile(std::span<const double> bounds, std::span<const uint64_t> cumulative,
                         double q) {
  if (cumulative.empty() || cumulative.size() != bounds.size() + 1) return 0;
  const uint64_t total = cumulative.back();
  if (total == 0) return 0;
  q = std::clamp(q, 0.0, 1.0);
  const double rank = q * static_cast<double>(total);
  size_t i = 0;
  while (i < bounds.size() && static_cast<double>(cumulative[i]) < rank) ++i;
  if (i == bounds.size()) return bounds.empty() ? 0 : bounds.back();  // In +Inf.
  const double lo = i == 0 ? 0.0 : bounds[i - 1];
  const double below = i == 0 ? 0.0 : static_cast<double>(cumulative[i - 1]);
  const double in_bucket = static_cast<double>(cumulative[i]) - below;
  if (in_bucket <= 0) return bounds[i];
  return lo + (bounds[i] - lo) * ((rank - below) / in_bucket);
}

// ---- SnapshotBuilder --------------------------------------------------------------------

v1::MetricFamily* SnapshotBuilder::Family(std::string_view name, std::string_view help,
                                          v1::MetricType type) {
  auto it = families_.find(name);
  if (it != families_.end()) return it->second;
  v1::MetricFamily* f = out_->add_families();
  f->set_name(std::string(name));
  f->set_help(std::string(help));
  f->set_type(type);
  families_.emplace(std::string(name), f);
  return f;
}

void SnapshotBuilder::AddCounter(std::string_view name, std::string_view help, const Labels& labels,
                                 double value) {
  v1::MetricSample* s = Family(name, help, v1::METRIC_TYPE_COUNTER)->add_samples();
  SetLabels(labels, s);
  s->set_value(value);
}

void SnapshotBuilder::AddGauge(std::string_view name, std::string_view help, const Labels& labels,
                               double value) {
  v1::MetricSample* s = Family(name, help, v1::METRIC_TYPE_GAUGE)->add_samples();
  SetLabels(labels, s);
  s->set_value(value);
}

void SnapshotBuilder::AddHistogram(std::string_view name, std::string_view help,
                                   const Labels& labels, const Histogram& h) {
  v1::MetricSample* s = Family(name, help, v1::METRIC_TYPE_HISTOGRAM)->add_samples();
  SetLabels(labels, s);
  h.Read(s->mutable_histogram());
}

// ---- OpTotals ----------------------------------------------------------------------------

namespace {

constexpr OpFamilies kNodeOpFamilies = {
    "epd_node_ops_total",
    "Ops ended on this node (OK or not), every group, per op kind; kept when a group ends.",
    "epd_node_op_failures_total",
    "Ops that ended with an error, every group, per op kind and status code.",
    "epd_node_op_bytes_total",
    "Bytes of token rows OK ops delivered to this node's ranks, every group.",
    "epd_node_op_latency_seconds",
    "OK ops of every group: the first local rank's request picked up until every completion "
    "is written.",
};

constexpr OpFamilies kGroupOpFamilies = {
    "epd_ops_total",
    "Ops ended on this node (OK or not), per group and op kind.",
    "epd_op_failures_total",
    "Ops that ended with an error, per group, op kind and status code.",
    "epd_op_bytes_total",
    "Bytes of token rows OK ops delivered to this node's ranks (dispatch: rows received; "
    "combine: rows combined).",
    "epd_op_latency_seconds",
    "OK ops: the first local rank's request picked up from its ring until every completion is "
    "written.",
};

}  // namespace

uint64_t OpTotals::failures(uint32_t op, absl::StatusCode code) const {
  const int c = static_cast<int>(code);
  if (c <= 0 || c >= kNumCodes) return 0;
  return ops_[Index(op)].failures[c].value();
}

bool OpTotals::CollectOp(SnapshotBuilder& out, int op, const Labels& labels,
                         const OpFamilies& families) const {
  if (op < 0 || op >= kNumOps) return false;
  const PerOp& p = ops_[op];
  if (p.ops.value() == 0) return false;  // Kinds never run: no series.
  const Labels l = With(labels, "op", abi::OpKindName(op));
  out.AddCounter(families.ops, families.ops_help, l, static_cast<double>(p.ops.value()));
  for (int c = 1; c < kNumCodes; ++c) {
    if (p.failures[c].value() == 0) continue;
    out.AddCounter(families.failures, families.failures_help, With(l, "code", CodeName(c)),
                   static_cast<double>(p.failures[c].value()));
  }
  out.AddCounter(families.bytes, families.bytes_help, l, static_cast<double>(p.bytes.value()));
  out.AddHistogram(families.latency, families.latency_help, l, p.latency);
  return true;
}

void OpTotals::Collect(SnapshotBuilder& out, const Labels& labels,
                       const OpFamilies& families) const {
  for (int op = 0; op < kNumOps; ++op) CollectOp(out, op, labels, families);
}

// ---- GroupMetrics -----------------------------------------------------------------------

GroupMetrics::GroupMetrics(std::string group, int32_t num_ranks, int32_t num_experts,
                           OpTotals* node)
    : group_(std::move(group)),
      node_(node),
      num_ranks_(std::max(num_ranks, 0)),
      num_experts_(std::max(num_experts, 0)),
      last_arrivals_(std::make_unique<Counter[]>(num_ranks_)),
      expert_tokens_(std::make_unique<Counter[]>(num_experts_)),
      masked_(std::make_unique<Gauge[]>(num_ranks_)) {}

void GroupMetrics::SetExpertTokenTally(std::shared_ptr<const ExpertTokenTally> tally) {
  std::lock_guard<std::mutex> lock(tally_mu_);
  tally_ = std::move(tally);
}

std::vector<uint64_t> GroupMetrics::ExpertTotals() const {
  std::vector<uint64_t> totals(num_experts_);
  for (int32_t e = 0; e < num_experts_; ++e) totals[e] = expert_tokens_[e].value();
  std::shared_ptr<const ExpertTokenTally> tally;
  {
    std::lock_guard<std::mutex> lock(tally_mu_);
    tally = tally_;
  }
  if (tally) tally->AddTo(totals);
  return totals;
}

uint64_t GroupMetrics::expert_tokens(int32_t expert) const {
  if (expert < 0 || expert >= num_experts_) return 0;
  return ExpertTotals()[expert];
}

void GroupMetrics::SetRankMasked(int32_t rank, bool masked) {
  if (rank < 0 || rank >= num_ranks_) return;
  const int64_t was = masked_[rank].value();
  masked_[rank].Set(masked ? 1 : 0);
  if (masked && was == 0) masks_.Add();
  if (!masked && was != 0) rejoins_.Add();
}

void GroupMetrics::Collect(SnapshotBuilder& out) const {
  const Labels g = {{"group", group_}};
  for (int op = 0; op < kNumOps; ++op) {  // 0: "Invalid" (a malformed request).
    if (!ops_.CollectOp(out, op, g, kGroupOpFamilies)) continue;
    if (gpu_[op].count() > 0) {
      out.AddHistogram("epd_op_gpu_seconds",
                       "OK ops: GPU time from CUDA events around the op's kernels on each rank's "
                       "stream, the longest rank's (daemon-launched ranks of the CUDA backend).",
                       With(g, "op", abi::OpKindName(op)), gpu_[op]);
    }
  }
  if (straggler_lag_.count() > 0) {
    out.AddHistogram("epd_straggler_lag_seconds",
                     "Per op: how long after the first local rank the last one arrived.", g,
                     straggler_lag_);
    for (int32_t r = 0; r < num_ranks_; ++r) {
      if (last_arrivals_[r].value() == 0) continue;
      out.AddCounter("epd_straggler_last_total", "Ops at which this rank arrived last.",
                     With(g, "rank", absl::StrCat(r)),
                     static_cast<double>(last_arrivals_[r].value()));
    }
  }
  const std::vector<uint64_t> expert_totals = ExpertTotals();
  for (int32_t e = 0; e < num_experts_; ++e) {
    const uint64_t n = expert_totals[e];
    if (n == 0) continue;
    out.AddCounter("epd_expert_received_tokens_total",
                   "Tokens each expert received by dispatches on this node (cumulative, as "
                   "DeepEP's expert stats; a token counts once per expert).",
                   With(g, "expert", absl::StrCat(e)), static_cast<double>(n));
  }
  int64_t masked = 0;
  for (int32_t r = 0; r < num_ranks_; ++r) masked += masked_[r].value();
  out.AddGauge("epd_masked_ranks", "Ranks of the group masked now.", g,
               static_cast<double>(masked));
  out.AddCounter("epd_rank_masks_total", "Times a rank of the group was masked.", g,
                 static_cast<double>(masks_.value()));
  out.AddCounter("epd_rank_rejoins_total", "Times a masked rank of the group came back.", g,
                 static_cast<double>(rejoins_.value()));
}

// ---- LinkMetrics ------------------------------------------------------------------------

void LinkMetrics::SetTransportProbe(std::function<TransportCounts()> probe) {
  std::lock_guard<std::mutex> lock(probe_mu_);
  probe_ = std::move(probe);
}

TransportCounts LinkMetrics::ReadTransport() const {
  std::lock_guard<std::mutex> lock(probe_mu_);
  return probe_ ? probe_() : TransportCounts{};
}

// ---- Registration and Registry ----------------------------------------------------------

Registration& Registration::operator=(Registration&& o) noexcept {
  if (this != &o) {
    Reset();
    registry_ = std::exchange(o.registry_, nullptr);
    id_ = std::exchange(o.id_, 0);
  }
  return *this;
}

void Registration::Reset() {
  if (registry_ != nullptr) registry_->Remove(id_);
  registry_ = nullptr;
  id_ = 0;
}

std::shared_ptr<GroupMetrics> Registry::AddGroup(const std::string& group, int32_t num_ranks,
                                                 int32_t num_experts) {
  auto m = std::make_shared<GroupMetrics>(group, num_ranks, num_experts, &node_totals_);
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(groups_, [](const std::weak_ptr<GroupMetrics>& w) { return w.expired(); });
  groups_.push_back(m);
  return m;
}

std::shared_ptr<GroupMetrics> Registry::FindGroup(std::string_view group) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = groups_.rbegin(); it != groups_.rend(); ++it) {
    std::shared_ptr<GroupMetrics> m = it->lock();
    if (m && m->group() == group) return m;
  }
  return nullptr;
}

std::shared_ptr<LinkMetrics> Registry::AddLink(const std::string& group,
                                               const std::string& transport,
                                               const std::string& peer) {
  auto m = std::make_shared<LinkMetrics>();
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(links_, [](const LinkEntry& e) { return e.link.expired(); });
  links_.push_back({group, transport, peer, m});
  return m;
}

template <typename Metric>
Metric* Registry::GetFixed(std::string_view name, std::string_view help, const Labels& labels,
                           v1::MetricType type, std::unique_ptr<Metric> Fixed::*member) {
  std::lock_guard<std::mutex> lock(mu_);
  for (Fixed& f : fixed_) {
    if (f.*member && f.name == name && f.labels == labels) return (f.*member).get();
  }
  Fixed& f = fixed_.emplace_back();
  f.name = std::string(name);
  f.help = std::string(help);
  f.type = type;
  f.labels = labels;
  f.*member = std::make_unique<Metric>();
  return (f.*member).get();
}

Counter* Registry::GetCounter(std::string_view name, std::string_view help, const Labels& labels) {
  return GetFixed(name, help, labels, v1::METRIC_TYPE_COUNTER, &Fixed::counter);
}

Gauge* Registry::GetGauge(std::string_view name, std::string_view help, const Labels& labels) {
  return GetFixed(name, help, labels, v1::METRIC_TYPE_GAUGE, &Fixed::gauge);
}

Registration Registry::Add(const Source* source) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  sources_[id] = source;
  return Registration(this, id);
}

Registration Registry::AddCollector(std::function<void(SnapshotBuilder&)> collect) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  collectors_[id] = std::move(collect);
  return Registration(this, id);
}

void Registry::Remove(uint64_t id) {
  std::lock_guard<std::mutex> collecting(collect_mu_);  // No Collect is inside it after.
  std::lock_guard<std::mutex> lock(mu_);
  sources_.erase(id);
  collectors_.erase(id);
}

v1::MetricsSnapshot Registry::Collect() const {
  v1::MetricsSnapshot snapshot;
  snapshot.set_unix_time_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count());
  SnapshotBuilder out(&snapshot);
  // collect_mu_ (held throughout) keeps every registered source and collector alive until
  // Collect returns (Remove waits for it); mu_ is held only to copy the lists, so a
  // collector may take locks (the group registry's) under which others register metrics.
  std::lock_guard<std::mutex> collecting(collect_mu_);
  std::vector<const Source*> sources;
  std::vector<const std::function<void(SnapshotBuilder&)>*> collectors;
  std::vector<std::shared_ptr<GroupMetrics>> groups;
  std::vector<std::pair<LinkEntry, std::shared_ptr<LinkMetrics>>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Fixed& f : fixed_) {
      if (f.counter) {
        out.AddCounter(f.name, f.help, f.labels, static_cast<double>(f.counter->value()));
      }
      if (f.gauge) out.AddGauge(f.name, f.help, f.labels, static_cast<double>(f.gauge->value()));
    }
    for (const auto& [id, source] : sources_) sources.push_back(source);
    for (const auto& [id, collect] : collectors_) collectors.push_back(&collect);
    for (const std::weak_ptr<GroupMetrics>& w : groups_) {
      if (std::shared_ptr<GroupMetrics> g = w.lock()) groups.push_back(std::move(g));
    }
    for (const LinkEntry& e : links_) {
      if (std::shared_ptr<LinkMetrics> m = e.link.lock()) links.emplace_back(e, std::move(m));
    }
  }
  node_totals_.Collect(out, {}, kNodeOpFamilies);
  for (const auto* collect : collectors) (*collect)(out);
  for (const Source* source : sources) source->Collect(out);
  for (const auto& g : groups) g->Collect(out);
  for (const auto& [e, m] : links) {
    const Labels l = {{"group", e.group}, {"peer", e.peer}, {"transport", e.transport}};
    out.AddCounter("epd_transport_sent_bytes_total",
                   "Bytes this node wrote to the peer node for the group's ops.", l,
                   static_cast<double>(m->bytes_sent.value()));
    out.AddCounter("epd_transport_writes_total", "Writes posted to the peer node.", l,
                   static_cast<double>(m->writes.value()));
    out.AddCounter("epd_transport_errors_total",
                   "Writes to the peer refused by the transport, and times the peer was lost.", l,
                   static_cast<double>(m->errors.value()));
    out.AddCounter("epd_transport_timeouts_total", "Ops that timed out waiting for the peer node.",
                   l, static_cast<double>(m->timeouts.value()));
    const TransportCounts t = m->ReadTransport();
    if (t.retransmits >= 0) {
      out.AddCounter("epd_transport_retransmits_total",
                     "Segments this node re-sent to the peer (TCP: tcpi_total_retrans of the "
                     "link's connections, closed ones included).",
                     l, static_cast<double>(t.retransmits));
    }
    if (t.error_completions >= 0) {
      out.AddCounter("epd_transport_error_completions_total",
                     "Work completions with an error status on the link's queue pairs (RDMA; "
                     "flushes not counted).",
                     l, static_cast<double>(t.error_completions));
    }
  }
  return snapshot;
}

Registry& Default() {
  static Registry registry;
  return registry;
}

void OnRankMasked(std::string_view group, int32_t rank) {
  if (std::shared_ptr<GroupMetrics> g = Default().FindGroup(group)) g->SetRankMasked(rank, true);
}

void OnRankRejoined(std::string_view group, int32_t rank) {
  if (std::shared_ptr<GroupMetrics> g = Default().FindGroup(group)) g->SetRankMasked(rank, false);
}

}  // namespace epd::metrics
