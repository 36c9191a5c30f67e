// common/cuda/cuda_check.h: a CUDA error becomes INTERNAL naming the call, file, line and
// the CUDA error's name and text; cudaSuccess is OK. No GPU needed (error names only).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#if EPD_HAVE_CUDA
#include "common/cuda/cuda_check.h"

namespace epd {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

absl::Status ReturnsTheError(cudaError_t err) {
  EPD_CUDA_RETURN_IF_ERROR(err);
  return absl::OkStatus();
}

TEST(CudaCheckTest, SuccessIsOk) {
  EXPECT_TRUE(EPD_CUDA_STATUS(cudaSuccess).ok());
  EXPECT_TRUE(ReturnsTheError(cudaSuccess).ok());
}

TEST(CudaCheckTest, ErrorNamesCallFileLineAndCudaError) {
  const absl::Status status = EPD_CUDA_STATUS(static_cast<cudaError_t>(cudaErrorInvalidValue));
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(status.message(),
              AllOf(HasSubstr("static_cast<cudaError_t>(cudaErrorInvalidValue) failed at "),
                    HasSubstr("cuda_check_test.cc:"), HasSubstr("cudaErrorInvalidValue: ")));
  EXPECT_EQ(ReturnsTheError(cudaErrorInvalidValue).code(), absl::StatusCode::kInternal);
}

TEST(CudaCheckTest, IgnoreDropsTheError) {
  EPD_CUDA_IGNORE(cudaErrorInvalidValue);  // compiles to a statement; nothing to report
  SUCCEED();
}

}  // namespace
}  // namespace epd
#endif  // EPD_HAVE_CUDA
