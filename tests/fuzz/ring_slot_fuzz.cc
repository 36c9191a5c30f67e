// Fuzz target: arbitrary bytes written straight into an endpoint's request ring (as a
// misbehaving process that maps the shm could), interleaved with the real client's ops.
// Properties checked on every input (abort() on violation, so the driver reports it):
// - the daemon never crashes or hangs on a slot;
// - every op of the real clients afterwards completes (OK, or an error for an op the
//   garbage consumed), and the op after that succeeds: the group keeps working;
// - a garbage slot is never executed as somebody's op on another rank.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

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

  World() {
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
  }

  /// Both ranks run GetDispatchLayout; returns their statuses.
  std::vector<absl::Status> Round() {
    std::vector<absl::Status> st(2);
    std::vector<std::thread> t;
    for (int r = 0; r < 2; ++r) {
      t.emplace_back([&, r] {
        auto op = eps[r]->GetDispatchLayout(idx_t);
        if (!op.ok()) {
          st[r] = op.status();
          return;
        }
        auto res = op->Wait(absl::Seconds(5));
        st[r] = res.status();
        if (res.ok() && res->num_tokens_per_expert.as<int32_t>()[0] != 2) {
          std::fprintf(stderr, "fuzz: wrong layout result\n");
          std::abort();
        }
      });
    }
    for (auto& th : t) th.join();
    return st;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World* world = new World();  // Lives for the whole fuzzing process.
  auto* h = reinterpret_cast<epd::abi::EndpointShmHeader*>(world->evil.data());
  auto* ring = reinterpret_cast<epd::abi::RequestSlot*>(world->evil.data() + h->ring_offset);
  // Up to 3 slots of fuzz bytes. Bias: sometimes a valid magic and the expected seq, so
  // the validation of every field is reached, not only the magic check.
  size_t n = std::min<size_t>(size / sizeof(epd::abi::RequestSlot), 3);
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
  world->Round();
  auto st = world->Round();
  auto st2 = world->Round();
  if (!st2[0].ok() || !st2[1].ok()) {
    std::fprintf(stderr, "fuzz: group did not recover: %s / %s\n", st2[0].ToString().c_str(),
                 st2[1].ToString().c_str());
    std::abort();
  }
  (void)st;
  return 0;
}
