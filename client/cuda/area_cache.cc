// The shared cache of mapped data areas (area_cache.h). Empty without CUDA.
#include "client/cuda/area_cache.h"

#if EPD_HAVE_CUDA

#include <map>
#include <mutex>

#include "common/status_macros.h"

namespace epd::internal {
namespace {

std::mutex& CacheMutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, std::weak_ptr<const CudaAreaMapping>>& Cache() {
  static auto* cache = new std::map<std::string, std::weak_ptr<const CudaAreaMapping>>();
  return *cache;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const CudaAreaMapping>> MapSharedArea(const std::string& ipc_handle,
                                                                     const std::string& gpu_uuid) {
  std::lock_guard<std::mutex> lock(CacheMutex());
  auto& cache = Cache();
  auto it = cache.find(ipc_handle);
  if (it != cache.end()) {
    if (std::shared_ptr<const CudaAreaMapping> live = it->second.lock()) return live;
    cache.erase(it);
  }
  EPD_ASSIGN_OR_RETURN(CudaAreaMapping mapping, CudaAreaMapping::Open(ipc_handle, gpu_uuid));
  auto shared = std::make_shared<const CudaAreaMapping>(std::move(mapping));
  cache[ipc_handle] = shared;
  // Expired entries of areas whose last holder is gone (the handle may be reused by a
  // later allocation of the daemon: a new Open is then made).
  for (auto e = cache.begin(); e != cache.end();) {
    e = e->second.expired() ? cache.erase(e) : std::next(e);
  }
  return shared;
}

}  // namespace epd::internal

#endif  // EPD_HAVE_CUDA
