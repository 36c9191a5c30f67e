// epd's metrics registry: counters, gauges and fixed-bucket histograms that the data path
// updates with relaxed atomics (no lock, no allocation), registered on the control path,
// and read at scrape time into a v1::MetricsSnapshot (proto/epd/v1/metrics.proto), which
// exposition.h renders in the Prometheus text format. Names, labels and what each metric
// means: docs/OPERATIONS.md "Metrics"; the design and its measured cost: DESIGN.md §10.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "daemon/metrics/expert_tally.h"
#include "epd/v1/metrics.pb.h"
#include "proto/abi/shm_abi.h"

namespace epd::metrics {

/// Label name → value, ordered by name (Prometheus sorts nothing; epd does, so that one
/// label set has one spelling).
using Labels = std::vector<std::pair<std::string, std::string>>;

/// A monotonic count. Add is one relaxed fetch_add: any thread, no lock.
class Counter {
 public:
  void Add(uint64_t n = 1) { v_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> v_{0};
};

/// A value now. Set/Add are relaxed atomics: any thread, no lock.
class Gauge {
 public:
  void Set(int64_t v) { v_.store(v, std::memory_order_relaxed); }
  void Add(int64_t n) { v_.fetch_add(n, std::memory_order_relaxed); }
  int64_t value() const { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> v_{0};
};

/// Most finite buckets a Histogram has.
inline constexpr size_t kMaxBuckets = 24;

/// Latency buckets in seconds, 1 µs to 10 s (1-2.5-5 steps): what an op's latency and a
/// straggler's lag are observed into.
std::span<const double> LatencyBuckets();

/// A histogram with fixed upper bounds (seconds for *_seconds families), kept in
/// nanoseconds. ObserveNs is a search of at most kMaxBuckets bounds and two relaxed
/// fetch_adds: any thread, no lock, no allocation.
class Histogram {
 public:
  /// `upper_bounds` ascending, at most kMaxBuckets (more are dropped), in seconds.
  explicit Histogram(std::span<const double> upper_bounds = LatencyBuckets());

  void ObserveNs(uint64_t ns) {
    size_t i = 0;
    while (i < num_bounds_ && ns > bounds_ns_[i]) ++i;
    counts_[i].fetch_add(1, std::memory_order_relaxed);
    sum_ns_.fetch_add(ns, std::memory_order_relaxed);
  }

  /// The bucket counts (cumulative), count, sum and quantiles now, into `out`.
  void Read(v1::HistogramValue* out) const;
  uint64_t count() const;

 private:
  size_t num_bounds_ = 0;
  std::array<double, kMaxBuckets> bounds_{};
  std::array<uint64_t, kMaxBuckets> bounds_ns_{};
  std::array<std::atomic<uint64_t>, kMaxBuckets + 1> counts_{};  ///< Per bucket, +Inf last.
  std::atomic<uint64_t> sum_ns_{0};
};

/// Quantile `q` (0..1) of a histogram from its cumulative bucket counts, as Prometheus's
/// histogram_quantile: linear within the bucket that holds rank q * count, from 0 for the
/// first bucket; the largest finite bound when it falls in +Inf; 0 when empty.
/// `cumulative` has bounds.size() + 1 entries.
double HistogramQuantile(std::span<const double> bounds, std::span<const uint64_t> cumulative,
                         double q);

/// Builds a snapshot: samples of one family name from several sources land in one family.
class SnapshotBuilder {
 public:
  explicit SnapshotBuilder(v1::MetricsSnapshot* out) : out_(out) {}
  /// The family `name`, created (with `help` and `type`) on first use.
  v1::MetricFamily* Family(std::string_view name, std::string_view help, v1::MetricType type);
  void AddCounter(std::string_view name, std::string_view help, const Labels& labels, double value);
  void AddGauge(std::string_view name, std::string_view help, const Labels& labels, double value);
  void AddHistogram(std::string_view name, std::string_view help, const Labels& labels,
                    const Histogram& h);

 private:
  v1::MetricsSnapshot* out_;
  std::map<std::string, v1::MetricFamily*, std::less<>> families_;
};

/// Something that writes samples at scrape time (a group's metrics, the daemon's gauges).
class Source {
 public:
  virtual ~Source() = default;
  virtual void Collect(SnapshotBuilder& out) const = 0;
};

class Registry;

/// Keeps a Source registered; unregisters on destruction, after which no Collect is inside
/// the source. Move-only.
class Registration {
 public:
  Registration() = default;
  Registration(Registry* registry, uint64_t id) : registry_(registry), id_(id) {}
  Registration(Registration&& o) noexcept { *this = std::move(o); }
  Registration& operator=(Registration&& o) noexcept;
  ~Registration() { Reset(); }
  void Reset();

 private:
  Registry* registry_ = nullptr;
  uint64_t id_ = 0;
};

/// The four metric families an OpTotals writes: each family's name and help text.
struct OpFamilies {
  std::string_view ops, ops_help;            ///< Counter: ops ended (OK or not).
  std::string_view failures, failures_help;  ///< Counter: ops failed, label `code` added.
  std::string_view bytes, bytes_help;        ///< Counter: bytes of token rows OK ops delivered.
  std::string_view latency, latency_help;    ///< Histogram: OK ops' latency (seconds).
};

/// Ops by kind (abi::OpKind): how many ended, how many failed with each status code, the
/// bytes and the latency of the OK ones. A group's own (GroupMetrics), and the node's over
/// every group, kept for the process's life (Registry::node_totals): the series an
/// operator's alerts read (error rate, P99), which do not vanish with a short-lived group
/// between two scrapes. Relaxed atomics, no lock, no allocation.
class OpTotals {
 public:
  static constexpr int kNumCodes = 17;  ///< absl::StatusCode values 0..16.
  static constexpr int kNumOps = static_cast<int>(abi::kMaxOpKind) + 1;

  /// An op of kind `op` (abi::OpKind; out of range: 0, "Invalid") ended on this node with
  /// `code` (out of range: UNKNOWN); for an OK op its latency (the first local rank's
  /// request picked up → completions written) and the bytes of token rows it delivered to
  /// this node's ranks.
  void RecordOp(uint32_t op, absl::StatusCode code, uint64_t latency_ns, uint64_t bytes) {
    PerOp& p = ops_[Index(op)];
    p.ops.Add();
    const int c = static_cast<int>(code);
    if (c != 0) {
      p.failures[c > 0 && c < kNumCodes ? c : 2].Add();  // 2 = UNKNOWN.
    } else {
      p.latency.ObserveNs(latency_ns);
      p.bytes.Add(bytes);
    }
  }
  /// `bytes` more bytes of token rows an OK op of kind `op` delivered.
  void AddOpBytes(uint32_t op, uint64_t bytes) { ops_[Index(op)].bytes.Add(bytes); }
  /// Ops of kind `op` ended (OK or not), and those that failed with `code` (0 for OK).
  uint64_t ops(uint32_t op) const { return ops_[Index(op)].ops.value(); }
  uint64_t failures(uint32_t op, absl::StatusCode code) const;

  /// Writes kind `op`'s samples into `families`, labelled `labels` plus `op` (plus `code`
  /// for failures): none for a kind never run, none for a code never seen. Returns whether
  /// the kind ran.
  bool CollectOp(SnapshotBuilder& out, int op, const Labels& labels,
                 const OpFamilies& families) const;
  /// CollectOp for every kind.
  void Collect(SnapshotBuilder& out, const Labels& labels, const OpFamilies& families) const;

  /// The slot of kind `op`: `op`, or 0 out of range.
  static int Index(uint32_t op) { return op < kNumOps ? static_cast<int>(op) : 0; }

 private:
  struct PerOp {
    Counter ops;
    Counter bytes;
    std::array<Counter, kNumCodes> failures;
    Histogram latency;
  };
  std::array<PerOp, kNumOps> ops_;
};

/// The metrics of one data-plane group on this node, sized at group creation (R ranks, E
/// experts), updated by the engine thread that polls the group (relaxed atomics, no
/// allocation) and read at scrape time. Label `group` = the group's name.
class GroupMetrics : public Source {
 public:
  static constexpr int kNumCodes = OpTotals::kNumCodes;
  static constexpr int kNumOps = OpTotals::kNumOps;

  /// `node` (may be null; else it outlives this): the node-wide totals RecordOp and
  /// AddOpBytes also count into.
  GroupMetrics(std::string group, int32_t num_ranks, int32_t num_experts, OpTotals* node = nullptr);

  /// An op of kind `op` (abi::OpKind) ended on this node with `code` (OpTotals::RecordOp).
  void RecordOp(uint32_t op, absl::StatusCode code, uint64_t latency_ns, uint64_t bytes) {
    if (node_ != nullptr) node_->RecordOp(op, code, latency_ns, bytes);
    ops_.RecordOp(op, code, latency_ns, bytes);
  }
  /// `bytes` more bytes of token rows an OK op of kind `op` delivered (for the kinds whose
  /// rows only the backend knows: the low-latency dispatch).
  void AddOpBytes(uint32_t op, uint64_t bytes) {
    if (node_ != nullptr) node_->AddOpBytes(op, bytes);
    ops_.AddOpBytes(op, bytes);
  }
  /// GPU time of an OK op of kind `op` (CUDA events around its kernels: OpGpuTimer).
  void RecordGpuTime(uint32_t op, uint64_t ns) { gpu_[OpTotals::Index(op)].ObserveNs(ns); }
  /// Every local rank arrived at an op; `last_rank` arrived last, `lag_ns` after the first.
  void RecordStraggler(int32_t last_rank, uint64_t lag_ns) {
    straggler_lag_.ObserveNs(lag_ns);
    if (last_rank >= 0 && last_rank < num_ranks_) last_arrivals_[last_rank].Add();
  }
  /// `tokens` more tokens received by global expert `expert` (out of range: ignored).
  void AddExpertTokens(int32_t expert, uint64_t tokens) {
    if (expert >= 0 && expert < num_experts_) expert_tokens_[expert].Add(tokens);
  }
  /// Per-expert totals the backend keeps itself (the CUDA backend's kernels), read at
  /// scrape time and added to those of AddExpertTokens. Shared: the tally lives as long as
  /// the last of the group's backend and these metrics. Null: none. Any thread.
  void SetExpertTokenTally(std::shared_ptr<const ExpertTokenTally> tally);
  /// Rank `rank` masked (true) or back (false): the masked gauge, and a counter of each.
  void SetRankMasked(int32_t rank, bool masked);

  const std::string& group() const { return group_; }
  int32_t num_ranks() const { return num_ranks_; }
  int32_t num_experts() const { return num_experts_; }
  /// For tests and epctl: ops of kind `op` ended (OK or not), and failed with `code`.
  uint64_t ops(uint32_t op) const { return ops_.ops(op); }
  /// Tokens global expert `expert` received: AddExpertTokens's and the tally's (0 out of
  /// range). Reads the whole tally: for tests and epctl, not the data path.
  uint64_t expert_tokens(int32_t expert) const;
  /// OK ops of kind `op` whose GPU time was recorded (RecordGpuTime).
  uint64_t gpu_timed_ops(uint32_t op) const { return gpu_[OpTotals::Index(op)].count(); }

  void Collect(SnapshotBuilder& out) const override;

 private:
  const std::string group_;
  OpTotals* const node_;
  const int32_t num_ranks_;
  const int32_t num_experts_;
  OpTotals ops_;
  std::array<Histogram, kNumOps> gpu_;  ///< Per op kind: RecordGpuTime.
  Histogram straggler_lag_;
  std::unique_ptr<Counter[]> last_arrivals_;  ///< [R]
  std::unique_ptr<Counter[]> expert_tokens_;  ///< [E]
  std::unique_ptr<Gauge[]> masked_;           ///< [R] 0/1
  mutable std::mutex tally_mu_;               ///< Guards tally_ (the pointer).
  std::shared_ptr<const ExpertTokenTally> tally_;
  /// Every global expert's total now: the counters plus the tally's. [E]; allocates.
  std::vector<uint64_t> ExpertTotals() const;
  Counter masks_;
  Counter rejoins_;
};

/// What the transport itself counts for a link to a peer, read at scrape time; -1 = the
/// transport does not know it (transport::LinkCounters).
struct TransportCounts {
  int64_t retransmits = -1;        ///< Segments re-sent to the peer (TCP).
  int64_t error_completions = -1;  ///< Work completions with an error status (RDMA).
};

/// A per-peer link's counters (one group, one peer node, one transport), updated by the
/// engine thread; label set {group, transport, peer}.
struct LinkMetrics {
  Counter bytes_sent;
  Counter writes;
  Counter errors;    ///< Writes refused and peers lost.
  Counter timeouts;  ///< Ops that timed out waiting for this peer.

  /// What reads the transport's counts of the link (TransportCounts) at scrape time: set
  /// by the link's owner while the link lives, cleared (an empty function) before the
  /// link goes; returns once no scrape is inside the old probe. Control path.
  void SetTransportProbe(std::function<TransportCounts()> probe);
  /// The probe's answer now (all -1 without a probe). Scrape time.
  TransportCounts ReadTransport() const;

 private:
  mutable std::mutex probe_mu_;  ///< Held while the probe runs.
  std::function<TransportCounts()> probe_;
};

/// The process's registry. Thread-safe; registration and Collect lock a mutex (control
/// path), the metrics themselves never do. A collector must not register or unregister
/// anything (Collect calls it holding collect_mu_).
class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  /// The metrics of a new group (registered until the returned pointer's last copy dies).
  /// A second group of the same name (in another daemon of this process, or after the
  /// first one died) gets its own.
  std::shared_ptr<GroupMetrics> AddGroup(const std::string& group, int32_t num_ranks,
                                         int32_t num_experts);
  /// The live metrics of group `group` (the latest added), or null.
  std::shared_ptr<GroupMetrics> FindGroup(std::string_view group) const;
  /// A link's counters, registered until the pointer's last copy dies.
  std::shared_ptr<LinkMetrics> AddLink(const std::string& group, const std::string& transport,
                                       const std::string& peer);

  /// A counter or gauge with a fixed name and labels, created on first use and kept for
  /// the process's life (for a bounded set of label values: engines, not groups). The
  /// address is stable. Control path (locks).
  Counter* GetCounter(std::string_view name, std::string_view help, const Labels& labels);
  Gauge* GetGauge(std::string_view name, std::string_view help, const Labels& labels);

  /// Registers `source` until the returned Registration dies; it must outlive that.
  Registration Add(const Source* source);
  /// Registers a function that writes samples at scrape time.
  Registration AddCollector(std::function<void(SnapshotBuilder&)> collect);
  /// The node-wide op totals every group added here counts into.
  const OpTotals& node_totals() const { return node_totals_; }

  /// Everything now.
  v1::MetricsSnapshot Collect() const;

 private:
  friend class Registration;
  void Remove(uint64_t id);
  struct Fixed {
    std::string name, help;
    v1::MetricType type;
    Labels labels;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
  };
  struct LinkEntry {
    std::string group, transport, peer;
    std::weak_ptr<LinkMetrics> link;
  };

  mutable std::mutex collect_mu_;  ///< Held by Collect and Remove (see Collect).
  mutable std::mutex mu_;          ///< Guards the lists below; never held while calling out.
  uint64_t next_id_ = 1;
  std::map<uint64_t, const Source*> sources_;
  std::map<uint64_t, std::function<void(SnapshotBuilder&)>> collectors_;
  std::vector<std::weak_ptr<GroupMetrics>> groups_;
  std::vector<LinkEntry> links_;
  std::vector<Fixed> fixed_;
  OpTotals node_totals_;

  /// GetCounter / GetGauge: the Fixed entry of `name` and `labels` holding `member`.
  template <typename Metric>
  Metric* GetFixed(std::string_view name, std::string_view help, const Labels& labels,
                   v1::MetricType type, std::unique_ptr<Metric> Fixed::*member);
};

/// The process-wide registry every part of the daemon records into.
Registry& Default();

/// Rank `rank` of group `group` was masked / rejoined (unmasked): for the masking code
/// (control path; a group with no metrics is ignored).
void OnRankMasked(std::string_view group, int32_t rank);
void OnRankRejoined(std::string_view group, int32_t rank);

}  // namespace epd::metrics
