// The checks every op applies to its DLPack arguments (dtype, shape, device, contiguity,
// alignment), the dtypes the ops take, and the byte views of a checked tensor.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "epd/client.h"

namespace epd::internal {

inline constexpr DLDataType kBf16{kDLBfloat, 16, 1};
inline constexpr DLDataType kE4m3 = kDLFloat8E4m3fn;  // client.h
inline constexpr DLDataType kF32{kDLFloat, 32, 1};
inline constexpr DLDataType kI32{kDLInt, 32, 1};
inline constexpr DLDataType kI64{kDLInt, 64, 1};
/// bool as one byte (0/1); DLPack 0.6 has no kDLBool, so uint8 is used.
inline constexpr DLDataType kBool{kDLUInt, 8, 1};

/// Whether `a` and `b` are the same dtype (code, bits and lanes).
bool SameType(DLDataType a, DLDataType b);

/// Checks a DLTensor against an expected dtype and shape (-1 = any size; the size found
/// is written back into `shape`). `cuda`: the endpoint is on the CUDA backend, which also
/// takes kDLCUDA tensors. Also checks that the first element (data + byte_offset) is
/// aligned to the dtype's element size. Errors: INVALID_ARGUMENT naming `op`, `name` and
/// the offending value. Allocates nothing when the tensor passes (README "Hot path").
absl::Status CheckTensor(bool cuda, const char* op, const char* name, const DLTensor* t,
                         std::initializer_list<DLDataType> dtypes, std::span<int64_t> shape);

/// CheckTensor, then: `t` is kDLCUDA memory of the endpoint's GPU `device` (a graph-mode
/// program step is captured, so it reads its inputs at run time, in place).
absl::Status CheckStepTensor(const char* op, const char* name, const DLTensor* t,
                             std::initializer_list<DLDataType> dtypes, std::span<int64_t> shape,
                             int device);

/// Whether a kernel on CUDA device `device` can read `t` in place: device memory of that
/// GPU, with its first element `alignment`-aligned.
bool ReadableInPlace(const DLTensor* t, int device, uintptr_t alignment);

/// The first byte of `t` (data + byte_offset).
inline const uint8_t* TensorBytes(const DLTensor* t) {
  return static_cast<const uint8_t*>(t->data) + t->byte_offset;
}

/// The bytes of `t` (a checked, contiguous tensor).
int64_t TensorNbytes(const DLTensor* t);

}  // namespace epd::internal
