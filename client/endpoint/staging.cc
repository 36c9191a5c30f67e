// Streams and staging of an endpoint's ops (endpoint_state.h): the stream an op runs on,
// and the copy of its inputs into the endpoint's staging regions.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/endpoint/endpoint_state.h"
#include "client/endpoint/tensor_checks.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"

#if EPD_HAVE_CUDA
#include "common/cuda/cuda_check.h"
#endif

namespace epd {

using internal::TensorBytes;
using internal::TensorNbytes;

absl::StatusOr<void*> Endpoint::Impl::OpStream(void* stream) {
#if EPD_HAVE_CUDA
  if (!cuda || stream != nullptr) return stream;
  internal::DeviceGuard guard(mapping->device());
  // Created at the first op given no stream: every stream takes one of the GPU's
  // CUDA_DEVICE_MAX_CONNECTIONS hardware queues, which streams beyond it share.
  if (own_stream == nullptr) {
    EPD_ASSIGN_OR_RETURN(own_stream, CreateStream());
    EPD_ASSIGN_OR_RETURN(legacy_event, CreateEvent());
  }
  EPD_CUDA_RETURN_IF_ERROR(cudaEventRecord(legacy_event.get(), cudaStreamLegacy));
  EPD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(own_stream.get(), legacy_event.get(), 0));
  return static_cast<void*>(own_stream.get());
#else
  return stream;
#endif
}

void Endpoint::Impl::NoteStream(uint64_t seq, const void* caller_stream) {
  unordered_ops[seq % unordered_ops.size()] = caller_stream == nullptr ? seq : 0;
}

absl::Status Endpoint::Impl::Stage(const char* op, const char* name, const DLTensor* t,
                                   const kernels::Region& r, void* stream, bool for_submit) {
  int64_t n = TensorNbytes(t);
  if (static_cast<uint64_t>(n) > r.bytes) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  op, ": ", name, " has ", n,
                                  " bytes, more than its staging area (", r.bytes, " bytes)")),
                              errors::Reason::kOpInputInvalid);
  }
  const uint8_t* src = TensorBytes(t);
  if (src == At(r) || n <= 0) return absl::OkStatus();
#if EPD_HAVE_CUDA
  if (cuda) {
    namespace kc = kernels::cuda;
    internal::DeviceGuard guard(mapping->device());
    const auto s = static_cast<cudaStream_t>(stream);
    // A tensor on the area's GPU is copied by a kernel (kc::CopyDeviceAsync: no
    // copy-engine queue shared with the process's other streams); anything else (host
    // memory, another GPU) by cudaMemcpyAsync, toward the area (never a read-back).
    if (t->device.device_type == kDLCUDA && t->device.device_id == mapping->device()) {
      if (for_submit && num_pending_copies < kc::kMaxBatchCopies) {
        pending_copies[num_pending_copies++] = {At(r), src, static_cast<uint64_t>(n)};
        return absl::OkStatus();
      }
      return kc::CopyDeviceAsync(At(r), src, static_cast<uint64_t>(n), s);
    }
    const cudaMemcpyKind to_area = cudaMemcpyDefault;  // copy-engine-lint: to the device
    EPD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(At(r), src, static_cast<size_t>(n), to_area, s));
    return absl::OkStatus();
  }
#else
  (void)stream;
  (void)for_submit;
#endif
  std::memcpy(At(r), src, static_cast<size_t>(n));
  return absl::OkStatus();
}

}  // namespace epd
