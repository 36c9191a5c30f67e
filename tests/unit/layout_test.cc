#include "epd/kernels/layout.h"

#include <gtest/gtest.h>

#include <initializer_list>

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
  EXPECT_EQ(n, 25 + 6 * kLowLatencyBuffers);  // incl. ll_routing, normal_tiles, sync, flags
  EXPECT_EQ(l.launch_flags.bytes, abi::kLaunchFlagsRegionBytes);
  EXPECT_EQ(l.launch_flags.offset + l.launch_flags.bytes, l.total_bytes);
  // recv_x: R*M rows of H bf16; over 4 GiB offsets must not wrap.
  EXPECT_EQ(l.recv_x.bytes, uint64_t{8} * 4096 * 7168 * 2);
  EXPECT_EQ(l.ll_recv_x[0].bytes, uint64_t{32} * 8 * 128 * 7168 * 2);
  EXPECT_EQ(l.ll_routing.bytes, uint64_t{128} * 8 * 8);  // [Mll, K] of two int32
  // 16 tiles of 256 tokens: [16, R] counts, [16, R] bases, [16, E] expert counts.
  EXPECT_EQ(l.normal_tiles.bytes, uint64_t{16} * (8 + 8 + 256) * 4);
}

// The normal dispatch's tiles: whole granules, never more than kMaxTiles, covering M.
TEST(EndpointLayoutTest, NormalDispatchTilesCoverEveryTokenInAtMostMaxTiles) {
  using Tiling = NormalDispatchTiling;
  EXPECT_EQ(Tiling::For(0).num_tiles, 0);
  EXPECT_EQ(Tiling::For(1).tile_tokens, Tiling::kTokenGranule);
  EXPECT_EQ(Tiling::For(1).num_tiles, 1);
  EXPECT_EQ(Tiling::For(4096).tile_tokens, 256);
  EXPECT_EQ(Tiling::For(4096).num_tiles, 16);
  EXPECT_EQ(Tiling::For(16384).num_tiles, 64);
  EXPECT_EQ(Tiling::For(16385).tile_tokens, 512);
  EXPECT_EQ(Tiling::For(16385).num_tiles, 33);
  EXPECT_EQ(Tiling::For(16385).slots, 64);
  int32_t last_slots = 0;
  for (const int32_t m : {2, 255, 256, 257, 1000, 8191, 16384, 16385, 65536, 100000, 2147483647}) {
    const Tiling t = Tiling::For(m);
    EXPECT_EQ(t.tile_tokens % Tiling::kTokenGranule, 0) << m;
    EXPECT_LE(t.num_tiles, t.slots) << m;
    EXPECT_LE(t.slots, Tiling::kMaxTiles) << m;
    EXPECT_GE(t.slots, last_slots) << m;  // The region never shrinks as M grows.
    last_slots = t.slots;
    EXPECT_GE(int64_t{t.num_tiles} * t.tile_tokens, m) << m;
    EXPECT_LT(int64_t{t.num_tiles - 1} * t.tile_tokens, m) << m;
  }
}

// The low-latency dispatch's scales are stored token index fastest (DeepEP's layout): f32
// [El, S, R*Mll]; UE8M0 int32 [El, S/4, R*Mll] with block 4j + i in byte i of word j. Both
// fit the f32-sized region.
TEST(EndpointLayoutTest, LowLatencyScalesAreTokenFastest) {
  GroupShape s;
  s.num_ranks = 2;
  s.num_experts = 6;  // El = 3
  s.hidden = 1024;    // S = 8
  s.num_topk = 2;
  s.max_tokens_per_rank = 4;
  s.ll_max_tokens_per_rank = 5;  // rows = 10
  s.use_fp8 = true;
  const int64_t rows = 10, S = 8, El = 3;
  EXPECT_EQ(LowLatencyScaleOffset(s, false, 0, 0, 0), 0u);
  EXPECT_EQ(LowLatencyScaleOffset(s, false, 0, 1, 0), 4u);
  EXPECT_EQ(LowLatencyScaleOffset(s, false, 0, 0, 1), uint64_t(rows * 4));
  EXPECT_EQ(LowLatencyScaleOffset(s, false, 2, 9, 7), uint64_t(((2 * S + 7) * rows + 9) * 4));
  EXPECT_EQ(LowLatencyScaleOffset(s, true, 0, 0, 3), 3u);
  EXPECT_EQ(LowLatencyScaleOffset(s, true, 0, 1, 0), 4u);
  EXPECT_EQ(LowLatencyScaleOffset(s, true, 0, 0, 4), uint64_t(rows * 4));
  EXPECT_EQ(LowLatencyScaleOffset(s, true, 2, 9, 6),
            uint64_t(((2 * (S / 4) + 1) * rows + 9) * 4 + 2));
  const EndpointLayout l = EndpointLayout::Compute(s);
  EXPECT_EQ(l.ll_recv_scales[0].bytes, uint64_t(El * S * rows * 4));
  EXPECT_LT(LowLatencyScaleOffset(s, false, El - 1, rows - 1, S - 1), l.ll_recv_scales[0].bytes);
  EXPECT_LT(LowLatencyScaleOffset(s, true, El - 1, rows - 1, S - 1), l.ll_recv_scales[0].bytes);
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

TEST(NormalCopyPartsTest, PartsAreWholeChunksNoneEmptyAndCoverTheRow) {
  constexpr int64_t kChunk = 128;  // The copy's chunk: 32 lanes x 4 vectors.
  struct Case {
    int64_t num_vec;
    int32_t wanted;
    int64_t parts;
    int64_t part_vec;
  };
  for (const Case& c : std::initializer_list<Case>{
           {448, 4, 4, 128},    // FP8 row of 7168 bytes in int4: 3.5 chunks, 4 parts
           {448, 3, 2, 256},    // 4 chunks asked in 3: 2 + 2 (2 + 1 + 1 is not even)
           {896, 4, 4, 256},    // BF16 row of 14336 bytes: 7 chunks, 2 + 2 + 2 + 1
           {896, 16, 7, 128},   // capped at the row's chunks
           {2052, 3, 3, 768},   // bf16 units of H = 2052: 17 chunks, 6 + 6 + 5
           {2052, 16, 9, 256},  // 17 chunks asked in 16: 2 each, 9 parts
           {257, 4, 3, 128},    // 3 chunks (the last 1 vector)
           {100, 4, 1, 100},    // one chunk: one part
           {1, 16, 1, 1},       // one vector
           {448, 1, 1, 448},    // a token an item
           {448, 0, 1, 448},    // below 1: as 1
       }) {
    SCOPED_TRACE(::testing::Message() << c.num_vec << " vectors, " << c.wanted << " wanted");
    const NormalCopyParts p = NormalCopyParts::For(c.num_vec, kChunk, c.wanted, 4096);
    EXPECT_EQ(p.parts, c.parts);
    EXPECT_EQ(p.part_vec, c.part_vec);
    EXPECT_TRUE(p.part_vec % kChunk == 0 || p.parts == 1);
    EXPECT_GE(p.parts * p.part_vec, c.num_vec) << "the parts cover the row";
    EXPECT_LT((p.parts - 1) * p.part_vec, c.num_vec) << "the last part is not empty";
  }
  // T x parts past int32: one part a token.
  EXPECT_EQ(NormalCopyParts::For(896, kChunk, 4, 1 << 30).parts, 1);
  EXPECT_EQ(NormalCopyParts::For(896, kChunk, 4, 1 << 28).parts, 4);
}

}  // namespace
}  // namespace epd::kernels
