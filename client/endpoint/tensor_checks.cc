// DLPack argument checks (tensor_checks.h).
#include "client/endpoint/tensor_checks.h"

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/errors/reason.h"
#include "common/status_macros.h"

namespace epd::internal {
namespace {

std::string TypeName(DLDataType t) {
  if (SameType(t, kBf16)) return "bfloat16";
  if (SameType(t, kE4m3)) return "float8_e4m3fn";
  if (SameType(t, kF32)) return "float32";
  if (SameType(t, kI32)) return "int32";
  if (SameType(t, kI64)) return "int64";
  return absl::StrCat("dtype(code=", t.code, ",bits=", t.bits, ",lanes=", t.lanes, ")");
}

std::string ShapeString(const int64_t* shape, int ndim) {
  std::vector<int64_t> v(shape, shape + ndim);
  return absl::StrCat("[", absl::StrJoin(v, ", "), "]");
}

/// Checks that `t`'s first element, data + byte_offset, is aligned to its dtype's element
/// size (bf16: 2 bytes, f32 and int32: 4, int64: 8): the host kernels and the CUDA kernels
/// that read a tensor in place load whole elements, and a misaligned one is undefined
/// behaviour. A tensor with no data pointer (empty) passes. INVALID_ARGUMENT naming `op`,
/// `name`, the address, data + byte_offset and the alignment required.
absl::Status CheckTensorAlignment(const char* op, const char* name, const DLTensor* t) {
  const uint64_t alignment = (t->dtype.bits + 7u) / 8u;
  if (t->data == nullptr || alignment <= 1) return absl::OkStatus();
  const uintptr_t address = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
  if (address % alignment == 0) return absl::OkStatus();
  return errors::WithReason(
      absl::InvalidArgumentError(
          absl::StrCat(op, ": ", name, " starts at address 0x", absl::Hex(address), " (data 0x",
                       absl::Hex(reinterpret_cast<uintptr_t>(t->data)), " + byte_offset ",
                       t->byte_offset, "), which is not aligned to ", alignment,
                       " bytes as its dtype ", TypeName(t->dtype), " requires")),
      errors::Reason::kOpInputInvalid);
}

/// Checks that byte_offset is a whole number of elements and that the tensor's bytes,
/// data + byte_offset up to its end, lie inside the address space (an offset that wraps
/// around would point before data). INVALID_ARGUMENT naming `op`, `name` and byte_offset.
absl::Status CheckTensorExtent(const char* op, const char* name, const DLTensor* t) {
  const uint64_t element = (t->dtype.bits + 7u) / 8u;
  if (element > 1 && t->byte_offset % element != 0) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(op, ": ", name, ".byte_offset=", t->byte_offset,
                                                " is not a multiple of its dtype ",
                                                TypeName(t->dtype), "'s ", element, " bytes")),
        errors::Reason::kOpInputInvalid);
  }
  if (t->data == nullptr) return absl::OkStatus();
  const uintptr_t data = reinterpret_cast<uintptr_t>(t->data);
  uint64_t nbytes = (uint64_t{t->dtype.bits} * t->dtype.lanes + 7) / 8;
  bool overflow = false;
  for (int i = 0; i < t->ndim; ++i) {
    overflow |= __builtin_mul_overflow(nbytes, static_cast<uint64_t>(t->shape[i]), &nbytes);
  }
  uintptr_t end = 0;
  overflow |= __builtin_add_overflow(data, t->byte_offset, &end);
  overflow |= __builtin_add_overflow(end, nbytes, &end);
  if (!overflow) return absl::OkStatus();
  return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                op, ": ", name, ".byte_offset=", t->byte_offset, " with data 0x",
                                absl::Hex(data), " and shape ", ShapeString(t->shape, t->ndim),
                                " runs past the end of the address space (a negative offset?)")),
                            errors::Reason::kOpInputInvalid);
}

}  // namespace

bool SameType(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

absl::Status CheckTensor(bool cuda, const char* op, const char* name, const DLTensor* t,
                         std::initializer_list<DLDataType> dtypes, std::span<int64_t> shape) {
  if (t == nullptr) {
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is required")),
        errors::Reason::kOpInputInvalid);
  }
  if (t->ndim < 0 || t->ndim > 8 || (t->ndim > 0 && t->shape == nullptr)) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  op, ": ", name, " is a malformed DLTensor: ndim = ", t->ndim,
                                  t->ndim > 0 && t->shape == nullptr ? " with a null shape array"
                                                                     : " (expected 0 to 8)")),
                              errors::Reason::kOpInputInvalid);
  }
  const bool device_ok = t->device.device_type == kDLCPU || t->device.device_type == kDLCUDAHost ||
                         (cuda && t->device.device_type == kDLCUDA);
  if (!device_ok) {
    return errors::WithReason(
        absl::InvalidArgumentError(
            absl::StrCat(op, ": ", name, " is on device type ", t->device.device_type,
                         cuda ? "; the CUDA backend takes kDLCUDA, kDLCPU or kDLCUDAHost tensors"
                              : "; the host backend takes kDLCPU tensors")),
        errors::Reason::kOpInputInvalid);
  }
  bool dtype_ok = false;
  for (DLDataType d : dtypes) dtype_ok |= SameType(t->dtype, d);
  if (!dtype_ok) {
    std::vector<std::string> want;
    for (DLDataType d : dtypes) want.push_back(TypeName(d));
    return errors::WithReason(
        absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has dtype ", TypeName(t->dtype),
                                                ", expected ", absl::StrJoin(want, " or "))),
        errors::Reason::kOpInputInvalid);
  }
  if (t->ndim != static_cast<int>(shape.size())) {
    return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                  op, ": ", name, " has ", t->ndim, " dimensions ",
                                  ShapeString(t->shape, t->ndim), ", expected ", shape.size())),
                              errors::Reason::kOpInputInvalid);
  }
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] < 0 || (shape[i] >= 0 && t->shape[i] != shape[i])) {
      std::vector<std::string> want;
      for (int64_t d : shape) want.push_back(d < 0 ? "*" : absl::StrCat(d));
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(
              op, ": ", name, " has shape ", ShapeString(t->shape, t->ndim), ", expected [",
              absl::StrJoin(want, ", "), "] (dimension ", i, " is ", t->shape[i], ")")),
          errors::Reason::kOpInputInvalid);
    }
    shape[i] = t->shape[i];
  }
  if (t->strides != nullptr) {
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
      if (t->shape[i] != 1 && t->strides[i] != expect) {
        return errors::WithReason(absl::InvalidArgumentError(absl::StrCat(
                                      op, ": ", name, " is not contiguous (row-major)")),
                                  errors::Reason::kOpInputInvalid);
      }
      expect *= t->shape[i];
    }
  }
  if (t->data == nullptr) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (n > 0) {
      return errors::WithReason(
          absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has no data")),
          errors::Reason::kOpInputInvalid);
    }
  }
  EPD_RETURN_IF_ERROR(CheckTensorAlignment(op, name, t));
  return CheckTensorExtent(op, name, t);
}

absl::Status CheckStepTensor(const char* op, const char* name, const DLTensor* t,
                             std::initializer_list<DLDataType> dtypes, std::span<int64_t> shape,
                             int device) {
  absl::Status st = CheckTensor(true, op, name, t, dtypes, shape);
  if (!st.ok()) return st;
  if (t->device.device_type == kDLCUDA && t->device.device_id == device) {
    return absl::OkStatus();
  }
  return errors::WithReason(
      absl::InvalidArgumentError(
          absl::StrCat(op, ": ", name, " must be kDLCUDA memory of the endpoint's GPU (device ",
                       device, ") so a captured step reads it at run time")),
      errors::Reason::kOpInputInvalid);
}

bool ReadableInPlace(const DLTensor* t, int device, uintptr_t alignment) {
  return t != nullptr && t->device.device_type == kDLCUDA && t->device.device_id == device &&
         reinterpret_cast<uintptr_t>(TensorBytes(t)) % alignment == 0;
}

int64_t TensorNbytes(const DLTensor* t) {
  int64_t n = (t->dtype.bits * t->dtype.lanes + 7) / 8;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  return n;
}

}  // namespace epd::internal
