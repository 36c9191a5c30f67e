#include "daemon/gpu/cuda_driver_probe.h"

#include <dlfcn.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "common/gpu_uuid.h"

namespace epd {
namespace {

// Driver API values (cuda.h), fixed by CUDA's ABI; cuda.h is not needed to build this.
constexpr int kAttrMultiprocessorCount = 16;
constexpr int kAttrComputeCapabilityMajor = 75;
constexpr int kAttrComputeCapabilityMinor = 76;
constexpr int kP2pAttrAccessSupported = 0x02;
constexpr int kP2pAttrNativeAtomicSupported = 0x03;

/// A dlopen handle, closed on destruction.
class Library {
 public:
  explicit Library(std::initializer_list<const char*> names) {
    for (const char* name : names) {
      handle_ = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (handle_ != nullptr) return;
      const char* why = ::dlerror();
      if (error_.empty()) error_ = why != nullptr ? why : name;
    }
  }
  ~Library() {
    if (handle_ != nullptr) ::dlclose(handle_);
  }
  Library(const Library&) = delete;
  Library& operator=(const Library&) = delete;

  bool loaded() const { return handle_ != nullptr; }
  const std::string& error() const { return error_; }
  template <typename Fn>
  Fn Get(const char* symbol) const {
    return handle_ == nullptr ? nullptr : reinterpret_cast<Fn>(::dlsym(handle_, symbol));
  }

 private:
  void* handle_ = nullptr;
  std::string error_;
};

/// The runtime's version from the first libcudart found (0 when none).
int ProbeRuntimeVersion() {
  Library cudart({"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"});
  auto get = cudart.Get<int (*)(int*)>("cudaRuntimeGetVersion");
  int version = 0;
  if (get == nullptr || get(&version) != 0) return 0;
  return version;
}

}  // namespace

std::string CudaVersionText(int version) {
  if (version <= 0) return "unknown";
  return absl::StrCat(version / 1000, ".", (version % 1000) / 10);
}

CudaDriverFacts ProbeCudaDriver(bool list_gpus) {
  CudaDriverFacts facts;
  facts.runtime_version = ProbeRuntimeVersion();
  Library cuda({"libcuda.so.1", "libcuda.so"});
  if (!cuda.loaded()) {
    facts.error = absl::StrCat("no CUDA driver: dlopen libcuda.so.1: ", cuda.error());
    return facts;
  }
  facts.library_loaded = true;
  using IntFn = int (*)(int*);
  auto init = cuda.Get<int (*)(unsigned)>("cuInit");
  auto driver_version = cuda.Get<IntFn>("cuDriverGetVersion");
  auto count = cuda.Get<IntFn>("cuDeviceGetCount");
  auto device_get = cuda.Get<int (*)(int*, int)>("cuDeviceGet");
  auto name = cuda.Get<int (*)(char*, int, int)>("cuDeviceGetName");
  auto attribute = cuda.Get<int (*)(int*, int, int)>("cuDeviceGetAttribute");
  auto total_mem = cuda.Get<int (*)(size_t*, int)>("cuDeviceTotalMem_v2");
  auto bus_id = cuda.Get<int (*)(char*, int, int)>("cuDeviceGetPCIBusId");
  auto uuid = cuda.Get<int (*)(void*, int)>("cuDeviceGetUuid");
  auto p2p_attribute = cuda.Get<int (*)(int*, int, int, int)>("cuDeviceGetP2PAttribute");
  if (driver_version != nullptr) driver_version(&facts.driver_version);
  if (!list_gpus) return facts;
  if (init == nullptr || count == nullptr || device_get == nullptr || attribute == nullptr) {
    facts.error = "libcuda.so.1 lacks cuInit/cuDeviceGetCount/cuDeviceGet/cuDeviceGetAttribute";
    return facts;
  }
  if (int rc = init(0); rc != 0) {
    facts.error = absl::StrCat("cuInit failed with CUresult ", rc,
                               " (100 = no device, 999 = unknown: is the nvidia module loaded?)");
    return facts;
  }
  int n = 0;
  if (int rc = count(&n); rc != 0) {
    facts.error = absl::StrCat("cuDeviceGetCount failed with CUresult ", rc);
    return facts;
  }
  std::vector<int> devices;
  for (int i = 0; i < n; ++i) {
    int device = 0;
    if (device_get(&device, i) != 0) continue;
    devices.push_back(device);
    v1::GpuInfo& gpu = facts.gpus.emplace_back();
    gpu.set_ordinal(i);
    int value = 0;
    if (attribute(&value, kAttrMultiprocessorCount, device) == 0) gpu.set_sm_count(value);
    if (attribute(&value, kAttrComputeCapabilityMajor, device) == 0) {
      gpu.set_compute_capability_major(value);
    }
    if (attribute(&value, kAttrComputeCapabilityMinor, device) == 0) {
      gpu.set_compute_capability_minor(value);
    }
    std::array<char, 256> text{};
    if (name != nullptr && name(text.data(), static_cast<int>(text.size()), device) == 0) {
      gpu.set_name(text.data());
    }
    text.fill(0);
    if (bus_id != nullptr && bus_id(text.data(), static_cast<int>(text.size()), device) == 0) {
      gpu.set_pci_bus_id(text.data());
    }
    std::array<unsigned char, 16> bytes{};
    if (uuid != nullptr && uuid(bytes.data(), device) == 0) {
      gpu.set_uuid(FormatGpuUuid(bytes.data()));
    }
    size_t bytes_total = 0;
    if (total_mem != nullptr && total_mem(&bytes_total, device) == 0) {
      gpu.set_total_memory_bytes(bytes_total);
    }
  }
  const size_t g = facts.gpus.size();
  facts.p2p.assign(g, std::vector<P2pLink>(g, P2pLink::kNone));
  for (size_t i = 0; i < g; ++i) {
    for (size_t j = 0; j < g; ++j) {
      int access = 0;
      int atomics = 0;
      if (i != j && p2p_attribute != nullptr) {
        if (p2p_attribute(&access, kP2pAttrAccessSupported, devices[i], devices[j]) != 0) {
          access = 0;
        }
        if (p2p_attribute(&atomics, kP2pAttrNativeAtomicSupported, devices[i], devices[j]) != 0) {
          atomics = 0;
        }
      }
      facts.p2p[i][j] = access == 0    ? P2pLink::kNone
                        : atomics != 0 ? P2pLink::kAtomics
                                       : P2pLink::kAccess;
      facts.gpus[i].add_peer_access(access != 0);
    }
  }
  return facts;
}

}  // namespace epd
