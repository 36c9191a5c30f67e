#include "epd/kernels/layout.h"

#include <gtest/gtest.h>

#include "proto/abi/launch_flags.h"

namespace epd::kernels {
namespace {

TEST(EndpointLayoutTest, RegionsAreAlignedAndDisjoint) {
  GroupShape s;
  s.num_ranks = 8;
  s.num_experts = 256;
  s.hidden = 7168;
  s.num_topk = 8;
  s.max_tokens_per_rank = 4096;
  s.ll_max_tokens_per_rank = 128;
  s.use_fp8 = true;
  EndpointLayout l = EndpointLayout::Compute(s);
  uint64_t prev_end = 0;
  int n = 0;
  l.ForEachRegion([&](const char* name, const Region& r) {
    EXPECT_EQ(r.offset % kRegionAlignment, 0u) << name;
    EXPECT_GE(r.offset, prev_end) << name;
    prev_end = r.offset + r.bytes;
    ++n;
  });
  EXPECT_LE(prev_end, l.total_bytes);
  EXPECT_EQ(n, 24 + 6 * kLowLatencyBuffers);  // incl. ll_routing, sync and launch_flags
  EXPECT_EQ(l.launch_flags.bytes, abi::kLaunchFlagsRegionBytes);
  EXPECT_EQ(l.launch_flags.offset + l.launch_flags.bytes, l.total_bytes);
  // recv_x: R*M rows of H bf16; over 4 GiB offsets must not wrap.
  EXPECT_EQ(l.recv_x.bytes, uint64_t{8} * 4096 * 7168 * 2);
  EXPECT_EQ(l.ll_recv_x[0].bytes, uint64_t{32} * 8 * 128 * 7168 * 2);
  EXPECT_EQ(l.ll_routing.bytes, uint64_t{128} * 8 * 8);  // [Mll, K] of two int32
}

TEST(EndpointLayoutTest, OffsetsAre64Bit) {
  GroupShape s;
  s.num_ranks = 8;
  s.num_experts = 8;
  s.hidden = 16384;
  s.num_topk = 8;
  s.max_tokens_per_rank = 32768;
  EndpointLayout l = EndpointLayout::Compute(s);
  EXPECT_GT(l.total_bytes, uint64_t{1} << 32);
  EXPECT_GT(l.combined_x.offset, uint64_t{1} << 32);
}

TEST(EndpointLayoutTest, LowLatencyDisabledTakesNoBytes) {
  GroupShape s;
  s.num_ranks = 2;
  s.num_experts = 4;
  s.hidden = 256;
  s.num_topk = 2;
  s.max_tokens_per_rank = 16;
  EndpointLayout l = EndpointLayout::Compute(s);
  EXPECT_EQ(l.ll_recv_x[0].bytes, 0u);
  EXPECT_EQ(l.ll_recv_count[1].bytes, 0u);
  EXPECT_EQ(l.ll_routing.bytes, 0u);
  EXPECT_EQ(l.recv_scales.bytes, 0u);
}

}  // namespace
}  // namespace epd::kernels
