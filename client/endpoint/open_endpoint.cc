// OpenEndpoint (endpoint_internal.h): checks the daemon's description of an endpoint (shm
// ABI, region table, backend and launch mode), maps its region, doorbell and data area, and
// picks its runner (DaemonLaunch or ClientLaunch).
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/endpoint/daemon_launch.h"
#include "client/endpoint/endpoint_internal.h"
#include "client/endpoint/endpoint_state.h"
#include "common/env_switch.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"
#include "epd/kernels/op_rules.h"

#if EPD_HAVE_CUDA
#include "client/cuda/area_cache.h"
#include "client/endpoint/client_launch.h"
#endif

namespace epd::internal {

absl::StatusOr<std::unique_ptr<Endpoint>> OpenEndpoint(const v1::EndpointInfo& info,
                                                       const v1::GroupSpec& spec, EndpointFds fds,
                                                       std::function<absl::Status()> leave,
                                                       std::shared_ptr<SessionWatch> session,
                                                       GroupEndpointsFn group_endpoints,
                                                       RankMaskFn rank_mask) {
  auto m = std::make_unique<Endpoint::Impl>();
  m->info = info;
  m->spec = spec;
  m->leave = std::move(leave);
  m->rank_mask = std::move(rank_mask);
  m->shape = rules::ShapeOf(spec);
  m->layout = kernels::EndpointLayout::Compute(m->shape);
  if (info.abi_version() != abi::kShmAbiVersion) {
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat("epd speaks shm ABI ", info.abi_version(),
                                                   ", this client ", abi::kShmAbiVersion)),
        errors::Reason::kVersionIncompatible);
  }
  if (info.backend() == "cuda") {
#if EPD_HAVE_CUDA
    m->cuda = true;
#else
    return errors::WithReason(
        absl::UnimplementedError(
            "the daemon offers a CUDA-backend endpoint but this libepdclient was built without "
            "CUDA"),
        errors::Reason::kUnsupported);
#endif
  } else if (info.backend() != "host") {
    return errors::WithReason(
        absl::UnimplementedError(
            absl::StrCat("this libepdclient maps 'host' and 'cuda' endpoints; the daemon offers '",
                         info.backend(), "'")),
        errors::Reason::kUnsupported);
  }
  if (info.launch_mode() == v1::LAUNCH_MODE_CLIENT && !m->cuda) {
    return absl::FailedPreconditionError(
        "the daemon granted a client-launched endpoint on the host backend; client-launched "
        "mode needs the CUDA backend");
  }
  // The daemon's regions must be the ones this client computes (same layout version).
  std::map<std::string, kernels::Region> mine;
  m->layout.ForEachRegion([&](const char* n, const kernels::Region& r) { mine[n] = r; });
  for (const v1::BufferRegion& br : info.regions()) {
    auto it = mine.find(br.name());
    if (it == mine.end() || it->second.offset != br.offset() || it->second.bytes != br.bytes()) {
      return absl::FailedPreconditionError(
          absl::StrCat("buffer region '", br.name(), "' differs between epd and this client"));
    }
  }
  if (fds.endpoint_id != info.endpoint_id()) {
    return absl::FailedPreconditionError(absl::StrCat("epd handed the memory of endpoint ",
                                                      fds.endpoint_id, " for endpoint ",
                                                      info.endpoint_id()));
  }
  // Sealed memfds of the expected sizes only: nothing can shrink them under the mapping.
  const std::string what = absl::StrCat("group ", info.group(), " rank ", info.rank());
  EPD_ASSIGN_OR_RETURN(ShmRegion region, ShmRegion::Map(std::move(fds.region), info.shm_bytes(),
                                                        absl::StrCat(what, ": endpoint region")));
  EPD_ASSIGN_OR_RETURN(ShmRegion doorbell,
                       ShmRegion::Map(std::move(fds.doorbell), sizeof(abi::DoorbellPage),
                                      absl::StrCat(what, ": doorbell")));
  // The doorbell page is shared with other clients of the engine, who can write its
  // header: only its two words are used, so its magic is not checked.
  const abi::EndpointShmHeader& h = *reinterpret_cast<const abi::EndpointShmHeader*>(region.data());
  if (h.magic != abi::kEndpointMagic || h.version != abi::kShmAbiVersion ||
      h.size != sizeof(abi::EndpointShmHeader) || h.total_bytes != info.shm_bytes() ||
      h.data_offset != info.data_offset() || h.data_bytes < m->layout.total_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the endpoint region has a bad header (magic/version/size)"));
  }
  m->data = region.data() + h.data_offset;
  m->ring = RingChannel(std::move(region), std::move(doorbell), spec.name(), info.rank(),
                        info.op_timeout_ms(), session);
#if EPD_HAVE_CUDA
  if (m->cuda) {
    EPD_ASSIGN_OR_RETURN(m->mapping, MapSharedArea(info.cuda_ipc_handle(), info.gpu_uuid()));
    m->data = m->mapping->data();
    m->device = DLDevice{kDLCUDA, m->mapping->device()};
    m->client_launched = info.launch_mode() == v1::LAUNCH_MODE_CLIENT;
    DeviceGuard guard(m->mapping->device());
    EPD_ASSIGN_OR_RETURN(m->aux_stream, CreateStream());
    if (!m->client_launched) {
      int mps = 0;
      if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, m->mapping->device()) !=
          cudaSuccess) {
        cudaGetLastError();  // Ours: no MPS assumed (the stream wait).
        mps = 0;
      }
      // EPD_KERNEL_DONE_WAIT=0: the stream waits of before (an A/B and fallback switch);
      // unset, empty or "1": as the daemon says.
      const absl::StatusOr<bool> allowed = SwitchFromEnv("EPD_KERNEL_DONE_WAIT", /*unset=*/true);
      if (!allowed.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": ", allowed.status().message()));
      }
      m->kernel_done_wait = info.kernel_done_wait() && mps != 0 && *allowed;
      m->program_kernel_done_wait = info.program_kernel_done_wait() && mps != 0 && *allowed;
    }
  }
  if (m->client_launched) {
    m->runner = std::make_unique<ClientLaunch>(*m, std::move(group_endpoints));
  }
#else
  (void)group_endpoints;
#endif
  if (m->runner == nullptr) m->runner = std::make_unique<DaemonLaunch>(*m);
  m->next_seq = info.first_seq();
  m->parity.dispatches = info.first_ll_dispatches();
  m->parity.combines = info.first_ll_combines();
#if EPD_HAVE_CUDA
  if (m->client_launched) {
    EPD_RETURN_IF_ERROR(static_cast<ClientLaunch&>(*m->runner).PrepareWithoutPeers());
  }
#endif
  abi::Atomic(m->ring.header().client_pid).store(static_cast<uint32_t>(::getpid()));
  abi::Atomic(m->ring.header().client_mapped).store(1, std::memory_order_release);
  m->session = std::move(session);
  if (m->session != nullptr && m->cuda) {
    // A daemon that dies leaves the streams of daemon-launched ops waiting: release them.
    Endpoint::Impl* raw = m.get();
    m->session_hook = m->session->AddHook([raw] { raw->runner->ReleaseStreams(); });
  }
  return std::make_unique<Endpoint>(std::move(m));
}

}  // namespace epd::internal
