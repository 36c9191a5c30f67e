// In-process fakes of the transport and the peer mesh (daemon/transport/transport.h,
// daemon/peer/peer_mesh.h) for tests of groups that span nodes: several HostDataPlanes in
// one process act as the nodes; a FakeHub joins them. A FakeLink's PostWrite copies the
// pieces straight into the peer link's receive region (memcpy, bounds checked) and queues
// the immediate there; FakePeers read each other's registrations from the hub. Kill(node)
// makes that node lost: its links fail and Health names it. Hostile(node, fn) lets a test
// rewrite what a node's writes leave in a peer's region (a peer daemon sending garbage).
// A strict FakeTransport (the default) refuses, as the RDMA transport does and with the same
// check (link_common.h FirstSourceOutside), a write piece whose source lies outside every
// region the link was given (receive region, send_regions, AddSendRegion).
#pragma once

#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/peer/peer_mesh.h"
#include "daemon/transport/link_common.h"
#include "daemon/transport/transport.h"

namespace epd::testing {

class FakeHub {
 public:
  struct LinkState {
    transport::GroupLinkOptions options;
    uint64_t generation = 0;  ///< Set by AddLink: tells the incarnations of a node apart.
    /// From node n: each immediate with the generation of the link that sent it.
    std::map<int32_t, std::deque<std::pair<uint64_t, uint32_t>>> inbox;
    std::map<int32_t, uint64_t> completed;  // Writes to node n.
  };

  /// Registers a link of (group, node); replaces an earlier one.
  void AddLink(const std::string& group, int32_t node, LinkState* s) {
    std::lock_guard<std::mutex> lock(mu_);
    s->generation = ++generations_;
    links_[{group, node}] = s;
  }
  void RemoveLink(const std::string& group, int32_t node, LinkState* s) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find({group, node});
    if (it != links_.end() && it->second == s) links_.erase(it);
  }
  /// Makes node `node` lost (its daemon died).
  void Kill(int32_t node) {
    std::lock_guard<std::mutex> lock(mu_);
    dead_.insert(node);
  }
  bool Dead(int32_t node) const {
    std::lock_guard<std::mutex> lock(mu_);
    return dead_.count(node) > 0;
  }
  /// Called (under the hub's lock) on the bytes of every write node `from` lands in a peer's
  /// region, with the write's region offset and size: a hostile peer's garbage.
  void Hostile(int32_t from,
               std::function<void(uint8_t* base, uint64_t offset, uint64_t bytes)> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    hostile_[from] = std::move(fn);
  }

  absl::Status Write(const std::string& group, int32_t from, int32_t to,
                     std::span<const transport::WritePiece> pieces, uint32_t imm) {
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (dead_.count(to) || dead_.count(from)) {
        return absl::UnavailableError(absl::StrCat("fake link: node ", to, " is lost"));
      }
      auto it = links_.find({group, to});
      if (it == links_.end()) return absl::UnavailableError("fake link: peer not there");
      LinkState* peer = it->second;
      for (const auto& p : pieces) {
        if (p.remote_offset > peer->options.recv_bytes ||
            p.bytes > peer->options.recv_bytes - p.remote_offset) {
          return absl::InvalidArgumentError(absl::StrCat("fake link: piece at ", p.remote_offset,
                                                         " + ", p.bytes, " outside the region"));
        }
      }
      auto* base = static_cast<uint8_t*>(peer->options.recv_base);
      for (const auto& p : pieces) {
        if (p.bytes > 0) std::memcpy(base + p.remote_offset, p.src, p.bytes);
        auto h = hostile_.find(from);
        if (h != hostile_.end()) h->second(base, p.remote_offset, p.bytes);
      }
      auto self = links_.find({group, from});
      peer->inbox[from].push_back({self != links_.end() ? self->second->generation : 0, imm});
      wake = peer->options.wake;
      if (self != links_.end()) ++self->second->completed[to];
    }
    if (wake) wake();
    return absl::OkStatus();
  }

  /// GroupLink::Connect again for `node` (a new incarnation): the immediates of its earlier
  /// links still undelivered are dropped (its current link's are kept) and the count of
  /// writes to it starts anew.
  void Reconnect(LinkState* s, const std::string& group, int32_t node) {
    std::lock_guard<std::mutex> lock(mu_);
    auto current = links_.find({group, node});
    const uint64_t now = current != links_.end() ? current->second->generation : 0;
    auto& q = s->inbox[node];
    std::erase_if(q, [now](const auto& e) { return e.first != now; });
    s->completed.erase(node);
  }
  bool Pop(LinkState* s, int32_t from, uint32_t* imm) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& q = s->inbox[from];
    if (q.empty()) return false;
    *imm = q.front().second;
    q.pop_front();
    return true;
  }
  uint64_t Completed(LinkState* s, int32_t to) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = s->completed.find(to);
    return it == s->completed.end() ? 0 : it->second;
  }
  /// The generation of (group, node)'s current link; 0 when it has none.
  uint64_t LinkGeneration(const std::string& group, int32_t node) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find({group, node});
    return it != links_.end() ? it->second->generation : 0;
  }

  // ---- the mesh's registry ----
  void Register(const std::string& group, int32_t node, const std::string& descriptor) {
    std::lock_guard<std::mutex> lock(mu_);
    registered_[{group, node}] = {++incarnation_, descriptor};
  }
  void Unregister(const std::string& group, int32_t node) {
    std::lock_guard<std::mutex> lock(mu_);
    registered_.erase({group, node});
  }
  std::optional<peer::PeerDescriptor> Descriptor(const std::string& group, int32_t node) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = registered_.find({group, node});
    if (it == registered_.end()) return std::nullopt;
    return it->second;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int32_t>, LinkState*> links_;
  std::map<std::pair<std::string, int32_t>, peer::PeerDescriptor> registered_;
  std::map<int32_t, std::function<void(uint8_t*, uint64_t, uint64_t)>> hostile_;
  std::set<int32_t> dead_;
  uint64_t incarnation_ = 0;
  uint64_t generations_ = 0;
};

class FakeLink : public transport::GroupLink {
 public:
  /// `strict_sources`: refuse sources outside the link's regions (RDMA's rule).
  /// `descriptor`: what LocalDescriptor answers ("" = "fake:<self_node>", the one peers
  /// accept).
  FakeLink(FakeHub* hub, const transport::GroupLinkOptions& o, bool strict_sources,
           std::string descriptor = "")
      : hub_(hub), strict_(strict_sources), descriptor_(std::move(descriptor)) {
    state_.options = o;
    const auto add = [this](const void* base, uint64_t bytes) {
      const auto at = reinterpret_cast<uint64_t>(base);
      if (bytes > 0) sources_.push_back({at, at + bytes, -1});
    };
    add(o.recv_base, o.recv_bytes);
    for (const transport::MemoryRegion& r : o.send_regions) add(r.base, r.bytes);
    hub_->AddLink(o.group, o.self_node, &state_);
  }
  ~FakeLink() override { Close(); }
  std::string LocalDescriptor() const override {
    return descriptor_.empty() ? absl::StrCat("fake:", state_.options.self_node) : descriptor_;
  }
  absl::Status Connect(int32_t node, std::string_view descriptor) override {
    if (descriptor != absl::StrCat("fake:", node)) {
      return absl::InvalidArgumentError(absl::StrCat("bad descriptor ", std::string(descriptor)));
    }
    if (!connected_.insert(node).second) hub_->Reconnect(&state_, state_.options.group, node);
    connected_generation_[node] = hub_->LinkGeneration(state_.options.group, node);
    return absl::OkStatus();
  }
  transport::PeerState State(int32_t node) const override {
    if (hub_->Dead(node)) return transport::PeerState::kFailed;
    if (!connected_.count(node)) return transport::PeerState::kIdle;
    // Ready once the peer's link is there; a link of the peer's that replaced the one this
    // end connected to (the peer restarted) needs Connect again, as a real connection to
    // a restarted daemon would.
    const uint64_t g = hub_->LinkGeneration(state_.options.group, node);
    auto it = connected_generation_.find(node);
    const bool current =
        g != 0 && (it == connected_generation_.end() || it->second == 0 || it->second == g);
    return current ? transport::PeerState::kReady : transport::PeerState::kConnecting;
  }
  absl::Status PeerStatus(int32_t node) const override {
    if (hub_->Dead(node)) {
      return absl::UnavailableError(absl::StrCat("node ", node, ": connection lost (fake)"));
    }
    return absl::OkStatus();
  }
  absl::Status PostWrite(int32_t node, std::span<const transport::WritePiece> pieces,
                         uint32_t imm) override {
    if (strict_) {
      if (const ptrdiff_t bad =
              transport::FirstSourceOutside(pieces, std::span<const Source>(sources_));
          bad >= 0) {
        ++refused_sources_;
        return transport::SourceOutsideError(pieces, bad, absl::StrCat("fake link to node ", node));
      }
    }
    return hub_->Write(state_.options.group, state_.options.self_node, node, pieces, imm);
  }
  uint64_t WritesCompleted(int32_t node) const override {
    return hub_->Completed(const_cast<FakeHub::LinkState*>(&state_), node);
  }
  bool PollImm(int32_t node, uint32_t* imm) override { return hub_->Pop(&state_, node, imm); }
  /// Fixed counts, so that tests see them reach the scrape: 10 + node retransmits.
  transport::LinkCounters Counters(int32_t node) const override {
    return {.retransmits = 10 + node, .error_completions = -1};
  }
  absl::StatusOr<int> AddSendRegion(const transport::MemoryRegion& region) override {
    if (!add_region_error.ok()) return add_region_error;
    if (region.base == nullptr || region.bytes == 0) {
      return absl::InvalidArgumentError("fake link: empty or null send region");
    }
    const auto at = reinterpret_cast<uint64_t>(region.base);
    sources_.push_back({at, at + region.bytes, next_handle_});
    return next_handle_++;
  }
  void RemoveSendRegion(int handle) override {
    std::erase_if(sources_, [handle](const Source& s) { return s.handle == handle; });
  }
  void Close() override {
    hub_->RemoveLink(state_.options.group, state_.options.self_node, &state_);
  }
  /// Regions the link holds now (receive region, send_regions and those added).
  size_t num_source_regions() const { return sources_.size(); }
  /// Writes refused for a source outside them.
  uint64_t refused_sources() const { return refused_sources_; }
  /// Not OK: AddSendRegion fails with it (a registration the memlock limit stops).
  absl::Status add_region_error;

 private:
  struct Source {
    uint64_t begin = 0, end = 0;
    int handle = -1;  ///< AddSendRegion's; -1 for the options' regions.
  };
  FakeHub* hub_;
  FakeHub::LinkState state_;
  std::set<int32_t> connected_;
  /// The peer's link generation at the last Connect (0: its link was not there yet).
  std::map<int32_t, uint64_t> connected_generation_;
  bool strict_ = true;
  std::string descriptor_;
  std::vector<Source> sources_;
  int next_handle_ = 0;
  uint64_t refused_sources_ = 0;
};

class FakeTransport : public transport::Transport {
 public:
  /// `strict_sources`: links refuse write sources outside their regions, as RDMA does;
  /// false: sources anywhere, as TCP takes them.
  explicit FakeTransport(FakeHub* hub, bool strict_sources = true)
      : hub_(hub), strict_(strict_sources) {}
  std::string name() const override { return "fake"; }
  absl::StatusOr<std::unique_ptr<transport::GroupLink>> CreateGroupLink(
      const transport::GroupLinkOptions& o) override {
    auto link = std::make_unique<FakeLink>(hub_, o, strict_, descriptor);
    last_link_ = link.get();
    return std::unique_ptr<transport::GroupLink>(std::move(link));
  }
  /// The link created last (owned by its caller; valid while it lives).
  FakeLink* last_link() const { return last_link_; }
  /// Not "": the descriptor links created from now on publish (peers refuse it).
  std::string descriptor;
  void Shutdown() override {}

 private:
  FakeHub* hub_;
  bool strict_ = true;
  FakeLink* last_link_ = nullptr;
};

class FakePeers : public peer::GroupPeers {
 public:
  FakePeers(FakeHub* hub, peer::GroupMembership m) : hub_(hub), m_(std::move(m)) {
    hub_->Register(m_.spec.name(), m_.self_node, m_.transport_descriptor);
  }
  ~FakePeers() override { hub_->Unregister(m_.spec.name(), m_.self_node); }
  std::optional<peer::PeerDescriptor> Descriptor(int32_t node) const override {
    return hub_->Descriptor(m_.spec.name(), node);
  }
  absl::Status Health() const override {
    for (int32_t n = 0; n < m_.spec.nodes_size(); ++n) {
      if (n != m_.self_node && hub_->Dead(n)) {
        return absl::UnavailableError(absl::StrCat("node ", n, " (",
                                                   m_.spec.nodes(n).peer_address(),
                                                   ") is lost: its daemon stopped answering"));
      }
    }
    return absl::OkStatus();
  }
  std::string DescribeMissing() const override {
    std::string out;
    for (int32_t n = 0; n < m_.spec.nodes_size(); ++n) {
      if (n != m_.self_node && !hub_->Descriptor(m_.spec.name(), n)) {
        absl::StrAppend(&out, out.empty() ? "" : "; ", "node ", n, " (",
                        m_.spec.nodes(n).peer_address(), ") has not joined");
      }
    }
    return out;
  }
  void SetLocalRanksJoined(const std::vector<bool>&) override {}

 private:
  FakeHub* hub_;
  peer::GroupMembership m_;
};

class FakeMesh : public peer::PeerMesh {
 public:
  FakeMesh(FakeHub* hub, std::string address) : hub_(hub), address_(std::move(address)) {}
  absl::StatusOr<std::unique_ptr<peer::GroupPeers>> RegisterGroup(
      peer::GroupMembership m) override {
    registered_join_secret_digest_ = m.join_secret_digest;
    return std::unique_ptr<peer::GroupPeers>(std::make_unique<FakePeers>(hub_, std::move(m)));
  }
  std::string advertised_address() const override { return address_; }
  /// A stand-in for the keyed digest: differs by group and secret, shows neither.
  std::string JoinSecretDigest(std::string_view group,
                               std::string_view join_secret) const override {
    std::string both(group);
    both.push_back('\0');
    both.append(join_secret);
    return std::to_string(std::hash<std::string>{}(both));
  }
  /// GroupMembership.join_secret_digest of the last group registered.
  const std::string& registered_join_secret_digest() const {
    return registered_join_secret_digest_;
  }

 private:
  FakeHub* hub_;
  std::string address_;
  std::string registered_join_secret_digest_;
};

}  // namespace epd::testing
