#include "daemon/gpu/gpu_inventory.h"

#include <dirent.h>
#include <sys/socket.h>
#include <sys/un.h>
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

/// True when a unix socket at `path` accepts a connection, of any of the socket types a
/// service may use (the MPS control socket is not necessarily SOCK_STREAM). Otherwise
/// `*error` says why the stream connect failed.
bool UnixSocketAccepts(const std::string& path, std::string* error) {
  if (path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    *error = "path too long";
    return false;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  error->clear();
  for (int type : {SOCK_STREAM, SOCK_SEQPACKET, SOCK_DGRAM}) {
    int fd = ::socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (!ok && error->empty()) *error = std::strerror(errno);
    ::close(fd);
    if (ok) return true;
  }
  return false;
}

/// Pid of the first live (not zombie) process whose /proc/<pid>/comm starts with
/// `prefix`, or 0.
long FindProcess(absl::string_view prefix) {
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) return 0;
  long found = 0;
  while (dirent* entry = ::readdir(dir)) {
    char* end = nullptr;
    long pid = std::strtol(entry->d_name, &end, 10);
    if (pid <= 0 || *end != '\0') continue;
    std::ifstream comm(absl::StrCat("/proc/", entry->d_name, "/comm"));
    std::string name;
    if (!std::getline(comm, name) || !absl::StartsWith(name, prefix)) continue;
    // /proc/<pid>/stat: "pid (comm) S ..."; a zombie (Z) or dead (X) process serves nothing.
    std::ifstream stat_file(absl::StrCat("/proc/", entry->d_name, "/stat"));
    std::string stat;
    std::getline(stat_file, stat);
    size_t paren = stat.rfind(')');
    char state = paren != std::string::npos && paren + 2 < stat.size() ? stat[paren + 2] : '?';
    if (state == 'Z' || state == 'X') continue;
    found = pid;
    break;
  }
  ::closedir(dir);
  return found;
}

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

MpsStatus DetectMps() {
  MpsStatus status;
  const char* env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  std::string pipe_dir = env != nullptr && *env != '\0' ? env : "/tmp/nvidia-mps";
  std::string control = absl::StrCat(pipe_dir, "/control");
  // CUDA joins MPS through the control socket of its pipe directory: that socket accepting
  // connections is what makes MPS active for this daemon.
  std::string connect_error;
  if (UnixSocketAccepts(control, &connect_error)) {
    status.active = true;
    status.detail = absl::StrCat("MPS control socket ", control, " accepts connections");
    if (long pid = FindProcess("nvidia-cuda-mps"); pid != 0) {
      absl::StrAppend(&status.detail, " (MPS process pid ", pid, ")");
    }
    return status;
  }
  if (long pid = FindProcess("nvidia-cuda-mps"); pid != 0) {
    status.detail = absl::StrCat(
        "an MPS process runs (pid ", pid, ") but the control socket ", control,
        " does not answer (", connect_error,
        "): this daemon does not use it (set CUDA_MPS_PIPE_DIRECTORY to its pipe directory)");
    return status;
  }
  status.detail =
      absl::StrCat("no MPS control socket at ", control, " and no nvidia-cuda-mps-* process");
  return status;
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
