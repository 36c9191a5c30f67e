// Fuzz target: arbitrary bytes written straight into an endpoint's request ring (as a
// misbehaving process that maps the shm could), interleaved with the real client's ops.
// Properties checked on every input (abort() on violation, so the driver reports it):
// - the daemon never crashes or hangs on a slot;
// - every op of the real clients afterwards completes (OK, or an error for an op the
//   garbage consumed), and the op after that succeeds: the group keeps working;
// - a garbage slot is never executed as somebody's op on another rank.
// A byte after the slots (inputs of a length that is not a multiple of 64) selects a group
// whose on_rank_failure is MASK (bit 0) and what its client does meanwhile: bits 1-2 mask
// rank 1 or rank 0 before the slots are written, or (both set) have rank 1 sit out the
// first round; bit 3 unmasks the rank after the first round; bit 4 queries the mask
// between rounds. There too, every op completes, an OK op's mask is within the group
// (epoch never decreasing, num_masked <= R, dropped pairs <= its T * K), and once the client
// cleans the mask the group works again within four rounds.
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "client/endpoint/endpoint_internal.h"
#include "common/os/shm_region.h"
#include "daemon/dataplane/host/host_data_plane.h"
#include "epd/client.h"
#include "proto/abi/shm_abi.h"
#include "spdlog/spdlog.h"
#include "tests/common/dtypes.h"

namespace {

using epd::DataPlane;
using epd::DataPlaneGroup;
using epd::Endpoint;
using epd::EndpointFds;
using epd::ScopedFd;
using epd::ShmRegion;
using ::epd::testing::kI64;
namespace v1 = epd::v1;
namespace internal = epd::internal;

struct World {
  std::unique_ptr<DataPlane> plane;
  std::unique_ptr<DataPlaneGroup> group;
  v1::GroupSpec spec;
  std::vector<std::unique_ptr<Endpoint>> eps;
  ShmRegion evil;  // A second mapping of rank 1's region.
  std::vector<int64_t> idx{0, 1, 2, -1, 3, 0};
  std::vector<int64_t> shape{3, 2};
  DLTensor idx_t{};
  std::vector<uint16_t> x = std::vector<uint16_t>(3 * 128, 0x3f80);  // [3, 128] bf16 ones.
  std::vector<int64_t> x_shape{3, 128};
  DLTensor x_t{};

  explicit World(v1::RankFailurePolicy policy) {
    spdlog::set_level(spdlog::level::off);
    epd::HostDataPlaneOptions o;
    o.op_timeout_ms = 200;
    o.host_threads = 1;
    plane = std::move(epd::MakeHostDataPlane(o).value());
    spec.set_name("fuzz");
    spec.set_num_ranks(2);
    spec.set_num_experts(4);
    spec.set_hidden(128);
    spec.set_num_topk(2);
    spec.set_max_tokens_per_rank(4);
    spec.set_ll_max_tokens_per_rank(4);
    spec.set_on_rank_failure(policy);
    group = std::move(plane->CreateGroup(spec).value());
    for (int r = 0; r < 2; ++r) {
      v1::EndpointInfo info;
      if (!group->AttachRank(r, "", v1::LAUNCH_MODE_UNSPECIFIED, {}, &info).ok()) std::abort();
      EndpointFds fds = std::move(group->TakeEndpointFds(r).value());
      if (r == 1) {
        evil = std::move(
            ShmRegion::Map(ScopedFd(::dup(fds.region.get())), info.shm_bytes(), "fuzz").value());
      }
      eps.push_back(std::move(internal::OpenEndpoint(info, spec, std::move(fds), [] {
                                return absl::OkStatus();
                              }).value()));
    }
    idx_t.data = idx.data();
    idx_t.device = {kDLCPU, 0};
    idx_t.ndim = 2;
    idx_t.dtype = kI64;
    idx_t.shape = shape.data();
    x_t = epd::MakeDLTensor(x.data(), ::epd::testing::kBf16, x_shape);
  }

  /// Both ranks (but `sit_out`) run GetDispatchLayout (a MASK group: a dispatch, whose
  /// result carries the op's mask); returns their statuses.
  std::vector<absl::Status> Round(int sit_out = -1) {
    const bool masking = spec.on_rank_failure() == v1::RANK_FAILURE_POLICY_MASK;
    std::vector<absl::Status> st(2);
    std::vector<std::thread> t;
    for (int r = 0; r < 2; ++r) {
      if (r == sit_out) continue;
      t.emplace_back([&, r] { st[r] = masking ? Dispatch(r) : Layout(r); });
    }
    for (auto& th : t) th.join();
    return st;
  }

  absl::Status Layout(int r) {
    auto op = eps[r]->GetDispatchLayout(idx_t);
    if (!op.ok()) return op.status();
    auto res = op->Wait(absl::Seconds(5));
    if (res.ok() && res->num_tokens_per_expert.as<int32_t>()[0] != 2) {
      std::fprintf(stderr, "fuzz: wrong layout result\n");
      std::abort();
    }
    return res.status();
  }

  /// Rank r's dispatch. A rank behind the group (its op ran without it) submits again at
  /// once, as a client catching up does, a ring's worth of times at most.
  absl::Status Dispatch(int r) {
    epd::DispatchArgs a;
    a.x = &x_t;
    a.topk_idx = &idx_t;
    absl::Status st;
    for (uint32_t i = 0; i < epd::abi::kRingCapacity; ++i) {
      auto op = eps[r]->Dispatch(a);
      if (!op.ok()) return op.status();
      auto res = op->Wait(absl::Seconds(5));
      if (res.ok()) CheckOpMask(res->mask);
      st = res.status();
      if (st.code() != absl::StatusCode::kFailedPrecondition ||
          !absl::StrContains(st.message(), ", which was masked")) {
        break;
      }
    }
    return st;
  }

  /// An OK op's mask: within the group, its epoch never going back.
  void CheckOpMask(const epd::OpMask& m) {
    uint32_t seen = mask_epoch.load();
    while (m.epoch > seen && !mask_epoch.compare_exchange_weak(seen, m.epoch)) {
    }
    if (m.epoch < seen || m.num_masked < 0 || m.num_masked > spec.num_ranks() ||
        m.dropped_pairs < 0 || m.dropped_pairs > static_cast<int32_t>(idx.size())) {
      std::fprintf(stderr,
                   "fuzz: op mask out of range: epoch %u (seen %u), %d masked, %d dropped\n",
                   m.epoch, seen, m.num_masked, m.dropped_pairs);
      std::abort();
    }
  }

  /// The group's mask as its client queries it: ranks ascending, within the group.
  void CheckQuery() {
    auto m = group->GetRankMask();
    if (!m.ok()) {
      std::fprintf(stderr, "fuzz: mask query failed: %s\n", m.status().ToString().c_str());
      std::abort();
    }
    int32_t last = -1;
    for (int32_t r : m->masked_ranks()) {
      if (r <= last || r >= spec.num_ranks()) {
        std::fprintf(stderr, "fuzz: mask query names rank %d after %d\n", r, last);
        std::abort();
      }
      last = r;
    }
  }

  /// Asks for a mask change as a client would; its errors (a rank not joined) are answers.
  void UpdateMask(std::vector<int32_t> mask, std::vector<int32_t> unmask, bool clean) {
    auto m = group->UpdateRankMask(mask, unmask, clean);
    if (!m.ok() && m.status().code() != absl::StatusCode::kFailedPrecondition) {
      std::fprintf(stderr, "fuzz: mask update failed: %s\n", m.status().ToString().c_str());
      std::abort();
    }
  }

  std::atomic<uint32_t> mask_epoch{0};  ///< Highest epoch an OK op reported.
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Both live for the whole fuzzing process.
  static World* fail_world = new World(v1::RANK_FAILURE_POLICY_FAIL);
  static World* mask_world = nullptr;
  size_t n = std::min<size_t>(size / sizeof(epd::abi::RequestSlot), 3);
  const size_t control_at = n * sizeof(epd::abi::RequestSlot);
  const uint8_t control = size > control_at ? data[control_at] : 0;
  const bool masking = control & 1;
  if (masking && mask_world == nullptr) mask_world = new World(v1::RANK_FAILURE_POLICY_MASK);
  World* world = masking ? mask_world : fail_world;
  // Bits 1-2: 1 masks rank 1, 2 masks rank 0, 3 has rank 1 sit out the first round (it is
  // masked for being late). The other rank may be masked already: every rank masked too.
  std::vector<int32_t> masked;
  const int sit_out = masking && (control & 6) == 6 ? 1 : -1;
  if (masking && sit_out < 0 && (control & 6) != 0) {
    masked.push_back((control & 2) ? 1 : 0);
    world->UpdateMask(masked, {}, false);
  }
  if (sit_out >= 0) masked.push_back(sit_out);
  auto* h = reinterpret_cast<epd::abi::EndpointShmHeader*>(world->evil.data());
  auto* ring = reinterpret_cast<epd::abi::RequestSlot*>(world->evil.data() + h->ring_offset);
  // Up to 3 slots of fuzz bytes. Bias: sometimes a valid magic and the expected seq, so
  // the validation of every field is reached, not only the magic check.
  for (size_t i = 0; i < n; ++i) {
    epd::abi::RequestSlot slot;
    std::memcpy(&slot, data + i * sizeof(slot), sizeof(slot));
    if (data[i * sizeof(slot)] & 1) {
      slot.magic = epd::abi::kRequestMagic;
      slot.seq = epd::abi::Atomic(h->ring_head).load() + 1;  // The seq rank 1 is due.
    }
    uint64_t head = epd::abi::Atomic(h->ring_head).load();
    std::memcpy(&ring[(head + 1) % epd::abi::kRingCapacity], &slot, sizeof(slot));
    epd::abi::Atomic(h->ring_head).store(head + 1);
  }
  // A garbage slot with the due seq is consumed as rank 1's op (and fails it); the client
  // of rank 1 does not know, so its next request is then dropped as stale, and it waits
  // for a completion that already came. Rounds must complete either way, and within two
  // rounds everything is back in step.
  world->Round(sit_out);
  if (masking && (control & 8) && !masked.empty()) world->UpdateMask({}, masked, false);
  if (masking && (control & 16)) world->CheckQuery();
  auto st = world->Round();
  (void)st;
  if (!masking) {
    auto st2 = world->Round();
    if (!st2[0].ok() || !st2[1].ok()) {
      std::fprintf(stderr, "fuzz: group did not recover: %s / %s\n", st2[0].ToString().c_str(),
                   st2[1].ToString().c_str());
      std::abort();
    }
    return 0;
  }
  // A MASK group may have masked a rank the garbage put out of step (or the client did):
  // the client cleans the mask, and within four rounds both ranks take part again.
  world->UpdateMask({}, {}, true);
  if (control & 16) world->CheckQuery();
  std::vector<absl::Status> last;
  for (int round = 0; round < 4; ++round) {
    last = world->Round();
    if (last[0].ok() && last[1].ok()) return 0;
  }
  std::fprintf(stderr, "fuzz: MASK group did not recover after a clean: %s / %s\n",
               last[0].ToString().c_str(), last[1].ToString().c_str());
  std::abort();
}
