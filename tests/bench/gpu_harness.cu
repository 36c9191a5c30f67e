// The GPU test harness (tests/gpu/gpu_test_util.{h,cc}: virtual-rank groups, RAII device
// buffers and streams, random inputs) compiled into epd_bench, whose CMake target only
// globs tests/bench. Include "tests/gpu/gpu_test_util.h" to use it from a bench source.
#include "tests/gpu/gpu_test_util.cc"
