#include "daemon/gpu/gpu_inventory.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errors/reason.h"
#include "common/gpu_uuid.h"
#include "common/status_macros.h"

#if EPD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace epd {
namespace {

/// PCI bus ids compare without case and with the domain optional ("3B:00.0" ==
/// "0000:3b:00.0"; CUDA reports "00000000:3B:00.0" from some APIs).
std::string NormalizePciBusId(std::string id) {
  id = absl::AsciiStrToLower(id);
  size_t first = id.find(':');
  if (first != std::string::npos && id.find(':', first + 1) != std::string::npos) {
    std::string domain = id.substr(0, first);
    size_t nonzero = domain.find_first_not_of('0');
    domain = nonzero == std::string::npos ? "0" : domain.substr(nonzero);
    return absl::StrCat(domain, id.substr(first));
  }
  return absl::StrCat("0", id.empty() ? "" : ":", id);
}

#if EPD_HAVE_CUDA
std::string CudaError(const char* call, cudaError_t err) {
  return absl::StrCat(call, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

#endif

}  // namespace

absl::Status CheckComputeCapability(const std::string& what, int major, int minor) {
  if (major >= kMinComputeCapabilityMajor) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      what, " has compute capability ", major, ".", minor, " (sm_", major, minor,
      "); epd's kernels need sm_", kMinComputeCapabilityMajor,
      "0 or newer (Ampere, Hopper): they are built for compute_", kMinComputeCapabilityMajor,
      "0 and up and use its bf16 instructions; use a newer GPU or the host backend"));
}

GpuInventory GpuInventory::FromList(std::vector<v1::GpuInfo> gpus, std::string reason,
                                    MpsStatus mps) {
  GpuInventory inventory;
  inventory.gpus_ = std::move(gpus);
  inventory.reason_ = std::move(reason);
  inventory.mps_ = std::move(mps);
  return inventory;
}

absl::StatusOr<GpuInventory> GpuInventory::Discover(const std::vector<std::string>& allowed_uuids) {
  GpuInventory inventory;
  inventory.mps_ = DetectMps();
#if EPD_HAVE_CUDA
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    inventory.reason_ = err != cudaSuccess ? absl::StrCat("no usable CUDA device: ",
                                                          CudaError("cudaGetDeviceCount", err))
                                           : "no CUDA device found (cudaGetDeviceCount = 0)";
    cudaGetLastError();  // Clear the error so later CUDA calls start clean.
  } else {
    std::vector<v1::GpuInfo> all;
    for (int dev = 0; dev < count; ++dev) {
      cudaDeviceProp prop{};
      if ((err = cudaGetDeviceProperties(&prop, dev)) != cudaSuccess) {
        return errors::WithReason(
            absl::UnavailableError(
                absl::StrCat("GPU ordinal ", dev, ": ", CudaError("cudaGetDeviceProperties", err))),
            errors::Reason::kGpuUnavailable);
      }
      v1::GpuInfo info;
      info.set_ordinal(dev);
      info.set_uuid(FormatGpuUuid(prop.uuid.bytes));
      char bus_id[32] = {};
      if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), dev) == cudaSuccess) {
        info.set_pci_bus_id(bus_id);
      }
      info.set_name(prop.name);
      info.set_sm_count(prop.multiProcessorCount);
      info.set_total_memory_bytes(prop.totalGlobalMem);
      info.set_compute_capability_major(prop.major);
      info.set_compute_capability_minor(prop.minor);
      const absl::Status supported = CheckComputeCapability(
          absl::StrCat("GPU ", dev, " (", prop.name, ")"), prop.major, prop.minor);
      info.set_supported(supported.ok());
      info.set_unsupported_reason(std::string(supported.message()));
      for (int peer = 0; peer < count; ++peer) {
        int can = 0;
        if (peer != dev && cudaDeviceCanAccessPeer(&can, dev, peer) != cudaSuccess) can = 0;
        info.add_peer_access(peer == dev || can != 0);
      }
      all.push_back(std::move(info));
    }
    for (const std::string& uuid : allowed_uuids) {
      bool known = false;
      for (const v1::GpuInfo& g : all) known = known || g.uuid() == uuid;
      if (!known) {
        std::vector<std::string> uuids;
        for (const v1::GpuInfo& g : all) uuids.push_back(g.uuid());
        return errors::WithReason(absl::NotFoundError(absl::StrCat(
                                      "gpu_uuids: \"", uuid, "\" is not a visible GPU (visible: ",
                                      absl::StrJoin(uuids, ", "), ")")),
                                  errors::Reason::kGpuNotFound);
      }
    }
    for (v1::GpuInfo& g : all) {
      bool allowed = allowed_uuids.empty();
      for (const std::string& uuid : allowed_uuids) allowed = allowed || g.uuid() == uuid;
      if (allowed) inventory.gpus_.push_back(std::move(g));
    }
    std::map<std::string, int> names;
    for (const v1::GpuInfo& g : inventory.gpus_) ++names[g.name()];
    std::vector<std::string> parts;
    for (const auto& [name, n] : names) parts.push_back(absl::StrCat(name, " x", n));
    inventory.reason_ =
        absl::StrCat(inventory.gpus_.size(), " GPU(s): ", absl::StrJoin(parts, ", "));
    EPD_RETURN_IF_ERROR(inventory.Refresh());
  }
#else
  if (!allowed_uuids.empty()) {
    return errors::WithReason(
        absl::NotFoundError(absl::StrCat("gpu_uuids: \"", allowed_uuids.front(),
                                         "\" cannot be used: epd was built without CUDA")),
        errors::Reason::kGpuNotFound);
  }
  inventory.reason_ = "epd was built without CUDA (EPD_WITH_CUDA=OFF or no nvcc)";
#endif
  return inventory;
}

absl::StatusOr<v1::GpuInfo> GpuInventory::Find(const std::string& id) const {
  std::string pci = NormalizePciBusId(id);
  for (const v1::GpuInfo& g : gpus_) {
    if (g.uuid() == id || (!g.pci_bus_id().empty() && NormalizePciBusId(g.pci_bus_id()) == pci)) {
      return g;
    }
  }
  std::vector<std::string> known;
  for (const v1::GpuInfo& g : gpus_)
    known.push_back(absl::StrCat(g.uuid(), " (", g.pci_bus_id(), ")"));
  return errors::WithReason(
      absl::NotFoundError(absl::StrCat(
          "gpu_uuid: \"", id, "\" is not a GPU of this daemon (known: ",
          known.empty() ? std::string("none, ") + reason_ : absl::StrJoin(known, ", "), ")")),
      errors::Reason::kGpuNotFound);
}

absl::Status GpuInventory::Refresh() {
#if EPD_HAVE_CUDA
  for (v1::GpuInfo& g : gpus_) {
    cudaError_t err = cudaSetDevice(g.ordinal());
    size_t free_bytes = 0, total_bytes = 0;
    if (err == cudaSuccess) err = cudaMemGetInfo(&free_bytes, &total_bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return errors::WithReason(
          absl::UnavailableError(absl::StrCat("GPU ", g.uuid(), " (ordinal ", g.ordinal(),
                                              ") lost: ", CudaError("cudaMemGetInfo", err))),
          errors::Reason::kGpuUnavailable);
    }
    g.set_free_memory_bytes(free_bytes);
  }
#endif
  return absl::OkStatus();
}

}  // namespace epd
