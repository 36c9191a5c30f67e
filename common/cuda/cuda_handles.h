// RAII owners of CUDA runtime resources, shared by the daemon's CUDA data plane and the
// client library (needs the CUDA runtime headers; include only where CUDA is built).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <type_traits>

#include "common/cuda/cuda_check.h"

namespace epd {

/// cudaFree (errors ignored: a destructor has no one to report to).
struct CudaFreeDeleter {
  void operator()(void* p) const {
    if (p != nullptr) EPD_CUDA_IGNORE(cudaFree(p));
  }
};
/// cudaFreeHost, for cudaHostAlloc'd memory.
struct CudaFreeHostDeleter {
  void operator()(void* p) const {
    if (p != nullptr) EPD_CUDA_IGNORE(cudaFreeHost(p));
  }
};
struct CudaStreamDeleter {
  void operator()(cudaStream_t s) const {
    if (s != nullptr) EPD_CUDA_IGNORE(cudaStreamDestroy(s));
  }
};
struct CudaEventDeleter {
  void operator()(cudaEvent_t e) const {
    if (e != nullptr) EPD_CUDA_IGNORE(cudaEventDestroy(e));
  }
};

/// cudaGraphExecDestroy. An executable graph may hold device memory of its own (its
/// nodes' parameters, memory nodes): destroy it off the engine path, as memory is freed
/// (DESIGN.md §8.2).
struct CudaGraphExecDeleter {
  void operator()(cudaGraphExec_t g) const {
    if (g != nullptr) EPD_CUDA_IGNORE(cudaGraphExecDestroy(g));
  }
};
/// cudaGraphDestroy, for a captured graph before (or after) it is instantiated.
struct CudaGraphDeleter {
  void operator()(cudaGraph_t g) const {
    if (g != nullptr) EPD_CUDA_IGNORE(cudaGraphDestroy(g));
  }
};

/// cudaHostUnregister, for memory this process mapped itself and registered.
struct CudaHostUnregisterDeleter {
  void operator()(uint8_t* p) const {
    if (p != nullptr) EPD_CUDA_IGNORE(cudaHostUnregister(p));
  }
};

/// cudaMalloc'd device memory (on the device current at allocation).
using DeviceMemory = std::unique_ptr<uint8_t, CudaFreeDeleter>;
/// cudaHostAlloc'd (pinned) host memory.
using PinnedMemory = std::unique_ptr<uint8_t, CudaFreeHostDeleter>;
using StreamHandle = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, CudaStreamDeleter>;
/// Host memory registered with cudaHostRegister (the mapping stays the caller's: destroy
/// this before unmapping it).
using HostRegistration = std::unique_ptr<uint8_t, CudaHostUnregisterDeleter>;
using EventHandle = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, CudaEventDeleter>;
using GraphExecHandle =
    std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, CudaGraphExecDeleter>;
using GraphHandle = std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, CudaGraphDeleter>;

}  // namespace epd
