// FaultTransport (fault_transport.h).
#include "daemon/transport/fault/fault_transport.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "daemon/core/logging.h"
#include "daemon/transport/tcp/tcp_transport.h"

namespace epd::transport {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kTick = std::chrono::milliseconds(2);

absl::string_view Absl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

}  // namespace

PeerFaults FaultPlan::For(int32_t node) const {
  PeerFaults f = all;
  auto it = per_node.find(node);
  if (it == per_node.end()) return f;
  if (it->second.delay_ms) f.delay_ms = it->second.delay_ms;
  if (it->second.drop_after_writes) f.drop_after_writes = it->second.drop_after_writes;
  if (it->second.reset_after_writes) f.reset_after_writes = it->second.reset_after_writes;
  return f;
}

bool FaultPlan::Partitioned(int32_t a, int32_t b) const {
  int side_a = -1;
  int side_b = -1;
  for (size_t s = 0; s < partition.size(); ++s) {
    for (int32_t n : partition[s]) {
      if (n == a) side_a = static_cast<int>(s);
      if (n == b) side_b = static_cast<int>(s);
    }
  }
  return side_a >= 0 && side_b >= 0 && side_a != side_b;
}

std::string FaultPlan::ToString() const {
  std::vector<std::string> items;
  const auto add = [&](const PeerFaults& f, const std::string& suffix) {
    if (f.delay_ms) items.push_back(absl::StrCat("delay_ms=", *f.delay_ms, suffix));
    if (f.drop_after_writes) {
      items.push_back(absl::StrCat("drop_after_writes=", *f.drop_after_writes, suffix));
    }
    if (f.reset_after_writes) {
      items.push_back(absl::StrCat("reset_after_writes=", *f.reset_after_writes, suffix));
    }
  };
  add(all, "");
  for (const auto& [node, f] : per_node) add(f, absl::StrCat(":node=", node));
  if (!partition.empty()) {
    std::vector<std::string> sides;
    for (const auto& side : partition) sides.push_back(absl::StrJoin(side, ","));
    items.push_back(absl::StrCat("partition=", absl::StrJoin(sides, "|")));
    items.push_back(absl::StrCat("partition_fail_ms=", partition_fail_after.count()));
  }
  return absl::StrJoin(items, ";");
}

absl::StatusOr<FaultPlan> ParseFaultPlan(std::string_view spec_in) {
  const absl::string_view spec = Absl(spec_in);
  FaultPlan plan;
  for (absl::string_view item : absl::StrSplit(spec, ';', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    const auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("fault spec '", spec, "': item '", item, "': ", why));
    };
    std::optional<int32_t> node;
    absl::string_view kv = item;
    if (const size_t colon = item.find(':'); colon != absl::string_view::npos) {
      absl::string_view q = item.substr(colon + 1);
      kv = item.substr(0, colon);
      int32_t n = 0;
      if (!absl::ConsumePrefix(&q, "node=") || !absl::SimpleAtoi(q, &n) || n < 0) {
        return bad("the qualifier must be :node=N with N >= 0");
      }
      node = n;
    }
    const size_t eq = kv.find('=');
    if (eq == absl::string_view::npos) return bad("want KEY=VALUE");
    const absl::string_view key = kv.substr(0, eq);
    const absl::string_view value = kv.substr(eq + 1);
    if (key == "partition") {
      if (node) return bad("partition takes no :node qualifier");
      plan.partition.clear();
      for (absl::string_view side : absl::StrSplit(value, '|')) {
        std::vector<int32_t> nodes;
        for (absl::string_view n : absl::StrSplit(side, ',')) {
          int32_t v = 0;
          if (!absl::SimpleAtoi(n, &v) || v < 0) {
            return bad(absl::StrCat("node '", n, "' is not an index >= 0"));
          }
          nodes.push_back(v);
        }
        plan.partition.push_back(std::move(nodes));
      }
      if (plan.partition.size() < 2) return bad("a partition needs two sides or more (a|b)");
      continue;
    }
    int64_t v = 0;
    if (!absl::SimpleAtoi(value, &v) || v < 0) {
      return bad(absl::StrCat("value '", value, "' is not an integer >= 0"));
    }
    if (key == "partition_fail_ms") {
      if (node || v == 0) return bad("partition_fail_ms is > 0 and takes no :node qualifier");
      plan.partition_fail_after = std::chrono::milliseconds(v);
      continue;
    }
    PeerFaults& f = node ? plan.per_node[*node] : plan.all;
    if (key == "delay_ms") {
      f.delay_ms = v;
    } else if (key == "drop_after_writes") {
      f.drop_after_writes = v;
    } else if (key == "reset_after_writes") {
      f.reset_after_writes = v;
    } else {
      return bad(absl::StrCat("unknown key '", key,
                              "' (delay_ms, drop_after_writes, reset_after_writes, partition, "
                              "partition_fail_ms)"));
    }
  }
  return plan;
}

namespace {

class FaultGroupLink;

/// What the transport and its links share: the plan and the live links (for the timer).
struct Shared {
  std::mutex mu;  // Guards everything below; taken before any link's mutex.
  FaultPlan plan;
  std::vector<FaultGroupLink*> links;
  std::condition_variable cv;
  bool stop = false;
};

class FaultGroupLink final : public GroupLink {
 public:
  FaultGroupLink(std::shared_ptr<Shared> shared, std::unique_ptr<GroupLink> inner,
                 const GroupLinkOptions& options)
      : shared_(std::move(shared)),
        inner_(std::move(inner)),
        group_(options.group),
        num_nodes_(options.num_nodes),
        self_(options.self_node),
        wake_(options.wake),
        peers_(static_cast<size_t>(options.num_nodes)) {}

  ~FaultGroupLink() override {
    {
      std::lock_guard<std::mutex> l(shared_->mu);
      auto& links = shared_->links;
      links.erase(std::remove(links.begin(), links.end(), this), links.end());
    }
    Close();
  }

  const std::string& group() const { return group_; }

  /// Takes `plan` (under Shared::mu).
  void ApplyPlan(const FaultPlan& plan, Clock::time_point now) {
    std::lock_guard<std::mutex> l(mu_);
    plan_ = plan;
    for (int32_t n = 0; n < num_nodes_; ++n) {
      Peer& p = peers_[static_cast<size_t>(n)];
      if (n == self_ || !plan_.Partitioned(self_, n)) {
        p.partitioned_since.reset();
      } else if (!p.partitioned_since) {
        p.partitioned_since = now;
      }
    }
  }

  /// Posts due delayed writes and fails partitioned peers past their bound (timer thread).
  void Tick(Clock::time_point now) {
    bool woke = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (closed_) return;
      for (int32_t n = 0; n < num_nodes_; ++n) {
        Peer& p = peers_[static_cast<size_t>(n)];
        while (!p.delayed.empty() && p.delayed.front().due <= now && p.failed.ok()) {
          Delayed& d = p.delayed.front();
          const absl::Status s = inner_->PostWrite(n, d.pieces, d.imm);
          if (absl::IsResourceExhausted(s)) break;
          if (!s.ok()) {
            woke |= FailLocked(n, absl::StrCat("a delayed write failed: ", s.message()));
            break;
          }
          p.delayed.pop_front();
        }
        if (p.partitioned_since && p.failed.ok() &&
            now - *p.partitioned_since >= plan_.partition_fail_after) {
          woke |= FailLocked(n, PartitionMessage(n));
        }
      }
    }
    if (woke && wake_) wake_();
  }

  std::string LocalDescriptor() const override { return inner_->LocalDescriptor(); }
  std::string LocalDescriptorFor(int32_t node) const override {
    return inner_->LocalDescriptorFor(node);
  }

  absl::Status Connect(int32_t node, std::string_view descriptor) override {
    std::lock_guard<std::mutex> l(mu_);
    return inner_->Connect(node, descriptor);
  }

  PeerState State(int32_t node) const override {
    std::lock_guard<std::mutex> l(mu_);
    if (Valid(node) && !peers_[static_cast<size_t>(node)].failed.ok()) {
      return PeerState::kFailed;
    }
    return inner_->State(node);
  }

  absl::Status PeerStatus(int32_t node) const override {
    std::lock_guard<std::mutex> l(mu_);
    if (Valid(node) && !peers_[static_cast<size_t>(node)].failed.ok()) {
      return peers_[static_cast<size_t>(node)].failed;
    }
    return inner_->PeerStatus(node);
  }

  absl::Status PostWrite(int32_t node, std::span<const WritePiece> pieces, uint32_t imm) override {
    std::lock_guard<std::mutex> l(mu_);
    if (!Valid(node)) return inner_->PostWrite(node, pieces, imm);
    Peer& p = peers_[static_cast<size_t>(node)];
    if (!p.failed.ok()) return p.failed;
    if (p.partitioned_since) {
      return errors::WithReason(absl::UnavailableError(PartitionMessage(node)),
                                errors::Reason::kTransportFailed);
    }
    const PeerFaults f = plan_.For(node);
    if (f.reset_after_writes && p.posted >= static_cast<uint64_t>(*f.reset_after_writes)) {
      // The engine learns it from the answer: no wake from inside its own call.
      FailLocked(node, absl::StrCat("fault injection: link reset after ", p.posted, " writes"));
      return p.failed;
    }
    if (f.drop_after_writes && p.posted >= static_cast<uint64_t>(*f.drop_after_writes)) {
      ++p.posted;
      ++p.dropped;
      return absl::OkStatus();
    }
    if ((f.delay_ms && *f.delay_ms > 0) || !p.delayed.empty()) {
      Delayed d;
      d.due = Clock::now() + std::chrono::milliseconds(f.delay_ms.value_or(0));
      d.pieces.assign(pieces.begin(), pieces.end());
      d.imm = imm;
      p.delayed.push_back(std::move(d));
    } else {
      EPD_RETURN_IF_ERROR(inner_->PostWrite(node, pieces, imm));
    }
    ++p.posted;
    ++p.passed;
    return absl::OkStatus();
  }

  uint64_t WritesCompleted(int32_t node) const override {
    std::lock_guard<std::mutex> l(mu_);
    const uint64_t inner = inner_->WritesCompleted(node);
    if (!Valid(node)) return inner;
    const Peer& p = peers_[static_cast<size_t>(node)];
    if (!p.failed.ok()) return p.posted;  // Delayed writes were discarded; none is read.
    return inner + (inner == p.passed ? p.dropped : 0);
  }

  bool PollImm(int32_t node, uint32_t* imm) override {
    std::lock_guard<std::mutex> l(mu_);
    if (Valid(node) && peers_[static_cast<size_t>(node)].partitioned_since) {
      uint32_t discard = 0;
      while (inner_->PollImm(node, &discard)) {
      }
      return false;
    }
    return inner_->PollImm(node, imm);
  }

  /// Called by the engine: no wake (it knows). ResetPeer wakes through WakeAfterReset.
  void FailPeer(int32_t node, const absl::Status& cause) override {
    std::lock_guard<std::mutex> l(mu_);
    if (Valid(node)) FailLocked(node, cause.message());
  }

  /// FailPeer from outside the engine (FaultTransport::ResetPeer): wakes the engine.
  void ResetFromOutside(int32_t node, absl::string_view why) {
    bool woke = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (Valid(node)) woke = FailLocked(node, why);
    }
    if (woke && wake_) wake_();
  }

  absl::StatusOr<int> AddSendRegion(const MemoryRegion& region) override {
    return inner_->AddSendRegion(region);
  }
  void RemoveSendRegion(int handle) override { inner_->RemoveSendRegion(handle); }
  LinkCounters Counters(int32_t node) const override { return inner_->Counters(node); }
  void Close() override {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return;
    closed_ = true;
    for (Peer& p : peers_) p.delayed.clear();
    inner_->Close();
  }

 private:
  struct Delayed {
    Clock::time_point due;
    std::vector<WritePiece> pieces;
    uint32_t imm = 0;
  };
  struct Peer {
    uint64_t posted = 0;  // Writes the caller posted (passed + dropped).
    uint64_t passed = 0;  // Posted to the wrapped link or queued for it.
    uint64_t dropped = 0;
    absl::Status failed;  // Set once this wrapper failed the peer.
    std::optional<Clock::time_point> partitioned_since;
    std::deque<Delayed> delayed;
  };

  bool Valid(int32_t node) const { return node >= 0 && node < num_nodes_ && node != self_; }

  std::string PartitionMessage(int32_t node) const {
    return absl::StrCat("fault injection: node ", node, " is partitioned from node ", self_);
  }

  /// Fails `node` (under mu_); true when it was not failed before (wake the engine).
  bool FailLocked(int32_t node, absl::string_view why) {
    Peer& p = peers_[static_cast<size_t>(node)];
    if (!p.failed.ok()) return false;
    p.delayed.clear();
    // The wrapped link's status names the peer's address too; the wrapper's own when that
    // link has no FailPeer.
    inner_->FailPeer(
        node, errors::WithReason(absl::UnavailableError(why), errors::Reason::kTransportFailed));
    p.failed = inner_->PeerStatus(node);
    if (p.failed.ok()) {
      p.failed = errors::WithReason(
          absl::UnavailableError(absl::StrCat("group '", group_, "': node ", node, ": ", why)),
          errors::Reason::kTransportFailed);
      GetLogger(kLogTransport)->warn("{}", p.failed.message());
    }
    return true;
  }

  const std::shared_ptr<Shared> shared_;
  const std::unique_ptr<GroupLink> inner_;
  const std::string group_;
  const int32_t num_nodes_;
  const int32_t self_;
  const std::function<void()> wake_;
  mutable std::mutex mu_;  // Serializes the calls into inner_; guards everything below.
  FaultPlan plan_;
  std::vector<Peer> peers_;
  bool closed_ = false;
};

class FaultTransportImpl final : public FaultTransport {
 public:
  FaultTransportImpl(std::unique_ptr<Transport> inner, FaultPlan plan)
      : inner_(std::move(inner)), shared_(std::make_shared<Shared>()) {
    shared_->plan = std::move(plan);
    timer_ = std::thread([this] { Run(); });
  }
  ~FaultTransportImpl() override { Shutdown(); }

  std::string name() const override { return absl::StrCat("fault(", inner_->name(), ")"); }
  absl::Status CompareDescriptorSettings(std::string_view ours, std::string_view theirs,
                                         std::string_view our_node,
                                         std::string_view their_node) const override {
    return inner_->CompareDescriptorSettings(ours, theirs, our_node, their_node);
  }

  absl::StatusOr<std::unique_ptr<GroupLink>> CreateGroupLink(
      const GroupLinkOptions& options) override {
    absl::StatusOr<std::unique_ptr<GroupLink>> inner = inner_->CreateGroupLink(options);
    if (!inner.ok()) return inner.status();
    auto link = std::make_unique<FaultGroupLink>(shared_, std::move(*inner), options);
    std::lock_guard<std::mutex> l(shared_->mu);
    link->ApplyPlan(shared_->plan, Clock::now());
    shared_->links.push_back(link.get());
    return std::unique_ptr<GroupLink>(std::move(link));
  }

  void Shutdown() override {
    {
      std::lock_guard<std::mutex> l(shared_->mu);
      shared_->stop = true;
    }
    shared_->cv.notify_all();
    if (timer_.joinable()) timer_.join();
    inner_->Shutdown();
  }

  void SetPlan(FaultPlan plan) override {
    std::lock_guard<std::mutex> l(shared_->mu);
    shared_->plan = std::move(plan);
    const Clock::time_point now = Clock::now();
    for (FaultGroupLink* link : shared_->links) link->ApplyPlan(shared_->plan, now);
  }

  FaultPlan plan() const override {
    std::lock_guard<std::mutex> l(shared_->mu);
    return shared_->plan;
  }

  absl::Status ResetPeer(std::string_view group, int32_t node) override {
    std::lock_guard<std::mutex> l(shared_->mu);
    for (FaultGroupLink* link : shared_->links) {
      if (link->group() == group) {
        link->ResetFromOutside(node, "fault injection: link reset");
        return absl::OkStatus();
      }
    }
    return absl::NotFoundError(absl::StrCat("no link of group '", Absl(group), "' here"));
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> l(shared_->mu);
    while (!shared_->stop) {
      shared_->cv.wait_for(l, kTick);
      const Clock::time_point now = Clock::now();
      for (FaultGroupLink* link : shared_->links) link->Tick(now);
    }
  }

  const std::unique_ptr<Transport> inner_;
  const std::shared_ptr<Shared> shared_;
  std::thread timer_;
};

}  // namespace

std::unique_ptr<FaultTransport> MakeFaultTransport(std::unique_ptr<Transport> inner,
                                                   FaultPlan plan) {
  return std::make_unique<FaultTransportImpl>(std::move(inner), std::move(plan));
}

}  // namespace epd::transport
