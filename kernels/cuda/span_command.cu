// SpanPostAsync / SpanAwaitAsync (cuda_span.h): a client-launched rank's op across nodes,
// posted to and answered by the daemon through the host mirror the client maps.
#include <algorithm>
#include <cstddef>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda_check.h"
#include "common/status_macros.h"
#include "epd/kernels/cuda_span.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/copy_bytes.cuh"

namespace epd::kernels::cuda {
namespace {

/// Blocks of the posting and the await kernel at most: every rank on a GPU has both resident
/// beside each other (a rank's await spins while its peers' posts still run).
constexpr uint64_t kMaxPostBlocks = 32;
constexpr uint64_t kMaxAwaitBlocks = 16;
constexpr int32_t kDeadlineExceeded = 4;  // absl::StatusCode::kDeadlineExceeded.

/// The bytes span `s` covers now (its rows read on the device when it has rows_ptr).
__device__ __forceinline__ uint64_t SpanBytes(const PostSpan& s) {
  int64_t rows =
      s.rows_ptr != nullptr ? *reinterpret_cast<const volatile int32_t*>(s.rows_ptr) : s.rows;
  rows = rows < 0 ? 0 : rows;
  const uint64_t bytes = static_cast<uint64_t>(rows) * s.row_bytes;
  return bytes < s.max_bytes ? bytes : s.max_bytes;
}

__global__ void SpanPostKernel(const SpanPostArgs a) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int32_t i = 0; i < a.num_spans; ++i) {
    const PostSpan& s = a.spans[i];
    device::CopyBytes(a.mirror + s.offset, a.area + s.offset, SpanBytes(s), first, stride);
  }
  // Every thread's writes reach the host before its block takes a ticket.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return;
  SpanDeviceState* st = a.state;
  if (gridDim.x > 1) {
    const uint32_t ticket = atomicAdd(&st->post_ticket, 1u);
    if (ticket != gridDim.x - 1) return;
    __threadfence_system();
    st->post_ticket = 0;
  }
  const uint64_t seq = st->next_seq;
  st->next_seq = seq + 1;
  st->current_seq = seq;
  int32_t T = a.num_tokens_ptr != nullptr ? *a.num_tokens_ptr : a.num_tokens;
  uint64_t handle_seq = 0;
  if (a.handle == SpanHandle::kRouting) handle_seq = st->routing_seq;
  if (a.handle == SpanHandle::kLowLatency) {
    const int hb = a.handle_buffer == 1 ? 1 : 0;
    handle_seq = st->ll_seq[hb];
    T = st->ll_tokens[hb];
  }
  if (a.records_routing) st->routing_seq = seq;
  if (a.records_ll) {
    const int cb = a.client_buffer == 1 ? 1 : 0;
    st->ll_seq[cb] = seq;
    st->ll_tokens[cb] = T;
  }
  volatile abi::SpanCommand* c = &a.control->command;
  c->magic = abi::kSpanCommandMagic;
  c->op = a.op;
  c->flags = a.flags;
  c->num_tokens = T;
  c->expert_alignment = a.expert_alignment;
  c->client_buffer = a.client_buffer;
  c->handle_seq = handle_seq;
  __threadfence_system();
  device::StReleaseSys64(const_cast<uint64_t*>(&c->seq), seq);
}

__global__ void SpanAwaitKernel(const SpanAwaitArgs a) {
  __shared__ abi::SpanCopy copies[abi::kMaxSpanCopies];
  __shared__ uint32_t s_arrived, s_n, s_bad;
  __shared__ uint64_t s_seq;
  if (threadIdx.x == 0) {
    const uint64_t seq = a.state->current_seq;  // The posting kernel's, earlier on the stream.
    const uint64_t deadline = device::GlobalTimerNs() + a.timeout_ns;
    uint32_t arrived = 0;
    for (;;) {
      if (device::LdAcquireSys64(&a.control->done_seq) == seq) {
        arrived = 1;
        break;
      }
      if (device::GlobalTimerNs() > deadline) break;
      __nanosleep(256);
    }
    const volatile abi::SpanControl* c = a.control;
    uint32_t n = 0;
    if (arrived && c->done_status_code == 0) n = c->num_copies;
    s_n = n < abi::kMaxSpanCopies ? n : abi::kMaxSpanCopies;
    s_arrived = arrived;
    s_seq = seq;
    s_bad = 0;
  }
  __syncthreads();
  const volatile abi::SpanCopy* table = a.control->copies;
  for (uint32_t i = threadIdx.x; i < s_n; i += blockDim.x) {
    copies[i].src_offset = table[i].src_offset;
    copies[i].dst_offset = table[i].dst_offset;
    copies[i].bytes = table[i].bytes;
  }
  __syncthreads();
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (uint32_t i = 0; i < s_n; ++i) {
    const abi::SpanCopy& k = copies[i];
    const bool inside = k.bytes <= a.mirror_bytes && k.src_offset <= a.mirror_bytes - k.bytes &&
                        k.bytes <= a.area_bytes && k.dst_offset <= a.area_bytes - k.bytes;
    if (!inside) {
      if (threadIdx.x == 0) ++s_bad;
      continue;
    }
    device::CopyBytes(a.area + k.dst_offset, a.mirror + k.src_offset, k.bytes, first, stride);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x != 0) return;
  SpanDeviceState* st = a.state;
  if (!s_arrived) atomicAdd(&st->await_timed_out, 1u);
  if (s_bad != 0 && blockIdx.x == 0) atomicAdd(&st->await_bad_copies, s_bad);
  if (gridDim.x > 1) {
    __threadfence();
    const uint32_t ticket = atomicAdd(&st->await_ticket, 1u);
    if (ticket != gridDim.x - 1) return;
    __threadfence();
    st->await_ticket = 0;
  }
  const uint32_t timed_out = atomicExch(&st->await_timed_out, 0u);
  const uint32_t bad = atomicExch(&st->await_bad_copies, 0u);
  const volatile abi::SpanControl* c = a.control;
  volatile SpanReadback* rb = a.readback;
  rb->seq = s_seq;
  rb->status_code = timed_out != 0 ? kDeadlineExceeded : c->done_status_code;
  rb->num_recv_tokens = timed_out != 0 ? 0 : c->done_num_recv_tokens;
  rb->timed_out = timed_out;
  rb->bad_copies = bad;
  __threadfence_system();
}

absl::Status PreloadSpanKernels() {
  cudaFuncAttributes attr;
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, SpanPostKernel));
  EPD_CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attr, SpanAwaitKernel));
  return absl::OkStatus();
}
const bool kSpanPreloadRegistered = RegisterPreloadHook(&PreloadSpanKernels);

}  // namespace

absl::Status SpanPostAsync(const SpanPostArgs& a, cudaStream_t stream) {
  if (a.num_spans < 0 || a.num_spans > kMaxPostSpans) {
    return absl::InvalidArgumentError(absl::StrCat("SpanPostAsync: num_spans = ", a.num_spans,
                                                   " is outside [0, ", kMaxPostSpans, "]"));
  }
  if (a.area == nullptr || a.mirror == nullptr || a.control == nullptr || a.state == nullptr) {
    return absl::InvalidArgumentError("SpanPostAsync: a null area, mirror, control or state");
  }
  (void)kSpanPreloadRegistered;
  const uint64_t blocks = CopyBlocks(a.max_total_bytes, kMaxPostBlocks);
  void* args[] = {const_cast<SpanPostArgs*>(&a)};
  return EPD_CUDA_STATUS(cudaLaunchKernel(reinterpret_cast<const void*>(&SpanPostKernel),
                                          dim3(static_cast<unsigned>(blocks)), dim3(kCopyThreads),
                                          args, 0, stream));
}

absl::Status SpanAwaitAsync(const SpanAwaitArgs& a, cudaStream_t stream) {
  if (a.area == nullptr || a.mirror == nullptr || a.control == nullptr || a.state == nullptr ||
      a.readback == nullptr) {
    return absl::InvalidArgumentError(
        "SpanAwaitAsync: a null area, mirror, control, state or readback");
  }
  const uint64_t blocks = CopyBlocks(a.max_total_bytes, kMaxAwaitBlocks);
  void* args[] = {const_cast<SpanAwaitArgs*>(&a)};
  return EPD_CUDA_STATUS(cudaLaunchKernel(reinterpret_cast<const void*>(&SpanAwaitKernel),
                                          dim3(static_cast<unsigned>(blocks)), dim3(kCopyThreads),
                                          args, 0, stream));
}

}  // namespace epd::kernels::cuda
