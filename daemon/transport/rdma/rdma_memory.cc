// The RDMA transport's registration lifecycle (rdma_memory.h).
#include "daemon/transport/rdma/rdma_memory.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errors/reason.h"
#include "common/os/scoped_fd.h"
#include "common/status_macros.h"
#include "daemon/transport/link_common.h"

#if defined(EPD_HAVE_CUDA)
#include <cuda.h>  // Driver API types only: entry points are resolved at run time.
#include <cuda_runtime.h>
#endif

namespace epd::transport::rdma {
namespace {

std::string Errno(int err) { return absl::StrCat(std::strerror(err), " (errno ", err, ")"); }

/// A failed registration as a Status: the memlock limit (EPERM/ENOMEM) is one the operator
/// can fix.
absl::Status RegistrationError(const std::string& what, const char* call, int err, uint64_t bytes) {
  if (err == ENOMEM || err == EPERM) {
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                  what, ": ", call, " of ", bytes, " bytes: ", Errno(err),
                                  ": raise the locked-memory limit (ulimit -l unlimited, systemd "
                                  "LimitMEMLOCK=infinity, docker --ulimit memlock=-1)")),
                              errors::Reason::kRdmaUnavailable);
  }
  return absl::InternalError(absl::StrCat(what, ": ", call, " of ", bytes, " bytes: ", Errno(err)));
}

#if defined(EPD_HAVE_CUDA)
struct DmabufOps {
  CUresult (*get_handle)(void*, CUdeviceptr, size_t, CUmemRangeHandleType,
                         unsigned long long) = nullptr;  // NOLINT(runtime/int)
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_get_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
};

/// The driver's dmabuf export, or FAILED_PRECONDITION saying what is missing.
absl::StatusOr<const DmabufOps*> GetDmabufOps() {
  static DmabufOps ops;
  static const absl::Status status = [] {
    const auto resolve = [](const char* name, void** fn) -> absl::Status {
      cudaDriverEntryPointQueryResult q{};
      const cudaError_t e =
          cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q);
      if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || *fn == nullptr) {
        (void)cudaGetLastError();
        return errors::WithReason(
            absl::FailedPreconditionError(absl::StrCat(
                "the CUDA driver has no entry point ", name, " (", cudaGetErrorString(e),
                "); GPU memory over RDMA needs a driver of CUDA 12 or later")),
            errors::Reason::kRdmaUnavailable);
      }
      return absl::OkStatus();
    };
    if (absl::Status s =
            resolve("cuMemGetHandleForAddressRange", reinterpret_cast<void**>(&ops.get_handle));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = resolve("cuDeviceGet", reinterpret_cast<void**>(&ops.device_get));
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            resolve("cuDeviceGetAttribute", reinterpret_cast<void**>(&ops.device_get_attribute));
        !s.ok()) {
      return s;
    }
    return resolve("cuGetErrorString", reinterpret_cast<void**>(&ops.get_error_string));
  }();
  if (!status.ok()) return status;
  return &ops;
}
#endif

}  // namespace

const RegisteredRegion* FindRegion(std::span<const RegisteredRegion> regions, const void* src,
                                   uint64_t bytes) {
  for (auto r = regions.rbegin(); r != regions.rend(); ++r) {
    if (RangeHolds(r->begin, r->end, src, bytes)) return &*r;
  }
  return nullptr;
}

absl::Status CudaDmabufUsable(std::span<const int> cuda_devices) {
#if defined(EPD_HAVE_CUDA)
  absl::StatusOr<const DmabufOps*> ops = GetDmabufOps();
  if (!ops.ok()) return ops.status();
  const int zero = 0;
  const std::span<const int> ordinals =
      cuda_devices.empty() ? std::span<const int>(&zero, 1) : cuda_devices;
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    (void)cudaGetLastError();
    return errors::WithReason(absl::FailedPreconditionError(absl::StrCat(
                                  "no CUDA device to register: ", cudaGetErrorString(e))),
                              errors::Reason::kRdmaUnavailable);
  }
  for (int d : ordinals) {
    int supported = 0;
    CUdevice dev = 0;
    if (d >= count || (*ops)->device_get(&dev, d) != CUDA_SUCCESS ||
        (*ops)->device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev) !=
            CUDA_SUCCESS) {
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              "CUDA device ", d, ": cannot query dmabuf support (", count, " devices here)")),
          errors::Reason::kRdmaUnavailable);
    }
    if (supported == 0) {
      return errors::WithReason(
          absl::FailedPreconditionError(absl::StrCat(
              "CUDA device ", d,
              " does not support dmabuf export (needs the open GPU kernel modules and a kernel "
              "with dmabuf; set rdma gpudirect to off to stage through host memory)")),
          errors::Reason::kRdmaUnavailable);
    }
  }
  return absl::OkStatus();
#else
  (void)cuda_devices;
  return errors::WithReason(
      absl::FailedPreconditionError(
          "epd was built without CUDA: GPU memory cannot be registered with the NIC"),
      errors::Reason::kRdmaUnavailable);
#endif
}

absl::StatusOr<IbvPtr<ibv_mr>> RegisterRegion(ibv_pd* pd, const MemoryRegion& region, int access,
                                              const std::string& what) {
  if (region.base == nullptr || region.bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": empty or null region (", region.bytes, " bytes)"));
  }
  if (region.kind == MemoryKind::kHost) {
    IbvPtr<ibv_mr> mr(ibv_reg_mr(pd, region.base, region.bytes, access));
    if (mr == nullptr) return RegistrationError(what, "ibv_reg_mr", errno, region.bytes);
    return mr;
  }
  EPD_ASSIGN_OR_RETURN(DmabufRange dmabuf, ExportCudaDmabuf(region, what));
  IbvPtr<ibv_mr> mr(ibv_reg_dmabuf_mr(pd, dmabuf.offset, region.bytes,
                                      reinterpret_cast<uint64_t>(region.base), dmabuf.fd.get(),
                                      access | IBV_ACCESS_RELAXED_ORDERING));
  // The memory region holds its own reference to the dmabuf: the fd closes here.
  if (mr == nullptr) return RegistrationError(what, "ibv_reg_dmabuf_mr", errno, region.bytes);
  return mr;
}

absl::StatusOr<DmabufRange> ExportCudaDmabuf(const MemoryRegion& region, const std::string& what) {
  if (region.kind != MemoryKind::kCudaDevice || region.base == nullptr || region.bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": not a non-empty CUDA device region (", region.bytes, " bytes)"));
  }
#if defined(EPD_HAVE_CUDA)
  absl::StatusOr<const DmabufOps*> ops = GetDmabufOps();
  if (!ops.ok()) return ops.status();
  // The export takes page-aligned ranges; the region is registered at its own offset in it.
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const auto base = reinterpret_cast<uint64_t>(region.base);
  const uint64_t aligned = base & ~(page - 1);
  const uint64_t span = ((base + region.bytes + page - 1) & ~(page - 1)) - aligned;
  int fd = -1;
  const CUresult r = (*ops)->get_handle(&fd, static_cast<CUdeviceptr>(aligned), span,
                                        CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS) {
    const char* msg = nullptr;
    (*ops)->get_error_string(r, &msg);
    return errors::WithReason(
        absl::FailedPreconditionError(absl::StrCat(
            what, ": cuMemGetHandleForAddressRange (dmabuf) of CUDA device ", region.cuda_device,
            " memory failed: CUresult ", static_cast<int>(r), ": ", msg != nullptr ? msg : "?",
            " (set rdma gpudirect to off to stage through host memory)")),
        errors::Reason::kRdmaUnavailable);
  }
  DmabufRange out;
  out.fd.Reset(fd);
  out.offset = base - aligned;
  out.bytes = region.bytes;
  return out;
#else
  return errors::WithReason(
      absl::FailedPreconditionError(absl::StrCat(
          what,
          ": CUDA device memory, but epd was built without CUDA (stage through host memory)")),
      errors::Reason::kRdmaUnavailable);
#endif
}

}  // namespace epd::transport::rdma
