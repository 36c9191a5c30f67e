// CK(call): for the scratch-grade CUDA probes (tests/gpu/probes/, tests/bench/handoff/),
// which use no epd code and no Status: a failed runtime call ends the process with the call,
// file, line and CUDA error string.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)
